"""A checkpoint that cannot be read or written is one line (issue 49): a sharded checkpoint's file
missing, truncated or another run's names the file and ``trainer.resume``, printed once under
torchrun (rank 0), every rank exiting 1; a write the disk refuses (a file size limit, a full disk)
names the file and the checkpoint left intact, which resumes."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lowmem.run.files import WriteFailed, append_jsonl, save_torch
from lowmem.run.refusals import RunRefused
from lowmem.sharding import DamagedShards, check_shards
from lowmem.train import run
from tests.helpers import ROOT, TINY_WRN, make_config

# 2 minibatches of 20 per epoch: a checkpoint at step 2, the next (when resumed for 2 epochs) at step 4.
SMALL = (*TINY_WRN, "data.train_size=40", "trainer.device=cpu", "trainer.epochs=1")
SHARDS = "checkpoint.shards.000000002"


def command(*args: str, ranks: int = 1, file_limit_kb: int | None = None) -> subprocess.CompletedProcess:
    """``python -m lowmem.train`` (under torchrun for 2 ranks), below ``ulimit -f`` if given; Python
    ignores SIGXFSZ, so a write past the limit fails with EFBIG rather than killing the process."""
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else []
    words = [sys.executable, *launch, "-m", "lowmem.train", *args]
    if file_limit_kb is not None:
        words = ["bash", "-c", f'ulimit -f {file_limit_kb}; exec "$@"', "bash", *words]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def refusal(out: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line of a failed command, checked to be printed once, with no traceback
    of lowmem's (torchrun's own report of the failed ranks follows it, with its launcher's)."""
    text = out.stdout + out.stderr
    lines = [line for line in text.splitlines() if line.startswith("error: ")]
    assert out.returncode != 0 and len(lines) == 1, text[-3000:]
    assert "[rank0]" not in text and "[rank1]" not in text, text[-3000:]
    assert text.count("Traceback") == text.count("ChildFailedError:"), text[-3000:]  # torchrun's alone
    return lines[0]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    """A 2-rank ``trainer.parallel=fsdp`` run of one epoch: checkpoint.pt and the shards of step 2."""
    run_dir = tmp_path_factory.mktemp("sharded") / "run"
    out = command(*SMALL, "trainer.parallel=fsdp", f"hydra.run.dir={run_dir}", ranks=2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / SHARDS).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    return run_dir


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("one") / "run"
    run_dir.mkdir()
    run(make_config(*SMALL), run_dir)
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "copy"))


# --- reading: a damaged sharded checkpoint ---------------------------------------------------------


def test_a_missing_shard_under_torchrun_is_one_line_from_rank_0_and_every_rank_exits_1(sharded_run, tmp_path):
    source = copy_of(sharded_run, tmp_path)
    shard = source / SHARDS / "__1_0.distcp"
    shard.unlink()
    out = command(*SMALL, "trainer.epochs=2", "trainer.parallel=fsdp", f"trainer.resume={source}",
                  f"hydra.run.dir={tmp_path / 'resumed'}", ranks=2)
    line = refusal(out)
    assert f"trainer.resume={source}" in line and f"{shard} is missing" in line, line
    # Rank 1 refused too (exit status 1), unless torchrun, seeing rank 0 fail first, stopped it (SIGTERM).
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: (1|-15) ", out.stderr), out.stderr[-3000:]
    assert not (tmp_path / "resumed").exists()  # the refused run left no directory


def test_a_truncated_shard_is_refused_naming_it_and_resumes_once_restored(sharded_run, tmp_path):
    """On one rank (a shard of 1 reads the 2 ranks' files), in this process: the refusal's message."""
    source = copy_of(sharded_run, tmp_path)
    shard = source / SHARDS / "__0_0.distcp"
    kept = shard.read_bytes()
    os.truncate(shard, 1000)
    resume = (*SMALL, "trainer.epochs=2", "trainer.parallel=fsdp", f"trainer.resume={source}")
    try:
        with pytest.raises(RunRefused, match=f"trainer.resume={source}: the sharded checkpoint") as refused:
            run(make_config(*resume), tmp_path / "refused")
        assert f"{shard} holds 1000 bytes, the .metadata records {len(kept)}: truncated" in str(refused.value)
        shard.write_bytes(kept)  # the file back: the checkpoint resumes
        run(make_config(*resume), tmp_path / "resumed")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)["trainer"]["step"] == 4


@pytest.mark.parametrize(
    ("damage", "named", "says"),
    [("delete", "__1_0.distcp", "is missing"), ("truncate", "__0_0.distcp", "truncated"),
     ("append", "__0_0.distcp", "not the file this checkpoint wrote"), ("delete", ".metadata", "is missing"),
     ("truncate", ".metadata", "cannot be read"), ("delete", "", "the directory is missing")],
)
def test_every_damaged_file_is_named_before_anything_is_loaded(sharded_run, tmp_path, damage, named, says):
    shards = Path(shutil.copytree(sharded_run / SHARDS, tmp_path / SHARDS))
    path = shards / named
    if damage == "delete":
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    elif damage == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    else:
        with open(path, "ab") as handle:
            handle.write(b"\0" * 10)
    with pytest.raises(DamagedShards, match=f"the sharded checkpoint {shards} cannot be loaded") as damaged:
        check_shards(shards)
    assert (str(path) if named else str(shards)) in str(damaged.value) and says in str(damaged.value)


def test_another_runs_shards_are_refused_naming_the_directory(sharded_run):
    """Shards of a model of another shape (width 2 here, width 1 saved) fail in dcp's planning, on
    every rank: one ``DamagedShards`` naming the directory and the tensor."""
    from lowmem.sharding import load_shards
    from lowmem.trainer import build_trainer

    try:
        trainer = build_trainer(make_config(*SMALL, "model.width=2", "trainer.parallel=fsdp"))
        with pytest.raises(DamagedShards, match=r"does not load into this run \(ValueError: Size mismatch") as error:
            load_shards(trainer.unwrapped_model, trainer.optimizer, sharded_run / SHARDS)
        assert str(sharded_run / SHARDS) in str(error.value)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_fails_alone(rank: int, world: int, port: int, shards: str, out: str) -> None:
    """One rank of ``test_a_failure_on_one_rank_stops_every_rank``: rank 1 alone finds the shards
    damaged, then rank 0 alone cannot write checkpoint.pt; each rank writes what it raised."""
    from datetime import timedelta
    from types import SimpleNamespace

    from lowmem import sharding
    from lowmem import trainer as trainer_module

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a rank left waiting fails, not hangs
    raised = []
    try:
        trainer = trainer_module.build_trainer(make_config(*SMALL, "trainer.parallel=fsdp"))
        if rank == 1:
            def damaged(path: Path) -> None:
                raise DamagedShards(f"rank 1 cannot read {path}")

            sharding.check_shards = damaged
        try:
            sharding.load_shards(trainer.unwrapped_model, trainer.optimizer, Path(shards))
        except DamagedShards as error:
            raised.append(f"{type(error).__name__}: {error}")
        if rank == 0:
            def full(obj: object, path: Path) -> None:
                raise WriteFailed(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))

            trainer_module.save_torch = full
        try:
            trainer._save_checkpoint(Path(out), SimpleNamespace(lines=0))
        except RunRefused as error:
            raised.append(f"{type(error).__name__}: {error}")
    finally:
        Path(out, f"rank{rank}.txt").write_text("\n".join(raised))
        dist.destroy_process_group()


def test_a_failure_on_one_rank_stops_every_rank(sharded_run, tmp_path):
    """Shards only rank 1 finds damaged, a checkpoint.pt only rank 0 cannot write (rank 0 writes it
    alone): every rank raises the failing rank's message, none waits for the others."""
    from tests.helpers import start_ranks
    from tests.test_distributed import _free_port

    start_ranks(_rank_fails_alone, (2, _free_port(), str(sharded_run / SHARDS), str(tmp_path)), 2)
    cannot_read = f"DamagedShards: rank 1 cannot read {sharded_run / SHARDS}"
    cannot_write = f"cannot write {tmp_path / 'checkpoint.pt'}: No space left on device"
    assert (tmp_path / "rank0.txt").read_text() == f"{cannot_read}\nWriteFailed: {cannot_write} (free some space)"
    assert (tmp_path / "rank1.txt").read_text() == f"{cannot_read}\nRunRefused: {cannot_write} (free some space)"
    assert not list(tmp_path.glob("checkpoint.shards.*"))  # the shards of the checkpoint not written: removed


# --- writing: the disk refuses ----------------------------------------------------------------------


def test_a_checkpoint_past_the_file_size_limit_is_one_line_and_the_previous_one_resumes(one_process_run, tmp_path):
    run_dir = copy_of(one_process_run, tmp_path)
    checkpoint = run_dir / "checkpoint.pt"
    before = checkpoint.read_bytes()
    limit_kb = len(before) // 1024 // 2  # checkpoint.pt cannot be written; the small files can
    resume = (*SMALL, "trainer.epochs=2", f"trainer.resume={run_dir}", f"hydra.run.dir={run_dir}")
    line = refusal(command(*resume, file_limit_kb=limit_kb))
    assert line.startswith(f"error: cannot write {checkpoint}: File too large (raise the file size limit"), line
    assert f"the checkpoint of step 2, {checkpoint}, is intact: resume with: " in line and "trainer.resume=" in line
    assert checkpoint.read_bytes() == before and not list(run_dir.glob(".checkpoint.pt.*"))  # no temporary file
    run(make_config(*resume), run_dir)  # the previous checkpoint resumes
    assert torch.load(checkpoint, weights_only=True)["trainer"]["step"] == 4


@pytest.mark.slow
def test_shards_past_the_file_size_limit_under_torchrun_leave_the_previous_checkpoint(sharded_run, tmp_path):
    run_dir = copy_of(sharded_run, tmp_path)
    before = (run_dir / "checkpoint.pt").read_bytes()
    limit_kb = (run_dir / SHARDS / "__0_0.distcp").stat().st_size // 1024 // 2
    out = command(*SMALL, "trainer.epochs=2", "trainer.parallel=fsdp", f"trainer.resume={run_dir}",
                  f"hydra.run.dir={run_dir}", ranks=2, file_limit_kb=limit_kb)
    line = refusal(out)
    assert line.startswith(f"error: cannot write {run_dir / 'checkpoint.shards.000000004'}/__"), line
    assert f"the checkpoint of step 2, {run_dir / 'checkpoint.pt'}, is intact" in line, line
    # The step-4 directory the ranks began is removed; checkpoint.pt and the shards it names are as they were.
    assert sorted(p.name for p in run_dir.glob("checkpoint.*")) == ["checkpoint.pt", SHARDS]
    assert (run_dir / "checkpoint.pt").read_bytes() == before and check_shards(run_dir / SHARDS) is not None


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES])
def test_a_refused_write_names_the_file_and_leaves_the_old_one(tmp_path, monkeypatch, code):
    path = tmp_path / "checkpoint.pt"
    save_torch({"old": torch.ones(3)}, path)
    before = path.read_bytes()

    def refuse(obj, handle):  # as torch.save reports a failed write: a RuntimeError chained to the OSError
        try:
            raise OSError(code, os.strerror(code))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos")  # noqa: B904

    monkeypatch.setattr(torch, "save", refuse)
    with pytest.raises(WriteFailed, match=f"cannot write {path}: {os.strerror(code)} ") as failed:
        save_torch({"new": torch.zeros(3)}, path)
    assert failed.value.path == path and path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]
    monkeypatch.undo()

    def full(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(WriteFailed, match=f"cannot write {tmp_path / 'metrics.jsonl'}"):
        append_jsonl({"step": 1}, tmp_path / "metrics.jsonl")
