"""Chains of blocks in a model lowmem did not write (lowmem.techniques.chains): how blocks are found,
wrapped and run checkpointed — keyword arguments, context tensors that need gradients, refusals,
copies and unwrapping."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowmem
from lowmem.techniques.chains import installed_runners, uninstall_chains
from lowmem.techniques.checkpointing import apply_checkpointing

STRATEGIES = [("residual", 1), ("residual", 3), ("residual_star", 2), ("residual_star", 4)]


class CrossBlock(nn.Module):
    """A decoder-style block: reads a memory (which needs its gradient) and a keyword scale."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = nn.Linear(2 * width, width)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, memory, *, scale: float = 1.0, mask=None):
        h = self.mix(torch.cat([x, memory], dim=-1)) * scale
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return x + self.drop(torch.tanh(self.norm(h)))


class Decoder(nn.Module):
    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.encoder = nn.Linear(width, width)
        self.layers = nn.ModuleList(CrossBlock(width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        memory = torch.sin(self.encoder(x))
        mask = x > 1.5
        for layer in self.layers:
            x = layer(x, memory, scale=0.5, mask=mask)
        return self.out(x).squeeze(-1)


def gradients(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    model(x).pow(2).mean().backward()
    return {**{n: p.grad.clone() for n, p in model.named_parameters()}, **dict(model.named_buffers())}


@pytest.mark.parametrize("strategy, every", STRATEGIES)
def test_keyword_arguments_and_context_gradients_are_exact(strategy, every):
    torch.manual_seed(0)
    model = Decoder().double()
    x = torch.randn(6, 8, dtype=torch.float64)
    reference = gradients(copy.deepcopy(model), x)
    checkpointed = copy.deepcopy(model)
    apply_checkpointing(checkpointed, strategy, every)
    got = gradients(checkpointed, x)
    assert reference.keys() == got.keys()
    for name, value in reference.items():
        assert torch.equal(value, got[name]), name  # the encoder's gradient arrives through the memory


def test_optimal_checkpointing_measures_blocks_with_keyword_arguments():
    torch.manual_seed(0)
    model = Decoder(width=16, depth=6)
    x = torch.randn(32, 16)

    def loss(m, batch):
        return m(batch).pow(2).mean()

    plain = lowmem.prepare(copy.deepcopy(model), loss, x, overrides=["trainer.device=cpu"]).profile(measure=False)
    budget = 0.7 * plain["activation_bytes"] / 1e6
    run = lowmem.prepare(copy.deepcopy(model), loss, x, overrides=[
        "trainer.device=cpu", "checkpointing.strategy=optimal", f"checkpointing.budget_mb={budget}"])  # fmt: skip
    assert run.profile(measure=False)["activation_bytes"] <= budget * 1e6
    run.step(x)


def test_a_block_returning_a_tuple_is_refused_naming_the_knob():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x), self.b(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Pair() for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = sum(block(x))
            return x

    model = Model()
    apply_checkpointing(model, "residual", 2)
    with pytest.raises(ValueError, match=r"block blocks.0 \(Pair\) returns tuple, not one tensor.*blocks="):
        model(torch.randn(2, 4))


def test_a_block_changing_its_input_in_place_is_refused():
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x.mul_(2))

    model = nn.Sequential(nn.Sequential(InPlace(), InPlace()))
    apply_checkpointing(model, "residual", 2, blocks=["0"])
    with pytest.raises(ValueError, match=r"block 0.0 \(InPlace\) changes its input in place"):
        model(torch.randn(2, 4, requires_grad=True) * 1)


def test_wrapping_is_per_instance_copies_train_alone_and_unwrapping_restores():
    torch.manual_seed(0)
    model = Decoder().double()
    x = torch.randn(6, 8, dtype=torch.float64)
    apply_checkpointing(model, "residual_star", 2)
    assert type(model.layers[0]) is CrossBlock and "forward" in vars(model.layers[0])
    clone = copy.deepcopy(model)
    assert installed_runners(clone)[0].blocks[0] is clone.layers[0]  # the copy's runner runs the copy's blocks
    assert torch.equal(torch.as_tensor(gradients(clone, x)["layers.0.mix.weight"]),
                       gradients(model, x)["layers.0.mix.weight"])  # fmt: skip
    with torch.no_grad():  # evaluation runs the blocks plainly
        model.eval()
        model(x)
    uninstall_chains(model)
    assert "forward" not in vars(model.layers[0]) and not installed_runners(model)
    assert list(model.state_dict()) == list(Decoder().state_dict())
