"""The C kernels split a large call across ``torch.get_num_threads()`` threads (more than
``cpu.PARALLEL_ELEMENTS`` elements); what they compute does not depend on how many.

``make test`` runs its workers on one thread each (tests/conftest.py), where no call is split: this
file sets the thread counts itself, so the split paths are tested whatever the workers have."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from lowmem.kernels import cpu, reference
from lowmem.techniques import checkpointing, compression

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler: the torch ops are used")

SIZES = (700_000, 500_000, 3)  # over PARALLEL_ELEMENTS in all: the update runs on several threads
THREADS = (1, 2, 3)


def at_threads(threads: int, compute: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return compute()
    finally:
        torch.set_num_threads(before)


def bits(tensors: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    for tensor in tensors:
        yield tensor.view(torch.int16) if tensor.element_size() == 2 else tensor


def assert_same_at_every_thread_count(compute: Callable[[], list[torch.Tensor]]) -> None:
    one, *others = (at_threads(threads, compute) for threads in THREADS)
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(bits(one), bits(other), strict=True))


def test_large_updates_are_split_and_their_bits_do_not_depend_on_it():
    assert len(at_threads(2, lambda: cpu._shards(SIZES))) == 2
    assert len(at_threads(1, lambda: cpu._shards(SIZES))) == 1
    generator = torch.Generator().manual_seed(0)
    start = [(0.1 * torch.randn(size, generator=generator)).bfloat16() for size in SIZES]
    grads = [(0.01 * torch.randn(size, generator=generator)).bfloat16() for size in SIZES]
    keys = reference.tensor_keys(5, 1, len(SIZES))  # stochastic rounding: a key per tensor

    def update() -> list[torch.Tensor]:
        weights, momenta = [w.clone() for w in start], [torch.ones_like(w) for w in start]
        cpu.sgd(weights, grads, momenta, keys, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4,
                grad_scale=3.0)  # fmt: skip
        adam_weights = [w.clone() for w in start]
        exp_avgs, exp_avg_sqs = [torch.zeros_like(w) for w in start], [torch.zeros_like(w) for w in start]
        scales = [(torch.tensor(0.0), torch.tensor(0.0)) for _ in start]
        step_sizes = [reference.adam_step_size(1e-3, 0.9, 0.999, 1)] * len(start)
        cpu.adam(adam_weights, grads, exp_avgs, exp_avg_sqs, scales, step_sizes, keys, beta1=0.9, beta2=0.999,
                 eps=1e-8, decay=None, grad_scale=3.0)  # fmt: skip
        return [*weights, *momenta, *adam_weights, *exp_avgs, *exp_avg_sqs, *(s for pair in scales for s in pair)]

    assert_same_at_every_thread_count(update)


def test_large_activations_are_split_and_their_bits_do_not_depend_on_it():
    generator = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(8, 16, 96, 96, generator=generator)).bfloat16()  # 1.2M elements
    norm = torch.nn.BatchNorm2d(16)
    norm.weight.data.normal_(generator=generator)
    _, mean, invstd = torch.ops.aten.native_batch_norm(x, norm.weight, norm.bias, None, None, True, 0.0, 1e-5)
    groups = x.numel() // compression.GROUP
    assert len(at_threads(2, lambda: cpu._group_shards(groups))) == 2
    assert len(at_threads(2, lambda: cpu._group_shards(x.shape[0], x[0].numel()))) == 2

    def compute() -> list[torch.Tensor]:
        with torch.no_grad():
            relu = checkpointing._norm_relu_from_statistics(norm, x, mean, invstd)
        codes, lows, steps = torch.ops.lowmem.quantize_activation(x, 4, 7)
        restored = torch.ops.lowmem.dequantize_activation(codes, lows, steps, 4, list(x.shape), x.dtype)
        return [relu, codes, lows, steps, restored]

    assert_same_at_every_thread_count(compute)
