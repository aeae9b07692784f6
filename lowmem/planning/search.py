"""The search behind ``python -m lowmem.plan``: the best configuration whose accounted total fits.

Searched knobs (one fixed on the command line is searched over its value only):

- ``sparsity.density``: the report's values 1.0, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05;
- ``precision``: fp32, fp16 (accounted on fake tensors, which compute nothing: fp16's figures are
  bf16's bytes, and planning fp16 on a CPU costs no FP16 arithmetic);
- ``microbatch.size``: none, then every divisor of ``data.batch_size`` from half of it down to 2
  (WRN's 100: 50, 25, 20, 10, 5, 4, 2, with the report's 10 and 4) that the recipe can cut the
  first minibatch into (token microbatches must hold the longest sentence pair);
- checkpointing: none, no_bn, residual every 1 and 2, residual_star every 1 to 4 (those the model's
  blocks support), and ``optimal`` with the activation budget the density and precision leave.

Preference, in this order: the highest density (accuracy: the report's Tables 3 and 4 lose accuracy
as density falls), then the largest microbatch (speed: fewer, larger kernels), then the fewest FLOPs
(recomputation), then fp32 before fp16 (no loss-scale skips), then the smallest total.

Every figure is the report's accounting as ``lowmem.profile`` prints it for the first minibatch,
from trainers built by ``build_trainer`` like a run's. Model and optimizer bytes depend on density
and precision only: one trainer per pair (sparse weights counted as CSR). Activation bytes and
FLOPs depend on precision, microbatch and checkpointing only: one trainer per precision and
microbatch size, whose strategy is swapped between accountings (~0.2 s each for WRN-28-2 on fake
tensors); ``optimal`` reuses one ``CheckpointPlacement`` per such trainer, which measures the
blocks once and knows the smallest activations any schedule reaches there, so a microbatch size too
large for the budget costs one measurement, not one accounting per strategy. All of it is cached,
and the search runs in preference order and stops once ``plan.top`` configurations fit: planning
WRN-28-2 at batch 100 within 8 MB searches for ~9 s on two idle CPU cores (~25 s when they are
shared with other jobs).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import hydra
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from lowmem.config import ConfigError, compose
from lowmem.planning.optimal import AccountedSchedule, CheckpointPlacement
from lowmem.planning.reported import reported_metric
from lowmem.profiler import MB, StateBytes, account_state, profile_trainer
from lowmem.techniques.checkpointing import apply_checkpointing
from lowmem.trainer import Trainer, build_trainer

DENSITIES = (1.0, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05)  # the report's Table 3 / 4 and figure values
PRECISIONS = ("fp32", "fp16")  # preference order among equal FLOPs
FIXED_STRATEGIES = (
    ("none", 1), ("no_bn", 1), ("residual", 1), ("residual", 2),
    ("residual_star", 1), ("residual_star", 2), ("residual_star", 3), ("residual_star", 4),
)  # fmt: skip
# Command-line knobs the planner chooses; fixing one restricts the search to its value.
SEARCHED = ("sparsity.density", "precision", "microbatch.size", "checkpointing.strategy", "checkpointing.every")


@dataclass(frozen=True)
class Candidate:
    """One configuration and its accounting (bytes; FLOPs of one minibatch)."""

    density: float
    precision: str
    microbatch: int | None  # examples (vision) or tokens (translation); None: the whole minibatch
    strategy: str  # a checkpointing.strategy
    every: int | None  # residual strategies' checkpointing.every
    budget_bytes: int | None  # optimal: its checkpointing.budget_mb, in bytes
    model_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    flops: int
    schedule: str = ""  # optimal: the schedule chosen (lowmem.planning.schedule.describe)

    @property
    def total_bytes(self) -> int:
        return self.model_bytes + self.optimizer_bytes + self.activation_bytes

    @property
    def checkpointing(self) -> str:
        return f"{self.strategy}/{self.every}" if self.strategy in ("residual", "residual_star") else self.strategy

    def knobs(self) -> dict[str, str]:
        """Every searched knob's value as an override value."""
        knobs = {
            "sparsity.density": f"{self.density}",
            "precision": self.precision,
            "microbatch.size": "null" if self.microbatch is None else f"{self.microbatch}",
            "checkpointing.strategy": self.strategy,
        }
        if self.every is not None:
            knobs["checkpointing.every"] = f"{self.every}"
        if self.budget_bytes is not None:
            knobs["checkpointing.budget_mb"] = repr(self.budget_bytes / MB)  # round(x * MB) gives the bytes back
        return knobs


def compose_config(*overrides: str) -> DictConfig:
    """``lowmem.config.compose``, also from inside a running Hydra app (``lowmem.plan``'s CLI, where
    Hydra is initialized on lowmem's config directory already)."""
    if GlobalHydra.instance().is_initialized():
        return hydra.compose("config", overrides=list(overrides))
    return compose(*overrides)


def knob_of(override: str) -> str:
    """``+recipe=wrn_cifar`` -> ``recipe``; ``sparsity.density=0.3`` -> ``sparsity.density``."""
    return override.split("=", 1)[0].lstrip("+~")


class Planner:
    """The search for one recipe and budget (see the module docstring).

    overrides: the command line's overrides (``plan.*`` ones included, ignored); those of searched
        knobs restrict the search to their value.
    budget_bytes: the accounted total (model + optimizer + activations) to fit.
    """

    def __init__(
        self, overrides: Sequence[str], budget_bytes: int, build: Callable[[DictConfig], Trainer] | None = None
    ) -> None:
        self.build = build_trainer if build is None else build  # a trainer from a configuration
        given = [o for o in overrides if not knob_of(o).startswith(("hydra.", "plan."))]
        if any(knob_of(o) == "checkpointing.budget_mb" for o in given):
            raise ConfigError(
                "checkpointing.budget_mb is chosen by lowmem.plan (for checkpointing.strategy=optimal); "
                "set the budget with plan.budget_mb"
            )
        self.budget = budget_bytes
        self.fixed = {knob_of(o) for o in given if knob_of(o) in SEARCHED}
        self.base = [o for o in given if knob_of(o) not in SEARCHED]
        self.cfg = compose_config(*given)
        cfg = self.cfg
        self.densities = (cfg.sparsity.density,) if "sparsity.density" in self.fixed else DENSITIES
        self.precisions = (cfg.precision.name,) if "precision" in self.fixed else PRECISIONS
        batch = cfg.data.batch_size
        divisors = [size for size in range(batch // 2, 1, -1) if batch % size == 0]
        self.microbatches: tuple[int | None, ...] = (
            (cfg.microbatch.size,) if "microbatch.size" in self.fixed else (None, *divisors)
        )
        strategies: list[tuple[str, int | None]] = [*FIXED_STRATEGIES, ("optimal", None)]
        if "checkpointing.strategy" in self.fixed:
            strategies = [(s, e) for s, e in strategies if s == cfg.checkpointing.strategy]
        if "checkpointing.every" in self.fixed:
            strategies = [(s, cfg.checkpointing.every if e is not None else None) for s, e in strategies]
        self.strategies = tuple(dict.fromkeys(strategies))
        self._states: dict[tuple[float, str], StateBytes] = {}
        self._trainers: dict[tuple[str, int | None], Trainer | None] = {}
        self._placements: dict[tuple[str, int | None], CheckpointPlacement] = {}
        self._accounted: dict[tuple, tuple[int, int] | None] = {}

    # --- the search ----------------------------------------------------------------------------
    def search(self, top: int) -> list[Candidate]:
        """Up to ``top`` configurations that fit, best first (the preference order)."""
        found: list[Candidate] = []
        with _quiet_builds():
            for density in self.densities:
                # Per precision, the microbatch sizes worth accounting at this density.
                sizes = {precision: self._sizes_that_may_fit(density, precision) for precision in self.precisions}
                for microbatch in self.microbatches:
                    group = [
                        candidate
                        for precision in self.precisions
                        if microbatch in sizes[precision]
                        for candidate in self._fitting(density, precision, microbatch)
                    ]
                    group.sort(key=lambda c: (c.flops, self.precisions.index(c.precision), c.total_bytes))
                    found.extend(group)
                    if len(found) >= top:
                        return found[:top]
        return found

    def smallest(self) -> Candidate:
        """The configuration with the smallest accounted total in the searched space: the lowest
        density at the smallest microbatch (activations grow with it), at its smallest schedule."""
        density, smallest = min(self.densities), None
        with _quiet_builds():
            for precision in self.precisions:
                microbatch = self._valid_sizes(precision)[-1]
                state = self.state_bytes(density, precision)
                if self._optimal_allowed:
                    smallest_schedule = self._placement(precision, microbatch).smallest()
                    budget = smallest_schedule.activation_bytes
                    found = [self._optimal(density, precision, microbatch, state, smallest_schedule, budget)]
                else:
                    found = [self._fixed(density, precision, microbatch, s, e, state) for s, e in self.strategies]
                for candidate in found:
                    if candidate is not None and (smallest is None or candidate.total_bytes < smallest.total_bytes):
                        smallest = candidate
        if smallest is None:
            raise ConfigError("lowmem.plan: the fixed checkpointing.strategy does not run on this model's blocks")
        return smallest

    def overrides(self, candidate: Candidate) -> list[str]:
        """The overrides to add to the command line planned with (knobs it fixed are left out)."""
        return [f"{knob}={value}" for knob, value in candidate.knobs().items() if knob not in self.fixed]

    def compose(self, candidate: Candidate) -> DictConfig:
        """The configuration ``lowmem.train <command line> <overrides>`` runs for ``candidate``."""
        return compose_config(*self.base, *(f"{k}={v}" for k, v in candidate.knobs().items()))

    def reported(self, candidate: Candidate) -> tuple[str, float, float] | None:
        """The report's accuracy figure for ``candidate`` (``lowmem.planning.reported``)."""
        cfg = self.cfg
        if OmegaConf.is_missing(cfg, "recipe"):  # a loop of the user's own (lowmem.api.plan)
            return None
        return reported_metric(
            cfg.recipe, cfg.model, cfg.data.batch_size, candidate.density, candidate.microbatch, candidate.precision
        )

    @property
    def _optimal_allowed(self) -> bool:
        return any(strategy == "optimal" for strategy, _ in self.strategies)

    def _fitting(self, density: float, precision: str, microbatch: int | None) -> list[Candidate]:
        """The configurations at (density, precision, microbatch) whose total fits the budget."""
        state = self.state_bytes(density, precision)
        room = self.budget - state.model_bytes - state.optimizer_bytes  # for activations
        if room <= 0 or self._trainer_for(precision, microbatch) is None:
            return []
        # No schedule goes below optimal's smallest.
        if self._optimal_allowed and self._placement(precision, microbatch).smallest().activation_bytes > room:
            return []
        fitting = []
        for strategy, every in self.strategies:
            if strategy != "optimal":
                candidate = self._fixed(density, precision, microbatch, strategy, every, state)
                if candidate is not None and candidate.activation_bytes <= room:
                    fitting.append(candidate)
        if self._optimal_allowed:
            accounted = self._placement(precision, microbatch).cheapest(room)
            # A schedule that is one of the fixed patterns is listed under its simpler name only.
            if not any((c.activation_bytes, c.flops) == (accounted.activation_bytes, accounted.flops) for c in fitting):
                fitting.append(self._optimal(density, precision, microbatch, state, accounted, room))
        return fitting

    @staticmethod
    def _optimal(
        density: float, precision: str, microbatch: int | None, state: StateBytes, accounted: AccountedSchedule,
        budget: int,
    ) -> Candidate:  # fmt: skip
        """Optimal checkpointing within ``budget`` activation bytes, as ``accounted`` (its schedule)."""
        return Candidate(
            density, precision, microbatch, "optimal", None, budget, state.model_bytes, state.optimizer_bytes,
            accounted.activation_bytes, accounted.flops, str(accounted.plan),
        )  # fmt: skip

    def _fixed(
        self, density: float, precision: str, microbatch: int | None, strategy: str, every: int | None,
        state: StateBytes,
    ) -> Candidate | None:  # fmt: skip
        key = (precision, microbatch, strategy, every)
        if key not in self._accounted:
            trainer = self._trainer_for(precision, microbatch)
            try:
                apply_checkpointing(trainer.unwrapped_model, strategy, every)
            except ValueError:  # the blocks do not support it (no_bn / residual_star on any block)
                self._accounted[key] = None
            else:
                report = profile_trainer(trainer, measure=False)
                self._accounted[key] = (report.activation_bytes, report.flops)
        if self._accounted[key] is None:
            return None
        activation, flops = self._accounted[key]
        every = every if strategy in ("residual", "residual_star") else None
        return Candidate(
            density, precision, microbatch, strategy, every, None, state.model_bytes, state.optimizer_bytes,
            activation, flops,
        )  # fmt: skip

    def _valid_sizes(self, precision: str) -> tuple[int | None, ...]:
        """The searched microbatch sizes (largest first) the recipe can cut the first minibatch
        into: all but token microbatches smaller than its longest sentence pair, which are the
        smallest sizes (one that holds the longest pair, any larger one does)."""
        sizes = self.microbatches
        low, high = 1, len(sizes)  # sizes[:low] are valid (the first, possibly none, always is); sizes[high:] not
        while low < high:
            middle = (low + high) // 2
            if self._trainer_for(precision, sizes[middle]) is None:
                high = middle
            else:
                low = middle + 1
        return sizes[:low]

    def _sizes_that_may_fit(self, density: float, precision: str) -> tuple[int | None, ...]:
        """The valid microbatch sizes whose smallest schedule leaves the activations within what
        ``density`` and ``precision`` leave of the budget: a suffix of ``_valid_sizes``, as every
        activation grows with the microbatch, found by bisection (a few measurements, not one per
        size). Without optimal among the strategies, every valid size."""
        state = self.state_bytes(density, precision)
        room = self.budget - state.model_bytes - state.optimizer_bytes
        sizes = self._valid_sizes(precision)
        if room <= 0:
            return ()
        if not self._optimal_allowed:
            return sizes
        low, high = 0, len(sizes)  # sizes[high:] fit; sizes[:low] do not
        while low < high:
            middle = (low + high) // 2
            if self._placement(precision, sizes[middle]).smallest().activation_bytes <= room:
                high = middle
            else:
                low = middle + 1
        return sizes[low:]

    # --- cached builds -------------------------------------------------------------------------
    def _build(self, density: float, precision: str, microbatch: int | None) -> Trainer:
        size = "null" if microbatch is None else microbatch
        knobs = [f"sparsity.density={density}", f"precision={precision}", f"microbatch.size={size}"]
        return self.build(compose_config(*self.base, *knobs, "checkpointing.strategy=none"))

    def state_bytes(self, density: float, precision: str) -> StateBytes:
        """Model and optimizer bytes at ``density`` and ``precision`` (microbatching changes neither).

        Accounted on the precision's trainer without drawing masks: DSR keeps round(density ·
        numel) weights of every sparsifiable tensor (``lowmem.techniques.sparsity``), counted as
        CSR like ``DynamicSparsity.trained_parameters()`` has them (``tests/test_planning.py`` pins
        the equality with built sparse trainers); building one per density would cost ~1 s each.
        """
        key = (density, precision)
        if key not in self._states:
            trainer = self._trainer_for(precision, None)
            model = trainer.unwrapped_model
            if trainer.sparsity is not None:  # sparsity.density was fixed: that trainer's own masks
                sparse = trainer.sparsity.trained_parameters()
            elif density < 1.0:
                params = dict(model.named_parameters())
                names = trainer.recipe.sparsifiable_weights(model)
                sparse = {name: (params[name].shape, round(density * params[name].numel())) for name in names}
            else:
                sparse = None
            self._states[key] = account_state(model, trainer.optimizer, sparse)
        return self._states[key]

    def _trainer_for(self, precision: str, microbatch: int | None) -> Trainer | None:
        """The trainer whose activations stand for every density at (precision, microbatch); None
        when the recipe cannot cut the first minibatch into such microbatches."""
        key = (precision, microbatch)
        if key not in self._trainers:
            # Activations do not depend on density: the first searched one stands for all (dense,
            # unless sparsity.density was fixed).
            try:
                trainer = self._build(self.densities[0], precision, microbatch)
                trainer.microbatches(trainer.example_batch())
            except (ConfigError, ValueError):
                if microbatch is None:  # the command line's own configuration fails: the user's error
                    raise
                trainer = None  # only the microbatch size differs: token microbatches too small for a pair
            self._trainers[key] = trainer
        return self._trainers[key]

    def _placement(self, precision: str, microbatch: int | None) -> CheckpointPlacement:
        key = (precision, microbatch)
        if key not in self._placements:
            self._placements[key] = CheckpointPlacement(self._trainer_for(precision, microbatch))
        return self._placements[key]


@contextlib.contextmanager
def _quiet_builds() -> Iterator[None]:
    """The search builds dozens of trainers: their start-up lines are not the user's news."""
    logger = logging.getLogger("lowmem")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
