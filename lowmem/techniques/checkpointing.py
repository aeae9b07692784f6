"""Activation checkpointing over a model's residual blocks (report §3.4).

Strategies (``checkpointing.strategy``, with ``checkpointing.every=m``):

- ``none``: autograd keeps every activation.
- ``no_bn``: every BN-ReLU-conv triple stores only the BN input; backward recomputes BN and ReLU
  (cheap, no convolution is recomputed) and feeds the recomputed ReLU output to the convolution's
  backward. Needs blocks that route their triples through ``lowmem.residual.norm_relu_conv``.
- ``residual``: the blocks run in segments of ``m``; only each segment's input is stored and
  backward recomputes the segment (each block's forward once), then backpropagates it block by
  block, last block first, releasing each block's recomputed tensors as soon as its backward is
  done. The segment's output is never held: backward starts from its gradient edge. Works for any
  block.
- ``residual_star``: ``residual`` outside, ``no_bn`` inside the recomputed segment: while a
  segment is backpropagated the recomputed block inputs and first-conv outputs of the blocks not
  yet backpropagated are held, BN and ReLU outputs never (backward recomputes them on the fly,
  into one buffer, and applies the ReLU backward in place).

Recomputation replays the RNG state (identical dropout masks) and the autocast state, and sends
BatchNorm running-statistic updates to scratch copies, so the statistics are updated exactly once
per forward (SPEC §6). Both recomputations are custom ``autograd.Function``s rather than
``torch.utils.checkpoint``, whose non-reentrant mode stops recomputing early and does not nest
the way ``residual_star`` needs (SPEC §6).

Apply before wrapping the model in DistributedDataParallel; the transformation changes no module,
parameter or state-dict key, so it composes with precision conversion and sparsity in any order.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lowmem.residual import (
    plain_norm_relu_conv,
    residual_stacks,
    routes_norm_relu_conv,
    run_sequentially,
    set_block_executor,
    set_norm_relu_conv,
)

STRATEGIES = ("none", "no_bn", "residual", "residual_star")


def validate_checkpointing(strategy: str, every: int) -> None:
    """Raise ValueError naming the knob if ``strategy`` or ``every`` (blocks per segment) is invalid."""
    if strategy not in STRATEGIES:
        raise ValueError(f"checkpointing.strategy={strategy!r} is unknown; allowed: {', '.join(STRATEGIES)}")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(
            f"checkpointing.every={every!r} must be an integer >= 1 (residual blocks per segment)"
        )


def apply_checkpointing(model: nn.Module, strategy: str, every: int = 1) -> None:
    """Make every residual stack of ``model`` run with ``strategy``, segments of ``every`` blocks.

    Changes only how blocks are executed (no module, parameter or state-dict key changes); calling
    it again replaces the previous strategy.
    """
    validate_checkpointing(strategy, every)
    stacks = residual_stacks(model)
    if not stacks:
        if strategy == "none":
            return
        raise ValueError(
            f"checkpointing.strategy={strategy!r} needs residual blocks, but {type(model).__name__} "
            "exposes none (a non-empty `residual_blocks` nn.ModuleList); use checkpointing.strategy=none"
        )
    blocks = [block for stack in stacks for block in stack.residual_blocks]
    recompute_norm = strategy in ("no_bn", "residual_star")
    if recompute_norm:
        unsupported = sorted({type(b).__name__ for b in blocks if not routes_norm_relu_conv(b)})
        if unsupported:
            raise ValueError(
                f"checkpointing.strategy={strategy!r} recomputes BatchNorm-ReLU outputs, which needs blocks "
                f"that route them through lowmem.residual.norm_relu_conv; {', '.join(unsupported)} "
                "does not; use checkpointing.strategy=residual (works for any block) or none"
            )
    for block in blocks:
        if routes_norm_relu_conv(block):
            set_norm_relu_conv(block, recomputed_norm_relu_conv if recompute_norm else plain_norm_relu_conv)
    if strategy in ("residual", "residual_star"):
        set_block_executor(model, functools.partial(run_checkpointed_segments, every=every))
    else:
        set_block_executor(model, run_sequentially)


# --- state replayed or isolated during recomputation -------------------------------------------


@contextlib.contextmanager
def scratch_running_stats(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Send BatchNorm running-statistic updates made inside the block to throwaway copies.

    The buffers are swapped rather than copied back afterwards: autograd may have saved the
    scratch tensors, and restoring in place would bump their version counters.
    """
    swapped = []
    for module in modules:
        if isinstance(module, _BatchNorm) and module.training and module.track_running_stats:
            originals = {
                name: getattr(module, name) for name in ("running_mean", "running_var", "num_batches_tracked")
            }
            for name, buffer in originals.items():
                if buffer is not None:
                    setattr(module, name, buffer.clone())
            swapped.append((module, originals))
    try:
        yield
    finally:
        for module, originals in swapped:
            for name, buffer in originals.items():
                setattr(module, name, buffer)


@dataclass(frozen=True)
class _AutocastState:
    """The autocast setting in force for ``device_type``, to recompute under the same one."""

    device_type: str
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def capture(cls, device: torch.device) -> _AutocastState:
        return cls(device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))

    def restore(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


class _RngState:
    """The CPU generator state and, for a CUDA tensor, its device's generator state."""

    def __init__(self, device: torch.device) -> None:
        self.cuda_devices = [device] if device.type == "cuda" else []
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Run the block from the captured state, leaving the caller's generators untouched."""
        with torch.random.fork_rng(devices=self.cuda_devices, device_type="cuda"):
            torch.set_rng_state(self.cpu)
            for device, state in zip(self.cuda_devices, self.cuda, strict=True):
                torch.cuda.set_rng_state(state, device)
            yield


def _recomputation_input(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A new leaf sharing ``tensor``'s storage, to differentiate the recomputation against, and the
    alias of it to feed the recomputation with.

    The alias is a non-leaf because module hooks that watch their inputs' gradients (the module
    tracker of FlopCounterMode) fail on a leaf inside ``torch.autograd.grad``.
    """
    leaf = tensor.detach().requires_grad_(tensor.requires_grad)
    with torch.enable_grad():  # backward runs with grad mode off
        return leaf, (leaf.view_as(leaf) if leaf.requires_grad else leaf)


# --- residual / residual_star: recompute a segment of blocks --------------------------------------


def run_checkpointed_segments(
    blocks: Sequence[nn.Module], x: torch.Tensor, context: tuple, every: int
) -> torch.Tensor:
    """Block executor: run ``blocks`` in segments of ``every``, storing only each segment's input."""
    if not torch.is_grad_enabled():
        return run_sequentially(blocks, x, context)
    is_tensor = [isinstance(item, torch.Tensor) for item in context]
    context_tensors = [item for item in context if isinstance(item, torch.Tensor)]
    for start in range(0, len(blocks), every):
        segment = blocks[start : start + every]
        # Parameters are explicit inputs so their gradients are returned through autograd (hooks,
        # DDP and torch.autograd.grad see them) instead of being accumulated behind its back.
        params = [p for block in segment for p in block.parameters() if p.requires_grad]
        x = _CheckpointedSegment.apply(
            segment, context, is_tensor, x, len(context_tensors), *context_tensors, *params
        )
    return x


class _CheckpointedSegment(torch.autograd.Function):
    """Forward without storing the segment's activations; backward recomputes and backprops it."""

    @staticmethod
    def forward(ctx, segment, context, is_tensor, x, num_context_tensors, *tensors):
        ctx.segment, ctx.is_tensor = segment, is_tensor
        ctx.skeleton = [None if t else item for t, item in zip(is_tensor, context, strict=True)]
        ctx.params = tensors[num_context_tensors:]
        ctx.rng, ctx.autocast = _RngState(x.device), _AutocastState.capture(x.device)
        ctx.save_for_backward(x, *tensors[:num_context_tensors])
        return run_sequentially(segment, x, context)

    @staticmethod
    def backward(ctx, grad_output):
        leaves, aliases = zip(*(_recomputation_input(t) for t in ctx.saved_tensors), strict=True)
        remaining = iter(aliases[1:])
        context = tuple(
            next(remaining) if t else item for t, item in zip(ctx.is_tensor, ctx.skeleton, strict=True)
        )
        # needs_input_grad covers (segment, context, is_tensor, x, num_context_tensors, *tensors).
        needed = [ctx.needs_input_grad[3]] + list(ctx.needs_input_grad[5:])
        # Recompute the segment block by block, each block's graph on its own: block k's input is
        # a fresh leaf sharing the storage of block k-1's output, so after block k is backpropagated
        # (last block first) its saved tensors are released while the earlier blocks' graphs stay.
        # Held at once: the recomputed graphs still to backpropagate (their block inputs and what
        # they save) and the gradient flowing back; never a block's output for its own sake: the
        # last block's output is dropped right away and backward starts from its gradient edge.
        block_inputs, output_edges = [], []
        x_leaf, x_alias = leaves[0], aliases[0]
        with ctx.rng.replayed(), ctx.autocast.restore(), scratch_running_stats(ctx.segment.modules()):
            with torch.enable_grad():
                for index, block in enumerate(ctx.segment):
                    output = block(x_alias, *context)
                    block_inputs.append(x_leaf)
                    output_edges.append(torch.autograd.graph.get_gradient_edge(output))
                    if index + 1 < len(ctx.segment):
                        x_leaf, x_alias = _recomputation_input(output)
                    del output
        del x_leaf, x_alias  # the last block's input lives on in its graph only
        # Gradients of the context tensors and parameters, summed over the blocks (each parameter
        # of a plain model is in one block; context tensors are read by every block).
        accumulated: list[torch.Tensor | None] = [None] * (len(leaves) - 1 + len(ctx.params))
        outer = [*leaves[1:], *ctx.params]
        outer_needed = needed[1:]
        grad = grad_output
        for index in range(len(ctx.segment) - 1, -1, -1):
            edge, block_input = output_edges.pop(), block_inputs.pop()
            need_input = index > 0 or needed[0]
            wanted = ([block_input] if need_input else []) + [
                t for t, need in zip(outer, outer_needed, strict=True) if need
            ]
            grads = list(torch.autograd.grad([edge], wanted, [grad], allow_unused=True)) if wanted else []
            grad = grads.pop(0) if need_input else None
            if index > 0 and grad is None:  # a block that ignores its input
                grad = torch.zeros_like(block_input)
            del edge, block_input  # the block's graph and input go now (its saved tensors already did)
            extra = iter(grads)
            for position, need in enumerate(outer_needed):
                if need:
                    value = next(extra)
                    if value is not None:
                        previous = accumulated[position]
                        accumulated[position] = value if previous is None else previous + value
        return (None, None, None, grad, None, *accumulated)


# --- no_bn: recompute BN-ReLU, never the convolution --------------------------------------------


def recomputed_norm_relu_conv(norm: nn.Module, conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``conv(relu(norm(x)))`` storing only ``x`` (and the conv weight) for backward.

    x: (N, C_in, H, W); returns (N, C_out, H', W'). ``norm`` may be any module (a BatchNorm, also
    one converted by precision or simulated microbatching): backward calls it again.
    """
    if not torch.is_grad_enabled():
        return plain_norm_relu_conv(norm, conv, x)
    if type(conv) is not nn.Conv2d or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        raise ValueError(
            f"checkpointing.strategy=no_bn/residual_star recompute BN-ReLU before an nn.Conv2d with numeric "
            f"zero padding; got {conv!r}"
        )
    norm_params = list(norm.parameters())
    return _NormReluConvRecomputed.apply(norm, conv, x, conv.weight, conv.bias, *norm_params)


class _NormReluConvRecomputed(torch.autograd.Function):
    """Fused norm-ReLU-conv whose backward recomputes norm-ReLU and calls the conv backward kernel."""

    @staticmethod
    def forward(ctx, norm, conv, x, weight, bias, *norm_params):
        ctx.norm, ctx.conv = norm, conv
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.autocast = _AutocastState.capture(x.device)
        ctx.save_for_backward(x, weight)
        # Forward runs the norm module once: this is the one running-statistics update.
        activation = F.relu(norm(x))
        return F.conv2d(activation, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)

    @staticmethod
    def backward(ctx, grad_output):
        saved_x, weight = ctx.saved_tensors
        x, x_alias = _recomputation_input(saved_x)
        norm, conv = ctx.norm, ctx.conv
        with ctx.autocast.restore(), scratch_running_stats([norm]), torch.enable_grad():
            normalized = norm(x_alias)
        # The ReLU is applied in place on a detached alias of the norm output: the norm's backward
        # needs its input, not its output, so one buffer holds both, and no ReLU node is recorded.
        with torch.no_grad():
            activation = normalized.detach().relu_()
        # Under autocast the convolution ran in the output's dtype; its backward does the same.
        dtype = grad_output.dtype
        need_x = ctx.needs_input_grad[2] or any(ctx.needs_input_grad[5:])
        need_weight, need_bias = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        # The kernel autograd itself calls for a convolution: gradients are bitwise the plain ones.
        grad_activation, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad_output,
            activation.detach().to(dtype),
            weight.to(dtype),
            ctx.bias_shape,
            conv.stride,
            conv.padding,
            conv.dilation,
            False,
            [0, 0],
            conv.groups,
            [need_x, need_weight, need_bias],
        )
        norm_inputs = [x, *norm.parameters()]
        needed = [ctx.needs_input_grad[2], *ctx.needs_input_grad[5:]]
        wanted = [t for t, need in zip(norm_inputs, needed, strict=True) if need]
        grads = iter([])
        if wanted:
            # ReLU's backward in place (the values of threshold_backward: zero where the output is
            # not positive), so the norm backward reads the same buffer the conv backward wrote.
            grad_normalized = grad_activation.to(normalized.dtype)
            grad_normalized.masked_fill_(activation <= 0, 0)
            del grad_activation, activation
            grads = iter(torch.autograd.grad(normalized, wanted, grad_normalized, allow_unused=True))
        norm_grads = [next(grads) if need else None for need in needed]
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(conv.bias.dtype)
        return (None, None, norm_grads[0], grad_weight, grad_bias, *norm_grads[1:])
