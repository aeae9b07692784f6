"""16-bit on this CPU: native kernels against ``precision.cpu_compute=fp32``, side by side.

Ops (one thread, median of 5): a conv2d forward, forward + backward, and a 1000x1000 matmul in
FP32, natively in BF16/FP16, and in BF16/FP16 under ``Fp32Arithmetic``. Steps (median of 4 after a
warm-up, one trainer at a time): WRN-28-2 at batch 100 and DynamicConv (recipe defaults, fake data)
in FP32, BF16 and FP16 under ``auto``, and BF16 native (``--no-native-steps`` skips it: on a CPU
without 16-bit kernels a native DynamicConv step takes minutes). The README's figures for
``precision.cpu_compute`` come from this script; run it with ``ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2`` for an AVX-512 CPU restricted to AVX2.

Per-call costs (``--per-call`` alone: seconds), one thread, median of 2,000 calls: a tiny BF16
convolution (1x4x4x4, 4 filters 3x3) forward and backward under ``Fp32Arithmetic`` against the same
FP32 op called directly (what the override adds to every call: the microbatched rows make thousands
a step); and ReLU(BN) recomputed from kept statistics (10x32x32x32 BF16, as ``no_bn`` and
``residual_star`` do in backward) in one C pass against torch's ops.

    .venv/bin/python scripts/bench_cpu_compute.py [--no-native-steps] [--per-call]
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


def median_us(work, repeats: int = 2000) -> float:
    for _ in range(100):
        work()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


DIRECT = "(the FP32 op called directly)"


def per_call_rows() -> list[str]:
    from torch import nn

    from lowmem.techniques import checkpointing

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x, weight, grad = (torch.randn(shape, generator=generator).bfloat16() for shape in ((1, 4, 4, 4), (4, 4, 3, 3),
                                                                                      (1, 4, 4, 4)))  # fmt: skip
    args = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    backward = torch.ops.aten.convolution_backward
    rows = []
    with torch.no_grad():
        direct = median_us(lambda: torch.ops.aten.convolution(x.float(), weight.float(), None, *args).bfloat16())
        with Fp32Arithmetic():
            override = median_us(lambda: torch.ops.aten.convolution(x, weight, None, *args))
        rows.append(f"| tiny BF16 convolution forward | {override:.1f} us | {direct:.1f} us {DIRECT} |")
        direct = median_us(lambda: [r.bfloat16() for r in backward(grad.float(), x.float(), weight.float(), None, *args,
                                                                    [True, True, False])[:2]])  # fmt: skip
        with Fp32Arithmetic():
            override = median_us(lambda: backward(grad, x, weight, None, *args, [True, True, False]))
        rows.append(f"| tiny BF16 convolution backward | {override:.1f} us | {direct:.1f} us {DIRECT} |")
        norm = nn.BatchNorm2d(32)
        activations = torch.randn(10, 32, 32, 32, generator=generator).bfloat16()
        _, mean, invstd = torch.ops.aten.native_batch_norm(activations, norm.weight, norm.bias, None, None, True, 0.0,
                                                           1e-5)  # fmt: skip
        fused = median_us(lambda: checkpointing._norm_relu_from_statistics(norm, activations, mean, invstd), 200)
        ops = median_us(lambda: checkpointing._normalized_from_statistics(norm, activations, mean, invstd).relu_(), 200)
        rows.append(f"| ReLU(BN) from kept statistics, 10x32x32x32 BF16 | {fused:.1f} us (C pass) | {ops:.1f} us "
                    "(torch's multiply-add, copy and ReLU) |")  # fmt: skip
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
    parser.add_argument("--per-call", action="store_true", help="only the per-call costs (seconds)")
    args = parser.parse_args()
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    reuse_freed_memory()  # as every run computing in FP32 has it
    print("| per call (1 thread, median) | lowmem | against |\n|---|---|---|")
    print("\n".join(per_call_rows()) + "\n", flush=True)
    if args.per_call:
        return
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
