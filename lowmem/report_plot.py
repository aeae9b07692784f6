"""The Pareto plot of ``lowmem.report``: metric vs. training memory, like the report's Figures 7,
8 and 10, with both figures of each configuration: the accounted memory (filled marker, the
report's definition, on which the frontier is drawn) and the measured peak (hollow marker, what the
device had to hold), joined by a thin line.

One marker family per configuration family (sparse / narrow / shallow / dense), error bars of the
95% confidence interval, the Pareto frontier as a step line with each point numbered by its row in
the table, the baseline starred. Drawn on an
Agg canvas (no display, no pyplot global state) and returned as PNG bytes at 150 dpi.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Protocol

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

MEGABYTE = 1e6
DPI = 150
MARKERS = {"dense": "s", "sparse": "o", "narrow": "^", "shallow": "v"}


class Row(Protocol):
    """What the plot reads of a configuration (``lowmem.report.Row`` has it)."""

    family: str  # sparse / narrow / shallow / dense: one marker family each
    memory_bytes: float  # the report's accounting
    peak_bytes: int | None  # measured
    mean: float  # the metric over seeds
    half_width: float | None  # 95% confidence interval's half-width
    pareto: bool
    baseline: bool


def plot_pareto(rows: Sequence[Row], metric: str, title: str) -> bytes:
    """PNG bytes of ``metric`` (mean ± CI) against accounted memory and measured peak (MB, log scale)."""
    figure = Figure(figsize=(8, 5.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    numbers = {id(row): number for number, row in enumerate(rows, start=1)}  # the table's "#"
    shown = [row for row in rows if not math.isnan(row.mean)]
    for index, name in enumerate(sorted({row.family for row in shown})):
        members = sorted((row for row in shown if row.family == name), key=lambda row: row.memory_bytes)
        axes.errorbar(
            [row.memory_bytes / MEGABYTE for row in members],
            [row.mean for row in members],
            yerr=[row.half_width or 0.0 for row in members],
            fmt=MARKERS.get(name, "D"),
            color=f"C{index}",
            capsize=3,
            markersize=6,
            linestyle="none",
            label=f"{name} ({len(members)})",
        )
        measured = [row for row in members if row.peak_bytes]
        for row in measured:  # accounted -> measured, at the configuration's metric
            axes.plot(
                [row.memory_bytes / MEGABYTE, row.peak_bytes / MEGABYTE],
                [row.mean, row.mean],
                color=f"C{index}",
                linewidth=0.8,
                alpha=0.5,
            )
        axes.plot(
            [row.peak_bytes / MEGABYTE for row in measured],
            [row.mean for row in measured],
            marker=MARKERS.get(name, "D"),
            markerfacecolor="none",
            markeredgecolor=f"C{index}",
            markersize=6,
            linestyle="none",
        )
    frontier = sorted((row for row in shown if row.pareto), key=lambda row: row.memory_bytes)
    if frontier:
        # Post-steps: from each optimal point, its metric is the best reachable until the next
        # (larger) memory budget.
        axes.step(
            [row.memory_bytes / MEGABYTE for row in frontier],
            [row.mean for row in frontier],
            where="post",
            color="black",
            linewidth=1.2,
            label="Pareto frontier (on accounted memory)",
        )
        for row in frontier:  # labels would overlap: the number points to the table's row
            axes.annotate(
                str(numbers[id(row)]),
                (row.memory_bytes / MEGABYTE, row.mean),
                textcoords="offset points",
                xytext=(5, -11),
                fontsize=7,
                color="0.2",
            )
    for row in shown:
        if row.baseline:
            axes.plot(
                row.memory_bytes / MEGABYTE,
                row.mean,
                marker="*",
                markersize=16,
                color="gold",
                markeredgecolor="black",
                linestyle="none",
                label=f"baseline (row {numbers[id(row)]})",
            )
    # Which marker is which figure (the families' colours and shapes say the rest).
    axes.plot([], [], marker="o", color="0.3", linestyle="none", label="accounted memory (filled)")
    axes.plot([], [], marker="o", markerfacecolor="none", markeredgecolor="0.3", color="0.3", linewidth=0.8,
              label="measured peak (hollow, joined)")
    axes.set_xscale("log")
    # Plain numbers (2, 5, 10, 20, ...) rather than powers of ten: budgets are read off the axis.
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axes.xaxis.set_minor_formatter(FuncFormatter(_two_and_five))
    axes.set_xlabel("training memory: accounted and measured peak (MB = 1e6 bytes, log scale)")
    axes.set_ylabel(f"{metric} (mean ± 95% CI over seeds)")
    axes.set_title(f"{title}\n(numbered: rows of pareto.md on the Pareto frontier)", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, loc="best")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _two_and_five(value: float, _position: int) -> str:
    """Minor tick label on a log axis: only at 2x and 5x a power of ten."""
    leading = round(value / 10 ** math.floor(math.log10(value)))
    return f"{value:g}" if leading in (2, 5) else ""
