"""Checkpointing keeps the gradient of every tensor a block computes, not only of what it returns
(``lowmem.techniques.side_outputs``): a mixture of experts' router logits collected by transformers'
hooks, attention maps, a feature a user's forward hook captures, a tensor a module stores on itself.
FP64, one step, every checkpointing strategy: the weights equal plain PyTorch's within 1e-10 of the
update. A block that lets a tensor out in a way recomputation cannot keep is refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowmem
from lowmem.config import ConfigError
from lowmem.techniques.checkpointing import apply_checkpointing, apply_schedule
from lowmem.techniques.recomputation import Segment
from lowmem.techniques.side_outputs import ForwardWatch, RecomputeCollect, one_op
from recipes.wrn_cifar.model import WideResNet
from tests.test_checkpointing_real_models import SGD
from tests.test_checkpointing_real_models import STRATEGIES as CHECKPOINTING

transformers = pytest.importorskip("transformers")

# optimal at a budget below its floor: lowmem_step takes the smallest the refusal names.
STRATEGIES = {**CHECKPOINTING, "optimal": ["checkpointing.strategy=optimal", "checkpointing.budget_mb=1e-3"]}


def mixtral() -> nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_dropout=0.0, output_router_logits=True, router_aux_loss_coef=0.05,
        experts_implementation="eager",  # transformers' grouped experts have no FP64 kernel on CPU
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=64,
                                      attn_implementation="eager")  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss  # Mixtral: with the router's auxiliary loss


def attention_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The LM loss plus an entropy penalty on every layer's attention maps."""
    out = model(input_ids=batch, labels=batch, output_attentions=True)
    entropy = sum(-(a * a.clamp_min(1e-12).log()).sum(-1).mean() for a in out.attentions)
    return out.loss + 0.1 * entropy


class FeatureLoss:
    """The LM loss plus a penalty on features a user's forward hooks capture inside the blocks (the
    MLP outputs): a feature-distillation loss."""

    def __init__(self) -> None:
        self.features: list[torch.Tensor] = []

    def hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.features.append(output)

    def __call__(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        self.features.clear()
        loss = model(input_ids=batch, labels=batch).loss
        return loss + 0.5 * sum(f.pow(2).mean() for f in self.features)


def batch() -> torch.Tensor:
    return torch.randint(0, 100, (3, 12), generator=torch.Generator().manual_seed(1))


def plain_step(model: nn.Module, loss, data) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(0)
    loss(model, data).backward()
    optimizer.step()
    return model.state_dict()


def lowmem_step(model: nn.Module, loss, data, overrides: list[str]) -> dict[str, torch.Tensor]:
    try:
        run = lowmem.prepare(model, loss, data, overrides=SGD + overrides)
    except ConfigError as refusal:  # optimal's budget below the floor: take the smallest it names
        smallest = str(refusal).split("checkpointing.budget_mb >= ")[1].split()[0]
        budget = f"checkpointing.budget_mb={float(smallest) * 1.0001}"
        run = lowmem.prepare(model, loss, data, overrides=SGD + overrides[:1] + [budget])
    torch.manual_seed(0)
    run.step(data)
    return run.model.state_dict()


def worst_of_update(got: dict, want: dict, start: dict) -> float:
    """The largest difference from plain PyTorch's weights, relative to each weight's update."""
    worst = 0.0
    for name, value in want.items():
        update = (value - start[name]).abs().max()
        if value.is_floating_point() and update > 1e-20:
            worst = max(worst, ((got[name].double() - value).abs().max() / update).item())
    return worst


def check_equal_to_plain(make, loss_for, strategy: str) -> None:
    torch.manual_seed(0)
    model = make().double()
    start = copy.deepcopy(model.state_dict())
    reference, checkpointed = copy.deepcopy(model), copy.deepcopy(model)
    want = plain_step(reference, loss_for(reference), batch())
    got = lowmem_step(checkpointed, loss_for(checkpointed), batch(), STRATEGIES[strategy])
    assert worst_of_update(got, want, start) <= 1e-10


def hooked_mlps(model: nn.Module) -> FeatureLoss:
    loss = FeatureLoss()
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(loss.hook)
    return loss


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_mixtral_router_loss_keeps_its_gradient(strategy):
    check_equal_to_plain(mixtral, lambda model: lm_loss, strategy)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_loss_on_output_attentions_keeps_its_gradient(strategy):
    check_equal_to_plain(llama, lambda model: attention_loss, strategy)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_loss_on_hooked_block_features_keeps_its_gradient(strategy):
    check_equal_to_plain(llama, hooked_mlps, strategy)


def test_the_router_gradient_was_lost_without_side_outputs(monkeypatch):
    """The test above can fail: with side outputs ignored, the gate weights' update is off."""
    monkeypatch.setattr(ForwardWatch, "escaped", lambda self, returned, kept=(): [])
    torch.manual_seed(0)
    model = mixtral().double()
    start = copy.deepcopy(model.state_dict())
    want = plain_step(copy.deepcopy(model), lm_loss, batch())
    got = lowmem_step(copy.deepcopy(model), lm_loss, batch(), STRATEGIES["residual"])
    assert worst_of_update(got, want, start) > 1e-3


# --- lowmem's own residual stacks (one autograd node per segment of blocks) ---------------------


class StoringBlock(nn.Module):
    """A residual block that stores a tensor on itself and lets a hook see another."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.linear = nn.Linear(channels, channels)
        self.gate = nn.Linear(channels, 2)
        self.stored: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stored = self.gate(x).softmax(-1)  # read by the loss, as a router's probabilities are
        return x + torch.tanh(self.linear(x))


class Stack(nn.Module):
    def __init__(self, channels: int = 6, blocks: int = 4) -> None:
        super().__init__()
        self.residual_blocks = nn.ModuleList(StoringBlock(channels) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lowmem.residual import run_residual_blocks

        return run_residual_blocks(self, x)


def stack_loss(model: Stack, x: torch.Tensor, outputs: list) -> torch.Tensor:
    outputs.clear()
    y = model(x)
    stored = sum(block.stored.pow(2).sum() for block in model.residual_blocks)
    return y.pow(2).mean() + stored + sum(o.pow(3).mean() for o in outputs)


@pytest.mark.parametrize("backprop", ["all_at_once", "recursively"])
@pytest.mark.parametrize("every", [1, 2, 4])
def test_residual_stack_blocks_that_store_tensors_keep_their_gradients(backprop, every):
    torch.manual_seed(0)
    reference = Stack().double()
    model = copy.deepcopy(reference)
    apply_schedule(model, [[Segment(every, backprop)] * (4 // every)])
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    grads = []
    for net in (reference, model):
        outputs: list = []
        # A block output that flows on to the next block and is also captured (output_hidden_states).
        handle = net.residual_blocks[1].register_forward_hook(lambda m, a, out, outputs=outputs: outputs.append(out))
        x.grad = None
        stack_loss(net, x, outputs).backward()
        handle.remove()
        grads.append([x.grad.clone(), *(p.grad.clone() for p in net.parameters())])
    for want, got in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_wrn_feature_hook_under_every_strategy_gives_plain_gradients():
    """A hook on WRN's blocks (stored BN-ReLU recomputation, kept statistics, the skipped last
    convolution of residual_star) feeding the loss."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(4, 3, 16, 16, generator=generator, dtype=torch.float64)
    labels = torch.arange(4) % 10
    torch.manual_seed(0)
    reference = WideResNet(depth=10, width=1).double()
    results = []
    for strategy in ("none", "no_bn", "residual", "residual_star"):
        model = copy.deepcopy(reference)
        apply_checkpointing(model, strategy, 2)  # block 0's output is inside a segment
        features: list = []
        model.residual_blocks[0].register_forward_hook(lambda m, a, out, features=features: features.append(out))
        loss = F.cross_entropy(model(inputs), labels) + features[0].pow(2).mean()
        loss.backward()
        results.append([p.grad for p in model.parameters()])
    for got in results[1:]:
        for a, b in zip(results[0], got, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14)


# --- refusals and the watch itself -----------------------------------------------------------------


class WritesIntoBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(self.linear(x).mean(0))  # a value that needs a gradient, into a buffer
        return x + self.linear(x)


def test_a_block_writing_a_value_that_needs_grad_into_a_buffer_is_refused_in_one_line():
    model = nn.Sequential(*(WritesIntoBuffer() for _ in range(3)))
    run = lowmem.prepare(model, lambda m, x: m(x).sum(), torch.randn(2, 4), overrides=["trainer.device=cpu",
                         "checkpointing.strategy=residual"])  # fmt: skip
    before = copy.deepcopy(run.model.state_dict())
    with pytest.raises(ValueError, match=r"block 0 \(WritesIntoBuffer\) writes a value that needs a gradient into a "
                                         r"tensor it did not create \(add_ .*x\.detach\(\).*checkpointing\.blocks"):
        run.step(torch.randn(2, 4))
    for name, value in run.model.state_dict().items():
        if name.endswith("weight") or name.endswith("bias"):
            assert torch.equal(value, before[name]), name


def test_the_watch_follows_autograd():
    weight = torch.randn(3, 3, requires_grad=True)
    buffer = torch.randn(3)
    keep: dict = {}
    with torch.no_grad(), ForwardWatch() as watch:
        y = torch.randn(2, 3) @ weight
        keep["view"] = y[0]  # a view of a returned tensor: a side output; y is its base
        keep["detached"] = (y * 2).detach()  # no history
        keep["buffer"] = buffer * 2  # nothing that requires grad
        keep["filled"] = torch.zeros(3)
        keep["filled"][1:] = y[1, 1:]  # written in place with a value that needs grad
        keep["index"] = y.argmax(-1)  # an integer
        dead = y.exp()  # noqa: F841  (dropped below)
        kept_stat = y.mean()
    del dead
    side = watch.escaped([y], kept=[kept_stat])
    assert [id(t) for _, t in side] == [id(keep["view"]), id(keep["filled"])]  # in call order


def test_a_stored_base_of_a_stored_view_is_a_side_output_too():
    weight = torch.randn(3, 3, requires_grad=True)
    keep: dict = {}
    with torch.no_grad(), ForwardWatch() as watch:
        out = torch.randn(2, 3) @ weight
        base = out * 2
        keep["base"], keep["view"] = base, base[0]
    del base
    assert {id(t) for _, t in watch.escaped([out])} == {id(keep["base"]), id(keep["view"])}
    del keep["base"]
    assert {id(t) for _, t in watch.escaped([out])} == {id(keep["view"])}  # the base lives on in the view only


def test_recomputation_finds_side_outputs_by_call_order_with_grad_on():
    weight = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)

    def block(store: list) -> torch.Tensor:
        h = (x @ weight).tanh()
        h /= h.sum(-1, keepdim=True)  # in place: autograd clones h below the torch functions
        store.append(h.softmax(-1))
        return one_op(lambda: h * 3 if torch.is_grad_enabled() else (h + h + h), h)  # other ops, one call

    stored: list = []
    with torch.no_grad(), ForwardWatch() as watch:
        out = block(stored)
    (index, side), = watch.escaped([out])
    assert side is stored[0]
    with RecomputeCollect([index]) as collect:
        block(stored)
    again, = collect.collected([index], [(tuple(side.shape), side.dtype)])
    assert again is stored[1] and again.requires_grad


def test_saved_tensor_hooks_calling_torch_functions_do_not_shift_the_numbering():
    """The recomputation saves tensors for backward (the forward without autograd did not): what a
    saved-tensor hook in force computes (lowmem's accounting, compression) is not the block's."""
    weight = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)

    class Square(torch.autograd.Function):  # saves its input when apply returns, outside any torch call
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t * t

        @staticmethod
        def backward(ctx, grad):
            (t,) = ctx.saved_tensors
            return 2 * t * grad

    def block(store: list) -> torch.Tensor:
        h = Square.apply(x @ weight)
        store.append(h * 2)
        return h + 1

    stored: list = []
    with torch.no_grad(), ForwardWatch() as watch:
        out = block(stored)
    (index, side), = watch.escaped([out])
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.sum()) or t, lambda t: t):
        with RecomputeCollect([index]) as collect:
            again = block(stored)
    assert packed  # the hook ran, calling torch functions
    found, = collect.collected([index], [(tuple(side.shape), side.dtype)])
    assert found is stored[1]
    again.sum().backward()
