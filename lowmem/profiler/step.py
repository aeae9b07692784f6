"""Profile one minibatch of a ``lowmem.trainer.Trainer``: the row ``python -m lowmem.profile`` prints.

Only the trainer's public pieces are used (``microbatches``, ``microbatch_backward``,
``train_step``, ``example_batch``), so this module does not import the trainer: the trainer imports
the profiler (for the accounting it stores with every result), never the other way round.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from lowmem.profiler.report import MemoryReport, Microbatch, profile_step


def profile_trainer(trainer: Any, measure: bool = True, batch: Any = None) -> MemoryReport:
    """Profile one minibatch of ``trainer``: ``batch``, by default its first (``example_batch``);
    ``measure=False`` skips the real step (no measured peak: the accounting and FLOPs only)."""
    batch = trainer.example_batch() if batch is None else batch
    trainer.model.train()
    # Each microbatch is handed to the accounting as inputs: it runs on fake CPU stand-ins of
    # them, so that a step on any device is accounted alike.
    # With CUDA graph replay, the shape a step starts with is captured and replayed (its activations
    # stay in the graphs' pool); the others (a short last microbatch) run eagerly on top of it.
    replays = bool(getattr(trainer, "replays_microbatches", False))
    microbatches = [
        Microbatch(
            functools.partial(_microbatch_backward, trainer, weight), count, inputs=part, replayed=replays and i == 0
        )
        for i, (part, weight, count) in enumerate(distinct_microbatches(trainer, batch))
    ]
    sparse = trainer.sparsity.trained_parameters() if trainer.sparsity is not None else None
    step = (lambda: trainer.train_step(batch)) if measure else None
    return profile_step(
        trainer.unwrapped_model,
        trainer.optimizer,
        microbatches,
        step,
        sparse=sparse,
        data=data_tensors(trainer, batch),
        owners=(trainer, batch),  # the run's tensors, not those of whoever profiles it
        arithmetic=trainer.arithmetic() if measure else None,
        host_bytes=_offload_pool_bytes(trainer),
    )


def _offload_pool_bytes(trainer: Any) -> Any:
    """The pinned host memory a trainer's offloaded activations hold, read after a step (None: no offload)."""
    offload = getattr(trainer, "offload", None)
    return None if offload is None else (lambda: offload.host_bytes)


def distinct_microbatches(trainer: Any, batch: Any) -> list[tuple[Any, float, int]]:
    """``batch``'s microbatches on this rank as (microbatch, loss weight, how many share its shapes),
    one per distinct shape, in the order they first occur: microbatches of equal shapes have equal
    activations and FLOPs."""
    distinct: dict[tuple, list] = {}
    for part, weight in trainer.microbatches(batch):
        distinct.setdefault(_shapes(part), [part, weight, 0])[2] += 1
    return [tuple(entry) for entry in distinct.values()]


def data_tensors(trainer: Any, batch: Any = None) -> list[torch.Tensor]:
    """The data set's tensors resident on the device and ``batch``'s: the measured breakdown's "data"."""
    return [*trainer.data.resident, *(t for t in tree_leaves(batch) if isinstance(t, torch.Tensor))]


def _microbatch_backward(trainer: Any, weight: float, part: Any) -> Any:
    return trainer.microbatch_backward(part, weight, local=True)


def profile_row(trainer: Any, measure: bool) -> tuple[MemoryReport, dict[str, Any]]:
    """Profile ``trainer``'s first minibatch: the report and its JSON row (with the batch's shapes:
    the global minibatch, of which each rank under torchrun profiles its share)."""
    batch = trainer.example_batch()
    report = profile_trainer(trainer, measure=measure, batch=batch)
    row = {
        **report.to_json(),
        "batch_shapes": batch_shapes(batch),
        "device": str(trainer.device),
        "cpu_compute": trainer.cpu_compute_record(),
        "torch": torch.__version__,
    }
    return report, row


def batch_shapes(batch: Any) -> dict[str, list[int]]:
    """The shapes of the profiled minibatch's tensors, by key (dict batches) or position (sequences)."""
    if isinstance(batch, torch.Tensor):
        batch = {"batch": batch}
    items = batch.items() if isinstance(batch, dict) else ((f"batch[{i}]", v) for i, v in enumerate(batch))
    return {key: list(value.shape) for key, value in items if isinstance(value, torch.Tensor) and value.dim()}


def _shapes(batch: Any) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tree_leaves(batch) if isinstance(t, torch.Tensor))
