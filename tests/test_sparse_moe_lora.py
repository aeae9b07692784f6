"""Sparsity on mixtures of experts and on LoRA models (issue 46, parts 2 and 4).

- transformers 5 stores experts as 3-D parameters ([experts, rows, columns]); at density 0.3 each
  expert's matrix starts with exactly 30% of its entries, the active count of the model stays exact
  through rewirings, compact storage equals masked storage in FP64, the optimizer state is reset at
  regrown positions of a 3-D tensor, and the state-dict keys stay the model's own: Mixtral (eager and
  grouped experts, FP32 and BF16) and Qwen2-MoE (with its shared expert and shared-expert gate).
- Routers stay dense by default and every multiplying weight left dense is named once in the log
  and in the profile JSON (``dense_weights``); ``sparsity.include`` naming experts sparsifies them.
- Frozen weights are untouched by default; one named by ``sparsity.include`` is pruned once, to its
  largest entries, with one warning, and never rewired.
- A peft LoRA Llama at density 0.3: every frozen base weight bit-identical after training; ``lora_A``
  sparse, the zero-initialised ``lora_B`` dense, so the adapted model still starts equal to its base.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowmem
from lowmem.techniques.compact import dense_copy
from lowmem.techniques.sparsity import DynamicSparsity, RewireSchedule
from lowmem.techniques.targets import default_sparse_weights, router_weights

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

# SGD with momentum (state to reset), rewiring after every update (the schedule's 100 / 100).
SGD = ["trainer.device=cpu", "optim.name=sgd", "optim.lr=0.1", "optim.momentum=0.9", "optim.weight_decay=0"]
EVERY_UPDATE = ["sparsity.density=0.3", "sparsity.rewire_freq_mult=100"]


def mixtral(experts_implementation: str = "eager") -> nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        output_router_logits=True, router_aux_loss_coef=0.05, experts_implementation=experts_implementation,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def qwen2_moe() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=24,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, output_router_logits=True,
        experts_implementation="eager",
    )  # fmt: skip
    return transformers.Qwen2MoeForCausalLM(config)


TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def multiplying_share(model: nn.Module) -> float:
    """Nonzeros over the weights that multiply (2-D or more, not the embedding, head or norms)."""
    nonzero = total = 0
    for name, tensor in model.state_dict().items():
        multiplies = tensor.dim() >= 2 and not any(part in name for part in ("embed", "lm_head", "norm"))
        if tensor.is_floating_point() and multiplies:
            nonzero += int(tensor.count_nonzero())
            total += tensor.numel()
    return nonzero / total


@pytest.mark.parametrize(
    "make, overrides",
    [(mixtral, ["sparsity.storage=masked"]), (mixtral, []), (qwen2_moe, []),
     (lambda: mixtral("grouped_mm"), []), (lambda: mixtral("grouped_mm"), ["precision=bf16"])],
    ids=["mixtral-masked", "mixtral", "qwen2_moe", "mixtral-grouped_mm", "mixtral-grouped_mm-bf16"],
)  # fmt: skip
def test_experts_are_sparse_per_expert_and_keep_their_count_through_rewirings(make, overrides):
    model = make()
    keys = list(model.state_dict())
    run = lowmem.prepare(model, lm_loss, TOKENS, overrides=[*SGD, *EVERY_UPDATE, *overrides])
    sparsity = run.trainer.sparsity
    experts = [name for name in sparsity.sparse_weight_names() if ".experts." in name]
    assert len(experts) == 4  # gate_up_proj and down_proj of both layers
    for name in experts:  # each expert's matrix: exactly round(0.3 · its entries)
        mask = sparsity.masks[name]
        assert mask.dim() == 3 and mask.sum((1, 2)).tolist() == [round(0.3 * mask[0].numel())] * mask.shape[0]
    counts = {name: int(mask.sum()) for name, mask in sparsity.masks.items()}
    for _ in range(3):
        assert math.isfinite(run.step(TOKENS)["loss"])
    masks = sparsity.masks
    assert sum(int(mask.sum()) for mask in masks.values()) == sum(counts.values())  # exact, all weights
    assert any(int(masks[name].sum()) != counts[name] for name in experts)  # rewired: counts moved
    state = run.model.state_dict()
    assert list(state) == keys
    for name in sparsity.sparse_weight_names():
        assert state[name].shape == masks[name].shape
        assert not state[name][~masks[name]].any()  # zero wherever inactive
    assert multiplying_share(run.model) <= 0.31
    plain = dense_copy(run.model)  # the experts module's own class again, holding the same weights
    assert type(plain.model.layers[0].mlp.experts) is type(make().model.layers[0].mlp.experts)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=TOKENS).logits, run.model(input_ids=TOKENS).logits, rtol=0, atol=0)


def test_compact_stacked_experts_equal_masked_ones_in_fp64():
    def trained(storage: str) -> dict[str, torch.Tensor]:
        overrides = [*SGD, *EVERY_UPDATE, "precision=fp64", f"sparsity.storage={storage}"]
        run = lowmem.prepare(mixtral(), lm_loss, TOKENS, overrides=overrides)
        for _ in range(2):
            run.step(TOKENS)
        return run.model.state_dict()

    compact, masked = trained("compact"), trained("masked")
    assert list(compact) == list(masked)
    for key, value in masked.items():
        torch.testing.assert_close(compact[key], value, rtol=0, atol=1e-12, msg=key)


def test_routers_stay_dense_and_every_dense_weight_is_named_once(caplog):
    model = qwen2_moe()
    routers = [f"model.layers.{i}.mlp.{gate}.weight" for i in range(2) for gate in ("gate", "shared_expert_gate")]
    assert router_weights(model) == routers  # expert logits [4, 16], the shared expert's gate [1, 16]
    with caplog.at_level(logging.INFO, logger="lowmem"):
        run = lowmem.prepare(model, lm_loss, TOKENS, overrides=[*SGD, "sparsity.density=0.3"])
    sparsity = run.trainer.sparsity
    assert not set(routers) & set(sparsity.sparse_weight_names())
    assert sparsity.dense_weights == {**dict.fromkeys(routers, "router"), "lm_head.weight": "last layer"}
    lines = [record.getMessage() for record in caplog.records if "stay dense" in record.getMessage()]
    assert lines == [
        "sparsity: 5 multiplying weights stay dense: router: model.layers.*.mlp.gate.weight (x2), "
        "model.layers.*.mlp.shared_expert_gate.weight (x2); last layer: lm_head.weight"
    ]


class ToyExperts(nn.Module):
    """Experts as transformers 5 stores them, routed softly (every token through every expert with its
    router weight) so that the profiler's fake pass runs through them."""

    def __init__(self, experts: int = 3, hidden: int = 8, inner: int = 12) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inner, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inner) / inner**0.5)

    def forward(self, x: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("th,eoh->teo", x, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("tei,ehi->teh", F.silu(gate) * up, self.down_proj)
        return (out * routing.unsqueeze(-1)).sum(1)


class ToyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.gate = nn.Linear(8, 3, bias=False)  # a router that is an nn.Linear: dense by the default rule
        self.experts = ToyExperts()
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = h + self.experts(h, self.gate(h).softmax(-1))
        return self.head(self.mix(h).relu())


def regression_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def test_linear_routers_stay_dense_and_the_profile_json_names_the_dense_weights():
    model = ToyMoE()
    assert default_sparse_weights(model) == ["experts.gate_up_proj", "experts.down_proj", "mix.weight"]
    assert default_sparse_weights(model, ["*experts*"]) == ["experts.gate_up_proj", "experts.down_proj"]
    batch = (torch.randn(6, 4), torch.randn(6, 2))
    run = lowmem.prepare(model, regression_loss, batch, overrides=[*SGD, "sparsity.density=0.5"])
    run.step(batch)
    row = run.profile(measure=False)
    assert row["dense_weights"] == {"stem.weight": "first layer", "gate.weight": "router", "head.weight": "last layer"}
    # Accounted as CSR of each expert's matrix: [experts · rows, columns].
    shapes = {name: shape for name, (shape, _) in run.trainer.sparsity.trained_parameters().items()}
    assert shapes["experts.gate_up_proj_values"] == (3 * 24, 8)


def test_sparsity_include_naming_experts_sparsifies_only_them():
    run = lowmem.prepare(mixtral(), lm_loss, TOKENS, overrides=[*SGD, *EVERY_UPDATE, "sparsity.include=*.experts.*"])
    sparsity = run.trainer.sparsity
    assert sparsity.sparse_weight_names() == [
        f"model.layers.{i}.mlp.experts.{name}" for i in range(2) for name in ("gate_up_proj", "down_proj")
    ]
    assert sparsity.dense_weights["model.layers.0.self_attn.q_proj.weight"] == "left out by the rule"
    run.step(TOKENS)
    assert run.model.state_dict()["model.layers.1.mlp.experts.down_proj"].count_nonzero() <= round(0.3 * 4 * 16 * 32)


def test_frozen_weights_are_untouched_unless_named_then_pruned_once_with_one_warning(caplog):
    frozen = "model.layers.0.self_attn.q_proj.weight"
    model = mixtral()
    model.get_parameter(frozen).requires_grad_(False)
    original = model.get_parameter(frozen).detach().clone()
    with caplog.at_level(logging.WARNING, logger="lowmem"):
        run = lowmem.prepare(model, lm_loss, TOKENS, overrides=[*SGD, *EVERY_UPDATE])
    assert frozen not in run.trainer.sparsity.sparse_weight_names()
    assert run.trainer.sparsity.dense_weights[frozen] == "frozen"
    for _ in range(2):
        run.step(TOKENS)
    assert torch.equal(run.model.state_dict()[frozen], original)
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]

    model = mixtral()
    model.get_parameter(frozen).requires_grad_(False)
    with caplog.at_level(logging.WARNING, logger="lowmem"):
        caplog.clear()
        overrides = [*SGD, *EVERY_UPDATE, "sparsity.include=*.q_proj.weight"]
        run = lowmem.prepare(model, lm_loss, TOKENS, overrides=overrides)
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(warnings) == 1 and frozen in warnings[0] and "never rewired" in warnings[0]
    sparsity = run.trainer.sparsity
    kept = round(0.3 * original.numel())
    largest = torch.zeros(original.numel(), dtype=torch.bool)
    largest[original.abs().flatten().topk(kept).indices] = True
    assert torch.equal(sparsity.masks[frozen], largest.view(original.shape))
    for _ in range(3):  # rewirings move the trained layer's entries, never the frozen one's
        run.step(TOKENS)
    assert torch.equal(sparsity.masks[frozen], largest.view(original.shape))
    assert torch.equal(run.model.state_dict()[frozen], original * largest.view(original.shape))


@pytest.mark.parametrize("storage", ["compact", "masked"])
def test_optimizer_state_is_reset_at_the_regrown_positions_of_a_3d_expert_tensor(storage):
    torch.manual_seed(0)
    model = ToyMoE()
    name = "experts.gate_up_proj"
    schedule = RewireSchedule(starts=(0,), periods=(1,), stop=10, unit="update")
    sparsity = DynamicSparsity(model, [name, "mix.weight"], 0.3, schedule=schedule, storage=storage, init="model",
                               init_threshold=0.1)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    regression_loss(model, (x, y)).backward()
    sparsity.mask_gradients()
    optimizer.step()
    before = sparsity.masks[name]
    param = sparsity.compact.values_of(name) if storage == "compact" else model.get_parameter(name)
    momentum = _dense_momentum(sparsity, optimizer, name, param)
    report = sparsity.rewire(optimizer)
    assert report["regrown"] > 0
    after = sparsity.masks[name]
    param = sparsity.compact.values_of(name) if storage == "compact" else model.get_parameter(name)
    moved = _dense_momentum(sparsity, optimizer, name, param)
    regrown, kept = after & ~before, after & before
    assert regrown.any() and not moved[regrown].any() and not moved[~after].any()
    assert torch.equal(moved[kept], momentum[kept])
    assert not sparsity.dense_weight(name)[regrown].any()  # regrown weights start at 0


def _dense_momentum(sparsity, optimizer, name: str, param: torch.Tensor) -> torch.Tensor:
    buffer = optimizer.state[param]["momentum_buffer"]
    if sparsity.compact is None:
        return buffer.clone()
    dense = buffer.new_zeros(sparsity.masks[name].numel())
    dense[sparsity.compact.positions(name)] = buffer
    return dense.view(sparsity.masks[name].shape)


def test_lora_keeps_every_frozen_base_weight_bit_identical_and_sparsifies_lora_a():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    lora = peft.get_peft_model(
        transformers.LlamaForCausalLM(config),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    frozen = {name: param.detach().clone() for name, param in lora.named_parameters() if not param.requires_grad}
    state = {key: value.clone() for key, value in lora.state_dict().items()}
    with torch.no_grad():
        base_logits = lora(input_ids=TOKENS).logits
    run = lowmem.prepare(lora, lm_loss, TOKENS, overrides=[*SGD, *EVERY_UPDATE])
    sparsity = run.trainer.sparsity
    assert sparsity.sparse_weight_names() and all(".lora_A." in name for name in sparsity.sparse_weight_names())
    assert {why for name, why in sparsity.dense_weights.items() if ".lora_B." in name} == {"zero-initialised"}
    with torch.no_grad():  # lora_B is still 0: the adapted model starts equal to its base
        assert torch.equal(run.model(input_ids=TOKENS).logits, base_logits)
    losses = [run.step(TOKENS)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    assert all(torch.equal(param, frozen[name]) for name, param in run.model.named_parameters() if name in frozen)
    trained = run.model.state_dict()
    assert list(trained) == list(state)
    assert all(torch.equal(trained[key], value) for key, value in state.items() if ".lora_" not in key)
