"""Writes are atomic: a failure while writing leaves the previous file intact and no temp files."""

import json

import pytest
import torch

from lowmem.run.files import measured_on, save_json, save_torch, set_aside_metrics


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "result.json"
    save_json({"acc": 1}, path)

    class Unserialisable:
        def __repr__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        save_json({"acc": Unserialisable()}, path)
    assert json.loads(path.read_text()) == {"acc": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_torch_save_round_trip_is_weights_only_loadable(tmp_path):
    path = tmp_path / "model.pt"
    save_torch({"w": torch.arange(3.0)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(3.0))


def test_a_benchmark_header_says_when_with_which_torch_and_on_which_device():
    header = measured_on("cpu")
    assert header.startswith("measured 20") and "\n" not in header
    assert f"torch {torch.__version__}" in header
    assert f"capability {torch.backends.cpu.get_cpu_capability()}" in header


def test_metrics_set_aside_take_the_first_free_number(tmp_path):
    assert set_aside_metrics(tmp_path) is None  # nothing there
    (tmp_path / "metrics.jsonl").write_text("")
    assert set_aside_metrics(tmp_path) is None  # nothing logged: nothing to keep
    for number, text in ((1, "a\n"), (2, "b\n")):
        (tmp_path / "metrics.jsonl").write_text(text)
        assert set_aside_metrics(tmp_path) == tmp_path / f"metrics.jsonl.{number}"
        assert (tmp_path / f"metrics.jsonl.{number}").read_text() == text
        assert not (tmp_path / "metrics.jsonl").exists()
