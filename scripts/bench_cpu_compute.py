"""16-bit on this CPU: native kernels against ``precision.cpu_compute=fp32``, side by side.

Ops (one thread, median of 5): a conv2d forward, forward + backward, and a 1000x1000 matmul in
FP32, natively in BF16/FP16, and in BF16/FP16 under ``Fp32Arithmetic``. Steps (median of 4 after a
warm-up, one trainer at a time): WRN-28-2 at batch 100 and DynamicConv (recipe defaults, fake data)
in FP32, BF16 and FP16 under ``auto``, and BF16 native (``--no-native-steps`` skips it: on a CPU
without 16-bit kernels a native DynamicConv step takes minutes). The README's figures for
``precision.cpu_compute`` come from this script; run it with ``ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2`` for an AVX-512 CPU restricted to AVX2.

    .venv/bin/python scripts/bench_cpu_compute.py [--no-native-steps]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from lowmem.config import compose
from lowmem.run.files import measured_on
from lowmem.techniques.cpu_compute import Fp32Arithmetic, reuse_freed_memory
from lowmem.trainer import build_trainer

_threads = torch.get_num_threads()  # the steps' threads (the ops run on one)
STEPS = {
    "WRN-28-2, batch 100": ["+recipe=wrn_cifar", "data=fake", "data.batch_size=100", "data.train_size=500"],
    "DynamicConv, 4,000 tokens": ["+recipe=dc_iwslt", "data=fake", "data.train_size=2000"],
}


def median_ms(work, context=contextlib.nullcontext, repeats: int = 5) -> float:
    with context():
        work()  # warm-up
    times = []
    for _ in range(repeats):
        with context():
            started = time.perf_counter()
            work()
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def _ops(dtype: torch.dtype) -> dict:
    x = torch.randn(10, 32, 32, 32).to(dtype).requires_grad_()
    weight = torch.randn(32, 32, 3, 3).to(dtype).requires_grad_()
    a, b = torch.randn(1000, 1000).to(dtype), torch.randn(1000, 1000).to(dtype)
    return {
        "conv forward": lambda: F.conv2d(x, weight, padding=1),
        "conv forward + backward": lambda: F.conv2d(x, weight, padding=1).sum().backward(),
        "matmul 1000x1000": lambda: a @ b,
    }


def op_rows() -> list[str]:
    torch.set_num_threads(1)
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ops = _ops(dtype)
        ways = {"native": contextlib.nullcontext} if dtype == torch.float32 else \
            {"native": contextlib.nullcontext, "fp32": Fp32Arithmetic}  # fmt: skip
        for way, context in ways.items():
            times = ", ".join(f"{name} {median_ms(op, context):.1f} ms" for name, op in ops.items())
            rows.append(f"| {str(dtype).removeprefix('torch.')} {way} | {times} |")
    torch.set_num_threads(_threads)
    return rows


def step_seconds(overrides: list[str]) -> tuple[float, str]:
    trainer = build_trainer(compose(*overrides, "trainer.device=cpu", "trainer.progress=none"))
    batches = iter(trainer.data.train.epoch(0))
    batch = next(batches)
    trainer.train_step(batch)  # warm-up
    times = []
    for _ in range(4):
        started = time.perf_counter()
        trainer.train_step(batch)
        times.append(time.perf_counter() - started)
    return statistics.median(times), ", ".join(f"{k} {v}" for k, v in trainer.cpu_compute.items())



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-native-steps", action="store_true", help="skip the native BF16 steps")
    args = parser.parse_args()
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    reuse_freed_memory()  # as every run computing in FP32 has it
    print(f"{_threads} threads for steps\n")
    print("| dtype, way | ops (1 thread, median of 5) |\n|---|---|")
    print("\n".join(op_rows()))
    print("\n| model | configuration | step s (median of 4) | vs FP32 | cpu_compute |\n|---|---|---|---|---|")
    ways = {"FP32": ["precision=fp32"], "BF16 auto": ["precision=bf16"], "FP16 auto": ["precision=fp16"]}
    if not args.no_native_steps:
        ways["BF16 native"] = ["precision=bf16", "precision.cpu_compute=native"]
    for model, overrides in STEPS.items():
        fp32 = None
        for way, extra in ways.items():
            seconds, chosen = step_seconds([*overrides, *extra])
            fp32 = fp32 or seconds
            print(f"| {model} | {way} | {seconds:.3f} | {seconds / fp32:.2f}x | {chosen or '—'} |", flush=True)


if __name__ == "__main__":
    main()
