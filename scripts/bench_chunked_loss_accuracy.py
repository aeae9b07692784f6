"""The DynamicConv recipe trains alike with its output layer and loss chunked (``loss.chunk_tokens``).

The small DynamicConv on the embedded phrases (``scripts/bench_state_bits.py``'s: BF16, Adam,
microbatches of 500 tokens, residual checkpointing) with the logits whole (``loss.chunk_tokens=none``)
and a chunk of 64 tokens at a time, over ``--seeds``, through the CLI as a user runs them; the test
BLEU of each. In BF16 the chunked loss is not the same arithmetic as plain's (its log-sum-exp and
the logits' gradient are FP32, the weight's gradient one product per vocabulary slice), so the runs
part ways after the first update: this measures whether they train alike. Runs are kept under
``--out`` (a finished run is not trained again). Prints a Markdown table; ``--json`` also writes it.

    .venv/bin/python scripts/bench_chunked_loss_accuracy.py [--seeds 0 1] [--dc-steps 400]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lowmem.run.files import measured_on  # noqa: E402
from scripts.bench_state_bits import SMALL_DC, train  # noqa: E402

SETTINGS = ("none", "64")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--dc-steps", type=int, default=400, help="DynamicConv updates on phrases")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_chunked_loss")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    figures: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
    for seed in args.seeds:  # seed by seed: an interrupted sweep still compares
        for setting in SETTINGS:
            overrides = ["+recipe=dc_iwslt", *SMALL_DC, f"trainer.max_steps={args.dc_steps}",
                         f"loss.chunk_tokens={setting}", f"trainer.seed={seed}"]  # fmt: skip
            result = train(args.out / f"dc-chunk{setting}-seed{seed}", overrides)
            figures[setting].append(float(result["bleu"]))
    none, chunked = (statistics.mean(figures[s]) for s in SETTINGS)
    print("\n| DynamicConv phrases, BF16 | `loss.chunk_tokens=none` | `loss.chunk_tokens=64` | difference | seeds |")
    print("|---|---|---|---|---|")
    cells = [f"{statistics.mean(v):.2f} [{', '.join(f'{x:.2f}' for x in v)}]" for v in figures.values()]
    print(f"| test BLEU, {args.dc_steps} updates | {' | '.join(cells)} | {chunked - none:+.2f} | "
          f"{', '.join(map(str, args.seeds))} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
