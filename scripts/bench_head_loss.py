"""A language model with a 32k vocabulary: plain PyTorch, the usual low-memory stack and lowmem, side by side.

A Llama-shaped ``transformers.LlamaForCausalLM`` built from its config (no download): vocabulary
32,000, hidden 256, MLP 688, 4 layers, 8 heads (2 key-value heads), untied output layer; a batch of
8 x 256 random tokens, ``labels=input_ids`` (the model's own loss). Its logits are the step's largest
tensors: 2,048 tokens x 32,000 x 4 B = 262 MB in FP32, each. Rows, every one Adam at lr 1e-4,
betas (0.9, 0.999), eps 1e-8, no weight decay:

1. plain PyTorch: FP32 model, ``torch.optim.AdamW``;
2. the usual stack: the model in pure BF16 (``model.to(torch.bfloat16)``), Hugging Face's gradient
   checkpointing, torchao's ``AdamW8bit`` (a benchmark-only dependency: ``pip install torchao==0.18.0``;
   without it the row says so and uses ``torch.optim.AdamW``);
3. the usual stack with gradient accumulation over microbatches of 1 sequence;
4. lowmem (``lowmem.prepare``): BF16, ``checkpointing.strategy=residual``, 8-bit Adam state,
   ``loss.chunk_tokens=auto``; and the same with ``loss.chunk_tokens=none`` (the head's share);
5. lowmem as in 4 with true microbatches of 1 sequence;
6. lowmem planned: ``lowmem.plan`` at the usual stack's measured peak / 3 (the optimizer fixed,
   everything else the planner's), then prepared with the plan's overrides.

Memory, one method for every row: ``lowmem.profiler.measure_peak`` (live tensor storages on the CPU:
every tensor the run holds when the step starts plus every storage the step creates, until it dies)
around one whole training step, forward, backward and optimizer step, taken after one warm-up step so
the optimizer state exists. torchao's update is ``torch.compile``d, which cannot run under the
tracker's dispatch mode: inside the measured step it runs outside that mode, compiled, as in training,
and what it allocates (``torch.profiler``'s memory events: every allocation of the CPU allocator,
kernels' scratch included) is added to the bytes live when it starts (``profiled_update``). Run
eagerly instead, its update of a 32,000 x 256 and a 256 x 688 BF16 weight allocated 467 MB at once
(65.8 MB compiled): no fair figure for the usual stack. The tracker counts torchao's 8-bit state (a
wrapper tensor subclass) at its outer BF16 size, twice its bytes; the script counts its inner tensors
instead (``wrapped_state_excess``).
Step time: the median (and the fastest) of ``--repeats`` steps per row, the rows taken round robin
in one process (each timed step after one untimed step of its own row), after a warm-up step each;
the load average before and after is printed (other processes on the machine only add time, so the
fastest step is the figure they disturb least).
Run: ``.venv/bin/python scripts/bench_head_loss.py`` (~8-10 min on 2 cores; ``--repeats`` to change;
``--rows usual,lowmem-auto,planned --repeats 7``: a longer timing of the rows the targets rest on, ~5 min).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lowmem  # noqa: E402
from lowmem.profiler import measure_peak  # noqa: E402
from lowmem.profiler.peak import AllocationTracker  # noqa: E402
from lowmem.run.files import measured_on  # noqa: E402

MB = 1e6
LR, BETAS, EPS = 1e-4, (0.9, 0.999), 1e-8
ADAM = ["trainer.device=cpu", "optim.name=adam", f"optim.lr={LR}", f"optim.betas=[{BETAS[0]},{BETAS[1]}]",
        f"optim.eps={EPS}", "optim.weight_decay=0"]  # fmt: skip
LOWMEM = [*ADAM, "precision=bf16", "checkpointing.strategy=residual", "optim.state_bits=8"]
PLANNED_NAME = "lowmem planned at the usual stack's peak / 3"


def llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


@dataclasses.dataclass
class Row:
    """One configuration: its training step and what the measurement needs to know of it."""

    name: str
    step: Callable[[], object]
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    owners: tuple
    arithmetic: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    measured_step: Callable[[], object] | None = None  # the step under measure_peak, when not ``step``
    peak: object = None  # PeakMeasurement
    seconds: float = float("nan")  # median wall-clock step
    fastest: float = float("nan")  # fastest wall-clock step
    accounted_bytes: int | None = None
    budget_total_bytes: int | None = None  # the accounted total with the step's temporaries (what a plan compares)


def allocation_peak(profile: torch.profiler.profile) -> int:
    """The most bytes ``profile``'s CPU allocations held at once above what was allocated when it
    started (its memory events in time order; frees of older storages are not reported)."""
    events = [event for event in profile.profiler.kineto_results.events() if event.name() == "[memory]"]
    held = peak = 0
    for event in sorted(events, key=lambda event: event.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak


def profiled_update(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` inside ``measure_peak``, outside its tracker's dispatch mode (``torch.compile``
    cannot run under one): the tracker's peak becomes at least the bytes live when the update starts
    plus the most the update allocated at once, as ``torch.profiler`` records it."""
    from torch.utils._python_dispatch import _disable_current_modes  # private: no public way to step out

    with _disable_current_modes() as modes:
        tracker = next((mode for mode in modes if isinstance(mode, AllocationTracker)), None)
        if tracker is None:  # not being measured
            optimizer.step()
            return
        live = dict(tracker.live)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            optimizer.step()
    extra = allocation_peak(prof)
    if sum(live.values()) + extra > tracker.peak_bytes:
        tracker.peak_bytes = sum(live.values()) + extra
        tracker.breakdown = {**live, "temporary": live["temporary"] + extra}
        tracker.location = "optimizer: compiled update (torch.profiler's allocations)"


def eight_bit_adamw(params) -> tuple[torch.optim.Optimizer, str, bool]:
    """torchao's AdamW8bit, or torch's AdamW when torchao cannot be imported (and a label that says so)."""
    try:
        from torchao.optim import AdamW8bit
    except Exception as error:  # noqa: BLE001 - any import failure: say it, fall back
        print(f"torchao cannot be imported ({type(error).__name__}: {error}); the usual stack's rows use "
              "torch.optim.AdamW (its state in the weights' dtype, BF16) instead", file=sys.stderr)  # fmt: skip
        optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
        return optimizer, "torch AdamW (torchao NOT installed)", False
    optimizer = AdamW8bit(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    return optimizer, "torchao AdamW8bit", True


def plain_row(batch: torch.Tensor) -> Row:
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        lm_loss(model, batch).backward()
        optimizer.step()

    return Row("plain PyTorch: FP32, torch AdamW", step, model, optimizer, (model, optimizer, batch))


def usual_row(batch: torch.Tensor, microbatch: int | None) -> Row:
    model = llama().to(torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.train()
    optimizer, label, compiled = eight_bit_adamw(model.parameters())
    parts = batch.split(microbatch) if microbatch else (batch,)

    def step(update: Callable[[], None] = optimizer.step) -> None:
        optimizer.zero_grad(set_to_none=True)
        for part in parts:  # each loss weighted by its share of the sequences (all of one length)
            (lm_loss(model, part) * (part.shape[0] / batch.shape[0])).backward()
        update()

    name = f"usual stack: pure BF16 + HF checkpointing + {label}"
    if microbatch:
        name += f", gradient accumulation over microbatches of {microbatch}"
    measured = (lambda: step(lambda: profiled_update(optimizer))) if compiled else None
    return Row(name, step, model, optimizer, (model, optimizer, batch), measured_step=measured)


def lowmem_row(name: str, batch: torch.Tensor, overrides: list[str]) -> Row:
    run = lowmem.prepare(llama(), lm_loss, batch, overrides=overrides)
    trainer = run.trainer
    row = Row(name, lambda: run.step(batch), trainer.unwrapped_model, run.optimizer, (trainer, batch),
              arithmetic=trainer.arithmetic)  # fmt: skip
    profiled = run.profile(measure=False)
    row.accounted_bytes, row.budget_total_bytes = profiled["total_bytes"], profiled["budget_total_bytes"]
    return row


def planned_row(batch: torch.Tensor, budget_mb: float) -> tuple[Row | None, list[str]]:
    """The planner's choice at ``budget_mb`` and what to say of it (planning time, overrides, or its refusal)."""
    started = time.perf_counter()
    try:
        plan = lowmem.plan(llama(), lm_loss, batch, budget_mb=budget_mb, overrides=ADAM)
    except Exception as error:  # noqa: BLE001 - a refusal (or a failure) is reported as it came
        seconds = time.perf_counter() - started
        return None, [f"lowmem.plan at {budget_mb:.1f} MB: no plan after {seconds:.0f} s: "
                      f"{type(error).__name__}: {str(error).splitlines()[0]}"]  # fmt: skip
    seconds = time.perf_counter() - started
    chosen = [o for o in plan["overrides"] if o not in ADAM]
    lines = [f"lowmem.plan at {budget_mb:.1f} MB took {seconds:.0f} s; it chose {' '.join(chosen)} "
             f"(accounted {plan['total_bytes'] / MB:.1f} MB, {plan['budget_total_bytes'] / MB:.1f} MB with the step's "
             f"temporaries, measured {plan['peak_bytes'] / MB:.1f} MB by the plan's verification)"]  # fmt: skip
    return lowmem_row(PLANNED_NAME, batch, list(plan["overrides"])), lines


def wrapped_state_excess(optimizer: torch.optim.Optimizer) -> int:
    """Bytes by which the CPU tracker overcounts ``optimizer``'s state held in wrapper tensor subclasses
    (torchao's ``OptimState8bit``): it counts such a tensor at its outer dtype's size (BF16: 2 bytes a
    value) where its inner tensors hold 1 byte a value and a scale per block. Their difference, which
    stays the same throughout a step (the state is updated in place)."""
    outer, inner = {}, {}
    for state in optimizer.state.values():
        for value in state.values():
            if type(value) is torch.Tensor or not hasattr(value, "__tensor_flatten__"):
                continue
            outer[value.untyped_storage()._cdata] = value.untyped_storage().nbytes()
            for name in value.__tensor_flatten__()[0]:
                storage = getattr(value, name).untyped_storage()
                inner[storage._cdata] = storage.nbytes()
    return sum(outer.values()) - sum(inner.values())


def measure(row: Row, batch: torch.Tensor) -> None:
    """The measured peak of one whole step (after the row's warm-up step, so its optimizer state exists)."""
    peak = measure_peak(row.measured_step or row.step, row.model, row.optimizer, data=[batch], owners=row.owners,
                        arithmetic=row.arithmetic())  # fmt: skip
    excess = wrapped_state_excess(row.optimizer)
    breakdown = {**peak.breakdown, "optimizer_state": peak.breakdown.get("optimizer_state", 0) - excess}
    row.peak = dataclasses.replace(peak, peak_bytes=peak.peak_bytes - excess, breakdown=breakdown)


def report_peak(row: Row) -> None:
    """On stderr: the row's measured peak, where it is and what it holds then (MB)."""
    held = ", ".join(f"{key} {value / MB:.1f}" for key, value in row.peak.breakdown.items() if value >= MB / 10)
    print(f"{row.name}: {row.peak.peak_bytes / MB:.1f} MB at {row.peak.location} ({held})", file=sys.stderr, flush=True)


def time_round_robin(rows: list[Row], repeats: int) -> None:
    """Each row's median and fastest step (wall-clock) over ``repeats`` rounds; in each round every row
    runs one untimed step, then one timed (the untimed step gives the row its memory back after another
    row's). The fastest is what other processes on a shared machine disturb least: they only add time."""
    times: dict[str, list[float]] = {row.name: [] for row in rows}
    for _ in range(repeats):
        for row in rows:
            row.step()
            started = time.perf_counter()
            row.step()
            times[row.name].append(time.perf_counter() - started)
    for row in rows:
        row.seconds, row.fastest = statistics.median(times[row.name]), min(times[row.name])


def table(rows: list[Row], usual: Row) -> list[str]:
    lines = ["| row | measured peak | ratio to the usual stack | step (median) | time ratio to the usual stack | "
             "fastest step | its ratio | lowmem's accounted total (with the step's temporaries) | where the peak is |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        accounted = "-"
        if row.accounted_bytes is not None:
            accounted = f"{row.accounted_bytes / MB:.1f} MB ({row.budget_total_bytes / MB:.1f} MB)"
        lines.append(
            f"| {row.name} | {row.peak.peak_bytes / MB:.1f} MB | {row.peak.peak_bytes / usual.peak.peak_bytes:.2f} | "
            f"{row.seconds:.2f} s | {row.seconds / usual.seconds:.2f} | {row.fastest:.2f} s | "
            f"{row.fastest / usual.fastest:.2f} | {accounted} | {row.peak.location} |"
        )
    return lines


def targets(rows: list[Row], usual: Row, planned: Row | None, budget_mb: float, plan_run: bool) -> list[str]:
    """Issue 47's two targets on this model, each with the figures it is judged on."""
    ours = [row for row in rows if row.name.startswith("lowmem")]
    if not ours:
        return []
    lowest = min(ours, key=lambda row: row.peak.peak_bytes)
    memory, seconds = lowest.peak.peak_bytes / usual.peak.peak_bytes, lowest.seconds / usual.seconds
    fastest = lowest.fastest / usual.fastest
    holds = memory <= 1 / 3 and seconds <= 1.5
    lines = [f"Target: lowmem's lowest measured peak <= 1/3 of the usual stack's at a step time <= 1.5x it: "
             f"{'holds' if holds else 'does NOT hold'} ({lowest.name}: {memory:.2f}x the peak, {seconds:.2f}x the "
             f"median step, {fastest:.2f}x the fastest)."]  # fmt: skip
    if not plan_run:
        return lines
    planned_target = f"Target: the plan at the usual stack's peak / 3 ({budget_mb:.1f} MB) measures within it: "
    if planned is None:
        lines.append(planned_target + "does NOT hold (no plan).")
    else:
        verdict = "holds" if planned.peak.peak_bytes <= budget_mb * MB else "does NOT hold"
        lines.append(planned_target + f"{verdict} ({planned.peak.peak_bytes / MB:.1f} MB).")
    return lines


def builders(batch: torch.Tensor) -> dict[str, Callable[[], Row]]:
    """The rows but the planned one, by key (``--rows``), in the table's order."""
    auto = [*LOWMEM, "loss.chunk_tokens=auto"]
    return {
        "plain": lambda: plain_row(batch),
        "usual": lambda: usual_row(batch, None),
        "usual-accumulate": lambda: usual_row(batch, 1),
        "lowmem-auto": lambda: lowmem_row("lowmem: BF16 + residual + 8-bit Adam, loss.chunk_tokens=auto", batch, auto),
        "lowmem-none": lambda: lowmem_row("lowmem: BF16 + residual + 8-bit Adam, loss.chunk_tokens=none", batch,
                                          [*LOWMEM, "loss.chunk_tokens=none"]),
        "lowmem-microbatch": lambda: lowmem_row("lowmem: as chunk auto + true microbatches of 1", batch,
                                                [*auto, "microbatch.size=1", "microbatch.mode=true"]),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per row (round robin)")
    parser.add_argument("--batch", type=int, default=8, help="sequences of 256 tokens")
    parser.add_argument(
        "--rows",
        default="plain,usual,usual-accumulate,lowmem-auto,lowmem-none,lowmem-microbatch,planned",
        help="comma-separated rows to run (the usual stack, every ratio's base, always runs)",
    )
    args = parser.parse_args(argv)
    print(measured_on("cpu"), flush=True)
    command = "python scripts/bench_head_loss.py" + "".join(f" {shlex.quote(a)}" for a in (argv or sys.argv[1:]))
    batch = torch.randint(0, 32000, (args.batch, 256), generator=torch.Generator().manual_seed(1))
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    wanted = {"usual", *args.rows.split(",")}
    known = builders(batch)
    unknown = wanted - set(known) - {"planned"}
    if unknown:
        parser.error(f"--rows: unknown {sorted(unknown)}; allowed: {', '.join([*known, 'planned'])}")

    rows = [build() for key, build in known.items() if key in wanted]
    for row in rows:  # warm-up (torchao compiles its update here), then the measured step
        row.step()
        measure(row, batch)
        report_peak(row)
    usual = next(row for row in rows if row.name.startswith("usual stack") and "accumulation" not in row.name)
    budget_mb = usual.peak.peak_bytes / MB / 3
    planned, plan_lines = planned_row(batch, budget_mb) if "planned" in wanted else (None, [])
    if planned is not None:
        planned.step()
        measure(planned, batch)
        report_peak(planned)
        rows.append(planned)
        verdict = "within" if planned.peak.peak_bytes <= budget_mb * MB else "OVER"
        plan_lines.append(f"its measured peak {planned.peak.peak_bytes / MB:.1f} MB is {verdict} the budget "
                          f"({planned.peak.peak_bytes / MB / budget_mb:.2f}x)")  # fmt: skip
    time_round_robin(rows, args.repeats)

    lines = [
        "",
        f"Command: `{command}`; Llama-shaped (vocabulary 32,000, hidden 256, MLP 688, 4 layers, 8 heads / 2 "
        f"key-value heads, {sum(p.numel() for p in llama().parameters()) / 1e6:.1f} M parameters), batch "
        f"{args.batch} x 256 tokens, labels=input_ids; Adam lr {LR}, betas {BETAS}, no weight decay. Memory: "
        "measure_peak around one whole step (forward, backward, optimizer) after one warm-up step; step: median "
        f"(and fastest) of {args.repeats} round-robin steps per row. Whole run {time.perf_counter() - started:.0f} s; "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after.",
        "",
        *table(rows, usual),
        "",
        *plan_lines,
        *targets(rows, usual, planned, budget_mb, "planned" in wanted),
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
