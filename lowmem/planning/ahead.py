"""A second process that accounts the planner's next (precision, microbatch) while this one accounts
the current one: ``lowmem.plan``'s fake passes are single-threaded Python, so a second core halves
the search (DynamicConv's 200 MB plan: each microbatch size it reaches costs ~15 fake passes).

How: ``os.fork`` (the child inherits the built trainers and every figure found so far), the child
runs the same deterministic accountings and sends back what it found (``Planner.export``: chain
costs, accounted schedules, per-shape figures; plain data, pickled through a pipe); this process
merges them into its caches (``Planner.merge``) and then finds them there, so the answer is the
one a single process gets: the child only fills caches ahead of time. A child that fails for any
reason sends nothing, and the work is done here as before.

Used only where it is safe and worth it: ``os.fork`` exists, at least two CPUs are usable, CUDA is
not initialized in this process (a forked child cannot use it), no process group is (the child
must not take part in collectives), not inside a child itself, and not once a child found autograd
unusable: after this process has run a backward pass on fake tensors (every accounting does), torch
refuses autograd in a forked child ("Unable to handle autograd's threading in combination with
fork-based multiprocessing"; its engine started device threads for the fake tensors' device). The
child says so (``_FORK_REFUSED``) and no child is forked again in this process: the work is done
here, as with one CPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import signal
from collections.abc import Callable
from typing import Any

import torch

_IN_CHILD = False
_AUTOGRAD_REFUSES_FORKS = False  # a child found autograd refusing to run after the fork
_FORK_REFUSED = b"\x00lowmem: autograd refuses forked children"  # what such a child sends
log = logging.getLogger("lowmem")


def in_child() -> bool:
    """Whether this process is a forked helper: whatever fails here is computed again by the parent
    (a refusal the child would record may be the fork's own failure, not the configuration's)."""
    return _IN_CHILD


def usable() -> bool:
    """Whether a forked helper can run here (see the module docstring)."""
    if _IN_CHILD or _AUTOGRAD_REFUSES_FORKS or not hasattr(os, "fork"):
        return False
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return cpus >= 2 and not torch.cuda.is_initialized() and not distributed


class Ahead:
    """At most one forked child computing one task ahead.

    compute(task): run in the child, returns picklable data (the caches it filled).
    merge(task, data): run here with that data.
    """

    def __init__(
        self, compute: Callable[[Any], Any], merge: Callable[[Any, Any], None], patience: float = 600.0
    ) -> None:
        self.compute, self.merge = compute, merge
        # Seconds ``collect`` waits for an answer before it stops the child (a fork can deadlock on a
        # lock another thread held): the task is then computed here, as without a child.
        self.patience = patience
        self._child: tuple[Any, int, int] | None = None  # task, pid, read end of its pipe

    def start(self, task: Any) -> None:
        """Fork a child computing ``task`` (the one running is collected first)."""
        self.collect()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: compute, send, and leave without running this process's exit code
            global _IN_CHILD
            _IN_CHILD = True
            os.close(read)
            payload = b""
            try:
                torch.set_num_threads(1)  # the parent's thread pool did not survive the fork
                payload = pickle.dumps(self.compute(task), protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as error:  # noqa: BLE001 - the parent computes it; it needs only to know why
                if "fork-based multiprocessing" in str(error):
                    payload = _FORK_REFUSED
            with contextlib.suppress(BaseException):
                with os.fdopen(write, "wb") as pipe:
                    pipe.write(payload)
            os._exit(0)
        os.close(write)
        self._child = (task, pid, read)

    def running(self) -> Any:
        """The task the child is computing (None: no child)."""
        return None if self._child is None else self._child[0]

    def finished(self) -> bool:
        """Whether the child's answer is ready (or it died): ``collect`` would not wait."""
        return self._answers_within(0)

    def _answers_within(self, seconds: float) -> bool:
        if self._child is None:
            return True
        readable, _, _ = select.select([self._child[2]], [], [], seconds)
        return bool(readable)

    def collect(self) -> None:
        """Wait for the child, if any, and merge what it sends (nothing, if it failed)."""
        if self._child is None:
            return
        if not self._answers_within(self.patience):
            log.warning("lowmem.plan: a helper process gave no answer in %.0f s; its work is done here", self.patience)
            self.cancel()
            return
        task, pid, read = self._child
        self._child = None
        with os.fdopen(read, "rb") as pipe:
            payload = pipe.read()
        os.waitpid(pid, 0)
        if payload == _FORK_REFUSED:
            global _AUTOGRAD_REFUSES_FORKS
            _AUTOGRAD_REFUSES_FORKS = True
        elif payload:
            try:
                data = pickle.loads(payload)
            except Exception:  # noqa: BLE001 - a garbled answer is no answer: computed here instead
                return
            self.merge(task, data)

    def cancel(self) -> None:
        """Stop the child, if any, discarding its work."""
        if self._child is None:
            return
        _, pid, read = self._child
        self._child = None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)

    def __enter__(self) -> Ahead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()
