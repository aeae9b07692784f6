"""``make gpu-report`` (scripts/gpu_report.py): its parts run at toy shapes on CPU and the report is written."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ROOT, load_script


@pytest.fixture(scope="module")
def gpu_report():
    return load_script("gpu_report")


@pytest.mark.slow
def test_the_report_is_written_with_every_part_and_its_provenance(gpu_report, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    chosen = gpu_report.parts(True, tmp_path, check_only=["profile table 3 t3_d10_mb4"], bench_only=["lowmem FP32"],
                              demo_baseline_only=True)
    assert [p.title for p in chosen] == ["gpu-check", "benchmark: default library workspaces",
                                         "benchmark: capped library workspaces", "demo"]
    assert "--tiny" in chosen[3].args and "--only-baseline" in chosen[3].args
    out = tmp_path / "report" / "r.md"
    # The demo's runs take as long as the rest together: `make gpu-report TINY=1` runs it (the acceptance check).
    assert gpu_report.write_report(out, "make gpu-report TINY=1", True, chosen[:3])
    report = out.read_text()
    assert "`make gpu-report TINY=1`" in report and f"torch {torch.__version__}" in report
    assert "no CUDA device on this machine" in report
    assert "PASS profile table 3 t3_d10_mb4" in report
    assert "| lowmem FP32 (no technique) |" in report and "capped library workspaces;" in report
    assert "## library workspaces: default against capped" in report


def test_a_part_that_fails_or_runs_out_of_time_is_reported_and_the_rest_still_run(gpu_report, tmp_path):
    chosen = [
        gpu_report.Part("sleeper", ["-c", "import time; print('started', flush=True); time.sleep(30)"], 3),
        gpu_report.Part("broken", ["-c", "raise SystemExit('no such device')"], 30),
        gpu_report.Part("fine", ["-c", "print('all good')"], 30),
    ]
    out = tmp_path / "r.md"
    assert not gpu_report.write_report(out, "test", True, chosen)
    report = out.read_text()
    assert "| sleeper | timed out after 3 s |" in report and "started" in report
    assert "| broken | failed (exit 1) |" in report and "no such device" in report
    assert "| fine | ok |" in report and "all good" in report


def test_the_default_path_names_the_date_and_device(gpu_report, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    path = gpu_report.default_out(tiny=False)
    assert path.parent == ROOT / "docs" / "measurements" and path.name.endswith("-nvidia-h100-80gb-hbm3.md")
