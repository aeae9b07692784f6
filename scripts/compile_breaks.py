"""Graph breaks of ``trainer.compile=true`` per model and configuration (docs/compile.md's table).

For WRN-28-2 and a small DynamicConv (recipes, through ``build_trainer``) and GPT-2 and resnet18
(through ``lowmem.prepare``), each configuration's graph breaks as ``lowmem.profile`` reports them
(dynamo's count over the first compiled step), beside those of ``torch.compile`` of the model alone.
Dynamo's tracing only (the ``eager`` backend): the breaks do not depend on the backend.

    .venv/bin/python scripts/compile_breaks.py
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
import torchvision
import transformers
from torch._dynamo.utils import counters

import lowmem
from lowmem.config import compose
from lowmem.trainer import build_trainer

CONFIGURATIONS = {
    "no technique": [],
    "compact sparse 0.3": ["sparsity.density=0.3"],
    "residual/1": ["checkpointing.strategy=residual", "checkpointing.every=1"],
    "full: sparse 0.3, true mb, residual(_star)/2, bf16": [
        "sparsity.density=0.3", "microbatch.mode=true", "checkpointing.strategy=STAR",
        "checkpointing.every=2", "precision=bf16",
    ],
}
WRN = ["+recipe=wrn_cifar", "data=fake", "model.depth=28", "model.width=2", "data.batch_size=20",
       "data.train_size=40", "data.test_size=20"]
DC = ["+recipe=dc_iwslt", "data=fake", "data.train_size=300", "data.test_size=8", "data.batch_size=800",
      "model.encoder_layers=3", "model.decoder_layers=2", "model.embed_dim=32", "model.ffn_dim=64", "model.heads=4"]
COMMON = ["trainer.device=cpu", "trainer.progress=none", "trainer.compile=true", "trainer.compile_backend=eager"]


def _star(overrides: list[str], star: str) -> list[str]:
    """The full combination's strategy: residual_star where BatchNorm-ReLU-conv blocks allow it."""
    return [o.replace("STAR", star) for o in overrides]


def recipe_breaks(base: list[str], overrides: list[str], microbatch: int, star: str) -> tuple[int, dict]:
    torch._dynamo.reset()
    overrides = _star(overrides, star)
    extra = [f"microbatch.size={microbatch}"] if "microbatch.mode=true" in overrides else []
    trainer = build_trainer(compose(*base, *COMMON, *overrides, *extra))
    trainer.train_step(trainer.example_batch())
    return trainer.compiled.graph_breaks, dict(trainer.compiled.reasons)


def prepared_breaks(model, loss, batch, overrides: list[str], microbatch: int, star: str) -> tuple[int, dict]:
    torch._dynamo.reset()
    overrides = _star(overrides, star)
    extra = [f"microbatch.size={microbatch}"] if "microbatch.mode=true" in overrides else []
    run = lowmem.prepare(model, loss, batch, [*COMMON[2:], *overrides, *extra])
    run.step(batch)
    return run.trainer.compiled.graph_breaks, dict(run.trainer.compiled.reasons)


def plain_breaks(model, loss, batch) -> int:
    torch._dynamo.reset()
    counters.clear()
    loss(torch.compile(model, backend="eager"), batch).backward()
    return sum(counters["graph_break"].values())


def main() -> None:
    torch.manual_seed(0)
    images = (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
    ids = torch.randint(0, 100, (4, 16))

    def classify(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    def lm(model, batch):
        return model(input_ids=batch, labels=batch).loss

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=100, n_positions=32, loss_type="ForCausalLM"))
    resnet = torchvision.models.resnet18(num_classes=10)
    rows = ["| model | torch.compile alone | " + " | ".join(CONFIGURATIONS) + " |",
            "|---|---|" + "---|" * len(CONFIGURATIONS)]
    reasons: dict[str, int] = {}

    def cell(result: tuple[int, dict]) -> str:
        for reason, count in result[1].items():
            reasons[reason] = reasons.get(reason, 0) + count
        return str(result[0])

    cells = [cell(recipe_breaks(WRN, o, 4, "residual_star")) for o in CONFIGURATIONS.values()]
    rows.append("| WRN-28-2 (12 blocks in 3 stacks) | 0 | " + " | ".join(cells) + " |")
    cells = [cell(recipe_breaks(DC, o, 200, "residual")) for o in CONFIGURATIONS.values()]
    rows.append("| DynamicConv small (3 + 2 layers) | - | " + " | ".join(cells) + " |")
    models = (("GPT-2 (4 blocks)", gpt2, lm, ids, "residual"),
              ("resnet18 (8 blocks)", resnet, classify, images, "residual_star"))
    for name, model, loss, batch, star in models:
        plain = plain_breaks(copy.deepcopy(model), loss, batch)
        cells = [cell(prepared_breaks(copy.deepcopy(model), loss, batch, o, 2, star)) for o in CONFIGURATIONS.values()]
        rows.append(f"| {name} | {plain} | " + " | ".join(cells) + " |")
    print("\n".join(rows))
    print("\nReasons (first line), over the table:")
    for reason, count in sorted(reasons.items(), key=lambda item: -item[1]):
        print(f"- {count} x {reason}")


if __name__ == "__main__":
    main()
