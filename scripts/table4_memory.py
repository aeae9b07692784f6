"""Table 4's memory column (DynamicConv, IWSLT'14) from lowmem's profiler, with today's PyTorch
operators and with PyTorch 1.0.1's (``model.ops=pytorch_1_0``: what the report ran, see
recipes/dc_iwslt/ops.py), beside the report's figures, on the generated IWSLT'14-sized corpus
(``data=fake``). The report's rows are accounted as the report ran them, the logits whole
(``loss.chunk_tokens=none``); beside them, with today's operators, the measured peak of one real
step unchunked and with the output layer and loss chunked (``loss.chunk_tokens=auto``, the default).
Prints a markdown table; ~6 minutes on 2 cores (``--accounted-only``: ~3, no real step).

    python scripts/table4_memory.py [--accounted-only]
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
    measure = "--accounted-only" not in sys.argv[1:]
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    base = ("+recipe=dc_iwslt", "data=fake")
    header = "| row | report | lowmem, today's operators | lowmem, PyTorch 1.0.1's operators |"
    if measure:
        header += " measured peak, logits whole | measured peak, `loss.chunk_tokens=auto` | ratio |"
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    shapes = None
    for label, report_mb, overrides in ROWS:
        cells = []
        for ops in OPS:
            cfg = compose(*base, f"model.ops={ops}", "loss.chunk_tokens=none", *overrides)
            row = profile_config(cfg, measure=measure and ops == "current")
            shapes = shapes or row["batch_shapes"]  # the first row's: the whole 4,000-token minibatch
            got = row["total_bytes"] / 1e6
            cells.append(f"{got:,.0f} MB ({(got - report_mb) / report_mb:+.1%})")
            if ops == "current":
                whole = row.get("peak_bytes")
        if measure:
            chunked = profile_config(compose(*base, "loss.chunk_tokens=auto", *overrides), measure=True)["peak_bytes"]
            cells += [f"{whole / 1e6:,.0f} MB", f"{chunked / 1e6:,.0f} MB", f"{chunked / whole:.2f}x"]
        print(f"| {label} | {report_mb:,} MB | {' | '.join(cells)} |", flush=True)
    print(f"\nProfiled minibatch: source {shapes['src_tokens']}, target {shapes['target']} tokens (padded).")


if __name__ == "__main__":
    main()
