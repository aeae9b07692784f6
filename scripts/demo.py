"""``make demo``: the whole idea on the embedded digits data, on this machine, in minutes.

Trains WRN-28-2 twice through the CLI, as a user would — the dense FP32 baseline and the report's
full combination (density 0.3, 16-bit weights, true microbatches of 10, residual_star every 2) —
prints a Table-3-style comparison (accounted memory, measured peak, reduction, accuracy, time) and
writes the Pareto table and plot (``python -m lowmem.report``) beside the runs.

BF16 stands in for FP16 on a CPU (no loss scaling needed; ``precision.cpu_compute=auto`` computes
either at FP32's speed where the CPU's 16-bit kernels are slow); on a GPU the full combination uses
FP16, as in the report. ``--tiny``: WRN-10-1 on fake data for a few steps
(what ``make gpu-report TINY=1`` runs on a CPU).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from lowmem.run.files import measured_on

ROOT = Path(__file__).resolve().parents[1]

SHORT_RUN = [
    "+recipe=wrn_cifar",
    "data=digits",
    "trainer.epochs={epochs}",
    "optim.milestones=[{m1},{m2}]",
    "trainer.progress=lines",
    "trainer.log_every=20",
]


def configurations(sixteen_bit: str) -> dict[str, list[str]]:
    return {
        "dense FP32 baseline": ["precision=fp32"],
        f"density 0.3 + {sixteen_bit.upper()} + microbatch 10 + residual_star 2": [
            "sparsity.density=0.3",
            f"precision={sixteen_bit}",
            "microbatch.size=10",
            "microbatch.mode=true",
            "checkpointing.strategy=residual_star",
            "checkpointing.every=2",
        ],
    }


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, text=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "outputs" / "demo"))
    parser.add_argument("--only-baseline", action="store_true", help="train the dense FP32 baseline only")
    parser.add_argument("--tiny", action="store_true", help="WRN-10-1 on fake data, 4 steps: the path in seconds")
    args = parser.parse_args()
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    if args.tiny:
        args.epochs = 1
    sixteen_bit = "fp16" if _cuda() else "bf16"
    short = [a.format(epochs=args.epochs, m1=args.epochs // 2, m2=(3 * args.epochs) // 4) for a in SHORT_RUN]
    if args.tiny:
        short = [a for a in short if a != "data=digits"] + [
            "data=fake", "data.train_size=80", "data.test_size=40", "data.batch_size=20", "model.depth=10",
            "model.width=1", "trainer.max_steps=4",
        ]
    rows = []
    started = time.perf_counter()
    for index, (label, overrides) in enumerate(configurations(sixteen_bit).items()):
        if args.only_baseline and index > 0:
            break
        run_dir = Path(args.out) / f"run{index}"
        print(f"== training: {label}", flush=True)
        out = run(["-m", "lowmem.train", *short, *overrides, f"hydra.run.dir={run_dir}"])
        if out.returncode != 0:
            raise SystemExit(f"training failed:\n{out.stderr[-3000:]}")
        result = json.loads((run_dir / "result.json").read_text())
        rows.append((label, result["memory"], result))
        print(
            f"   best test accuracy {result['best_test_acc']:.2f}%, final {result['final_test_acc']:.2f}%, "
            f"{result['wall_s']:.0f}s of training",
            flush=True,
        )
    print_table(rows)
    # The same runs through the Pareto report: pareto.md and pareto.png beside them.
    out = run(["-m", "lowmem.report", args.out])
    if out.returncode != 0:
        raise SystemExit(f"lowmem.report failed:\n{out.stderr[-3000:]}")
    print(f"\ndemo wall time {time.perf_counter() - started:.0f}s; run directories, pareto.md and pareto.png "
          f"under {args.out}")


def print_table(rows) -> None:
    """Accounted memory (the report's definition) and the run's measured peak (training steps and
    evaluation: ``result.json``'s ``peak_bytes``), each with its reduction against the baseline."""
    base, base_peak = rows[0][1]["total_bytes"], rows[0][2].get("peak_bytes")
    device = rows[0][2]["provenance"].get("device", "?")
    print(
        f"\n| configuration | accounted memory (reduction) | measured peak, {device} (reduction) | best test acc "
        "| final test acc | train time |"
    )
    print("|---|---|---|---|---|---|")
    for label, memory, result in rows:
        peak = result.get("peak_bytes")
        measured = "n/a" if peak is None or base_peak is None else f"{peak / 1e6:.1f} MB ({base_peak / peak:.1f}x)"
        print(
            f"| {label} | {memory['total_bytes'] / 1e6:.1f} MB ({base / memory['total_bytes']:.1f}x) | {measured} | "
            f"{result['best_test_acc']:.2f}% | {result['final_test_acc']:.2f}% | {result['wall_s']:.0f} s |"
        )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
