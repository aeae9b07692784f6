"""Offloaded saved activations (checkpointing.offload, issue 33) on a CPU, through a test double of
the CUDA copy stream: the gradients are the plain ones bit for bit, copies go out in forward order
and come back in reverse with a bounded prefetch, the pinned pool is reused across steps and
bounded, the accounting counts host bytes instead of device activations, and a CPU run is refused
naming the knob."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lowmem.config import ConfigError, compose
from lowmem.planning.optimal import AccountedSchedule, _preference, apply_optimal_checkpointing
from lowmem.planning.schedule import BlockCosts, ChainCosts, cheapest_plan, exposed_transfer
from lowmem.profiler import account_activations, profile_trainer
from lowmem.techniques.compression import apply_compression
from lowmem.techniques.offload import PREFETCH, apply_offload, exposed_transfer_flops
from lowmem.trainer import build_trainer
from tests.helpers import TINY_WRN


class FakeStreams:
    """The copy stream as a log of (operation, position in forward order): copies run at once on
    the CPU; an event is the copy's (operation, position)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.pinned_buffers = 0
        self._positions: dict[int, int] = {}  # buffer -> position of the tensor it holds
        self._offloads = 0

    def new_step(self) -> None:
        self.log.clear()
        self._offloads = 0

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.pinned_buffers += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def to_host(self, tensor: torch.Tensor, buffer: torch.Tensor) -> tuple[str, int]:
        buffer[: tensor.numel() * tensor.element_size()].copy_(tensor.reshape(-1).view(torch.uint8))
        self._positions[id(buffer)] = self._offloads
        self._offloads += 1
        self.log.append(("to_host", self._positions[id(buffer)]))
        return self.log[-1]

    def to_device(self, buffer: torch.Tensor, like: torch.Tensor, after: tuple) -> tuple[torch.Tensor, tuple]:
        assert after in self.log  # the offload it must follow was issued
        out = torch.empty(like.shape, dtype=like.dtype)
        out.reshape(-1).view(torch.uint8).copy_(buffer[: out.numel() * out.element_size()])
        self.log.append(("to_device", self._positions[id(buffer)]))
        return out, self.log[-1]

    def wait(self, event: tuple) -> None:
        self.log.append(("wait", event[1]))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(layer for _ in range(5) for layer in (nn.Linear(256, 256), nn.Tanh())), nn.Linear(256, 4))


X = torch.randn(128, 256, generator=torch.Generator().manual_seed(1))  # 128 KiB activations


def gradients(model: nn.Module, x: torch.Tensor = X) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def offloaded(prefetch: int = 2, max_bytes: int = 1 << 30) -> tuple[nn.Module, FakeStreams, object]:
    model, streams = mlp(), FakeStreams()
    return model, streams, apply_offload(model, streams, prefetch=prefetch, max_bytes=max_bytes)


def test_offloaded_gradients_are_the_plain_ones_bit_for_bit():
    plain = gradients(mlp())
    model, streams, hooks = offloaded()
    got = gradients(model)
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
    # Each tanh's output, which the next linear layer saves too: offloaded once (the minibatch, a
    # leaf, and the transposed weights stay).
    assert hooks.offloaded_bytes == 5 * 128 * 256 * 4
    assert sum(kind == "to_host" for kind, _ in streams.log) == 5


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_copies_go_out_in_order_and_come_back_in_reverse_within_the_prefetch_depth(prefetch):
    model, streams, _ = offloaded(prefetch)
    gradients(model)
    log = streams.log
    out = [position for kind, position in log if kind == "to_host"]
    back = [position for kind, position in log if kind == "to_device"]
    waits = [position for kind, position in log if kind == "wait"]
    assert out == sorted(out) and back == sorted(back, reverse=True) and waits == sorted(waits, reverse=True)
    assert sorted(back) == sorted(waits) == out  # every tensor fetched once, and waited for once
    last_offload = max(i for i, (kind, _) in enumerate(log) if kind == "to_host")
    assert all(i > last_offload for i, (kind, _) in enumerate(log) if kind != "to_host")  # backward after forward
    fetched: set[int] = set()
    for kind, position in log:
        if kind == "to_device":
            fetched.add(position)
        elif kind == "wait":
            assert position in fetched  # fetched before the compute stream waits for it
            ahead = {p for p in fetched if p < position}
            assert len(ahead) <= prefetch  # never more than the prefetch depth in flight ahead
            assert ahead == set(range(max(0, position - prefetch), position))  # and those are the next ones
            fetched.discard(position)


def test_the_pinned_pool_is_reused_across_steps_and_bounded():
    model, streams, hooks = offloaded()
    gradients(model)
    pinned, held = streams.pinned_buffers, hooks.host_bytes
    assert pinned == 5 and held == 5 * 128 * 1024  # 128 KiB buffers, one per tensor saved at once
    for _ in range(2):
        streams.new_step()
        gradients(model)
    assert streams.pinned_buffers == pinned and hooks.host_bytes == held  # no buffer pinned again
    small, streams, hooks = offloaded(max_bytes=2 * 128 * 1024)
    assert all(torch.equal(a, b) for a, b in zip(gradients(mlp()), gradients(small), strict=True))
    # The other three stayed on the device, each saved twice (by its tanh and the next linear layer).
    assert hooks.host_bytes == 2 * 128 * 1024 and hooks.kept_for_room == 6


def test_compressed_codes_are_what_is_offloaded():
    x = torch.randn(512, 256)
    reference = mlp()
    apply_compression(reference, 8, seed=3)
    expected = gradients(reference, x)
    model, streams, hooks = offloaded()
    apply_compression(model, 8, seed=3)  # installed after offloading: its codes go to the host
    got = gradients(model, x)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    # The 8-bit codes of five activations and of the minibatch (the ranges are under 64 KiB: kept).
    assert hooks.offloaded_bytes == 6 * 512 * 256


def test_the_accounting_counts_offloaded_tensors_as_host_bytes():
    plain_model = mlp()
    plain = account_activations(lambda: plain_model(X).square().mean().backward(), plain_model)
    model, _, _ = offloaded()
    trace = account_activations(lambda: model(X).square().mean().backward(), model)
    assert trace.offloaded_bytes == 5 * 128 * 256 * 4
    # On the device at most: the minibatch (a leaf: kept), the tensor backward reads fetched back and
    # the PREFETCH fetched ahead of it, 128 KiB each, against all six kept.
    assert trace.max_saved_bytes == (2 + PREFETCH) * 128 * 256 * 4 < plain.max_saved_bytes


def test_a_cpu_run_is_refused_naming_the_knob():
    cfg = compose("+recipe=wrn_cifar", "data=fake", "trainer.device=cpu", "checkpointing.offload=true")
    with pytest.raises(ConfigError, match="checkpointing.offload=true needs a CUDA device") as refused:
        build_trainer(cfg)
    assert "\n" not in str(refused.value) and "checkpointing.offload=false" in str(refused.value)
    with pytest.raises(ValueError, match="checkpointing.offload"):
        apply_offload(copy.deepcopy(mlp()), device=torch.device("cpu"))


def offloadable_block(stored: int, left: int, flops: int, exposed: int) -> BlockCosts:
    """A block storing ``stored`` bytes, of which ``left`` stay on the device when offloaded, whose
    copies cost ``exposed`` FLOP-equivalents its compute cannot hide."""
    peaks = {(backprop, False): stored + 20 for backprop in ("stored", "all_at_once", "recursively")}
    return BlockCosts(
        input_bytes=10, output_bytes=10, stored_bytes={False: stored}, peak_bytes=peaks, flops=flops,
        forward_flops=flops // 3, rebuild_flops=flops // 3, routes_norm=False,
        offloaded={False: (left, stored + 20, flops + exposed)},
    )  # fmt: skip


def test_the_planner_offloads_where_the_link_hides_the_copies():
    fast = ChainCosts(tuple(offloadable_block(100, 5, 300, 0) for _ in range(4)), (4,), (0,), 0)
    assert str(cheapest_plan(fast, 1000)) == "stored:4"  # room: nothing moves
    tight = cheapest_plan(fast, 140)
    assert str(tight) == "stored/offload:3 stored:1" and tight.flops == 1200  # free copies beat recomputing
    slow = ChainCosts(tuple(offloadable_block(100, 5, 300, 500) for _ in range(4)), (4,), (0,), 0)
    assert "offload" not in str(cheapest_plan(slow, 140))  # recomputing a block (+100) beats +500 of copies
    some = ChainCosts(tuple(offloadable_block(100, 5, 300, 60) for _ in range(4)), (4,), (0,), 0)
    assert cheapest_plan(some, 140).flops == 1200 + 3 * 60  # 60 per block offloaded, below 100 recomputing


def test_accounted_schedules_are_preferred_with_their_transfers_counted():
    """A real accounting counts arithmetic only; an offloaded block's copies cost the time the model
    prices (``exposed_transfer``). A schedule that offloads over a slow link, with fewer FLOPs than
    one that recomputes, must not be preferred for them."""
    slow = ChainCosts(tuple(offloadable_block(100, 5, 300, 500) for _ in range(4)), (4,), (0,), 0)
    offloading = cheapest_plan(slow, 135)  # below what recomputing alone reaches: one block offloaded
    assert str(offloading) == "recursively:2 stored/offload:1 stored:1"
    assert offloading.flops == 1500 + 500  # two blocks' rebuilds, one block's copies
    assert exposed_transfer(slow, offloading.schedules) == 500
    recomputing = cheapest_plan(slow, 140)
    assert "offload" not in str(recomputing) and exposed_transfer(slow, recomputing.schedules) == 0
    # Real accountings where the offloading schedule does less arithmetic: its copies still cost more.
    cheap_but_slow = AccountedSchedule(offloading, 135, 1500, exposed_transfer(slow, offloading.schedules))
    recomputed = AccountedSchedule(recomputing, 140, 1600, 0)
    assert min(cheap_but_slow, recomputed, key=_preference) is recomputed


def test_optimal_checkpointing_offloads_the_blocks_it_chooses_and_stays_exact():
    """On a CPU through the copy stream's test double: with a link that hides every copy the planner
    offloads stored blocks to fit a tight budget instead of recomputing; only those blocks' saves
    go to the host, the accounted activations fit, and the gradients are the plain ones."""
    cfg = compose(*TINY_WRN, "trainer.device=cpu", "precision=fp32")
    plain = build_trainer(cfg)
    batch = plain.example_batch()
    kept = profile_trainer(plain, measure=False).activation_bytes
    budget_mb = kept * 0.5 / 1e6  # recomputing one of WRN-10-1's three blocks fits it
    plain.model.zero_grad()
    plain.microbatch_backward(batch, weight=1.0)
    expected = [p.grad.clone() for p in plain.model.parameters()]

    trainer = build_trainer(cfg)
    streams = FakeStreams()
    hooks = apply_offload(trainer.unwrapped_model, streams, everywhere=False)
    chosen = apply_optimal_checkpointing(trainer, budget_mb, offload=0.0)
    assert "offload" in chosen.description and "all_at_once" not in chosen.description
    assert chosen.activation_bytes <= budget_mb * 1e6
    trainer.model.zero_grad()
    trainer.microbatch_backward(batch, weight=1.0)
    assert all(torch.equal(a, p.grad) for a, p in zip(expected, trainer.model.parameters(), strict=True))
    assert 0 < hooks.offloaded_bytes < kept  # some blocks offloaded, not everything saved
    assert [op for op, _ in streams.log].count("to_host") == [op for op, _ in streams.log].count("to_device")
    # The same budget with a link too slow to hide anything: recomputation instead; below what
    # recomputation reaches, offloading however slow.
    slow = build_trainer(cfg)
    apply_offload(slow.unwrapped_model, FakeStreams(), everywhere=False)
    recomputed = apply_optimal_checkpointing(slow, budget_mb, offload=1e9).description
    assert "offload" not in recomputed and "recursively" in recomputed
    assert "offload" in apply_optimal_checkpointing(slow, budget_mb * 0.8, offload=1e9).description


def test_exposed_transfer_is_what_the_blocks_compute_cannot_hide():
    assert exposed_transfer_flops(1000, 5000, 9000, 2.0) == 0  # 2,000 FLOP-times each way: hidden
    assert exposed_transfer_flops(1000, 500, 9000, 2.0) == 1500  # the copy out outlasts the forward
    assert exposed_transfer_flops(1000, 500, 1000, 2.0) == 1500 + 1000


def test_lowmem_plan_lets_optimal_offload_where_allowed(monkeypatch):
    """``lowmem.plan ... checkpointing.offload=true`` (a CUDA run, stood in for on a CPU by the copy
    stream's test double and a free host link): at a budget only recomputation or offloading meets,
    the chosen configuration offloads instead of recomputing, and says so in its overrides; on a CPU
    the knob is refused in one line."""
    from lowmem.planning import search

    fixed = [*TINY_WRN, "trainer.device=cpu", "sparsity.density=1.0", "precision=fp32", "microbatch.size=null",
             "optim.state_bits=null"]  # fmt: skip
    plain = search.Planner([*fixed, "checkpointing.strategy=optimal"], 10**12)
    roomy = plain.search(1)[0]
    # Two fifths of the activations less: optimal is planned within the room less the step's largest
    # op (a built configuration's check adds it), and half as much less leaves no schedule here.
    budget = roomy.budget_total_bytes - roomy.activation_bytes * 2 // 5
    recomputing = search.Planner([*fixed, "checkpointing.strategy=optimal"], budget).search(1)[0]
    assert "offload" not in recomputing.schedule and not recomputing.offload

    monkeypatch.setattr(search, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(
        search, "install_offload", lambda model, device: apply_offload(model, FakeStreams(), everywhere=False)
    )
    monkeypatch.setattr(search, "link_price", lambda trainer: 0.0)
    planner = search.Planner([*fixed, "checkpointing.offload=true"], budget)
    chosen = planner.search(1)[0]
    assert chosen.strategy == "optimal" and chosen.offload and "offload" in chosen.schedule
    assert chosen.flops < recomputing.flops and chosen.budget_total_bytes <= budget
    assert "checkpointing.offload=true" in planner.overrides(chosen)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="checkpointing.offload=true needs a CUDA device"):
        search.Planner([*fixed, "checkpointing.offload=true"], budget)
