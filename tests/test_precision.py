"""Low precision: policies, model conversion, the loss scaler and the 16-bit optimizers (CPU, tiny)."""

import copy
import math

import pytest
import torch
from torch import nn

from lowmem.techniques.optimizers import LowPrecisionAdam, LowPrecisionSGD, read_moment
from lowmem.techniques.precision import (
    PRECISIONS,
    AmpLossScaler,
    LossScaler,
    autocast_context,
    cast_input,
    convert_model,
    make_loss_scaler,
    make_policy,
    round_to_dtype,
)
from tests.per_tensor_optimizers import LowPrecisionAdam as PerTensorAdam

CPU = torch.device("cpu")


def small_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def batch(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 8, 8), torch.randint(0, 10, (n,))


def train_step(model, optimizer, scaler, policy, x, y) -> tuple[float, bool]:
    """The documented step: returns the loss and whether the step was skipped."""
    optimizer.zero_grad()
    with autocast_context(policy, CPU):
        logits = model(cast_input(x, policy))
    loss = nn.functional.cross_entropy(logits.float(), y)
    scaler.scale_loss(loss).backward()
    found = scaler.found_overflow(model.parameters())
    if not found:
        optimizer.step(grad_scale=scaler.scale)
    scaler.update(found)
    return loss.item(), found


def build(precision: str, lr: float = 0.05, **policy_kw):
    policy = make_policy(precision, CPU, **policy_kw)
    model = convert_model(small_model(), policy)
    optimizer = LowPrecisionSGD(model.parameters(), lr=lr, stochastic_rounding=policy.stochastic_rounding)
    return policy, model, optimizer, make_loss_scaler(policy, optimizer=optimizer)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


# --- policies -------------------------------------------------------------------------------------


def test_unknown_precision_is_a_clear_error():
    with pytest.raises(ValueError, match=r"precision='fp8'.*fp32, fp16, bf16, amp"):
        make_policy("fp8", CPU)


def test_stochastic_rounding_needs_16_bit_weights():
    with pytest.raises(ValueError, match="stochastic_rounding.*precision=amp"):
        make_policy("amp", CPU, stochastic_rounding=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_precision_on_a_device_that_cannot_run_it_is_a_clear_error():
    with pytest.raises(ValueError, match="precision=fp16 cannot run on device cuda"):
        make_policy("fp16", "cuda")


def test_policies_on_cpu():
    fields = {
        name: (p.param_dtype, p.input_dtype, p.autocast_dtype, p.uses_loss_scaling)
        for name in PRECISIONS
        for p in [make_policy(name, CPU)]
    }
    assert fields == {
        "fp32": (torch.float32, torch.float32, None, False),
        "fp16": (torch.float16, torch.float16, None, True),
        "bf16": (torch.bfloat16, torch.bfloat16, None, False),
        "amp": (torch.float32, torch.float32, torch.bfloat16, False),  # GradScaler on CUDA only
        "fp64": (torch.float64, torch.float64, None, False),  # the reference for equivalence tests
    }
    assert not make_policy("fp16", CPU).stochastic_rounding  # off by default


# --- model conversion -----------------------------------------------------------------------------


def test_convert_keeps_state_dict_keys_and_normalization_in_fp32():
    model = small_model()
    keys = list(model.state_dict())
    convert_model(model, make_policy("fp16", CPU))
    state = model.state_dict()
    assert list(state) == keys
    assert {k: v.dtype for k, v in state.items()} == {
        "0.weight": torch.float16,
        "1.weight": torch.float32,
        "1.bias": torch.float32,
        "1.running_mean": torch.float32,
        "1.running_var": torch.float32,
        "1.num_batches_tracked": torch.int64,
        "5.weight": torch.float16,
        "5.bias": torch.float16,
    }
    # The FP32 BatchNorm takes FP16 input, returns FP16 and updates its FP32 statistics.
    x = torch.randn(4, 8, 5, 5, dtype=torch.float16)
    assert model[1](x).dtype == torch.float16
    assert model[1].running_mean.dtype == torch.float32 and model[1].running_mean.abs().sum() > 0
    # No hooks: the 16-bit input goes to the FP32 layer as it is, so what it saves stays 16-bit.
    assert not model[1]._forward_pre_hooks and not model[1]._forward_hooks


class _Rotary(nn.Module):
    """A parameter-free module holding a constant (as transformers' rotary embeddings do)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2) / 16)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * self.inv_freq
        return (x * angles.cos().to(x.dtype).repeat(1, 2)).to(x.dtype)


class _WithConstants(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary, self.linear = _Rotary(), nn.Linear(16, 16)
        # A block's constant whose parameters are in its children computes with them: 16-bit.
        self.register_buffer("mask", torch.full((16,), 0.3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.rotary(x)) * self.mask


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_16_bit_keeps_the_constants_of_parameter_free_modules(precision):
    from lowmem.techniques.precision import kept_constants

    model = convert_model(_WithConstants(), make_policy(precision, CPU))
    exact = _Rotary().inv_freq
    assert model.rotary.inv_freq.dtype == torch.float32 and torch.equal(model.rotary.inv_freq, exact)
    assert model.mask.dtype == model.linear.weight.dtype != torch.float32
    assert kept_constants(model) == ["rotary.inv_freq"]
    # Rebuilt and reloaded from its state dict, the model is the same model (the constant is not saved).
    again = convert_model(_WithConstants(), make_policy(precision, CPU))
    again.load_state_dict(model.state_dict())
    x = torch.randn(2, 5, 16).to(model.linear.weight.dtype)
    assert torch.equal(again(x), model(x))


def test_16_bit_llama_keeps_its_rotary_frequencies_exact():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=50)
    model = transformers.LlamaForCausalLM(config)
    exact = model.model.rotary_emb.inv_freq.clone()
    convert_model(model, make_policy("bf16", CPU))
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.model.rotary_emb.inv_freq, exact)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    logits = model(input_ids=torch.randint(0, 50, (2, 7))).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("norm", [nn.LayerNorm(6), nn.GroupNorm(2, 6)])
def test_layer_and_group_norm_run_in_fp32(norm):
    model = convert_model(nn.Sequential(nn.Linear(6, 6), norm), make_policy("bf16", CPU))
    x = torch.randn(3, 6, dtype=torch.bfloat16, requires_grad=True)
    model(x).sum().backward()
    assert model[1].weight.dtype == model[1].weight.grad.dtype == torch.float32
    assert model[0].weight.grad.dtype == x.grad.dtype == torch.bfloat16


# --- memory: no FP32 copy -------------------------------------------------------------------------


def memory_by_part(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state, split into normalization and the rest."""
    norm_params = {id(p) for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()}
    totals = {"norm": 0, "rest": 0}
    for param in model.parameters():
        tensors = [param, param.grad] + [v for v in optimizer.state[param].values() if torch.is_tensor(v)]
        part = "norm" if id(param) in norm_params else "rest"
        totals[part] += sum(t.numel() * t.element_size() for t in tensors)
    return totals


def all_training_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    return tensors + [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def test_fp16_weights_gradients_and_momentum_take_half_the_bytes():
    memory = {}
    for precision in ("fp32", "fp16"):
        torch.manual_seed(0)
        policy, model, optimizer, scaler = build(precision)
        assert not train_step(model, optimizer, scaler, policy, *batch())[1]
        memory[precision] = memory_by_part(model, optimizer)
        if precision == "fp16":
            weight_sizes = {model[0].weight.numel(), model[5].weight.numel()}
            fp32_weight_sized = [
                t.shape
                for t in all_training_tensors(model, optimizer)
                if t.dtype == torch.float32 and t.numel() in weight_sizes
            ]
            assert fp32_weight_sized == []
    assert memory["fp16"]["rest"] * 2 == memory["fp32"]["rest"]
    assert memory["fp16"]["norm"] == memory["fp32"]["norm"]  # BatchNorm stays FP32


def test_fp16_adam_keeps_its_moments_in_fp16():
    model = convert_model(nn.Linear(16, 16), make_policy("fp16", CPU))
    optimizer = LowPrecisionAdam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 16, dtype=torch.float16)).float().sum().backward()
    optimizer.step()
    big = [t for t in all_training_tensors(model, optimizer) if t.numel() > 1]
    assert {t.dtype for t in big} == {torch.float16}
    scales = [t for t in all_training_tensors(model, optimizer) if t.numel() == 1]
    assert len(scales) == 4 and all(t.dim() == 0 for t in scales)  # 2 moments x (weight, bias)


# --- optimizers against plain references ----------------------------------------------------------


def test_sgd_on_fp32_is_torch_sgd_bit_for_bit():
    params = [nn.Parameter(torch.randn(7, 5)), nn.Parameter(torch.randn(5))]
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    ours = LowPrecisionSGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    torch_sgd = torch.optim.SGD(reference, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    for _ in range(5):
        grads = [torch.randn_like(p) for p in params]
        for p, r, g in zip(params, reference, grads, strict=True):
            p.grad, r.grad = g.clone(), g.clone()
        ours.step()
        torch_sgd.step()
    for p, r in zip(params, reference, strict=True):
        assert torch.equal(p, r)
        assert torch.equal(ours.state[p]["momentum_buffer"], torch_sgd.state[r]["momentum_buffer"])


def reference_adam(w, grads, lr, betas, eps, weight_decay):
    """fairseq's Adam written out plainly, in float64."""
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        w = w * (1 - lr * weight_decay)
        w = w - lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t) * m / (v.sqrt() + eps)
    return w


def test_adam_on_fp32_matches_the_plain_reference_and_adamw():
    w0 = torch.randn(6, 4)
    grads = [torch.randn(6, 4) for _ in range(6)]
    settings = {"lr": 1e-2, "betas": (0.9, 0.98), "eps": 1e-8, "weight_decay": 1e-4}
    param, adamw_param = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    ours = LowPrecisionAdam([param], **settings)
    adamw = torch.optim.AdamW([adamw_param], **settings)
    for g in grads:
        param.grad, adamw_param.grad = g.clone(), g.clone()
        ours.step()
        adamw.step()
    expected = reference_adam(w0.double(), [g.double() for g in grads], **settings).float()
    torch.testing.assert_close(param.detach(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(param.detach(), adamw_param.detach(), rtol=0, atol=1e-6)


class UnscaledMomentAdam(PerTensorAdam):
    """The naive variant the report warns about: FP16 moments rounded without any scaling."""

    @staticmethod
    def _read_moment(state, key):
        return state[key].float()

    @staticmethod
    def _write_moment(state, key, value):
        state[key].copy_(value)


def fit_toy_regression(optimizer_class, dtype: torch.dtype, steps: int = 60):
    """Adam on least squares with small (~1e-4) gradients, FP16 gradients loss-scaled by 2**12."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 32, generator=generator) * 1e-2
    w_true = torch.randn(32, generator=generator)
    y = x @ w_true
    w = nn.Parameter((w_true + 0.2 * torch.randn(32, generator=generator)).to(dtype))
    optimizer = optimizer_class([w], lr=3e-3)
    grad_scale = 1.0 if dtype == torch.float32 else 2.0**12
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((x.to(dtype) @ w).float() - y).pow(2).mean()
        (loss * grad_scale).backward()
        optimizer.step(grad_scale=grad_scale)
    return w.detach().float(), loss.item(), optimizer.state[w]


def test_scaled_fp16_moments_track_fp32_while_unscaled_ones_flush_to_zero():
    w32, loss32, _ = fit_toy_regression(LowPrecisionAdam, torch.float32)
    w16, loss16, state16 = fit_toy_regression(LowPrecisionAdam, torch.float16)
    w_naive, loss_naive, state_naive = fit_toy_regression(UnscaledMomentAdam, torch.float16)
    # Scaled per tensor: nothing lost, the FP16 run follows the FP32 one.
    assert (state16["exp_avg_sq"] == 0).float().mean() == 0
    assert (w16 - w32).norm() / w32.norm() < 0.01
    assert loss16 < 1.1 * loss32
    # Unscaled: (1 - 0.98) * g**2 ~ 1e-10 is below FP16's smallest number, v = 0, the steps blow up.
    assert (state_naive["exp_avg_sq"] == 0).float().mean() > 0.9
    assert (w_naive - w32).norm() / w32.norm() > 0.1
    assert loss_naive > 10 * loss32


def test_scaled_moments_survive_state_dict_and_sparsity_zeroing():
    def make():
        param = nn.Parameter(torch.ones(50, dtype=torch.float16))
        return param, LowPrecisionAdam([param], lr=1e-3)

    param, optimizer = make()
    # Gradients spanning 1e-7..1e-3: v spans 2e-16..2e-8, all below FP16's smallest number unscaled.
    gradient = torch.logspace(-7, -3, 50) * torch.tensor([1.0, -1.0]).repeat(25)
    param.grad = (gradient * 2.0**14).half()  # loss-scaled, as the FP16 gradient would arrive
    assert ((1 - 0.98) * gradient**2).half().eq(0).all()
    optimizer.step(grad_scale=2.0**14)
    exp_avg_sq = read_moment(optimizer.state[param], "exp_avg_sq")
    assert optimizer.state[param]["exp_avg_sq_log2_scale"] > 16  # 2**16 itself would overflow FP16
    torch.testing.assert_close(exp_avg_sq, 0.02 * param.grad.float().div(2.0**14) ** 2, rtol=2e-3, atol=0)

    # Optimizer.load_state_dict casts every state tensor to FP16: the log2 scales must survive it.
    restored_param, restored = make()
    restored_param.data.copy_(param.data)
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    torch.testing.assert_close(
        read_moment(restored.state[restored_param], "exp_avg_sq"), exp_avg_sq
    )

    # The sparsity technique zeroes state at inactive positions: a stored zero reads as a zero moment.
    optimizer.state[param]["exp_avg_sq"][:10] = 0
    assert (read_moment(optimizer.state[param], "exp_avg_sq")[:10] == 0).all()


def test_scaled_fp16_gradient_is_unscaled_in_fp32_not_in_fp16():
    param = nn.Parameter(torch.ones(4, dtype=torch.float16))
    optimizer = LowPrecisionAdam([param], lr=1e-2, eps=1e-12)  # eps far below sqrt(v) ~ 1e-8
    param.grad = torch.full((4,), 1e-8 * 2.0**16).half()  # 1e-8 itself would be 0 in FP16
    optimizer.step(grad_scale=2.0**16)  # Adam's first step: lr * sign(gradient)
    torch.testing.assert_close(param.float(), torch.full((4,), 0.99), atol=1e-3, rtol=0)


@pytest.mark.parametrize("optimizer_class", [LowPrecisionSGD, LowPrecisionAdam])
def test_lr_scheduler_drives_the_optimizers(optimizer_class):
    param = nn.Parameter(torch.ones(3))
    optimizer = optimizer_class([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    for _ in range(2):
        param.grad = torch.ones(3)
        optimizer.step(grad_scale=1.0)
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


# --- loss scaler ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_value", [math.inf, math.nan])
def test_overflow_skips_the_step_unchanged_and_backs_off(bad_value):
    policy, model, optimizer, scaler = build("fp16")
    x, y = batch()
    assert not train_step(model, optimizer, scaler, policy, x, y)[1]  # creates the momentum buffers
    before = snapshot(model, optimizer)
    scale = scaler.scale

    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(cast_input(x, policy)).float(), y)
    scaler.scale_loss(loss).backward()
    model[0].weight.grad[0, 0, 0, 0] = bad_value
    found = scaler.found_overflow(model.parameters())
    if not found:
        optimizer.step(grad_scale=scaler.scale)
    scaler.update(found)

    assert found
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model, optimizer), strict=True))
    assert scaler.scale == scale / 2


def test_clean_steps_grow_the_scale_and_state_round_trips():
    policy, model, optimizer, scaler = build("fp16", init_scale=2.0**8, growth_interval=3)
    for _ in range(4):
        assert not train_step(model, optimizer, scaler, policy, *batch())[1]
    assert scaler.scale == 2.0**9 and scaler.clean_steps == 1
    restored = make_loss_scaler(policy)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict() == {"scale": 2.0**9, "clean_steps": 1}


def test_found_overflow_has_no_false_alarm_and_disabled_scaler_never_skips():
    param = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    param.grad = torch.full((4,), 60000.0, dtype=torch.float16)  # finite, though its L2 norm is not
    assert not LossScaler().found_overflow([param])
    param.grad[0] = math.inf
    disabled = make_loss_scaler(make_policy("bf16", CPU))
    assert not disabled.enabled and disabled.scale == 1.0 and not disabled.found_overflow([param])


def test_overflow_at_the_minimum_scale_means_divergence():
    scaler = LossScaler(init_scale=2.0, min_scale=1.0)
    scaler.update(found_inf=True)
    assert scaler.scale == 1.0
    with pytest.raises(FloatingPointError, match="minimum loss scale"):
        scaler.update(found_inf=True)


# --- stochastic rounding --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_is_unbiased(dtype):
    # Between neighbours, negative, across a binade edge, and (FP16) subnormal.
    values = torch.tensor([1 + 2**-12, -3.3, 0.999, 1e-6, 7e-8 if dtype == torch.float16 else 1e-39])
    samples = values.repeat(20000, 1)
    generator = torch.Generator().manual_seed(0)
    rounded = round_to_dtype(samples, dtype, stochastic=True, generator=generator).float()
    for column, value in zip(rounded.T, values, strict=True):
        # Always one of the two neighbours, and on average the value itself (5-sigma bound).
        lower, upper = column.unique()
        assert lower < value < upper
        assert (column.mean() - value).abs() <= 5 * 0.5 * (upper - lower) / math.sqrt(len(column))
    # The default is round-to-nearest-even, deterministic.
    assert torch.equal(round_to_dtype(samples, dtype), samples.to(dtype))


def test_stochastic_rounding_keeps_updates_smaller_than_half_a_unit():
    def train(stochastic_rounding: bool) -> float:
        param = nn.Parameter(torch.ones(2000, dtype=torch.float16))
        optimizer = LowPrecisionSGD(
            [param],
            lr=1.0,
            momentum=0.0,
            nesterov=False,
            weight_decay=0.0,
            stochastic_rounding=stochastic_rounding,
        )
        for _ in range(40):
            param.grad = torch.full_like(param, -(2.0**-13))  # an eighth of FP16's spacing at 1.0
            optimizer.step()
        return param.float().mean().item()

    assert train(stochastic_rounding=False) == 1.0  # every update rounded away
    assert train(stochastic_rounding=True) == pytest.approx(1 + 40 * 2.0**-13, abs=2e-4)


def test_stochastic_rounding_resumes_from_its_state_dict():
    def make(param):
        return LowPrecisionAdam([param], lr=1e-3, stochastic_rounding=True)

    param = nn.Parameter(torch.randn(100).half())
    optimizer = make(param)
    grads = [torch.randn(100).half() for _ in range(3)]
    param.grad = grads[0]
    optimizer.step()
    saved_param, saved_state = param.detach().clone(), copy.deepcopy(optimizer.state_dict())
    for grad in grads[1:]:
        param.grad = grad
        optimizer.step()

    resumed_param = nn.Parameter(saved_param)
    resumed = make(resumed_param)
    resumed.load_state_dict(saved_state)
    for grad in grads[1:]:
        resumed_param.grad = grad
        resumed.step()
    assert torch.equal(resumed_param, param)


# --- amp and end-to-end ---------------------------------------------------------------------------


def test_amp_runs_on_cpu_with_bf16_autocast_and_fp32_weights():
    policy, model, optimizer, scaler = build("amp")
    assert isinstance(scaler, AmpLossScaler) and not scaler.enabled
    with autocast_context(policy, CPU):
        assert model(torch.randn(2, 3, 8, 8)).dtype == torch.bfloat16
    before = snapshot(model, optimizer)
    assert not train_step(model, optimizer, scaler, policy, *batch())[1]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not torch.equal(before[0], model[0].weight)


def test_amp_scaler_drives_torch_grad_scaler():
    policy = make_policy("amp", CPU)
    model = small_model()
    optimizer = LowPrecisionSGD(model.parameters(), lr=0.05)
    scaler = AmpLossScaler(torch.amp.GradScaler("cpu", init_scale=2.0**10), optimizer)
    x, y = batch()
    loss, found = train_step(model, optimizer, scaler, policy, x, y)
    assert not found and scaler.scale == 2.0**10
    # An overflow: torch's scaler backs off, our caller pattern skips the step.
    before = snapshot(model, optimizer)
    scaler.scale_loss(nn.functional.cross_entropy(model(x), y)).backward()
    model[5].weight.grad[0, 0] = math.inf
    found = scaler.found_overflow(model.parameters())
    assert found and scaler.scale == 1.0  # gradients are unscaled until update
    scaler.update(found)
    assert scaler.scale == 2.0**9
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model, optimizer), strict=True))


def test_short_low_precision_training_decreases_the_loss_like_fp32():
    x, y = batch(16)
    final = {}
    for precision in ("fp32", "fp16", "bf16"):
        torch.manual_seed(0)
        policy, model, optimizer, scaler = build(precision, lr=0.5, stochastic_rounding=precision == "bf16")
        losses = [train_step(model, optimizer, scaler, policy, x, y)[0] for _ in range(25)]
        assert losses[-1] < 0.6 * losses[0], precision
        final[precision] = losses[-1]
    assert final["fp16"] == pytest.approx(final["fp32"], rel=0.05)
    assert final["bf16"] == pytest.approx(final["fp32"], rel=0.05)


def test_fp64_reference_casts_everything_and_sgd_updates_in_fp64():
    model = convert_model(small_model(), make_policy("fp64", CPU))
    assert all(t.dtype == torch.float64 for t in model.state_dict().values() if t.is_floating_point())
    optimizer = LowPrecisionSGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 3, 5, 5, dtype=torch.float64)).sum().backward()
    optimizer.step()
    assert all(optimizer.state[p]["momentum_buffer"].dtype == torch.float64 for p in model.parameters())
