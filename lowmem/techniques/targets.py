"""Which weights of an arbitrary model dynamic sparsity trains sparse (``sparsity.include`` / ``exclude``).

The weights that can be sparse are those of the layers that multiply by their weight and that
compact storage runs itself: ``nn.Linear``, ``nn.Conv1d/2d/3d``, ``nn.Embedding`` and transformers'
``Conv1D`` (GPT-2's linear layers, weight [in, out]) — exactly those classes
(``lowmem.techniques.compact.has_compact_forward``).

The default rule, for a model lowmem did not write: every such weight but the embeddings', except
the model's first and last layers — the stem that reads the input and the classifier / output
projection, the layers sparse-training papers (DSR, RigL, SNFS) keep dense because they are small
and every input or class depends on them alone. "First" and "last" are the first and last modules,
in registration order, that own parameters directly; a model that starts with an embedding keeps
no first linear dense (the embedding is its first layer, and it is not sparsified by default).

``include`` (shell-style patterns over parameter names, e.g. ``layer*.conv*.weight``) replaces the
rule by exactly the weights it matches; ``exclude`` removes weights from whichever set. Nothing
left to sparsify is an error naming the knob.

A weight that several modules share (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) is
one weight, named as ``model.named_parameters()`` names it (its first place): a pattern matching
any of its names includes or excludes it, the default rule skips it when any of its places is the
first or last layer, and it is sparsified once with every place kept tied.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from lowmem.techniques.compact import has_compact_forward

_LAYERS = "Linear, Conv1d/2d/3d, Embedding or transformers' Conv1D"  # the weights that can be sparse
_DEFAULT_LAYERS = "Linear, Conv1d/2d/3d and transformers' Conv1D"  # those the default rule takes


def default_sparse_weights(
    model: nn.Module, include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> list[str]:
    """Parameter names (``layer1.0.conv1.weight``) of the weights to sparsify, in registration order."""
    places = _weight_places(model)
    if include:
        names = [name for name, where in places.items() if _matches(where, include)]
        if not names:
            raise ValueError(
                f"sparsity.include={list(include)!r} matches no {_LAYERS} weight of "
                f"{type(model).__name__}; weights: {', '.join(_weight_names(places)) or 'none'}"
            )
    else:
        owners = [prefix for prefix, module in model.named_modules() if _owns_parameters(module)]
        edges = {owners[0], owners[-1]} if owners else set()
        names = [
            name
            for name, where in places.items()
            if not any(prefix in edges for prefix, _ in where)
            and any(not isinstance(module, nn.Embedding) for _, module in where)
        ]
    names = [name for name in names if not _matches(places[name], exclude)]
    if not names:
        raise ValueError(
            f"sparsity: no weight of {type(model).__name__} is left to sparsify (the default rule takes every "
            f"{_DEFAULT_LAYERS} weight but the first and last layer"
            + (f"; sparsity.exclude={list(exclude)!r} removed the rest" if exclude else "")
            + f"); name weights with sparsity.include=[...] (weights: {', '.join(_weight_names(places)) or 'none'}) "
            "or use sparsity.density=1.0"
        )
    return names


def _weight_places(model: nn.Module) -> dict[str, list[tuple[str, nn.Module]]]:
    """Every weight that can be sparse, by its name in ``model.named_parameters()``: the (module
    prefix, module) of each layer that holds it (several when the weight is tied)."""
    names = {id(param): name for name, param in model.named_parameters()}
    places: dict[str, list[tuple[str, nn.Module]]] = {}
    for prefix, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is not None and id(weight) in names and has_compact_forward(module):
            places.setdefault(names[id(weight)], []).append((prefix, module))
    return places


def _matches(where: list[tuple[str, nn.Module]], patterns: Sequence[str]) -> bool:
    """Whether a pattern matches one of the names of a weight held at ``where``."""
    names = [f"{prefix}.weight" if prefix else "weight" for prefix, _ in where]
    return any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in patterns)


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _weight_names(places: dict[str, list[tuple[str, nn.Module]]], limit: int = 12) -> list[str]:
    names = [f"{prefix}.weight" if prefix else "weight" for where in places.values() for prefix, _ in where]
    return names[:limit] + ([f"... ({len(names) - limit} more)"] if len(names) > limit else [])
