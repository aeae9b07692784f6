"""The knobs' reference cannot drift from the schema, and a misspelt knob gets one line naming the
right one: on every command line (before Hydra composes) and in ``lowmem.prepare``/``lowmem.plan``."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowmem
from lowmem.config import Config, ConfigError
from lowmem.knobs import check_overrides, groups, knobs
from lowmem.profiler.step import ROW_FIELDS
from tests.helpers import ROOT, load_script


def test_every_knob_has_help_text_and_every_group_a_docstring():
    missing = [knob.name for knob in knobs() if len(knob.help.split()) < 2]
    assert not missing, f"knobs without help text (lowmem/config.py: knob(default, help)): {missing}"
    undocumented = [prefix or "Config" for prefix, schema in groups() if not (schema.__doc__ or "").strip()]
    assert not undocumented, f"schema groups without a docstring: {undocumented}"


def leaf_fields(schema: type = Config, prefix: str = "") -> list[str]:
    """Every field of every config dataclass below ``schema``, dotted, read here independently."""
    hints = typing.get_type_hints(schema)
    names = []
    for field in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[field.name]):
            names += leaf_fields(hints[field.name], f"{prefix}{field.name}.")
        else:
            names.append(f"{prefix}{field.name}")
    return names


def test_the_generated_reference_lists_every_field_of_every_config_dataclass():
    reference = load_script("docs_reference").knob_reference()
    fields = leaf_fields()
    assert len(fields) > 50 and [knob.name for knob in knobs()] == fields
    for name in fields:
        assert f"| `{name}` |" in reference, name
    assert "| `sparsity.density` | `float` | `1.0` | Fraction of nonzeros" in reference


def test_the_profile_reference_describes_every_field_the_profiler_emits():
    row = lowmem.prepare(nn.Linear(4, 2), _loss, (torch.randn(4, 4), torch.randn(4, 2))).profile(measure=True)
    emitted = set(row) | {"rank", "world_size"}  # the two python -m lowmem.profile adds
    assert emitted == set(ROW_FIELDS), (
        f"undocumented in lowmem.profiler.step.ROW_FIELDS: {sorted(emitted - set(ROW_FIELDS))}; "
        f"documented but not emitted: {sorted(set(ROW_FIELDS) - emitted)}"
    )
    assert "| `peak_bytes` |" in load_script("docs_reference").profile_reference()


def _loss(model, batch):
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("sparsity.densty=0.3", "did you mean sparsity.density?"),
        ("+sparsity.densty=0.3", "did you mean sparsity.density?"),
        ("trainer.density=0.3", "did you mean sparsity.density?"),
        ("precison=fp16", "did you mean precision?"),
        ("~trainer.sed", "did you mean trainer.seed?"),
        ("sparsity.density.x=1", "sparsity.density is a value"),
    ],
)
def test_a_misspelt_knob_names_the_closest_and_the_groups_knobs(override, named):
    with pytest.raises(ConfigError, match="is not a knob") as refused:
        check_overrides([override])
    message = str(refused.value)
    assert named in message and "\n" not in message
    if override.startswith("sparsity.densty"):
        assert "sparsity's knobs: density, rewire_fraction," in message


@pytest.mark.parametrize(
    "override",
    ["sparsity.density=0.3", "data=fake", "+recipe=wrn_cifar", "+model.width=64", "hydra.run.dir=x",
     "hydra/job_logging=disabled", "+setting=t3_d30_mb10", "sparsity.density=0.1,0.3", "optim.betas=[0.9,0.99]"],
)
def test_real_knobs_and_hydras_own_pass(override):
    check_overrides([override])


def test_every_field_of_the_schema_is_a_knob_the_check_accepts():
    check_overrides([f"{knob.name}=1" for knob in knobs()])
    assert {field.name for field in dataclasses.fields(Config)} >= {"sparsity", "trainer", "plan"}


def test_lowmem_prepare_and_plan_name_the_closest_knob():
    batch = (torch.randn(4, 4), torch.randn(4, 2))
    with pytest.raises(ConfigError, match=r"sparsity.densty is not a knob: did you mean sparsity.density\?"):
        lowmem.prepare(nn.Linear(4, 2), _loss, batch, overrides=["sparsity.densty=0.3"])
    with pytest.raises(ConfigError, match=r"did you mean checkpointing.strategy\?"):
        lowmem.plan(nn.Linear(4, 2), _loss, batch, budget_mb=1, overrides=["checkpointing.stratgy=optimal"])


# The three command lines in one process (importing torch once): each refused before Hydra composes,
# in one line on stderr, exit status 1, no run directory.
COMMAND_LINES = """
import runpy, sys
for module in ("lowmem.train", "lowmem.profile", "lowmem.plan"):
    sys.argv = [module, "+recipe=wrn_cifar", "data=fake", "sparsity.densty=0.3", "hydra.run.dir=" + sys.argv[1]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        print(module, stop.code, flush=True)
"""


def test_the_command_lines_refuse_a_misspelt_knob_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-c", COMMAND_LINES, str(tmp_path / "run")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["lowmem.train", "1", "lowmem.profile", "1", "lowmem.plan", "1"], done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 3, done.stderr
    for line in lines:
        assert line.startswith("error: sparsity.densty is not a knob: did you mean sparsity.density? sparsity's knobs")
    assert not (tmp_path / "run").exists()
