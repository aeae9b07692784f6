"""Sharded data parallelism (``trainer.parallel=fsdp``): PyTorch FSDP2's ``fully_shard`` over a model
that lowmem's techniques have already transformed.

Each rank holds 1/N of every weight, gradient and optimizer state tensor (FSDP2 shards each along
dimension 0); a block's weights are gathered whole for its forward and its backward only. What is
sharded, and in what order (the order of ``shard_model``):

1. weights in another dtype than the rest (pure FP16/BF16 keeps normalization layers in FP32, and
   FSDP2 gathers one dtype per unit) stay whole on every rank, their gradients averaged after
   backward (a few KB: BatchNorm's scales and shifts);
2. the blocks checkpointing runs (a model's residual blocks, or the chains of blocks found in any
   model / named by ``checkpointing.blocks``): one unit each. Checkpointing is applied before, as
   torchtitan does: a checkpointed block recomputed in backward is gathered again by FSDP2's own
   hooks, and its gradients reduce-scattered from them (``lowmem.techniques.checkpointing``);
3. the root, holding the rest: the stem and the head.

Compact sparse weights are not FSDP2's: the values of all layers are one flat parameter and their
int16 columns one flat buffer (``CompactWeights.share_values``), whose sizes never change, sharded
by lowmem as FSDP2 shards; each block gathers its layers' range of both for its forward, and a
layer outside the blocks for its own module's forward (``lowmem.techniques.compact_shards``):
FSDP2 would gather them whole, for the root. A rewiring (which moves entries between layers, so
between units) gathers every value and column, takes the one-process decisions from the same
seeded generator on every rank, and each rank keeps its rows of the new layout. The row starts (8
bytes per 2^15 dense entries) are not sharded: every rank holds them, identical.

Gradients: FSDP2 reduce-scatters (averages) them across ranks; the trainer weights each rank's loss
as for DDP, so the result is the global minibatch's mean. The optimizers update each rank's local
rows (``lowmem.techniques.shards``). A run in one process with ``fsdp`` is a shard of 1 (a process
group of one rank): what resumes a sharded checkpoint on one rank.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowmem import distributed
from lowmem.profiler.peak import PeakMeasurement
from lowmem.profiler.real_passes import named_first_line
from lowmem.profiler.report import MemoryReport
from lowmem.profiler.state import COMPACT_COLUMN_BYTES, _state_entry_bytes, csr_index_bytes
from lowmem.residual import residual_stacks
from lowmem.techniques.chains import find_block_chains, installed_runners
from lowmem.techniques.compact import (
    SHARED_COLUMNS,
    SHARED_VALUES,
    CompactWeights,
    compact_modules,
    compact_state_dict_keys,
    dense_weight,
)
from lowmem.techniques.compact_shards import UnitGathering
from lowmem.techniques.precision import NORMALIZATION_TYPES
from lowmem.techniques.shards import full, is_fsdp_module, local, local_rows, row_range, write_full
from lowmem.techniques.shards import is_sharded as is_sharded_tensor
from lowmem.techniques.sparsity import DynamicSparsity

log = logging.getLogger("lowmem")
REDUCE_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def join_single_process_group(device: torch.device) -> None:
    """A process group of one rank, for ``fsdp`` without torchrun (FSDP2 needs a group)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def sharded_blocks(model: nn.Module, names: Sequence[str] = ()) -> list[nn.Module]:
    """The blocks that become FSDP2 units: the model's residual blocks, the chains checkpointing
    installed, or those found (or named by ``checkpointing.blocks``); none if nothing is found."""
    stacks = residual_stacks(model)
    if stacks and not names:
        return [block for stack in stacks for block in stack.residual_blocks]
    runners = installed_runners(model)
    if runners:
        return [block for runner in runners for block in runner.blocks]
    try:
        return [block for chain in find_block_chains(model, names) for block in chain.blocks]
    except ValueError:
        return []


def shard_model(
    model: nn.Module,
    device: torch.device,
    *,
    param_dtype: torch.dtype,
    autocast_dtype: torch.dtype | None = None,
    blocks: Sequence[str] = (),
    reshard_after_forward: bool = True,
    reduce_dtype: str | None = None,
    sparsity: DynamicSparsity | None = None,
) -> nn.Module:
    """``fully_shard`` ``model`` (in place; it is returned) over every rank of the default process
    group, in the order of the module docstring. ``param_dtype``: the dtype of the weights outside
    the normalization layers; ``autocast_dtype``: ``precision=amp``'s (None otherwise);
    ``reduce_dtype``: ``precision.reduce_dtype``.

    ``precision=amp`` is FSDP2's own mixed precision over FP32 shards: each unit's weights are
    gathered in ``autocast_dtype`` (what autocast would cast them to for every convolution and
    matrix product, so those compute on the same bits as one process under autocast), and their
    gradients reduce-scattered in FP32 unless ``reduce_dtype`` says otherwise (in the gathered
    16 bits, the mean of N ranks' gradients would be rounded to 16 bits, which one process's FP32
    gradients are not). Normalization layers keep their FP32 weights, as under autocast."""
    # FSDP2 is imported where it is used: 0.6 s of every process's start otherwise (lowmem.techniques.shards).
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    join_single_process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    reduce = REDUCE_DTYPES.get(reduce_dtype) if reduce_dtype else None
    units = sharded_blocks(model, blocks)
    compact = sparsity.compact if sparsity is not None else None
    if compact is not None:  # sharded and gathered per unit by lowmem, not FSDP2 (compact_shards)
        compact.share_values(model)
        compact.gathering = UnitGathering(compact, model, units, mesh, reduce)
    if autocast_dtype is not None:
        policy = MixedPrecisionPolicy(param_dtype=autocast_dtype, reduce_dtype=reduce or torch.float32)
    else:
        policy = MixedPrecisionPolicy(reduce_dtype=reduce)
    # 1. Weights in another dtype than the rest (pure FP16/BF16 keeps normalization layers in FP32,
    #    and FSDP2 gathers one dtype per unit) are not sharded: every rank holds them (a few KB), and
    #    their gradients are averaged across ranks after backward (``average_replicated_gradients``).
    #    Units of their own would not do: checkpointing's no_bn recomputation reads a BatchNorm's
    #    weights without calling the module, past FSDP2's hooks. Under amp, the normalization
    #    layers' FP32 weights, which FSDP2 would otherwise gather in the autocast dtype.
    replicated = replicated_parameters(model, param_dtype, autocast_dtype)
    ignored = {*replicated, *([getattr(model, SHARED_VALUES)] if compact is not None else [])}
    options = {"mesh": mesh, "mp_policy": policy, "ignored_params": ignored}
    object.__setattr__(model, _REPLICATED, replicated)
    # 2. The blocks, each its own unit; 3. the root (FSDP2 keeps its weights gathered from forward
    #    to backward, which begins with them).
    for block in units:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, **options)
    log.info(
        "fsdp: %d ranks, %d blocks sharded, then the root (%d tensors of another dtype replicated)%s",
        dist.get_world_size(),
        len(units),
        len(replicated),
        "; compact sparse values sharded, gathered per unit" if compact is not None else "",
    )
    return model


def replicated_parameters(
    model: nn.Module, param_dtype: torch.dtype, autocast_dtype: torch.dtype | None
) -> list[nn.Parameter]:
    """The parameters ``shard_model`` leaves whole on every rank (its step 1): those in another dtype
    than ``param_dtype``; under amp (``autocast_dtype``), the normalization layers'."""
    if autocast_dtype is not None:
        return [p for m in model.modules() if isinstance(m, NORMALIZATION_TYPES) for p in m.parameters(recurse=False)]
    return [p for p in model.parameters() if p.dtype != param_dtype]


_REPLICATED = "_lowmem_replicated"  # model attribute: the parameters FSDP2 leaves whole on every rank


@torch.no_grad()
def average_replicated_gradients(model: nn.Module) -> None:
    """Average the gradients of the parameters left unsharded (``shard_model``) across the ranks,
    as FSDP2's reduce-scatter averages the others: one all-reduce."""
    grads = [p.grad for p in getattr(model, _REPLICATED, []) if p.grad is not None]
    if not grads or dist.get_world_size() == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def is_sharded(model: nn.Module) -> bool:
    return is_fsdp_module(model)


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Whether the next backward reduce-scatters the gradients (``trainer.gradient_sync=minibatch``
    turns it off for all but a minibatch's last microbatch)."""
    model.set_requires_gradient_sync(sync)


@torch.no_grad()
def full_state_dict(model: nn.Module, sparsity: DynamicSparsity | None) -> dict[str, torch.Tensor]:
    """The model's plain state dict, whole, with the model's own keys (compact weights dense, as one
    process's ``dense_state_dict``), as CPU tensors: a collective, to call on every rank."""
    compact = sparsity.compact if sparsity is not None else None
    with compact.gathered() if compact is not None else contextlib.nullcontext():
        state = {}
        dense = {
            (f"{prefix}.{attr}" if prefix else attr): dense_weight(module, attr)
            for prefix, module, attr in compact_modules(model)
        }
        with compact_state_dict_keys():
            items = model.state_dict().items()
        for key, value in items:
            if key in (SHARED_VALUES, SHARED_COLUMNS):
                continue
            weight = key.removesuffix("_row_starts")
            if weight in dense:  # a compact weight, dense, in place of its positions
                state[weight] = dense[weight].detach().cpu()
                continue
            state[key] = full(value).detach().to("cpu", copy=True)
    return state


# --- sharded checkpoints (torch.distributed.checkpoint) ------------------------------------------

SHARDS_PREFIX = "checkpoint.shards."  # + the step: the directory of a checkpoint's sharded tensors


def shards_directory(run_dir: Path, step: int) -> Path:
    return run_dir / f"{SHARDS_PREFIX}{step:09d}"


class DamagedShards(RuntimeError):
    """A sharded checkpoint's directory that cannot be loaded (a file missing, truncated or another
    run's); the message names the directory and, when known, the file. Raised on every rank."""


def save_shards(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Write the model's and the optimizer's state to the directory ``path`` with
    ``torch.distributed.checkpoint``: each rank writes its own rows of every sharded tensor (nothing
    is gathered), tensors every rank holds alike once. A collective: call it on every rank. A
    checkpoint written by N ranks loads on any number (``load_shards``).

    A write that fails on any rank (the disk full, a file size limit) raises on every rank an
    OSError naming the file, ``path`` removed if this call created it (the directory a previous
    checkpoint names is another: a checkpoint's step names it)."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    created = not distributed.rank0s(path.exists())  # rank 0's look, before any rank creates it
    state = {"model": _model_state(model), "optimizer": _optimizer_state(optimizer)}
    try:
        dcp.save(state, storage_writer=_writer(path))
    except CheckpointException as error:  # raised on every rank, each rank's failure in it
        if created and dist.get_rank() == 0:  # every rank is past its writes: dcp gathered them
            shutil.rmtree(path, ignore_errors=True)
        failures = [error.failures[rank][0] for rank in sorted(error.failures)]
        written = next((f for f in failures if isinstance(f, OSError) and f.errno is not None), None)
        if written is not None:
            raise OSError(written.errno, written.strerror, written.filename or str(path)) from error
        raise RuntimeError(f"{path} could not be written: {named_first_line(failures[0], 200)}") from error


def _writer(path: Path) -> Any:
    """dcp's file system writer for ``path``, whose failed writes raise an OSError naming the file:
    torch.save reports the disk's error (EFBIG, ENOSPC) as a RuntimeError raised while handling it,
    and dcp hands each rank's exception to the others pickled, which drops that chain."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem

    class FilesNamedOnFailure(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: str | Path, mode: str) -> Any:
            try:
                with super().create_stream(path, mode) as stream:
                    yield stream
            except Exception as error:
                cause: BaseException | None = error
                while cause is not None and not (isinstance(cause, OSError) and cause.errno is not None):
                    cause = cause.__cause__ or cause.__context__
                if cause is None:
                    raise
                raise OSError(cause.errno, cause.strerror, str(path)) from error

    writer = dcp.FileSystemWriter(str(path))
    writer.fs = FilesNamedOnFailure()
    return writer


def check_shards(path: Path) -> Any:
    """The metadata of the sharded checkpoint ``path`` once its files are checked against it, before
    anything is loaded; raises ``DamagedShards`` naming the file when the directory or its
    ``.metadata`` is missing or unreadable, a file it lists is missing, or a file's size is not the
    one it records (truncated, or another checkpoint's file)."""
    import torch.distributed.checkpoint as dcp

    damaged = f"the sharded checkpoint {path} cannot be loaded"
    if not path.is_dir():
        raise DamagedShards(f"{damaged}: the directory is missing")
    listing = path / ".metadata"
    if not listing.is_file():  # torch.distributed.checkpoint writes it last, once every file is written
        raise DamagedShards(f"{damaged}: {listing} is missing (the writing did not finish, or it was removed)")
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        ends: dict[str, int] = {}
        for stored in metadata.storage_data.values():
            ends[stored.relative_path] = max(ends.get(stored.relative_path, 0), stored.offset + stored.length)
    except Exception as error:
        reason = f"{named_first_line(error, 200)}: truncated or corrupt"
        raise DamagedShards(f"{damaged}: {listing} cannot be read ({reason})") from error
    for name, end in sorted(ends.items()):
        file = path / name
        if not file.is_file():
            raise DamagedShards(f"{damaged}: {file} is missing (the .metadata lists {len(ends)} files)")
        size = file.stat().st_size
        if size != end:
            what = "truncated" if size < end else "not the file this checkpoint wrote"
            raise DamagedShards(f"{damaged}: {file} holds {size} bytes, the .metadata records {end}: {what}")
    return metadata


def _checked_on_every_rank(path: Path) -> Any:
    """``check_shards(path)`` on every rank, which all raise the first rank's ``DamagedShards`` if
    any rank's check failed (a rank that went on alone would wait for the others forever)."""
    metadata, problem = None, None
    try:
        metadata = check_shards(path)
    except DamagedShards as error:
        problem = str(error)
    found = distributed.first_failure(problem)
    if found is not None:
        raise DamagedShards(found)
    return metadata


def _load(state: dict[str, Any], path: Path) -> None:
    """``dcp.load``, its failure (raised on every rank: a tensor of another shape or key, a file that
    does not read) as ``DamagedShards`` naming ``path`` and the first rank's error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as error:
        first = error.failures[min(error.failures)][0]
        raise DamagedShards(
            f"the sharded checkpoint {path} does not load into this run ({named_first_line(first, 200)}): "
            "another run's, or damaged"
        ) from error


def load_shards(
    model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, compact: CompactWeights | None = None
) -> None:
    """Load ``save_shards``'s directory ``path`` into the sharded ``model`` and ``optimizer`` in place,
    each rank reading its rows (of any number of ranks' checkpoint). Optimizer state kept per rank
    (8/4-bit codes and scales, FP16 Adam's moment scales) saved by another number of ranks: each rank
    reads that of the saved pieces its rows overlap, and ``optimizer.reshard_state`` takes it over
    exactly (codes and scales as saved). ``compact``: the model's compact weights, whose positions a
    checkpoint of before they were sharded holds per layer, whole."""
    state = {"model": _model_state(model), "optimizer": _optimizer_state(optimizer)}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    metadata = _checked_on_every_rank(path)
    overlapping = _saved_pieces(state["optimizer"]["state"], params, metadata)
    columns = None
    if f"model.{SHARED_COLUMNS}" not in metadata.state_dict_metadata and SHARED_COLUMNS in state["model"]:
        columns = state["model"].pop(SHARED_COLUMNS)
    _load(state, path)
    if columns is not None and compact is not None:  # each layer's columns, whole (git 6a8c9e4 and before)
        sizes = {name: metadata.state_dict_metadata[f"model.{name}_columns"].size for name in compact.names}
        layers = {"model": {f"{name}_columns": torch.empty(size, dtype=torch.int16) for name, size in sizes.items()}}
        _load(layers, path)
        whole = compact.join_columns({name: layers["model"][f"{name}_columns"] for name in compact.names})
        write_full(columns, whole.to(local(columns).device))
    for index, (start, pieces) in overlapping.items():
        entries = state["optimizer"]["state"][str(index)]
        pieces_state = [
            (begin, end, {key: entries.pop(f"{key}{_PER_RANK}{r}") for key in keys}) for r, begin, end, keys in pieces
        ]
        optimizer.reshard_state(params[index], start, pieces_state)
    saved = state["optimizer"]
    for group, loaded in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        group.update({key: value for key, value in loaded.items() if key != "params"})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        for key, value in saved["state"].get(str(index), {}).items():
            if not isinstance(value, torch.Tensor):  # step counts: loaded values replace them
                optimizer.state[param][key] = value
    optimizer.rounding_step = int(saved.get("rounding_step", 0))


def _saved_pieces(
    state: dict[str, dict[str, Any]], params: list[torch.Tensor], metadata: Any
) -> dict[int, tuple[int, list[tuple[int, int, int, list[str]]]]]:
    """The per-rank optimizer state in ``metadata`` (a sharded checkpoint's, of any number of ranks):
    for each parameter index, the value where this rank's piece starts and, per saved rank whose
    piece overlaps it, (rank, its first value, its end, its per-rank keys). ``state``
    (``_optimizer_state``'s, loaded into) gets those ranks' tensors in place of this rank's. On as
    many ranks as saved too: the saved layout (e.g. segments of an earlier resume) may not be the
    one this run starts with."""
    saved_ranks: dict[int, dict[int, list[str]]] = {}  # index -> rank -> keys
    for name in metadata.state_dict_metadata:
        if name.startswith("optimizer.state.") and _PER_RANK in name:
            index, key = name.removeprefix("optimizer.state.").split(".", 1)
            key, rank = key.rsplit(_PER_RANK, 1)
            saved_ranks.setdefault(int(index), {}).setdefault(int(rank), []).append(key)
    world = 1 + max((r for ranks in saved_ranks.values() for r in ranks), default=0)
    overlapping = {}
    for index, ranks in saved_ranks.items():
        param, entries = params[index], state[str(index)]
        for key in [key for key in entries if _PER_RANK in key]:
            del entries[key]
        rows = param.shape[0] if param.dim() else 1
        per_row = param.numel() // max(rows, 1)
        spans = {r: row_range(rows, r, world) for r in ranks} if is_sharded_tensor(param) else {0: (0, rows)}
        mine = row_range(rows, dist.get_rank(), dist.get_world_size())
        start, stop = mine if is_sharded_tensor(param) else (0, rows)
        pieces = []
        for r, (first, last) in spans.items():
            if first < stop and start < last:
                for key in ranks[r]:
                    meta = metadata.state_dict_metadata[f"optimizer.state.{index}.{key}{_PER_RANK}{r}"]
                    entries[f"{key}{_PER_RANK}{r}"] = torch.empty(meta.size, dtype=meta.properties.dtype)
                pieces.append((r, first * per_row, last * per_row, ranks[r]))
        overlapping[index] = (start * per_row, pieces)
    return overlapping


_PER_RANK = "@rank"  # key suffix of optimizer state each rank keeps for its own rows only


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    with compact_state_dict_keys():  # compact values and positions as they are
        return model.state_dict()


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` (its tensors the live ones) with plain tensors, which only this rank
    holds as they are, under per-rank keys; sharded tensors keep theirs."""
    state = optimizer.state_dict()
    rank = dist.get_rank()
    state["state"] = {
        str(index): {
            (
                key if is_sharded_tensor(value) or not isinstance(value, torch.Tensor) else f"{key}{_PER_RANK}{rank}"
            ): value
            for key, value in entries.items()
        }
        for index, entries in state["state"].items()
    }
    return state


def whole(state: Any) -> Any:
    """``state`` (a state dict, nested) with every sharded tensor gathered whole, as a CPU tensor (a
    collective: call it on every rank, with states of the same structure). Other tensors that
    differ between ranks (8/4-bit optimizer state: codes and scales per local piece; FP16 Adam's
    per-piece moment scales) become ``{"per_rank": [one per rank]}``: such a checkpoint resumes on
    the same number of ranks only (a sharded checkpoint, ``load_shards``, on any number)."""
    if isinstance(state, dict):
        return {key: whole(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(whole(value) for value in state)
    if is_sharded_tensor(state):
        return full(state).detach().to("cpu", copy=True)
    if isinstance(state, torch.Tensor) and dist.get_world_size() > 1:
        pieces: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, state.detach().cpu())
        if all(piece.shape == pieces[0].shape and torch.equal(piece, pieces[0]) for piece in pieces):
            return pieces[0]
        return {PER_RANK: pieces}
    return state


PER_RANK = "per_rank"


def _restore(live: torch.Tensor, saved: Any, name: str) -> None:
    """Copy ``saved`` (whole, or one per rank) into ``live`` (sharded or not): this rank's part."""
    if isinstance(saved, dict) and PER_RANK in saved:
        pieces = saved[PER_RANK]
        if len(pieces) != dist.get_world_size():
            raise RuntimeError(
                f"{name} was saved per rank by {len(pieces)} ranks (8/4-bit optimizer state, or FP16 Adam's "
                f"moment scales); it resumes on {len(pieces)} ranks only, not {dist.get_world_size()}"
            )
        saved = pieces[dist.get_rank()]
        if saved.shape != live.shape:
            raise RuntimeError(f"{name}: saved {tuple(saved.shape)}, this run holds {tuple(live.shape)}")
        live.copy_(saved)
        return
    if tuple(saved.shape) != tuple(live.shape):
        raise RuntimeError(f"{name}: saved {tuple(saved.shape)}, this run has {tuple(live.shape)}")
    write_full(live, saved.to(device=live.device, dtype=live.dtype))


@torch.no_grad()
def load_whole_model_state(model: nn.Module, state: dict[str, Any], compact: CompactWeights | None = None) -> None:
    """Load a state dict of ``whole`` tensors into the sharded ``model``: each rank keeps its rows.
    ``compact``: the model's compact weights, whose positions a state dict of one process (or of
    before they were sharded) holds per layer. Raises KeyError naming keys the model and the state
    do not share."""
    with compact_state_dict_keys():
        live = model.state_dict()
    if compact is not None and SHARED_COLUMNS in live and SHARED_COLUMNS not in state:
        state = dict(state)
        layers = {name: state[name + "_columns"] for name in compact.names if name + "_columns" in state}
        if len(layers) == len(compact.names):
            state[SHARED_COLUMNS] = compact.join_columns(layers)
            for name in compact.names:
                for key in compact.column_keys(name):
                    state.pop(key, None)
    if live.keys() != state.keys():
        missing, unexpected = sorted(live.keys() - state.keys()), sorted(state.keys() - live.keys())
        raise KeyError(f"model state: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for key, tensor in live.items():
        _restore(tensor, state[key], key)


@torch.no_grad()
def load_whole_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an optimizer state dict of ``whole`` tensors (``whole(optimizer.state_dict())``) into an
    optimizer over sharded parameters: hyperparameters as saved, each state tensor's rows in place."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_groups = state["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise KeyError("optimizer state: its parameter groups differ from this run's")
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        group.update({key: value for key, value in saved.items() if key != "params"})
    ids = [i for group in saved_groups for i in group["params"]]
    for index, param in zip(ids, params, strict=True):
        for key, value in state["state"].get(index, {}).items():
            live = optimizer.state[param].get(key)
            if isinstance(live, torch.Tensor):
                _restore(live, value, f"optimizer state {key} of parameter {index}")
            else:
                optimizer.state[param][key] = value
    if "rounding_step" in state:
        optimizer.rounding_step = int(state["rounding_step"])


# --- BatchNorm running statistics: those of one process ----------------------------------------


class RunningStatistics:
    """Makes every rank's BatchNorm running statistics, after each step, those one process would
    have after the same minibatch, whose examples it runs in rank order.

    One update with momentum m is r <- (1 - m) r + m s, so after the n updates of rank k starting
    from r0 a rank holds R_k = (1 - m)^n_k r0 + D_k, and one process running the ranks' updates in
    order ends at (1 - m)^N r0 + sum_k (1 - m)^(updates after rank k's) D_k: one all-reduce of
    the scaled D_k. Updates are counted by ``num_batches_tracked``, so recomputation (which restores
    the statistics) and simulated microbatching (one update per group) count right. BatchNorm with
    ``momentum=None`` (a cumulative average) keeps per-rank statistics.
    """

    def __init__(self, model: nn.Module) -> None:
        self.norms = [
            m
            for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.momentum is not None
        ]
        self.start: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def before_step(self) -> None:
        self.start = [(m.running_mean.clone(), m.running_var.clone(), int(m.num_batches_tracked)) for m in self.norms]

    @torch.no_grad()
    def after_step(self) -> None:
        if not self.norms or dist.get_world_size() == 1:
            return
        counts = torch.tensor(
            [int(m.num_batches_tracked) - n for m, (_, _, n) in zip(self.norms, self.start, strict=True)]
        )
        every = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
        dist.all_gather(every, counts)
        rank = dist.get_rank()
        after = sum(every[rank + 1 :], torch.zeros_like(counts)).tolist()
        total = sum(every, torch.zeros_like(counts)).tolist()
        pieces = []
        for m, (mean, var, _), n, later in zip(self.norms, self.start, counts.tolist(), after, strict=True):
            keep = 1.0 - m.momentum
            for live, first in ((m.running_mean, mean), (m.running_var, var)):
                pieces.append((live.double() - keep**n * first.double()) * keep**later)
        combined = torch.cat(pieces)
        dist.all_reduce(combined)
        offset = 0
        for m, (mean, var, first_count), n in zip(self.norms, self.start, total, strict=True):
            keep = 1.0 - m.momentum
            for live, first in ((m.running_mean, mean), (m.running_var, var)):
                part = combined[offset : offset + live.numel()].view_as(live)
                live.copy_(part + keep**n * first.double())
                offset += live.numel()
            m.num_batches_tracked.fill_(first_count + n)
        self.start = []


# --- what each rank holds: the profiler's per-rank figures ---------------------------------------


def account_shards(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sparsity: DynamicSparsity | None,
    gathered_dtype: torch.dtype | None = None,
) -> dict[str, int]:
    """This rank's model, optimizer (gradients + state) and state bytes by the report's definition,
    for its local rows of every sharded tensor (compact positions as CSR index bytes, its share of
    them), and ``gathered_bytes``: the weights FSDP2 gathers whole at once at most, the
    root's (held from forward through backward) plus the largest other unit's, in the dtype they are
    gathered in (``gathered_dtype``: ``precision=amp``'s autocast dtype; None: their own). The
    weights every rank holds whole (``replicated_parameters``) are not gathered."""
    model_bytes = optimizer_bytes = state_bytes = 0
    # Masked sparse weights count their active entries in this rank's rows, as CSR (the report's
    # definition, as in one process); every rank holds the masks whole, as the compact positions.
    masks = sparsity.masks if sparsity is not None and sparsity.compact is None else {}
    for name, param in model.named_parameters():
        piece = local(param)
        entries = piece.numel()
        if name in masks:
            rows = local_rows(masks[name], param)
            entries = int(rows.sum())
            model_bytes += csr_index_bytes(rows.shape, entries) if rows.numel() else 0
        model_bytes += entries * piece.element_size()
        if param.requires_grad:
            held = _state_entry_bytes(optimizer, param, entries, None, None)
            optimizer_bytes += entries * piece.element_size() + held
            state_bytes += held
    compact = sparsity.compact if sparsity is not None else None
    gathering = compact.gathering if compact is not None else None
    if compact is not None:
        # Compact positions as CSR index bytes, each weight's share in this rank's piece of the
        # sharded columns (their rows of the flat buffer; every rank holds the row starts whole).
        low, high = (0, compact.capacity) if gathering is None else gathering.local_range()
        start = 0
        for shape, count in sparsity.trained_parameters().values():
            mine = max(0, min(start + count, high) - max(start, low))
            model_bytes += csr_index_bytes(shape, count) * mine // max(count, 1)
            start += count
    units = [module for module in model.modules() if is_fsdp_module(module)]
    replicated = {id(p) for p in getattr(model, _REPLICATED, [])}
    owned = {id(p) for unit in units if unit is not model for p in unit.parameters()}
    # Compact values and columns: each unit's range, gathered by lowmem (values in their own dtype:
    # autocast casts them per op, as in one process), not by FSDP2.
    values = {} if gathering is None else gathering.unit_bytes()
    if gathering is not None:
        replicated.add(id(gathering.values))
    sizes = [
        values.get(unit, 0)
        + sum(
            p.numel() * (gathered_dtype or p.dtype).itemsize
            for p in unit.parameters()
            if id(p) not in replicated and (unit is not model or id(p) not in owned)
        )
        for unit in units
    ]
    root = sizes[units.index(model)] if model in units else 0
    others = [size for unit, size in zip(units, sizes, strict=True) if unit is not model]
    return {
        "model_bytes": model_bytes,
        "optimizer_bytes": optimizer_bytes,
        "optimizer_state_bytes": state_bytes,
        "gathered_bytes": root + max(others, default=0),
    }


def planned_gathered_bytes(
    model: nn.Module,
    sparse: dict | None = None,
    *,
    param_dtype: torch.dtype,
    autocast_dtype: torch.dtype | None = None,
) -> int:
    """What ``account_shards`` calls ``gathered_bytes`` for ``model`` not sharded yet (the planner's
    what-if): the weights outside the blocks ``shard_model`` would make units plus the largest
    block's, in the dtype FSDP2 gathers them in (``autocast_dtype`` under amp; compact sparse values,
    gathered per unit by lowmem with their columns, in their own), less those every rank holds
    whole; ``sparse``: name -> (dense shape, active count) of the sparse weights (their active
    entries now: a rewiring moves entries between units); ``param_dtype``, ``autocast_dtype``: as
    for ``shard_model``."""
    sparse = sparse or {}
    blocks = sharded_blocks(model)
    block_of = {id(p): index for index, block in enumerate(blocks) for p in block.parameters()}
    replicated = {id(p) for p in replicated_parameters(model, param_dtype, autocast_dtype)}
    root, per_block = 0, [0] * len(blocks)
    for name, param in model.named_parameters():
        if id(param) in replicated:
            continue
        if name in sparse:  # compact values and their int16 columns
            size = sparse[name][1] * (param.dtype.itemsize + COMPACT_COLUMN_BYTES)
        else:
            size = param.numel() * (autocast_dtype or param.dtype).itemsize
        if id(param) not in block_of:
            root += size
        else:
            per_block[block_of[id(param)]] += size
    return root + max(per_block, default=0)


def per_rank_report(
    unsharded: MemoryReport, shards: dict[str, int], peak: PeakMeasurement | None, gradient_sync: str
) -> MemoryReport:
    """One rank's report: ``unsharded``'s activations and FLOPs (this rank's share of the minibatch,
    accounted before sharding), with the model and optimizer bytes of its shards, the gathered
    weights (``gathered_bytes``; their gradients before the reduce-scatter take as much again, and
    with ``trainer.gradient_sync=minibatch`` every gradient is held whole) in the budget figure, and
    ``peak``, measured on the sharded step."""
    state = shards["model_bytes"] + shards["optimizer_bytes"]
    activations = unsharded.total_bytes - unsharded.model_bytes - unsharded.optimizer_bytes
    held = unsharded.total_with_graph_pool_bytes - unsharded.model_bytes - unsharded.optimizer_bytes
    gathered = shards["gathered_bytes"]
    gradients = unsharded.model_bytes if gradient_sync == "minibatch" else gathered
    return replace(
        unsharded,
        model_bytes=shards["model_bytes"],
        optimizer_bytes=shards["optimizer_bytes"],
        optimizer_state_bytes=shards["optimizer_state_bytes"],
        total_bytes=state + activations,
        total_with_graph_pool_bytes=state + held,
        budget_total_bytes=state + held + unsharded.step_temporary_bytes + gathered + gradients,
        gathered_bytes=gathered,
        peak_bytes=None if peak is None else peak.peak_bytes,
        peak_breakdown={} if peak is None else peak.breakdown,
        peak_location="" if peak is None else peak.location,
        peak_source="" if peak is None else peak.source,
    )
