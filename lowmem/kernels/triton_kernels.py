"""The fused 16-bit optimizer updates on CUDA, in Triton: ``reference.py``'s arithmetic in registers.

One launch updates every tensor of a call (two for Adam: the per-tensor moment maxima first). The
tensors are reached through a table of addresses; each program updates one slice of ``BLOCK``
elements of one tensor. No multiply-add is fused (``enable_fp_fusion=False``) and division and
square root are the correctly rounded ones: the operations of the C kernel and of the reference.

Tested on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``: tests/test_optimizers.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 1024
_LAUNCH = {"num_warps": 4, "enable_fp_fusion": False}


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _random24(key, offsets):
    return _fmix32(key ^ (offsets.to(tl.uint32) * 0x27D4EB2F)) >> 8


@triton.jit
def _to_16(value, BF16: tl.constexpr):
    """Round-to-nearest-even into FP16 or BF16 (BF16 by its bits, as torch rounds, on every backend)."""
    if BF16:
        bits = value.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return value.to(tl.float16)


@triton.jit
def _store_weight(pointer, offsets, mask, value, key, STOCHASTIC: tl.constexpr, BF16: tl.constexpr):
    if STOCHASTIC:
        r24 = _random24(key, offsets)
        bits = value.to(tl.uint32, bitcast=True)
        sign = bits & 0x80000000
        magnitude = bits & 0x7FFFFFFF
        if BF16:
            rounded = sign | ((magnitude + (r24 >> 8)) & 0xFFFF0000)
        else:
            normal = sign | ((magnitude + (r24 >> 11)) & 0xFFFFE000)
            q = tl.abs(value) * 16777216.0
            lower = tl.floor(q)
            up = tl.where(r24.to(tl.float32) * 5.9604644775390625e-08 < q - lower, 1.0, 0.0)
            subnormal = sign | ((lower + up) * 5.9604644775390625e-08).to(tl.uint32, bitcast=True)
            rounded = tl.where(magnitude < 0x38800000, subnormal, normal)
        rounded = tl.where(magnitude >= 0x7F800000, bits, rounded)
        value = rounded.to(tl.float32, bitcast=True)
    tl.store(pointer + offsets, _to_16(value, BF16), mask=mask)


@triton.jit
def _pow2(k):
    """2**k for integer-valued FP32 k in [-126, 127]."""
    return ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _sgd_kernel(table, chunk_tensor, chunk_start, count, lr, momentum, weight_decay, grad_scale,
                MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, DECAY: tl.constexpr, STOCHASTIC: tl.constexpr,
                BF16: tl.constexpr, BLOCK: tl.constexpr):
    dtype = tl.bfloat16 if BF16 else tl.float16
    chunk = tl.program_id(0)
    t = tl.load(chunk_tensor + chunk)
    offsets = tl.load(chunk_start + chunk) + tl.arange(0, BLOCK)
    mask = offsets < tl.load(table + 3 * count + t)
    w_pointer = tl.load(table + t).to(tl.pointer_type(dtype))
    g_pointer = tl.load(table + count + t).to(tl.pointer_type(dtype))
    weight = tl.load(w_pointer + offsets, mask=mask).to(tl.float32)
    grad = tl.div_rn(tl.load(g_pointer + offsets, mask=mask).to(tl.float32), grad_scale)
    if DECAY:
        grad = grad + weight * weight_decay
    update = grad
    if MOMENTUM:
        b_pointer = tl.load(table + 2 * count + t).to(tl.pointer_type(dtype))
        buffer = tl.load(b_pointer + offsets, mask=mask).to(tl.float32) * momentum + grad
        if NESTEROV:
            update = grad + buffer * momentum
        else:
            update = buffer
        tl.store(b_pointer + offsets, _to_16(buffer, BF16), mask=mask)
    key = tl.load(table + 4 * count + t).to(tl.uint32)
    _store_weight(w_pointer, offsets, mask, weight + update * -lr, key, STOCHASTIC, BF16)


@triton.jit
def _adam_moments(table, count, t, offsets, mask, read_m, read_v, beta1, beta2, one_minus_beta1,
                  one_minus_beta2, grad_scale, BF16: tl.constexpr):
    dtype = tl.bfloat16 if BF16 else tl.float16
    g_pointer = tl.load(table + count + t).to(tl.pointer_type(dtype))
    m_pointer = tl.load(table + 2 * count + t).to(tl.pointer_type(dtype))
    v_pointer = tl.load(table + 3 * count + t).to(tl.pointer_type(dtype))
    grad = tl.div_rn(tl.load(g_pointer + offsets, mask=mask).to(tl.float32), grad_scale)
    avg = tl.load(m_pointer + offsets, mask=mask).to(tl.float32) * read_m * beta1 + grad * one_minus_beta1
    avg_sq = tl.load(v_pointer + offsets, mask=mask).to(tl.float32) * read_v * beta2 + one_minus_beta2 * grad * grad
    return avg, avg_sq, m_pointer, v_pointer


@triton.jit
def _adam_amax_kernel(table, chunk_tensor, chunk_start, count, scratch, beta1, beta2, one_minus_beta1,
                      one_minus_beta2, grad_scale, BF16: tl.constexpr, BLOCK: tl.constexpr):
    chunk = tl.program_id(0)
    t = tl.load(chunk_tensor + chunk)
    start = tl.load(chunk_start + chunk)
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < tl.load(table + 6 * count + t)
    m_scale = tl.load(tl.load(table + 4 * count + t).to(tl.pointer_type(tl.float32)))
    v_scale = tl.load(tl.load(table + 5 * count + t).to(tl.pointer_type(tl.float32)))
    avg, avg_sq, _, _ = _adam_moments(table, count, t, offsets, mask, _pow2(-m_scale), _pow2(-v_scale), beta1,
                                      beta2, one_minus_beta1, one_minus_beta2, grad_scale, BF16)
    tl.atomic_max(scratch + 2 * t, tl.max(tl.where(mask, tl.abs(avg), 0.0), axis=0))
    tl.atomic_max(scratch + 2 * t + 1, tl.max(tl.where(mask, tl.abs(avg_sq), 0.0), axis=0))
    if start == 0:  # the scales the moments are read with, kept for pass two (which overwrites them)
        tl.store(scratch + 2 * count + 2 * t, m_scale)
        tl.store(scratch + 2 * count + 2 * t + 1, v_scale)


@triton.jit
def _moment_log2_scale(top):
    biased = (top.to(tl.uint32, bitcast=True) >> 23) & 0xFF
    exponent = tl.where(top == 0.0, 0, biased.to(tl.int32) - 126)  # frexp's; subnormals clamp below
    return tl.minimum(tl.maximum(15 - exponent, -126), 126).to(tl.float32)


@triton.jit
def _adam_kernel(table, chunk_tensor, chunk_start, count, scratch, step_sizes, beta1, beta2, one_minus_beta1,
                 one_minus_beta2, eps, decay, grad_scale, DECAY: tl.constexpr, STOCHASTIC: tl.constexpr,
                 BF16: tl.constexpr, BLOCK: tl.constexpr):
    dtype = tl.bfloat16 if BF16 else tl.float16
    chunk = tl.program_id(0)
    t = tl.load(chunk_tensor + chunk)
    start = tl.load(chunk_start + chunk)
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < tl.load(table + 6 * count + t)
    read_m = _pow2(-tl.load(scratch + 2 * count + 2 * t))
    read_v = _pow2(-tl.load(scratch + 2 * count + 2 * t + 1))
    scale_m = _moment_log2_scale(tl.load(scratch + 2 * t))
    scale_v = _moment_log2_scale(tl.load(scratch + 2 * t + 1))
    avg, avg_sq, m_pointer, v_pointer = _adam_moments(table, count, t, offsets, mask, read_m, read_v, beta1, beta2,
                                                      one_minus_beta1, one_minus_beta2, grad_scale, BF16)
    w_pointer = tl.load(table + t).to(tl.pointer_type(dtype))
    weight = tl.load(w_pointer + offsets, mask=mask).to(tl.float32)
    if DECAY:
        weight = weight * decay
    weight = weight + -tl.load(step_sizes + t) * tl.div_rn(avg, tl.sqrt_rn(avg_sq) + eps)
    tl.store(m_pointer + offsets, _to_16(avg * _pow2(scale_m), BF16), mask=mask)
    tl.store(v_pointer + offsets, _to_16(avg_sq * _pow2(scale_v), BF16), mask=mask)
    key = tl.load(table + 7 * count + t).to(tl.uint32)
    _store_weight(w_pointer, offsets, mask, weight, key, STOCHASTIC, BF16)
    if start == 0:
        tl.store(tl.load(table + 4 * count + t).to(tl.pointer_type(tl.float32)), scale_m)
        tl.store(tl.load(table + 5 * count + t).to(tl.pointer_type(tl.float32)), scale_v)


# The tables a launch reads live on the device. Each kind of call (sgd/adam, device, number of
# tensors, dtype) keeps its latest tables only: a step whose tensors did not move reuses them (no
# host-to-device copy), and a compact-sparsity rewiring (new addresses and sizes) replaces them, so
# the old ones are freed at the first update after it. At most MAX_TABLE_SLOTS kinds are kept.
MAX_TABLE_SLOTS = 16
_tables: dict[tuple, tuple[tuple, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]] = {}


def _cached(slot: tuple, contents: tuple, make):
    """The device tensor(s) for ``contents`` in ``slot``: the cached ones if unchanged, else ``make()``'s."""
    found = _tables.pop(slot, None)  # popped and put back: the dict's order is least recently used first
    if found is None or found[0] != contents:
        found = (contents, make())
    _tables[slot] = found
    while len(_tables) > MAX_TABLE_SLOTS:
        del _tables[next(iter(_tables))]
    return found[1]


def _chunks(slot: tuple, sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per program: the tensor it updates and the first element of its slice (on ``device``)."""

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        tensor, start = [], []
        for index, size in enumerate(sizes):
            for first in range(0, size, BLOCK):
                tensor.append(index)
                start.append(first)
        return torch.tensor(tensor, dtype=torch.int32).to(device), torch.tensor(start, dtype=torch.int64).to(device)

    return _cached(("chunks", *slot), sizes, make)


def _table(slot: tuple, rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    values = tuple(value for row in rows for value in row)
    return _cached(("table", *slot), values, lambda: torch.tensor(values, dtype=torch.int64).to(device))


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
    """``reference.sgd`` in one Triton launch (contiguous tensors of one 16-bit dtype, one device)."""
    count, device = len(weights), weights[0].device
    sizes, slot = tuple(w.numel() for w in weights), ("sgd", device, count, weights[0].dtype)
    table = _table(
        slot,
        [
            [w.data_ptr() for w in weights],
            [g.data_ptr() for g in grads],
            [b.data_ptr() for b in momenta] if momentum != 0 else [0] * count,
            sizes,
            list(keys) if keys else [0] * count,
        ],
        device,
    )
    chunk_tensor, chunk_start = _chunks(slot, sizes, device)
    _sgd_kernel[(len(chunk_tensor),)](
        table, chunk_tensor, chunk_start, count, lr, momentum, weight_decay, grad_scale,
        MOMENTUM=momentum != 0, NESTEROV=nesterov, DECAY=weight_decay != 0, STOCHASTIC=keys is not None,
        BF16=weights[0].dtype == torch.bfloat16, BLOCK=BLOCK, **_LAUNCH,
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
    """``reference.adam`` in two Triton launches (contiguous tensors of one 16-bit dtype, one device)."""
    count, device = len(weights), weights[0].device
    sizes, slot = tuple(w.numel() for w in weights), ("adam", device, count, weights[0].dtype)
    table = _table(
        slot,
        [
            [w.data_ptr() for w in weights],
            [g.data_ptr() for g in grads],
            [m.data_ptr() for m in exp_avgs],
            [v.data_ptr() for v in exp_avg_sqs],
            [m_scale.data_ptr() for m_scale, _ in log2_scales],
            [v_scale.data_ptr() for _, v_scale in log2_scales],
            sizes,
            list(keys) if keys else [0] * count,
        ],
        device,
    )
    chunk_tensor, chunk_start = _chunks(slot, sizes, device)
    scratch = torch.zeros(4 * count, dtype=torch.float32, device=device)  # maxima, then the old scales
    grid, bf16 = (len(chunk_tensor),), weights[0].dtype == torch.bfloat16
    moments = (beta1, beta2, 1 - beta1, 1 - beta2)
    _adam_amax_kernel[grid](
        table, chunk_tensor, chunk_start, count, scratch, *moments, grad_scale, BF16=bf16, BLOCK=BLOCK, **_LAUNCH
    )
    _adam_kernel[grid](
        table, chunk_tensor, chunk_start, count, scratch, torch.tensor(step_sizes, dtype=torch.float32).to(device),
        *moments, eps, 1.0 if decay is None else decay, grad_scale, DECAY=decay is not None,
        STOCHASTIC=keys is not None, BF16=bf16, BLOCK=BLOCK, **_LAUNCH,
    )
