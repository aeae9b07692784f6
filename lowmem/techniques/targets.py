"""Which weights of an arbitrary model dynamic sparsity trains sparse (``sparsity.include`` / ``exclude``).

The default rule, for a model lowmem did not write: every ``nn.Conv2d`` and ``nn.Linear`` weight
(exactly those classes: compact storage runs their forward itself), except the model's first and
last layers when they are convolutions or linears — the stem that reads the input and the
classifier / output projection, the layers sparse-training papers (DSR, RigL, SNFS) keep dense
because they are small and every input or class depends on them alone. "First" and "last" are the
first and last modules, in registration order, that own parameters directly; a model that starts
with an embedding keeps no first linear dense (the embedding is its first layer, and it is not
sparsified by default).

``include`` (shell-style patterns over parameter names, e.g. ``layer*.conv*.weight``) replaces the
rule by exactly the weights it matches (any Conv2d, Linear or Embedding weight of >= 2 dims);
``exclude`` removes weights from whichever set. Nothing left to sparsify is an error naming the knob.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

_DEFAULT_TYPES = (nn.Conv2d, nn.Linear)
_INCLUDABLE_TYPES = (nn.Conv2d, nn.Linear, nn.Embedding)


def default_sparse_weights(
    model: nn.Module, include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> list[str]:
    """Parameter names (``layer1.0.conv1.weight``) of the weights to sparsify, in registration order."""
    if include:
        names = [
            f"{prefix}.weight" if prefix else "weight"
            for prefix, module in model.named_modules()
            if type(module) in _INCLUDABLE_TYPES and getattr(module, "weight", None) is not None
        ]
        names = [name for name in names if any(fnmatch.fnmatchcase(name, pattern) for pattern in include)]
        if not names:
            raise ValueError(
                f"sparsity.include={list(include)!r} matches no Conv2d, Linear or Embedding weight of "
                f"{type(model).__name__}; weights: {', '.join(_weight_names(model)) or 'none'}"
            )
    else:
        owners = [(prefix, module) for prefix, module in model.named_modules() if _owns_parameters(module)]
        edges = {owners[0][0], owners[-1][0]} if owners else set()
        names = [
            f"{prefix}.weight" if prefix else "weight"
            for prefix, module in owners
            if type(module) in _DEFAULT_TYPES and prefix not in edges
        ]
    for pattern in exclude:
        names = [name for name in names if not fnmatch.fnmatchcase(name, pattern)]
    if not names:
        raise ValueError(
            f"sparsity: no weight of {type(model).__name__} is left to sparsify (the default rule takes every "
            "Conv2d and Linear weight but the first and last layer"
            + (f"; sparsity.exclude={list(exclude)!r} removed the rest" if exclude else "")
            + f"); name weights with sparsity.include=[...] (weights: {', '.join(_weight_names(model)) or 'none'}) "
            "or use sparsity.density=1.0"
        )
    return names


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _weight_names(model: nn.Module, limit: int = 12) -> list[str]:
    names = [
        f"{prefix}.weight" if prefix else "weight"
        for prefix, module in model.named_modules()
        if type(module) in _INCLUDABLE_TYPES
    ]
    return names[:limit] + ([f"... ({len(names) - limit} more)"] if len(names) > limit else [])
