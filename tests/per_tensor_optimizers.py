"""The per-tensor optimizers lowmem shipped before its fused multi-tensor ones (lowmem/techniques/optimizers.py
at commit 8b1be5c), kept as the reference the fused updates are tested against (tests/test_optimizers.py)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from lowmem.techniques.precision import round_to_dtype

# A 16-bit moment tensor is stored times 2**log2_scale, chosen so that its largest |value| lands in
# [2**14, 2**15): the top binade in which every value still rounds to a finite FP16 (max 65504).
# Entries down to 2**-28 of the largest then keep full precision and down to 2**-38 stay nonzero,
# instead of flushing to zero the way unscaled FP16 moments do (the report's divergence).
_MOMENT_TOP_EXPONENT = 15
# Keep 2**log2_scale finite in FP32 even for an all-tiny tensor.
_MAX_LOG2_SCALE = 126


class _LowPrecisionOptimizer(torch.optim.Optimizer):
    """What both optimizers share: FP32 views of 16-bit tensors and the write-back."""

    def __init__(
        self, params: Iterable, defaults: dict[str, Any], stochastic_rounding: bool, seed: int
    ) -> None:
        super().__init__(params, defaults)
        self.stochastic_rounding = stochastic_rounding
        self._generator: torch.Generator | None = None
        if stochastic_rounding:
            # A seeded generator of our own: data-parallel ranks then round identically and stay in
            # sync, and the global RNG (data order, dropout) is not disturbed.
            device = self.param_groups[0]["params"][0].device
            self._generator = torch.Generator(device=device).manual_seed(seed)

    def _write_weight(self, param: torch.Tensor, weight: torch.Tensor) -> None:
        """Store the FP32 ``weight`` (from ``_as_fp32(param)``) back into ``param``."""
        if weight is not param:
            param.copy_(round_to_dtype(weight, param.dtype, self.stochastic_rounding, self._generator))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._generator is not None:
            state["rounding_generator"] = self._generator.get_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        generator_state = state_dict.pop("rounding_generator", None)
        super().load_state_dict(state_dict)
        if self._generator is not None and generator_state is not None:
            self._generator.set_state(generator_state)


def _as_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself if FP32 or wider (so updates land in place), else a temporary FP32 copy."""
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


def _unscaled_grad(param: torch.Tensor, grad_scale: float) -> torch.Tensor:
    """The gradient in FP32 divided by the loss scale: a new tensor, ``param.grad`` is not changed."""
    return _as_fp32(param.grad) / grad_scale


class LowPrecisionSGD(_LowPrecisionOptimizer):
    """SGD with (Nesterov) momentum; the momentum buffer is kept in the parameter's dtype.

    Per tensor, in FP32: ``g = grad / grad_scale + weight_decay * w``; ``buf = momentum * buf + g``;
    ``w -= lr * (g + momentum * buf)`` (Nesterov) or ``w -= lr * buf``. For FP32 parameters this is
    bit-for-bit ``torch.optim.SGD(..., nesterov=nesterov)``. ``stochastic_rounding`` applies to the
    weight's write-back (the momentum is rounded to nearest).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        momentum: float = 0.9,
        nesterov: bool = True,
        weight_decay: float = 5e-4,
        stochastic_rounding: bool = False,
        seed: int = 0,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(
                f"SGD needs lr, momentum, weight_decay >= 0; got {lr}, {momentum}, {weight_decay}"
            )
        if nesterov and momentum == 0:
            raise ValueError("SGD with nesterov=True needs momentum > 0")
        defaults = {"lr": lr, "momentum": momentum, "nesterov": nesterov, "weight_decay": weight_decay}
        super().__init__(params, defaults, stochastic_rounding, seed)

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0) -> None:
        """One update of every parameter with a gradient; ``grad_scale`` is the loss scale (a factor)."""
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                weight = _as_fp32(param)
                grad = _unscaled_grad(param, grad_scale)
                if group["weight_decay"] != 0:
                    grad = grad.add(weight, alpha=group["weight_decay"])
                update = grad
                if momentum != 0:
                    state = self.state[param]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(param)
                    buffer = _as_fp32(state["momentum_buffer"])
                    buffer.mul_(momentum).add_(grad)
                    update = grad.add(buffer, alpha=momentum) if group["nesterov"] else buffer
                    if buffer is not state["momentum_buffer"]:
                        state["momentum_buffer"].copy_(buffer)
                weight.add_(update, alpha=-lr)
                self._write_weight(param, weight)


class LowPrecisionAdam(_LowPrecisionOptimizer):
    """fairseq's Adam: bias-corrected moments, decoupled weight decay, moments in the param's dtype.

    Per tensor, in FP32, at step t: ``g = grad / grad_scale``; ``m = b1 m + (1-b1) g``;
    ``v = b2 v + (1-b2) g^2``; ``w *= 1 - lr * weight_decay``;
    ``w -= lr * sqrt(1-b2^t) / (1-b1^t) * m / (sqrt(v) + eps)``.

    For 16-bit parameters each moment is stored scaled per tensor by ``2**log2_scale`` (FP32 0-dim
    state, re-chosen every step from the moment's max |value|), because unscaled FP16 moments —
    especially ``v``, a square of small gradients — mostly round to zero and training diverges.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.98),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        stochastic_rounding: bool = False,
        seed: int = 0,
    ) -> None:
        if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"Adam needs lr >= 0, eps > 0, weight_decay >= 0, 0 <= betas < 1; "
                f"got lr={lr}, eps={eps}, weight_decay={weight_decay}, betas={betas}"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, stochastic_rounding, seed)

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0) -> None:
        """One update of every parameter with a gradient; ``grad_scale`` is the loss scale (a factor)."""
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                grad = _unscaled_grad(param, grad_scale)
                exp_avg = self._read_moment(state, "exp_avg")
                exp_avg_sq = self._read_moment(state, "exp_avg_sq")
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr * math.sqrt(1 - beta2 ** state["step"]) / (1 - beta1 ** state["step"])

                weight = _as_fp32(param)
                if group["weight_decay"] != 0:
                    weight.mul_(1 - lr * group["weight_decay"])
                weight.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(group["eps"]), value=-step_size)
                self._write_moment(state, "exp_avg", exp_avg)
                self._write_moment(state, "exp_avg_sq", exp_avg_sq)
                self._write_weight(param, weight)

    @staticmethod
    def _read_moment(state: dict[str, Any], key: str) -> torch.Tensor:
        """The moment in FP32: the state tensor itself if FP32, else stored / 2**log2_scale."""
        stored = state[key]
        if stored.dtype == torch.float32:
            return stored
        log2_scale = state.get(f"{key}_log2_scale")
        if log2_scale is None:  # first step: the zeros need no scale
            return stored.float()
        return torch.ldexp(stored.float(), -log2_scale.float())

    @staticmethod
    def _write_moment(state: dict[str, Any], key: str, value: torch.Tensor) -> None:
        """Store the FP32 ``value`` scaled so its max |value| sits near the top of the FP16 range.

        The scale is a power of two, so scaling adds no rounding error of its own, and it is kept as
        its (integer) exponent: ``Optimizer.load_state_dict`` casts all state to the parameter's
        dtype, which an integer below 2**8 survives exactly even in BF16, a scale like 2**30 not.
        """
        stored = state[key]
        if value is stored:
            return  # FP32: updated in place
        _, exponent = torch.frexp(value.abs().amax())  # max |value| in [2**(exponent-1), 2**exponent)
        log2_scale = (_MOMENT_TOP_EXPONENT - exponent).clamp(-_MAX_LOG2_SCALE, _MAX_LOG2_SCALE).float()
        stored.copy_(torch.ldexp(value, log2_scale))
        state[f"{key}_log2_scale"] = log2_scale
