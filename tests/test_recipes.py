"""Recipe facts from the report: per-density table defaults and the scaled rewiring schedule."""

import pytest

from lowmem.config import ConfigError
from recipes.dc_iwslt.recipe import RECIPE as DC
from recipes.wrn_cifar.recipe import RECIPE as WRN
from tests.helpers import make_config


@pytest.mark.parametrize(("density", "expected"), [(1.0, (0.5, 1, 1)), (0.3, (1, 2, 0.5)), (0.05, (0.5, 1, 0.25)),
                                                   (0.28, (1, 2, 0.5))])  # 0.28: the nearest row, 0.3
def test_wrn_tables_6_and_8(density, expected):
    d = WRN.table_defaults(density)
    assert (d.lr_mult, d.rewire_fraction_mult, d.rewire_freq_mult) == expected


@pytest.mark.parametrize(("density", "expected"), [(1.0, (1, 1, 1)), (0.3, (4, 4, 0.125)), (0.1, (8, 1, 0.5))])
def test_dc_tables_7_and_9(density, expected):
    d = DC.table_defaults(density)
    assert (d.lr_mult, d.rewire_fraction_mult, d.rewire_freq_mult) == expected


def test_wrn_schedule_scales_with_the_run_length():
    cfg = make_config("+recipe=wrn_cifar")
    full = WRN.rewire_schedule(cfg, 200.0)
    assert full.starts == (0, 25, 80, 140) and full.stop == 190 and full.periods == (100, 200, 400, 800)
    short = WRN.rewire_schedule(cfg, 6.0)  # e.g. trainer.max_steps=30 at 5 minibatches per epoch
    assert short.stop == pytest.approx(5.7) and short.starts[1] == pytest.approx(0.75)
    assert short.period(step=29, epoch=5.8) is None  # the last epochs train the regrown weights


def test_dc_schedule_follows_max_steps():
    cfg = make_config("+recipe=dc_iwslt", "trainer.max_steps=5000")
    schedule = DC.rewire_schedule(cfg, 1.0)
    assert schedule.unit == "update" and schedule.stop == pytest.approx(4750)


def test_wrn_model_knobs_are_checked():
    with pytest.raises(ConfigError, match="model.depth=27"):
        WRN.build_model(make_config("+recipe=wrn_cifar", "model.depth=27"))
