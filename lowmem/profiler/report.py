"""The memory and FLOP report of one training step: the report's accounting and the measured peak.

Two different figures, never mixed (SPEC §4):

- the **accounting** (report §2.2, Appendix B): ``model_bytes`` (parameters, sparse ones as CSR),
  ``optimizer_bytes`` (gradient + momentum buffers), ``activation_bytes`` (peak of what backward
  needs, read off the real autograd graph: ``lowmem.profiler.activations``), ``total_bytes`` their sum;
  ``activation_held_bytes`` is the same tensors' peak as this run's autograd really held them
  (gradients until their storage dies, not only while a node needs them);
- with CUDA graph replay (``trainer.cuda_graphs=auto`` on CUDA), the activations of a replayed
  microbatch shape live in the graphs' private memory pool, which stays reserved for the whole run:
  ``graph_pool_bytes`` is that pool's accounted content (the replayed shapes' activations), and
  microbatches run eagerly (a short last one) allocate on top of it, so the run holds
  ``total_with_graph_pool_bytes`` = model + optimizer + pool + the eager shapes' activations (equal
  to ``total_bytes`` when nothing replays or every microbatch is replayed);
- what a real step holds beyond the accounting, ``step_temporary_bytes`` (``step_temporaries``:
  compact sparse positions as stored, a compact layer's dense weight and gradient, gradient
  accumulation over microbatches, and ``largest_op_bytes``, the largest forward op's new outputs,
  read off the fake pass), and ``budget_total_bytes`` = ``total_with_graph_pool_bytes`` + it: the
  figure ``lowmem.plan`` and ``checkpointing.budget_mb``'s planner compare with a budget, as the
  measured peak holds these too (the report's figures above stay its definition);
- the **measured peak** ``peak_bytes`` of one real training step on the device
  (``lowmem.profiler.peak``), which also holds temporaries, gradient scratch and everything else.

``flops`` counts one minibatch: forward + backward + recomputation (``torch.utils.flop_counter``).

Usage with your own model and step::

    def run_microbatches():            # forward + backward only, every microbatch of one minibatch
        for x, y in microbatches:
            loss_fn(model(x), y).backward()

    def train_step():                  # the whole real step, optimizer included
        optimizer.zero_grad(); run_microbatches(); optimizer.step()

    report = profile_step(model, optimizer, run_microbatches, train_step, sparse=sparsity.trained_parameters())
    print(report.table()); json.dumps(report.to_json())

The accounting and the FLOPs run ``run_microbatches`` on fake tensors (shapes and dtypes, no
compute: about a second for WRN-28-2), so it must not read tensor values (``.item()``); pass
``fake=False`` otherwise. Only ``train_step`` computes for real. When microbatches repeat the same
shapes, pass one ``Microbatch(run, count)`` per distinct shape instead of ``run_microbatches``:
each is then run once (ten times faster for ten equal microbatches).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from lowmem.profiler.activations import ActivationTrace, account_activations
from lowmem.profiler.peak import accounted_eagerly, measure_peak
from lowmem.profiler.state import account_state, step_temporaries

MB = 1e6  # the report's megabyte (404.8 MB = 404.8e6 bytes)


@dataclass(frozen=True)
class Microbatch:
    """Forward + backward of one microbatch (``run``), standing for ``count`` microbatches of the
    minibatch with the same shapes (the same activation memory and FLOPs). With ``inputs``, the
    accounting calls ``run(inputs)`` with them as fake CPU tensors (see ``account_activations``)."""

    run: Callable[..., object]
    count: int = 1
    inputs: Any = None
    replayed: bool = False  # captured and replayed (CUDA graphs): its activations stay in the graphs' pool


@dataclass(frozen=True)
class MemoryReport:
    """One configuration's memory (bytes) and FLOPs; see the module docstring for the definitions."""

    model_bytes: int
    optimizer_bytes: int  # gradients + optimizer state
    activation_bytes: int
    total_bytes: int  # model + optimizer + activation: the report's figure
    peak_bytes: int | None  # measured; None when no real step was run
    peak_breakdown: dict[str, int]  # bytes per category at the measured peak
    peak_location: str  # where the measured peak happened
    flops: int  # one minibatch: forward + backward + recomputation
    params: int  # parameters (dense count)
    nonzero_params: int  # parameters counting only active positions of sparse weights
    activation_at_peak: dict[str, int]  # saved / recomputed / gradient bytes at the activation peak
    activation_location: str  # where the activation peak happened
    activation_stored_before_backward: int  # saved when backward starts (checkpoints only, if any)
    activation_held_bytes: int  # the same tensors as autograd here really held them (see table())
    activation_saved_bytes: int  # the most saved-for-backward bytes alive at once (no gradients)
    peak_source: str = ""  # "cuda allocator" or "cpu tensor tracker"
    optimizer_state_bytes: int = 0  # the optimizer state alone (part of optimizer_bytes): codes + scales when quantized
    graph_pool_bytes: int = 0  # accounted: replayed microbatches' activations, held in the CUDA graphs' pool (0: none)
    total_with_graph_pool_bytes: int = 0  # model + optimizer + graph pool + eager microbatches' activations
    step_temporary_bytes: int = 0  # held by a real step beyond the accounting (positions, dense temporaries, ...)
    step_temporaries: dict[str, int] = field(default_factory=dict)  # step_temporary_bytes by cause
    budget_total_bytes: int = 0  # total_with_graph_pool_bytes + step_temporary_bytes: compared with budgets
    compressed_bytes: int = 0  # of activation_saved_bytes, stored compressed (checkpointing.compress)
    offloaded_bytes: int = 0  # accounted: saved activations in host memory at most at once (checkpointing.offload)
    host_bytes: int = 0  # host memory held for offloaded activations (pinned pool after a real step, else accounted)
    gathered_bytes: int = 0  # sharded (fsdp): the weights gathered whole at once at most (0: not sharded)
    dense_weights: dict[str, str] = field(default_factory=dict)  # multiplying weights sparsity left dense: why
    seconds: dict[str, float] = field(default_factory=dict)  # time spent per measurement

    def to_json(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        """A readable breakdown, in the report's MB (1e6 bytes)."""

        def mb(value: int | None) -> str:
            return "n/a" if value is None else f"{value / MB:10.3f} MB"

        active = f"{self.nonzero_params:,} of {self.params:,} weights active"
        lines = [
            "accounting (report's definition)",
            f"  model        {mb(self.model_bytes)}   ({active})",
            f"  optimizer    {mb(self.optimizer_bytes)}   (state {mb(self.optimizer_state_bytes).strip()}, "
            f"gradients {mb(self.optimizer_bytes - self.optimizer_state_bytes).strip()})",
            f"  activations  {mb(self.activation_bytes)}   at {self.activation_location}",
            *(f"    {name:<11}{mb(value)}" for name, value in self.activation_at_peak.items()),
            f"    (saved for backward at most: {mb(self.activation_saved_bytes).strip()}; stored when backward "
            f"starts: {mb(self.activation_stored_before_backward).strip()}; held by this run's autograd at most: "
            f"{mb(self.activation_held_bytes).strip()})",
            *(
                [f"    (stored compressed: {mb(self.compressed_bytes).strip()} of the saved bytes)"]
                if self.compressed_bytes
                else []
            ),
            *(
                [f"    (offloaded to host memory: {mb(self.offloaded_bytes).strip()}; host memory held "
                 f"{mb(self.host_bytes).strip()})"]
                if self.offloaded_bytes or self.host_bytes
                else []
            ),
            f"  total        {mb(self.total_bytes)}",
            f"  + step temporaries {mb(self.step_temporary_bytes).strip()} ("
            + ", ".join(f"{name} {value / MB:.3f}" for name, value in self.step_temporaries.items())
            + f" MB) = {mb(self.budget_total_bytes).strip()}, the figure budgets are compared with",
            *([self._replay_line()] if self.graph_pool_bytes else []),
            *(
                [f"  sharded: this rank's shards above; weights gathered at once at most {mb(self.gathered_bytes)}"]
                if self.gathered_bytes
                else []
            ),
            f"measured peak ({self.peak_source or 'not measured'})",
            f"  peak         {mb(self.peak_bytes)}   at {self.peak_location or 'n/a'}",
            *(f"    {name:<18}{mb(value)}" for name, value in self.peak_breakdown.items() if value),
            f"flops          {self.flops / 1e9:10.3f} GFLOP  (minibatch: forward + backward + recompute)",
        ]
        return "\n".join(lines)

    def _replay_line(self) -> str:
        eager = self.total_with_graph_pool_bytes - self.model_bytes - self.optimizer_bytes - self.graph_pool_bytes
        return (
            f"  with CUDA graph replay {self.total_with_graph_pool_bytes / MB:.3f} MB: graph pool "
            f"{self.graph_pool_bytes / MB:.3f} MB held for the run + eager microbatches {eager / MB:.3f} MB on top"
        )


def profile_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    microbatches: Callable[[], object] | Sequence[Microbatch],
    train_step: Callable[[], object] | None = None,
    *,
    sparse: Mapping[str, tuple[Sequence[int], int]] | None = None,
    data: Sequence[torch.Tensor] = (),
    owners: Sequence[object] | None = None,
    fake: bool = True,
    arithmetic: contextlib.AbstractContextManager | None = None,
    host_bytes: Callable[[], int] | None = None,
    dense_weights: Mapping[str, str] | None = None,
) -> MemoryReport:
    """Account, count and (if ``train_step`` is given) measure one training step of ``model``.

    microbatches: forward + backward (no optimizer step) of every microbatch of one minibatch, run
        one after another, or one ``Microbatch`` per distinct microbatch shape. Activations are one
        microbatch's (the largest), FLOPs the whole minibatch's.
    train_step: the complete real step (it runs once and updates the model); None skips the
        measured peak.
    sparse: the parameters holding sparse weights, with their dense shapes and active counts
        (``DynamicSparsity.trained_parameters()``), counted as CSR.
    data: the data set's and the minibatch's tensors, named "data" in the measured breakdown.
    owners: the objects that hold the run (its trainer): the measured peak counts the tensors alive
        at the start that they reach, not the caller's (``lowmem.profiler.peak``); None: every
        tensor alive in the process.
    arithmetic: the context the real step computes in (``measure_peak``), e.g. the trainer's
        ``arithmetic()``.
    host_bytes: the host memory held for offloaded activations after the real step (a pinned
        pool's bytes); without it, or without a real step, the accounted offloaded bytes.
    dense_weights: the multiplying weights a sparse run leaves dense, each with why
        (``DynamicSparsity.dense_weights``), carried into the report as they are.
    """
    if callable(microbatches):
        microbatches = [Microbatch(microbatches)]
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    sparse = dict(sparse or {})
    state = account_state(model, optimizer, sparse)
    with accounted_eagerly(model):  # a compiled model's ops, each seen by the accounting
        traces = [(account_activations(m.run, model, fake=fake, inputs=m.inputs), m.count) for m in microbatches]
    activations = max((trace for trace, _ in traces), key=lambda trace: trace.activation_bytes)
    pool, eager = replayed_activations(
        [(trace.activation_bytes, m.replayed) for (trace, _), m in zip(traces, microbatches, strict=True)]
    )
    held_activations = pool + eager if pool else activations.activation_bytes
    flops = sum(trace.flops * count for trace, count in traces)
    state_temporaries = step_temporaries(model, sparse)
    # What the pass's own tensors held at once beyond the report's activations: every temporary of
    # forward and backward at its moment, saved tensors at their real size; with several
    # microbatches, each weight gradient too until it is added to the previous ones' (``live_bytes``).
    accumulating = sum(m.count for m in microbatches) > 1
    live = max(live_bytes(trace, model, accumulating) for trace, _ in traces)
    temporaries = {
        **state_temporaries._asdict(),
        "data": data_bytes(data),
        "pass_temporaries": max(0, live - held_activations),
    }
    temporary_bytes = sum(temporaries.values())
    seconds["accounting_and_flops"] = time.perf_counter() - started
    peak = None
    if train_step is not None:
        started = time.perf_counter()
        peak = measure_peak(train_step, model, optimizer, data=data, owners=owners, arithmetic=arithmetic)
        seconds["measured_step"] = time.perf_counter() - started
    offloaded = max(trace.offloaded_bytes for trace, _ in traces)
    held_on_host = host_bytes() if host_bytes is not None and peak is not None else 0
    params = dict(model.named_parameters())
    nonzero = sum(sparse[n][1] if n in sparse else p.numel() for n, p in params.items())
    dense_count = sum(math.prod(sparse[n][0]) if n in sparse else p.numel() for n, p in params.items())
    return MemoryReport(
        model_bytes=state.model_bytes,
        optimizer_bytes=state.optimizer_bytes,
        optimizer_state_bytes=state.optimizer_state_bytes,
        activation_bytes=activations.activation_bytes,
        total_bytes=state.model_bytes + state.optimizer_bytes + activations.activation_bytes,
        graph_pool_bytes=pool,
        total_with_graph_pool_bytes=state.model_bytes + state.optimizer_bytes + held_activations,
        step_temporary_bytes=temporary_bytes,
        step_temporaries=temporaries,
        budget_total_bytes=state.model_bytes + state.optimizer_bytes + held_activations + temporary_bytes,
        peak_bytes=None if peak is None else peak.peak_bytes,
        peak_breakdown={} if peak is None else peak.breakdown,
        peak_location="" if peak is None else peak.location,
        flops=flops,
        params=dense_count,
        nonzero_params=nonzero,
        activation_at_peak=activations.at_peak,
        activation_location=f"{activations.peak_phase}: {activations.peak_location}",
        activation_stored_before_backward=activations.stored_before_backward,
        activation_held_bytes=max(trace.held_bytes for trace, _ in traces),
        activation_saved_bytes=max(trace.max_saved_bytes for trace, _ in traces),
        compressed_bytes=max(trace.compressed_bytes for trace, _ in traces),
        offloaded_bytes=offloaded,
        host_bytes=max(held_on_host, offloaded),
        peak_source="" if peak is None else peak.source,
        dense_weights=dict(dense_weights or {}),
        seconds={k: round(v, 2) for k, v in seconds.items()},
    )


# The run's first recomputation of each block of a detected chain checks it against a fingerprint of
# its forward's output (``lowmem.techniques.block_checks``): a hash of its bits, a chunk of 2**16
# elements at a time, with three int64 temporaries per element (the bits, their positions, their
# product). A fake pass skips it (no values); the live record adds it where backward recomputes.
# (The profiler sits below the techniques: the chunk and the models that have chains are named here,
# and tests/test_plan_promise.py checks them against lowmem.techniques.)
RECOMPUTATION_CHECK_BYTES = 3 * 8 * (1 << 16)
CHAINS_ATTRIBUTE = "_lowmem_block_chains"  # lowmem.techniques.chains: a root model's chain runners


def live_bytes(trace: ActivationTrace, model: nn.Module | None, accumulating: bool) -> int:
    """What a real step's microbatch holds of its own at most, as ``trace`` saw it (``live_bytes``;
    ``accumulating``: a step of several microbatches, each weight gradient added into the previous
    ones'), with the scratch of the checks of a recomputed block on top where the pass recomputed
    blocks of ``model``'s detected chains (``RECOMPUTATION_CHECK_BYTES``)."""
    live = trace.live_accumulating_bytes if accumulating else trace.live_bytes
    recomputing = trace.live_recomputing_accumulating_bytes if accumulating else trace.live_recomputing_bytes
    if recomputing and getattr(model, CHAINS_ATTRIBUTE, None):
        live = max(live, recomputing + RECOMPUTATION_CHECK_BYTES)
    return live


def data_bytes(data: Sequence[torch.Tensor]) -> int:
    """Bytes of the data set resident on the device and the minibatch (``data``), each storage once."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in data if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def replayed_activations(shapes: Sequence[tuple[int, bool]]) -> tuple[int, int]:
    """(graph pool, eager) activation bytes of a minibatch's distinct microbatch shapes, each given as
    (activation bytes, replayed): the pool holds the largest replayed shape's activations for the
    whole run (the graphs share one pool), and an eager shape's activations come on top of it."""
    pool = max((size for size, replayed in shapes if replayed), default=0)
    eager = max((size for size, replayed in shapes if not replayed), default=0)
    return pool, eager
