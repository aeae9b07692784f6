"""Compressed saved activations (checkpointing.compress, issue 33): the quantizer's error bound and
unbiasedness, counter-based bits (a resume is bit-identical), stored bytes, gradients close to the
uncompressed ones on WRN and on a transformers model through lowmem.prepare, the planner choosing
compression when it pays, and bad input refused naming the knob."""

from __future__ import annotations

import copy
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowmem
from lowmem.config import ConfigError, compose, validate
from lowmem.planning.schedule import BlockCosts, ChainCosts, cheapest_plan
from lowmem.profiler import account_activations
from lowmem.techniques.checkpointing import Segment, apply_schedule
from lowmem.techniques.compression import (
    GROUP,
    QUANTIZE_FLOPS,
    apply_compression,
    code_bytes,
    dequantize_activation,
    quantize_activation,
    validate_compress,
)
from recipes.wrn_cifar.model import WideResNet
from tests.helpers import classification_loss

transformers = pytest.importorskip("transformers")


def roundtrip(x: torch.Tensor, bits: int, key: int = 7) -> torch.Tensor:
    codes, lows, steps = quantize_activation(x, bits, key)
    return dequantize_activation(codes, lows, steps, bits, list(x.shape), x.dtype)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_value_is_within_one_step_of_its_group(bits, dtype):
    x = (torch.randn(3, 5, 17, 13) * torch.linspace(0.01, 100, 13)).to(dtype)  # ranges differ per group
    y = roundtrip(x, bits)
    assert y.shape == x.shape and y.dtype == dtype
    flat = x.float().reshape(-1)
    pad = -flat.numel() % GROUP
    groups = torch.cat([flat, flat[-1:].expand(pad)]).view(-1, GROUP)
    step = ((groups.amax(1) - groups.amin(1)) / (2**bits - 1)).repeat_interleave(GROUP)[: flat.numel()]
    error = (y.float().reshape(-1) - flat).abs()
    slack = (flat.abs() + step) * (1e-6 if dtype == torch.float32 else 2**-8)  # the result's own rounding
    assert bool((error <= step + slack).all())


def test_rounding_is_unbiased_and_drawn_from_the_key():
    x = torch.rand(4 * GROUP) * 3 - 1
    draws = torch.stack([roundtrip(x, 2, key) for key in range(400)])
    step = 4 / 3  # a group's range is about 4 over 3 steps (each value within one step of its mean)
    assert (draws.mean(0) - x).abs().max() < 5 * (step / 2) / math.sqrt(400)
    assert (draws.mean(0) - x).mean().abs() < 0.01  # no drift over the elements
    assert torch.equal(roundtrip(x, 4, 3), roundtrip(x, 4, 3))  # counter-based: same key, same bits
    assert not torch.equal(roundtrip(x, 4, 3), roundtrip(x, 4, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_c_kernel_gives_the_torch_definitions_bits(dtype, monkeypatch):
    x = (torch.randn(3, 7, 11, 13) * 5).to(dtype)  # a short last group
    for bits in (8, 4, 2):
        kernel = quantize_activation(x, bits, 99)
        read = dequantize_activation(*kernel, bits, list(x.shape), dtype)
        monkeypatch.setenv("LOWMEM_KERNELS", "torch")
        torch_codes = quantize_activation(x, bits, 99)
        assert all(torch.equal(a, b) for a, b in zip(kernel, torch_codes, strict=True))
        assert torch.equal(read, dequantize_activation(*torch_codes, bits, list(x.shape), dtype))
        monkeypatch.delenv("LOWMEM_KERNELS")


def test_constant_and_exactly_representable_values_come_back_exactly():
    x = torch.full((2, GROUP), 1.5)
    assert torch.equal(roundtrip(x, 2), x)
    levels = torch.arange(4, dtype=torch.float32).repeat(GROUP // 2)
    assert torch.equal(roundtrip(levels, 2), levels)


def small_wrn() -> nn.Module:
    torch.manual_seed(0)
    return WideResNet(depth=10, width=1)


def gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def wrn_batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 3, 32, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator)


def test_wrn_gradients_stay_close_and_the_relu_masks_exact(wrn_batch):
    x, y = wrn_batch
    model = small_wrn()
    plain = gradients(model, x, y)
    errors = {}
    for bits in (8, 4, 2):
        compressed = copy.deepcopy(model)
        hooks = apply_compression(compressed, bits, seed=0)
        errors[bits] = relative_error(gradients(compressed, x, y), plain)
        assert hooks.compressed_bytes > 0
        hooks.remove()
    assert errors[8] < 0.02 and errors[4] < 0.15 and errors[2] < 0.6, errors
    assert errors[8] < errors[4] < errors[2]
    relu = torch.randn(64, 4096, requires_grad=True)
    net = nn.Sequential(nn.ReLU())
    apply_compression(net, 2)
    grad = torch.randn(64, 4096)
    net(relu * 1.0).backward(grad)  # the ReLU's own saved output is a 1-bit mask: exact
    assert torch.equal(relu.grad, grad * (relu > 0))


def test_stored_bytes_are_codes_and_ranges_at_their_size(wrn_batch):
    x, y = wrn_batch
    model = small_wrn()

    def step() -> None:
        F.cross_entropy(model(x), y).backward()

    plain = account_activations(step, model, inputs=None)
    hooks = apply_compression(model, 4)
    compressed = account_activations(step, model, inputs=None)
    hooks.remove()
    assert compressed.compressed_bytes > 0 and plain.compressed_bytes == 0
    assert plain.max_saved_bytes / compressed.max_saved_bytes > 5
    # One 13x... activation alone: its codes and two FP32 numbers per group.
    codes, lows, steps = quantize_activation(torch.randn(16, 16, 32, 32), 4, 0)
    assert codes.numel() == code_bytes(16 * 16 * 32 * 32, 4) == 16 * 16 * 32 * 32 // 2
    assert lows.numel() == steps.numel() == 16 * 16 * 32 * 32 // GROUP


def test_the_profile_counts_quantization_flops_and_compressed_bytes(wrn_batch):
    batch = wrn_batch
    plain = lowmem.prepare(small_wrn(), classification_loss, batch, overrides=["trainer.device=cpu"])
    run = lowmem.prepare(
        small_wrn(), classification_loss, batch, overrides=["trainer.device=cpu", "checkpointing.compress=8"]
    )
    before, after = plain.profile(measure=False), run.profile(measure=False)
    assert after["compressed_bytes"] > 0 and before["compressed_bytes"] == 0
    assert after["offloaded_bytes"] == after["host_bytes"] == 0
    extra = after["flops"] - before["flops"]
    assert 0 < extra < 12 * before["activation_saved_bytes"] / 4  # at most ~10 per FP32 element saved
    assert extra >= QUANTIZE_FLOPS * 16 * 16 * 32 * 32  # one 16x16x32x32 activation quantized at least


def test_a_resumed_compressed_run_is_bit_identical(wrn_batch):
    overrides = ["trainer.device=cpu", "checkpointing.compress=4", "checkpointing.strategy=residual"]
    first, second = wrn_batch, (wrn_batch[0].flip(0), wrn_batch[1].flip(0))
    model = small_wrn()
    interrupted = lowmem.prepare(copy.deepcopy(model), classification_loss, first, overrides=overrides)
    interrupted.step(first)
    saved = copy.deepcopy(interrupted.state_dict())
    interrupted.step(second)
    resumed = lowmem.prepare(copy.deepcopy(model), classification_loss, first, overrides=overrides)
    resumed.load_state_dict(saved)
    resumed.step(second)
    for name, value in interrupted.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
    # Another step count draws other bits: the same batch from the same weights differs.
    again = lowmem.prepare(copy.deepcopy(model), classification_loss, first, overrides=overrides)
    again.trainer.state.step = 1
    again.step(first)
    other = lowmem.prepare(copy.deepcopy(model), classification_loss, first, overrides=overrides)
    other.step(first)
    assert not torch.equal(again.model.conv1.weight, other.model.conv1.weight)


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def gpt2_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def test_a_transformers_model_through_prepare_trains_close_to_uncompressed():
    tokens = torch.randint(0, 100, (8, 32), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": tokens, "labels": tokens}
    sgd = ["trainer.device=cpu", "optim.name=sgd", "optim.lr=0.1", "optim.momentum=0", "optim.nesterov=false",
           "optim.weight_decay=0"]
    steps = {}
    for compress in ("none", "8"):
        run = lowmem.prepare(gpt2(), gpt2_loss, batch, overrides=[*sgd, f"checkpointing.compress={compress}"])
        start = {k: v.clone() for k, v in run.model.state_dict().items()}
        run.step(batch)
        steps[compress] = torch.cat([(run.model.state_dict()[k] - v).reshape(-1).float() for k, v in start.items()])
        if compress == "8":
            assert run.trainer.compression.compressed_bytes > 0
            assert set(run.model.state_dict()) == set(start)  # no key added
    assert relative_error(steps["8"], steps["none"]) < 0.02


def block_costs(stored: int, compressed: int, flops: int, quantize: int) -> BlockCosts:
    return BlockCosts(
        input_bytes=10, output_bytes=10, stored_bytes={False: stored}, peak_bytes={
            ("stored", False): stored + 20, ("all_at_once", False): stored + 20, ("recursively", False): stored + 20},
        flops=flops, forward_flops=flops // 3, rebuild_flops=flops // 3, routes_norm=False,
        compressed={(False, 4): (compressed, compressed + 20, flops + quantize)},
    )  # fmt: skip


def test_the_planner_compresses_where_it_is_cheaper_than_recomputing():
    costs = ChainCosts(tuple(block_costs(100, 15, 300, 5) for _ in range(4)), (4,), (0,), 0)
    roomy, tight = cheapest_plan(costs, 1000), cheapest_plan(costs, 120)
    assert str(roomy) == "stored:4" and roomy.flops == 1200
    assert str(tight) == "stored/4bit:4" and tight.flops == 1220  # 4 x 5 for quantizing beats 4 x 100 recomputing
    expensive = ChainCosts(tuple(block_costs(100, 15, 300, 500) for _ in range(4)), (4,), (0,), 0)
    assert "4bit" not in str(cheapest_plan(expensive, 400))  # recomputing one block costs less than quantizing


def test_optimal_checkpointing_chooses_compression_under_a_tight_budget(wrn_batch):
    def prepare(*overrides: str):
        base = ["trainer.device=cpu", "checkpointing.strategy=optimal"]
        return lowmem.prepare(small_wrn(), classification_loss, wrn_batch, overrides=[*base, *overrides])

    kept = prepare("checkpointing.budget_mb=1000").profile(measure=False)["activation_bytes"]
    budget = f"checkpointing.budget_mb={kept * 0.5 / 1e6}"
    recompute = prepare(budget).profile(measure=False)
    run = prepare(budget, "checkpointing.compress=4")
    compressed = run.profile(measure=False)
    assert compressed["activation_bytes"] <= kept * 0.5 and compressed["compressed_bytes"] > 0
    assert compressed["flops"] < recompute["flops"]
    run.step(wrn_batch)


def test_apply_schedule_compresses_only_the_segments_given_a_width(wrn_batch):
    x, y = wrn_batch
    model = small_wrn()
    hooks = apply_compression(model, None)
    gradients(model, x, y)
    assert hooks.compressed_bytes == 0  # no default width: nothing compressed without a schedule
    apply_schedule(model, [(Segment(1, "stored", bits=8), Segment(1, "all_at_once"), Segment(1, "stored"))])
    gradients(model, x, y)
    assert hooks.compressed_bytes > 0
    with pytest.raises(ValueError, match="a width or offload only when stored"):
        apply_schedule(model, [(Segment(3, "all_at_once", bits=8),)])


@pytest.mark.parametrize("bits", [None, 8])
def test_a_saved_output_never_backpropagated_is_freed(bits):
    """What the hooks store holds no saved output's own graph (tanh saves its output; kept as it
    is without a width): no reference cycle outlives the step."""
    net = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    apply_compression(net, bits)
    output = net(torch.randn(128, 64))
    freed = weakref.ref(output)
    del output
    assert freed() is None


@pytest.mark.parametrize("value", [3, "16", 1.5, True, "fp8"])
def test_a_bad_width_is_refused_naming_the_knob_and_the_values(value):
    with pytest.raises(ValueError, match=r"checkpointing.compress=.* one of none, 8, 4, 2"):
        validate_compress(value)
    cfg = compose("+recipe=wrn_cifar", "data=fake")
    cfg.checkpointing.compress = value
    with pytest.raises(ConfigError, match="checkpointing.compress"):
        validate(cfg)
    assert validate_compress("none") is None and validate_compress(4) == 4 and validate_compress("2") == 2


class _Stored:
    """Records the form and bytes each saved tensor is stored in (wrapping the hooks' pack)."""

    def __init__(self, hooks) -> None:
        self.forms: list[tuple[str, torch.dtype, int]] = []
        pack = hooks._pack

        def recording(tensor):
            packed = pack(tensor)
            stored = packed.nbytes if packed.form != "plain" else tensor.numel() * tensor.element_size()
            self.forms.append((packed.form, tensor.dtype, stored))
            return packed

        hooks._pack = recording


@pytest.mark.parametrize(("side", "dtype"), [(16, torch.uint8), (64, torch.int16), (256, torch.int32)])
def test_max_pooling_indices_are_stored_narrow_and_exact(side, dtype):
    """A max-pooling module's int64 indices come back exactly from the narrowest type holding its
    plane's positions, so the gradient reaching the pooling's input is bit-identical."""
    pool = nn.Sequential(nn.MaxPool2d(3, stride=2, padding=1))
    x = torch.randn(16, 8, side, side)
    scale = nn.Parameter(torch.tensor(1.5))
    grads = []
    for bits in (None, 2):
        hooks = apply_compression(pool, bits)
        stored = _Stored(hooks)
        inner = x * scale
        inner.register_hook(grads.append)
        pool(inner).sum().backward()
        hooks.remove()
    assert torch.equal(grads[0], grads[1])
    narrowed = [s for s in stored.forms if s[0] == "narrowed"]
    assert len(narrowed) == 1 and narrowed[0][1] == torch.int64
    assert narrowed[0][2] == 16 * 8 * (side // 2) ** 2 * torch.empty((), dtype=dtype).element_size()


class _NativeDropout(nn.Module):
    """Dropout as CUDA runs it (``native_dropout``: a bool mask saved); CPU's ``F.dropout`` saves
    a floating-point noise tensor instead, a leaf kept as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.native_dropout(x, 0.3, True)[0]


def test_bool_masks_are_stored_at_one_bit_and_exact():
    net = nn.Sequential(_NativeDropout())
    x = torch.randn(32, 4096)
    scale = nn.Parameter(torch.tensor(2.0))
    grads = []
    for bits in (None, 8):
        hooks = apply_compression(net, bits)
        stored = _Stored(hooks)
        torch.manual_seed(0)
        inner = x * scale
        inner.register_hook(grads.append)
        net(inner).square().sum().backward()
        hooks.remove()
    assert torch.equal(grads[0], grads[1])
    masks = [s for s in stored.forms if s[1] == torch.bool]
    assert masks and all(form == "signs" and nbytes == 32 * 4096 // 8 for form, _, nbytes in masks)


def test_the_minibatch_is_quantized_where_saved_but_buffers_and_parameters_are_not():
    conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8))
    conv.register_buffer("table", torch.randn(64, 64))
    x = torch.randn(8, 3, 32, 32)
    hooks = apply_compression(conv, 8)
    stored = _Stored(hooks)
    conv(x).mul(conv.table.sum()).sum().backward()
    quantized = [s for s in stored.forms if s[0] == "quantized"]
    # The convolution's input (the minibatch: 24,576 values) and BatchNorm's input, each at 8 bits
    # plus two FP32 numbers per group; the weight stays as it is.
    assert sorted(nbytes for _, _, nbytes in quantized) == [8 * 3 * 32 * 32 * 33 // 32, 8 * 8 * 32 * 32 * 33 // 32]
    assert ("plain", torch.float32, 8 * 3 * 3 * 3 * 4) in stored.forms
