"""FP32 arithmetic for 16-bit operands on a CPU: ``precision.cpu_compute=auto|native|fp32``.

Most CPUs have no fast BF16 or FP16 kernels (those without AVX-512-BF16 or AMX; FP16 convolution
backward is slow even on most with them): PyTorch falls back to reference kernels there, 20-60x
slower than FP32. A GPU computes a 16-bit convolution or matrix product with FP32 accumulation and
rounds the result once; computing the same 16-bit operands in FP32 and rounding the result once is
that arithmetic, at FP32's speed.

``Fp32Arithmetic`` (a context manager) does it for the compute-heavy ops — convolution forward
and backward, the matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ... which ``linear``,
``matmul`` and ``einsum`` become, and their ``out=`` forms, which compiled code calls) and CPU
scaled-dot-product attention forward and backward — in
forward, recomputation and backward alike, by overriding those ops' CPU kernels while it is
entered (every other op runs untouched, at no cost). What is stored stays 16-bit: autograd saves
the op's 16-bit operands (it records above the kernels), and every result is rounded to the
operands' dtype before anything keeps it. The FP32 copies are temporaries of one op, freed when it
returns: kernel scratch, as native kernels have theirs, which a tracker of live tensors does not
see; ``measure_scratch`` measures them (``tests/test_cpu_compute.py`` bounds them).

``cpu_compute``:
- ``native``: the 16-bit kernels as PyTorch has them;
- ``fp32``: every op above in FP32 from its 16-bit operands;
- ``auto`` (default): per kind of op (``KINDS``) and dtype, by a probe timed once per machine
  (``probe_choices``): native only where it is clearly faster than FP32 on the probe
  (``NATIVE_MUST_WIN``: 1.4x), FP32 where it is not, and a close call (within ``CLOSE_CALL``, 1.3x,
  of that bar either way) as the CPU's model and flags say (``feature_choices``), never by timing. Native
  kernels range from twice FP32's speed (AMX; an AMD EPYC with AVX-512-BF16: a whole WRN-28-2 BF16
  step natively in 0.54x FP32's time) to 200 times slower (FP16 convolution backward on AVX-512),
  and per op from 0.6x to 1.5x FP32's time on the same CPU (an Intel Xeon with AVX-512-BF16 without
  AMX: a whole WRN-28-2 step natively 1.4x slower); the FP32 path runs at FP32's speed wherever it
  runs.
On CUDA, or for FP32/FP64 operands, nothing changes.

A run's bits must not depend on how loaded the machine was when it started: where the two ways are
close (BF16 on AVX-512-BF16) a probe timed anew by each process chose either. So ``auto``'s choice
is recorded, the first time it is probed, in ``cpu_compute.json`` beside the compiled kernels
(``lowmem.kernels.cpu.cache_dir()``), under a key of what it depends on (``machine_key``: the CPU's
model and flags, torch's version, CPU capability and thread count, oneDNN's ISA limit, the dtype,
``PROBE_VERSION``), and every later process on the machine takes it from there. The probe is timed
on one thread (``_one_thread``: several threads of a loaded machine wait on each other). One
process probes and writes at a time (a lock in the directory; the file is replaced atomically), so
processes started together use one choice; an unreadable record is probed again with a warning.
Delete the file to probe again. Under ``torch.use_deterministic_algorithms`` (``trainer.deterministic=true``
sets it) ``auto`` is never timed: ``feature_choices`` decides from the CPU's flags alone.

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
import hashlib
import json
import logging
import os
import platform
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from lowmem.kernels import cpu as kernel_cache

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
# A ratio within this factor of the bar is a close call: the probe does not decide it, the CPU's
# flags do (``feature_choices``). Probes of one kind vary by +-15% from process to process: an AMD
# EPYC with AVX-512-BF16 measured its BF16 convolution backward 1.38x and 1.7x faster natively, and
# with a choice recorded per cache directory, runs under two directories (a fresh
# ``LOWMEM_CACHE_DIR``) computed differently. Close calls cost little speed either way.
CLOSE_CALL = 1.3
# Native probe runs this many times over the bar, the fastest of the first ``ABANDON_AFTER`` timed
# runs included, are a slow reference kernel (20-100x FP32's time), not noise: timing stops there.
# Slower runs short of it are noise the fastest of the runs drops. (Stopping at the bar itself let one
# run slowed by the machine flip a kind: an AMD EPYC with AVX-512-BF16, whose native BF16 convolution
# backward beats FP32 1.7x on the probe, was set to FP32 while the other core was busy, and its BF16
# step ran 1.55x slower than native. Stopping at the first run over 4x the bar did the same to every
# BF16 kind on that CPU with 1 thread and other jobs loading both cores: a run the scheduler
# preempts takes one time slice, ~4 ms, more, 15-30x a 0.15-0.3 ms probe.)
ABANDON_OVER_BAR = 4.0
ABANDON_AFTER = 3
# Timed runs per way and kind. The probe runs once per machine (the choice is recorded), so it can
# afford more runs than a per-process probe could: the fastest of 15 is seldom one the machine slowed.
PROBE_REPEATS = 15


class Fp32Arithmetic:
    """Context manager: compute the ops of ``kinds`` whose operands are 16-bit CPU tensors in FP32
    and round each result once to the operands' dtype (the FP32 op applied to the upcast operands,
    then ``.to``), on this thread, until it exits.

    It does so in the ops' CPU kernels (``_CpuKernels``), not as a dispatch mode: the ops it
    computes pay a few microseconds of Python each, every other op nothing (a ``TorchDispatchMode``
    sees every op: about 13 us each, 0.29 s of a 1.7 s microbatched WRN-28-2 step). Nested, the
    innermost context whose kinds include the op's acts. Other threads are not affected.

    A tracker of live tensors (``lowmem.profiler.track_peak``) never sees the FP32 copies: they are
    made inside the ops' kernels, as a native kernel's scratch is. ``measure_scratch=True``
    measures them: ``scratch_peak_bytes``, the most bytes any one op allocated at once (its FP32
    copies and its rounded result); given ``live_bytes`` (a tracker's live total), also
    ``peak_with_scratch_bytes``, the most of ``live_bytes()`` at an op's start plus those bytes.
    """

    def __init__(
        self,
        kinds: frozenset[str] | set[str] = frozenset(KINDS),
        measure_scratch: bool = False,
        live_bytes: Callable[[], int] | None = None,
    ) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown kinds of op {sorted(unknown)}; allowed: {', '.join(KINDS)}")
        self.kinds = frozenset(kinds)
        self.computed: collections.Counter[str] = collections.Counter()  # ops computed in FP32, per kind
        self.measure_scratch = measure_scratch or live_bytes is not None
        self.live_bytes = live_bytes
        self.scratch_peak_bytes = self.peak_with_scratch_bytes = 0

    def __enter__(self) -> Fp32Arithmetic:
        _CpuKernels.install()
        _contexts().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _contexts().remove(self)

    def compute(self, func, kind: str, dtype: torch.dtype, args: tuple, kwargs: dict):
        self.computed[kind] += 1
        handler = _HANDLERS.get(func, _in_fp32)
        if not self.measure_scratch:
            # The FP32 op straight to the kernel this module replaced: dispatched again, it would come
            # back through the override (tens of microseconds of Python for nothing).
            return handler(func, _NATIVE.get(func, func), dtype, args, kwargs)
        live = self.live_bytes() if self.live_bytes is not None else 0
        with _ScratchMeter() as meter:  # it must see the FP32 op's result: dispatched again
            result = handler(func, func, dtype, args, kwargs)
        self.scratch_peak_bytes = max(self.scratch_peak_bytes, meter.peak)
        self.peak_with_scratch_bytes = max(self.peak_with_scratch_bytes, live + meter.peak)
        return result


_thread = threading.local()


def _contexts() -> list[Fp32Arithmetic]:
    """This thread's entered ``Fp32Arithmetic`` contexts, outermost first."""
    if not hasattr(_thread, "contexts"):
        _thread.contexts = []
    return _thread.contexts


# Each overridden op's FP32 kernel as the dispatcher had it (``_CpuKernels.install``), called directly.
_NATIVE: dict = {}
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


class _CpuKernels:
    """The CPU kernels of the ops of ``_KIND_OF``, overridden from the first ``Fp32Arithmetic``
    entered in the process on (registered once: the dispatcher's tables must not change while
    other threads dispatch, so they are not restored on exit either).

    Each override computes in FP32 when an entered context of this thread wants the op's kind and
    its operands are 16-bit CPU tensors; otherwise it calls the kernel it replaced (captured from
    the dispatcher when installed), a few microseconds later. Autograd records above the CPU
    kernels, so what it saves is the ops' 16-bit operands, and its backward ops come back through
    the overrides.
    """

    _lock = threading.Lock()
    _library: torch.library.Library | None = None

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._library is None:
                library = torch.library.Library("aten", "IMPL")
                for func, kind in _KIND_OF.items():
                    name = func._schema.name  # "aten::mm": every op here is its default overload
                    replaced = _cpu_kernel(name)
                    library.impl(name.removeprefix("aten::"), _untraced(_override(func, kind, replaced)), "CPU",
                                 with_keyset=True)  # fmt: skip
                    _NATIVE[func] = functools.partial(replaced.call_boxed, _CPU)
                    if _writes_out(func):
                        out_kernel = _untraced(_out_override(func, kind, _cpu_kernel(f"{name}.out")))
                        library.impl(f"{name.removeprefix('aten::')}.out", out_kernel, "CPU", with_keyset=True)
                cls._library = library


def _untraced(kernel: Callable) -> Callable:
    """``kernel`` with ``torch.compile`` off inside it. A kernel is Python the dispatcher calls, and
    where it is called from a frame that runs eagerly under a compiled model (a frame dynamo gave up
    on: a model's loop over checkpointed blocks), dynamo would otherwise try to compile it and the
    functions it calls, each breaking at the replaced kernel's call, and every later call of them ran
    through the frames dynamo made of them (the GPT-style model of ``scripts/bench_compile.py`` with
    ``cpu_compute=fp32`` and ``residual_star``: 11 breaks against 7 natively). This imports dynamo,
    once per process, where nothing imported it before."""
    return torch.compiler.disable(kernel, recursive=True)


def _cpu_kernel(name: str):
    return torch._C._dispatch_get_computed_kernel_for_dispatch_key(name, torch._C.DispatchKey.CPU)


def _writes_out(func) -> bool:
    """Whether ``func`` has an ``out=`` overload writing one tensor (``torch.mm(a, b, out=c)``):
    compiled code calls the matrix products so (inductor's ``extern_kernels.mm(..., out=buf)``), and
    without its override a compiled 16-bit step ran torch's native kernels, 20-60x slower than FP32
    where they are reference kernels (AVX2)."""
    packet = func.overloadpacket
    if "out" not in packet.overloads():
        return False
    outs = [argument.name for argument in packet.out._schema.arguments if argument.is_out]
    return outs == ["out"]


def _acting(kind: str, args: tuple, kwargs: dict) -> tuple[Fp32Arithmetic, torch.dtype] | None:
    """The innermost entered context of this thread that wants ``kind``, and the operands' 16-bit
    dtype; None where no context wants it or the operands are not 16-bit CPU tensors of one dtype."""
    for context in reversed(_contexts()):
        if kind in context.kinds:
            dtype = _operand_dtype(args, kwargs)
            return None if dtype is None else (context, dtype)
    return None


def _override(func, kind: str, replaced) -> Callable:
    def kernel(keyset, *args, **kwargs):
        acting = _acting(kind, args, kwargs)
        if acting is not None:
            context, dtype = acting
            return context.compute(func, kind, dtype, args, kwargs)
        return replaced.call_boxed(keyset, *args, **kwargs)

    return kernel


def _out_override(func, kind: str, replaced) -> Callable:
    """The override of ``func``'s ``out=`` overload: ``func`` computed as ``_override`` does (FP32,
    rounded once), copied into ``out`` (resized as ``out=`` overloads resize an empty one)."""

    def kernel(keyset, *args, out, **kwargs):
        acting = _acting(kind, args, kwargs)
        if acting is not None and out.dtype == acting[1] and out.device.type == "cpu":
            context, dtype = acting
            result = context.compute(func, kind, dtype, args, kwargs)
            if out.shape != result.shape:
                out.resize_(result.shape)
            return out.copy_(result)
        return replaced.call_boxed(keyset, *args, out=out, **kwargs)

    return kernel


class _ScratchMeter(TorchDispatchMode):
    """The most bytes of storage alive at once among what the ops under it create."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else (result,):
            # New storage only: not a view (of a weight, say), not an operand written in place.
            if isinstance(value, torch.Tensor) and not value._is_view():
                storage = value.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._seen and not _shares_storage(key, args, kwargs):
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, storage.nbytes())
        return result

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


def _shares_storage(key: int, args: tuple, kwargs: dict) -> bool:
    return any(
        isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == key
        for value in (*args, *kwargs.values())
    )


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


def _in_fp32(func, call: Callable, dtype: torch.dtype, args: tuple, kwargs: dict):
    """The op ``func``, run by ``call`` (``func`` itself, or its FP32 kernel: ``_NATIVE``) on FP32
    copies of the ``dtype`` operands; each result rounded once to ``dtype``."""

    def up(value):
        return value.float() if isinstance(value, torch.Tensor) and value.dtype == dtype else value

    # The FP32 copies live for the call only: they die before the results are rounded.
    result = call(*tree_map(up, args), **tree_map(up, kwargs))
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


def _matrix_product_in_fp32(func, call, dtype, args, kwargs):
    """``mm(a, b)`` / ``addmm(bias, a, b, beta=, alpha=)`` in FP32, in blocks along the largest of
    a's rows, b's columns (each result element computed whole, rounded once) and the shared
    dimension (the blocks' products summed in an FP32 result, rounded once at the end)."""
    bias, (a, b) = (None, args) if func is _aten.mm.default else (args[0], args[1:])
    (rows, shared), columns = a.shape, b.shape[1]
    if 4 * (rows * shared + shared * columns + rows * columns) <= BLOCK_BYTES:
        return _in_fp32(func, call, dtype, args, kwargs)
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
    channels = weight.shape[0]
    per_channel = weight.numel() // max(1, channels) * 4
    if groups != 1 or transposed or channels * per_channel <= CHUNK_BYTES:
        return [slice(None)]
    step = max(16, CHUNK_BYTES // per_channel // 16 * 16)
    return [slice(start, min(start + step, channels)) for start in range(0, channels, step)]


def _convolution_in_fp32(func, call, dtype, args, kwargs):
    """``convolution`` in FP32 (run by ``call``), per block of output channels (``_channel_blocks``),
    each block's output rounded once into the 16-bit result."""
    if kwargs:  # the dispatcher passes every argument positionally; anything else whole
        return _in_fp32(func, call, dtype, args, kwargs)
    inputs, weight, bias, *arguments = args
    blocks = _channel_blocks(weight, transposed=arguments[3], groups=arguments[5])
    if len(blocks) == 1:  # the FP32 input and weight die before the result is rounded
        return call(inputs.float(), weight.float(), _up(bias), *arguments).to(dtype)
    inputs = inputs.float()
    output = None
    for block in blocks:
        part = call(inputs, weight[block].float(), _up(bias, block), *arguments)
        if output is None:
            shape = (part.shape[0], weight.shape[0], *part.shape[2:])
            output = torch.empty(shape, dtype=dtype, memory_format=_memory_format(part))
        output[:, block].copy_(part)
        del part
    return output


def _convolution_backward_in_fp32(func, call, dtype, args, kwargs):
    """``convolution_backward`` in FP32, per block of output channels (``_channel_blocks``): each
    block's weight (and bias) gradient is its part of the result; the input's gradient sums the
    blocks' in FP32. Each result is rounded once, into the layout the native op returns.

    The operands are real FP32 copies: a zero-stride stand-in for the operand a gradient does not
    read is materialized by the kernel (a fill as large as the copy, and slower)."""
    if kwargs:  # as in _convolution_in_fp32
        return _in_fp32(func, call, dtype, args, kwargs)
    grad, inputs, weight, bias_sizes, *arguments, output_mask = args
    # arguments: stride, padding, dilation, transposed, output_padding, groups
    backward = call
    blocks = _channel_blocks(weight, transposed=arguments[3], groups=arguments[5])
    if len(blocks) == 1:
        results = backward(grad.float(), inputs.float(), weight.float(), bias_sizes, *arguments, output_mask)
        return tuple(None if result is None else result.to(dtype) for result in results)
    inputs_fp32 = inputs.float()
    grads: list[torch.Tensor | None] = [None, None, None]
    if output_mask[1]:
        grads[1] = torch.empty_like(weight, dtype=dtype)
    if output_mask[2]:
        grads[2] = weight.new_empty(weight.shape[0], dtype=dtype)
    total = None
    for block in blocks:
        part_weight = weight[block].float()
        sizes = None if bias_sizes is None else [part_weight.shape[0]]
        parts = backward(grad[:, block].float(), inputs_fp32, part_weight, sizes, *arguments, output_mask)
        del part_weight
        if parts[0] is not None:
            total = parts[0] if total is None else total.add_(parts[0])
        for result, part in zip(grads[1:], parts[1:], strict=True):
            if result is not None:
                result[block].copy_(part)
        del parts
    del inputs_fp32
    if total is not None:
        grads[0] = total.to(dtype)
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


# --- choosing --------------------------------------------------------------------------------


def check_setting(setting: str) -> None:
    if setting not in CPU_COMPUTE:
        raise ValueError(f"precision.cpu_compute={setting!r} is not one of {', '.join(CPU_COMPUTE)}")


def choices(
    setting: str, dtype: torch.dtype | None, device: torch.device | str, deterministic: bool | None = None
) -> dict[str, str]:
    """Per kind of op, ``"native"`` or ``"fp32"`` for ``dtype`` operands on ``device`` under
    ``precision.cpu_compute=setting``. ``auto``: ``probe_choices`` (probed once per machine and
    recorded), or ``feature_choices`` where ``deterministic`` (default: whether
    ``torch.use_deterministic_algorithms`` is on, as ``trainer.deterministic=true`` sets it). Empty
    where the knob changes nothing: a CUDA device, or a dtype that is not 16-bit."""
    check_setting(setting)
    if torch.device(device).type != "cpu" or dtype not in _SIXTEEN_BIT:
        return {}
    if setting == "auto":
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        return feature_choices(dtype) if deterministic else dict(probe_choices(dtype))
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
    """Whether an ``Fp32Arithmetic`` is entered on this thread."""
    return bool(_contexts())


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


def probe_choices(dtype: torch.dtype) -> tuple[tuple[str, str], ...]:
    """``auto``'s choice per kind for ``dtype`` on this machine with torch's thread count: recorded
    (``cpu_compute.json``), else probed now and recorded; read once per process and logged."""
    return _machine_choices(dtype, torch.get_num_threads())


# Part of a record's key: a change to the probe or to the rule (NATIVE_MUST_WIN, PROBE_REPEATS, the
# probe's problems) makes every machine decide again.
PROBE_VERSION = 4
RECORD = "cpu_compute.json"  # in lowmem.kernels.cpu.cache_dir(), beside the compiled kernels


def machine_key(dtype: torch.dtype, threads: int) -> dict[str, object]:
    """What ``auto``'s choice depends on, other than chance: the record's key."""
    model, flags = kernel_cache.cpu_identity()
    return {
        "cpu": model,
        "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "machine": platform.machine(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),  # ATEN_CPU_CAPABILITY lowers it
        "onednn_max_cpu_isa": kernel_cache.onednn_isa_limit(),
        "threads": threads,
        "dtype": str(dtype).removeprefix("torch."),
        "probe": PROBE_VERSION,
    }


@functools.cache
def _machine_choices(dtype: torch.dtype, threads: int) -> tuple[tuple[str, str], ...]:
    machine = machine_key(dtype, threads)
    try:
        decided, source = _recorded_or_probed(machine, dtype)
    except OSError as error:  # the cache directory refused (not private) or not writable
        log.warning(
            "precision.cpu_compute=auto cannot record its choice (%s): probed for this process alone, so runs may "
            "compute differently; set LOWMEM_CACHE_DIR to a directory of your own, or precision.cpu_compute=fp32 "
            "or native", str(error)[:300],
        )
        with _one_thread():
            decided = decide(dtype, probe_seconds)
        source = "probed, not recorded"
    log.info(
        "precision.cpu_compute=auto on this CPU (%s, %d threads) for %s: %s (%s)",
        machine["capability"], threads, machine["dtype"],
        ", ".join(f"{kind} {choice}" for kind, choice in decided.items()), source,
    )
    return tuple(decided.items())


def _recorded_or_probed(machine: dict[str, object], dtype: torch.dtype) -> tuple[dict[str, str], str]:
    """The choice recorded for ``machine`` in the record file, or one probed now and recorded there
    (under the directory's lock: whoever comes second reads the first one's); and where it came from."""
    directory = kernel_cache.cache_dir()
    kernel_cache.private_directory(directory)
    path = directory / RECORD
    key = hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:16]
    with kernel_cache.locked(directory, RECORD + ".lock"):
        records = _read_records(path)
        entry = records.get(key)
        if entry is not None:
            recorded = _recorded_choices(entry, machine)
            if recorded is not None:
                return recorded, f"recorded {entry.get('probed', '')} in {path}"
            log.warning("precision.cpu_compute=auto: %s holds a damaged record for this machine; probing again", path)
        timings: dict[str, dict[str, float]] = {}

        def timed(kind: str, dtype: torch.dtype, fp32: bool, limit: float | None = None) -> float:
            elapsed = probe_seconds(kind, dtype, fp32, limit=limit)
            timings.setdefault(kind, {})["fp32" if fp32 else "native"] = round(elapsed, 7)
            return elapsed

        with _one_thread():
            decided = decide(dtype, timed)
        records[key] = {
            "machine": machine,
            "choices": decided,
            "seconds": timings,
            "probed": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        document = {"about": "precision.cpu_compute=auto's choices (lowmem.techniques.cpu_compute): delete this file "
                             "to probe again", "records": records}  # fmt: skip
        kernel_cache.write_atomically(path, (json.dumps(document, indent=1, sort_keys=True) + "\n").encode())
    return decided, f"probed now, recorded in {path}"


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Torch's intra-op threads at one while the probe is timed. On several threads each run waits
    for the slowest, and on a loaded machine one of them is often preempted: on a 2-core AMD EPYC
    with other jobs running, 2-thread probe runs of a 0.2 ms op took 100-350 ms, and FP16 native
    convolutions (100x slower than FP32) were chosen. One thread's fastest of 15 runs is steady
    there (FP32 over native within +-3% from probe to probe)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _read_records(path) -> dict[str, dict]:
    """The records of the record file; none if it is missing, and none with a warning if it is not
    one (it is then rewritten whole)."""
    if not path.is_file():
        return {}
    try:
        records = json.loads(path.read_text())["records"]
        if not isinstance(records, dict):
            raise TypeError(f"records is a {type(records).__name__}")
        return records
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning(
            "precision.cpu_compute=auto: %s is not a record of choices (%s: %s); probing again and rewriting it",
            path, type(error).__name__, str(error)[:100],
        )
        return {}


def _recorded_choices(entry: object, machine: dict[str, object]) -> dict[str, str] | None:
    """A record's choices if it is whole and for ``machine``, else None."""
    if not isinstance(entry, dict) or entry.get("machine") != machine or not isinstance(entry.get("choices"), dict):
        return None
    chosen = entry["choices"]
    if set(chosen) != set(KINDS) or not all(chosen[kind] in ("native", "fp32") for kind in KINDS):
        return None
    return {kind: chosen[kind] for kind in KINDS}


def feature_choices(dtype: torch.dtype) -> dict[str, str]:
    """``auto``'s choice without timing anything (close calls, and ``trainer.deterministic=true``):
    native BF16 for every kind where torch and oneDNN may use AVX-512 (capability AVX-512; no lower
    ``ONEDNN_MAX_CPU_ISA``) and the CPU has AMX tiles for BF16 (``amx_bf16``: about twice FP32's
    speed) or is an AMD one with AVX-512-BF16 (Zen 4 on: a whole WRN-28-2 BF16 step natively
    0.5-0.6x FP32's time, while its probe's convolutions are close calls, 1.4-1.55x). FP32
    everywhere else: on an Intel CPU with AVX-512-BF16 but no AMX a whole WRN-28-2 step is 1.4x
    slower natively; elsewhere native is a reference kernel 20-200x slower; FP16 convolution
    backward is slow even with AVX-512-FP16."""
    model, flags = kernel_cache.cpu_identity()
    flags = flags.split()
    isa = kernel_cache.onednn_isa_limit().upper() or "ALL"
    unlimited = isa in ("ALL", "DEFAULT")
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    amx = "amx_bf16" in flags and avx512 and (unlimited or "AMX" in isa)
    amd_bf16 = (
        model.upper().startswith("AMD")
        and "avx512_bf16" in flags
        and avx512
        and (unlimited or any(level in isa for level in ("BF16", "FP16", "AMX")))
    )
    return dict.fromkeys(KINDS, "native" if dtype == torch.bfloat16 and (amx or amd_bf16) else "fp32")


def decide(dtype: torch.dtype, seconds: Callable[..., float]) -> dict[str, str]:
    """Per kind, ``native`` where the FP32 run takes at least ``NATIVE_MUST_WIN`` x ``CLOSE_CALL``
    times the native run, ``fp32`` where it takes at most ``NATIVE_MUST_WIN`` / ``CLOSE_CALL``
    times, and in between (a close call, which the next probe may call otherwise)
    ``feature_choices``' answer, which times nothing. ``seconds(kind, dtype, fp32, limit=None)``:
    the kind's time, natively or in FP32; given a ``limit``, it may stop timing once a run takes
    far longer."""
    features = feature_choices(dtype)
    decided = {}
    for kind in KINDS:
        fp32 = seconds(kind, dtype, True)
        wins, loses = fp32 / (NATIVE_MUST_WIN * CLOSE_CALL), fp32 * CLOSE_CALL / NATIVE_MUST_WIN
        native = seconds(kind, dtype, False, limit=loses)
        decided[kind] = "native" if native <= wins else "fp32" if native >= loses else features[kind]
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


def probe_seconds(
    kind: str,
    dtype: torch.dtype,
    fp32: bool,
    limit: float | None = None,
    repeats: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The fastest of ``repeats`` runs (default ``PROBE_REPEATS``; after one warm-up: first runs pay
    one-time set-up) of ``kind``'s probe in ``dtype``, natively or under ``Fp32Arithmetic``; the
    fastest of the first ``ABANDON_AFTER`` if even it exceeds ``ABANDON_OVER_BAR`` times ``limit`` (a
    reference kernel, which need not be timed again). ``clock``: seconds, for the runs' start and end."""
    repeats = PROBE_REPEATS if repeats is None else repeats
    work = _probe_work(kind, dtype)
    context = (lambda: Fp32Arithmetic({kind})) if fp32 else contextlib.nullcontext
    best = float("inf")
    with torch.no_grad():
        for attempt in range(repeats + 1):
            with context():
                started = clock()
                work()
                elapsed = clock() - started
            if attempt:
                best = min(best, elapsed)
                if attempt >= ABANDON_AFTER and limit is not None and best > ABANDON_OVER_BAR * limit:
                    return best
    return best


def summary(recorded: Mapping[str, object]) -> str:
    """One line for logs and tables: ``auto: convolution fp32, ...``."""
    parts = [f"{kind} {recorded[kind]}" for kind in KINDS if kind in recorded]
    return f"{recorded.get('setting')}: {', '.join(parts)}" if parts else str(recorded.get("setting"))
