"""Keep a run directory's Hydra record (``.hydra/*.yaml``) when lowmem does not run the job.

Hydra writes ``.hydra/config.yaml``, ``hydra.yaml`` and ``overrides.yaml`` into the run directory
before it calls lowmem. When that directory already holds a finished run (skipped) or another
configuration's run (refused), those files would then describe a job that never ran there. The
``KeepHydraRecords`` callback (registered in ``conf/config.yaml``) reads them when the run or
sweep starts, before any job writes; ``restore`` puts a run directory's back, atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lowmem.run.files import save_bytes

_RECORDS: dict[Path, bytes] = {}  # .hydra file -> its bytes before this invocation's jobs
_SEEN: set[Path] = set()  # run directories whose .hydra files were read


def _remember(run_dir: Path) -> None:
    _SEEN.add(run_dir.resolve())
    for path in (run_dir / ".hydra").glob("*.yaml"):
        _RECORDS[path.resolve()] = path.read_bytes()


class KeepHydraRecords(Callback):
    """Remember the ``.hydra`` files of the run directory (single run) or of every job directory
    below the sweep directory (multirun) that exist before the jobs start."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _remember(Path(config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            for hydra_dir in sweep_dir.glob("**/.hydra"):
                _remember(hydra_dir.parent)


def restore(run_dir: Path) -> list[Path]:
    """Rewrite ``run_dir``'s remembered ``.hydra`` files as they were; the paths restored."""
    restored = []
    for path in (Path(run_dir) / ".hydra").glob("*.yaml"):
        before = _RECORDS.get(path.resolve())
        if before is not None and path.read_bytes() != before:
            save_bytes(before, path)
            restored.append(path)
    return restored


def remove_added(run_dir: Path) -> list[Path]:
    """Remove the ``.hydra`` files this invocation added to ``run_dir`` (a refused job's record in a
    directory that had none); the paths removed."""
    hydra_dir = Path(run_dir) / ".hydra"
    if Path(run_dir).resolve() not in _SEEN:
        return []
    removed = [path for path in hydra_dir.glob("*.yaml") if path.resolve() not in _RECORDS]
    for path in removed:
        path.unlink()
    if hydra_dir.is_dir() and not any(hydra_dir.iterdir()):
        hydra_dir.rmdir()
    return removed
