"""Misuses of ``lowmem.prepare`` give one line naming the cause and the fix, not a torch error from
deep inside a step (issue 49, item 10), and leave the model as it was.

A half-precision model under precision=fp32, a model prepared twice, a loss cut off from the graph,
a model without trainable parameters, torch.save of a checkpointed model, an integer loss and an
empty batch.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowmem
from lowmem.config import ConfigError

CPU = ["trainer.device=cpu"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    """A residual chain of blocks (checkpointing finds it) between an input and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def mean_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def detached_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1]).detach()


def batch(examples: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(examples, 4, generator=generator), torch.randint(0, 3, (examples,), generator=generator)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name


@pytest.mark.parametrize(
    "dtype, precision, fix",
    [
        (torch.float16, "fp32", "precision=fp16"),
        (torch.bfloat16, "fp32", "precision=bf16"),
        (torch.float64, "fp32", "precision=fp64"),
        (torch.bfloat16, "amp", "precision=bf16"),
    ],
)
def test_a_model_not_in_fp32_under_fp32_or_amp_is_refused_untouched(dtype, precision, fix):
    model = Net().to(dtype)
    before = snapshot(model)
    message = rf"precision={precision} .*FP32 weights.*{dtype}.*inp.weight.*model.float\(\).*{fix}"
    with pytest.raises(ConfigError, match=message):
        lowmem.prepare(model, mean_loss, batch(), [*CPU, f"precision={precision}"])
    assert_unchanged(model, before)
    assert not hasattr(model, "_lowmem_prepared")


def test_frozen_16_bit_parameters_are_not_refused_under_fp32():
    """A LoRA-style model: a frozen 16-bit base is not trained, so its dtype is not the precision's."""
    from lowmem.api import check_model

    model = Net()
    model.inp.to(torch.bfloat16).requires_grad_(False)
    check_model(model, "fp32")  # nothing raised
    model.inp.requires_grad_(True)
    with pytest.raises(ConfigError, match="2 trainable torch.bfloat16 parameters"):
        check_model(model, "fp32")


def test_precisions_that_cast_the_model_take_a_half_model():
    run = lowmem.prepare(Net().half(), mean_loss, batch(), [*CPU, "precision=bf16"])
    assert next(run.model.parameters()).dtype == torch.bfloat16
    assert not run.step(batch())["skipped"]


def test_a_model_prepared_twice_is_refused_untouched():
    model = Net()
    copy_before = copy.deepcopy(model)
    lowmem.prepare(model, mean_loss, batch(), [*CPU, "precision=bf16", "sparsity.density=0.5"])
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"model Net was already prepared by lowmem.prepare.*copy.deepcopy.*first Run"):
        lowmem.prepare(model, mean_loss, batch(), CPU)
    assert_unchanged(model, before)
    with pytest.raises(ValueError, match="already prepared"):  # a copy of a prepared model is prepared too
        lowmem.prepare(copy.deepcopy(model), mean_loss, batch(), CPU)
    lowmem.prepare(copy_before, mean_loss, batch(), CPU).step(batch())  # the copy made before: fine


def test_a_refused_prepare_leaves_the_model_preparable_unless_it_changed_it(monkeypatch):
    untouched = Net()
    with pytest.raises(ConfigError, match="microbatch.size=7"):  # refused before any change
        lowmem.prepare(untouched, mean_loss, batch(), [*CPU, "microbatch.size=7"])
    lowmem.prepare(untouched, mean_loss, batch(), CPU)
    # A knob's refusal after changes (here: after the cast to bf16) is retried with the knob changed.
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(ConfigError, match="no chain of blocks"):
        lowmem.prepare(plain, mean_loss, batch(), [*CPU, "precision=bf16", "checkpointing.strategy=residual"])
    with pytest.raises(ConfigError, match=r"precision=fp32 keeps the model's dtype.*torch.bfloat16"):
        lowmem.prepare(plain, mean_loss, batch(), CPU)
    lowmem.prepare(plain, mean_loss, batch(), [*CPU, "precision=bf16"]).step(batch())
    # Any other failure after changes leaves the model marked: prepared again, it would fail deep in torch.
    def fail_after_changes(cfg, model, task, example_batch):
        model.to(torch.float64)
        raise RuntimeError("a failure after the model was changed")

    monkeypatch.setattr("lowmem.api._build_trainer", fail_after_changes)
    changed = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(RuntimeError, match="after the model was changed"):
        lowmem.prepare(changed, mean_loss, batch(), CPU)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="model Sequential was left part-way modified by a lowmem.prepare that failed"):
        lowmem.prepare(changed, mean_loss, batch(), CPU)


def test_a_loss_that_does_not_require_grad_is_refused_before_any_update():
    run = lowmem.prepare(Net(), detached_loss, batch(), CPU)
    before = snapshot(run.model)
    with pytest.raises(ValueError, match=r"does not require grad.*model's outputs.*\.detach\(\).*detached_loss"):
        run.step(batch())
    assert_unchanged(run.model, before)
    assert run.trainer.state.step == 0


@pytest.mark.parametrize(
    "model, held",
    [(nn.Sequential(nn.ReLU()), "it has none"), (Net().requires_grad_(False), "all 16 have requires_grad=False")],
    ids=["no parameters", "all frozen"],
)
def test_a_model_without_trainable_parameters_is_refused(model, held):
    with pytest.raises(ValueError, match=rf"model \w+ has no trainable parameters \({held}\)"):
        lowmem.prepare(model, lambda m, b: m(b[0]).mean(), batch(), CPU)
    assert not hasattr(model, "_lowmem_prepared")


def test_a_checkpointed_model_pickles_and_computes_the_same():
    run = lowmem.prepare(Net(), mean_loss, batch(), [*CPU, "checkpointing.strategy=residual_star"])
    run.step(batch())  # a forward leaves the chain's last block call behind (a weak reference)
    saved = io.BytesIO()
    torch.save(run.model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    for model in (run.model, loaded, copy.deepcopy(run.model)):
        model.zero_grad(set_to_none=True)
        mean_loss(model, batch()).backward()
    grads = [[p.grad for p in model.parameters()] for model in (run.model, loaded)]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert not run.step(batch())["skipped"]  # the run goes on after the save


@pytest.mark.parametrize(
    "loss_fn, message",
    [
        (lambda m, b: (m(b[0]).argmax(1) == b[1]).sum(), r"returned a torch.int64 tensor: .*floating-point"),
        (lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"), r"returned \[6\]: .*scalar"),
        (lambda m, b: 1.5, r"returned a float: .*tensor"),
    ],
    ids=["integer", "per example", "python float"],
)
def test_a_bad_loss_is_refused_naming_its_dtype_or_shape(loss_fn, message):
    run = lowmem.prepare(Net(), loss_fn, batch(), CPU)
    with pytest.raises(ValueError, match=message + r".*loss_fn is tests.test_prepare_misuse.<lambda>"):
        run.step(batch())


def test_an_empty_batch_is_refused_untouched():
    with pytest.raises(ValueError, match=r"example_batch has 0 examples"):
        lowmem.prepare(Net(), mean_loss, batch(0), CPU)
    run = lowmem.prepare(Net(), mean_loss, batch(), CPU)
    before = snapshot(run.model)
    with pytest.raises(ValueError, match=r"batch has 0 examples"):
        run.step(batch(0))
    assert_unchanged(run.model, before)
    assert run.trainer.state.step == 0


def test_an_offloaded_model_refuses_pickling_in_one_line_and_still_deep_copies():
    from tests.test_offload import gradients, offloaded  # the CPU stand-in for a CUDA copy stream

    model, _, _ = offloaded()
    want = gradients(model)
    with pytest.raises(TypeError, match=r"checkpointing.offload=true cannot be pickled.*state_dict\(\)"):
        torch.save(model, io.BytesIO())
    clone = copy.deepcopy(model)
    assert all(torch.equal(a, b) for a, b in zip(want, gradients(clone), strict=True))
