"""Accounting passes on real tensors, for a model whose step fake tensors cannot run.

Fake tensors carry shapes and dtypes, not values. A step whose shapes depend on its values cannot
run on them: a mixture of experts routes each token to some experts (``nonzero`` on the routing
mask, then one slice per expert: ``DynamicOutputShapeException``), a loss reads ``.item()``
(``DataDependentOutputException``). Neither can an op whose fake implementation refuses what its
real kernel accepts (``torch._grouped_mm`` in FP32 on a CPU: "Expected mat_a to be BFloat16").
Such a model's accounting passes run on real tensors instead (``ActivationTracer`` accounts them
alike), on the model's own device, and each pass puts back what it changed: the gradients, the
buffers (BatchNorm statistics) and the random streams. The model is noted once, with the reason
(``real_pass_reason``): every later pass over it goes straight to real tensors.

The figures are then those of the values measured (the first minibatch, the weights at that
moment): a mixture of experts routing another batch differently holds as many routed tokens in
all (``tokens x experts_per_token``), split otherwise between the experts.

Where a real pass fails too, the step cannot be accounted: ``UnaccountableStep`` (a ValueError,
one line) names the module that failed and the knobs that avoid the pass.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

log = logging.getLogger("lowmem")
T = TypeVar("T")

# Raised by fake tensors where they cannot stand for real ones.
_FAKE_LIMITS = (
    DynamicOutputShapeException,
    DataDependentOutputException,
    UnsupportedOperatorException,
    UnsupportedFakeTensorException,
    GuardOnDataDependentSymNode,
)
# Where torch computes an op's output shape without its values: an error raised in there (a meta
# function's dtype check) is the fake pass's, not necessarily the step's.
_FAKE_MACHINERY = (
    "torch/_subclasses/fake", "torch/_meta_registrations", "torch/_prims", "torch/_refs", "torch/_decomp",
)  # fmt: skip
# Models whose passes run on real tensors, with the reason (weak: a model's note dies with it).
_REAL: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


class UnaccountableStep(ValueError):
    """Neither a fake nor a real pass can account a model's step; the message (one line) names the
    module and the knobs that avoid it."""


def real_pass_reason(model: nn.Module | None) -> str | None:
    """Why ``model``'s accounting runs on real tensors (None: it runs on fake ones)."""
    return None if model is None else _REAL.get(model)


def fake_pass_limit(error: BaseException, model: nn.Module | None = None) -> str | None:
    """Why a fake pass over ``model`` stopped, when ``error`` (raised by it) is a limit of fake
    tensors: a data-dependent shape or value, or an op raising inside torch's fake or meta
    implementations. None: an error of the step itself (lowmem's own refusals included)."""
    if type(error).__module__.startswith("lowmem"):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    in_machinery = any(part in frame.filename.replace("\\", "/") for frame in frames for part in _FAKE_MACHINERY)
    if not isinstance(error, _FAKE_LIMITS) and not in_machinery:
        return None
    what = {
        DynamicOutputShapeException: "an output shape that depends on values",
        DataDependentOutputException: "a value read on fake tensors",
        GuardOnDataDependentSymNode: "control flow on a value",
    }.get(type(error), "an op fake tensors do not run")
    where = failing_module(error, model)
    return f"{first_line(error)} ({what}){f' in {where}' if where else ''}"


def failing_module(error: BaseException, model: nn.Module | None) -> str | None:
    """The innermost module of ``model`` whose ``forward`` the traceback of ``error`` passes through."""
    if model is None:
        return None
    names = {id(module): name or type(model).__name__ for name, module in model.named_modules()}
    found = None
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    return found


def noted_fake_pass_limit(error: BaseException, model: nn.Module) -> str | None:
    """``fake_pass_limit(error, model)``; when it is one, ``model`` is noted (``note_real_passes``):
    its passes run on real tensors from now on. None: the step's own error, to raise as it is."""
    reason = fake_pass_limit(error, model)
    if reason is not None:
        note_real_passes(model, reason)
    return reason


def note_real_passes(model: nn.Module, reason: str) -> None:
    """From now on ``model``'s accounting passes run on real tensors; logged once per model."""
    if model not in _REAL:
        log.info("accounting %s on real tensors: its fake pass stops at %s", type(model).__name__, reason)
    _REAL[model] = reason


@contextlib.contextmanager
def training_state_kept(model: nn.Module) -> Iterator[None]:
    """Inside, a real pass over ``model`` may run: its gradients start at None, and on exit the
    gradients, buffers (BatchNorm statistics, counters) and random streams are as they were."""
    params = list(model.parameters())
    grads = [param.grad for param in params]
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    cuda = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        for param in params:
            param.grad = None
        try:
            yield
        finally:
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)


def real_pass(model: nn.Module, run: Callable[[], T], reason: str) -> T:
    """``run()``, a pass over ``model`` on real tensors because its fake pass stopped (``reason``),
    with the training state kept. lowmem's own refusals and ValueErrors pass through; any other
    error is raised as ``UnaccountableStep``."""
    try:
        with training_state_kept(model):
            return run()
    except Exception as error:
        if isinstance(error, ValueError) or type(error).__module__.startswith("lowmem"):
            raise
        where = failing_module(error, model)
        param = next(model.parameters(), None)
        device, dtype = (torch.device("cpu"), None) if param is None else (param.device, param.dtype)
        if isinstance(error, torch.OutOfMemoryError):
            fix = "a smaller microbatch.size or checkpointing.strategy that fits the device (or a larger device)"
        else:
            fix = f"a real step fails alike: the model does not run in {dtype} as configured (another precision=...)"
        raise UnaccountableStep(
            f"lowmem cannot account {type(model).__name__}'s step: fake tensors stop at {reason}, and a real pass on "
            f"{device} fails{f' in {where}' if where else ''}: {first_line(error)}; {fix}"
        ) from error


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, or its class name when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def named_first_line(error: BaseException, limit: int | None = None) -> str:
    """``ValueError: <the first line of its message>`` (at most ``limit`` characters of it; the class
    name alone without one)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:limit]}" if text else type(error).__name__
