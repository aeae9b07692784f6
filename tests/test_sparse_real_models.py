"""Sparse and dense training on the models people train (issue 30): transformers' GPT-2 (its linear
layers are ``Conv1D``, its embedding is tied to its output projection) and torchvision's resnet18.

- ``run.load_state_dict(run.state_dict())`` changes nothing (the state holds views of the live
  tensors, as torch's does), and the state saved with ``torch.save`` and loaded into a fresh
  ``lowmem.prepare`` of a freshly built model continues bit-identically: sparse compact, sparse
  masked and dense; SGD and Adam; 16-bit and 8/4-bit optimizer state.
- GPT-2 at density 0.3 trains with its ``Conv1D`` layers compact sparse, its tied embedding kept
  tied; a tied weight that ``sparsity.include`` names is sparsified once, in both places, and the
  model and optimizer bytes shrink; one FP64 step of compact storage equals masked storage's.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import lowmem
from lowmem.techniques.targets import default_sparse_weights

transformers = pytest.importorskip("transformers")
torchvision = pytest.importorskip("torchvision")
transformers.logging.set_verbosity_error()  # the tiny config's token ids are outside its vocabulary

CPU = ["trainer.device=cpu"]
SGD = [*CPU, "optim.name=sgd", "optim.lr=0.1", "optim.momentum=0.9"]
ADAM = [*CPU, "optim.name=adam", "optim.lr=1e-3"]


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=500, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def gpt2_batch(seed: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 500, (4, 24), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": tokens, "labels": tokens.clone()}


def gpt2_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def resnet18() -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def image_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 32, 32, generator=generator), torch.randint(0, 10, (4,), generator=generator)


def image_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


MODELS = {"gpt2": (gpt2, gpt2_batch, gpt2_loss), "resnet18": (resnet18, image_batch, image_loss)}


def assert_same(got: Any, expected: Any, where: str = "state") -> None:
    """``got`` equals ``expected`` bit for bit: nested dicts, lists, tensors (dtype too) and plain values."""
    if isinstance(expected, dict):
        assert list(got) == list(expected), where
        for key, value in expected.items():
            assert_same(got[key], value, f"{where}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert len(got) == len(expected), where
        for index, (item, value) in enumerate(zip(got, expected, strict=True)):
            assert_same(item, value, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected), where
    else:
        assert got == expected, where


def saved(state: dict) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


CASES = {
    "gpt2-compact-sgd": ("gpt2", [*SGD, "sparsity.density=0.3"]),
    "gpt2-compact-adam-bf16-8bit": ("gpt2", [*ADAM, "sparsity.density=0.3", "precision=bf16", "optim.state_bits=8"]),
    "gpt2-masked-adam": ("gpt2", [*ADAM, "sparsity.density=0.3", "sparsity.storage=masked"]),
    "gpt2-dense-adam-bf16": ("gpt2", [*ADAM, "precision=bf16"]),
    "resnet18-compact-adam": ("resnet18", [*ADAM, "sparsity.density=0.3"]),
    "resnet18-compact-sgd-bf16-4bit": ("resnet18", [*SGD, "sparsity.density=0.3", "precision=bf16",
                                                    "optim.state_bits=4"]),
    "resnet18-masked-sgd": ("resnet18", [*SGD, "sparsity.density=0.3", "sparsity.storage=masked"]),
    "resnet18-dense-sgd": ("resnet18", SGD),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_state_dict_round_trips_and_a_fresh_run_continues_bit_identically(case):
    name, overrides = CASES[case]
    build, make_batch, loss = MODELS[name]
    run = lowmem.prepare(build(), loss, make_batch(0), overrides=overrides)
    run.step(make_batch(0))
    if run.trainer.sparsity is not None:  # a layout that a fresh run's does not match
        assert run.trainer.sparsity.rewire(run.optimizer)["pruned"] > 0
    checkpoint = saved(run.state_dict())
    before = torch.load(saved(run.state_dict()), weights_only=True)

    state = run.state_dict()
    if "sparsity.storage=masked" not in overrides and run.trainer.sparsity is not None:
        live = run.trainer.sparsity.compact.values
        assert any(t.untyped_storage().data_ptr() == live.untyped_storage().data_ptr()
                   for t in state["model"].values())  # views of the live state, not copies  # fmt: skip
    run.load_state_dict(state)
    assert_same(torch.load(saved(run.state_dict()), weights_only=True), before)
    expected = [run.step(make_batch(step))["loss"] for step in (1, 2)]

    fresh = lowmem.prepare(build(), loss, make_batch(0), overrides=overrides)
    fresh.load_state_dict(torch.load(checkpoint, weights_only=True))
    assert [fresh.step(make_batch(step))["loss"] for step in (1, 2)] == expected
    ending = torch.load(saved(run.state_dict()), weights_only=True)
    assert_same(torch.load(saved(fresh.state_dict()), weights_only=True)["model"], ending["model"], "model")
    assert_same(torch.load(saved(fresh.state_dict()), weights_only=True)["optimizer"], ending["optimizer"],
                "optimizer")  # fmt: skip


# --- GPT-2's Conv1D layers and its tied embedding -------------------------------------------------


def test_gpt2_trains_with_its_conv1d_layers_compact_sparse_and_its_embedding_tied():
    batch = gpt2_batch(1)
    run = lowmem.prepare(gpt2(), gpt2_loss, batch, overrides=[*SGD, "sparsity.density=0.3"])
    sparse = run.trainer.sparsity.sparse_weight_names()
    # The default rule: every Conv1D; the embedding tied to the output projection (first and last layer) dense.
    assert len(sparse) == 16 and all(name.startswith("transformer.h.") for name in sparse)
    assert type(run.model.transformer.h[0].mlp.c_fc).__name__ == "CompactConv1D"
    losses = [run.step(batch)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    state = run.model.state_dict()  # the dense model's keys and shapes
    weight = state["transformer.h.0.mlp.c_fc.weight"]
    assert weight.shape == (64, 256) and 0.25 < weight.count_nonzero() / weight.numel() < 0.35
    model = run.model
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


def model_and_optimizer_bytes(overrides: list[str]) -> tuple[lowmem.api.Run, int]:
    run = lowmem.prepare(gpt2(), gpt2_loss, gpt2_batch(1), overrides=overrides)
    row = run.profile(measure=False)
    return run, row["model_bytes"] + row["optimizer_bytes"]


@pytest.mark.parametrize("named", ["lm_head.weight", "transformer.wte.weight"])
def test_a_tied_weight_that_include_names_is_sparsified_once_and_stays_tied(named):
    _, dense_bytes = model_and_optimizer_bytes(SGD)
    run, sparse_bytes = model_and_optimizer_bytes([*SGD, "sparsity.density=0.3", f"sparsity.include={named}"])
    assert run.trainer.sparsity.sparse_weight_names() == ["transformer.wte.weight"]  # one weight, its first name
    model = run.model
    assert model.lm_head.weight_values is model.transformer.wte.weight_values
    assert model.lm_head.weight_columns is model.transformer.wte.weight_columns
    run.step(gpt2_batch(1))
    assert torch.equal(model.lm_head.weight, model.transformer.wte.weight)
    state = model.state_dict()
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    assert 0.29 < state["lm_head.weight"].count_nonzero() / state["lm_head.weight"].numel() < 0.31
    # 32,000 embedding entries: at density 0.3 the model and SGD state lose ~70% of them, counted once.
    assert dense_bytes - sparse_bytes > 0.6 * 2 * 32_000 * 4


def test_a_tied_weight_is_excluded_by_any_of_its_names():
    model = gpt2()
    with pytest.raises(ValueError, match="sparsity.exclude"):
        default_sparse_weights(model, ["transformer.wte.weight"], ["lm_head.*"])
    assert "transformer.wte.weight" not in default_sparse_weights(model)


def test_gpt2_one_fp64_step_compact_equals_masked():
    batch = gpt2_batch(1)
    weights = {}
    for storage in ("compact", "masked"):
        overrides = [*SGD, "precision=fp64", "sparsity.density=0.3", "sparsity.include=[transformer.*.weight]",
                     f"sparsity.storage={storage}"]  # fmt: skip
        run = lowmem.prepare(gpt2(), gpt2_loss, batch, overrides=overrides)
        run.step(batch)
        weights[storage] = run.model.state_dict()
    assert "transformer.wte.weight" in run.trainer.sparsity.sparse_weight_names()
    for key, value in weights["compact"].items():
        torch.testing.assert_close(value, weights["masked"][key], rtol=1e-10, atol=1e-12, msg=key)
