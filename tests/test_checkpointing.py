"""Activation checkpointing: every strategy reproduces checkpointing.strategy=none exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lowmem.residual import run_residual_blocks
from lowmem.techniques.checkpointing import Segment, apply_checkpointing, apply_schedule, validate_checkpointing
from lowmem.techniques.microbatch import apply_simulated_microbatching
from recipes.wrn_cifar.model import WideResNet

STRATEGIES = [("no_bn", 1), ("residual", 1), ("residual", 2), ("residual", 5), ("residual_star", 1),
              ("residual_star", 2), ("residual_star", 4), ("residual_star", 7)]  # fmt: skip


def train_steps(
    model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, steps: int
) -> list[list[torch.Tensor]]:
    """Run ``steps`` SGD steps; return every step's parameter gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return grads


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True))


class SavedTensorPeak:
    """Peak bytes of distinct storages (parameters excluded) saved for backward and not yet released."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.holders: dict[int, int] = {}  # storage -> number of saved references alive
        self.current = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self.params:
            return tensor
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if self.holders.get(key, 0) == 0:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        self.holders[key] = self.holders.get(key, 0) + 1
        # Autograd drops the packed object when it releases the saved tensor.
        return _SavedTensor(tensor, lambda: self._release(key, nbytes))

    def _release(self, key: int, nbytes: int) -> None:
        self.holders[key] -= 1
        if self.holders[key] == 0:
            self.current -= nbytes

    @staticmethod
    def unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _SavedTensor) else packed


class _SavedTensor:
    def __init__(self, tensor: torch.Tensor, on_release) -> None:
        self.tensor, self.on_release = tensor, on_release

    def __del__(self) -> None:
        self.on_release()


def saved_tensor_bytes(model: nn.Module, inputs: torch.Tensor) -> int:
    """Peak saved-tensor bytes of one forward and backward (recomputation included)."""
    tracker = SavedTensorPeak(model)
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        model(inputs).sum().backward()
    return tracker.peak


@pytest.fixture(scope="module")
def wrn_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 32, 32, generator=generator, dtype=torch.float64), torch.arange(8) % 10


@pytest.mark.parametrize("depth", [10, 16])
@pytest.mark.parametrize("strategy,every", STRATEGIES)
def test_strategy_matches_none_on_wrn(depth, strategy, every, wrn_data):
    reference = WideResNet(depth=depth, width=1).double()
    model = copy.deepcopy(reference)
    apply_checkpointing(model, strategy, every)
    steps = 3
    expected = train_steps(reference, *wrn_data, steps)
    got = train_steps(model, *wrn_data, steps)
    for step in range(steps):
        assert max_difference(expected[step], got[step]) <= 1e-12, f"gradients differ at step {step}"
    for (name, a), b in zip(reference.named_buffers(), model.buffers(), strict=True):
        if name.endswith("num_batches_tracked"):
            assert int(b) == steps, f"{name}: BatchNorm updated during recomputation"
        assert torch.equal(a, b), name


def test_state_dict_and_parameter_count_unchanged():
    model = WideResNet(depth=28, width=2)
    assert sum(p.numel() for p in model.parameters()) == 1_456_858
    keys = list(model.state_dict())
    apply_checkpointing(model, "residual_star", 2)
    assert list(model.state_dict()) == keys


def test_strategies_store_less_and_recompute_only_what_they_should(wrn_data):
    """Saved bytes shrink in the report's order; FLOPs: no_bn recomputes no convolution, the
    residual strategies recompute the blocks' forward once."""
    inputs = wrn_data[0]
    reference = WideResNet(depth=16, width=1).double()

    def measure(strategy: str, every: int = 1) -> tuple[int, int]:
        model = copy.deepcopy(reference)
        apply_checkpointing(model, strategy, every)
        counter = FlopCounterMode(display=False)
        with counter:
            model(inputs).sum().backward()
        return saved_tensor_bytes(model, inputs), counter.get_total_flops()

    none, no_bn, residual, star = (
        measure("none"),
        measure("no_bn"),
        measure("residual", 2),
        measure("residual_star", 2),
    )
    assert none[0] > 1.9 * no_bn[0] and no_bn[0] > residual[0] > star[0]
    convolutions = []  # forward FLOPs of (conv1, conv2) of every block
    with torch.no_grad():
        x = reference.conv1(inputs)
        for block in reference.residual_blocks:
            with FlopCounterMode(display=False) as counter:
                x = block(x)
            counts = counter.get_flop_counts()
            convolutions.append([sum(counts[f"PreActBlock.{conv}"].values()) for conv in ("conv1", "conv2")])
    blocks_forward = sum(map(sum, convolutions))
    assert no_bn[1] == none[1]
    assert residual[1] == none[1] + blocks_forward
    # residual_star: the sweep runs every block but each segment's last; each block's graph is
    # rebuilt once for backprop, with its first convolution only (the second one's output is unread).
    lasts = range(1, len(convolutions), 2)
    recomputed = blocks_forward - sum(sum(convolutions[i]) for i in lasts) + sum(c1 for c1, _ in convolutions)
    assert star[1] == none[1] + recomputed
    assert star[1] < residual[1]  # the first blocks of stages 2 and 3 have a cheaper (strided) conv1


def test_autocast_recomputation_matches(wrn_data):
    """Recomputation runs under the forward's autocast state (CPU bfloat16 here)."""
    inputs, labels = wrn_data[0].float(), wrn_data[1]
    reference = WideResNet(depth=10, width=1)
    results = []
    for strategy in ("none", "residual_star"):
        model = copy.deepcopy(reference)
        apply_checkpointing(model, strategy, 2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        results.append([p.grad for p in model.parameters()])
    assert max_difference(*results) == 0.0


def wrn_with_fp32_norms(depth: int, dtype: torch.dtype) -> WideResNet:
    """WRN-depth-1 with every weight but the BatchNorms' in ``dtype`` (pure 16-bit training's layout)."""
    model = WideResNet(depth=depth, width=1)
    for module in model.modules():
        if not isinstance(module, nn.BatchNorm2d):
            for param in module.parameters(recurse=False):
                param.data = param.data.to(dtype)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", ["no_bn", "residual_star"])
def test_recomputing_bn_from_kept_statistics_gives_the_same_bits(wrn_data, strategy, dtype):
    """On CPU, BN's output is recomputed from the forward's batch statistics with the kernel's own
    rounding and BN's backward kernel is called directly: the gradients are autograd's bits, in
    FP32 and in 16 bits with FP32 BatchNorm (pure BF16 training)."""
    inputs, labels = wrn_data[0].to(dtype), wrn_data[1]
    reference = wrn_with_fp32_norms(10, dtype)
    results = []
    for name in ("none", strategy):
        model = copy.deepcopy(reference)
        apply_checkpointing(model, name, 2)
        F.cross_entropy(model(inputs).float(), labels).backward()
        results.append([p.grad for p in model.parameters()])
    assert max_difference(*results) == 0.0


class _NormStatistics(TorchDispatchMode):
    """Counts the ops that compute a BatchNorm's batch statistics (its forward kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        self.calls += "batch_norm" in name and "backward" not in name
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", ["no_bn", "residual_star"])
def test_recomputations_reuse_the_forwards_batch_statistics(wrn_data, strategy, dtype):
    """A checkpointed segment's recomputations (the block inputs without a graph, each block's graph,
    the skipped last convolution's input in backward) normalize with the batch statistics its
    forward computed: each BatchNorm computes them once per step, as without checkpointing, and the
    gradients and running statistics are the same bits. (WRN-16-1: segments of two blocks.)"""
    inputs, labels = wrn_data[0].to(dtype), wrn_data[1]
    reference = wrn_with_fp32_norms(16, dtype)
    results, counted = [], []
    for name in ("none", strategy):
        model = copy.deepcopy(reference)
        apply_checkpointing(model, name, 2)
        with _NormStatistics() as statistics:
            F.cross_entropy(model(inputs).float(), labels).backward()
        counted.append(statistics.calls)
        results.append([p.grad for p in model.parameters()] + list(model.buffers()))
    assert counted[0] == sum(isinstance(m, nn.BatchNorm2d) for m in reference.modules())
    assert counted[1] == counted[0]
    assert max_difference(*results) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4, 32, 8, 8), (3, 5, 7, 7), (2, 6, 5), (1, 3, 1, 1), (8, 16, 96, 96)])
def test_recomputed_norm_relu_is_bn_kernels_output_in_one_pass(shape, dtype):
    """The C kernel that recomputes ReLU(BN) from the kept statistics (one pass, no FP32 scratch)
    returns the BN kernel's output after ReLU bit for bit, as torch's ops do; the largest shape is
    split across threads. NaN stays NaN; every value not above 0 becomes +0."""
    from lowmem.kernels import cpu as cpu_kernels
    from lowmem.techniques import checkpointing

    if cpu_kernels.library() is None:
        pytest.skip("no C compiler: the torch ops are used")
    generator = torch.Generator().manual_seed(sum(shape))
    norm = nn.BatchNorm2d(shape[1])
    norm.weight.data.normal_(generator=generator)
    norm.bias.data.normal_(generator=generator)
    x = (3 * torch.randn(shape, generator=generator)).to(dtype)
    flat = x.view(-1)
    flat[:3] = torch.tensor([0.0, -0.0, float("nan")])
    _, mean, invstd = torch.ops.aten.native_batch_norm(x, norm.weight, norm.bias, None, None, True, 0.0, 1e-5)
    flat[2] = 0.0  # NaN would make every statistic NaN: the kernel's output is compared without it
    out, mean, invstd = torch.ops.aten.native_batch_norm(x, norm.weight, norm.bias, None, None, True, 0.0, 1e-5)
    scale, shift = checkpointing._scale_and_shift(norm, mean, invstd)
    assert cpu_kernels.norm_relu_fits(x, scale, shift)
    with torch.no_grad():
        fused = checkpointing._norm_relu_from_statistics(norm, x, mean, invstd)
        by_torch = checkpointing._normalized_from_statistics(norm, x, mean, invstd).relu_()
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(fused.view(bits), out.relu().view(bits))
    assert torch.equal(fused.view(bits), by_torch.view(bits))
    assert not torch.signbit(fused).any()
    flat[-1] = float("nan")
    assert cpu_kernels.norm_relu(x, scale, shift).view(-1)[-1].isnan()


def test_composes_with_simulated_microbatching(wrn_data):
    reference = WideResNet(depth=10, width=1).double()
    apply_simulated_microbatching(reference, 3)
    model = copy.deepcopy(reference)
    apply_checkpointing(model, "residual_star", 2)
    assert (
        max_difference(train_steps(reference, *wrn_data, 2)[-1], train_steps(model, *wrn_data, 2)[-1])
        <= 1e-12
    )
    assert max_difference(list(reference.buffers()), list(model.buffers())) == 0.0


def test_eval_and_no_grad_run_plainly(wrn_data):
    reference = WideResNet(depth=10, width=1).double().eval()
    model = copy.deepcopy(reference)
    apply_checkpointing(model, "residual_star", 2)
    with torch.no_grad():
        assert torch.equal(reference(wrn_data[0]), model(wrn_data[0]))


class DropoutBlock(nn.Module):
    """A residual block that reads a context tensor and uses dropout: recomputation must replay RNG."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, scale: float) -> torch.Tensor:
        return x + scale * F.dropout(torch.tanh(self.linear(x) + memory), p=0.5, training=self.training)


class DropoutStack(nn.Module):
    def __init__(self, width: int = 6, blocks: int = 5) -> None:
        super().__init__()
        self.residual_blocks = nn.ModuleList(DropoutBlock(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return run_residual_blocks(self, x, memory, 0.5)


@pytest.mark.parametrize("every", [1, 2, 3, 9])
def test_residual_replays_dropout_and_reaches_context(every):
    reference = DropoutStack().double()
    model = copy.deepcopy(reference)
    apply_checkpointing(model, "residual", every)
    assert max_difference(*_dropout_stack_gradients(reference, model)) <= 1e-12


def _dropout_stack_gradients(*nets: nn.Module) -> list[list[torch.Tensor]]:
    """Per net: the input's and context's gradients, the next random draw (a recomputation must
    leave the caller's RNG stream untouched) and the parameters' gradients, from the same draws."""
    inputs, memories = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    results = []
    for net in nets:
        x, memory = inputs.clone().requires_grad_(), memories.clone().requires_grad_()
        torch.manual_seed(3)
        net(x, memory).pow(2).sum().backward()
        results.append([x.grad, memory.grad, torch.rand(3), *(p.grad for p in net.parameters())])
    return results


@pytest.mark.parametrize("strategy", ["no_bn", "residual_star"])
def test_blocks_without_norm_protocol_are_rejected(strategy):
    with pytest.raises(ValueError, match=f"checkpointing.strategy='{strategy}'.*DropoutBlock"):
        apply_checkpointing(DropoutStack(), strategy)


@pytest.mark.parametrize(
    "strategy,every,message",
    [("residual_2", 1, r"checkpointing.strategy='residual_2'.*none, no_bn, residual, residual_star"),
     ("residual", 0, "checkpointing.every=0"), ("residual", 1.5, "checkpointing.every=1.5")],
)  # fmt: skip
def test_bad_knobs_are_rejected(strategy, every, message):
    with pytest.raises(ValueError, match=message):
        validate_checkpointing(strategy, every)


def test_model_without_blocks_is_rejected_naming_the_knob():
    apply_checkpointing(nn.Linear(2, 2), "none")  # nothing to do, not an error
    with pytest.raises(ValueError, match="no chain of blocks found in Linear.*checkpointing.blocks"):
        apply_checkpointing(nn.Linear(2, 2), "residual")


# Every kind of segment in one schedule (WRN-16-1: 6 blocks), as checkpointing.strategy=optimal runs them.
MIXED_SCHEDULE = (Segment(1, "stored"), Segment(1, "stored", True), Segment(2, "all_at_once", True),
                  Segment(1, "all_at_once"), Segment(1, "recursively", True))  # fmt: skip


def test_mixed_schedule_matches_none(wrn_data):
    """Stored, no_bn, all_at_once (with and without BN-ReLU recomputation) and recursive segments
    side by side: the same gradients and BatchNorm statistics (updated once per step) as none."""
    reference = WideResNet(depth=16, width=1).double()
    model = copy.deepcopy(reference)
    apply_schedule(model, [MIXED_SCHEDULE])
    steps = 2
    expected, got = train_steps(reference, *wrn_data, steps), train_steps(model, *wrn_data, steps)
    for step in range(steps):
        assert max_difference(expected[step], got[step]) <= 1e-12, f"gradients differ at step {step}"
    for (name, a), b in zip(reference.named_buffers(), model.buffers(), strict=True):
        assert torch.equal(a, b), name
        if name.endswith("num_batches_tracked"):
            assert int(b) == steps, name


def test_schedule_replays_dropout_and_reaches_context():
    reference = DropoutStack().double()
    model = copy.deepcopy(reference)
    apply_schedule(model, [(Segment(2, "recursively"), Segment(1, "stored"), Segment(2, "all_at_once"))])
    assert max_difference(*_dropout_stack_gradients(reference, model)) <= 1e-12


@pytest.mark.parametrize(
    "schedule,message",
    [((Segment(2, "stored"), Segment(2, "all_at_once")), "does not cover the 5 blocks"),
     ((Segment(5, "all_at_twice"),), "backprop one of stored, all_at_once, recursively"),
     ((Segment(5, "stored", True),), "recomputes BatchNorm-ReLU outputs, but DropoutBlock")],
)  # fmt: skip
def test_bad_schedules_are_rejected(schedule, message):
    with pytest.raises(ValueError, match=message):
        apply_schedule(DropoutStack(), [schedule])
