"""The fused 16-bit optimizer updates in plain torch: their definition, and the fallback backend.

Every tensor of a call is 16-bit (FP16 or BF16: weights, gradients, optimizer state alike); each
element is computed in FP32 and written back in 16 bits, with no FP32 copy of anything kept
(the report's pure FP16). The C kernel (``lowmem_kernels.c``) and the Triton kernel
(``triton_kernels.py``) do the same arithmetic in registers; this version works through slices of
``SLICE`` elements, so its FP32 temporaries stay a few slices large whatever the model.

Every ``*``, ``/``, ``+`` and square root below is one correctly rounded FP32 operation, done in the
order written (left to right): no path fuses a multiply and an add. That is what makes the paths
give the same bits: whether a compiler or ATen's vectorised kernel for this CPU (``ATEN_CPU_CAPABILITY``)
would contract ``a + b * c`` into an FMA would otherwise decide the last bit, so the C kernel is
built with ``-ffp-contract=off``, the Triton kernels launch with ``enable_fp_fusion=False``, and
this file avoids the torch operations that may fuse (``add(..., alpha=)``, ``addcmul``, ``addcdiv``,
``lerp``) and torch's FP32 ``sqrt`` (on the CPU it goes through MKL's vector math, which is not
correctly rounded: see ``_sqrt``).

SGD (momentum buffer in the weight's dtype), per element::

    g = grad / grad_scale;  g = g + w * weight_decay;  b = b * momentum + g
    u = g + b * momentum (Nesterov) or b;  w = w + u * -lr

Adam (fairseq's: decoupled weight decay, bias correction folded into ``step_size``); each moment
is stored times ``2**log2_scale``, one scale per tensor chosen every step so that its largest
magnitude lands in [2**14, 2**15), the top binade of FP16 (unscaled FP16 moments mostly round to
zero and training diverges: the report's finding)::

    m = m * 2**-m_log2_scale * b1 + g * (1 - b1);  v = v * 2**-v_log2_scale * b2 + (1 - b2) * g * g
    w = w * decay;  w = w + -step_size * (m / (sqrt(v) + eps))

The weight is written with round-to-nearest-even or, with ``stochastic``, rounded up in magnitude
with probability equal to its distance from the lower neighbour (unbiased). The random numbers are
counter based: element i of tensor t at update s draws ``random24(key(seed, s, t), i)``, so every
backend, device and data-parallel rank draws the same ones and a resumed run continues the stream
from the update count alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

SLICE = 1 << 14  # elements per slice of the torch fallback (FP32 temporaries of 64 KB each)
_MASK32 = 0xFFFFFFFF
# The moment scale puts a tensor's largest |value| in [2**14, 2**15): every value then rounds to a
# finite FP16 (max 65504); entries down to 2**-28 of the largest keep full precision.
MOMENT_TOP_EXPONENT = 15
MAX_LOG2_SCALE = 126  # keeps 2**log2_scale a normal FP32 number


def fmix32(value: int) -> int:
    """MurmurHash3's 32-bit finaliser: a bijective mix of 32 bits."""
    value ^= value >> 16
    value = (value * 0x85EBCA6B) & _MASK32
    value ^= value >> 13
    value = (value * 0xC2B2AE35) & _MASK32
    return value ^ (value >> 16)


def tensor_keys(seed: int, step: int, count: int) -> list[int]:
    """The 32-bit random key of each of ``count`` tensors at update ``step``."""
    base = ((seed & _MASK32) * 0x9E3779B9) & _MASK32
    return [
        fmix32((base + fmix32(((step * 0x85EBCA77) + (t * 0xC2B2AE3D)) & _MASK32)) & _MASK32) for t in range(count)
    ]


def _fmix32_tensor(value: torch.Tensor) -> torch.Tensor:
    """``fmix32`` over an int64 tensor of 32-bit values (products wrap modulo 2**64; the low 32 bits
    are exact)."""
    value = value ^ (value >> 16)
    value = (value * 0x85EBCA6B) & _MASK32
    value = value ^ (value >> 13)
    value = (value * 0xC2B2AE35) & _MASK32
    return value ^ (value >> 16)


def random24(key: int, start: int, count: int, device: torch.device) -> torch.Tensor:
    """24 random bits (int64, in [0, 2**24)) for elements ``start .. start+count-1`` of a tensor."""
    index = torch.arange(start, start + count, dtype=torch.int64, device=device)
    return _fmix32_tensor(((index * 0x27D4EB2F) & _MASK32) ^ key) >> 8


def _bits(value: torch.Tensor) -> torch.Tensor:
    """The IEEE bits of an FP32 tensor as non-negative int64."""
    return value.view(torch.int32).to(torch.int64) & _MASK32


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    """FP32 values from non-negative int64 IEEE bits."""
    signed = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
    return signed.to(torch.int32).view(torch.float32)


def round_stochastic(value: torch.Tensor, r24: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 ``value`` in ``dtype`` (FP16 or BF16), its magnitude rounded up with probability equal to
    its distance from the lower neighbour in units of the spacing there; ``r24`` in [0, 2**24)."""
    bits = _bits(value)
    sign, magnitude = bits & 0x80000000, bits & 0x7FFFFFFF
    if dtype == torch.bfloat16:
        rounded = sign | ((magnitude + (r24 >> 8)) & 0xFFFF0000)
    else:
        normal = sign | ((magnitude + (r24 >> 11)) & (_MASK32 ^ 0x1FFF))
        # Below 2**-14, FP16 numbers are evenly spaced 2**-24 apart.
        q = value.abs() * 2.0**24
        lower = q.floor()
        up = (r24.to(torch.float32) * 2.0**-24 < q - lower).to(torch.float32)
        subnormal = sign | _bits((lower + up) * 2.0**-24)
        rounded = torch.where(magnitude < 0x38800000, subnormal, normal)
    rounded = torch.where(magnitude >= 0x7F800000, bits, rounded)  # inf and NaN: to nearest
    return _from_bits(rounded).to(dtype)


def _store_weight(weight: torch.Tensor, value: torch.Tensor, key: int | None, start: int) -> None:
    if key is None:
        weight.copy_(value)
        return
    # The random bits and their hashing take int64 temporaries: a quarter slice at a time.
    step = SLICE // 4
    for offset in range(0, value.numel(), step):
        part = slice(offset, offset + step)
        bits = random24(key, start + offset, value[part].numel(), value.device)
        weight[part].copy_(round_stochastic(value[part], bits, weight.dtype))


def _slices(size: int) -> range:
    return range(0, size, SLICE)


def _sqrt(value: torch.Tensor) -> torch.Tensor:
    """The correctly rounded FP32 square root of FP32 ``value``, as the kernels' ``sqrtf``/``sqrt_rn``.

    torch's FP32 ``sqrt`` on the CPU is MKL's (within an ulp, not correctly rounded: a sixth of
    random inputs differ), whatever ``ATEN_CPU_CAPABILITY``. An FP64 square root within an ulp,
    rounded to FP32, is the correctly rounded FP32 one: scaled into [1, 2), the exact root of an
    FP32 number is at least 2**-50 away from every FP32 rounding boundary (halfway point), and the
    FP64 root is within 2**-52 of it, so both lie on the same side."""
    return value.double().sqrt_().float()


def _pow2(log2_scale: torch.Tensor) -> torch.Tensor:
    """2**k (FP32) for an integer-valued FP32 tensor k in [-126, 127], from its bits, as the kernels."""
    return ((log2_scale.to(torch.int32) + 127) << 23).view(torch.float32)


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
    """SGD over 16-bit ``weights`` in place (see the module docstring); ``keys``: stochastic rounding's
    per-tensor keys, or None for round-to-nearest."""
    for t, (weight, grad) in enumerate(zip(weights, grads, strict=True)):
        w, g_all = weight.view(-1), grad.view(-1)
        b_all = momenta[t].view(-1) if momentum != 0 else None
        for start in _slices(w.numel()):
            part = slice(start, start + SLICE)
            value = w[part].float()
            g = g_all[part].float() / grad_scale
            if weight_decay != 0:
                g.add_(value * weight_decay)
            update = g
            if b_all is not None:
                buffer = b_all[part].float().mul_(momentum).add_(g)
                update = g + buffer * momentum if nesterov else buffer
                b_all[part].copy_(buffer)
            _store_weight(w[part], value.add_(update * -lr), None if keys is None else keys[t], start)


def moment_log2_scale(top: torch.Tensor) -> torch.Tensor:
    """The power of two (its exponent, FP32) that puts ``top`` (a max |value|, FP32) in [2**14, 2**15)."""
    _, exponent = torch.frexp(top)
    return (MOMENT_TOP_EXPONENT - exponent).clamp(-MAX_LOG2_SCALE, MAX_LOG2_SCALE).float()


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
    """Adam over 16-bit ``weights`` in place (see the module docstring). ``log2_scales``: per tensor,
    the 0-dim FP32 exponents the two moments are stored with (updated); ``step_sizes``: per tensor,
    lr · sqrt(1 - b2^t) / (1 - b1^t); ``decay``: 1 - lr · weight_decay, or None."""
    for t, weight in enumerate(weights):
        m_scale, v_scale = log2_scales[t]
        read_m, read_v = _pow2(-m_scale), _pow2(-v_scale)

        def moments(part: slice, t: int = t, read_m: torch.Tensor = read_m, read_v: torch.Tensor = read_v):
            g = grads[t].view(-1)[part].float() / grad_scale
            m = exp_avgs[t].view(-1)[part].float().mul_(read_m).mul_(beta1).add_(g * (1 - beta1))
            v = exp_avg_sqs[t].view(-1)[part].float().mul_(read_v).mul_(beta2)
            return m, v.add_((g * (1 - beta2)).mul_(g))

        # Pass 1: the largest magnitude of each new moment (its scale is needed before any is stored).
        top_m = top_v = torch.zeros((), device=weight.device)
        for start in _slices(weight.numel()):
            m, v = moments(slice(start, start + SLICE))
            top_m, top_v = torch.maximum(top_m, m.abs().amax()), torch.maximum(top_v, v.abs().amax())
        new_m_scale, new_v_scale = moment_log2_scale(top_m), moment_log2_scale(top_v)
        # Pass 2: recompute the moments, store them scaled, update the weight.
        w = weight.view(-1)
        for start in _slices(w.numel()):
            part = slice(start, start + SLICE)
            m, v = moments(part)
            value = w[part].float()
            if decay is not None:
                value.mul_(decay)
            value.add_(m.div(_sqrt(v).add_(eps)).mul_(-step_sizes[t]))
            exp_avgs[t].view(-1)[part].copy_(m.mul_(_pow2(new_m_scale)))
            exp_avg_sqs[t].view(-1)[part].copy_(v.mul_(_pow2(new_v_scale)))
            _store_weight(w[part], value, None if keys is None else keys[t], start)
        m_scale.copy_(new_m_scale)
        v_scale.copy_(new_v_scale)


def adam_step_size(lr: float, beta1: float, beta2: float, step: int) -> float:
    """Adam's step size at update ``step`` (1-based), bias corrections included."""
    return lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
