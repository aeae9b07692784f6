"""Activation memory by the report's definition, read off the real autograd graph of a step.

Activation bytes (SPEC §4, report §2.2.2 and Appendix B) are the maximum, over the whole forward
and backward pass, of the bytes alive in three kinds of tensors, each storage counted once:

- saved: what autograd holds for backward (saved tensors), parameters and buffers excluded. A
  tensor ReLU saves for itself counts 1 bit per element (a sign mask suffices); ops that save
  nothing (add, view, transpose) count nothing by construction. A saved view of a storage the
  step created counts the whole storage (it keeps it alive: the value chunk of a fused
  query-key-value projection holds all three); a view of data from outside the step (a
  microbatch slice of the minibatch) counts the bytes its views span.
- recomputed: what a checkpoint's backward computes again *and holds for backward*: tensors
  saved by the recomputed graph (packed while a custom ``autograd.Function``'s backward runs),
  counted exactly like the original forward's saved tensors. Recomputed tensors nothing saves
  (a BN-ReLU output fed once to a convolution's weight-gradient kernel, a block output that is
  only the root of the nested backward) are temporaries of a single computation, which the report
  does not count (Appendix B: "we also do not calculate temporary memory for intermediate
  computations"); a recomputed block output that the next block reads is saved by that block and
  so is counted.
- gradient: gradients with respect to activations (the backward activations). Appendix B: "to
  compute backward through a node [...] we need the node's inputs as well as the gradients of the
  loss with respect to the node's outputs". So a gradient counts from when a node produces it until
  the nodes it is sent to have read it (an addition sends one gradient to both branches: it waits
  for both), and moments are taken when a node starts: its incoming gradients count, the gradient
  it is computing counts from the next node on. A gradient captured by ``torch.autograd.grad``
  (a checkpoint's recomputation) waits until its storage dies. Gradients reaching parameters, or
  tensors computed from parameters alone (``weight.t()``, a cast), are optimizer memory and are
  not counted. ``held_bytes`` is also kept: the peak with every gradient counted until its storage
  dies, i.e. what this execution's autograd really held (a custom Function's ``grad_output``, for
  one, lives until its backward returns); it is higher by about one or two gradients.

How: ``saved_tensors_hooks``, active over forward *and* backward, wrap each saved tensor in a handle
whose death (``weakref.finalize``) marks its release, so recomputation inside backward is seen
like the original forward. A ``TorchDispatchMode`` sees every op: it registers hooks on the
autograd nodes of op inputs (their pre- and post-hooks report activation gradients) and counts
recomputed outputs. Lifetimes are those of the real execution: a tensor held by a Python variable
inside a custom backward stays counted until released.

A step fake tensors cannot run (shapes that depend on values, a mixture of experts' routing; an op
fake tensors refuse) is accounted the same way on real tensors (``lowmem.profiler.real_passes``).

Limits: a custom Function must save through ``ctx.save_for_backward`` (a tensor kept as a ``ctx``
attribute is invisible); non-reentrant ``torch.utils.checkpoint`` installs its own saved-tensor
hooks, which hide its tensors: use reentrant checkpointing (lowmem's, or ``use_reentrant=True``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import Node
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import flop_registry

from lowmem.profiler.real_passes import noted_fake_pass_limit, real_pass, real_pass_reason

# Autograd nodes whose own saved tensor is only needed as a sign mask (1 bit per element).
_ONE_BIT_NODES = frozenset({"ReluBackward0", "ReluBackward1"})
# Keys in an autograd node's metadata: hooks registered; output computed from model state alone.
_HOOKED = "lowmem_activation_hooks"
_FROM_STATE = "lowmem_from_model_state"
CATEGORIES = ("saved", "recomputed", "gradient")
# Attribute a saved-tensor hook sets on what it hands on in a saved tensor's place, naming its form:
# "compressed" (codes, ranges, sign masks: counted as saved, at their size, and tallied apart) or
# "offloaded" (a host copy: not activation memory on the device; tallied as host bytes).
SAVED_FORM = "_lowmem_saved_form"
# The device query C++ code sends through the dispatch modes for every fake tensor it checks (most
# of a fake pass's calls, chiefly the autograd engine's): answered at once, as the fake mode would.
_DEVICE_QUERY = torch.ops.prim.device.default
_RECOMPUTING = -1  # in the live record: a moment backward recomputes (never an allocation number)


@dataclass(frozen=True)
class ActivationTrace:
    """Activation memory of one forward + backward (bytes, the report's accounting)."""

    activation_bytes: int  # the maximum over the pass of all CATEGORIES together (the report's view)
    at_peak: dict[str, int]  # bytes per category at that moment
    held_bytes: int  # the maximum of what this execution's autograd actually kept alive
    max_saved_bytes: int  # maximum of saved + recomputed alone (the end of forward, usually)
    stored_before_backward: int  # saved bytes when backward starts: the checkpoints, with checkpointing
    peak_phase: str  # "forward" or "backward"
    peak_location: str  # last aten op (forward) or the autograd node running (backward)
    saved_tensors: int  # tensors packed by autograd (parameters and buffers not included)
    flops: int  # of everything run: forward, backward, recomputation (torch.utils.flop_counter's formulas)
    # The most bytes one forward op's new outputs take (a logits-sized softmax): the largest op
    # temporary of a step, outside the report's accounting (backward's outputs are activation and
    # weight gradients, which it counts).
    largest_op_bytes: int = 0
    # The most bytes the pass's own tensors held at once, each storage at its real size from the op
    # that made it until it died: saved and recomputed tensors (ReLU's output whole), activation
    # gradients, and every temporary of forward and backward (a loss's logits, a chunk of them in a
    # chunked loss's backward, a grouped convolution's backward scratch tensors). Weight gradients
    # (optimizer memory) and offloaded copies (host memory) are left out. What a real step holds on
    # top of the model and optimizer state, which the report's activations leave out.
    live_bytes: int = 0
    live_location: str = ""  # where ``live_bytes`` peaked: "<phase>: <op or autograd node>"
    # ``live_bytes`` of a microbatch after the first of a step: each weight gradient counts from the
    # op that makes it until it is added into the ``.grad`` the previous microbatches left (a
    # checkpointed segment's backward returns its blocks' gradients together, at its end).
    live_accumulating_bytes: int = 0
    # The most of ``live_bytes`` (``live_accumulating_bytes``) at a moment backward recomputes (a
    # checkpointed segment saves a tensor): where a run's first step checks a recomputed block.
    live_recomputing_bytes: int = 0
    live_recomputing_accumulating_bytes: int = 0
    compressed_bytes: int = 0  # of max_saved_bytes, stored compressed (SAVED_FORM), at that moment
    offloaded_bytes: int = 0  # saved tensors held in host memory instead, at most at once


def op_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of an op's arguments or results (tensors, lists and tuples of them, dicts of
    keyword arguments): ``tree_leaves`` for the structures ops take, without its per-op cost."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    found: list[torch.Tensor] = []
    for item in tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list | tuple) else ():
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, list | tuple | dict):
            found.extend(op_tensors(item))
    return found


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of the tensor's storage (shared by all its views), valid while the storage lives."""
    return tensor.untyped_storage()._cdata


def held_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the part of the tensor's storage that it spans (the whole tensor for a contiguous
    one; a microbatch slice of a minibatch counts the microbatch only). A bool tensor (a dropout
    or padding mask) counts its real storage, a byte per element: only ReLU's own saved output is
    counted at 1 bit (SPEC §4)."""
    start, end = held_range(tensor)
    return end - start


def held_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The byte range [start, end) of its storage that ``tensor`` spans (``held_bytes``)."""
    if tensor.numel() == 0:
        return 0, 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    start = tensor.storage_offset() * tensor.element_size()
    return start, min(start + span * tensor.element_size(), tensor.untyped_storage().nbytes())


def saved_by_relu_itself(tensor: torch.Tensor, mark: str) -> bool:
    """True for the ReLU node saving its own output; False for later ops saving that output.

    ReLU saves its result right after attaching its node, before any other op can see the tensor,
    so the first pack of a tensor whose ``grad_fn`` is a ReLU node is ReLU's own. ``mark``: the
    attribute this caller notes it in (each layer of saved-tensor hooks sees every pack: its own).
    """
    node = tensor.grad_fn
    if node is None or type(node).__name__ not in _ONE_BIT_NODES:
        return False
    if getattr(tensor, mark, None) == id(node):
        return False
    setattr(tensor, mark, id(node))  # an id, not the node: no reference cycle
    return True


class _Handle:
    """What autograd stores for a saved tensor while the tracer is on: a detached alias (no
    reference cycle through ``grad_fn``); its death means autograd released the tensor."""

    __slots__ = ("tensor", "offloaded", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.offloaded = 0  # an offloaded tensor's bytes, until backward fetches it back


class _Entry:
    """One counted key: its bytes, how many holders keep it, its category and, for a gradient,
    how many nodes it is still waiting for and how many running nodes are reading it."""

    __slots__ = ("nbytes", "holders", "category", "waiting", "readers", "start", "end", "form")

    def __init__(self, nbytes: int, category: str, start: int = 0, form: str | None = None) -> None:
        self.nbytes, self.holders, self.category, self.form = nbytes, 1, category, form
        self.start, self.end = start, start + nbytes  # the byte range of the storage seen in views
        self.waiting = self.readers = 0

    @property
    def needed(self) -> bool:
        """Whether the report's node-by-node view counts this entry now (forward tensors: always,
        while held; gradients: while waiting for, or being read by, a node)."""
        return self.category != "gradient" or self.waiting > 0 or self.readers > 0


class _Ledger:
    """Live bytes per category, in two views, with the maximum of each over the pass.

    Each key (a storage, or one ReLU mask) counts once, in the category it first entered with and
    with the widest view of it seen, until its last holder releases it (its storage dies). That is
    the *held* view: what this execution's autograd keeps alive. The *needed* view, the report's
    definition, counts a gradient only from when a node produces it until the nodes it is sent to
    have read it (while one of them runs), and is evaluated when a node starts: a node's incoming
    gradients count, the one it is computing counts from the next node on (Appendix B: backprop
    through a node needs its inputs and the gradients w.r.t. its outputs).
    """

    def __init__(self, location: Callable[[], tuple[str, str]]) -> None:
        self.entries: dict[int, _Entry] = {}
        self.held = dict.fromkeys(CATEGORIES, 0)
        self.needed = dict.fromkeys(CATEGORIES, 0)
        self.peak_needed = self.peak_held = self.peak_stored = 0
        self.at_peak = dict(self.needed)
        self.peak_phase = self.peak_location = ""
        self.stored_before_backward: int | None = None
        self.compressed = self.compressed_at_stored_peak = 0  # live; when saved + recomputed peaked
        self._location = location

    def _note_backward_start(self) -> None:
        if self.stored_before_backward is None and torch._C._current_autograd_node() is not None:
            self.stored_before_backward = self.held["saved"] + self.held["recomputed"]

    def _recount(self, entry: _Entry, change) -> None:
        """Apply ``change`` to ``entry``, keeping the needed view's sums right."""
        before = entry.needed
        change(entry)
        if entry.needed != before:
            self.needed[entry.category] += entry.nbytes if entry.needed else -entry.nbytes

    def acquire(self, key: int, nbytes: int, category: str, start: int = 0, form: str | None = None) -> None:
        """Count ``nbytes`` from byte ``start`` of storage ``key`` (views of one storage, e.g. the
        query, key and value chunks of one projection, count the range they cover together);
        ``form``: "compressed" for a compressed saved tensor's parts (``SAVED_FORM``)."""
        self._note_backward_start()
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _Entry(nbytes, category, start, form)
            self.held[category] += nbytes
            if form == "compressed":
                self.compressed += nbytes
            if entry.needed:
                self.needed[category] += nbytes
        else:
            entry.holders += 1
            low, high = min(entry.start, start), max(entry.end, start + nbytes)
            if high - low <= entry.nbytes:
                return
            # Another part of a storage already held: the storage counts the range its views cover.
            self.held[entry.category] += high - low - entry.nbytes
            if entry.needed:
                self.needed[entry.category] += high - low - entry.nbytes
            entry.nbytes, entry.start, entry.end = high - low, low, high
        if self.held["saved"] + self.held["recomputed"] > self.peak_stored:
            self.peak_stored = self.held["saved"] + self.held["recomputed"]
            self.compressed_at_stored_peak = self.compressed
        self.peak_held = max(self.peak_held, sum(self.held.values()))
        if category != "gradient":  # gradients are evaluated when the node reading them starts
            self.evaluate()

    def release(self, key: int) -> None:
        self._note_backward_start()
        entry = self.entries[key]
        entry.holders -= 1
        if entry.holders == 0:
            del self.entries[key]
            self.held[entry.category] -= entry.nbytes
            if entry.form == "compressed":
                self.compressed -= entry.nbytes
            if entry.needed:
                self.needed[entry.category] -= entry.nbytes

    def sent(self, key: int, nodes: int) -> None:
        """The gradient under ``key`` was produced for ``nodes`` nodes (at least that many wait)."""
        entry = self.entries.get(key)
        if entry is not None:
            self._recount(entry, lambda e: setattr(e, "waiting", max(e.waiting, nodes)))

    def reading(self, key: int) -> None:
        """A node starts and reads the gradient under ``key``."""
        entry = self.entries.get(key)
        if entry is not None:
            def start(e: _Entry) -> None:
                e.waiting, e.readers = max(0, e.waiting - 1), e.readers + 1

            self._recount(entry, start)

    def read(self, key: int) -> None:
        """A node that read the gradient under ``key`` is done."""
        entry = self.entries.get(key)
        if entry is not None:
            self._recount(entry, lambda e: setattr(e, "readers", max(0, e.readers - 1)))

    def evaluate(self) -> None:
        """A moment of the report's node-by-node view: keep it if it is the maximum so far."""
        total = sum(self.needed.values())
        if total > self.peak_needed:
            self.peak_needed, self.at_peak = total, dict(self.needed)
            self.peak_phase, self.peak_location = self._location()


class ActivationTracer(TorchDispatchMode):
    """Context manager that accounts the activation memory of the autograd work run inside it.

    exclude: tensors whose storages are model state, not activations (parameters, buffers, masks).
    Read ``trace`` after the context exits.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.ledger = _Ledger(self._location)
        self.excluded = {storage_key(t) for t in exclude}
        # Storages computed from model state alone (parameter views, casts): gradients reaching
        # them are weight gradients. Grows during the step; entries leave when their storage dies.
        self.from_state = set(self.excluded)
        # Storages created by the step's own ops (not the inputs' or the data's): a saved view of
        # one holds the whole storage (the value chunk of a fused query-key-value projection keeps
        # all three alive), while a view of pre-existing data counts only its span (a microbatch
        # slice of the minibatch).
        self.created: set[int] = set()
        self.saved_tensors = 0
        self.flops = 0
        self.largest_op_bytes = 0
        self.host_live = self.host_peak = 0  # bytes of saved tensors offloaded to host memory
        self._mask_keys = itertools.count(-1, -1)  # negative: never a storage key
        self._last_op = ""
        self._hooks = contextlib.ExitStack()
        # Every storage the pass creates, in order: (allocation number, +bytes at its creation with
        # where, or -bytes at its death). Weight gradients are known only once they reach ``.grad``
        # (at the end), so the live peak is read off this record then, leaving them out.
        self._state = [t for t in exclude if isinstance(t, torch.Tensor)]
        self._events: list[tuple[int, int, tuple[str, str] | None]] = []
        self._allocation_of: dict[int, int] = {}  # live storage key -> its allocation number
        self._allocations = itertools.count()
        self._not_live: set[int] = set()  # allocation numbers left out: offloaded copies
        self._gradients: set[int] = set()  # allocation numbers of weight gradients (known at the end)
        self._closed: tuple[int, str, int, int, int] | None = None  # ``_live_peaks``, once the pass is over
        self._finalizers: list[weakref.finalize] = []  # of the live record's storages, detached at the end

    # --- saved tensors --------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Handle:
        key = storage_key(tensor)
        if key in self.excluded:
            return tensor.detach()  # model memory; detached like every packed tensor (no cycle)
        self.saved_tensors += 1
        handle = _Handle(tensor.detach())
        form = getattr(tensor, SAVED_FORM, None)
        if form == "offloaded":  # in host memory until backward fetches it: not on the device
            number = self._number_of(tensor)
            if number is not None:
                self._not_live.add(number)
            nbytes = tensor.untyped_storage().nbytes()
            self.host_live += nbytes
            self.host_peak = max(self.host_peak, self.host_live)
            handle.offloaded = nbytes
            weakref.finalize(handle, self._host_released, nbytes)
            return handle
        if saved_by_relu_itself(tensor, "_lowmem_relu_node"):
            key, nbytes = next(self._mask_keys), math.ceil(tensor.numel() / 8)
            start = 0
        elif key in self.created:
            start, nbytes = 0, tensor.untyped_storage().nbytes()
        else:
            start, end = held_range(tensor)
            nbytes = end - start
        # Saved while a custom Function's backward runs: a checkpoint's recomputed graph.
        recomputing = isinstance(torch._C._current_autograd_node(), BackwardCFunction)
        if recomputing and self._closed is None:
            self._events.append((_RECOMPUTING, 0, None))
        weakref.finalize(handle, self.ledger.release, key)
        self.ledger.acquire(key, nbytes, "recomputed" if recomputing else "saved", start, form)
        return handle

    def _host_released(self, nbytes: int) -> None:
        self.host_live -= nbytes

    def _unpack(self, packed: torch.Tensor | _Handle) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed
        if packed.offloaded:  # fetched back: on the device again until autograd releases it
            key = next(self._mask_keys)
            weakref.finalize(packed, self.ledger.release, key)
            self.ledger.acquire(key, packed.offloaded, "saved", 0, "offloaded")
            packed.offloaded = 0
        return packed.tensor

    # --- every op: gradient hooks, model-state tracking, recomputation ------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY:  # reads no data, makes no tensor: a fake tensor answers itself
            return args[0].device if isinstance(args[0], FakeTensor) else func(*args)
        kwargs = kwargs or {}
        inputs = op_tensors((args, kwargs))
        for tensor in inputs:
            if tensor.grad_fn is not None:
                self._hook_node(tensor.grad_fn, tensor)
        out = func(*args, **kwargs)
        # FLOPs here rather than in a FlopCounterMode, whose module tracker holds tensors (it would
        # lengthen lifetimes) and would cost a second pass.
        count_flops = flop_registry.get(func.overloadpacket)
        if count_flops is not None:
            self.flops += count_flops(*args, **kwargs, out_val=out)
        outputs = op_tensors(out)
        if not outputs or func is torch.ops.aten.detach.default:  # the pack hook's own detach
            return out
        # A new storage: not a view (of an input, or of real data a fake pass converted) nor in place.
        aliases = any(r.alias_info is not None for r in func._schema.returns)
        input_keys = {storage_key(t) for t in inputs}
        new_bytes = 0
        self._last_op = func.overloadpacket.__name__
        for tensor in [] if aliases else outputs:
            key = storage_key(tensor)
            if key not in input_keys and key not in self.created:
                self.created.add(key)
                nbytes = tensor.untyped_storage().nbytes()
                new_bytes += nbytes
                weakref.finalize(tensor.untyped_storage(), self.created.discard, key)
                self._allocated(tensor.untyped_storage(), key, nbytes)
        state_inputs = [t for t in inputs if storage_key(t) in self.from_state]
        # Forward ops on activations only: a compact layer's dense weight, built from model state,
        # is a temporary of its own (lowmem.profiler.step_temporaries).
        if torch._C._current_autograd_node() is None and len(state_inputs) < len(inputs):
            self.largest_op_bytes = max(self.largest_op_bytes, new_bytes)
        if inputs and len(state_inputs) == len(inputs):
            for tensor in outputs:
                self._mark_from_state(tensor)
        elif isinstance(torch._C._current_autograd_node(), BackwardCFunction) and any(
            self._category(t) == "gradient" for t in inputs
        ):
            # A custom Function's backward computing on activation gradients (the conv backward's,
            # a sum of branch gradients): its outputs are activation gradients, except an output
            # shaped like one of the op's model-state inputs, that input's gradient (optimizer
            # memory). Its other outputs are recomputation, counted when autograd saves them.
            state_shapes = {t.shape for t in state_inputs}
            for tensor in outputs:
                if tensor.is_floating_point() and tensor.shape not in state_shapes:
                    key = self._track_storage(tensor, "gradient")
                    if key is not None:
                        self.ledger.sent(key, 1)  # for the next op of this backward
        return out

    # --- the live record: every storage the pass creates -------------------------------------------
    def _allocated(self, storage: torch.UntypedStorage, key: int, nbytes: int) -> None:
        if self._closed is not None:
            return
        number = next(self._allocations)
        self._allocation_of[key] = number
        self._events.append((number, nbytes, self._location()))
        self._finalizers.append(weakref.finalize(storage, self._freed, key, number, nbytes))

    def _freed(self, key: int, number: int, nbytes: int) -> None:
        if self._closed is not None:
            return
        if self._allocation_of.get(key) == number:
            del self._allocation_of[key]
        self._events.append((number, -nbytes, None))

    def _number_of(self, tensor: torch.Tensor) -> int | None:
        return self._allocation_of.get(storage_key(tensor))

    def _accumulated(self, parameter: torch.Tensor) -> None:
        """A weight gradient reached ``parameter.grad``: with an earlier microbatch's there, it would
        have been added into it and freed now."""
        if parameter.grad is None:  # (a hook of the model's took it: nothing is held)
            return
        number = self._number_of(parameter.grad)
        if number is not None and self._closed is None:
            self._events.append((number, 0, None))

    def _live_peaks(self) -> tuple[int, str, int, int, int]:
        """The live record's peak (bytes) and where, weight gradients left out; its peak with each
        weight gradient counted until it was accumulated (``live_accumulating_bytes``); both at the
        moments backward recomputes (``live_recomputing_bytes``, ``..._accumulating_bytes``)."""
        if self._closed is not None:
            return self._closed
        live = peak = accumulating = accumulating_peak = recomputing = recomputing_accumulating = 0
        where = ("", "")
        made: dict[int, int] = {}  # weight gradients counted in ``accumulating``, by allocation number
        for number, change, location in self._events:
            if number == _RECOMPUTING:
                recomputing = max(recomputing, live)
                recomputing_accumulating = max(recomputing_accumulating, live + accumulating)
                continue
            if number in self._not_live:
                continue
            if number in self._gradients:
                if change > 0:
                    made[number] = change
                    accumulating += change
                elif number in made:  # accumulated (a marker) or freed first: no longer held
                    accumulating -= made.pop(number)
                accumulating_peak = max(accumulating_peak, live + accumulating)
                continue
            live += change
            accumulating_peak = max(accumulating_peak, live + accumulating)
            if live > peak:
                peak, where = live, location
        where_text = f"{where[0]}: {where[1]}" if peak else ""
        return peak, where_text, accumulating_peak, recomputing, recomputing_accumulating

    def _close_live_record(self) -> None:
        # A weight gradient reaching ``.grad`` is optimizer memory (counted whole from the start).
        for tensor in self._state:
            number = None if tensor.grad is None else self._number_of(tensor.grad)
            if number is not None:
                self._gradients.add(number)
        self._closed = self._live_peaks()
        self._events.clear()
        self._allocation_of.clear()
        # The finalizers of storages still alive (weight gradients in ``.grad``, what the caller
        # keeps) would hold this tracer, and through ``_state`` the model, for as long as they live.
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()
        self._state = []

    def _track_storage(self, tensor: torch.Tensor, category: str) -> int | None:
        """Count ``tensor``'s storage (once) in ``category`` until the storage dies; its key
        (None for model state)."""
        key = storage_key(tensor)
        if key in self.from_state:
            return None
        if key not in self.ledger.entries:
            weakref.finalize(tensor.untyped_storage(), self.ledger.release, key)
            self.ledger.acquire(key, held_bytes(tensor), category)
        return key

    def _category(self, tensor: torch.Tensor) -> str | None:
        entry = self.ledger.entries.get(storage_key(tensor))
        return None if entry is None else entry.category

    def _mark_from_state(self, tensor: torch.Tensor) -> None:
        key = storage_key(tensor)
        if key not in self.from_state:
            self.from_state.add(key)
            weakref.finalize(tensor.untyped_storage(), self.from_state.discard, key)

    def _hook_node(self, node: Node, output: torch.Tensor) -> None:
        """Register the gradient hooks on ``node``, whose ``output`` an op is now reading."""
        metadata = node.metadata
        if _HOOKED in metadata:
            return
        metadata[_HOOKED] = True
        metadata[_FROM_STATE] = storage_key(output) in self.from_state
        # Which inputs of the node are activations (their gradients are backward activations).
        # Computed now so that the hooks hold no reference to the node (that would be a cycle).
        is_activation = tuple(
            next_node is not None and not self._outputs_model_state(next_node)
            for next_node, _ in node.next_functions
        )
        track, ledger = self._track_storage, self.ledger
        reads = not metadata[_FROM_STATE]  # a node on model state alone computes weight gradients

        def gradient_keys(grads) -> list[int]:
            return [key for grad in grads if grad is not None and (key := track(grad, "gradient")) is not None]

        def before(grad_outputs):
            for key in gradient_keys(grad_outputs):
                ledger.reading(key)
            ledger.evaluate()

        def after(grad_inputs, grad_outputs):
            if reads:
                for key in gradient_keys(grad_outputs):
                    ledger.read(key)
            # A gradient sent to several nodes (an addition's, to both branches) waits for each.
            sent = [g for g, activation in zip(grad_inputs, is_activation, strict=False) if activation]
            for key, nodes in Counter(gradient_keys(sent)).items():
                ledger.sent(key, nodes)

        if reads:
            node.register_prehook(before)
        node.register_hook(after)

    def _outputs_model_state(self, node: Node) -> bool:
        """True if the gradient ``node`` receives is a weight gradient: ``node`` accumulates into
        model state, or its output was computed from model state alone (``weight.t()``, a cast)."""
        if type(node).__name__ == "AccumulateGrad":
            return storage_key(node.variable) in self.from_state
        return node.metadata.get(_FROM_STATE, False)

    def _location(self) -> tuple[str, str]:
        node = torch._C._current_autograd_node()
        if node is not None:
            return "backward", node.name()
        return "forward", self._last_op

    # --- context --------------------------------------------------------------------------------
    def __enter__(self) -> ActivationTracer:
        self._hooks.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
        for tensor in self._state:
            if tensor.requires_grad and tensor.is_leaf:
                self._hooks.callback(tensor.register_post_accumulate_grad_hook(self._accumulated).remove)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._hooks.close()
        self._close_live_record()

    @property
    def trace(self) -> ActivationTrace:
        ledger = self.ledger
        live, where, accumulating, recomputing, recomputing_accumulating = self._live_peaks()
        return ActivationTrace(
            activation_bytes=ledger.peak_needed,
            at_peak=dict(ledger.at_peak),
            held_bytes=ledger.peak_held,
            max_saved_bytes=ledger.peak_stored,
            stored_before_backward=ledger.stored_before_backward or 0,
            peak_phase=ledger.peak_phase,
            peak_location=ledger.peak_location,
            saved_tensors=self.saved_tensors,
            flops=self.flops,
            largest_op_bytes=self.largest_op_bytes,
            live_bytes=live,
            live_location=where,
            live_accumulating_bytes=accumulating,
            live_recomputing_bytes=recomputing,
            live_recomputing_accumulating_bytes=recomputing_accumulating,
            compressed_bytes=ledger.compressed_at_stored_peak,
            offloaded_bytes=self.host_peak,
        )


# --- running a step without computing ---------------------------------------------------------
#
# The fake pass always runs on CPU stand-ins, whatever device the model trains on. The accounting
# is the report's definition, a property of the configuration rather than of a device's kernels;
# computed on the training device's own fake tensors it came out at about half the CPU figure on
# an H100 (223.8 against 404.8 MB for WRN-28-2, 2026-11-23), which fake CUDA tensors on a machine
# without a GPU do not reproduce. CPU stand-ins give every device the same figure.


def _is_cpu_fake(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, FakeTensor) and tensor.device.type == "cpu"


def cpu_fake(mode: FakeTensorMode, tensor: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor of ``mode`` standing for ``tensor`` (same shape, strides and dtype).

    A real CPU tensor goes through ``mode.from_tensor`` (views of one storage stay views of one
    fake storage); a tensor on any other device gets a fresh CPU stand-in of its own.
    """
    if isinstance(tensor, FakeTensor) and tensor.fake_mode is mode and tensor.device.type == "cpu":
        return tensor
    if tensor.device.type == "cpu" and not isinstance(tensor, FakeTensor):
        return mode.from_tensor(tensor)
    with mode:
        fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
    return fake.requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else fake


class _OnCpuStandIns(TorchDispatchMode):
    """Hands the fake mode below it CPU stand-ins for the real tensors an op reads (the step's
    inputs, a loss scale, ...), once per tensor: the whole fake pass runs on CPU."""

    def __init__(self, mode: FakeTensorMode) -> None:
        super().__init__()
        self.mode = mode
        self.stand_ins: dict[int, torch.Tensor] = {}
        self._finalizers: list[weakref.finalize] = []

    def convert(self, tensor: torch.Tensor) -> torch.Tensor:
        if _is_cpu_fake(tensor):
            return tensor
        key = id(tensor)
        if key not in self.stand_ins:
            self.stand_ins[key] = cpu_fake(self.mode, tensor)
            self._finalizers.append(weakref.finalize(tensor, self.stand_ins.pop, key, None))  # id reuse
        return self.stand_ins[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY:
            return func(*args)
        kwargs = kwargs or {}
        if not all(_is_cpu_fake(t) for t in op_tensors((args, kwargs))):
            args, kwargs = tree_map_only(torch.Tensor, self.convert, (args, kwargs))
        return func(*args, **kwargs)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for finalizer in self._finalizers:  # the real tensors outlive the pass; its stand-ins need not
            finalizer.detach()
        self._finalizers.clear()
        self.stand_ins.clear()


@contextlib.contextmanager
def fake_model(model: nn.Module, mode: FakeTensorMode) -> Iterator[None]:
    """Swap ``model``'s parameters and buffers for fake CPU tensors of ``mode`` (same shapes,
    dtypes, no data), restoring the real ones on exit. Tied parameters stay tied."""
    originals: list[tuple[dict, str, torch.Tensor]] = []
    fakes: dict[int, torch.Tensor] = {}
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in list(table.items()):
                    if tensor is None:
                        continue
                    if id(tensor) not in fakes:
                        fake = cpu_fake(mode, tensor.detach() if isinstance(tensor, nn.Parameter) else tensor)
                        if isinstance(tensor, nn.Parameter):
                            fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
                        fakes[id(tensor)] = fake
                    originals.append((table, name, tensor))
                    table[name] = fakes[id(tensor)]
        yield
    finally:
        for table, name, tensor in originals:
            table[name] = tensor


@contextlib.contextmanager
def maybe_fake(model: nn.Module | None, fake: bool) -> Iterator[FakeTensorMode | None]:
    """Run the body on fake CPU tensors (shapes and dtypes, no data, no compute) when ``fake``;
    yields the mode (None when not ``fake``).

    ``model``'s parameters and buffers are swapped for fake ones; other tensors the body reads
    stay real and are replaced on use by CPU stand-ins.
    """
    if not fake:
        yield None
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with contextlib.ExitStack() as stack:
        # An op fake tensors refuse raises (``lowmem.profiler.real_passes`` sorts it out); torch's
        # own traceback of it in the log is noise.
        stack.enter_context(quieted(logging.getLogger("torch._subclasses.fake_tensor")))
        if model is not None:
            stack.enter_context(fake_model(model, mode))
        stack.enter_context(mode)
        stack.enter_context(_OnCpuStandIns(mode))
        yield mode


@contextlib.contextmanager
def quieted(logger: logging.Logger, level: int = logging.CRITICAL) -> Iterator[None]:
    """``logger``'s records below ``level`` left out of the log inside (default: its errors too)."""
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def model_state(model: nn.Module | None) -> list[torch.Tensor]:
    """The model's parameters and buffers (model memory, never activations)."""
    return [] if model is None else [*model.parameters(), *model.buffers()]


def account_activations(
    run_step: Callable[..., object],
    model: nn.Module | None = None,
    *,
    fake: bool = True,
    inputs: Any = None,
) -> ActivationTrace:
    """Activation memory (and FLOPs) of ``run_step``: forward + backward of one microbatch, or of
    several microbatches run one after another (the maximum over time is then one microbatch's).

    model: its parameters and buffers are not activations; with ``fake`` they are swapped for fake
        CPU tensors, so the step runs without computing (about a second for WRN-28-2, whose FP16
        CPU convolutions would take ~20 s), and gives the same figure for a model on any device.
        A step fake tensors cannot run (shapes that depend on values: a mixture of experts'
        routing, ``.item()``; an op fake tensors refuse) runs on real tensors instead, with the
        model's training state kept (``lowmem.profiler.real_passes``); ``fake=False`` asks for that
        from the start, without keeping the state.
    inputs: when given, ``run_step(inputs)`` is called with the tensors of ``inputs`` (any nesting
        of lists, tuples and dicts) as fake CPU tensors, so that device-dependent choices inside the
        step (autocast's device, say) follow the fake pass; else ``run_step()``.
    """
    if fake and model is not None:
        reason = real_pass_reason(model)
        if reason is None:
            try:
                return _accounted(run_step, model, True, inputs)
            except Exception as error:  # noqa: BLE001 - sorted below: fake tensors' limit, or the step's error
                reason = noted_fake_pass_limit(error, model)
                if reason is None:
                    raise
        return real_pass(model, lambda: _accounted(run_step, model, False, inputs), reason)
    return _accounted(run_step, model, fake, inputs)


def _accounted(run_step: Callable[..., object], model: nn.Module | None, fake: bool, inputs: Any) -> ActivationTrace:
    with maybe_fake(model, fake) as mode:
        if inputs is not None and mode is not None:
            inputs = tree_map_only(torch.Tensor, functools.partial(cpu_fake, mode), inputs)
        tracer = ActivationTracer(exclude=model_state(model))
        with tracer:
            run_step() if inputs is None else run_step(inputs)
    return tracer.trace
