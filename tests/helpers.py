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

# A small DynamicConv: the model's keyword arguments, and the same through the CLI on generated data.
SMALL_DC_ARCH = dict(encoder_layers=2, decoder_layers=2, embed_dim=32, ffn_dim=64, heads=4,
                     encoder_kernel_sizes=(3, 7), decoder_kernel_sizes=(3, 7))
SMALL_DC = (
    "+recipe=dc_iwslt",
    "data=fake",
    "data.train_size=300",
    "data.test_size=8",
    "data.batch_size=800",
    "model.encoder_layers=3",
    "model.decoder_layers=2",
    "model.embed_dim=32",
    "model.ffn_dim=64",
    "model.heads=4",
    "trainer.progress=none",
)

__all__ = ["CONF", "ROOT", "SMALL_DC", "SMALL_DC_ARCH", "TINY_WRN", "make_config"]
