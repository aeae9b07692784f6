"""The quantization maps of 8- and 4-bit optimizer state (``optim.state_bits``).

State is quantized in blocks of ``optim.state_block_size`` consecutive values: each block keeps its
largest magnitude (``absmax``, FP32) and every value as the code of the nearest entry of a map of
2**bits numbers in [-1, 1] once divided by it (blockwise quantization: Dettmers et al., 2022,
"8-bit Optimizers via Block-wise Quantization"; Li et al., 2023, "Memory Efficient Optimizers with
4-bit States"). A value reads back as ``map[code] * absmax``.

The maps are *dynamic exponent* maps (Dettmers, 2016), all but the 4-bit second moment's (below):
numbers spread over decades, each decade holding half as many as the one above it, so the relative
precision is best near the block's maximum and small values still keep their order of magnitude.
For a map of D decades, decade d (0: [0.1, 1], 1: [0.01, 0.1], ...) holds ``2**(D-1-d)`` numbers
``10**-d * (0.1 + 0.9 * j / count)``, j = 1 .. count, so 1.0 is in every map (a block's largest
value is stored exactly; the linear map has it too).

- ``signed`` maps (SGD's momentum, Adam's first moment): zero, 2**(bits-1) positive numbers over
  bits-1 decades plus one decade lower, and the negatives of all but that lowest one.
- ``unsigned`` maps (Adam's second moment, never negative): zero and 2**bits - 1 positive numbers,
  at 8 bits a dynamic exponent map over 8 decades, at 4 bits *linear*: ``j / 15``, j = 1 .. 15.
  **Zero is only the code of an exact zero**: a positive value never rounds to it. Li et al. found
  this "zero-point problem" to be what makes 4-bit second moments fail: a second moment read back as
  0 turns the next update of that weight into ``m / eps``. An exact zero keeps its code, so a reset
  position (DSR's regrown weights) is exactly zero.

  Why linear at 4 bits (Li et al.'s choice for the second moment, their "Linear" map, there without
  a zero at all): Adam divides by ``sqrt(v)``, so what matters is v's *relative* error where v is
  large, and a small v only needs to stay away from zero. The 4-bit dynamic exponent map puts 7 of
  its 15 positive entries at or below a tenth of the maximum and leaves gaps of 0.1125 above 0.2
  (53% of the entry at 0.21); the linear map's gaps are 1/15 everywhere (7% at the top), and a
  second moment below 1/15 of its block's maximum reads back as 1/15 of it (a smaller step for that
  weight, never a larger one). Measured (DynamicConv on phrases, Adam, 3 seeds, README): the
  dynamic exponent map trained 0.72 BLEU below 16-bit state, the linear map 0.45 below.

Rounding is to the nearest map entry: the code is the number of midpoints (FP32, between
neighbouring entries) below the normalised value, found by a binary search in every backend, so
the C kernel, the Triton kernel and the torch fallback give the same codes.
"""

from __future__ import annotations

import functools

import torch

BITS = (8, 4)


def _decades(count: int, exponents: int) -> list[float]:
    """Positive numbers over ``exponents`` decades, decade d holding 2**(exponents-1-d) of them."""
    values = []
    for d in range(exponents):
        count_here = 2 ** (exponents - 1 - d)
        values += [10.0**-d * (0.1 + 0.9 * j / count_here) for j in range(1, count_here + 1)]
    assert len(values) == count
    return values


@functools.cache
def code_map(bits: int, signed: bool) -> tuple[float, ...]:
    """The 2**bits numbers of a map, ascending (as FP32 values)."""
    if bits not in BITS:
        raise ValueError(f"quantized state has 8 or 4 bits, not {bits}")
    if signed:
        exponents = bits - 1
        positive = [*_decades(2**exponents - 1, exponents), 10.0**-exponents]
        values = [-v for v in positive if v != 10.0**-exponents] + [0.0] + positive
    elif bits == 4:  # the 4-bit second moment: linear (see the module docstring)
        values = [0.0, *(j / 15 for j in range(1, 16))]
    else:
        values = [0.0, *_decades(2**bits - 1, bits)]
    rounded = sorted(float(torch.tensor(v, dtype=torch.float32)) for v in values)
    assert len(rounded) == 2**bits and len(set(rounded)) == len(rounded) and 1.0 in rounded
    return tuple(rounded)


@functools.cache
def midpoints(bits: int, signed: bool) -> tuple[float, ...]:
    """The 2**bits - 1 FP32 numbers halfway between neighbouring map entries."""
    values = code_map(bits, signed)
    pairs = zip(values, values[1:], strict=False)
    return tuple(float(torch.tensor((a + b) / 2, dtype=torch.float32)) for a, b in pairs)


def zero_code(bits: int, signed: bool) -> int:
    """The code of 0.0 in a map."""
    return code_map(bits, signed).index(0.0)


@functools.cache
def _device_tables(bits: int, signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(code_map(bits, signed), dtype=torch.float32, device=device),
        torch.tensor(midpoints(bits, signed), dtype=torch.float32, device=device),
    )


def tables(bits: int, signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The map and its midpoints as FP32 tensors on ``device`` (made once per device)."""
    return _device_tables(bits, signed, torch.device(device))
