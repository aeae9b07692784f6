"""Image classifiers the vision recipe can train: torchvision's registry by name, or a user's class.

``model.arch=NAME`` builds ``torchvision.models.get_model(NAME, weights=None, num_classes=10, **rest)``;
``model._target_=pkg.module.Class`` builds ``Class(**rest)`` (Hydra's instantiate convention), where
``rest`` are the other ``model.*`` keys. Keys set to null are ignored.

Before training, one forward pass of a batch of 2 fake images at the run's image size (shapes only:
``FakeTensorMode``, no arithmetic, no memory) shows whether the model accepts that size; a model that
does not (vit_b_16 needs exactly 224, alexnet and inception_v3 more than 32) is refused at start,
with the smallest size tried that works.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torchvision
from torch import nn
from torch._subclasses import fake_tensor
from torch.func import functional_call
from torch.nn.parameter import is_lazy

from lowmem.config import ConfigError

DEFAULT_ARCH = "resnet18"
# googlenet and inception_v3 return (logits, auxiliary logits) in training unless aux_logits=False;
# init_weights=True is torchvision's current initialisation, stated to silence its FutureWarning.
TORCHVISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "googlenet": {"aux_logits": False, "init_weights": True},
    "inception_v3": {"aux_logits": False, "init_weights": True},
}
# Square image sizes (pixels) tried, in order, for a model that refuses data.image_size.
CANDIDATE_SIZES = (32, 48, 64, 75, 96, 128, 160, 192, 224, 256, 299, 384, 448, 512)
PROBE_BATCH = 2  # BatchNorm needs more than one value per channel in training mode
# Fake tensors cannot run these (data-dependent shapes, ops without a meta kernel): the probe
# then cannot tell, and the first real step will.
_PROBE_LIMITS = (
    fake_tensor.DataDependentOutputException,
    fake_tensor.DynamicOutputShapeException,
    fake_tensor.UnsupportedFakeTensorException,
    fake_tensor.UnsupportedOperatorException,
)
LIST_HINT = (
    "list them with: python -c 'import torchvision; print(torchvision.models.list_models(module=torchvision.models))'"
)


def torchvision_classifiers() -> list[str]:
    """Names of torchvision's image classification models (``model.arch`` values)."""
    return torchvision.models.list_models(module=torchvision.models)


def model_constructor(knobs: dict[str, Any], num_classes: int) -> tuple[Callable[..., nn.Module], dict[str, Any], str]:
    """(constructor, keyword arguments, description for errors) chosen by the ``model.*`` knobs."""
    knobs = {key: value for key, value in knobs.items() if value is not None}
    arch, target = knobs.pop("arch", None), knobs.pop("_target_", None)
    if arch is not None and target is not None:
        raise ConfigError(
            f"model.arch={arch!r} and model._target_={target!r} are both set: give one "
            "(a torchvision name or your own class)"
        )
    if target is not None:
        return locate(str(target)), knobs, f"model._target_={target}"
    arch = DEFAULT_ARCH if arch is None else str(arch)
    names = torchvision_classifiers()
    if arch not in names:
        close = difflib.get_close_matches(arch, names, n=3)
        suggestion = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(
            f"model.arch={arch!r} is not a torchvision classification model: {suggestion}"
            f"{len(names)} are available; {LIST_HINT}"
        )

    def build(**kwargs: Any) -> nn.Module:
        return torchvision.models.get_model(arch, weights=None, **kwargs)

    return build, {"num_classes": num_classes, **TORCHVISION_DEFAULTS.get(arch, {}), **knobs}, f"model.arch={arch}"


def locate(target: str) -> Callable[..., nn.Module]:
    """The class (or function) ``pkg.module.Name``, importable from the working directory too."""
    module_name, _, attribute = target.rpartition(".")
    if not module_name:
        raise ConfigError(f"model._target_={target!r} is not a dotted path: give pkg.module.Class")
    if os.getcwd() not in sys.path:  # `python -m` puts it there; a console script or a test may not
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # whatever the module raises while importing: report it, in one line
        raise ConfigError(f"model._target_={target!r}: cannot import {module_name}: {one_line(error)}") from error
    if not hasattr(module, attribute):
        raise ConfigError(f"model._target_={target!r}: module {module_name} has no attribute {attribute!r}")
    return getattr(module, attribute)


def build_classifier(knobs: dict[str, Any], *, num_classes: int, image_size: int) -> nn.Module:
    """The model ``model.*`` describes, checked to turn [B, 3, image_size, image_size] images into
    logits [B, >= num_classes]; a model that cannot is refused naming ``data.image_size``."""
    constructor, kwargs, description = model_constructor(knobs, num_classes)
    try:
        model = constructor(**kwargs)
    except (TypeError, ValueError, AssertionError) as error:  # torchvision asserts on bad arguments
        given = sorted(key for key, value in knobs.items() if value is not None and key not in ("arch", "_target_"))
        keys = ", ".join(f"model.{key}" for key in given) or "none given"
        raise ConfigError(
            f"{description} refuses the keyword arguments (model.*: {keys}): {one_line(error)}"
        ) from error
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{description} built a {type(model).__name__}, not a torch.nn.Module")
    # Lazy modules take their shapes from a first batch: a real one, at the run's image size.
    lazy = any(is_lazy(parameter) for parameter in model.parameters())
    error = forward_error(model, image_size, num_classes) if lazy else input_size_error(model, image_size, num_classes)
    if error is not None:
        works = [] if lazy else [s for s in CANDIDATE_SIZES if s != image_size and probe(model, s, num_classes) is None]
        hint = (
            f"; the smallest size that works of {', '.join(map(str, CANDIDATE_SIZES))} is {works[0]}" if works else ""
        )
        if str(knobs.get("arch")).startswith("vit_"):
            hint += "; or build the transformer for the size: +model.image_size=N (a multiple of its patch size)"
        raise ConfigError(f"{description} cannot classify images of data.image_size={image_size}: {error}{hint}")
    return model


def input_size_error(model: nn.Module, image_size: int, num_classes: int) -> str | None:
    """Why ``model`` cannot classify images of ``image_size`` pixels, or None if it can.

    Shapes are probed with fake tensors; a refusal is confirmed by one real forward pass, since a
    model may do what fake tensors cannot.
    """
    if probe(model, image_size, num_classes) is None:
        return None
    return forward_error(model, image_size, num_classes)


def forward_error(model: nn.Module, image_size: int, num_classes: int) -> str | None:
    """One real training-mode forward of a batch of 2 zero images of ``image_size`` pixels: the error
    it raises or None. Runs on copies of the buffers with the random state restored afterwards, so
    the model and the run's random numbers are as they were."""
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    images = torch.zeros(PROBE_BATCH, 3, image_size, image_size, device=_device(model))
    with torch.random.fork_rng(devices=[]), torch.no_grad(), _training(model):
        try:
            return _output_error(functional_call(model, buffers, (images,), strict=False), num_classes)
        except Exception as error:  # the model's own complaint about the input, in one line
            return one_line(error)


def probe(model: nn.Module, image_size: int, num_classes: int) -> str | None:
    """One training-mode forward of a batch of 2 fake images of ``image_size`` pixels (shapes only):
    the error it raises or None. The model's parameters and buffers are untouched."""
    mode = fake_tensor.FakeTensorMode()
    state = {name: mode.from_tensor(t) for name, t in _tensors(model)}
    logger = logging.getLogger(fake_tensor.__name__)
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # it logs every failing meta kernel with a traceback
    try:
        with torch.no_grad(), _training(model), mode:
            images = torch.zeros(PROBE_BATCH, 3, image_size, image_size, device=_device(model))
            return _output_error(functional_call(model, state, (images,)), num_classes)
    except _PROBE_LIMITS:
        return None
    except Exception as error:  # the model's own complaint about the input, in one line
        return one_line(error)
    finally:
        logger.setLevel(level)


def _output_error(output: Any, num_classes: int) -> str | None:
    if isinstance(output, torch.Tensor) and output.dim() == 2 and output.shape[1] >= num_classes:
        return None
    shape = list(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
    return f"the model returned {shape}; the vision recipe needs logits [batch, {num_classes}]"


def _tensors(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def _device(model: nn.Module) -> torch.device:
    return next((t.device for _, t in _tensors(model)), torch.device("cpu"))


@contextmanager
def _training(model: nn.Module) -> Iterator[None]:
    """Training mode for the duration (the mode the model will run in), then each module's own."""
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def one_line(error: BaseException) -> str:
    """``Type: first line of the message`` (tracebacks and multi-line messages are for logs)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
