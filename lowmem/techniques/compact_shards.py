"""Compact sparse values under sharded training (``trainer.parallel=fsdp``): sharded across the
ranks, gathered a unit at a time.

``CompactWeights`` keeps every layer's values in one flat buffer whose size never changes (a
rewiring moves entries between layers, not the total). Sharded, that buffer is a parameter of the
model, ``lowmem_compact_values``: a ``DTensor`` sharded along its one dimension as FSDP2 shards
(rank r holds ``torch.chunk``'s r-th piece), so that the optimizers, checkpoints and the rewiring
treat it as any sharded parameter. lowmem gathers it rather than FSDP2: FSDP2 gathers a parameter
whole for its unit, and the values of one block's layers are a range of the buffer that moves at
every rewiring. Whole, they were held on every rank from the forward to the end of backward, with
their gradient twice (DynamicConv at 4 ranks measured more per rank than one process).

Each unit (a block FSDP2 shards, or the root for the layers outside every block; a weight tied
across units counts as the root's) gets a forward pre-hook that gathers the ranges of the buffer
holding its layers' values (each rank broadcasts the part it holds: exact, and nothing more than
the range) and binds each layer's ``<name>_values`` as a view of them (one ``split``), and a
forward hook that unbinds them, so that they live on only in what autograd saved. Under grad the
gathered range is a leaf parameter (model state: saved-activation compression leaves it exact); when
backward has accumulated its gradient (once per forward: the split joins the layers' gradients),
each part is reduced onto the rank that holds it (one ``reduce`` per part), averaged over the ranks
as FSDP2 averages, added to the flat parameter's sharded gradient and freed. A checkpointed block
gathers again in its recomputation, as FSDP2 does for its own weights. Every microbatch's gradient
is reduced when its backward ends, whatever ``trainer.gradient_sync`` says: holding it unreduced
would hold the values whole.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lowmem.techniques.shards import row_range

if TYPE_CHECKING:
    from lowmem.techniques.compact import CompactWeights


class UnitGathering:
    """The sharded values of ``compact`` (already one parameter ``name`` of ``model``, whole: it
    becomes sharded over ``mesh``) and the hooks that gather them per unit of ``units`` (the blocks
    FSDP2 shards; the rest is the root's, ``model``'s). ``reduce_dtype``: the dtype gradients are
    reduced in (None: their own)."""

    def __init__(
        self,
        compact: CompactWeights,
        model: nn.Module,
        name: str,
        units: Sequence[nn.Module],
        mesh: DeviceMesh,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.compact, self.model, self.name = compact, model, name
        self.mesh, self.group = mesh, mesh.get_group()
        self.world, self.rank = mesh.size(), mesh.get_local_rank()
        self.reduce_dtype = reduce_dtype
        whole = getattr(model, name)
        self.numel = whole.numel()
        start, stop = row_range(self.numel, self.rank, self.world)
        piece = whole.detach()[start:stop].clone()
        model.register_parameter(name, nn.Parameter(self._sharded(piece), requires_grad=whole.requires_grad))
        # Each weight's unit: the block holding every module that uses it, else the root (-1).
        unit_of = {id(module): index for index, unit in enumerate(units) for module in unit.modules()}
        owners = []
        for weight in compact.names:
            found = {unit_of.get(id(module), -1) for module, _ in compact.places(weight)}
            owners.append(found.pop() if len(found) == 1 else -1)
        # Runs of consecutive weights of one unit: [first, stop) in compact.names' order.
        self.runs: dict[int, list[tuple[int, int]]] = {}
        position = 0
        for owner, group in itertools.groupby(owners):
            count = len(list(group))
            self.runs.setdefault(owner, []).append((position, position + count))
            position += count
        self.units = {index: (model if index == -1 else units[index]) for index in self.runs}
        for index, unit in self.units.items():
            unit.register_forward_pre_hook(functools.partial(self._gather, self.runs[index]))
            unit.register_forward_hook(functools.partial(self._release, self.runs[index]))

    @property
    def values(self) -> nn.Parameter:
        """The sharded flat parameter (a ``DTensor``)."""
        return getattr(self.model, self.name)

    def unit_bytes(self) -> dict[nn.Module, int]:
        """Bytes of values each unit gathers at once, at the layers' counts now."""
        size = self.values.dtype.itemsize
        starts = self._starts()
        return {
            self.units[index]: sum(starts[stop] - starts[first] for first, stop in runs) * size
            for index, runs in self.runs.items()
        }

    # --------------------------------------------------------------------------------- hooks
    def _gather(self, runs: list[tuple[int, int]], module: nn.Module, args: object) -> None:
        if self.compact.values is not None:  # inside CompactWeights.gathered(): every value is bound
            return
        flat = self.values
        piece = flat.to_local()
        starts = self._starts()
        grad = torch.is_grad_enabled() and flat.requires_grad
        for first, stop in runs:
            low, high = starts[first], starts[stop]
            gathered = piece.new_empty(high - low)
            for rank, begin, part in self._parts(low, high, gathered):
                if rank == self.rank:
                    offset = begin - row_range(self.numel, rank, self.world)[0]
                    part.copy_(piece[offset : offset + part.numel()])
                if self.world > 1:
                    dist.broadcast(part, src=dist.get_global_rank(self.group, rank), group=self.group)
            gathered = nn.Parameter(gathered, requires_grad=grad)
            if grad:
                gathered.register_post_accumulate_grad_hook(functools.partial(self._reduce, low, high))
            self.compact.bind(gathered, first, stop)

    def _release(self, runs: list[tuple[int, int]], module: nn.Module, args: object, output: object) -> None:
        if self.compact.values is not None:
            return
        for first, stop in runs:
            self.compact.unbind(first, stop)

    @torch.no_grad()
    def _reduce(self, low: int, high: int, gathered: torch.Tensor) -> None:
        grad, gathered.grad = gathered.grad, None
        if grad is None:
            return
        if self.reduce_dtype is not None and grad.dtype != self.reduce_dtype:
            grad = grad.to(self.reduce_dtype)
        flat = self.values
        for rank, begin, part in self._parts(low, high, grad):
            if self.world > 1:
                dist.reduce(part, dst=dist.get_global_rank(self.group, rank), group=self.group)
            if rank == self.rank:
                if flat.grad is None:
                    flat.grad = self._sharded(torch.zeros_like(flat.to_local()))
                offset = begin - row_range(self.numel, rank, self.world)[0]
                mine = flat.grad.to_local()[offset : offset + part.numel()]
                mine.add_((part / self.world).to(mine.dtype))

    # ------------------------------------------------------------------------------- helpers
    def _starts(self) -> list[int]:
        """Where each weight's values start in the flat buffer now, and where the last ends."""
        return [0, *itertools.accumulate(self.compact.counts)]

    def _parts(self, low: int, high: int, tensor: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
        """(rank, first flat index, view of ``tensor``) for each rank holding part of [low, high),
        ``tensor`` being that range."""
        parts = []
        for rank in range(self.world):
            begin, end = row_range(self.numel, rank, self.world)
            begin, end = max(begin, low), min(end, high)
            if begin < end:
                parts.append((rank, begin, tensor[begin - low : end - low]))
        return parts

    def _sharded(self, piece: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            piece, self.mesh, [Shard(0)], run_check=False, shape=torch.Size([self.numel]), stride=(1,)
        )
