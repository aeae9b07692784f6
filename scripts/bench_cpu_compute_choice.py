"""Is ``precision.cpu_compute=auto``'s recorded choice the faster way on this CPU, and how often
would a probe made anew by each process have chosen otherwise?

1. The probe made anew ``--probes`` times per dtype, on one thread as the recorded probe is timed
   (as every process did before the choice was recorded): per kind of op, how often it chose
   native, and the probe's FP32-over-native time ratio (min, median, max; native is kept from
   ``NATIVE_MUST_WIN`` up).
2. The choice recorded for this machine (``probe_choices``: read from ``cpu_compute.json`` in the
   kernel cache, or probed now and recorded there, as a run would).
3. Whole BF16 training steps (WRN-28-2 at batch 100 on fake data unless ``--model`` says
   otherwise; the same first minibatch; one trainer, its choice swapped between steps) under the
   recorded choice, all native, all FP32 and the recorded choice with each kind flipped, timed in
   turn ``--rounds`` times after a warm-up (so that a machine whose load drifts slows every way
   alike); median per way, and its time over the recorded choice's. A way whose warm-up step takes
   over ``SLOW`` times the recorded choice's is not timed further (a reference kernel).

Run it on an idle machine or not, as the question is; restrict an AVX-512 CPU to AVX2 with
``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` (a record of its own: the key holds both).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_cpu_compute_choice.py [--probes 10] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lowmem.config import compose
from lowmem.run.files import measured_on
from lowmem.techniques import cpu_compute
from lowmem.techniques.cpu_compute import KINDS, NATIVE_MUST_WIN, decide, probe_choices, probe_seconds
from lowmem.trainer import build_trainer

MODEL = "+recipe=wrn_cifar data=fake data.batch_size=100 data.train_size=500"
SLOW = 5.0


def probe_rows(dtype: torch.dtype, probes: int) -> list[str]:
    """One row per kind: how often a probe made anew chose native, and its time ratios."""
    natives = dict.fromkeys(KINDS, 0)
    ratios: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(probes):
        times: dict[str, dict[bool, float]] = {kind: {} for kind in KINDS}

        def timed(kind, dtype, fp32, limit=None, times=times):
            times[kind][fp32] = probe_seconds(kind, dtype, fp32, limit=limit)
            return times[kind][fp32]

        with cpu_compute._one_thread():  # as the recorded probe is timed
            decided = decide(dtype, timed)
        for kind, choice in decided.items():
            natives[kind] += choice == "native"
            ratios[kind].append(times[kind][True] / times[kind][False])
    name = str(dtype).removeprefix("torch.")
    return [
        f"| {name} | {kind} | {natives[kind]} of {probes} | {min(ratios[kind]):.2f} / "
        f"{statistics.median(ratios[kind]):.2f} / {max(ratios[kind]):.2f} |"
        for kind in KINDS
    ]


def ways_of(recorded: dict[str, str]) -> dict[str, dict[str, str]]:
    """The recorded choice, all native, all FP32 and each kind flipped alone (duplicates dropped)."""
    flip = {"native": "fp32", "fp32": "native"}
    candidates = {
        "recorded": dict(recorded),
        "all native": dict.fromkeys(KINDS, "native"),
        "all FP32": dict.fromkeys(KINDS, "fp32"),
        **{f"{kind} flipped": {**recorded, kind: flip[recorded[kind]]} for kind in KINDS},
    }
    ways: dict[str, dict[str, str]] = {}
    for name, choice in candidates.items():
        if choice not in ways.values():
            ways[name] = choice
    return ways


def step_rows(model: list[str], recorded: dict[str, str], rounds: int) -> list[str]:
    trainer = build_trainer(compose(*model, "precision=bf16", "trainer.device=cpu", "trainer.progress=none"))
    batch = trainer.example_batch()
    ways = ways_of(recorded)

    def step(choice: dict[str, str]) -> float:
        trainer.cpu_compute = choice
        started = time.perf_counter()
        trainer.train_step(batch)
        return time.perf_counter() - started

    warm = {name: step(choice) for name, choice in ways.items()}
    too_slow = {name for name, seconds in warm.items() if seconds > SLOW * warm["recorded"]}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, choice in ways.items():
            if name not in too_slow:
                times[name].append(step(choice))
    base = statistics.median(times["recorded"])
    rows = []
    for name, choice in ways.items():
        described = ", ".join(f"{kind} {choice[kind]}" for kind in KINDS)
        if name in too_slow:
            rows.append(f"| {name} | {described} | warm-up {warm[name]:.3f} s | > {SLOW:g}x |")
        else:
            seconds = statistics.median(times[name])
            rows.append(f"| {name} | {described} | {seconds:.3f} s | {seconds / base:.2f}x |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probes", type=int, default=10, help="probes made anew per dtype")
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per way")
    parser.add_argument("--model", default=MODEL, help="overrides of the model stepped (BF16 is added)")
    parser.add_argument("--no-steps", action="store_true", help="only the probes and the recorded choice")
    args = parser.parse_args()
    print(measured_on("cpu"), flush=True)
    print(f"\n| dtype | kind | chose native | FP32 / native on the probe (min / median / max; native from "
          f"{NATIVE_MUST_WIN}) |\n|---|---|---|---|")  # fmt: skip
    for dtype in (torch.bfloat16, torch.float16):
        print("\n".join(probe_rows(dtype, args.probes)), flush=True)
    recorded = dict(probe_choices(torch.bfloat16))
    record = cpu_compute.kernel_cache.cache_dir() / cpu_compute.RECORD
    print(f"\nrecorded for BF16 ({torch.get_num_threads()} threads, {record}): "
          f"{', '.join(f'{kind} {choice}' for kind, choice in recorded.items())}")  # fmt: skip
    if args.no_steps:
        return
    print(f"\n| BF16 step ({args.model}) | choice | median of {args.rounds} | vs recorded |\n|---|---|---|---|")
    print("\n".join(step_rows(args.model.split(), recorded, args.rounds)))


if __name__ == "__main__":
    main()
