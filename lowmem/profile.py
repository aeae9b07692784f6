"""``python -m lowmem.profile +recipe=wrn_cifar [the overrides of lowmem.train]``: memory and FLOPs.

Builds the configuration exactly as ``lowmem.train`` does (same Hydra config, same
``build_trainer``), runs no training loop, and profiles one minibatch (``lowmem.profiler``):

- the report's accounting (model, optimizer, activations, total) on fake tensors: no compute;
- the FLOPs of the minibatch (forward + backward + recomputation), also on fake tensors;
- the measured allocator peak of one real ``Trainer.train_step`` on the configured device.

Prints a readable table, then, as the last stdout line, one JSON object (SPEC §2) with at least
model_bytes, optimizer_bytes, activation_bytes, total_bytes, peak_bytes, flops and params. The
same object is written to ``profile.json`` in Hydra's run directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lowmem import distributed
from lowmem.config import register_configs
from lowmem.profiler import profile_row
from lowmem.profiler.peak import freeze_imports
from lowmem.run.command import one_line_errors, refuse_unknown_knobs
from lowmem.run.files import save_json
from lowmem.trainer import build_trainer, resolve_device

register_configs()


def profile_config(cfg: DictConfig, measure: bool = True) -> dict[str, Any]:
    """The SPEC §2 JSON row of a composed configuration (``lowmem.config.compose``); prints nothing."""
    return profile_row(build_trainer(cfg), measure)[1]


def run(cfg: DictConfig) -> dict[str, Any]:
    """Build the configuration, profile it, print the table; return the JSON row.

    Under torchrun every rank profiles its own share of the global minibatch (per-rank memory);
    each rank prints its table and row, tagged with ``rank`` and ``world_size``.
    """
    distributed.init_from_environment(resolve_device(cfg.trainer.device))
    report, row = profile_row(build_trainer(cfg), cfg.profile.measure_peak)
    print(report.table())
    shapes = row["batch_shapes"].items()
    data = ", ".join(f"{key} {' x '.join(map(str, shape))}" for key, shape in shapes if len(shape) > 1)
    share = f"; this rank profiles its share of {distributed.world_size()}" if distributed.world_size() > 1 else ""
    print(f"minibatch profiled (the first of epoch 0): {data}{share}")
    return {**row, "rank": distributed.rank(), "world_size": distributed.world_size()}


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
@one_line_errors
def main(cfg: DictConfig) -> None:
    freeze_imports()
    row = run(cfg)
    name = "profile.json" if row["world_size"] == 1 else f"profile.rank{row['rank']}.json"
    save_json(row, Path(HydraConfig.get().runtime.output_dir) / name)
    # Under torchrun the ranks print their rows one after another, one whole line each (written at
    # the same moment, two ranks' output could interleave within a line), rank 0's last: the last
    # stdout line is rank 0's row.
    for rank in reversed(range(row["world_size"])):
        if rank == row["rank"]:
            print(json.dumps(row), flush=True)
        distributed.barrier()


if __name__ == "__main__":
    refuse_unknown_knobs()
    sys.exit(main())
