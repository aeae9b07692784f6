"""The vision recipe: any image classifier on the WRN recipe's image data, cross entropy, accuracy.

``model.arch=NAME`` trains a classification model of torchvision's registry (default resnet18),
``model._target_=pkg.module.Class`` a user's class (``recipes/vision/models.py``). Data, loss,
evaluation, batching and the rewiring schedule are the WRN recipe's; what differs is the model, its
sparse weights (the default rule of ``lowmem.techniques.targets``, initialised as the model draws
them), the per-density defaults (no table: 1.0 each) and the image size (``data.image_size``: each
batch resized on its device, after augmentation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import Tensor, nn

from lowmem.config import ConfigError
from lowmem.recipe import RecipeData, TechniqueDefaults
from lowmem.techniques.targets import default_sparse_weights
from recipes.vision.models import build_classifier
from recipes.wrn_cifar.data import IMAGE_SIZE, NUM_CLASSES, DeviceBatches
from recipes.wrn_cifar.recipe import WRNCifarRecipe


def image_size(cfg) -> int:
    """``data.image_size`` in pixels (a side of the square images): the data set's own 32 when unset."""
    size = cfg.data.image_size
    if size is None:
        return IMAGE_SIZE
    if size < 1:
        raise ConfigError(f"data.image_size={size} is not allowed: a positive number of pixels, or null (32)")
    return int(size)


def resize(images: Tensor, size: int) -> Tensor:
    """Images [B, C, H, W] -> [B, C, size, size], bilinear (antialiased when shrinking), computed in
    FP32 or wider and returned in the input's dtype and memory format."""
    compute = torch.promote_types(images.dtype, torch.float32)
    resized = F.interpolate(
        images.to(compute), size=(size, size), mode="bilinear", align_corners=False, antialias=size < images.shape[-1]
    )
    return resized.to(images.dtype)


class ResizedBatches:
    """``DeviceBatches`` whose images are resized to ``size`` x ``size`` pixels, one batch at a time on
    the batches' device (after augmentation and normalisation): the data set itself stays 32x32."""

    def __init__(self, batches: DeviceBatches, size: int) -> None:
        self.batches, self.size = batches, size

    def __len__(self) -> int:
        return len(self.batches)

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
        batches = self.batches.epoch(epoch, start_batch)  # a bad start_batch fails here, not later
        return ((resize(images, self.size), labels) for images, labels in batches)


class VisionRecipe(WRNCifarRecipe):
    """The WRN recipe's data, loss, evaluation and batching with a model of the user's choice."""

    name = "vision"
    data_names = ("digits", "cifar10", "fake")
    primary_metric = "test_acc"
    sparse_init = "model"  # keep the model's own initialisation: lowmem does not know its rule

    def build_model(self, cfg) -> nn.Module:
        knobs = OmegaConf.to_container(cfg.model, resolve=True)
        return build_classifier(knobs, num_classes=NUM_CLASSES, image_size=image_size(cfg))

    def sparsifiable_weights(self, model: nn.Module) -> list[str]:
        # sparsity.include / exclude are applied by the trainer on top of this default rule.
        return default_sparse_weights(model)

    def table_defaults(self, density: float) -> TechniqueDefaults:
        # The report tabulates WRN and DynamicConv only: no multiplier is assumed for other models.
        return TechniqueDefaults(lr_mult=1.0, rewire_fraction_mult=1.0, rewire_freq_mult=1.0)

    def build_data(self, cfg, device: torch.device, input_dtype: torch.dtype) -> RecipeData:
        data = super().build_data(cfg, device, input_dtype)
        size = image_size(cfg)
        if size == IMAGE_SIZE:
            return data
        return dataclasses.replace(
            data,
            train=ResizedBatches(data.train, size),
            test=ResizedBatches(data.test, size),
            description=f"{data.description}, resized to {size}x{size} per batch",
        )


RECIPE = VisionRecipe()
