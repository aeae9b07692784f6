"""Compact sparse weights under sharded training (``trainer.parallel=fsdp``): values and positions
sharded across the ranks, gathered a unit at a time.

``CompactWeights`` keeps every layer's values in one flat buffer, and their int16 columns in
another, whose sizes never change (a rewiring moves entries between layers, not the total).
Sharded, they are the model's parameter ``lowmem_compact_values`` and buffer
``lowmem_compact_columns``: ``DTensor``s sharded along their one dimension as FSDP2 shards (rank r
holds ``torch.chunk``'s r-th piece), so that the optimizers, checkpoints and the rewiring treat them
as any sharded tensor. lowmem gathers them rather than FSDP2: FSDP2 gathers a parameter whole for
its unit, and the values of one block's layers are a range of the buffer that moves at every
rewiring. Whole, they were held on every rank from the forward to the end of backward, with their
gradient twice (DynamicConv at 4 ranks measured more per rank than one process); the columns, as
many bytes as FP16 values, were held whole on every rank.

Where they are gathered:

- a weight whose every place is inside one block that FSDP2 shards is gathered with the block's
  other compact weights (one range of each buffer) in the block's forward, and again in its
  recomputation, as FSDP2 does for its own weights;
- any other weight (an embedding, an output projection, a weight tied across blocks) is gathered
  by each module holding it, for that module's forward, and bound there only. An embedding keeps
  nothing of it for backward: a lookup's backward needs the positions only, which it gathers again
  (``compact.COLUMNS_AGAIN``).

A gather is exact: each rank broadcasts the part of the range it holds (int16 columns travel as
FP16 bits, which gloo carries), and the layers' ``<name>_values`` and ``<name>_columns`` are bound
as views of the gathered range (one ``split``), unbound when the forward ends, so that they live
on only in what autograd saved. Under grad the gathered values are the output of ``GatheredValues``
(not a leaf: autograd holds nothing of them but what the layers saved) whose backward gets their
gradient once per forward (the split joins the layers' gradients) and reduces each part onto the
rank that holds it (one ``reduce`` per part), averaged over the ranks as FSDP2 averages, into the
flat parameter's sharded gradient. Every microbatch's gradient is reduced when its backward ends,
whatever ``trainer.gradient_sync`` says: holding it unreduced would hold the values whole.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from lowmem.techniques.compact import COLUMNS_AGAIN, SHARED_COLUMNS, SHARED_VALUES
from lowmem.techniques.shards import row_range

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from lowmem.techniques.compact import CompactWeights

Runs = list[tuple[int, int]]  # [first, stop) ranges of CompactWeights.names gathered together
_AROUND = "_lowmem_compact_gathered_around"  # a block's attribute (in its __dict__): see gathered_for


def gathered_for(block: nn.Module) -> contextlib.AbstractContextManager[list[tuple[torch.Tensor, Callable]]]:
    """Around a call of ``block``'s forward that bypasses its hooks (a recomputation that calls the
    forward itself, as FSDP2's ``unshard`` is called there), its compact weights gathered and bound;
    nothing for a block without them. It gives a list of (gathered values, reduce) made under grad:
    a caller that takes gradients with ``torch.autograd.grad`` (which runs no node past the inputs
    it names) names those values among its inputs and calls ``reduce`` with each one's gradient."""
    around = block.__dict__.get(_AROUND)
    return around() if around is not None else contextlib.nullcontext([])


class GatheredValues(torch.autograd.Function):
    """``gather()``'s gathered values as a tensor whose gradient, when backward has joined it, goes to
    ``reduce`` (``anchor``: any tensor that requires grad, so that autograd records this node)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, gather: Callable[[], torch.Tensor], reduce: Callable) -> torch.Tensor:
        ctx.reduce = reduce
        return gather()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.reduce(grad)
        return None, None, None


def is_gathered_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is (a view of) compact values gathered for a unit: model state."""
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(base.grad_fn, GatheredValues._backward_cls)


class UnitGathering:
    """The sharded values and columns of ``compact`` (already ``model``'s ``SHARED_VALUES`` and
    ``SHARED_COLUMNS``, whole: they become sharded over ``mesh``) and the hooks that gather them per
    unit (``units``: the blocks FSDP2 shards; the rest per module holding them). ``reduce_dtype``:
    the dtype gradients are reduced in (None: their own)."""

    def __init__(
        self,
        compact: CompactWeights,
        model: nn.Module,
        units: Sequence[nn.Module],
        mesh: DeviceMesh,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.compact, self.model = compact, model
        self.mesh, self.group = mesh, mesh.get_group()
        self.world, self.rank = mesh.size(), mesh.get_local_rank()
        self.reduce_dtype = reduce_dtype
        values, columns = getattr(model, SHARED_VALUES), getattr(model, SHARED_COLUMNS)
        self.numel = values.numel()
        start, stop = self.local_range()
        piece = values.detach()[start:stop].clone()
        model.register_parameter(SHARED_VALUES, nn.Parameter(self._sharded(piece), requires_grad=values.requires_grad))
        model.register_buffer(SHARED_COLUMNS, self._sharded(columns[start:stop].clone()))
        self._anchor = torch.empty(0, device=piece.device, requires_grad=True)
        # Each weight's unit: the block holding every module that uses it (None: no one block).
        unit_of = {id(module): index for index, unit in enumerate(units) for module in unit.modules()}
        owners: list[int | None] = []
        for weight in compact.names:
            found = {unit_of.get(id(module)) for module, _ in compact.places(weight)}
            owners.append(found.pop() if len(found) == 1 else None)
        # Runs of consecutive weights of one block ([first, stop) in compact.names' order), then the
        # runs each other module gathers for its own forward.
        self.units: list[tuple[nn.Module, Runs, nn.Module | None]] = []  # (module, runs, bound at)
        block_runs: dict[int, Runs] = {}
        position = 0
        for owner, group in itertools.groupby(owners):
            count = len(list(group))
            if owner is not None:
                block_runs.setdefault(owner, []).append((position, position + count))
            position += count
        self.units += [(units[index], runs, None) for index, runs in block_runs.items()]
        holders: dict[nn.Module, list[int]] = {}
        for index, (weight, owner) in enumerate(zip(compact.names, owners, strict=True)):
            if owner is None:
                for module, _ in compact.places(weight):
                    holders.setdefault(module, []).append(index)
                    if isinstance(module, nn.Embedding):  # a lookup's backward gathers its positions again
                        module.__dict__[COLUMNS_AGAIN] = functools.partial(self._columns_again, index)
        self.units += [(module, [(i, i + 1) for i in indices], module) for module, indices in holders.items()]
        for module, runs, at in self.units:
            module.register_forward_pre_hook(functools.partial(self._gather, runs, at))
            module.register_forward_hook(functools.partial(self._release, runs, at))
            module.__dict__[_AROUND] = functools.partial(self._around, runs, at, module)

    @property
    def values(self) -> nn.Parameter:
        """The sharded flat values parameter (a ``DTensor``)."""
        return getattr(self.model, SHARED_VALUES)

    @property
    def columns(self) -> DTensor:
        """The sharded flat columns buffer (a ``DTensor``)."""
        return getattr(self.model, SHARED_COLUMNS)

    def local_range(self) -> tuple[int, int]:
        """The entries [start, stop) of the flat buffers this rank holds."""
        return row_range(self.numel, self.rank, self.world)

    def unit_bytes(self) -> dict[nn.Module, int]:
        """Bytes of values and columns each block gathers at once, at the layers' counts now; the
        modules outside the blocks count together as the root's (``model``), whose forward holds
        them, a module at a time."""
        size = self.values.dtype.itemsize + self.columns.dtype.itemsize
        starts = self._starts()
        out: dict[nn.Module, int] = {}
        for module, runs, at in self.units:
            key = module if at is None else self.model
            out[key] = out.get(key, 0) + sum(starts[stop] - starts[first] for first, stop in runs) * size
        return out

    # --------------------------------------------------------------------------------- hooks
    def _gather(
        self, runs: Runs, at: nn.Module | None, module: nn.Module, args: object, made: list | None = None
    ) -> None:
        if self.compact.values is not None:  # inside CompactWeights.gathered(): every value is bound
            return
        starts = self._starts()
        grad = torch.is_grad_enabled() and self.values.requires_grad
        for first, stop in runs:
            low, high = starts[first], starts[stop]
            gather = functools.partial(self._gather_range, self.values.to_local(), low, high)
            if grad:
                reduce = functools.partial(self._reduce, low, high)
                values = GatheredValues.apply(self._anchor, gather, reduce)
                if made is not None:
                    made.append((values, reduce))
            else:
                values = gather()
            self.compact.bind(values, self._gather_columns(low, high), first, stop, at)

    def _release(self, runs: Runs, at: nn.Module | None, module: nn.Module, args: object, output: object) -> None:
        if self.compact.values is not None:
            return
        for first, stop in runs:
            self.compact.unbind(first, stop, at)

    @contextlib.contextmanager
    def _around(self, runs: Runs, at: nn.Module | None, module: nn.Module) -> Iterator[list]:
        made: list[tuple[torch.Tensor, Callable]] = []
        self._gather(runs, at, module, (), made)
        try:
            yield made
        finally:
            self._release(runs, at, module, (), None)

    def _columns_again(self, index: int) -> torch.Tensor:
        """Weight ``compact.names[index]``'s columns, gathered (for a backward: a collective)."""
        starts = self._starts()
        return self._gather_columns(starts[index], starts[index + 1])

    @torch.no_grad()
    def _reduce(self, low: int, high: int, grad: torch.Tensor) -> None:
        if self.reduce_dtype is not None and grad.dtype != self.reduce_dtype:
            grad = grad.to(self.reduce_dtype)
        grad = grad.contiguous()
        flat = self.values
        for rank, begin, part in self._parts(low, high, grad):
            if self.world > 1:
                dist.reduce(part, dst=dist.get_global_rank(self.group, rank), group=self.group)
            if rank == self.rank:
                if flat.grad is None:
                    flat.grad = self._sharded(torch.zeros_like(flat.to_local()))
                offset = begin - self.local_range()[0]
                mine = flat.grad.to_local()[offset : offset + part.numel()]
                mine.add_((part / self.world).to(mine.dtype))

    # ------------------------------------------------------------------------------- helpers
    @torch.no_grad()
    def _gather_range(self, piece: torch.Tensor, low: int, high: int) -> torch.Tensor:
        """Entries [low, high) of the flat tensor whose local piece is ``piece``, on every rank."""
        gathered = piece.new_empty(high - low)
        for rank, begin, part in self._parts(low, high, gathered):
            if rank == self.rank:
                offset = begin - self.local_range()[0]
                part.copy_(piece[offset : offset + part.numel()])
            if self.world > 1:
                dist.broadcast(part, src=dist.get_global_rank(self.group, rank), group=self.group)
        return gathered

    def _gather_columns(self, low: int, high: int) -> torch.Tensor:
        bits = self.columns.to_local().view(torch.float16)  # gloo does not carry int16
        return self._gather_range(bits, low, high).view(torch.int16)

    def _starts(self) -> list[int]:
        """Where each weight's entries start in the flat buffers now, and where the last ends."""
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
        from torch.distributed.tensor import DTensor, Shard  # imported by FSDP2 before any unit is made

        return DTensor.from_local(
            piece, self.mesh, [Shard(0)], run_check=False, shape=torch.Size([self.numel]), stride=(1,)
        )
