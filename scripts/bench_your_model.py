"""Models lowmem did not write, through ``lowmem.prepare``: plain PyTorch FP32 vs lowmem's techniques.

For torchvision's resnet18 and mobilenet_v3_small, a small VisionTransformer (image 32, patch 4,
6 layers, width 128, 4 heads, MLP 256) and a GPT-style model (``tests.helpers.tiny_gpt``, 4 blocks
of width 128 called in a loop with a causal mask), on CPU, batch 100 (images 32x32; sequences of
64 tokens), measured side by side in one process:

- plain PyTorch: ``torch.optim.SGD`` (momentum, Nesterov), a plain loop; its measured peak
  (lowmem's CPU tensor tracker over one step, the same instrument as lowmem's figures) and step time;
- lowmem without techniques (FP32): the report's accounting and step time (≤ 1.1x plain: the
  framework itself costs nothing);
- lowmem's full combination (density 0.3, BF16, microbatch 10, residual_star every 2): accounting,
  measured peak and step time, and its step time over FLOPs against lowmem's pure BF16 run (the
  same precision without techniques; 1.00 = time grows exactly as the FLOPs of recomputation);
- plain PyTorch FP32 again, its minibatch run as microbatches of 10 (the combination's): what
  microbatching costs without any lowmem code. Models with large weights and small activations
  (resnet18 on 32x32 images) pay for every weight once per microbatch, in each pass; that ratio is,
  roughly, a floor under the combination's time/FLOPs, and the last column divides it out (1.00 = lowmem's
  techniques cost what their FLOPs and plain microbatching explain).

Step times are the median of ``--repeats`` steps after one warm-up step, alternating the five
configurations so that machine noise falls on all alike. Writes a Markdown table (stdout, and
``--out`` when given) and, on stderr, what the combination's measured peak holds and where it happens.
Run: ``.venv/bin/python scripts/bench_your_model.py`` (~3 min on 2 cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lowmem  # noqa: E402
from lowmem.profiler import measure_peak  # noqa: E402
from lowmem.run.files import measured_on  # noqa: E402
from tests.helpers import classification_loss, lm_loss, tiny_gpt  # noqa: E402

MB = 1e6
MICROBATCH = 10
COMBINATION = ["sparsity.density=0.3", "precision=bf16", f"microbatch.size={MICROBATCH}",
               "checkpointing.strategy=residual_star", "checkpointing.every=2"]  # fmt: skip


def models(batch: int) -> dict[str, tuple[Callable[[], torch.nn.Module], tuple, Callable]]:
    generator = torch.Generator().manual_seed(0)
    images = (torch.randn(batch, 3, 32, 32, generator=generator), torch.randint(0, 10, (batch,), generator=generator))
    tokens = torch.randint(0, 97, (batch, 65), generator=generator)
    vit = dict(image_size=32, patch_size=4, num_layers=6, num_heads=4, hidden_dim=128, mlp_dim=256, num_classes=10)
    return {
        "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), images, classification_loss),
        "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(num_classes=10), images,
                               classification_loss),
        "vit (6x128, patch 4)": (lambda: torchvision.models.VisionTransformer(**vit), images, classification_loss),
        "gpt-style (4x128, 64 tokens)": (lambda: tiny_gpt(d=128, layers=4, ctx=64, dropout=0.0),
                                         (tokens[:, :-1], tokens[:, 1:]), lm_loss),
    }  # fmt: skip


def plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, batch) -> Callable:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        optimizer.step()

    return step


def plain_microbatched_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, batch, size: int
) -> Callable:
    """``plain_step`` with the batch run as microbatches of ``size`` examples, each loss weighted by
    its share: what microbatching costs in plain PyTorch, without any lowmem code."""
    total = batch[0].shape[0]
    parts = list(zip(*(tensor.split(size) for tensor in batch), strict=True))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for part in parts:
            (loss_fn(model, part) * (part[0].shape[0] / total)).backward()
        optimizer.step()

    return step


def timed(step: Callable[[], object]) -> float:
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def bench(name: str, make_model: Callable, batch: tuple, loss_fn: Callable, repeats: int) -> dict:
    """One model's row. Each measured peak is taken with only its own configuration alive (the CPU
    tracker counts every live tensor), then all five are timed side by side."""

    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)
        return make_model()

    def plain_setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = fresh()
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)

    model, optimizer = plain_setup()
    params = sum(p.numel() for p in model.parameters())
    step = plain_step(model, optimizer, loss_fn, batch)
    plain_peak = measure_peak(step, model, optimizer, data=list(batch)).peak_bytes
    del step
    del model, optimizer
    accounted = lowmem.prepare(fresh(), loss_fn, batch, overrides=["trainer.device=cpu"]).profile(measure=False)
    combined = lowmem.prepare(fresh(), loss_fn, batch, overrides=["trainer.device=cpu", *COMBINATION]).profile()
    model, optimizer = plain_setup()
    lowmem_plain = lowmem.prepare(fresh(), loss_fn, batch, overrides=["trainer.device=cpu"])
    pure = lowmem.prepare(fresh(), loss_fn, batch, overrides=["trainer.device=cpu", "precision=bf16"])
    combination = lowmem.prepare(fresh(), loss_fn, batch, overrides=["trainer.device=cpu", *COMBINATION])
    microbatched, microbatched_optimizer = plain_setup()
    steps = {"plain": plain_step(model, optimizer, loss_fn, batch), "lowmem": lambda: lowmem_plain.step(batch),
             "pure": lambda: pure.step(batch), "combination": lambda: combination.step(batch),
             "plain_microbatched": plain_microbatched_step(microbatched, microbatched_optimizer, loss_fn, batch,
                                                           MICROBATCH)}  # fmt: skip
    times: dict[str, list[float]] = {key: [] for key in steps}
    for step in steps.values():  # warm-up
        step()
    for _ in range(repeats):
        for key, step in steps.items():
            times[key].append(timed(step))
    median = {key: statistics.median(values) for key, values in times.items()}
    return {
        "model": name,
        "params_m": params / 1e6,
        "plain_peak": plain_peak,
        "fp32_accounted": accounted["total_bytes"],
        "fp32_activations": accounted["activation_bytes"],
        "combo_accounted": combined["total_bytes"],
        "combo_peak": combined["peak_bytes"],
        "combo_peak_breakdown": combined["peak_breakdown"],
        "combo_peak_location": combined["peak_location"],
        "lowmem_vs_plain_time": median["lowmem"] / median["plain"],
        "combo_vs_plain_time": median["combination"] / median["plain"],
        # Against pure BF16 (same precision, no technique), over the FLOPs recomputation adds.
        "combo_time_per_flop": (median["combination"] / median["pure"]) / (combined["flops"] / accounted["flops"]),
        # What microbatches alone cost in plain PyTorch FP32 (same FLOPs): roughly the part of the
        # combination's time/FLOPs that no implementation of the techniques can remove on this CPU.
        "plain_microbatch_time": median["plain_microbatched"] / median["plain"],
        "plain_step_s": median["plain"],
    }


def table(rows: list[dict], batch: int) -> str:
    lines = [
        f"| model (batch {batch}, CPU) | params | plain PyTorch FP32 peak | lowmem FP32 accounted (activations) | "
        "combination accounted | combination peak | accounted ratio | peak ratio | step time lowmem / plain | "
        f"step time combination / plain | combination time/FLOPs vs pure BF16 | plain PyTorch, microbatches of "
        f"{MICROBATCH} / plain | combination time/FLOPs over plain microbatching's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['params_m']:.2f} M | {r['plain_peak'] / MB:.1f} MB | "
            f"{r['fp32_accounted'] / MB:.1f} MB ({r['fp32_activations'] / MB:.1f}) | "
            f"{r['combo_accounted'] / MB:.1f} MB | "
            f"{r['combo_peak'] / MB:.1f} MB | {r['fp32_accounted'] / r['combo_accounted']:.1f}x | "
            f"{r['plain_peak'] / r['combo_peak']:.1f}x | {r['lowmem_vs_plain_time']:.2f}x | "
            f"{r['combo_vs_plain_time']:.2f}x | {r['combo_time_per_flop']:.2f} | {r['plain_microbatch_time']:.2f}x | "
            f"{r['combo_time_per_flop'] / r['plain_microbatch_time']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default=None, help="benchmark the models whose name contains this")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    rows = []
    for name, (make_model, batch, loss_fn) in models(args.batch).items():
        if args.only is None or args.only in name:
            row = bench(name, make_model, batch, loss_fn, args.repeats)
            rows.append(row)
            held = ", ".join(f"{key} {value / MB:.2f}" for key, value in row["combo_peak_breakdown"].items() if value)
            print(f"{name}: combination peak {row['combo_peak'] / MB:.2f} MB ({held}) at "
                  f"{row['combo_peak_location']}", file=sys.stderr, flush=True)  # fmt: skip
    text = table(rows, args.batch)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
