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

from lowmem.profiler.real_passes import real_pass_reason
from lowmem.profiler.report import MemoryReport, Microbatch, profile_step

# Every field of the JSON row (``python -m lowmem.profile``'s last stdout line, ``profile.json``,
# ``run.profile()``): what it holds. The documentation's reference is generated from this table, and
# a test fails when the row has a field it does not describe. MB in the text is 1e6 bytes.
ROW_FIELDS = {
    "model_bytes": "The report's accounting: parameter bytes, sparse weights as CSR (values and column indices).",
    "optimizer_bytes": "The report's accounting: gradients plus optimizer state (SGD: momentum; Adam: two moments).",
    "optimizer_state_bytes": "The optimizer state alone (part of `optimizer_bytes`): codes and scales when "
    "`optim.state_bits` is 8 or 4.",
    "activation_bytes": "The report's accounting: the most bytes backward needs at once, over forward and backward "
    "(saved tensors, recomputation included, each storage once, ReLU's at 1 bit, plus the activation gradients "
    "alive by the report's node-by-node rule), for the largest microbatch.",
    "total_bytes": "`model_bytes` + `optimizer_bytes` + `activation_bytes`: the report's figure.",
    "activation_at_peak": "`activation_bytes` by kind (saved, recomputed, gradient) at the activation peak.",
    "activation_location": "Where the activation peak happens (the module and the pass).",
    "activation_pass": "What the accounting ran on: `fake tensors` (shapes, no compute), or `real tensors: <why>` "
    "where a fake pass cannot run (a mixture of experts' routing: shapes that depend on values; an op fake tensors "
    "refuse), with why and where; the figures are then those of the profiled minibatch's values.",
    "activation_saved_bytes": "The most saved-for-backward bytes alive at once (no gradients).",
    "compressed_bytes": "Of `activation_saved_bytes`, the bytes stored compressed (`checkpointing.compress`), at "
    "their stored size (0: nothing compressed).",
    "offloaded_bytes": "Saved activations held in host memory instead of on the device, at most at once "
    "(`checkpointing.offload`; 0: nothing offloaded).",
    "host_bytes": "Host memory held for offloaded activations: the pinned pool after a real step, else the accounted "
    "figure (0: nothing offloaded).",
    "activation_stored_before_backward": "Saved-for-backward bytes when backward starts (the checkpoints, if any).",
    "activation_held_bytes": "The same tensors' peak as this run's autograd really held them (every gradient until "
    "its storage dies).",
    "graph_pool_bytes": "With CUDA graph replay: the replayed microbatches' accounted activations, held in the "
    "graphs' private pool for the run (0: nothing replays).",
    "total_with_graph_pool_bytes": "Model + optimizer + graph pool + the eagerly run microbatches' activations on top "
    "of it (equal to `total_bytes` when nothing replays).",
    "step_temporary_bytes": "What a real step holds beyond the accounting: compact sparse positions as stored, the "
    "model's buffers, the data on the device, and what the step's own tensors hold beyond the activations "
    "(`pass_temporaries`: every temporary of forward and backward at its moment, saved tensors at their real size, "
    "weight gradients until they are added to the previous microbatches' sum, a recomputed block's first check).",
    "step_temporaries": "`step_temporary_bytes` by cause: `positions`, `buffers`, `data`, `pass_temporaries`.",
    "budget_total_bytes": "`total_with_graph_pool_bytes` + `step_temporary_bytes`: the figure `lowmem.plan` and "
    "`checkpointing.budget_mb` compare with a budget.",
    "gathered_bytes": "`trainer.parallel=fsdp`: the weights FSDP2 gathers whole at once at most (the root's, held "
    "from forward through backward, plus the largest block's); `model_bytes` and `optimizer_bytes` are then this "
    "rank's shards. 0 when not sharded.",
    "peak_bytes": "The measured peak of one real training step on the device (CUDA: the allocator's "
    "`max_memory_allocated`, plus the graph pool's unused reserve; CPU: lowmem's tensor tracker); null with "
    "`profile.measure_peak=false`.",
    "peak_source": "How the peak was measured: `cuda allocator`, `cpu tensor tracker`, or (a compiled model on a "
    "CPU) `cpu allocator events` (torch.profiler's record of the allocator; the step's own bytes are one "
    "`temporary` figure).",
    "peak_breakdown": "The measured peak by category: data, workspaces, graph_pool, parameters, gradients, "
    "optimizer_state, saved_activations, temporary, other.",
    "peak_location": "Where the measured peak happened.",
    "flops": "FLOPs of one minibatch: forward + backward + recomputation.",
    "params": "Parameters, counted dense.",
    "nonzero_params": "Parameters counting only the active positions of sparse weights.",
    "dense_weights": "With `sparsity.density` < 1: every multiplying weight (of a Linear, convolution, "
    "transformers `Conv1D`, experts module or router) left dense, by name, with why: `frozen`, `router`, "
    "`first layer`, `last layer`, `zero-initialised`, a layer class lowmem cannot run sparse, or `left out by the "
    "rule` (the recipe's, `sparsity.include` / `exclude`). Empty when dense.",
    "seconds": "Time spent per measurement (accounting and FLOPs, the measured step).",
    "batch_shapes": "The profiled minibatch's tensor shapes by key: the global minibatch (each rank under torchrun "
    "profiles its share).",
    "device": "The training device.",
    "cpu_compute": "`precision.cpu_compute` and what it chose per kind of op.",
    "compile": "`trainer.compile`: whether the model ran compiled (`torch.compile`).",
    "graph_breaks": "`trainer.compile=true`: graph breaks of the model's first compilation (the measured step "
    "compiles first); null when not compiled, or when the process had compiled an identical model before.",
    "graph_break_reasons": "`trainer.compile=true`: each break's reason (first line and torch's context), with "
    "its count.",
    "compile_backend": "`trainer.compile_backend`.",
    "compile_segments": "`trainer.compile_segments`: how checkpointed stacks and blocks ran compiled (`stack`: whole, "
    "the compiler recomputing; `blocks`: lowmem's segments, each block compiled); null when not compiled.",
    "compiled_graphs": "`trainer.compile=true`: graphs compiled (every microbatch shape's).",
    "recompilations": "`trainer.compile=true`: calls after the first that compiled something (another microbatch "
    "shape, a checkpointed block's first compiled run, a rewiring's new sizes).",
    "compile_seconds": "`trainer.compile=true`: wall time of the calls that compiled (compilation and one run).",
    "torch": "torch's version.",
    "rank": "`python -m lowmem.profile` only: this process's rank (0 without torchrun).",
    "world_size": "`python -m lowmem.profile` only: the number of ranks.",
}


def profile_trainer(trainer: Any, measure: bool = True, batch: Any = None) -> MemoryReport:
    """Profile one minibatch of ``trainer``: ``batch``, by default its first (``example_batch``);
    ``measure=False`` skips the real step (no measured peak: the accounting and FLOPs only)."""
    batch = trainer.example_batch() if batch is None else batch
    sharded = getattr(trainer, "sharded_report", None)
    if sharded is not None:  # trainer.parallel=fsdp: the trainer knows what its rank holds
        return sharded(measure, batch)
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
    if measure and hasattr(trainer, "warm_up_compiled"):  # trainer.compile: compiled before it is measured
        trainer.warm_up_compiled(batch)
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
        dense_weights=trainer.sparsity.dense_weights if trainer.sparsity is not None else None,
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
    report = profile_trainer(trainer, measure=measure, batch=batch)  # UnaccountableStep: a refusal (one line)
    reason = real_pass_reason(trainer.unwrapped_model)
    row = {
        **report.to_json(),
        "activation_pass": "fake tensors" if reason is None else f"real tensors: {reason}",
        "batch_shapes": batch_shapes(batch),
        "device": str(trainer.device),
        "cpu_compute": trainer.cpu_compute_record(),
        **(trainer.compile_summary() if hasattr(trainer, "compile_summary") else {}),
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
