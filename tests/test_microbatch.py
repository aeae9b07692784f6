"""Microbatching: true mode equals the full batch; simulated mode equals true mode."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowmem.techniques.microbatch import (
    apply_simulated_microbatching,
    no_sync_except_last,
    split_by_examples,
    split_by_tokens,
    validate_microbatch,
)
from recipes.wrn_cifar.model import WideResNet


def true_microbatch_step(
    model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, size: int
) -> torch.Tensor:
    """Sequential microbatches, each mean loss weighted by its share; returns the logits."""
    logits = []
    for (x, y), weight in split_by_examples([inputs, labels], size):
        out = model(x)
        (F.cross_entropy(out, y) * weight).backward()
        logits.append(out.detach())
    return torch.cat(logits)


def full_batch_step(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    out = model(inputs)
    F.cross_entropy(out, labels).backward()
    return out.detach()


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True))


def test_split_by_examples_weights_by_share():
    inputs, labels = torch.randn(10, 3), torch.arange(10)
    parts = split_by_examples([inputs, labels], 4)
    assert [len(x) for (x, _), _ in parts] == [4, 4, 2]
    assert [weight for _, weight in parts] == [0.4, 0.4, 0.2]
    assert torch.equal(torch.cat([y for (_, y), _ in parts]), labels)
    assert parts[0][0][0].data_ptr() == inputs.data_ptr()  # views, not copies


def test_split_by_tokens_groups_consecutive_sentences():
    counts = torch.tensor([3, 4, 2, 5, 1, 3])
    groups = split_by_tokens(counts, 7)
    assert [g for g, _ in groups] == [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert [w for _, w in groups] == pytest.approx([7 / 18, 7 / 18, 4 / 18])
    with pytest.raises(ValueError, match=r"microbatch.size=4 tokens.*sentence 3.*5 tokens"):
        split_by_tokens(counts, 4)


@pytest.mark.parametrize(
    "mode,expected", [(True, "true"), ("true", "true"), ("True", "true"), ("simulated", "simulated")]
)
def test_validate_accepts_hydra_spellings(mode, expected):
    assert validate_microbatch(10, mode, 100) == expected


@pytest.mark.parametrize(
    "size,mode,message",
    [(0, "true", "microbatch.size=0"), (-3, "true", "microbatch.size=-3"),
     (101, "true", r"microbatch.size=101.*data.batch_size=100"),
     (10, "ghost", r"microbatch.mode='ghost'.*true, simulated"), (10, False, "microbatch.mode=False")],
)  # fmt: skip
def test_validate_rejects_bad_knobs(size, mode, message):
    with pytest.raises(ValueError, match=message):
        validate_microbatch(size, mode, 100)


def test_true_microbatching_equals_full_batch_without_batchnorm():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).double()
    inputs, labels = torch.randn(10, 3, 8, 8, dtype=torch.float64), torch.arange(10) % 5
    reference = copy.deepcopy(model)
    expected = full_batch_step(reference, inputs, labels)
    got = true_microbatch_step(model, inputs, labels, 4)  # 4 + 4 + 2: a short last microbatch
    assert max_difference([expected, *grads(reference)], [got, *grads(model)]) <= 1e-12


@pytest.mark.parametrize("size", [3, 4, 10])
def test_simulated_equals_true_on_wrn(size):
    """Forward outputs, gradients and running statistics over several steps, incl. a short last group."""
    true_model = WideResNet(depth=10, width=1).double()
    simulated = copy.deepcopy(true_model)
    apply_simulated_microbatching(simulated, size)
    inputs, labels = torch.randn(10, 3, 32, 32, dtype=torch.float64), torch.arange(10)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (true_model, simulated)]
    for _ in range(2):
        for optimizer in optimizers:
            optimizer.zero_grad()
        expected = true_microbatch_step(true_model, inputs, labels, size)
        got = full_batch_step(simulated, inputs, labels)
        assert max_difference([expected, *grads(true_model)], [got, *grads(simulated)]) <= 1e-12
        for optimizer in optimizers:
            optimizer.step()
    groups = -(-10 // size)
    for (name, a), b in zip(true_model.named_buffers(), simulated.buffers(), strict=True):
        if name.endswith("num_batches_tracked"):
            assert int(b) == 2 * groups
        assert max_difference([a], [b]) <= 1e-12, name
    true_model.eval(), simulated.eval()
    assert max_difference([true_model(inputs)], [simulated(inputs)]) <= 1e-12  # eval: running statistics


def test_simulated_keeps_state_dict_and_hooks():
    model = WideResNet(depth=10, width=1)
    keys = list(model.state_dict())
    calls = []
    model.bn.register_forward_hook(lambda *args: calls.append(1))
    apply_simulated_microbatching(model, 4)
    apply_simulated_microbatching(model, 5)  # re-applying changes the group size
    assert list(model.state_dict()) == keys and isinstance(model.bn, nn.BatchNorm2d)
    assert model.bn.microbatch_size == 5
    model(torch.randn(10, 3, 32, 32))
    assert calls == [1] and int(model.bn.num_batches_tracked) == 2


def _run_in_fp32(module: nn.Module) -> None:
    """Casting hooks as a precision conversion adds them: FP32 BatchNorm on FP16 activations."""
    module.register_forward_pre_hook(lambda m, args: (args[0].float(),))
    module.register_forward_hook(lambda m, args, out: out.half())


@pytest.mark.parametrize("cast_by_hooks", [True, False])
def test_simulated_with_fp16_input_and_fp32_batchnorm(cast_by_hooks):
    true_bn = nn.BatchNorm2d(4)
    if cast_by_hooks:
        _run_in_fp32(true_bn)
    simulated = copy.deepcopy(true_bn)
    apply_simulated_microbatching(simulated, 3)
    x = torch.randn(7, 4, 5, 5).half().requires_grad_()
    expected = torch.cat([true_bn(group) for group in x.split(3)])
    got = simulated(x)
    assert got.dtype == torch.float16 and torch.equal(expected, got)
    (grad_expected,) = torch.autograd.grad(expected.float().sum(), x)
    (grad_got,) = torch.autograd.grad(got.float().sum(), x)
    assert torch.equal(grad_expected, grad_got)
    assert max_difference(list(true_bn.buffers()), list(simulated.buffers())) == 0.0


def test_no_sync_except_last(tmp_path):
    assert isinstance(no_sync_except_last(nn.Linear(2, 2), 0, 3), contextlib.nullcontext)  # not data parallel
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        for index, syncs in [(0, False), (1, False), (2, True)]:
            with no_sync_except_last(model, index, 3):
                assert model.require_backward_grad_sync is syncs
    finally:
        dist.destroy_process_group()
