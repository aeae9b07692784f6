"""Microbatching (report §3.3): true (sequential) and simulated (BatchNorm statistics per group).

``microbatch.mode=true``: the trainer runs each minibatch as microbatches one after another and
accumulates gradients. Each microbatch's loss (a mean over its examples or target tokens) is
scaled by its share of the minibatch, so the accumulated gradient equals the minibatch gradient,
also when the last microbatch is short. The helpers here split the batch and hold back the
data-parallel all-reduce until the last microbatch.

``microbatch.mode=simulated``: one pass over the whole minibatch, but every BatchNorm normalizes
each consecutive group of ``microbatch.size`` examples with that group's statistics and updates
its running statistics group after group, with the full momentum each time: exactly what true
mode computes (outputs, gradients and running statistics), not Composer's ghost BatchNorm, which
divides the momentum by the number of groups (SPEC §6).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

MODES = ("true", "simulated")


def validate_microbatch(size: int, mode: str | bool, batch_size: int) -> str:
    """Check the knobs and return the mode as ``"true"`` or ``"simulated"``.

    ``size`` and ``batch_size`` are in the same unit (examples, or tokens for translation). Hydra
    parses ``microbatch.mode=true`` as the boolean True, which is accepted as ``"true"``.
    """
    normalized = str(mode).lower() if isinstance(mode, bool | str) else mode
    if normalized not in MODES:
        raise ValueError(f"microbatch.mode={mode!r} is unknown; allowed: {', '.join(MODES)}")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ValueError(f"microbatch.size={size!r} must be a positive integer")
    if size > batch_size:
        raise ValueError(
            f"microbatch.size={size} is larger than the minibatch (data.batch_size={batch_size})"
        )
    return normalized


# --- true mode ---------------------------------------------------------------------------------


def split_by_examples(
    tensors: Sequence[torch.Tensor], size: int
) -> list[tuple[tuple[torch.Tensor, ...], float]]:
    """Split tensors of equal length along dim 0 into microbatches of ``size`` examples.

    Returns ``(microbatch tensors, weight)`` pairs, weight = the microbatch's examples / all
    examples; the last microbatch may be shorter. The microbatches are views, not copies.
    """
    total = tensors[0].shape[0]
    if any(t.shape[0] != total for t in tensors):
        raise ValueError(
            f"cannot split tensors of different lengths {[t.shape[0] for t in tensors]} into microbatches"
        )
    pieces = zip(*(t.split(size) for t in tensors), strict=True)
    return [(piece, piece[0].shape[0] / total) for piece in pieces]


def split_by_tokens(token_counts: torch.Tensor, max_tokens: int) -> list[tuple[slice, float]]:
    """Group consecutive sentences into microbatches of at most ``max_tokens`` tokens.

    token_counts: (sentences,) target tokens per sentence, in batch order. Returns ``(slice of
    sentences, weight)`` pairs, weight = the group's tokens / all tokens (the loss is a mean over
    target tokens). Groups are filled greedily, so every group but the last is as full as possible.
    """
    counts = [int(c) for c in token_counts.tolist()]
    total = sum(counts)
    groups: list[tuple[slice, float]] = []
    start, tokens = 0, 0
    for index, count in enumerate(counts):
        if count > max_tokens:
            raise ValueError(
                f"microbatch.size={max_tokens} tokens is smaller than sentence {index} of the batch "
                f"({count} tokens); the longest sentence must fit in one microbatch"
            )
        if tokens + count > max_tokens:
            groups.append((slice(start, index), tokens / total))
            start, tokens = index, 0
        tokens += count
    if start < len(counts):
        groups.append((slice(start, len(counts)), tokens / total))
    return groups


def no_sync_except_last(model: nn.Module, index: int, count: int) -> contextlib.AbstractContextManager:
    """Context for microbatch ``index`` of ``count``: under DistributedDataParallel, skip the gradient
    all-reduce for all but the last microbatch (gradients accumulate locally until then)."""
    if isinstance(model, DistributedDataParallel) and index < count - 1:
        return model.no_sync()
    return contextlib.nullcontext()


# --- simulated mode ----------------------------------------------------------------------------


class SimulatedMicrobatchBatchNorm(_BatchNorm):
    """Mixin placed in front of a BatchNorm's own class: in training, run the BatchNorm's forward
    once per consecutive group of ``microbatch_size`` examples, as true microbatching would."""

    microbatch_size: int

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        batchnorm_forward = super().forward
        if not self.training:
            return batchnorm_forward(input)
        # Each call normalizes with its group's statistics and applies one full-momentum update
        # of the running statistics (num_batches_tracked += 1), group after group. split() gives
        # views and a single backward node, so no activation is copied except by the final cat.
        return torch.cat([batchnorm_forward(group) for group in input.split(self.microbatch_size)])


@functools.cache
def _simulated_class(batchnorm_class: type) -> type:
    return type(
        f"SimulatedMicrobatch{batchnorm_class.__name__}", (SimulatedMicrobatchBatchNorm, batchnorm_class), {}
    )


def apply_simulated_microbatching(model: nn.Module, size: int) -> None:
    """Make every BatchNorm in ``model`` compute statistics per group of ``size`` examples.

    The modules are changed in place (their class gains the grouped forward), so parameters,
    buffers, state-dict keys, hooks (e.g. precision's FP32 casting) and outside references stay.
    Calling it again changes the group size.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ValueError(f"microbatch.size={size!r} must be a positive integer")
    for module in model.modules():
        if isinstance(module, _BatchNorm):
            if not isinstance(module, SimulatedMicrobatchBatchNorm):
                module.__class__ = _simulated_class(type(module))
            module.microbatch_size = size
