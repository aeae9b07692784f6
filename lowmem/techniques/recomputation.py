"""What every checkpointed block shares, on residual stacks (``checkpointing``) and on any model's
chains of blocks (``chains``) alike: the ``Segment``s a schedule is made of, and the state a
recomputation replays or isolates.

A recomputation must compute what the forward computed: it replays the RNG state (the same
dropout masks) and the autocast state, and sends BatchNorm running-statistic updates to scratch
copies, so that the statistics are updated exactly once per forward (SPEC §6). It differentiates
against a new leaf sharing its input's storage, and a recomputed tensor held for a later step of a
backward stays visible to saved-tensor hooks as a saved tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

BACKPROPS = ("stored", "all_at_once", "recursively")  # how a Segment's activations reach backward


@dataclass(frozen=True)
class Segment:
    """Consecutive residual blocks of one stack, and how backward gets their activations.

    blocks: how many consecutive blocks (>= 1).
    backprop: ``stored``: autograd keeps their activations (as ``none``/``no_bn``); ``all_at_once``:
        only the segment's input is kept and backward recomputes the segment's graph (as
        ``residual``); ``recursively``: only the input is kept, backward recomputes the block
        inputs, then one block's graph at a time (as ``residual_star``).
    recompute_norm: the blocks' BN-ReLU outputs are recomputed in backward, never kept (as
        ``no_bn``); needs blocks that route their triples through ``lowmem.residual.norm_relu_conv``.
    bits: a stored segment's saved activations are stored compressed at this width (8, 4, 2;
        ``lowmem.techniques.compression``, whose hooks must be installed on the model); None: as
        the hooks' own width says (none installed: as they are).
    offload: a stored segment's saved activations are offloaded to host memory
        (``lowmem.techniques.offload``, whose hooks must be installed on the model without offloading
        everything: ``apply_offload(..., everywhere=False)``); False: as the hooks say.
    """

    blocks: int
    backprop: str = "stored"
    recompute_norm: bool = False
    bits: int | None = None
    offload: bool = False

    def __str__(self) -> str:
        compressed = f"/{self.bits}bit" if self.bits is not None else ""
        offloaded = "/offload" if self.offload else ""
        return f"{self.backprop}{'/no_bn' if self.recompute_norm else ''}{compressed}{offloaded}:{self.blocks}"


# --- state replayed or isolated during recomputation -------------------------------------------


_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def scratch_running_stats(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Send BatchNorm running-statistic updates made inside the block to throwaway copies.

    The buffers are swapped rather than copied back afterwards: autograd may have saved the
    scratch tensors, and restoring in place would bump their version counters. They are swapped in
    the module's buffer table itself (what ``setattr`` of a registered buffer does, without its
    checks: every checkpointed segment's backward swaps a dozen buffers)."""
    swapped = []
    for module in modules:
        if isinstance(module, _BatchNorm) and module.training and module.track_running_stats:
            table = module._buffers
            originals = {name: table[name] for name in _RUNNING_STATS if table.get(name) is not None}
            for name, buffer in originals.items():
                table[name] = buffer.clone()
            swapped.append((table, originals))
    try:
        yield
    finally:
        for table, originals in swapped:
            table.update(originals)


@dataclass(frozen=True)
class _AutocastState:
    """The autocast setting in force for ``device_type``, to recompute under the same one."""

    device_type: str
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def capture(cls, device: torch.device) -> _AutocastState:
        return cls(device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))

    def restore(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


class _RngState:
    """The CPU generator state and, for a CUDA tensor, its device's generator state.

    Inside a CUDA graph capture (``lowmem.techniques.replay``) the CUDA state is the capture's:
    torch >= 2.10 reads and sets a generator's state inside a capture as long as the seed stays,
    which moves the capture's Philox offset (pytorch/pytorch#162505). So a captured recomputation
    rewinds to the offset its forward drew from, every replay redraws the forward's dropout masks,
    and replays advance the generator like eager steps. That is not taken on trust from torch's
    version: the replaying runner checks each new capture's first replay against an eager run
    (gradients included, which a recomputation with other masks changes) and keeps the shape eager
    if they differ; a torch that refuses inside a capture fails the capture, and the run goes on
    eagerly.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda_devices = [device] if device.type == "cuda" else []
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Run the block from the captured state, leaving the caller's generators untouched."""
        with torch.random.fork_rng(devices=self.cuda_devices, device_type="cuda"):
            torch.set_rng_state(self.cpu)
            for device, state in zip(self.cuda_devices, self.cuda, strict=True):
                torch.cuda.set_rng_state(state, device)
            yield


def _recomputation_input(
    tensor: torch.Tensor, requires_grad: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A new leaf sharing ``tensor``'s storage, to differentiate the recomputation against, and the
    alias of it to feed the recomputation with.

    The alias is a non-leaf because module hooks that watch their inputs' gradients (the module
    tracker of FlopCounterMode) fail on a leaf inside ``torch.autograd.grad``.
    """
    leaf = tensor.detach().requires_grad_(tensor.requires_grad if requires_grad is None else requires_grad)
    with torch.enable_grad():  # backward runs with grad mode off
        return leaf, (leaf.view_as(leaf) if leaf.requires_grad else leaf)


class _Hold(torch.autograd.Function):
    """Identity that saves its input: a recomputed tensor held for a later step of a backward
    becomes a saved tensor, visible to saved-tensor hooks (profilers, offloading) like the others."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _hold(leaf: torch.Tensor) -> torch.Tensor | None:
    """A token keeping ``leaf`` registered as saved until the token is dropped."""
    if not leaf.requires_grad:
        return None
    with torch.enable_grad():
        return _Hold.apply(leaf)
