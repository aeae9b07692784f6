"""Compact storage of sparse weights: nonzero values and their positions, never a dense weight at rest.

A sparse weight of dense shape S with k active entries is held as

- ``<name>_values``: the k active values, a 1-D ``nn.Parameter`` in the weight's dtype (trained: its
  gradient and its optimizer state have k entries too), in increasing order of flat position; and
- their positions, in CSR form over the flattened weight cut into rows of ``ROW`` (2^15) entries,
  flat position = row · ROW + column, as two buffers:

  - ``<name>_columns``: the k column indices, int16 (2 bytes per active entry);
  - ``<name>_row_starts``: int64, ceil(numel / ROW) + 1 of them, row r's entries being
    ``values[row_starts[r]:row_starts[r + 1]]`` (8 bytes per 2^15 dense entries).

Why these rows rather than the weight's own (output channels): with a fixed row length every column
index fits in 16 bits whatever the weight's shape (a Linear of 100,000 inputs too), so no layer needs a
wider fallback; and signed int16 (not uint16, to which torch cannot add) adds to an int64 position
without a conversion pass. Resnet18 at density 0.3 holds 6.7 MB of int16 columns where flat int32
positions took 13.4 MB (the report's accounting, ``lowmem.profiler.state``, counts ceil(log2 columns)
bits per index of the weight's own rows: 13 bits there, so the real bytes stay close to it).

All compact weights of a model are views into three flat buffers (``CompactWeights.values`` /
``.columns`` / ``.row_starts``) whose sizes never change: the values and columns have one entry per
active weight (the total never changes), the row starts a fixed number per layer; a rewiring rewrites
entries and moves layer boundaries in place, so nothing is reallocated.

A layer builds its dense weight when it computes and drops it right after: autograd saves the
layer's input (and the compact tensors, which are model state), not the dense weight; backward
builds it again, runs the layer's backward kernels and gathers the weight gradient at the active
positions. Positions are expanded to flat indices by chunks of active entries, so building a dense
weight or gathering its gradient needs at most 1 MiB of index scratch beside the dense tensor.
The layers: ``nn.Linear``, ``nn.Conv1d/2d/3d``, ``nn.Embedding`` and transformers' ``Conv1D``
(GPT-2's linear layers, weight [in, out]; recognised by class name, transformers is never imported)
— their class gains a compact forward, whose output is a tensor of its own that the next op may
modify in place — and a bare 2-D parameter that the model applies with ``linear(module, name, x)``
(a decoder's output projection, say). A weight tied between modules stays tied: one values
parameter and one set of positions, held by every module that used the dense weight.

**Stacked matrices** (``is_stacked_matrices``): a parameter of 3 or more dims held by a module that
is no such layer — a mixture of experts' weights as transformers 5 stores them, ``gate_up_proj``
[experts, 2·intermediate, hidden] and ``down_proj`` [experts, hidden, intermediate], whatever the
module's own forward does with them (an expert loop, ``grouped_mm``, ``bmm``). The module's class
gains a forward that builds each such weight dense once per call, through autograd (its gradient
is gathered at the active positions in backward), and binds it under the parameter's name for the
call, so the module's own code reads a dense tensor of the weight's shape whose zeros are the
inactive entries; read outside a forward, the attribute builds a new one. Unlike a layer's, this
dense weight is the module's own ops' input, so they save it for backward like any input: it is held
from the forward to the backward (inside a checkpointed block, only while the block recomputes),
and the step holds it besides the compact values; gradients and optimizer state stay compact.

**Sharded training** (``trainer.parallel=fsdp``; ``CompactWeights.share_values``): the values of all
layers become one parameter of the model, ``lowmem_compact_values``, and their columns one buffer,
``lowmem_compact_columns`` (the flat buffers themselves, whose sizes never change), sharded across
the ranks; each unit's layers' ``<name>_values`` and ``<name>_columns`` are views of those gathered
for the unit's forward, and the values' gradients are reduced back onto the ranks that hold them
(``lowmem.techniques.compact_shards``). The row starts stay whole on every rank. A rewiring gathers
every value and column (``CompactWeights.gathered``), decides on every rank alike and each rank
keeps its rows of the new layout. A state dict holding each layer's columns (one process's) loads
into a sharded model (``CompactWeights.join_columns``).

The state-dict keys change (``conv.weight`` becomes ``conv.weight_values`` + ``conv.weight_columns``
+ ``conv.weight_row_starts``); ``dense_state_dict`` gives the plain form. A state dict of the former
layout (int32 flat ``<name>_positions``) still loads: it is converted on load.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import sys
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import checkpoint

from lowmem.kernels import cpu as cpu_kernels
from lowmem.residual import conv_output_shape
from lowmem.techniques.shards import full, write_full

_VALUES, _COLUMNS, _ROW_STARTS = "_values", "_columns", "_row_starts"
_INDEX = (_COLUMNS, _ROW_STARTS)  # the buffers that say where the values are
_FLAT_POSITIONS = "_positions"  # the former layout's int32 flat positions (converted on load)
_SHAPES = "_compact_shapes"  # module attribute: {weight attribute: dense shape}
SHARED_VALUES = "lowmem_compact_values"  # sharded training: the model's parameter holding every compact value
SHARED_COLUMNS = "lowmem_compact_columns"  # sharded training: the model's buffer holding every compact column

ROW = 1 << 15  # entries per row of a flattened weight: every column index fits in int16
# Active entries whose flat positions are built at once: ``densify``'s int64 indices (1 MiB, and
# 512 KiB of int32 while they are summed) and ``gather``'s int32 ones (256 KiB: a gather runs beside
# the dense weight gradient, its gathered entries and those of the weights before it in a
# checkpointed segment, a step's peak moment).
DENSIFY_CHUNK, GATHER_CHUNK = 1 << 17, 1 << 16
# A compact convolution whose dense weight takes at most this in FP32 computes its backward in one
# kernel call (``conv_backward``): the dense weight and its gradient then live together.
ONE_CALL_BYTES = 1 << 20


# --- positions: CSR over rows of ROW entries ----------------------------------------------------------


def row_count(numel: int) -> int:
    """Rows of ``ROW`` entries that a weight of ``numel`` entries is cut into (the last one partial)."""
    return max(1, -(-numel // ROW))


def encode(positions: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(columns, row_starts)`` of strictly increasing flat ``positions`` (any integer dtype) into a
    weight of ``numel`` entries: int16 columns, one per position, and ``row_count(numel) + 1`` int64
    row starts."""
    positions = positions.long()
    row_starts = positions.new_zeros(row_count(numel) + 1)
    row_starts[1:] = torch.bincount(positions // ROW, minlength=row_count(numel)).cumsum(0)
    return (positions % ROW).to(torch.int16), row_starts


def positions_by_chunk(
    columns: torch.Tensor, row_starts: torch.Tensor, size: int, dtype: torch.dtype = torch.int64
) -> Iterator[tuple[slice, torch.Tensor]]:
    """``(entries, flat positions)`` of consecutive chunks of at most ``size`` active entries: the
    slice of the active entries and their flat positions, a new ``dtype`` tensor (drop it before
    asking for the next, so that one chunk's scratch is alive at a time).

    Every row that starts inside a chunk adds ``ROW`` from its first entry on (rows starting at or
    before the chunk's first entry all count there), so one cumulative sum of these marks gives
    row · ROW; the column is added in place. The sum runs in int32 where the weight allows (a mixed
    int64 + int16 addition is several times slower on CPU), converted to ``dtype`` last. Sizes
    depend on the number of entries only: no device synchronisation (CUDA graphs capture it)."""
    count = columns.numel()
    if _without_values(columns):
        # A fake pass: positions have no values to compute, and each op costs the same whatever its
        # size, so all entries come at once and the positions are made in one op. The accounting is
        # the same (integer scratch is never saved nor counted; tests/test_compact.py pins it), and
        # fake passes through compact layers run ~3x fewer ops (lowmem.plan's, lowmem.profile's).
        yield slice(0, count), torch.empty(count, dtype=dtype, device=columns.device)
        return
    if row_starts.numel() <= 2:  # a weight of one row: the columns are the flat positions
        for start in range(0, count, size):
            entries = slice(start, min(start + size, count))
            yield entries, columns[entries].to(dtype)
        return
    rows = row_starts.numel() - 1
    summed = torch.int32 if rows * ROW <= torch.iinfo(torch.int32).max else torch.int64
    later_starts = row_starts[1:-1]
    row_step = torch.full(later_starts.shape, ROW, dtype=summed, device=columns.device)
    for start in range(0, count, size):
        entries = slice(start, min(start + size, count))
        length = entries.stop - start
        marks = torch.zeros(length + 1, dtype=summed, device=columns.device)  # the last slot: rows after it
        marks.index_add_(0, (later_starts - start).clamp_(0, length), row_step)
        positions = marks[:length].cumsum_(0).add_(columns[entries]).to(dtype)
        del marks
        yield entries, positions
        del positions


def _without_values(columns: torch.Tensor) -> bool:
    """Whether ``columns`` is a tensor without data (a profiler's fake pass, or the meta device)."""
    return isinstance(columns, FakeTensor) or columns.is_meta


def flat_positions(columns: torch.Tensor, row_starts: torch.Tensor) -> torch.Tensor:
    """The flat positions of all active entries (increasing), a new int64 tensor."""
    for _, positions in positions_by_chunk(columns, row_starts, max(1, columns.numel())):
        return positions  # the one chunk
    return columns.new_zeros(0, dtype=torch.int64)


def densify(
    values: torch.Tensor, columns: torch.Tensor, row_starts: torch.Tensor, shape: Sequence[int],
    memory_format: torch.memory_format = torch.contiguous_format,
) -> torch.Tensor:  # fmt: skip
    """The dense weight of ``shape``: ``values`` at their positions, zeros elsewhere (no autograd), in
    ``memory_format`` (channels-last: the C kernel writes each entry where that layout puts it; the
    torch fallback writes in position order and copies)."""
    channels_last = memory_format == torch.channels_last and len(shape) == 4
    if _copied_in_c(values, columns, row_starts):  # one pass, no index scratch
        if channels_last:
            dense = torch.empty(shape, dtype=values.dtype, device=values.device, memory_format=torch.channels_last)
            if cpu_kernels.densify(dense, values, columns, row_starts, ROW, _planes(shape)):
                return dense
        dense = values.new_empty(math.prod(shape))
        cpu_kernels.densify(dense, values, columns, row_starts, ROW)
    else:
        dense = values.new_zeros(math.prod(shape))
        for entries, positions in positions_by_chunk(columns, row_starts, DENSIFY_CHUNK):
            dense.index_copy_(0, positions, values[entries])
            del positions  # before the next chunk's are built
    if channels_last:
        return dense.view(shape).contiguous(memory_format=memory_format)
    return dense.view(shape)


# --- compiled code: a small weight built by ops the compiler traces --------------------------------------
# In compiled code a compact layer is one opaque operator (``lowmem.techniques.compact_ops``), whose
# every call passes through Python, in forward and in backward: a per-call cost which a small layer's
# own kernels do not outweigh (mobilenet_v3_small at 32x32 in microbatches of 10: a
# compiled compact sparse step 1.33x plain PyTorch compiled, FP32 on a Zen 3; docs/compile.md). A
# weight of at most ``TRACED_BYTES`` in FP32 (where the operator computes its backward in one kernel
# call too, ``ONE_CALL_BYTES``: the dense weight and its gradient alive together) is built instead by
# ops the compiler traces (``traced_dense``), which inductor turns into kernels of its own, and the
# layer's convolution or product is the graph's own. The dense weight stays what it is eagerly: built
# where the layer computes and dropped after, never saved for backward (``recomputed_dense``).
TRACED_BYTES = ONE_CALL_BYTES


def traced(shape: Sequence[int]) -> bool:
    """Whether compiled code builds a compact weight of dense ``shape`` by traced ops."""
    return math.prod(shape) * 4 <= TRACED_BYTES


def traced_dense(values: torch.Tensor, columns: torch.Tensor, row_starts: torch.Tensor, shape: Sequence[int]
                 ) -> torch.Tensor:  # fmt: skip
    """``densify`` as ops a compiler traces (through autograd: the values' gradient is the dense
    gradient at the active positions). An entry's row is found by binary search in the row starts
    (one row: the columns are the positions). The zeros come from padding an empty slice of the
    values, not from a new ``zeros``: the compiler merges equal factory calls of a graph into one
    tensor, and one zero tensor shared by the layers of a shape was then saved for backward,
    alive from forward to backward (tests/test_compile.py holds that none is)."""
    if row_starts.shape[0] <= 2:
        positions = columns.long()
    else:
        entries = torch.arange(values.shape[0], device=values.device)
        positions = torch.searchsorted(row_starts[1:-1], entries, right=True) * ROW + columns
    return F.pad(values[:0], (0, math.prod(shape))).index_put((positions,), values).view(shape)


def recomputed_dense(values: torch.Tensor, columns: torch.Tensor, row_starts: torch.Tensor, shape: Sequence[int]
                     ) -> torch.Tensor:  # fmt: skip
    """``traced_dense`` in compiled code inside ``torch.utils.checkpoint``: the compiler marks its ops
    to be recomputed for backward (its partitioner recomputes such ops whatever they cost), so it never
    saves the dense weight: backward builds it again, as the eager layer's does."""
    return checkpoint(traced_dense, values, columns, row_starts, tuple(shape), use_reentrant=False)


def gather(
    dense_grad: torch.Tensor, columns: torch.Tensor, row_starts: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The entries of ``dense_grad`` (any layout) at the active positions, in ``dtype`` (the compact
    values' gradient). The indices are int32 where the weight allows (half the scratch of int64)."""
    # Made like the columns (model state): activation profilers see a weight gradient, not an activation's.
    out = torch.empty_like(columns, dtype=dtype, device=dense_grad.device)
    if _channels_last(dense_grad) and dtype == dense_grad.dtype:
        stored = dense_grad.permute(0, 2, 3, 1).reshape(-1)  # its memory in order: a view, no copy
        if _copied_in_c(stored, columns, row_starts) and cpu_kernels.gather(
            out, stored, columns, row_starts, ROW, _planes(dense_grad.shape)
        ):
            return out
    flat = dense_grad.reshape(-1)
    index_dtype = torch.int32 if flat.numel() <= torch.iinfo(torch.int32).max else torch.int64
    if dtype == flat.dtype and _copied_in_c(flat, columns, row_starts):
        cpu_kernels.gather(out, flat, columns, row_starts, ROW)
        return out
    for entries, positions in positions_by_chunk(columns, row_starts, GATHER_CHUNK, index_dtype):
        if dtype == flat.dtype:
            torch.index_select(flat, 0, positions, out=out[entries])
        else:
            out[entries] = flat.index_select(0, positions)
        del positions  # before the next chunk's are built
    return out


def _planes(shape: Sequence[int]) -> tuple[int, int]:
    """(inner, spatial) of a 4-D weight [outer, inner, height, width], as the C kernels' channels-last
    copies take them."""
    return shape[1], shape[2] * shape[3]


def _channels_last(tensor: torch.Tensor) -> bool:
    """A 4-D tensor laid out channels-last and not also contiguous (a 1x1 kernel's is both)."""
    return (tensor.dim() == 4 and not tensor.is_contiguous()
            and tensor.is_contiguous(memory_format=torch.channels_last))  # fmt: skip


def _copied_in_c(values: torch.Tensor, columns: torch.Tensor, row_starts: torch.Tensor) -> bool:
    """Whether ``densify``/``gather`` run as one C loop (``lowmem.kernels.cpu``): real contiguous
    CPU tensors, and not where ``LOWMEM_KERNELS=torch`` asks for plain torch."""
    return (
        values.device.type == "cpu"
        and not _without_values(columns)
        and os.environ.get("LOWMEM_KERNELS", "auto") != "torch"
        and cpu_kernels.copies_compact(values, columns, row_starts)
    )


def repoint(parameter: nn.Parameter, data: torch.Tensor) -> None:
    """``parameter.data = data``, where a rewiring moved the layer's count (a new shape). A gradient
    accumulator of ``parameter`` that an old graph still holds is first cut loose: torch keeps it
    across a change of shape (``.data`` drops it on a change of dtype or device only), with the old
    shape, and the next backward through ``parameter`` then fails ("returned an invalid gradient ...
    expected shape compatible with" the old count). Old graphs outlive a step more often than one
    would think: a loss tensor kept from an earlier step (``total += loss``), and ``torch.compile``'s
    traced inputs, held in reference cycles until the garbage collector runs (a compiled
    ``residual_star`` step failed so at the second rewiring)."""
    if parameter.shape != data.shape:
        other = torch.float16 if data.dtype != torch.float16 else torch.float32  # every device has both
        parameter.data = data.new_empty(0, dtype=other)  # a new dtype: torch drops the accumulator
    parameter.data = data


def mark_counts_dynamic(module: nn.Module) -> None:
    """Tell ``torch.compile`` that the number of active values of ``module``'s compact weights is a
    dynamic size (``maybe_mark_dynamic``: a symbol, where no code specializes it): a rewiring changes
    it layer by layer, and graphs compiled for static counts recompiled at every rewiring (every block
    graph of a checkpointed model, seconds each, until dynamo's cache limit sent them back to eager
    code). Marks the values parameters and their columns (new tensors at each rewiring: ``_store``
    marks them again once the compiler is loaded)."""
    from torch._dynamo import maybe_mark_dynamic

    for name in compact_names(module):
        for tensor in (getattr(module, name + _VALUES, None), getattr(module, name + _COLUMNS, None)):
            if isinstance(tensor, torch.Tensor):  # sharded values are gathered views, or absent, between steps
                maybe_mark_dynamic(tensor, 0)


def is_compact(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s weight ``name`` is held in compact form."""
    return name in getattr(module, _SHAPES, {})


def compact_names(module: nn.Module) -> dict[str, torch.Size]:
    """The compact weights of ``module`` (its own, not its children's): attribute -> dense shape."""
    return dict(getattr(module, _SHAPES, {}))


def dense_weight(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """``module``'s weight ``name`` as a dense tensor: the parameter itself, or one built from the
    compact form (a new tensor outside autograd)."""
    if not is_compact(module, name):
        return getattr(module, name)
    with torch.no_grad():
        return densify(_values(module, name), *_index(module, name), getattr(module, _SHAPES)[name])


def trained_weight(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """The tensor the optimizer trains for weight ``name``: the dense parameter or the compact values."""
    return _values(module, name) if is_compact(module, name) else getattr(module, name)


def index_of(module: nn.Module, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor] | None:
    """(columns, row_starts) of ``module``'s compact weight ``name`` as bound now, or None if it is
    dense: what a backward that reads the weight again should keep from its forward."""
    return _index(module, name) if is_compact(module, name) else None


def _values(module: nn.Module, name: str) -> torch.Tensor:
    return getattr(module, name + _VALUES)


def _index(module: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(columns, row_starts) of compact weight ``name``."""
    return getattr(module, name + _COLUMNS), getattr(module, name + _ROW_STARTS)


# --- the layers' computations ------------------------------------------------------------------


def _dtype_for(grad: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in ``grad``'s dtype (under autocast the forward computed in that dtype)."""
    return tensor if tensor.dtype == grad.dtype else tensor.to(grad.dtype)


def _own_tensor(output: torch.Tensor) -> torch.Tensor:
    """A compact layer's ``output`` as a tensor of its own, not a view, in the same memory (no copy):
    the next op may then modify it in place (``x[..., :2] = ...``, ``x.add_(...)``), which autograd
    refuses on a view that a custom Function returned. ``F.linear`` on an input of 3 or more dims
    returns its 2-D product reshaped as a view (swin_v2_t writes into it)."""
    return torch.ops.aten._unsafe_view(output, output.shape) if output._is_view() else output


CONVOLUTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}  # by number of spatial dims


def conv_backward(
    conv: nn.Conv1d | nn.Conv2d | nn.Conv3d,
    grad_output: torch.Tensor,
    x: torch.Tensor,
    trained: torch.Tensor,
    bias_shape: Sequence[int] | None,
    wanted: tuple[bool, bool, bool],
    index: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``conv``'s input, trained weight (``trained_weight(conv)``) and bias from those of
    its output, with the kernels autograd calls (under autocast in ``grad_output``'s dtype);
    ``index``: a compact weight's (columns, row_starts) as its forward read them (default: the
    module's now; under sharded training they are bound for the unit's forward only). A
    compact weight is built for the input gradient only and dropped before the weight gradient,
    computed from the input alone (as ``torch.nn.grad.conv2d_weight`` does), is gathered: one
    dense weight-sized tensor at a time, never two. Except for a small weight (``ONE_CALL_BYTES``):
    one kernel call computes every gradient, as autograd's own backward does, and the dense weight
    and its gradient are alive together (at most twice that size): the second call costs more time
    than those bytes are worth (its operands converted again under ``precision.cpu_compute=fp32``,
    its kernel set up again: docs/techniques.md gives the measured difference)."""
    args = (conv.stride, conv.padding, conv.dilation, False, [0] * len(conv.stride), conv.groups)
    if not is_compact(conv, "weight"):
        weight = _dtype_for(grad_output, trained)
        x = _dtype_for(grad_output, x)
        return torch.ops.aten.convolution_backward(grad_output, x, weight, bias_shape, *args, list(wanted))
    index = index if index is not None else _index(conv, "weight")
    return compact_conv_backward(grad_output, x, trained, index, conv.compact_shape("weight"), args, bias_shape, wanted)


def compact_conv_backward(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    trained: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor],
    shape: Sequence[int],
    args: tuple,
    bias_shape: Sequence[int] | None,
    wanted: tuple[bool, bool, bool],
    memory_format: torch.memory_format = torch.contiguous_format,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``conv_backward`` of a compact weight of dense ``shape``, its (values, index); ``args``:
    ``aten.convolution_backward``'s (stride, padding, dilation, transposed, output padding, groups);
    the dense weight built in ``memory_format`` (that of ``x`` and ``grad_output``)."""
    x = _dtype_for(grad_output, x)
    need_x, need_weight, need_bias = wanted
    grad_x = grad_values = grad_bias = None

    def dense() -> torch.Tensor:
        return _dtype_for(grad_output, densify(trained, *index, shape, memory_format))

    if need_x and need_weight and math.prod(shape) * 4 <= ONE_CALL_BYTES:
        weight = dense()
        grad_x, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad_output, x, weight, bias_shape, *args, list(wanted)
        )
        del weight
        return grad_x, gather(grad_weight, *index, trained.dtype), grad_bias
    if need_x:
        weight = dense()
        grad_x = torch.ops.aten.convolution_backward(grad_output, x, weight, None, *args, [True, False, False])[0]
        del weight
    if need_weight or need_bias:
        shape_only = grad_output.new_empty(1).expand(shape)  # the kernel reads the weight's shape only
        _, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad_output, x, shape_only, bias_shape, *args, [False, need_weight, need_bias]
        )
        if grad_weight is not None:
            grad_values = gather(grad_weight, *index, trained.dtype)
    return grad_x, grad_values, grad_bias


conv2d_backward = conv_backward  # the name the no_bn checkpointing strategy imports


def compact_conv(x, values, columns, row_starts, bias, shape, stride, padding, dilation, groups) -> torch.Tensor:
    """A convolution by a compact weight of dense ``shape`` (no autograd): built, used, dropped."""
    weight = densify(values, columns, row_starts, shape)
    return _own_tensor(CONVOLUTIONS[len(stride)](x, weight, bias, stride, padding, dilation, groups))


class _CompactConvolution(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, values, columns, row_starts, bias, conv):
        ctx.conv, ctx.bias_shape = conv, None if bias is None else bias.shape
        ctx.save_for_backward(x, values, columns, row_starts)
        return compact_conv(x, values, columns, row_starts, bias, conv.compact_shape("weight"), conv.stride,
                            conv.padding, conv.dilation, conv.groups)

    @staticmethod
    def backward(ctx, grad_output):
        x, values, columns, row_starts = ctx.saved_tensors
        wanted = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[4])
        grad_x, grad_values, grad_bias = conv_backward(
            ctx.conv, grad_output, x, values, ctx.bias_shape, wanted, (columns, row_starts)
        )
        return grad_x, grad_values, None, None, grad_bias, None


class _CompactLinear(torch.autograd.Function):
    """``x @ W.T + bias`` with W of ``shape`` [out, in] (``nn.Linear``) or, ``transposed``,
    ``x @ W + bias`` with W [in, out] (transformers' ``Conv1D``), computed as that layer's own
    forward does (one addmm over the input flattened to 2-D)."""

    @staticmethod
    def forward(ctx, x, values, columns, row_starts, bias, shape, transposed):
        ctx.shape, ctx.transposed = shape, transposed
        ctx.save_for_backward(x, values, columns, row_starts)
        return compact_linear(x, values, columns, row_starts, bias, shape, transposed)

    @staticmethod
    def backward(ctx, grad_output):
        x, values, columns, row_starts = ctx.saved_tensors
        wanted = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[4])
        grad_x, grad_values, grad_bias = compact_linear_backward(
            grad_output, x, values, columns, row_starts, ctx.shape, ctx.transposed, wanted
        )
        return grad_x, grad_values, None, None, grad_bias, None, None


def compact_linear(x, values, columns, row_starts, bias, shape, transposed) -> torch.Tensor:
    """``_CompactLinear``'s product (no autograd)."""
    weight = densify(values, columns, row_starts, shape)
    if not transposed:
        return _own_tensor(F.linear(x, weight, bias))
    return _own_tensor(_transposed_product(x, weight, bias))


def _transposed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight + bias`` for ``weight`` [in, out], as transformers' ``Conv1D`` computes it (one
    addmm over ``x`` flattened to 2-D)."""
    x_2d = x.reshape(-1, x.shape[-1])
    out = x_2d.mm(weight) if bias is None else torch.addmm(bias, x_2d, weight)
    return out.view(*x.shape[:-1], weight.shape[1])


def compact_linear_backward(grad_output, x, values, columns, row_starts, shape, transposed, wanted):
    """``_CompactLinear``'s gradients of (x, values, bias) where ``wanted``, else None."""
    grad_x = grad_values = grad_bias = None
    grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
    if wanted[0]:
        weight = _dtype_for(grad_output, densify(values, columns, row_starts, shape))
        grad_x = grad_output.matmul(weight.t() if transposed else weight)
        del weight
    if wanted[1]:
        x_2d = _dtype_for(grad_output, x).reshape(-1, x.shape[-1])
        grad_weight = x_2d.t().mm(grad_2d) if transposed else grad_2d.t().mm(x_2d)
        grad_values = gather(grad_weight, columns, row_starts, values.dtype)
    if wanted[2]:
        grad_bias = grad_2d.sum(0)
    return grad_x, grad_values, grad_bias


class _CompactEmbedding(torch.autograd.Function):
    """A lookup needs the values in forward only: backward gathers the dense gradient at the
    positions. Under sharded training the unit gathering may give the embedding a way to gather its
    columns again (``COLUMNS_AGAIN``), as FSDP2 gathers a weight again for backward; then nothing of
    the gathered weight is held from the forward to the backward."""

    @staticmethod
    def forward(ctx, tokens, values, columns, row_starts, embedding):
        ctx.embedding, ctx.values_dtype = embedding, values.dtype
        ctx.columns_again = embedding.__dict__.get(COLUMNS_AGAIN)
        ctx.save_for_backward(tokens, row_starts, *([] if ctx.columns_again else [columns]))
        weight = densify(values, columns, row_starts, embedding.compact_shape("weight"))
        padding_idx = -1 if embedding.padding_idx is None else embedding.padding_idx
        return _own_tensor(torch.ops.aten.embedding(weight, tokens, padding_idx, embedding.scale_grad_by_freq, False))

    @staticmethod
    def backward(ctx, grad_output):
        tokens, row_starts, *columns = ctx.saved_tensors
        embedding = ctx.embedding
        padding_idx = -1 if embedding.padding_idx is None else embedding.padding_idx
        grad_weight = torch.ops.aten.embedding_dense_backward(
            grad_output, tokens, embedding.num_embeddings, padding_idx, embedding.scale_grad_by_freq
        )
        columns = columns[0] if columns else ctx.columns_again()
        return None, gather(grad_weight, columns, row_starts, ctx.values_dtype), None, None, None


# Sharded training: a compact embedding's attribute (in its __dict__), a function that gathers its
# weight's columns again for backward (``lowmem.techniques.compact_shards``).
COLUMNS_AGAIN = "_lowmem_columns_again"


def _untraced(x: torch.Tensor | fx.Proxy) -> torch.Tensor:
    """``x``, unless a ``torch.fx`` trace is passing through a compact layer: refused, since the trace
    would keep the positions of this moment as constants (new tensors held by the traced module,
    and stale after the next rewiring). Tracers that catch the error run the module as it is."""
    if isinstance(x, fx.Proxy):
        raise TypeError("a compact sparse layer cannot be traced by torch.fx (its positions change at each rewiring)")
    return x


def linear(module: nn.Module, name: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, module.<name>, bias)`` for a bare weight parameter, compact or dense."""
    if not is_compact(module, name):
        return F.linear(x, getattr(module, name), bias)
    shape = module._compact_shapes[name]
    if torch.compiler.is_compiling():  # one op of the graph (lowmem.techniques.compact_ops)
        x, values, bias = _autocast_operands(x, _values(module, name), bias)
        return torch.ops.lowmem.compact_linear(x, values, *_index(module, name), bias, list(shape), False)
    return _CompactLinear.apply(_untraced(x), _values(module, name), *_index(module, name), bias, shape, False)


class _DenseStacked(torch.autograd.Function):
    """The dense tensor of a compact stacked weight, for its module's own ops; backward gathers the
    dense gradient those ops give it at the active positions (the values' gradient)."""

    @staticmethod
    def forward(ctx, values, columns, row_starts, shape):
        ctx.values_dtype = values.dtype
        ctx.save_for_backward(columns, row_starts)
        return _own_tensor(densify(values, columns, row_starts, shape))

    @staticmethod
    def backward(ctx, grad):
        columns, row_starts = ctx.saved_tensors
        return gather(grad, columns, row_starts, ctx.values_dtype), None, None, None


def _dense_stacked(module: nn.Module, name: str) -> torch.Tensor:
    """``module``'s compact stacked weight ``name`` as a new dense tensor, in autograd's graph."""
    return _DenseStacked.apply(_values(module, name), *_index(module, name), getattr(module, _SHAPES)[name])


class _CompactStackedModule:
    """Mixin of a module holding compact stacked weights (``is_stacked_matrices``): inside its
    forward each reads as one dense tensor built for the call (every expert of the call reads the
    same one); outside, each read builds a new one."""

    def forward(self, *args: object, **kwargs: object) -> object:
        stacked = [name for name, shape in getattr(self, _SHAPES).items() if len(shape) >= 3]
        self.__dict__.update({name: _dense_stacked(self, name) for name in stacked})
        try:
            return super().forward(*args, **kwargs)
        finally:  # the call's dense weights live on only where its ops saved them for backward
            for name in stacked:
                self.__dict__.pop(name, None)

    def __getattr__(self, name: str) -> object:
        if name in self.__dict__.get(_SHAPES, {}):
            return _dense_stacked(self, name)
        return super().__getattr__(name)


_STACKED_CLASSES: dict[type, type] = {}  # a module's class -> its class with compact stacked weights


def is_stacked_matrices(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` is a parameter of stacked matrices: 3 or more dims, held by a module
    that is not a layer with a weight of its own kind (``nn.Linear``, ``nn.Embedding``, a convolution,
    transformers' ``Conv1D``). The leading dims index the matrices, the last two are each one's
    [rows, columns]: a mixture of experts' weights (transformers 5's ``gate_up_proj``, ``down_proj``)."""
    param = module._parameters.get(name)
    return (
        param is not None
        and param.dim() >= 3
        and not isinstance(module, (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd))
        and not is_transformers_conv1d(module)
    )


def matrix_count(shape: Sequence[int]) -> int:
    """How many matrices a stacked weight of ``shape`` holds (the product of its leading dims)."""
    return math.prod(shape[:-2])


class _CompactModule:
    """Mixin of the compact layer classes: ``weight`` reads as a dense tensor (built on demand)."""

    def compact_shape(self, name: str) -> torch.Size:
        return getattr(self, _SHAPES)[name]

    @property
    def weight(self) -> torch.Tensor:
        return dense_weight(self, "weight")


def _autocast_operands(
    x: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A compiled compact layer's operands in autocast's dtype where autocast is on (``precision=amp``),
    as the eager layer's convolution or product casts them (the operators run without autocast); the
    casts' backward returns the values' gradient in their own dtype, as the eager layer's gather does."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, values, bias
    dtype = torch.get_autocast_dtype(device)
    return x.to(dtype), values.to(dtype), None if bias is None else bias.to(dtype)


class _CompactConvolutionModule(_CompactModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.compact_shape("weight")
        if torch.compiler.is_compiling() and traced(shape):  # the graph's own ops
            weight = recomputed_dense(self.weight_values, *_index(self, "weight"), shape)
            return CONVOLUTIONS[len(self.stride)](x, weight, self.bias, self.stride, self.padding, self.dilation,
                                                  self.groups)  # fmt: skip
        if torch.compiler.is_compiling():  # one op of the graph (lowmem.techniques.compact_ops)
            x, values, bias = _autocast_operands(x, self.weight_values, self.bias)
            return torch.ops.lowmem.compact_conv(
                x, values, *_index(self, "weight"), bias, list(self.compact_shape("weight")),
                list(self.stride), list(self.padding), list(self.dilation), self.groups,
            )
        return _CompactConvolution.apply(_untraced(x), self.weight_values, *_index(self, "weight"), self.bias, self)

    def unread_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x)`` as an autograd node only, in compiled code (``lowmem.residual.unread_conv``):
        a broadcast zero, whose backward is the compact convolution's (computed eagerly)."""
        if not torch.compiler.is_compiling():
            return self(x)
        x, values, bias = _autocast_operands(x, self.weight_values, self.bias)
        arguments = (list(self.compact_shape("weight")), list(self.stride), list(self.padding), list(self.dilation),
                     self.groups)  # fmt: skip
        return _UnreadCompactConvolution.apply(x, values, *_index(self, "weight"), bias, arguments)


class _UnreadCompactConvolution(torch.autograd.Function):
    """Traced by the compiler: forward a broadcast zero of the output's shape, backward the operator
    ``lowmem::compact_conv_backward`` (registered by ``lowmem.techniques.compact_ops``)."""

    @staticmethod
    def forward(ctx, x, values, columns, row_starts, bias, arguments):
        shape, stride, padding, dilation, groups = arguments
        ctx.save_for_backward(x, values, columns, row_starts)
        ctx.arguments, ctx.bias_size = arguments, -1 if bias is None else bias.shape[0]
        output = conv_output_shape(x.shape, shape[0], shape[2:], stride, padding, dilation)
        return x.new_zeros((), dtype=values.dtype).expand(output)

    @staticmethod
    def backward(ctx, grad_output):
        x, values, columns, row_starts = ctx.saved_tensors
        wanted = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[4] and ctx.bias_size >= 0]
        grad_x, grad_values, grad_bias = torch.ops.lowmem.compact_conv_backward(
            grad_output, x, values, columns, row_starts, *ctx.arguments, ctx.bias_size, wanted
        )
        return (grad_x if wanted[0] else None, grad_values if wanted[1] else None, None, None,
                grad_bias if wanted[2] else None, None)  # fmt: skip


class CompactConv1d(_CompactConvolutionModule, nn.Conv1d):
    pass


class CompactConv2d(_CompactConvolutionModule, nn.Conv2d):
    pass


class CompactConv3d(_CompactConvolutionModule, nn.Conv3d):
    pass


class CompactLinear(_CompactModule, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.compact_shape("weight")
        if torch.compiler.is_compiling() and traced(shape):  # the graph's own ops
            return F.linear(x, recomputed_dense(self.weight_values, *_index(self, "weight"), shape), self.bias)
        if torch.compiler.is_compiling():  # one op of the graph
            x, values, bias = _autocast_operands(x, self.weight_values, self.bias)
            return torch.ops.lowmem.compact_linear(x, values, *_index(self, "weight"), bias, list(shape), False)
        return _CompactLinear.apply(_untraced(x), self.weight_values, *_index(self, "weight"), self.bias, shape, False)


class CompactEmbedding(_CompactModule, nn.Embedding):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and COLUMNS_AGAIN not in self.__dict__:  # one op of the graph
            padding_idx = -1 if self.padding_idx is None else self.padding_idx
            return torch.ops.lowmem.compact_embedding(
                tokens, self.weight_values, *_index(self, "weight"), list(self.compact_shape("weight")), padding_idx,
                self.scale_grad_by_freq,
            )
        return _CompactEmbedding.apply(_untraced(tokens), self.weight_values, *_index(self, "weight"), self)


class _CompactTransposedLinear(_CompactModule):
    """The compact forward of transformers' ``Conv1D``; ``_compact_class`` makes the class, a
    subclass of the model's own ``Conv1D`` (lowmem does not import transformers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.compact_shape("weight")
        if torch.compiler.is_compiling() and traced(shape):  # the graph's own ops, as Conv1D computes
            return _transposed_product(x, recomputed_dense(self.weight_values, *_index(self, "weight"), shape),
                                       self.bias)
        if torch.compiler.is_compiling():  # one op of the graph
            x, values, bias = _autocast_operands(x, self.weight_values, self.bias)
            return torch.ops.lowmem.compact_linear(x, values, *_index(self, "weight"), bias, list(shape), True)
        return _CompactLinear.apply(_untraced(x), self.weight_values, *_index(self, "weight"), self.bias, shape, True)


_COMPACT_CLASSES: dict[type, type] = {
    nn.Conv1d: CompactConv1d,
    nn.Conv2d: CompactConv2d,
    nn.Conv3d: CompactConv3d,
    nn.Linear: CompactLinear,
    nn.Embedding: CompactEmbedding,
}
_DENSE_CLASSES = {compact: dense for dense, compact in _COMPACT_CLASSES.items()}
_CONVOLUTION_CLASSES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def is_transformers_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (``transformers.pytorch_utils``, GPT-2's layers):
    a linear layer whose weight is [in, out], y = x @ W + b. Recognised by its class's name and
    module, so that lowmem never imports transformers."""
    kind = type(module)
    return kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers")


def _compact_class(module: nn.Module) -> type | None:
    """The class whose forward runs ``module`` with a compact weight (``None``: no such class)."""
    kind = type(module)
    if kind not in _COMPACT_CLASSES and is_transformers_conv1d(module):
        compact = type("CompactConv1D", (_CompactTransposedLinear, kind), {"__module__": __name__})
        _COMPACT_CLASSES[kind], _DENSE_CLASSES[compact] = compact, kind
    return _COMPACT_CLASSES.get(kind)


def compact_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that run a compact forward (layers, and modules of stacked matrices)."""
    return [m for m in model.modules() if isinstance(m, (_CompactModule, _CompactStackedModule))]


def compiles_whole(layer: nn.Module) -> bool:
    """Whether compiled code runs compact ``layer`` without a graph break: as one operator
    (``lowmem.techniques.compact_ops``) or, a small weight (``traced``), as traced ops: convolutions,
    linear layers, transformers' ``Conv1D`` and embeddings (not under sharded training)."""
    if isinstance(layer, _CompactConvolutionModule):
        return True  # padded by numbers (check_compactable refuses a padding by name)
    if isinstance(layer, CompactEmbedding):
        return COLUMNS_AGAIN not in layer.__dict__
    return isinstance(layer, (CompactLinear, _CompactTransposedLinear))


def has_compact_forward(module: nn.Module) -> bool:
    """Whether ``module``'s ``weight`` can be held compact and run by a compact forward: exactly
    ``nn.Linear``, ``nn.Conv1d/2d/3d``, ``nn.Embedding`` and transformers' ``Conv1D`` (not their
    subclasses, whose forward may do more)."""
    return _compact_class(module) is not None and isinstance(getattr(module, "weight", None), torch.Tensor)


def check_compactable(module: nn.Module, name: str, qualified: str) -> None:
    """Raise ValueError (naming the weight) unless compact storage can hold and run ``module.<name>``."""
    layer = _compact_class(module) is not None
    if name == "weight" and layer:
        problem = None
        if isinstance(module, _CONVOLUTION_CLASSES) and (
            module.padding_mode != "zeros" or isinstance(module.padding, str)
        ):
            problem = f"an {type(module).__name__} with numeric zero padding"
        if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.sparse):
            problem = "an Embedding without max_norm and sparse=False"
        if problem is None:
            return
        raise ValueError(f"sparsity.storage=compact: {qualified} must be {problem}; use sparsity.storage=masked")
    if is_stacked_matrices(module, name):
        return
    if layer or getattr(module, name).dim() != 2:
        raise ValueError(
            f"sparsity.storage=compact holds the weights of nn.Linear, nn.Conv1d/2d/3d, nn.Embedding and "
            f"transformers' Conv1D, stacked matrices (a parameter of 3 or more dims of another module: a "
            f"mixture of experts' weights) and 2-D parameters that the model applies with "
            f"lowmem.techniques.compact.linear; {qualified} is none of these (use sparsity.storage=masked)"
        )


# --- the flat buffers ---------------------------------------------------------------------------------


class CompactWeights:
    """Every compact sparse weight of one model, as views into three flat buffers of fixed size.

    ``names`` are parameter names of ``model`` (``conv1.weight``, ``decoder.embed_out``); ``masks``
    says which entries are active (bool, the weights' shapes). Construction moves the active values
    of each weight into the buffers and removes the dense weights from the model.

    A weight that several modules share (a tied embedding and output projection: GPT-2's
    ``transformer.wte.weight`` is ``lm_head.weight``) stays shared: every module holding it gets the
    one values parameter and the same positions, so it is sparsified once and trained once.
    """

    def __init__(self, model: nn.Module, names: Sequence[str], masks: Mapping[str, torch.Tensor]) -> None:
        self.names = list(names)
        self._owners = {name: owner_of(model, name) for name in self.names}
        # The other (module, attribute) places that hold the same parameter, by weight.
        self._tied = {name: _tied_places(model, *self._owners[name]) for name in self.names}
        dense = {name: getattr(module, attr) for name, (module, attr) in self._owners.items()}
        dtypes = {w.dtype for w in dense.values()}
        devices = {w.device for w in dense.values()}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"sparsity.storage=compact needs every sparse weight in one dtype on one device; got "
                f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}"
            )
        for name, (module, attr) in self._owners.items():
            check_compactable(module, attr, name)
            for qualified, tied_module, tied_attr in self._tied[name]:
                check_compactable(tied_module, tied_attr, f"{qualified} (tied to {name})")
        positions = {name: masks[name].flatten().nonzero().squeeze(1) for name in self.names}
        self.capacity = sum(p.numel() for p in positions.values())
        (dtype,), (device,) = dtypes, devices
        self.values = torch.empty(self.capacity, dtype=dtype, device=device)
        self.columns = torch.empty(self.capacity, dtype=torch.int16, device=device)
        rows = sum(row_count(dense[name].numel()) + 1 for name in self.names)
        self.row_starts = torch.empty(rows, dtype=torch.int64, device=device)
        self.counts = [0] * len(self.names)
        self.shared: nn.Module | None = None  # sharded training: the model holding every value (SHARED_VALUES)
        self.gathering = None  # sharded training: what gathers each unit's values (compact_shards.UnitGathering)
        with torch.no_grad():
            layers = {name: (positions[name], dense[name].flatten()[positions[name]]) for name in self.names}
            for name, (module, attr) in self._owners.items():
                _install(module, attr, dense[name].shape)
                for _, tied_module, tied_attr in self._tied[name]:
                    _install(tied_module, tied_attr, dense[name].shape, _values(module, attr))
            self._store(layers)

    # ------------------------------------------------------------------------------------ layers
    def values_of(self, name: str) -> nn.Parameter:
        """The values parameter of weight ``name`` (a view into ``values``; shared values: a view of
        the gathered values, inside ``gathered()`` only)."""
        module, attr = self._owners[name]
        if self.shared is not None and self.values is None:
            raise RuntimeError(f"compact weight {name}: its values are sharded; read them inside gathered()")
        return _values(module, attr)

    def positions(self, name: str) -> torch.Tensor:
        """The flat positions of weight ``name``'s active entries, increasing: a new int64 tensor
        (shared values: inside ``gathered()`` only)."""
        module, attr = self._owners[name]
        if self.shared is not None and self.columns is None:
            raise RuntimeError(f"compact weight {name}: its positions are sharded; read them inside gathered()")
        return flat_positions(*_index(module, attr))

    def layer(self, name: str) -> tuple[nn.Parameter, torch.Tensor]:
        """The values parameter and the flat positions (new, int64) of weight ``name``."""
        return self.values_of(name), self.positions(name)

    def shape(self, name: str) -> torch.Size:
        module, attr = self._owners[name]
        return getattr(module, _SHAPES)[attr]

    def owner(self, name: str) -> tuple[nn.Module, str]:
        return self._owners[name]

    def dense(self, name: str) -> torch.Tensor:
        """Weight ``name`` as a new dense tensor (shared values: inside ``gathered()`` only)."""
        self.values_of(name)
        module, attr = self._owners[name]
        return dense_weight(module, attr)

    def mask(self, name: str) -> torch.Tensor:
        """A new dense bool tensor, True at the active entries of weight ``name``."""
        positions = self.positions(name)
        mask = torch.zeros(math.prod(self.shape(name)), dtype=torch.bool, device=positions.device)
        return mask.index_put_((positions,), mask.new_ones(())).view(self.shape(name))

    @torch.no_grad()
    def relayout(self, layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store new (flat positions, values) for every weight, positions strictly increasing, their
        total at most the capacity; the layers' views move to their new places inside the same
        buffers (unused capacity, only when a rewiring could not regrow all it pruned, holds zeros)."""
        if self.shared is not None:
            with self.gathered():
                self._store(layers)
            return
        self._follow_the_model()
        self._store(layers)

    # ------------------------------------------------------------------------- sharded training
    def share_values(self, model: nn.Module) -> None:
        """Make the values of every layer one parameter of ``model``, ``SHARED_VALUES`` (a parameter,
        not a submodule, which a container model would run), and their columns one buffer,
        ``SHARED_COLUMNS``, to be sharded: the flat buffers, whose sizes a rewiring never changes.
        The layers' ``<name>_values`` stop being parameters and their ``<name>_columns`` buffers;
        they are bound, as views of gathered ones, by the units' hooks that
        ``lowmem.techniques.compact_shards.UnitGathering`` installs, or inside ``gathered()``. The
        row starts (8 bytes per 2^15 dense entries) stay every layer's buffers, whole."""
        self._follow_the_model()
        requires_grad = any(self.values_of(name).requires_grad for name in self.names)
        for name in self.names:
            for place, attr in self.places(name):
                del place._parameters[attr + _VALUES]
                del place._buffers[attr + _COLUMNS]
        model.register_parameter(SHARED_VALUES, nn.Parameter(self.values, requires_grad=requires_grad))
        model.register_buffer(SHARED_COLUMNS, self.columns)
        self.shared, self.values, self.columns = model, None, None

    @property
    def shared_values(self) -> nn.Parameter:
        """Shared values: the parameter as the model holds it now (sharded, or gathered by FSDP2)."""
        return getattr(self.shared, SHARED_VALUES)

    @property
    def shared_columns(self) -> torch.Tensor:
        """Shared values: the columns buffer as the model holds it now (sharded)."""
        return getattr(self.shared, SHARED_COLUMNS)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Shared values: inside, ``values`` and ``columns`` hold every value and column on every rank
        (gathered: a collective, entered on every rank) and the layers' values and columns are views
        of them; what is written there is kept (each rank copies back the rows it holds).
        Re-entrant; without shared values, nothing."""
        if self.shared is None or self.values is not None:
            yield
            return
        self.values = full(self.shared_values.detach()).clone()
        self.columns = full(self.shared_columns).clone()
        self.bind(self.values, self.columns)
        try:
            yield
            write_full(self.shared_values, self.values)
            write_full(self.shared_columns, self.columns)
        finally:
            self.unbind()
            self.values = self.columns = None

    def join_columns(self, layers: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The flat columns buffer of ``layers`` (each weight's columns, whole, by weight name: a
        state dict of before the positions were shared, under ``<name>_columns``), the weights' in
        ``names``' order then zeros up to the capacity: what ``SHARED_COLUMNS`` holds whole."""
        columns = [layers[name].to(torch.int16) for name in self.names]
        if [c.numel() for c in columns] != self.counts:
            raise ValueError(
                f"compact positions of {[c.numel() for c in columns]} entries per weight do not fit this "
                f"model's layout {self.counts}"
            )
        return torch.cat([*columns, columns[0].new_zeros(self.capacity - sum(self.counts))])

    def column_keys(self, name: str) -> list[str]:
        """The state-dict keys that held weight ``name``'s columns before they were shared (each place's)."""
        return [name + _COLUMNS] + [qualified + _COLUMNS for qualified, _, _ in self._tied[name]]

    def places(self, name: str) -> list[tuple[nn.Module, str]]:
        """(module, attribute) of every place holding weight ``name`` (tied places included)."""
        return [self._owners[name]] + [(module, attr) for _, module, attr in self._tied[name]]

    def bind(
        self,
        values: torch.Tensor,
        columns: torch.Tensor,
        first: int = 0,
        stop: int | None = None,
        at: nn.Module | None = None,
    ) -> None:
        """Shared values: the layers ``names[first:stop]`` (default: every layer) get their
        ``<name>_values`` and ``<name>_columns`` as views of ``values`` and ``columns``, which hold
        theirs, in order, from their start (and may hold more after them: unused capacity); ``at``:
        at that module's places only (default: at every place of each weight).

        The views come from one ``split``, not a slice each: in backward a slice's node makes a
        gradient of every value, zeros but its own, for each layer (with the gathered values of
        DynamicConv, 38.6 MB per layer, several at once); the split's node joins the layers'
        gradients once, when the last has come."""
        names, counts = self.names[first:stop], self.counts[first:stop]
        views = values.split([*counts, values.numel() - sum(counts)])  # the last: what follows them
        column_views = columns.split([*counts, columns.numel() - sum(counts)])
        for name, view, column_view in zip(names, views, column_views, strict=False):
            for place, attr in self.places(name):
                if at is None or place is at:
                    place.__dict__[attr + _VALUES], place.__dict__[attr + _COLUMNS] = view, column_view

    def unbind(self, first: int = 0, stop: int | None = None, at: nn.Module | None = None) -> None:
        """Shared values: drop ``bind``'s views of the layers ``names[first:stop]`` (``at``: at that
        module's places only)."""
        for name in self.names[first:stop]:
            for place, attr in self.places(name):
                if at is None or place is at:
                    place.__dict__.pop(attr + _VALUES, None)
                    place.__dict__.pop(attr + _COLUMNS, None)

    def _store(self, layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        total = sum(positions.numel() for positions, _ in layers.values())
        if total > self.capacity:
            raise ValueError(f"compact sparse weights: {total} active entries exceed the capacity {self.capacity}")
        # Stage everything first: a layer's new place may overlap another layer's old one.
        encoded = [encode(layers[name][0], math.prod(self.shape(name))) for name in self.names]
        staged_values = torch.cat([layers[name][1].to(self.values.dtype) for name in self.names])
        self.columns[:total].copy_(torch.cat([columns for columns, _ in encoded]))
        self.row_starts.copy_(torch.cat([row_starts for _, row_starts in encoded]))
        self.values[:total].copy_(staged_values)
        self.values[total:].zero_()
        self.columns[total:].zero_()
        start = row = 0
        for index, (name, (_, row_starts)) in enumerate(zip(self.names, encoded, strict=True)):
            count, rows = layers[name][0].numel(), row_starts.numel()
            module, attr = self._owners[name]
            if self.shared is None:
                repoint(getattr(module, attr + _VALUES), self.values[start : start + count])  # tied places share it
            columns, row_starts = self.columns[start : start + count], self.row_starts[row : row + rows]
            for place, place_attr in self.places(name):
                place._buffers[place_attr + _ROW_STARTS] = row_starts
                if self.shared is None:  # shared: bound below
                    place._buffers[place_attr + _COLUMNS] = columns
            self.counts[index] = count
            start += count
            row += rows
        if self.shared is not None:
            self.bind(self.values, self.columns)
        elif "torch._dynamo" in sys.modules:  # the compiler may run these layers: new columns marked too
            for module, _ in self._owners.values():
                mark_counts_dynamic(module)

    def _follow_the_model(self) -> None:
        """If the model was cast or moved since (``model.to(...)`` gives every parameter and buffer
        storage of its own), make buffers of the new dtype and device hold the layers again."""
        layers = [(self.values_of(name), *_index(*self._owners[name])) for name in self.names]
        buffers = (self.values, self.columns, self.row_starts)
        if all(
            tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            for layer in layers
            for tensor, buffer in zip(layer, buffers, strict=True)
        ):
            return
        values, columns, row_starts = zip(*layers, strict=True)
        unused = self.capacity - sum(self.counts)
        self.values = torch.cat([*(v.detach() for v in values), values[0].new_zeros(unused)])
        self.columns = torch.cat([*columns, columns[0].new_zeros(unused)])
        self.row_starts = torch.cat(row_starts)


def owner_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding parameter ``name`` of ``model`` and its attribute there."""
    prefix, _, attr = name.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), attr


def _tied_places(model: nn.Module, module: nn.Module, attr: str) -> list[tuple[str, nn.Module, str]]:
    """(qualified name, module, attribute) of every other place in ``model`` that holds the parameter
    ``module.<attr>`` (tied weights)."""
    weight = module._parameters[attr]
    return [
        (f"{prefix}.{name}" if prefix else name, other, name)
        for prefix, other in model.named_modules()
        for name, param in other._parameters.items()
        if param is weight and (other, name) != (module, attr)
    ]


def _install(module: nn.Module, attr: str, shape: torch.Size, values: nn.Parameter | None = None) -> None:
    """Replace ``module.<attr>`` (a dense parameter) by an (empty, for now) compact triple; ``values``:
    the values parameter of the place this weight is tied to (``None``: a new one)."""
    dense = module._parameters[attr]
    shapes = dict(getattr(module, _SHAPES, {}))
    shapes[attr] = torch.Size(shape)
    object.__setattr__(module, _SHAPES, shapes)
    if values is None:
        values = nn.Parameter(dense.new_empty(0), requires_grad=dense.requires_grad)
    _replace_in_order(module._parameters, attr, attr + _VALUES, values)  # state-dict keys keep their order
    module.register_buffer(attr + _COLUMNS, torch.empty(0, dtype=torch.int16, device=dense.device))
    module.register_buffer(attr + _ROW_STARTS, torch.empty(0, dtype=torch.int64, device=dense.device))
    if not getattr(module, "_lowmem_converts_flat_positions", False):
        module.register_load_state_dict_pre_hook(_load_flat_positions)
        object.__setattr__(module, "_lowmem_converts_flat_positions", True)
    compact_class = _compact_class(module)
    if attr == "weight" and compact_class is not None:
        module.__class__ = compact_class
    elif len(shape) >= 3 and not isinstance(module, _CompactStackedModule):  # stacked matrices
        kind = type(module)
        if kind not in _STACKED_CLASSES:
            stacked = type(f"Compact{kind.__name__}", (_CompactStackedModule, kind), {"__module__": __name__})
            _STACKED_CLASSES[kind], _DENSE_CLASSES[stacked] = stacked, kind
        module.__class__ = _STACKED_CLASSES[kind]


def _replace_in_order(table: dict, old: str, new: str, value: object) -> None:
    items = [(new, value) if key == old else (key, item) for key, item in table.items()]
    table.clear()
    table.update(items)


def _uninstall(module: nn.Module, attr: str, weight: nn.Parameter) -> None:
    _replace_in_order(module._parameters, attr + _VALUES, attr, weight)
    for suffix in _INDEX:
        del module._buffers[attr + suffix]
    shapes = dict(getattr(module, _SHAPES))
    del shapes[attr]
    object.__setattr__(module, _SHAPES, shapes)
    if isinstance(module, _CompactStackedModule):
        if not any(len(shape) >= 3 for shape in shapes.values()):  # no stacked weight left
            module.__class__ = _DENSE_CLASSES[type(module)]
    elif attr == "weight" and type(module) in _DENSE_CLASSES:
        module.__class__ = _DENSE_CLASSES[type(module)]


def _load_flat_positions(module: nn.Module, state: dict, prefix: str, *args: object) -> None:
    """A state dict of the former layout (``<name>_positions``: int32 flat positions) loads: its
    positions become this layout's columns and row starts."""
    for attr, shape in compact_names(module).items():
        key = prefix + attr + _FLAT_POSITIONS
        if key in state:
            columns, row_starts = encode(state.pop(key), math.prod(shape))
            state[prefix + attr + _COLUMNS], state[prefix + attr + _ROW_STARTS] = columns, row_starts


def compact_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(module prefix, module, weight attribute) of every compact weight of ``model``."""
    for prefix, module in model.named_modules():
        for attr in compact_names(module):
            yield prefix, module, attr


def index_buffer_names(model: nn.Module) -> list[str]:
    """The names in ``model.named_buffers()`` of every compact weight's columns and row starts: state
    every data-parallel rank derives alike (the seeded masks), which DistributedDataParallel should not
    broadcast (int16, which gloo and NCCL do not carry)."""
    return [
        f"{prefix}.{attr}{suffix}" if prefix else attr + suffix
        for prefix, _, attr in compact_modules(model)
        for suffix in _INDEX
    ]


def _dense_keys_in_place(state: dict, dense: dict[str, tuple[str, torch.Tensor]]) -> dict:
    """``state`` with each compact weight's entries replaced, in place of its values, by its dense
    tensor under its own key: ``dense`` maps ``<key>_values`` to ``(key, dense tensor)``."""
    out = {}
    for key, value in state.items():
        if key in dense:
            name, weight = dense[key]
            out[name] = weight
        elif not any(key.endswith(suffix) and key[: -len(suffix)] + _VALUES in dense for suffix in _INDEX):
            out[key] = value
    return out


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every compact weight as its plain dense tensor, under the dense
    weight's own key and in its place: what a model without compact storage would save.

    The dense weights are CPU tensors: each is built on the model's device and copied out at once,
    so saving a sparse model never holds more than one dense weight on an accelerator."""
    state = model.state_dict()
    dense = {}
    for prefix, module, attr in compact_modules(model):
        key = f"{prefix}.{attr}" if prefix else attr
        dense[key + _VALUES] = (key, dense_weight(module, attr).detach().to("cpu", copy=True))
    return _dense_keys_in_place(state, dense)


def dense_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` in which every compact weight is a plain dense parameter again."""
    clone = copy.deepcopy(model)
    dense: dict[int, nn.Parameter] = {}  # by values parameter: tied places get the one dense parameter
    for _, module, attr in list(compact_modules(clone)):
        values = _values(module, attr)
        if id(values) not in dense:
            dense[id(values)] = nn.Parameter(dense_weight(module, attr).clone(), requires_grad=values.requires_grad)
        _uninstall(module, attr, dense[id(values)])
    return clone


# --- the dense model's state-dict keys, for a model prepared for a user's own loop -------------------

_RAW_KEYS = [0]  # > 0 inside compact_state_dict_keys()


@contextlib.contextmanager
def compact_state_dict_keys() -> Iterator[None]:
    """Inside, a model given ``use_dense_keys`` saves and loads its compact entries as they are
    (``<name>_values`` / ``<name>_columns`` / ``<name>_row_starts``): what a resumable checkpoint needs."""
    _RAW_KEYS[0] += 1
    try:
        yield
    finally:
        _RAW_KEYS[0] -= 1


def use_dense_keys(model: nn.Module) -> None:
    """Make ``model.state_dict()`` and ``model.load_state_dict()`` use the dense model's keys: each
    compact weight is saved as its dense tensor under its own key (``conv.weight``), in its place,
    and a dense weight loaded is stored at the current active positions (it must be zero elsewhere).
    So a user's checkpoint and evaluation code keep working on a sparse model."""
    if getattr(model, "_lowmem_dense_keys", False):
        return
    model._register_state_dict_hook(_save_dense_keys)
    model.register_load_state_dict_pre_hook(_load_dense_keys)
    object.__setattr__(model, "_lowmem_dense_keys", True)


def _save_dense_keys(model: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    if _RAW_KEYS[0]:
        return
    dense = {}
    for path, module, attr in compact_modules(model):
        key = prefix + (f"{path}.{attr}" if path else attr)
        dense[key + _VALUES] = (key, dense_weight(module, attr).detach())
    if not dense:
        return
    items = _dense_keys_in_place(state, dense)
    state.clear()
    state.update(items)


def _load_dense_keys(model: nn.Module, state: dict, prefix: str, *args: object) -> None:
    if _RAW_KEYS[0]:
        return
    for path, module, attr in compact_modules(model):
        key = prefix + (f"{path}.{attr}" if path else attr)
        if key not in state:
            continue
        weight = state.pop(key).reshape(-1)
        columns, row_starts = _index(module, attr)
        values = weight.index_select(0, flat_positions(columns, row_starts).to(weight.device))
        if int(weight.count_nonzero()) != int(values.count_nonzero()):
            raise ValueError(
                f"load_state_dict: {key} has nonzero entries outside the sparse weight's active positions "
                "(a dense weight loads into a sparse model only where the model's mask is active)"
            )
        state[key + _VALUES] = values
        state[key + _COLUMNS] = columns.detach().clone()
        state[key + _ROW_STARTS] = row_starts.detach().clone()
