"""The local piece of a sharded tensor, for techniques that compute per element.

Under sharded training (``trainer.parallel=fsdp``, PyTorch FSDP2) a parameter, its gradient and
the optimizer state created like it are ``DTensor``s sharded along dimension 0: each rank holds
the rows ``torch.chunk`` gives it (the last ranks may hold fewer, or none). lowmem's optimizers,
loss scaler and sparse rewiring work on these local pieces as plain tensors (in place: a local
piece shares its ``DTensor``'s storage), and gather a whole tensor only where a decision needs
every entry (a rewiring's global threshold). Without sharding each function is the identity.

Nothing here imports ``torch.distributed.tensor`` or ``torch.distributed.fsdp`` (together 0.6 s of
every process's start): no ``DTensor`` or FSDP2 module can exist before its package is imported, so
``is_sharded`` and ``is_fsdp_module`` look for the class among the imported modules.
"""

from __future__ import annotations

import sys

import torch


def is_sharded(tensor: object) -> bool:
    """Whether ``tensor`` is a ``DTensor``."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def is_fsdp_module(module: object) -> bool:
    """Whether ``module`` is sharded by FSDP2 (``fully_shard``)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor`` (a view of the same storage), or ``tensor`` itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """Every entry of ``tensor`` on every rank (a collective for a sharded tensor: call it on every
    rank), as a plain tensor; ``tensor`` itself when it is not sharded. int16 (compact positions),
    which gloo does not carry, travels as FP16 bits."""
    if not is_sharded(tensor):
        return tensor
    if tensor.dtype == torch.int16:
        from torch.distributed.tensor import DTensor

        piece = tensor.to_local().view(torch.float16)
        bits = DTensor.from_local(
            piece, tensor.device_mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride(), run_check=False
        )
        return bits.full_tensor().view(torch.int16)
    return tensor.full_tensor()


def row_range(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a tensor of ``rows`` rows that ``rank`` holds when it is sharded
    along dimension 0 over ``world_size`` ranks (``torch.chunk``'s split, as FSDP2's)."""
    size = -(-rows // world_size) if rows else 0
    start = min(rank * size, rows)
    return start, min(start + size, rows)


def local_rows(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The rows of ``whole`` (a plain tensor with every row) that this rank holds of ``like``
    (sharded along dimension 0 as FSDP2 shards): ``whole`` itself when ``like`` is not sharded."""
    if not is_sharded(like):
        return whole
    mesh = like.device_mesh
    start, stop = row_range(whole.shape[0], mesh.get_local_rank(), mesh.size())
    piece = whole[start:stop]
    if piece.shape != like.to_local().shape:
        raise RuntimeError(f"a sharded tensor of local shape {tuple(like.to_local().shape)} is not rows {start}:{stop}")
    return piece


@torch.no_grad()
def write_full(tensor: torch.Tensor, whole: torch.Tensor) -> None:
    """Set ``tensor`` (sharded or not) to ``whole`` (every entry, the same on every rank): each rank
    copies in the rows it holds."""
    local(tensor).copy_(local_rows(whole, tensor))


def gather_like(piece: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Every rank's ``piece`` (this rank's rows of a tensor sharded as ``like``, e.g. quantized state
    read back) joined into the whole tensor, on every rank (a collective); ``piece`` when ``like`` is
    not sharded."""
    if not is_sharded(like):
        return piece
    from torch.distributed.tensor import DTensor

    shape = (like.shape[0], *piece.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(piece, like.device_mesh, like.placements, shape=shape, stride=stride).full_tensor()


def moved_entries(whole: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """A new tensor whose entry i is ``whole[source[i]]``, or zero where ``source[i]`` is -1."""
    kept = source >= 0
    moved = whole.new_zeros(source.shape)
    moved[kept] = whole[source[kept]]
    return moved
