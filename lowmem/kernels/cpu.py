"""The fused 16-bit optimizer updates on the CPU: ``lowmem_kernels.c``, built once, loaded with ctypes.

The source is compiled on first use with the system C compiler (``$CC``, else ``cc``) for this
machine's CPU, into ``$LOWMEM_CACHE_DIR`` (default ``~/.cache/lowmem``), under a name that hashes the
source, the flags, the compiler and the CPU, so a changed file or another machine builds anew. The
build is written to a temporary name and renamed into place (concurrent processes are safe). Without
a working compiler ``library()`` returns None (logged once) and lowmem uses the plain-torch
fallback (``reference.py``): slower and more operations, the same results.

The calls release the GIL, so a large update is split across ``torch.get_num_threads()`` threads,
tensor by tensor.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("lowmem_kernels.c")
# No FMA contraction: the kernels' FMAs are explicit, the same as the reference's.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
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
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}


def cache_dir() -> Path:
    return Path(os.environ.get("LOWMEM_CACHE_DIR") or Path.home() / ".cache" / "lowmem")


def _cpu_fingerprint() -> str:
    try:
        flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
        return flags[0] if flags else platform.processor()
    except OSError:
        return platform.processor()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None if they cannot be built here (the reason is logged once)."""
    compiler = os.environ.get("CC", "cc")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
        digest = hashlib.sha256(
            "\n".join([SOURCE.read_text(), " ".join(FLAGS), version, platform.machine(), _cpu_fingerprint()]).encode()
        ).hexdigest()[:16]
        target = cache_dir() / f"lowmem_kernels_{digest}.so"
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                built = Path(scratch) / target.name
                subprocess.run(
                    [compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True, check=True
                )
                os.replace(built, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        log.warning("lowmem's CPU kernels could not be built (%s); using the torch fallback", detail.strip()[:300])
        return None
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, None
    return lib


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
