"""``python -m lowmem.plan +recipe=... plan.budget_mb=X [knobs to fix]``: the best configuration for a budget.

Searches density, precision (fp32, and bf16 where BF16 runs at full speed, else fp16), optimizer
state bits (``optim.state_bits``: the precision's width, 8, 4), microbatch size (down to one
example), checkpointing (``optimal`` included) and the chunked loss (``loss.chunk_tokens``: none,
auto, where the model has an output layer) for the configurations whose accounted total (the
report's model + optimizer + activations, exactly as ``lowmem.profile`` prints it for the first
minibatch) plus what a real step holds beyond it (``budget_total_bytes``: compact sparse positions
as stored, the model's buffers, the data, and every temporary the step's own tensors hold beyond the
activations) is at most X MB (1e6 bytes); any searched knob given on the command line is fixed to
that value (``lowmem.planning.search``). Preference: the highest density (accuracy), then the widest
optimizer state (accuracy), then the widest saved activations (``checkpointing.compress`` with
optimal checkpointing: none, 8, 4, 2 bits), then the largest microbatch (speed), then the fewest
FLOPs (the unchunked loss has fewer).

A plan is a promise (``plan.verify=true``, the default): the chosen configuration is built as
``lowmem.train`` builds it and one real step measured; one whose build is refused, whatever it
raises, or whose measured peak exceeds the budget (unverified: whose figure built alone does) is
skipped for the next; where the search's figures fall short of what built configurations hold, it
searches again below the budget by that shortfall; the configuration of the smallest figure is tried
last (``lowmem.planning.budget``). Prints a table of the best ``plan.top`` configurations (state
bits, accounted total, FLOPs, and the accuracy the report measured for them where it has a figure),
each configuration built and its verdict, then the chosen one's profile, and as the **last stdout
line** one JSON object with ``"overrides"`` (``knob=value`` strings to add to the same command line
for ``lowmem.train``), ``"total_bytes"``, ``"budget_total_bytes"``, ``"peak_bytes"`` (measured),
``"refused"`` (one line per configuration the search or the build refused, with why) and
``"tried"`` (each configuration built: overrides, figures, verdict). Also written to ``plan.json`` in
Hydra's run directory. When nothing fits, it fails (non-zero exit) naming one figure, the smallest
configuration's (its measured peak, verified) and that configuration: any budget of at least that
figure gets a plan.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lowmem.api import plan as plan_model
from lowmem.config import ConfigError, register_configs
from lowmem.planning.budget import plan_search
from lowmem.profiler.peak import freeze_imports
from lowmem.run.command import one_line_errors, refuse_unknown_knobs
from lowmem.run.files import save_json

register_configs()


def plan(cfg: DictConfig, overrides: list[str]) -> dict[str, Any]:
    """``python -m lowmem.plan``: search, print the table and the chosen configuration's profile;
    return the JSON row."""
    if cfg.plan.top < 1:
        raise ConfigError(f"plan.top={cfg.plan.top!r} is not allowed: a number of table rows >= 1")
    return plan_search(
        overrides, cfg.plan.budget_mb, top=cfg.plan.top, verify=cfg.plan.verify, world_size=cfg.plan.world_size
    )


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
@one_line_errors
def main(cfg: DictConfig) -> None:
    freeze_imports()  # (the search measures many steps: each walks the live objects)
    row = plan(cfg, list(HydraConfig.get().overrides.task))
    save_json(row, Path(HydraConfig.get().runtime.output_dir) / "plan.json")
    print(json.dumps(row), flush=True)


class _PlanModule(types.ModuleType):
    """``lowmem.plan`` is both this command's module and the function ``lowmem.api.plan``: importing
    the module (which makes it the package's attribute) must leave ``lowmem.plan(...)`` working."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return plan_model(*args, **kwargs)


sys.modules[__name__].__class__ = _PlanModule

if __name__ == "__main__":
    refuse_unknown_knobs()
    sys.exit(main())
