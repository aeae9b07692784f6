"""The search for a memory budget, behind ``python -m lowmem.plan`` and ``lowmem.api.plan``.

``plan_search`` searches (``lowmem.planning.search``), prints the table of the configurations that
fit, builds and profiles the chosen one as ``lowmem.profile`` would, and returns the JSON row the
command line prints last. When nothing fits it raises ``NothingFits``, naming the smallest
achievable total and its configuration.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from omegaconf import DictConfig

from lowmem.config import ConfigError
from lowmem.planning import ahead
from lowmem.planning.search import Candidate, Planner
from lowmem.profiler import MB, MemoryReport, profile_row
from lowmem.profiler.real_passes import first_line


class NothingFits(ConfigError):
    """No configuration of the search fits ``plan.budget_mb``."""

    def __init__(self, budget_mb: float, smallest: Candidate, overrides: list[str]) -> None:
        self.smallest = smallest
        super().__init__(
            f"plan.budget_mb={budget_mb:g}: nothing fits; the smallest achievable accounted total is "
            f"{smallest.total_bytes / MB:.3f} MB (model {smallest.model_bytes / MB:.3f} + optimizer "
            f"{smallest.optimizer_bytes / MB:.3f} + activations {smallest.activation_bytes / MB:.3f} MB) with "
            f"{' '.join(overrides) or 'the knobs as fixed'}; allowed: plan.budget_mb >= {smallest.total_bytes / MB:.3f}"
        )


def table(planner: Planner, found: list[Candidate], budget_mb: float) -> str:
    """The configurations that fit, best first, one line each (MB = 1e6 bytes)."""
    metric = next((m[0] for m in map(planner.reported, found) if m is not None), "report's figure")
    lines = [
        f"configurations whose accounted total fits {budget_mb:g} MB, best first "
        "(highest density, then widest optimizer state, then widest saved activations, then largest microbatch, "
        "then fewest FLOPs):",
        f"{'#':>3}  {'density':>7}  {'precision':<9}  {'state bits':>10}  {'microbatch':>10}  {'checkpointing':<15}  "
        f"{'activations MB':>14}  {'total MB':>9}  {'GFLOP':>7}  {metric} (cost)",
    ]
    for rank, c in enumerate(found, start=1):
        reported = planner.reported(c)
        figure = "n/a" if reported is None else f"{reported[1]:.2f} ({-reported[2]:+.2f})"
        microbatch = "none" if c.microbatch is None else str(c.microbatch)
        lines.append(
            f"{rank:>3}  {c.density:>7g}  {c.precision:<9}  {c.bits:>10}  {microbatch:>10}  {c.checkpointing:<15}  "
            f"{c.activation_bytes / MB:>14.3f}  {c.total_bytes / MB:>9.3f}  {c.flops / 1e9:>7.1f}  {figure}"
        )
    return "\n".join(lines)


def plan_search(
    overrides: Sequence[str],
    budget_mb: float | None,
    *,
    top: int = 10,
    verify: bool = False,
    build: Callable[[DictConfig], Any] | None = None,
    echo: bool = True,
    world_size: int = 1,
) -> dict[str, Any]:
    """The search behind ``lowmem.plan`` and ``lowmem.api.plan``: ``build`` makes a trainer from a
    configuration (default: a recipe's, ``build_trainer``); ``echo`` prints the table and profile.
    ``world_size`` above 1 (``plan.world_size``): the budget is per rank of ``trainer.parallel=fsdp``
    over that many ranks, planned in this process (``Planner``)."""
    if budget_mb is None or not math.isfinite(budget_mb) or budget_mb <= 0:
        raise ConfigError(f"plan.budget_mb={budget_mb!r} is not allowed: lowmem.plan needs the budget, a finite MB > 0")
    say = print if echo else (lambda *args: None)
    started = time.perf_counter()
    budget = round(budget_mb * MB)
    planner = Planner(overrides, budget, build=build, world_size=world_size)
    # The chosen configuration, built from its overrides as lowmem.train will build it and profiled:
    # the best one found is, by a forked child while the search goes on (lowmem.planning.ahead).
    profiled: dict[Candidate, tuple[MemoryReport, dict[str, Any]]] = {}
    with ahead.Ahead(lambda chosen: profile_row(planner.build_chosen(chosen), verify), profiled.__setitem__) as early:
        found = planner.search(top, first=early.start if not verify and ahead.usable() else None)
        searched = time.perf_counter() - started
        early.collect()
    if not found:
        smallest = planner.smallest()
        raise NothingFits(budget_mb, smallest, planner.overrides(smallest))
    say(table(planner, found, budget_mb))
    refused = planner.refusals()  # configurations the search could not account, and why
    for line in refused:
        say(f"(refused while searching: {line})")
    planner.release(keep=found)  # the search's trainers and fake-pass caches: not part of what is profiled
    for chosen in found:
        try:
            report, row = profiled.pop(chosen, None) or profile_row(planner.build_chosen(chosen), verify)
            if world_size > 1:
                report, row = _per_rank(planner, chosen, report, row)
            # With CUDA graph replay, what must fit is the total with the graphs' pool (the search's figures).
            if chosen.strategy == "optimal" and (_held_activations(row), row["flops"]) != (
                chosen.activation_bytes, chosen.flops
            ):
                # The search's schedule does not stand for this build: its checkpoints placed afresh.
                report, row = profile_row(planner.build_chosen(chosen, reuse=False), verify)
        except Exception as refusal:  # noqa: BLE001 - lowmem.prepare / lowmem.train refuse it, however: never chosen
            why = first_line(refusal)
            say(f"(#{found.index(chosen) + 1} refused when built: {why}: skipped)")
            refused.append(f"{' '.join(planner.overrides(chosen))}: {why}")
            continue
        held = max(row["budget_total_bytes"], row["peak_bytes"] or 0)
        if held <= budget:
            break
        say(f"(#{found.index(chosen) + 1} profiled at {held / MB:.3f} MB when built alone: skipped)")
    else:
        raise ConfigError(f"plan.budget_mb={budget_mb:g}: no configuration found fits when built alone")
    chosen_overrides = planner.overrides(chosen) + (["trainer.parallel=fsdp"] if world_size > 1 else [])
    say(f"\nchosen: {' '.join(chosen_overrides) or '(the knobs as fixed)'}")
    if chosen.schedule:
        say(f"optimal checkpoint schedule (per stack, forward order): {chosen.schedule}")
    say(report.table())
    say(f"searched in {searched:.1f} s")
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
        "budget_bytes": budget,
        "configuration": chosen.knobs(),
        "checkpointing_schedule": chosen.schedule or None,
        "reported": None if reported is None else dict(zip(("metric", "value", "cost"), reported, strict=True)),
        "search_seconds": round(searched, 2),
        "refused": refused,
    }


def _per_rank(
    planner: Planner, chosen: Candidate, report: MemoryReport, row: dict[str, Any]
) -> tuple[MemoryReport, dict[str, Any]]:
    """The chosen configuration's profile (one process, one rank's share of the minibatch) as one
    rank of ``plan.world_size`` holds it: the first rank's shards of the weights, gradients and
    optimizer state, and the weights gathered at once with their gradients (in the budget figure)."""
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
    return replace(report, **changes), {**row, **changes}


def _held_activations(row: dict[str, Any]) -> int:
    """A profiled row's activations as the search accounts them: with CUDA graph replay, the graphs'
    pool plus the eager microbatches on top of it (else the report's activations)."""
    return row["total_with_graph_pool_bytes"] - row["model_bytes"] - row["optimizer_bytes"]
