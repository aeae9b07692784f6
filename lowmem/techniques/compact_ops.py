"""Compact sparse layers as operators the compiler keeps whole (``trainer.compile=true``).

A compact layer builds its dense weight from the compact values in a C kernel and drops it after
use (``lowmem.techniques.compact``): code ``torch.compile`` cannot trace. Registered here as
``torch.library`` custom operators, each layer is one opaque node of the compiled graph — no graph
break — whose backward is another (``register_autograd``): they run the same functions as the
eager layer's autograd node, so a compiled step computes the eager step's bits for these layers.
A layer of a small weight (``compact.traced``) is not one of these in compiled code but traced ops
(``compact.recomputed_dense``): an operator's every call passes through Python.

- ``lowmem::compact_conv`` / ``lowmem::compact_conv_backward``: ``nn.Conv1d/2d/3d`` (numeric padding);
- ``lowmem::compact_linear`` / ``lowmem::compact_linear_backward``: ``nn.Linear``, transformers'
  ``Conv1D`` (``transposed``) and a bare weight (``compact.linear``);
- ``lowmem::compact_embedding`` / ``lowmem::compact_embedding_backward``: ``nn.Embedding`` (not
  under sharded training, whose embedding gathers its columns again for backward).

Gradients a backward is not asked for come back as empty tensors (an operator returns tensors
only) and are handed to autograd as None. Registered once, on import (``apply_compile``).

Inductor caches compiled graphs under a key that names an operator, not its fake kernel: a graph
compiled against another version's output layouts would load and fail its stride checks. On import
this module enters a digest of its source into that key (``OperatorsVersion``, a graph pass that
changes nothing), wherever the cache lies.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import Tensor
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.flop_counter import conv_flop_count, mm_flop, register_flop_formula

from lowmem.kernels import cpu as cpu_kernels
from lowmem.techniques.compact import (
    CONVOLUTIONS,
    compact_conv,
    compact_conv_backward,
    compact_linear,
    compact_linear_backward,
    densify,
    gather,
)


def _or_empty(tensor: Tensor | None, like: Tensor) -> Tensor:
    return like.new_empty(0) if tensor is None else tensor


def _none_if_unwanted(tensor: Tensor, wanted: bool) -> Tensor | None:
    return tensor if wanted else None


# --- convolution ------------------------------------------------------------------------------------


def layout(x: Tensor) -> torch.memory_format:
    """The memory format a compiled compact convolution computes in: channels-last for a 2-D
    convolution on a CPU, as inductor lays out a graph's dense convolutions there (its
    ``layout_optimization``; oneDNN's kernels are faster so); as given otherwise.
    The forward's output and the input's gradient come in that format, the fake kernels saying so."""
    return torch.channels_last if x.dim() == 4 and x.device.type == "cpu" else torch.contiguous_format


def _laid_out(tensor: Tensor, memory_format: torch.memory_format) -> Tensor:
    return tensor if memory_format == torch.contiguous_format else tensor.contiguous(memory_format=memory_format)


@torch.library.custom_op("lowmem::compact_conv", mutates_args=())
def conv_op(
    x: Tensor, values: Tensor, columns: Tensor, row_starts: Tensor, bias: Tensor | None, shape: list[int],
    stride: list[int], padding: list[int], dilation: list[int], groups: int,
) -> Tensor:  # fmt: skip
    # A tensor of its own (compact_conv returns no view): an operator's output may not alias an input.
    memory_format = layout(x)
    if memory_format == torch.contiguous_format:
        return compact_conv(x, values, columns, row_starts, bias, shape, stride, padding, dilation, groups)
    weight = densify(values, columns, row_starts, shape, memory_format)
    output = CONVOLUTIONS[len(stride)](_laid_out(x, memory_format), weight, bias, stride, padding, dilation, groups)
    return output.contiguous(memory_format=memory_format)


@conv_op.register_fake
def _(x, values, columns, row_starts, bias, shape, stride, padding, dilation, groups):
    memory_format = layout(x)
    weight = _laid_out(values.new_empty(shape), memory_format)
    output = CONVOLUTIONS[len(stride)](_laid_out(x, memory_format), weight, bias, stride, padding, dilation, groups)
    return _laid_out(output, memory_format)


@torch.library.custom_op("lowmem::compact_conv_backward", mutates_args=())
def conv_backward_op(
    grad_output: Tensor, x: Tensor, values: Tensor, columns: Tensor, row_starts: Tensor, shape: list[int],
    stride: list[int], padding: list[int], dilation: list[int], groups: int, bias_size: int, wanted: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    args = (stride, padding, dilation, False, [0] * len(stride), groups)
    bias_shape = [bias_size] if bias_size >= 0 else None
    wanted_bias = wanted[2] and bias_size >= 0
    memory_format = layout(x)
    grad_x, grad_values, grad_bias = compact_conv_backward(
        _laid_out(grad_output, memory_format), _laid_out(x, memory_format), values, (columns, row_starts), shape,
        args, bias_shape, (wanted[0], wanted[1], wanted_bias), memory_format,
    )
    grad_x = None if grad_x is None else _laid_out(grad_x, memory_format)
    return _or_empty(grad_x, x), _or_empty(grad_values, values), _or_empty(grad_bias, values)


@conv_backward_op.register_fake
def _(grad_output, x, values, columns, row_starts, shape, stride, padding, dilation, groups, bias_size, wanted):
    grad_x = (torch.empty(x.shape, dtype=grad_output.dtype, device=x.device, memory_format=layout(x)) if wanted[0]
              else x.new_empty(0))
    grad_values = torch.empty_like(values) if wanted[1] else values.new_empty(0)
    grad_bias = grad_output.new_empty(bias_size) if wanted[2] and bias_size >= 0 else values.new_empty(0)
    return grad_x, grad_values, grad_bias


def _conv_setup(ctx, inputs, output) -> None:
    x, values, columns, row_starts, bias, shape, stride, padding, dilation, groups = inputs
    ctx.save_for_backward(x, values, columns, row_starts)
    ctx.params = (shape, stride, padding, dilation, groups, -1 if bias is None else bias.shape[0])


def _conv_backward(ctx, grad_output):
    x, values, columns, row_starts = ctx.saved_tensors
    shape, stride, padding, dilation, groups, bias_size = ctx.params
    wanted = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[4]]
    grad_x, grad_values, grad_bias = conv_backward_op(
        grad_output, x, values, columns, row_starts, shape, stride, padding, dilation, groups, bias_size, wanted
    )
    return (_none_if_unwanted(grad_x, wanted[0]), _none_if_unwanted(grad_values, wanted[1]), None, None,
            _none_if_unwanted(grad_bias, wanted[2] and bias_size >= 0), None, None, None, None, None)


conv_op.register_autograd(_conv_backward, setup_context=_conv_setup)


# --- linear -----------------------------------------------------------------------------------------


@torch.library.custom_op("lowmem::compact_linear", mutates_args=())
def linear_op(
    x: Tensor, values: Tensor, columns: Tensor, row_starts: Tensor, bias: Tensor | None, shape: list[int],
    transposed: bool,
) -> Tensor:  # fmt: skip
    return compact_linear(x, values, columns, row_starts, bias, shape, transposed)  # no view either


@linear_op.register_fake
def _(x, values, columns, row_starts, bias, shape, transposed):
    weight = values.new_empty(shape)
    return torch.matmul(x, weight) if transposed else F.linear(x, weight)


@torch.library.custom_op("lowmem::compact_linear_backward", mutates_args=())
def linear_backward_op(
    grad_output: Tensor, x: Tensor, values: Tensor, columns: Tensor, row_starts: Tensor, shape: list[int],
    transposed: bool, wanted: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    grad_x, grad_values, grad_bias = compact_linear_backward(
        grad_output, x, values, columns, row_starts, shape, transposed, tuple(wanted)
    )
    return _or_empty(grad_x, x), _or_empty(grad_values, values), _or_empty(grad_bias, values)


@linear_backward_op.register_fake
def _(grad_output, x, values, columns, row_starts, shape, transposed, wanted):
    grad_x = x.new_empty(x.shape, dtype=grad_output.dtype) if wanted[0] else x.new_empty(0)
    grad_values = torch.empty_like(values) if wanted[1] else values.new_empty(0)
    grad_bias = grad_output.new_empty(grad_output.shape[-1]) if wanted[2] else values.new_empty(0)
    return grad_x, grad_values, grad_bias


def _linear_setup(ctx, inputs, output) -> None:
    x, values, columns, row_starts, bias, shape, transposed = inputs
    ctx.save_for_backward(x, values, columns, row_starts)
    ctx.params = (shape, transposed, bias is not None)


def _linear_backward(ctx, grad_output):
    x, values, columns, row_starts = ctx.saved_tensors
    shape, transposed, has_bias = ctx.params
    wanted = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[4] and has_bias]
    grad_x, grad_values, grad_bias = linear_backward_op(
        grad_output, x, values, columns, row_starts, shape, transposed, wanted
    )
    return (_none_if_unwanted(grad_x, wanted[0]), _none_if_unwanted(grad_values, wanted[1]), None, None,
            _none_if_unwanted(grad_bias, wanted[2]), None, None)


linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


# --- embedding --------------------------------------------------------------------------------------


@torch.library.custom_op("lowmem::compact_embedding", mutates_args=())
def embedding_op(
    tokens: Tensor, values: Tensor, columns: Tensor, row_starts: Tensor, shape: list[int], padding_idx: int,
    scale_grad_by_freq: bool,
) -> Tensor:  # fmt: skip
    weight = densify(values, columns, row_starts, shape)
    return torch.ops.aten.embedding(weight, tokens, padding_idx, scale_grad_by_freq, False)


@embedding_op.register_fake
def _(tokens, values, columns, row_starts, shape, padding_idx, scale_grad_by_freq):
    return values.new_empty((*tokens.shape, shape[1]))


@torch.library.custom_op("lowmem::compact_embedding_backward", mutates_args=())
def embedding_backward_op(
    grad_output: Tensor, tokens: Tensor, columns: Tensor, row_starts: Tensor, shape: list[int], padding_idx: int,
    scale_grad_by_freq: bool, values_dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    grad_weight = torch.ops.aten.embedding_dense_backward(
        grad_output, tokens, shape[0], padding_idx, scale_grad_by_freq
    )
    return gather(grad_weight, columns, row_starts, values_dtype)


@embedding_backward_op.register_fake
def _(grad_output, tokens, columns, row_starts, shape, padding_idx, scale_grad_by_freq, values_dtype):
    return torch.empty_like(columns, dtype=values_dtype)


def _embedding_setup(ctx, inputs, output) -> None:
    tokens, values, columns, row_starts, shape, padding_idx, scale_grad_by_freq = inputs
    ctx.save_for_backward(tokens, columns, row_starts)
    ctx.params = (shape, padding_idx, scale_grad_by_freq, values.dtype)


def _embedding_backward(ctx, grad_output):
    tokens, columns, row_starts = ctx.saved_tensors
    grad_values = embedding_backward_op(grad_output, tokens, columns, row_starts, *ctx.params)
    return None, grad_values, None, None, None, None, None


embedding_op.register_autograd(_embedding_backward, setup_context=_embedding_setup)


# --- FLOPs ------------------------------------------------------------------------------------------
# What a FLOP counter (torch.utils.flop_counter's, which lowmem.profile and the benchmarks use) counts
# for an operator met in a compiled graph: the dense products it computes from the densified weight,
# as the eager layer's own aten calls count. (Embedding lookups count none, as aten's.)


def _weight_gradient_flops(x_shape: list[int], grad_shape: list[int], shape: list[int]) -> int:
    """A dense convolution's weight gradient: the convolution of the input by the output gradient
    (torch's own count, batch and channels swapped)."""
    swap = lambda s: [s[1], s[0], *s[2:]]  # noqa: E731
    return conv_flop_count(swap(x_shape), swap(grad_shape), swap(shape))


@register_flop_formula(torch.ops.lowmem.compact_conv)
def _conv_flops(x_shape, values_shape, columns_shape, row_starts_shape, bias_shape, shape, *args, out_shape=None,
                **kwargs) -> int:  # fmt: skip
    return conv_flop_count(x_shape, shape, out_shape)


@register_flop_formula(torch.ops.lowmem.compact_conv_backward)
def _conv_backward_flops(grad_shape, x_shape, values_shape, columns_shape, row_starts_shape, shape, stride, padding,
                         dilation, groups, bias_size, wanted, *, out_shape=None, **kwargs) -> int:  # fmt: skip
    flops = conv_flop_count(grad_shape, shape, x_shape, transposed=True) if wanted[0] else 0
    return flops + (_weight_gradient_flops(x_shape, grad_shape, shape) if wanted[1] else 0)


@register_flop_formula(torch.ops.lowmem.compact_linear)
def _linear_flops(x_shape, values_shape, columns_shape, row_starts_shape, bias_shape, shape, transposed, *,
                  out_shape=None, **kwargs) -> int:  # fmt: skip
    inputs, outputs = (shape[0], shape[1]) if transposed else (shape[1], shape[0])
    return mm_flop([math.prod(x_shape[:-1]), inputs], [inputs, outputs])


@register_flop_formula(torch.ops.lowmem.compact_linear_backward)
def _linear_backward_flops(grad_shape, x_shape, values_shape, columns_shape, row_starts_shape, shape, transposed,
                           wanted, *, out_shape=None, **kwargs) -> int:  # fmt: skip
    rows, inputs = math.prod(x_shape[:-1]), x_shape[-1]
    outputs = grad_shape[-1]
    return (mm_flop([rows, outputs], [outputs, inputs]) if wanted[0] else 0) + (
        mm_flop([inputs, rows], [rows, outputs]) if wanted[1] else 0
    )


# --- the operators' version in inductor's cache key ------------------------------------------------


class OperatorsVersion(CustomGraphPass):
    """A post-grad graph pass that changes nothing; its ``uuid`` (a digest of this module's source:
    the operators and their fake kernels; and the instruction sets torch and oneDNN run at) is part
    of inductor's cache key for every graph. The instruction sets: a process restricted to AVX2
    (``ATEN_CPU_CAPABILITY=avx2``) that loaded graphs cached by an AVX-512 process crashed in a
    compiled max-pool backward (resnet18, compact sparse; an index out of bounds), and ran with a
    cache of its own."""

    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]

    def __call__(self, graph: torch.fx.Graph) -> None:
        pass

    def uuid(self) -> str:
        isa = cpu_kernels.onednn_isa_limit() or "default"
        return f"lowmem operators {self.digest} {torch.backends.cpu.get_cpu_capability()} {isa}"


def _enter_version() -> None:
    """Add ``OperatorsVersion`` to inductor's post-grad passes (after any of yours)."""
    passes = inductor_config.post_grad_custom_post_pass
    present = list(passes) if isinstance(passes, (list, tuple)) else [] if passes is None else [passes]
    if not any(isinstance(p, OperatorsVersion) for p in present):
        inductor_config.post_grad_custom_post_pass = [*present, OperatorsVersion()] if present else OperatorsVersion()


_enter_version()
