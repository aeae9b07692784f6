"""A compact weight's dense build and gradient gather per memory layout (what a compiled step pays).

A compiled compact convolution on a CPU computes channels-last (inductor's layout there): its dense
weight is built and its weight gradient gathered in that layout. For WRN-28-2's 3x3 convolution
weights at a density, in BF16, the time of one build (``lowmem.techniques.compact.densify``) and one
gather (``gather``): contiguous, channels-last by the C loop that writes and reads each entry where
that layout has it, and channels-last the way it was made before (built contiguously, then copied;
gathered from a contiguous copy). Median of ``--repeats`` timings of ``--loops`` calls each.

    .venv/bin/python scripts/bench_compact_layout.py [--density 0.2] [--repeats 7] [--loops 500]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch

from lowmem.run.files import measured_on
from lowmem.techniques import compact

SHAPES = ([32, 32, 3, 3], [64, 64, 3, 3], [128, 128, 3, 3])  # WRN-28-2's convolutions of each stage


def microseconds(call: Callable[[], object], repeats: int, loops: int) -> float:
    for _ in range(loops // 10):
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(loops):
            call()
        times.append((time.perf_counter() - started) / loops * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--loops", type=int, default=500)
    args = parser.parse_args()
    print(measured_on())
    print(f"\ndensity {args.density}, BF16, median of {args.repeats} x {args.loops} calls, microseconds a call\n")
    print("| weight | build contiguous | build channels-last | build contiguous + copy (before) "
          "| gather contiguous | gather channels-last | gather from a contiguous copy (before) |")
    print("|---|---|---|---|---|---|---|")
    channels_last = torch.channels_last
    for shape in SHAPES:
        numel = math.prod(shape)
        mask = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < args.density
        index = compact.encode(mask.nonzero().squeeze(1), numel)
        values = torch.randn(int(mask.sum()), dtype=torch.bfloat16)
        flat_grad = torch.randn(shape, dtype=torch.bfloat16)
        grad = flat_grad.contiguous(memory_format=channels_last)
        calls = {
            "build contiguous": lambda: compact.densify(values, *index, shape),  # noqa: B023
            "build channels-last": lambda: compact.densify(values, *index, shape, channels_last),  # noqa: B023
            "build + copy": lambda: compact.densify(values, *index, shape).contiguous(memory_format=channels_last),  # noqa: B023
            "gather contiguous": lambda: compact.gather(flat_grad, *index, torch.bfloat16),  # noqa: B023
            "gather channels-last": lambda: compact.gather(grad, *index, torch.bfloat16),  # noqa: B023
            "gather copy": lambda: compact.gather(grad.reshape(-1), *index, torch.bfloat16),  # noqa: B023 (a copy)
        }
        cells = [f"{microseconds(call, args.repeats, args.loops):.1f}" for call in calls.values()]
        print(f"| {'x'.join(map(str, shape))} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
