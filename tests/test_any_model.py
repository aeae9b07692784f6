"""Any nn.Module through lowmem.prepare: every technique against a plain reference (issue 20).

Models lowmem did not write — torchvision's resnet18 and mobilenet_v3_small, a VisionTransformer and
a GPT-style model whose blocks are called in a loop with a mask — trained one step in FP64: every
checkpointing strategy gives the plain step's gradients (and BatchNorm statistics), true
microbatches give the full batch's where no BatchNorm couples the examples, sparse training keeps
its exact nonzero count through a rewiring, 16-bit steps run, the state-dict keys stay the
model's, a resumed run ends bit-identical, and bad input fails naming what to change.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator

import pytest
import torch
import torchvision
from torch import nn

import lowmem
from lowmem.config import ConfigError
from lowmem.techniques.chains import find_block_chains
from tests.helpers import classification_loss, lm_loss, slow, tiny_gpt

FP64 = ["precision=fp64", "trainer.device=cpu", "optim.name=sgd", "optim.lr=0.1", "optim.momentum=0.9"]


def tiny_vit(dropout: float = 0.1) -> nn.Module:
    return torchvision.models.VisionTransformer(
        image_size=32, patch_size=4, num_layers=6, num_heads=4, hidden_dim=128, mlp_dim=256, num_classes=10,
        dropout=dropout,
    )  # fmt: skip


def image_batch(examples: int = 4, side: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(examples, 3, side, side, generator=generator)
    return images, torch.randint(0, 10, (examples,), generator=generator)


def token_batch(examples: int = 4, length: int = 16, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 97, (examples, length + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


MODELS = {  # name: (model, example batch, loss, has BatchNorm)
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), image_batch, classification_loss, True),
    "mobilenet_v3_small": (
        lambda: torchvision.models.mobilenet_v3_small(num_classes=10), image_batch, classification_loss, True
    ),
    "vit": (tiny_vit, image_batch, classification_loss, False),
    "gpt": (tiny_gpt, token_batch, lm_loss, False),
}


def one_step(name: str, overrides: list[str], batch=None, **model_options) -> dict[str, torch.Tensor]:
    """The model's state after one step from the same FP64 weights (seeded)."""
    make_model, make_batch, loss, _ = MODELS[name]
    torch.manual_seed(0)
    model = make_model(**model_options)
    batch = make_batch() if batch is None else batch
    run = lowmem.prepare(model, loss, batch, overrides=[*FP64, *overrides])
    record = run.step(batch)
    assert isinstance(record["loss"], float) and math.isfinite(record["loss"])
    return {k: v.clone() for k, v in run.model.state_dict().items()}


def assert_same(reference: dict, got: dict, tolerance: float, what: str) -> None:
    assert list(reference) == list(got), f"{what}: state-dict keys differ"
    for key, value in reference.items():
        if not value.is_floating_point():
            assert torch.equal(value, got[key]), f"{what}: {key}"
            continue
        scale = max(value.abs().max().item(), 1.0)
        difference = (value - got[key]).abs().max().item()
        assert difference <= tolerance * scale, f"{what}: {key} differs by {difference:.3g}"


@pytest.fixture(scope="module")
def plain_steps() -> Iterator[dict[str, dict[str, torch.Tensor]]]:
    steps = {name: one_step(name, []) for name in MODELS}
    yield steps
    # pytest keeps fixture values referenced until the session ends: free the FP64 states (~110 MB),
    # which later tests' CPU peak measurements (every live tensor) would otherwise count.
    steps.clear()


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(
    "strategy", [("residual", 1), ("residual", 2), ("residual_star", 2), ("residual_star", 3)], ids=str
)
def test_checkpointing_gives_the_plain_step(name, strategy, plain_steps):
    overrides = [f"checkpointing.strategy={strategy[0]}", f"checkpointing.every={strategy[1]}"]
    # Bit for bit, BatchNorm running statistics included: recomputation replays what forward did.
    assert_same(plain_steps[name], one_step(name, overrides), 0.0, f"{name} {strategy}")


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_batchnorm_relu_recomputation_gives_the_plain_step(name, plain_steps):
    # torchvision's blocks route their BatchNorm-ReLU-conv triples through the fx-traced forward.
    assert_same(plain_steps[name], one_step(name, ["checkpointing.strategy=no_bn"]), 0.0, f"{name} no_bn")


@pytest.mark.parametrize("name", [slow("resnet18"), "gpt"])
def test_optimal_checkpointing_gives_the_plain_step_within_its_budget(name, plain_steps):
    make_model, make_batch, loss, _ = MODELS[name]
    plain = lowmem.prepare(make_model(), loss, make_batch(), overrides=FP64).profile(measure=False)
    budget = 0.8 * plain["activation_bytes"] / 1e6
    overrides = ["checkpointing.strategy=optimal", f"checkpointing.budget_mb={budget}"]
    torch.manual_seed(0)
    run = lowmem.prepare(make_model(), loss, make_batch(), overrides=[*FP64, *overrides])
    assert run.profile(measure=False)["activation_bytes"] <= budget * 1e6
    assert_same(plain_steps[name], one_step(name, overrides), 0.0, f"{name} optimal")


@pytest.mark.parametrize("name", ["vit", "gpt"])
def test_true_microbatches_equal_the_full_batch(name):
    # No BatchNorm couples the examples; dropout draws differ per microbatch, so it is turned off.
    reference = one_step(name, [], dropout=0.0)
    for size in (1, 3):  # equal parts, and a short last one
        got = one_step(name, [f"microbatch.size={size}"], dropout=0.0)
        assert_same(reference, got, 1e-10, f"{name} microbatch {size}")


def test_simulated_microbatches_equal_true_ones_with_batchnorm():
    batch = image_batch(4, 16)
    true = one_step("resnet18", ["microbatch.size=2"], batch)
    simulated = one_step("resnet18", ["microbatch.size=2", "microbatch.mode=simulated"], batch)
    assert_same(true, simulated, 1e-10, "resnet18 simulated vs true")


@pytest.mark.parametrize("name", list(MODELS))
def test_sparse_training_keeps_its_nonzero_count_through_a_rewiring(name):
    make_model, make_batch, loss, _ = MODELS[name]
    batch = make_batch()
    run = lowmem.prepare(make_model(), loss, batch, overrides=["sparsity.density=0.3", "trainer.device=cpu"])
    sparsity = run.trainer.sparsity
    expected = sum(round(0.3 * math.prod(shape)) for shape, _ in sparsity.trained_parameters().values())
    assert sparsity.nonzero_count() == expected
    run.step(batch)
    report = sparsity.rewire(run.optimizer)
    assert report["regrown"] > 0
    assert sparsity.nonzero_count() == expected
    run.step(batch)
    assert sparsity.nonzero_count() == expected


def test_the_default_sparse_weights_leave_the_first_and_last_layer_dense():
    masked = ["sparsity.density=0.5", "trainer.device=cpu", "sparsity.storage=masked"]
    run = lowmem.prepare(torchvision.models.resnet18(), classification_loss, image_batch(), overrides=masked)
    names = run.trainer.sparsity.sparse_weight_names()
    assert "conv1.weight" not in names and "fc.weight" not in names
    assert "layer1.0.conv1.weight" in names and "layer4.1.conv2.weight" in names and len(names) == 19
    run = lowmem.prepare(torchvision.models.resnet18(), classification_loss, image_batch(),
                         overrides=["sparsity.density=0.5", "trainer.device=cpu", "sparsity.include=layer4.*",
                                    "sparsity.exclude=*downsample*"])  # fmt: skip
    assert run.trainer.sparsity.sparse_weight_names() == [
        "layer4.0.conv1.weight", "layer4.0.conv2.weight", "layer4.1.conv1.weight", "layer4.1.conv2.weight"
    ]  # fmt: skip
    gpt_names = lowmem.prepare(tiny_gpt(), lm_loss, token_batch(),
                               overrides=["sparsity.density=0.5", "trainer.device=cpu"]).trainer.sparsity.sparse_weight_names()  # fmt: skip # noqa: E501
    assert gpt_names[0] == "blocks.0.mlp.0.weight" and "head.weight" not in gpt_names


@pytest.mark.parametrize(
    "name, precision",
    [(name, "bf16") for name in MODELS] + [(name, "fp16") for name in ("resnet18", "vit", "gpt")],  # FP16: slow on CPU
)
def test_16_bit_steps_run_with_every_technique(name, precision):
    make_model, make_batch, loss, _ = MODELS[name]
    small = precision == "fp16" and name in ("resnet18", "mobilenet_v3_small")  # FP16 is slow on CPUs
    batch = make_batch(4, 8) if name == "gpt" else make_batch(4, 16 if small else 32)
    overrides = [f"precision={precision}", "trainer.device=cpu", "sparsity.density=0.5", "microbatch.size=2",
                 "checkpointing.strategy=residual_star", "checkpointing.every=2"]  # fmt: skip
    if precision == "fp16" and name != "gpt":
        overrides.append("checkpointing.strategy=residual")
    run = lowmem.prepare(make_model(), loss, batch, overrides=overrides)
    first = run.step(batch)
    assert math.isfinite(first["loss"])
    dtypes = {p.dtype for n, p in run.model.named_parameters() if "norm" not in n and "ln" not in n and "bn" not in n}
    assert torch.bfloat16 in dtypes or torch.float16 in dtypes


@pytest.mark.parametrize(
    "overrides",
    [["checkpointing.strategy=residual_star", "checkpointing.every=2"], ["microbatch.size=2"],
     ["precision=bf16"], ["sparsity.density=0.5", "sparsity.storage=masked"], ["sparsity.density=0.5"]],
    ids=lambda o: o[0],
)  # fmt: skip
def test_state_dict_keys_are_the_models_own(overrides):
    for name in ("resnet18", "gpt"):
        make_model, make_batch, loss, _ = MODELS[name]
        model = make_model()
        keys = list(model.state_dict())
        run = lowmem.prepare(model, loss, make_batch(), overrides=["trainer.device=cpu", *overrides])
        run.step(make_batch())
        assert run.model is model
        assert list(run.model.state_dict()) == keys
        plain = make_model()
        plain.load_state_dict(run.model.state_dict())  # a user's own loading code works
        run.model.load_state_dict(plain.state_dict())  # and back
        assert_same(run.model.state_dict(), plain.state_dict(), 0.0, "loaded back")
        if run.trainer.sparsity is None or run.trainer.sparsity.compact is None:
            assert list(dict(run.model.named_parameters())) == list(dict(plain.named_parameters()))


def test_checkpointing_finds_the_chains_of_blocks():
    chains = {name: [str(c) for c in find_block_chains(MODELS[name][0]())] for name in MODELS}
    assert chains["resnet18"] == ["8 x BasicBlock (layer1.0 .. layer4.1)"]
    assert chains["gpt"] == ["3 x Block (blocks.0 .. blocks.2)"]
    assert chains["vit"] == ["6 x EncoderBlock (encoder.layers.encoder_layer_0 .. encoder.layers.encoder_layer_5)"]
    assert chains["mobilenet_v3_small"][0].startswith("13 x ")
    named = find_block_chains(torchvision.models.resnet18(), ["layer3", "layer4"])
    assert [len(c.blocks) for c in named] == [4]
    by_class = find_block_chains(tiny_gpt(), ["Block"])
    assert [len(c.blocks) for c in by_class] == [3]


def test_a_block_between_code_starts_a_new_segment_and_stays_exact():
    """Code between two blocks (the second block's input is not the first one's output) must not be
    recomputed away: the block starts its own segment."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))

        def forward(self, x):
            for index, block in enumerate(self.blocks):
                x = block(x) * (2.0 if index == 1 else 1.0)
            return x.sum(1)

    def loss(model, batch):
        return (model(batch[0]) - batch[1]).pow(2).mean()

    torch.manual_seed(0)
    model = Scaled().double()
    batch = (torch.randn(6, 8, dtype=torch.float64), torch.randn(6, dtype=torch.float64))
    plain = lowmem.prepare(copy.deepcopy(model), loss, batch, overrides=FP64)
    segments_of_four = [*FP64, "checkpointing.strategy=residual", "checkpointing.every=4"]
    checkpointed = lowmem.prepare(copy.deepcopy(model), loss, batch, overrides=segments_of_four)
    plain.step(batch)
    checkpointed.step(batch)
    assert_same(plain.model.state_dict(), checkpointed.model.state_dict(), 0.0, "code between blocks")


def test_resume_is_bit_identical():
    overrides = ["trainer.device=cpu", "precision=bf16", "sparsity.density=0.3", "optim.name=adam",
                 "optim.lr=1e-3", "precision.stochastic_rounding=true", "microbatch.size=2",
                 "checkpointing.strategy=residual_star"]  # fmt: skip
    first, second = token_batch(), token_batch(seed=3)
    torch.manual_seed(0)
    model = tiny_gpt()
    interrupted = lowmem.prepare(copy.deepcopy(model), lm_loss, first, overrides=overrides)
    interrupted.step(first)
    interrupted.trainer.sparsity.rewire(interrupted.optimizer)  # state at new positions reset, then saved
    saved = copy.deepcopy(interrupted.state_dict())
    interrupted.step(second)
    # One process, one global generator: the resumed run is built after the first one's last step.
    resumed = lowmem.prepare(copy.deepcopy(model), lm_loss, first, overrides=overrides)
    resumed.load_state_dict(saved)
    resumed.step(second)
    assert_same(interrupted.model.state_dict(), resumed.model.state_dict(), 0.0, "resumed")
    assert interrupted.trainer.state == resumed.trainer.state


def test_profile_reports_and_leaves_training_state_alone():
    batch = image_batch(8)
    run = lowmem.prepare(torchvision.models.resnet18(num_classes=10), classification_loss, batch,
                         overrides=["trainer.device=cpu", "sparsity.density=0.5"])  # fmt: skip
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    row = run.profile()
    for key in ("model_bytes", "optimizer_bytes", "activation_bytes", "total_bytes", "peak_bytes", "flops", "params"):
        assert row[key] > 0, key
    assert row["total_bytes"] == row["model_bytes"] + row["optimizer_bytes"] + row["activation_bytes"]
    assert_same(before, run.model.state_dict(), 0.0, "after profile()")
    assert run.trainer.state.step == 0


def test_each_technique_shows_in_the_accounting_on_its_own():
    batch = image_batch(20)

    def accounted(*overrides: str) -> dict:
        model = torchvision.models.resnet18(num_classes=10)
        return lowmem.prepare(model, classification_loss, batch, overrides=["trainer.device=cpu", *overrides]).profile(
            measure=False
        )

    plain = accounted()
    assert accounted("checkpointing.strategy=residual_star", "checkpointing.every=2")["activation_bytes"] < 0.7 * (
        plain["activation_bytes"]
    )
    assert accounted("microbatch.size=2")["activation_bytes"] < 0.2 * plain["activation_bytes"]
    assert accounted("checkpointing.strategy=no_bn")["activation_bytes"] < 0.9 * plain["activation_bytes"]
    sparse = accounted("sparsity.density=0.3")
    assert sparse["model_bytes"] < 0.6 * plain["model_bytes"]
    assert sparse["activation_bytes"] == plain["activation_bytes"]
    assert accounted("precision=bf16")["total_bytes"] < 0.55 * plain["total_bytes"]


@pytest.mark.parametrize("name", list(MODELS))
def test_the_accounting_agrees_with_an_independent_count_of_saved_tensors(name):
    """Saved-tensor hooks on a real forward, counting each storage autograd keeps once (model state
    excluded), against what the accounting (a tracer on fake tensors) stores when backward starts."""
    make_model, make_batch, loss, _ = MODELS[name]
    batch = make_batch(16)
    torch.manual_seed(0)
    model = make_model()
    state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in state:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor.detach()  # not the tensor itself: an output saving itself would leak a cycle

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss(model, batch)
    independent = sum(saved.values())
    row = lowmem.prepare(model, loss, batch, overrides=["trainer.device=cpu"]).profile(measure=False)
    assert abs(row["activation_stored_before_backward"] - independent) <= 0.02 * independent


@pytest.mark.slow
def test_plan_overrides_profile_within_the_budget():
    batch = token_batch(16)
    plain = lowmem.prepare(tiny_gpt(), lm_loss, batch, overrides=["trainer.device=cpu"]).profile(measure=False)
    budget = plain["total_bytes"] / 1e6 / 3
    found = lowmem.plan(tiny_gpt(), lm_loss, batch, budget_mb=budget, overrides=["trainer.device=cpu"], top=3)
    got = lowmem.prepare(tiny_gpt(), lm_loss, batch, overrides=["trainer.device=cpu", *found["overrides"]])
    assert found["total_bytes"] <= budget * 1e6
    assert got.profile(measure=False)["total_bytes"] == found["total_bytes"]
    with pytest.raises(ConfigError, match="plan.budget_mb=0.001: nothing fits"):
        lowmem.plan(tiny_gpt(), lm_loss, batch, budget_mb=0.001, overrides=["trainer.device=cpu"])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: lowmem.prepare(tiny_gpt(), lambda m, b: m(b[0]).sum(-1), token_batch()).step(token_batch()),
         r"loss_fn\(model, batch\) returned \[4, 16\]: it must return the mean loss"),
        (lambda: lowmem.prepare(tiny_gpt(), lm_loss, (torch.zeros(4, 16, dtype=torch.long), torch.zeros(3, 16))),
         r"example_batch: its tensors disagree on dimension 0 \(example_batch\[0\] has 4, example_batch\[1\] has 3\)"),
        (lambda: lowmem.prepare(tiny_gpt(), lm_loss, token_batch(), overrides=["optim.lrr=0.1"]), "optim.lrr"),
        (lambda: lowmem.prepare(tiny_gpt(), lm_loss, token_batch(), overrides=["precision=fp8"]),
         "(?s)Could not find 'precision/fp8'.*Available options in 'precision'"),
        (lambda: lowmem.prepare(tiny_gpt(), lm_loss, token_batch(), overrides=["+recipe=wrn_cifar"]),
         "recipe belongs to the command line"),
        (lambda: lowmem.prepare(tiny_gpt(), lm_loss, token_batch(),
                                overrides=["checkpointing.strategy=residual", "checkpointing.blocks=blockz"]),
         "checkpointing.blocks='blockz' is neither a module path nor a block class.*close: blocks"),
        (lambda: lowmem.prepare(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), lambda m, b: m(b).mean(),
                                torch.zeros(2, 4), overrides=["checkpointing.strategy=residual"]),
         "no chain of blocks found in Sequential.*checkpointing.blocks"),
        (lambda: lowmem.prepare(tiny_gpt(), lm_loss, token_batch(), overrides=["checkpointing.strategy=no_bn"]),
         "checkpointing.strategy='no_bn'.*Block have no BatchNorm-ReLU-Conv2d sequence.*residual_star"),
        (lambda: lowmem.prepare(tiny_gpt(), lm_loss, token_batch(), overrides=["microbatch.size=5"]),
         "microbatch.size=5 is not allowed: must not exceed data.batch_size=4"),
        (lambda: lowmem.prepare(tiny_gpt(), lm_loss, token_batch(), overrides=["sparsity.density=0.5",
                                                                               "sparsity.include=nothing*"]),
         r"sparsity.include=\['nothing\*'\] matches no Linear, Conv1d/2d/3d, Embedding or transformers' Conv1D weight"),
    ],
    ids=["non-scalar loss", "batch lengths", "unknown knob", "bad value", "recipe", "blocks", "no chains", "no_bn",
         "microbatch", "include"],
)  # fmt: skip
def test_bad_input_is_refused_naming_what_to_change(call, message):
    with pytest.raises((ValueError, TypeError, Exception), match=message):
        call()
