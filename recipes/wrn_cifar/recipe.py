"""The WRN / CIFAR-10 recipe: WideResNet, image data on the device, cross entropy, accuracy.

Per-density defaults follow the report: Table 6 (LR multipliers) and Table 8 (rewiring fraction and
frequency multipliers). A density between tabulated ones takes the nearest tabulated row.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from lowmem.config import ConfigError, data_device, evaluation_batch_size
from lowmem.recipe import RecipeData, TechniqueDefaults, check_model_knobs
from lowmem.techniques.convolutions import input_memory_format
from lowmem.techniques.microbatch import split_by_examples
from lowmem.techniques.sparsity import WRN_SCHEDULE, RewireSchedule
from recipes.wrn_cifar.data import DeviceBatches, evaluation_batches, load_image_dataset, training_batches
from recipes.wrn_cifar.model import WideResNet

# density: (LR multiplier [Table 6], rewire fraction multiplier, rewire frequency multiplier [Table 8])
TABLE_DEFAULTS = {
    1.0: (0.5, 1.0, 1.0),
    0.5: (0.5, 4.0, 0.5),
    0.4: (1.0, 1.0, 2.0),
    0.3: (1.0, 2.0, 0.5),
    0.2: (1.0, 2.0, 1.0),
    0.1: (0.5, 1.0, 0.5),
    0.05: (0.5, 1.0, 0.25),
}
REPORT_EPOCHS = 200  # the rewiring schedule's epochs are stated for a 200-epoch run


@dataclass
class WRNModelConfig:
    depth: int = 28
    width: int = 2
    num_classes: int = 10


def nearest_table_row(table: dict[float, tuple], density: float) -> tuple:
    keys = sorted(table)
    i = bisect.bisect_left(keys, density)
    candidates = keys[max(i - 1, 0) : i + 1]
    return table[min(candidates, key=lambda k: abs(k - density))]


def model_config(cfg) -> WRNModelConfig:
    """``model.*`` checked against WRNModelConfig: an unknown key fails naming it."""
    check_model_knobs(cfg.model, WRNModelConfig, "wrn_cifar")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(WRNModelConfig), cfg.model))


class WRNCifarRecipe:
    name = "wrn_cifar"
    data_names = ("digits", "cifar10", "fake")
    primary_metric = "test_acc"
    sparse_init = "he_normal"  # DSR's WRN rule (SPEC §5): sparse convs re-drawn He-normal, not rescaled

    def build_model(self, cfg) -> nn.Module:
        m = model_config(cfg)
        try:
            return WideResNet(depth=m.depth, width=m.width, num_classes=m.num_classes)
        except ValueError as error:
            raise ConfigError(str(error)) from error

    def sparsifiable_weights(self, model: nn.Module) -> list[str]:
        return model.sparsifiable_weights()

    def table_defaults(self, density: float) -> TechniqueDefaults:
        return TechniqueDefaults(*nearest_table_row(TABLE_DEFAULTS, density))

    def rewire_schedule(self, cfg, run_epochs: float) -> RewireSchedule:
        # The schedule's epochs are stated for 200 epochs; they scale with the run's real length
        # (trainer.epochs, or fewer when trainer.max_steps ends it), so a short run keeps every
        # phase, including the last epochs without rewiring that train the regrown weights.
        scale = run_epochs / REPORT_EPOCHS
        return RewireSchedule(
            starts=tuple(s * scale for s in WRN_SCHEDULE.starts),
            periods=WRN_SCHEDULE.periods,
            stop=WRN_SCHEDULE.stop * scale,
            unit="epoch",
        )

    def build_data(self, cfg, device: torch.device, input_dtype: torch.dtype) -> RecipeData:
        options = {
            k: v
            for k, v in (("train_size", cfg.data.train_size), ("test_size", cfg.data.test_size))
            if v is not None
        }
        # data.device=cpu keeps the images in (pinned) host memory; each minibatch is copied over.
        storage = data_device(cfg, device)
        data = load_image_dataset(cfg.data.name, cfg.data.root, storage, **options)
        if storage != device and device.type == "cuda":
            for name in ("train_images", "train_labels", "test_images", "test_labels"):
                setattr(data, name, getattr(data, name).pin_memory())
        # 16-bit images on CUDA arrive channels-last, and every activation follows (techniques.convolutions).
        layout = input_memory_format(input_dtype, device)
        # Digits are not mirror-symmetric: the data set says whether flips are a valid augmentation.
        train = training_batches(
            data, cfg.data.batch_size, seed=cfg.trainer.seed, dtype=input_dtype, device=device, memory_format=layout
        )
        test = evaluation_batches(
            data, evaluation_batch_size(cfg), dtype=input_dtype, device=device, memory_format=layout
        )
        description = (
            f"{data.name}: {len(data.train_labels)} train / {len(data.test_labels)} test images on {storage}, "
            f"{len(train)} minibatches of {cfg.data.batch_size} per epoch"
        )
        resident = (data.train_images, data.train_labels, data.test_images, data.test_labels,
                    *train.normalization, *test.normalization)
        return RecipeData(train=train, test=test, description=description, resident=resident)

    def batch_size(self, batch) -> int:
        return int(batch[1].shape[0])

    def shard(self, batch, rank: int, world_size: int) -> tuple:
        share = self.batch_size(batch) // world_size  # the global batch is divisible (checked at start)
        return tuple(t[rank * share : (rank + 1) * share] for t in batch)

    def split(self, batch, microbatch_size: int) -> Sequence[tuple[tuple, float]]:
        return split_by_examples(batch, microbatch_size)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images).float(), labels)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, test: DeviceBatches) -> dict[str, float]:
        correct, loss_sum, count = 0, 0.0, 0
        for images, labels in test.epoch(0):
            logits = model(images).float()
            loss_sum += float(F.cross_entropy(logits, labels, reduction="sum"))
            correct += int((logits.argmax(1) == labels).sum())
            count += int(labels.numel())
        return {"test_acc": 100.0 * correct / count, "test_loss": loss_sum / count}


RECIPE = WRNCifarRecipe()
