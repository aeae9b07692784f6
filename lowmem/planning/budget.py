"""The search for a memory budget, behind ``python -m lowmem.plan`` and ``lowmem.api.plan``.

``plan_search`` searches (``lowmem.planning.search``), prints the table of the configurations that
fit, builds and profiles the chosen one as ``lowmem.profile`` would, and returns the JSON row the
command line prints last. When nothing fits it raises ``NothingFits``, naming the smallest
achievable figure and its configuration.

A plan is a promise (``verify``, ``plan.verify=true`` by default): each configuration chosen is
built as ``lowmem.train`` builds it and one real step measured; one whose measured peak exceeds the
budget is skipped for the next. Where the search's figures fall short of what built configurations
hold, the search runs again below the budget by the least such shortfall (``MAX_ROUNDS`` searches
at most), and the configuration of the smallest figure is tried last: "nothing fits" then names its
figure, the one compared with the budget (its measured peak, verified), so that any budget at
least that figure gets a plan.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from omegaconf import DictConfig

from lowmem.config import ConfigError
from lowmem.planning import ahead
from lowmem.planning.search import Candidate, Planner
from lowmem.profiler import MB, MemoryReport, profile_row
from lowmem.profiler.real_passes import first_line

MAX_ROUNDS = 3  # searches of a plan: the first, then again below the budget by what built ones held beyond it
OVER_PER_ROUND = 3  # configurations over the budget when built before the search is run again below it


@dataclass
class Tried:
    """One configuration ``lowmem.plan`` built and profiled: its overrides, the search's figure and
    the built one's (accounted total plus the step's temporaries, bytes), the measured peak (bytes;
    None unverified), and the verdict: ``fits``, ``over the budget`` or ``refused when built: <why>``."""

    overrides: list[str]
    searched_bytes: int
    accounted_bytes: int | None = None
    peak_bytes: int | None = None
    verdict: str = ""

    def row(self) -> dict[str, Any]:
        return {
            "overrides": self.overrides,
            "searched_mb": round(self.searched_bytes / MB, 3),
            "accounted_mb": None if self.accounted_bytes is None else round(self.accounted_bytes / MB, 3),
            "measured_mb": None if self.peak_bytes is None else round(self.peak_bytes / MB, 3),
            "verdict": self.verdict,
        }


class NothingFits(ConfigError):
    """No configuration of the search fits ``plan.budget_mb``: the message names the smallest one's
    figure, the one the budget is compared with (its measured peak when verified, else its accounted
    total with the step's temporaries); ``tried`` holds what was built and profiled (``Tried.row``)."""

    def __init__(
        self, budget_mb: float, smallest: Tried | None, tried: list[Tried], verify: bool, why: str = ""
    ) -> None:
        self.smallest = smallest
        self.smallest_mb: float | None = None  # the figure named, in MB rounded up to the kB
        self.tried = [entry.row() for entry in tried]
        if smallest is None:
            message = f"plan.budget_mb={budget_mb:g}: nothing fits; {why}"
        else:
            overrides = " ".join(smallest.overrides) or "the knobs as fixed"
            # One figure, rounded up to the kB: a budget of at least it gets a plan.
            figure = smallest.peak_bytes if verify else smallest.accounted_bytes
            self.smallest_mb = math.ceil(figure / 1000) / 1000
            if verify:
                what = (
                    f"the smallest configuration measures {self.smallest_mb:.3f} MB (the peak of one step; accounted "
                    f"with the step's temporaries {smallest.accounted_bytes / MB:.3f} MB)"
                )
            else:
                what = f"the smallest accounted total with the step's temporaries is {self.smallest_mb:.3f} MB"
            message = (
                f"plan.budget_mb={budget_mb:g}: nothing fits; {what} with {overrides}; allowed: plan.budget_mb >= "
                f"{self.smallest_mb:.3f}"
            )
        super().__init__(message)


def tried_table(tried: list[Tried]) -> str:
    """What ``lowmem.plan`` built and profiled, in order, one line each (MB = 1e6 bytes)."""
    lines = [f"{'searched MB':>11}  {'accounted MB':>12}  {'measured MB':>11}  verdict: overrides"]
    for entry in tried:
        accounted = "-" if entry.accounted_bytes is None else f"{entry.accounted_bytes / MB:.3f}"
        measured = "-" if entry.peak_bytes is None else f"{entry.peak_bytes / MB:.3f}"
        lines.append(
            f"{entry.searched_bytes / MB:>11.3f}  {accounted:>12}  {measured:>11}  {entry.verdict}: "
            f"{' '.join(entry.overrides) or '(the knobs as fixed)'}"
        )
    return "\n".join(lines)


def table(planner: Planner, found: list[Candidate], budget_mb: float) -> str:
    """The configurations that fit, best first, one line each (MB = 1e6 bytes)."""
    metric = next((m[0] for m in map(planner.reported, found) if m is not None), "report's figure")
    lines = [
        f"configurations whose accounted total with the step's temporaries fits {budget_mb:g} MB, best first "
        "(highest density, then widest optimizer state, then widest saved activations, then largest microbatch, "
        "then fewest FLOPs):",
        f"{'#':>3}  {'density':>7}  {'precision':<9}  {'state bits':>10}  {'microbatch':>10}  {'checkpointing':<15}  "
        f"{'loss chunks':<11}  {'activations MB':>14}  {'total MB':>9}  {'+ temporaries':>13}  {'GFLOP':>7}  "
        f"{metric} (cost)",
    ]
    for rank, c in enumerate(found, start=1):
        reported = planner.reported(c)
        figure = "n/a" if reported is None else f"{reported[1]:.2f} ({-reported[2]:+.2f})"
        microbatch = "none" if c.microbatch is None else str(c.microbatch)
        lines.append(
            f"{rank:>3}  {c.density:>7g}  {c.precision:<9}  {c.bits:>10}  {microbatch:>10}  {c.checkpointing:<15}  "
            f"{c.chunk or '-':<11}  {c.activation_bytes / MB:>14.3f}  {c.total_bytes / MB:>9.3f}  "
            f"{c.budget_total_bytes / MB:>13.3f}  {c.flops / 1e9:>7.1f}  {figure}"
        )
    return "\n".join(lines)


def plan_search(
    overrides: Sequence[str],
    budget_mb: float | None,
    *,
    top: int = 10,
    verify: bool = True,
    build: Callable[[DictConfig], Any] | None = None,
    echo: bool = True,
    world_size: int = 1,
) -> dict[str, Any]:
    """The search behind ``lowmem.plan`` and ``lowmem.api.plan``: ``build`` makes a trainer from a
    configuration (default: a recipe's, ``build_trainer``); ``echo`` prints the table and profile;
    ``verify`` measures one real step of each configuration chosen (the module docstring).
    ``world_size`` above 1 (``plan.world_size``): the budget is per rank of ``trainer.parallel=fsdp``
    over that many ranks, planned in this process (``Planner``)."""
    if budget_mb is None or not math.isfinite(budget_mb) or budget_mb <= 0:
        raise ConfigError(f"plan.budget_mb={budget_mb!r} is not allowed: lowmem.plan needs the budget, a finite MB > 0")
    say = print if echo else (lambda *args: None)
    started = time.perf_counter()
    budget = round(budget_mb * MB)
    planner = Planner(overrides, budget, build=build, world_size=world_size)
    # The chosen configuration, built from its overrides as lowmem.train will build it and profiled:
    # unverified, the best one found is, by a forked child while the search goes on (lowmem.planning.ahead).
    profiled: dict[Candidate, tuple[MemoryReport, dict[str, Any]]] = {}
    with ahead.Ahead(lambda chosen: profile_row(planner.build_chosen(chosen), verify), profiled.__setitem__) as early:
        found = planner.search(top, first=early.start if not verify and ahead.usable() else None)
        early.collect()
    searched = time.perf_counter() - started
    if found:
        say(table(planner, found, budget_mb))
    tried: list[Tried] = []
    built: dict[Candidate, tuple[MemoryReport, dict[str, Any]] | None] = {}

    def attempt(candidate: Candidate) -> tuple[MemoryReport, dict[str, Any]] | None:
        """Build and profile ``candidate`` (once), noting it in ``tried``; its profile if it fits."""
        if candidate in built:
            return built[candidate]
        entry = Tried(planner.overrides(candidate), candidate.budget_total_bytes)
        tried.append(entry)
        try:
            report, row = _profiled(planner, candidate, world_size, verify, profiled.pop(candidate, None))
        except Exception as refusal:  # noqa: BLE001 - lowmem.prepare / lowmem.train refuse it, however: never chosen
            entry.verdict = f"refused when built: {first_line(refusal)}"
            say(f"({' '.join(entry.overrides)}: {entry.verdict}: skipped)")
            built[candidate] = None
            return None
        entry.accounted_bytes, entry.peak_bytes = row["budget_total_bytes"], row["peak_bytes"]
        fits = _figure(row, verify) <= budget
        entry.verdict = "fits" if fits else "over the budget"
        if not fits:
            what = "measured" if verify else "accounted with the step's temporaries"
            say(f"({' '.join(entry.overrides)}: {what} {_figure(row, verify) / MB:.3f} MB when built alone: skipped)")
        built[candidate] = (report, row) if fits else None
        return built[candidate]

    if planner.device.type != "cpu":
        # What the search leaves alive is not the chosen run's: freed before that run is built and
        # measured (a CUDA allocator's peak counts every tensor of the process; a CPU measurement
        # counts the run's own only, and keeps the search's caches for another search).
        planner.release(keep=found)
    chosen, result = _choose(planner, found, attempt, tried, top, verify)
    searched_again = time.perf_counter() - started - searched
    if chosen is None:
        # Last, the configuration of the smallest figure: any budget at least its figure gets a plan.
        try:
            with_smallest = planner.smallest()
        except ConfigError as error:
            raise NothingFits(budget_mb, None, tried, verify, str(error)) from None
        result = attempt(with_smallest)
        if result is None:
            smallest = next((t for t in tried if t.overrides == planner.overrides(with_smallest)), None)
            if smallest is not None and smallest.accounted_bytes is None:  # refused when built
                smallest = min(
                    (t for t in tried if t.accounted_bytes is not None), key=lambda t: _tried_figure(t, verify),
                    default=None,
                )  # fmt: skip
            if tried:
                say("configurations built and profiled:\n" + tried_table(tried))
            raise NothingFits(budget_mb, smallest, tried, verify, "every configuration was refused when built")
        chosen = with_smallest
    report, row = result
    refused = planner.refusals()  # configurations the search could not account, and why
    for line in refused:
        say(f"(refused while searching: {line})")
    refused += [f"{' '.join(t.overrides)}: {t.verdict.removeprefix('refused when built: ')}" for t in tried
                if t.verdict.startswith("refused")]  # fmt: skip
    chosen_overrides = planner.overrides(chosen) + (["trainer.parallel=fsdp"] if world_size > 1 else [])
    say(f"\nchosen: {' '.join(chosen_overrides) or '(the knobs as fixed)'}")
    if chosen.schedule:
        say(f"optimal checkpoint schedule (per stack, forward order): {chosen.schedule}")
    say(report.table())
    say(f"searched in {searched:.1f} s" + (f", built and verified in {searched_again:.1f} s" if verify else ""))
    reported = planner.reported(chosen)
    return {
        "overrides": chosen_overrides,
        "total_bytes": row["total_bytes"],
        "total_with_graph_pool_bytes": row["total_with_graph_pool_bytes"],
        "step_temporary_bytes": row["step_temporary_bytes"],
        "budget_total_bytes": row["budget_total_bytes"],
        "model_bytes": row["model_bytes"],
        "optimizer_bytes": row["optimizer_bytes"],
        "optimizer_state_bytes": row.get("optimizer_state_bytes"),
        "state_bits": chosen.bits,
        "compress": chosen.compress,
        "offload": chosen.offload,
        "activation_bytes": row["activation_bytes"],
        "flops": row["flops"],
        "peak_bytes": row["peak_bytes"],
        "verified": verify,
        "budget_bytes": budget,
        "configuration": chosen.knobs(),
        "checkpointing_schedule": chosen.schedule or None,
        "reported": None if reported is None else dict(zip(("metric", "value", "cost"), reported, strict=True)),
        "search_seconds": round(searched, 2),
        "seconds": round(time.perf_counter() - started, 2),
        "refused": refused,
        "tried": [entry.row() for entry in tried],
    }


def _choose(
    planner: Planner,
    found: list[Candidate],
    attempt: Callable[[Candidate], tuple[MemoryReport, dict[str, Any]] | None],
    tried: list[Tried],
    top: int,
    verify: bool,
) -> tuple[Candidate | None, tuple[MemoryReport, dict[str, Any]] | None]:
    """The first configuration, in the search's order, that fits when built (and measured, with
    ``verify``). Where ``OVER_PER_ROUND`` of a round's configurations are over the budget when
    built, the search runs again below the budget by the least shortfall of its figures on them (a
    search's figure is a configuration's accounting; what it misses, a built one holds: run again
    below the budget by that, it finds configurations whose figures leave room for it)."""
    asked = top
    for round_number in range(MAX_ROUNDS):
        over: list[int] = []
        for candidate in found:
            known = len(tried)
            result = attempt(candidate)
            if result is not None:
                return candidate, result
            if len(tried) > known and tried[-1].accounted_bytes is not None:  # built, and over the budget
                over.append(_tried_figure(tried[-1], verify) - candidate.budget_total_bytes)
                if len(over) >= OVER_PER_ROUND:
                    break
        shortfall = min((miss for miss in over if miss > 0), default=0)
        if round_number + 1 == MAX_ROUNDS or (shortfall == 0 and len(found) < asked):
            break  # the last search, or one that found all there is and nothing held more than its figure
        planner.budget -= max(shortfall, 1)
        # As many new ones as the first search offered (the search rebuilds what release() freed).
        asked = top + len(tried)
        found = planner.search(asked)
    return None, None


def _profiled(
    planner: Planner, chosen: Candidate, world_size: int, verify: bool,
    early: tuple[MemoryReport, dict] | None = None,
) -> tuple[MemoryReport, dict]:  # fmt: skip
    """``chosen`` built as ``lowmem.train`` builds it and profiled (``verify``: one real step too),
    or its profile made ``early`` by a forked helper, taken as one of this process's."""
    report, row = early or profile_row(planner.build_chosen(chosen), verify)
    if world_size > 1:
        report, row = _per_rank(planner, chosen, report, row)
    # With CUDA graph replay, what must fit is the total with the graphs' pool (the search's figures).
    if chosen.strategy == "optimal" and (_held_activations(row), row["flops"]) != (
        chosen.activation_bytes,
        chosen.flops,
    ):
        # The search's schedule does not stand for this build: its checkpoints placed afresh.
        report, row = profile_row(planner.build_chosen(chosen, reuse=False), verify)
        if world_size > 1:
            report, row = _per_rank(planner, chosen, report, row)
    return report, row


def _figure(row: dict[str, Any], verify: bool) -> int:
    """What a built configuration's profile is compared with the budget by: its measured peak when
    verified, else its accounted total with the step's temporaries."""
    return row["peak_bytes"] if verify else row["budget_total_bytes"]


def _tried_figure(entry: Tried, verify: bool) -> int:
    return entry.peak_bytes if verify else entry.accounted_bytes


def _per_rank(
    planner: Planner, chosen: Candidate, report: MemoryReport, row: dict[str, Any]
) -> tuple[MemoryReport, dict[str, Any]]:
    """The chosen configuration's profile (one process, one rank's share of the minibatch) as one
    rank of ``plan.world_size`` holds it: the first rank's shards of the weights, gradients and
    optimizer state, and the weights gathered at once with their gradients (in the budget figure;
    the measured peak, of the whole state in one process, moved by the same)."""
    state = planner.state_bytes(chosen.density, chosen.precision, chosen.state_bits)
    change = state.model_bytes + state.optimizer_bytes - row["model_bytes"] - row["optimizer_bytes"]
    gathered = planner.gathered_bytes(chosen.density, chosen.precision)
    changes = {
        "model_bytes": state.model_bytes,
        "optimizer_bytes": state.optimizer_bytes,
        "optimizer_state_bytes": state.optimizer_state_bytes,
        "total_bytes": row["total_bytes"] + change,
        "total_with_graph_pool_bytes": row["total_with_graph_pool_bytes"] + change,
        "budget_total_bytes": row["budget_total_bytes"] + change + gathered,
        "gathered_bytes": gathered // 2,
    }
    if row["peak_bytes"] is not None:
        changes["peak_bytes"] = row["peak_bytes"] + change + gathered
    return replace(report, **changes), {**row, **changes}


def _held_activations(row: dict[str, Any]) -> int:
    """A profiled row's activations as the search accounts them: with CUDA graph replay, the graphs'
    pool plus the eager microbatches on top of it (else the report's activations)."""
    return row["total_with_graph_pool_bytes"] - row["model_bytes"] - row["optimizer_bytes"]
