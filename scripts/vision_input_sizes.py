"""Which torchvision classifiers accept the data sets' 32x32 images, and what size the others need.

    python scripts/vision_input_sizes.py [--models resnet18,vit_b_16] [--verify]

Builds every model of ``torchvision.models.list_models(module=torchvision.models)`` as the vision
recipe does (10 classes, random weights) and probes one training-mode forward of 2 images with fake
tensors (shapes only) at 32 pixels; for a model that refuses, the smallest working size (scanning
up from 33 pixels) and which sizes after it work. ``--verify`` repeats the boundary sizes with real
forward passes on the CPU (slower), checking that the fake probe agrees. Prints a Markdown table;
about three minutes on two CPU cores (most of it building the models; ``--verify``: six).
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings

from torch import nn

from lowmem.run.files import measured_on
from recipes.vision.models import forward_error, model_constructor, probe, torchvision_classifiers
from recipes.wrn_cifar.data import IMAGE_SIZE, NUM_CLASSES

LARGEST = 1024  # pixels: the scan for a working size stops here
FOLLOWING = 64  # pixels after the smallest working size examined to describe which sizes work


def smallest_working_size(model: nn.Module, start: int) -> int | None:
    return next((size for size in range(start, LARGEST + 1) if probe(model, size, NUM_CLASSES) is None), None)


def describe(model: nn.Module, smallest: int) -> str:
    """Which sizes from ``smallest`` to ``smallest + FOLLOWING`` work, as ranges (``221-224``)."""
    last = smallest + FOLLOWING
    works = [size for size in range(smallest, last + 1) if probe(model, size, NUM_CLASSES) is None]
    if works == list(range(smallest, last + 1)):
        return f"any size >= {smallest}"
    runs: list[list[int]] = []
    for size in works:
        if runs and size == runs[-1][-1] + 1:
            runs[-1].append(size)
        else:
            runs.append([size])
    ranges = [str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs]
    return f"only {', '.join(ranges)} (of {smallest}-{last})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated names (default: all of torchvision's classifiers)")
    parser.add_argument("--verify", action="store_true", help="confirm the boundary sizes with real forwards")
    args = parser.parse_args()
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    warnings.filterwarnings("ignore", category=UserWarning)
    names = args.models.split(",") if args.models else torchvision_classifiers()
    print(
        f"| model | params (M) | at {IMAGE_SIZE} px | smallest working size | sizes that work |"
        + (" real forward agrees |" if args.verify else "")
    )
    print("|---|---|---|---|---|" + ("---|" if args.verify else ""))
    started = time.perf_counter()
    for name in names:
        constructor, kwargs, _ = model_constructor({"arch": name}, NUM_CLASSES)
        model = constructor(**kwargs)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        error = probe(model, IMAGE_SIZE, NUM_CLASSES)
        if error is None:
            row = [name, f"{params:.1f}", "ok", "", ""]
            checks = [(IMAGE_SIZE, True)]
        else:
            smallest = smallest_working_size(model, IMAGE_SIZE + 1)
            sizes = describe(model, smallest) if smallest else f"none up to {LARGEST}"
            row = [name, f"{params:.1f}", f"refused: {error[:90]}", str(smallest or "-"), sizes]
            checks = [(IMAGE_SIZE, False)] + ([(smallest - 1, False), (smallest, True)] if smallest else [])
        if args.verify:
            agrees = all((forward_error(model, size, NUM_CLASSES) is None) == works for size, works in checks)
            row.append("yes" if agrees else "NO")
        print("| " + " | ".join(row) + " |", flush=True)
        del model
        gc.collect()
    print(f"\n({len(names)} models in {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
