"""Which weights of an arbitrary model dynamic sparsity trains sparse (``sparsity.include`` / ``exclude``).

The weights that can be sparse are those that compact storage runs itself: the weights of
``nn.Linear``, ``nn.Conv1d/2d/3d``, ``nn.Embedding`` and transformers' ``Conv1D`` (GPT-2's linear
layers, weight [in, out]) — exactly those classes (``lowmem.techniques.compact.has_compact_forward``)
— and stacked matrices: a parameter of 3 or more dims of any other module, whose leading dims index
matrices (``lowmem.techniques.compact.is_stacked_matrices``), as transformers 5 stores a mixture of
experts (``mlp.experts.gate_up_proj`` [experts, 2·intermediate, hidden], ``mlp.experts.down_proj``).

The default rule, for a model lowmem did not write: every such weight that trains
(``requires_grad``) but the embeddings', the routers' and the model's first and last layers', and of
stacked matrices only an experts module's:

- **first and last layer**: the stem that reads the input and the classifier / output projection,
  the layers sparse-training papers (DSR, RigL, SNFS) keep dense because they are small and every
  input or class depends on them alone. "First" and "last" are the first and last modules, in
  registration order, that own parameters directly; a model that starts with an embedding keeps no
  first linear dense (the embedding is its first layer, and it is not sparsified by default).
- **experts module** (``expert_count``): a module whose class name ends in ``Experts`` or that has an
  integer ``num_experts`` (every transformers experts class), holding stacked matrices; or a
  ``ModuleList`` / ``ModuleDict`` of experts (named ``experts``, or of such a class). Each expert's
  matrix gets the density (``lowmem.techniques.sparsity``).
- **router** (``router_weights``): the layer that scores the experts, which every token's routing
  depends on (small, as the first and last layers are). Recognised by its shape and place, not its
  name: a 2-D weight of a sibling of an experts module (a module with the same parent), or of a
  sibling's child, whose outputs are as many as the experts (Mixtral's ``mlp.gate``, Switch's
  ``mlp.router.classifier``) or one (a shared expert's gate: Qwen2-MoE's ``mlp.shared_expert_gate``).
  transformers 5's routers hold a bare 2-D weight (not an ``nn.Linear``), which cannot be sparse
  anyway; a router that is an ``nn.Linear`` stays dense by this rule.
- **frozen weights** (``requires_grad=False``: a LoRA model's base weights) stay as they are: a
  sparse fine-tune of adapters wants its base intact.
- **zero-initialised weights** (every entry 0 when sparsity attaches: LoRA's ``lora_B``, a
  ControlNet's zero convolutions, DiT's zero-initialised modulation) stay dense: DSR prunes by
  magnitude across all sparse weights, and a weight that starts at zero has none to keep it; on a
  peft LoRA Llama, ``lora_B`` of ``q_proj`` kept 1 of its 128 entries after five rewirings.
  With peft's LoRA, then, ``lora_A`` is the sparse weight; its inactive entries are zeroed, and as
  ``lora_B`` starts at 0 the adapted model still starts equal to its base.

``include`` (shell-style patterns over parameter names, e.g. ``layer*.conv*.weight``) replaces the
rule by exactly the weights it matches, frozen ones too (``DynamicSparsity`` warns, prunes them once
and never rewires them); ``exclude`` removes weights from whichever set. Nothing left to sparsify is
an error naming the knob.

A weight that several modules share (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) is
one weight, named as ``model.named_parameters()`` names it (its first place): a pattern matching
any of its names includes or excludes it, the default rule skips it when any of its places is the
first or last layer, and it is sparsified once with every place kept tied.

Nothing stays dense silently: ``dense_weights`` lists every multiplying weight (of a ``Linear``,
convolution, ``Conv1D``, experts module or router) a run leaves dense, with why; ``DynamicSparsity``
logs it once and the profile JSON holds it (``dense_weights``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Sequence

import torch
from torch import nn

from lowmem.techniques.compact import has_compact_forward, is_stacked_matrices, is_transformers_conv1d

_LAYERS = "Linear, Conv1d/2d/3d, Embedding or transformers' Conv1D weight or stacked matrices (experts)"
_DEFAULT_LAYERS = "trainable Linear, Conv1d/2d/3d, transformers' Conv1D and experts'"

Place = tuple[str, nn.Module, str]  # (module prefix, module, parameter attribute)


def default_sparse_weights(
    model: nn.Module, include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> list[str]:
    """Parameter names (``layer1.0.conv1.weight``) of the weights to sparsify, in registration order."""
    places = _weight_places(model)
    if include:
        names = [name for name, where in places.items() if _matches(where, include)]
        if not names:
            raise ValueError(
                f"sparsity.include={list(include)!r} matches no {_LAYERS} of "
                f"{type(model).__name__}; weights: {', '.join(_weight_names(places)) or 'none'}"
            )
    else:
        kept, edges = _kept_dense(model, places), _edge_layers(model)
        names = [name for name, where in places.items() if name not in kept and _taken_by_default(edges, where)]
    names = [name for name in names if not _matches(places[name], exclude)]
    if not names:
        frozen = [name for name, param in model.named_parameters() if name in places and not param.requires_grad]
        raise ValueError(
            f"sparsity: no weight of {type(model).__name__} is left to sparsify (the default rule takes every "
            f"{_DEFAULT_LAYERS} weight but the routers' and the first and last layer's"
            + (f"; {len(frozen)} frozen weights are left as they are" if frozen else "")
            + (f"; sparsity.exclude={list(exclude)!r} removed the rest" if exclude else "")
            + f"); name weights with sparsity.include=[...] (weights: {', '.join(_weight_names(places)) or 'none'}) "
            "or use sparsity.density=1.0"
        )
    return names


def dense_weights(model: nn.Module, sparse: Collection[str]) -> dict[str, str]:
    """The multiplying weights of ``model`` that stay dense while the weights ``sparse`` are sparse,
    in registration order, each with why (what keeps it out of the default rule, if anything):
    ``frozen``, ``router``, ``first layer``, ``last layer``, ``zero-initialised``, ``<class> is not a
    layer lowmem runs sparse`` (a subclass of ``nn.Linear``, a transposed convolution) or ``left out
    by the rule`` (the recipe's rule, ``sparsity.include`` / ``exclude``). Call it before the sparse
    weights are made compact (it reads the dense model).

    Multiplying weights: the weights (2 dims or more) of every ``nn.Linear``, convolution and
    transformers ``Conv1D`` (subclasses included), experts' stacked matrices and routers' weights.
    Embeddings are lookups, not counted; nor are other bare parameters."""
    params = dict(model.named_parameters())
    names = {id(param): name for name, param in params.items()}
    routers = set(router_weights(model))
    edges = _edge_layers(model)
    dense: dict[str, str] = {}
    for prefix, module in model.named_modules():
        for attr, param in module._parameters.items():
            name = names.get(id(param)) if param is not None else None
            if name is None or name in sparse or name in dense or param.dim() < 2:
                continue
            layer = isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)) or is_transformers_conv1d(module)
            if name in routers:
                dense[name] = "router"
            elif (layer and attr == "weight") or (
                is_stacked_matrices(module, attr) and expert_count(prefix, module) is not None
            ):
                dense[name] = _why_dense(module, prefix, params[name], edges)
    return dense


def summarize_weights(labelled: dict[str, str]) -> str:
    """Weight names in a line (``dense_weights``'s, say): grouped by their label (none: ``""``), names
    that differ only in their numbers (layer indices) written once with ``*`` for them and counted
    (``model.layers.*.mlp.gate.weight (x32)``)."""
    groups: dict[str, dict[str, list[str]]] = {}
    for name, why in labelled.items():
        pattern = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name)
        groups.setdefault(why, {}).setdefault(pattern, []).append(name)
    return "; ".join(
        (f"{why}: " if why else "")
        + ", ".join(names[0] if len(names) == 1 else f"{pattern} (x{len(names)})" for pattern, names in by.items())
        for why, by in groups.items()
    )


def expert_count(prefix: str, module: nn.Module) -> int | None:
    """How many experts ``module`` (named ``prefix`` in its model) holds if it is an experts module,
    else ``None``: a module whose class name ends in ``Experts`` or with an integer ``num_experts``,
    holding stacked matrices (their leading dim, or ``num_experts``, counts the experts); or a
    ``ModuleList`` / ``ModuleDict`` named ``experts`` or of such a class (one child per expert)."""
    named = type(module).__name__.endswith("Experts")
    declared = getattr(module, "num_experts", None)
    declared = declared if isinstance(declared, int) and not isinstance(declared, bool) else None
    if isinstance(module, nn.ModuleList | nn.ModuleDict):
        return len(module) if named or declared is not None or prefix.rpartition(".")[2] == "experts" else None
    stacked = [param for attr, param in module._parameters.items() if is_stacked_matrices(module, attr)]
    if not stacked or not (named or declared is not None):
        return None
    return declared if declared is not None else stacked[0].shape[0]


def router_weights(model: nn.Module) -> list[str]:
    """Parameter names of the routers' weights (see the module docstring): a 2-D weight held by a
    sibling of an experts module, or by a sibling's child, with as many outputs as experts, or one."""
    names = {id(param): name for name, param in model.named_parameters()}
    found: list[str] = []
    for prefix, module in model.named_modules():
        experts = expert_count(prefix, module)
        if experts is None or not prefix:
            continue
        parent = model.get_submodule(prefix.rpartition(".")[0])
        for sibling in parent.children():
            if sibling is module:
                continue
            for candidate in (sibling, *sibling.children()):
                weight = candidate._parameters.get("weight")
                if weight is None or weight.dim() != 2 or id(weight) not in names:
                    continue
                outputs = weight.shape[1] if is_transformers_conv1d(candidate) else weight.shape[0]
                if outputs in (experts, 1) and names[id(weight)] not in found:
                    found.append(names[id(weight)])
    return found


def _why_dense(module: nn.Module, prefix: str, weight: torch.Tensor, edges: dict[str, str]) -> str:
    if not weight.requires_grad:
        return "frozen"
    if prefix in edges:
        return edges[prefix]
    if _all_zero(weight):
        return "zero-initialised"
    if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)) and not has_compact_forward(module):
        return f"{type(module).__name__} is not a layer lowmem runs sparse"
    return "left out by the rule"


def _edge_layers(model: nn.Module) -> dict[str, str]:
    """The prefixes of the model's first and last modules that own parameters: "first layer", "last layer"."""
    owners = [prefix for prefix, module in model.named_modules() if _owns_parameters(module)]
    if not owners:
        return {}
    return {owners[-1]: "last layer", owners[0]: "first layer" if len(owners) > 1 else "first and last layer"}


def _kept_dense(model: nn.Module, candidates: Collection[str]) -> set[str]:
    """Names of the weights the default rule keeps dense whatever their layer: routers, frozen weights
    and, of ``candidates``, the zero-initialised."""
    params = dict(model.named_parameters())
    frozen = {name for name, param in params.items() if not param.requires_grad}
    zero = {name for name in candidates if name not in frozen and _all_zero(params[name])}
    return frozen | zero | set(router_weights(model))


def _all_zero(weight: torch.Tensor) -> bool:
    """Whether every entry of ``weight`` is zero (a weight without data, on the meta device, is not)."""
    return not weight.is_meta and not bool(weight.detach().any())


def _taken_by_default(edges: dict[str, str], where: list[Place]) -> bool:
    """Whether the default rule takes a (trainable, non-router) weight held at ``where``: none of its
    places in the first or last layer, and one that is a layer's other than an embedding's or an
    experts module's stacked matrices."""
    if any(prefix in edges for prefix, _, _ in where):
        return False
    return any(
        expert_count(prefix, module) is not None
        if is_stacked_matrices(module, attr)
        else not isinstance(module, nn.Embedding)
        for prefix, module, attr in where
    )


def _weight_places(model: nn.Module) -> dict[str, list[Place]]:
    """Every weight that can be sparse, by its name in ``model.named_parameters()``: the (module
    prefix, module, attribute) of each place that holds it (several when the weight is tied)."""
    names = {id(param): name for name, param in model.named_parameters()}
    places: dict[str, list[Place]] = {}
    for prefix, module in model.named_modules():
        if has_compact_forward(module):
            attrs = ["weight"]
        else:
            attrs = [attr for attr in module._parameters if is_stacked_matrices(module, attr)]
        for attr in attrs:
            param = module._parameters.get(attr)
            if param is not None and id(param) in names:
                places.setdefault(names[id(param)], []).append((prefix, module, attr))
    return places


def _qualified(prefix: str, attr: str) -> str:
    return f"{prefix}.{attr}" if prefix else attr


def _matches(where: list[Place], patterns: Sequence[str]) -> bool:
    """Whether a pattern matches one of the names of a weight held at ``where``."""
    names = [_qualified(prefix, attr) for prefix, _, attr in where]
    return any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in patterns)


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _weight_names(places: dict[str, list[Place]], limit: int = 12) -> list[str]:
    names = [_qualified(prefix, attr) for where in places.values() for prefix, _, attr in where]
    return names[:limit] + ([f"... ({len(names) - limit} more)"] if len(names) > limit else [])
