"""What runs on a GPU runs the same way here: each defect the first H100 run found, reproduced on CPU.

A CUDA device differs from the CPU in ways these tests stand in for: a loss-scaled ``amp`` (FP16
autocast with torch's GradScaler) runs on CPU with FP16 autocast; a model on an accelerator is a
model on the ``meta`` device (tensors without CPU storage); CUDA's LayerNorm kernel's dtype rule is
checked on the operator's arguments. The same checks run on a real GPU where one exists (the
``cuda`` tests at the bottom, skipped here) and in ``make gpu-check``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lowmem.config import compose
from lowmem.profiler import Microbatch, profile_step, profile_trainer
from lowmem.techniques.precision import make_loss_scaler
from lowmem.train import run
from lowmem.trainer import build_trainer, resume_from
from recipes.wrn_cifar.model import WideResNet
from tests.helpers import SMALL_DC, TINY_WRN

CUDA = torch.cuda.is_available()


def train(run_dir: Path, *overrides: str) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    return run(compose(*overrides), run_dir)


class _OutputDevices(TorchDispatchMode):
    """Records the device of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.devices.add(tensor.device.type)
        return out


def _loss_scaled_amp(trainer):
    """``trainer`` switched to what ``precision=amp`` is on CUDA: FP16 autocast and torch's GradScaler."""
    trainer.policy = dataclasses.replace(trainer.policy, autocast_dtype=torch.float16, uses_loss_scaling=True)
    trainer.scaler = make_loss_scaler(trainer.policy, optimizer=trainer.optimizer, device=trainer.device)
    return trainer


# --- amp with loss scaling -------------------------------------------------------------------------


def test_loss_scaled_amp_trains_after_the_accounting_and_logs_its_real_scale():
    """The accounting's fake pass scaled a fake loss first, and GradScaler kept the fake scale it
    created then: the first real step failed (``precision=amp`` on CUDA exited 1). The logged
    ``loss_scale`` read 1.0 (after unscaling)."""
    trainer = _loss_scaled_amp(build_trainer(compose(*TINY_WRN, "precision=amp")))
    accounting = trainer.account_memory()
    assert accounting["activation_bytes"] > 0
    batch = trainer.example_batch()
    records = [trainer.train_step(batch) for _ in range(2)]
    assert all(record["loss_scale"] == 2.0**16 for record in records)
    assert not any(record["skipped"] for record in records)
    assert trainer.scaler.grad_scaler.get_scale() == 2.0**16


# --- the accounting does not depend on the device ----------------------------------------------


def _accounted(device: str) -> tuple[int, int, set[str]]:
    torch.manual_seed(0)
    model = WideResNet(depth=10, width=1).to(device)
    images = torch.randn(8, 3, 32, 32, device=device)
    labels = torch.randint(0, 10, (8,), device=device)
    spy = _OutputDevices()

    def step(batch):
        with spy:
            F.cross_entropy(model(batch[0]), batch[1]).backward()

    report = profile_step(model, None, [Microbatch(step, inputs=(images, labels))])
    return report.activation_bytes, report.flops, spy.devices


def test_accounting_of_a_model_on_another_device_runs_on_cpu_and_equals_the_cpu_figure():
    """On an H100 the accounting came out at about half the CPU figure (223.8 against 404.8 MB):
    the fake pass now runs on CPU stand-ins whatever the model's device (``meta`` stands in)."""
    on_cpu = _accounted("cpu")
    elsewhere = _accounted("meta")
    assert elsewhere[2] == {"cpu"}  # every op of the fake pass computed on CPU stand-ins
    assert elsewhere[:2] == on_cpu[:2]


def test_a_step_reading_real_tensors_of_another_device_is_accounted_on_cpu():
    """A closure reading real tensors (the README's usage) is accounted on CPU stand-ins too."""
    torch.manual_seed(0)
    model = WideResNet(depth=10, width=1)
    images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    reference = profile_step(model, None, lambda: F.cross_entropy(model(images), labels).backward())
    model.to("meta")
    images, labels = images.to("meta"), labels.to("meta")
    report = profile_step(model, None, lambda: F.cross_entropy(model(images), labels).backward())
    assert (report.activation_bytes, report.flops) == (reference.activation_bytes, reference.flops)


def test_trainer_accounting_with_the_model_and_batch_on_another_device():
    trainer = build_trainer(compose(*TINY_WRN, "checkpointing.strategy=residual_star", "microbatch.size=10"))
    batch = trainer.example_batch()
    reference = profile_trainer(trainer, measure=False, batch=batch)
    trainer.unwrapped_model.to("meta")
    moved = profile_trainer(trainer, measure=False, batch=[t.to("meta") for t in batch])
    assert moved.activation_bytes == reference.activation_bytes
    assert moved.flops == reference.flops


# --- resume: generator states stay on the CPU ------------------------------------------------------


def test_resume_loads_the_checkpoint_on_cpu_whatever_the_training_device(tmp_path):
    """``resume_from`` mapped the checkpoint to the training device, which moved the saved generator
    states there; ``torch.set_rng_state`` and ``Generator.set_state`` accept CPU byte tensors only."""
    overrides = (*TINY_WRN, "sparsity.density=0.5", "trainer.max_steps=2")
    train(tmp_path / "first", *overrides)
    trainer = build_trainer(compose(*overrides))
    trainer.device = torch.device("meta")  # stands in for a CUDA device (no CPU storage there)
    resume_from(trainer, str(tmp_path / "first"), tmp_path / "first")
    assert trainer.state.step == 2


SPARSE_FP16_ADAM = (
    *SMALL_DC,
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "data.train_size=120",
    "data.batch_size=300",
    "precision=fp16",
    "precision.stochastic_rounding=true",
    "sparsity.density=0.5",
    "sparsity.rewire_freq_mult=200",  # rewiring at updates 1, 2 and 4 (the schedule scales to 6 updates)
    "trainer.epochs=1",
)


@pytest.mark.slow
def test_sparse_fp16_adam_with_stochastic_rounding_resumes_bit_identically(tmp_path):
    straight = train(tmp_path / "straight", *SPARSE_FP16_ADAM, "trainer.max_steps=6")
    train(tmp_path / "first", *SPARSE_FP16_ADAM, "trainer.max_steps=3")
    resumed = train(tmp_path / "second", *SPARSE_FP16_ADAM, "trainer.max_steps=6",
                    f"trainer.resume={tmp_path / 'first'}")
    assert straight["updates"] == resumed["updates"] >= 5  # FP16: a skipped step would also count
    a = torch.load(tmp_path / "straight" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "second" / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    rewirings = [
        json.loads(line)
        for line in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()
        if '"rewiring"' in line
    ]
    assert any(r["step"] > 3 for r in rewirings)  # the resumed half rewired too


# --- LayerNorm under pure 16-bit ---------------------------------------------------------------------


class _LayerNormDtypes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.dtype, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.native_layer_norm.default:
            x, _, weight, bias = args[:4]
            self.calls.append((x.dtype, weight.dtype, bias.dtype))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_layer_norm_parameters_reach_the_kernel_in_the_inputs_dtype(precision):
    """CUDA's LayerNorm kernel wants its parameters in the input's dtype; the CPU kernel accepts FP32
    parameters with a 16-bit input, which hid the failure. Checked on the operator's arguments."""
    trainer = build_trainer(compose(*SMALL_DC, f"precision={precision}", "model.encoder_layers=1",
                                    "model.decoder_layers=1"))
    norms = [m for m in trainer.unwrapped_model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms and all(m.weight.dtype == torch.float32 for m in norms)  # the policy keeps them FP32
    spy = _LayerNormDtypes()
    with spy:
        trainer.train_step(trainer.example_batch())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert spy.calls and all(call == (dtype, dtype, dtype) for call in spy.calls)


# --- the measured peak: steps and evaluation alike -----------------------------------------------


def test_the_runs_measured_peak_covers_evaluation(tmp_path):
    """A run whose evaluation needs more memory than its training step: the peak in result.json is
    the evaluation's (it was the first training step's alone)."""
    overrides = (*TINY_WRN, "data.batch_size=2", "data.test_size=200", "data.eval_batch_size=200",
                 "trainer.max_steps=1")
    result = train(tmp_path / "run", *overrides)
    step_only = profile_trainer(build_trainer(compose(*overrides))).peak_bytes
    assert result["peak_bytes"] > 2 * step_only
    assert "evaluation" in result["peak_scope"]
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["peak_bytes"] == result["peak_bytes"]


# --- the same on a real GPU --------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@cuda_only
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "amp"])
def test_cuda_wrn_trains_under_every_precision(tmp_path, precision):
    result = train(tmp_path / precision, *TINY_WRN, f"precision={precision}", "trainer.max_steps=3",
                   "trainer.device=cuda")
    assert result["steps"] == 3 and result["peak_bytes"] > 0


@cuda_only
def test_cuda_accounting_equals_the_cpu_accounting():
    overrides = (*TINY_WRN, "checkpointing.strategy=residual_star", "checkpointing.every=2")
    cpu = build_trainer(compose(*overrides, "trainer.device=cpu")).account_memory()
    cuda = build_trainer(compose(*overrides, "trainer.device=cuda")).account_memory()
    assert cuda == cpu


@cuda_only
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_dynamicconv_trains_in_pure_16_bit(tmp_path, precision):
    result = train(tmp_path / precision, *SMALL_DC, f"precision={precision}", "trainer.max_steps=2",
                   "trainer.epochs=1", "trainer.device=cuda")
    assert result["steps"] == 2


@cuda_only
def test_cuda_resume_is_bit_identical(tmp_path: Path):
    overrides = (*SPARSE_FP16_ADAM, "trainer.device=cuda", "trainer.deterministic=true")
    train(tmp_path / "straight", *overrides, "trainer.max_steps=4")
    train(tmp_path / "first", *overrides, "trainer.max_steps=2")
    train(tmp_path / "second", *overrides, "trainer.max_steps=4", f"trainer.resume={tmp_path / 'first'}")
    a = torch.load(tmp_path / "straight" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "second" / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
