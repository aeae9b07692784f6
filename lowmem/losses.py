"""Losses for a loop of one's own: the output layer and its cross-entropy without the logits.

::

    from lowmem.losses import linear_cross_entropy
    hidden = model.model(input_ids).last_hidden_state          # [B, T, H]: the output layer's input
    loss = linear_cross_entropy(hidden[:, :-1], model.lm_head, input_ids[:, 1:])

equals ``F.cross_entropy(model.lm_head(hidden[:, :-1]).flatten(0, -2).float(), input_ids[:, 1:].flatten())``
(FP64: to rounding; FP32: each token's logit gradient has plain PyTorch's bits) but never holds more
than one chunk of logits or of their gradient: see ``lowmem.techniques.head_loss``. Through
``lowmem.prepare`` and the command line nothing needs changing: ``loss.chunk_tokens`` (default
``auto``) applies this to a ``transformers`` model's ``labels=`` loss and to the DynamicConv recipe.
"""

from __future__ import annotations

import torch
from torch import nn

from lowmem.techniques.head_loss import IGNORE_INDEX, Head, LossForm, chunk_for, linear_cross_entropy_per_token

__all__ = ["linear_cross_entropy"]


class _Weights:
    """A bare weight (and bias) as a head's module."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor | nn.Linear,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_tokens: int | str | None = "auto",
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target)`` over the last dim of ``hidden``
    ([..., H]; ``target`` [...], class indices), a chunk of tokens at a time.

    ``weight``: the output layer's [V, H] weight, or the ``nn.Linear`` itself (its bias is used;
    a compact sparse one too). ``reduction``: "mean" (over the targets not ignored), "sum" or
    "none" (per token, ``target``'s shape). ``chunk_tokens``: tokens per chunk, "auto" (chunked when
    the FP32 logits would exceed 8 MiB) or None / "none" (one chunk: still never the saved logits).
    The loss is FP32 (FP64 for FP64 weights)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is not allowed: one of mean, sum, none")
    if isinstance(weight, nn.Linear):
        if bias is not None:
            raise ValueError("bias is given twice: the nn.Linear's own bias is used; pass its weight to give another")
        head = Head(weight)
    elif isinstance(weight, torch.Tensor) and weight.dim() == 2:
        head = Head(_Weights(weight, bias))  # type: ignore[arg-type]
    else:
        raise TypeError(f"weight must be an nn.Linear or a [vocabulary, features] tensor, not {type(weight).__name__}")
    vocab, features = head.shape()
    if hidden.shape[-1] != features:
        raise ValueError(f"hidden has {hidden.shape[-1]} features in its last dim where the weight takes {features}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target {tuple(target.shape)} must have hidden's shape without its last dim, "
                         f"{tuple(hidden.shape[:-1])}")
    flat, labels = hidden.reshape(-1, features), target.reshape(-1)
    chunk = chunk_for(chunk_tokens, flat.shape[0], vocab, features) or max(1, flat.shape[0])
    form = LossForm.torch(vocab, label_smoothing, ignore_index)
    loss, _ = linear_cross_entropy_per_token(flat, head, labels, form, chunk)
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / labels.ne(ignore_index).sum()
