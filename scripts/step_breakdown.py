"""Where a CPU training step's time goes: convolutions against everything else, per configuration.

``scripts/bench_memory.py``'s last column (time/FLOPs vs none) says how much slower a configuration
runs than its FLOPs explain. This script splits each step into two parts, measured with
``torch.profiler`` over one step after a warm-up:

- **convolutions**: the share of the (profiled) step spent in the top-level ``aten::convolution``
  and ``aten::convolution_backward`` calls, everything inside them included (under
  ``precision.cpu_compute=fp32`` that is the FP32 kernels and the 16-bit operands' conversions);
  convolutions are nearly all of WRN-28-2's counted FLOPs, so their time over the FLOPs ratio is
  the kernels' efficiency against the baseline's;
- **everything else**: the step's wall time less the convolutions: normalization, ReLU, the
  additions, the loss, the optimizer, the recomputed normalization-ReLU of ``residual_star`` /
  ``no_bn`` (elementwise work, which ``torch.utils.flop_counter`` does not count), building compact
  sparse weights, autograd's and lowmem's Python per call.

Rows: plain PyTorch FP32 (no lowmem code) with its minibatch of 100 run as microbatches of 100,
10 and 4 (what small convolutions cost without any technique), then lowmem in 16 bits (BF16 on a
CPU): pure 16-bit, true microbatches alone, and Table 3's rows 2-7. Each part is compared with the
first row of its group (plain at 100; pure 16-bit), divided by the FLOPs ratio: 1.00 = that part
grows exactly as the FLOPs. Every row's step is built first, and the step times are taken
round-robin, each repeat an untimed and a timed step of every row in turn (as ``bench_memory.py``
does), so that a slowing or speeding machine moves every row alike; the rows' convolution shares
and FLOPs are measured after.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/step_breakdown.py [--only SUBSTRING ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowmem.config import compose  # noqa: E402
from lowmem.profiler import count_flops  # noqa: E402
from lowmem.run.files import measured_on  # noqa: E402
from lowmem.trainer import build_trainer  # noqa: E402
from recipes.wrn_cifar.model import WideResNet  # noqa: E402
from scripts.bench_memory import median_seconds_round_robin  # noqa: E402

BATCH = 100
BASE = ["+recipe=wrn_cifar", "data=fake", "trainer.progress=none", f"data.batch_size={BATCH}", "trainer.device=cpu"]
CONVOLUTIONS = ("aten::convolution", "aten::convolution_backward")


def lowmem_rows() -> dict[str, list[str]]:
    star = ["precision=bf16", "checkpointing.strategy=residual_star", "checkpointing.every=2", "microbatch.mode=true"]
    return {
        "pure BF16": ["precision=bf16"],
        "BF16, microbatches of 10": ["precision=bf16", "microbatch.mode=true", "microbatch.size=10"],
        "BF16, microbatches of 4": ["precision=bf16", "microbatch.mode=true", "microbatch.size=4"],
        "T3 row 2: d1.0 mb100": [*star, f"microbatch.size={BATCH}"],
        "T3 row 3: d1.0 mb10": [*star, "microbatch.size=10"],
        "T3 row 4: d0.3 mb10": [*star, "sparsity.density=0.3", "microbatch.size=10"],
        "T3 row 5: d0.2 mb10": [*star, "sparsity.density=0.2", "microbatch.size=10"],
        "T3 row 6: d0.2 mb4": [*star, "sparsity.density=0.2", "microbatch.size=4"],
        "T3 row 7: d0.1 mb4": [*star, "sparsity.density=0.1", "microbatch.size=4"],
    }


def convolution_share(step) -> float:
    """The share of one profiled ``step()``'s wall time spent inside top-level convolution calls
    (a share, not seconds: the profiler slows every op a little, small ones the most)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        step()
        wall = time.perf_counter() - started
    total = 0.0
    for event in prof.events():
        if event.name in CONVOLUTIONS:
            parent = event.cpu_parent
            while parent is not None and parent.name not in CONVOLUTIONS:
                parent = parent.cpu_parent
            if parent is None:
                total += event.cpu_time_total
    return total / 1e6 / wall


def measure(steps: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict]:
    """Per row: its median step time, taken round-robin with every other row's (machine noise falls
    on all rows alike: ``bench_memory.median_seconds_round_robin``), the seconds of it in
    convolutions (the median share of 3 profiled steps) and its FLOPs."""
    seconds = median_seconds_round_robin(steps, repeats, torch.device("cpu"))
    rows = {}
    for name, step in steps.items():
        share = statistics.median(convolution_share(step) for _ in range(3))
        rows[name] = {"seconds": seconds[name], "convolutions": min(share, 1.0) * seconds[name],
                      "flops": count_flops(step)}  # fmt: skip
        print(name, rows[name], flush=True)
    return rows


def plain_step(microbatch: int):
    torch.manual_seed(0)
    model = WideResNet(28, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    images, labels = torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,))

    def step():
        optimizer.zero_grad(set_to_none=True)
        for start in range(0, BATCH, microbatch):
            part = slice(start, start + microbatch)
            loss = F.cross_entropy(model(images[part]), labels[part]) * (len(labels[part]) / BATCH)
            loss.backward()
        optimizer.step()

    return step


def lowmem_step(overrides: list[str]):
    trainer = build_trainer(compose(*BASE, *overrides))
    batch = trainer.example_batch()
    return lambda: trainer.train_step(batch)


def render(groups: dict[str, dict[str, dict]]) -> str:
    lines = [
        "| configuration | step s | FLOPs ratio | time/FLOPs | convolutions s (share) | convolutions time/FLOPs "
        "| everything else s | everything else / FLOPs ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rows in groups.values():
        base = next(iter(rows.values()))
        other_base = base["seconds"] - base["convolutions"]
        for name, row in rows.items():
            flops = row["flops"] / base["flops"]
            other = row["seconds"] - row["convolutions"]
            lines.append(
                f"| {name} | {row['seconds']:.2f} | {flops:.2f} | {row['seconds'] / base['seconds'] / flops:.2f} "
                f"| {row['convolutions']:.2f} ({row['convolutions'] / row['seconds']:.0%}) "
                f"| {row['convolutions'] / base['convolutions'] / flops:.2f} | {other:.2f} "
                f"| {other / other_base / flops:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", nargs="*", help="substrings of row names to run (each group's first row always runs)")
    args = parser.parse_args(argv)
    print(measured_on(), f"| {torch.get_num_threads()} threads", flush=True)
    plain = {f"plain PyTorch FP32, microbatches of {size}": size for size in (BATCH, 10, 4)}
    steps = {"plain": {}, "lowmem": {}}
    for index, (name, size) in enumerate(plain.items()):
        if index == 0 or not args.only or any(s in name for s in args.only):
            steps["plain"][name] = plain_step(size)
    for index, (name, overrides) in enumerate(lowmem_rows().items()):
        if index == 0 or not args.only or any(s in name for s in args.only):
            steps["lowmem"][name] = lowmem_step(overrides)
    measured = measure({name: step for group in steps.values() for name, step in group.items()}, args.repeats)
    groups = {group: {name: measured[name] for name in rows} for group, rows in steps.items()}
    print()
    print(render(groups))


if __name__ == "__main__":
    main()
