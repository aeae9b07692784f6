"""Writes are atomic: a failure while writing leaves the previous file intact and no temp files."""

import json

import pytest
import torch

from lowmem.run.files import measured_on, save_json, save_torch


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
