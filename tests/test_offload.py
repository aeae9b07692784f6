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
from lowmem.profiler import account_activations
from lowmem.techniques.compression import apply_compression
from lowmem.techniques.offload import apply_offload
from lowmem.trainer import build_trainer


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
    assert trace.max_saved_bytes < plain.max_saved_bytes - trace.offloaded_bytes // 2


def test_a_cpu_run_is_refused_naming_the_knob():
    cfg = compose("+recipe=wrn_cifar", "data=fake", "trainer.device=cpu", "checkpointing.offload=true")
    with pytest.raises(ConfigError, match="checkpointing.offload=true needs a CUDA device") as refused:
        build_trainer(cfg)
    assert "\n" not in str(refused.value) and "checkpointing.offload=false" in str(refused.value)
    with pytest.raises(ValueError, match="checkpointing.offload"):
        apply_offload(copy.deepcopy(mlp()), device=torch.device("cpu"))
