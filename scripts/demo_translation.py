"""The translation recipe on the embedded German→English corpus, on this machine, in minutes.

Trains a small DynamicConv (3 encoder + 3 decoder layers, d=128) through the CLI as a user would,
with true microbatching of 500 tokens and residual checkpointing of every layer, and prints the
test BLEU before training (the untrained model) and after (beam search over the average of the
last snapshots), the wall time and the measured peak.

    .venv/bin/python scripts/demo_translation.py [--steps 400]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from lowmem.run.files import measured_on

ROOT = Path(__file__).resolve().parents[1]
SMALL_MODEL = [
    "model.encoder_layers=3",
    "model.decoder_layers=3",
    "model.embed_dim=128",
    "model.ffn_dim=256",
    "model.heads=4",
    "model.dropout=0.1",
]


def bleu_before(overrides: list[str]) -> dict:
    """BLEU of the untrained model on the same test set (what training has to beat)."""
    from lowmem.config import compose
    from lowmem.trainer import build_trainer
    from recipes.dc_iwslt.recipe import translate_and_score

    trainer = build_trainer(compose("+recipe=dc_iwslt", *overrides))
    test = trainer.data.test
    return translate_and_score(trainer.unwrapped_model, test["test"], test["corpus"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", default=str(ROOT / "outputs" / "demo_translation"))
    args = parser.parse_args()
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    overrides = [
        *SMALL_MODEL,
        "data=phrases",
        "data.batch_size=2000",
        "optim.warmup_updates=100",
        "optim.lr=1e-3",
        f"trainer.max_steps={args.steps}",
        "microbatch.size=500",
        "checkpointing.strategy=residual",
        "checkpointing.every=1",
        "trainer.progress=lines",
    ]
    before = bleu_before(overrides)
    print(
        f"before training: BLEU {before['bleu']:.2f} (tokenized {before['tokenized_bleu']:.2f})", flush=True
    )
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "lowmem.train", "+recipe=dc_iwslt", *overrides, f"hydra.run.dir={args.out}"],
        cwd=ROOT,
        text=True,
        capture_output=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"training failed:\n{out.stderr[-3000:]}")
    result = json.loads((Path(args.out) / "result.json").read_text())
    print(
        f"after {result['updates']} updates: BLEU {result['bleu']:.2f} (tokenized {result['tokenized_bleu']:.2f}), "
        f"training {result['wall_s']:.0f} s, wall {time.perf_counter() - started:.0f} s including evaluation, "
        f"measured peak {result['peak_bytes'] / 1e6:.1f} MB ({result.get('peak_scope', 'measured peak')})"
    )


if __name__ == "__main__":
    main()
