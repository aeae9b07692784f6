"""Shared test helpers: compose lowmem's Hydra config like the CLI does."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from lowmem.config import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

register_configs()


def make_config(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=False)


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
