"""One model of each torchvision classification family under lowmem's full combination, through the CLI.

    python scripts/torchvision_families.py [--models resnet18,vgg11] [--precision bf16] [--out table.md]

For each family's smallest model: ``python -m lowmem.profile +recipe=vision model.arch=NAME data=fake``
with density 0.3, ``precision`` (default bf16), microbatches of 2 of a batch of 4 and
``residual_star`` every 2, measuring one real step (``profile.measure_peak=true``). A model that
refuses the data's 32x32 images names ``data.image_size`` and the smallest size that works: it is
run again at that size. Prints (and writes) a Markdown table: the model, the image size, and either
the accounted total (the report's definition), the total with the step's temporaries (what a budget
is compared with) and the measured peak, or the one-line refusal; a crash (a traceback, or no JSON
line) is reported as such and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from lowmem.run.files import measured_on

ROOT = Path(__file__).resolve().parents[1]
# The smallest model of each family of torchvision.models.list_models(module=torchvision.models).
FAMILIES = {
    "AlexNet": "alexnet", "ConvNeXt": "convnext_tiny", "DenseNet": "densenet121", "EfficientNet": "efficientnet_b0",
    "EfficientNetV2": "efficientnet_v2_s", "GoogLeNet": "googlenet", "Inception v3": "inception_v3",
    "MaxViT": "maxvit_t", "MNASNet": "mnasnet0_5", "MobileNet v2": "mobilenet_v2",
    "MobileNet v3": "mobilenet_v3_small", "RegNet": "regnet_x_400mf", "ResNet": "resnet18",
    "ResNeXt": "resnext50_32x4d", "ShuffleNet v2": "shufflenet_v2_x0_5", "SqueezeNet": "squeezenet1_1",
    "Swin": "swin_t", "Swin v2": "swin_v2_t", "VGG": "vgg11", "VGG-BN": "vgg11_bn", "ViT": "vit_b_16",
    "Wide ResNet": "wide_resnet50_2",
}
COMBINATION = ["sparsity.density=0.3", "microbatch.size=2", "checkpointing.strategy=residual_star",
               "checkpointing.every=2", "data.batch_size=4", "data.eval_batch_size=2"]


def profile(arch: str, precision: str, image_size: int | None) -> tuple[str, dict | None, float]:
    """Run lowmem.profile once: (its output, the JSON row or None, seconds)."""
    command = [sys.executable, "-m", "lowmem.profile", "+recipe=vision", f"model.arch={arch}", "data=fake",
               f"precision={precision}", "profile.measure_peak=true", *COMBINATION]
    if image_size is not None:
        command.append(f"data.image_size={image_size}")
    began = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    row = None
    if done.returncode == 0 and done.stdout.strip():
        try:
            row = json.loads(done.stdout.strip().splitlines()[-1])
        except json.JSONDecodeError:
            row = None
    return output, row, time.perf_counter() - began


def refusal(output: str) -> str | None:
    """The one-line refusal lowmem printed (``error: ...``), or None for a crash."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    if any(line.startswith("Traceback") for line in lines):
        return None
    errors = [line for line in lines if line.lower().startswith(("error", "lowmem"))]
    return errors[-1] if errors else (lines[-1] if lines else None)


def suggested_size(message: str) -> int | None:
    """The working image size a ``data.image_size`` refusal names ("... the smallest size that works
    of 32, 48, ... is 75")."""
    found = re.search(r"smallest size that works.*? is (\d+)", message)
    return int(found.group(1)) if found and "data.image_size" in message else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated model names (default: one of each family)")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args()
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    chosen = {name: name for name in args.models.split(",")} if args.models else FAMILIES
    lines = [f"| family | model | image size | outcome ({args.precision}, density 0.3, microbatches of 2, "
             "residual_star every 2) | time (s) |", "|---|---|---|---|---|"]
    crashed = 0
    for family, arch in chosen.items():
        size, outcome = None, ""
        output, row, seconds = profile(arch, args.precision, None)
        if row is None:
            message = refusal(output) or ""
            size = suggested_size(message)
            if size is not None:
                output, row, more = profile(arch, args.precision, size)
                seconds += more
        if row is not None:
            budget = row.get("budget_total_bytes")
            with_temporaries = f", with the step's temporaries {budget / 1e6:.1f} MB" if budget else ""
            outcome = (f"works: accounted {row['total_bytes'] / 1e6:.1f} MB{with_temporaries}, measured peak "
                       f"{row['peak_bytes'] / 1e6:.1f} MB")
        else:
            message = refusal(output)
            if message is None:
                crashed += 1
                tail = [line for line in output.strip().splitlines() if line.strip()][-1:]
                outcome = f"**crashed**: {tail[0] if tail else 'no output'}"
            else:
                outcome = f"refused: {message}"
        line = f"| {family} | {arch} | {size or 32} | {outcome.replace('|', '/')} | {seconds:.0f} |"
        lines.append(line)
        print(line, flush=True)
    table = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(table + "\n")
    print(f"{len(chosen) - crashed} of {len(chosen)} ran or were refused in one line; {crashed} crashed")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
