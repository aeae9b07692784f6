"""``python -m lowmem.profile +recipe=wrn_cifar [the overrides of lowmem.train]``: memory and FLOPs.

Builds the configuration exactly as ``lowmem.train`` does (same Hydra config, same
``build_trainer``), runs no training loop, and profiles one minibatch (``lowmem.memory``):

- the report's accounting (model, optimizer, activations, total) on fake tensors: no compute;
- the FLOPs of the minibatch (forward + backward + recomputation), also on fake tensors;
- the measured allocator peak of one real ``Trainer.train_step`` on the configured device.

Prints a readable table, then, as the last stdout line, one JSON object (SPEC §2) with at least
model_bytes, optimizer_bytes, activation_bytes, total_bytes, peak_bytes, flops and params. The
same object is written to ``profile.json`` in Hydra's run directory.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch.utils._pytree import tree_leaves

from lowmem import distributed
from lowmem.config import register_configs
from lowmem.memory import MemoryReport, Microbatch, profile_step
from lowmem.run_files import save_json

register_configs()


def profile_trainer(trainer, measure: bool = True, batch: Any = None) -> MemoryReport:
    """Profile one minibatch of ``trainer`` (a ``lowmem.trainer.Trainer``): ``batch``, by default its
    first (``example_batch``); ``measure=False`` skips the real step (no measured peak: the
    accounting and FLOPs only)."""
    batch = trainer.example_batch() if batch is None else batch
    trainer.model.train()
    # Microbatches of equal shapes have equal activations and FLOPs: account one of each shape.
    distinct: dict[tuple, list] = {}
    for part, weight in trainer.microbatches(batch):
        distinct.setdefault(_shapes(part), [part, weight, 0])[2] += 1
    microbatches = [
        Microbatch(functools.partial(trainer.microbatch_backward, part, weight, local=True), count)
        for part, weight, count in distinct.values()
    ]
    masks = trainer.sparsity.masks if trainer.sparsity is not None else None
    step = (lambda: trainer.train_step(batch)) if measure else None
    return profile_step(trainer.unwrapped_model, trainer.optimizer, microbatches, step, masks=masks)


def batch_shapes(batch: Any) -> dict[str, list[int]]:
    """The shapes of the profiled minibatch's tensors, by key (dict batches) or position (sequences)."""
    if isinstance(batch, torch.Tensor):
        batch = {"batch": batch}
    items = batch.items() if isinstance(batch, dict) else ((f"batch[{i}]", v) for i, v in enumerate(batch))
    return {key: list(value.shape) for key, value in items if isinstance(value, torch.Tensor) and value.dim()}


def _shapes(batch: Any) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tree_leaves(batch) if isinstance(t, torch.Tensor))


def _profile_row(trainer, measure: bool) -> tuple[MemoryReport, dict[str, Any]]:
    """Profile ``trainer``'s first minibatch: the report and its JSON row (with the batch's shapes:
    the global minibatch, of which each rank under torchrun profiles its share)."""
    batch = trainer.example_batch()
    report = profile_trainer(trainer, measure=measure, batch=batch)
    row = {
        **report.to_json(),
        "batch_shapes": batch_shapes(batch),
        "device": str(trainer.device),
        "torch": torch.__version__,
    }
    return report, row


def profile_config(cfg: DictConfig, measure: bool = True) -> dict[str, Any]:
    """The SPEC §2 JSON row of a composed configuration (``lowmem.config.compose``); prints nothing."""
    from lowmem.trainer import build_trainer

    return _profile_row(build_trainer(cfg), measure)[1]


def run(cfg: DictConfig) -> dict[str, Any]:
    """Build the configuration, profile it, print the table; return the JSON row.

    Under torchrun every rank profiles its own share of the global minibatch (per-rank memory);
    each rank prints its table and row, tagged with ``rank`` and ``world_size``.
    """
    from lowmem.trainer import build_trainer, resolve_device

    distributed.init_from_environment(resolve_device(cfg.trainer.device))
    report, row = _profile_row(build_trainer(cfg), cfg.profile.measure_peak)
    print(report.table())
    shapes = row["batch_shapes"].items()
    data = ", ".join(f"{key} {' x '.join(map(str, shape))}" for key, shape in shapes if len(shape) > 1)
    share = f"; this rank profiles its share of {distributed.world_size()}" if distributed.world_size() > 1 else ""
    print(f"minibatch profiled (the first of epoch 0): {data}{share}")
    return {**row, "rank": distributed.rank(), "world_size": distributed.world_size()}


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    row = run(cfg)
    name = "profile.json" if row["world_size"] == 1 else f"profile.rank{row['rank']}.json"
    save_json(row, Path(HydraConfig.get().runtime.output_dir) / name)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
