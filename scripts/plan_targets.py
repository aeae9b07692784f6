"""A plan is a promise (issue 47): ``lowmem.plan`` at 0.3x and 0.5x of plain PyTorch's measured peak,
then the chosen configuration measured again, on GPT-2, Llama, T5 and timm's RegNetX-200MF, in FP32
and BF16, with the planning time.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/plan_targets.py [model ...]

Plain PyTorch's peak: ``lowmem.prepare`` with ``loss.chunk_tokens=none`` and nothing else (FP32, or
BF16 for the BF16 rows), one step, ``run.profile()``'s measured peak. The plan fixes the precision
and searches every other knob (``trainer.device=cpu``); the chosen overrides are prepared afresh,
stepped once and profiled: that measured peak is the one compared with the budget (issue 47's bar:
at most the budget + 3%). Plan seconds are wall-clock and CPU seconds of the ``lowmem.plan`` call
(one thread: on a machine shared with other jobs, two OpenMP threads spin while waiting for a core).
Prints a Markdown table, the measurement's provenance first.
"""

from __future__ import annotations

import copy
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lowmem  # noqa: E402
from lowmem.run.files import measured_on  # noqa: E402

FRACTIONS = (0.3, 0.5)


def language_model_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def tokens(vocabulary: int, examples: int = 4, length: int = 128) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocabulary, (examples, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def images(examples: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    labels = torch.randint(0, 10, (examples,), generator=generator)
    return torch.randn(examples, 3, 64, 64, generator=generator), labels


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    return LlamaForCausalLM(config)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=8000, n_positions=128))


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=8000, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    return T5ForConditionalGeneration(config)


def regnetx_002() -> nn.Module:
    import timm

    return timm.create_model("regnetx_002", num_classes=10)


# name -> (model, loss, batch): Llama with a 32k vocabulary (hidden 64, 2 layers), GPT-2 (64 wide, 4
# layers) and T5 (d_model 64, 2 + 2 layers) with 8k, all on 4 x 128 tokens; RegNetX-200MF on 8
# images of 3 x 64 x 64.
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable, Callable[[], object]]] = {
    "llama": (llama, language_model_loss, lambda: tokens(32000)),
    "gpt2": (gpt2, language_model_loss, lambda: tokens(8000)),
    "t5": (t5, language_model_loss, lambda: tokens(8000)),
    "regnetx_002": (regnetx_002, classification_loss, images),
}


def measured_peak(model: nn.Module, loss: Callable, batch: object, overrides: list[str]) -> float:
    """MB: one step of ``model`` prepared with ``overrides``, then ``run.profile()``'s measured peak."""
    run = lowmem.prepare(model, loss, batch, overrides=["trainer.device=cpu", *overrides])
    run.step(batch)
    return run.profile()["peak_bytes"] / 1e6


def main(names: list[str]) -> None:
    print(measured_on("cpu"), flush=True)
    warnings.filterwarnings("ignore")
    print("| model | precision | plain peak (MB) | budget (MB) | chosen | accounted + step temporaries (MB) | "
          "measured peak (MB) | peak / budget | plan s (CPU s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names or list(MODELS):
        build, loss, batch_of = MODELS[name]
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            model, batch = build(), batch_of()
            plain_knobs = [f"precision={precision}", "loss.chunk_tokens=none"]
            plain = measured_peak(copy.deepcopy(model), loss, batch, plain_knobs)
            for fraction in FRACTIONS:
                budget = round(fraction * plain, 2)
                fixed = ["trainer.device=cpu", f"precision={precision}"]
                began, cpu = time.perf_counter(), time.process_time()
                plan = lowmem.plan(copy.deepcopy(model), loss, batch, budget_mb=budget, overrides=fixed)
                seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
                peak = measured_peak(copy.deepcopy(model), loss, batch, [*fixed, *plan["overrides"]])
                chosen = " ".join(plan["overrides"])
                print(f"| {name} | {precision} | {plain:.1f} | {budget:g} ({fraction}x) | `{chosen}` | "
                      f"{plan['budget_total_bytes'] / 1e6:.2f} | {peak:.2f} | {peak / budget:.3f} | "
                      f"{seconds:.1f} ({cpu:.1f}) |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
