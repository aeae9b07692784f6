"""Runs that are safe to share, stop cleanly on a signal, and say in one line what went wrong (issue 22).

One process per run directory (a second one refused naming hydra.run.dir and the owner's pid, a
dead owner's lock taken over); SIGINT / SIGTERM write a checkpoint at the step, print the resume
command and exit 130 / 143, and the resumed run ends bit-identical; refusals are one line, without
a traceback and without a stray run directory; a resumed run never logs a step twice, carries
DynamicConv's snapshots into a new directory and refuses a precision change.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lowmem.config import ConfigError, validate
from lowmem.run.files import read_checkpoint
from lowmem.run.lock import LOCK_FILE, acquire, release_all
from lowmem.run.refusals import RunRefused
from lowmem.train import run
from tests.helpers import ROOT, SMALL_DC, TINY_WRN, make_config, slow

# 60 minibatches of 20 (2 epochs of 30): long enough for a signal to land mid-run.
LONGER = (*TINY_WRN, "data.train_size=600", "trainer.epochs=2", "trainer.log_every=1")


def train(run_dir: Path, *overrides: str) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    return run(make_config(*overrides), run_dir)


def cli(*args: str, module: str = "lowmem.train", wait: bool = True) -> subprocess.CompletedProcess | subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    command = [sys.executable, "-m", module, *args]
    if not wait:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def one_line(out: str) -> str:
    """The last line of a command's output, checked to come without a traceback."""
    assert "Traceback" not in out, out[-2000:]
    return out.strip().splitlines()[-1]


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = (torch.load(d / "model.pt", weights_only=True) for d in (a, b))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def logged_twice(run_dir: Path) -> list:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = [(tuple(sorted(r)), r.get("step"), r.get("epoch")) for r in records]
    return [key for key in set(keys) if keys.count(key) > 1]


# --- refusals: one line, no traceback, no run directory left behind --------------------------------


@pytest.mark.parametrize(
    ("knob", "value"),
    [("checkpointing.budget_mb", "inf"), ("checkpointing.budget_mb", "nan"), ("optim.lr", "inf"),
     ("precision.init_scale", "nan"), ("optim.betas", "[0.9,inf]")],
)
def test_inf_and_nan_are_refused_naming_the_knob(knob, value):
    overrides = [f"{knob}={value}"] + (["checkpointing.strategy=optimal"] if knob.startswith("checkpointing") else [])
    with pytest.raises(ConfigError, match=knob.replace("[", r"\[")):
        validate(make_config(*TINY_WRN, *overrides))


def test_refused_configurations_print_one_line_and_leave_no_run_directory(tmp_path):
    out = cli(*TINY_WRN, "checkpointing.strategy=optimal", "checkpointing.budget_mb=inf",
              f"hydra.run.dir={tmp_path / 'new'}")
    assert out.returncode == 1
    assert one_line(out.stdout + out.stderr).startswith("error: checkpointing.budget_mb=inf")
    assert not (tmp_path / "new").exists()
    planned = cli("+recipe=wrn_cifar", "data=fake", "plan.budget_mb=nan", f"hydra.run.dir={tmp_path / 'plan'}",
                  module="lowmem.plan")
    assert planned.returncode == 1 and "plan.budget_mb=nan" in one_line(planned.stdout + planned.stderr)
    assert not (tmp_path / "plan").exists()
    unwritable = cli(*TINY_WRN, "hydra.run.dir=/proc/lowmem-run")
    assert unwritable.returncode == 1 and "hydra.run.dir=/proc/lowmem-run" in one_line(unwritable.stderr)


def test_a_refusal_in_an_existing_directory_is_recorded_in_its_log(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    out = cli(*TINY_WRN, "sparsity.density=0", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 1 and "sparsity.density" in one_line(out.stderr)
    assert "sparsity.density" in (tmp_path / "train.log").read_text()
    assert not (tmp_path / ".hydra").exists() and (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("damage", ["truncated", "random bytes", "pickle"])
def test_a_corrupt_checkpoint_is_named_with_trainer_resume(tmp_path, damage):
    path = tmp_path / "checkpoint.pt"
    if damage == "pickle":
        torch.save({"model": object}, path)  # not loadable weights-only
    else:
        path.write_bytes(os.urandom(4096) if damage == "random bytes" else b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(RunRefused, match=r"trainer.resume=.*checkpoint.pt cannot be read") as refused:
        read_checkpoint(path, f"trainer.resume={tmp_path}")
    assert "weights_only" not in str(refused.value)  # torch's advice to unpickle anything: not here


def test_a_truncated_checkpoint_through_the_command_line(tmp_path):
    train(tmp_path / "run", *TINY_WRN, "trainer.max_steps=1")
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    with open(checkpoint, "r+b") as handle:
        handle.truncate(checkpoint.stat().st_size // 2)
    before = checkpoint.read_bytes()
    out = cli(*TINY_WRN, f"trainer.resume={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'new'}")
    line = one_line(out.stderr)
    assert out.returncode == 1 and "trainer.resume=" in line and str(checkpoint) in line
    assert checkpoint.read_bytes() == before and not (tmp_path / "new").exists()


# --- one process per run directory -------------------------------------------------------------------


def test_a_locked_run_directory_is_refused_and_a_dead_owners_lock_taken_over(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from lowmem.run.lock import acquire; acquire(sys.argv[1]); "
         "print('locked', flush=True); time.sleep(120)", str(tmp_path / "run")],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        out = cli(*TINY_WRN, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}")
        line = one_line(out.stderr)
        assert out.returncode == 1 and f"hydra.run.dir={tmp_path / 'run'}" in line and f"process {holder.pid}" in line
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOCK_FILE]  # nothing touched
        with pytest.raises(RunRefused, match=str(holder.pid)):
            acquire(tmp_path / "run")
    finally:
        holder.kill()
        holder.wait()
    acquire(tmp_path / "run")  # the owner is gone: its lock is taken over
    assert (tmp_path / "run" / LOCK_FILE).read_text().split()[0] == str(os.getpid())
    release_all()
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_the_default_run_directory_cannot_collide():
    """Date and time as before, then the process id: two runs started in the same second differ."""
    conf = OmegaConf.load(ROOT / "lowmem" / "conf" / "config.yaml")
    for node in ("run", "sweep"):
        assert conf.hydra[node]._get_node("dir")._value().endswith("/${now:%Y-%m-%d}/${now:%H-%M-%S}-${lowmem.pid:}")
    assert OmegaConf.create({"suffix": "${lowmem.pid:}"}).suffix == os.getpid()


# --- signals -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    train(run_dir, *LONGER)
    return run_dir


@pytest.mark.parametrize(("signum", "code"), [slow(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_checkpoints_the_step_and_the_resumed_run_is_bit_identical(tmp_path, uninterrupted, signum, code):
    process = cli(*LONGER, f"hydra.run.dir={tmp_path}", wait=False)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    assert process.returncode == code, err[-2000:]
    line = one_line(out + err)
    assert "resume with: " in line and f"trainer.resume={tmp_path}" in line and f"hydra.run.dir={tmp_path}" in line
    step = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["trainer"]["step"]
    assert f"at step {step}:" in line and step < 60 and not (tmp_path / "model.pt").exists()
    assert not (tmp_path / LOCK_FILE).exists()
    train(tmp_path, *LONGER, f"trainer.resume={tmp_path}")
    assert same_weights(uninterrupted, tmp_path)
    assert logged_twice(tmp_path) == []


def test_a_second_signal_exits_at_once():
    code = (
        "import os, signal, time\nfrom lowmem.signals import StopOnSignal\n"
        "with StopOnSignal() as stop:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n    print('asked', stop.received, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(30)\n    print('not reached')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 130 and out.stdout.split() == ["asked", str(int(signal.SIGINT))]


# --- resume: exact in every case ---------------------------------------------------------------------


def test_steps_logged_after_the_checkpoint_are_not_logged_twice(tmp_path):
    overrides = (*TINY_WRN, "trainer.epochs=2", "trainer.log_every=1")
    train(tmp_path / "full", *overrides)
    train(tmp_path / "run", *overrides, "trainer.max_steps=4")  # checkpoint at step 4 (mid epoch 1)
    # As if killed after logging two more steps that the checkpoint does not hold:
    with open(tmp_path / "run" / "metrics.jsonl", "a") as metrics:
        for step in (5, 6):
            metrics.write(json.dumps({"step": step, "epoch": 1, "loss": 1.0, "lr": 0.1, "loss_scale": 1.0,
                                      "skipped": False}) + "\n")
        metrics.write('{"step": 7, "ep')  # a line cut short
    (tmp_path / "run" / "result.json").unlink()
    train(tmp_path / "run", *overrides, f"trainer.resume={tmp_path / 'run'}")
    assert logged_twice(tmp_path / "run") == []
    assert same_weights(tmp_path / "full", tmp_path / "run")
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))


def logged_steps(path: Path) -> list[tuple]:
    """Each record of a ``metrics.jsonl`` as (its keys, step, epoch), in order."""
    return [(tuple(sorted(r)), r.get("step"), r.get("epoch")) for r in map(json.loads, path.read_text().splitlines())]


def test_a_run_killed_before_its_first_checkpoint_and_run_again_logs_each_step_once(tmp_path):
    overrides = (*TINY_WRN, "trainer.epochs=1", "trainer.log_every=1")  # 3 steps, a checkpoint after the third
    train(tmp_path / "full", *overrides)
    # As if `kill -9` had stopped the same command after two logged steps, before any checkpoint:
    record = {"epoch": 0, "loss": 9.0, "lr": 0.1, "skipped": False}
    killed = "".join(json.dumps({"step": step, **record}) + "\n" for step in (1, 2)) + '{"step": 3, "ep'
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(killed)
    train(tmp_path / "run", *overrides)  # the same command again: no checkpoint, so it starts afresh
    assert logged_twice(tmp_path / "run") == []
    assert logged_steps(tmp_path / "run" / "metrics.jsonl") == logged_steps(tmp_path / "full" / "metrics.jsonl")
    assert same_weights(tmp_path / "full", tmp_path / "run")
    assert (tmp_path / "run" / "metrics.jsonl.1").read_text() == killed  # kept aside, not lost


def test_resume_carries_what_the_checkpoint_counts_on_and_nothing_after(tmp_path):
    """Metrics and snapshots up to the checkpoint's step: into a new directory (copied) or in place
    (the later ones removed); a checkpoint without a line count (older lowmem) keeps steps <= its own."""
    from lowmem.trainer import carry_run_files

    source = tmp_path / "source"
    (source / "snapshots").mkdir(parents=True)
    lines = [{"step": s, "loss": 1.0} for s in range(1, 7)] + [{"step": 6, "final": {"bleu": 1.0}}]
    (source / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for step in (3, 6):
        (source / "snapshots" / f"step_{step:09d}.pt").write_bytes(b"%d" % step)
    checkpoint = {"trainer": {"step": 4}}
    carry_run_files(source, tmp_path / "new", checkpoint)
    carried = (tmp_path / "new" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in carried] == [1, 2, 3, 4]
    assert [p.name for p in (tmp_path / "new" / "snapshots").iterdir()] == ["step_000000003.pt"]
    carry_run_files(source, source, {**checkpoint, "metrics_lines": 2})
    assert len((source / "metrics.jsonl").read_text().splitlines()) == 2
    assert [p.name for p in (source / "snapshots").iterdir()] == ["step_000000003.pt"]


def test_a_precision_change_on_resume_is_refused_naming_the_knob(tmp_path):
    train(tmp_path / "first", *TINY_WRN, "trainer.max_steps=1")
    with pytest.raises(ConfigError, match="precision=fp32.*precision=bf16"):
        train(tmp_path / "second", *TINY_WRN, "precision=bf16", f"trainer.resume={tmp_path / 'first'}")
    with pytest.raises(ConfigError, match="optim.name=sgd"):
        train(tmp_path / "second", *TINY_WRN, "optim.name=adam", f"trainer.resume={tmp_path / 'first'}")


@pytest.mark.slow
def test_dynamicconv_resumed_into_a_new_directory_ends_bit_identical(tmp_path):
    small = (*SMALL_DC, "data.train_size=40", "data.test_size=2", "model.encoder_layers=1", "model.decoder_layers=1",
             "trainer.epochs=2")
    full = train(tmp_path / "full", *small)
    train(tmp_path / "part", *small, "trainer.epochs=1")
    resumed = train(tmp_path / "resumed", *small, f"trainer.resume={tmp_path / 'part'}")
    assert full["averaged_snapshots"] == resumed["averaged_snapshots"] == 2
    assert (full["bleu"], full["steps"]) == (resumed["bleu"], resumed["steps"])
    assert same_weights(tmp_path / "full", tmp_path / "resumed")
    assert sorted(p.name for p in (tmp_path / "resumed" / "snapshots").iterdir()) == sorted(
        p.name for p in (tmp_path / "full" / "snapshots").iterdir()
    )


# --- errors a user can act on; the Pareto plot's two figures ----------------------------------------


def test_a_recipes_missing_data_is_a_refusal():
    from lowmem.run.refusals import is_refusal
    from recipes.wrn_cifar.data import DataUnavailableError

    assert is_refusal(DataUnavailableError("CIFAR-10 is not in data")) and is_refusal(RunRefused("x"))
    assert not is_refusal(RuntimeError("a bug"))


def test_the_pareto_plot_shows_accounted_memory_and_the_measured_peak(monkeypatch):
    from matplotlib.figure import Figure

    from lowmem.report import Row
    from lowmem.report_plot import plot_pareto

    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (drawn.append(self), save(self, *a, **k))[1])
    rows = [Row(config={}, runs=[], memory_bytes=m * 1e6, peak_bytes=int(p * 1e6), mean=acc, seeds=1, family="sparse",
                pareto=True, baseline=acc == 95) for m, p, acc in ((30, 40, 95), (6.9, 15.8, 90))]
    plot_pareto(rows, "test_acc", "demo")
    lines = drawn[0].axes[0].lines
    hollow = [line for line in lines if line.get_markerfacecolor() == "none" and len(line.get_xdata())]
    assert sorted(hollow[0].get_xdata()) == [15.8, 40.0]  # the measured peaks, MB
    joins = [sorted(line.get_xdata()) for line in lines if len(line.get_xdata()) == 2 and line.get_marker() == "None"]
    assert [6.9, 15.8] in joins and [30.0, 40.0] in joins
    labels = drawn[0].axes[0].get_legend_handles_labels()[1]
    assert "accounted memory (filled)" in labels and "measured peak (hollow, joined)" in labels
