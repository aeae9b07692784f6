"""FP32 arithmetic for 16-bit operands on a CPU: ``precision.cpu_compute=auto|native|fp32``.

Most CPUs have no fast BF16 or FP16 kernels (those without AVX-512-BF16 or AMX; FP16 convolution
backward is slow even on most with them): PyTorch falls back to reference kernels there, 20-60x
slower than FP32. A GPU computes a 16-bit convolution or matrix product with FP32 accumulation and
rounds the result once; computing the same 16-bit operands in FP32 and rounding the result once is
that arithmetic, at FP32's speed.

``Fp32Arithmetic`` (a ``TorchDispatchMode``) does it for the compute-heavy ops — convolution forward
and backward, the matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ... which ``linear``,
``matmul`` and ``einsum`` become) and CPU scaled-dot-product attention forward and backward — in
forward, recomputation and backward alike. What is stored stays 16-bit: autograd saves the op's
16-bit operands (it records above this mode), and every result is rounded to the operands' dtype
before anything keeps it. The FP32 copies are temporaries of one op, freed when it returns: kernel
scratch, as native kernels have theirs. lowmem's measured CPU peaks enter the mode outside their
tracker, which so sees each op's 16-bit operands and result and not the scratch, as it sees
neither the native kernels' (and as the CUDA path has none); a tracker entered inside it counts
them (``tests/test_cpu_compute.py`` bounds them). Only the outermost context acts.

``cpu_compute``:
- ``native``: the 16-bit kernels as PyTorch has them;
- ``fp32``: every op above in FP32 from its 16-bit operands;
- ``auto`` (default): per kind of op (``KINDS``) and dtype, by a probe timed once per process (a
  few milliseconds, ``probe_choices``): native only where it is clearly faster than FP32 on the
  probe (``NATIVE_MUST_WIN``: 1.4x), else FP32. Native kernels range from twice FP32's speed (AMX) to
  200 times slower (FP16 convolution backward on AVX-512), and per op from 0.6x to 1.5x FP32's
  time on the same CPU (AVX-512-BF16 without AMX: a whole WRN-28-2 step natively 1.4x slower);
  the FP32 path runs at FP32's speed wherever it runs.
On CUDA, or for FP32/FP64 operands, nothing changes.

Each op's FP32 copies are fresh allocations of up to a few tens of MB. By default glibc serves
such sizes by ``mmap`` or returns freed memory at the top of its heap to the system, so each
copy's pages are faulted in anew: a WRN-28-2 BF16 step took 1.2-1.3x the FP32 step that way, and
equal time without. So where FP32 is chosen, ``reuse_freed_memory`` sets, once per process,
glibc's mmap threshold to its maximum (32 MiB) and its trim threshold to 1 GiB: freed memory stays
in the heap for the next op, as PyTorch's CUDA allocator keeps it cached. The peak is the same;
the process's resident memory stays at its high-water mark (up to 1 GiB more). Not where the
user's environment sets ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_``, and not
without glibc.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_map

log = logging.getLogger(__name__)

CPU_COMPUTE = ("auto", "native", "fp32")

# The kinds of op a choice is made for; the probe times one of each.
KINDS = ("convolution", "convolution_backward", "matmul")

_aten = torch.ops.aten
_KIND_OF = {
    _aten.convolution.default: "convolution",
    _aten.convolution_backward.default: "convolution_backward",
    **dict.fromkeys(
        (
            _aten.mm.default,
            _aten.addmm.default,
            _aten.bmm.default,
            _aten.baddbmm.default,
            _aten.addbmm.default,
            _aten.mv.default,
            _aten.addmv.default,
            _aten.dot.default,
            _aten._scaled_dot_product_flash_attention_for_cpu.default,
            _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        ),
        "matmul",
    ),
}
# Outputs that the native op returns in FP32 whatever its operands (attention's log-sum-exp).
_FP32_OUTPUTS = {_aten._scaled_dot_product_flash_attention_for_cpu.default: {1}}

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)

# ``auto`` keeps a native kernel only where the FP32 path takes this many times its time on the probe.
# On AVX-512-BF16 without AMX the two BF16 ways tie on the probe within +-30% from run to run while
# a whole WRN-28-2 step is 1.4x slower natively; native FP16 matrix products (AVX-512-FP16) win by
# 1.4-1.5x there, and with AMX native BF16 is about twice as fast.
NATIVE_MUST_WIN = 1.4


class Fp32Arithmetic(TorchDispatchMode):
    """Compute the ops of ``kinds`` whose operands are 16-bit CPU tensors in FP32 and round each
    result once to the operands' dtype (the FP32 op applied to the upcast operands, then ``.to``)."""

    def __init__(self, kinds: frozenset[str] | set[str] = frozenset(KINDS)) -> None:
        super().__init__()
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown kinds of op {sorted(unknown)}; allowed: {', '.join(KINDS)}")
        self.kinds = frozenset(kinds)
        self.computed: collections.Counter[str] = collections.Counter()  # ops computed in FP32, per kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _KIND_OF.get(func)
        if kind in self.kinds:
            dtype = _operand_dtype(args, kwargs)
            if dtype is not None:
                self.computed[kind] += 1
                return _HANDLERS.get(func, _in_fp32)(func, dtype, args, kwargs)
        return func(*args, **kwargs)


def _operand_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The 16-bit dtype of the op's CPU operands, or None (not all on the CPU, no 16-bit operand,
    or two 16-bit dtypes mixed, which the native op refuses: left to it)."""
    dtypes = set()
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                return None
            if value.dtype in _SIXTEEN_BIT:
                dtypes.add(value.dtype)
    return dtypes.pop() if len(dtypes) == 1 else None


def _in_fp32(func, dtype: torch.dtype, args: tuple, kwargs: dict):
    def up(value):
        return value.float() if isinstance(value, torch.Tensor) and value.dtype == dtype else value

    # The FP32 copies live for the call only: they die before the results are rounded.
    result = func(*tree_map(up, args), **tree_map(up, kwargs))
    keep = _FP32_OUTPUTS.get(func, ())

    def down(value):
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.dtype == torch.float32 else value

    if isinstance(result, torch.Tensor):
        return down(result)
    return type(result)(value if index in keep else down(value) for index, value in enumerate(result))


# A matrix product whose FP32 operands and result exceed this runs in blocks of about a quarter of
# it, so that an op's FP32 copies stay bounded (a DynamicConv output projection's FP32 logits alone
# are ~100 MB). Blocks this large cost no measured time; blocks of 1 MB cost up to 1.6x on large
# products (AVX2, 2 threads).
BLOCK_BYTES = 16 << 20


def _matrix_product_in_fp32(func, dtype, args, kwargs):
    """``mm(a, b)`` / ``addmm(bias, a, b, beta=, alpha=)`` in FP32, in blocks along the largest of
    a's rows, b's columns (each result element computed whole, rounded once) and the shared
    dimension (the blocks' products summed in an FP32 result, rounded once at the end)."""
    bias, (a, b) = (None, args) if func is _aten.mm.default else (args[0], args[1:])
    (rows, shared), columns = a.shape, b.shape[1]
    if 4 * (rows * shared + shared * columns + rows * columns) <= BLOCK_BYTES:
        return _in_fp32(func, dtype, args, kwargs)
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    largest = max(rows, shared, columns)
    if largest == shared:
        step = max(1, BLOCK_BYTES // 4 // (4 * (rows + columns)))
        total = None
        for start in range(0, shared, step):
            block = slice(start, start + step)
            part_a, part_b = a[:, block].float(), b[block].float()
            if total is None:
                total = torch.mm(part_a, part_b) if bias is None else \
                    torch.addmm(_up(bias), part_a, part_b, beta=beta, alpha=alpha)  # fmt: skip
            else:
                total.addmm_(part_a, part_b, alpha=alpha)
        return total.to(dtype)
    result = torch.empty((rows, columns), dtype=dtype)
    by_rows = largest == rows
    whole = b.float() if by_rows else a.float()
    step = max(1, BLOCK_BYTES // 4 // (4 * (shared + (columns if by_rows else rows))))
    for start in range(0, largest, step):
        block = slice(start, start + step)
        index = (block, slice(None)) if by_rows else (slice(None), block)
        operands = (a[block].float(), whole) if by_rows else (whole, b[:, block].float())
        if bias is None:
            part = torch.mm(*operands)
        else:
            broadcast = bias.expand(rows, columns)[index]
            part = torch.addmm(broadcast.float(), *operands, beta=beta, alpha=alpha)
        result[index].copy_(part)
        del part
    return result


# The most FP32 weight one convolution call holds: larger weights run in blocks of output channels
# (their FP32 copies and FP32 weight gradients would otherwise add twice the 16-bit weight to the
# peak, which at small batches is most of it).
CHUNK_BYTES = 1 << 20


def _channel_blocks(weight: torch.Tensor, transposed: bool, groups: int) -> list[slice]:
    """Blocks of output channels (multiples of 16) whose FP32 weight is at most ``CHUNK_BYTES``;
    one block, the whole weight, when it is small, grouped or transposed."""
    channels, per_channel = weight.shape[0], weight[0].numel() * 4
    if groups != 1 or transposed or channels * per_channel <= CHUNK_BYTES:
        return [slice(None)]
    step = max(16, CHUNK_BYTES // per_channel // 16 * 16)
    return [slice(start, min(start + step, channels)) for start in range(0, channels, step)]


def _convolution_in_fp32(func, dtype, args, kwargs):
    """``convolution`` in FP32, per block of output channels (``_channel_blocks``), each block's
    output rounded once into the 16-bit result."""
    if kwargs:  # the dispatcher passes every argument positionally; anything else whole
        return _in_fp32(func, dtype, args, kwargs)
    inputs, weight, bias, *arguments = args
    blocks = _channel_blocks(weight, transposed=arguments[3], groups=arguments[5])
    if len(blocks) == 1:  # the FP32 input and weight die before the result is rounded
        return _aten.convolution.default(inputs.float(), weight.float(), _up(bias), *arguments).to(dtype)
    inputs = inputs.float()
    output = None
    for block in blocks:
        part = _aten.convolution.default(inputs, weight[block].float(), _up(bias, block), *arguments)
        if output is None:
            shape = (part.shape[0], weight.shape[0], *part.shape[2:])
            output = torch.empty(shape, dtype=dtype, memory_format=_memory_format(part))
        output[:, block].copy_(part)
        del part
    return output


def _convolution_backward_in_fp32(func, dtype, args, kwargs):
    """``convolution_backward`` in FP32: the weight's gradient (and the bias's), then the input's,
    per block of output channels (``_channel_blocks``). Each gradient needs only the other
    operand's shape, given as a zero-stride stand-in, so the FP32 weight and the FP32 weight
    gradient are never alive together (a channels-last input is passed whole: a stand-in cannot
    carry its layout, which the kernel follows). The input's gradient sums the blocks' in FP32;
    each result is rounded once, into the layout of its operand as the native op returns it."""
    if kwargs:  # as in _convolution_in_fp32
        return _in_fp32(func, dtype, args, kwargs)
    grad, inputs, weight, bias_sizes, *arguments, output_mask = args
    # arguments: stride, padding, dilation, transposed, output_padding, groups
    backward = _aten.convolution_backward.default
    blocks = _channel_blocks(weight, transposed=arguments[3], groups=arguments[5])
    whole = grad.float() if len(blocks) == 1 else None
    grad_of = (lambda block: whole) if whole is not None else (lambda block: grad[:, block].float())
    grads: list[torch.Tensor | None] = [None, None, None]
    # The weight's gradient first: then the FP32 input dies before the input's gradient is made,
    # and the FP32 output gradient before that is rounded (the fewest FP32 activations at once).
    if output_mask[1] or output_mask[2]:
        inputs_fp32 = inputs.float()
        if output_mask[1]:
            grads[1] = torch.empty_like(weight, dtype=dtype)
        if output_mask[2]:
            grads[2] = weight.new_empty(weight.shape[0], dtype=dtype)
        mask = [False, output_mask[1], output_mask[2]]
        for block in blocks:
            channels = weight[block].shape[0]
            sizes = None if bias_sizes is None else [channels]
            _, weight_part, bias_part = backward(
                grad_of(block), inputs_fp32, _stand_in(weight[block]), sizes, *arguments, mask
            )
            for result, part in ((grads[1], weight_part), (grads[2], bias_part)):
                if result is not None:
                    result[block].copy_(part)
            del weight_part, bias_part
        del inputs_fp32
    if output_mask[0]:
        shape_of_inputs = _stand_in(inputs) if inputs.is_contiguous() else inputs.float()
        total = None
        for block in blocks:
            part = backward(grad_of(block), shape_of_inputs, weight[block].float(), None, *arguments,
                            [True, False, False])[0]  # fmt: skip
            total = part if total is None else total.add_(part)
            del part
        del shape_of_inputs, whole, grad_of
        grads[0] = torch.empty_like(inputs).copy_(total)
        del total
    return tuple(grads)


_HANDLERS = {  # ops computed in blocks; every other op of _KIND_OF: _in_fp32
    _aten.convolution.default: _convolution_in_fp32,
    _aten.convolution_backward.default: _convolution_backward_in_fp32,
    _aten.mm.default: _matrix_product_in_fp32,
    _aten.addmm.default: _matrix_product_in_fp32,
}


def _memory_format(tensor: torch.Tensor) -> torch.memory_format:
    """Channels-last for a channels-last 4-d tensor (as the native convolution returns it)."""
    channels_last = tensor.dim() == 4 and not tensor.is_contiguous()
    return torch.channels_last if channels_last and tensor.is_contiguous(memory_format=torch.channels_last) \
        else torch.contiguous_format  # fmt: skip


def _up(tensor: torch.Tensor | None, block: slice = slice(None)) -> torch.Tensor | None:
    return None if tensor is None else tensor[block].float()


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """An FP32 tensor of ``tensor``'s shape holding one element (its values are never read)."""
    return torch.empty((), dtype=torch.float32).expand(tensor.shape)


# --- choosing --------------------------------------------------------------------------------


def check_setting(setting: str) -> None:
    if setting not in CPU_COMPUTE:
        raise ValueError(f"precision.cpu_compute={setting!r} is not one of {', '.join(CPU_COMPUTE)}")


def choices(setting: str, dtype: torch.dtype | None, device: torch.device | str) -> dict[str, str]:
    """Per kind of op, ``"native"`` or ``"fp32"`` for ``dtype`` operands on ``device`` under
    ``precision.cpu_compute=setting`` (``auto`` probes once per process and dtype). Empty where the
    knob changes nothing: a CUDA device, or a dtype that is not 16-bit."""
    check_setting(setting)
    if torch.device(device).type != "cpu" or dtype not in _SIXTEEN_BIT:
        return {}
    if setting == "auto":
        return dict(probe_choices(dtype))
    return dict.fromkeys(KINDS, setting)


def compute_context(
    setting: str, dtype: torch.dtype | None, device: torch.device | str
) -> contextlib.AbstractContextManager:
    """The context 16-bit CPU work runs in: ``Fp32Arithmetic`` for the kinds chosen ``fp32``, or
    nothing at all (no dispatch overhead) where every kind stays native."""
    return context_for(choices(setting, dtype, device))


def context_for(chosen: Mapping[str, str]) -> contextlib.AbstractContextManager:
    """``compute_context`` for choices already made (``choices``; a resumed run's, from its checkpoint)."""
    kinds = {kind for kind, choice in chosen.items() if choice == "fp32"}
    if not kinds or active():
        return contextlib.nullcontext()  # nothing to do, or an enclosing one decides
    reuse_freed_memory()
    return Fp32Arithmetic(kinds)


def active() -> bool:
    """Whether an ``Fp32Arithmetic`` is on this thread's dispatch mode stack."""
    return any(isinstance(mode, Fp32Arithmetic) for mode in _get_current_dispatch_mode_stack())


# glibc's mallopt parameters: (number, value, environment variable that sets it at start-up).
_MALLOPT = (
    (-3, 32 * 1024 * 1024, "MALLOC_MMAP_THRESHOLD_"),  # M_MMAP_THRESHOLD, the most glibc accepts on 64-bit
    (-1, 1024 * 1024 * 1024, "MALLOC_TRIM_THRESHOLD_"),  # M_TRIM_THRESHOLD
)


@functools.cache
def reuse_freed_memory() -> bool:
    """Keep freed memory in glibc's heap for reuse instead of faulting in fresh pages for every
    op's FP32 copies (see the module docstring); once per process. Whether it was set."""
    if any(variable in os.environ for _, _, variable in _MALLOPT):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    done = all([bool(mallopt(parameter, value)) for parameter, value, _ in _MALLOPT])
    if done:
        log.info("cpu compute: glibc keeps freed memory for reuse (mmap threshold 32 MiB, trim threshold 1 GiB)")
    return done


@functools.cache
def probe_choices(dtype: torch.dtype) -> tuple[tuple[str, str], ...]:
    """``auto``'s choice per kind for ``dtype`` on this CPU, timed once per process and logged."""
    decided = decide(dtype, probe_seconds)
    log.info(
        "precision.cpu_compute=auto on this CPU (%s) for %s: %s",
        torch.backends.cpu.get_cpu_capability(),
        str(dtype).removeprefix("torch."),
        ", ".join(f"{kind} {choice}" for kind, choice in decided.items()),
    )
    return tuple(decided.items())


def decide(dtype: torch.dtype, seconds: Callable[..., float]) -> dict[str, str]:
    """Per kind, ``native`` where the FP32 run takes at least ``NATIVE_MUST_WIN`` times the native
    run, else ``fp32``. ``seconds(kind, dtype, fp32, limit=None)``: the kind's time, natively or in
    FP32; given a ``limit``, it may stop timing (and return) once a run takes longer."""
    decided = {}
    for kind in KINDS:
        bar = seconds(kind, dtype, True) / NATIVE_MUST_WIN  # what native must beat
        decided[kind] = "native" if seconds(kind, dtype, False, limit=bar) <= bar else "fp32"
    return decided


# The probe's problems: large enough that a fast kernel is past its fixed costs (smaller ones
# favour FP32 by too little to tell), small enough that one run of a slow reference kernel takes
# milliseconds (tens at most: FP16 convolution backward on AVX-512).
def _probe_work(kind: str, dtype: torch.dtype) -> Callable[[], object]:
    generator = torch.Generator().manual_seed(0)
    if kind == "matmul":
        a, b = (torch.randn(256, 256, generator=generator).to(dtype) for _ in range(2))
        return lambda: torch.mm(a, b)
    x = torch.randn(8, 32, 16, 16, generator=generator).to(dtype)
    weight = torch.randn(32, 32, 3, 3, generator=generator).to(dtype)
    if kind == "convolution":
        return lambda: F.conv2d(x, weight, padding=1)
    grad = torch.randn(8, 32, 16, 16, generator=generator).to(dtype)
    return lambda: _aten.convolution_backward(
        grad, x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False]
    )


def probe_seconds(kind: str, dtype: torch.dtype, fp32: bool, limit: float | None = None, repeats: int = 5) -> float:
    """The fastest of ``repeats`` runs (after one warm-up: first runs pay one-time set-up) of
    ``kind``'s probe in ``dtype``, natively or under ``Fp32Arithmetic``; the time of the first
    timed run that exceeds ``limit``, as soon as one does."""
    work = _probe_work(kind, dtype)
    context = (lambda: Fp32Arithmetic({kind})) if fp32 else contextlib.nullcontext
    best = float("inf")
    with torch.no_grad():
        for attempt in range(repeats + 1):
            with context():
                started = time.perf_counter()
                work()
                elapsed = time.perf_counter() - started
            if attempt:
                if limit is not None and elapsed > limit:
                    return elapsed
                best = min(best, elapsed)
    return best


def summary(recorded: Mapping[str, object]) -> str:
    """One line for logs and tables: ``auto: convolution fp32, ...``."""
    parts = [f"{kind} {recorded[kind]}" for kind in KINDS if kind in recorded]
    return f"{recorded.get('setting')}: {', '.join(parts)}" if parts else str(recorded.get("setting"))
