"""What the measured peak holds and what keeps it low: evaluation no larger than a training
microbatch, the data set's place, library workspaces, and refusals that protect a compact run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lowmem.config import ConfigError, compose, validate
from lowmem.libraries import CAPPED, configure_libraries, library_environment
from lowmem.profiler import profile_trainer, track_peak
from lowmem.train import run
from lowmem.trainer import build_trainer
from tests.helpers import SMALL_DC, TINY_WRN


def train(run_dir: Path, *overrides: str) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    return run(compose(*overrides), run_dir)


# --- evaluation never costs more than training ------------------------------------------------------


def test_wrn_evaluation_batches_are_no_larger_than_a_training_microbatch():
    plain = build_trainer(compose(*TINY_WRN, "data.eval_batch_size=500"))
    assert {len(labels) for _, labels in plain.data.test.epoch(0)} == {20}  # the whole test set at once
    microbatched = build_trainer(compose(*TINY_WRN, "data.eval_batch_size=500", "microbatch.size=6"))
    sizes = [len(labels) for _, labels in microbatched.data.test.epoch(0)]
    assert max(sizes) == 6 and sum(sizes) == 20  # every test image, the last chunk short


def test_translation_evaluation_batches_hold_at_most_a_microbatch_of_tokens():
    trainer = build_trainer(compose(*SMALL_DC, "microbatch.size=200", "data.eval_batch_size=4000"))
    for name in ("valid", "test"):
        batches = trainer.data.test[name]
        assert len(batches) > 1
        budget = max(200, batches.longest_pair)  # a pair longer than the microbatch still fits alone
        for batch in batches.epoch(0):
            rows = batch["target"].shape[0]
            assert rows * max(batch["src_tokens"].shape[1], batch["target"].shape[1]) <= budget


def test_a_microbatched_run_measures_less_than_one_evaluating_the_whole_test_set(tmp_path):
    common = (*TINY_WRN, "data.test_size=200", "data.eval_batch_size=200", "trainer.max_steps=1")
    whole = train(tmp_path / "whole", *common)
    chunked = train(tmp_path / "chunked", *common, "microbatch.size=5")
    assert chunked["peak_bytes"] < whole["peak_bytes"]


# --- where the data set lives ------------------------------------------------------------------------


def test_data_device_cpu_on_a_cpu_run_changes_nothing(tmp_path):
    train(tmp_path / "auto", *TINY_WRN, "trainer.max_steps=2")
    train(tmp_path / "cpu", *TINY_WRN, "trainer.max_steps=2", "data.device=cpu")
    a = torch.load(tmp_path / "auto" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "cpu" / "model.pt", weights_only=True)
    assert all(torch.equal(a[key], b[key]) for key in a)


def test_an_unknown_data_device_names_the_knob():
    with pytest.raises(ConfigError, match=r"data.device='gpu'.*auto, cpu"):
        validate(compose(*TINY_WRN, "data.device=gpu"))


def test_the_breakdown_names_the_data_set_and_the_minibatch():
    with track_peak(device="cpu") as idle:  # tensors other tests left alive in this process
        pass
    trainer = build_trainer(compose(*TINY_WRN))
    report = profile_trainer(trainer)
    resident = sum(t.nbytes for t in trainer.data.resident)
    assert report.peak_breakdown["data"] >= resident > 0
    # Everything of the run alive at the start has a name: "other" holds only what was there before.
    assert report.peak_breakdown["other"] <= idle.start_bytes
    assert report.peak_breakdown["workspaces"] == 0  # CPU kernels' scratch is invisible


# --- library workspaces and determinism ----------------------------------------------------------------


def test_capped_workspaces_set_the_libraries_environment_without_overriding_the_user(monkeypatch):
    for name in CAPPED:  # set, then removed: monkeypatch restores the environment afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("CUDNN_CONV_WSCAP_DBG", "64")  # the user's own choice stays
    in_force = configure_libraries(torch.device("cpu"), "capped", deterministic=False)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert in_force["CUDNN_CONV_WSCAP_DBG"] == "64"
    assert library_environment("default", deterministic=True) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert library_environment("default", deterministic=False) == {}


def test_a_deterministic_cuda_run_refuses_an_irreproducible_cublas_setting(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":1024:2")
    with pytest.raises(ValueError, match=r"trainer.deterministic=true.*CUBLAS_WORKSPACE_CONFIG=:1024:2"):
        configure_libraries(torch.device("cuda"), "default", deterministic=True)
    configure_libraries(torch.device("cpu"), "default", deterministic=True)  # CPU: cuBLAS plays no part
    configure_libraries(torch.device("cpu"))  # back to the default for the tests that follow


def test_an_unknown_workspace_setting_names_the_knob():
    with pytest.raises(ConfigError, match=r"trainer.workspaces='tiny'.*default, capped"):
        validate(compose(*TINY_WRN, "trainer.workspaces=tiny"))


def test_a_deterministic_run_switches_torch_to_deterministic_algorithms_and_back(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # restored afterwards
    build_trainer(compose(*TINY_WRN, "trainer.deterministic=true"))
    assert torch.are_deterministic_algorithms_enabled()
    build_trainer(compose(*TINY_WRN))
    assert not torch.are_deterministic_algorithms_enabled()


# --- a compact checkpoint resumes only as what it is ----------------------------------------------------


@pytest.mark.parametrize(("knob", "other"), [("density", "0.3"), ("storage", "masked")])
def test_resuming_a_compact_checkpoint_with_another_sparsity_names_the_knob(tmp_path, knob, other):
    train(tmp_path / "first", *TINY_WRN, "sparsity.density=0.5", "trainer.max_steps=1")
    overrides = {"density": "0.5", "storage": "compact", knob: other}
    with pytest.raises(ConfigError, match=rf"sparsity.{knob}"):
        train(
            tmp_path / "second", *TINY_WRN, f"sparsity.density={overrides['density']}",
            f"sparsity.storage={overrides['storage']}", f"trainer.resume={tmp_path / 'first'}",
        )


# --- the Triton optimizer's device tables ------------------------------------------------------------


def test_the_triton_tables_are_reused_while_unchanged_replaced_at_a_rewiring_and_bounded():
    triton_kernels = pytest.importorskip("lowmem.kernels.triton_kernels")
    triton_kernels._tables.clear()
    cpu = torch.device("cpu")
    slot = ("sgd", cpu, 2, torch.float16)
    first = triton_kernels._table(slot, [[1, 2], [3, 4]], cpu)
    chunks = triton_kernels._chunks(slot, (1500, 10), cpu)
    assert triton_kernels._table(slot, [[1, 2], [3, 4]], cpu) is first  # no new copy to the device
    assert triton_kernels._chunks(slot, (1500, 10), cpu) is chunks
    assert chunks[0].tolist() == [0, 0, 1] and chunks[1].tolist() == [0, 1024, 0]
    moved = triton_kernels._table(slot, [[5, 6], [3, 4]], cpu)  # a rewiring moved the weights
    assert moved is not first and moved.tolist() == [5, 6, 3, 4]
    assert len(triton_kernels._tables) == 2  # the old table is no longer held
    for count in range(3 * triton_kernels.MAX_TABLE_SLOTS):
        triton_kernels._table(("adam", cpu, count, torch.bfloat16), [[count]], cpu)
    assert len(triton_kernels._tables) == triton_kernels.MAX_TABLE_SLOTS
    triton_kernels._tables.clear()


# --- the CUDA graphs' memory pool counts in the measured peak ------------------------------------------


def test_the_graph_pool_held_idle_counts_in_the_measured_peak(monkeypatch):
    from lowmem.profiler.peak import graph_pool_bytes
    from lowmem.trainer import PeakTracker

    segments = [  # the default pool, a graph pool with 6 MB idle, a graph pool on another device
        {"device": 0, "total_size": 20_000_000, "allocated_size": 5_000_000, "segment_pool_id": (0, 0)},
        {"device": 0, "total_size": 8_000_000, "allocated_size": 2_000_000, "segment_pool_id": (1, 1)},
        {"device": 1, "total_size": 8_000_000, "allocated_size": 0, "segment_pool_id": (1, 2)},
    ]
    assert graph_pool_bytes(torch.device("cuda", 0), segments) == 6_000_000
    assert graph_pool_bytes(torch.device("cpu")) == 0
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 30_000_000)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    trainer = type("FakeTrainer", (), {"device": torch.device("cuda", 0)})()
    tracker = PeakTracker(trainer)
    assert tracker.peak_bytes == 36_000_000 and "graph pool" in tracker.scope
