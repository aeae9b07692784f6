"""Dynamic sparse reparameterization (DSR; Mostafa & Wang 2019, with the report's changes; SPEC §5).

A "model converter": attach it to a model, then make one call after each *applied* optimizer step.
It needs no trainer::

    sparsity = DynamicSparsity(model, model.sparsifiable_weights(), density=0.3, schedule=WRN_SCHEDULE)
    for inputs, targets in batches:
        loss_fn(model(inputs), targets).backward()
        sparsity.mask_gradients()  # before any overflow check, unscaling or clipping
        optimizer.step()           # if the step is skipped (FP16 overflow), skip the next line too
        sparsity.after_optimizer_step(optimizer, epoch)

By default a sparse weight is stored compactly (its active values and their positions,
``lowmem.techniques.compact``), so the weights, their gradients and the optimizer state exist for
the active entries only. ``storage="masked"`` keeps the report's simulation instead: dense weights
holding exact zeros outside a bool mask, gradients masked, optimizer state reset wherever a weight
is inactive or has just been regrown. Either way the weights, their gradients and the optimizer
state share one sparsity pattern.

Stacked matrices (a mixture of experts' weights: a parameter of 3 or more dims whose leading dims
index its matrices, ``lowmem.techniques.compact.is_stacked_matrices``) start with the density in each
matrix, an exact count per expert; rewiring then treats the parameter as one layer, as it treats
every layer: its total moves with the global threshold and the regrowth split, and regrowth is
uniform over its free positions, so one expert's share may drift as one layer's share of the model
does. A frozen weight (``requires_grad=False``, named on purpose: ``lowmem.techniques.targets``
never picks one) keeps its largest entries, the density's share of each matrix, and is never
rewired: no gradient could regrow it.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lowmem.techniques.compact import CompactWeights, is_stacked_matrices, matrix_count, owner_of
from lowmem.techniques.shards import full, is_sharded, local, local_rows, moved_entries, write_full
from lowmem.techniques.targets import dense_weights, summarize_weights

log = logging.getLogger("lowmem")

# How sparse weights are stored (see DynamicSparsity) and how they are initialised.
STORAGES = ("compact", "masked")
INITS = ("he_normal", "model")
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
    ``param`` (SGD's momentum buffer, Adam's two moments, FP16 moments of custom optimizers).

    An optimizer whose state is not shaped like its parameters (lowmem's 8- and 4-bit state:
    codes and per-block scales) resets it itself: ``optimizer.reset_state(param, where)``."""
    if hasattr(optimizer, "reset_state"):
        optimizer.reset_state(param, where)
        return
    for value in optimizer.state.get(param, {}).values():
        if isinstance(value, torch.Tensor) and value.shape == param.shape:  # sharded: this rank's rows
            local(value).masked_fill_(local_rows(where.to(local(value).device), value), 0)


def remap_optimizer_state(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, kept_from: torch.Tensor, kept_to: torch.Tensor, size: int
) -> None:
    """Compact storage's rewiring: every state tensor of ``param`` shaped like it (1-D, its old active
    count) becomes a new tensor of ``size`` entries holding the old entries ``kept_from`` at
    ``kept_to`` and zeros elsewhere (regrown entries start with no momentum).

    An optimizer with state of another shape (8- and 4-bit state) moves it itself:
    ``optimizer.remap_state(param, kept_from, kept_to, size)``."""
    if hasattr(optimizer, "remap_state"):
        optimizer.remap_state(param, kept_from, kept_to, size)
        return
    state = optimizer.state.get(param, {})
    for key, value in list(state.items()):
        if isinstance(value, torch.Tensor) and value.shape == param.shape:
            moved = value.new_zeros(size)
            moved[kept_to] = value[kept_from]
            state[key] = moved


def remap_shared_optimizer_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, source: torch.Tensor) -> None:
    """Compact storage's rewiring of shared values (sharded training): every state tensor of ``param``
    shaped like it becomes, entry i, the old entry ``source[i]`` (zero where ``source`` is -1: the
    regrown). Sharded state is gathered, moved on every rank alike, and each rank keeps its rows.

    An optimizer with state of another shape (8- and 4-bit state) moves it itself:
    ``optimizer.remap_shared_state(param, source)``."""
    if hasattr(optimizer, "remap_shared_state"):
        optimizer.remap_shared_state(param, source)
        return
    for value in optimizer.state.get(param, {}).values():
        if isinstance(value, torch.Tensor) and value.shape == param.shape:
            write_full(value, moved_entries(full(value), source))


class DynamicSparsity:
    """DSR over the weights ``weight_names`` of ``model``, all at the same ``density``.

    State: which entries of each weight are active, one global pruning threshold (``threshold``), the
    number of applied updates (``step_count``) and a seeded CPU generator, so that every
    data-parallel rank with the same seed draws the same masks.

    ``storage`` says how a sparse weight is held:

    - ``"compact"`` (default): its active values and their positions only
      (``lowmem.techniques.compact``): the dense weight exists only while its layer computes (stacked
      matrices: from their module's forward to its backward), and gradients and optimizer state exist
      for the active entries only. The dense parameter
      ``<name>`` of the model becomes ``<name>_values`` (trained) and its positions,
      ``<name>_columns`` (int16) and ``<name>_row_starts``.
    - ``"masked"``: the report's simulation, a dense weight holding exact zeros outside a bool
      mask; gradients are masked after backward (``mask_gradients``).

    Both make the same random draws and, in exact arithmetic, train the same weights.

    ``density`` is the fraction of active weights per layer, and per matrix of stacked matrices (1.0 =
    dense: every entry is active and rewiring never happens, since there would be no free position to
    regrow into). ``init``:
    ``"he_normal"`` re-initialises the sparse weights He-normal (not rescaled for density) from the
    generator, the WRN rule of DSR; ``"model"`` keeps the model's own initialisation. Inactive
    entries are zero either way. ``rewire_fraction · fraction_mult`` of all sparsifiable weights is
    the number N_p each rewiring aims to prune; ``freq_mult`` divides the schedule's periods. Frozen
    weights (``requires_grad=False``) keep their values and largest entries, are never rewired and
    do not count in N_p; one warning names them.

    ``dense_weights``: the model's multiplying weights left dense, each with why
    (``lowmem.techniques.targets.dense_weights``), logged once at construction.

    Order within one training step: backward (all microbatches) → ``mask_gradients`` → overflow
    check / unscale / clip → ``optimizer.step`` → ``after_optimizer_step`` (only if the step was
    applied). Attach after the model's final precision cast (values are stored in the weights'
    dtype). To resume: construct as usual, ``load_state_dict``, then the model's and the
    optimizer's state dicts (compact storage: the model's last, it holds the positions).
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
        storage: str = "compact",
        init: str = "he_normal",
    ) -> None:
        _check_positive("sparsity.density", density, "in (0, 1]", upper=1.0)
        _check_positive("sparsity.rewire_fraction", rewire_fraction, "in (0, 1]", upper=1.0)
        _check_positive("sparsity.rewire_fraction_mult", fraction_mult, "> 0")
        _check_positive("sparsity.rewire_freq_mult", freq_mult, "> 0")
        _check_positive("sparsity.init_threshold", init_threshold, "> 0")
        if storage not in STORAGES:
            raise ValueError(f"sparsity.storage={storage!r} is unknown; allowed: {', '.join(STORAGES)}")
        if init not in INITS:
            raise ValueError(f"sparsity init={init!r} is unknown; allowed: {', '.join(INITS)}")
        self.model = model
        self.schedule = schedule
        self.storage = storage
        self.density = float(density)
        self.fraction_mult = float(fraction_mult)
        self.freq_mult = float(freq_mult)
        self.threshold = float(init_threshold)
        self.step_count = 0
        self._names = _resolve_weights(model, weight_names)
        self._shapes = {name: model.get_parameter(name).shape for name in self._names}
        self._stacked = {name for name in self._names if is_stacked_matrices(*owner_of(model, name))}
        self._frozen = {name for name in self._names if not model.get_parameter(name).requires_grad}
        self.dense_weights = dense_weights(model, self._names) if self.density < 1.0 else {}
        if self.dense_weights:
            log.info(
                "sparsity: %d multiplying weights stay dense: %s",
                len(self.dense_weights),
                summarize_weights(self.dense_weights),
            )
        if self._frozen:
            log.warning(
                "sparsity: frozen weights (requires_grad=False) are sparsified as named: %s; each keeps its "
                "largest entries (density %s) and is never rewired, since no gradient can regrow it",
                summarize_weights({name: "" for name in self._names if name in self._frozen}),
                self.density,
            )
        self._generator = torch.Generator().manual_seed(seed)
        # N_p: how many weights each rewiring aims to prune (frozen weights are never rewired).
        rewired = sum(math.prod(shape) for name, shape in self._shapes.items() if name not in self._frozen)
        self.target_pruned = rewire_fraction * fraction_mult * rewired
        masks: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name in self._names:
                weight = model.get_parameter(name)
                if name in self._frozen:
                    masks[name] = self._largest_mask(name, weight)
                else:
                    masks[name] = self._random_mask(name, weight)
                    if init == "he_normal":
                        self._he_normal_(name, weight)
                weight.mul_(masks[name])
        # Masked storage keeps the *inactive* masks: gradients are masked in place with no new tensor.
        self._inactive: dict[str, torch.Tensor] = {}
        self._whole: dict[str, torch.Tensor] = {}  # sharded masked weights, gathered for a rewiring
        self.compact: CompactWeights | None = None
        if storage == "compact":
            self.compact = CompactWeights(model, self._names, masks)
        else:
            self._inactive = {name: mask.logical_not() for name, mask in masks.items()}

    # ----------------------------------------------------------------------------------- queries
    def sparse_weight_names(self) -> list[str]:
        """Names of the sparse weights (as the dense model names them), in the order given."""
        return list(self._names)

    def numel(self) -> int:
        """Number of sparsifiable weights (active or not)."""
        return sum(math.prod(shape) for shape in self._shapes.values())

    @property
    def masks(self) -> dict[str, torch.Tensor]:
        """Active entries per weight, as new dense bool tensors (for inspection and tests: the
        training path never builds them)."""
        if self.compact is not None:
            with self.compact.gathered():  # sharded positions: a collective, on every rank
                return {name: self.compact.mask(name) for name in self._names}
        return {name: inactive.logical_not() for name, inactive in self._inactive.items()}

    def dense_weight(self, name: str) -> torch.Tensor:
        """Weight ``name`` as a dense tensor (compact storage: a new one)."""
        if self.compact is None:
            return self.model.get_parameter(name)
        with self.compact.gathered():  # sharded values: a collective, on every rank
            return self.compact.dense(name)

    def trained_parameters(self) -> dict[str, tuple[torch.Size, int]]:
        """The parameter that holds each sparse weight, by its name in ``model.named_parameters()``
        (``<name>_values`` in compact storage, ``<name>`` masked), with the weight's dense shape and
        its number of active entries: what the accounting counts as CSR. Stacked matrices have their
        matrices one under the other, [matrices · rows, columns]: each matrix is CSR of its own."""
        counts = self._active_counts()
        suffix = "_values" if self.compact is not None else ""
        return {
            name + suffix: (self._matrix_shape(name), count)
            for name, count in zip(self._names, counts, strict=True)
        }

    def _matrix_shape(self, name: str) -> torch.Size:
        shape = self._shapes[name]
        return torch.Size((math.prod(shape[:-1]), shape[-1])) if name in self._stacked else shape

    def nonzero_count(self) -> int:
        """Number of active weights. Just-regrown weights are active but still 0."""
        return sum(self._active_counts())

    def mask_checksum(self) -> int:
        """An exact fingerprint of the active positions (sum of active flat positions, layer-weighted):
        data-parallel ranks compare it after every rewiring (sharded positions are gathered: a
        collective, on every rank)."""
        with self.compact.gathered() if self.compact is not None else contextlib.nullcontext():
            sums = [self._active_positions(name).sum() * layer for layer, name in enumerate(self._names, start=1)]
        return int(torch.stack(sums).sum())

    def layer_density(self) -> dict[str, float]:
        """Fraction of active weights per layer."""
        return {
            name: count / math.prod(self._shapes[name])
            for name, count in zip(self._names, self._active_counts(), strict=True)
        }

    # ---------------------------------------------------------------------------------- masking
    @torch.no_grad()
    def mask_gradients(self) -> None:
        """Masked storage: zero gradients at inactive positions, in place (NaN/inf there vanish too).
        Compact storage has no inactive positions: nothing to do.

        Call between backward and the optimizer step, before any overflow check, so a NaN at an
        inactive position cannot make a loss scaler skip the step.
        """
        for name in self._inactive:
            weight = self.model.get_parameter(name)
            if weight.grad is not None:  # sharded: this rank's rows
                local(weight.grad).masked_fill_(local_rows(self._on_device(name, weight), weight.grad), 0)

    # --------------------------------------------------------------------------------- rewiring
    def after_optimizer_step(self, optimizer: torch.optim.Optimizer, epoch: float) -> dict | None:
        """Count one applied update and rewire if the schedule says so.

        Call once per *applied* optimizer step (never after a skipped one, never per microbatch),
        on every data-parallel rank. ``epoch`` is the epoch this update belongs to, fractional allowed
        (epoch index + batches done before it / batches per epoch); only "epoch" schedules read it,
        and it is not rescaled. Returns the rewiring diagnostics (see ``rewire``) or ``None``.

        Nothing is re-masked: an inactive weight has a zero gradient and zero optimizer state, so
        SGD and Adam (weight decay included) leave it exactly zero.
        """
        self.step_count += 1
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

        Compact values sharded across ranks (``CompactWeights.share_values``): every rank gathers
        every value, takes the same decisions from the same generator, and keeps its rows of the new
        layout (the optimizer state is moved likewise): the masks of one process, on every rank.
        """
        if self.compact is not None:
            with self.compact.gathered():
                return self._rewire(optimizer)
        with self._gathered_weights():
            return self._rewire(optimizer)

    @contextlib.contextmanager
    def _gathered_weights(self) -> Iterator[None]:
        """Masked storage sharded across ranks (FSDP2): inside, ``_weight`` gives every sparse weight
        whole (gathered: a collective, entered on every rank), so every rank takes the one-process
        decisions; what is written there is kept (each rank copies back the rows it holds)."""
        sharded = [name for name in self._names if is_sharded(self.model.get_parameter(name))]
        self._whole = {name: full(self.model.get_parameter(name).detach()).clone() for name in sharded}
        try:
            yield
            for name, whole in self._whole.items():
                write_full(self.model.get_parameter(name).detach(), whole)
        finally:
            self._whole = {}

    def _weight(self, name: str) -> torch.Tensor:
        """Masked storage: sparse weight ``name`` (whole while ``_gathered_weights`` holds it)."""
        whole = self._whole.get(name)
        return whole if whole is not None else self.model.get_parameter(name)

    def _rewire(self, optimizer: torch.optim.Optimizer | None) -> dict:
        # The active values per weight, in increasing order of flat position (their positions are
        # built per weight where needed, not for all weights at once).
        actives = [self._active_values(name) for name in self._names]
        # 1. Global magnitude prune. Compare in FP32 so FP16/BF16 weights meet the same threshold.
        keep = [values.abs().float() >= self.threshold for values in actives]
        pruned = torch.stack([k.logical_not().sum() for k in keep]).tolist()  # one device sync for all
        active = [len(values) for values in actives]
        for i, (name, values) in enumerate(zip(self._names, actives, strict=True)):
            if name in self._frozen:  # never rewired: no gradient could regrow it
                keep[i].fill_(True)
                pruned[i] = 0
            elif active[i] > 0 and pruned[i] == active[i]:  # the layer would vanish: keep its largest weight
                keep[i][values.abs().float().argmax()] = True
                pruned[i] -= 1
        total_pruned = sum(pruned)

        # 2. Regrow exactly K at random positions that were inactive *before* this rewiring, so a
        # just-pruned position cannot come straight back.
        quotas = split_regrowth(
            total_pruned,
            survivors=[a - p for a, p in zip(active, pruned, strict=True)],
            free=[
                0 if name in self._frozen else math.prod(self._shapes[name]) - a
                for name, a in zip(self._names, active, strict=True)
            ],
            generator=self._generator,
        )
        regrown = []
        for name, values, quota in zip(self._names, actives, quotas, strict=True):
            if quota > 0:
                regrown.append(sample_inactive(self._dense_mask(name), quota, self._generator))
            else:
                regrown.append(torch.empty(0, dtype=torch.long, device=values.device))
        # New weights start at 0; 3. optimizer state is reset wherever the weight is inactive or new.
        if self.compact is not None:
            self._commit_compact(actives, keep, regrown, optimizer)
        else:
            self._commit_masked(actives, keep, regrown, optimizer)

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

    def _commit_masked(self, actives, keep, regrown, optimizer) -> None:
        for name, kept, new in zip(self._names, keep, regrown, strict=True):
            weight = self._weight(name)
            inactive = self._on_device(name, weight)
            pruned_here = self._active_positions(name)[kept.logical_not()]
            inactive.view(-1)[pruned_here] = True  # now: inactive after pruning, before regrowth
            weight.view(-1)[pruned_here] = 0
            if optimizer is not None:  # inactive and (still) the regrown; sharded: each rank its rows
                reset_optimizer_state(optimizer, self.model.get_parameter(name), inactive)
            inactive.view(-1)[new] = False

    def _commit_compact(self, actives, keep, regrown, optimizer) -> None:
        layers = {}
        shared = self.compact.shared is not None
        # Shared values: where each entry of the new flat layout comes from in the old (-1: regrown).
        sources, old_start = [], 0
        for name, values, kept, new in zip(self._names, actives, keep, regrown, strict=True):
            kept_from = kept.nonzero().squeeze(1)
            merged, order = torch.cat([self.compact.positions(name)[kept_from], new.long()]).sort()
            # Held for every weight until the relayout: int32 where the weight allows.
            narrow = merged.int() if math.prod(self._shapes[name]) <= torch.iinfo(torch.int32).max else merged
            layers[name] = (narrow, torch.cat([values[kept_from], values.new_zeros(len(new))])[order])
            if shared:
                source = torch.full_like(order, -1)
                is_kept = order < len(kept_from)
                source[is_kept] = old_start + kept_from[order[is_kept]]
                sources.append(source)
                old_start += len(values)
            elif optimizer is not None:
                where = torch.empty_like(order)
                where[order] = torch.arange(len(order), device=order.device)
                param = self.compact.values_of(name)
                remap_optimizer_state(optimizer, param, kept_from, where[: len(kept_from)], len(order))
        if shared:
            unused = self.compact.capacity - sum(len(source) for source in sources)
            source = torch.cat([*sources, sources[0].new_full((unused,), -1)])
            if optimizer is not None:
                remap_shared_optimizer_state(optimizer, self.compact.shared_values, source)
            self.compact.shared_values.grad = None  # the step's gradient belongs to the old layout
            self.compact.relayout(layers)
            return
        self.compact.relayout(layers)
        for name in self._names:  # the step's gradients belong to the old layout
            self.compact.values_of(name).grad = None

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Storage, which entries are active (masked: the masks as CPU bool tensors; compact: the
        count per weight, the positions being in the model's state dict), threshold, update count and
        generator state; plain types only, so ``torch.load(..., weights_only=True)`` reads it back."""
        state = {
            "storage": self.storage,
            "threshold": self.threshold,
            "step_count": self.step_count,
            "generator": self._generator.get_state(),
        }
        if self.compact is not None:
            state["counts"] = dict(zip(self._names, self.compact.counts, strict=True))
        else:
            state["masks"] = {name: inactive.logical_not().cpu() for name, inactive in self._inactive.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output. Compact storage: this lays the weights out for the saved
        active counts; load the model's state dict afterwards (it holds the values and positions).

        A layout that already has the saved counts is left as it is, so the model's state dict loads
        into the very buffers it may view: ``state_dict()`` returns views of the live tensors (torch's
        convention), and loading a run's own state must not clear them first."""
        storage = state.get("storage", "masked")
        if storage != self.storage:
            raise ValueError(f"sparsity checkpoint uses sparsity.storage={storage}; this run uses {self.storage}")
        saved = state["counts"] if storage == "compact" else state["masks"]
        if set(saved) != set(self._names):
            raise ValueError(
                f"sparsity checkpoint holds weights {sorted(saved)}, "
                f"but this model's sparse weights are {sorted(self._names)}"
            )
        if self.compact is not None:
            total = sum(int(count) for count in saved.values())
            if total != self.compact.capacity:
                raise ValueError(
                    f"sparsity checkpoint holds {total:,} active weights, this model holds {self.compact.capacity:,} "
                    f"(sparsity.density={self.density}): resume with the checkpoint's sparsity.density"
                )
            counts = [int(saved[name]) for name in self._names]
            if counts != self.compact.counts:  # placeholders of the saved sizes, filled by the model's load
                positions = self.compact.row_starts.new_zeros((), dtype=torch.int32)
                with self.compact.gathered():  # shared (sharded) values: every value, on every rank
                    self.compact.relayout(
                        {
                            name: (positions.expand(count), self.compact.values.new_zeros(count))
                            for name, count in zip(self._names, counts, strict=True)
                        }
                    )
        else:
            for name in self._names:
                mask = saved[name]
                if mask.shape != self._shapes[name] or mask.dtype != torch.bool:
                    raise ValueError(
                        f"sparsity checkpoint: mask {name} is {mask.dtype} {tuple(mask.shape)}, "
                        f"expected torch.bool {tuple(self._shapes[name])}"
                    )
                weight = self.model.get_parameter(name)
                self._inactive[name] = mask.logical_not().to(weight.device)
                with torch.no_grad():
                    weight.masked_fill_(self._inactive[name], 0)
        self.threshold = float(state["threshold"])
        self.step_count = int(state["step_count"])
        self._generator.set_state(state["generator"].cpu())  # a CPU generator: a CPU byte tensor

    # --------------------------------------------------------------------------------- helpers
    def _active_values(self, name: str) -> torch.Tensor:
        """The values of the active entries of weight ``name``, in increasing order of flat position."""
        if self.compact is not None:
            return self.compact.values_of(name).detach()
        weight = self._weight(name)
        return weight.detach().view(-1)[self._on_device(name, weight).view(-1).logical_not()]

    def _active_positions(self, name: str) -> torch.Tensor:
        """The flat positions (increasing, int64) of the active entries of weight ``name``: a new tensor."""
        if self.compact is not None:
            return self.compact.positions(name)
        weight = self._weight(name)
        return self._on_device(name, weight).view(-1).logical_not().nonzero().squeeze(1)

    def _active_counts(self) -> list[int]:
        if self.compact is not None:
            return list(self.compact.counts)
        sizes = torch.stack([inactive.logical_not().sum() for inactive in self._inactive.values()])
        return sizes.tolist()

    def _dense_mask(self, name: str) -> torch.Tensor:
        """A dense bool of the active entries (masked storage: built from its inactive mask)."""
        if self.compact is not None:
            return self.compact.mask(name)
        return self._inactive[name].logical_not()

    def _on_device(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        inactive = self._inactive[name]
        if inactive.device != weight.device:  # the model moved after attaching
            inactive = self._inactive[name] = inactive.to(weight.device)
        return inactive

    def _random_mask(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """A mask with exactly round(density · numel) True entries at uniformly random positions; of
        stacked matrices, that many in each matrix."""
        matrices, size = self._matrices(name, weight)
        active = self._active_count(name, size)
        mask = torch.zeros(matrices, size, dtype=torch.bool)
        for matrix in mask:
            matrix[torch.randperm(size, generator=self._generator)[:active]] = True
        return mask.view(weight.shape).to(weight.device)

    def _largest_mask(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """A frozen weight's mask: its round(density · numel) largest entries by magnitude (of stacked
        matrices, in each matrix); ties go to the first positions."""
        matrices, size = self._matrices(name, weight)
        order = weight.detach().float().abs().reshape(matrices, size).argsort(dim=1, descending=True, stable=True)
        mask = torch.zeros(matrices, size, dtype=torch.bool, device=weight.device)
        return mask.scatter_(1, order[:, : self._active_count(name, size)], True).view(weight.shape)

    def _matrices(self, name: str, weight: torch.Tensor) -> tuple[int, int]:
        """How many matrices the weight ``name`` holds (stacked matrices: many; any other: one), and the
        entries of each."""
        matrices = matrix_count(weight.shape) if name in self._stacked else 1
        return matrices, weight.numel() // matrices

    def _active_count(self, name: str, size: int) -> int:
        """round(density · size) active entries of ``size`` (a weight's, or one of its matrices'), at least 1."""
        active = round(self.density * size)
        if active < 1:
            what = "each matrix of " if name in self._stacked else ""
            raise ValueError(
                f"sparsity.density={self.density} leaves {what}{name} ({size} weights) with no weight; "
                f"it needs a density of at least {0.5 / size:.2g}"
            )
        return active

    def _he_normal_(self, name: str, weight: torch.Tensor) -> None:
        """He-normal init: N(0, 2/fan_in), fan_in = elements per output row (ci·k1·k2 for a conv; a
        stacked matrix's columns).

        Drawn in FP32 from the seeded CPU generator (then cast), so every rank, device and precision
        gets the same values.
        """
        fan_in = weight.shape[-1] if name in self._stacked else weight[0].numel()
        std = math.sqrt(2.0 / fan_in)
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
