"""Data parallel: two CPU ranks (gloo) equal one process over the same global minibatches."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_WRN, make_config, start_ranks

# Sparsity, true microbatching (10 examples per microbatch on each rank: the same BatchNorm groups
# as one process with microbatches of 10) and checkpointing, in FP64 so that only summation order
# separates the runs.
OVERRIDES = (
    *TINY_WRN,
    "data.batch_size=40",
    "data.train_size=160",
    "precision=fp64",
    "sparsity.density=0.5",
    "sparsity.rewire_freq_mult=50",
    "microbatch.size=10",
    "checkpointing.strategy=residual",
    "checkpointing.every=2",
    "trainer.epochs=1",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, run_dir: str, overrides: tuple[str, ...]) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from lowmem.train import run
    from lowmem.trainer import build_trainer

    cfg = make_config(*overrides)
    if cfg.trainer.resume:
        run(cfg, Path(run_dir))
        return
    from lowmem import distributed

    distributed.init_from_environment(torch.device("cpu"))
    trainer = build_trainer(cfg)
    trainer.fit(Path(run_dir))
    params = {k: v.detach().clone() for k, v in trainer.unwrapped_model.named_parameters()}
    torch.save({"params": params, "masks": trainer.sparsity.masks}, Path(run_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def _launch(world: int, run_dir: Path, *overrides: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    start_ranks(_rank_main, (world, _free_port(), str(run_dir), (*OVERRIDES, *overrides)), world)


def _single(run_dir: Path, *overrides: str) -> dict[str, torch.Tensor]:
    from lowmem.trainer import build_trainer

    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(make_config(*OVERRIDES, *overrides))
    trainer.fit(run_dir)
    return {"params": dict(trainer.unwrapped_model.named_parameters()), "masks": trainer.sparsity.masks}


def test_two_ranks_equal_one_process_and_hold_identical_masks(tmp_path):
    _launch(2, tmp_path / "ddp", "trainer.max_steps=4")
    ranks = [torch.load(tmp_path / "ddp" / f"rank{r}.pt", weights_only=True) for r in range(2)]
    single = _single(tmp_path / "single", "trainer.max_steps=4")
    for name, mask in ranks[0]["masks"].items():
        assert torch.equal(mask, ranks[1]["masks"][name]) and torch.equal(mask, single["masks"][name]), name
    for name, value in single["params"].items():
        for rank in ranks:
            torch.testing.assert_close(rank["params"][name], value.detach(), rtol=1e-9, atol=1e-10)
    assert (tmp_path / "ddp" / "model.pt").is_file() and not list((tmp_path / "ddp").glob("rank1*.json"))


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_on_one_rank(tmp_path):
    _launch(2, tmp_path / "ddp", "trainer.max_steps=2")
    _single(tmp_path / "full", "trainer.max_steps=4")
    from lowmem.train import run

    (tmp_path / "resumed").mkdir()
    run(
        make_config(*OVERRIDES, "trainer.max_steps=4", f"trainer.resume={tmp_path / 'ddp'}"),
        tmp_path / "resumed",
    )
    full = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed" / "model.pt", weights_only=True)
    for name, value in full.items():
        if value.is_floating_point() and "running" not in name:  # BatchNorm statistics are per rank
            torch.testing.assert_close(resumed[name], value, rtol=1e-9, atol=1e-10)


def test_a_global_batch_not_divisible_by_the_ranks_is_refused(monkeypatch):
    import pytest

    from lowmem.config import ConfigError
    from lowmem.trainer import build_trainer

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="data.batch_size=20 .* divisible by the number of ranks"):
        build_trainer(make_config(*TINY_WRN))


def test_sync_batchnorm_on_cpu_ranks_is_refused_at_start_naming_the_knob(monkeypatch):
    """torch's SyncBatchNorm raises on CPU tensors at the first synchronized forward: refused before."""
    import pytest

    from lowmem.config import ConfigError
    from lowmem.trainer import build_trainer

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="trainer.sync_batchnorm=true needs a CUDA device"):
        build_trainer(make_config(*TINY_WRN, "trainer.sync_batchnorm=true", "trainer.device=cpu"))


@pytest.mark.slow
def test_the_profiler_reports_per_rank_memory_under_torchrun(tmp_path):
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT

    tiny = [
        "+recipe=wrn_cifar",
        "data=fake",
        "model.depth=10",
        "model.width=1",
        "data.batch_size=20",
        "profile.measure_peak=false",
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    out = subprocess.run(
        [*torchrun, "-m", "lowmem.profile", *tiny, f"hydra.run.dir={tmp_path / 'ddp'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # Each rank's row from its own file: the ranks' printed lines may interleave on a busy machine.
    rows = [json.loads((tmp_path / "ddp" / f"profile.rank{rank}.json").read_text()) for rank in range(2)]
    single = subprocess.run(
        [sys.executable, "-m", "lowmem.profile", *tiny, f"hydra.run.dir={tmp_path / 'one'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    whole = json.loads(single.stdout.splitlines()[-1])
    assert [(row["rank"], row["world_size"]) for row in rows] == [(0, 2), (1, 2)]
    # Each rank holds the activations of its half of the global batch of 20.
    assert all(
        abs(row["activation_bytes"] * 2 - whole["activation_bytes"]) <= 0.01 * whole["activation_bytes"] for row in rows
    )


def test_two_compiled_ranks_equal_one_eager_process(tmp_path):
    """trainer.compile=true under DDP: each rank's compiled model (graphs captured and run through
    AOTAutograd) ends where one eager process ends."""
    compiled = ("trainer.max_steps=2", "trainer.compile=true", "trainer.compile_backend=aot_eager")
    _launch(2, tmp_path / "ddp", *compiled)
    ranks = [torch.load(tmp_path / "ddp" / f"rank{r}.pt", weights_only=True) for r in range(2)]
    single = _single(tmp_path / "single", "trainer.max_steps=2")
    for name, value in single["params"].items():
        for rank in ranks:
            torch.testing.assert_close(rank["params"][name], value.detach(), rtol=1e-9, atol=1e-10)
