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
# the compiler's backend): its norm-ReLU-conv triples are plain, compiled or not, so that its eager
# and compiled runs compute alike and the compiler's partitioner does what ``no_bn`` would.
COMPILED_BLOCK = "_lowmem_compiled_block"


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
    backward instead of saving their outputs, as ``no_bn`` does eagerly."""
    if torch.compiler.is_compiling() or COMPILED_BLOCK in block.__dict__:
        return plain_norm_relu_conv(norm, conv, x)
    compute = getattr(block, "_norm_relu_conv", plain_norm_relu_conv)
    return compute(norm, conv, x)


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
