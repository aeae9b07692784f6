"""The budget on a mixture of experts and a diffusion UNet (issue 46): plain PyTorch's measured peak,
``lowmem.plan`` at half of it, then ``lowmem.prepare`` with the chosen overrides, one step and
``run.profile()``'s measured peak; one markdown table row per case (docs/planner-profiler.md).

``.venv/bin/python scripts/plan_moe_unet.py`` (about a minute on two CPU cores).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lowmem  # noqa: E402
from lowmem.run.files import measured_on  # noqa: E402
from tests.test_plan_moe_unet import (  # noqa: E402
    denoising_loss,
    language_model_loss,
    mixtral,
    noisy_images,
    token_ids,
    unet,
)

CASES = {
    "Mixtral, eager experts (routing by `nonzero`)": (lambda: mixtral("eager"), language_model_loss, token_ids),
    "Mixtral, grouped experts (transformers' default)": (lambda: mixtral(None), language_model_loss, token_ids),
    "diffusers UNet2DModel": (unet, denoising_loss, noisy_images),
}
CPU = ["trainer.device=cpu"]
# Searched besides the free search: the plain run's FP32 fixed, and optimal checkpointing fixed.
FIXED = (["precision=fp32"], ["precision=fp32", "checkpointing.strategy=optimal"])


def row(name: str, fixed: list[str]) -> str:
    build, loss, batch_of = CASES[name]
    batch = batch_of()
    plain = lowmem.prepare(build(), loss, batch, overrides=[*CPU, "precision=fp32"])
    plain.step(batch)
    profiled = plain.profile()
    del plain
    budget = round(0.5 * profiled["peak_bytes"] / 1e6, 3)
    started = time.perf_counter()
    try:
        plan = lowmem.plan(build(), loss, batch, budget_mb=budget, overrides=[*CPU, *fixed])
    except ValueError as refusal:  # nothing fits, or nothing fits when built: said in one line
        return f"| {name} | {' '.join(fixed) or '-'} | {profiled['peak_bytes'] / 1e6:.3f} | {budget} | {refusal} |"
    searched = time.perf_counter() - started
    run = lowmem.prepare(build(), loss, batch, overrides=[*CPU, *fixed, *plan["overrides"]])
    run.step(batch)
    peak = run.profile()["peak_bytes"] / 1e6
    chosen = " ".join(plan["overrides"])
    return (
        f"| {name} | {' '.join(fixed) or '-'} | {profiled['peak_bytes'] / 1e6:.3f} | {budget} | `{chosen}` | "
        f"{plan['budget_total_bytes'] / 1e6:.3f} | {peak:.3f} | {peak / budget:.3f} | {searched:.1f} |"
    )


def main() -> None:
    torch.set_num_threads(2)
    print(measured_on("cpu"))
    print("| model | fixed | plain peak (MB) | budget (MB) | chosen | accounted + step temporaries (MB) "
          "| measured peak (MB) | peak / budget | plan (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name in CASES:
        for fixed in ([], *FIXED):
            print(row(name, fixed), flush=True)


if __name__ == "__main__":
    main()
