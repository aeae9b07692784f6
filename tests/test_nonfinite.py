"""Nothing non-finite trains on, in any precision (``trainer.stop_on_nonfinite``): a step whose loss or
gradients are not finite is skipped, as FP16's loss scaler skips one; persisting, the run stops with
one line, its last checkpoint intact and resumable."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowmem
from lowmem.techniques.precision import NONFINITE_LIMIT, TrainingDiverged
from lowmem.train import run
from tests.helpers import TINY_WRN, make_config
from tests.test_run_safety import cli

DIVERGING = (*TINY_WRN, "trainer.device=cpu", "optim.lr=1e6", "trainer.epochs=6", "data.train_size=200")


@pytest.mark.slow
def test_a_diverging_fp32_run_stops_with_one_line_and_keeps_its_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    done = cli(*DIVERGING, "precision=fp32", f"hydra.run.dir={run_dir}")
    assert done.returncode == 3, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("training diverged at step ")
    assert "optim.lr" in lines[-1] and "precision (fp32)" in lines[-1] and "checkpoint.pt is kept" in lines[-1]
    assert "Traceback" not in done.stderr and "HYDRA_FULL_ERROR" not in done.stderr
    assert not (run_dir / "result.json").exists()
    # The checkpoint it kept (the first epoch's: statistics of steps whose activations overflowed
    # were not kept either) is finite and resumable.
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    resumed = tmp_path / "resumed"
    done = cli(*DIVERGING, "precision=fp32", "trainer.stop_on_nonfinite=false", "trainer.max_steps=12",
               f"trainer.resume={run_dir}", f"hydra.run.dir={resumed}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (resumed / "result.json").is_file()


def test_a_run_that_ends_in_non_finite_steps_is_not_done(tmp_path):
    """Fewer steps left than NONFINITE_LIMIT (the break-it check's: 2 minibatches an epoch, 4 epochs):
    reaching the end in a streak of skipped steps stops it as diverged, not "done"."""
    run_dir = tmp_path / "run"
    done = cli(*TINY_WRN, "trainer.device=cpu", "optim.lr=1e6", "trainer.epochs=4", "data.train_size=200",
               "data.batch_size=100", "precision=fp32", f"hydra.run.dir={run_dir}")  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    line = [line for line in done.stderr.splitlines() if line.strip()][-1]
    assert line.startswith("training diverged at the end of the run (step 8): its last ") and "optim.lr" in line
    assert not (run_dir / "result.json").exists()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_diverging_16_bit_run_stops_before_writing_a_non_finite_state(precision, tmp_path):
    """BF16 skips non-finite steps as FP32 does; FP16's scaler halves its scale on each overflow, and
    overflows persisting at a scale of 1 or less stop the run as well."""
    with pytest.raises(TrainingDiverged, match=rf"training diverged at step \d+: .*precision \({precision}\)"):
        run(make_config(*DIVERGING, f"precision={precision}"), tmp_path)
    assert not (tmp_path / "result.json").exists() and not (tmp_path / "model.pt").exists()


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp"])
def test_a_nan_in_a_prepared_batch_skips_the_step(precision):
    torch.manual_seed(0)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    bad = x.clone()
    bad[3, 2] = float("nan")
    prepared = lowmem.prepare(_Net(), _loss, (x, y), overrides=["trainer.device=cpu", f"precision={precision}"])
    before = copy.deepcopy(prepared.model.state_dict())
    metrics = prepared.step((bad, y))
    assert metrics["skipped"] is True
    for key, value in prepared.model.state_dict().items():
        assert torch.equal(value, before[key]), key  # nothing of the step applied
    assert prepared.step((x, y))["skipped"] is False  # the next good batch trains
    assert all(torch.isfinite(p).all() for p in prepared.model.parameters())


def test_persisting_nan_batches_raise_one_line_through_prepare():
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    x[0, 0] = float("inf")
    prepared = lowmem.prepare(_Net(), _loss, (x, y), overrides=["trainer.device=cpu"])
    for _ in range(NONFINITE_LIMIT - 1):
        assert prepared.step((x, y))["skipped"]
    with pytest.raises(TrainingDiverged) as raised:
        prepared.step((x, y))
    assert "\n" not in str(raised.value) and f"{NONFINITE_LIMIT} steps in a row" in str(raised.value)


def test_the_opt_out_trains_on():
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    x[0, 0] = float("nan")
    prepared = lowmem.prepare(_Net(), _loss, (x, y), overrides=["trainer.device=cpu",
                                                             "trainer.stop_on_nonfinite=false"])
    assert prepared.step((x, y))["skipped"] is False
    assert not all(torch.isfinite(p).all() for p in prepared.model.parameters())

