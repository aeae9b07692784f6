"""Planned budgets against measured peaks on library models: the table behind the README's claim.

    python scripts/budget_table.py

For each model of tests/test_budget_real_models.py (torchvision and timm ResNet-18, timm
ConvNeXt-Atto and EfficientNet-B0, transformers GPT-2 and Llama; FP32 on the CPU, batch 16 of
32x32 images or 4 x 24 tokens): ``lowmem.plan`` at its budget, then ``lowmem.prepare`` with the
chosen overrides, one step, and ``run.profile()``'s measured peak. Prints a Markdown table.
"""

from __future__ import annotations

import copy
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lowmem  # noqa: E402
from lowmem.run.files import measured_on  # noqa: E402
from tests.test_budget_real_models import CPU, MODELS  # noqa: E402


def main() -> None:
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    warnings.filterwarnings("ignore")
    print("| model | budget (MB) | chosen | accounted + step temporaries (MB) | measured peak (MB) | peak / budget |")
    print("|---|---|---|---|---|---|")
    for name, (build, loss, batch_of, budget) in MODELS.items():
        began = time.perf_counter()
        torch.manual_seed(0)
        model, batch = build(), batch_of()
        plan = lowmem.plan(copy.deepcopy(model), loss, batch, budget_mb=budget, overrides=CPU)
        run = lowmem.prepare(model, loss, batch, overrides=[*plan["overrides"], "trainer.device=cpu"])
        run.step(batch)
        peak = run.profile()["peak_bytes"] / 1e6
        chosen = " ".join(plan["overrides"])
        print(f"| {name} | {budget:g} | `{chosen}` | {plan['budget_total_bytes'] / 1e6:.2f} | {peak:.2f} | "
              f"{peak / budget:.3f} |", flush=True)
        print(f"  ({time.perf_counter() - began:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
