"""Shared test helpers: compose lowmem's Hydra config like the CLI does."""

from __future__ import annotations

from pathlib import Path

import pytest

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


# --- models lowmem did not write (the "your model" API) ----------------------------------------------


def tiny_gpt(vocab: int = 97, d: int = 32, layers: int = 3, heads: int = 4, ctx: int = 16, dropout: float = 0.1):
    """A GPT-style model: pre-norm blocks in an nn.ModuleList called in a Python loop, the causal mask
    passed to each block by the caller (as users write them)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

        def forward(self, x, mask):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class TinyGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

        def forward(self, idx):
            t = idx.shape[1]
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=idx.device), 1)
            x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.ln(x))

    return TinyGPT()


def lm_loss(model, batch):
    import torch.nn.functional as F

    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def classification_loss(model, batch):
    import torch.nn.functional as F

    images, labels = batch
    return F.cross_entropy(model(images), labels)


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module (scripts are not a package)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# Modules a rank process needs, imported once by the fork server that starts the ranks.
_RANK_PRELOAD = ["torch", "torch.distributed", "lowmem.train", "lowmem.trainer", "lowmem.profile", "tests.helpers"]


def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.start_processes(fn, args, nprocs)`` with each rank forked from a fork
    server that has imported torch and lowmem once (``multiprocessing``'s ``forkserver``: a fresh
    process, started at the first call, that has run no torch op), not spawned: a spawned rank imports
    them again (about 3 s of CPU each, 12 s for the 4 ranks of a launch). Each rank is a new process
    as a spawned one is, its ``fn`` called with the same arguments; it inherits the environment the
    server started with (no test changes it for its ranks)."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(_RANK_PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def slow(*values: object, id: str | None = None) -> object:  # noqa: A002 (pytest.param's own name)
    """A parametrized case that only ``make test-all`` runs (marked slow): the longer one of a
    capability ``make test`` covers with a shorter case."""
    return pytest.param(*values, marks=pytest.mark.slow, id=id)
