import math

import pytest

from lowmem.schedules import inverse_sqrt_lr, multistep_lr


@pytest.mark.parametrize(
    ("epoch", "lr"),
    [(0, 0.1), (59, 0.1), (60, 0.02), (119, 0.02), (120, 0.004), (160, 0.0008), (199, 0.0008)],
)
def test_multistep_is_dsr_schedule(epoch, lr):
    assert math.isclose(multistep_lr(0.1, epoch, [60, 120, 160], 0.2), lr, rel_tol=1e-12)


def test_inverse_sqrt_warms_up_linearly_then_decays():
    assert inverse_sqrt_lr(5e-4, 0, 4000, 1e-7) == 1e-7
    assert math.isclose(inverse_sqrt_lr(5e-4, 2000, 4000, 1e-7), (1e-7 + 5e-4) / 2)
    assert math.isclose(inverse_sqrt_lr(5e-4, 4000, 4000, 1e-7), 5e-4)
    assert math.isclose(inverse_sqrt_lr(5e-4, 16000, 4000, 1e-7), 2.5e-4)
