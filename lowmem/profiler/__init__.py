"""Where the memory goes: the report's accounting, the measured peak and the FLOPs of a step.

One entry for a trainer's configuration, ``profile_trainer(trainer)`` (what ``python -m
lowmem.profile`` prints), and one for any model and step, ``profile_step(model, optimizer,
microbatches, train_step)``; both return a ``MemoryReport``. The parts, each usable alone:

- ``state``: model and optimizer bytes by the report's definition (sparse weights as CSR);
- ``activations``: activation bytes read off the real autograd graph, on fake tensors;
- ``peak``: the measured allocator peak of a real step, with a breakdown, and FLOP counting;
- ``report``: ``MemoryReport`` and ``profile_step``, which combine them;
- ``step``: ``profile_trainer`` and the JSON row of ``lowmem.profile``.
"""

from lowmem.profiler.activations import ActivationTrace, ActivationTracer, account_activations
from lowmem.profiler.peak import AllocationTracker, PeakMeasurement, count_flops, measure_peak, track_peak
from lowmem.profiler.report import MB, MemoryReport, Microbatch, profile_step
from lowmem.profiler.state import (
    StateBytes,
    StepTemporaries,
    account_state,
    csr_index_bytes,
    quantized_state_bytes,
    step_temporaries,
)
from lowmem.profiler.step import batch_shapes, profile_row, profile_trainer

__all__ = [
    "MB",
    "ActivationTrace",
    "ActivationTracer",
    "AllocationTracker",
    "MemoryReport",
    "Microbatch",
    "PeakMeasurement",
    "StateBytes",
    "StepTemporaries",
    "account_activations",
    "account_state",
    "batch_shapes",
    "count_flops",
    "csr_index_bytes",
    "measure_peak",
    "profile_row",
    "profile_step",
    "profile_trainer",
    "quantized_state_bytes",
    "step_temporaries",
    "track_peak",
]
