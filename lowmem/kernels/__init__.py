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

``sgd_quantized`` and ``adam_quantized`` are the same updates with 8- or 4-bit blockwise-quantized
state (``quantized.py``) for FP32, FP16 or BF16 weights, on the same three backends
(``lowmem::sgd_q_`` / ``lowmem::adam_q_``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence

import torch

from lowmem.kernels import cpu, quantized, reference

BACKENDS = ("auto", "torch")


def backend(device: torch.device) -> str:
    """"cpu", "triton" or "torch": what updates 16-bit tensors on ``device`` here."""
    choice = os.environ.get("LOWMEM_KERNELS", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"LOWMEM_KERNELS={choice!r} is unknown; allowed: {', '.join(BACKENDS)}")
    if choice == "torch":
        return "torch"
    if device.type == "cpu" and cpu.library() is not None:
        return "cpu"
    if device.type == "cuda" and _triton_available():
        return "triton"
    return "torch"


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


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
    if backend(weights[0].device) == "torch" or not _all_contiguous(weights, grads, momenta):
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
    if backend(weights[0].device) == "torch" or not _all_contiguous(weights, grads, exp_avgs, exp_avg_sqs):
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
        weights, grads, list(zip(codes, scales, strict=True)), keys if stochastic else None, bits=bits,
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
        step_sizes, keys if stochastic else None, bits=bits, block_size=block_size, beta1=beta1, beta2=beta2,
        eps=eps, decay=decay if decays else None, grad_scale=grad_scale,
    )


def sgd_quantized(
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momenta: Sequence[quantized.QState],
    keys: Sequence[int] | None,
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
    if backend(weights[0].device) == "torch" or not _all_contiguous(weights, grads):
        quantized.sgd(weights, grads, momenta, keys, bits=bits, block_size=block_size, lr=lr, momentum=momentum,
                      nesterov=nesterov, weight_decay=weight_decay, grad_scale=grad_scale)
        return
    torch.ops.lowmem.sgd_q_(
        list(weights), list(grads), [c for c, _ in momenta], [s for _, s in momenta], list(keys or []), bits,
        block_size, lr, momentum, nesterov, weight_decay, grad_scale, keys is not None,
    )


def adam_quantized(
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[quantized.QState],
    exp_avg_sqs: Sequence[quantized.QState],
    step_sizes: Sequence[float],
    keys: Sequence[int] | None,
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
    if backend(weights[0].device) == "torch" or not _all_contiguous(weights, grads):
        quantized.adam(weights, grads, exp_avgs, exp_avg_sqs, step_sizes, keys, bits=bits, block_size=block_size,
                       beta1=beta1, beta2=beta2, eps=eps, decay=decay, grad_scale=grad_scale)
        return
    torch.ops.lowmem.adam_q_(
        list(weights), list(grads), [c for c, _ in exp_avgs], [s for _, s in exp_avgs], [c for c, _ in exp_avg_sqs],
        [s for _, s in exp_avg_sqs], list(step_sizes), list(keys or []), bits, block_size, beta1, beta2, eps,
        1.0 if decay is None else decay, decay is not None, grad_scale, keys is not None,
    )


def _all_contiguous(*lists: Sequence[torch.Tensor]) -> bool:
    return all(t.is_contiguous() for tensors in lists for t in tensors)
