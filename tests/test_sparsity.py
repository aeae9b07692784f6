"""Dynamic sparse reparameterization (SPEC §5): exact counts, masking, optimizer-state reset,
schedule, threshold rule, determinism, checkpoints, low precision and bad input."""

from __future__ import annotations

import io
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowmem.techniques.optimizers import LowPrecisionAdam, LowPrecisionSGD
from lowmem.techniques.sparsity import (
    DC_SCHEDULE,
    STORAGES,
    WRN_SCHEDULE,
    DynamicSparsity,
    RewireSchedule,
    sample_inactive,
    split_regrowth,
)
from recipes.wrn_cifar.model import WideResNet

storages = pytest.mark.parametrize("storage", STORAGES)


class ToyNet(nn.Module):
    """Two convs and a linear layer: 216 + 1,152 + 160 = 1,528 sparsifiable weights."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc(x.mean((2, 3)))


SPARSE = ["conv1.weight", "conv2.weight", "fc.weight"]


def every(updates: int) -> RewireSchedule:
    """Rewire every ``updates`` updates, forever."""
    return RewireSchedule(starts=(0,), periods=(updates,), stop=1e12, unit="update")


def make_sparsity(model: nn.Module, density: float = 0.3, period: int = 2, **kwargs) -> DynamicSparsity:
    kwargs.setdefault("rewire_fraction", 0.05)  # ~76 of 1,528 weights: every rewiring moves some
    return DynamicSparsity(model, SPARSE, density, schedule=every(period), **kwargs)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)


def train_step(model: nn.Module, sparsity: DynamicSparsity, optimizer: torch.optim.Optimizer, step: int):
    """One update on data fixed by ``step``; returns the rewiring diagnostics or None."""
    generator = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 3, 8, 8, generator=generator), torch.randint(10, (8,), generator=generator)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    sparsity.mask_gradients()
    optimizer.step()
    return sparsity.after_optimizer_step(optimizer, epoch=0.0)


def assert_inactive_zero(sparsity: DynamicSparsity) -> None:
    for name, mask in sparsity.masks.items():
        assert mask.dtype == torch.bool
        assert (sparsity.dense_weight(name)[~mask] == 0).all(), name


def dense_state(sparsity: DynamicSparsity, optimizer: torch.optim.Optimizer, name: str) -> list[torch.Tensor]:
    """The optimizer's parameter-shaped state of sparse weight ``name``, as dense tensors."""
    if sparsity.compact is None:
        param = sparsity.model.get_parameter(name)
        return [v for v in optimizer.state[param].values() if torch.is_tensor(v) and v.shape == param.shape]
    values, positions = sparsity.compact.layer(name)
    shape = sparsity.compact.shape(name)
    state = optimizer.state[values].values()
    return [
        v.new_zeros(shape.numel()).index_put_((positions,), v).view(shape)
        for v in state
        if torch.is_tensor(v) and v.shape == values.shape
    ]


@storages
def test_exact_count_and_zero_inactive_weights_through_training(storage):
    model = ToyNet()
    expected = sum(round(0.3 * model.get_parameter(name).numel()) for name in SPARSE)
    sparsity = make_sparsity(model, storage=storage)
    optimizer = sgd(model)
    initial = {name: mask.clone() for name, mask in sparsity.masks.items()}
    assert sparsity.nonzero_count() == expected and sparsity.numel() == 1528
    assert_inactive_zero(sparsity)

    reports = [train_step(model, sparsity, optimizer, step) for step in range(40)]
    rewirings = [report for report in reports if report is not None]
    assert len(rewirings) == 20
    for report in rewirings:
        assert report["regrown"] == report["pruned"]
        assert report["density"] == pytest.approx(expected / 1528)
        assert set(report["layer_density"]) == set(SPARSE)
    assert sum(report["pruned"] for report in rewirings) > 100
    assert sparsity.nonzero_count() == expected
    assert_inactive_zero(sparsity)
    assert any(not torch.equal(initial[name], sparsity.masks[name]) for name in SPARSE)


class FP16MomentSGD(torch.optim.Optimizer):
    """A custom optimizer keeping its momentum in FP16 next to a per-tensor scalar."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["moment_fp16"] = torch.zeros_like(p, dtype=torch.float16)
                    state["scale"] = torch.ones(())
                state["moment_fp16"].mul_(0.9).add_(p.grad.half())
                p.add_(state["moment_fp16"].float(), alpha=-group["lr"])


@storages
@pytest.mark.parametrize(
    "make_optimizer",
    [
        sgd,
        lambda model: torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4),
        lambda model: LowPrecisionAdam(model.parameters(), lr=1e-2, weight_decay=1e-4),
        lambda model: FP16MomentSGD(model.parameters()),
    ],
    ids=["sgd_nesterov", "adam", "lowmem_adam", "custom_fp16_moments"],
)
def test_optimizer_state_zero_at_inactive_and_regrown_positions(make_optimizer, storage):
    model = ToyNet()
    sparsity = make_sparsity(model, period=3, storage=storage)
    optimizer = make_optimizer(model)
    grown_somewhere = False
    for step in range(18):
        before = {name: mask.clone() for name, mask in sparsity.masks.items()}
        report = train_step(model, sparsity, optimizer, step)
        for name, mask in sparsity.masks.items():
            grown = mask & ~before[name]
            grown_somewhere |= bool(grown.any())
            assert (sparsity.dense_weight(name)[grown] == 0).all()
            states = dense_state(sparsity, optimizer, name)
            assert states
            for state in states:
                assert (state[~mask | grown] == 0).all(), (name, step)
                if report is None:
                    assert state[mask].abs().sum() > 0  # the reset is not a blanket wipe
    assert grown_somewhere


@storages
def test_no_regrowth_at_just_pruned_positions(storage):
    model = ToyNet()
    # At density 0.9 free slots are scarce: regrowth that could reuse pruned positions would hit them
    # about half the time.
    sparsity = make_sparsity(model, density=0.9, storage=storage)
    active = torch.cat([sparsity.dense_weight(n).detach()[m].abs() for n, m in sparsity.masks.items()])
    sparsity.threshold = float(active.quantile(0.08))
    before = {name: mask.clone() for name, mask in sparsity.masks.items()}
    just_pruned = {
        name: mask & (sparsity.dense_weight(name).abs() < sparsity.threshold) for name, mask in before.items()
    }
    count = sparsity.nonzero_count()

    report = sparsity.rewire()

    assert report["pruned"] == sum(int(p.sum()) for p in just_pruned.values()) > 50
    assert report["regrown"] == report["pruned"] and sparsity.nonzero_count() == count
    for name, mask in sparsity.masks.items():
        assert not mask[just_pruned[name]].any(), name
        assert (sparsity.dense_weight(name)[mask & ~before[name]] == 0).all()


@pytest.mark.parametrize(("target_over_pruned", "factor"), [(1 / 1.2, 0.5), (1 / 0.8, 2.0), (1.0, 1.0)])
def test_threshold_halves_or_doubles(target_over_pruned, factor):
    threshold = 0.05
    probe = make_sparsity(ToyNet(), seed=7)
    pruned = sum(
        int((mask & (probe.dense_weight(name).abs() < threshold)).sum())
        for name, mask in probe.masks.items()
    )
    assert pruned > 10
    fraction = pruned * target_over_pruned / probe.numel()
    sparsity = make_sparsity(ToyNet(), seed=7, rewire_fraction=fraction)
    sparsity.threshold = threshold

    report = sparsity.rewire()

    assert report["pruned"] == pruned
    assert report["target"] == pytest.approx(pruned * target_over_pruned)
    assert report["threshold"] == threshold
    assert report["next_threshold"] == sparsity.threshold == pytest.approx(threshold * factor)


def test_schedule_periods():
    assert [WRN_SCHEDULE.period(0, e) for e in (0, 24.99, 25, 79.9, 80, 140, 189.99)] == [
        100, 100, 200, 200, 400, 800, 800,
    ]  # fmt: skip
    assert WRN_SCHEDULE.period(0, 190) is None and WRN_SCHEDULE.period(0, 199.5) is None
    assert WRN_SCHEDULE.period(0, 30, freq_mult=4) == 50
    assert WRN_SCHEDULE.period(0, 150, freq_mult=0.125) == 6400
    assert WRN_SCHEDULE.period(0, 0, freq_mult=1000) == 1  # at least one update
    assert [DC_SCHEDULE.period(s, 0.0) for s in (1, 6249, 6250, 20000, 35000, 47499)] == [
        100, 100, 200, 400, 800, 800,
    ]  # fmt: skip
    assert DC_SCHEDULE.period(47500, 0.0) is None
    assert DC_SCHEDULE.period(100, 99.0, freq_mult=0.5) == 200  # the epoch does not matter here


def rewire_steps(schedule: RewireSchedule, updates: int, freq_mult: float = 1.0) -> list[int]:
    model = ToyNet()
    sparsity = DynamicSparsity(model, SPARSE, 0.3, schedule=schedule, freq_mult=freq_mult)
    optimizer = sgd(model)
    fired = []
    for update in range(1, updates + 1):
        # Fractional epochs: 10 updates per epoch.
        if sparsity.after_optimizer_step(optimizer, epoch=update / 10) is not None:
            fired.append(update)
    return fired


def test_schedule_fires_at_the_right_updates():
    by_update = RewireSchedule(starts=(0, 10), periods=(3, 5), stop=20, unit="update")
    assert rewire_steps(by_update, 40) == [3, 6, 9, 10, 15]
    assert rewire_steps(by_update, 40, freq_mult=0.5) == [6, 10]
    assert rewire_steps(by_update, 40, freq_mult=2) == [2, 4, 6, 8, 12, 15, 18]  # 1.5 -> 2, 2.5 -> 3
    by_epoch = RewireSchedule(starts=(0, 1), periods=(2, 4), stop=2, unit="epoch")
    assert rewire_steps(by_epoch, 40) == [2, 4, 6, 8, 12, 16]
    assert rewire_steps(by_epoch, 40, freq_mult=0.5) == [4, 8, 16]


def test_skipped_steps_neither_count_nor_rewire():
    model = ToyNet()
    sparsity = make_sparsity(model, period=3)
    optimizer = sgd(model)
    fired = []
    for iteration in range(12):
        if iteration % 2:  # e.g. an FP16 overflow: no optimizer step, nothing reported
            continue
        report = train_step(model, sparsity, optimizer, iteration)
        if report is not None:
            fired.append(report["rewire_step"])
    assert sparsity.step_count == 6
    assert fired == [3, 6]


def test_same_seed_same_masks_and_weights():
    torch.manual_seed(1)
    first = make_sparsity(ToyNet(), seed=3)
    torch.manual_seed(2)  # a different initial model: DSR re-initialises it from its own seed
    second = make_sparsity(ToyNet(), seed=3)
    other = make_sparsity(ToyNet(), seed=4)
    masked = make_sparsity(ToyNet(), seed=3, storage="masked")  # storage changes nothing drawn
    for name in SPARSE:
        assert torch.equal(first.masks[name], second.masks[name])
        assert torch.equal(first.masks[name], masked.masks[name])
        assert torch.equal(first.dense_weight(name), second.dense_weight(name))
        assert torch.equal(first.dense_weight(name), masked.dense_weight(name))
    assert any(not torch.equal(first.masks[name], other.masks[name]) for name in SPARSE)


@storages
def test_state_dict_round_trip_continues_bit_identically(storage):
    model = ToyNet()
    sparsity = make_sparsity(model, period=4, seed=0, storage=storage)
    optimizer = sgd(model)
    for step in range(12):
        train_step(model, sparsity, optimizer, step)
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sparsity": sparsity.state_dict()},
        buffer,
    )
    reports = [train_step(model, sparsity, optimizer, step) for step in range(12, 26)]
    assert sum(report is not None for report in reports) == 3

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed_model = ToyNet()
    resumed = make_sparsity(resumed_model, period=4, seed=99, storage=storage)  # the checkpoint overrides it all
    resumed.load_state_dict(checkpoint["sparsity"])  # first: compact storage takes the saved layout
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_optimizer = sgd(resumed_model)
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    resumed_reports = [train_step(resumed_model, resumed, resumed_optimizer, step) for step in range(12, 26)]

    assert resumed_reports == reports
    assert resumed.step_count == sparsity.step_count == 26 and resumed.threshold == sparsity.threshold
    for name in SPARSE:
        assert torch.equal(resumed.masks[name], sparsity.masks[name])
    for (name, value), resumed_value in zip(
        model.state_dict().items(), resumed_model.state_dict().values(), strict=True
    ):
        assert torch.equal(value, resumed_value), name


@storages
def test_loading_the_state_dicts_own_views_changes_nothing(storage):
    # state_dict() returns views of the live tensors (torch's convention): loading them back must not
    # clear the buffers they view first (compact storage once zeroed every sparse weight so).
    model = ToyNet()
    sparsity = make_sparsity(model, period=4, seed=0, storage=storage)
    optimizer = sgd(model)
    for step in range(6):  # one rewiring: a layout other than the initial one
        train_step(model, sparsity, optimizer, step)
    expected = {key: value.clone() for key, value in model.state_dict().items()}
    masks = sparsity.masks
    sparsity.load_state_dict(sparsity.state_dict())
    model.load_state_dict(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    for name in SPARSE:
        assert torch.equal(sparsity.masks[name], masks[name])
    assert sparsity.nonzero_count() == sum(int(mask.sum()) for mask in masks.values())


@storages
def test_load_state_dict_rejects_other_layers_another_density_and_storage(storage):
    state = make_sparsity(ToyNet(), storage=storage).state_dict()
    layers = state["counts" if storage == "compact" else "masks"]
    layers["conv3.weight"] = layers.pop("conv2.weight")
    with pytest.raises(ValueError, match="conv3.weight"):
        make_sparsity(ToyNet(), storage=storage).load_state_dict(state)
    other = "masked" if storage == "compact" else "compact"
    with pytest.raises(ValueError, match="sparsity.storage"):
        make_sparsity(ToyNet(), storage=other).load_state_dict(make_sparsity(ToyNet(), storage=storage).state_dict())
    if storage == "compact":
        with pytest.raises(ValueError, match="sparsity.density"):
            make_sparsity(ToyNet(), density=0.5).load_state_dict(make_sparsity(ToyNet()).state_dict())


@storages
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_weights(dtype, storage):
    model = ToyNet().to(dtype)
    sparsity = make_sparsity(model, init_threshold=0.02, storage=storage)
    optimizer = LowPrecisionSGD(model.parameters(), lr=0.1, stochastic_rounding=True)
    count = sparsity.nonzero_count()
    pruned = 0
    for step in range(12):
        for name, param in model.named_parameters():
            param.grad = torch.randn_like(param) * 0.1
            if name in sparsity.masks:  # garbage at inactive positions must vanish
                param.grad[~sparsity.masks[name]] = float("nan")
        sparsity.mask_gradients()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        optimizer.step()
        report = sparsity.after_optimizer_step(optimizer, epoch=step / 10)
        pruned += report["pruned"] if report else 0
    assert pruned > 0 and sparsity.nonzero_count() == count
    assert all(sparsity.dense_weight(name).dtype == dtype for name in SPARSE)
    assert_inactive_zero(sparsity)


def test_mask_gradients_keeps_active_gradients():
    model = ToyNet()
    sparsity = make_sparsity(model, storage="masked")  # compact storage has no inactive gradient
    grads = {name: torch.randn_like(model.get_parameter(name)) for name in SPARSE}
    for name, grad in grads.items():
        model.get_parameter(name).grad = torch.where(sparsity.masks[name], grad, float("inf"))
    model.fc.bias.grad = torch.full_like(model.fc.bias, float("nan"))  # dense: not touched
    sparsity.mask_gradients()
    for name, grad in grads.items():
        mask = sparsity.masks[name]
        assert torch.equal(model.get_parameter(name).grad, torch.where(mask, grad, 0.0))
    assert model.fc.bias.grad.isnan().all()


@storages
def test_density_one_is_dense_and_never_rewires(storage):
    model = ToyNet()
    sparsity = make_sparsity(model, density=1.0, period=1, storage=storage)
    optimizer = sgd(model)
    assert all(mask.all() for mask in sparsity.masks.values())
    assert all(train_step(model, sparsity, optimizer, step) is None for step in range(3))
    assert sparsity.nonzero_count() == sparsity.numel()


@storages
def test_wrn_16_1_step_and_rewiring(storage):
    model = WideResNet(16, 1)
    names = model.sparsifiable_weights()
    dense_counts = sum(round(0.3 * model.get_parameter(n).numel()) for n in names)
    sparsity = DynamicSparsity(model, names, 0.3, schedule=every(1), init_threshold=0.05, storage=storage)
    optimizer = sgd(model)
    count = sparsity.nonzero_count()
    assert len(sparsity.sparse_weight_names()) == 12
    x, y = torch.randn(4, 3, 32, 32), torch.randint(10, (4,))
    F.cross_entropy(model(x), y).backward()
    sparsity.mask_gradients()
    optimizer.step()
    report = sparsity.after_optimizer_step(optimizer, epoch=0.01)
    assert report is not None and report["pruned"] > 0
    assert sparsity.nonzero_count() == count == dense_counts
    assert_inactive_zero(sparsity)


def test_split_regrowth():
    generator = torch.Generator().manual_seed(0)
    assert split_regrowth(10, [1, 1, 1], [100, 100, 100], generator) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])
    assert split_regrowth(100, [300, 100], [1000, 1000], generator) == [75, 25]
    assert split_regrowth(100, [300, 100], [10, 1000], generator) == [10, 90]  # capped by free slots
    assert split_regrowth(100, [1, 1], [30, 20], generator) == [30, 20]  # not enough free slots
    assert split_regrowth(0, [5, 5], [9, 9], generator) == [0, 0]


@pytest.mark.parametrize("count", [2, 6])  # sampling by rejection / by enumerating the candidates
def test_sample_inactive_is_uniform_and_distinct(count):
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(1000, dtype=torch.bool)
    inactive = torch.arange(5, 1000, 100)
    mask[inactive] = False
    hits = torch.zeros(1000)
    for _ in range(500):
        picked = sample_inactive(mask, count, generator)
        assert picked.unique().numel() == count and not mask[picked].any()
        hits[picked] += 1
    expected = 500 * count / 10
    assert hits.sum() == 500 * count and ((hits[inactive] - expected).abs() < 0.2 * expected).all()


@pytest.mark.parametrize(
    ("kwargs", "knob"),
    [
        ({"density": 0.0}, "sparsity.density"),
        ({"density": 1.5}, "sparsity.density"),
        ({"density": float("nan")}, "sparsity.density"),
        ({"density": 1e-4}, "sparsity.density"),  # leaves conv1 (216 weights) with none
        ({"weight_names": []}, "`sparsity` layer rule"),
        ({"weight_names": ["conv9.weight"]}, "`sparsity` layer rule"),
        ({"weight_names": ["fc.bias"]}, "fc.bias"),
        ({"fraction_mult": 0}, "sparsity.rewire_fraction_mult"),
        ({"freq_mult": -1.0}, "sparsity.rewire_freq_mult"),
    ],
)
def test_bad_input_names_the_knob(kwargs, knob):
    arguments = {"weight_names": SPARSE, "density": 0.3, **kwargs}
    with pytest.raises(ValueError, match=re.escape(knob)):
        DynamicSparsity(ToyNet(), schedule=WRN_SCHEDULE, **arguments)


def test_bad_schedule():
    with pytest.raises(ValueError, match="unit"):
        RewireSchedule(starts=(0,), periods=(100,), stop=10, unit="epochs")
    with pytest.raises(ValueError, match="periods"):
        RewireSchedule(starts=(0, 5), periods=(100,), stop=10)


def test_a_graph_kept_across_a_rewiring_does_not_break_the_next_backward():
    """A compact layer whose count a rewiring changes gets values of a new shape; a graph of an
    earlier step still alive (a kept loss tensor, or a compiler's traced inputs until the garbage
    collector runs) holds the old gradient accumulator, which torch keeps across a change of shape:
    the next backward failed ("expected shape compatible with" the old count) until the rewiring cut
    it loose (``compact.repoint``)."""
    torch.manual_seed(0)
    model = ToyNet()
    sparsity = make_sparsity(model, period=1, storage="compact", rewire_fraction=0.2)
    optimizer = sgd(model)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(10, (8,))
    kept = []
    changed = False
    for _ in range(6):
        counts = [values.numel() for values, _ in map(sparsity.compact.layer, sparsity.sparse_weight_names())]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward(retain_graph=True)
        kept.append(loss)  # the graph, and the accumulators of the values it read, stay alive
        sparsity.mask_gradients()
        optimizer.step()
        sparsity.after_optimizer_step(optimizer, epoch=0.0)
        after = [values.numel() for values, _ in map(sparsity.compact.layer, sparsity.sparse_weight_names())]
        changed = changed or after != counts
    assert changed  # some rewiring moved a layer's count: the shapes changed under the kept graphs
    assert_inactive_zero(sparsity)
