"""Low precision: ``precision=fp32|fp16|bf16|amp`` (the report's section 3.2).

- ``fp16``: parameters, gradients, optimizer state and activations in FP16 with **no FP32 copy of
  any weight**. Normalization layers (parameters and running statistics) stay FP32 and run in FP32
  on their FP16 input. The loss is computed in FP32 from the logits and scaled by a dynamic
  ``LossScaler``; gradients stay scaled in FP16 and the optimizers of ``optimizers.py`` unscale them
  in FP32 inside the update.
- ``bf16``: the same without loss scaling (BF16 has FP32's exponent range).
- ``amp``: ``torch.autocast`` over FP32 weights, with torch's ``GradScaler`` on CUDA: the
  conventional peer, kept for side-by-side comparison.
- ``fp32``: plain.
- ``fp64``: everything in FP64 — not a memory technique, the reference that equivalence tests
  (e.g. data parallel vs one process) compare against.

Build order and one training step (the same code for every precision)::

    policy = make_policy(cfg.precision, device)
    model = convert_model(model, policy)               # before building the optimizer
    optimizer = LowPrecisionSGD(model.parameters(), lr=0.1)
    scaler = make_loss_scaler(policy, optimizer=optimizer)

    optimizer.zero_grad()
    with autocast_context(policy, device):
        logits = model(cast_input(x, policy))
    loss = loss_fn(logits.float(), y)                  # the loss in FP32, whatever the logits' dtype
    scaler.scale_loss(loss).backward()
    found = scaler.found_overflow(params)              # under data parallelism: all-reduce (max) it here
    if not found:
        optimizer.step(grad_scale=scaler.scale)
    scaler.update(found)

On a CPU, ``precision.cpu_compute`` (``lowmem.techniques.cpu_compute``) computes the 16-bit
convolutions and matrix products in FP32 where the CPU's native 16-bit kernels are slow.

A skipped step leaves weights and optimizer state untouched; it is not an applied step (the
sparsity technique must not count it).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowmem.techniques.cpu_compute import check_setting
from lowmem.techniques.shards import is_sharded, local

PRECISIONS = ("fp32", "fp16", "bf16", "amp", "fp64")

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)

# Layers whose parameters and running statistics stay FP32 (the report keeps BatchNorm in FP32;
# LayerNorm and GroupNorm reduce over many values just the same). Subclasses match too.
NORMALIZATION_TYPES: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
)


@dataclass(frozen=True)
class PrecisionPolicy:
    """What one ``precision=`` value means; built by ``make_policy``.

    ``param_dtype`` is the dtype of every weight outside the normalization layers (and so of its
    gradient and optimizer state); ``input_dtype`` the dtype floating-point inputs are cast to;
    ``autocast_dtype`` is set for ``amp`` only. ``init_scale`` (a factor) and ``growth_interval``
    (applied steps) configure the loss scaler when ``uses_loss_scaling``.
    """

    name: str
    param_dtype: torch.dtype
    input_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    uses_loss_scaling: bool
    stochastic_rounding: bool
    device_type: str
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    cpu_compute: str = "auto"  # precision.cpu_compute: see lowmem.techniques.cpu_compute

    @property
    def sixteen_bit(self) -> torch.dtype | None:
        """The 16-bit dtype this precision computes in (weights' or autocast's), or None."""
        dtype = self.autocast_dtype or self.param_dtype
        return dtype if dtype in _SIXTEEN_BIT else None


def make_policy(
    name: str,
    device: torch.device | str,
    *,
    stochastic_rounding: bool = False,
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
    cpu_compute: str = "auto",
) -> PrecisionPolicy:
    """The policy for ``precision=name`` on ``device``.

    Raises ``ValueError`` for an unknown name, for stochastic rounding without 16-bit weights, and
    when the device cannot run the precision (BF16 on a CUDA GPU without native BF16, or a probe
    convolution in the needed dtype failing there), and for a ``cpu_compute`` not in
    ``CPU_COMPUTE``. 16-bit on a CPU runs at FP32's speed or better under ``cpu_compute``.
    """
    if name not in PRECISIONS:
        raise ValueError(f"precision={name!r} is not one of {', '.join(PRECISIONS)}")
    check_setting(cpu_compute)
    device = torch.device(device)
    compute_dtype = {
        "fp32": torch.float32,
        "fp64": torch.float64,  # reference runs: equivalence tests compare against it
        "fp16": torch.float16,
        "bf16": torch.bfloat16,
        # autocast's usual pairing: FP16 with a loss scaler on CUDA, BF16 (no scaler needed) elsewhere
        "amp": torch.float16 if device.type == "cuda" else torch.bfloat16,
    }[name]
    pure_low_precision = name in ("fp16", "bf16")
    if stochastic_rounding and not pure_low_precision:
        raise ValueError(
            f"precision.stochastic_rounding=True needs precision=fp16 or bf16 (16-bit weights), "
            f"got precision={name}"
        )
    if compute_dtype in _SIXTEEN_BIT:
        _check_device_runs(name, compute_dtype, device)
    storage_dtype = compute_dtype if pure_low_precision or name == "fp64" else torch.float32
    return PrecisionPolicy(
        name=name,
        param_dtype=storage_dtype,
        input_dtype=storage_dtype,
        autocast_dtype=compute_dtype if name == "amp" else None,
        uses_loss_scaling=compute_dtype == torch.float16,
        stochastic_rounding=stochastic_rounding,
        device_type=device.type,
        init_scale=init_scale,
        growth_interval=growth_interval,
        cpu_compute=cpu_compute,
    )


def _check_device_runs(name: str, dtype: torch.dtype, device: torch.device) -> None:
    if dtype == torch.bfloat16 and device.type == "cuda" and torch.cuda.is_available():
        # Pre-Ampere GPUs emulate BF16: it "works" but is slow, so refuse it up front.
        if not torch.cuda.is_bf16_supported(including_emulation=False):
            raise ValueError(
                f"precision={name} needs bfloat16, which {torch.cuda.get_device_name(device)} does not "
                f"support natively; use precision=fp16 or fp32"
            )
    error = _conv_probe_error(str(device), dtype)
    if error is not None:
        raise ValueError(
            f"precision={name} cannot run on device {device}: a {dtype} convolution failed ({error})"
        )


@functools.cache
def _conv_probe_error(device: str, dtype: torch.dtype) -> str | None:
    """None if a tiny conv2d forward and backward runs in ``dtype`` on ``device``, else the error."""
    try:
        x = torch.ones(1, 1, 3, 3, device=device, dtype=dtype, requires_grad=True)
        weight = torch.ones(1, 1, 3, 3, device=device, dtype=dtype)
        F.conv2d(x, weight).sum().backward()
    # torch raises AssertionError, not RuntimeError, for a CUDA device in a build without CUDA.
    except (RuntimeError, AssertionError) as error:
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    return None


def convert_model(model: nn.Module, policy: PrecisionPolicy) -> nn.Module:
    """Cast ``model`` in place for ``policy`` and return it; state-dict keys do not change.

    For fp16/bf16 every floating-point parameter and buffer becomes ``policy.param_dtype``, except:

    - the normalization layers (``NORMALIZATION_TYPES``), which stay FP32. They take the 16-bit
      input as it is: torch's normalization kernels accept a 16-bit input with FP32 parameters,
      compute the statistics in FP32 and return the input's dtype — so the activations they save
      for backward stay 16-bit (casting the input to FP32 first would double that memory);
    - the constants of parameter-free modules: a floating-point buffer registered
      ``persistent=False`` (not in the state dict: the module computes it from its configuration)
      in a module with no parameters, in itself or the modules inside it, e.g. a rotary
      embedding's ``inv_freq``. Rounding it would change the model for good (Llama's rotary
      frequencies by up to 0.37%, growing with position) and make it differ from itself rebuilt
      and reloaded, since the state dict does not carry it. The buffers of modules with
      parameters (a block's attention mask, relative-position tables, biases kept as buffers)
      compute with those parameters and become 16-bit with them.

    Integer and bool tensors (BatchNorm's ``num_batches_tracked``, position ids, sparsity masks)
    are untouched. fp32 and amp leave the model as it is.

    Call it before building the optimizer (its state is created in the parameters' dtype).
    """
    if policy.param_dtype == torch.float32:
        return model
    if policy.param_dtype == torch.float64:
        return model.double()  # a reference run: everything, normalization included, in FP64
    for module in model.modules():
        if isinstance(module, NORMALIZATION_TYPES):
            _cast_own_tensors(module, torch.float32)
        else:
            _cast_own_tensors(module, policy.param_dtype)
    return model


def _cast_own_tensors(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the module's own (not its children's) floating-point parameters and buffers, but not
    the constants of a parameter-free module (see ``convert_model``)."""
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype)  # keeps the Parameter object, so references stay valid
    constant_holder = not _has_parameters(module)
    for name, buffer in module.named_buffers(recurse=False):
        if buffer.is_floating_point() and not (constant_holder and name in module._non_persistent_buffers_set):
            setattr(module, name, buffer.to(dtype))


def _has_parameters(module: nn.Module) -> bool:
    """Whether ``module`` or any module inside it has parameters."""
    return any(True for _ in module.parameters())


def kept_constants(model: nn.Module) -> list[str]:
    """The floating-point buffers ``convert_model`` leaves in their dtype under fp16/bf16 (names)."""
    return [
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if not isinstance(module, NORMALIZATION_TYPES) and not _has_parameters(module)
        for name, buffer in module.named_buffers(recurse=False)
        if buffer.is_floating_point() and name in module._non_persistent_buffers_set
    ]


def cast_input(x: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    """A floating-point input in ``policy.input_dtype``; integer inputs (token ids) unchanged."""
    return x.to(policy.input_dtype) if x.is_floating_point() else x


def autocast_context(
    policy: PrecisionPolicy, device: torch.device | str
) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for amp; a no-op context for every other precision."""
    if policy.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=policy.autocast_dtype)


def round_to_dtype(
    value: torch.Tensor,
    dtype: torch.dtype,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``value`` (FP32) in ``dtype``: round-to-nearest-even, or stochastic rounding for FP16/BF16.

    Stochastic rounding picks one of the two neighbouring ``dtype`` numbers with probability
    proportional to closeness, so the expected result equals ``value``: updates smaller than half a
    unit in the last place are not lost on average (with round-to-nearest they vanish every time).
    """
    if not stochastic or dtype not in _SIXTEEN_BIT:
        return value.to(dtype)
    info = torch.finfo(dtype)
    # |value| in [2**(exponent-1), 2**exponent); below the normal range the spacing stops shrinking.
    _, exponent = torch.frexp(value)
    exponent = exponent.clamp(min=round(math.log2(info.tiny)) + 1)
    spacing = torch.ldexp(torch.full_like(value, info.eps), exponent - 1)  # dtype's ulp at value
    lower = torch.floor(value / spacing) * spacing  # exact: spacing is a power of two
    fraction = (value - lower) / spacing  # in [0, 1): the probability of rounding up
    draw = torch.rand(value.shape, generator=generator, device=value.device)
    return torch.where(draw < fraction, lower + spacing, lower).to(dtype)


def has_nonfinite_grad(params: Iterable[torch.Tensor]) -> bool:
    """True if any gradient holds an inf or NaN. One fused pass and one host sync.

    The per-tensor max |g| (an inf-norm, never overflowing for finite values) is inf or NaN exactly
    when the tensor holds one.
    """
    # Sharded gradients: this rank's rows (the caller combines the ranks' answers).
    grads = [local(p.grad) for p in params if p.grad is not None and local(p.grad).numel() > 0]
    if not grads:
        return False
    max_abs = torch._foreach_norm(grads, math.inf)
    return not bool(torch.stack([m.float() for m in max_abs]).isfinite().all())


NONFINITE_LIMIT = 10  # non-finite steps in a row after which a run stops (trainer.stop_on_nonfinite)
# A run that reaches its end in this many non-finite steps in a row or more has diverged too, though
# it had fewer than NONFINITE_LIMIT left (its weights are the last good ones: nothing of them applied).
NONFINITE_AT_END = 2


class TrainingDiverged(FloatingPointError):
    """Non-finite losses or gradients persist: the run cannot train on (one line, the step, the loss
    and the knobs to look at). Raised before anything of the failing step is applied or saved."""


class LossScaler:
    """Dynamic loss scaling for gradients that stay FP16 (``torch.amp.GradScaler`` refuses those).

    The loss is multiplied by ``scale`` so small gradients do not underflow FP16. An overflow (any
    non-finite gradient) means the step must be skipped and ``scale`` is multiplied by
    ``backoff_factor``; after ``growth_interval`` applied steps in a row without overflow it is
    multiplied by ``growth_factor``. An overflow with ``scale`` already at ``min_scale`` raises
    ``FloatingPointError``: the gradients are non-finite whatever the scale, training has diverged.

    ``enabled=False`` (fp32, bf16): ``scale`` is 1, nothing is checked and no step is skipped.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 2.0**-14,
        enabled: bool = True,
    ) -> None:
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(
                f"loss scaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                f"growth_interval >= 1; got init_scale={init_scale}, growth_factor={growth_factor}, "
                f"backoff_factor={backoff_factor}, growth_interval={growth_interval}"
            )
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.clean_steps = 0  # applied steps since the last change of scale

    @property
    def loss_scale(self) -> float:
        """The factor losses are multiplied by this step (what the log reports)."""
        return self.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``: backpropagate this one (keep ``loss`` itself for logging)."""
        return loss * self.scale if self.enabled else loss

    def found_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """True if any gradient of ``params`` is inf or NaN (always False when disabled)."""
        return self.enabled and has_nonfinite_grad(params)

    def update(self, found_inf: bool) -> None:
        """Adapt the scale after a step; ``found_inf`` must be the same on every data-parallel rank."""
        if not self.enabled:
            return
        if found_inf:
            if self.scale <= self.min_scale:
                raise FloatingPointError(
                    f"gradients overflow even at the minimum loss scale {self.min_scale}: training diverged"
                )
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])


class AmpLossScaler:
    """``LossScaler``'s interface over ``torch.amp.GradScaler``, for ``precision=amp``.

    The gradients are FP32 here, so ``found_overflow`` lets torch unscale them in place
    (``GradScaler.unscale_``); from then until ``update`` the gradients carry no scale and ``scale``
    reads 1.0, so the usual ``optimizer.step(grad_scale=scaler.scale)`` is right. ``update`` adapts
    the scale by ``found_inf``, the overflow of any rank: torch's own record holds this rank's
    gradients only, which under sharding (``trainer.parallel=fsdp``: each rank checks its rows) may
    differ between ranks, and the ranks' scales must not.
    """

    def __init__(
        self,
        grad_scaler: torch.amp.GradScaler,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device | str | None = None,
    ) -> None:
        if grad_scaler.is_enabled() and optimizer is None:
            raise ValueError(
                "precision=amp with loss scaling needs the optimizer: make_loss_scaler(..., optimizer=)"
            )
        self.grad_scaler = grad_scaler
        self.optimizer = optimizer
        self._unscaled = False
        self._unscaling: _LocalGradients | None = None  # GradScaler keys its record of a step by it
        if grad_scaler.is_enabled():
            # GradScaler creates its scale tensor on the first loss it scales. Created here, on the
            # training device, so that the profiler's pass on fake tensors (which scales a fake loss
            # first) cannot leave a fake scale behind for the real steps.
            grad_scaler.scale(torch.ones((), device=device or grad_scaler._device))

    @property
    def enabled(self) -> bool:
        return self.grad_scaler.is_enabled()

    @property
    def scale(self) -> float:
        """The factor the current gradients carry (1.0 once ``found_overflow`` has unscaled them)."""
        return 1.0 if self._unscaled or not self.enabled else self.grad_scaler.get_scale()

    @property
    def loss_scale(self) -> float:
        """The factor this step's losses were multiplied by, unscaled gradients or not (for the log)."""
        return self.grad_scaler.get_scale() if self.enabled else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self._unscaled = False
        return self.grad_scaler.scale(loss)

    def found_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        if not self.enabled:
            return False
        # Sharded: torch's unscale_ refuses a mix of sharded (DTensor) and whole gradients, so it
        # unscales each gradient's local piece (in place: the same storage), through a stand-in.
        self._unscaling = _LocalGradients(self.optimizer)
        self.grad_scaler.unscale_(self._unscaling)
        self._unscaled = True
        return has_nonfinite_grad(params)

    def update(self, found_inf: bool) -> None:
        """Adapt the scale after a step; ``found_inf`` must be the same on every data-parallel rank."""
        if self.enabled:
            # GradScaler.update reads the overflow it recorded while unscaling, this rank's only.
            for recorded in self.grad_scaler._per_optimizer_states.values():
                for found in recorded["found_inf_per_device"].values():
                    found.fill_(float(found_inf))
        self.grad_scaler.update()
        self._unscaled = False

    def state_dict(self) -> dict[str, Any]:
        return self.grad_scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.grad_scaler.load_state_dict(state)


class _LocalGradients:
    """What ``GradScaler.unscale_`` reads of an optimizer (``param_groups``), each sharded parameter
    replaced by its local piece (detached, no copy) holding its gradient's local piece as ``grad``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.param_groups = [
            {"params": [_local_with_grad(p) for p in group["params"]]} for group in optimizer.param_groups
        ]


def _local_with_grad(param: torch.Tensor) -> torch.Tensor:
    if param.grad is None or not is_sharded(param.grad):
        return param
    piece = local(param).detach()
    piece.grad = local(param.grad)
    return piece


def make_loss_scaler(
    policy: PrecisionPolicy,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 2.0**-14,
    device: torch.device | str | None = None,
) -> LossScaler | AmpLossScaler:
    """The loss scaler for ``policy``: ours for fp16, disabled for fp32 and bf16, torch's for amp.

    ``optimizer`` is needed for amp on CUDA only (torch unscales gradients through it); ``device``
    (default: the policy's device type) is where amp's scale tensor lives.
    """
    if policy.name == "amp":
        grad_scaler = torch.amp.GradScaler(
            policy.device_type,
            init_scale=policy.init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=policy.growth_interval,
            enabled=policy.uses_loss_scaling,
        )
        return AmpLossScaler(grad_scaler, optimizer, policy.device_type if device is None else device)
    return LossScaler(
        init_scale=policy.init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=policy.growth_interval,
        min_scale=min_scale,
        enabled=policy.uses_loss_scaling,
    )
