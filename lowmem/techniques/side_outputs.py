"""Tensors that leave a checkpointed block other than by its return value: found, and kept in the graph.

A checkpointed block's first forward runs without autograd's graph (inside a custom
``autograd.Function``), and only what it returns is connected to the graph. Whatever else the
block lets out — a tensor a forward hook appends to a list the caller holds (transformers' output
recorders: the router logits of a mixture of experts, attention maps), one a module stores on
itself, a hooked feature for a distillation loss — would be a tensor without a graph, and any loss
computed from it would silently lose its gradient.

The design (chosen over running the first forward with its graph and dropping what autograd saves,
as ``torch.utils.checkpoint``'s non-reentrant mode does, which would give up lowmem's per-block
recomputations, BatchNorm-statistics reuse and exact accounting):

1. ``ForwardWatch`` (a ``TorchFunctionMode``, a few microseconds per call) sees every torch
   function the block's forward calls. It numbers each tensor they return (the *op index*) and
   follows, as autograd would, which of them would require a gradient: a floating-point result of
   a differentiable function any of whose tensor arguments requires one (a parameter, the block's
   input, a context tensor) or was so marked. It keeps weak references only.
2. After the forward, the marked tensors still alive that the block did not return are its *side
   outputs* (``escaped``). They are returned by the autograd Function as extra outputs, which
   autograd connects to the graph in place: the very objects the hook or the module holds get the
   checkpointed node as their ``grad_fn``.
3. The recomputation in backward runs under ``RecomputeCollect``, which numbers op results the
   same way and picks the tensors at the side outputs' op indices (the same ops, in the same order,
   as the self-check demands of the block's output). Their gradient edges join the block output's,
   so one backward of the recomputed graph carries every gradient. The collected tensors are
   checked against the forward's shapes and dtypes; a recomputation that takes another path stops
   the step with a one-line error naming the block.

lowmem's own fused BatchNorm-ReLU-conv paths compute one thing by different ops in forward and in
recomputation (kept batch statistics, C kernels): ``one_op`` counts each as a single op.

A block that writes a value needing a gradient into a tensor it did not create (an in-place op on
a buffer, ``self.ema.add_(x)``) is refused in one line: the tensor's history before the block
cannot be kept. Hooks run again when the block is recomputed, as under ``torch.utils.checkpoint``:
a hook that appends to a list appends again during backward (transformers' recorders do not: they
collect only inside the model's forward).

One limit of following autograd from outside it: the first forward already runs without grad, so
a tensor a block computes under its own ``torch.no_grad()`` from one that requires a gradient and
then stores is taken for a side output (it comes back requiring grad, with a zero or unused
gradient); ``.detach()`` marks it as autograd would.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Functions whose results never require grad, whatever their arguments: autograd gives them no
# history (and ``Tensor.data``, a property).
_NON_DIFFERENTIABLE = frozenset(
    {
        "detach",
        "detach_",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
        "new_tensor",
    }
)
_DATA = torch.Tensor.data
# Functions that return their argument itself when there is nothing to do (not a write).
_MAY_RETURN_AN_ARGUMENT = frozenset(
    {"to", "contiguous", "type", "type_as", "float", "double", "half", "bfloat16", "cpu", "cuda", "requires_grad_"}
)


def _differentiable(func: Callable) -> bool:
    return getattr(func, "__name__", None) not in _NON_DIFFERENTIABLE and getattr(func, "__self__", None) is not _DATA


def _tensor_arguments(args: tuple, kwargs: dict) -> Iterable[torch.Tensor]:
    """The tensors among a call's arguments (one level of lists: ``cat``'s, ``stack``'s)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (item for item in value if isinstance(item, torch.Tensor))


def _tensor_results(out: Any) -> list[torch.Tensor]:
    results = out if isinstance(out, (tuple, list)) else (out,)
    return [r for r in results if isinstance(r, torch.Tensor)]


class _Numbering(TorchFunctionMode):
    """Numbers every tensor the torch functions called under it return (``observe``), except inside
    ``one_op``. Torch functions, not aten ops: the calls are the block's own, the same with grad
    mode on or off (autograd adds aten ops of its own below them: the detaches and clones of the
    tensors it saves)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = 0

    def __enter__(self) -> _Numbering:
        _active().append(self)  # as torch's mode stack: per thread
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        _active().remove(self)
        super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            self.observe(func, args, kwargs, out)
        return out

    def observe(self, func: Callable | None, args: tuple, kwargs: dict, out: Any) -> None:
        raise NotImplementedError


_THREAD = threading.local()


def _active() -> list[_Numbering]:
    """This thread's numbering modes, innermost last."""
    if not hasattr(_THREAD, "modes"):
        _THREAD.modes = []
    return _THREAD.modes


def one_op(compute: Callable[[], Any], *inputs: torch.Tensor) -> Any:
    """``compute()``, which lowmem computes by other ops in forward and in recomputation (the fused
    BatchNorm-ReLU-conv paths), numbered as one op of ``inputs`` by the watch around it, if any."""
    watching = _active()[-1] if _active() else None
    if watching is None:
        return compute()
    watching.paused += 1
    try:
        out = compute()
    finally:
        watching.paused -= 1
    watching.observe(None, inputs, {}, out)
    return out


class SideOutputRefused(ValueError):
    """A checkpointed block lets a tensor out in a way recomputation cannot keep in the graph."""


class ForwardWatch(_Numbering):
    """Watches a checkpointed block's forward without autograd (see the module docstring)."""

    def __init__(self, marked: dict[int, weakref.ref] | None = None) -> None:
        """``marked``: shared with the watches of the blocks before this one in one forward without
        autograd (a segment), whose output this block reads: id -> tensor that would require grad."""
        super().__init__()
        self.marked = {} if marked is None else marked
        self.created: dict[int, tuple[int, weakref.ref]] = {}  # id -> (op index, marked tensor an op created)
        self.written: list[tuple[str, weakref.ref]] = []  # (op, tensor from outside marked in place)
        self.born: dict[int, tuple[int, weakref.ref]] = {}  # id -> (op index, any tensor a call made)

    def _requires_grad(self, tensor: torch.Tensor) -> bool:
        if tensor.requires_grad:
            return True
        ref = self.marked.get(id(tensor))
        return ref is not None and ref() is tensor

    def observe(self, func: Callable | None, args: tuple, kwargs: dict, out: Any) -> None:
        results = _tensor_results(out)
        start, self.count = self.count, self.count + len(results)
        name = getattr(func, "__name__", "")
        if func is torch.Tensor.__setitem__:  # x[i] = value: x written in place, returns None
            results = [args[0]]
        inputs = list(_tensor_arguments(args, kwargs))
        for offset, result in enumerate(results):
            if not any(result is t for t in inputs):
                self.born[id(result)] = (start + offset, weakref.ref(result))
        if not results or (func is not None and not _differentiable(func)):
            return
        if not any(self._requires_grad(t) for t in inputs):
            return
        for offset, result in enumerate(results):
            if not (result.is_floating_point() or result.is_complex()) or self._requires_grad(result):
                continue
            if any(result is t for t in inputs):
                if name in _MAY_RETURN_AN_ARGUMENT:  # x.to(x.dtype): nothing new
                    continue
                born = self.born.get(id(result))  # written in place: a tensor the block made, or not
                if born is None or born[1]() is not result:
                    self.written.append((name or "an in-place op", weakref.ref(result)))
                    continue
                index = born[0]
            else:
                index = start + offset
            self.created[id(result)] = (index, weakref.ref(result))
            self.marked[id(result)] = weakref.ref(result)

    def escaped(
        self, returned: Sequence[torch.Tensor], kept: Sequence[torch.Tensor] = ()
    ) -> list[tuple[int, torch.Tensor]]:
        """The side outputs, in op order: (op index, tensor) of each marked tensor an op created that
        is still alive and is not one of ``returned`` (the block's output tensors) nor ``kept`` (what
        lowmem's own recomputation keeps: batch statistics), nor alive only as the base of a view.
        Raises ``SideOutputRefused`` for a tensor from outside the block written in place."""
        for op, ref in self.written:
            tensor = ref()
            if tensor is not None:
                raise SideOutputRefused(
                    f"writes a value that needs a gradient into a tensor it did not create ({op} on a "
                    f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} tensor), whose history before "
                    "the block recomputation cannot keep; write a detached value (x.detach())"
                )
        known = {id(t) for t in (*returned, *kept)}
        alive = sorted((index, ref) for index, ref in self.created.values() if ref() is not None)
        alive = [(index, ref) for index, ref in alive if id(ref()) not in known]
        # A view keeps its base's Python object alive (PyObject preservation) with one reference
        # of its own: a base of a returned tensor or of a side output is stored only if Python
        # references it besides.
        bases = {id(t._base) for t in returned if t._base is not None}
        bases.update(id(ref()._base) for _, ref in alive if ref()._base is not None)
        found = [(index, ref) for index, ref in alive if id(ref()) not in bases or _referenced_besides_views(ref)]
        return [(index, ref()) for index, ref in found]


def _referenced_besides_views(ref: weakref.ref) -> bool:
    """Whether Python holds the tensor ``ref`` points to besides the one reference its views keep
    (``getrefcount`` counts that one, and its own argument)."""
    return sys.getrefcount(ref()) > 2


class SideOutputMismatch(RuntimeError):
    """A recomputation did not produce a side output where its forward did (another path)."""


class RecomputeCollect(_Numbering):
    """Numbers a block's recomputation as ``ForwardWatch`` numbered its forward and keeps the tensors
    at ``indices`` (the side outputs' op indices)."""

    def __init__(self, indices: Sequence[int]) -> None:
        super().__init__()
        self.wanted = set(indices)
        self.found: dict[int, torch.Tensor] = {}
        self._hooks: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> RecomputeCollect:
        # The saved-tensor hooks in force (lowmem's accounting and compression, a user's) run when
        # the recomputation saves tensors for backward, which the forward without autograd never
        # did: whatever torch functions they call are not the block's, and are not numbered.
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if hooks is not None:
            pack, unpack = hooks
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._unnumbered(pack), unpack)
            self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None

    def _unnumbered(self, pack: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
        def packed(tensor: torch.Tensor) -> Any:
            self.paused += 1
            try:
                return pack(tensor)
            finally:
                self.paused -= 1

        return packed

    def observe(self, func: Callable | None, args: tuple, kwargs: dict, out: Any) -> None:
        results = _tensor_results(out)
        for offset, result in enumerate(results):
            if self.count + offset in self.wanted:
                self.found[self.count + offset] = result
        self.count += len(results)

    def collected(self, indices: Sequence[int], layout: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list:
        """The tensors at ``indices``, each checked against the forward's (shape, dtype): raises
        ``SideOutputMismatch`` where the recomputation took another path."""
        tensors = []
        for index, (shape, dtype) in zip(indices, layout, strict=True):
            tensor = self.found.pop(index, None)
            if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                got = "nothing" if tensor is None else f"a {list(tensor.shape)} {tensor.dtype} tensor"
                raise SideOutputMismatch(
                    f"the tensor it let out in forward (result {index} of its ops, {list(shape)} {dtype}) is {got} in "
                    "its recomputation"
                )
            tensors.append(tensor)
        return tensors


def layout_of(tensors: Iterable[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]
