"""Table 4's memory column (DynamicConv, IWSLT'14) from lowmem's profiler, with today's PyTorch
operators and with PyTorch 1.0.1's (``model.ops=pytorch_1_0``: what the report ran, see
recipes/dc_iwslt/ops.py), beside the report's figures. Accounting only (no training step), on the
generated IWSLT'14-sized corpus (``data=fake``). Prints a markdown table; ~3 minutes on 2 cores.

    python scripts/table4_memory.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lowmem.config import compose  # noqa: E402
from lowmem.profile import profile_config  # noqa: E402
from lowmem.run.files import measured_on  # noqa: E402

MICRO = ("microbatch.size=250", "microbatch.mode=true", "checkpointing.strategy=residual", "checkpointing.every=1")
ROWS = [  # (label, report MB, overrides): SPEC §4 Table 4
    ("FP32 baseline (4,000 tokens, no microbatching, no checkpointing)", 2896, ("precision=fp32",)),
    ("density 1.0, FP32", 662, ("precision=fp32", *MICRO)),
    ("density 1.0, FP16", 331, ("precision=fp16", *MICRO)),
    ("density 0.5, FP32", 380, ("sparsity.density=0.5", "precision=fp32", *MICRO)),
    ("density 0.5, FP16", 201, ("sparsity.density=0.5", "precision=fp16", *MICRO)),
    ("density 0.3, FP32", 249, ("sparsity.density=0.3", "precision=fp32", *MICRO)),
    ("density 0.3, FP16", 131, ("sparsity.density=0.3", "precision=fp16", *MICRO)),
]
OPS = ("current", "pytorch_1_0")


def main() -> None:
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    base = ("+recipe=dc_iwslt", "data=fake")
    print("| row | report | lowmem, today's operators | lowmem, PyTorch 1.0.1's operators |")
    print("|---|---|---|---|")
    shapes = None
    for label, report_mb, overrides in ROWS:
        cells = []
        for ops in OPS:
            row = profile_config(compose(*base, f"model.ops={ops}", *overrides), measure=False)
            shapes = shapes or row["batch_shapes"]  # the first row's: the whole 4,000-token minibatch
            got = row["total_bytes"] / 1e6
            cells.append(f"{got:,.0f} MB ({(got - report_mb) / report_mb:+.1%})")
        print(f"| {label} | {report_mb:,} MB | {' | '.join(cells)} |", flush=True)
    print(f"\nProfiled minibatch: source {shapes['src_tokens']}, target {shapes['target']} tokens (padded).")


if __name__ == "__main__":
    main()
