"""The profiler, the planner and optimal checkpointing on models fake tensors or a strict chain of
blocks do not fit (issue 46, items 2 and 3): a mixture of experts, whose routing gives shapes that
depend on values (measured on real tensors instead), and diffusers' UNet, whose blocks are called
with keyword arguments only and not one after another (its down blocks, the middle block's, its up
blocks: measured as runs). Plans hold their budget within 3%; a configuration that cannot be built
or accounted, whatever it raises, is skipped."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowmem
from lowmem.config import ConfigError
from lowmem.planning.optimal import BudgetTooSmall
from lowmem.planning.schedule import BlockCosts, ChainCosts
from lowmem.planning.search import Planner
from lowmem.techniques.checkpointing import Segment

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

CPU = ["trainer.device=cpu"]
MARGIN = 1.03  # measured peak <= budget + 3%


def mixtral(experts: str | None = "eager") -> nn.Module:
    """A tiny Mixtral with its router loss on; ``experts``: transformers' experts implementation
    (None: its default, grouped matrix products)."""
    torch.manual_seed(0)
    implementation = {} if experts is None else {"experts_implementation": experts}
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_dropout=0.0, output_router_logits=True, router_aux_loss_coef=0.05, **implementation,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def language_model_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def token_ids() -> torch.Tensor:
    return torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))


def unet() -> nn.Module:
    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8, attention_head_dim=8, dropout=0.0,
    )  # fmt: skip


def denoising_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, t, noise = batch
    return F.mse_loss(model(x, t).sample, noise)


def noisy_images() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(2)
    return (
        torch.randn(4, 3, 16, 16, generator=generator),
        torch.randint(0, 1000, (4,), generator=generator),
        torch.randn(4, 3, 16, 16, generator=generator),
    )


def plain_peak_mb(build, loss, batch, overrides: list[str]) -> float:  # noqa: ANN001
    run = lowmem.prepare(build(), loss, batch, overrides=[*CPU, *overrides])
    run.step(batch)
    return run.profile()["peak_bytes"] / 1e6


def measured_peak_mb(build, loss, batch, overrides: list[str]) -> float:  # noqa: ANN001
    run = lowmem.prepare(build(), loss, batch, overrides=[*overrides, *CPU])
    run.step(batch)
    return run.profile()["peak_bytes"] / 1e6


# --- a mixture of experts ---------------------------------------------------------------------------


@pytest.mark.parametrize("experts", ["eager", None])
def test_a_mixture_of_experts_is_profiled_on_real_tensors(experts: str | None) -> None:
    """Eager experts route with ``nonzero``; grouped experts' ``_grouped_mm`` has no fake FP32 kernel:
    the accounting runs on real tensors, says so and why, and leaves the training state as it was."""
    batch = token_ids()
    run = lowmem.prepare(mixtral(experts), language_model_loss, batch, overrides=[*CPU, "precision=fp32"])
    run.step(batch)
    params = {name: p.detach().clone() for name, p in run.model.named_parameters()}
    grads = {name: p.grad for name, p in run.model.named_parameters()}
    random_state = torch.random.get_rng_state()
    row = run.profile(measure=False)
    assert row["activation_pass"].startswith("real tensors: ") and "experts" in row["activation_pass"]
    assert 0 < row["activation_bytes"] < row["total_bytes"] and row["flops"] > 0
    assert all(torch.equal(p, params[name]) for name, p in run.model.named_parameters())
    assert all(p.grad is grads[name] for name, p in run.model.named_parameters())
    assert torch.equal(torch.random.get_rng_state(), random_state)
    assert run.profile()["peak_bytes"] > 0


def test_optimal_on_a_mixture_of_experts_names_the_smallest_budget_and_trains_at_it() -> None:
    batch = token_ids()
    optimal = [*CPU, "precision=fp32", "checkpointing.strategy=optimal"]
    with pytest.raises(BudgetTooSmall) as refusal:
        lowmem.prepare(mixtral(), language_model_loss, batch, overrides=[*optimal, "checkpointing.budget_mb=0.001"])
    message = str(refusal.value)
    assert "\n" not in message and "checkpointing.budget_mb" in message
    smallest = float(re.search(r"smallest reachable is ([0-9.]+) MB", message).group(1))
    at_smallest = [*optimal, f"checkpointing.budget_mb={smallest}"]
    run = lowmem.prepare(mixtral(), language_model_loss, batch, overrides=at_smallest)
    losses = [run.step(batch)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    assert run.profile(measure=False)["activation_bytes"] <= smallest * 1e6


def test_a_step_neither_pass_can_run_is_refused_in_one_line() -> None:
    """Grouped experts in FP64: no fake kernel, and no real one either (``_grouped_mm`` takes no
    Double): one line naming the module and the knob, no raw torch error."""
    batch = token_ids()
    with pytest.raises(ConfigError) as refusal:
        lowmem.prepare(mixtral(None), language_model_loss, batch, overrides=[
            *CPU, "precision=fp64", "checkpointing.strategy=optimal", "checkpointing.budget_mb=1"
        ])  # fmt: skip
    message = str(refusal.value)
    assert "\n" not in message and "model.layers.0.mlp.experts" in message and "precision=" in message


@pytest.mark.slow
def test_a_plan_for_a_mixture_of_experts_at_half_its_peak_measures_within_its_budget() -> None:
    batch = token_ids()
    budget = round(0.5 * plain_peak_mb(mixtral, language_model_loss, batch, ["precision=fp32"]), 3)
    plan = lowmem.plan(mixtral(), language_model_loss, batch, budget_mb=budget, overrides=CPU)
    assert plan["budget_total_bytes"] <= budget * 1e6
    peak = measured_peak_mb(mixtral, language_model_loss, batch, plan["overrides"])
    assert peak <= MARGIN * budget, (budget, peak, plan["overrides"])


# --- diffusers' UNet: keyword-only blocks, not one chain ----------------------------------------


def test_a_unet_trains_under_optimal_checkpointing() -> None:
    batch = noisy_images()
    plain = plain_peak_mb(unet, denoising_loss, batch, ["precision=fp32"])
    optimal = ["checkpointing.strategy=optimal", f"checkpointing.budget_mb={0.6 * plain:.3f}"]
    run = lowmem.prepare(unet(), denoising_loss, batch, overrides=[*CPU, "precision=fp32", "optim.lr=0.01", *optimal])
    losses = [run.step(batch)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0], losses


@pytest.mark.slow
def test_a_plan_for_a_unet_at_half_its_peak_measures_within_its_budget() -> None:
    batch = noisy_images()
    budget = round(0.5 * plain_peak_mb(unet, denoising_loss, batch, ["precision=fp32"]), 2)
    plan = lowmem.plan(unet(), denoising_loss, batch, budget_mb=budget, overrides=[*CPU, "precision=fp32"])
    peak = measured_peak_mb(unet, denoising_loss, batch, plan["overrides"])
    assert peak <= MARGIN * budget, (budget, peak, plan["overrides"])


@pytest.mark.parametrize("strategy", ["residual", "residual_star", "optimal"])
def test_a_unet_step_equals_plain_pytorch_in_fp64(strategy: str) -> None:
    """One SGD step (no momentum, no decay) in FP64: every weight within 1e-10 of its update of the
    plain step, whichever way the keyword-only blocks are checkpointed."""
    batch = noisy_images()
    reference = unet().double()
    before = {name: p.detach().clone() for name, p in reference.named_parameters()}
    denoising_loss(reference, (batch[0].double(), batch[1], batch[2].double())).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    sgd = ["precision=fp64", "optim.name=sgd", "optim.lr=0.1", "optim.momentum=0", "optim.nesterov=false",
           "optim.weight_decay=0"]  # fmt: skip
    budget = ["checkpointing.budget_mb=4"] if strategy == "optimal" else []
    run = lowmem.prepare(unet(), denoising_loss, batch, overrides=[
        *CPU, *sgd, f"checkpointing.strategy={strategy}", *budget
    ])  # fmt: skip
    run.step(batch)
    trained = dict(run.model.named_parameters())
    for name, p in reference.named_parameters():
        update = (p - before[name]).abs().max()
        assert (trained[name] - p).abs().max() <= 1e-10 * update, name


def test_runs_of_a_chain_make_one_schedule_per_chain() -> None:
    """A chain measured as runs (blocks 2-3, then 0-1; block 4 never chained) gets its runs' segments
    in block order, and a stored segment for the block no run holds."""
    block = BlockCosts(0, 0, {False: 0}, {}, 0, 0, 0, False)
    costs = ChainCosts((block,) * 4, (2, 2), (0, 0), 0, 0, (0, 0), (2, 0), (5,))
    late, early = (Segment(2, "all_at_once"),), (Segment(1, "recursively"), Segment(1))
    assert costs.in_model_order([late, early]) == [(*early, *late, Segment(1))]


# --- whatever a configuration raises, the plan goes on ---------------------------------------------


class TwiceCalledBlocks(nn.Module):
    """Its first block runs twice per forward (shared weights): optimal's programme, which gives each
    block one way to run, refuses it; the fixed strategies run it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        x = self.blocks[0](x)
        return self.head(self.blocks[1](x))


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def test_optimal_refuses_a_block_run_twice_in_one_line() -> None:
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    with pytest.raises(ConfigError) as refusal:
        lowmem.prepare(TwiceCalledBlocks(), classification_loss, batch, overrides=[
            *CPU, "checkpointing.strategy=optimal", "checkpointing.budget_mb=1"
        ])  # fmt: skip
    message = str(refusal.value)
    assert "\n" not in message and "blocks.0" in message and "checkpointing.strategy=residual" in message


def test_plan_skips_what_the_search_cannot_account_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lowmem.planning.ahead.usable", lambda: False)  # one process: deterministic
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    fixed = [*CPU, "precision=fp32", "sparsity.density=1.0", "optim.state_bits=null"]
    plan = lowmem.plan(TwiceCalledBlocks(), classification_loss, batch, budget_mb=50, overrides=fixed)
    assert plan["configuration"]["checkpointing.strategy"] != "optimal"
    assert any("optimal" in line and "blocks.0" in line for line in plan["refused"])


def test_plan_skips_a_build_that_raises_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    refused: list[dict[str, str]] = []
    build_chosen = Planner.build_chosen

    def fail_the_first(self: Planner, candidate, reuse: bool = True):  # noqa: ANN001
        if not refused:
            refused.append(candidate.knobs())
            raise KeyError("a build that fails in a way no one foresaw")
        return build_chosen(self, candidate, reuse)

    monkeypatch.setattr(Planner, "build_chosen", fail_the_first)
    monkeypatch.setattr("lowmem.planning.ahead.usable", lambda: False)  # no child building the first one
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    fixed = [*CPU, "precision=fp32", "sparsity.density=1.0", "optim.state_bits=null", "microbatch.size=null"]
    plan = lowmem.plan(TwiceCalledBlocks(), classification_loss, batch, budget_mb=50, overrides=fixed)
    assert refused and plan["configuration"] != refused[0]
    assert any("no one foresaw" in line for line in plan["refused"])
