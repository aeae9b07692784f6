"""The conformance suite's results as the README's table: every technique on each library model.

    python scripts/conformance_table.py [--out table.md]

Runs tests/test_conformance.py's cases (the same code, outside pytest) and prints a Markdown table:
one row per model, one column per technique, each cell ``equal`` (FP64, one SGD step, plain
PyTorch's weights to the stated tolerance), ``trains`` (the loss falls), ``refused`` (one line
naming a knob; the message is listed under the table) or ``FAILS``. Exit status 1 if any fails.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lowmem.run.files import measured_on  # noqa: E402
from tests.test_conformance import CASES, MODELS, conformance  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args()
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    warnings.filterwarnings("ignore")
    began = time.perf_counter()
    header = "| model | " + " | ".join(case.name for case in CASES) + " |"
    lines = [header, "|---" * (len(CASES) + 1) + "|"]
    refusals: dict[str, list[str]] = {}
    failed = 0
    for model in MODELS:
        cells = []
        for case in CASES:
            try:
                outcome = conformance(model, case)
            except Exception as error:  # noqa: BLE001 - a failing case is a cell, the others still run
                failed += 1
                outcome = f"FAILS: {type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
            if outcome.startswith("refused"):
                refusals.setdefault(outcome.removeprefix("refused: "), []).append(f"{model.name} / {case.name}")
                cells.append("refused")
            else:
                cells.append(outcome.split(" (")[0] if not outcome.startswith("FAILS") else outcome)
        lines.append(f"| {model.library} {model.name} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines.append("")
    for message, where in refusals.items():
        lines.append(f"- refused ({', '.join(where)}): {message}")
    lines.append(f"\n{len(MODELS) * len(CASES)} cases, {failed} failing, {time.perf_counter() - began:.0f} s")
    table = "\n".join(lines)
    print("\n".join(lines[len(MODELS) + 2:]))
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
