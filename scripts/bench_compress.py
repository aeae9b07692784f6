"""Compressed saved activations (``checkpointing.compress``) against keeping them: memory, the planner, accuracy.

Three parts (``--part memory|planner|accuracy|all``):

- **memory**: WRN-28-2 (FP32 and BF16, batch 100) and torchvision's resnet18 (``+recipe=vision``, FP32,
  batch 100) with ``checkpointing.compress=none|8|4|2`` alone: the stored activations
  (``activation_saved_bytes``: what autograd holds for backward at most, compressed bytes at their
  stored size), the accounted activations, and, FP32, the measured peak of one real step
  (``peak_bytes``, the CPU tracker) and the step's seconds; each against keeping them.
- **planner**: WRN-28-2 FP32 batch 100 at residual_star every 2's own accounted activations (the
  budget the README's optimal-checkpointing table uses): ``checkpointing.strategy=optimal`` with
  recomputation only, and with compression allowed down to 8, 4 and 2 bits — the schedule, accounted
  activations, FLOPs (quantization passes included) and the seconds of real steps.
- **accuracy**: WRN-28-2 BF16 on the embedded digits with saved activations uncompressed, 8-, 4- and
  2-bit, and the small DynamicConv on the embedded phrases (as ``scripts/bench_state_bits.py``, without
  checkpointing) uncompressed and 8-bit, over ``--seeds``, through the CLI as a user runs them. Runs are kept under
  ``--out`` (a finished run is not trained again).

Prints Markdown tables; ``--json`` also writes the figures.

    .venv/bin/python scripts/bench_compress.py [--part memory] [--seeds 0 1 2] [--epochs 12]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lowmem.run.files import measured_on  # noqa: E402
from scripts.bench_state_bits import SMALL_DC, train  # noqa: E402

MB = 1e6
WIDTHS = ("none", "8", "4", "2")
WRN = ["+recipe=wrn_cifar", "data=fake", "data.batch_size=100", "trainer.device=cpu"]
RESNET18 = ["+recipe=vision", "model.arch=resnet18", "data=fake", "data.batch_size=100", "trainer.device=cpu"]


def profile(overrides: list[str], measure: bool) -> dict:
    from lowmem.config import compose
    from lowmem.profile import profile_config

    return profile_config(compose(*overrides), measure=measure)


def step_seconds(overrides: list[str], steps: int = 2) -> float:
    """Seconds per real training step (after one warm-up step) of the configuration."""
    from lowmem.config import compose
    from lowmem.trainer import build_trainer

    trainer = build_trainer(compose(*overrides))
    batch = trainer.example_batch()
    trainer.train_step(batch)
    started = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(batch)
        trainer.state.step += 1
    return (time.perf_counter() - started) / steps


def memory_part() -> dict:
    cases = {
        "WRN-28-2, FP32, batch 100": (WRN, True),
        "WRN-28-2, BF16, batch 100": ([*WRN, "precision=bf16"], False),
        "resnet18, FP32, batch 100": (RESNET18, True),
        "resnet18, BF16, batch 100": ([*RESNET18, "precision=bf16"], False),
    }
    figures = {}
    print("\n| model | compress | stored activations MB (fewer) | accounted activations MB | measured peak MB "
          "(lower) | step s |\n|---|---|---|---|---|---|")  # fmt: skip
    for name, (overrides, measure) in cases.items():
        rows = {}
        for width in WIDTHS:
            row = profile([*overrides, f"checkpointing.compress={width}"], measure)
            rows[width] = {
                "saved_mb": row["activation_saved_bytes"] / MB,
                "compressed_mb": row["compressed_bytes"] / MB,
                "activation_mb": row["activation_bytes"] / MB,
                "peak_mb": None if row["peak_bytes"] is None else row["peak_bytes"] / MB,
                "step_s": row["seconds"].get("measured_step"),
                "flops": row["flops"],
            }
            kept = rows["none"]
            saved = f"{rows[width]['saved_mb']:.1f} ({kept['saved_mb'] / rows[width]['saved_mb']:.2f}x)"
            peak = "n/a"
            if rows[width]["peak_mb"] is not None:
                peak = f"{rows[width]['peak_mb']:.1f} ({kept['peak_mb'] / rows[width]['peak_mb']:.2f}x)"
            seconds = "n/a" if rows[width]["step_s"] is None else f"{rows[width]['step_s']:.1f}"
            print(f"| {name} | {width} | {saved} | {rows[width]['activation_mb']:.1f} | {peak} | {seconds} |",
                  flush=True)  # fmt: skip
        figures[name] = rows
    return figures


def planner_part(timed_steps: int = 2) -> dict:
    star = profile([*WRN, "checkpointing.strategy=residual_star", "checkpointing.every=2"], False)
    budget = math.ceil(star["activation_bytes"] / MB * 1e6) / 1e6  # MB, rounded up to the byte
    print(f"\nWRN-28-2 FP32 batch 100, optimal within residual_star every 2's accounted {budget:.6f} MB "
          f"(residual_star/2 itself: {star['flops'] / 1e9:.1f} GFLOP)")  # fmt: skip
    print("\n| compression allowed | schedule | accounted activations MB | GFLOP (vs recompute-only) | step s |"
          "\n|---|---|---|---|---|")  # fmt: skip
    figures = {"budget_mb": budget, "residual_star_2_flops": star["flops"]}
    for width in WIDTHS:
        overrides = [*WRN, "checkpointing.strategy=optimal", f"checkpointing.budget_mb={budget}",
                     f"checkpointing.compress={width}"]  # fmt: skip
        with _logged_schedule() as logged:
            row = profile(overrides, False)
        schedule = logged[-1] if logged else "?"
        seconds = step_seconds(overrides, timed_steps) if timed_steps else None
        figures[width] = {"flops": row["flops"], "activation_mb": row["activation_bytes"] / MB,
                          "schedule": schedule, "step_s": seconds}  # fmt: skip
        ratio = row["flops"] / figures["none"]["flops"]
        shown = "n/a" if seconds is None else f"{seconds:.1f}"
        print(f"| {width} | `{schedule}` | {row['activation_bytes'] / MB:.1f} | {row['flops'] / 1e9:.1f} "
              f"({ratio:.2f}x) | {shown} |", flush=True)  # fmt: skip
    return figures


@contextlib.contextmanager
def _logged_schedule() -> Iterator[list[str]]:
    """The schedules ``checkpointing.strategy=optimal`` logs while the body builds trainers."""
    found: list[str] = []

    class Schedules(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("checkpointing optimal within"):
                found.append(message.split(": ", 1)[1].split(" (accounted")[0])

    handler, logger = Schedules(), logging.getLogger("lowmem")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def accuracy_part(out: Path, seeds: list[int], epochs: int, dc_steps: int) -> dict:
    milestones = f"optim.milestones=[{epochs // 2},{3 * epochs // 4}]"
    experiments = {
        "WRN-28-2 digits, BF16": (["+recipe=wrn_cifar", "data=digits", "precision=bf16",
                                   f"trainer.epochs={epochs}", milestones], "best_test_acc", WIDTHS),  # fmt: skip
        # Without checkpointing (phrases need little memory): every block's activations are then
        # compressed (residual checkpointing would leave only the blocks' inputs, kept exactly).
        "DynamicConv phrases, BF16, Adam": (["+recipe=dc_iwslt", *SMALL_DC, f"trainer.max_steps={dc_steps}",
                                             "checkpointing.strategy=none"], "bleu", ("none", "8")),  # fmt: skip
    }
    figures: dict[str, dict[str, list[float]]] = {name: {w: [] for w in e[2]} for name, e in experiments.items()}
    for seed in seeds:  # seed by seed: an interrupted sweep still compares
        for name, (overrides, metric, widths) in experiments.items():
            slug = "wrn" if name.startswith("WRN") else "dc"
            for width in widths:
                run_dir = out / f"{slug}-compress{width}-seed{seed}"
                result = train(run_dir, [*overrides, f"checkpointing.compress={width}", f"trainer.seed={seed}"])
                figures[name][width].append(float(result[metric]))
    print("\n| run | metric | none | 8-bit | 4-bit | 2-bit | seeds |\n|---|---|---|---|---|---|---|")
    for name, rows in figures.items():
        metric = "BLEU" if "DynamicConv" in name else "best test acc %"
        cells = []
        for width in WIDTHS:
            if width not in rows or not rows[width]:
                cells.append("n/a")
                continue
            mean = statistics.mean(rows[width])
            delta = "" if width == "none" else f" ({mean - statistics.mean(rows['none']):+.2f})"
            cells.append(f"{mean:.2f}{delta} [{', '.join(f'{v:.1f}' for v in rows[width])}]")
        print(f"| {name} | {metric} | {' | '.join(cells)} | {', '.join(map(str, seeds))} |")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("memory", "planner", "accuracy", "all"), default="all")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=12, help="WRN-28-2 epochs on digits")
    parser.add_argument("--dc-steps", type=int, default=400, help="DynamicConv updates on phrases")
    parser.add_argument("--timed-steps", type=int, default=2, help="planner: real steps timed per schedule (0: none)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_compress")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    figures = {}
    if args.part in ("memory", "all"):
        figures["memory"] = memory_part()
    if args.part in ("planner", "all"):
        figures["planner"] = planner_part(args.timed_steps)
    if args.part in ("accuracy", "all"):
        figures["accuracy"] = accuracy_part(args.out, args.seeds, args.epochs, args.dc_steps)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
