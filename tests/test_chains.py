"""Chains of blocks in a model lowmem did not write (lowmem.techniques.chains): how blocks are found,
wrapped and run checkpointed — keyword arguments, context tensors that need gradients, refusals,
copies and unwrapping."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowmem
from lowmem.techniques.block_checks import OutputFingerprint
from lowmem.techniques.chains import RecomputationMismatch, installed_runners, uninstall_chains
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


def plain_and_checkpointed_gradients(model: nn.Module, x: torch.Tensor, strategy: str, every: int):
    """``gradients`` of a copy of ``model`` as it is, and of a copy checkpointed with ``strategy``."""
    checkpointed = copy.deepcopy(model)
    apply_checkpointing(checkpointed, strategy, every)
    return gradients(copy.deepcopy(model), x), gradients(checkpointed, x)


@pytest.mark.parametrize("strategy, every", STRATEGIES)
def test_keyword_arguments_and_context_gradients_are_exact(strategy, every):
    torch.manual_seed(0)
    reference, got = plain_and_checkpointed_gradients(Decoder().double(), torch.randn(6, 8, dtype=torch.float64),
                                                      strategy, every)  # fmt: skip
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


class Pair(nn.Module):
    """A block returning a tuple: the tensor for the next block, a side tensor (needs its gradient),
    and a non-tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.a(x)), self.b(x), "note"


class PairModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Pair() for _ in range(3))

    def forward(self, x):
        total = 0
        for block in self.blocks:
            x, side, note = block(x)
            assert note == "note"
            total = total + side.pow(2).sum()
        return x.sum() + total


@pytest.mark.parametrize("strategy, every", [("residual", 3), ("residual_star", 2)])
def test_a_block_returning_a_tuple_is_checkpointed_on_its_first_tensor(strategy, every):
    torch.manual_seed(0)
    reference, got = plain_and_checkpointed_gradients(PairModel().double(), torch.randn(5, 4, dtype=torch.float64),
                                                      strategy, every)  # fmt: skip
    for name, value in reference.items():
        assert torch.equal(value, got[name]), name  # the side outputs' gradients reach blocks.*.b


def test_a_block_returning_no_tensor_is_refused_naming_the_knob():
    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return {"note": "no tensor"}

    model = nn.Sequential(nn.Sequential(Named(), Named()))
    apply_checkpointing(model, "residual", 2, blocks=["0"])
    with pytest.raises(ValueError, match=r"block 0.0 \(Named\) returns dict whose first tensor is no float.*blocks="):
        model(torch.randn(2, 4, requires_grad=True))


class Counting(nn.Module):
    """A block whose output depends on how often it ran: its recomputation differs from forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x) * self.calls


class CountingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Counting() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("strategy", ["residual", "residual_star", "optimal"])
def test_a_recomputation_that_differs_from_forward_stops_the_step(strategy):
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    extra = ["checkpointing.budget_mb=0.0004"] if strategy == "optimal" else ["checkpointing.every=3"]
    run = lowmem.prepare(CountingModel(), lambda m, b: m(b), x,
                         overrides=["trainer.device=cpu", f"checkpointing.strategy={strategy}", *extra])  # fmt: skip
    before = [p.detach().clone() for p in run.model.parameters()]
    with pytest.raises(RecomputationMismatch, match=r"^checkpointing: block blocks\.\d \(Counting\) recomputed in "
                       r"backward differs from its forward \(its output tensor 0 sums to .*beyond the relative "
                       r"tolerance .*checkpointing\.blocks"):
        run.step(x)
    assert all(torch.equal(a, b) for a, b in zip(before, run.model.parameters(), strict=True))  # never trained on


def test_recomputation_is_checked_once_per_block_and_input_shape():
    torch.manual_seed(0)
    model = Decoder().double()
    apply_checkpointing(model, "residual", 2)
    forwards = installed_runners(model)[0].forwards
    for batch in (6, 6, 3):
        gradients(model, torch.randn(batch, 8, dtype=torch.float64))
    shapes = [((6, 8), torch.float64, torch.device("cpu")), ((3, 8), torch.float64, torch.device("cpu"))]
    assert all(sorted(f.recomputation_checked, key=str) == sorted(shapes, key=str) for f in forwards)
    assert all(f.arguments_checked == f.recomputation_checked for f in forwards)


def test_fingerprints_compare_bits_or_sums_within_the_stated_tolerance():
    x = torch.randn(70_000, dtype=torch.float64)  # more than one chunk
    fingerprint = OutputFingerprint.of([x])
    assert fingerprint.differs([x.clone()], bitwise=True) is None
    swapped = x.clone()
    swapped[[0, 69_999]] = swapped[[69_999, 0]]
    assert "beyond the relative tolerance" in fingerprint.differs([swapped], bitwise=True)  # moved: weighted sum
    rounded = x * (1 + 1e-12)
    assert fingerprint.differs([rounded], bitwise=True) is not None
    assert fingerprint.differs([rounded], bitwise=False) is None
    # Other bits, rounding alone (another kernel's order of summation): within 2**10 ulps of the sums.
    assert fingerprint.differs([x * (1 + 2**-52)], bitwise=True) is None
    assert "beyond the relative tolerance" in fingerprint.differs([x * 1.01], bitwise=False)
    assert "returned [3] float64" in fingerprint.differs([x[:3]], bitwise=False)
    strided = torch.randn(4, 50_000).t()  # not contiguous: hashed slice by slice, in the same order
    assert OutputFingerprint.of([strided]) == OutputFingerprint.of([strided.contiguous()])


class Cache:
    """A stateful object handed to every block, as transformers' key/value caches are."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.store = {"total": torch.zeros(4)}


class CachingBlock(nn.Module):
    def __init__(self, change: str) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.change = change

    def forward(self, x, cache, *, extra=None):
        if self.change == "append":
            cache.keys.append(x.detach())
        elif self.change == "in place":
            cache.store["total"].add_(1)
        elif self.change == "keyword":
            extra["seen"] = True
        return self.linear(x)


@pytest.mark.parametrize("change, argument", [("append", "argument 1"), ("in place", "argument 1"),
                                              ("keyword", "argument 'extra'")])  # fmt: skip
def test_a_block_changing_an_object_passed_to_it_is_refused(change, argument):
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(CachingBlock(change) for _ in range(2))

        def forward(self, x):
            cache, extra = Cache(), {}
            for block in self.blocks:
                x = block(x, cache, extra=extra)
            return x.sum()

    model = Model()
    apply_checkpointing(model, "residual", 2)
    with pytest.raises(ValueError, match=rf"block blocks.0 \(CachingBlock\) changes its {argument} \(\w+\) in forward"
                       r".*checkpointing.blocks="):  # fmt: skip
        model(torch.randn(2, 4))
    model.blocks[0].change = model.blocks[1].change = "none"
    model(torch.randn(2, 4)).backward()  # reading the same objects is fine


def test_a_plain_layer_sequential_is_checkpointed_in_layer_runs():
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Dropout(0.3),
                          nn.Conv2d(8, 4, 3), nn.ReLU()),
            nn.Flatten(), nn.Linear(4 * 2 * 2, 3)).double()  # fmt: skip

    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    reference = gradients(net(), x)
    for strategy, every in STRATEGIES:
        model = net()
        apply_checkpointing(model, strategy, every)
        (chain,) = installed_runners(model)
        assert chain.chain.names == ("0.0-3", "0.4-6", "0.7-8")
        calls = []
        model[0][7].register_forward_hook(lambda *_, calls=calls: calls.append(1))
        got = gradients(model, x)
        assert len(calls) == 2, strategy  # forward and recomputation (the last run's input is never recomputed)
        assert all(torch.equal(value, got[name]) for name, value in reference.items())
        assert list(model.state_dict()) == list(net().state_dict())
    uninstall_chains(model)
    assert "forward" not in vars(model[0])


@pytest.mark.parametrize("strategy, every", STRATEGIES)
def test_an_in_place_op_on_a_block_output_changes_nothing(strategy, every):
    """A block's output changed in place by the next op (ReLU(inplace=True)) is no longer the next
    block's input as returned: that block starts a new segment, and gradients stay exact."""
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True),
                             nn.Linear(4, 4), nn.Tanh()).double()  # fmt: skip

    x = torch.randn(3, 4, dtype=torch.float64)
    reference = gradients(net(), x)
    model = net()
    apply_checkpointing(model, strategy, every, blocks=["0", "2", "4"])
    got = gradients(model, x)
    assert all(torch.equal(value, got[name]) for name, value in reference.items())


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
