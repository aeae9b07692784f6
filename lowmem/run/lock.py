"""One process per run directory: ``hydra.run.dir`` is locked before Hydra writes anything there.

Two runs writing one directory would interleave ``metrics.jsonl`` and overwrite each other's
result and checkpoint. The ``LockRunDirectory`` callback (registered in ``conf/config.yaml``)
takes the lock when the run starts, before Hydra writes ``.hydra/`` and the log; a second process
is refused in one line naming ``hydra.run.dir`` and the owner's pid, touching nothing.

The lock is an advisory ``flock`` on ``<run dir>/.lowmem.lock``, which also holds the owner's pid
and host. The kernel releases a flock when its process ends, however it ends (``kill -9``
included), so a lock whose owner is gone is simply taken over. The owner removes the file when it
exits normally. Under torchrun only rank 0 locks (the other ranks write nothing there).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from lowmem.run.refusals import RunRefused, exit_refused

LOCK_FILE = ".lowmem.lock"
_held: dict[Path, int] = {}  # resolved run directory -> the open, flocked lock file
_created: set[Path] = set()  # run directories this process created


def created_by_this_process(run_dir: Path) -> bool:
    return Path(run_dir).resolve() in _created


def holds_only_startup_files(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds nothing but what a run writes before it starts: Hydra's record,
    the job's log and the lock."""
    for path in Path(run_dir).iterdir():
        if path.name in (".hydra", LOCK_FILE) or path.suffix == ".log":
            continue
        return False
    return True


def _owner(fd: int) -> str:
    """Who holds the lock, as the owner wrote it (it writes right after locking: wait a little)."""
    for _ in range(20):
        text = os.pread(fd, 200, 0).decode(errors="replace").split()
        if text:
            pid, host = (text + ["?"])[:2]
            return f"process {pid} on {host}"
        time.sleep(0.05)
    return "another process"


def acquire(run_dir: Path, knob: str = "hydra.run.dir") -> None:
    """Create ``run_dir`` if needed and lock it for this process (no-op if already held).

    Raises ``RunRefused`` naming ``knob`` when the directory cannot be created or written, or is
    locked by a live process."""
    run_dir = Path(run_dir).absolute()
    existed = run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = error.strerror or error
        raise RunRefused(f"{knob}={run_dir} cannot be created: {reason}; choose another {knob}") from None
    key = run_dir.resolve()
    if not existed:
        _created.add(key)
    if key in _held:
        return
    path = run_dir / LOCK_FILE
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            reason = error.strerror or error
            raise RunRefused(f"{knob}={run_dir} is not writable: {reason}; choose another {knob}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _owner(fd)
            os.close(fd)
            raise RunRefused(
                f"{knob}={run_dir} is in use by {owner} (lock {path}); wait for that run to end, "
                f"or choose another {knob}"
            ) from None
        # The previous owner may have removed the file between our open and flock: lock the file
        # that is in place, not a removed one.
        try:
            in_place = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            in_place = False
        if in_place:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    _held[key] = fd


def release_all() -> None:
    """Remove and unlock this process's lock files (at exit)."""
    for key, fd in list(_held.items()):
        try:
            path = key / LOCK_FILE
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                path.unlink()
        except OSError:
            pass
        os.close(fd)
        del _held[key]


atexit.register(release_all)


def _rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


class LockRunDirectory(Callback):
    """Lock the run directory before Hydra writes there (single runs), or each job's directory
    when it starts (sweeps); refuse in one line when another process holds it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if _rank0():
            try:
                acquire(Path(config.hydra.run.dir))
            except RunRefused as error:
                exit_refused(str(error))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if _rank0() and config.hydra.mode == RunMode.MULTIRUN:
            try:
                acquire(Path(config.hydra.runtime.output_dir), "hydra.sweep.dir")
            except RunRefused as error:
                exit_refused(str(error))
