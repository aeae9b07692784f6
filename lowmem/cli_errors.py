"""What a command line prints when a run cannot go ahead: one line, no traceback.

A refusal is a message for the user, who can act on it: ``ConfigError`` (a knob's value cannot
work), ``RunRefused`` (the run directory or a file it needs cannot be used) or a recipe's
``DataUnavailableError`` (its data set is missing). It is printed as one line on stderr and the
process exits with status 1. A configuration refused before training leaves no run directory
behind (when this process created it), or the error in its log (when the directory held
something before). ``HYDRA_FULL_ERROR=1`` shows the full traceback as for any other error;
genuine bugs always get theirs.

A run stopped by SIGINT / SIGTERM (``lowmem.signals.Interrupted``) prints one line saying where its
checkpoint is and the exact command that resumes it, and exits with 130 / 143.
"""

from __future__ import annotations

import functools
import logging
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from lowmem.config import ConfigError


class RunRefused(Exception):
    """The run cannot go ahead for a reason the user can act on (a run directory in use or not
    writable, a checkpoint that cannot be read); the message names the knob or the file."""


REFUSALS = (ConfigError, RunRefused)
EXIT_REFUSED = 1


def is_refusal(error: BaseException) -> bool:
    """A refusal, or a recipe's ``DataUnavailableError`` (data set missing: its message says how
    to get it); recipes know nothing of lowmem's exception classes, so it is known by name."""
    return isinstance(error, REFUSALS) or any(cls.__name__ == "DataUnavailableError" for cls in type(error).__mro__)


def full_errors() -> bool:
    """``HYDRA_FULL_ERROR=1``: tracebacks for refusals too (Hydra's own switch)."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def exit_refused(message: str) -> NoReturn:
    """Print ``message`` as one line on stderr and exit with status 1 (no traceback)."""
    sys.stdout.flush()
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.stderr.flush()
    raise SystemExit(EXIT_REFUSED)


def record_in_log(message: str, level: int = logging.ERROR) -> None:
    """Write ``message`` to the run's log file only (the console gets its own line)."""
    record = logging.LogRecord("lowmem", level, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _close_log_files_in(run_dir: Path) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).resolve().is_relative_to(run_dir):
            handler.close()
            root.removeHandler(handler)


def discard_refused_run(run_dir: Path, message: str) -> None:
    """After a refusal: remove ``run_dir`` if this process created it and nothing but Hydra's
    record, the log and the lock is in it; otherwise put its ``.hydra`` record back as it was and
    write the error into its log."""
    from lowmem import hydra_records, run_lock

    run_dir = Path(run_dir).resolve()
    if run_lock.created_by_this_process(run_dir) and run_lock.holds_only_startup_files(run_dir):
        _close_log_files_in(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    hydra_records.restore(run_dir)
    hydra_records.remove_added(run_dir)
    record_in_log(message)


def resume_command(run_dir: Path, module: str = "lowmem.train") -> str:
    """The command that continues the run in ``run_dir``: this one's overrides, resuming there."""
    from hydra.core.hydra_config import HydraConfig

    replaced = ("trainer.resume=", "hydra.run.dir=")
    overrides = [o for o in HydraConfig.get().overrides.task if not o.lstrip("+~").startswith(replaced)]
    python = sys.executable
    plain = shutil.which("python")
    if plain is not None and os.path.realpath(plain) == os.path.realpath(python):
        python = "python"
    words = [python, "-m", module, *overrides, f"trainer.resume={run_dir}", f"hydra.run.dir={run_dir}"]
    return " ".join(shlex.quote(word) for word in words)


def one_line_errors(task: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wrap a ``@hydra.main`` task function: refusals and signals as one line (see the module)."""

    @functools.wraps(task)
    def wrapper(cfg: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from lowmem import distributed
        from lowmem.signals import Interrupted, terminate_as_interrupt

        run_dir = Path(HydraConfig.get().runtime.output_dir)
        try:
            with terminate_as_interrupt():
                return task(cfg)
        except Interrupted as stop:
            if distributed.is_rank0():
                line = (
                    f"stopped by {stop.signal_name} at step {stop.step}: checkpoint {stop.checkpoint}; "
                    f"resume with: {resume_command(run_dir)}"
                )
                record_in_log(line, logging.WARNING)
                sys.stdout.flush()
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
            raise SystemExit(stop.exit_code) from None
        except Exception as error:
            if not is_refusal(error):
                raise
            discard_refused_run(run_dir, str(error))
            # A sweep keeps Hydra's behaviour: the other jobs of the batch still run.
            if full_errors() or HydraConfig.get().mode == RunMode.MULTIRUN:
                raise
            exit_refused(str(error))
        except KeyboardInterrupt as stop:
            # Ctrl-C (or SIGTERM) before training (building data, the model): nothing to resume.
            signum = getattr(stop, "signum", signal.SIGINT)
            message = f"stopped by {signal.Signals(signum).name} outside the training loop: no checkpoint written"
            discard_refused_run(run_dir, message)
            sys.stderr.write(message + "\n")
            raise SystemExit(128 + signum) from None

    return wrapper
