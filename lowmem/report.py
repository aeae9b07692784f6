"""``python -m lowmem.report <sweep dir> [--out DIR] [--metric KEY] [--baseline KEY=VALUE ...]``

Turns a directory of finished runs into the report's Pareto table (``pareto.md``) and plot
(``pareto.png``), and prints the table.

Runs: every ``result.json`` below the directory, at any depth.

Configurations: runs are grouped by their ``result["config"]``, flattened to dotted keys, after

- dropping what does not change what a run computes or what varies inside a group:
  ``trainer.seed`` (the replicate), ``trainer.resume``, ``trainer.progress``,
  ``trainer.log_every``, ``trainer.num_threads``, every ``logger.*`` key, ``data.root`` and any
  ``hydra*`` key;
- replacing ``optim.lr_mult`` by the multiplier the run actually used (``result["lr_mult"]``), so
  a multiplier left to the table default and the same multiplier set explicitly are one
  configuration.

Columns, one row per configuration, sorted by accounted memory (largest first):

- #: the row number, which also marks the Pareto-optimal points of the plot;
- configuration: the knobs whose values differ between configurations;
- accounted memory: the report's accounting (SPEC §4: model + optimizer + activations) in MB
  (1 MB = 1e6 bytes): ``result["memory"]["total_bytes"]`` when the results carry it, otherwise
  ``lowmem.profile.profile_config(config)``, called once per configuration;
- measured peak: the largest ``result["peak_bytes"]`` over the seeds, in MB, with the device;
- reduction: baseline accounted memory / accounted memory. The baseline is the configuration
  with the largest accounted memory, or the one ``--baseline`` selects;
- the metric: mean ± the 95% confidence half-width over seeds,
  t_{0.975, n-1} · s / √n (Student t, s the sample standard deviation; "± n/a" for one seed);
- seeds: the number of runs that report the metric;
- Pareto: ✓ when no other configuration has memory ≤ and a metric at least as good, one of them
  strictly. Metrics are better when higher, except losses and perplexities (names containing
  "loss" or "ppl", e.g. DynamicConv's best_valid_loss).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lowmem.run.files import RESULT, save_bytes

log = logging.getLogger("lowmem.report")

MEGABYTE = 1e6  # the report's MB
DROPPED_KEYS = frozenset(
    {"trainer.seed", "trainer.resume", "trainer.progress", "trainer.log_every", "trainer.num_threads"}
    | {"data.root"}
)
DROPPED_PREFIXES = ("logger.", "hydra")
# The first of these that the results contain is the default metric: WRN's best test accuracy
# (the report quotes best-over-epochs), then DynamicConv's BLEU.
METRIC_PREFERENCE = ("best_test_acc", "bleu", "best_bleu")
LOWER_IS_BETTER_WORDS = ("loss", "ppl")
WIDTH_WORDS = ("width", "dim")  # model.* keys that make a model narrower when smaller
DEPTH_WORDS = ("depth", "layers")  # ... and shallower
# Labelled in the report's words by `describe`; other differing keys are shown as key=value.
TECHNIQUE_KEYS = frozenset(
    {"sparsity.density", "precision.name", "microbatch.size", "checkpointing.strategy"}
)
DESCRIBED_KEYS = TECHNIQUE_KEYS | {
    "microbatch.mode",
    "checkpointing.every",
    "optim.lr_mult",
    "optim.state_bits",
    "data.batch_size",
}


@dataclass
class Run:
    path: Path  # the run's result.json
    result: dict[str, Any]
    config: dict[str, Any]  # flattened and normalised (see the module docstring)


@dataclass
class Row:
    """One configuration: its runs and everything the table and the plot show about it."""

    config: dict[str, Any]
    runs: list[Run]
    memory_bytes: float = math.nan  # the report's accounting
    peak_bytes: int | None = None  # measured, max over the runs
    devices: tuple[str, ...] = ()
    mean: float = math.nan
    half_width: float | None = None  # 95% CI half-width; None for a single seed
    seeds: int = 0
    label: str = ""
    family: str = ""
    reduction: float = math.nan
    pareto: bool = False
    baseline: bool = False


# --- gathering and grouping ------------------------------------------------------------------------
def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts to dotted keys; lists become tuples so that values can be compared and hashed."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = tuple(value) if isinstance(value, list) else value
    return flat


def configuration(result: dict[str, Any]) -> dict[str, Any]:
    """The grouping key of a run: its flattened config minus the dropped keys (module docstring)."""
    flat = {
        key: value
        for key, value in flatten(result.get("config", {})).items()
        if key not in DROPPED_KEYS and not key.startswith(DROPPED_PREFIXES)
    }
    if result.get("lr_mult") is not None:
        flat["optim.lr_mult"] = float(result["lr_mult"])
    return flat


def find_runs(root: Path) -> list[Run]:
    """Every readable result.json below ``root`` that carries its config, in path order."""
    runs = []
    for path in sorted(root.rglob(RESULT)):
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            log.warning("skipping %s: %s", path, error)
            continue
        if not isinstance(result, dict) or "config" not in result:
            log.warning("skipping %s: no 'config' in it (not a lowmem result)", path)
            continue
        runs.append(Run(path, result, configuration(result)))
    return runs


def group_runs(runs: Sequence[Run]) -> list[Row]:
    groups: dict[str, Row] = {}
    for run in runs:
        key = json.dumps(run.config, sort_keys=True, default=str)
        groups.setdefault(key, Row(config=run.config, runs=[])).runs.append(run)
    return list(groups.values())


# --- statistics ------------------------------------------------------------------------------------
def choose_metric(runs: Sequence[Run], requested: str | None) -> str:
    available = sorted({key for run in runs for key, value in run.result.items() if _is_number(value)})
    if requested is not None:
        if requested not in available:
            names = ", ".join(available)
            raise SystemExit(f"--metric {requested!r}: no result has it; numeric keys: {names}")
        return requested
    for name in METRIC_PREFERENCE:
        if name in available:
            return name
    best = [name for name in available if name.startswith("best_")]
    if not best:
        names = ", ".join(available)
        raise SystemExit(f"no known metric in the results; choose one with --metric from: {names}")
    return best[0]


def mean_confidence(values: Sequence[float], level: float = 0.95) -> tuple[float, float | None]:
    """Mean and the half-width of its Student-t confidence interval (None for a single value)."""
    from scipy.stats import t  # scipy comes with scikit-learn, a lowmem dependency

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    quantile = float(t.ppf(0.5 + level / 2, len(values) - 1))
    return mean, quantile * statistics.stdev(values) / math.sqrt(len(values))


def pareto_flags(points: Sequence[tuple[float, float]]) -> list[bool]:
    """``points`` are (memory, metric); a point is optimal unless another has memory <= and
    metric >= with at least one strict. Points with a NaN coordinate are never optimal."""

    def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
        return a[0] <= b[0] and a[1] >= b[1] and (a[0] < b[0] or a[1] > b[1])

    return [
        not any(math.isnan(c) for c in point) and not any(dominates(other, point) for other in points)
        for point in points
    ]


def higher_is_better(metric: str) -> bool:
    return not any(word in metric for word in LOWER_IS_BETTER_WORDS)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# --- memory ----------------------------------------------------------------------------------------
def accounted_memory(row: Row) -> float:
    """The report's accounting of a configuration, in bytes: from the results when they carry it,
    otherwise from the profiler (fake tensors for the accounting; it also measures one step)."""
    for run in row.runs:
        total = (run.result.get("memory") or {}).get("total_bytes")
        if total is not None:
            return float(total)
    return float(_profile(row.runs[0].result["config"])["total_bytes"])


def _profile(config: dict[str, Any]) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from lowmem.config import Config

    try:
        from lowmem.profile import profile_config
    except (ImportError, AttributeError) as error:
        raise SystemExit(
            "accounted memory: these results carry no 'memory' and lowmem.profile.profile_config "
            f"is not available ({error}); the report needs one of the two"
        ) from error
    # The typed schema, as lowmem.train composes it, so the profiler sees the trainer's config.
    return profile_config(OmegaConf.merge(OmegaConf.structured(Config), config), measure=False)


# --- labels and families ---------------------------------------------------------------------------
def differing_keys(rows: Sequence[Row]) -> set[str]:
    keys = set().union(*(row.config for row in rows))
    return {key for key in keys if len({repr(row.config.get(key)) for row in rows}) > 1}


def describe(config: dict[str, Any], keys: set[str]) -> str:
    """A short label of ``config`` naming the knobs in ``keys``: technique knobs first, in the
    report's words, then the model, then anything else as key=value."""
    parts = []
    if "sparsity.density" in keys:
        parts.append(f"density {config['sparsity.density']!r}")  # repr: 1.0 and 0.3, never 1 or .3
    if "precision.name" in keys:
        parts.append(str(config["precision.name"]))
    if keys & {"microbatch.size", "microbatch.mode"}:
        size = config.get("microbatch.size")
        mode = str(config.get("microbatch.mode")).lower()
        parts.append("no microbatching" if size is None else f"microbatch {size} ({mode})")
    if keys & {"checkpointing.strategy", "checkpointing.every"}:
        strategy = config.get("checkpointing.strategy")
        if strategy in (None, "none"):
            parts.append("no checkpointing")
        elif strategy.startswith("residual"):
            parts.append(f"{strategy}/{config.get('checkpointing.every')}")
        else:
            parts.append(str(strategy))
    if "optim.state_bits" in keys:
        bits = config.get("optim.state_bits")
        parts.append("state in the weights' dtype" if bits is None else f"{bits}-bit state")
    for key in sorted(k for k in keys if k.startswith("model.")):
        parts.append(f"{key.removeprefix('model.')} {config.get(key)}")
    if "optim.lr_mult" in keys:
        parts.append(f"lr ×{config['optim.lr_mult']:g}")
    if "data.batch_size" in keys:
        parts.append(f"batch {config['data.batch_size']}")
    others = sorted(key for key in keys - DESCRIBED_KEYS if not key.startswith("model."))
    parts += [f"{key}={config.get(key)}" for key in others]
    return ", ".join(parts)


def family(row: Row, reference: dict[str, Any]) -> str:
    """sparse / narrow / shallow (joined with + when several apply) or dense: how ``row`` differs
    from the ``reference`` (the baseline's config). A ``family`` field in the results wins."""
    given = {run.result["family"] for run in row.runs if run.result.get("family")}
    if given:
        return "/".join(sorted(given))
    tags = []
    for tag, words in (("narrow", WIDTH_WORDS), ("shallow", DEPTH_WORDS)):
        if any(_smaller(row.config, reference, key) for key in row.config if _is_model_key(key, words)):
            tags.append(tag)
    if row.config.get("sparsity.density", 1.0) < 1.0:
        tags.insert(0, "sparse")
    return "+".join(tags) or "dense"


def _is_model_key(key: str, words: Sequence[str]) -> bool:
    return key.startswith("model.") and any(word in key for word in words)


def _smaller(config: dict[str, Any], reference: dict[str, Any], key: str) -> bool:
    value, base = config.get(key), reference.get(key)
    return _is_number(value) and _is_number(base) and value < base


# --- the table -------------------------------------------------------------------------------------
def build_rows(runs: Sequence[Run], metric: str, baseline: Sequence[str] = ()) -> list[Row]:
    """Group ``runs`` and fill every column; rows sorted by accounted memory, largest first."""
    rows = group_runs(runs)
    for row in rows:
        values = [float(run.result[metric]) for run in row.runs if _is_number(run.result.get(metric))]
        row.seeds = len(values)
        if values:
            row.mean, row.half_width = mean_confidence(values)
        peaks = [run.result["peak_bytes"] for run in row.runs if _is_number(run.result.get("peak_bytes"))]
        row.peak_bytes = max(peaks) if peaks else None
        devices = {(run.result.get("provenance") or {}).get("device") for run in row.runs}
        row.devices = tuple(sorted(str(device) for device in devices if device))
        row.memory_bytes = accounted_memory(row)
    # Largest memory first, as in the report's tables; equal memory: better metric first.
    sign = 1.0 if higher_is_better(metric) else -1.0  # Pareto and ties compare sign * metric
    rows.sort(key=lambda row: (-row.memory_bytes, -sign * row.mean if row.seeds else math.inf))
    base = select_baseline(rows, baseline)
    base.baseline = True
    keys = differing_keys(rows) or TECHNIQUE_KEYS
    flags = pareto_flags([(row.memory_bytes, sign * row.mean) for row in rows])
    for row, optimal in zip(rows, flags, strict=True):
        row.label = describe(row.config, keys)
        row.family = family(row, base.config)
        row.reduction = base.memory_bytes / row.memory_bytes
        row.pareto = optimal
    return rows


def select_baseline(rows: Sequence[Row], selectors: Sequence[str]) -> Row:
    """The row whose config matches every KEY=VALUE of ``selectors``; without selectors, the row
    with the largest accounted memory (``rows`` are sorted that way)."""
    if not selectors:
        return rows[0]
    wanted = {}
    for selector in selectors:
        key, sep, value = selector.partition("=")
        if not sep:
            raise SystemExit(f"--baseline {selector!r}: expected KEY=VALUE, e.g. precision.name=fp32")
        wanted[key] = value
    matches = [row for row in rows if all(_matches(row.config.get(k), v) for k, v in wanted.items())]
    if len(matches) != 1:
        choices = "; ".join(describe(row.config, set(wanted)) for row in rows)
        raise SystemExit(
            f"--baseline {' '.join(selectors)} matches {len(matches)} configurations, not 1: {choices}"
        )
    return matches[0]


def _matches(value: Any, text: str) -> bool:
    return value == yaml.safe_load(text) or str(value).lower() == text.lower()


def render_markdown(rows: Sequence[Row], metric: str, source: str) -> str:
    base = next(row for row in rows if row.baseline)
    higher = higher_is_better(metric)
    lines = [
        f"# Pareto table: {source}",
        "",
        f"Metric: `{metric}`, mean ± 95% confidence half-width over seeds (Student t). "
        "Accounted memory: the report's accounting (model + optimizer + activations); "
        "measured peak: the largest allocator peak over the seeds, on the device named. "
        "MB = 1e6 bytes. "
        f"Reduction: baseline accounted memory / accounted memory; baseline: {base.label}. "
        f"Pareto ✓: no other configuration has memory ≤ and {metric} {'≥' if higher else '≤'}, "
        "one of them strictly.",
        "",
        f"| # | configuration | accounted memory | measured peak | reduction | {metric} | seeds | Pareto |",
        "|---:|---|---:|---:|---:|---:|---:|:-:|",
    ]
    for number, row in enumerate(rows, start=1):
        cells = (number, row.label, _megabytes(row.memory_bytes), _peak(row), _times(row.reduction))
        cells += (_metric(row), row.seeds, "✓" if row.pareto else "")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def _times(ratio: float) -> str:
    """The report's "9.5x"; two significant digits below 1 (when a row uses more than the baseline)."""
    return f"{ratio:.1f}x" if ratio >= 1 else f"{ratio:.2g}x"


def _megabytes(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value / MEGABYTE:.2f} MB"


def _peak(row: Row) -> str:
    devices = f" ({', '.join(row.devices)})" if row.devices else ""
    return "n/a" if row.peak_bytes is None else f"{_megabytes(row.peak_bytes)}{devices}"


def _metric(row: Row) -> str:
    if row.seeds == 0:
        return "n/a"
    return f"{row.mean:.2f} ± {'n/a' if row.half_width is None else f'{row.half_width:.2f}'}"


# --- entry point -----------------------------------------------------------------------------------
def write_report(
    directory: Path, out: Path | None = None, metric: str | None = None, baseline: Sequence[str] = ()
) -> tuple[list[Row], str]:
    """Gather, tabulate, write ``pareto.md`` and ``pareto.png`` (atomically) into ``out``
    (default: ``directory``); return the rows and the metric name."""
    from lowmem.report_plot import plot_pareto  # matplotlib: imported when a plot is drawn

    runs = find_runs(directory)
    if not runs:
        raise SystemExit(f"no {RESULT} below {directory}")
    metric = choose_metric(runs, metric)
    rows = build_rows(runs, metric, baseline)
    out = out or directory
    markdown = render_markdown(rows, metric, str(directory))
    save_bytes(markdown.encode(), out / "pareto.md")
    png = plot_pareto(rows, metric, title=f"{directory.name or directory}: {metric} vs. training memory")
    save_bytes(png, out / "pareto.png")
    print(markdown, end="")
    print(f"wrote {out / 'pareto.md'} and {out / 'pareto.png'}")
    return rows, metric


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lowmem.report", description=__doc__.split("\n\n")[1])
    parser.add_argument("directory", type=Path, help="a sweep directory: result.json files at any depth")
    parser.add_argument("--out", type=Path, help="where pareto.md and pareto.png go (default: DIRECTORY)")
    parser.add_argument("--metric", help="the result key to report (default: best_test_acc, else bleu)")
    parser.add_argument(
        "--baseline",
        nargs="+",
        default=(),
        metavar="KEY=VALUE",
        help="select the baseline configuration, e.g. precision.name=fp32 microbatch.size=null "
        "(default: the largest accounted memory)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_report(args.directory, args.out, args.metric, args.baseline)


if __name__ == "__main__":
    sys.exit(main())
