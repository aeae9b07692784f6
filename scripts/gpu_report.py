"""``make gpu-report``: everything a GPU can tell about lowmem, in one file, in one command.

Runs, each in its own process and under its own time limit (a part that fails or runs out of time
is reported as such, with what it printed, and the others still run):

1. ``make gpu-check`` (scripts/gpu_check.py): one PASS/FAIL line per case;
2. the memory/speed benchmark (scripts/bench_memory.py): plain PyTorch, the peer stack and every
   lowmem row with Table 3's, measured peak, step time and time/FLOPs; then the same lowmem rows
   with capped library workspaces (``trainer.workspaces=capped``, a separate process: the libraries
   read their workspace sizes once per process) and a default-vs-capped comparison;
3. the demo (scripts/demo.py);

and writes them into ``docs/measurements/<date>-<device>.md`` (``--out`` elsewhere) with the
command, git revision, torch, CUDA and driver versions. ``--tiny`` runs the same at toy shapes
(WRN-10-1, a few cases, a few steps: minutes on a CPU); without CUDA it runs tiny on the CPU and
says so at the top of the report. Exit status 1 if a part failed (the report is written anyway).

    .venv/bin/python scripts/gpu_report.py [--tiny] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# The capped-workspace comparison: lowmem's own rows (plain PyTorch runs no lowmem code); tiny: two.
CAPPED_ROWS = ("lowmem FP32 (no technique)", "T3 row")
TINY_CAPPED_ROWS = ("lowmem FP32 (no technique)", "T3 row 7:")
BUDGET_S = 540  # the whole report's time limit (s)


@dataclass
class Part:
    """One command of the report: its title, its arguments (after ``python``) and time limit (s)."""

    title: str
    args: list[str]
    limit_s: int
    files: dict[str, Path] = field(default_factory=dict)  # what it writes: label -> path


@dataclass
class Outcome:
    part: Part
    status: str  # "ok", "failed (exit N)" or "timed out after N s"
    seconds: float
    output: str


def parts(tiny: bool, workdir: Path, check_only: list[str] | None = None, bench_only: list[str] | None = None,
          demo_baseline_only: bool = False) -> list[Part]:
    """The report's commands. ``tiny``: toy shapes on this machine's device (CPU without CUDA);
    the ``*_only`` arguments narrow them further (the tests)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check = ["scripts/gpu_check.py", "--device", device]
    if tiny:  # a few representative cases (the full tiny list takes a quarter of an hour on 2 cores)
        check += ["--tiny", "--only", *(check_only or [
            "wrn_cifar/fake bf16 all", "dc_iwslt/phrases bf16 all", "profile table 3 t3_d10_mb4",
        ])]
    elif check_only:
        check += ["--only", *check_only]
    bench = ["scripts/bench_memory.py", "--repeats", "1" if tiny else "5"] + (["--tiny"] if tiny else [])
    rows = bench_only or (["plain PyTorch", "peer", "lowmem FP32", "T3 row"] if tiny else None)
    capped_rows = [r for r in (TINY_CAPPED_ROWS if tiny else CAPPED_ROWS)
                   if not bench_only or any(r.startswith(b) for b in bench_only)]
    demo = ["scripts/demo.py", "--out", str(workdir / "demo")] + (["--tiny"] if tiny else ["--epochs", "15"])
    if demo_baseline_only:
        demo.append("--only-baseline")
    # Time limits (s): the whole report under 9 minutes on one H100 (BUDGET_S); tiny, each part may
    # take what is left of it (about 4 minutes in all on 2 cores, more on a loaded machine).
    limits = (BUDGET_S,) * 4 if tiny else (240, 150, 60, 90)
    return [
        Part("gpu-check", check, limits[0]),
        Part("benchmark: default library workspaces",
             [*bench, "--out", str(workdir / "bench.md"), "--json", str(workdir / "bench.json"),
              *(["--only", *rows] if rows else [])],
             limits[1], {"table": workdir / "bench.md", "json": workdir / "bench.json"}),
        Part("benchmark: capped library workspaces",
             [*bench, "--workspaces", "capped", "--out", str(workdir / "capped.md"), "--json",
              str(workdir / "capped.json"), "--only", *capped_rows],
             limits[2], {"table": workdir / "capped.md", "json": workdir / "capped.json"}),
        Part("demo", demo, limits[3], {"pareto": workdir / "demo" / "pareto.md"}),
    ]


def run_part(part: Part, limit_s: float) -> Outcome:
    """Run ``part`` for at most ``limit_s`` seconds; what it printed is kept whatever happens."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    print(f"== {part.title}: python {' '.join(part.args)}", flush=True)
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, *part.args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=max(limit_s, 1))
        status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        status = f"timed out after {max(limit_s, 1):.0f} s"
        output = "".join(_text(x) for x in (expired.stdout, expired.stderr))
    seconds = time.perf_counter() - started
    print(f"   {status} in {seconds:.0f} s", flush=True)
    return Outcome(part, status, seconds, output)


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def provenance(command: str, tiny: bool) -> list[str]:
    """The report's header lines: what ran, where, with which versions."""
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
    lines = [
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- git revision: {revision.stdout.strip() or 'unknown'}"
        + (" (with uncommitted changes)" if dirty.stdout.strip() else ""),
        f"- torch {torch.__version__}, Python {sys.version.split()[0]}",
    ]
    if torch.cuda.is_available():
        lines += [
            f"- device: {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}, cuDNN "
            f"{torch.backends.cudnn.version()}, driver {driver_version()}",
        ]
    else:
        lines += [f"- device: cpu ({torch.get_num_threads()} threads): **no CUDA device on this machine**; "
                  "every part ran on the CPU at toy shapes, so no figure here is a GPU figure"]
    if tiny:
        lines += ["- shapes: tiny (WRN-10-1, a few cases and steps): a check that the report runs, not measurements"]
    return lines


def driver_version() -> str:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if smi.returncode == 0 and smi.stdout.strip():
            return smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown (no nvidia-smi)"


def workspace_comparison(default: Path, capped: Path) -> list[str]:
    """Measured peak and step time of each lowmem row, default against capped workspaces."""
    if not (default.exists() and capped.exists()):
        return []
    a, b = json.loads(default.read_text()), json.loads(capped.read_text())
    lines = ["| configuration | measured peak MB default -> capped | step s default -> capped |", "|---|---|---|"]
    for name in (name for name in b if name in a):
        peak = lambda r: "—" if r["peak"] is None else f"{r['peak'] / 1e6:.1f}"  # noqa: E731
        lines.append(f"| {name} | {peak(a[name])} -> {peak(b[name])} | "
                     f"{a[name]['seconds']:.3f} -> {b[name]['seconds']:.3f} |")
    return lines


def render(command: str, tiny: bool, outcomes: list[Outcome]) -> str:
    lines = ["# lowmem GPU report", "", *provenance(command, tiny), "", "| part | status | time |", "|---|---|---|"]
    lines += [f"| {o.part.title} | {o.status} | {o.seconds:.0f} s |" for o in outcomes]
    for outcome in outcomes:
        lines += ["", f"## {outcome.part.title}", "", f"`python {' '.join(_relative(a) for a in outcome.part.args)}`"
                  f": {outcome.status}, {outcome.seconds:.0f} s", ""]
        table = outcome.part.files.get("table")
        if table is not None and table.exists():
            lines += [table.read_text().rstrip(), ""]
        pareto = outcome.part.files.get("pareto")
        if pareto is not None and pareto.exists():
            lines += ["Pareto table (`lowmem.report`):", "", pareto.read_text().rstrip(), ""]
        if table is None or not table.exists() or outcome.status != "ok":  # the table says it all
            lines += ["Output:", "", "```", _clean(outcome.output)[-20000:].rstrip(), "```"]
    files = {o.part.title: o.part.files for o in outcomes}
    comparison = workspace_comparison(*(files.get(f"benchmark: {w} library workspaces", {}).get("json", Path("/-"))
                                        for w in ("default", "capped")))
    if comparison:
        lines += ["", "## library workspaces: default against capped", "", *comparison]
    return "\n".join(lines) + "\n"


def _relative(arg: str) -> str:
    return re.sub(r"^/.*/(gpu_report_[^/]+)/", r"$WORK/", arg)


def _clean(output: str) -> str:
    """Output without carriage-return progress bars."""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in output.splitlines())


def default_out(tiny: bool) -> Path:
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    device = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    day = datetime.date.today().isoformat()
    return ROOT / "docs" / "measurements" / f"{day}-{device}{'-tiny' if tiny else ''}.md"


def write_report(out: Path, command: str, tiny: bool, chosen: list[Part], budget_s: float = BUDGET_S) -> bool:
    """Run ``chosen`` within ``budget_s`` seconds in all and write the report to ``out``; True when
    every part succeeded."""
    deadline = time.monotonic() + budget_s
    outcomes = [run_part(part, min(part.limit_s, deadline - time.monotonic())) for part in chosen]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(command, tiny, outcomes))
    return all(o.status == "ok" for o in outcomes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="toy shapes: what a CPU-only machine runs")
    parser.add_argument("--out", help="the report's path (default: docs/measurements/<date>-<device>.md)")
    parser.add_argument("--command", default=None, help="the command to record (make passes its own)")
    args = parser.parse_args(argv)
    tiny = args.tiny or not torch.cuda.is_available()
    if not torch.cuda.is_available():
        print("gpu-report: no CUDA device on this machine: running on the CPU at toy shapes", flush=True)
    out = Path(args.out) if args.out else default_out(tiny)
    command = args.command or "python " + " ".join(["scripts/gpu_report.py", *(sys.argv[1:] if argv is None else argv)])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_report_") as tmp:
        ok = write_report(out, command, tiny, parts(tiny, Path(tmp)))
    print(f"gpu-report: {'every part ran' if ok else 'a part failed (see the report)'}; "
          f"{time.perf_counter() - started:.0f} s; written to {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
