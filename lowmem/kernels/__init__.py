"""Fused multi-tensor optimizer updates for 16-bit weights: one operation per parameter group.

``sgd`` and ``adam`` update a list of FP16 or BF16 tensors (weights, gradients, optimizer state all
in that dtype) in place, computing every element in FP32 (``reference.py`` defines the arithmetic).
Where the update runs:

- CPU: a C kernel built on first use (``cpu.py``), one ``lowmem::sgd16_`` / ``lowmem::adam16_``
  operation, no temporaries;
- CUDA: a Triton kernel (``triton_kernels.py``), one launch (Adam: two);
- anywhere else, or where neither can be built, or with ``LOWMEM_KERNELS=torch``: the plain-torch
  reference, slice by slice (temporaries of a few 16K-element slices; more operations).

Both fused paths are registered as torch operators, so profilers and dispatch modes see each update
as the single operation it is.

A fused kernel proves itself before it updates a run's weights: the first call of each kind (update,
device, dtype, state width) in a process first runs it and the fallback on a small probe from the
same inputs (``verified``). The C kernel must give the fallback's bits; Triton (whose division by
the loss scale may differ from torch's CUDA kernels in the last bit) must agree within two units in
the last place and 1% of the state codes. A kernel that fails to build, launch or agree is not used
again on that device in this process: one warning names it, and the fallback does its work
(``backend`` then says "torch", as checkpoints record).

``sgd_quantized`` and ``adam_quantized`` are the same updates with 8- or 4-bit blockwise-quantized
state (``quantized.py``) for FP32, FP16 or BF16 weights, on the same three backends
(``lowmem::sgd_q_`` / ``lowmem::adam_q_``).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Sequence

import torch

from lowmem.kernels import cpu, quantized, reference

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch")
_verified: dict[tuple, bool] = {}  # (kind, device, dtype, bits, block size) -> the fused kernel agreed
_refused: set[str] = set()  # devices (str) whose fused kernels failed their check: the fallback there


def backend(device: torch.device) -> str:
    """"cpu", "triton" or "torch": what updates 16-bit tensors on ``device`` here."""
    choice = os.environ.get("LOWMEM_KERNELS", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"LOWMEM_KERNELS={choice!r} is unknown; allowed: {', '.join(BACKENDS)}")
    if choice == "torch" or str(device) in _refused:
        return "torch"
    if device.type == "cpu" and cpu.library() is not None:
        return "cpu"
    if device.type == "cuda" and _triton_available():
        return "triton"
    return "torch"


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def verified(
    kind: str, device: torch.device, dtype: torch.dtype, bits: int | None = None, block_size: int = 128
) -> bool:
    """Whether the fused ``kind`` kernel ("sgd", "adam", "sgd_q", "adam_q") agrees with the fallback on
    ``device`` for ``dtype`` (see the module docstring); checked once per process."""
    key = (kind, str(device), dtype, bits, block_size)
    if key not in _verified:
        try:
            problem = _probe(kind, device, dtype, bits, block_size)
        except Exception as error:  # noqa: BLE001 - a kernel that does not build or launch here
            problem = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        _verified[key] = problem is None
        if problem is not None:
            _refused.add(str(device))
            log.warning(
                "lowmem's fused %s optimizer kernel (%s, %s%s) failed its check against the torch fallback (%s); the "
                "fallback updates this run's weights on %s from now on", kind, backend_name(device), dtype,
                f", {bits}-bit state" if bits else "", problem, device,
            )
    return _verified[key]


def backend_name(device: torch.device) -> str:
    return "C" if device.type == "cpu" else "Triton"


def _probe(kind: str, device: torch.device, dtype: torch.dtype, bits: int | None, block_size: int) -> str | None:
    """Run the fused kernel and the fallback from the same small inputs; what differs, or None."""
    generator = torch.Generator().manual_seed(0)
    sizes = (2 * block_size + 77, 77)

    def make(scale: float, positive: bool = False) -> list[torch.Tensor]:
        made = [torch.randn(n, generator=generator) * scale for n in sizes]
        return [(t.abs() if positive else t).to(dtype).to(device) for t in made]

    weights, grads = make(0.1), make(50.0)
    keys = reference.tensor_keys(1, 1, len(sizes)) if dtype != torch.float32 else None
    first, second = make(1.0), make(100.0, positive=True)  # the state both paths start from
    native = _native(device)
    runs = []
    for fused in (True, False):
        w = [t.clone() for t in weights]
        if kind == "sgd":
            momenta = [t.clone() for t in first]
            call: Callable = native.sgd if fused else reference.sgd
            call(w, grads, momenta, keys, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4, grad_scale=64.0)
            state = momenta
        elif kind == "adam":
            m, v = [t.clone() for t in first], [t.clone() for t in second]
            scales = [(torch.tensor(3.0, device=device), torch.tensor(-2.0, device=device)) for _ in sizes]
            call = native.adam if fused else reference.adam
            call(w, grads, m, v, scales, [1e-3] * len(sizes), keys, beta1=0.9, beta2=0.999, eps=1e-8, decay=0.9999,
                 grad_scale=64.0)
            state = [*m, *v, *(t for pair in scales for t in pair)]
        else:
            m = [quantized.quantize(t.float(), bits, block_size, True) for t in first]
            state_keys = reference.tensor_keys(2, 1, len(sizes))
            if kind == "sgd_q":
                call = native.sgd_quantized if fused else quantized.sgd
                call(w, grads, m, keys, state_keys, bits=bits, block_size=block_size, lr=0.1, momentum=0.9,
                     nesterov=True, weight_decay=5e-4, grad_scale=64.0)
                state = [t for q in m for t in q]
            else:
                v = [quantized.quantize(t.float(), bits, block_size, False) for t in second]
                call = native.adam_quantized if fused else quantized.adam
                call(w, grads, m, v, [1e-3] * len(sizes), keys, state_keys, bits=bits, block_size=block_size, beta1=0.9,
                     beta2=0.999, eps=1e-8, decay=0.9999, grad_scale=64.0)
                state = [t for q in (*m, *v) for t in q]
        runs.append([*w, *state])
    exact = device.type == "cpu"
    for a, b in zip(*runs, strict=True):
        if torch.equal(a, b):
            continue
        if exact:
            return "different bits"
        if a.dtype == torch.uint8:  # quantized codes
            if (a != b).float().mean() > 0.01:
                return "state codes differ"
            continue
        ulp = torch.finfo(a.dtype).eps
        a, b = a.float(), b.float()
        if not torch.isfinite(a).all() or not torch.isfinite(b).all():
            return "non-finite values"
        if ((a - b).abs() > 2 * ulp * b.abs() + 1e-30).float().mean() > 0.01:
            return "values differ beyond the last bits"
    return None


def _native(device: torch.device):
    if device.type == "cpu":
        return cpu
    from lowmem.kernels import triton_kernels

    return triton_kernels


@torch.library.custom_op("lowmem::sgd16_", mutates_args=("weights", "momenta"))
def _sgd16(
    weights: list[torch.Tensor],
    grads: list[torch.Tensor],
    momenta: list[torch.Tensor],
    keys: list[int],
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    grad_scale: float,
    stochastic: bool,
) -> None:
    _native(weights[0].device).sgd(
        weights, grads, momenta, keys if stochastic else None, lr=lr, momentum=momentum, nesterov=nesterov,
        weight_decay=weight_decay, grad_scale=grad_scale,
    )


@torch.library.custom_op("lowmem::adam16_", mutates_args=("weights", "exp_avgs", "exp_avg_sqs", "m_scales", "v_scales"))
def _adam16(
    weights: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    m_scales: list[torch.Tensor],
    v_scales: list[torch.Tensor],
    step_sizes: list[float],
    keys: list[int],
    beta1: float,
    beta2: float,
    eps: float,
    decay: float,
    decays: bool,
    grad_scale: float,
    stochastic: bool,
) -> None:
    _native(weights[0].device).adam(
        weights, grads, exp_avgs, exp_avg_sqs, list(zip(m_scales, v_scales, strict=True)), step_sizes,
        keys if stochastic else None, beta1=beta1, beta2=beta2, eps=eps, decay=decay if decays else None,
        grad_scale=grad_scale,
    )


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
    """SGD (``reference.sgd``) over 16-bit tensors of one dtype on one device, in place."""
    device, dtype = weights[0].device, weights[0].dtype
    if backend(device) == "torch" or not _all_contiguous(weights, grads, momenta) or not verified("sgd", device, dtype):
        reference.sgd(weights, grads, momenta, keys, lr=lr, momentum=momentum, nesterov=nesterov,
                      weight_decay=weight_decay, grad_scale=grad_scale)
        return
    torch.ops.lowmem.sgd16_(
        list(weights), list(grads), list(momenta), list(keys or []), lr, momentum, nesterov, weight_decay,
        grad_scale, keys is not None,
    )


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
    """Adam (``reference.adam``) over 16-bit tensors of one dtype on one device, in place."""
    device, dtype = weights[0].device, weights[0].dtype
    if (
        backend(device) == "torch"
        or not _all_contiguous(weights, grads, exp_avgs, exp_avg_sqs)
        or not verified("adam", device, dtype)
    ):
        reference.adam(weights, grads, exp_avgs, exp_avg_sqs, log2_scales, step_sizes, keys, beta1=beta1,
                       beta2=beta2, eps=eps, decay=decay, grad_scale=grad_scale)
        return
    torch.ops.lowmem.adam16_(
        list(weights), list(grads), list(exp_avgs), list(exp_avg_sqs), [m for m, _ in log2_scales],
        [v for _, v in log2_scales], list(step_sizes), list(keys or []), beta1, beta2, eps,
        1.0 if decay is None else decay, decay is not None, grad_scale, keys is not None,
    )


@torch.library.custom_op("lowmem::sgd_q_", mutates_args=("weights", "codes", "scales"))
def _sgd_q(
    weights: list[torch.Tensor],
    grads: list[torch.Tensor],
    codes: list[torch.Tensor],
    scales: list[torch.Tensor],
    keys: list[int],
    state_keys: list[int],
    bits: int,
    block_size: int,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    grad_scale: float,
    stochastic: bool,
) -> None:
    native = _native(weights[0].device)
    native.sgd_quantized(
        weights, grads, list(zip(codes, scales, strict=True)), keys if stochastic else None, state_keys, bits=bits,
        block_size=block_size, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
        grad_scale=grad_scale,
    )


@torch.library.custom_op("lowmem::adam_q_", mutates_args=("weights", "m_codes", "m_scales", "v_codes", "v_scales"))
def _adam_q(
    weights: list[torch.Tensor],
    grads: list[torch.Tensor],
    m_codes: list[torch.Tensor],
    m_scales: list[torch.Tensor],
    v_codes: list[torch.Tensor],
    v_scales: list[torch.Tensor],
    step_sizes: list[float],
    keys: list[int],
    state_keys: list[int],
    bits: int,
    block_size: int,
    beta1: float,
    beta2: float,
    eps: float,
    decay: float,
    decays: bool,
    grad_scale: float,
    stochastic: bool,
) -> None:
    _native(weights[0].device).adam_quantized(
        weights, grads, list(zip(m_codes, m_scales, strict=True)), list(zip(v_codes, v_scales, strict=True)),
        step_sizes, keys if stochastic else None, state_keys, bits=bits, block_size=block_size, beta1=beta1,
        beta2=beta2, eps=eps, decay=decay if decays else None, grad_scale=grad_scale,
    )


def sgd_quantized(
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momenta: Sequence[quantized.QState],
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
    """SGD with quantized momentum (``quantized.sgd``) over tensors of one dtype on one device, in place."""
    device, dtype = weights[0].device, weights[0].dtype
    if (
        backend(device) == "torch"
        or not _all_contiguous(weights, grads)
        or not verified("sgd_q", device, dtype, bits, block_size)
    ):
        quantized.sgd(weights, grads, momenta, keys, state_keys, bits=bits, block_size=block_size, lr=lr,
                      momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, grad_scale=grad_scale)
        return
    torch.ops.lowmem.sgd_q_(
        list(weights), list(grads), [c for c, _ in momenta], [s for _, s in momenta], list(keys or []),
        list(state_keys), bits, block_size, lr, momentum, nesterov, weight_decay, grad_scale, keys is not None,
    )


def adam_quantized(
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[quantized.QState],
    exp_avg_sqs: Sequence[quantized.QState],
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
    """Adam with quantized moments (``quantized.adam``) over tensors of one dtype on one device, in place."""
    device, dtype = weights[0].device, weights[0].dtype
    if (
        backend(device) == "torch"
        or not _all_contiguous(weights, grads)
        or not verified("adam_q", device, dtype, bits, block_size)
    ):
        quantized.adam(weights, grads, exp_avgs, exp_avg_sqs, step_sizes, keys, state_keys, bits=bits,
                       block_size=block_size, beta1=beta1, beta2=beta2, eps=eps, decay=decay, grad_scale=grad_scale)
        return
    torch.ops.lowmem.adam_q_(
        list(weights), list(grads), [c for c, _ in exp_avgs], [s for _, s in exp_avgs], [c for c, _ in exp_avg_sqs],
        [s for _, s in exp_avg_sqs], list(step_sizes), list(keys or []), list(state_keys), bits, block_size, beta1,
        beta2, eps, 1.0 if decay is None else decay, decay is not None, grad_scale, keys is not None,
    )


def _all_contiguous(*lists: Sequence[torch.Tensor]) -> bool:
    return all(t.is_contiguous() for tensors in lists for t in tensors)
