"""``checkpointing.strategy=optimal checkpointing.budget_mb=X``: checkpoints placed under a budget.

``apply_optimal_checkpointing(trainer, budget_mb)`` makes the trainer's model run the schedule with
the fewest FLOPs whose accounted activations (the report's definition, as ``lowmem.profile``
prints them for the first minibatch) are at most ``budget_mb``:

1. the per-block figures are measured on fake tensors (``lowmem.planning.measure``, ~1 s; on real
   tensors for a model fake tensors cannot run, a mixture of experts);
2. the schedule with the smallest modelled peak is applied and accounted for real
   (``profile_trainer``): above the budget, no schedule fits and a ConfigError names
   ``checkpointing.budget_mb`` with that smallest reachable figure;
3. the DP's cheapest schedule within the budget less the model's error on the schedule accounted
   last is applied and accounted; the next target moves by that schedule's error (down when it
   was over budget, up when it left room), until the DP repeats a schedule or
   ``MAX_ACCOUNTINGS`` are spent. The cheapest schedule whose *real* accounting fits is kept, so
   the promise holds for the real figure, not only the model's (on WRN-28-2 the model is exact
   and one schedule is accounted after the smallest; where it is not, e.g. a decoder whose blocks
   all save the encoder's output, this is what corrects it).

Deterministic: the same configuration and minibatch give the same schedule, so ``lowmem.plan``'s
figures are those a run of its overrides gets.

Every accounting here is ``profile_trainer``'s (``MinibatchAccounting``): activations are the most
any distinct microbatch shape of the minibatch reaches, FLOPs the minibatch's. Accounted one shape
at a time, largest first, a schedule can be ruled out for a budget after its first shapes only
(``CheckpointPlacement.reaches``: how ``lowmem.plan`` rules out microbatch sizes).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from lowmem import distributed
from lowmem.config import ConfigError
from lowmem.planning.measure import FakePasses, OutsidePass, measure_chain, measured, outside_pass
from lowmem.planning.schedule import ChainCosts, Plan, cheapest_plan, describe, exposed_transfer, smallest_plan
from lowmem.profiler import MB
from lowmem.profiler.report import live_bytes, replayed_activations
from lowmem.profiler.step import distinct_microbatches
from lowmem.techniques.chains import ensure_chains
from lowmem.techniques.checkpointing import Segment, apply_schedule

log = logging.getLogger("lowmem")
MAX_ACCOUNTINGS = 6  # schedules accounted per budget, after the smallest one
# A placement whose figures stand for the next trainer's (``reusing_placement``): lowmem.plan's own.
_REUSED: ContextVar[CheckpointPlacement | None] = ContextVar("lowmem_reused_placement", default=None)


@dataclass(frozen=True)
class Accounted:
    """Activation bytes (the most of any microbatch; with CUDA graph replay, the graph pool's replayed
    shape plus the largest eager shape on top, as ``profile_step``'s ``total_with_graph_pool_bytes``)
    and FLOPs (of those accounted) of a minibatch; not ``complete``: only its first microbatch shapes
    are accounted, and the bytes exceed the bound asked for (a lower bound of the complete figure)."""

    activation_bytes: int
    flops: int
    complete: bool
    # The most bytes the passes' own tensors held at once (``ActivationTrace.live_bytes``: every
    # temporary at its moment too; in a step of several microbatches, weight gradients until added to
    # the previous ones'), of the shapes accounted; and without those weight gradients.
    live_bytes: int = 0
    live_without_gradients_bytes: int = 0

    @property
    def beyond_bytes(self) -> int:
        """What a real step holds beyond the report's activations: the ``pass_temporaries`` of
        ``lowmem.profiler.profile_step``."""
        return max(0, self.live_bytes - self.activation_bytes)

    def beyond_bytes_at(self, density: float) -> int:
        """``beyond_bytes`` of the same step with its sparsifiable weights at ``density``: the weight
        gradients being accumulated scale with it (those of compact weights hold their active
        entries only), interpolated from the dense model's passes (the most of a sum over moments
        is convex in the density: the interpolation bounds it)."""
        gradients = self.live_bytes - self.live_without_gradients_bytes
        return max(0, self.live_without_gradients_bytes + round(density * gradients) - self.activation_bytes)


class MinibatchAccounting:
    """``profile_trainer``'s accounting of a trainer's first minibatch (activation bytes and FLOPs,
    no state bytes) under any number of checkpoint schedules, one distinct microbatch shape at a
    time and cached per schedule: a schedule whose largest microbatch already exceeds a bound is
    known not to fit without accounting the others (translation's token microbatches come in
    several shapes, each a fake pass through the whole model)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        parts = distinct_microbatches(trainer, trainer.example_batch())
        # Largest first: the likeliest to exceed a bound.
        self.parts = sorted(parts, key=lambda entry: -_numel(entry[0]))
        # With CUDA graph replay the shape a step starts with is replayed from the graphs' pool, held
        # for the run; the other shapes run eagerly on top of it (``profile_trainer`` alike).
        self.replayed = (
            next(i for i, entry in enumerate(self.parts) if entry is parts[0])
            if parts and getattr(trainer, "replays_microbatches", False)
            else None
        )
        # A step of several microbatches adds each weight gradient into the previous ones' sum.
        self.accumulating = sum(count for _, _, count in parts) > 1
        # Per schedule, per shape: activation bytes, FLOPs x count, live bytes (``live_accumulating_bytes``
        # when accumulating), live bytes without the weight gradients being accumulated.
        self._figures: dict[Hashable, list[tuple[int, int, int, int]]] = {}

    def account(self, key: Hashable, apply: Callable[[], object], above: int | None = None) -> Accounted:
        """The accounting of the schedule ``key`` that ``apply()`` makes the model run; with ``above``,
        it may stop at the first shape whose activations exceed ``above`` bytes."""
        figures = self._figures.setdefault(key, [])
        if len(figures) < len(self.parts) and (above is None or max((f[0] for f in figures), default=0) <= above):
            apply()
            trainer = self.trainer
            trainer.model.train()

            def account() -> None:
                with _own_random_streams(trainer), FakePasses(trainer.unwrapped_model) as passes:
                    for part, weight, count in self.parts[len(figures) :]:
                        step = functools.partial(trainer.microbatch_backward, weight=weight, local=True)
                        trace = passes.account(step, part)
                        model = trainer.unwrapped_model
                        live = live_bytes(trace, model, self.accumulating)
                        first = live_bytes(trace, model, False)  # no earlier microbatch's gradients to add to
                        figures.append((trace.activation_bytes, trace.flops * count, live, first))
                        if above is not None and trace.activation_bytes > above:
                            break

            measured(account)  # on real tensors where a fake pass cannot run (a mixture of experts)
        complete = len(figures) == len(self.parts)
        activations = max(f[0] for f in figures)
        if complete and self.replayed is not None:
            pool, eager = replayed_activations([(f[0], i == self.replayed) for i, f in enumerate(figures)])
            activations = pool + eager
        flops = sum(f[1] for f in figures)
        return Accounted(activations, flops, complete, max(f[2] for f in figures), max(f[3] for f in figures))

    def found(self) -> dict[Hashable, list[tuple[int, int, int, int]]]:
        """The per-shape figures accounted so far, per schedule (plain data, for ``merge``)."""
        return {key: list(figures) for key, figures in self._figures.items()}

    def merge(self, found: dict[Hashable, list[tuple[int, int, int, int]]]) -> None:
        """Take figures another process accounted for this trainer's configuration (shapes come
        largest first everywhere: a longer list extends a shorter one)."""
        for key, figures in found.items():
            if len(figures) > len(self._figures.get(key, ())):
                self._figures[key] = list(figures)


def _numel(part: Any) -> int:
    """Elements in a microbatch's tensors: the order, largest first, in which shapes are accounted."""
    return sum(t.numel() for t in tree_leaves(part) if isinstance(t, torch.Tensor))


def _own_random_streams(trainer: Any) -> Any:
    """Fake passes only, but no generator of the run may move because of them."""
    device = trainer.device
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


@dataclass(frozen=True)
class OptimalCheckpointing:
    """The schedule applied and its real accounting (one minibatch; bytes, FLOPs)."""

    schedules: tuple[tuple[Segment, ...], ...]  # per residual stack, residual_stacks order
    description: str  # the schedule per stack in forward order (``describe``)
    activation_bytes: int  # accounted, as lowmem.profile reports it
    flops: int
    smallest_bytes: int  # the smallest accounted activations any schedule reached
    accountings: int  # real accountings spent (the smallest schedule's included)


@dataclass(frozen=True)
class AccountedSchedule:
    """A schedule (with its modelled figures) and its real accounting: bytes, FLOPs; ``exposed``: the
    modelled FLOP-equivalents of its offloaded blocks' transfers (``schedule.exposed_transfer``),
    which a real accounting's FLOPs do not count."""

    plan: Plan
    activation_bytes: int
    flops: int
    exposed: int = 0
    live_bytes: int = 0  # ``Accounted.live_bytes``
    live_without_gradients_bytes: int = 0

    @property
    def beyond_bytes(self) -> int:
        """What a real step holds beyond the report's activations (``Accounted.beyond_bytes``)."""
        return max(0, self.live_bytes - self.activation_bytes)

    def beyond_bytes_at(self, density: float) -> int:
        """``Accounted.beyond_bytes_at``."""
        return Accounted(self.activation_bytes, self.flops, True, self.live_bytes,
                         self.live_without_gradients_bytes).beyond_bytes_at(density)  # fmt: skip


class BudgetTooSmall(ConfigError):
    """No schedule's accounted activations fit ``checkpointing.budget_mb``."""

    def __init__(self, budget_bytes: int, smallest: AccountedSchedule) -> None:
        self.smallest_bytes = smallest.activation_bytes
        super().__init__(
            f"checkpointing.budget_mb={budget_bytes / MB:g} is below what any checkpoint placement reaches "
            f"for this configuration: the smallest reachable is {smallest.activation_bytes / MB:.6f} MB of "
            f"accounted activations ({smallest.plan}); allowed: checkpointing.budget_mb >= "
            f"{smallest.activation_bytes / MB:.6f} (or a smaller microbatch.size, or 16-bit precision)"
        )


class CheckpointPlacement:
    """Schedules for one trainer's model, accounted for real on its first minibatch (cached).

    trainer: a ``lowmem.trainer.Trainer`` over the model to checkpoint (see ``measure_chain``);
    its model runs whichever schedule was accounted or applied last.
    widths: the widths a stored block may be compressed at (``checkpointing.compress`` and wider;
    the model has compression hooks installed), none: blocks are kept or recomputed.
    offload: the host link's price in FLOPs per byte when a stored block may be offloaded (the model
    has offload hooks installed that offload where a schedule says), None: it may not.
    """

    def __init__(self, trainer: Any, widths: Sequence[int] = (), offload: float | None = None) -> None:
        self.trainer = trainer
        self.widths = tuple(widths)
        self.offload = offload
        self._costs: ChainCosts | None = None
        self._accounted: dict[str, AccountedSchedule] = {}
        self._smallest: AccountedSchedule | None = None
        self._smallest_plan: Plan | None = None
        self._accounting: MinibatchAccounting | None = None
        self._parts: list[tuple[Any, float, int]] | None = None  # distinct microbatches (measure_chain's order)
        self._outside: dict[int, OutsidePass] = {}  # per index in _parts: its outside pass

    def moved_to(self, trainer: Any) -> CheckpointPlacement:
        """This placement's figures standing for ``trainer`` (the same configuration but for the
        density, which changes no activation), whose model it then applies schedules to."""
        placement = CheckpointPlacement(trainer, self.widths, self.offload)
        placement.merge({**self.found(), "figures": None})  # per-shape figures stay with their trainer
        return placement

    def found(self) -> dict[str, Any]:
        """What this placement measured and accounted so far (plain data, for ``merge``)."""
        return {
            "costs": self._costs,
            "accounted": dict(self._accounted),
            "smallest": self._smallest,
            "smallest_plan": self._smallest_plan,
            "outside": dict(self._outside),
            "figures": None if self._accounting is None else self._accounting.found(),
        }

    def merge(self, found: dict[str, Any]) -> None:
        """Take what another process's placement for this configuration found (``found``): the
        figures are deterministic, so this only saves measuring them here."""
        self._costs = self._costs or found["costs"]
        self._smallest_plan = self._smallest_plan or found["smallest_plan"]
        self._smallest = self._smallest or found["smallest"]
        self._accounted = {**found["accounted"], **self._accounted}
        for index, outside in found["outside"].items():
            self._outside.setdefault(index, outside)
        if found["figures"]:
            if self._accounting is None:
                self._accounting = MinibatchAccounting(self.trainer)
            self._accounting.merge(found["figures"])

    @property
    def costs(self) -> ChainCosts:
        """The per-block figures (measured on first use, ~1 s for WRN-28-2). The FLOPs outside the
        stacks are not measured (the same for every schedule: the plans' ``flops`` leave them out;
        every schedule chosen is accounted for real)."""
        if self._costs is None:
            with _own_random_streams(self.trainer):
                outside = [self._outside.get(index) for index in range(len(self._distinct()))]
                self._costs = measure_chain(
                    self.trainer, outside_flops=False, outside=outside, widths=self.widths, offload=self.offload
                )
        return self._costs

    def _distinct(self) -> list[tuple[Any, float, int]]:
        if self._parts is None:
            self._parts = distinct_microbatches(self.trainer, self.trainer.example_batch())
        return self._parts

    def below_floor(self, budget: int) -> bool:
        """Whether ``budget`` bytes are below what the model holds outside its stacks alone at some
        microbatch shape (``lowmem.planning.measure.OutsidePass``, a lower bound of every schedule's
        accounting): then no schedule fits. One fake pass per shape, largest first, up to the first
        that tells, without measuring the blocks (a sixth of the work on DynamicConv, where the
        logits and loss outside the stacks make the bound tight); ``costs`` reuses the passes."""
        if self._costs is not None:
            return self._costs.outside_peak > budget
        parts = self._distinct()
        largest_first = sorted(range(len(parts)), key=lambda index: -_numel(parts[index][0]))
        for index in largest_first:
            if index not in self._outside:
                part, weight, _ = parts[index]
                with _own_random_streams(self.trainer):
                    self._outside[index] = outside_pass(self.trainer, part, weight)
            if self._outside[index].activation_bytes > budget:
                return True
        return False

    def largest_op(self) -> int:
        """The largest forward op's new outputs at any of the minibatch's shapes (bytes: a temporary
        every schedule holds beside its activations, a lower bound of what a built configuration
        holds beyond them), read off the outside passes, run here for the shapes not run yet
        (``costs`` takes them)."""
        for index, (part, weight, _) in enumerate(self._distinct()):
            if index not in self._outside:
                with _own_random_streams(self.trainer):
                    self._outside[index] = outside_pass(self.trainer, part, weight)
        return max(outside.largest_op_bytes for outside in self._outside.values())

    @property
    def accountings(self) -> int:
        """Real accountings run so far (~0.3 s each for WRN-28-2)."""
        return len(self._accounted)

    def smallest(self) -> AccountedSchedule:
        """The schedule with the smallest modelled peak, accounted."""
        if self._smallest is None:
            self._smallest = self._account(self._plan_of_smallest())
        return self._smallest

    def reaches(self, budget: int) -> bool:
        """Whether ``smallest()``'s accounted activations fit ``budget`` bytes, accounting no more
        microbatch shapes than it takes to tell."""
        if self._smallest is not None:
            return self._smallest.activation_bytes <= budget
        if self.below_floor(budget):
            return False
        plan = self._plan_of_smallest()
        return self._accounted_figures(plan, above=budget).activation_bytes <= budget

    def _plan_of_smallest(self) -> Plan:
        if self._smallest_plan is None:
            self._smallest_plan = smallest_plan(self.costs)
        return self._smallest_plan

    def cheapest(self, budget: int) -> AccountedSchedule:
        """The cheapest schedule found whose accounted activations fit ``budget`` bytes (the
        module docstring's step 3); raises ``BudgetTooSmall`` when even the smallest does not."""
        smallest = self.smallest()
        if smallest.activation_bytes > budget:
            raise BudgetTooSmall(budget, smallest)
        # Only this call's schedules steer it (the cache saves work, never changes the answer):
        # a fresh trainer built from lowmem.plan's overrides must reach the same schedule.
        seen: dict[str, AccountedSchedule] = {}
        best = smallest
        target = budget - (smallest.activation_bytes - smallest.plan.peak_bytes)
        for _ in range(MAX_ACCOUNTINGS):
            plan = cheapest_plan(self.costs, target)
            if plan is None:
                break  # tightened below the smallest modelled peak
            if str(plan) in seen and seen[str(plan)].activation_bytes <= budget:
                break  # the DP repeats a schedule that fits: nothing new to learn
            accounted = seen[str(plan)] = self._account(plan)
            fits = accounted.activation_bytes <= budget
            if fits:
                best = min(best, accounted, key=_preference)
            error = accounted.activation_bytes - plan.peak_bytes  # the model's error on this schedule
            # Within budget: as loose as this schedule's error allows; over: tighter by the excess.
            excess = accounted.activation_bytes - budget
            target = budget - error if fits else min(budget - error, target - excess)
        return best

    def apply(self, accounted: AccountedSchedule) -> tuple[tuple[Segment, ...], ...]:
        """Make the model run ``accounted``'s schedule; the schedules per stack (model order)."""
        schedules = tuple(self.costs.in_model_order(accounted.plan.schedules))
        apply_schedule(self.trainer.unwrapped_model, schedules)
        return schedules

    def _account(self, plan: Plan) -> AccountedSchedule:
        key = str(plan)
        if key not in self._accounted:
            accounted = self._accounted_figures(plan)
            exposed = exposed_transfer(self.costs, plan.schedules)
            self._accounted[key] = AccountedSchedule(
                plan, accounted.activation_bytes, accounted.flops, exposed, accounted.live_bytes,
                accounted.live_without_gradients_bytes,
            )  # fmt: skip
        return self._accounted[key]

    def _accounted_figures(self, plan: Plan, above: int | None = None) -> Accounted:
        if self._accounting is None:
            self._accounting = MinibatchAccounting(self.trainer)
        model, schedules = self.trainer.unwrapped_model, self.costs.in_model_order(plan.schedules)
        return self._accounting.account(str(plan), lambda: apply_schedule(model, schedules), above)


def _preference(accounted: AccountedSchedule) -> tuple[int, int]:
    # An offloaded block's transfer costs time its arithmetic does not show: a schedule that offloads
    # over a slow link must not win on FLOPs alone.
    return accounted.flops + accounted.exposed, accounted.activation_bytes


def _agreed_across_ranks(placement: CheckpointPlacement, budget: int) -> AccountedSchedule:
    """The cheapest schedule within ``budget`` for this rank's share of the first minibatch, made
    the same on every data-parallel rank: shares of token minibatches differ, and ranks running
    different schedules (or some refusing the budget while the others wait) would hang or diverge.
    Every rank plans; a refusal anywhere is raised everywhere; otherwise all run the schedule of
    the rank whose own accounting is largest (the largest share, for which it was planned)."""
    if distributed.world_size() == 1:
        return placement.cheapest(budget)
    try:
        mine, refusal = placement.cheapest(budget), None
    except BudgetTooSmall as error:
        mine, refusal = None, str(error)
    gathered = distributed.gather_objects((refusal, None if mine is None else (mine.activation_bytes, mine)))
    for rank, (message, _) in enumerate(gathered):
        if message is not None:
            raise ConfigError(f"data-parallel rank {rank} of {len(gathered)}: {message}")
    return max((chosen for _, chosen in gathered), key=lambda pair: pair[0])[1]


def apply_optimal_checkpointing(
    trainer: Any,
    budget_mb: float,
    blocks: Sequence[str] = (),
    widths: Sequence[int] = (),
    offload: float | None = None,
) -> OptimalCheckpointing:
    """Apply to ``trainer``'s model the cheapest schedule whose accounted activations fit ``budget_mb``
    (MB = 1e6 bytes); raise ``BudgetTooSmall`` (a ConfigError) when none does.

    trainer: a ``lowmem.trainer.Trainer`` over the model to checkpoint (see ``measure_chain``).
    blocks: ``checkpointing.blocks``, the chains of blocks to place checkpoints in (a model that
        declares no residual stacks has its chains detected when none are named).
    widths: the widths (bits) a stored block may be compressed at (``checkpointing.compress`` and
        wider, ``lowmem.techniques.compression.allowed_widths``; the model must have compression
        hooks installed); empty: every block is kept or recomputed, as before.
    offload: the host link's price in FLOPs per byte (``lowmem.techniques.offload.link_flops_per_byte``)
        when a stored block may be offloaded (the model must have offload hooks installed with
        ``everywhere=False``); None: no block is.
    """
    if budget_mb is None or not math.isfinite(budget_mb) or budget_mb <= 0:
        raise ConfigError(f"checkpointing.budget_mb={budget_mb!r} is not allowed: a finite number of MB > 0")
    ensure_chains(trainer.unwrapped_model, blocks)
    budget = round(budget_mb * MB)
    reused = _REUSED.get()
    placement = CheckpointPlacement(trainer, widths, offload) if reused is None else reused.moved_to(trainer)
    best = _agreed_across_ranks(placement, budget)
    result = OptimalCheckpointing(
        placement.apply(best),
        describe(best.plan.schedules),
        best.activation_bytes,
        best.flops,
        placement.smallest().activation_bytes,
        placement.accountings,
    )
    if distributed.is_rank0():
        log.info(
            "checkpointing optimal within %.6f MB: %s (accounted %.3f MB, %.2f GFLOP; smallest reachable %.3f MB)",
            budget / MB,
            result.description,
            result.activation_bytes / MB,
            result.flops / 1e9,
            result.smallest_bytes / MB,
        )
    return result


@contextlib.contextmanager
def reusing_placement(placement: CheckpointPlacement) -> Iterator[None]:
    """Inside, ``apply_optimal_checkpointing`` takes ``placement``'s measurements and accountings
    for the trainer it places checkpoints in, instead of measuring it again: ``lowmem.plan``
    building the configuration it chose, whose figures it has (the density aside, which changes
    no activation; it accounts the built trainer afterwards, and builds again without this if the
    figures differ)."""
    token = _REUSED.set(placement)
    try:
        yield
    finally:
        _REUSED.reset(token)
