"""A plan is a promise (issue 47, items 3 and 4): ``lowmem.plan`` verifies its choice with one measured
step by default and skips a configuration whose measured peak exceeds the budget; "nothing fits"
names one figure, which a budget of that figure plans; the search offers microbatches of one
example, BF16 where it runs at full speed and the chunked loss; the accounting counts what a real
step holds beyond the activations (temporaries of backward, grouped convolutions, BF16, the data).
Each test takes a few seconds on two CPU cores."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowmem
import lowmem.api
from lowmem.planning import budget as plan_budget
from lowmem.planning.budget import NothingFits
from lowmem.planning.search import Planner, precisions_for
from lowmem.profiler import MB
from lowmem.profiler.activations import account_activations
from tests.helpers import TINY_WRN, make_config

# The knobs these tests fix, so that each plan searches the microbatch sizes alone (fast).
FIXED = ["trainer.device=cpu", "precision=fp32", "sparsity.density=1.0", "optim.state_bits=null",
         "checkpointing.strategy=none"]  # fmt: skip


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def small_convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, groups=4),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip


def images(examples: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(examples, 3, 16, 16, generator=generator), torch.randint(0, 10, (examples,), generator=generator)


def test_verify_is_the_default_of_the_command_line_and_of_python():
    assert make_config(*TINY_WRN).plan.verify is True
    assert inspect.signature(lowmem.api.plan).parameters["verify"].default is True  # lowmem.plan(...)
    assert inspect.signature(plan_budget.plan_search).parameters["verify"].default is True


def test_a_configuration_measured_over_the_budget_is_skipped(monkeypatch):
    """The first configuration chosen measures (here: is made to measure) over the budget: it is
    skipped, the next one is chosen, and the table of what was tried says so."""
    profile_row = plan_budget.profile_row
    calls = []

    def first_over(trainer, measure):
        report, row = profile_row(trainer, measure)
        calls.append(measure)
        if len(calls) == 1:
            row = {**row, "peak_bytes": 10**9}  # a peak far over any budget here
        return report, row

    monkeypatch.setattr(plan_budget, "profile_row", first_over)
    plan = lowmem.plan(small_convnet(), classification_loss, images(), budget_mb=50, overrides=FIXED)
    assert calls[0] is True  # verified: one real step measured
    assert [t["verdict"] for t in plan["tried"]] == ["over the budget", "fits"]
    assert plan["tried"][0]["measured_mb"] == 1000.0
    assert plan["overrides"] == plan["tried"][1]["overrides"] != plan["tried"][0]["overrides"]
    assert plan["verified"] and plan["peak_bytes"] <= 50 * MB


def test_nothing_fits_names_one_figure_and_a_budget_of_it_plans():
    model, batch = small_convnet(), images()
    with pytest.raises(NothingFits) as refused:
        lowmem.plan(model, classification_loss, batch, budget_mb=0.01, overrides=FIXED)
    message = str(refused.value)
    named = re.search(r"measures ([0-9.]+) MB \(.*allowed: plan.budget_mb >= ([0-9.]+)$", message)
    assert named and named[1] == named[2] == f"{refused.value.smallest_mb:.3f}", message
    assert "microbatch.size=1" in message  # the smallest configuration: one example at a time
    assert refused.value.tried and refused.value.tried[-1]["verdict"] == "over the budget"
    # The figure named is one a budget can be: planned for it, a configuration fits when measured.
    plan = lowmem.plan(model, classification_loss, batch, budget_mb=refused.value.smallest_mb, overrides=FIXED)
    assert plan["peak_bytes"] <= refused.value.smallest_mb * MB


def test_the_search_offers_microbatches_of_one_example_and_bf16():
    planner = Planner([*TINY_WRN, "trainer.device=cpu"], 10**9)
    assert planner.microbatches[0] is None and planner.microbatches[-1] == 1
    # On a CPU, BF16 at full speed: its products computed in FP32 where native kernels are slower.
    assert precisions_for(make_config(*TINY_WRN, "trainer.device=cpu")) == ("fp32", "bf16")
    assert precisions_for(make_config(*TINY_WRN, "trainer.device=cpu", "precision.cpu_compute=fp32")) == (
        "fp32", "bf16",
    )  # fmt: skip
    assert planner.precisions == ("fp32", "bf16")
    plan = lowmem.plan(
        small_convnet(), classification_loss, images(), budget_mb=50,
        overrides=[o for o in FIXED if not o.startswith("precision")] + ["microbatch.size=1"], verify=False,
    )  # fmt: skip
    assert plan["configuration"]["microbatch.size"] == "1"


class _Vocabulary(nn.Module):
    """A language model's shape in miniature: embedding, one layer, an output layer over a large
    vocabulary (``get_output_embeddings``: the chunked loss applies)."""

    def __init__(self, vocabulary: int = 8000, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, hidden)
        self.layer = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocabulary, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.layer(self.embed(tokens))))


def language_model_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def test_the_search_chooses_the_chunked_loss_where_the_unchunked_does_not_fit():
    """loss.chunk_tokens: none (fewer FLOPs) where it fits, auto where only it does."""
    from lowmem.api import LoopTask, _build, as_loop_config, loop_defaults

    batch = torch.randint(0, 8000, (4, 129), generator=torch.Generator().manual_seed(4))  # 512 tokens: 16 MB logits
    task = LoopTask(language_model_loss)

    def build(cfg):
        return _build(as_loop_config(cfg), _Vocabulary(), task, batch)

    fixed = [*loop_defaults(4), *FIXED, "microbatch.size=null"]
    roomy = Planner(fixed, 10**9, build=build)
    roomy.parallel = False
    found = roomy.search(top=2)
    assert [c.chunk for c in found] == ["none", "auto"] and found[0].flops < found[1].flops
    assert found[1].budget_total_bytes < found[0].budget_total_bytes  # the logits never held whole
    tight = Planner(fixed, found[0].budget_total_bytes - 1, build=build)
    tight.parallel = False
    assert [c.chunk for c in tight.search(top=2)] == ["auto"]
    assert "loss.chunk_tokens=auto" in tight.overrides(tight.search(top=1)[0])


class _BigTemporaryInBackward(torch.autograd.Function):
    """Saves its input; its backward makes a temporary 16 times the input's size."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        scratch = x.repeat(16, 1)  # a temporary of backward: no activation, but memory
        return grad * 2 + scratch[: x.shape[0]] * 0


def test_the_live_record_sees_temporaries_of_backward_but_not_weight_gradients():
    model = nn.Linear(256, 256, bias=False)
    x = torch.randn(16, 256)

    def step():
        _BigTemporaryInBackward.apply(model(x)).sum().backward()

    for fake in (True, False):
        trace = account_activations(step, model, fake=fake)
        scratch, weight_gradient = 16 * 16 * 256 * 4, 256 * 256 * 4
        assert trace.activation_bytes < scratch <= trace.live_bytes  # the report's activations leave it out
        assert trace.live_bytes < scratch + weight_gradient  # optimizer memory: not the pass's
        # ... unless a previous microbatch's gradient is there to add it to: then a temporary until added.
        assert trace.live_accumulating_bytes >= trace.live_bytes
        model.weight.grad = None


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_budget_figure_holds_a_real_step_of_grouped_convolutions(precision):
    """What the planner compares with the budget (accounted total with the step's temporaries) is at
    least the measured peak (+1%): grouped convolutions, microbatches, FP32 and BF16."""
    model, batch = small_convnet(), images()
    overrides = ["trainer.device=cpu", f"precision={precision}", "microbatch.size=2"]
    run = lowmem.prepare(model, classification_loss, batch, overrides=overrides)
    row = run.profile()
    assert row["peak_bytes"] <= 1.01 * row["budget_total_bytes"], row["step_temporaries"]
    assert row["step_temporaries"]["data"] > 0 and row["step_temporaries"]["buffers"] > 0


def test_the_profilers_recomputation_check_figures_are_the_techniques():
    """The profiler sits below the techniques: the scratch of a recomputed block's first check and the
    attribute that says a model has chains are named there; they must be the techniques' own."""
    from lowmem.profiler import report
    from lowmem.techniques import block_checks, chains

    assert report.RECOMPUTATION_CHECK_BYTES == 3 * 8 * block_checks._CHUNK
    assert report.CHAINS_ATTRIBUTE == chains._RUNNERS


def test_the_live_record_takes_a_gradient_a_hook_of_the_model_took():
    """A post-accumulate-grad hook of the model's own may take ``.grad`` (as swin_t's compact sparse
    weights did under BF16 microbatches): the record counts nothing for it, and does not fail."""
    model = nn.Linear(64, 64)
    taken = []
    model.weight.register_post_accumulate_grad_hook(lambda p: taken.append(p.grad) or setattr(p, "grad", None))
    x = torch.randn(8, 64)
    for fake in (True, False):
        trace = account_activations(lambda: model(x).square().sum().backward(), model, fake=fake)
        assert trace.live_bytes > 0 and model.weight.grad is None
    assert taken  # the real pass ran the hook before the record's own


def test_the_live_record_leaves_no_tracer_alive():
    """Each storage's finalizer holds the tracer; those of storages that outlive the pass (weight
    gradients in ``.grad``) are detached at its end, or every accounting pass (a plan runs many)
    would keep its tracer and model alive."""
    import gc

    from lowmem.profiler.activations import ActivationTracer

    def tracers() -> int:
        gc.collect()
        return sum(type(o) is ActivationTracer for o in gc.get_objects())  # (isinstance wakes deprecated proxies)

    model, x = nn.Linear(32, 32), torch.randn(4, 32)
    before = tracers()
    for fake in (True, False, True, False):
        account_activations(lambda: model(x).square().sum().backward(), model, fake=fake)
    assert tracers() == before
