"""Offloaded saved activations (``checkpointing.offload=true``, CUDA): what autograd keeps for backward
is copied to pinned host memory as forward runs and brought back, in reverse order, ahead of the
backward that needs it.

``apply_offload(model)`` installs saved-tensor hooks around ``model``'s forward (as compression does:
``lowmem.techniques.compression``; hooks active outside still see what is stored, and compression
installed after offloading hands its codes to it). Each saved activation of at least
``MIN_BYTES`` (model state, leaves and small tensors stay on the device:
``lowmem.techniques.compression.is_model_state``) is

- copied device-to-host on a side stream (``Streams.copy``), which waits for the compute stream to
  have produced the tensor; the caching allocator is told the side stream uses it
  (``record_stream``), so its memory is reused only once the copy is done, while forward goes on;
- held in a buffer of a bounded pool of pinned host buffers (``PinnedPool``): buffers are taken in
  powers of two, returned when backward has read them back, and reused by the next step (pinning
  memory anew costs milliseconds per tensor: pytorch PR#186161). Past the pool's ``max_bytes`` a
  tensor stays on the device (counted, logged once);
- fetched host-to-device on the side stream when backward first needs it, together with the next
  ``prefetch`` tensors backward will need (those saved just before it: backward runs in reverse),
  so the copies overlap with backward's compute; the compute stream waits only for the tensor it
  reads.

A tensor saved by several nodes is offloaded once. In the accounting's fake pass (CPU stand-ins:
``lowmem.profiler.activations``) the hooks hand on a stand-in marked ``offloaded``: counted as host
bytes, not as device activations, until backward fetches it back (prefetches included), from when
its device copy counts as a saved activation until autograd releases it. On a CPU the hooks would
copy memory to itself: a CPU run is refused at set-up (``lowmem.trainer.start_run``). ``Streams``
is the one place that touches CUDA: tests drive the hooks through a test double of it on a CPU.
"""

from __future__ import annotations

import copy
import logging
import weakref
from typing import Any, Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from lowmem.profiler.activations import SAVED_FORM
from lowmem.techniques.compression import ForwardSavedTensorHooks, is_model_state, offloaded_here

log = logging.getLogger("lowmem")
MIN_BYTES = 1 << 16  # smaller saved tensors stay on the device (the copy's latency outweighs them)
PREFETCH = 2  # tensors fetched ahead of the one backward reads
MAX_POOL_BYTES = 1 << 36  # pinned host memory the pool may hold (64 GiB): beyond it, tensors stay


class Streams(Protocol):
    """What offloading needs of a device: pinned buffers, copies on a side stream, and events."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A pinned host buffer of ``nbytes`` bytes (uint8)."""
        ...

    def to_host(self, tensor: torch.Tensor, buffer: torch.Tensor) -> Any:
        """Copy ``tensor``'s bytes into ``buffer`` on the side stream, after the compute stream has
        produced it; an event marking the copy's end."""
        ...

    def to_device(self, buffer: torch.Tensor, like: torch.Tensor, after: Any) -> tuple[torch.Tensor, Any]:
        """A device tensor shaped and typed as ``like`` (its meta), filled from ``buffer`` on the side
        stream once ``after`` (the offload's event) is done; and an event marking the copy's end."""
        ...

    def wait(self, event: Any) -> None:
        """Make the compute stream wait for ``event``."""
        ...


class CudaStreams:
    """``Streams`` on a CUDA device: one side stream for both directions (copies stay in order)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy = torch.cuda.Stream(device)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def to_host(self, tensor: torch.Tensor, buffer: torch.Tensor) -> Any:
        self.copy.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy):
            buffer[: tensor.numel() * tensor.element_size()].copy_(_bytes_of(tensor), non_blocking=True)
            tensor.record_stream(self.copy)
            return self.copy.record_event()

    def to_device(self, buffer: torch.Tensor, like: torch.Tensor, after: Any) -> tuple[torch.Tensor, Any]:
        with torch.cuda.stream(self.copy):
            self.copy.wait_event(after)
            out = torch.empty(like.shape, dtype=like.dtype, device=self.device)
            _bytes_of(out).copy_(buffer[: out.numel() * out.element_size()], non_blocking=True)
            event = self.copy.record_event()
        out.record_stream(torch.cuda.current_stream(self.device))  # allocated on the side stream, read on this one
        return out, event

    def wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


class PinnedPool:
    """Pinned host buffers reused across steps: sizes rounded up to a power of two (at least 64 KiB),
    at most ``max_bytes`` in all. ``allocated`` counts buffers ever pinned, ``held_bytes`` their bytes."""

    def __init__(self, streams: Streams, max_bytes: int = MAX_POOL_BYTES) -> None:
        self.streams, self.max_bytes = streams, max_bytes
        self.free: dict[int, list[torch.Tensor]] = {}
        self.held_bytes = 0
        self.allocated = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A free buffer of at least ``nbytes``, or None when the pool is at its limit."""
        size = max(MIN_BYTES, 1 << (nbytes - 1).bit_length())
        free = self.free.get(size)
        if free:
            return free.pop()
        if self.held_bytes + size > self.max_bytes:
            return None
        self.held_bytes += size
        self.allocated += 1
        return self.streams.pinned(size)

    def give_back(self, buffer: torch.Tensor) -> None:
        self.free.setdefault(buffer.numel(), []).append(buffer)


class _Offloaded:
    """One saved tensor in host memory: where, how to rebuild it, and its fetch once issued."""

    __slots__ = ("position", "buffer", "meta", "stored", "fetched", "fetch_event", "unpack_outer", "__weakref__")

    def __init__(self, position: int, buffer: torch.Tensor, meta: torch.Tensor, stored: Any) -> None:
        self.position, self.buffer, self.meta, self.stored = position, buffer, meta, stored
        self.fetched: torch.Tensor | None = None
        self.fetch_event: Any = None
        self.unpack_outer: Any = None  # the accounting's pass: the outer hooks read it back (a fetch)


class _Kept:
    """A saved tensor left as it is (handed to the hooks outside, if any)."""

    __slots__ = ("packed", "unpack_outer")

    def __init__(self, tensor: torch.Tensor, outer: tuple | None) -> None:
        self.unpack_outer = None if outer is None else outer[1]
        self.packed = tensor.detach() if outer is None else outer[0](tensor)  # detached: no cycle via grad_fn

    def tensor(self) -> torch.Tensor:
        return self.packed if self.unpack_outer is None else self.unpack_outer(self.packed)


class ActivationOffload(ForwardSavedTensorHooks):
    """Saved-tensor hooks that offload what ``model``'s forward saves (``apply_offload``).

    streams: the device's copy machinery (``CudaStreams``; a test double on a CPU).
    prefetch: how many tensors are fetched ahead of the one backward reads.
    ``offloaded_bytes``: bytes the last forward offloaded; ``kept_for_room``: saves (a tensor saved
    by two nodes counts twice) left on the device because the pool was full.
    """

    def __init__(
        self,
        model: nn.Module,
        streams: Streams,
        prefetch: int = PREFETCH,
        max_bytes: int = MAX_POOL_BYTES,
        everywhere: bool = True,
    ):
        self.streams, self.prefetch, self.everywhere = streams, prefetch, everywhere
        self.pool = PinnedPool(streams, max_bytes)
        self.offloaded_bytes = self.kept_for_room = 0
        self._order: list[weakref.ref] = []  # this forward's offloaded tensors, in pack order
        super().__init__(model)

    @property
    def host_bytes(self) -> int:
        """Pinned host memory the pool holds (bytes)."""
        return self.pool.held_bytes

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pinned buffers and a device's copy stream belong to this process: torch.save(model) of an
        # offloaded model would fail on them deep inside pickle (or on a forward's weak references).
        raise TypeError(
            "a model trained with checkpointing.offload=true cannot be pickled whole (its pinned host buffers and "
            "copy stream belong to this process): save torch.save(model.state_dict(), path), or run.state_dict() "
            "to resume"
        )

    def __deepcopy__(self, memo: dict) -> ActivationOffload:
        # What deepcopy does without __reduce_ex__ (compact.dense_copy copies an offloaded model).
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    def _starts(self, args: tuple) -> None:
        self._order, self.offloaded_bytes = [], 0

    def _pack(self, tensor: torch.Tensor) -> _Offloaded | _Kept:
        nbytes = tensor.numel() * tensor.element_size()
        compressed = getattr(tensor, SAVED_FORM, None) == "compressed"  # codes: no history, not model state
        if not offloaded_here(self.everywhere):  # a schedule keeps this segment's saves on the device
            return _Kept(tensor, self._outer)
        if nbytes < MIN_BYTES or (not compressed and is_model_state(tensor, self._state_shapes)):
            return _Kept(tensor, self._outer)
        cached = getattr(tensor, "_lowmem_offloaded", None)
        if cached is not None and cached[0] == tensor._version and cached[1]() is not None:
            return cached[1]()
        if isinstance(tensor, FakeTensor):  # the accounting's pass: a host stand-in, counted as such
            stand_in = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            setattr(stand_in, SAVED_FORM, "offloaded")
            stored = stand_in if self._outer is None else self._outer[0](stand_in)
            item = _Offloaded(len(self._order), stand_in, stand_in, stored)
            if self._outer is None:
                item.fetched = stand_in
            else:  # the outer hooks (the accounting) see backward fetch it back to the device
                item.unpack_outer = self._outer[1]
        else:
            buffer = self.pool.take(nbytes)
            if buffer is None:
                self.kept_for_room += 1
                if self.kept_for_room == 1:
                    log.warning("checkpointing.offload: the pinned pool is full; more activations stay on the device")
                return _Kept(tensor, self._outer)
            source = tensor.detach().contiguous()
            event = self.streams.to_host(source, buffer)
            meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            item = _Offloaded(len(self._order), buffer, meta, event)
            self.offloaded_bytes += nbytes
        self._order.append(weakref.ref(item))
        tensor._lowmem_offloaded = (tensor._version, weakref.ref(item))
        return item

    def _unpack(self, packed: _Offloaded | _Kept) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.tensor()
        self._fetch(packed)
        # Backward reads in reverse order of saving: the ones saved just before are fetched while
        # this one is computed with.
        for position in range(packed.position - 1, max(packed.position - 1 - self.prefetch, -1), -1):
            item = self._order[position]() if position < len(self._order) else None
            if item is not None:
                self._fetch(item)
        if packed.fetch_event is not None:
            self.streams.wait(packed.fetch_event)
            packed.fetch_event = None
            self.pool.give_back(packed.buffer)  # the side stream reuses it only after this fetch
        return packed.fetched

    def _fetch(self, item: _Offloaded) -> None:
        if item.fetched is None and item.unpack_outer is not None:
            item.fetched = item.unpack_outer(item.stored)
        elif item.fetched is None:
            item.fetched, item.fetch_event = self.streams.to_device(item.buffer, item.meta, item.stored)


def apply_offload(
    model: nn.Module,
    streams: Streams | None = None,
    device: torch.device | None = None,
    prefetch: int = PREFETCH,
    max_bytes: int = MAX_POOL_BYTES,
    everywhere: bool = True,
) -> ActivationOffload:
    """Offload what ``model``'s forward saves for backward to pinned host memory (CUDA ``device``, or
    the given ``streams``): everything (``everywhere``), or only where a schedule's stored segment
    says (``Segment.offload``: ``checkpointing.strategy=optimal`` chooses per block). Changes no
    module, parameter or state-dict key; ``remove()`` takes it off."""
    if streams is None:
        if device is None or device.type != "cuda":
            where = getattr(device, "type", device)
            raise ValueError(
                "checkpointing.offload=true needs a CUDA device (it copies saved activations to pinned host memory "
                f"on a side stream); this model runs on {where}: use checkpointing.offload=false"
            )
        streams = CudaStreams(device)
    previous = offload_of(model)
    if previous is not None:
        previous.remove()
    hooks = ActivationOffload(model, streams, prefetch, max_bytes, everywhere)
    object.__setattr__(model, "_lowmem_offload", hooks)  # a plain attribute: no state-dict key
    return hooks


def offload_of(model: nn.Module) -> ActivationOffload | None:
    """The offload hooks installed on ``model`` (``apply_offload``), or None."""
    return model.__dict__.get("_lowmem_offload")


# --- what offloading costs (the planner's price) -----------------------------------------------


def exposed_transfer_flops(host_bytes: int, forward_flops: int, backward_flops: int, flops_per_byte: float) -> int:
    """FLOP-equivalents of offloading a stored block's ``host_bytes`` that its own compute cannot
    hide: the copy out runs beside the block's forward, the copy back (prefetched) beside its
    backward, each taking ``host_bytes * flops_per_byte`` FLOP-times (``link_flops_per_byte``).
    What the copies could also hide behind neighbouring blocks is not counted: a bound from above,
    so the planner offloads only where it is surely cheap."""
    transfer = host_bytes * flops_per_byte
    return round(max(0.0, transfer - forward_flops) + max(0.0, transfer - backward_flops))


_LINKS: dict[tuple[str, torch.dtype], float] = {}


def link_flops_per_byte(device: torch.device, dtype: torch.dtype, nbytes: int = 64 << 20) -> float:
    """The device's matrix-product rate over its host link's, in FLOPs per byte copied, measured
    once per process and (device, dtype) on CUDA: the slower direction of an ``nbytes`` pinned copy,
    and a 4096 x 4096 product in ``dtype``. An H100 over PCIe 5 is about 10,000: a block must do that
    many FLOPs per byte it saves for its offload to hide."""
    key = (str(device), dtype)
    if key not in _LINKS:
        if device.type != "cuda":
            raise ValueError(f"offloading is priced on CUDA only; this is {device.type}")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        seconds = []
        for destination, source in ((host, on_device), (on_device, host)):
            destination.copy_(source, non_blocking=True)  # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                destination.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 3e3)
        matrix = torch.randn(4096, 4096, device=device).to(dtype if dtype.is_floating_point else torch.float32)
        matrix @ matrix  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            matrix @ matrix
        end.record()
        end.synchronize()
        rate = 5 * 2 * 4096**3 / (start.elapsed_time(end) / 1e3)
        bandwidth = nbytes / max(seconds)
        _LINKS[key] = rate / bandwidth
        log.info(
            "checkpointing.offload: host link %.1f GB/s (slower direction), %s products %.1f TFLOP/s: %.0f FLOPs per "
            "byte offloaded to hide", bandwidth / 1e9, dtype, rate / 1e12, _LINKS[key]
        )  # fmt: skip
    return _LINKS[key]
