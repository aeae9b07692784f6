"""Sharded training (``trainer.parallel=fsdp``) measured on this machine, as a user runs it: through
``torchrun --standalone`` and the CLI, on CPU with gloo.

- **memory**: rank 0's ``lowmem.profile`` row (its shards of the model and optimizer state, its share
  of the minibatch's activations, the weights gathered at once, the measured peak of one real step)
  at 1, 2 and 4 ranks, for WRN-28-2 dense FP32, the report's full combination on WRN-28-2 (density
  0.3, FP16, true microbatches of 10, residual_star every 2) and DynamicConv (density 0.5, FP16, Adam
  with 8-bit state), each at the same global minibatch;
- **accuracy**: WRN-28-2 on the embedded digits, the full combination (BF16 on a CPU, as ``make
  demo``), in one process against 2 ranks with ``fsdp``, over ``--seeds``; the best test accuracy.
  Runs are kept under ``--out`` and skipped when finished before.

Usage::

    .venv/bin/python scripts/bench_fsdp.py [--part memory|accuracy|all] [--ranks 1 2 4] [--seeds 0 1 2]

Each rank of a run is a process with one thread: on a machine with fewer cores than ranks they take
turns, so the times are not the point; the bytes are.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lowmem.run.files import measured_on  # noqa: E402

MB = 1e6
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
WRN = ["+recipe=wrn_cifar", "data=fake", "data.batch_size=20", "trainer.device=cpu"]
COMBINATION = ["sparsity.density=0.3", "microbatch.size=10", "microbatch.mode=true",
               "checkpointing.strategy=residual_star", "checkpointing.every=2"]  # fmt: skip
MEMORY_CASES = {
    "WRN-28-2, FP32 dense, SGD": WRN,
    "WRN-28-2, FP16, density 0.3, microbatch 10, residual_star every 2": [*WRN, "precision=fp16", *COMBINATION],
    "DynamicConv, FP16, density 0.5, Adam 8-bit state, microbatch 250 tokens, residual every 1": [
        "+recipe=dc_iwslt", "data=fake", "trainer.device=cpu", "precision=fp16", "sparsity.density=0.5",
        "optim.state_bits=8", "microbatch.size=250", "checkpointing.strategy=residual", "checkpointing.every=1",
    ],
}  # fmt: skip


def launch(module: str, overrides: list[str], ranks: int, log: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m module`` in one process (``ranks`` 1) or under torchrun with ``trainer.parallel=fsdp``."""
    if ranks == 1:
        command = [sys.executable, "-m", module, *overrides]
    else:
        command = [TORCHRUN, "--standalone", f"--nproc_per_node={ranks}", "-m", module, *overrides,
                   "trainer.parallel=fsdp"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, text=True, capture_output=True, env=env)
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    return done


def profile_row(overrides: list[str], ranks: int, measure: bool) -> dict:
    """Rank 0's ``lowmem.profile`` JSON row (the last line it prints)."""
    extra = [] if measure else ["profile.measure_peak=false"]
    done = launch("lowmem.profile", [*overrides, *extra], ranks)
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        raise SystemExit(f"lowmem.profile on {ranks} rank(s) failed:\n{done.stderr[-3000:]}")
    return json.loads(rows[-1])


def memory_part(ranks: list[int], measure: bool, cases: list[str]) -> dict:
    print("\n| configuration | ranks | model MB | optimizer MB | model + optimizer (vs 1) | activations MB | "
          "accounted total MB | gathered MB | measured peak MB (vs 1) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    figures: dict[str, dict[int, dict]] = {}
    for name, overrides in MEMORY_CASES.items():
        if cases and not any(case in name for case in cases):
            continue
        figures[name] = {}
        for count in ranks:
            row = profile_row(overrides, count, measure)
            figures[name][count] = row
            one = figures[name][ranks[0]]
            state, state_one = (r["model_bytes"] + r["optimizer_bytes"] for r in (row, one))
            peak = row.get("peak_bytes")
            shown_peak = "n/a" if peak is None else f"{peak / MB:.2f} ({peak / one['peak_bytes']:.2f}x)"
            gathered = row.get("gathered_bytes") or 0
            print(f"| {name if count == ranks[0] else ''} | {count} | {row['model_bytes'] / MB:.2f} | "
                  f"{row['optimizer_bytes'] / MB:.2f} | {state / MB:.2f} ({state / state_one:.2f}x) | "
                  f"{row['activation_bytes'] / MB:.2f} | {row['total_bytes'] / MB:.2f} | {gathered / MB:.2f} | "
                  f"{shown_peak} |", flush=True)  # fmt: skip
    return figures


def accuracy_part(out: Path, seeds: list[int], epochs: int) -> dict:
    milestones = f"optim.milestones=[{epochs // 2},{3 * epochs // 4}]"
    overrides = ["+recipe=wrn_cifar", "data=digits", "precision=bf16", *COMBINATION, f"trainer.epochs={epochs}",
                 milestones, "trainer.progress=none"]  # fmt: skip
    figures: dict[int, list[float]] = {1: [], 2: []}
    for seed in seeds:  # seed by seed: an interrupted sweep still compares
        for ranks in (1, 2):
            run_dir = out / f"wrn-combination-ranks{ranks}-seed{seed}"
            result = run_dir / "result.json"
            if not result.exists():
                started = time.perf_counter()
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                done = launch("lowmem.train", [*overrides, f"trainer.seed={seed}", f"hydra.run.dir={run_dir}"], ranks,
                              log=out / f"{run_dir.name}.log")  # fmt: skip
                if done.returncode != 0 or not result.exists():
                    raise SystemExit(f"{run_dir.name} failed:\n{done.stderr[-3000:]}")
                print(f"  {run_dir.name}: {time.perf_counter() - started:.0f} s", flush=True)
            figures[ranks].append(float(json.loads(result.read_text())["best_test_acc"]))
    print("\n| WRN-28-2 digits, full combination (BF16) | best test acc % | seeds |\n|---|---|---|")
    for ranks, values in figures.items():
        label = "one process" if ranks == 1 else f"{ranks} ranks, trainer.parallel=fsdp"
        spread = ", ".join(f"{v:.1f}" for v in values)
        print(f"| {label} | {statistics.mean(values):.2f} [{spread}] | {', '.join(map(str, seeds))} |")
    gap = statistics.mean(figures[2]) - statistics.mean(figures[1])
    print(f"\n2 ranks - one process: {gap:+.2f} points (mean over {len(seeds)} seeds)")
    return {str(k): v for k, v in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("memory", "accuracy", "all"), default="all")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--no-measure", action="store_true", help="memory: the accounting only, no real step")
    parser.add_argument("--case", nargs="+", default=[], help="memory: only the configurations naming one of these")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=12, help="WRN-28-2 epochs on digits")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_fsdp")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    figures = {}
    if args.part in ("memory", "all"):
        figures["memory"] = memory_part(args.ranks, not args.no_measure, args.case)
    if args.part in ("accuracy", "all"):
        figures["accuracy"] = accuracy_part(args.out, args.seeds, args.epochs)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    main()
