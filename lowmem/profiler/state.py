"""Model and optimizer memory by the report's definition (SPEC §4, report §2.2 and §3.1).

- model bytes: every parameter, dense as ``numel · element_size``; a sparse (masked) weight as CSR
  of its ``rows × columns`` matrix, ``rows = shape[0]`` and ``columns = prod(shape[1:])`` (a conv
  weight ``co × ci × k1 × k2`` becomes ``co × (ci·k1·k2)``): value bits per nonzero, plus
  ⌈log2(columns)⌉ bits per column index, plus ``rows + 1`` row pointers of
  ``ROW_POINTER_BITS`` bits.
- optimizer bytes: one gradient buffer per trainable parameter plus its momentum buffers
  (SGD with momentum: 1, Adam: 2). For a sparse weight they hold only the nonzero values: they share
  the weight's index arrays (DSR resets momentum at inactive positions, report §3.1).
- optimizer state bytes: the momentum buffers alone (part of the optimizer bytes). 8- and 4-bit
  state (``optim.state_bits``) counts its codes, ⌈n · bits / 8⌉ bytes for n values, plus one FP32
  scale per block of ``optim.state_block_size`` values (``quantized_state_bytes``).

Buffers (BatchNorm running statistics) and scalar optimizer bookkeeping (step counts, per-tensor
scales) are not counted: the report counts parameters and parameter-shaped buffers only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import nn

# Row pointers index into the nonzeros; 32 bits is the usual CSR choice (cuSPARSE, MKL, torch's
# int32 CSR) and holds any layer of up to 2**32 nonzeros. Their cost is (rows + 1) · 4 bytes per
# sparse tensor: about 10 KB over WRN-28-2's 24 sparse convolutions.
ROW_POINTER_BITS = 32


class StateBytes(NamedTuple):
    """Model and optimizer memory in bytes (report's accounting)."""

    model_bytes: int  # parameters: values, plus CSR indices of sparse weights
    optimizer_bytes: int  # gradient buffers + momentum buffers (values only for sparse weights)
    optimizer_state_bytes: int = 0  # the momentum buffers alone (codes + scales when quantized)


SCALE_BYTES = 4  # one FP32 scale (the block's largest magnitude) per quantization block


def quantized_state_bytes(values: int, bits: int, block_size: int) -> int:
    """Bytes of one state tensor of ``values`` entries at ``bits`` (8 or 4) per entry, blocks of
    ``block_size`` entries: the packed codes plus one FP32 scale per block."""
    return math.ceil(values * bits / 8) + SCALE_BYTES * math.ceil(values / block_size)


def csr_index_bytes(shape: torch.Size | tuple[int, ...], nonzeros: int) -> int:
    """Bytes of the CSR index arrays (column indices + row pointers) of a tensor of ``shape``.

    The tensor is viewed as a ``shape[0] × prod(shape[1:])`` matrix; each column index takes
    ⌈log2(columns)⌉ bits and each of the ``rows + 1`` row pointers ``ROW_POINTER_BITS`` bits.
    Bits are summed over the tensor and rounded up to whole bytes once.
    """
    rows = shape[0] if len(shape) > 0 else 1
    columns = math.prod(shape[1:]) if len(shape) > 1 else 1
    column_bits = (columns - 1).bit_length()  # = ceil(log2(columns)) for columns >= 1
    return math.ceil((nonzeros * column_bits + (rows + 1) * ROW_POINTER_BITS) / 8)


def momentum_buffers(optimizer: torch.optim.Optimizer | None) -> int:
    """Parameter-shaped state tensors the optimizer keeps per parameter: Adam-like (``betas``) 2,
    SGD with nonzero ``momentum`` 1, otherwise (plain SGD, no optimizer) 0."""
    if optimizer is None:
        return 0
    if "betas" in optimizer.defaults:
        return 2
    return 1 if optimizer.defaults.get("momentum", 0) else 0


def _state_entry_bytes(
    optimizer: torch.optim.Optimizer | None, param: torch.Tensor, values: int, state_bits: int | None,
    block_size: int | None,
) -> int:
    """Bytes of ``param``'s momentum buffers when they hold ``values`` entries (its nonzeros)."""
    if state_bits is None:  # the optimizer's own layout
        state_bits = getattr(optimizer, "state_bits", None)
        block_size = getattr(optimizer, "block_size", block_size)
        if state_bits not in (8, 4):
            buffers = _state_buffers(optimizer, param)
            sizes = (
                [b.element_size() for b in buffers]
                if buffers is not None
                else [param.element_size()] * momentum_buffers(optimizer)
            )
            return values * sum(sizes)
    count = momentum_buffers(optimizer)
    if state_bits in (8, 4):
        return count * quantized_state_bytes(values, state_bits, block_size or 128)
    return count * values * state_bits // 8


def _state_buffers(optimizer: torch.optim.Optimizer | None, param: torch.Tensor) -> list[torch.Tensor] | None:
    """The optimizer's parameter-shaped state tensors of ``param``; None before its first step."""
    if optimizer is None or param not in optimizer.state or not optimizer.state[param]:
        return None
    return [
        v
        for k, v in optimizer.state[param].items()
        if isinstance(v, torch.Tensor) and v.shape == param.shape and not k.endswith(("_codes", "_scales"))
    ]


def account_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    sparse: Mapping[str, tuple[Sequence[int], int]] | None = None,
    state_bits: int | None = None,
    state_block_size: int | None = None,
    shards: int = 1,
) -> StateBytes:
    """Model and optimizer bytes of ``model`` trained with ``optimizer``.

    sparse: the parameters that hold sparse weights, by their names in ``model.named_parameters()``,
        each with the weight's dense shape and its number of active entries
        (``DynamicSparsity.trained_parameters()``); those weights are counted as CSR, whether the
        parameter holds the dense weight (masked storage) or the active values only (compact).
    optimizer: its existing state tensors are counted in their own dtype; before the optimizer's
        first step (no state yet) the momentum buffers are counted by the optimizer's kind
        (``momentum_buffers``) in the parameter's dtype. None: gradients only. 8- and 4-bit state
        (the optimizer's ``state_bits``) is counted as ``quantized_state_bytes`` of the nonzeros.
    state_bits, state_block_size: count the optimizer's momentum buffers at this width instead of
        their own (the planner's what-if: ``optim.state_bits`` without building an optimizer).
    shards: the bytes of the first of ``shards`` ranks that shard every tensor along dimension 0
        (``trainer.parallel=fsdp``: ``ceil(rows / shards)`` rows of a dense tensor, of sparse values
        ``ceil(nonzeros / shards)``, and as large a share of their positions' CSR bytes: sharded
        compact positions, or the rows of a masked weight that rank holds).
    """
    sparse = dict(sparse or {})
    params = dict(model.named_parameters())
    unknown = sorted(set(sparse) - set(params))
    if unknown:
        raise KeyError(f"sparse weights that {type(model).__name__} does not have: {', '.join(unknown)}")
    model_bytes = optimizer_bytes = state_bytes = 0
    for name, param in params.items():
        shape, active = sparse.get(name, (param.shape, param.numel()))
        rows = param.shape[0] if name not in sparse and param.dim() else active
        nonzeros = _first_shard(active, rows, shards) if shards > 1 else active
        model_bytes += nonzeros * param.element_size()
        if name in sparse:
            model_bytes += csr_index_bytes(shape, active) * nonzeros // max(active, 1)
        if not param.requires_grad:
            continue
        grad_size = param.grad.element_size() if param.grad is not None else param.element_size()
        held = _state_entry_bytes(optimizer, param, nonzeros, state_bits, state_block_size)
        optimizer_bytes += nonzeros * grad_size + held
        state_bytes += held
    return StateBytes(model_bytes, optimizer_bytes, state_bytes)


def _first_shard(entries: int, rows: int, shards: int) -> int:
    """Entries of the first of ``shards`` shards of a tensor of ``entries`` in ``rows`` rows."""
    return -(-rows // shards) * (entries // rows) if rows else entries


# Compact sparse positions as stored (``lowmem.techniques.compact``): an int16 column per active
# entry and int64 row starts, one per row of ``COMPACT_ROW`` entries of the flattened weight, plus one.
COMPACT_COLUMN_BYTES, COMPACT_ROW_START_BYTES, COMPACT_ROW = 2, 8, 1 << 15
# Building a dense weight expands its positions by chunks of up to 2**17 entries: int64 flat
# indices and, while they are summed, int32 ones (compact.DENSIFY_CHUNK), bytes per entry.
COMPACT_DENSIFY_CHUNK, COMPACT_INDEX_SCRATCH_BYTES = 1 << 17, 8 + 4


class StepTemporaries(NamedTuple):
    """What a real step holds beyond the report's accounting and the pass's own tensors (bytes), by
    cause: the figure a memory budget is compared with is the accounted total, what the pass held
    beyond its activations (``lowmem.profiler.activations.ActivationTrace.live_bytes``, weight
    gradients being accumulated included) and ``total``.

    positions: compact sparse positions as stored (int16 columns, int64 row starts) less their CSR
        bits the accounting counts.
    buffers: the model's buffers other than compact positions (BatchNorm statistics, masks), which
        the report's model bytes leave out.
    """

    positions: int = 0
    buffers: int = 0

    @property
    def total(self) -> int:
        return self.positions + self.buffers


def step_temporaries(
    model: nn.Module, sparse: Mapping[str, tuple[Sequence[int], int]] | None = None
) -> StepTemporaries:
    """``StepTemporaries`` of a step of ``model`` whose weights ``sparse`` (name -> dense shape,
    active count, as ``account_state`` takes them) are compact."""
    sparse = dict(sparse or {})
    positions = 0
    for name in dict(model.named_parameters()):
        if name in sparse:
            shape, nonzeros = sparse[name]
            rows = max(1, -(-math.prod(shape) // COMPACT_ROW))
            stored = nonzeros * COMPACT_COLUMN_BYTES + (rows + 1) * COMPACT_ROW_START_BYTES
            positions += max(0, stored - csr_index_bytes(shape, nonzeros))
    # Compact positions are buffers too, counted above as stored.
    positions_suffixes = ("_columns", "_row_starts", "lowmem_compact_columns")
    buffers = {
        buffer.untyped_storage()._cdata: buffer.untyped_storage().nbytes()
        for name, buffer in model.named_buffers()
        if not name.endswith(positions_suffixes)
    }
    return StepTemporaries(positions, sum(buffers.values()))


def dense_weight_bytes(model: nn.Module, sparse: Mapping[str, tuple[Sequence[int], int]] | None = None) -> int:
    """The dense weight (or its gradient: one at a time) the largest compact sparse layer of ``model``
    builds while it computes, with the index scratch that builds it (bytes; ``sparse`` as
    ``step_temporaries`` takes it). A pass over the compact model holds it among its own tensors;
    ``lowmem.plan``, which accounts activations on the dense model, adds it."""
    dense = 0
    for name, param in model.named_parameters():
        if name in (sparse or {}):
            shape, nonzeros = sparse[name]
            scratch = min(nonzeros, COMPACT_DENSIFY_CHUNK) * COMPACT_INDEX_SCRATCH_BYTES
            dense = max(dense, math.prod(shape) * param.element_size() + scratch)
    return dense
