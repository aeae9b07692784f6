"""torchrun's own restarts (``--max-restarts``): a rank killed mid-run, the job restarted by torchrun
continues from the last checkpoint in the same run directory and ends where an uninterrupted run
ends; a rank blocked in a collective exits promptly on SIGTERM; a stopped run's resume line
launches as many ranks as it had."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lowmem.run.command import resume_command
from lowmem.signals import BLOCKED_SECONDS
from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks' processes in /proc")

# 5 steps of 20 examples per epoch, 2 epochs, a checkpoint after each; FP64 so that a resumed run
# is bit-identical to an uninterrupted one.
OVERRIDES = (
    "+recipe=wrn_cifar",
    "data=fake",
    "model.depth=10",
    "model.width=1",
    "data.train_size=100",
    "data.test_size=20",
    "data.batch_size=20",
    "precision=fp64",
    "trainer.parallel=fsdp",
    "trainer.epochs=2",
    "trainer.device=cpu",
    "trainer.log_every=1",
    "trainer.progress=none",
)


def _torchrun(cwd: Path, *args: str, restarts: int = 0) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               f"--max-restarts={restarts}", "-m", "lowmem.train", *OVERRIDES, *args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # (ranks oversubscribing the CPUs crawl)
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _ranks(torchrun: int) -> dict[int, int]:
    """The pids of torchrun's workers, by rank."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != torchrun:
                continue
            environ = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v)
        except (OSError, IndexError):  # gone meanwhile
            continue
        if "RANK" in environ:
            ranks[int(environ["RANK"])] = int(entry.name)
    return ranks


def _logged_steps(metrics: Path) -> list[int]:
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [record["step"] for record in map(json.loads, lines) if "loss" in record]


def _wait_for(condition, what: str, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_torchrun_restarts_a_killed_rank_from_the_last_checkpoint_and_ends_as_an_uninterrupted_run(tmp_path):
    """``kill -9`` of rank 0 at step 7 (the last checkpoint at step 5), in Hydra's default run
    directory (named by the start time): torchrun's restart continues in that directory from step 5
    and ends bit-identical to an uninterrupted run, each step logged once."""
    whole = _torchrun(tmp_path, f"hydra.run.dir={tmp_path / 'whole'}")  # (both at once: half the wait)
    killed = _torchrun(tmp_path, restarts=1)
    try:
        logs = lambda: tmp_path.glob("outputs/*/*/metrics.jsonl")  # noqa: E731
        _wait_for(lambda: any(len(_logged_steps(metrics)) >= 7 for metrics in logs()), "step 7")
        os.kill(_ranks(killed.pid)[0], signal.SIGKILL)
        out, _ = killed.communicate(timeout=300)
        whole_out, _ = whole.communicate(timeout=300)
    finally:
        killed.kill()
        whole.kill()
    assert whole.returncode == 0, whole_out[-3000:]
    assert killed.returncode == 0, out[-3000:]
    (run_dir,) = tmp_path.glob("outputs/*/*")  # the restart did not start a directory of its own
    assert "holds an interrupted run of this configuration: continuing it" in out
    assert _logged_steps(run_dir / "metrics.jsonl") == list(range(1, 11))
    expected, resumed = (torch.load(d / "model.pt", weights_only=True) for d in (tmp_path / "whole", run_dir))
    assert expected.keys() == resumed.keys() and all(torch.equal(expected[k], resumed[k]) for k in expected)


_RANK = """
import os, time, torch, torch.distributed as dist
from lowmem.distributed import init_from_environment
time.sleep(float(os.environ["DELAY"]))
init_from_environment(torch.device("cpu"))
value = torch.ones(1)
dist.all_reduce(value)
os._exit(0 if value.item() == 2 else 1)  # (no clean-up, as a killed rank)
"""


@pytest.mark.slow
def test_a_restarted_generation_does_not_read_the_addresses_the_killed_one_published():
    """torchrun's agent serves one store for every restart of a job. A restart whose rank 1 joins
    while rank 0 is still starting must not read the address the previous rank 0 published there
    (torch's env:// alone: "connectFullMesh failed ... Connection refused"; rank 1 late: a hang)."""
    from datetime import timedelta

    import torch.distributed as dist

    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port), "WORLD_SIZE": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # fmt: skip
    for restart, rank0_delay in ((0, 0), (1, 3)):
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", _RANK],
                env={**env, "TORCHELASTIC_RESTART_COUNT": str(restart), "RANK": str(rank),
                     "DELAY": str(rank0_delay if rank == 0 else 0)},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            for rank in (0, 1)
        ]
        try:
            outputs = [rank.communicate(timeout=60)[0] for rank in ranks]
        finally:
            for rank in ranks:
                rank.kill()
        assert [rank.returncode for rank in ranks] == [0, 0], f"restart {restart}: " + "\n".join(outputs)[-2000:]


@pytest.mark.slow
def test_a_rank_blocked_waiting_for_a_hung_rank_exits_promptly_on_sigterm(tmp_path):
    """Rank 1 stopped (SIGSTOP: a rank that hangs), rank 0 waits for it in a collective, where Python
    runs no signal handler: SIGTERM (what torchrun sends when a rank fails) ends it within
    ``BLOCKED_SECONDS`` and a little, not at the collective's 30-minute timeout."""
    run_dir = tmp_path / "run"
    job = _torchrun(tmp_path, f"hydra.run.dir={run_dir}")
    try:
        _wait_for(lambda: len(_logged_steps(run_dir / "metrics.jsonl")) >= 3, "step 3")
        ranks = _ranks(job.pid)
        os.kill(ranks[1], signal.SIGSTOP)
        time.sleep(3)  # rank 0 is waiting for it by now (a step takes a fraction of a second)
        sent = time.monotonic()
        os.kill(ranks[0], signal.SIGTERM)
        _wait_for(lambda: _gone(ranks[0]), "rank 0 to exit", seconds=BLOCKED_SECONDS + 25)
        took = time.monotonic() - sent
        os.kill(ranks[1], signal.SIGKILL)
        out, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    assert took < BLOCKED_SECONDS + 10
    assert "SIGTERM: this rank is blocked (waiting for a rank that died or hangs?): exiting now" in out


@pytest.mark.parametrize(
    ("environment", "launcher"),
    [
        ({}, ["-m", "lowmem.train"]),
        ({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "0"},
         ["--standalone", "--nproc_per_node=2", "-m", "lowmem.train"]),
        ({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "3"},
         ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=HOST:PORT", "--nproc_per_node=4",
          "--max-restarts=3", "-m", "lowmem.train"]),
    ],
)  # fmt: skip
def test_the_resume_line_launches_as_many_ranks_as_the_stopped_run(monkeypatch, environment, launcher):
    from hydra.core.hydra_config import HydraConfig

    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    overrides = ["+recipe=wrn_cifar", "trainer.parallel=fsdp", "hydra.run.dir=old", "trainer.resume=old"]
    hydra = SimpleNamespace(overrides=SimpleNamespace(task=overrides))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: hydra))
    first, *words = resume_command(Path("/runs/a")).split()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    assert first in (("torchrun", torchrun) if environment else ("python", sys.executable))
    assert words == [*launcher, "+recipe=wrn_cifar", "trainer.parallel=fsdp", "trainer.resume=/runs/a",
                     "hydra.run.dir=/runs/a"]  # fmt: skip


def test_each_start_of_a_multi_node_job_is_counted_alike_on_every_rank(monkeypatch):
    """On several nodes torchrun's restart counts differ from node to node (a node re-forms its ranks
    for another's restart without counting it): the generation is each rank's joins instead."""
    import torch.distributed as dist

    from lowmem.distributed import generation

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    for start in range(3):
        for rank, restarts in ((0, start), (1, 0)):  # node 1's torchrun counted none of them
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restarts))
            assert generation(store) == start
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")  # one node: its torchrun's count
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "4")
    assert generation(store) == 4
