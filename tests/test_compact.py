"""Compact sparse storage (lowmem.techniques.compact): the layers against dense-masked references, the
fixed-capacity buffers, the plain state dict, and compact vs dense-masked training in FP64."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowmem.techniques import compact
from lowmem.techniques.checkpointing import apply_checkpointing
from lowmem.techniques.optimizers import LowPrecisionAdam, LowPrecisionSGD
from lowmem.techniques.sparsity import DynamicSparsity, RewireSchedule
from recipes.wrn_cifar.model import WideResNet


class Mixed(nn.Module):
    """Every kind of layer compact storage runs: strided grouped conv with bias, 3-D linear with bias,
    embedding with a padding row, and a bare output matrix applied with ``compact.linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)
        self.embed = nn.Embedding(11, 6, padding_idx=1)
        self.proj = nn.Linear(6, 8)
        self.out = nn.Parameter(torch.randn(5, 8) * 0.3)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        pooled = F.relu(self.conv(images)).mean((2, 3))  # [B, 6]
        h = torch.tanh(self.proj(self.embed(tokens) + pooled[:, None, :]))  # [B, T, 8]
        return compact.linear(self, "out", h)  # [B, T, 5]


NAMES = ["conv.weight", "embed.weight", "proj.weight", "out"]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    images = torch.randn(3, 4, 9, 9, generator=generator, dtype=torch.float64)
    tokens = torch.randint(0, 11, (3, 7), generator=generator)
    tokens[0, -2:] = 1  # padding
    return images, tokens, torch.randint(0, 5, (3, 7), generator=generator)


def every(updates: int) -> RewireSchedule:
    return RewireSchedule(starts=(0,), periods=(updates,), stop=1e12, unit="update")


def sparse_model(storage: str, density: float = 0.4, **kwargs) -> tuple[Mixed, DynamicSparsity]:
    torch.manual_seed(0)
    model = Mixed().double()
    kwargs.setdefault("init_threshold", 0.05)
    sparsity = DynamicSparsity(model, NAMES, density, schedule=every(3), rewire_fraction=0.1, storage=storage, **kwargs)
    return model, sparsity


def test_compact_layers_equal_dense_masked_ones_forward_and_backward():
    model, sparsity = sparse_model("compact")
    reference = compact.dense_copy(model)
    images, tokens, _ = batch(0)
    images_a, images_b = images.clone().requires_grad_(), images.clone().requires_grad_()
    out = model(images_a, tokens)
    expected = reference(images_b, tokens)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(images_a.grad, images_b.grad, rtol=1e-12, atol=1e-12)
    for name in NAMES:
        values, positions = sparsity.compact.layer(name)
        dense_grad = reference.get_parameter(name).grad
        torch.testing.assert_close(values.grad, dense_grad.reshape(-1)[positions.long()], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.conv.bias.grad, reference.conv.bias.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.proj.bias.grad, reference.proj.bias.grad, rtol=1e-12, atol=1e-12)


def test_compact_storage_holds_active_entries_only_in_fixed_buffers():
    model, sparsity = sparse_model("compact")
    store = sparsity.compact
    names = dict(model.named_parameters())
    assert not set(NAMES) & set(names)  # no dense weight is left
    buffers = (store.values.data_ptr(), store.positions.data_ptr(), store.capacity)
    optimizer = LowPrecisionSGD(model.parameters(), lr=0.05)
    for step in range(7):
        images, tokens, target = batch(step)
        F.cross_entropy(model(images, tokens).flatten(0, 1), target.flatten()).backward()
        for name in NAMES:
            values, positions = store.layer(name)
            assert values.grad.shape == values.shape == positions.shape  # gradients: active entries only
            assert (positions[1:] > positions[:-1]).all()  # strictly increasing
        optimizer.step()
        report = sparsity.after_optimizer_step(optimizer, epoch=0.0)
        for param in model.parameters():
            param.grad = None
        if report is not None:
            assert report["pruned"] > 0
            # Rewiring moved entries inside the same buffers, whose capacity does not change.
            assert (store.values.data_ptr(), store.positions.data_ptr(), store.capacity) == buffers
            assert sum(store.counts) == store.capacity == sparsity.nonzero_count()
            for name in NAMES:
                values, _ = store.layer(name)
                assert optimizer.state[values]["momentum_buffer"].shape == values.shape


@pytest.mark.parametrize("optimizer_class", [LowPrecisionSGD, LowPrecisionAdam])
def test_compact_and_dense_masked_training_give_the_same_weights_in_fp64(optimizer_class):
    runs = {}
    for storage in ("compact", "masked"):
        model, sparsity = sparse_model(storage)
        optimizer = optimizer_class(model.parameters(), lr=0.05, weight_decay=1e-3)
        rewirings = 0
        for step in range(12):
            images, tokens, target = batch(step)
            for param in model.parameters():
                param.grad = None
            F.cross_entropy(model(images, tokens).flatten(0, 1), target.flatten()).backward()
            sparsity.mask_gradients()
            optimizer.step()
            rewirings += sparsity.after_optimizer_step(optimizer, epoch=0.0) is not None
        assert rewirings == 4
        runs[storage] = ({n: sparsity.dense_weight(n).detach() for n in NAMES}, sparsity.masks, model.conv.bias)
    (compact_weights, compact_masks, compact_bias), (masked_weights, masked_masks, masked_bias) = runs.values()
    for name in NAMES:
        assert torch.equal(compact_masks[name], masked_masks[name]), name
        torch.testing.assert_close(compact_weights[name], masked_weights[name], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(compact_bias, masked_bias, rtol=1e-12, atol=1e-14)


def test_dense_state_dict_is_a_plain_state_dict_and_the_compact_one_resumes():
    model, sparsity = sparse_model("compact")
    plain = compact.dense_state_dict(model)
    assert list(plain) == list(Mixed().state_dict())
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    buffer.seek(0)
    dense = Mixed().double()
    dense.load_state_dict(torch.load(buffer, weights_only=True))
    for name in NAMES:
        assert torch.equal(dense.get_parameter(name), sparsity.dense_weight(name))
    # The compact state dict (what checkpoints hold) restores the layout after a rewiring.
    sparsity.rewire()
    state = {"model": model.state_dict(), "sparsity": sparsity.state_dict()}
    assert any(key.endswith("_positions") for key in state["model"])
    resumed_model, resumed = sparse_model("compact")
    resumed.load_state_dict(state["sparsity"])
    resumed_model.load_state_dict(state["model"])
    for name in NAMES:
        assert torch.equal(resumed.dense_weight(name), sparsity.dense_weight(name))


def test_compact_layers_under_bf16_autocast_keep_fp32_gradients_and_follow_a_cast_model():
    model, sparsity = sparse_model("compact")
    model.float()  # after attaching: the buffers follow at the next rewiring
    images, tokens, target = batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(images.float(), tokens)
    assert out.dtype == torch.bfloat16
    F.cross_entropy(out.float().flatten(0, 1), target.flatten()).backward()
    for name in NAMES:
        values, _ = sparsity.compact.layer(name)
        assert values.grad.dtype == torch.float32 and values.grad.isfinite().all()
    before = {name: sparsity.dense_weight(name) for name in NAMES}
    sparsity.threshold = 0.0  # a rewiring that prunes nothing: the layout moves into new buffers
    sparsity.rewire()
    assert sparsity.compact.values.dtype == torch.float32
    for name in NAMES:
        assert torch.equal(sparsity.dense_weight(name), before[name])
        values, _ = sparsity.compact.layer(name)
        assert values.untyped_storage().data_ptr() == sparsity.compact.values.untyped_storage().data_ptr()


@pytest.mark.parametrize("strategy", ["no_bn", "residual", "residual_star"])
def test_checkpointed_compact_convolutions_give_the_gradients_of_no_checkpointing(strategy):
    def run(strategy: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = WideResNet(10, 1).double()
        DynamicSparsity(model, model.sparsifiable_weights(), 0.3, schedule=every(100))
        apply_checkpointing(model, strategy, every=2)
        x, y = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.tensor([1, 2, 3, 4])
        F.cross_entropy(model(x), y).backward()
        return {name: p.grad for name, p in model.named_parameters()}

    plain, checkpointed = run("none"), run(strategy)
    assert any(name.endswith("weight_values") for name in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_unsupported_layers_are_refused_naming_the_knob():
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding="same"), nn.Conv1d(2, 2, 3))
    for name in ("0.weight", "1.weight"):
        with pytest.raises(ValueError, match="sparsity.storage=masked"):
            DynamicSparsity(model, [name], 0.5, schedule=every(10))
        DynamicSparsity(nn.Sequential(nn.Conv2d(2, 2, 3, padding="same"), nn.Conv1d(2, 2, 3)), [name], 0.5,
                        schedule=every(10), storage="masked")
