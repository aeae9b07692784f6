"""What a command line does when a run cannot go ahead: one line, no traceback.

A refusal (``lowmem.run.refusals``) is printed as one line on stderr and the process exits with
status 1. A configuration refused before training leaves no run directory behind (when this
process created it), or the error in its log (when the directory held something before). A knob
that does not exist (``sparsity.densty=0.3``) is refused before Hydra composes anything, naming
the closest knobs (``refuse_unknown_knobs``).

A run stopped by SIGINT / SIGTERM (``lowmem.signals.Interrupted``) prints one line saying where its
checkpoint is and the exact command that resumes it, and exits with 130 / 143. A run whose losses
or gradients stay non-finite (``TrainingDiverged``, ``trainer.stop_on_nonfinite``) prints one line
naming the step, the loss and the knobs to look at, keeps its last checkpoint, and exits with 3.
"""

from __future__ import annotations

import functools
import logging
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lowmem import distributed
from lowmem.config import ConfigError
from lowmem.knobs import check_overrides
from lowmem.run import lock, records
from lowmem.run.files import CHECKPOINT, WriteFailed, kept_checkpoint
from lowmem.run.refusals import exit_refused, full_errors, is_refusal
from lowmem.signals import Interrupted, terminate_as_interrupt
from lowmem.techniques.precision import TrainingDiverged

EXIT_DIVERGED = 3  # a run stopped by non-finite losses or gradients (trainer.stop_on_nonfinite)


def refuse_unknown_knobs(argv: Sequence[str] | None = None) -> None:
    """Before Hydra composes: a command line override naming no knob exits with one line naming
    the closest knobs (Hydra's own message takes seven lines and suggests appending it with ``+``,
    which fails too). ``argv``: the command line's arguments (default ``sys.argv[1:]``)."""
    from hydra._internal.utils import get_args_parser

    arguments, _ = get_args_parser().parse_known_args(sys.argv[1:] if argv is None else list(argv))
    try:
        check_overrides(arguments.overrides)
    except ConfigError as error:
        if full_errors():
            raise
        exit_refused(str(error))


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
    run_dir = Path(run_dir).resolve()
    if lock.created_by_this_process(run_dir) and lock.holds_only_startup_files(run_dir):
        _close_log_files_in(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    records.restore(run_dir)
    records.remove_added(run_dir)
    record_in_log(message)


def _as_typed(path: str, name: str) -> str:
    """``name`` when the shell finds ``path`` by that name, else ``path``. (Symbolic links are not
    followed: a virtual environment's python is a link to one the shell may find without it.)"""
    found = shutil.which(name)
    return name if found is not None and os.path.abspath(found) == os.path.abspath(path) else path


def _launcher() -> list[str]:
    """How this process was started: python, or torchrun with its ranks per node, nodes and restarts."""
    python = _as_typed(sys.executable, "python")
    if "LOCAL_WORLD_SIZE" not in os.environ:  # (set by torchrun alone)
        return [python]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    words = [_as_typed(torchrun, "torchrun")] if os.path.isfile(torchrun) else [python, "-m", "torch.distributed.run"]
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if nodes == 1:
        words.append("--standalone")
    else:  # the same command on each node, with the job's rendezvous endpoint (the ranks do not know it)
        words += [f"--nnodes={nodes}", "--rdzv-backend=c10d", "--rdzv-endpoint=HOST:PORT"]
    words.append(f"--nproc_per_node={os.environ['LOCAL_WORLD_SIZE']}")
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    return words + ([f"--max-restarts={restarts}"] if restarts > 0 else [])


def resume_command(run_dir: Path, module: str = "lowmem.train") -> str:
    """The command that continues the run in ``run_dir``: this one's launcher (python, or torchrun
    with as many ranks) and overrides, resuming there."""
    from hydra.core.hydra_config import HydraConfig

    replaced = ("trainer.resume=", "hydra.run.dir=")
    overrides = [o for o in HydraConfig.get().overrides.task if not o.lstrip("+~").startswith(replaced)]
    words = [*_launcher(), "-m", module, *overrides, f"trainer.resume={run_dir}", f"hydra.run.dir={run_dir}"]
    return " ".join(shlex.quote(word) for word in words)


def one_line_errors(task: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wrap a ``@hydra.main`` task function: refusals and signals as one line (see the module)."""

    @functools.wraps(task)
    def wrapper(cfg: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

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
        except TrainingDiverged as error:
            # Nothing of the failing step was applied or saved: the last checkpoint stays as it was.
            if distributed.is_rank0():
                checkpoint = run_dir / CHECKPOINT
                kept = f"its last checkpoint {checkpoint} is kept" if checkpoint.is_file() else "no checkpoint written"
                line = f"{error}; {kept}"
                record_in_log(line, logging.ERROR)
                sys.stdout.flush()
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
            raise SystemExit(EXIT_DIVERGED) from None
        except Exception as error:
            if not is_refusal(error):
                raise
            message = str(error)
            if isinstance(error, WriteFailed):
                # The disk may be full: a log line that cannot be written is dropped, not printed
                # with a traceback. What the run leaves is its last checkpoint (writes are atomic).
                logging.raiseExceptions = False
                kept = kept_checkpoint(run_dir)
                message += (
                    f"; {kept}, is intact: resume with: {resume_command(run_dir)}"
                    if kept is not None
                    else f"; no checkpoint was written in {run_dir} yet"
                )
            try:
                discard_refused_run(run_dir, message)
            except WriteFailed:
                pass  # its .hydra record cannot be put back either: the line below says why
            # A sweep keeps Hydra's behaviour: the other jobs of the batch still run.
            if full_errors() or HydraConfig.get().mode == RunMode.MULTIRUN:
                raise
            exit_refused(message)  # rank 0 alone prints it under torchrun
        except KeyboardInterrupt as stop:
            # Ctrl-C (or SIGTERM) before training (building data, the model): nothing to resume.
            signum = getattr(stop, "signum", signal.SIGINT)
            message = f"stopped by {signal.Signals(signum).name} outside the training loop: no checkpoint written"
            discard_refused_run(run_dir, message)
            sys.stderr.write(message + "\n")
            raise SystemExit(128 + signum) from None

    return wrapper
