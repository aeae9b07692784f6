"""The fused 16-bit optimizer updates on CUDA, in Triton: ``reference.py``'s arithmetic in registers.

One launch updates every tensor of a call (two for Adam: the per-tensor moment maxima first). The
tensors are reached through a table of addresses; each program updates one slice of ``BLOCK``
elements of one tensor. No multiply-add is fused (``enable_fp_fusion=False``) and division and
square root are the correctly rounded ones: the operations of the C kernel and of the reference.

The same file holds the updates with 8- and 4-bit state (``quantized.py``'s arithmetic): a
program updates whole quantization blocks, as two tiles of rows x half-blocks (the even and the odd
elements, which share a byte at 4 bits), then takes each block's largest magnitude and writes the
codes, found by the same binary search over the map's midpoints as the C kernel.

Tested on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``: tests/test_optimizers.py,
tests/test_quantized_state.py).
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
    # One return statement: Triton's compiler reads a `return` under an `if BF16:` and the one after it
    # as two returns of the function (bf16 and fp16: "Return type mismatch").
    if BF16:
        bits = value.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)
        narrow = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        narrow = value.to(tl.float16)
    return narrow


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


def _chunks(
    slot: tuple, sizes: tuple[int, ...], device: torch.device, chunk: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per program: the tensor it updates and the first element of its slice of ``chunk`` elements
    (on ``device``)."""

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        tensor, start = [], []
        for index, size in enumerate(sizes):
            for first in range(0, size, chunk):
                tensor.append(index)
                start.append(first)
        return torch.tensor(tensor, dtype=torch.int32).to(device), torch.tensor(start, dtype=torch.int64).to(device)

    return _cached(("chunks", *slot), (chunk, sizes), make)


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


# ------------------------------------------------------------------------------------------------
# 8- and 4-bit state (quantized.py). WEIGHTS: 0 FP16, 1 BF16, 2 FP32.
QUANTIZED_CHUNK = 2048  # elements per program (whole blocks; one block if the block is larger)
_WEIGHT_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


@triton.jit
def _load_any(pointer, offsets, mask, WEIGHTS: tl.constexpr):
    dtype = tl.float32 if WEIGHTS == 2 else (tl.bfloat16 if WEIGHTS == 1 else tl.float16)
    return tl.load(pointer.to(tl.pointer_type(dtype)) + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_any(pointer, offsets, mask, value, key, STOCHASTIC: tl.constexpr, WEIGHTS: tl.constexpr):
    if WEIGHTS == 2:
        tl.store(pointer.to(tl.pointer_type(tl.float32)) + offsets, value, mask=mask)
    else:
        dtype = tl.bfloat16 if WEIGHTS == 1 else tl.float16
        _store_weight(pointer.to(tl.pointer_type(dtype)), offsets, mask, value, key, STOCHASTIC, WEIGHTS == 1)


@triton.jit
def _read_codes(codes, offsets, mask, BITS: tl.constexpr):
    if BITS == 8:  # one return statement, as in _to_16
        code = tl.load(codes + offsets, mask=mask, other=0).to(tl.int32)
    else:
        byte = tl.load(codes + (offsets >> 1), mask=mask, other=0).to(tl.int32)
        code = (byte >> ((offsets & 1) * 4).to(tl.int32)) & 15
    return code


@triton.jit
def _find_code(x, mids, BITS: tl.constexpr):
    """The number of midpoints below x: a binary search, as the C kernel's."""
    code = tl.zeros(x.shape, dtype=tl.int32)
    # Steps of 2**(BITS-1-i), written out: a `step: tl.constexpr = ...` in the unrolled loop is refused
    # by Triton's compiler from its second iteration on ("constexpr cannot be reassigned").
    for i in tl.static_range(BITS):
        middle = tl.load(mids + code + ((1 << (BITS - 1 - i)) - 1))
        code = tl.where(middle < x, code + (1 << (BITS - 1 - i)), code)
    return code


@triton.jit
def _round_code(x, offsets, table, mids, key, BITS: tl.constexpr):
    """The code of normalised x rounded stochastically between the entries around it, as the C kernel's."""
    code = _find_code(x, mids, BITS)
    lower = tl.where(x < tl.load(table + code), code - 1, code)
    last: tl.constexpr = (1 << BITS) - 1
    below = tl.load(table + lower)
    gap = tl.load(table + tl.minimum(lower + 1, last)) - below
    r = _random24(key, offsets).to(tl.float32) * 5.9604644775390625e-08
    up = (lower < last) & (r * gap < x - below)
    return tl.where(up, lower + 1, lower)


@triton.jit
def _quantize(x_even, x_odd, mask_even, mask_odd, even, codes, scales, block_index, block_mask, table, mids, key,
              SIGNED: tl.constexpr, BITS: tl.constexpr):
    top = tl.max(tl.maximum(tl.where(mask_even, tl.abs(x_even), 0.0), tl.where(mask_odd, tl.abs(x_odd), 0.0)),
                 axis=1)
    tl.store(scales + block_index, top, mask=block_mask)
    top = top[:, None]
    safe = tl.where(top > 0.0, top, 1.0)
    code_even = _round_code(tl.where(top > 0.0, tl.div_rn(x_even, safe), 0.0), even, table, mids, key, BITS)
    code_odd = _round_code(tl.where(top > 0.0, tl.div_rn(x_odd, safe), 0.0), even + 1, table, mids, key, BITS)
    if not SIGNED:  # an unsigned map's zero is an exact zero's code only
        code_even = tl.where((x_even > 0.0) & (code_even == 0), 1, code_even)
        code_odd = tl.where((x_odd > 0.0) & (code_odd == 0), 1, code_odd)
    if BITS == 8:
        tl.store(codes + even, code_even.to(tl.uint8), mask=mask_even)
        tl.store(codes + even + 1, code_odd.to(tl.uint8), mask=mask_odd)
    else:
        byte = code_even | (tl.where(mask_odd, code_odd, 0) << 4)
        tl.store(codes + (even >> 1), byte.to(tl.uint8), mask=mask_even)


@triton.jit
def _sgd_q_lane(table, count, t, offsets, mask, scale, m_map, lr, momentum, weight_decay, grad_scale, key,
                NESTEROV: tl.constexpr, DECAY: tl.constexpr, STOCHASTIC: tl.constexpr, WEIGHTS: tl.constexpr,
                BITS: tl.constexpr):
    w_pointer = tl.load(table + t)
    weight = _load_any(w_pointer, offsets, mask, WEIGHTS)
    grad = tl.div_rn(_load_any(tl.load(table + count + t), offsets, mask, WEIGHTS), grad_scale)
    if DECAY:
        grad = grad + weight * weight_decay
    codes = tl.load(table + 2 * count + t).to(tl.pointer_type(tl.uint8))
    buffer = tl.load(m_map + _read_codes(codes, offsets, mask, BITS)) * scale * momentum + grad
    if NESTEROV:
        update = grad + buffer * momentum
    else:
        update = buffer
    _store_any(w_pointer, offsets, mask, weight + update * -lr, key, STOCHASTIC, WEIGHTS)
    return buffer


@triton.jit
def _sgd_q_kernel(table, chunk_tensor, chunk_start, count, state_keys, m_map, m_mids, lr, momentum, weight_decay,
                  grad_scale, NESTEROV: tl.constexpr, DECAY: tl.constexpr, STOCHASTIC: tl.constexpr,
                  WEIGHTS: tl.constexpr, BITS: tl.constexpr, QB: tl.constexpr, ROWS: tl.constexpr):
    chunk = tl.program_id(0)
    t = tl.load(chunk_tensor + chunk)
    start = tl.load(chunk_start + chunk)
    size = tl.load(table + 5 * count + t)
    state_key = tl.load(state_keys + t).to(tl.uint32)
    rows = tl.arange(0, ROWS)
    even = start + rows[:, None] * QB + 2 * tl.arange(0, QB // 2)[None, :]
    mask_even, mask_odd = even < size, even + 1 < size
    block_index = start // QB + rows
    block_mask = block_index * QB < size
    scales = tl.load(table + 3 * count + t).to(tl.pointer_type(tl.float32))
    scale = tl.load(scales + block_index, mask=block_mask, other=0.0)[:, None]
    key = tl.load(table + 4 * count + t).to(tl.uint32)
    b_even = _sgd_q_lane(table, count, t, even, mask_even, scale, m_map, lr, momentum, weight_decay, grad_scale,
                         key, NESTEROV, DECAY, STOCHASTIC, WEIGHTS, BITS)
    b_odd = _sgd_q_lane(table, count, t, even + 1, mask_odd, scale, m_map, lr, momentum, weight_decay, grad_scale,
                        key, NESTEROV, DECAY, STOCHASTIC, WEIGHTS, BITS)
    codes = tl.load(table + 2 * count + t).to(tl.pointer_type(tl.uint8))
    _quantize(b_even, b_odd, mask_even, mask_odd, even, codes, scales, block_index, block_mask, m_map, m_mids,
              state_key, True, BITS)


@triton.jit
def _adam_q_lane(table, count, t, offsets, mask, m_scale, v_scale, m_map, v_map, step_size, beta1, beta2,
                 one_minus_beta1, one_minus_beta2, eps, decay, grad_scale, key, DECAY: tl.constexpr,
                 STOCHASTIC: tl.constexpr, WEIGHTS: tl.constexpr, BITS: tl.constexpr):
    w_pointer = tl.load(table + t)
    grad = tl.div_rn(_load_any(tl.load(table + count + t), offsets, mask, WEIGHTS), grad_scale)
    m_codes = tl.load(table + 2 * count + t).to(tl.pointer_type(tl.uint8))
    v_codes = tl.load(table + 4 * count + t).to(tl.pointer_type(tl.uint8))
    avg = tl.load(m_map + _read_codes(m_codes, offsets, mask, BITS)) * m_scale * beta1 + grad * one_minus_beta1
    avg_sq = (tl.load(v_map + _read_codes(v_codes, offsets, mask, BITS)) * v_scale * beta2
              + one_minus_beta2 * grad * grad)
    weight = _load_any(w_pointer, offsets, mask, WEIGHTS)
    if DECAY:
        weight = weight * decay
    weight = weight + -step_size * tl.div_rn(avg, tl.sqrt_rn(avg_sq) + eps)
    _store_any(w_pointer, offsets, mask, weight, key, STOCHASTIC, WEIGHTS)
    return avg, avg_sq


@triton.jit
def _adam_q_kernel(table, chunk_tensor, chunk_start, count, step_sizes, state_keys, m_map, m_mids, v_map, v_mids,
                   beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay, grad_scale, DECAY: tl.constexpr,
                   STOCHASTIC: tl.constexpr, WEIGHTS: tl.constexpr, BITS: tl.constexpr, QB: tl.constexpr,
                   ROWS: tl.constexpr):
    chunk = tl.program_id(0)
    t = tl.load(chunk_tensor + chunk)
    start = tl.load(chunk_start + chunk)
    size = tl.load(table + 6 * count + t)
    state_key = tl.load(state_keys + t).to(tl.uint32)
    rows = tl.arange(0, ROWS)
    even = start + rows[:, None] * QB + 2 * tl.arange(0, QB // 2)[None, :]
    mask_even, mask_odd = even < size, even + 1 < size
    block_index = start // QB + rows
    block_mask = block_index * QB < size
    m_scales = tl.load(table + 3 * count + t).to(tl.pointer_type(tl.float32))
    v_scales = tl.load(table + 5 * count + t).to(tl.pointer_type(tl.float32))
    m_scale = tl.load(m_scales + block_index, mask=block_mask, other=0.0)[:, None]
    v_scale = tl.load(v_scales + block_index, mask=block_mask, other=0.0)[:, None]
    key = tl.load(table + 7 * count + t).to(tl.uint32)
    step_size = tl.load(step_sizes + t)
    m_even, v_even = _adam_q_lane(table, count, t, even, mask_even, m_scale, v_scale, m_map, v_map, step_size, beta1,
                                  beta2, one_minus_beta1, one_minus_beta2, eps, decay, grad_scale, key, DECAY,
                                  STOCHASTIC, WEIGHTS, BITS)
    m_odd, v_odd = _adam_q_lane(table, count, t, even + 1, mask_odd, m_scale, v_scale, m_map, v_map, step_size,
                                beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay, grad_scale, key, DECAY,
                                STOCHASTIC, WEIGHTS, BITS)
    m_codes = tl.load(table + 2 * count + t).to(tl.pointer_type(tl.uint8))
    v_codes = tl.load(table + 4 * count + t).to(tl.pointer_type(tl.uint8))
    _quantize(m_even, m_odd, mask_even, mask_odd, even, m_codes, m_scales, block_index, block_mask, m_map, m_mids,
              state_key, True, BITS)
    _quantize(v_even, v_odd, mask_even, mask_odd, even, v_codes, v_scales, block_index, block_mask, v_map, v_mids,
              state_key ^ 0x5851F42D, False, BITS)  # quantized.SECOND_MOMENT_SALT


def _per_step(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-tensor numbers that change every update (step sizes, the state's rounding keys): copied to
    the device on their own, so that the cached address tables stay unchanged."""
    return torch.tensor(values, dtype=dtype).to(device)


def _quantized_launch(block_size: int) -> tuple[int, int]:
    """(rows, elements) of a program: whole blocks, QUANTIZED_CHUNK elements or one larger block."""
    rows = max(1, QUANTIZED_CHUNK // block_size)
    return rows, rows * block_size


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
    """``quantized.sgd`` in one Triton launch (contiguous tensors on one device; weights FP32/FP16/BF16)."""
    from lowmem.kernels import codebooks

    count, device, dtype = len(weights), weights[0].device, weights[0].dtype
    sizes, slot = tuple(w.numel() for w in weights), ("sgd_q", device, count, dtype, bits, block_size)
    table = _table(
        slot,
        [[w.data_ptr() for w in weights], [g.data_ptr() for g in grads], [c.data_ptr() for c, _ in momenta],
         [s.data_ptr() for _, s in momenta], list(keys) if keys else [0] * count, sizes],
        device,
    )  # fmt: skip
    rows, chunk = _quantized_launch(block_size)
    chunk_tensor, chunk_start = _chunks(slot, sizes, device, chunk)
    m_map, m_mids = codebooks.tables(bits, True, device)
    _sgd_q_kernel[(len(chunk_tensor),)](
        table, chunk_tensor, chunk_start, count, _per_step(state_keys, torch.int64, device), m_map, m_mids, lr,
        momentum, weight_decay, grad_scale,
        NESTEROV=nesterov, DECAY=weight_decay != 0, STOCHASTIC=keys is not None, WEIGHTS=_WEIGHT_CODES[dtype],
        BITS=bits, QB=block_size, ROWS=rows, **_LAUNCH,
    )


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
    """``quantized.adam`` in one Triton launch (contiguous tensors on one device; weights FP32/FP16/BF16)."""
    from lowmem.kernels import codebooks

    count, device, dtype = len(weights), weights[0].device, weights[0].dtype
    sizes, slot = tuple(w.numel() for w in weights), ("adam_q", device, count, dtype, bits, block_size)
    table = _table(
        slot,
        [[w.data_ptr() for w in weights], [g.data_ptr() for g in grads], [c.data_ptr() for c, _ in exp_avgs],
         [s.data_ptr() for _, s in exp_avgs], [c.data_ptr() for c, _ in exp_avg_sqs],
         [s.data_ptr() for _, s in exp_avg_sqs], sizes, list(keys) if keys else [0] * count],
        device,
    )  # fmt: skip
    rows, chunk = _quantized_launch(block_size)
    chunk_tensor, chunk_start = _chunks(slot, sizes, device, chunk)
    m_map, m_mids = codebooks.tables(bits, True, device)
    v_map, v_mids = codebooks.tables(bits, False, device)
    _adam_q_kernel[(len(chunk_tensor),)](
        table, chunk_tensor, chunk_start, count, _per_step(step_sizes, torch.float32, device),
        _per_step(state_keys, torch.int64, device), m_map, m_mids, v_map, v_mids, beta1, beta2, 1 - beta1, 1 - beta2,
        eps, 1.0 if decay is None else decay, grad_scale,
        DECAY=decay is not None, STOCHASTIC=keys is not None, WEIGHTS=_WEIGHT_CODES[dtype], BITS=bits,
        QB=block_size, ROWS=rows, **_LAUNCH,
    )
