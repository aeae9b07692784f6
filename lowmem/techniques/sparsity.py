"""Dynamic sparse reparameterization (DSR; Mostafa & Wang 2019, with the report's changes; SPEC §5).

A "model converter": attach it to a model, then make one call after each *applied* optimizer step.
It needs no trainer::

    sparsity = DynamicSparsity(model, model.sparsifiable_weights(), density=0.3, schedule=WRN_SCHEDULE)
    for inputs, targets in batches:
        loss_fn(model(inputs), targets).backward()
        sparsity.mask_gradients()  # before any overflow check, unscaling or clipping
        optimizer.step()           # if the step is skipped (FP16 overflow), skip the next line too
        sparsity.after_optimizer_step(optimizer, epoch)

Sparsity is simulated: weights stay dense tensors holding exact zeros outside a bool mask. The
weights, their gradients and the optimizer state share one sparsity pattern, because gradients are
masked and the optimizer state is reset wherever a weight is inactive or has just been regrown.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

# DSR's WRN setting (20,000 of the 1,451,520 sparsifiable weights per rewiring), as a fraction.
DEFAULT_REWIRE_FRACTION = 0.01377866
# The threshold moves by this factor when a rewiring prunes more than 10% off its target.
THRESHOLD_SCALE = 2.0
THRESHOLD_TOLERANCE = 0.1


@dataclass(frozen=True)
class RewireSchedule:
    """Rewiring periods.

    ``starts[i]`` (inclusive) begins a range in which rewiring happens every ``periods[i]`` updates;
    from ``stop`` on, never. ``unit`` says what ``starts`` and ``stop`` count: ``"epoch"`` (the
    epoch passed by the caller, fractional allowed) or ``"update"`` (applied optimizer steps).
    """

    starts: tuple[float, ...]
    periods: tuple[int, ...]
    stop: float
    unit: str = "epoch"

    def __post_init__(self) -> None:
        if self.unit not in ("epoch", "update"):
            raise ValueError(f"RewireSchedule.unit={self.unit!r}: must be 'epoch' or 'update'")
        if not self.starts or len(self.starts) != len(self.periods):
            raise ValueError(
                f"RewireSchedule: starts {self.starts} and periods {self.periods} must be non-empty "
                "and of equal length"
            )
        if list(self.starts) != sorted(self.starts) or self.stop < self.starts[-1]:
            raise ValueError(f"RewireSchedule: starts {self.starts} must increase up to stop={self.stop}")
        if any(period < 1 for period in self.periods):
            raise ValueError(f"RewireSchedule.periods={self.periods}: every period must be >= 1 update")

    def period(self, step: int, epoch: float, freq_mult: float = 1.0) -> int | None:
        """Rewiring period (updates) at update ``step`` / ``epoch``; ``None`` = no rewiring here.

        A frequency multiplier k rewires every X/k updates instead of every X (rounded, at least 1).
        """
        position = epoch if self.unit == "epoch" else step
        if position >= self.stop or position < self.starts[0]:
            return None
        index = max(i for i, start in enumerate(self.starts) if start <= position)
        return max(1, math.floor(self.periods[index] / freq_mult + 0.5))


# WRN-28-2: epochs [0,25) every 100 updates, [25,80) 200, [80,140) 400, [140,190) 800, none after.
WRN_SCHEDULE = RewireSchedule(starts=(0, 25, 80, 140), periods=(100, 200, 400, 800), stop=190, unit="epoch")
# DynamicConv (50,000 updates): the same periods with every range halved in length.
DC_SCHEDULE = RewireSchedule(
    starts=(0, 6250, 20000, 35000), periods=(100, 200, 400, 800), stop=47500, unit="update"
)


def split_regrowth(
    total: int, survivors: Sequence[int], free: Sequence[int], generator: torch.Generator
) -> list[int]:
    """Split ``total`` new weights across layers in proportion to their ``survivors``.

    Each layer gets at most ``free[i]`` new weights. The rounding remainder goes to random layers
    (one random layer at a time, as much as it can take) until the total is exact or every layer is
    full, so the sum is ``min(total, sum(free))``.
    """
    surviving = sum(survivors)
    if total <= 0 or surviving <= 0:
        return [0] * len(survivors)
    quotas = [min(cap, round(total * count / surviving)) for count, cap in zip(survivors, free, strict=True)]
    remaining = total - sum(quotas)
    while remaining != 0:
        if remaining > 0:
            eligible = [i for i, cap in enumerate(free) if quotas[i] < cap]
        else:
            eligible = [i for i, quota in enumerate(quotas) if quota > 0]
        if not eligible:  # only when total exceeds all free slots
            break
        layer = eligible[int(torch.randint(len(eligible), (1,), generator=generator))]
        if remaining > 0:
            change = min(remaining, free[layer] - quotas[layer])
        else:
            change = -min(-remaining, quotas[layer])
        quotas[layer] += change
        remaining -= change
    return quotas


def sample_inactive(mask: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct flat indices drawn uniformly at random among the False entries of ``mask``.

    Positions are drawn one after another over the whole tensor, skipping active and already taken
    ones; this is a uniform sample without replacement that costs O(count) instead of O(numel) while
    inactive positions are plentiful. Random numbers come from the CPU ``generator``, so the result
    does not depend on the device. Raises if ``mask`` has fewer than ``count`` False entries.
    """
    flat = mask.view(-1)
    inactive = flat.numel() - int(flat.count_nonzero())
    if count > inactive:
        raise ValueError(f"cannot place {count} weights in {inactive} inactive positions")
    if 4 * count > inactive:  # rejection would redraw too often: enumerate the candidates instead
        candidates = flat.logical_not().nonzero().squeeze(1)
        return candidates[torch.randperm(inactive, generator=generator)[:count].to(flat.device)]
    batch = int(count * flat.numel() / inactive * 1.2) + 16  # expected draws, with some margin
    draws = torch.empty(0, dtype=torch.long)
    while True:
        draws = torch.cat((draws, torch.randint(flat.numel(), (batch,), generator=generator)))
        hits = draws.to(flat.device)
        hits = hits[flat[hits].logical_not()]
        # Keep the first occurrence of each position, in draw order.
        unique, inverse = torch.unique(hits, return_inverse=True)
        order = torch.arange(hits.numel(), device=hits.device)
        first = torch.full_like(unique, hits.numel()).scatter_reduce_(0, inverse, order, "amin")
        if unique.numel() >= count:
            return hits[first.sort().values[:count]]


def reset_optimizer_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, where: torch.Tensor) -> None:
    """Zero, at the positions ``where`` is True, every tensor of ``optimizer.state[param]`` shaped like
    ``param`` (SGD's momentum buffer, Adam's two moments, FP16 moments of custom optimizers)."""
    for value in optimizer.state.get(param, {}).values():
        if isinstance(value, torch.Tensor) and value.shape == param.shape:
            value.masked_fill_(where.to(value.device), 0)


class DynamicSparsity:
    """DSR over the weights ``weight_names`` of ``model``, all at the same ``density``.

    State: a bool mask per weight (``masks``), one global pruning threshold (``threshold``), the
    number of applied updates (``step_count``) and a seeded CPU generator, so that every
    data-parallel rank with the same seed draws the same masks.

    ``density`` is the fraction of active weights per layer (1.0 = dense: the masks are all True and
    rewiring never happens, since there would be no free position to regrow into). Attaching
    re-initialises the sparse weights He-normal (not rescaled for density) from that generator and
    zeroes the inactive ones. ``rewire_fraction · fraction_mult`` of all sparsifiable weights is the
    number N_p each rewiring aims to prune; ``freq_mult`` divides the schedule's periods.

    Order within one training step: backward (all microbatches) → ``mask_gradients`` → overflow
    check / unscale / clip → ``optimizer.step`` → ``after_optimizer_step`` (only if the step was
    applied). To resume, construct as usual, then ``load_state_dict`` (and the model's and the
    optimizer's state dicts, in any order).
    """

    def __init__(
        self,
        model: nn.Module,
        weight_names: Sequence[str],
        density: float,
        *,
        schedule: RewireSchedule,
        rewire_fraction: float = DEFAULT_REWIRE_FRACTION,
        fraction_mult: float = 1.0,
        freq_mult: float = 1.0,
        init_threshold: float = 1e-3,
        seed: int = 0,
    ) -> None:
        _check_positive("sparsity.density", density, "in (0, 1]", upper=1.0)
        _check_positive("sparsity.rewire_fraction", rewire_fraction, "in (0, 1]", upper=1.0)
        _check_positive("sparsity.rewire_fraction_mult", fraction_mult, "> 0")
        _check_positive("sparsity.rewire_freq_mult", freq_mult, "> 0")
        _check_positive("sparsity.init_threshold", init_threshold, "> 0")
        self.model = model
        self.schedule = schedule
        self.density = float(density)
        self.fraction_mult = float(fraction_mult)
        self.freq_mult = float(freq_mult)
        self.threshold = float(init_threshold)
        self.step_count = 0
        self._names = _resolve_weights(model, weight_names)
        self._generator = torch.Generator().manual_seed(seed)
        # N_p: how many weights each rewiring aims to prune.
        self.target_pruned = rewire_fraction * fraction_mult * self.numel()
        self.masks: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, weight in self._weights():
                self.masks[name] = self._random_mask(name, weight)
                self._he_normal_(weight)
        self.apply_masks()

    # ----------------------------------------------------------------------------------- queries
    def sparse_weight_names(self) -> list[str]:
        """Names of the sparse weights, in the order given."""
        return list(self._names)

    def numel(self) -> int:
        """Number of sparsifiable weights (active or not)."""
        return sum(self.model.get_parameter(name).numel() for name in self._names)

    def nonzero_count(self) -> int:
        """Number of active weights (mask True). Just-regrown weights are active but still 0."""
        return sum(int(mask.count_nonzero()) for mask in self.masks.values())

    def mask_checksum(self) -> int:
        """An exact fingerprint of the masks (sum of active flat positions, layer-weighted): data-parallel
        ranks compare it after every rewiring."""
        total = 0
        for layer, mask in enumerate(self.masks.values(), start=1):
            total += layer * int(mask.flatten().nonzero().sum())
        return total

    def layer_density(self) -> dict[str, float]:
        """Fraction of active weights per layer."""
        return {name: int(mask.count_nonzero()) / mask.numel() for name, mask in self.masks.items()}

    # ---------------------------------------------------------------------------------- masking
    @torch.no_grad()
    def apply_masks(self) -> None:
        """Set inactive weights to 0 (weights *= mask)."""
        # A multiply (several times faster than masked_fill on CPU) suffices: weights are finite, and
        # only gradients, masked with masked_fill, can hold NaN/inf.
        for name, weight in self._weights():
            weight.mul_(self._mask(name, weight))

    @torch.no_grad()
    def mask_gradients(self) -> None:
        """Zero gradients at inactive positions, in place (NaN/inf there vanish too).

        Call between backward and the optimizer step, before any overflow check, so a NaN at an
        inactive position cannot make a loss scaler skip the step.
        """
        for name, weight in self._weights():
            if weight.grad is not None:
                weight.grad.masked_fill_(self._mask(name, weight).logical_not(), 0)

    # --------------------------------------------------------------------------------- rewiring
    def after_optimizer_step(self, optimizer: torch.optim.Optimizer, epoch: float) -> dict | None:
        """Count one applied update, re-apply the masks and rewire if the schedule says so.

        Call once per *applied* optimizer step (never after a skipped one, never per microbatch),
        on every data-parallel rank. ``epoch`` is the epoch this update belongs to, fractional allowed
        (epoch index + batches done before it / batches per epoch); only "epoch" schedules read it,
        and it is not rescaled. Returns the rewiring diagnostics (see ``rewire``) or ``None``.
        """
        self.step_count += 1
        # Weight decay and momentum cannot revive inactive weights (their gradients and momentum
        # are 0), but re-masking costs little and holds even for optimizers that would.
        self.apply_masks()
        period = self.schedule.period(self.step_count, epoch, self.freq_mult)
        if period is None or self.step_count % period != 0 or self.density == 1.0:
            return None
        return self.rewire(optimizer)

    @torch.no_grad()
    def rewire(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """One DSR rewiring now, regardless of the schedule (SPEC §5 steps 1-4); ``optimizer`` is the
        one whose state gets reset (``None``: no optimizer yet).

        Returns ``{"rewire_step", "pruned" (K), "regrown", "target" (N_p), "threshold" (H used),
        "next_threshold", "density", "layer_density"}``.
        """
        names = list(self._names)
        weights = [weight for _, weight in self._weights()]
        masks = [self._mask(name, weight) for name, weight in zip(names, weights, strict=True)]
        # 1. Global magnitude prune. Compare in FP32 so FP16/BF16 weights meet the same threshold.
        prune = [
            mask & (weight.abs().float() < self.threshold)
            for weight, mask in zip(weights, masks, strict=True)
        ]
        counts = torch.stack(
            [torch.stack([m.count_nonzero() for m in masks]), torch.stack([p.count_nonzero() for p in prune])]
        )
        active, pruned = counts.tolist()  # one device sync for all counts
        for i, (weight, mask) in enumerate(zip(weights, masks, strict=True)):
            if active[i] > 0 and pruned[i] == active[i]:  # the layer would vanish: keep its largest weight
                prune[i].view(-1)[torch.where(mask, weight.abs().float(), -1.0).argmax()] = False
                pruned[i] -= 1
        total_pruned = sum(pruned)

        # 2. Regrow exactly K at random positions that were inactive *before* this rewiring, so a
        # just-pruned position cannot come straight back.
        quotas = split_regrowth(
            total_pruned,
            survivors=[a - p for a, p in zip(active, pruned, strict=True)],
            free=[weight.numel() - a for weight, a in zip(weights, active, strict=True)],
            generator=self._generator,
        )
        for name, weight, mask, pruned_here, quota in zip(names, weights, masks, prune, quotas, strict=True):
            survivors = mask & pruned_here.logical_not()
            new_mask = survivors.clone()
            if quota > 0:
                new_mask.view(-1)[sample_inactive(mask, quota, self._generator)] = True
            # New weights start at 0; 3. reset optimizer state wherever the weight is inactive or new.
            weight.mul_(survivors)
            if optimizer is not None:
                reset_optimizer_state(optimizer, weight, survivors.logical_not())
            self.masks[name] = new_mask

        # 4. Adapt H for the next rewiring only.
        used = self.threshold
        if total_pruned > (1 + THRESHOLD_TOLERANCE) * self.target_pruned:
            self.threshold /= THRESHOLD_SCALE
        elif total_pruned < (1 - THRESHOLD_TOLERANCE) * self.target_pruned:
            self.threshold *= THRESHOLD_SCALE
        return {
            "rewire_step": self.step_count,
            "pruned": total_pruned,
            "regrown": sum(quotas),
            "target": self.target_pruned,
            "threshold": used,
            "next_threshold": self.threshold,
            "density": self.nonzero_count() / self.numel(),
            "layer_density": self.layer_density(),
        }

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Masks (CPU bool tensors), threshold, update count and generator state; plain types only,
        so ``torch.load(..., weights_only=True)`` reads it back."""
        return {
            "masks": {name: mask.cpu() for name, mask in self.masks.items()},
            "threshold": self.threshold,
            "step_count": self.step_count,
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output and re-apply the masks to the current weights."""
        if set(state["masks"]) != set(self._names):
            raise ValueError(
                f"sparsity checkpoint holds masks for {sorted(state['masks'])}, "
                f"but this model's sparse weights are {sorted(self._names)}"
            )
        for name, weight in self._weights():
            mask = state["masks"][name]
            if mask.shape != weight.shape or mask.dtype != torch.bool:
                raise ValueError(
                    f"sparsity checkpoint: mask {name} is {mask.dtype} {tuple(mask.shape)}, "
                    f"expected torch.bool {tuple(weight.shape)}"
                )
            self.masks[name] = mask.to(weight.device)
        self.threshold = float(state["threshold"])
        self.step_count = int(state["step_count"])
        self._generator.set_state(state["generator"])
        self.apply_masks()

    # --------------------------------------------------------------------------------- helpers
    def _weights(self) -> list[tuple[str, nn.Parameter]]:
        # Looked up by name each time, so moving or casting the model after attaching is fine.
        return [(name, self.model.get_parameter(name)) for name in self._names]

    def _mask(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        mask = self.masks[name]
        if mask.device != weight.device:  # the model moved after attaching
            mask = self.masks[name] = mask.to(weight.device)
        return mask

    def _random_mask(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """A mask with exactly round(density · numel) True entries at uniformly random positions."""
        active = round(self.density * weight.numel())
        if active < 1:
            raise ValueError(
                f"sparsity.density={self.density} leaves {name} ({weight.numel()} weights) with no weight; "
                f"it needs a density of at least {0.5 / weight.numel():.2g}"
            )
        mask = torch.zeros(weight.numel(), dtype=torch.bool)
        mask[torch.randperm(weight.numel(), generator=self._generator)[:active]] = True
        return mask.view(weight.shape).to(weight.device)

    def _he_normal_(self, weight: torch.Tensor) -> None:
        """He-normal init: N(0, 2/fan_in), fan_in = elements per output row (ci·k1·k2 for a conv).

        Drawn from the seeded CPU generator (then cast), so every rank and device gets the same values.
        """
        std = math.sqrt(2.0 / weight[0].numel())
        weight.copy_(torch.randn(weight.shape, generator=self._generator) * std)


def _check_positive(knob: str, value: float, allowed: str, upper: float = math.inf) -> None:
    """Raise a ValueError naming ``knob`` unless 0 < value <= upper."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= upper:
        raise ValueError(f"{knob}={value!r}: must be {allowed}")


def _resolve_weights(model: nn.Module, weight_names: Sequence[str]) -> list[str]:
    """Check that ``weight_names`` names distinct weight matrices/kernels (>= 2 dims) of ``model``."""
    if isinstance(weight_names, str) or not weight_names:
        raise ValueError(
            f"sparsity: no sparse weights given for {type(model).__name__} "
            f"(the recipe's `sparsity` layer rule matched nothing): {weight_names!r}"
        )
    params = dict(model.named_parameters())
    missing = [name for name in weight_names if name not in params]
    if missing:
        raise ValueError(
            f"sparsity: the `sparsity` layer rule names {missing}, which {type(model).__name__} does not have"
        )
    if len(set(weight_names)) != len(weight_names):
        raise ValueError(f"sparsity: the `sparsity` layer rule names a weight twice: {list(weight_names)}")
    flat = [name for name in weight_names if params[name].dim() < 2]
    if flat:
        raise ValueError(f"sparsity: {flat} have < 2 dims; only weight matrices and kernels are sparsified")
    return list(weight_names)
