"""The accuracy the report measured for a configuration, for ``lowmem.plan``'s table (SPEC §4).

Checkpointing changes no computation (gradients are bit-identical to ``none``) and true token
microbatches are exact, so a figure depends on:

- WRN-28-2 / CIFAR-10, Table 3: density and microbatch. Its rows are FP16 + residual_star every 2,
  except the dense FP32 baseline; the report found FP16 and FP32 equally accurate (94.43 against
  94.37 dense), so a row's figure is shown for either precision, the dense minibatch-100 row per
  precision.
- DynamicConv / IWSLT'14, Table 4: density and precision (microbatches of 250 tokens, exact).

A figure holds for the report's model and minibatch only (WRN-28-2 at 100 examples; the full
DynamicConv at 4,000 tokens); any other configuration gets None ("n/a" in the table).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# recipe -> (metric name, the report's baseline figure, the model knobs and minibatch it holds for)
_SETTINGS: dict[str, tuple[str, float, dict[str, int], int]] = {
    "wrn_cifar": ("test acc %", 94.37, {"depth": 28, "width": 2}, 100),
    "dc_iwslt": ("BLEU", 35.15, {"encoder_layers": 7, "decoder_layers": 6, "embed_dim": 512, "ffn_dim": 1024}, 4000),
}
# Table 3: (density, microbatch examples) -> test accuracy %; the dense minibatch-100 row per precision.
_TABLE3 = {(1.0, 10): 94.28, (0.3, 10): 93.95, (0.2, 10): 93.64, (0.2, 4): 93.08, (0.1, 4): 91.75}
_TABLE3_DENSE = {"fp32": 94.37, "fp16": 94.43}
# Table 4: (density, precision) -> BLEU.
_TABLE4 = {
    (1.0, "fp32"): 35.15, (1.0, "fp16"): 34.99, (0.5, "fp32"): 34.71, (0.5, "fp16"): 34.61,
    (0.4, "fp32"): 34.35, (0.4, "fp16"): 34.25, (0.3, "fp32"): 34.08, (0.3, "fp16"): 33.92,
}  # fmt: skip


def reported_metric(
    recipe: str, model: Mapping[str, Any], batch_size: int, density: float, microbatch: int | None, precision: str
) -> tuple[str, float, float] | None:
    """(metric name, the report's figure, its cost against the report's FP32 dense baseline) for a
    configuration, or None where the report has no figure for it."""
    if recipe not in _SETTINGS:
        return None
    name, baseline, knobs, reported_batch = _SETTINGS[recipe]
    if batch_size != reported_batch or any(model.get(knob) != value for knob, value in knobs.items()):
        return None
    if recipe == "wrn_cifar":
        examples = batch_size if microbatch is None else microbatch
        if (density, examples) == (1.0, batch_size):
            value = _TABLE3_DENSE.get(precision)
        else:
            value = _TABLE3.get((density, examples))
    else:
        value = _TABLE4.get((density, precision))
    return None if value is None else (name, value, round(baseline - value, 2))
