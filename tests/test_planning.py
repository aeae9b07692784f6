"""Checkpoint placement by dynamic programming (checkpointing.strategy=optimal) and lowmem.plan."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import random
import re
import subprocess
import sys

import pytest
import torch

from lowmem.config import ConfigError
from lowmem.plan import plan
from lowmem.planning import ahead
from lowmem.planning.measure import measure_chain
from lowmem.planning.optimal import BudgetTooSmall, CheckpointPlacement, MinibatchAccounting
from lowmem.planning.schedule import BlockCosts, ChainCosts, cheapest_plan, predict, smallest_plan
from lowmem.planning.search import DENSITIES, Planner
from lowmem.profile import profile_config
from lowmem.profiler import MB, profile_trainer
from lowmem.residual import residual_stacks
from lowmem.techniques.checkpointing import Segment, apply_checkpointing, uniform_schedule
from lowmem.trainer import build_trainer
from tests.helpers import ROOT, SMALL_DC, TINY_WRN, make_config, slow

# --- the dynamic program against brute force ---------------------------------------------------


def synthetic_chain(seed: int, sizes: tuple[int, ...]) -> ChainCosts:
    """Blocks with random figures (some can recompute BN-ReLU, some cannot), in stacks of ``sizes``."""
    rng = random.Random(seed)
    blocks = []
    for _ in range(sum(sizes)):
        routes = rng.random() < 0.6
        norms = (False, True) if routes else (False,)
        stored = {False: rng.randint(50, 100)}
        if routes:
            stored[True] = rng.randint(20, stored[False])
        kinds = ("stored", "all_at_once")
        peaks = {(kind, norm): stored[norm] + rng.randint(10, 60) for kind in kinds for norm in norms}
        peaks[("recursively", routes)] = rng.randint(30, 90)
        flops = rng.randint(100, 200)
        blocks.append(
            BlockCosts(
                input_bytes=rng.randint(5, 20), output_bytes=rng.randint(5, 20), stored_bytes=stored,
                peak_bytes=peaks, flops=flops, forward_flops=rng.randint(20, 60), rebuild_flops=rng.randint(5, 40),
                routes_norm=routes,
            )
        )  # fmt: skip
    held = tuple(rng.randint(0, 30) for _ in sizes)
    return ChainCosts(tuple(blocks), sizes, held, rng.randint(10, 80), outside_flops=7)


def every_schedule(blocks: list[BlockCosts]) -> list[tuple[Segment, ...]]:
    """All schedules of one stack (what the DP chooses among)."""
    if not blocks:
        return [()]
    found = []
    for length in range(1, len(blocks) + 1):
        routes = {b.routes_norm for b in blocks[:length]}
        norms = (False, True) if routes == {True} else (False,)
        kinds = [Segment(length, "all_at_once", norm) for norm in norms]
        if length == 1:
            kinds += [Segment(1, "stored", norm) for norm in norms]
        if len(routes) == 1:
            kinds.append(Segment(length, "recursively", routes.pop()))
        for kind, rest in itertools.product(kinds, every_schedule(blocks[length:])):
            found.append((kind, *rest))
    return found


@pytest.mark.parametrize("seed", range(6))
def test_dp_matches_brute_force(seed):
    costs = synthetic_chain(seed, (3, 2))
    stacks = [every_schedule(list(costs.blocks[:3])), every_schedule(list(costs.blocks[3:]))]
    figures = [predict(costs, schedules) for schedules in itertools.product(*stacks)]
    assert len(figures) > 100
    smallest = min(peak for peak, _ in figures)
    assert smallest_plan(costs).peak_bytes == smallest
    assert predict(costs, smallest_plan(costs).schedules)[0] == smallest
    largest = max(peak for peak, _ in figures)
    for budget in sorted({smallest, (smallest + largest) // 2, largest, smallest + 7}):
        best = min(flops for peak, flops in figures if peak <= budget)
        chosen = cheapest_plan(costs, budget)
        assert chosen is not None and chosen.flops == best, f"budget {budget}"
        assert predict(costs, chosen.schedules) == (chosen.peak_bytes, chosen.flops)
        assert chosen.peak_bytes <= budget
    assert cheapest_plan(costs, smallest - 1) is None


# --- optimal checkpointing through the trainer (tiny WRN-10-1, batch 20, FP32) -----------------


@pytest.fixture(scope="module")
def tiny_chain():
    trainer = build_trainer(make_config(*TINY_WRN))
    return trainer, measure_chain(trainer)


def test_cost_model_is_the_accounting_for_the_fixed_strategies(tiny_chain):
    """On WRN the model of lowmem.planning.schedule predicts the profiler's figures: FLOPs exactly,
    activation bytes within a few per-channel statistics (exactly, on WRN-28-2)."""
    trainer, costs = tiny_chain
    model = trainer.unwrapped_model
    (stack,) = residual_stacks(model)
    for strategy, every in [("none", 1), ("no_bn", 1), ("residual", 2), ("residual_star", 1), ("residual_star", 2)]:
        apply_checkpointing(model, strategy, every)
        report = profile_trainer(trainer, measure=False)
        peak, flops = predict(costs, [uniform_schedule(strategy, every, len(stack.residual_blocks))])
        assert flops == report.flops, strategy
        assert abs(peak - report.activation_bytes) <= 512, strategy
    apply_checkpointing(model, "none")


def test_measuring_without_the_flops_outside_the_stacks_changes_nothing_else(tiny_chain):
    trainer, costs = tiny_chain
    assert measure_chain(trainer, outside_flops=False) == dataclasses.replace(costs, outside_flops=0)


def test_minibatch_accounting_is_the_profilers_shape_by_shape():
    """Several token microbatch shapes: the profiler's figures, and with a bound, only the shapes
    up to the first that exceeds it (the largest first)."""
    trainer = build_trainer(make_config(*SMALL_DC, "microbatch.size=200"))
    accounting = MinibatchAccounting(trainer)
    assert len(accounting.parts) > 1
    model = trainer.unwrapped_model
    apply_checkpointing(model, "residual")
    report = profile_trainer(trainer, measure=False)
    apply = functools.partial(apply_checkpointing, model, "residual")
    bounded = accounting.account("residual", apply, above=report.activation_bytes - 1)
    assert bounded.activation_bytes == report.activation_bytes and bounded.flops <= report.flops
    accounted = accounting.account("residual", apply)
    assert (accounted.activation_bytes, accounted.flops) == (report.activation_bytes, report.flops)
    assert accounted.complete
    # What the passes held beyond the activations: the profile's pass temporaries.
    assert accounted.beyond_bytes == report.step_temporaries["pass_temporaries"]
    assert accounting.account("again", apply, above=report.activation_bytes).complete
    apply_checkpointing(model, "none")


def profiled(*overrides: str) -> dict:
    return profile_config(make_config(*TINY_WRN, *overrides), measure=False)


def test_optimal_honours_the_budget_with_fewer_flops(tiny_chain):
    star = profiled("checkpointing.strategy=residual_star", "checkpointing.every=2")
    budget = star["activation_bytes"]
    optimal = profiled("checkpointing.strategy=optimal", f"checkpointing.budget_mb={budget / MB!r}")
    assert optimal["activation_bytes"] <= budget
    assert optimal["flops"] < star["flops"]
    # A loose budget buys fewer FLOPs, down to none's when everything fits.
    none = profiled()
    loose = profiled("checkpointing.strategy=optimal", f"checkpointing.budget_mb={none['activation_bytes'] / MB!r}")
    assert loose["flops"] == none["flops"] and loose["activation_bytes"] <= none["activation_bytes"]


def test_optimal_trains_like_none(tiny_chain):
    """Same parameters and BatchNorm statistics (updated once) as strategy none after two steps."""
    star = profiled("checkpointing.strategy=residual_star", "checkpointing.every=2")
    optimal = ("checkpointing.strategy=optimal", f"checkpointing.budget_mb={star['activation_bytes'] / MB!r}")
    states = []
    for overrides in [(), optimal]:
        trainer = build_trainer(make_config(*TINY_WRN, *overrides))
        batch = trainer.example_batch()
        for _ in range(2):
            trainer.train_step(batch)
        states.append(trainer.unwrapped_model.state_dict())
    assert states[0].keys() == states[1].keys()
    for name, value in states[0].items():
        assert torch.equal(value, states[1][name]), name
        if name.endswith("num_batches_tracked"):
            assert int(states[1][name]) == 2, name


def test_too_small_budget_names_the_knob_and_the_smallest_figure(tiny_chain):
    with pytest.raises(BudgetTooSmall, match=r"checkpointing.budget_mb=0.001 .*smallest reachable is") as error:
        build_trainer(make_config(*TINY_WRN, "checkpointing.strategy=optimal", "checkpointing.budget_mb=0.001"))
    smallest = error.value.smallest_bytes
    # The figure is reachable: exactly that budget builds, and the profile honours it.
    assert (
        profiled("checkpointing.strategy=optimal", f"checkpointing.budget_mb={smallest / MB!r}")["activation_bytes"]
        == smallest
    )


def test_data_parallel_ranks_run_one_schedule_and_refuse_together(tiny_chain, monkeypatch):
    """Ranks plan for their own shares (token shares differ): all run the schedule of the rank
    whose accounting is largest, and a budget refused on one rank is refused on all (no hang)."""
    from lowmem import distributed
    from lowmem.planning import optimal

    trainer, _ = tiny_chain
    placement = optimal.CheckpointPlacement(trainer)
    star = profiled("checkpointing.strategy=residual_star", "checkpointing.every=2")["activation_bytes"]
    mine = placement.cheapest(star)
    larger = placement.smallest()  # stands for another rank's plan, accounted larger than mine
    other = optimal.AccountedSchedule(larger.plan, mine.activation_bytes + 1, larger.flops)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "gather_objects", lambda value: [value, (None, (other.activation_bytes, other))])
    assert optimal._agreed_across_ranks(placement, star) is other
    refused = ("checkpointing.budget_mb=... is below what any checkpoint placement reaches", None)
    monkeypatch.setattr(distributed, "gather_objects", lambda value: [value, refused])
    with pytest.raises(ConfigError, match=r"data-parallel rank 1 of 2: checkpointing.budget_mb"):
        optimal._agreed_across_ranks(placement, star)


@pytest.mark.parametrize(
    "overrides,message",
    [(("checkpointing.strategy=optimal",), "checkpointing.budget_mb=None .*needs a budget"),
     (("checkpointing.strategy=optimal", "checkpointing.budget_mb=-1"), "checkpointing.budget_mb=-1"),
     (("checkpointing.strategy=residual", "checkpointing.budget_mb=5"), "only with checkpointing.strategy=optimal"),
     (("checkpointing.strategy=optimum",), "one of none, no_bn, residual, residual_star, optimal")],
)  # fmt: skip
def test_bad_checkpointing_knobs_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_trainer(make_config(*TINY_WRN, *overrides))


# --- the planner -------------------------------------------------------------------------------


def test_state_without_masks_equals_built_sparse_trainers():
    planner = Planner([*TINY_WRN, "microbatch.size=5"], budget_bytes=10**9)
    for density, precision in [(0.5, "fp32"), (0.05, "fp16"), (1.0, "fp16")]:
        row = profiled(f"sparsity.density={density}", f"precision={precision}")
        state = planner.state_bytes(density, precision)
        assert (state.model_bytes, state.optimizer_bytes) == (row["model_bytes"], row["optimizer_bytes"])


def test_quantized_state_is_counted_as_built_optimizers_hold_it():
    planner = Planner([*TINY_WRN, "microbatch.size=5"], budget_bytes=10**9)
    for density, precision, bits in [(1.0, "fp32", 8), (0.5, "fp16", 4), (0.05, "fp16", 8)]:
        row = profiled(f"sparsity.density={density}", f"precision={precision}", f"optim.state_bits={bits}")
        state = planner.state_bytes(density, precision, bits)
        assert state == (row["model_bytes"], row["optimizer_bytes"], row["optimizer_state_bytes"])


def test_fixed_state_bits_restrict_the_search():
    sixteen = Planner(list(TINY_WRN), 10**9).precisions[1]  # bf16 where it runs at full speed, else fp16
    assert Planner([*TINY_WRN, "optim.state_bits=null"], 10**9).state_bits == {"fp32": (None,), sixteen: (None,)}
    assert Planner([*TINY_WRN, "optim.state_bits=16"], 10**9).state_bits == {"fp32": (), sixteen: (None,)}
    assert Planner([*TINY_WRN, "optim.state_bits=4"], 10**9).state_bits == {"fp32": (4,), sixteen: (4,)}
    assert Planner(list(TINY_WRN), 10**9).state_bits == {"fp32": (None, 8, 4), sixteen: (None, 8, 4)}
    with pytest.raises(ConfigError, match=r"optim.state_bits=16 is not allowed: with precision=fp32 one of 32, 8, 4"):
        Planner([*TINY_WRN, "precision=fp32", "optim.state_bits=16"], 10**9)


def preference(candidate, batch: int) -> tuple:
    microbatch = batch if candidate.microbatch is None else candidate.microbatch
    quantization = 0 if candidate.state_bits is None else (8, 4).index(candidate.state_bits) + 1
    return -candidate.density, quantization, -microbatch, candidate.flops


@pytest.fixture(scope="module")
def wrn_plan():
    """A budget that dense FP32 misses at any microbatch and schedule, planned over FP32 with its
    own (32-bit) optimizer state."""
    with pytest.raises(BudgetTooSmall) as error:  # the smallest activations at the smallest microbatch
        build_trainer(make_config(*TINY_WRN, "microbatch.size=1", "checkpointing.strategy=optimal",
                                  "checkpointing.budget_mb=1e-6"))  # fmt: skip
    dense = profiled()
    budget = dense["model_bytes"] + dense["optimizer_bytes"] + error.value.smallest_bytes - 1
    # The budget holds the step's temporaries too (gradient accumulation at microbatch 1).
    budget += Planner([*TINY_WRN, "precision=fp32"], budget).temporary_bytes(1.0, "fp32", 1)
    planner = Planner([*TINY_WRN, "precision=fp32", "optim.state_bits=null", f"plan.budget_mb={budget / MB}"], budget)
    return planner, planner.search(top=12), budget


def test_planner_follows_the_preference_and_fits(wrn_plan):
    planner, found, budget = wrn_plan
    assert found and all(c.precision == "fp32" for c in found)
    keys = [preference(c, 20) for c in found]
    assert keys == sorted(keys)
    best = found[0]
    assert best.density < 1.0  # dense misses the budget at every microbatch
    row = profile_config(planner.compose(best), measure=False)
    assert row["total_bytes"] == best.total_bytes <= budget
    # Nothing denser fits, nor a larger microbatch at the chosen density.
    fp32 = [*TINY_WRN, "precision=fp32", "optim.state_bits=null"]
    denser = DENSITIES[DENSITIES.index(best.density) - 1]
    assert Planner([*fp32, f"sparsity.density={denser}"], budget).search(top=1) == []
    sizes = planner.microbatches
    if best.microbatch != sizes[0]:
        larger = sizes[sizes.index(best.microbatch) - 1]
        fixed = [f"sparsity.density={best.density}", f"microbatch.size={'null' if larger is None else larger}"]
        assert Planner([*fp32, *fixed], budget).search(top=1) == []


def test_quantized_state_buys_density(wrn_plan):
    """Where dense FP32 misses with its own state, quantized state fits it: the densest
    configuration wins, with the widest state that fits."""
    _, _, budget = wrn_plan
    planner = Planner([*TINY_WRN, "precision=fp32"], budget)
    found = planner.search(top=6)
    assert [preference(c, 20) for c in found] == sorted(preference(c, 20) for c in found)
    best = found[0]
    assert best.density == 1.0 and best.state_bits in (8, 4)
    assert f"optim.state_bits={best.state_bits}" in planner.overrides(best)
    row = profile_config(planner.compose(best), measure=False)
    assert row["total_bytes"] == best.total_bytes <= budget
    if best.state_bits == 4:
        eight = [*TINY_WRN, "precision=fp32", "optim.state_bits=8", "sparsity.density=1.0"]
        assert Planner(eight, budget).search(top=1) == []


def test_the_chosen_schedule_taken_from_the_search_accounts_as_placed_afresh(wrn_plan):
    planner, found, _ = wrn_plan
    chosen = next(c for c in found if c.strategy == "optimal")
    reused = profile_trainer(planner.build_chosen(chosen), measure=False)
    afresh = profile_trainer(planner.build_chosen(chosen, reuse=False), measure=False)
    figures = (chosen.activation_bytes, chosen.flops, chosen.total_bytes)
    assert (reused.activation_bytes, reused.flops, reused.total_bytes) == figures
    assert (afresh.activation_bytes, afresh.flops, afresh.total_bytes) == figures


def test_plan_command_prints_overrides_that_fit(wrn_plan, capsys):
    _, _, budget = wrn_plan
    cfg = make_config(*TINY_WRN, "precision=fp32", f"plan.budget_mb={budget / MB!r}", "plan.top=3")
    row = plan(cfg, [*TINY_WRN, "precision=fp32", f"plan.budget_mb={budget / MB!r}", "plan.top=3"])
    printed = capsys.readouterr().out
    assert "best first" in printed and "chosen:" in printed and "state bits" in printed
    assert row["state_bits"] in (32, 8, 4)
    assert all(o.split("=")[0] != "precision" for o in row["overrides"])  # fixed on the command line
    again = profile_config(make_config(*TINY_WRN, "precision=fp32", *row["overrides"]), measure=False)
    assert again["total_bytes"] == row["total_bytes"] <= budget


def test_the_command_writes_its_plan(tmp_path):
    """``python -m lowmem.plan`` as a user runs it: exit 0, the chosen row printed and in plan.json."""
    command = [sys.executable, "-m", "lowmem.plan", *TINY_WRN, "precision=fp32", "plan.budget_mb=1000",
               "plan.top=2", f"hydra.run.dir={tmp_path}"]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-2000:]
    row = json.loads((tmp_path / "plan.json").read_text())
    assert row["total_with_graph_pool_bytes"] == row["total_bytes"] <= 1000 * MB  # nothing replays on a CPU
    assert json.loads(result.stdout.strip().splitlines()[-1]) == row


def test_nothing_fits_names_the_smallest_and_exits_non_zero():
    command = [sys.executable, "-m", "lowmem.plan", *TINY_WRN, "precision=fp16", "plan.budget_mb=0.01",
               "hydra.run.dir=/tmp/lowmem-test-plan"]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "nothing fits; the smallest configuration measures" in output, output[-2000:]
    assert "over the budget" in output  # the table of what was built and measured
    # One figure, named twice: the smallest configuration's measured peak, and the budget allowed.
    named = re.search(r"measures ([0-9.]+) MB .* allowed: plan.budget_mb >= ([0-9.]+)", output)
    assert named and named[1] == named[2], output[-2000:]


@pytest.mark.slow
def test_dc_iwslt_small_shapes():
    """The same planner and optimal checkpointing on the translation recipe (two stacks, no BN)."""
    fixed = [*SMALL_DC, "precision=fp32", "microbatch.size=null"]
    none = profile_config(make_config(*fixed), measure=False)
    residual = profile_config(make_config(*fixed, "checkpointing.strategy=residual"), measure=False)
    budget = (none["activation_bytes"] + residual["activation_bytes"]) // 2
    optimal = profile_config(
        make_config(*fixed, "checkpointing.strategy=optimal", f"checkpointing.budget_mb={budget / MB!r}"), measure=False
    )
    assert optimal["activation_bytes"] <= budget and optimal["flops"] <= residual["flops"]
    total = none["total_bytes"] - 1  # dense without checkpointing misses by a byte
    planner = Planner(fixed, total)
    found = planner.search(top=3)
    assert found and found[0].density == 1.0 and found[0].strategy != "none"
    assert profile_config(planner.compose(found[0]), measure=False)["total_bytes"] <= total


@pytest.mark.parametrize("overrides", [(*TINY_WRN,), slow((*SMALL_DC, "microbatch.size=200"))],
                         ids=["wrn", "dc"])
def test_the_floor_outside_the_stacks_is_below_every_schedule_and_saves_their_measuring(overrides):
    """``below_floor`` rules microbatch sizes out without measuring blocks: sound only if what the
    model holds outside its stacks is at most every schedule's accounted activations."""
    trainer = build_trainer(make_config(*overrides))
    placement = CheckpointPlacement(trainer)
    assert not placement.below_floor(10**12)  # every shape's pass run
    floor = max(outside.activation_bytes for outside in placement._outside.values())
    assert placement.below_floor(floor - 1) and not placement.below_floor(floor)
    assert placement._costs is None  # no block measured yet
    model = trainer.unwrapped_model
    strategies = [("none", 1), ("residual", 1), ("residual", 2)]
    if "dc_iwslt" not in overrides[0]:
        strategies += [("no_bn", 1), ("residual_star", 1), ("residual_star", 2)]
    for strategy, every in strategies:
        apply_checkpointing(model, strategy, every)
        assert floor <= profile_trainer(trainer, measure=False).activation_bytes, strategy
    apply_checkpointing(model, "none")
    assert floor <= placement.smallest().activation_bytes
    assert placement.costs.outside_peak == floor  # the passes are measure_chain's own, reused
    assert measure_chain(trainer, outside_flops=False) == placement.costs


@pytest.mark.skipif(not ahead.usable(), reason="no forked helper here (one CPU in this process's affinity)")
def test_a_forked_helper_fills_caches_ahead_and_changes_no_answer():
    """lowmem.planning.ahead: a forked child accounts the next microbatch size while this process
    accounts the current one; the configurations found are those of a single process. Once a child
    finds autograd refusing to run after the fork (torch does, in a child of a process that ran a
    backward pass on fake tensors), no other child is forked."""
    overrides = [*TINY_WRN, "precision=fp32", "sparsity.density=1.0", "optim.state_bits=null",
                 "checkpointing.strategy=optimal"]  # fmt: skip
    alone = Planner(overrides, budget_bytes=10**12)
    alone.parallel = False
    expected = alone.search(top=3)
    assert len({c.microbatch for c in expected}) >= 2  # several microbatch sizes: tasks to share
    helped = Planner(overrides, budget_bytes=10**12)
    started = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ahead, "_AUTOGRAD_REFUSES_FORKS", False)  # as if no child had said so yet
        start = ahead.Ahead.start
        patch.setattr(ahead.Ahead, "start", lambda self, task: started.append(task) or start(self, task))
        assert helped.search(top=3) == expected
        assert started  # a child did run
        if ahead._AUTOGRAD_REFUSES_FORKS:  # this process ran fake backward passes (alone's search)
            assert len(started) == 1 and not ahead.usable()
    assert helped.search(top=3) == expected  # and what it merged is what a process finds alone


def test_a_forked_helper_that_fails_or_is_cancelled_leaves_the_work_here():
    merged = {}
    with ahead.Ahead(lambda task: {"task": task}, merged.__setitem__) as helper:
        helper.start("a")
        assert helper.running() == "a"
        helper.collect()
        helper.start("b")  # still running when the block ends: cancelled, nothing merged
    assert merged == {"a": {"task": "a"}}  # "b" was cancelled on exit
    with ahead.Ahead(lambda task: 1 / 0, merged.__setitem__) as helper:
        helper.start("c")
        helper.collect()
    assert "c" not in merged and helper.running() is None


def test_a_forked_helper_that_never_answers_is_stopped_after_its_patience():
    import time

    merged = {}
    with ahead.Ahead(lambda task: time.sleep(60), merged.__setitem__, patience=0.5) as helper:
        helper.start("slow")
        started = time.perf_counter()
        helper.collect()
        assert time.perf_counter() - started < 10 and helper.running() is None
    assert merged == {}


def test_lowmem_plan_chooses_the_gradient_sync_of_sharded_microbatches():
    """``plan.world_size=2`` with microbatches: one reduce-scatter per minibatch where every
    gradient held whole still fits, else one per microbatch (each rank accumulating its shards)."""
    from lowmem.planning import search

    fixed = [*TINY_WRN, "trainer.device=cpu", "sparsity.density=1.0", "precision=fp32", "microbatch.size=5",
             "optim.state_bits=null", "checkpointing.strategy=none"]  # fmt: skip
    roomy = search.Planner(fixed, 10**12, world_size=2)
    chosen = roomy.search(1)[0]
    assert chosen.gradient_sync == "minibatch" and "trainer.gradient_sync=minibatch" in roomy.overrides(chosen)
    extra = roomy.temporary_bytes(1.0, "fp32", 5, "minibatch") - roomy.temporary_bytes(1.0, "fp32", 5, "microbatch")
    assert extra > 0  # every gradient whole, against the largest gathered unit's
    tight = search.Planner(fixed, chosen.budget_total_bytes - 1, world_size=2).search(1)[0]
    assert tight.gradient_sync == "microbatch" and tight.budget_total_bytes == chosen.budget_total_bytes - extra
    alone = search.Planner(fixed, 10**12).search(1)[0]  # one process: the knob means nothing
    assert alone.gradient_sync is None and "trainer.gradient_sync" not in alone.knobs()
