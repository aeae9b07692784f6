"""The documentation's reference pages, generated from the code when MkDocs builds the site.

Registered as a MkDocs hook in ``mkdocs.yml``: a page holding one of these marker lines gets the
generated text in its place, so the reference cannot drift from the code.

- ``<!-- knobs -->``: every knob of the configuration schema (``lowmem/config.py``, read by
  ``lowmem.knobs``) with its type, default and help text, group by group;
- ``<!-- config groups -->``: the values of each Hydra group (``conf/<group>/*.yaml``) with the
  comment at the top of each file;
- ``<!-- profile fields -->``: the fields of ``lowmem.profile``'s JSON row
  (``lowmem.profiler.step.ROW_FIELDS``);
- ``<!-- gpu reports -->``: a link to each report ``make gpu-report`` wrote into ``docs/measurements/``.

``python scripts/docs_reference.py`` prints them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from lowmem.config import CONF_DIR
from lowmem.knobs import config_groups, groups, knobs
from lowmem.profiler.step import ROW_FIELDS


def _value(value: Any) -> str:
    """A default as it is written on the command line."""
    if value is MISSING:
        return "required"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list | tuple | dict):
        return f"`{json.dumps(list(value) if isinstance(value, tuple) else value)}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def knob_reference() -> str:
    """Every knob, one table per group of the schema, in declaration order."""
    every = knobs()
    sections = []
    for prefix, schema in groups():
        mine = [k for k in every if k.name.startswith(prefix) and "." not in k.name[len(prefix) :]]
        if not mine:
            continue
        title = f"`{prefix.rstrip('.')}`" if prefix else "top level"
        doc = " ".join((schema.__doc__ or "").split())
        rows = [
            f"| `{k.name}` | `{k.type.replace(' | ', ' or ')}` | {_value(k.default)} | {_cell(k.help)} |" for k in mine
        ]
        sections.append(
            f"## {title}\n\n{doc}\n\n| knob | type | default | meaning |\n|---|---|---|---|\n" + "\n".join(rows)
        )
    return "\n\n".join(sections)


def _leading_comment(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def group_reference() -> str:
    """Each Hydra group's values, with what each file's top comment says."""
    sections = []
    for group in config_groups():
        values = sorted(path for path in (CONF_DIR / group).glob("*.yaml") if not path.name.startswith("_"))
        choice = f"+{group}" if group in ("recipe", "setting", "sweep") else group
        rows = [f"| `{choice}={path.stem}` | {_cell(_leading_comment(path.read_text()))} |" for path in values]
        sections.append(f"### `{choice}=`\n\n| value | what it is |\n|---|---|\n" + "\n".join(rows))
    return "\n\n".join(sections)


def profile_reference() -> str:
    rows = [f"| `{name}` | {_cell(text)} |" for name, text in ROW_FIELDS.items()]
    return "| field | what it holds |\n|---|---|\n" + "\n".join(rows)


REPORTS = Path(__file__).resolve().parents[1] / "docs" / "measurements"


def gpu_reports() -> str:
    """One line per GPU report, newest first, with the first line of its summary."""
    lines = []
    for path in sorted(REPORTS.glob("*.md"), reverse=True):
        if path.name != "README.md":
            device = next((line[len("- device: "):] for line in path.read_text().splitlines()
                           if line.startswith("- device: ")), "")
            lines.append(f"- [{path.stem}]({path.name}){': ' + device if device else ''}")
    return "\n".join(lines) or "No GPU report yet."


MARKERS = {
    "<!-- knobs -->": knob_reference,
    "<!-- config groups -->": group_reference,
    "<!-- profile fields -->": profile_reference,
    "<!-- gpu reports -->": gpu_reports,
}


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """MkDocs hook: each marker line replaced by its generated text."""
    for marker, generate in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown


if __name__ == "__main__":
    for generate in MARKERS.values():
        print(generate(), end="\n\n")
