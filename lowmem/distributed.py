"""Data parallelism through torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR...).

Without torchrun every function here is a single-process no-op. ``data.batch_size`` is always
the *global* minibatch: each rank trains on its 1/WORLD_SIZE share.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowmem.config import ConfigError
from lowmem.techniques.compact import index_buffer_names


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_rank0() -> bool:
    return rank() == 0


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def restart_count() -> int:
    """How many times torchrun restarted this job's workers (``--max-restarts``): 0 at first."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def agent_store() -> dist.Store | None:
    """The key-value store torchrun's agent serves for the whole job, every restart of it (at
    ``MASTER_ADDR:MASTER_PORT``); None when the workers are not launched with one."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # (Waits in it as long as torch's env:// does, 30 minutes: rank 0 may read a large checkpoint before joining.)
    return dist.TCPStore(address, port, is_master=False, timeout=timedelta(minutes=30))


def init_from_environment(device: torch.device) -> None:
    """Join the process group torchrun describes (NCCL on CUDA, gloo on CPU)."""
    if not launched_by_torchrun() or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = agent_store()
    if store is None:
        dist.init_process_group(backend=backend)
        return
    # The agent's store outlives a restart (--max-restarts), and torch's env:// joins it without a
    # prefix per restart: the restarted ranks would read the addresses the killed ones published and
    # hang, or fail with "connectFullMesh failed ... Connection refused". Each restart gets its own keys.
    store = dist.PrefixStore(f"lowmem/restart_{generation(store)}", store)
    dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]), world_size=launched_ranks())


def leave() -> None:
    """The end of a run under torchrun: every rank waits for the others, then leaves the process
    group (its gloo or NCCL threads stopped in order). Left to the interpreter's exit, a rank whose
    peer had exited first could abort in the group's destructor ("terminate called without an active
    exception", SIGABRT), and torchrun then reported a failed job whose training had ended."""
    if launched_by_torchrun() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def abandon() -> None:
    """The end of a command under torchrun, whatever ended it: a process group still there (a run
    that stopped with an error, a refusal, a signal) is torn down without waiting for the other
    ranks, which may have stopped elsewhere or not at all (``leave`` tore down a finished run's).
    Left to the interpreter's exit, the group's destructor could abort the process (SIGABRT,
    "terminate called without an active exception") instead of exiting with the status the error
    chose: seen once in about six runs of a refused resume's rank 1."""
    if launched_by_torchrun() and dist.is_initialized():
        dist.destroy_process_group()


def generation(store: dist.Store) -> int:
    """Which start of the job's workers this is (0 first), the same on every rank. One node: its
    torchrun's restart count. Several: each node's torchrun counts only the restarts its own ranks
    failed into (another node's restart re-forms this one's ranks without counting), so each rank
    counts its own joins in the job's store instead: every rank joins once per start."""
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) <= 1:
        return restart_count()
    return int(store.add(f"lowmem/joins/rank_{os.environ['RANK']}", 1)) - 1


RUN_DIRECTORY_KEY = "lowmem/run_dir"


def record_run_directory(run_dir: Path) -> None:
    """Rank 0 writes ``run_dir`` into torchrun's job-wide store: a restarted rank 0 continues
    there (``first_run_directory``) rather than in a directory named by its own start time."""
    store = agent_store() if int(os.environ.get("RANK", "0")) == 0 else None
    if store is not None:
        store.set(RUN_DIRECTORY_KEY, str(Path(run_dir).absolute()))


def first_run_directory() -> str | None:
    """After a restart by torchrun: the directory the job's rank 0 ran in before, or None when it
    did not get that far. Raises ``ConfigError`` when torchrun keeps no job-wide store."""
    store = agent_store()
    if store is None:
        raise ConfigError(
            f"torchrun restarted this job (restart {restart_count()}) without a store kept across restarts "
            "(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or a rendezvous backend other than c10d): the directory its "
            "first start ran in is unknown; give torchrun's command a hydra.run.dir=... to continue there"
        )
    if not store.check([RUN_DIRECTORY_KEY]):
        return None
    return store.get(RUN_DIRECTORY_KEY).decode()


def local_device(device: torch.device) -> torch.device:
    """On CUDA each rank uses the GPU of its LOCAL_RANK."""
    if device.type == "cuda" and launched_by_torchrun():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def launched_ranks() -> int:
    """The number of ranks torchrun launched (``WORLD_SIZE``; 1 without it), known before the
    process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_batch_divisible(batch_size: int) -> None:
    n = launched_ranks()
    if batch_size % n != 0:
        raise ConfigError(
            f"data.batch_size={batch_size} is the global minibatch and must be divisible by the "
            f"number of ranks ({n})"
        )


def any_rank(flag: bool, device: torch.device) -> bool:
    """True if ``flag`` is true on any rank (e.g. an FP16 overflow: all ranks skip together)."""
    if world_size() == 1:
        return bool(flag)
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def most_over_ranks(value: int, device: torch.device) -> int:
    """The largest ``value`` of any rank (e.g. microbatches in a step: sharded ranks must agree)."""
    if world_size() == 1:
        return value
    most = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def wrap_model(model: nn.Module, device: torch.device, sync_batchnorm: bool = False) -> nn.Module:
    if world_size() == 1:
        return model
    if sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    device_ids = [device.index] if device.type == "cuda" else None
    return _data_parallel(model, device_ids)


def rewrap_model(model: nn.Module) -> nn.Module:
    """A new DistributedDataParallel around ``model``'s module, for parameters that changed size
    (compact sparse weights after a rewiring); ``model`` itself when not wrapped."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return model
    return _data_parallel(model.module, model.device_ids)


def _data_parallel(model: nn.Module, device_ids: list[int] | None) -> nn.Module:
    # Compact sparse weights' positions are not broadcast: every rank derives the same ones from
    # the seeded masks (checked after each rewiring), and int16 is a type gloo and NCCL do not carry.
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, index_buffer_names(model))
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def check_identical(value: int, what: str, device: torch.device) -> None:
    """Fail loudly if ``value`` (e.g. a checksum of the sparsity masks) differs between ranks."""
    if world_size() == 1:
        return
    low = torch.tensor([value], dtype=torch.int64, device=device)
    high = low.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if int(low) != int(high):
        raise RuntimeError(f"{what} differ between data-parallel ranks (checksums {int(low)} .. {int(high)})")


def barrier() -> None:
    """Wait for every rank (nothing in one process)."""
    if world_size() > 1:
        dist.barrier()


def rank0s(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a picklable object; ``value`` itself in one process)."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order (picklable objects; ``[value]`` in one process)."""
    if world_size() == 1:
        return [value]
    values: list[Any] = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def first_failure(message: str | None) -> str | None:
    """The first rank's failure ``message`` (None: this rank did not fail), or None when no rank
    failed: what every rank raises, so that none goes on alone to wait for the others forever (a
    collective: call it on every rank)."""
    return next((m for m in gather_objects(message) if m is not None), None)
