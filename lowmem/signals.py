"""SIGINT (Ctrl-C) and SIGTERM (how a scheduler preempts a job) during training.

The first signal only asks the training loop to stop: it finishes the step it is in, writes a
checkpoint at that step and raises ``Interrupted``; the command line then prints where the
checkpoint is and how to resume, and exits with 128 + the signal's number (130 / 143). A second
signal exits at once: every file of a run is written atomically, so nothing is left half-written.
Under data parallelism the ranks agree after every step, so all stop at the same one.

Python runs a signal's handler in the main thread, between two bytecodes. A rank waiting in a
collective for a rank that died or hangs runs none until the collective times out (30 minutes):
under torchrun (which sends SIGTERM to the other ranks when one fails, and SIGKILL 30 s later) a
rank whose main thread has not run the handler ``BLOCKED_SECONDS`` after a signal exits at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import BinaryIO

import torch

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Seconds a rank's main thread may go without running a signal's handler before it exits: short of
# torchrun's 30 s between SIGTERM and SIGKILL, and longer than the single calls a healthy rank makes
# (a CUDA backward it waits for, rank 0 writing a large checkpoint while the others wait for it):
# those still stop gracefully, writing the checkpoint of their step.
BLOCKED_SECONDS = 20.0
_handled_at = 0.0  # time.monotonic() when the main thread last ran a handler of this module


class Interrupted(Exception):
    """Training stopped on a signal after writing ``checkpoint`` at ``step``."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {self.signal_name} at step {step}: checkpoint {checkpoint}")

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Stopped(KeyboardInterrupt):
    """SIGTERM outside the training loop: raised like Ctrl-C's KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _handling() -> None:
    global _handled_at
    _handled_at = time.monotonic()


def _exit_when_blocked(pipe: BinaryIO) -> None:
    """Read the numbers of the signals as they arrive, whatever the main thread is doing (Python
    writes them to its wakeup file descriptor, ``pipe``'s other end); exit when the main thread
    runs no handler for one within ``BLOCKED_SECONDS``."""
    attributed = read_at = time.monotonic()
    with pipe:
        while numbers := pipe.read(64):
            # A handler run before the previous read, or already matched with a signal before, is not this one's.
            after = max(attributed, read_at)
            read_at = time.monotonic()
            received = [number for number in numbers if number in SIGNALS]
            if not received:
                continue
            while _handled_at <= after and time.monotonic() < read_at + BLOCKED_SECONDS:
                time.sleep(0.02)
            if _handled_at <= after:
                name = signal.Signals(received[-1]).name
                os.write(2, f"\n{name}: this rank is blocked (waiting for a rank that died or hangs?): exiting now; "
                         "the last checkpoint written is kept\n".encode())  # fmt: skip
                os._exit(128 + received[-1])
            attributed = _handled_at


@contextmanager
def _exit_if_blocked_under_torchrun() -> Iterator[None]:
    # torchrun's ranks alone (it sets TORCHELASTIC_RUN_ID): another launcher's grace period is its own.
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or "TORCHELASTIC_RUN_ID" not in os.environ:
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    pipe = os.fdopen(read, "rb", buffering=0)
    threading.Thread(target=_exit_when_blocked, args=(pipe,), name="lowmem-exit-when-blocked", daemon=True).start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        os.close(write)  # the thread reads the pipe's end and ends


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Outside the training loop SIGTERM interrupts like Ctrl-C does (``Stopped``), so that the
    command line can clean up and say so instead of dying silently. Under torchrun a rank blocked
    when a signal arrives exits (see the module)."""
    if not _in_main_thread():
        yield
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        _handling()
        raise Stopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in SIGNALS}
    try:
        with _exit_if_blocked_under_torchrun():
            yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class StopOnSignal:
    """Between ``install()`` and ``restore()`` (or within ``with StopOnSignal() as stop:``) the first
    SIGINT / SIGTERM is remembered, not raised; the loop asks ``stop.requested(device)`` between
    steps. A second one exits at once."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopOnSignal:
        if _in_main_thread():  # (Python runs signal handlers in the main thread only)
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __enter__(self) -> StopOnSignal:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        _handling()
        name = signal.Signals(signum).name
        if self.received is not None:
            # Files are replaced atomically: exiting here leaves the last checkpoint as it was.
            os.write(2, f"\n{name} again: exiting now; the last checkpoint written is kept\n".encode())
            os._exit(128 + signum)
        self.received = signum
        os.write(2, f"\n{name}: stopping after this step to write a checkpoint ({name} again: exit now)\n".encode())

    def requested(self, device: torch.device) -> int | None:
        """The signal to stop on, agreed by every data-parallel rank (a collective there: call it
        at the same points on every rank); None to go on."""
        import torch.distributed as dist

        received = self.received or 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            value = torch.tensor([received], dtype=torch.int64, device=device)
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
            received = int(value.item())
        return received or None
