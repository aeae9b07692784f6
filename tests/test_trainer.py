"""The trainer through its public entry points: run files, resume, bad input, logging."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lowmem.config import ConfigError
from lowmem.train import run
from tests.helpers import ROOT, TINY_WRN, make_config

RUN_FILES = ("result.json", "metrics.jsonl", "model.pt", "checkpoint.pt")


def train(run_dir: Path, *overrides: str) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    return run(make_config(*TINY_WRN, *overrides), run_dir)


def test_cli_writes_every_run_file(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "lowmem.train", *TINY_WRN, "trainer.max_steps=2", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for name in (*RUN_FILES, ".hydra/config.yaml"):
        assert (tmp_path / name).exists(), name
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["steps"] == 2 and 0 <= result["final_test_acc"] <= 100
    assert {"best_test_acc", "final_test_acc", "wall_s", "peak_bytes", "provenance"} <= set(result)
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert "fc.weight" in state and all(isinstance(v, torch.Tensor) for v in state.values())
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("test_acc" in line for line in lines)


def test_cli_bad_batch_size_names_the_knob(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "lowmem.train", *TINY_WRN, "data.batch_size=-3", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "data.batch_size=-3" in out.stderr + out.stdout


def test_resume_ends_bit_identical_to_an_uninterrupted_run(tmp_path):
    common = ("trainer.epochs=3", "trainer.seed=3")
    train(tmp_path / "full", *common)
    train(
        tmp_path / "part", *common, "trainer.max_steps=4"
    )  # stops in the middle of epoch 2 (3 batches/epoch)
    train(tmp_path / "resumed", *common, f"trainer.resume={tmp_path / 'part'}")
    full = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed" / "model.pt", weights_only=True)
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
    a = json.loads((tmp_path / "full" / "result.json").read_text())
    b = json.loads((tmp_path / "resumed" / "result.json").read_text())
    # (best_test_acc may differ: the interrupted run also evaluated where it stopped, mid-epoch.)
    assert (a["steps"], a["final_test_acc"]) == (b["steps"], b["final_test_acc"])
    history = (tmp_path / "resumed" / "metrics.jsonl").read_text()
    assert history.startswith((tmp_path / "part" / "metrics.jsonl").read_text())
    # The resumed process measures its own first step; the run keeps the larger measured peak.
    part = json.loads((tmp_path / "part" / "result.json").read_text())
    assert b["peak_bytes"] is not None and b["peak_bytes"] >= part["peak_bytes"] > 0


def test_resume_pointing_at_nothing_names_the_knob(tmp_path):
    with pytest.raises(ConfigError, match="trainer.resume"):
        train(tmp_path / "run", f"trainer.resume={tmp_path / 'nothing'}")


def test_data_of_another_recipe_lists_the_allowed_names(tmp_path):
    cfg = make_config(*TINY_WRN)
    cfg.data.name = "iwslt14"
    with pytest.raises(ConfigError, match="digits"):
        run(cfg, tmp_path)


def test_unknown_model_knob_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="model.depht"):
        train(tmp_path / "run", "+model.depht=16", "trainer.max_steps=1")


def test_epochs_and_steps_are_counted_and_the_training_loss_decreases(tmp_path):
    result = train(tmp_path / "run", "trainer.epochs=4", "trainer.log_every=1")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if "test_loss" in x]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert result["steps"] == 12 and result["updates"] == 12 and len(evals) == 4 and len(losses) == 12
    assert sum(losses[-3:]) < sum(losses[:3])


def test_wandb_offline_run_holds_the_logged_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(tmp_path / "run", "logger=wandb", "trainer.max_steps=2", "trainer.log_every=1")
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*/*.wandb"))
    assert len(runs) == 1
    # The offline run is a protobuf log whose history items hold each value as a JSON string. The
    # wandb-core service process may still be flushing it when finish() returns: wait briefly.
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = metrics[-1]
    # (test_loss: a non-integral float, written the same by Python and by wandb's Go core.)
    wanted = [b"test_acc", b"test_loss", json.dumps(final["test_loss"]).encode()]
    deadline = time.monotonic() + 10
    while not all(w in runs[0].read_bytes() for w in wanted) and time.monotonic() < deadline:
        time.sleep(0.5)
    raw = runs[0].read_bytes()
    assert all(w in raw for w in wanted), [w for w in wanted if w not in raw]


def test_rerunning_a_finished_run_skips_it_and_another_config_is_refused(tmp_path):
    first = train(tmp_path / "run", "trainer.max_steps=1")
    before = (tmp_path / "run" / "model.pt").read_bytes()
    again = train(tmp_path / "run", "trainer.max_steps=1")
    assert again["wall_s"] == first["wall_s"] and (tmp_path / "run" / "model.pt").read_bytes() == before
    with pytest.raises(ConfigError, match="different configuration"):
        train(tmp_path / "run", "trainer.max_steps=2")
    assert (tmp_path / "run" / "model.pt").read_bytes() == before


def test_a_refused_or_skipped_rerun_leaves_the_runs_hydra_record_as_it_was(tmp_path):
    """Hydra writes .hydra/*.yaml before lowmem sees the job: the callback puts them back."""

    def cli(*overrides: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "lowmem.train", *TINY_WRN, *overrides, f"hydra.run.dir={tmp_path}"]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)

    assert cli("trainer.max_steps=1").returncode == 0
    record = {p.name: p.read_bytes() for p in (tmp_path / ".hydra").glob("*.yaml")}
    assert set(record) == {"config.yaml", "hydra.yaml", "overrides.yaml"}
    refused = cli("trainer.max_steps=2")
    assert refused.returncode != 0 and "different configuration" in refused.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / ".hydra").glob("*.yaml")} == record
    skipped = cli("trainer.max_steps=1", "trainer.progress=none")  # the same run, asked again
    assert skipped.returncode == 0 and "skipped" in skipped.stderr + skipped.stdout
    assert {p.name: p.read_bytes() for p in (tmp_path / ".hydra").glob("*.yaml")} == record


def test_an_interrupted_run_is_continued_when_rerun(tmp_path):
    train(tmp_path / "full", "trainer.epochs=2")
    train(tmp_path / "run", "trainer.epochs=2")
    (tmp_path / "run" / "result.json").unlink()  # as if killed after its last checkpoint
    result = train(tmp_path / "run", "trainer.epochs=2")
    assert result["steps"] == 6
    full = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    rerun = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert all(torch.equal(full[k], rerun[k]) for k in full)


def test_a_checkpoint_records_its_optimizer_kernels_and_a_resume_across_triton_says_so(caplog):
    from lowmem.trainer import build_trainer

    trainer = build_trainer(make_config(*TINY_WRN, "precision=bf16", "trainer.device=cpu"))
    state = trainer.checkpoint_state()
    assert state["optimizer_kernels"] in ("cpu", "torch")  # the C kernel, or the fallback without a compiler
    trainer.load_checkpoint(state)  # the same path: nothing said
    assert "optimizer updates ran on" not in caplog.text
    state["optimizer_kernels"] = "triton"
    with caplog.at_level(logging.WARNING, logger="lowmem"):
        trainer.load_checkpoint(state)
    assert "optimizer updates ran on triton" in caplog.text
