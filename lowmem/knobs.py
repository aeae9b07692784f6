"""The knobs of the configuration schema (``lowmem.config``), read from its dataclasses: name, type,
default and help text.

Two readers: the documentation's knob reference is generated from ``knobs()`` (so it cannot drift
from the code), and ``check_overrides`` refuses an override that names no knob before Hydra
composes anything, in one line naming the closest knobs: ``sparsity.densty=0.3`` gets "did you
mean sparsity.density?" and the group's knobs, where Hydra would print seven lines suggesting
``+sparsity.densty=0.3`` (which fails too).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, is_dataclass
from typing import Any, get_type_hints

from omegaconf import MISSING

from lowmem.config import CONF_DIR, Config, ConfigError


@dataclass(frozen=True)
class Knob:
    """One leaf of the schema: ``sparsity.density``, its type as written in the schema, its default
    (``"???"``: none, it must be given) and its help text."""

    name: str
    type: str
    default: Any
    help: str


def groups(schema: type = Config, prefix: str = "") -> Iterator[tuple[str, type]]:
    """Every dataclass node of the schema, dotted (``""`` for the root), with its class."""
    yield prefix, schema
    hints = get_type_hints(schema)
    for field in dataclasses.fields(schema):
        if is_dataclass(hints[field.name]):
            yield from groups(hints[field.name], f"{prefix}{field.name}.")


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def knobs(schema: type = Config, prefix: str = "") -> list[Knob]:
    """Every leaf of the schema in declaration order, dotted names (``trainer.seed``)."""
    found = []
    hints = get_type_hints(schema)
    for field in dataclasses.fields(schema):
        if is_dataclass(hints[field.name]):
            found += knobs(hints[field.name], f"{prefix}{field.name}.")
        else:
            help_text = field.metadata.get("help", "")
            found.append(Knob(f"{prefix}{field.name}", str(field.type), _default(field), help_text))
    return found


def config_groups() -> list[str]:
    """The Hydra groups a value is chosen from by name (``data=fake``, ``+recipe=wrn_cifar``)."""
    return sorted(path.name for path in CONF_DIR.iterdir() if path.is_dir())


def _fields(schema: type) -> dict[str, type]:
    hints = get_type_hints(schema)
    return {field.name: hints[field.name] for field in dataclasses.fields(schema)}


def _closest(wrong: str, names: Sequence[str]) -> list[str]:
    return difflib.get_close_matches(wrong, names, n=3, cutoff=0.6)


def check_knob(key: str) -> None:
    """Raise ConfigError when ``key`` (``sparsity.density``, an override's left-hand side without
    its ``+``/``~``) names no knob of the schema. Hydra's own keys (``hydra.*``), a group choice
    (``data``, ``recipe``) and the recipe's model keys (``model.*``, checked by the recipe) pass."""
    parts = key.split(".")
    if parts[0] == "hydra" or "/" in key or (len(parts) == 1 and key in config_groups()):
        return
    schema: Any = Config
    for depth, part in enumerate(parts):
        if not is_dataclass(schema):
            if schema is Any or str(schema).startswith(("dict", "typing.Any")):
                return  # a free-form node (model.*): its keys are the recipe's to check
            value = ".".join(parts[:depth])
            raise ConfigError(f"{key} is not a knob: {value} is a value, not a group of knobs (set it as {value}=...)")
        fields = _fields(schema)
        if part not in fields:
            group = ".".join(parts[:depth])
            near = [f"{group}.{name}" if group else name for name in _closest(part, list(fields))]
            if not near:  # the right knob in another group (trainer.density)?
                leaves = {knob.name.rsplit(".", 1)[-1]: knob.name for knob in knobs()}
                near = [leaves[name] for name in _closest(part, list(leaves))]
            suggestion = f"did you mean {' or '.join(near)}? " if near else ""
            if group:
                listed = f"{group}'s knobs: {', '.join(fields)}"
            else:
                listed = f"the top-level knobs: {', '.join(fields)}; the groups: {', '.join(config_groups())}"
            raise ConfigError(f"{key} is not a knob: {suggestion}{listed}")
        schema = fields[part]


def check_overrides(overrides: Sequence[str]) -> None:
    """Raise ConfigError naming the first override whose key is no knob (see ``check_knob``).
    An override Hydra cannot parse is left to Hydra, which says why."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException:
            continue
        check_knob(override.key_or_group)


def required(knob: Knob) -> bool:
    """Whether the knob has no default (``recipe``: ``+recipe=...`` must be given)."""
    return knob.default is MISSING
