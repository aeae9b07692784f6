"""``model.ops`` (recipes/dc_iwslt/ops.py): PyTorch 1.0.1's operators compute today's functions, and
hold for backward what PyTorch 1.0.1 held (what the report's Table 4 accounting counted)."""

import pytest
import torch
from torch import nn

from lowmem.config import ConfigError
from lowmem.profiler import account_activations
from lowmem.trainer import build_trainer
from recipes.dc_iwslt.model import DynamicConvModel
from recipes.dc_iwslt.ops import LayerNorm, Ops, Pytorch10Ops, ops_named
from recipes.dc_iwslt.recipe import architecture, label_smoothed_loss
from tests.helpers import SMALL_DC, SMALL_DC_ARCH, make_config

ROWS, DIM = 12, 16
F32 = 4


def _grads(fn, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    out = fn(x)
    (out * weight).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_saving_its_input_computes_todays_function_and_gradient(name):
    x, weight = torch.randn(ROWS, DIM, dtype=torch.float64), torch.randn(ROWS, DIM, dtype=torch.float64)
    current = _grads(lambda t: getattr(Ops(), name)(t, -1), x, weight)
    old = _grads(lambda t: getattr(Pytorch10Ops(), name)(t, -1), x, weight)
    for a, b in zip(current, old, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_layer_norm_as_batch_norm_and_addcmul_computes_todays_function_and_gradients():
    norms = {}
    for ops in (Ops(), Pytorch10Ops()):
        torch.manual_seed(0)
        norm = LayerNorm(DIM, ops).double()
        with torch.no_grad():
            norm.weight.normal_()
            norm.bias.normal_()
        norms[ops.name] = norm
    x = torch.randn(3, 4, DIM, dtype=torch.float64) * 5 + 2
    weight = torch.randn_like(x)
    results = {name: (*_grads(norm, x, weight), norm.weight.grad, norm.bias.grad) for name, norm in norms.items()}
    for a, b in zip(results["current"], results["pytorch_1_0"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert set(norms["pytorch_1_0"].state_dict()) == {"weight", "bias"}  # the state dict is nn.LayerNorm's


def test_byte_mask_dropout_drops_scales_and_routes_the_gradient_through_the_same_mask():
    torch.manual_seed(0)
    p = 0.25
    x = (torch.rand(200, 50) + 1).requires_grad_()
    out = Pytorch10Ops().dropout(x, p, training=True)
    kept = out != 0
    assert kept.float().mean().item() == pytest.approx(1 - p, abs=0.02)
    torch.testing.assert_close(out[kept], x.detach()[kept] / (1 - p))
    out.sum().backward()
    torch.testing.assert_close(x.grad, kept.to(x.dtype) / (1 - p))
    # Evaluation and p = 0 return the input itself (PyTorch 1.0 saved nothing for them).
    assert Pytorch10Ops().dropout(x, p, training=False) is x
    assert Pytorch10Ops().dropout(x, 0.0, training=True) is x


def _saved_bytes(fn, x: torch.Tensor, module: nn.Module | None = None) -> int:
    x = x.detach().requires_grad_()
    return account_activations(lambda: fn(x).sum().backward(), module, fake=False).max_saved_bytes


def test_pytorch_1_0_ops_save_what_pytorch_1_0_saved():
    x = torch.randn(ROWS, DIM)
    elements = ROWS * DIM
    # LayerNorm: the input and per-row mean / inverse std today; 1.0 also kept the normalized tensor.
    for ops, saved in ((Ops(), elements * F32 + 2 * ROWS * F32), (Pytorch10Ops(), 2 * elements * F32 + 2 * ROWS * F32)):
        norm = LayerNorm(DIM, ops)
        assert _saved_bytes(norm, x, norm) == saved, ops.name
    # softmax and log-softmax: the output today, input and output in 1.0.
    for name in ("softmax", "log_softmax"):
        assert _saved_bytes(lambda t, name=name: getattr(Ops(), name)(t, -1), x) == elements * F32
        assert _saved_bytes(lambda t, name=name: getattr(Pytorch10Ops(), name)(t, -1), x) == 2 * elements * F32
    # dropout: a byte per element in 1.0 on CUDA; on CPU today's PyTorch keeps the float noise.
    assert _saved_bytes(lambda t: Pytorch10Ops().dropout(t, 0.1, True), x) == elements
    assert _saved_bytes(lambda t: Ops().dropout(t, 0.1, True), x) == elements * F32


SMALL = SMALL_DC_ARCH
NO_DROPOUT = dict(dropout=0.0, weight_dropout=0.0, attention_dropout=0.0)


def test_the_model_and_loss_agree_between_ops_without_dropout():
    """Same weights, float64, training mode with dropout off: same loss and gradients either way."""
    torch.manual_seed(0)
    src, prev = torch.randint(4, 20, (3, 9)), torch.randint(4, 17, (3, 11))
    target = torch.randint(4, 17, (3, 11))
    models = {
        name: DynamicConvModel(20, 17, **SMALL, **NO_DROPOUT, ops=name).double() for name in ("current", "pytorch_1_0")
    }
    models["pytorch_1_0"].load_state_dict(models["current"].state_dict())
    results = {}
    for name, model in models.items():
        loss, _ = label_smoothed_loss(model(src, torch.full((3,), 9), prev), target, 0.1, model.ops)
        loss.backward()
        results[name] = [loss.detach(), *(p.grad for p in model.parameters())]
    for a, b in zip(results["current"], results["pytorch_1_0"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_pytorch_1_0_ops_train_in_pure_16_bit_like_todays(precision):
    """Through the real precision policy (norm parameters stay FP32): each LayerNorm returns its
    input's dtype, and a whole training step runs and updates the weights."""
    trainer = build_trainer(make_config(*SMALL_DC, f"precision={precision}", "model.ops=pytorch_1_0"))
    model = trainer.unwrapped_model
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    norms = [m for m in model.modules() if isinstance(m, LayerNorm)]
    assert norms and all(m.weight.dtype == torch.float32 for m in norms)  # the policy's, not the test's
    seen = []
    hooks = [m.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype))) for m in norms]
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train_step(trainer.example_batch())
    for hook in hooks:
        hook.remove()
    assert seen and all(pair == (dtype, dtype) for pair in seen)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_unknown_ops_is_a_clear_error_naming_the_knob():
    with pytest.raises(ValueError, match=r"model.ops='fast': must be one of current, pytorch_1_0"):
        ops_named("fast")
    with pytest.raises(ConfigError, match=r"model.ops='fast'"):
        architecture(make_config("+recipe=dc_iwslt", "data=fake", "model.ops=fast"))
    assert architecture(make_config("+recipe=dc_iwslt", "data=fake")).ops == "current"  # the default


def test_each_model_part_uses_the_chosen_ops():
    model = DynamicConvModel(20, 17, **SMALL, ops="pytorch_1_0")
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert norms and all(isinstance(m, LayerNorm) and m.ops.name == "pytorch_1_0" for m in norms)
    assert all(m.ops.name == "pytorch_1_0" for m in model.modules() if hasattr(m, "ops"))
