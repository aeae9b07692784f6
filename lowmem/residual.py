"""The one thing a model must expose for activation checkpointing: its residual blocks.

A model opts in by holding its residual blocks, in forward order, in ``model.residual_blocks``
(an ``nn.ModuleList``) and by running them through ``run_residual_blocks`` instead of a plain
loop. Checkpointing then swaps the *executor* (how the blocks are run), never the modules, so
parameter names and state dicts do not change.

Every block is called as ``block(x, *context)`` and returns the new ``x``; ``context`` carries
inputs that every block reads but does not change (an encoder output, padding masks, ...).

A block may also opt in to having its normalization outputs recomputed (the ``no_bn`` and
``residual_star`` checkpointing strategies): it sets ``routes_norm_relu_conv = True`` and computes
every ``conv(relu(norm(x)))`` triple through ``norm_relu_conv``, whose implementation checkpointing
swaps per block with ``set_norm_relu_conv``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

BlockExecutor = Callable[[Sequence[nn.Module], torch.Tensor, tuple], torch.Tensor]
NormReluConv = Callable[[nn.Module, nn.Module, torch.Tensor], torch.Tensor]


# A block of a checkpointed segment that runs compiled (``lowmem.techniques.compilation``; the value is
# a ``CompiledMark``): its norm-ReLU-conv triples are plain, compiled or not, so that its eager
# and compiled runs compute alike and the compiler's partitioner does what ``no_bn`` would.
COMPILED_BLOCK = "_lowmem_compiled_block"


class CompiledMark:
    """``COMPILED_BLOCK``'s value: the compiler's backend, and how checkpointed segments of the block
    run compiled (``segments``: ``trainer.compile_segments``). A copy of the block
    (``copy.deepcopy``, ``torch.save``) is not compiled, as ``nn.Module`` drops its own compiled
    forward from copies: the mark copies as None, and a copied model runs its blocks eagerly until
    compiled again."""

    __slots__ = ("backend", "segments")

    def __init__(self, backend: str, segments: str = "blocks") -> None:
        self.backend, self.segments = backend, segments

    def __reduce__(self) -> tuple:  # what pickle and copy.deepcopy build a copy from
        return _not_compiled, ()

    def __repr__(self) -> str:
        return f"CompiledMark({self.backend!r}, {self.segments!r})"


def _not_compiled() -> None:
    return None


def compiled_backend(block: nn.Module) -> str | None:
    """The backend ``block`` runs compiled with in checkpointed segments, or None."""
    mark = block.__dict__.get(COMPILED_BLOCK)
    return None if mark is None else mark.backend


def compiled_segments(block: nn.Module) -> str | None:
    """How checkpointed segments of ``block`` run compiled (``trainer.compile_segments``), or None."""
    mark = block.__dict__.get(COMPILED_BLOCK)
    return None if mark is None else mark.segments


def run_sequentially(blocks: Sequence[nn.Module], x: torch.Tensor, context: tuple) -> torch.Tensor:
    """The plain executor: every block in order, every activation kept by autograd."""
    for block in blocks:
        x = block(x, *context)
    return x


def residual_stacks(model: nn.Module) -> list[nn.Module]:
    """Every submodule (the model included) that exposes a non-empty ``residual_blocks`` list.

    A classifier has one stack; an encoder-decoder has two (encoder and decoder layers).
    """
    return [
        module
        for module in model.modules()
        if isinstance(getattr(module, "residual_blocks", None), nn.ModuleList)
        and len(module.residual_blocks) > 0
    ]


def set_block_executor(model: nn.Module, executor: BlockExecutor) -> None:
    """Make every residual stack of ``model`` run its blocks with ``executor``."""
    stacks = residual_stacks(model)
    if not stacks:
        raise ValueError(
            f"{type(model).__name__} exposes no residual blocks (a `residual_blocks` nn.ModuleList)"
        )
    for stack in stacks:
        # A plain attribute, not a submodule: the executor holds no parameters or state.
        object.__setattr__(stack, "_block_executor", executor)


def run_residual_blocks(stack: nn.Module, x: torch.Tensor, *context) -> torch.Tensor:
    """Run ``stack.residual_blocks`` on ``x`` with the stack's executor (plain by default)."""
    executor = getattr(stack, "_block_executor", run_sequentially)
    return executor(stack.residual_blocks, x, context)


def plain_norm_relu_conv(norm: nn.Module, conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``conv(relu(norm(x)))`` with every intermediate kept by autograd; without autograd (evaluation,
    recomputation) the ReLU is applied in place, so the norm's output is the only intermediate."""
    return conv(relu_of_norm(norm(x), x))


def relu_of_norm(normalized: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``relu(normalized)``, in place when autograd is off and ``normalized`` (a norm's output) does not
    share ``x``'s storage: no second activation-sized tensor. Under ``torch.compile`` out of place
    (the compiler plans its own buffers; the storage test would break the graph)."""
    if torch.compiler.is_compiling():
        return F.relu(normalized)
    shares = torch._C._is_alias_of(normalized, x)  # storage identity, fake tensors included
    return F.relu(normalized, inplace=not torch.is_grad_enabled() and not shares)


def norm_relu_conv(block: nn.Module, norm: nn.Module, conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``conv(relu(norm(x)))`` computed the way checkpointing chose for ``block`` (plain by default).
    Compiled code computes it plainly: the compiler's partitioner recomputes the norm and the ReLU in
    backward instead of saving their outputs, as ``no_bn`` does eagerly; the triple
    ``COMPILED_TRIPLES`` names as unread computes no convolution (``unread_conv``)."""
    if torch.compiler.is_compiling() or compiled_backend(block) is not None:
        triples = COMPILED_TRIPLES
        # Counted eagerly, and in compiled code only where a checkpointed segment's runner set the
        # count (model-level compiled code reads nothing it would have to guard on). Only compiled
        # code leaves a convolution unread (a runner stopped by an error leaves `unread` set).
        if triples.unread >= 0 or not torch.compiler.is_compiling():
            index = triples.count
            triples.count = index + 1
            if index == triples.unread and torch.compiler.is_compiling():
                return unread_conv(conv, relu_of_norm(norm(x), x))
        return plain_norm_relu_conv(norm, conv, x)
    compute = getattr(block, "_norm_relu_conv", plain_norm_relu_conv)
    return compute(norm, conv, x)


class CompiledTriples:
    """The norm-ReLU-conv triples of a block of a compiled checkpointed segment, as it runs: ``count``
    of them so far (eagerly: what a watched forward counts; compiled: the runner starts it at 0) and
    the index of the one whose convolution output nobody reads (``unread``; -1: none). A rebuild of
    a block for backprop only (``residual_star``) reads its output's gradient edge, never its value:
    its last convolution's output, added to the shortcut only, need not be computed."""

    def __init__(self) -> None:
        self.count = 0
        self.unread = -1


COMPILED_TRIPLES = CompiledTriples()  # one per process: segments run one block at a time


def unread_conv(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` as an autograd node only: backward computes the convolution's gradients, forward
    returns a broadcast zero of the output's shape (its value is never read). A convolution module
    with an ``unread_forward`` of its own (compact sparse) uses it; a convolution other than
    ``nn.Conv1d/2d/3d`` with numeric zero padding is computed."""
    own = getattr(conv, "unread_forward", None)
    if own is not None:
        return own(x)
    plain = type(conv) in (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    if not plain or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return conv(x)
    weight, bias = conv.weight, conv.bias
    device = x.device.type
    if torch.is_autocast_enabled(device):  # the operands the convolution would compute in
        dtype = torch.get_autocast_dtype(device)
        x, weight, bias = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    return UnreadConvolution.apply(x, weight, bias, (conv.stride, conv.padding, conv.dilation, conv.groups))


class UnreadConvolution(torch.autograd.Function):
    """A convolution whose output is not computed (a broadcast zero) and whose backward is the
    convolution's: ``aten.convolution_backward`` from the saved input and weight."""

    @staticmethod
    def forward(ctx, x, weight, bias, arguments):
        stride, padding, dilation, groups = arguments
        ctx.save_for_backward(x, weight)
        ctx.arguments, ctx.has_bias = arguments, bias is not None
        shape = conv_output_shape(x.shape, weight.shape[0], weight.shape[2:], stride, padding, dilation)
        return x.new_zeros((), dtype=weight.dtype).expand(shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.arguments
        wanted = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2] and ctx.has_bias]
        grad_x, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad, x, weight, [weight.shape[0]] if ctx.has_bias else None, list(stride), list(padding),
            list(dilation), False, [0] * len(stride), groups, wanted,
        )  # fmt: skip
        return grad_x, grad_weight, grad_bias, None


def conv_output_shape(
    x_shape: Sequence[int], out_channels: int, kernel: Sequence[int], stride: Sequence[int],
    padding: Sequence[int], dilation: Sequence[int],
) -> tuple[int, ...]:  # fmt: skip
    """The shape a convolution with numeric padding returns for an input of ``x_shape``."""
    dims = len(kernel)
    spatial = [
        (size + 2 * pad - dil * (k - 1) - 1) // step + 1
        for size, pad, dil, k, step in zip(x_shape[-dims:], padding, dilation, kernel, stride, strict=True)
    ]
    return (*x_shape[: -dims - 1], out_channels, *spatial)


def routes_norm_relu_conv(block: nn.Module) -> bool:
    """Whether ``block`` computes its norm-ReLU-conv triples through ``norm_relu_conv``."""
    return bool(getattr(block, "routes_norm_relu_conv", False))


def set_norm_relu_conv(block: nn.Module, compute: NormReluConv) -> None:
    """Make ``block`` compute its norm-ReLU-conv triples with ``compute``."""
    if not routes_norm_relu_conv(block):
        raise ValueError(
            f"{type(block).__name__} does not route its norm-ReLU-conv triples through norm_relu_conv"
        )
    # A plain attribute, not a submodule, as for the block executor.
    object.__setattr__(block, "_norm_relu_conv", compute)
