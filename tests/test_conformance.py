"""Conformance: every technique on the models users train, against plain PyTorch.

For each small model of Hugging Face ``transformers`` and ``timm`` (tests/conformance_models.py)
and each technique, ``lowmem.prepare`` either refuses at start in one line naming a knob, or:

- ``equal`` cases, in FP64, one SGD step: the loss and the weights after the step equal plain
  PyTorch's doing the same arithmetic (the same microbatches accumulated with their shares, the
  sparse weights' gradients masked) to 1e-10 of the update's size;
- ``trains`` cases (16-bit, 8-bit state, the full combination): four Adam steps on one batch lower
  the loss.

Only ``no_bn`` (BatchNorm-ReLU-conv recomputation) and simulated microbatching (BatchNorm
statistics per group) may be refused, and only on models without what they need. The README's
conformance table is this suite's output (``scripts/conformance_table.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_map_only

import lowmem
from lowmem.api import split_examples
from lowmem.config import ConfigError
from lowmem.planning.optimal import BudgetTooSmall
from lowmem.residual import routes_norm_relu_conv
from lowmem.techniques.chains import installed_runners
from lowmem.techniques.compact import compact_modules
from tests.conformance_models import ConformanceModel, conformance_models

pytest.importorskip("transformers")
pytest.importorskip("timm")

LR = 0.1
SGD = ["optim.name=sgd", f"optim.lr={LR}", "optim.momentum=0", "optim.nesterov=false", "optim.weight_decay=0",
       "trainer.device=cpu"]
ADAM = ["optim.name=adam", "optim.lr=1e-3", "trainer.device=cpu"]
TOLERANCE = 1e-10
REFUSABLE = {"no_bn", "no_bn sparse", "microbatch simulated"}  # the techniques a model may lack the structure for
KNOB = re.compile(r"\b(checkpointing|sparsity|precision|microbatch|optim)\.[a-z_]+")


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[str, ...]
    kind: str  # "equal" (FP64, against plain PyTorch) or "trains" (loss falls)
    microbatch: int | None = None


CASES = (
    Case("none", (), "equal"),
    Case("checkpointing residual", ("checkpointing.strategy=residual",), "equal"),
    Case("checkpointing residual_star every 2", ("checkpointing.strategy=residual_star", "checkpointing.every=2"),
         "equal"),
    Case("checkpointing optimal", ("checkpointing.strategy=optimal",), "equal"),
    Case("no_bn", ("checkpointing.strategy=no_bn",), "equal"),
    Case("no_bn sparse", ("checkpointing.strategy=no_bn", "sparsity.density=0.3"), "equal"),
    Case("microbatch true", ("microbatch.size=2",), "equal", microbatch=2),
    Case("sparsity 0.3", ("sparsity.density=0.3",), "equal"),
    Case("combination in fp64", ("sparsity.density=0.3", "microbatch.size=2", "checkpointing.strategy=residual_star",
                                 "checkpointing.every=2"), "equal", microbatch=2),
    Case("microbatch simulated", ("microbatch.size=2", "microbatch.mode=simulated"), "trains"),
    Case("fp16", ("precision=fp16",), "trains"),
    Case("8-bit state", ("optim.state_bits=8",), "trains"),
    Case("full combination bf16", ("sparsity.density=0.3", "precision=bf16", "microbatch.size=2",
                                   "checkpointing.strategy=residual_star", "checkpointing.every=2"), "trains"),
)
MODELS = conformance_models()


def _fp64(batch: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.double() if t.is_floating_point() else t, batch)


def _prepare(model: ConformanceModel, overrides: list[str], batch: Callable[[], Any] | None = None) -> lowmem.Run:
    """``lowmem.prepare`` on ``batch()`` (default ``model.batch()``); ``optimal`` at the smallest
    reachable activation budget, so that the dynamic program's schedule recomputes."""
    batch = batch or model.batch
    if "checkpointing.strategy=optimal" not in overrides:
        return lowmem.prepare(model.build(), model.loss, batch(), overrides=overrides)
    try:
        lowmem.prepare(model.build(), model.loss, batch(), overrides=[*overrides, "checkpointing.budget_mb=1e-6"])
    except BudgetTooSmall as error:
        budget = error.smallest_bytes / 1e6 + 1e-6
    return lowmem.prepare(model.build(), model.loss, batch(),
                          overrides=[*overrides, f"checkpointing.budget_mb={budget:.6f}"])


def plain_step(model: ConformanceModel, start: dict[str, torch.Tensor], masks: dict[str, torch.Tensor],
               microbatch: int | None) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain PyTorch's FP64 SGD step from the state ``start``: the loss and the state after it."""
    reference = model.build().double()
    reference.load_state_dict(start)
    reference.train()
    batch = _fp64(model.batch())
    parts = split_examples(batch, microbatch) if microbatch else [(batch, 1.0)]
    total = 0.0
    for part, share in parts:
        loss = model.loss(reference, part) * share
        loss.backward()
        total += loss.item()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.grad is not None:
                param -= LR * (param.grad * masks[name] if name in masks else param.grad)
    return total, reference.state_dict()


def check_equal(model: ConformanceModel, case: Case) -> str:
    run = _prepare(model, [*SGD, "precision=fp64", *case.overrides])
    start = {k: v.clone() for k, v in run.model.state_dict().items()}
    masks = {f"{prefix}.{attr}" if prefix else attr: start[f"{prefix}.{attr}" if prefix else attr] != 0
             for prefix, _, attr in compact_modules(run.model)}
    # A tied weight (GPT-2's lm_head and wte, T5's lm_head and shared) is one parameter with two keys.
    for key, tensor in list(start.items()):
        for other, mask in list(masks.items()):
            if key not in masks and start[other].data_ptr() == tensor.data_ptr():
                masks[key] = mask
    if any(knob.startswith("checkpointing.") for knob in case.overrides):
        runners = installed_runners(run.model)
        if "checkpointing.strategy=no_bn" in case.overrides:  # stored segments, BatchNorm-ReLU recomputed
            assert any(routes_norm_relu_conv(block) for runner in runners for block in runner.blocks), "no triple"
        else:
            assert any(runner.plan is not None for runner in runners), "nothing is checkpointed"
    record = run.step(_fp64(model.batch()))
    want_loss, want = plain_step(model, start, masks, case.microbatch)
    got = run.model.state_dict()
    # The reported loss is summed in FP32 (the trainer's log); the weights carry the FP64 comparison.
    assert abs(record["loss"] - want_loss) <= 1e-6 * abs(want_loss), (record["loss"], want_loss)
    worst = 0.0
    for key, expected in want.items():
        if not expected.is_floating_point():
            assert torch.equal(got[key], expected), key
            continue
        update = (expected - start[key]).abs().max().item()
        scale = update if update > 0 else max(expected.abs().max().item(), 1e-300)
        error = (got[key].double() - expected).abs().max().item() / scale
        assert error <= TOLERANCE, f"{key}: differs from plain PyTorch by {error:.3g} of its update"
        worst = max(worst, error)
    return f"equal ({worst:.1e})"


def check_trains(model: ConformanceModel, case: Case, updates: int = 4) -> str:
    """``updates`` applied Adam steps on one batch lower the loss. FP16's first steps may overflow at
    the initial loss scale: those are skipped (the scaler's job) and not counted, up to 20 more."""
    batch_of = model.trains_batch or model.batch
    run = _prepare(model, [*ADAM, *case.overrides], batch_of)
    batch = batch_of()
    losses, skipped = [], 0
    while len(losses) <= updates and skipped < 20:
        record = run.step(batch)
        if record["skipped"]:
            skipped += 1
        else:
            losses.append(record["loss"])
    assert len(losses) > updates, f"{skipped} steps skipped for overflow"
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], f"loss did not fall over {updates} updates: {losses}"
    return f"trains ({losses[0]:.3f} -> {losses[-1]:.3f})"


def conformance(model: ConformanceModel, case: Case) -> str:
    """The outcome of ``case`` on ``model``: "equal (...)", "trains (...)" or "refused: <message>"."""
    try:
        return (check_equal if case.kind == "equal" else check_trains)(model, case)
    except (ConfigError, ValueError) as error:
        message = str(error)
        if "\n" in message.strip() or not KNOB.search(message):
            raise AssertionError(f"refused without a one-line message naming a knob: {message!r}") from error
        return f"refused: {message}"


# `optimal` measures each block before it plans: on these four models 7-14 s a case on a Zen 3 core. Their
# optimal cases run in `make test-all`; `make test` runs optimal on the other models (a timm CNN, a ViT,
# a Swin, the transformers LMs and encoders, the MoE, LoRA) and every other technique on these four.
SLOW_OPTIMAL = {"efficientnet_b0", "resnet10t", "unet2d", "t5"}


def _cases():
    for model in MODELS:
        for case in CASES:
            slow_ = case.name == "checkpointing optimal" and model.name in SLOW_OPTIMAL
            yield pytest.param(model, case, id=f"{model.library}-{model.name}-{case.name}",
                               marks=pytest.mark.slow if slow_ else ())


@pytest.mark.parametrize(("model", "case"), _cases())
def test_technique_on_library_model(model: ConformanceModel, case: Case) -> None:
    outcome = conformance(model, case)
    if outcome.startswith("refused"):
        assert case.name in REFUSABLE, f"{case.name} on {model.name}: {outcome}"
        if case.name == "microbatch simulated":
            assert not model.has_batchnorm, outcome
        else:
            assert not model.norm_relu_conv, outcome
