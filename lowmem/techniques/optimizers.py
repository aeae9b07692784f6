"""SGD and Adam that train 16-bit weights without any FP32 copy (the report's sections 3.2 and 4.3).

A step is a handful of multi-tensor operations, whatever the number of parameter tensors: the
parameters of a group are split by device and dtype, and

- 16-bit tensors (FP16/BF16 weights, gradients and state) go to one fused update
  (``lowmem.kernels``): every element computed in FP32 in registers and written back in 16 bits,
  with no FP32 temporaries (the plain-torch fallback works through 16K-element slices);
- FP32 and FP64 tensors go through ``torch._foreach_*`` operations in place, the same arithmetic as
  ``torch.optim.SGD`` (bit for bit) and fairseq's Adam. The update is computed inside the gradient
  tensors, so **a step consumes the gradients** (they hold the update afterwards) and needs no
  memory beyond them.

Gradients may arrive scaled by a loss scaler: ``step(grad_scale=scaler.scale)`` divides by the scale
in FP32, so no unscaled FP16 gradient (which could underflow) is ever materialised. Nothing in a
step waits for the device (no host synchronisation).

State is created with the optimizer (zeros), so the memory of the first step is that of every
step. Layout, and what the sparsity technique may do with it: every state tensor shaped like its
parameter (SGD's ``momentum_buffer``; Adam's ``exp_avg`` and ``exp_avg_sq``) may be zeroed at any
positions or replaced by another of the parameter's new shape between steps, because a stored zero
is a zero moment whatever the tensor's scale. The 0-dim FP32 ``*_log2_scale`` tensors and ``step``
must be left alone. Stochastic rounding draws counter-based random numbers (``lowmem.kernels
.reference``): ``rounding_step`` in the state dict is all a resumed run needs to round as the
original.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lowmem import kernels
from lowmem.kernels.reference import adam_step_size, tensor_keys

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


class _LowPrecisionOptimizer(torch.optim.Optimizer):
    """What both optimizers share: state created up front, parameters grouped by device and dtype,
    the stochastic-rounding counter."""

    def __init__(self, params: Iterable, defaults: dict[str, Any], stochastic_rounding: bool, seed: int) -> None:
        super().__init__(params, defaults)
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        self.rounding_step = 0  # applied steps: the counter of the stochastic-rounding stream
        # Each parameter's index over the whole optimizer: its stochastic-rounding stream.
        self._index = {p: i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        for group in self.param_groups:
            for param in group["params"]:
                self._init_state(param, group)

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _by_dtype(self, group: dict[str, Any]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
        """The group's parameters that have a gradient, by (device, dtype)."""
        split: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for param in group["params"]:
            if param.grad is not None:
                split.setdefault((param.device, param.dtype), []).append(param)
        return split

    def _keys(self, params: list[torch.Tensor]) -> list[int] | None:
        """Stochastic rounding's per-tensor keys for this step, or None (round to nearest)."""
        if not self.stochastic_rounding:
            return None
        keys = tensor_keys(self.seed, self.rounding_step, len(self._index))
        return [keys[self._index[p]] for p in params]

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["rounding_step"] = self.rounding_step
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.rounding_step = int(state_dict.pop("rounding_step", 0))
        state_dict.pop("rounding_generator", None)  # written by lowmem before counter-based rounding
        super().load_state_dict(state_dict)
        # Optimizer.load_state_dict casts floating state to the parameter's dtype; the scales are
        # FP32 (they are small integers, so the round trip was exact).
        for state in self.state.values():
            for key, value in state.items():
                if key.endswith("_log2_scale"):
                    state[key] = value.float()


def read_moment(state: dict[str, Any], key: str) -> torch.Tensor:
    """Adam's moment ``key`` ("exp_avg" or "exp_avg_sq") of one parameter, in FP32 and unscaled."""
    stored, scale = state[key], state.get(f"{key}_log2_scale")
    return stored.float() if scale is None else torch.ldexp(stored.float(), -scale)


def _unscale_(grads: list[torch.Tensor], grad_scale: float) -> None:
    if grad_scale != 1.0:
        torch._foreach_div_(grads, grad_scale)


class LowPrecisionSGD(_LowPrecisionOptimizer):
    """SGD with (Nesterov) momentum; the momentum buffer is kept in the parameter's dtype.

    Per element, in FP32: ``g = grad / grad_scale + weight_decay * w``; ``buf = momentum * buf + g``;
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

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        if group["momentum"] != 0:
            self.state[param]["momentum_buffer"] = torch.zeros_like(param)

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0) -> None:
        """One update of every parameter with a gradient; ``grad_scale`` is the loss scale (a factor)."""
        self.rounding_step += 1
        for group in self.param_groups:
            lr, momentum, nesterov, decay = group["lr"], group["momentum"], group["nesterov"], group["weight_decay"]
            for (_, dtype), params in self._by_dtype(group).items():
                grads = [p.grad for p in params]
                momenta = [self.state[p]["momentum_buffer"] for p in params] if momentum != 0 else []
                if dtype in _SIXTEEN_BIT:
                    kernels.sgd(params, grads, momenta, self._keys(params), lr=lr, momentum=momentum,
                                nesterov=nesterov, weight_decay=decay, grad_scale=grad_scale)
                    continue
                # FP32/FP64: torch.optim.SGD's arithmetic, in place in the gradients.
                _unscale_(grads, grad_scale)
                if decay != 0:
                    torch._foreach_add_(grads, params, alpha=decay)
                update = grads
                if momentum != 0:
                    torch._foreach_mul_(momenta, momentum)
                    torch._foreach_add_(momenta, grads)
                    if nesterov:
                        torch._foreach_add_(grads, momenta, alpha=momentum)
                    else:
                        update = momenta
                torch._foreach_add_(params, update, alpha=-lr)


class LowPrecisionAdam(_LowPrecisionOptimizer):
    """fairseq's Adam: bias-corrected moments, decoupled weight decay, moments in the param's dtype.

    Per element, in FP32, at step t: ``g = grad / grad_scale``; ``m = b1 m + (1-b1) g``;
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

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[param]
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(param)
        state["exp_avg_sq"] = torch.zeros_like(param)
        if param.dtype in _SIXTEEN_BIT:
            for key in ("exp_avg_log2_scale", "exp_avg_sq_log2_scale"):
                state[key] = torch.zeros((), dtype=torch.float32, device=param.device)

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0) -> None:
        """One update of every parameter with a gradient; ``grad_scale`` is the loss scale (a factor)."""
        self.rounding_step += 1
        for group in self.param_groups:
            (beta1, beta2), lr, eps, weight_decay = group["betas"], group["lr"], group["eps"], group["weight_decay"]
            decay = 1 - lr * weight_decay if weight_decay != 0 else None
            for (_, dtype), params in self._by_dtype(group).items():
                states = [self.state[p] for p in params]
                for state in states:
                    state["step"] += 1
                step_sizes = [adam_step_size(lr, beta1, beta2, state["step"]) for state in states]
                grads = [p.grad for p in params]
                exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
                if dtype in _SIXTEEN_BIT:
                    scales = [(s["exp_avg_log2_scale"], s["exp_avg_sq_log2_scale"]) for s in states]
                    kernels.adam(params, grads, exp_avgs, exp_avg_sqs, scales, step_sizes, self._keys(params),
                                 beta1=beta1, beta2=beta2, eps=eps, decay=decay, grad_scale=grad_scale)
                    continue
                # FP32/FP64: in place; the gradients end up holding the denominators.
                _unscale_(grads, grad_scale)
                torch._foreach_mul_(exp_avgs, beta1)
                torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
                if decay is not None:
                    torch._foreach_mul_(params, decay)
                torch._foreach_copy_(grads, exp_avg_sqs)
                torch._foreach_sqrt_(grads)
                torch._foreach_add_(grads, eps)
                torch._foreach_addcdiv_(params, exp_avgs, grads, [-size for size in step_sizes])
