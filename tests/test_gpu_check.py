"""``make gpu-check`` (scripts/gpu_check.py): its cases run on CPU at toy shapes, so the script itself is tested."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import load_script


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


def test_without_cuda_it_says_so_and_exits_0(gpu_check, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_every_technique_under_one_precision_passes_on_cpu(gpu_check, capsys):
    assert gpu_check.main(["--device", "cpu", "--tiny", "--only", "wrn_cifar/fake bf16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    passed = [line for line in lines if line.startswith("PASS train wrn_cifar/fake bf16")]
    assert len(passed) == len(gpu_check.techniques("wrn_cifar"))


def test_a_refused_combination_is_not_applicable_and_a_broken_one_fails(gpu_check, capsys, monkeypatch):
    assert gpu_check.main(["--device", "cpu", "--tiny", "--only", "dc_iwslt/fake fp32 ckpt-no_bn"]) == 0
    assert "N/A  train dc_iwslt/fake fp32 ckpt-no_bn" in capsys.readouterr().out

    def broken(overrides, steps=3):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu_check, "train_steps", broken)
    assert gpu_check.main(["--device", "cpu", "--tiny", "--only", "wrn_cifar/fake fp32 plain"]) == 1
    out = capsys.readouterr().out
    assert "FAIL train wrn_cifar/fake fp32 plain" in out and "illegal memory access" in out


def test_the_table_profiles_match_the_cpu_accounting(gpu_check, capsys):
    assert gpu_check.main(["--device", "cpu", "--tiny", "--only", "profile table 3 t3_d10_mb4"]) == 0
    assert "PASS profile table 3 t3_d10_mb4" in capsys.readouterr().out
