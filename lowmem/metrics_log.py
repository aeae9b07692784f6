"""Metrics: ``metrics.jsonl`` always, Weights & Biases when ``logger=wandb``, a progress display."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lowmem.run.files import METRICS, append_jsonl

log = logging.getLogger("lowmem")


class MetricsLog:
    """One JSON object per logged step or epoch, mirrored to wandb if configured.

    ``enabled=False`` (data-parallel ranks other than 0) makes every call a no-op. ``lines``: the
    lines ``metrics.jsonl`` holds (a checkpoint records it; a resumed run drops the lines after).
    """

    def __init__(self, run_dir: Path, logger_cfg: Any, config: dict, enabled: bool = True) -> None:
        self.path = Path(run_dir) / METRICS
        self.enabled = enabled
        self.lines = self.path.read_bytes().count(b"\n") if enabled and self.path.is_file() else 0
        self._wandb_run = None
        if enabled and logger_cfg.name == "wandb":
            import wandb  # imported only when asked for: it is slow to import

            self._wandb_run = wandb.init(
                project=logger_cfg.project, mode=logger_cfg.mode, dir=str(run_dir), config=config, reinit=True
            )

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        append_jsonl(record, self.path)
        self.lines += 1
        if self._wandb_run is not None:
            numbers = {
                k: v for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)
            }
            self._wandb_run.log(numbers, step=int(record.get("step", 0)))

    def close(self) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


class Progress:
    """A tqdm bar per epoch on a terminal; a plain line every ``every`` steps otherwise."""

    def __init__(self, mode: str, every: int, enabled: bool = True) -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode if enabled else "none"
        self.every = every
        self._bar: tqdm | None = None

    def start_epoch(self, epoch: int, total: int, initial: int = 0) -> None:
        if self.mode == "bar":
            self._bar = tqdm(
                total=total, initial=initial, desc=f"epoch {epoch}", leave=False, dynamic_ncols=True
            )

    def step(self, step: int, values: dict[str, float]) -> None:
        text = " ".join(f"{k}={v:.4g}" for k, v in values.items())
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(text, refresh=False)
        elif self.mode == "lines" and step % self.every == 0:
            log.info("step %d %s", step, text)

    def end_epoch(self, summary: str) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.mode != "none":
            log.info(summary)
