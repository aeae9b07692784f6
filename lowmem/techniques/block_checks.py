"""Checks that make a checkpointed block's recomputation trustworthy (``lowmem.techniques.chains``).

Recomputation is correct only if running a block again gives what its forward gave. Two things
break that without any error from autograd: a block whose forward depends on state outside its
inputs (a counter, a cache it appends to), and a block that changes an object passed into it (a
key/value cache, whose second append in recomputation doubles the keys). So, once per block and
input shape:

- ``OutputFingerprint``: a cheap summary of the forward's output tensors, computed in forward,
  compared with the recomputed output. Keeping the output itself would cost the very memory
  checkpointing saves; the fingerprint is a few numbers, computed in chunks of
  ``_CHUNK`` elements so its temporaries stay small.
- ``argument_state``: a bounded snapshot of what a block could change in its non-tensor
  arguments (their attributes, containers, and the identity, shape and version of the tensors in
  them), taken before and after the block's forward.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

_CHUNK = 1 << 16  # elements hashed at a time: the hash's temporaries are a few hundred KB
_HASH_MULTIPLIER = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio constant as a signed int64
# Recomputation that may legitimately differ in rounding (CUDA without trainer.deterministic:
# atomics, algorithm choice) must agree with forward to this relative tolerance, in the sum and the
# absolute sum of every output tensor (float64 accumulation). A recomputation that computes
# something else (doubled keys, another dropout mask) differs by far more.
RELATIVE_TOLERANCE = 1e-3
_WALK_DEPTH = 6  # levels of attributes / items followed from a block's argument
_WALK_NODES = 4096  # objects and values recorded per argument at most
_INTEGER_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class OutputFingerprint:
    """What a block's forward returned, summarized: per output tensor, its shape and dtype, a
    position-weighted hash of its bits, and its float64 sum, absolute sum and position-weighted sum."""

    shapes: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    hashes: tuple[int, ...]
    sums: tuple[tuple[float, float, float], ...]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> OutputFingerprint:
        with torch.no_grad():
            return cls(
                tuple((tuple(t.shape), t.dtype) for t in tensors),
                tuple(_bit_hash(t) for t in tensors),
                tuple(_sums(t) for t in tensors),
            )

    def differs(self, tensors: Sequence[torch.Tensor], bitwise: bool) -> str | None:
        """Why ``tensors`` (the recomputed output) is not what forward returned, or None.
        ``bitwise`` (CPU, deterministic algorithms): the bits match, or the sums differ by rounding
        alone (``_rounding_tolerance``); otherwise the sums agree within ``RELATIVE_TOLERANCE``."""
        shapes = tuple((tuple(t.shape), t.dtype) for t in tensors)
        if shapes != self.shapes:
            return f"it returned {_describe(shapes)} where forward returned {_describe(self.shapes)}"
        with torch.no_grad():
            if bitwise and tuple(_bit_hash(t) for t in tensors) == self.hashes:
                return None
            for index, (tensor, (total, size, weighted)) in enumerate(zip(tensors, self.sums, strict=True)):
                tolerance = _rounding_tolerance(tensor.dtype) if bitwise else RELATIVE_TOLERANCE
                again, again_size, again_weighted = _sums(tensor)
                bound = tolerance * max(size, again_size, 1e-30)
                if max(abs(again - total), abs(again_size - size), abs(again_weighted - weighted) / 1.5) > bound:
                    return (f"its output tensor {index} sums to {again:.6g} (absolute {again_size:.6g}), forward's to "
                            f"{total:.6g} ({size:.6g}): beyond the relative tolerance {tolerance:g}")
        return None


def _rounding_tolerance(dtype: torch.dtype) -> float:
    """How far a recomputation on deterministic kernels may differ from forward: rounding only.
    The bits are compared first; they can differ where a kernel takes another path for tensors that
    require grad (torch.matmul does not fold a batched product whose operand does; T5's attention),
    and the blocks after it then see inputs that differ in the last bits. Those differences stay
    within ~2**10 units in the last place of the sums; what a wrong recomputation changes (doubled
    keys, a counter) is far larger. Capped at ``RELATIVE_TOLERANCE`` for 16-bit outputs."""
    if not dtype.is_floating_point:
        return 0.0
    return min(RELATIVE_TOLERANCE, 1024 * torch.finfo(dtype).eps)


def has_values(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` hold values to fingerprint: not the fake or meta tensors of a profiling pass."""
    return not any(is_fake(t) or t.is_meta for t in tensors)


def _describe(shapes) -> str:
    return ", ".join(f"{list(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in shapes) or "no tensor"


def _chunks(tensor: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """``tensor``'s elements in flattened order, about ``_CHUNK`` at a time, with the position of
    each chunk's first element; a non-contiguous tensor is copied a few slices along dim 0 at a time."""
    tensor = tensor.detach()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.is_contiguous() or tensor.dim() < 2:
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), _CHUNK):
            yield start, flat[start : start + _CHUNK]
        return
    per_row = max(1, tensor[0].numel())
    rows = max(1, _CHUNK // per_row)
    for row in range(0, tensor.shape[0], rows):
        part = tensor[row : row + rows].reshape(-1)  # a copy of at most ~_CHUNK elements (or one slice)
        for start in range(0, part.numel(), _CHUNK):
            yield row * per_row + start, part[start : start + _CHUNK]


def _bit_hash(tensor: torch.Tensor) -> int:
    """sum_i bits_i * w_i modulo 2**64 over the flattened tensor, with odd weights w_i that depend
    on the position i: a change of any one element, or elements swapped, changes the hash."""
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for start, chunk in _chunks(tensor):
        if chunk.dtype == torch.bool:
            chunk = chunk.to(torch.uint8)
        if chunk.is_floating_point():
            chunk = chunk.view(_INTEGER_VIEW[chunk.element_size()])
        weights = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=tensor.device)
        weights.mul_(_HASH_MULTIPLIER).bitwise_or_(1)  # wraps modulo 2**64: integer arithmetic, exact
        total += (chunk.to(torch.int64) * weights).sum()
    return int(total)


def _sums(tensor: torch.Tensor) -> tuple[float, float, float]:
    """The float64 sum, absolute sum and position-weighted sum (weights in [0.5, 1.5), depending on
    the position: elements moved change it) of ``tensor``'s values; zeros for an integer tensor,
    whose bits are only compared exactly."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return 0.0, 0.0, 0.0
    total = size = weighted = 0.0
    for start, chunk in _chunks(tensor):
        chunk = chunk.to(torch.float64)
        total += float(chunk.sum())
        size += float(chunk.abs().sum())
        positions = torch.arange(start, start + chunk.numel(), device=chunk.device, dtype=torch.int64)
        weights = ((positions * 2654435761) % 1021).to(torch.float64) / 1021 + 0.5
        weighted += float((chunk * weights).sum())
    return total, size, weighted


# --- arguments a block changes ------------------------------------------------------------------------

_ATOMS = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum, type(None))


def argument_state(value: object) -> tuple:
    """What a block could change in ``value``, a non-tensor argument: a bounded depth-first record
    of the objects reachable from it (their types, attributes and items), the plain values in them,
    and for each tensor its identity, shape and version counter (bumped by any in-place change).
    Modules are recorded by identity only: their buffers' updates (BatchNorm statistics) are the
    model's own, handled by recomputation. Cheap: at most ``_WALK_NODES`` entries, ``_WALK_DEPTH``
    levels."""
    record: list = []
    seen: set[int] = set()
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack and len(record) < _WALK_NODES:
        item, depth = stack.pop()
        if isinstance(item, torch.Tensor):
            record.append(("tensor", id(item), tuple(item.shape), item._version))
        elif isinstance(item, _ATOMS):
            record.append(repr(item))  # repr: a NaN equals itself
        elif isinstance(item, nn.Module) or id(item) in seen or depth >= _WALK_DEPTH:
            record.append(("object", type(item).__name__, id(item)))
        else:
            seen.add(id(item))
            children = _children(item)
            record.append((type(item).__name__, id(item), len(children)))
            stack.extend((child, depth + 1) for child in reversed(children))
    return tuple(record)


def _children(item: object) -> list:
    """The values an object holds: a container's items (a dict's keys too), else its attributes."""
    if isinstance(item, dict):
        return [part for pair in item.items() for part in pair]
    if isinstance(item, (list, tuple, set, frozenset)):
        return list(item) if not isinstance(item, (set, frozenset)) else sorted(item, key=repr)
    attributes = getattr(item, "__dict__", None)
    if isinstance(attributes, dict):
        return [part for pair in attributes.items() for part in pair]
    return []
