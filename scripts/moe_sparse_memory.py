"""A mixture of experts dense and at density 0.3: where its training memory goes (docs/techniques.md).

A 4-layer Mixtral (hidden 128, 8 experts of 512, 2 per token, transformers' grouped experts), FP32,
Adam, a batch of 8 x 64 tokens, on the CPU, through ``lowmem.prepare``; for each density one step,
then ``run.profile()``: the measured peak and the accounting's model, optimizer and activation bytes.
Compact sparse experts are built dense once per experts call and saved for backward by the experts'
own ops, so the activations grow by the experts' dense weights, printed beside them.
Run: ``.venv/bin/python scripts/moe_sparse_memory.py`` (~20 s on 2 cores).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lowmem  # noqa: E402
from lowmem.run.files import measured_on  # noqa: E402

MB = 1e6


def mixtral() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=512, num_local_experts=8, num_experts_per_tok=2,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        output_router_logits=True,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def main() -> None:
    tokens = torch.randint(0, 1000, (8, 64), generator=torch.Generator().manual_seed(1))

    def loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=batch, labels=batch).loss

    experts = sum(p.numel() * p.element_size() for n, p in mixtral().named_parameters() if ".experts." in n)
    print(measured_on("cpu"))
    print("| density | measured peak | model | optimizer | activations | experts' dense weights |")
    print("|---|---|---|---|---|---|")
    for density in (1.0, 0.3):
        run = lowmem.prepare(mixtral(), loss, tokens, overrides=["trainer.device=cpu", "precision=fp32",
                             "optim.name=adam", f"sparsity.density={density}"])  # fmt: skip
        run.step(tokens)
        row = run.profile()
        held = f"{experts / MB:.1f} MB (held to backward)" if density < 1 else "(parameters)"
        print(f"| {density} | {row['peak_bytes'] / MB:.1f} MB | {row['model_bytes'] / MB:.1f} MB | "
              f"{row['optimizer_bytes'] / MB:.1f} MB | {row['activation_bytes'] / MB:.1f} MB | {held} |")  # fmt: skip


if __name__ == "__main__":
    main()
