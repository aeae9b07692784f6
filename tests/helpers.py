"""Shared test helpers: compose lowmem's Hydra config like the CLI does."""

from __future__ import annotations

from pathlib import Path

from lowmem.config import CONF_DIR
from lowmem.config import compose as make_config

ROOT = Path(__file__).resolve().parents[1]
CONF = CONF_DIR

TINY_WRN = (
    "+recipe=wrn_cifar",
    "data=fake",
    "model.depth=10",
    "model.width=1",
    "data.batch_size=20",
    "data.train_size=60",
    "data.test_size=20",
    "trainer.progress=none",
)

__all__ = ["CONF", "ROOT", "TINY_WRN", "make_config"]
