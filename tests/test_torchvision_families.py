"""One model of each torchvision classification family under the full combination, through
``lowmem.prepare``: it trains a step. (The issue allows a refusal in one line naming a knob; all 22
run today, so a refusal is a regression here.)

FP32 (the BF16 run through ``lowmem.profile`` is ``scripts/torchvision_families.py``, whose table is in
the README): density 0.3, microbatches of 2 of a batch of 4, ``residual_star`` every 2, at the
smallest image size the model accepts. The models are built as ``+recipe=vision`` builds them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lowmem
from recipes.vision.models import build_classifier
from scripts.torchvision_families import FAMILIES
from tests.helpers import slow

# The smallest square image each accepts where 32x32 is too small (scripts/vision_input_sizes.py).
IMAGE_SIZES = {"alexnet": 63, "inception_v3": 75, "maxvit_t": 224, "vit_b_16": 224}
COMBINATION = ["sparsity.density=0.3", "microbatch.size=2", "checkpointing.strategy=residual_star",
               "checkpointing.every=2", "precision=fp32", "optim.name=sgd", "optim.lr=0.01", "trainer.device=cpu"]


def classify(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


# The slowest four (12-25 s each on a Zen 3 core) run in `make test-all` only: VGG's layer runs and a
# ViT's encoder are covered in `make test` by tests/test_checkpointing_real_models.py and test_any_model.py.
# So do the larger twin of a family `make test` keeps (4-10 s each): wide_resnet50_2 (resnext50_32x4d's
# bottleneck blocks), swin_v2_t (swin_t), efficientnet_v2_s (efficientnet_b0).
SLOW = {"vgg11", "vgg11_bn", "vit_b_16", "maxvit_t", "wide_resnet50_2", "swin_v2_t", "efficientnet_v2_s"}


@pytest.mark.parametrize("arch", [slow(a) if a in SLOW else a for a in FAMILIES.values()])
def test_the_full_combination_runs_on_each_torchvision_family(arch: str) -> None:
    size = IMAGE_SIZES.get(arch, 32)
    torch.manual_seed(0)
    model = build_classifier({"arch": arch}, num_classes=10, image_size=size)
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 3, size, size, generator=generator), torch.randint(0, 10, (4,), generator=generator))
    run = lowmem.prepare(model, classify, batch, overrides=COMBINATION)
    record = run.step(batch)
    assert torch.isfinite(torch.tensor(record["loss"]))
    assert not record["skipped"]
