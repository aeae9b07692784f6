"""What the trainer needs from a recipe (a task: model, data, loss, evaluation), and where recipes live.

``lowmem`` knows no task. A recipe is a module ``recipes.<name>.recipe`` exposing ``RECIPE``, an
object with the interface below. Batches are opaque to the trainer: only the recipe splits them
into microbatches, computes their loss and moves them between devices.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lowmem.config import ConfigError

KNOWN_RECIPES = ("wrn_cifar", "dc_iwslt", "vision")


@dataclass(frozen=True)
class TechniqueDefaults:
    """Per-density defaults from the report's tables (LR multiplier; rewiring fraction and frequency)."""

    lr_mult: float
    rewire_fraction_mult: float
    rewire_freq_mult: float


class TrainBatches(Protocol):
    def __len__(self) -> int: ...  # minibatches per epoch

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        """The minibatches of ``epoch`` from ``start_batch`` on; a function of (seed, epoch) only."""
        ...


@dataclass
class RecipeData:
    train: TrainBatches
    test: Any  # whatever the recipe's ``evaluate`` reads
    description: str  # one line for the log: data set, sizes
    resident: tuple[torch.Tensor, ...] = ()  # the data set's tensors kept on the device (measured peak: "data")


class Recipe(Protocol):
    name: str
    data_names: tuple[str, ...]  # accepted values of `data=`
    primary_metric: str  # key of ``evaluate``'s result that "best" refers to (higher is better)
    sparse_init: str  # how sparsity initialises sparse weights: "he_normal" or "model" (keep the model's)

    def build_model(self, cfg: Any) -> nn.Module: ...

    def sparsifiable_weights(self, model: nn.Module) -> list[str]: ...

    def table_defaults(self, density: float) -> TechniqueDefaults: ...

    def rewire_schedule(self, cfg: Any, run_epochs: float) -> Any:
        """The DSR schedule (a lowmem.techniques.sparsity.RewireSchedule) for a run of ``run_epochs``."""
        ...

    def build_data(self, cfg: Any, device: torch.device, input_dtype: torch.dtype) -> RecipeData: ...

    def batch_size(self, batch: Any) -> int: ...  # examples (vision) or target tokens (translation)

    def shard(self, batch: Any, rank: int, world_size: int) -> Any:
        """This rank's share of a global minibatch (data parallel)."""
        ...

    def split(self, batch: Any, microbatch_size: int) -> Sequence[tuple[Any, float]]:
        """Microbatches of ``batch`` with the weight of each (its share of the minibatch's units)."""
        ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean training loss over the units of ``batch``, as an FP32 scalar."""
        ...

    def evaluate(self, model: nn.Module, test: Any) -> dict[str, float]: ...


def check_model_knobs(knobs: Any, schema: type, recipe: str) -> dict[str, Any]:
    """``model.*`` as a plain dict, refusing keys that are not fields of the dataclass ``schema``."""
    values = OmegaConf.to_container(knobs, resolve=True) if isinstance(knobs, DictConfig) else dict(knobs)
    allowed = sorted(f.name for f in fields(schema))
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ConfigError(
            f"model.{unknown[0]} is not a knob of recipe {recipe}: allowed model.{{{', '.join(allowed)}}}"
        )
    return values


def get_recipe(name: str) -> Recipe:
    if name not in KNOWN_RECIPES:
        raise ConfigError(f"recipe={name!r} is unknown: choose one of {', '.join(KNOWN_RECIPES)}")
    return importlib.import_module(f"recipes.{name}.recipe").RECIPE
