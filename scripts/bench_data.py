"""Is the data pipeline fast enough? Its training images/s beside WRN-28-2's, on this machine's CPU.

The pipeline (gather a shuffled batch, crop after zero padding, flip, normalise; batch 100, FP32)
must outrun the model's training step (forward + backward + SGD, FP32, batch 100) by at least
20x, so that data never shows in a training profile. Prints a markdown table.

Also times one DSR rewiring of WRN-28-2 (its cost against the training steps between rewirings).

    python scripts/bench_data.py [--images 10000] [--steps 5] [--warmup 2] [--rewirings 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lowmem.run.files import measured_on  # noqa: E402
from recipes.wrn_cifar.data import DeviceBatches, channel_stats  # noqa: E402
from recipes.wrn_cifar.model import WideResNet  # noqa: E402

BATCH_SIZE = 100
REQUIRED_RATIO = 20


def pipeline_images_per_second(num_images: int, epochs: int = 3) -> float:
    """Training images/s of ``DeviceBatches`` over CIFAR-sized random uint8 images (one warm-up epoch)."""
    images = torch.randint(0, 256, (num_images, 3, 32, 32), dtype=torch.uint8)
    labels = torch.randint(0, 10, (num_images,))
    mean, std = channel_stats(images)
    batches = DeviceBatches(images, labels, BATCH_SIZE, mean=mean, std=std, train=True, seed=0)
    for _ in batches.epoch(0):
        pass
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        for _ in batches.epoch(epoch):
            pass
    return epochs * len(batches) * BATCH_SIZE / (time.perf_counter() - start)


def model_images_per_second(steps: int, warmup: int) -> float:
    """Training images/s of WRN-28-2 (forward + backward + SGD-Nesterov step, FP32, batch 100)."""
    model = WideResNet(depth=28, width=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    inputs = torch.randn(BATCH_SIZE, 3, 32, 32)
    targets = torch.randint(0, 10, (BATCH_SIZE,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * BATCH_SIZE / (time.perf_counter() - start)


def rewiring_milliseconds(repeats: int) -> tuple[float, int]:
    """Median time of one DSR rewiring of WRN-28-2 at density 0.3 (prune, regrow, reset the
    optimizer state at new positions), and the number of sparsifiable weights."""
    from lowmem.config import compose
    from lowmem.trainer import build_trainer

    trainer = build_trainer(compose("+recipe=wrn_cifar", "data=fake", "sparsity.density=0.3", "trainer.progress=none"))
    trainer.train_step(trainer.example_batch())  # momentum buffers exist, as in training
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        trainer.sparsity.rewire(trainer.optimizer)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:]), trainer.sparsity.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=10_000, help="images in the synthetic data set")
    parser.add_argument("--steps", type=int, default=5, help="timed WRN training steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed WRN training steps first")
    parser.add_argument("--rewirings", type=int, default=5, help="timed DSR rewirings")
    args = parser.parse_args()
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU

    pipeline = pipeline_images_per_second(args.images)
    model = model_images_per_second(args.steps, args.warmup)
    ratio = pipeline / model
    rewiring, sparsifiable = rewiring_milliseconds(args.rewirings)
    print(f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}, batch {BATCH_SIZE}, FP32\n")
    print("| stage | training images/s |")
    print("|---|---:|")
    print(f"| data pipeline (gather, crop, flip, normalise) | {pipeline:,.0f} |")
    print(f"| WRN-28-2 step (forward, backward, SGD) | {model:,.1f} |")
    print(f"| **ratio** | **{ratio:,.0f}x** (required ≥ {REQUIRED_RATIO}x) |")
    print(f"\nDSR rewiring of WRN-28-2's {sparsifiable:,} sparsifiable weights at density 0.3: "
          f"{rewiring:.1f} ms (median)")
    if ratio < REQUIRED_RATIO:
        sys.exit(f"the data pipeline is only {ratio:.1f}x faster than training: it would show in profiles")


if __name__ == "__main__":
    main()
