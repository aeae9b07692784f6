"""lowmem.report: grouping, statistics, the Pareto table and plot; end to end through the CLI.

Synthetic results carry "memory" (the report's accounting), so only the end-to-end tests touch
the profiler.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import lowmem.profile
from lowmem.report import mean_confidence, pareto_flags, write_report
from lowmem.run.files import save_json
from tests.helpers import ROOT

# t_{0.975, df} from a printed Student-t table (df = seeds - 1).
T975 = {1: 12.706204736174696, 2: 4.302652729911275, 4: 2.7764451051977987}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TABLE6_LR = {1.0: 0.5, 0.3: 1.0, 0.2: 1.0, 0.1: 0.5}


def make_result(
    *,
    density: float = 1.0,
    precision: str = "fp32",
    microbatch: int | None = None,
    checkpointing: tuple[str, int] = ("none", 1),
    model: tuple[int, int] = (28, 2),
    seed: int = 0,
    acc: float | None = 94.0,
    memory: float | None = 1e8,
    peak: int = 2_000_000,
    lr_mult: float | None = None,
    **extra,
) -> dict:
    """A result.json as the trainer writes it (the keys the report reads)."""
    config = {
        "recipe": "wrn_cifar",
        "data": {"name": "cifar10", "root": "data", "batch_size": 100},
        "model": {"depth": model[0], "width": model[1]},
        "optim": {"lr": 0.1, "lr_mult": None, "milestones": [60, 120, 160]},
        "sparsity": {"density": density, "rewire_fraction_mult": None},
        "precision": {"name": precision},
        "microbatch": {"size": microbatch, "mode": "true"},
        "checkpointing": {"strategy": checkpointing[0], "every": checkpointing[1]},
        "trainer": {"seed": seed, "resume": None, "max_steps": None},
        "logger": {"name": "none"},
    }
    result = {
        "best_test_acc": acc,
        "final_test_acc": acc,
        "peak_bytes": peak,
        "lr_mult": lr_mult if lr_mult is not None else TABLE6_LR.get(density, 0.5),
        "config": config,
        "provenance": {"device": "cpu"},
        **extra,
    }
    if memory is not None:
        result["memory"] = {"total_bytes": memory, "model_bytes": memory / 4}
    return result


def write_runs(root: Path, runs: dict[str, dict]) -> None:
    for name, result in runs.items():
        save_json(result, root / name / "result.json")


def table(markdown: str) -> list[list[str]]:
    """The configuration rows of pareto.md as lists of cells, without the header, the rule and the
    row-number column."""
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")][1:] for line in rows[2:]]


FP16_CKPT = {"precision": "fp16", "checkpointing": ("residual_star", 2)}


@pytest.fixture
def table3_like(tmp_path: Path) -> Path:
    """Six configurations; seeds differ in the dropped keys (seed, logger, data.root, lr_mult
    left to the default or set to the same value) and must still group together."""
    runs: dict[str, dict] = {}
    for seed, acc in enumerate([94.0, 94.6, 94.3]):  # A: the FP32 baseline
        result = make_result(seed=seed, acc=acc, memory=400e6, peak=900_000_000 + seed)
        result["config"]["logger"]["name"] = ["none", "wandb", "none"][seed]
        result["config"]["data"]["root"] = f"/data/{seed}"
        if seed == 1:
            result["config"]["optim"]["lr_mult"] = 0.5  # explicit, equal to the table default
        runs[f"a/seed{seed}"] = result
    for seed, acc in enumerate([94.1, 94.3]):  # B
        runs[f"b/{seed}"] = make_result(microbatch=10, seed=seed, acc=acc, memory=12e6, **FP16_CKPT)
    for seed, acc in enumerate([93.8, 94.0, 93.9, 94.1, 93.95]):  # C
        runs[f"c/{seed}"] = make_result(
            density=0.3, microbatch=10, seed=seed, acc=acc, memory=6.7e6, **FP16_CKPT
        )
    runs["d/0"] = make_result(density=0.2, microbatch=10, acc=93.5, memory=8e6, **FP16_CKPT)  # dominated by C
    for seed, acc in enumerate([91.75, 91.85]):  # E: the least memory
        runs[f"e/{seed}"] = make_result(
            density=0.1, microbatch=4, seed=seed, acc=acc, memory=2.5e6, **FP16_CKPT
        )
    runs["f/0"] = make_result(density=0.2, microbatch=4, acc=91.0, memory=2.5e6, **FP16_CKPT)  # tie with E
    write_runs(tmp_path, runs)
    return tmp_path


def test_table_values_exactly(table3_like: Path):
    write_report(table3_like)
    half_a = T975[2] * 0.3 / math.sqrt(3)  # s = 0.3 for 94.0, 94.6, 94.3
    half_b = T975[1] * math.sqrt(0.02) / math.sqrt(2)  # s = sqrt(0.02)
    half_c = T975[4] * math.sqrt(0.05 / 4) / math.sqrt(5)  # squared deviations sum to 0.05
    half_e = T975[1] * math.sqrt(0.005) / math.sqrt(2)
    assert [f"{h:.2f}" for h in (half_a, half_b, half_c, half_e)] == ["0.75", "1.27", "0.14", "0.64"]
    stack = "fp16, microbatch {} (true), residual_star/2"
    assert table((table3_like / "pareto.md").read_text()) == [
        [
            "density 1.0, fp32, no microbatching, no checkpointing, lr ×0.5",
            "400.00 MB",
            "900.00 MB (cpu)",
            "1.0x",
            "94.30 ± 0.75",
            "3",
            "✓",
        ],
        [
            f"density 1.0, {stack.format(10)}, lr ×0.5",
            "12.00 MB",
            "2.00 MB (cpu)",
            "33.3x",
            "94.20 ± 1.27",
            "2",
            "✓",
        ],
        [
            f"density 0.2, {stack.format(10)}, lr ×1",
            "8.00 MB",
            "2.00 MB (cpu)",
            "50.0x",
            "93.50 ± n/a",
            "1",
            "",
        ],
        [
            f"density 0.3, {stack.format(10)}, lr ×1",
            "6.70 MB",
            "2.00 MB (cpu)",
            "59.7x",
            "93.95 ± 0.14",
            "5",
            "✓",
        ],
        [
            f"density 0.1, {stack.format(4)}, lr ×0.5",
            "2.50 MB",
            "2.00 MB (cpu)",
            "160.0x",
            "91.80 ± 0.64",
            "2",
            "✓",
        ],
        [
            f"density 0.2, {stack.format(4)}, lr ×1",
            "2.50 MB",
            "2.00 MB (cpu)",
            "160.0x",
            "91.00 ± n/a",
            "1",
            "",
        ],
    ]


def test_rows_carry_the_numbers(table3_like: Path):
    rows, metric = write_report(table3_like)
    assert metric == "best_test_acc" and len(rows) == 6
    baseline = rows[0]
    assert baseline.baseline and baseline.seeds == 3 and baseline.peak_bytes == 900_000_002
    assert baseline.mean == pytest.approx(94.3) and baseline.half_width == pytest.approx(
        T975[2] * 0.3 / math.sqrt(3)
    )
    assert rows[3].reduction == pytest.approx(400 / 6.7)
    assert [row.pareto for row in rows] == [True, True, False, True, True, False]


def test_png_is_written_and_valid(table3_like: Path, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    write_report(table3_like, out=out)
    png = (out / "pareto.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    import matplotlib.image

    height, width = matplotlib.image.imread(out / "pareto.png").shape[:2]
    assert (width, height) == (1200, 825)  # 8 x 5.5 inches at 150 dpi
    assert (out / "pareto.md").is_file() and not (table3_like / "pareto.md").exists()
    assert not list(out.glob(".*.tmp")), "atomic writes leave no temporary files"


def report_cli(directory: Path, timeout: float) -> subprocess.CompletedProcess:
    """``python -m lowmem.report directory``, as a user runs it."""
    command = [sys.executable, "-m", "lowmem.report", str(directory)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_cli_prints_the_table(table3_like: Path):
    out = report_cli(table3_like, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("| density ") == 6 and "94.30 ± 0.75" in out.stdout


def test_baseline_selector(table3_like: Path):
    rows, _ = write_report(table3_like, baseline=["sparsity.density=1.0", "microbatch.size=10"])
    assert [row.baseline for row in rows] == [False, True, False, False, False, False]
    assert [f"{row.reduction:.3g}" for row in rows] == ["0.03", "1", "1.5", "1.79", "4.8", "4.8"]
    assert "| 0.03x |" in (table3_like / "pareto.md").read_text()
    with pytest.raises(SystemExit, match="matches 2 configurations"):
        write_report(table3_like, baseline=["microbatch.size=10", "precision.name=fp16", "optim.lr_mult=1"])
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        write_report(table3_like, baseline=["fp32"])


def test_mean_confidence_and_pareto_rules():
    mean, half = mean_confidence([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0 and half == pytest.approx(T975[4] * math.sqrt(2.5) / math.sqrt(5))
    assert mean_confidence([7.0]) == (7.0, None)
    # memory, metric: (2, 5) dominates (3, 5) (less memory, equal metric) and (2, 4) (equal memory).
    points = [(2.0, 5.0), (3.0, 5.0), (2.0, 4.0), (1.0, 1.0), (5.0, 6.0), (4.0, math.nan), (2.0, 5.0)]
    assert pareto_flags(points) == [True, False, False, True, True, False, True]


def test_families_and_model_labels(tmp_path: Path):
    write_runs(
        tmp_path,
        {
            "dense": make_result(memory=40e6, acc=94.0),
            "sparse": make_result(density=0.5, memory=20e6, acc=93.9),
            "narrow": make_result(model=(28, 1), memory=15e6, acc=93.0),
            "shallow": make_result(model=(10, 2), memory=10e6, acc=92.0),
            "tagged": make_result(model=(16, 2), memory=12e6, acc=92.5, family="my family"),
        },
    )
    rows, _ = write_report(tmp_path)
    assert [(row.label, row.family) for row in rows] == [
        ("density 1.0, depth 28, width 2", "dense"),
        ("density 0.5, depth 28, width 2", "sparse"),
        ("density 1.0, depth 28, width 1", "narrow"),
        ("density 1.0, depth 16, width 2", "my family"),
        ("density 1.0, depth 10, width 2", "shallow"),
    ]


def test_metric_choice(tmp_path: Path):
    bleu = make_result(acc=None, memory=5e6, bleu=34.5)
    del bleu["best_test_acc"], bleu["final_test_acc"]
    write_runs(tmp_path / "dc", {"a": bleu, "b": {**bleu, "bleu": 35.5}})
    rows, metric = write_report(tmp_path / "dc")
    assert metric == "bleu" and rows[0].mean == 35.0 and rows[0].seeds == 2
    # One configuration: the label names the technique knobs anyway.
    assert rows[0].label == "density 1.0, fp32, no microbatching, no checkpointing"
    # A loss is better when lower: the configuration with the larger loss is dominated.
    loss = {**bleu, "best_valid_loss": 4.0}
    write_runs(
        tmp_path / "loss",
        {"a": loss, "b": make_result(density=0.5, acc=None, memory=4e6, best_valid_loss=3.0)},
    )
    rows, _ = write_report(tmp_path / "loss", metric="best_valid_loss")
    assert [(row.mean, row.pareto) for row in rows] == [(4.0, False), (3.0, True)]
    assert "best_valid_loss ≤" in (tmp_path / "loss" / "pareto.md").read_text()
    write_runs(tmp_path / "wrn", {"a": make_result(acc=90.0)})
    assert write_report(tmp_path / "wrn", metric="final_test_acc")[1] == "final_test_acc"
    with pytest.raises(SystemExit, match="no result has it"):
        write_report(tmp_path / "wrn", metric="bleu")
    with pytest.raises(SystemExit, match="no result.json"):
        write_report(tmp_path / "empty")


def test_memory_from_the_profiler_once_per_configuration(tmp_path: Path, monkeypatch):
    write_runs(
        tmp_path,
        {
            f"{density}/{seed}": make_result(density=density, seed=seed, memory=None)
            for density in (1.0, 0.3)
            for seed in range(3)
        },
    )
    calls = []

    def profile_config(cfg, measure=True):
        assert not measure  # the accounting only: the measured peak comes from the runs
        calls.append(cfg)
        return {"total_bytes": 1e8 * cfg.sparsity.density}

    monkeypatch.setattr(lowmem.profile, "profile_config", profile_config)
    rows, _ = write_report(tmp_path)
    assert [row.memory_bytes for row in rows] == [1e8, 3e7] and len(calls) == 2
    # The profiler gets the typed schema, with the knobs of the configuration.
    assert calls[0].precision.name == "fp32" and calls[0].trainer.epochs == 200


def test_missing_profiler_is_a_clear_error(tmp_path: Path, monkeypatch):
    write_runs(tmp_path, {"a": make_result(memory=None)})
    monkeypatch.setitem(sys.modules, "lowmem.profile", types.ModuleType("lowmem.profile"))
    with pytest.raises(SystemExit, match="no 'memory' and lowmem.profile.profile_config is not available"):
        write_report(tmp_path)


# --- end to end: the trainer's own result files -----------------------------------------------------
TINY = ("model.depth=10", "model.width=1", "data.batch_size=20", "data.train_size=40", "data.test_size=20")


@pytest.fixture(scope="module")
def trained_sweep(tmp_path_factory) -> Path:
    """Two tiny configurations (density 1.0 and 0.3), one step each, through the CLI multirun."""
    sweep = tmp_path_factory.mktemp("sweep")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lowmem.train",
            "-m",
            "+recipe=wrn_cifar",
            "data=fake",
            "trainer.max_steps=1",
            "sparsity.density=1.0,0.3",
            *TINY,
            "trainer.progress=none",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return sweep


def test_real_results_with_a_stub_profiler(trained_sweep: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(lowmem.profile, "profile_config", lambda cfg: {"total_bytes": 4e6 * cfg.sparsity.density})
    rows, metric = write_report(trained_sweep, out=tmp_path)
    assert metric == "best_test_acc"
    assert [row.label for row in rows] == ["density 1.0, lr ×0.5", "density 0.3, lr ×1"]
    assert all(row.seeds == 1 and row.half_width is None and row.peak_bytes for row in rows)
    assert [row.devices for row in rows] == [("cpu",), ("cpu",)]
    assert [row.family for row in rows] == ["dense", "sparse"]


def test_cli_end_to_end(trained_sweep: Path):
    out = report_cli(trained_sweep, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    markdown = (trained_sweep / "pareto.md").read_text()
    assert len(table(markdown)) == 2
    assert len(re.findall(r"(?m)^\|.*(0\.3|30 ?%|1\.0|100 ?%)", markdown)) >= 2
    assert (trained_sweep / "pareto.png").read_bytes().startswith(PNG_SIGNATURE)
