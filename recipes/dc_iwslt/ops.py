"""The operators of the DynamicConv model whose saved tensors changed between PyTorch versions.

``model.ops`` picks one of two implementations of LayerNorm, softmax, log-softmax and dropout. They
compute the same function (tested to rounding); they differ in what autograd holds for backward:

- ``current``: today's PyTorch. LayerNorm saves its input and per-row statistics; softmax and
  log-softmax save their output; dropout saves its mask (a byte per element on CUDA, the float
  noise on CPU).
- ``pytorch_1_0``: what PyTorch 1.0.1 on CUDA, the report's stack (§4.1), ran and saved:

  - LayerNorm was batch norm over the input viewed as [1, N, d], then ``bias.addcmul(normalized,
    weight)`` (pytorch/pytorch#11867: "aten::layer_norm, which is implemented in terms of
    thnn_batch_normalization"; fused kernels came later): it saved the input *and* the normalized
    tensor, twice today's bytes.
  - softmax and log-softmax saved their input as well as their output (pytorch/pytorch#64000:
    "Backward formulas for softmax/logsoftmax reference ``self``").
  - dropout was CUDA's fused kernel, which saved a byte mask (so on CPU this is *less* than
    ``current``'s 4-byte noise).

  These are emulations (custom autograd functions holding what 1.0's kernels held), not 1.0's
  kernels. ``pytorch_1_0`` exists to reproduce the report's accounting (Table 4's 2,896 MB FP32
  baseline was counted on PyTorch 1.0.1); it costs memory and time, so train with ``current``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Ops:
    """Today's PyTorch operators (``model.ops=current``)."""

    name = "current"

    def softmax(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.softmax(x, dim)

    def log_softmax(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return F.log_softmax(x, dim)

    def dropout(self, x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
        return F.dropout(x, p, training)

    def layer_norm(self, x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
        # Pure 16-bit training keeps the norms' parameters in FP32 (lowmem.techniques.precision).
        # CUDA's LayerNorm kernel takes parameters in the input's dtype only (the CPU kernel accepts
        # the mix), so they are cast here, on every device alike: one computation everywhere, the
        # statistics still accumulated in FP32, and nothing activation-sized in FP32.
        weight, bias = (None if t is None else t.to(x.dtype) for t in (norm.weight, norm.bias))
        return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)


class _SoftmaxSavingInput(torch.autograd.Function):
    """softmax / log-softmax that saves its input besides its output, as PyTorch 1.0 did."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
        out = torch._log_softmax(x, dim, False) if log else torch._softmax(x, dim, False)
        ctx.save_for_backward(x, out)
        ctx.dim, ctx.log = dim, log
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, out = ctx.saved_tensors  # x is held only for its bytes: the formula needs the output
        backward = torch._log_softmax_backward_data if ctx.log else torch._softmax_backward_data
        return backward(grad, out, ctx.dim, x.dtype), None, None


class _ByteMaskDropout(torch.autograd.Function):
    """Inverted dropout that saves a one-byte keep mask, as CUDA's fused dropout did in 1.0."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        keep = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p)
        ctx.save_for_backward(keep)
        ctx.scale = 1.0 / (1.0 - p)
        return x.masked_fill(~keep, 0.0) * ctx.scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return grad.masked_fill(~keep, 0.0) * ctx.scale, None


class Pytorch10Ops(Ops):
    """PyTorch 1.0.1's operators on CUDA, what the report ran (``model.ops=pytorch_1_0``)."""

    name = "pytorch_1_0"

    def softmax(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _SoftmaxSavingInput.apply(x, dim, False)

    def log_softmax(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _SoftmaxSavingInput.apply(x, dim, True)

    def dropout(self, x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
        if not training or p == 0.0:  # 1.0 returned the input itself: nothing saved
            return x
        return _ByteMaskDropout.apply(x, p)

    def layer_norm(self, x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
        # Each of the N rows is one channel of a batch norm over a batch of one (its d elements
        # are the "spatial" positions); training statistics, nothing tracked.
        rows = x.numel() // x.shape[-1]
        normalized = F.batch_norm(x.contiguous().view(1, rows, -1), None, None, training=True, eps=norm.eps)
        # Pure 16-bit training keeps the norms' parameters in FP32 (lowmem.techniques.precision):
        # the affine step would promote to FP32, so return the input's dtype as today's kernel does.
        # addcmul still saves the 16-bit normalized tensor, as 1.0's all-FP16 model did.
        return torch.addcmul(norm.bias, normalized.view(x.shape), norm.weight).to(x.dtype)


OPS = {ops.name: ops for ops in (Ops, Pytorch10Ops)}  # model.ops -> operator set


def ops_named(name: str) -> Ops:
    """The operators ``model.ops=name`` selects; ValueError naming the knob for any other name."""
    if name not in OPS:
        raise ValueError(f"model.ops={name!r}: must be one of {', '.join(OPS)}")
    return OPS[name]()


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters, same state dict) computed by the model's ``Ops``."""

    def __init__(self, dim: int, ops: Ops) -> None:
        super().__init__(dim)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.layer_norm(x, self)
