"""What a refusal is, and how a command line prints one: one line on stderr, no traceback, exit 1.

A refusal is a message for the user, who can act on it: ``ConfigError`` (a knob's value cannot
work), ``RunRefused`` (the run directory or a file it needs cannot be used), ``UnaccountableStep``
(neither a fake nor a real pass can account the step: it names the module and the knob) or a recipe's
``DataUnavailableError`` (its data set is missing). ``HYDRA_FULL_ERROR=1`` shows the full
traceback as for any other error; genuine bugs always get theirs. Under torchrun, rank 0 alone
prints the line; every rank exits with status 1.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from lowmem.config import ConfigError
from lowmem.profiler.real_passes import UnaccountableStep


class RunRefused(Exception):
    """The run cannot go ahead for a reason the user can act on (a run directory in use or not
    writable, a checkpoint that cannot be read); the message names the knob or the file."""


REFUSALS = (ConfigError, RunRefused, UnaccountableStep)
EXIT_REFUSED = 1


def is_refusal(error: BaseException) -> bool:
    """A refusal, or a recipe's ``DataUnavailableError`` (data set missing: its message says how
    to get it); recipes know nothing of lowmem's exception classes, so it is known by name."""
    return isinstance(error, REFUSALS) or any(cls.__name__ == "DataUnavailableError" for cls in type(error).__mro__)


def full_errors() -> bool:
    """``HYDRA_FULL_ERROR=1``: tracebacks for refusals too (Hydra's own switch)."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def exit_refused(message: str) -> NoReturn:
    """Print ``message`` as one line on stderr and exit with status 1 (no traceback). Under torchrun,
    rank 0 alone prints it and every rank exits with status 1: the ranks refuse together (a rank's
    refusal that others may not share is made theirs first: ``lowmem.trainer``'s checkpoints), and
    the user reads the line once, not once per rank."""
    if int(os.environ.get("RANK", "0")) == 0:
        sys.stdout.flush()
        sys.stderr.write(f"error: {' '.join(message.split())}\n")
        sys.stderr.flush()
    raise SystemExit(EXIT_REFUSED)
