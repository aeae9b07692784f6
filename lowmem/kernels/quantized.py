"""Optimizer updates with 8- or 4-bit state in plain torch: their definition, and the fallback backend.

SGD's momentum buffer and Adam's two moments are held as blockwise-quantized ``QState``s (codes and
one FP32 scale per block; ``codebooks.py`` says which maps and why) for weights of any float dtype
(FP32, FP16, BF16). An update reads each block back in FP32, computes the new state and the weight
exactly as the 16-bit update does (``reference.py``: same operations, same order, none fused), uses
the *unquantized* new state for the weight's update, and then quantizes the new state: the block's
largest magnitude becomes its scale, each value the code of one of the two map entries around
``value / scale``, rounded stochastically (up with probability equal to its distance from the lower
entry over their gap: unbiased). Rounding to the nearest entry would keep a slowly changing value
where it is: SGD's momentum decays by 10% a step, while the 4-bit map's top entries are 29-69%
apart, so a small weight's momentum stuck at its entry and kept pushing (measured over 3 seeds:
WRN-28-2 on digits with 4-bit momentum, 0.73 points below 16-bit state rounded to nearest, 0.13
above it rounded stochastically; the README has the runs). The random bits are counter-based, as
stochastic rounding of the weights: ``random24(key, i)`` for element i of a tensor, ``key`` the
tensor's *state key* of the update (Adam's second moment: ``key ^ SECOND_MOMENT_SALT``), so every
backend draws the same bits and a resumed run draws what the uninterrupted one did. ``quantize``
(a new state, a rewiring's re-layout) rounds to nearest. The C kernel (``lowmem_kernels.c``) and
the Triton kernel (``triton_kernels.py``) do the same arithmetic; this version works through slices
of ``reference.SLICE`` elements (whole blocks), so its temporaries stay a few slices large.

Per element, with ``read(x) = map[code] * scale``::

    SGD:  g = grad / grad_scale;  g = g + w * weight_decay;  b = read(b) * momentum + g
          u = g + b * momentum (Nesterov) or b;  w = w + u * -lr
    Adam: g = grad / grad_scale;  m = read(m) * b1 + g * (1 - b1);  v = read(v) * b2 + (1 - b2) * g * g
          w = w * decay;  w = w + -step_size * (m / (sqrt(v) + eps))

and per block of the new state: ``scale = max |x|``; with ``y = x / scale`` (0 when the scale is 0),
``c = #{midpoints < y}`` (the nearest entry), ``lo = c - 1`` if ``y < map[c]`` else ``c``, and the code
is ``lo + 1`` when ``lo`` is not the last entry and ``(r24 * 2**-24) * (map[lo+1] - map[lo]) <
y - map[lo]``, else ``lo`` (FP32, no operation fused); in the unsigned map (``v``) a positive x
never takes the code of zero.

Layout of a ``QState`` of n values at ``bits`` bits in blocks of ``block_size``: ``codes`` uint8,
n bytes (8 bits) or ⌈n/2⌉ (4 bits: value 2i in the low half of byte i, 2i+1 in the high half);
``scales`` FP32, ⌈n / block_size⌉ entries. Block sizes are powers of two up to 4096, so a slice
holds whole blocks and whole bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from lowmem.kernels import codebooks
from lowmem.kernels.reference import SLICE, _sqrt, _store_weight, random24

SECOND_MOMENT_SALT = 0x5851F42D  # Adam's second moment rounds with the bits of (state key ^ this)


class QState(NamedTuple):
    """One quantized state tensor: its codes (uint8) and its blocks' scales (FP32)."""

    codes: torch.Tensor
    scales: torch.Tensor


def code_bytes(values: int, bits: int) -> int:
    return math.ceil(values * bits / 8)


def zeros(values: int, bits: int, block_size: int, signed: bool, device: torch.device) -> QState:
    """A state of ``values`` zeros."""
    code = codebooks.zero_code(bits, signed)
    fill = code if bits == 8 else code | (code << 4)
    return QState(
        torch.full((code_bytes(values, bits),), fill, dtype=torch.uint8, device=device),
        torch.zeros(math.ceil(values / block_size), dtype=torch.float32, device=device),
    )


def _unpack(codes: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """``count`` codes (int32) from the bytes of a slice."""
    if bits == 8:
        return codes[:count].int()
    return torch.stack((codes & 15, codes >> 4), dim=1).view(-1)[:count].int()


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (int32) as the bytes that hold them."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _blocks(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """``values`` as rows of ``block_size`` (the last one padded with zeros)."""
    pad = -values.numel() % block_size
    if pad:
        values = torch.cat([values, values.new_zeros(pad)])
    return values.view(-1, block_size)


def read_slice(state: QState, start: int, count: int, bits: int, block_size: int, signed: bool) -> torch.Tensor:
    """Values ``start .. start+count-1`` (``start`` a multiple of the block size) in FP32."""
    table, _ = codebooks.tables(bits, signed, state.codes.device)
    first = start * bits // 8
    codes = _unpack(state.codes[first : first + code_bytes(count, bits)], count, bits)
    values = _blocks(table.index_select(0, codes), block_size)
    first_block = start // block_size
    values = values * state.scales[first_block : first_block + values.shape[0]].unsqueeze(1)
    return values.view(-1)[:count]


def write_slice(
    state: QState, start: int, values: torch.Tensor, bits: int, block_size: int, signed: bool, key: int | None = None
) -> None:
    """Quantize FP32 ``values`` into the state from ``start`` (a multiple of the block size): whole
    blocks (the tensor's last may be short); rounded stochastically with the bits of ``key``, or to
    the nearest entry (None)."""
    table, mids = codebooks.tables(bits, signed, values.device)
    count = values.numel()
    blocks = _blocks(values, block_size)
    top = blocks.abs().amax(dim=1, keepdim=True)
    normalised = torch.where(top > 0, blocks / top, torch.zeros((), device=values.device)).view(-1)[:count]
    codes = torch.searchsorted(mids, normalised, out_int32=True)  # #{midpoints < x}: the nearest entry
    if key is not None:  # the random bits and their hashing take int64 temporaries: a quarter slice at a time
        step = SLICE // 4
        for offset in range(0, count, step):
            part = slice(offset, offset + step)
            r24 = random24(key, start + offset, codes[part].numel(), values.device)
            codes[part] = _round_stochastic(normalised[part], codes[part], table, r24)
    if not signed:
        codes = torch.where((values > 0) & (codes == 0), 1, codes)  # zero is an exact zero's code only
    first = start * bits // 8
    state.codes[first : first + code_bytes(count, bits)] = _pack(codes, bits)
    first_block = start // block_size
    state.scales[first_block : first_block + blocks.shape[0]] = top.view(-1)


def _round_stochastic(x: torch.Tensor, nearest: torch.Tensor, table: torch.Tensor, r24: torch.Tensor) -> torch.Tensor:
    """The codes of normalised ``x`` rounded between the entries around it (see the module docstring)."""
    lower = nearest - (x < table[nearest]).int()
    last = table.numel() - 1
    below = table[lower]
    gap = table[(lower + 1).clamp_(max=last)] - below
    up = (r24.to(torch.float32) * 2.0**-24) * gap < x - below
    return torch.where((lower < last) & up, lower + 1, lower)


def read(state: QState, values: int, bits: int, block_size: int, signed: bool) -> torch.Tensor:
    """The whole state in FP32 (``values`` entries)."""
    return read_slice(state, 0, values, bits, block_size, signed)


def quantize(values: torch.Tensor, bits: int, block_size: int, signed: bool) -> QState:
    """A new state holding FP32 ``values`` (1-D)."""
    state = zeros(values.numel(), bits, block_size, signed, values.device)
    for start in range(0, values.numel(), SLICE):
        write_slice(state, start, values[start : start + SLICE], bits, block_size, signed)
    return state


def sgd(
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momenta: Sequence[QState],
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
    """SGD with quantized momentum (signed map) over ``weights`` in place (see the module docstring);
    ``keys``: stochastic rounding's per-tensor keys (16-bit weights), or None; ``state_keys``: the
    state's rounding keys, per tensor."""
    for t, (weight, grad) in enumerate(zip(weights, grads, strict=True)):
        w, g_all = weight.view(-1), grad.view(-1)
        for start in range(0, w.numel(), SLICE):
            part = slice(start, start + SLICE)
            value = w[part].float()
            g = g_all[part].float() / grad_scale
            if weight_decay != 0:
                g.add_(value * weight_decay)
            buffer = read_slice(momenta[t], start, value.numel(), bits, block_size, True).mul_(momentum).add_(g)
            update = g + buffer * momentum if nesterov else buffer
            value.add_(update * -lr)
            del g, update  # freed before quantizing: the temporaries stay a few slices large
            write_slice(momenta[t], start, buffer, bits, block_size, True, state_keys[t])
            _store_weight(w[part], value, None if keys is None else keys[t], start)


def adam(
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[QState],
    exp_avg_sqs: Sequence[QState],
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
    """Adam with quantized moments (first: signed map, second: unsigned) over ``weights`` in place;
    ``step_sizes``: per tensor, lr · sqrt(1 - b2^t) / (1 - b1^t); ``decay``: 1 - lr · weight_decay, or None."""
    for t, weight in enumerate(weights):
        w, g_all = weight.view(-1), grads[t].view(-1)
        for start in range(0, w.numel(), SLICE):
            part = slice(start, start + SLICE)
            value = w[part].float()
            count = value.numel()
            g = g_all[part].float() / grad_scale
            m = read_slice(exp_avgs[t], start, count, bits, block_size, True).mul_(beta1).add_(g * (1 - beta1))
            v = read_slice(exp_avg_sqs[t], start, count, bits, block_size, False).mul_(beta2)
            v.add_((g * (1 - beta2)).mul_(g))
            if decay is not None:
                value.mul_(decay)
            value.add_(m.div(_sqrt(v).add_(eps)).mul_(-step_sizes[t]))
            del g  # freed before quantizing: the temporaries stay a few slices large
            write_slice(exp_avgs[t], start, m, bits, block_size, True, state_keys[t])
            write_slice(exp_avg_sqs[t], start, v, bits, block_size, False, state_keys[t] ^ SECOND_MOMENT_SALT)
            _store_weight(w[part], value, None if keys is None else keys[t], start)
