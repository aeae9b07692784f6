"""Measured memory of one real training step, and its FLOPs — separate from the report's accounting.

The measured peak is what decides whether a run fits (SPEC §4): on CUDA the allocator's own
``torch.cuda.max_memory_allocated``; on CPU, where the allocator keeps no statistics, the peak of
live tensor storages seen by ``AllocationTracker`` (a ``TorchDispatchMode``: every op's output
storage counts from its creation until it dies, on top of every tensor alive when the step
starts, each at its size of the moment: storages resized in place count as they grow and shrink,
which is how FSDP2 allocates and frees gathered weights). Kernel-internal scratch buffers that
never become tensors are not seen on CPU. Both report a breakdown at the peak moment and where it
happened.

Whose tensors: given ``owners`` (a run's trainer), the CPU tracker counts only the tensors alive at
the start that those objects reach (``reachable_tensors``: the model, optimizer state, data and
whatever else the run holds) plus everything the step creates; tensors the caller holds (another
model, a leftover of the planner) are not the run's and are not counted. Without ``owners`` every
tensor alive at the start counts (as "other" when nothing names it).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from lowmem.profiler.activations import storage_key

# Categories of the breakdown, in display order:
# - data: the data set resident on the device and the minibatch being trained on;
# - workspaces: allocator memory no tensor accounts for (CUDA: cuBLAS/cuDNN workspaces, kernel
#   scratch), sampled at the tracker's peak; CPU kernels' scratch is invisible (always 0);
# - graph_pool: CUDA graphs' private memory pool (trainer.cuda_graphs=auto) held reserved for the
#   replays while no tensor uses it: max_memory_allocated never sees it (replays allocate nothing);
# - parameters: parameters and buffers (BatchNorm statistics, compact sparse positions);
# - gradients, optimizer_state, saved_activations (what autograd holds for backward);
# - temporary: everything else the step creates (unsaved outputs, activation gradients, scratch);
# - other: tensors alive at the start that are none of the above (with ``owners``: only those the
#   run reaches).
PEAK_CATEGORIES = (
    "data",
    "workspaces",
    "graph_pool",
    "parameters",
    "gradients",
    "optimizer_state",
    "saved_activations",
    "temporary",
    "other",
)


@dataclass(frozen=True)
class PeakMeasurement:
    """The measured peak of one step (bytes) and what was alive then."""

    peak_bytes: int  # CUDA: max_memory_allocated + idle graph pool; CPU: the tracker's peak of live tensor bytes
    breakdown: dict[str, int]  # PEAK_CATEGORIES -> bytes at the tracker's peak
    location: str  # "<phase>: <module or autograd node> / <aten op>" at the tracker's peak
    start_bytes: int  # live tensor bytes when the step started
    source: str  # "cuda allocator" or "cpu tensor tracker"


@dataclass
class _Storage:
    nbytes: int
    category: str


class AllocationTracker(TorchDispatchMode):
    """Context manager tracking live tensor storages on ``device`` and their peak (bytes).

    model, optimizer, data: name what lives at the start (parameters and buffers, gradients,
    optimizer state, the data set and minibatch) and let the tracker recategorise storages as the
    step creates gradients and optimizer state. Storages autograd saves for backward become
    ``saved_activations``; everything else created during the step is ``temporary`` (unsaved
    forward outputs, activation gradients, scratch). Tensors alive at the start that are none of
    these are ``other``; with ``owners``, only those the owners reach count at all (see the module
    docstring). On CUDA the allocator memory no tensor accounts for at the peak is ``workspaces``.
    See ``PEAK_CATEGORIES``.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        data: Iterable[torch.Tensor] = (),
        owners: Iterable[object] | None = None,
    ) -> None:
        super().__init__()
        self.device, self.model, self.optimizer = torch.device(device), model, optimizer
        self.data = [t for t in data if isinstance(t, torch.Tensor)]
        self.owners = None if owners is None else list(owners)
        self.live = dict.fromkeys(PEAK_CATEGORIES, 0)
        self.peak_bytes = self.start_bytes = 0
        self.breakdown: dict[str, int] = {}
        self.location = ""
        self._storages: dict[int, _Storage] = {}
        # Detached on exit: a finalizer holds this tracker (and through it the model) until its
        # storage dies, and parameters' storages outlive the step.
        self._finalizers: list[weakref.finalize] = []
        self._context = contextlib.ExitStack()
        self._modules: list[str] = []
        self._module_names: dict[int, str] = {}
        self._in_optimizer = False
        self._op = ""

    # --- bookkeeping ----------------------------------------------------------------------------
    def _add(self, tensor: torch.Tensor, category: str, recategorise: bool = False) -> None:
        if _is_dtensor(tensor):  # sharded (FSDP2): this rank holds its local piece only
            tensor = tensor._local_tensor
        if not self._on_device(tensor.device) or isinstance(tensor, FakeTensor):
            return
        storage = tensor.untyped_storage()
        entry = self._storages.get(storage._cdata)
        if entry is None:
            self._track(storage, category)
            return
        if recategorise and entry.category != category:
            self.live[entry.category] -= entry.nbytes
            self.live[category] += entry.nbytes
            entry.category = category
        if storage.nbytes() != entry.nbytes:  # resized in place by an op (``out=``, ``resize_``)
            self._resize(entry, storage.nbytes())

    def _track(self, storage: torch.UntypedStorage, category: str) -> None:
        key = storage._cdata  # ``storage_key``: the same for every view of it
        self._storages[key] = _Storage(storage.nbytes(), category)
        self.live[category] += storage.nbytes()
        self._finalizers.append(weakref.finalize(storage, self._remove, key))
        self._update_peak()

    def _resize(self, entry: _Storage, nbytes: int) -> None:
        grew = nbytes > entry.nbytes
        self.live[entry.category] += nbytes - entry.nbytes
        entry.nbytes = nbytes
        if grew:
            self._update_peak()

    def _storage_resized(self, storage: torch.UntypedStorage) -> None:
        """After ``UntypedStorage.resize_``, which CPU tensors' storages do without passing through
        ``__torch_dispatch__``: FSDP2 frees a gathered weight by resizing its storage to 0 bytes and
        allocates it again by resizing it back before the next all-gather. A storage the tracker
        did not know counts from now, as memory the step allocated."""
        if not self._on_device(storage.device):
            return
        entry = self._storages.get(storage._cdata)
        if entry is None:
            if storage.nbytes():
                self._track(storage, "temporary")
        elif storage.nbytes() != entry.nbytes:
            self._resize(entry, storage.nbytes())

    def _on_device(self, device: torch.device) -> bool:
        # "cuda" means the current CUDA device: compare types, then indices
        if device.type != self.device.type:
            return False
        return self.device.index is None or device.index is None or device.index == self.device.index

    def _remove(self, key: int) -> None:
        entry = self._storages.pop(key)
        self.live[entry.category] -= entry.nbytes

    def _update_peak(self) -> None:
        total = sum(self.live.values())
        if total > self.peak_bytes:
            self.peak_bytes, self.breakdown = total, dict(self.live)
            if self.device.type == "cuda":
                untracked = torch.cuda.memory_allocated(self.device) - total
                self.breakdown["workspaces"] = max(0, untracked)
            self.location = self._where()

    def _where(self) -> str:
        """ "<phase>: <module or autograd node> / <op>"; phase is forward (inside a module),
        backward, optimizer (inside ``optimizer.step``) or step (anywhere else)."""
        node = torch._C._current_autograd_node()
        if node is not None:
            return f"backward: {node.name()} / {self._op}"
        if self._in_optimizer:
            return f"optimizer: {self._op}"
        if self._modules:
            return f"forward: {self._modules[-1]} / {self._op}"
        return f"step: {self._op}"

    def _start(self) -> None:
        """Count every tensor alive now, categorised by what the model and optimizer say it is."""
        known: list[tuple[Iterable[torch.Tensor], str]] = [(self.data, "data")]
        if self.model is not None:
            params = list(self.model.parameters())
            known += [
                ([*params, *self.model.buffers()], "parameters"),
                ([p.grad for p in params if p.grad is not None], "gradients"),
            ]
        if self.optimizer is not None:
            known.append((_optimizer_tensors(self.optimizer), "optimizer_state"))
        for tensors, category in known:
            for tensor in tensors:
                self._add(tensor, category)
        gc.collect()
        for tensor in _live_tensors() if self.owners is None else reachable_tensors(self.owners):
            self._add(tensor, "other")
        self.start_bytes = sum(self.live.values())

    # --- events ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is not torch.ops.aten.detach.default:
            self._op = func.overloadpacket.__name__
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._add(tensor, "temporary")
        return out

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._add(tensor, "saved_activations", recategorise=self._category(tensor) == "temporary")
        return tensor.detach()  # not the tensor itself: that would make a cycle through grad_fn

    def _category(self, tensor: torch.Tensor) -> str | None:
        entry = self._storages.get(storage_key(tensor))
        return entry.category if entry is not None else None

    def _gradient_ready(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._add(param.grad, "gradients", recategorise=True)

    def _optimizer_pre(self, *_) -> None:
        self._in_optimizer = True

    def _optimizer_post(self, optimizer, *_) -> None:
        for tensor in _optimizer_tensors(optimizer):
            self._add(tensor, "optimizer_state", recategorise=True)
        self._in_optimizer = False

    def _module_pre(self, module: nn.Module, *_) -> None:
        self._modules.append(self._module_names.get(id(module), type(module).__name__))

    def _module_post(self, *_) -> None:
        if self._modules:
            self._modules.pop()

    # --- context --------------------------------------------------------------------------------
    def __enter__(self) -> AllocationTracker:
        hooks = self._context
        if self.model is not None:
            self._module_names = {id(m): name or type(m).__name__ for name, m in self.model.named_modules()}
            for param in self.model.parameters():
                if param.requires_grad:
                    hooks.callback(param.register_post_accumulate_grad_hook(self._gradient_ready).remove)
        if self.optimizer is not None:
            hooks.callback(self.optimizer.register_step_pre_hook(self._optimizer_pre).remove)
            hooks.callback(self.optimizer.register_step_post_hook(self._optimizer_post).remove)
        hooks.callback(nn.modules.module.register_module_forward_pre_hook(self._module_pre).remove)
        hooks.callback(nn.modules.module.register_module_forward_hook(self._module_post).remove)
        hooks.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        hooks.enter_context(_storage_resizes_reported_to(self._storage_resized))
        self._start()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._context.close()
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()


# The profiler's own chatter on stderr, which a run measuring its compiled steps would print at every
# measured step: kineto's banners ("USDT: ... profiler_start", and on a CUDA build without a GPU
# "ERROR: ... gpuGetDeviceCount failed"), and c10's one warning per process that a block allocated
# before profiling began was freed during it - the case CompiledStepTracker handles (its storages'
# finalizers time those deaths).
_KINETO_SILENT = "6"  # kineto's log levels run VERBOSE 0 .. USDT 5: 6 prints none
_UNKNOWN_BLOCK_WARNED = False


def _quiet_kineto() -> None:
    """``KINETO_LOG_LEVEL`` set to print nothing, unless you set it (kineto reads it when the
    process first profiles: a process that profiled before keeps its level)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", _KINETO_SILENT)


def _free_unheard(older: list[torch.Tensor]) -> None:
    """Free the tensors of ``older`` (allocated before the profiler started; the list holds their
    only references) with the process's stderr sent to /dev/null for that moment: c10 warns once per
    process about the first such block, and this spends that one warning where nobody reads it."""
    global _UNKNOWN_BLOCK_WARNED
    _UNKNOWN_BLOCK_WARNED = True
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no stderr to silence: the warning goes nowhere anyway
        return
    try:
        silent = os.open(os.devnull, os.O_WRONLY)
        os.dup2(silent, 2)
        os.close(silent)
        older.clear()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class CompiledStepTracker(AllocationTracker):
    """The tracker of a step that runs compiled code (``torch.compile``): the allocator's own
    allocation and free events, which ``torch.profiler`` records (``profile_memory``) for compiled
    kernels' buffers as for eager ops' tensors, where a ``TorchDispatchMode`` would make compiled
    code run uncompiled. The peak is the bytes alive at the start (counted and named as
    ``AllocationTracker`` counts them) plus the highest running total of the step's allocations
    less its frees; at the peak, what the step itself holds is one figure, ``temporary`` (the
    events do not say whose a buffer is). ``location``: the innermost op running at the peak.

    The allocator reports no free of a block allocated before profiling began: the deaths of the
    tensors alive at the start (a previous step's gradients, set to None) come from their storages'
    finalizers instead, timed on the profiler's clock (ns since the epoch)."""

    def __enter__(self) -> CompiledStepTracker:
        from torch.profiler import ProfilerActivity, profile

        self._deaths: list[tuple[int, int]] = []
        self._start()
        self._context.callback(self._detach)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        _quiet_kineto()
        older = [] if _UNKNOWN_BLOCK_WARNED else [torch.empty(1)]
        self._profiler = self._context.enter_context(profile(activities=activities, profile_memory=True))
        if older:
            _free_unheard(older)
        return self

    def __exit__(self, *exc) -> None:
        self._context.close()
        if exc[0] is None:
            self._read(self._profiler.profiler.kineto_results.events())

    def _track(self, storage: torch.UntypedStorage, category: str) -> None:
        nbytes = storage.nbytes()
        self._storages[storage._cdata] = _Storage(nbytes, category)
        self.live[category] += nbytes
        self._finalizers.append(weakref.finalize(storage, self._died, nbytes))

    def _died(self, nbytes: int) -> None:
        self._deaths.append((time.time_ns(), -nbytes))

    def _detach(self) -> None:
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()

    def _read(self, events: list) -> None:
        kind = "CUDA" if self.device.type == "cuda" else "CPU"
        memory = [e for e in events if e.name() == "[memory]" and str(e.device_type()).endswith(kind)]
        changes = sorted([(e.start_ns(), e.nbytes()) for e in memory] + self._deaths)
        running = highest = 0
        at = None
        for when, nbytes in changes:
            running += nbytes
            if running > highest:
                highest, at = running, when
        self.breakdown = dict(self.live)
        self.breakdown["temporary"] += highest
        self.peak_bytes = self.start_bytes + highest
        ops = [e for e in events if e.name() != "[memory]" and at is not None and e.start_ns() <= at <= e.end_ns()]
        innermost = min(ops, key=lambda e: e.end_ns() - e.start_ns(), default=None)
        name = innermost.name() if innermost is not None else "start"
        if "CompiledFxGraph" in name:  # "## Call CompiledFxGraph <hash> ##"
            name = "a compiled graph"
        self.location = f"compiled step: {name}"


@contextlib.contextmanager
def _storage_resizes_reported_to(report: Callable[[torch.UntypedStorage], None]) -> Iterator[None]:
    """Calls ``report(storage)`` after every ``UntypedStorage.resize_`` inside: the dispatcher never
    sees those on CPU (torch resizes a CPU storage directly), and no torch hook does."""
    cls = torch.UntypedStorage
    own = vars(cls).get("resize_")  # an enclosing tracker's wrapper, or None (inherited from C)
    resize = cls.resize_

    def resize_reported(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        result = resize(storage, size)
        report(storage)
        return result

    cls.resize_ = resize_reported
    try:
        yield
    finally:
        if own is None:
            del cls.resize_
        else:
            cls.resize_ = own


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def freeze_imports() -> None:
    """For a process that runs one command (``python -m lowmem.train`` and the other commands): what
    its imports built lives as long as it does. Frozen (``gc.freeze``), the garbage collector and
    ``_live_tensors``' walk, once per measured phase, skip it: in ``lowmem.train`` ~255k objects,
    0.3-0.6 s a walk on a Zen 3 core. Called before the run builds anything, so that every object of
    the run (model, data, optimizer) is walked as before; tensors made at import time are not a run's.
    Not for a library call (``lowmem.prepare``): that process's objects are its owner's to collect."""
    gc.collect()
    gc.freeze()


def _live_tensors() -> list[torch.Tensor]:
    """Every tensor Python can reach (the CPU analogue of the allocator's allocated set)."""
    with warnings.catch_warnings():  # isinstance on lazy deprecated module attributes warns
        warnings.simplefilter("ignore")
        return [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]


# Objects whose references lead out of a run to the whole process (a function's globals, a module's
# namespace, a class's attributes): ``reachable_tensors`` does not follow them.
_NOT_FOLLOWED = (type, types.ModuleType, types.CodeType, types.FrameType, types.BuiltinFunctionType)


def reachable_tensors(owners: Iterable[object]) -> list[torch.Tensor]:
    """Every tensor reachable from ``owners`` through attributes, containers and closures (not
    through module globals or classes): what a run holds. A tensor's own references are not
    followed (a parameter's gradient is named by the tracker's model)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    pending = list(owners)
    while pending:
        item = pending.pop()
        if id(item) in seen or isinstance(item, _NOT_FOLLOWED):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, types.FunctionType):
            pending.extend(cell.cell_contents for cell in item.__closure__ or () if _filled(cell))
            pending.extend(item.__defaults__ or ())
        else:
            pending.extend(gc.get_referents(item))
    return found


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def track_peak(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    device: torch.device | str | None = None,
    data: Iterable[torch.Tensor] = (),
    owners: Iterable[object] | None = None,
) -> Iterator[AllocationTracker]:
    """Track the live tensor bytes of the code run inside; read ``.peak_bytes`` afterwards.
    ``data``: the data set's and minibatch's tensors (the breakdown's "data"); ``owners``: count
    only the tensors alive at the start that these objects reach (``AllocationTracker``)."""
    if device is None:
        device = next(model.parameters()).device if model is not None else torch.device("cpu")
    kind = CompiledStepTracker if model is not None and runs_compiled(model) else AllocationTracker
    with kind(device, model, optimizer, data, owners) as tracker:
        yield tracker


def runs_compiled(model: nn.Module) -> bool:
    """Whether calling ``model`` runs compiled code: compiled in place (``nn.Module.compile``) or a
    ``torch.compile`` wrapper."""
    return getattr(model, "_compiled_call_impl", None) is not None or hasattr(model, "_orig_mod")


@contextlib.contextmanager
def accounted_eagerly(model: nn.Module | None) -> Iterator[None]:
    """Inside: a compiled ``model`` runs eagerly (``torch.compiler.set_stance("force_eager")``), as the
    accounting's fake-tensor passes and FLOP counts need (their dispatch modes see every op)."""
    if model is None or not runs_compiled(model):
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


def graph_pool_bytes(device: torch.device, segments: list[dict] | None = None) -> int:
    """Bytes ``device``'s allocator holds in private pools (the CUDA graphs' pools) that no tensor
    uses: reserved for the replays for as long as the graphs live, though ``max_memory_allocated``
    never counts them. ``segments``: ``torch.cuda.memory_snapshot()`` (taken here on CUDA; 0 elsewhere)."""
    if segments is None:
        if device.type != "cuda" or not torch.cuda.is_initialized():
            return 0
        segments = torch.cuda.memory_snapshot()
    index = torch.cuda.current_device() if device.index is None and device.type == "cuda" else device.index
    return sum(
        segment["total_size"] - segment["allocated_size"]
        for segment in segments
        if tuple(segment.get("segment_pool_id") or (0, 0)) != (0, 0) and segment.get("device", index) == index
    )


def measure_peak(
    train_step: Callable[[], object],
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    data: Iterable[torch.Tensor] = (),
    owners: Iterable[object] | None = None,
    arithmetic: contextlib.AbstractContextManager | None = None,
) -> PeakMeasurement:
    """Run ``train_step`` once for real and measure its memory peak on the model's device.

    The step runs for real: it updates the weights and every other piece of training state.
    data: the data set's and the minibatch's tensors (the breakdown's "data").
    owners: the objects whose tensors are the run's (``AllocationTracker``); None: every tensor alive.
    arithmetic: a context the step runs in, e.g. a trainer's ``arithmetic()`` or
        ``lowmem.techniques.cpu_compute.compute_context`` for a 16-bit step on a CPU: its FP32
        copies are made inside the ops' kernels, scratch the CPU tracker does not see (as it does
        not see native kernels' scratch).
    """
    device = next(model.parameters()).device if model is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with arithmetic or contextlib.nullcontext(), track_peak(model, optimizer, device, data, owners) as tracker:
        train_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        pool = graph_pool_bytes(device)
        return PeakMeasurement(
            int(torch.cuda.max_memory_allocated(device)) + pool,
            {**tracker.breakdown, "graph_pool": pool},
            tracker.location,
            tracker.start_bytes,
            "cuda allocator",
        )
    source = "cpu allocator events" if isinstance(tracker, CompiledStepTracker) else "cpu tensor tracker"
    return PeakMeasurement(tracker.peak_bytes, tracker.breakdown, tracker.location, tracker.start_bytes, source)


def count_flops(run_step: Callable[[], object]) -> int:
    """FLOPs (multiply and add counted separately) of everything ``run_step`` runs: forward,
    backward and any recomputation, as ``torch.utils.flop_counter`` counts them (matrix products
    and convolutions; elementwise ops are not counted)."""
    with FlopCounterMode(display=False) as counter:
        run_step()
    return counter.get_total_flops()


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor``, without importing ``torch.distributed.tensor`` (0.6 s of a
    process's start; none exists before it is imported): ``lowmem.techniques.shards.is_sharded``,
    which this layer may not import."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)
