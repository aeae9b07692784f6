"""A budget that holds (issue 30, item 6): a configuration ``lowmem.plan`` picks measures within its
budget (+3%) on models people train (torchvision, timm, transformers), the planner never picks nor
stops on a configuration ``lowmem.prepare`` refuses, and ``run.profile()`` measures the run's own
tensors, not the caller's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import lowmem
from lowmem.config import ConfigError
from lowmem.planning.search import Planner
from tests.helpers import slow

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

CPU = ["precision=fp32", "trainer.device=cpu"]
MARGIN = 1.03  # measured peak <= budget + 3%


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def language_model_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def images() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(16, 3, 32, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator)


def tokens() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 500, (4, 24), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=500, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=500,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


# model -> (build, loss, batch, budget in MB: about half of plain PyTorch's measured peak, above the
# smallest reachable)
MODELS = {
    "torchvision_resnet18": (lambda: torchvision.models.resnet18(num_classes=10), classification_loss, images, 40.0),
    "timm_convnext_atto": (
        lambda: timm.create_model("convnext_atto", num_classes=10), classification_loss, images, 24.0,
    ),
    "timm_efficientnet_b0": (
        lambda: timm.create_model("efficientnet_b0", num_classes=10), classification_loss, images, 36.0,
    ),
    "gpt2": (gpt2, language_model_loss, tokens, 3.2),
    "llama": (llama, language_model_loss, tokens, 3.0),
}


# 40-145 s each on a Zen 3 core (a search, a plain and a planned step): the issue's own case (torchvision
# resnet18 at 40 MB) runs in `make test`, the others in `make test-all` only. timm's resnet18
# (torchvision's architecture again, budget 46 MB) was measured within its budget and left out for time.
SLOW = {"timm_convnext_atto", "timm_efficientnet_b0", "llama", "gpt2"}


@pytest.mark.parametrize("name", [slow(n) if n in SLOW else n for n in MODELS])
def test_a_planned_configuration_measures_within_its_budget(name: str) -> None:
    build, loss, batch_of, budget = MODELS[name]
    torch.manual_seed(0)
    model, batch = build(), batch_of()
    # torchvision resnet18 at 40 MB: the search's best configurations include no_bn on compact
    # sparse layers, which lowmem.prepare refuses; lowmem.plan skips them and goes on.
    # top=1: the chosen configuration alone (the same as with the default table of 10; the search for
    # 10 fitting rows took resnet18's test from 26 to 40 s on a Zen 3 core)
    plan = lowmem.plan(copy.deepcopy(model), loss, batch, budget_mb=budget, overrides=CPU, top=1)
    assert plan["budget_total_bytes"] <= budget * 1e6
    assert plan["budget_total_bytes"] == plan["total_bytes"] + plan["step_temporary_bytes"]
    run = lowmem.prepare(model, loss, batch, overrides=[*plan["overrides"], "trainer.device=cpu"])
    run.step(batch)
    peak = run.profile()["peak_bytes"]
    assert peak <= budget * 1e6 * MARGIN, f"{name}: {plan['overrides']} measured {peak / 1e6:.2f} MB for {budget} MB"


def small_convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 10),
    )  # fmt: skip


def test_plan_skips_a_configuration_its_build_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    refused: list[dict[str, str]] = []
    build_chosen = Planner.build_chosen

    def refuse_the_first(self: Planner, candidate, reuse: bool = True):  # noqa: ANN001
        if not refused:
            refused.append(candidate.knobs())
            raise ConfigError("checkpointing.strategy='no_bn': refused (as lowmem.prepare would)")
        return build_chosen(self, candidate, reuse)

    monkeypatch.setattr(Planner, "build_chosen", refuse_the_first)
    monkeypatch.setattr("lowmem.planning.ahead.usable", lambda: False)  # no child profiling the first one
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    fixed = [*CPU, "checkpointing.strategy=none", "sparsity.density=1.0"]  # no blocks, no sparsifiable weight
    plan = lowmem.plan(small_convnet(), classification_loss, (x, y), budget_mb=50, overrides=fixed)
    assert refused and plan["configuration"] != refused[0]
    lowmem.prepare(small_convnet(), classification_loss, (x, y), overrides=[*plan["overrides"], "trainer.device=cpu"])


def test_profile_measures_the_runs_tensors_not_the_callers() -> None:
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    run = lowmem.prepare(small_convnet(), classification_loss, (x, y), overrides=CPU)
    run.step((x, y))
    alone = run.profile()
    held_by_the_caller = torch.ones(12_500_000)  # 50 MB of the caller's own
    beside = run.profile()
    assert beside["peak_bytes"] == alone["peak_bytes"]
    assert beside["peak_breakdown"]["other"] < 1e6
    assert held_by_the_caller.sum() > 0
