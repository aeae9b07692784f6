"""Compressed saved activations (``checkpointing.compress=8|4|2``): what autograd keeps for backward,
stored blockwise quantized, through ``torch.autograd.graph.saved_tensors_hooks``, on any model.

``apply_compression(model, bits)`` makes every forward of ``model`` store each floating-point tensor
autograd saves for backward as ``bits``-bit codes with one range per group of ``GROUP`` elements,
and read it back (dequantized, in its own dtype) when backward needs it:

- groups (ActNN's and GACT's choice: per-group ranges): ``GROUP`` consecutive elements in memory
  order, each with its own minimum and step (FP32). For an NCHW activation whose H x W is at least
  ``GROUP`` a group lies inside one channel of one sample: ActNN's per-sample ranges, refined per
  channel, which is where activation ranges differ most (a BatchNorm output's channels share a scale,
  a ReLU's do not; samples differ in contrast). Memory order keeps it one reshape, whatever the
  layout; two FP32 numbers per 256 elements cost 0.25 bits per element;
- stochastic rounding: ``code = floor((x - min) / step + u)``, ``u`` uniform in (0, 1), so the stored
  value is unbiased (to within 1/512 of a step: ``u`` takes 256 values). The random bits are
  counter-based, as the quantized optimizer state's (``lowmem.kernels.reference``): element i of
  the k-th tensor saved in a forward draws the i-th byte of MurmurHash3's finaliser over
  (i / 4, the tensor's key), the key derived from the trainer's seed, its step count, the
  microbatch and k (``ActivationCompression.start_microbatch``), so a resumed run draws the bits
  the uninterrupted one did, on every device;
- the minibatch is an activation like any other: a floating-point tensor the model's forward was
  given (or a microbatch slice of it) is quantized where an op saves it (the first convolution
  keeps its input for its weight gradient), as ActNN's compressed layers do. What the caller itself
  still holds of it is its own memory, not autograd's;
- stored exactly, in fewer bytes (lossless): a ReLU's own saved output as a 1-bit sign mask (its
  backward needs nothing else), as lowmem's accounting has always counted it; a bool tensor (a
  dropout or padding mask) at 1 bit per element; the int64 indices a max-pooling module
  (``nn.MaxPool1d/2d/3d``, ``nn.AdaptiveMaxPool1d/2d/3d``) saves, in the narrowest integer type
  that holds every position of its input's plane (uint8 up to 256 positions, int16 up to 32,768,
  int32 beyond: torchvision's resnet18 at 32x32 pools a 16x16 plane, 8x fewer bytes). The width
  follows from the input's shape alone, so a fake pass (the accounting) sizes it exactly;
- what is not compressed: parameters and tensors computed from them alone (a transposed or cast
  weight), other leaves (buffers, constants), tensors of fewer than ``MIN_ELEMENTS`` elements
  (BatchNorm's statistics), other integer tensors (a functional max-pool's or an embedding's
  indices), and a checkpointed segment's input (recomputation starts from it exactly);
- a tensor saved twice in one forward (a ReLU output saved by the ReLU and by the convolution after
  it, a layer-norm output read by three projections) is quantized once.

Other saved-tensor hooks active around the forward (lowmem's accounting and measured peak, a user's
own) still see every saved tensor: the codes, ranges and masks are handed to them in its place, so
the accounting counts compressed bytes at their stored size. Quantizing and dequantizing are custom
ops (``lowmem::quantize_activation`` and three more) with fake implementations, so the accounting's
fake pass knows their output sizes, and with FLOP formulas (``QUANTIZE_FLOPS`` and
``DEQUANTIZE_FLOPS`` per element), so a profile's FLOPs include them: a FLOP-equivalent counts the
arithmetic of one pass over the elements (range, subtract, scale, add noise, floor, clamp, pack: 8
per element to quantize; unpack, multiply, add: 2 to read back). On a CPU they run in lowmem's C
kernel (``lowmem/kernels/lowmem_kernels.c``) with the bits of the torch code here, which is their
definition and the fallback (``LOWMEM_KERNELS=torch``, other devices); the torch code works chunk by
chunk, so its scratch stays a few MB, like a kernel's.

With ``checkpointing.strategy=optimal`` the hooks are installed without a default width and the
planner's schedule compresses block by block (``compressed_saves``: a stored segment's width).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import register_flop_formula

from lowmem import kernels
from lowmem.kernels import cpu
from lowmem.kernels.reference import _fmix32_tensor, fmix32, tensor_keys
from lowmem.profiler.activations import SAVED_FORM, op_tensors, saved_by_relu_itself, storage_key
from lowmem.techniques.compact_shards import is_gathered_values

WIDTHS = (8, 4, 2)  # checkpointing.compress, widest first
GROUP = 256  # elements per quantization group (one FP32 minimum and step each)
MIN_ELEMENTS = 4096  # saved tensors smaller than this are stored as they are
CHUNK = 1 << 20  # elements quantized at a time: the scratch stays a few MB
QUANTIZE_FLOPS = 8  # FLOP-equivalents per element quantized (see the module docstring)
DEQUANTIZE_FLOPS = 2  # FLOP-equivalents per element read back
SIGN_FLOPS = 1  # per element of a 1-bit ReLU mask, packed or read back
_MASK32 = 0xFFFFFFFF
_SALT = 0x2545F491  # activation keys differ from the optimizer's for the same seed and step
_UNSET = object()
# The width saved tensors are stored at where a schedule sets one (``compressed_saves``): None
# keeps them as they are; unset: the hooks' own width.
_WIDTH: ContextVar[Any] = ContextVar("lowmem_compressed_width", default=_UNSET)
# Whether saved tensors are offloaded where a schedule says (``offloaded_saves``); unset: as the
# offload hooks' own setting says.
_OFFLOADED: ContextVar[Any] = ContextVar("lowmem_offloaded", default=_UNSET)


def validate_compress(value: Any) -> int | None:
    """``checkpointing.compress``: None / "none" (nothing compressed) or 8, 4, 2 bits; the bits or None.
    Raises ValueError naming the knob and the allowed values."""
    if value is None or value == "none":
        return None
    if isinstance(value, bool) or not isinstance(value, int | str) or str(value) not in {str(w) for w in WIDTHS}:
        raise ValueError(
            f"checkpointing.compress={value!r} is not allowed: one of none, {', '.join(map(str, WIDTHS))} "
            "(bits per saved activation element)"
        )
    return int(value)


def allowed_widths(narrowest: int | None) -> tuple[int, ...]:
    """The widths a planner may choose when ``checkpointing.compress`` is ``narrowest``: that one
    and every wider one (``WIDTHS``), widest first."""
    return () if narrowest is None else tuple(w for w in WIDTHS if w >= narrowest)


# --- the arithmetic: custom ops with fake implementations and FLOP formulas --------------------


def code_bytes(elements: int, bits: int) -> int:
    """Bytes of codes for ``elements`` values at ``bits`` bits, padded to whole groups."""
    return math.ceil(elements / GROUP) * GROUP * bits // 8


def _uniform(key: int, start: int, count: int, device: torch.device) -> torch.Tensor:
    """``count`` (a multiple of 4) uniform numbers in (0, 1), FP32, for elements ``start ..``: byte
    ``i % 4`` of the 32-bit hash of word ``i // 4`` (``lowmem.kernels.reference.random24``'s hash)."""
    index = torch.arange(start // 4, (start + count) // 4, dtype=torch.int64, device=device)
    words = _fmix32_tensor(((index * 0x27D4EB2F) & _MASK32) ^ key).to(torch.int32)
    return words.view(torch.uint8).float().add_(0.5).mul_(1 / 256)


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (each < 2**bits) packed ``8 // bits`` to a byte, the first in the low bits."""
    if bits == 8:
        return codes
    columns = codes.view(-1, 8 // bits)
    packed = columns[:, 0].clone()
    for j in range(1, 8 // bits):
        packed |= columns[:, j] << (j * bits)
    return packed


def _unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & (2**bits - 1)).view(-1)


def _c_kernel(tensor: torch.Tensor) -> bool:
    """Whether lowmem's C kernel does this CPU tensor's arithmetic (the same bits as the torch code)."""
    return tensor.device.type == "cpu" and tensor.dtype in cpu.DTYPE_CODES and kernels.backend(tensor.device) == "cpu"


@torch.library.custom_op("lowmem::quantize_activation", mutates_args=())
def quantize_activation(x: torch.Tensor, bits: int, key: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (any float dtype and shape) as (codes uint8, per-group minimum FP32, per-group step FP32)."""
    flat = x.reshape(-1)
    count, levels = flat.numel(), 2**bits - 1
    groups = math.ceil(count / GROUP)
    codes = torch.empty(code_bytes(count, bits), dtype=torch.uint8, device=x.device)
    lows = torch.empty(groups, dtype=torch.float32, device=x.device)
    steps = torch.empty(groups, dtype=torch.float32, device=x.device)
    if _c_kernel(x):
        cpu.quantize_activation(flat.contiguous(), bits, key, codes, lows, steps)
        return codes, lows, steps
    for start in range(0, count, CHUNK):
        part = flat[start : start + CHUNK].float()
        pad = -part.numel() % GROUP
        if pad:  # the last group padded with its last value: its range does not widen
            part = torch.cat([part, part[-1:].expand(pad)])
        rows = part.view(-1, GROUP)
        low, high = rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True)
        step = (high - low) / levels
        scaled = (rows - low).mul_(torch.where(step > 0, step.reciprocal(), 0.0))
        del part, rows
        scaled.add_(_uniform(key, start, scaled.numel(), x.device).view_as(scaled)).floor_().clamp_(0, levels)
        first, last = start // GROUP, start // GROUP + scaled.shape[0]
        codes[first * GROUP * bits // 8 : last * GROUP * bits // 8] = _pack_codes(scaled.to(torch.uint8), bits).view(-1)
        lows[first:last], steps[first:last] = low.view(-1), step.view(-1)
    return codes, lows, steps


@quantize_activation.register_fake
def _(x, bits, key):
    groups = math.ceil(x.numel() / GROUP)
    return (
        x.new_empty(code_bytes(x.numel(), bits), dtype=torch.uint8),
        x.new_empty(groups, dtype=torch.float32),
        x.new_empty(groups, dtype=torch.float32),
    )


@torch.library.custom_op("lowmem::dequantize_activation", mutates_args=())
def dequantize_activation(
    codes: torch.Tensor, lows: torch.Tensor, steps: torch.Tensor, bits: int, shape: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """The values ``quantize_activation`` stored, in ``dtype`` and ``shape``."""
    count = math.prod(shape)
    out = torch.empty(count, dtype=dtype, device=codes.device)
    if _c_kernel(out):
        cpu.dequantize_activation(codes, lows, steps, bits, out)
        return out.view(shape)
    for start in range(0, count, CHUNK):
        stop = min(start + CHUNK, count)
        first, last = start // GROUP, math.ceil(stop / GROUP)
        values = _unpack_codes(codes[first * GROUP * bits // 8 : last * GROUP * bits // 8], bits).view(-1, GROUP)
        # A multiply, then an add (no fused multiply-add): the C kernel's bits.
        rows = values.float().mul_(steps[first:last, None]).add_(lows[first:last, None])
        out[start:stop] = rows.view(-1)[: stop - start]
    return out.view(shape)


@dequantize_activation.register_fake
def _(codes, lows, steps, bits, shape, dtype):
    return codes.new_empty(shape, dtype=dtype)


@torch.library.custom_op("lowmem::pack_signs", mutates_args=())
def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """``x > 0`` as bits, 8 to a byte (uint8, ceil(numel / 8) bytes)."""
    positive = (x.reshape(-1) > 0).to(torch.uint8)
    pad = -positive.numel() % 8
    if pad:
        positive = torch.cat([positive, positive.new_zeros(pad)])
    return _pack_codes(positive, 1)


@pack_signs.register_fake
def _(x):
    return x.new_empty(math.ceil(x.numel() / 8), dtype=torch.uint8)


@torch.library.custom_op("lowmem::unpack_signs", mutates_args=())
def unpack_signs(packed: torch.Tensor, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """1 where the packed sign bit is set, else 0, in ``dtype`` and ``shape`` (what a ReLU's backward
    reads of its output: whether it is positive)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[: math.prod(shape)]
    return bits.to(dtype).view(shape)


@unpack_signs.register_fake
def _(packed, shape, dtype):
    return packed.new_empty(shape, dtype=dtype)


@register_flop_formula(torch.ops.lowmem.quantize_activation)
def _quantize_flops(x_shape, *args, **kwargs) -> int:
    return QUANTIZE_FLOPS * math.prod(x_shape)


@register_flop_formula(torch.ops.lowmem.dequantize_activation)
def _dequantize_flops(codes_shape, lows_shape, steps_shape, bits, shape, *args, **kwargs) -> int:
    return DEQUANTIZE_FLOPS * math.prod(shape)


@register_flop_formula(torch.ops.lowmem.pack_signs)
def _pack_signs_flops(x_shape, *args, **kwargs) -> int:
    return SIGN_FLOPS * math.prod(x_shape)


@register_flop_formula(torch.ops.lowmem.unpack_signs)
def _unpack_signs_flops(packed_shape, shape, *args, **kwargs) -> int:
    return SIGN_FLOPS * math.prod(shape)


# --- the saved-tensor hooks ----------------------------------------------------------------------


@contextlib.contextmanager
def compressed_saves(bits: int | None) -> Iterator[None]:
    """Inside, tensors saved for backward are stored at ``bits`` bits (None: as they are), whatever
    the installed hooks' own width: a schedule's stored segment, or a checkpoint's input."""
    token = _WIDTH.set(bits)
    try:
        yield
    finally:
        _WIDTH.reset(token)


@contextlib.contextmanager
def offloaded_saves(offload: bool = True) -> Iterator[None]:
    """Inside, tensors saved for backward are offloaded to host memory (``offload``) or kept on the
    device, whatever the installed offload hooks' own setting (``lowmem.techniques.offload``): a
    schedule's stored segment."""
    token = _OFFLOADED.set(offload)
    try:
        yield
    finally:
        _OFFLOADED.reset(token)


def offloaded_here(everywhere: bool) -> bool:
    """Whether a tensor saved now is offloaded, by hooks that offload ``everywhere`` unless told."""
    chosen = _OFFLOADED.get()
    return everywhere if chosen is _UNSET else chosen


@contextlib.contextmanager
def stored_saves(bits: int | None, offload: bool) -> Iterator[None]:
    """How a stored segment keeps what it saves: compressed at ``bits`` (None: as the hooks' own
    width says), offloaded when ``offload`` (else as the offload hooks say)."""
    with contextlib.ExitStack() as saves:
        if bits is not None:
            saves.enter_context(compressed_saves(bits))
        if offload:
            saves.enter_context(offloaded_saves())
        yield


class _Packed:
    """What autograd holds for one saved tensor: its stored form, each part handed to the saved-tensor
    hooks that were active outside (``outer``: their pack results, read back with their unpack)."""

    __slots__ = ("form", "parts", "meta", "nbytes", "unpack_outer", "__weakref__")

    def __init__(self, form: str, parts: list[torch.Tensor], meta: tuple, outer: tuple | None) -> None:
        self.form, self.meta = form, meta
        self.nbytes = 0 if form == "plain" else sum(part.untyped_storage().nbytes() for part in parts)
        if form != "plain":
            for part in parts:  # how the accounting (lowmem.profiler.activations) tells them apart
                setattr(part, SAVED_FORM, "compressed")
        self.unpack_outer = None if outer is None else outer[1]
        # Kept detached (as autograd's own hooks need): a saved output holding its own grad_fn through
        # this object would be a reference cycle no collector sees, and leak every step.
        self.parts = [part.detach() for part in parts] if outer is None else [outer[0](part) for part in parts]

    def tensors(self) -> list[torch.Tensor]:
        return self.parts if self.unpack_outer is None else [self.unpack_outer(part) for part in self.parts]


class ForwardSavedTensorHooks:
    """Saved-tensor hooks entered around every forward of ``model`` (a forward pre-hook and an
    always-called forward hook) and chained to the hooks active outside: ``self._outer`` is their
    (pack, unpack), to which a subclass's ``_pack`` hands what it stores, so the accounting and the
    measured peak see the stored form. Subclasses define ``_pack``, ``_unpack`` and ``_starts``
    (what a new forward resets)."""

    def __init__(self, model: nn.Module) -> None:
        self._outer: tuple | None = None
        self._contexts: list[tuple[contextlib.AbstractContextManager, tuple | None]] = []
        self._state_shapes = state_shapes(model)
        self._handles = [
            model.register_forward_pre_hook(self._forward_starts),
            model.register_forward_hook(self._forward_ends, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """The hooks on for the body (a block run alone, as the planner measures it)."""
        self._push()
        try:
            yield
        finally:
            self._pop()

    def _starts(self, args: tuple) -> None:
        """A forward starts, given ``args``: reset what the subclass counts per forward."""

    def _forward_starts(self, module: nn.Module, args: tuple) -> None:
        self._starts(args)
        self._state_shapes = state_shapes(module)
        self._push()

    def _forward_ends(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._pop()

    def _push(self) -> None:
        context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._contexts.append((context, self._outer))
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        context.__enter__()

    def _pop(self) -> None:
        if self._contexts:
            context, self._outer = self._contexts.pop()
            context.__exit__(None, None, None)


class ActivationCompression(ForwardSavedTensorHooks):
    """Saved-tensor hooks installed around ``model``'s forward (``apply_compression``).

    bits: the width every saved activation is stored at, or None: only where a schedule sets one
        (``compressed_saves``). seed: the run's seed (``trainer.seed``), for the random bits.
    ``compressed_bytes`` counts what the last forward stored compressed (codes, ranges, masks).
    """

    def __init__(self, model: nn.Module, bits: int | None, seed: int = 0) -> None:
        self.bits, self.seed = bits, seed
        self.key = fmix32(seed ^ _SALT)
        self.compressed_bytes = 0
        self._count = 0  # tensors quantized in this forward (each draws its own key)
        self._inputs: set[int] = set()  # storages of the floating-point tensors the forward was given
        self._plane: int | None = None  # positions in the plane a max-pooling module runs over
        super().__init__(model)
        for module in model.modules():
            if isinstance(module, tuple(_MAX_POOLS)):
                self._handles += [
                    module.register_forward_pre_hook(self._pooling_starts),
                    module.register_forward_hook(self._pooling_ends, always_call=True),
                ]

    def start_microbatch(self, step: int, microbatch: int) -> None:
        """Draw the next forward's random bits for microbatch ``microbatch`` of step ``step``."""
        self.key = fmix32(tensor_keys(self.seed ^ _SALT, step, 1)[0] ^ fmix32(microbatch & _MASK32))

    def _starts(self, args: tuple) -> None:
        self._count, self.compressed_bytes = 0, 0
        self._inputs = {storage_key(t) for t in op_tensors(args) if t.is_floating_point() and t.grad_fn is None}

    def _pooling_starts(self, module: nn.Module, args: tuple) -> None:
        dims = next(d for kind, d in _MAX_POOLS.items() if isinstance(module, kind))
        self._plane = math.prod(args[0].shape[-dims:]) if args and isinstance(args[0], torch.Tensor) else None

    def _pooling_ends(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._plane = None

    # --- saved tensors --------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> _Packed:
        width = _WIDTH.get()
        width = self.bits if width is _UNSET else width
        form = "plain" if width is None else self._form(tensor)
        shape = list(tensor.shape)
        if form == "signs":
            signs = torch.ops.lowmem.pack_signs(tensor.detach())
            packed = _Packed("signs", [signs], (shape, tensor.dtype), self._outer)
        elif form == "narrowed":
            narrow = tensor.detach().to(_index_dtype(self._plane))
            packed = _Packed("narrowed", [narrow], (tensor.dtype,), self._outer)
        elif form == "quantized":
            cached = getattr(tensor, "_lowmem_quantized", None)
            if cached is not None and cached[0] == (tensor._version, width) and cached[1]() is not None:
                return cached[1]()
            key = fmix32((self.key + self._count * 0x9E3779B9) & _MASK32)
            self._count += 1
            parts = list(torch.ops.lowmem.quantize_activation(tensor.detach(), width, key))
            packed = _Packed("quantized", parts, (width, shape, tensor.dtype), self._outer)
            tensor._lowmem_quantized = ((tensor._version, width), weakref.ref(packed))
        else:
            return _Packed("plain", [tensor], (), self._outer)
        self.compressed_bytes += packed.nbytes
        return packed

    @staticmethod
    def _unpack(packed: _Packed) -> torch.Tensor:
        parts = packed.tensors()
        if packed.form == "plain":
            return parts[0]
        if packed.form == "signs":
            shape, dtype = packed.meta
            return torch.ops.lowmem.unpack_signs(parts[0], shape, dtype)
        if packed.form == "narrowed":
            return parts[0].to(packed.meta[0])
        bits, shape, dtype = packed.meta
        return torch.ops.lowmem.dequantize_activation(*parts, bits, shape, dtype)

    def _form(self, tensor: torch.Tensor) -> str:
        """How ``tensor`` is stored: "signs" (a ReLU's own output, a bool mask: 1 bit each),
        "narrowed" (a max-pooling module's indices), "quantized" or "plain"."""
        if tensor.numel() < MIN_ELEMENTS:
            return "plain"
        if not tensor.is_floating_point():
            if tensor.dtype == torch.bool:
                return "signs"
            if tensor.dtype == torch.int64 and self._plane is not None and self._plane <= _INT32_POSITIONS:
                return "narrowed"
            return "plain"  # other indices
        if tensor.grad_fn is None:  # a leaf: the minibatch is an activation; parameters, buffers are not
            return "quantized" if storage_key(tensor) in self._inputs else "plain"
        if saved_by_relu_itself(tensor, "_lowmem_sign_node"):
            return "signs"
        if is_model_state(tensor, self._state_shapes):
            return "plain"
        return "quantized"


_MAX_POOLS = {  # max-pooling modules, each with the dimensions its indices address (the input's last)
    nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3,
    nn.AdaptiveMaxPool1d: 1, nn.AdaptiveMaxPool2d: 2, nn.AdaptiveMaxPool3d: 3,
}  # fmt: skip
_INT32_POSITIONS = 2**31


def _index_dtype(positions: int) -> torch.dtype:
    """The narrowest integer type holding every index into a plane of ``positions`` elements."""
    if positions <= 256:
        return torch.uint8
    return torch.int16 if positions <= 2**15 else torch.int32


def is_model_state(tensor: torch.Tensor, state_shapes: set[tuple[int, ...]]) -> bool:
    """Whether a saved ``tensor`` is model state, not an activation: a leaf (a parameter, a buffer,
    the minibatch), a view of a parameter (a part of it), a layer's compact values under
    ``trainer.parallel=fsdp`` (a view of its unit's gathered values), or a parameter transposed,
    cast or masked (shaped like a parameter, of one of ``state_shapes``, and computed from
    parameters alone)."""
    if tensor.grad_fn is None:
        return True
    if isinstance(tensor._base, nn.Parameter):  # not a recomputation's input: a view of a plain leaf
        return True
    if is_gathered_values(tensor):  # compact values gathered for a unit of sharded training
        return True
    return tuple(tensor.shape) in state_shapes and _from_model_state(tensor.grad_fn)


def state_shapes(model: nn.Module) -> set[tuple[int, ...]]:
    """The shapes of ``model``'s parameters, and of them transposed."""
    shapes = set()
    for p in model.parameters():
        shapes.update((tuple(p.shape), tuple(reversed(p.shape))))
    return shapes


def _from_model_state(node: Any, depth: int = 3) -> bool:
    """Whether the autograd ``node`` computes from parameters alone (within ``depth`` steps, inputs
    without gradient aside): a transposed, cast or masked weight."""
    if type(node).__name__ == "AccumulateGrad":
        return True
    if depth == 0:
        return False
    inputs = [n for n, _ in node.next_functions if n is not None]
    return bool(inputs) and all(_from_model_state(n, depth - 1) for n in inputs)


def apply_compression(model: nn.Module, bits: int | None, seed: int = 0) -> ActivationCompression:
    """Store what ``model``'s forward saves for backward at ``bits`` bits (8, 4, 2; None: only where
    a schedule's segment sets a width). Changes no module, parameter or state-dict key; returns
    the hooks (``remove()`` takes them off)."""
    if bits is not None and bits not in WIDTHS:
        raise ValueError(f"checkpointing.compress={bits!r} is not allowed: one of none, {', '.join(map(str, WIDTHS))}")
    previous = compression_of(model)
    if previous is not None:
        previous.remove()
    hooks = ActivationCompression(model, bits, seed)
    object.__setattr__(model, "_lowmem_compression", hooks)  # a plain attribute: no state-dict key
    return hooks


def compression_of(model: nn.Module) -> ActivationCompression | None:
    """The compression hooks installed on ``model`` (``apply_compression``), or None."""
    return model.__dict__.get("_lowmem_compression")
