"""Evaluation batch size on this CPU: WRN-28-2's evaluation of the digits test set (500 images)
through the trainer, at ``data.eval_batch_size`` 500, 100 and 50, timed round-robin.

The default of ``data.eval_batch_size`` (100) rests on this: on a CPU a no-grad forward over 500
images at once ran 1.6x slower than in batches of 100 (activations of 65 MB outgrow the caches and
are mapped afresh each time). Prints a markdown table; ``--precision`` and further overrides pick
other configurations (a microbatched run evaluates in its microbatches whatever the knob says).

    .venv/bin/python scripts/bench_evaluation.py [--repeats 5] [--precision fp32] [OVERRIDE ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lowmem.config import compose  # noqa: E402
from lowmem.run.files import measured_on  # noqa: E402
from lowmem.trainer import build_trainer  # noqa: E402
from scripts.bench_memory import median_seconds_round_robin  # noqa: E402

SIZES = (500, 100, 50)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("overrides", nargs="*", help="further lowmem.train overrides")
    args = parser.parse_args(argv)
    print(measured_on(), f"| {torch.get_num_threads()} threads", flush=True)
    base = ["+recipe=wrn_cifar", "data=digits", "trainer.progress=none", "trainer.device=cpu",
            f"precision={args.precision}", *args.overrides]  # fmt: skip
    trainers = {size: build_trainer(compose(*base, f"data.eval_batch_size={size}")) for size in SIZES}
    seconds = median_seconds_round_robin(
        {size: trainer.evaluate for size, trainer in trainers.items()}, args.repeats, torch.device("cpu")
    )
    print(f"\n| data.eval_batch_size | evaluation of {len(trainers[SIZES[0]].data.test.labels)} images, s | "
          f"against batches of {SIZES[1]} |")  # fmt: skip
    print("|---|---|---|")
    for size in SIZES:
        print(f"| {size} | {seconds[size]:.3f} | {seconds[size] / seconds[SIZES[1]]:.2f}x |")


if __name__ == "__main__":
    main()
