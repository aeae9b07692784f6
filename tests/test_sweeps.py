"""The stored sweeps (conf/sweep/*.yaml) and the named settings they sweep (conf/setting/*.yaml).

- every configuration of every sweep composes (data=fake), passes validation and builds its model;
- the settings are the report's rows: Table 3, Table 4, and the Table 6 / Table 7 learning rates of
  the Figure 8 / Figure 10 baselines;
- one configuration of each sweep runs through the CLI (`-m +sweep=<name>`, one step on a small
  model) into the directory the shared layout promises.

A sweep's configurations are expanded here the way Hydra's basic sweeper does it: its
``hydra.sweeper.params`` parsed as overrides, then the cartesian product. ``trainer.seed`` is the
replicate, not part of a configuration: configurations are composed with one seed.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from lowmem.config import microbatch_mode, validate
from tests.helpers import CONF, ROOT, make_config, slow

SWEEP_DIR = CONF / "sweep"
SWEEPS = sorted(path.stem for path in SWEEP_DIR.glob("*.yaml") if not path.stem.startswith("_"))
RUNS = {  # runs per sweep = configurations x 5 seeds
    "table3": 7 * 5,
    "fig6_sparsity_precision": 7 * 2 * 5,
    "fig7_density_microbatch": 7 * 4 * 5,
    "fig8_baselines": 11 * 2 * 5,
    "table4": 9 * 5,
    "fig10_dc_baselines": 13 * 5,
    "state_bits": 3 * 3 * 5,
}
REAL_DATA = {"wrn_cifar": "cifar10", "dc_iwslt": "iwslt14"}


def sweep_axes(name: str) -> dict[str, list[str]]:
    """The sweeper's params of ``conf/sweep/<name>.yaml``: key -> the values it takes, in order."""
    params = OmegaConf.load(SWEEP_DIR / f"{name}.yaml").hydra.sweeper.params
    axes = {}
    for override in OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()]):
        key = override.get_key_element()
        if override.is_sweep_override():
            axes[key] = list(override.sweep_string_iterator())
        else:
            axes[key] = [override.get_value_element_as_str()]
    return axes


def configurations(name: str) -> list[tuple[str, ...]]:
    """Every configuration of a sweep as overrides, without the seed axis."""
    axes = {key: values for key, values in sweep_axes(name).items() if key != "trainer.seed"}
    return [
        tuple(f"{k}={v}" for k, v in zip(axes, values, strict=True)) for values in itertools.product(*axes.values())
    ]


@cache
def composed(sweep: str, overrides: tuple[str, ...]) -> DictConfig:
    """A configuration of ``sweep`` as its jobs compose it, on fake data, seed 0 (composed once:
    the row tests reuse what the composition test built)."""
    return make_config(f"+sweep={sweep}", *overrides, "trainer.seed=0", "data=fake")


def setting_config(sweep: str, setting: str) -> DictConfig:
    """The first configuration of ``sweep`` with ``setting=<setting>``."""
    return composed(sweep, next(c for c in configurations(sweep) if c[0] == f"setting={setting}"))


@cache
def check_model(recipe: str, model_json: str) -> None:
    """The recipe accepts the model knobs: WRN builds the model, DynamicConv checks its
    Architecture (building it needs the corpus). Once per architecture."""
    model = OmegaConf.create({"model": json.loads(model_json)})
    if recipe == "wrn_cifar":
        from recipes.wrn_cifar.recipe import RECIPE

        RECIPE.build_model(model)
    else:
        from recipes.dc_iwslt.recipe import architecture

        architecture(model)


def test_every_sweep_is_known():
    assert SWEEPS == sorted(RUNS)


@pytest.mark.parametrize("name", SWEEPS)
def test_run_count_and_seeds(name: str):
    axes = sweep_axes(name)
    assert axes["trainer.seed"] == ["0", "1", "2", "3", "4"]
    assert math.prod(len(values) for values in axes.values()) == RUNS[name]


@pytest.mark.parametrize("name", SWEEPS)
def test_every_configuration_composes(name: str):
    distinct = set()
    for overrides in configurations(name):
        cfg = composed(name, overrides)
        validate(cfg)
        assert cfg.data.name == "fake"
        check_model(cfg.recipe, json.dumps(OmegaConf.to_container(cfg.model), sort_keys=True))
        distinct.add(json.dumps(OmegaConf.to_container(cfg), sort_keys=True))
    # Distinct overrides give distinct configs: no setting is silently shadowed by the sweep.
    assert len(distinct) == len(configurations(name))
    # Without data=fake, the sweep trains on the recipe's real data set.
    cfg = make_config(f"+sweep={name}", *configurations(name)[0])
    assert cfg.data.name == REAL_DATA[cfg.recipe]


@pytest.mark.parametrize("name", SWEEPS)
def test_runs_land_in_one_directory_per_configuration(name: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        hydra_cfg = compose("config", overrides=[f"+sweep={name}"], return_hydra_config=True).hydra
    assert hydra_cfg.sweep.dir == f"multirun/{name}"
    assert OmegaConf.to_container(hydra_cfg.sweep)["subdir"] == "${hydra.job.override_dirname}"
    # Keys left out of the directory name must be keys the trainer ignores when it decides whether
    # a run directory already holds this configuration; otherwise a re-run would be refused.
    from lowmem.train import comparable_config

    config = OmegaConf.to_container(make_config(f"+sweep={name}"), resolve=True)
    for key in set(hydra_cfg.job.config.override_dirname.exclude_keys) - {"sweep"}:
        changed = copy.deepcopy(config)
        section, knob = key.split(".")
        changed[section][knob] = "another value"
        assert comparable_config(changed) == comparable_config(config), key


def knobs(cfg: DictConfig) -> tuple:
    """(precision, density, microbatch, checkpointing) in the words of the report's tables."""
    size = cfg.microbatch.size
    microbatch = f"{size} ({microbatch_mode(cfg)})" if size is not None else "none"
    strategy = cfg.checkpointing.strategy
    checkpointing = strategy if strategy == "none" else f"{strategy}/{cfg.checkpointing.every}"
    return cfg.precision.name, cfg.sparsity.density, microbatch, checkpointing


STAR2 = "residual_star/2"
TABLE3 = {  # SPEC §4 Table 3, top to bottom
    "t3_fp32_baseline": ("fp32", 1.0, "none", "none"),
    "t3_d100_mb100": ("fp16", 1.0, "100 (true)", STAR2),
    "t3_d100_mb10": ("fp16", 1.0, "10 (true)", STAR2),
    "t3_d30_mb10": ("fp16", 0.3, "10 (true)", STAR2),
    "t3_d20_mb10": ("fp16", 0.2, "10 (true)", STAR2),
    "t3_d20_mb4": ("fp16", 0.2, "4 (true)", STAR2),
    "t3_d10_mb4": ("fp16", 0.1, "4 (true)", STAR2),
}
TABLE4 = {  # SPEC §4 Table 4: the baseline, then density x precision
    "t4_fp32_baseline": ("fp32", 1.0, "none", "none"),
    **{
        f"t4_{precision}_d{round(100 * density)}": (precision, density, "250 (true)", "residual/1")
        for density in (1.0, 0.5, 0.4, 0.3)
        for precision in ("fp32", "fp16")
    },
}


@pytest.mark.parametrize(("sweep", "rows"), [("table3", TABLE3), ("table4", TABLE4)])
def test_table_rows_are_the_reports(sweep: str, rows: dict):
    assert sweep_axes(sweep)["setting"] == list(rows)
    for setting, expected in rows.items():
        assert knobs(setting_config(sweep, setting)) == expected, setting


# setting: (model knobs, density, learning-rate multiplier of Table 6 / Table 7). Sparse settings
# leave optim.lr_mult unset: the trainer applies the table default for the density.
FIG8 = {
    "wrn_dense": ({"depth": 28, "width": 2}, 1.0, 0.5),
    **{f"wrn_sparse_d{round(100 * d)}": ({"depth": 28, "width": 2}, d, None) for d in (0.5, 0.4, 0.3, 0.2, 0.1, 0.05)},
    "wrn_narrow_w1": ({"depth": 28, "width": 1}, 1.0, 0.5),
    "wrn_shallow_l22": ({"depth": 22, "width": 2}, 1.0, 0.5),
    "wrn_shallow_l16": ({"depth": 16, "width": 2}, 1.0, 0.5),
    "wrn_shallow_l10": ({"depth": 10, "width": 2}, 1.0, 0.5),
}
FIG10 = {
    "dc_dense": ({}, 1.0, 1),
    **{f"dc_sparse_d{round(100 * d)}": ({}, d, None) for d in (0.5, 0.4, 0.3, 0.2, 0.1, 0.05)},
    "dc_narrow_e384": ({"embed_dim": 384, "ffn_dim": 768}, 1.0, 1),
    "dc_narrow_e256": ({"embed_dim": 256, "ffn_dim": 512}, 1.0, 2),
    "dc_narrow_e192": ({"embed_dim": 192, "ffn_dim": 384}, 1.0, 2),
    "dc_narrow_e128": ({"embed_dim": 128, "ffn_dim": 256}, 1.0, 4),
    "dc_shallow_dec3": ({"decoder_layers": 3}, 1.0, 1),
    "dc_shallow_dec1": ({"decoder_layers": 1}, 1.0, 2),
}
TABLE6 = {1.0: 0.5}  # WRN, density 1.0 (the trainer's default for dense runs)
TABLE7 = {1.0: 1.0}  # DynamicConv, density 1.0


@pytest.mark.parametrize(
    ("sweep", "rows", "stack"),
    [
        ("fig8_baselines", FIG8, ("fp16", STAR2)),
        ("fig10_dc_baselines", FIG10, ("fp16", "residual/1")),
    ],
)
def test_baseline_settings_follow_the_learning_rate_tables(sweep: str, rows: dict, stack: tuple):
    assert sweep_axes(sweep)["setting"] == list(rows)
    defaults = TABLE6 if sweep == "fig8_baselines" else TABLE7
    for setting, (model, density, lr_mult) in rows.items():
        cfg = setting_config(sweep, setting)
        precision, cfg_density, _, checkpointing = knobs(cfg)
        assert (precision, checkpointing, cfg_density) == (*stack, density), setting
        assert {key: cfg.model[key] for key in model} == model, setting
        effective = cfg.optim.lr_mult if cfg.optim.lr_mult is not None else defaults.get(cfg_density)
        assert effective == lr_mult, setting


# --- the CLI: one configuration per sweep ---------------------------------------------------------
SMALL_WRN = ("data.batch_size=4", "data.train_size=8", "data.test_size=4")
SMALL_DC = ("model.embed_dim=16", "model.ffn_dim=32", "model.heads=2", "model.encoder_layers=1")
SMALL_DC += ("model.decoder_layers=1", "data.batch_size=500")
SMALL_DC += ("data.train_size=32", "data.test_size=8")
# sweep: (the swept keys pinned to one value, small-model overrides, knobs the run must have)
SMOKE = {
    "table3": (
        ("setting=t3_d20_mb4",),  # FP16, sparse, microbatches, residual_star
        ("model.depth=10", "model.width=1", *SMALL_WRN),
        {"precision.name": "fp16", "sparsity.density": 0.2, "microbatch.size": 4},
    ),
    "fig6_sparsity_precision": (
        ("sparsity.density=0.3", "precision=fp32"),
        ("model.depth=10", "model.width=1", *SMALL_WRN),
        {"precision.name": "fp32", "sparsity.density": 0.3, "checkpointing.strategy": "none"},
    ),
    "fig7_density_microbatch": (
        ("sparsity.density=0.1", "microbatch.size=2"),
        ("model.depth=10", "model.width=1", *SMALL_WRN),
        {"checkpointing.strategy": "residual_star", "checkpointing.every": 2, "microbatch.size": 2},
    ),
    "fig8_baselines": (
        ("setting=wrn_narrow_w1", "microbatch.size=4"),
        ("model.depth=10", *SMALL_WRN),  # the width comes from the setting
        {"model.width": 1, "optim.lr_mult": 0.5, "precision.name": "fp16"},
    ),
    "table4": (
        ("setting=t4_fp16_d50",),
        SMALL_DC,
        {"precision.name": "fp16", "microbatch.size": 250, "checkpointing.strategy": "residual"},
    ),
    "fig10_dc_baselines": (
        ("setting=dc_narrow_e128",),
        SMALL_DC,
        {"optim.lr_mult": 4.0, "precision.name": "fp16", "checkpointing.every": 1},  # lr from the setting
    ),
    "state_bits": (
        ("setting=t3_d10_mb4", "optim.state_bits=4"),
        ("model.depth=10", "model.width=1", *SMALL_WRN),
        {"precision.name": "fp16", "sparsity.density": 0.1, "optim.state_bits": 4},
    ),
}


def dotted(tree: dict, key: str):
    for part in key.split("."):
        tree = tree[part]
    return tree


# One sweep's run in `make test` (Table 3's); the other sweeps' runs (10-14 s each) in `make test-all`.
CLI_IN_MAKE_TEST = {"table3"}


@pytest.mark.parametrize("name", [n if n in CLI_IN_MAKE_TEST else slow(n) for n in SWEEPS])
def test_one_configuration_runs_through_the_cli(name: str, tmp_path: Path):
    pinned, small, expected = SMOKE[name]
    pinned = (*pinned, "trainer.seed=0")
    assert {override.split("=")[0] for override in pinned} == set(sweep_axes(name)), "pin every swept key"
    command = ["-m", f"+sweep={name}", *pinned, "data=fake", "trainer.max_steps=1", *small]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lowmem.train",
            *command,
            "trainer.progress=none",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # The run directory is named by the job's overrides, sorted; trainer.progress and the sweep
    # itself are left out of the name (conf/sweep/_layout.yaml).
    run_dirs = [path.parent for path in tmp_path.rglob("result.json")]
    assert [path.name for path in run_dirs] == [",".join(sorted(command[2:]))]
    config = json.loads((run_dirs[0] / "result.json").read_text())["config"]
    assert config["data"]["name"] == "fake" and config["trainer"]["max_steps"] == 1
    assert {key: dotted(config, key) for key in expected} == expected
