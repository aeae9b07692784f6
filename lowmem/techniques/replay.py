"""One microbatch's forward and backward: run eagerly, or captured once per shape and replayed.

The trainer runs a minibatch through a ``MicrobatchRunner``: ``start_step(params)`` first, then
``forward_backward(model, part, weight)`` per microbatch, which returns the microbatch's mean loss
(detached, unweighted) and adds ``weight x loss scale x`` its gradient to every parameter's ``.grad``.

- ``EagerMicrobatches`` (``trainer.cuda_graphs=off``, CPU, data parallel, ``precision=amp``):
  forward, loss scaling, backward, every time; ``start_step`` sets the gradients to None.
- ``ReplayedMicrobatches`` (``trainer.cuda_graphs=auto`` on CUDA in one process): a microbatch
  shape seen for the second time, at the start of a step, is captured once — forward, loss
  scaling and backward, checkpointed blocks and their recomputation included — and every later
  microbatch of that shape replays the capture: its tensors are copied into the capture's input
  buffers and the whole pass runs as one launch, with none of the Python and kernel-launch
  overhead that dominates small microbatches on a GPU (a microbatch of 10 images does a tenth of
  the FLOPs but costs as many launches as a full batch).

What a replay reads and writes must be the same memory every time, so the replaying runner keeps:

- gradients in place: ``start_step`` zeroes the ``.grad`` tensors instead of dropping them, and the
  captured backward accumulates into them (the optimizers of ``optimizers.py`` consume gradients
  in place, so the same tensors serve every step);
- the loss weight and the loss scale as device tensors the capture multiplies by, filled before a
  replay when they change (a Python float would be baked into the capture);
- the state a training forward mutates: BatchNorm running statistics (and any other buffer). The
  warm-up passes and the capture pass must not count, so every buffer is copied before them and
  copied back in place afterwards (a transient copy of the buffers, once per capture); each replay
  then updates the statistics exactly once, as an eager microbatch does;
- the random number generators: forked around warm-up and capture, so the first replay draws what
  the eager microbatch would have drawn; on CUDA each replay advances the generator's offset by the
  capture's total (torch's graph-safe Philox state), so dropout masks differ between replays while
  a checkpointed recomputation redraws its forward's masks (``recomputation._RngState``).

A capture stays valid while every parameter, gradient and buffer keeps its memory: ``start_step``
compares their addresses and shapes with the capture's, and captures again when they moved (a
compact-sparsity rewiring re-slices the weights and drops their gradients; resuming re-lays them
out). Nothing else a capture reads can change: the loss scale is a device tensor, the precision,
checkpointing strategy and the models' Python-side choices are fixed for a run.

Each new capture is checked once, at its first replay, against an eager run of the same microbatch
from the same state and random numbers: loss, every gradient and every buffer (BatchNorm statistics)
must be equal — bit for bit where the eager run is deterministic (CPU, ``trainer.deterministic``),
else within ``VERIFY_TOLERANCE`` of each tensor's largest magnitude. A capture that differs is
dropped, its microbatch keeps the eager run's results, and the shape runs eagerly from then on (one
warning). A failure at the CUDA level during a capture (the device's state is then in doubt) stops
capturing for the rest of the run; the stream in use before it is restored whatever failed.

Anything that cannot be captured runs eagerly, and the run goes on: a shape not yet repeated (the
translation recipe's token batches rarely repeat: their padded shapes and token counts vary), a
shape that only occurs after another microbatch of the step (a short last microbatch: a capture
needs gradients that hold nothing yet, see ``_capture``), a capture that raises, more shapes than
``MAX_GRAPHS``. A model with a parameter that gets no gradient cannot keep zeroed gradients (the
optimizer would decay that parameter where eager training leaves it alone): the runner turns eager.

The capture mechanics sit behind a two-method backend (``warm_up``, ``capture``):
``CudaGraphBackend`` captures into ``torch.cuda.CUDAGraph``s sharing one memory pool;
``RecordingBackend`` "captures" by remembering the call and replays by calling it again on the same
input buffers, on any device: the runner's logic (buffers, shape keys, gradient accumulation, the
saved statistics, invalidation, fallback) runs and is tested on a CPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lowmem.techniques.precision import LossScaler

log = logging.getLogger("lowmem")

CUDA_GRAPHS = ("auto", "off")  # values of trainer.cuda_graphs
WARM_UP_PASSES = 3  # eager passes on the capture stream before a capture (cuDNN, cuBLAS, allocator)
MAX_GRAPHS = 8  # microbatch shapes kept captured at once; further shapes run eagerly
MAX_FAILED_CAPTURES = 3  # after this many shapes failed to capture, no new shape is tried
MAX_REMEMBERED_SHAPES = 4096  # shapes counted while waiting to repeat (token batches rarely do)
# A first replay may differ from eager by this fraction of a tensor's largest magnitude where the
# eager run is not deterministic (CUDA kernels with atomics); elsewhere it must be bit for bit.
VERIFY_TOLERANCE = 1e-3

LossFunction = Callable[[nn.Module, Any], torch.Tensor]  # (model, microbatch) -> mean loss, FP32


class MicrobatchRunner(Protocol):
    def start_step(self, params: Sequence[nn.Parameter]) -> None:
        """Prepare ``params``' gradients for a minibatch's first microbatch."""
        ...

    def forward_backward(self, model: nn.Module, part: Any, weight: float) -> torch.Tensor:
        """Forward and backward of microbatch ``part``; its (unweighted, detached) mean loss."""
        ...


class EagerMicrobatches:
    """Forward, loss scaling and backward, every microbatch (what lowmem always did).

    ``loss`` computes a microbatch's mean loss (FP32) from the model; ``autocast(part)`` returns the
    precision's autocast context for a microbatch (a no-op but for ``precision=amp``); ``scaler``
    scales the loss.
    """

    def __init__(
        self,
        loss: LossFunction,
        scaler: Any,
        autocast: Callable[[Any], contextlib.AbstractContextManager],
    ) -> None:
        self.loss, self.scaler, self.autocast = loss, scaler, autocast

    def start_step(self, params: Sequence[nn.Parameter]) -> None:
        for p in params:
            p.grad = None

    def forward_backward(self, model: nn.Module, part: Any, weight: float) -> torch.Tensor:
        with self.autocast(part):
            loss = self.loss(model, part)
        # Loss scaling (FP16): gradients stay scaled; the optimizer unscales them in FP32.
        self.scaler.scale_loss(loss * weight).backward()
        return loss.detach()


# --- capture backends --------------------------------------------------------------------------


class Replay(Protocol):
    def replay(self) -> torch.Tensor:
        """Run the captured call again; its output (valid until the next replay of any capture)."""
        ...


class CaptureBackend(Protocol):
    def warm_up(self, call: Callable[[], torch.Tensor], passes: int) -> None:
        """Run ``call`` ``passes`` times the way a capture needs it warmed up."""
        ...

    def capture(self, call: Callable[[], torch.Tensor]) -> Replay:
        """Capture ``call`` for replay (it may or may not run it)."""
        ...


class CudaGraphBackend:
    """CUDA graphs: warm-up and capture on one side stream, every graph in one memory pool.

    Sharing the pool is safe because replays never overlap and a replay's only output (the loss) is
    copied before the next replay; one pool means the memory of the largest microbatch shape, not
    of all of them. The pool stays reserved while graphs exist (``max_memory_allocated`` counts it
    once, when it is captured).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    def warm_up(self, call: Callable[[], torch.Tensor], passes: int) -> None:
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        try:
            with torch.cuda.stream(self.stream):
                for _ in range(passes):
                    call()
        finally:  # what the runner restores afterwards, on the main stream, waits for these passes
            _restore_stream(main, self.device)
            main.wait_stream(self.stream)

    def capture(self, call: Callable[[], torch.Tensor]) -> Replay:
        graph = torch.cuda.CUDAGraph()
        main = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                output = call()
        except Exception as error:
            # torch.cuda.graph's exit skips the stream context's when capture_end raises: the rest of
            # the run would go on on the capture stream. The previous one is put back, and a failed
            # capture's stream (perhaps still routed to the pool) is never used again.
            _restore_stream(main, self.device)
            self.stream = torch.cuda.Stream(self.device)
            raise CaptureFailed(_describe(error)) from error
        return _CudaGraphReplay(graph, output)


@dataclass
class _CudaGraphReplay:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class CaptureFailed(RuntimeError):
    """A capture failed on the device (inside ``torch.cuda.graph``): the runner captures no more."""


def _restore_stream(stream: torch.cuda.Stream, device: torch.device) -> None:
    if torch.cuda.current_stream(device) != stream:
        torch.cuda.set_stream(stream)


def _cuda_level(error: Exception) -> bool:
    """Whether ``error`` came from the device (a CUDA error, a failed capture), not from Python."""
    accelerator_error = getattr(torch, "AcceleratorError", CaptureFailed)
    return isinstance(error, CaptureFailed | accelerator_error) or (
        isinstance(error, RuntimeError) and "CUDA" in str(error)
    )


class RecordingBackend:
    """The capture interface run eagerly, on any device: ``capture`` runs the call once (as a capture
    pass would touch state, so the runner's restoring is exercised) and keeps it; a replay calls it
    again on the same input buffers. What the runner's CPU tests use in place of CUDA graphs."""

    def warm_up(self, call: Callable[[], torch.Tensor], passes: int) -> None:
        for _ in range(passes):
            call()

    def capture(self, call: Callable[[], torch.Tensor]) -> Replay:
        call()
        return _RecordedCall(call)


@dataclass
class _RecordedCall:
    call: Callable[[], torch.Tensor]

    def replay(self) -> torch.Tensor:
        return self.call()


# --- the replaying runner ----------------------------------------------------------------------


@dataclass
class _Captured:
    """One captured microbatch shape: the input buffers a replay copies into, and the replay."""

    inputs: list[torch.Tensor]  # one per tensor leaf of the microbatch, in pytree order
    replay: Replay
    verified: bool = False  # its first replay matched an eager run


class ReplayedMicrobatches:
    """Capture each repeating microbatch shape once, then replay it (see the module docstring).

    ``eager`` supplies the loss, autocast and scaler (a ``LossScaler``: amp's ``GradScaler`` keeps
    state of its own) and runs whatever is not replayed; ``model`` is the (not data-parallel)
    model every call runs; ``backend`` captures and replays; ``device`` is where the loss weight and
    scale tensors live.
    """

    def __init__(
        self, eager: EagerMicrobatches, model: nn.Module, backend: CaptureBackend, device: torch.device
    ) -> None:
        if not isinstance(eager.scaler, LossScaler):
            raise ValueError(
                f"trainer.cuda_graphs=auto replays lowmem's LossScaler, not {type(eager.scaler).__name__} "
                "(precision=amp runs eagerly)"
            )
        self.eager, self.model, self.backend, self.device = eager, model, backend, device
        self.graphs: dict[tuple, _Captured] = {}
        self.sightings: Counter[tuple] = Counter()  # microbatches of each shape run so far
        self.refused: dict[tuple, str] = {}  # shapes that cannot be captured, with the reason
        self.disabled: str | None = None  # why the runner runs everything eagerly from now on
        self.captures = 0  # captures made (a rewiring makes new ones)
        # The loss weight and loss scale every capture multiplies the loss by (made with the first).
        self._scalars: dict[str, torch.Tensor] = {}
        self._filled: dict[str, float] = {}
        self._params: Sequence[nn.Parameter] = ()
        self._clean = False  # no backward has run since start_step: every gradient is zero or None
        self._signature: tuple | None = None
        self._buffer_slots: list[tuple[nn.Module, str]] = []  # (module, name) of every buffer
        self._logged: set[str] = set()

    # ------------------------------------------------------------------------------- per step
    def start_step(self, params: Sequence[nn.Parameter]) -> None:
        """Zero the gradients in place while captures exist (they accumulate into those tensors);
        drop the captures first if any parameter, gradient or buffer moved since they were made."""
        self._params, self._clean = params, True
        if self.graphs and self._storage_signature() != self._signature:
            self._log_once(
                "moved", "parameters or buffers moved (a sparsity rewiring or a resume): microbatches are "
                "captured again"
            )
            self.graphs.clear()
        if not self.graphs:
            self.eager.start_step(params)
            return
        torch._foreach_zero_([p.grad for p in params])

    def forward_backward(self, model: nn.Module, part: Any, weight: float) -> torch.Tensor:
        if self.disabled is not None or model is not self.model:
            return self._eager(model, part, weight)
        leaves, spec = tree_flatten(part)
        key = self._key(leaves, spec)
        captured = self.graphs.get(key)
        if captured is None and key is not None and self._may_capture(key):
            captured = self._capture(key, leaves, spec, weight)
        if captured is None:
            return self._eager(model, part, weight)
        if not captured.verified:
            return self._verified_replay(key, captured, model, part, leaves, weight)
        self._clean = False
        return self._replay(captured, leaves, weight)

    # ------------------------------------------------------------------------------- helpers
    def _replay(self, captured: _Captured, leaves: list[Any], weight: float) -> torch.Tensor:
        for buffer, leaf in zip(captured.inputs, _tensors(leaves), strict=True):
            buffer.copy_(leaf)
        self._fill(weight)
        # A copy: the next replay (of any shape: the graphs share one pool) overwrites the output.
        return captured.replay.replay().clone()

    def _verified_replay(
        self, key: tuple, captured: _Captured, model: nn.Module, part: Any, leaves: list[Any], weight: float
    ) -> torch.Tensor:
        """A new capture's first replay, checked against an eager run of the same microbatch from the
        same state (every gradient is zero here: a capture is made at a clean point). The eager run
        draws the random numbers the replay then draws; if they differ the eager results are kept."""
        params, buffers = self._params, _buffers(self.model)
        with torch.no_grad():
            saved = [buffer.clone() for _, _, buffer in buffers]
        with _forked_rng(self.device):
            eager_loss = self.eager.forward_backward(model, part, weight)
        with torch.no_grad():
            eager_state = [p.grad.clone() for p in params] + [buffer.clone() for _, _, buffer in buffers]
            for (_, _, buffer), copy in zip(buffers, saved, strict=True):
                buffer.copy_(copy)
            torch._foreach_zero_([p.grad for p in params])
        del saved
        self._clean = False
        loss = self._replay(captured, leaves, weight)
        state = [p.grad for p in params] + [buffer for _, _, buffer in buffers]
        difference = _difference([eager_loss, *eager_state], [loss, *state], self._deterministic())
        if difference is None:
            captured.verified = True
            return loss
        with torch.no_grad():  # the microbatch as eager mode computed it
            for target, value in zip(state, eager_state, strict=True):
                target.copy_(value)
        del self.graphs[key]
        self.refused[key] = f"its replay differs from eager mode ({difference})"
        log.warning(
            "trainer.cuda_graphs: a captured microbatch shape does not replay as it runs eagerly (%s): it runs "
            "eagerly from now on", difference,
        )
        return eager_loss

    def _deterministic(self) -> bool:
        return self.device.type != "cuda" or torch.are_deterministic_algorithms_enabled()

    def _eager(self, model: nn.Module, part: Any, weight: float) -> torch.Tensor:
        self._clean = False
        return self.eager.forward_backward(model, part, weight)

    def _key(self, leaves: list[Any], spec: Any) -> tuple | None:
        """What a capture depends on besides the model: the microbatch's structure, its tensors'
        shapes, dtypes and devices, its other values (baked into the capture), training mode.
        None when it cannot be captured (an input that needs a gradient, an unhashable value)."""
        key: list[Any] = [spec, self.model.training]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if leaf.requires_grad:
                    return None
                key.append((tuple(leaf.shape), leaf.dtype, leaf.device))
            else:
                try:
                    hash(leaf)
                except TypeError:
                    return None
                key.append(("value", leaf))
        return tuple(key)

    def _may_capture(self, key: tuple) -> bool:
        if key not in self.sightings and len(self.sightings) >= MAX_REMEMBERED_SHAPES:
            self.sightings.clear()  # a shape that repeats soon is counted again soon
        self.sightings[key] += 1
        if key in self.refused or self.sightings[key] < 2:
            if self.sightings[key] == 1:
                self._log_once("first", "microbatch shapes run eagerly until they repeat, then are captured")
            return False
        if len(self.refused) >= MAX_FAILED_CAPTURES:
            return False
        if len(self.graphs) >= MAX_GRAPHS:
            self._log_once("full", f"{MAX_GRAPHS} microbatch shapes are captured: further shapes run eagerly")
            return False
        # Only where no gradient holds anything yet: warm-up and capture accumulate into the
        # gradients, and zeroing them afterwards is all the restoring they need (no copy to keep).
        return self._clean

    def _fill(self, weight: float) -> None:
        """Put this microbatch's loss weight and the scaler's current scale where the captures read
        them (only when they changed: each fill is a launch). FP32, like the loss (``recipe.loss``
        returns FP32), so ``loss * tensor`` rounds exactly as eager mode's ``loss * float``."""
        for name, value in (("weight", weight), ("scale", self.eager.scaler.scale)):
            if name not in self._scalars:
                self._scalars[name] = torch.empty((), dtype=torch.float32, device=self.device)
            if self._filled.get(name) != value:
                self._scalars[name].fill_(value)
                self._filled[name] = value

    def _capture(self, key: tuple, leaves: list[Any], spec: Any, weight: float) -> _Captured | None:
        params = self._params
        for p in params:  # a clean point: None and zero are the same gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        inputs = [leaf.clone() for leaf in _tensors(leaves)]  # the buffers replays copy into
        next_input = iter(inputs)
        static_part = tree_unflatten(
            [next(next_input) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec
        )
        self._fill(weight)
        weight_tensor, scale_tensor = self._scalars["weight"], self._scalars["scale"]

        def call() -> torch.Tensor:
            with self.eager.autocast(static_part):
                loss = self.eager.loss(self.model, static_part)
            if loss.dtype != weight_tensor.dtype:
                raise TypeError(f"the loss is {loss.dtype}, captures scale an FP32 loss")
            ((loss * weight_tensor) * scale_tensor).backward()
            return loss.detach()

        buffers = _buffers(self.model)
        saved = [buffer.clone() for _, _, buffer in buffers]
        grad_versions = [p.grad._version for p in params]
        replay, unused, problem, fatal = None, [], None, False
        try:
            with _forked_rng(self.device):
                self.backend.warm_up(call, WARM_UP_PASSES)
                unused = [p for p, version in zip(params, grad_versions, strict=True) if p.grad._version == version]
                if not unused:
                    replay = self.backend.capture(call)
        except Exception as error:  # whatever a capture raises, the microbatch runs eagerly
            problem = _describe(error)
            fatal = _cuda_level(error)
        finally:
            with torch.no_grad():
                for (_, _, buffer), copy in zip(buffers, saved, strict=True):
                    buffer.copy_(copy)
                torch._foreach_zero_([p.grad for p in params])
            del saved
        if unused:
            names = {id(p): name for name, p in self.model.named_parameters()}
            self._turn_eager(
                f"{len(unused)} parameter(s) get no gradient (e.g. {names.get(id(unused[0]), '?')}); "
                "replaying would need their gradients zeroed, which changes their update"
            )
            return None
        if fatal:
            self._turn_eager(f"a capture failed on the device ({problem}); no further capture in this run")
            return None
        if problem is None:
            problem = _buffer_replaced(buffers)
        if problem is not None:
            self.refused[key] = problem
            if not self.graphs:  # back to eager gradients (still a clean point: all are zero)
                self.eager.start_step(params)
            log.warning(
                "trainer.cuda_graphs: a microbatch shape could not be captured and runs eagerly (%s)%s",
                problem,
                "; no further shape will be tried" if len(self.refused) >= MAX_FAILED_CAPTURES else "",
            )
            return None
        self.captures += 1
        self._buffer_slots = [(module, name) for module, name, _ in buffers]
        self._signature = self._storage_signature()
        self.graphs[key] = _Captured(inputs, replay)
        self._log_once("captured", "trainer.cuda_graphs=auto: repeating microbatch shapes are captured and replayed")
        return self.graphs[key]

    def _storage_signature(self) -> tuple:
        """Where every parameter, gradient and buffer lives (address, shape): what a capture reads
        and writes. (The buffers are looked up where they were at the capture: walking the module
        tree each step would cost more than the rest of this check.)"""
        params = self._params
        buffers = (module._buffers.get(name) for module, name in self._buffer_slots)
        tensors = [*params, *(p.grad for p in params), *buffers]
        return tuple(None if t is None else (t.data_ptr(), t.shape) for t in tensors)

    def _turn_eager(self, reason: str) -> None:
        self.disabled = reason
        self.graphs.clear()
        self.eager.start_step(self._params)  # still a clean point: every gradient is zero
        log.warning("trainer.cuda_graphs: microbatches run eagerly from now on: %s", reason)

    def _log_once(self, topic: str, message: str) -> None:
        if topic not in self._logged:
            self._logged.add(topic)
            log.info(message)


def _describe(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _difference(expected: list[torch.Tensor], got: list[torch.Tensor], exact: bool) -> str | None:
    """Where ``got`` differs from ``expected`` (bit for bit if ``exact``, else beyond
    ``VERIFY_TOLERANCE`` of each tensor's largest magnitude), or None."""
    for index, (a, b) in enumerate(zip(expected, got, strict=True)):
        if torch.equal(a, b):
            continue
        if not exact and a.is_floating_point():
            scale = float(a.abs().max()) if a.numel() else 0.0
            if float((a.float() - b.float()).abs().max()) <= VERIFY_TOLERANCE * scale:
                continue
        what = "the loss" if index == 0 else f"tensor {index} of the gradients and buffers"
        return f"{what}: largest difference {float((a.double() - b.double()).abs().max()):.3g}"
    return None


def _tensors(leaves: list[Any]) -> list[torch.Tensor]:
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _buffers(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every buffer of ``model`` (BatchNorm running statistics among them): (module, name, tensor)."""
    return [
        (module, name, buffer)
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None
    ]


def _buffer_replaced(buffers: list[tuple[nn.Module, str, torch.Tensor]]) -> str | None:
    """Why the capture would read a buffer the module no longer holds, or None."""
    for module, name, buffer in buffers:
        if module._buffers.get(name) is not buffer:
            return f"{type(module).__name__}.{name} was replaced by another tensor during the pass"
    return None


def _forked_rng(device: torch.device) -> contextlib.AbstractContextManager:
    """Leave the CPU generator (and ``device``'s, on CUDA) as they were: warm-up and capture passes
    draw random numbers the replays must draw again."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type="cuda")


def make_microbatch_runner(
    setting: str,
    eager: EagerMicrobatches,
    model: nn.Module,
    device: torch.device,
    *,
    data_parallel: bool,
    backend: CaptureBackend | None = None,
) -> EagerMicrobatches | ReplayedMicrobatches:
    """The runner ``trainer.cuda_graphs=setting`` asks for on ``device``.

    ``auto`` replays on CUDA (or with the given ``backend``, on any device) unless the run is data
    parallel (each microbatch but the last skips DDP's all-reduce, which a capture would have to
    follow) or uses ``precision=amp`` (torch's GradScaler); ``off`` runs eagerly.
    """
    if setting not in CUDA_GRAPHS:
        raise ValueError(f"trainer.cuda_graphs={setting!r} is unknown; allowed: {', '.join(CUDA_GRAPHS)}")
    if setting == "off" or (backend is None and device.type != "cuda"):
        return eager
    refusal = None
    if data_parallel:
        refusal = "data parallel training (DDP's deferred all-reduce and FSDP2's gathers are not captured)"
    elif not isinstance(eager.scaler, LossScaler):
        refusal = "precision=amp (torch's GradScaler)"
    if refusal is not None:
        log.info("trainer.cuda_graphs=auto: microbatches run eagerly under %s", refusal)
        return eager
    return ReplayedMicrobatches(eager, model, backend if backend is not None else CudaGraphBackend(device), device)
