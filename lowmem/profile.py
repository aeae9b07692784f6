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

from lowmem.config import register_configs
from lowmem.memory import MemoryReport, Microbatch, profile_step
from lowmem.techniques.precision import autocast_context

register_configs()


def _example_batch(trainer) -> Any:
    """One minibatch of the configured data (the trainer's own when it offers one)."""
    if hasattr(trainer, "example_batch"):
        return trainer.example_batch()
    return next(iter(trainer.data.train.epoch(0)))


def profile_trainer(trainer) -> MemoryReport:
    """Profile one minibatch of ``trainer`` (a ``lowmem.trainer.Trainer``)."""
    batch = _example_batch(trainer)
    true_microbatches = trainer.microbatch_size is not None and trainer.microbatch_mode == "true"
    parts = trainer.recipe.split(batch, trainer.microbatch_size) if true_microbatches else [(batch, 1.0)]

    def forward_backward(part: Any, weight: float) -> None:
        # The forward and backward of Trainer.train_step, without its update and its reads of
        # values (loss logging, overflow check), which fake tensors cannot serve.
        trainer.model.train()
        with autocast_context(trainer.policy, trainer.device):
            loss = trainer.recipe.loss(trainer.model, part)
        trainer.scaler.scale_loss(loss * weight).backward()

    # Microbatches of equal shapes have equal activations and FLOPs: account one of each shape.
    distinct: dict[tuple, list] = {}
    for part, weight in parts:
        distinct.setdefault(_shapes(part), [part, weight, 0])[2] += 1
    microbatches = [Microbatch(functools.partial(forward_backward, part, weight), count)
                    for part, weight, count in distinct.values()]
    masks = trainer.sparsity.masks if trainer.sparsity is not None else None
    return profile_step(trainer.unwrapped_model, trainer.optimizer, microbatches,
                        lambda: trainer.train_step(batch), masks=masks)


def _shapes(batch: Any) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tree_leaves(batch) if isinstance(t, torch.Tensor))


def run(cfg: DictConfig) -> dict[str, Any]:
    """Build the configuration, profile it, print the table; return the JSON row."""
    from lowmem.trainer import Trainer, build_trainer

    # Data are only needed for a batch when the trainer cannot make one itself.
    trainer = build_trainer(cfg, with_data=not hasattr(Trainer, "example_batch"))
    report = profile_trainer(trainer)
    print(report.table())
    return {**report.to_json(), "device": str(trainer.device), "torch": torch.__version__}


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    row = run(cfg)
    (Path(HydraConfig.get().runtime.output_dir) / "profile.json").write_text(json.dumps(row, indent=1) + "\n")
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
