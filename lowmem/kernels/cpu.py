"""The fused 16-bit optimizer updates on the CPU: ``lowmem_kernels.c``, built once, loaded with ctypes.

The source is compiled on first use with the system C compiler (``$CC``, split like a shell word
list, so ``CC="ccache gcc"`` works; else ``cc``) for this machine's CPU, under a name that hashes the
source, the flags, the compiler and the CPU, so a changed file or another machine builds anew. The
cache directory is ``$LOWMEM_CACHE_DIR`` (the kernels directly in it), else
``$XDG_CACHE_HOME/lowmem``, else ``~/.cache/lowmem``.

Loading a shared library runs its code, so the cache is trusted only when it is private: the
directory is created 0700, and one owned by another user or writable by group or others is refused
(a warning; the fallback is used). One process compiles at a time (an ``fcntl`` lock in the
directory); a compile that takes longer than ``COMPILE_TIMEOUT_S`` is abandoned. Each library is
written with a record of its size and SHA-256 (``<library>.sha256``, written atomically after the
library is in place) and checked against it before it is loaded: loading a truncated library maps
pages past its end, and the first touch of one kills the process with SIGBUS, so a library whose
record is missing or differs is deleted and rebuilt (a warning), as is one that does not load or
lacks a function (a corrupt or stale file).

Without a working compiler ``library()`` returns None (logged once) and lowmem uses the plain-torch
fallback (``reference.py``): slower and more operations, the same bits.

The calls release the GIL, so a large update is split across ``torch.get_num_threads()`` threads,
tensor by tensor.
"""

from __future__ import annotations

import _ctypes
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shlex
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import torch

from lowmem.kernels import codebooks

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("lowmem_kernels.c")
# No FMA contraction: the kernels' every multiply and add is rounded on its own, as the reference's.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120  # a compile takes under a second; a hung compiler must not hang training
PARALLEL_ELEMENTS = 1 << 20  # updates of more elements than this run on several threads

_P64 = ctypes.POINTER(ctypes.c_int64)
_PU32 = ctypes.POINTER(ctypes.c_uint32)
_PF32 = ctypes.POINTER(ctypes.c_float)
_i64, _i32, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "lowmem_sgd": [_i64, _P64, _P64, _P64, _P64, _PU32, _i32, _f32, _f32, _i32, _f32, _f32, _i32],
    "lowmem_adam_amax": [_i64, _P64, _P64, _P64, _P64, _P64, _P64, _i32, _f32, _f32, _f32, _f32, _f32, _PF32],
    "lowmem_adam": [_i64, _P64, _P64, _P64, _P64, _P64, _P64, _P64, _PF32, _PF32, _PU32, _i32, _f32, _f32, _f32,
                    _f32, _f32, _i32, _f32, _f32, _i32],
}
_ptr = ctypes.c_void_p
_SIGNATURES |= {
    "lowmem_sgd_q": [_i64, _P64, _P64, _P64, _P64, _P64, _PU32, _PU32, _i32, _i32, _i64, _ptr, _ptr, _f32, _f32,
                     _i32, _f32, _f32, _i32],
    "lowmem_adam_q": [_i64, _P64, _P64, _P64, _P64, _P64, _P64, _P64, _PF32, _PU32, _PU32, _i32, _i32, _i64, _ptr,
                      _ptr, _ptr, _ptr, _f32, _f32, _f32, _f32, _f32, _i32, _f32, _f32, _i32],
}
_SIGNATURES |= {
    "lowmem_densify": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i32, _i64, _i64],
    "lowmem_gather": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i32, _i64, _i64],
    "lowmem_quantize_activation": [_i64, _ptr, _i32, _i32, ctypes.c_uint32, _i64, _i64, _ptr, _ptr, _ptr],
    "lowmem_dequantize_activation": [_i64, _ptr, _ptr, _ptr, _i32, _ptr, _i32, _i64, _i64],
    "lowmem_norm_relu": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i32, _i64, _i64],
}
_RESTYPES = {"lowmem_densify": _i32, "lowmem_gather": _i32}  # the others return nothing
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def cache_dir() -> Path:
    """Where the compiled kernels are kept: ``$LOWMEM_CACHE_DIR``, ``$XDG_CACHE_HOME/lowmem`` or
    ``~/.cache/lowmem`` (XDG: a relative ``XDG_CACHE_HOME`` is ignored)."""
    override = os.environ.get("LOWMEM_CACHE_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "lowmem"


def private_directory(directory: Path) -> None:
    """Create ``directory`` (mode 0700) if missing; PermissionError if another user owns it or group or
    others may write to it (anyone who can write there can put code into every process that loads it)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"the kernel cache {directory} is owned by uid {info.st_uid} with mode "
            f"{stat.S_IMODE(info.st_mode):o}; it must be yours and writable by you alone (chmod 700 it, or set "
            "LOWMEM_CACHE_DIR to another directory)"
        )


@contextlib.contextmanager
def locked(directory: Path, name: str = "lock") -> Iterator[None]:
    """One process (or thread) at a time in what ``directory / name`` guards: the kernels' check,
    build and load by default."""
    descriptor = os.open(directory / name, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def write_atomically(path: Path, data: bytes | Callable[[IO[bytes]], object], mode: int | None = None) -> None:
    """``path`` := ``data`` (bytes, or a function that writes them to the file it is given), through a
    scratch file in its directory, flushed to disk and renamed into place (a reader sees the old file
    or the new one, whole). ``mode``: the file's permissions (default ``mkstemp``'s 0600). The run
    files' writes are these too (``lowmem.run.files``)."""
    descriptor, scratch = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if mode is not None:
            os.chmod(scratch, mode)
        with os.fdopen(descriptor, "wb") as handle:
            data(handle) if callable(data) else handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(scratch, path)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise


def onednn_isa_limit() -> str:
    """The instruction-set limit oneDNN runs under (``ONEDNN_MAX_CPU_ISA``, or its older name
    ``DNNL_MAX_CPU_ISA``), as given; "" where none is set."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", ""))


@functools.cache
def cpu_identity() -> tuple[str, str]:
    """This CPU's model name and its ``flags`` line (``/proc/cpuinfo``; else ``platform.processor()``)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith("flags")), "")
    return model or platform.processor(), flags or platform.processor()


def compiler_command() -> list[str]:
    """``$CC`` as a command line split like a shell's words (``ccache gcc``), else ``cc``."""
    try:
        return shlex.split(os.environ.get("CC", "")) or ["cc"]
    except ValueError as error:
        raise ValueError(f"CC={os.environ['CC']!r} is not a command line a shell could split: {error}") from None


def kernel_path(compiler: Sequence[str]) -> Path:
    """The cached library's path: its name hashes the source, the flags, the compiler (its command and
    ``--version``) and the CPU. Runs ``compiler --version``."""
    version = subprocess.run(
        [*compiler, "--version"], capture_output=True, text=True, check=True, timeout=COMPILE_TIMEOUT_S
    ).stdout
    digest = hashlib.sha256(
        "\n".join([SOURCE.read_text(), " ".join(FLAGS), shlex.join(compiler), version, platform.machine(),
                   cpu_identity()[1]]).encode()
    ).hexdigest()[:16]
    return cache_dir() / f"lowmem_kernels_{digest}.so"


def _build(compiler: Sequence[str], target: Path) -> None:
    """Compile the kernels into ``target``: into a scratch name first, renamed into place when whole;
    then its record (``_record``) beside it."""
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run(
            [*compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True, check=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        os.replace(built, target)
    data = target.read_bytes()
    record = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    write_atomically(_record(target), (json.dumps(record) + "\n").encode())


def _record(target: Path) -> Path:
    """The file holding ``target``'s size and SHA-256, written after it."""
    return target.with_name(target.name + ".sha256")


def _damage(target: Path) -> str | None:
    """What is wrong with the cached library ``target`` as its record tells (it must be loaded only if
    None): no record, another size or another checksum."""
    try:
        record = json.loads(_record(target).read_text())
        size, digest = int(record["bytes"]), str(record["sha256"])
    except FileNotFoundError:
        return "no record of its size and checksum (an older lowmem's, or a build cut short)"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"its record {_record(target).name} is unreadable ({type(error).__name__})"
    data = target.read_bytes()
    if len(data) != size:
        return f"{len(data)} bytes where {size} were written (truncated or overwritten)"
    if hashlib.sha256(data).hexdigest() != digest:
        return "its SHA-256 differs from the one written with it"
    return None


def _load(target: Path) -> ctypes.CDLL:
    """``target`` loaded with its functions' signatures set; OSError or AttributeError if it cannot be."""
    info = target.stat()
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OSError(f"{target} is not the user's own, or others may write to it")
    lib = ctypes.CDLL(str(target))
    try:
        for name, argtypes in _SIGNATURES.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, _RESTYPES.get(name)
    except AttributeError:
        # Unload it, or loading the rebuilt file under the same name would return this one again.
        _ctypes.dlclose(lib._handle)
        raise
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None if they cannot be built here (the reason is logged once)."""
    try:
        compiler = compiler_command()
        target = kernel_path(compiler)
        private_directory(target.parent)
        with locked(target.parent):
            if target.is_file():
                # Checked before loading: a truncated library crashes the process that loads it (SIGBUS).
                damage = _damage(target)
                try:
                    if damage is None:
                        return _load(target)
                except (OSError, AttributeError) as error:
                    damage = str(error)
                log.warning("the cached CPU kernels %s are unusable (%s); rebuilding them", target, damage)
                target.unlink()
                _record(target).unlink(missing_ok=True)
            _build(compiler, target)
            return _load(target)
    except (OSError, AttributeError, ValueError, subprocess.SubprocessError) as error:
        log.warning("lowmem's CPU kernels are unavailable (%s); using the torch fallback", _reason(error))
        return None


def _reason(error: Exception) -> str:
    if isinstance(error, subprocess.CalledProcessError) and error.stderr:
        return error.stderr.strip()[:300]
    if isinstance(error, subprocess.TimeoutExpired):
        return f"{error.cmd[0]} timed out after {error.timeout} s"
    return str(error)[:300]


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lowmem-kernel")


def _addresses(tensors: Sequence[torch.Tensor]) -> ctypes.Array:
    return (ctypes.c_int64 * len(tensors))(*(t.data_ptr() for t in tensors))


def _shards(sizes: Sequence[int]) -> list[list[int]]:
    """Tensor indices split into up to ``torch.get_num_threads()`` groups of similar element counts."""
    threads = torch.get_num_threads()
    if threads < 2 or sum(sizes) < PARALLEL_ELEMENTS:
        return [list(range(len(sizes)))]
    groups: list[list[int]] = [[] for _ in range(threads)]
    loads = [0] * threads
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        lightest = loads.index(min(loads))
        groups[lightest].append(index)
        loads[lightest] += sizes[index]
    return [sorted(group) for group in groups if group]


def _run(call: Callable[[list[int]], None], sizes: Sequence[int]) -> None:
    shards = _shards(sizes)
    if len(shards) == 1:
        call(shards[0])
        return
    for future in [_pool(len(shards)).submit(call, shard) for shard in shards]:
        future.result()


def sgd(
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor],
    keys: Sequence[int] | None,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    grad_scale: float,
) -> None:
    """``reference.sgd`` with the C kernel (contiguous CPU tensors of one 16-bit dtype)."""
    lib, code = library(), DTYPE_CODES[weights[0].dtype]
    sizes = [w.numel() for w in weights]

    def call(shard: list[int]) -> None:
        pick = [weights[i] for i in shard]
        lib.lowmem_sgd(
            len(shard), _addresses(pick), _addresses([grads[i] for i in shard]),
            _addresses([momenta[i] for i in shard] if momentum != 0 else pick),
            (ctypes.c_int64 * len(shard))(*(sizes[i] for i in shard)),
            (ctypes.c_uint32 * len(shard))(*(keys[i] if keys else 0 for i in shard)),
            code, lr, momentum, int(nesterov), weight_decay, grad_scale, int(keys is not None),
        )

    _run(call, sizes)


def adam(
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    log2_scales: Sequence[tuple[torch.Tensor, torch.Tensor]],
    step_sizes: Sequence[float],
    keys: Sequence[int] | None,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    decay: float | None,
    grad_scale: float,
) -> None:
    """``reference.adam`` with the C kernel (contiguous CPU tensors of one 16-bit dtype)."""
    lib, code = library(), DTYPE_CODES[weights[0].dtype]
    sizes = [w.numel() for w in weights]

    def call(shard: list[int]) -> None:
        n = len(shard)
        common = (
            _addresses([exp_avgs[i] for i in shard]), _addresses([exp_avg_sqs[i] for i in shard]),
            (ctypes.c_int64 * n)(*(sizes[i] for i in shard)),
            _addresses([log2_scales[i][0] for i in shard]), _addresses([log2_scales[i][1] for i in shard]),
        )
        grads_here = _addresses([grads[i] for i in shard])
        amax = (ctypes.c_float * (2 * n))()
        lib.lowmem_adam_amax(n, grads_here, *common, code, beta1, beta2, 1 - beta1, 1 - beta2, grad_scale, amax)
        lib.lowmem_adam(
            n, _addresses([weights[i] for i in shard]), grads_here, *common, amax,
            (ctypes.c_float * n)(*(step_sizes[i] for i in shard)),
            (ctypes.c_uint32 * n)(*(keys[i] if keys else 0 for i in shard)),
            code, beta1, beta2, 1 - beta1, 1 - beta2, eps, int(decay is not None),
            1.0 if decay is None else decay, grad_scale, int(keys is not None),
        )

    _run(call, sizes)


def sgd_quantized(
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momenta: Sequence[tuple[torch.Tensor, torch.Tensor]],
    keys: Sequence[int] | None,
    state_keys: Sequence[int],
    *,
    bits: int,
    block_size: int,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    grad_scale: float,
) -> None:
    """``quantized.sgd`` with the C kernel (contiguous CPU tensors; weights FP32, FP16 or BF16)."""
    lib, code = library(), DTYPE_CODES[weights[0].dtype]
    table, mids = codebooks.tables(bits, True, torch.device("cpu"))
    sizes = [w.numel() for w in weights]

    def call(shard: list[int]) -> None:
        n = len(shard)
        lib.lowmem_sgd_q(
            n, _addresses([weights[i] for i in shard]), _addresses([grads[i] for i in shard]),
            _addresses([momenta[i][0] for i in shard]), _addresses([momenta[i][1] for i in shard]),
            (ctypes.c_int64 * n)(*(sizes[i] for i in shard)),
            (ctypes.c_uint32 * n)(*(keys[i] if keys else 0 for i in shard)),
            (ctypes.c_uint32 * n)(*(state_keys[i] for i in shard)),
            code, bits, block_size, table.data_ptr(), mids.data_ptr(), lr, momentum, int(nesterov), weight_decay,
            grad_scale, int(keys is not None),
        )

    _run(call, sizes)


def adam_quantized(
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    exp_avg_sqs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    step_sizes: Sequence[float],
    keys: Sequence[int] | None,
    state_keys: Sequence[int],
    *,
    bits: int,
    block_size: int,
    beta1: float,
    beta2: float,
    eps: float,
    decay: float | None,
    grad_scale: float,
) -> None:
    """``quantized.adam`` with the C kernel (contiguous CPU tensors; weights FP32, FP16 or BF16)."""
    lib, code = library(), DTYPE_CODES[weights[0].dtype]
    m_table, m_mids = codebooks.tables(bits, True, torch.device("cpu"))
    v_table, v_mids = codebooks.tables(bits, False, torch.device("cpu"))
    sizes = [w.numel() for w in weights]

    def call(shard: list[int]) -> None:
        n = len(shard)
        lib.lowmem_adam_q(
            n, _addresses([weights[i] for i in shard]), _addresses([grads[i] for i in shard]),
            _addresses([exp_avgs[i][0] for i in shard]), _addresses([exp_avgs[i][1] for i in shard]),
            _addresses([exp_avg_sqs[i][0] for i in shard]), _addresses([exp_avg_sqs[i][1] for i in shard]),
            (ctypes.c_int64 * n)(*(sizes[i] for i in shard)),
            (ctypes.c_float * n)(*(step_sizes[i] for i in shard)),
            (ctypes.c_uint32 * n)(*(keys[i] if keys else 0 for i in shard)),
            (ctypes.c_uint32 * n)(*(state_keys[i] for i in shard)),
            code, bits, block_size, m_table.data_ptr(), m_mids.data_ptr(), v_table.data_ptr(), v_mids.data_ptr(),
            beta1, beta2, 1 - beta1, 1 - beta2, eps, int(decay is not None), 1.0 if decay is None else decay,
            grad_scale, int(keys is not None),
        )

    _run(call, sizes)


# --- compact sparse weights --------------------------------------------------------------------

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def copies_compact(*tensors: torch.Tensor) -> bool:
    """Whether ``densify`` / ``gather`` below can take these tensors: plain (no subclass but a
    parameter), contiguous CPU tensors of 2, 4 or 8-byte elements, with the C kernels built."""
    for tensor in tensors:  # a loop, not all(...): called several times per compact layer and step
        if type(tensor) not in _PLAIN or not tensor.is_cpu or not tensor.is_contiguous():
            return False
    return tensors[0].element_size() in (2, 4, 8) and library() is not None


def densify(
    dense: torch.Tensor, values: torch.Tensor, columns: torch.Tensor, row_starts: torch.Tensor, row: int,
    planes: tuple[int, int] = (1, 1),
) -> bool:
    """``dense`` (flat) := zeros with ``values`` at their positions (see ``lowmem.techniques.compact``);
    ``planes``: (inner, spatial) of a channels-last weight [outer, inner, spatial] that ``dense``
    holds as [outer, spatial, inner] (default: contiguous). False where the kernel cannot make its
    table of one plane's offsets (a plane over int32, or no memory): nothing written."""
    status = library().lowmem_densify(dense.data_ptr(), values.data_ptr(), columns.data_ptr(), row_starts.data_ptr(),
                                      row_starts.numel() - 1, dense.numel(), row, dense.element_size(), *planes)
    return status == 0


def gather(
    out: torch.Tensor, dense: torch.Tensor, columns: torch.Tensor, row_starts: torch.Tensor, row: int,
    planes: tuple[int, int] = (1, 1),
) -> bool:
    """``out`` := the entries of ``dense`` (flat, ``out``'s dtype) at the active positions; ``planes``
    and the result as ``densify``'s."""
    status = library().lowmem_gather(out.data_ptr(), dense.data_ptr(), columns.data_ptr(), row_starts.data_ptr(),
                                     row_starts.numel() - 1, row, out.element_size(), *planes)
    return status == 0


# --- recomputed BatchNorm-ReLU ------------------------------------------------------------------


def norm_relu_fits(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> bool:
    """Whether ``norm_relu`` can take these: a contiguous plain CPU ``x`` of FP32, FP16 or BF16 with
    at least one dimension, contiguous FP32 ``scale`` and ``shift`` of one value per channel
    (dimension 1), and the C kernels built."""
    return (
        x.device.type == "cpu"
        and x.dim() >= 2
        and x.dtype in DTYPE_CODES
        and type(x) in _PLAIN
        and x.is_contiguous()
        and all(t.dtype == torch.float32 and t.is_contiguous() and t.numel() == x.shape[1] for t in (scale, shift))
        and library() is not None
    )


def norm_relu(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``relu(addcmul(shift, x, scale))`` per channel, rounded once to ``x``'s dtype, in one pass
    (``norm_relu_fits`` must hold): a new tensor like ``x``."""
    lib, out = library(), torch.empty_like(x)
    batch, channels = x.shape[0], x.shape[1]
    plane = x.numel() // max(1, batch * channels)

    def call(first: int, count: int) -> None:
        lib.lowmem_norm_relu(out.data_ptr(), x.data_ptr(), scale.data_ptr(), shift.data_ptr(), channels, plane,
                             DTYPE_CODES[x.dtype], first, count)  # fmt: skip

    _run_groups(call, batch, group_elements=channels * plane)  # the examples, split across threads
    return out


def _group_shards(groups: int, group_elements: int = 256) -> list[tuple[int, int]]:
    """Groups [0, groups) of ``group_elements`` each cut into up to ``torch.get_num_threads()``
    (first, count) ranges: one range below ``PARALLEL_ELEMENTS`` in all."""
    threads = torch.get_num_threads() if groups * group_elements >= PARALLEL_ELEMENTS else 1
    per = max(1, -(-groups // max(1, threads)))  # no groups: no range
    return [(first, min(per, groups - first)) for first in range(0, groups, per)]


def _run_groups(call: Callable[[int, int], None], groups: int, group_elements: int = 256) -> None:
    shards = _group_shards(groups, group_elements)
    if len(shards) == 1:
        call(*shards[0])
        return
    for future in [_pool(len(shards)).submit(call, *shard) for shard in shards]:
        future.result()


def quantize_activation(
    x: torch.Tensor, bits: int, key: int, codes: torch.Tensor, lows: torch.Tensor, steps: torch.Tensor
) -> None:
    """``lowmem.techniques.compression``'s quantization of a contiguous CPU tensor (FP32, FP16 or BF16)
    into ``codes``, ``lows`` and ``steps`` with the C kernel: the torch version's bits."""
    lib, count = library(), x.numel()

    def call(first: int, groups: int) -> None:
        lib.lowmem_quantize_activation(
            count, x.data_ptr(), DTYPE_CODES[x.dtype], bits, key & 0xFFFFFFFF, first, groups,
            codes.data_ptr(), lows.data_ptr(), steps.data_ptr(),
        )  # fmt: skip

    _run_groups(call, lows.numel())


def dequantize_activation(
    codes: torch.Tensor, lows: torch.Tensor, steps: torch.Tensor, bits: int, out: torch.Tensor
) -> None:
    """The values ``quantize_activation`` stored, into the contiguous CPU tensor ``out``."""
    lib, count = library(), out.numel()

    def call(first: int, groups: int) -> None:
        lib.lowmem_dequantize_activation(
            count, codes.data_ptr(), lows.data_ptr(), steps.data_ptr(), bits, out.data_ptr(), DTYPE_CODES[out.dtype],
            first, groups,
        )  # fmt: skip

    _run_groups(call, lows.numel())
