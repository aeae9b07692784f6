"""The files of a run directory (SPEC §2), written atomically.

Every write goes to a temporary file in the same directory and is renamed into place
(``os.replace`` is atomic on POSIX), so a crash leaves either the old file or the new one —
never a half-written checkpoint or result. A write the disk refuses (full, a file size limit, a
quota, read-only, no permission) raises ``WriteFailed``: one line naming the file, the file as it
was left in place.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from lowmem.kernels.cpu import write_atomically
from lowmem.run.refusals import RunRefused

CONFIG = ".hydra/config.yaml"
METRICS = "metrics.jsonl"
RESULT = "result.json"
MODEL = "model.pt"
CHECKPOINT = "checkpoint.pt"

_UMASK = os.umask(0)
os.umask(_UMASK)


# What the disk or the file system refuses, which the user acts on (frees space, raises the limit,
# makes the directory writable); other OSErrors are bugs or stranger faults and keep their traceback.
DISK_ERRORS = {  # errno -> what to do about it
    errno.ENOSPC: "free some space",
    errno.EDQUOT: "free some space, or raise the quota",
    errno.EFBIG: "raise the file size limit, ulimit -f",
    errno.EROFS: "the file system is mounted read-only",
    errno.EACCES: "make the directory writable",
    errno.EPERM: "make the directory writable",
}


class WriteFailed(RunRefused):
    """A run file the disk refused to write; ``path`` as it was is left in place (atomic writes)."""

    def __init__(self, path: str | os.PathLike, error: OSError) -> None:
        self.path = Path(path)
        advice = DISK_ERRORS.get(error.errno)
        super().__init__(f"cannot write {self.path}: {error.strerror}" + (f" ({advice})" if advice else ""))


def disk_error(error: BaseException) -> OSError | None:
    """The ``DISK_ERRORS`` OSError that caused ``error``, following its chain (torch.save reports a
    failed write as a RuntimeError raised while handling the OSError), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in DISK_ERRORS:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # mkstemp makes 0600 files: a run's files get the usual permissions.
        write_atomically(path, write, mode=0o666 & ~_UMASK)
    except BaseException as error:
        cause = disk_error(error)
        if cause is not None:
            raise WriteFailed(path, cause) from error
        raise


def save_torch(obj: Any, path: str | os.PathLike) -> None:
    _atomic_write(Path(path), lambda handle: torch.save(obj, handle))


def save_bytes(data: bytes, path: str | os.PathLike) -> None:
    _atomic_write(Path(path), lambda handle: handle.write(data))


def copy_file(source: str | os.PathLike, path: str | os.PathLike) -> None:
    """Copy ``source`` to ``path`` atomically."""
    def copy(handle: IO[bytes]) -> None:
        with open(source, "rb") as original:
            shutil.copyfileobj(original, handle)

    _atomic_write(Path(path), copy)


def save_json(obj: Any, path: str | os.PathLike) -> None:
    data = (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode()
    _atomic_write(Path(path), lambda handle: handle.write(data))


def append_jsonl(record: dict, path: str | os.PathLike) -> None:
    """Append one JSON line. A line is written with one ``write`` call and flushed to disk."""
    line = json.dumps(record, sort_keys=True, default=str) + "\n"
    try:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        if error.errno in DISK_ERRORS:
            raise WriteFailed(path, error) from error
        raise


def set_aside_metrics(run_dir: str | os.PathLike) -> Path | None:
    """Rename ``run_dir``'s ``metrics.jsonl``, unless missing or empty, to ``metrics.jsonl.<n>`` (the
    first ``n`` from 1 not taken) and return the new path: for a run that starts afresh in a directory
    where a run stopped before its first checkpoint (killed: there is nothing to resume), whose
    steps the new run would otherwise follow in the same file, each of its steps then appearing twice."""
    path = Path(run_dir) / METRICS
    if not path.is_file() or path.stat().st_size == 0:
        return None
    number = 1
    while path.with_name(f"{METRICS}.{number}").exists():
        number += 1
    aside = path.with_name(f"{METRICS}.{number}")
    os.rename(path, aside)  # the run directory's lock keeps every other run out
    return aside


def read_checkpoint(path: str | os.PathLike, refusal: str) -> dict[str, Any]:
    """``path`` (a ``checkpoint.pt``) loaded on the CPU, weights only; a file that cannot be read
    (truncated, corrupt, not a lowmem checkpoint) raises ``RunRefused``: ``refusal``, which names
    the knob, followed by the file and why."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises RuntimeError, UnpicklingError, EOFError, ... by cause
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        # (torch's advice to load with weights_only=False would run code from the file: never here.)
        if "weights_only" in str(error):
            reason = "it holds objects a lowmem checkpoint never contains: not a checkpoint lowmem wrote"
        else:
            reason = f"{text[:160]}: the file is truncated or corrupt"
        raise RunRefused(f"{refusal}: {path} cannot be read ({reason})") from error
    if not isinstance(checkpoint, dict) or not {"model", "trainer", "config"} <= set(checkpoint):
        raise RunRefused(f"{refusal}: {path} is not a lowmem checkpoint (no model, trainer and config entries)")
    return checkpoint


def kept_checkpoint(run_dir: str | os.PathLike) -> str | None:
    """"the checkpoint of step N, <run_dir>/checkpoint.pt" when it can be read and the shards
    directory it names (a sharded checkpoint's) is complete, else None: what a run that could not
    write a file leaves to resume."""
    path = Path(run_dir) / CHECKPOINT
    try:  # mmap: a whole checkpoint's tensors are not read
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        step = int(checkpoint["trainer"]["step"])
        shards = checkpoint.get("shards")
    except Exception:
        return None
    if shards and not (Path(run_dir) / shards / ".metadata").is_file():
        return None
    return f"the checkpoint of step {step}, {path}"


def git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def cpu_description() -> str:
    """The CPU: its model name, torch's capability level on it and its AVX-512 / AMX flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    flags = sorted({flag for flag in info.split() if flag.startswith(("avx512", "amx"))})
    return (
        f"{names[0] if names else platform.processor() or 'CPU'} (capability "
        f"{torch.backends.cpu.get_cpu_capability()}; {' '.join(flags) or 'no AVX-512'}), {os.cpu_count()} cores"
    )


def measured_on(device: torch.device | str | None = None) -> str:
    """One line saying when, with which torch and on which device a benchmark measured, printed
    first by every benchmark: the header its figures are quoted with. ``device``: the one measured
    (default: CUDA when present, else the CPU); the CPU is named either way."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    gpu = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}) with " if device.type == "cuda" else ""
    revision = (git_revision() or "unknown")[:7]
    return (
        f"measured {time.strftime('%Y-%m-%d %H:%M %Z')} on {gpu}{cpu_description()}, "
        f"{torch.get_num_threads()} torch threads; torch {torch.__version__}, git {revision}"
    )


def provenance(device: torch.device) -> dict[str, Any]:
    """Where a result came from: code revision, device, library versions."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "git_revision": git_revision(),
        "device": str(device),
        "device_name": name,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host_threads": torch.get_num_threads(),
    }
