"""BatchNorm-ReLU recomputation (``no_bn``) in blocks lowmem did not write.

The built-in recipes' blocks compute every ``conv(relu(norm(x)))`` through
``lowmem.residual.norm_relu_conv``, which checkpointing swaps for a version that stores only ``x``
(``lowmem.techniques.checkpointing.recomputed_norm_relu_conv``). Any other block — torchvision's
ResNet blocks, MobileNet's inverted residuals — can be read the same way: ``route_norm_relu_conv``
traces the block's forward with ``torch.fx`` and finds each BatchNorm module whose only user is a
ReLU (module or function) whose only user is an ``nn.Conv2d``, dense or compact sparse, past
``nn.Identity`` modules between them (a
compact layer is a leaf of the trace: its forward is called, never traced). The block then runs its traced
graph (``torch.fx.Interpreter``, on the block's own modules: no copy, no new parameters, no
generated code), computing each such triple through ``norm_relu_conv``; everything else runs as
traced. A block that cannot be traced (data-dependent control flow), has no such triple, or is
called with keyword arguments runs its own forward, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lowmem.residual import norm_relu_conv, routes_norm_relu_conv
from lowmem.techniques.compact import CompactConv2d, compact_names

_ROUTED = "_lowmem_routed_graph"  # instance attribute of a routed block: its _RoutedForward
_RELU_FUNCTIONS = (F.relu, torch.relu, torch.relu_)


def route_norm_relu_conv(block: nn.Module) -> bool:
    """Make ``block`` compute its BatchNorm-ReLU-conv triples through ``norm_relu_conv`` when it has
    any; whether it now routes them (a block that already does is left as it is)."""
    if routes_norm_relu_conv(block):
        return True
    try:
        graph = _LeafCompactTracer().trace(block)
    except Exception:  # noqa: BLE001 - any tracing failure means: run the block as it is
        return False
    modules = dict(block.named_modules())
    triples = {}
    for node in graph.nodes:
        if node.op != "call_module" or not _conv_takes_recomputed_input(modules.get(node.target)):
            continue
        relu = _through_identities(node.args[0] if node.args else None, modules)
        if not isinstance(relu, fx.Node) or len(relu.users) != 1 or not _is_relu(relu, modules):
            continue
        norm = _through_identities(relu.args[0] if relu.args else None, modules)
        if not isinstance(norm, fx.Node) or len(norm.users) != 1 or norm.op != "call_module":
            continue
        if isinstance(modules.get(norm.target), _BatchNorm) and len(node.args) == 1 and not node.kwargs:
            triples[node] = (norm, relu)
    if not triples:
        return False
    object.__setattr__(block, _ROUTED, _RoutedForward(block, graph, triples))
    object.__setattr__(block, "routes_norm_relu_conv", True)
    return True


def routed_forward(block: nn.Module) -> _RoutedForward | None:
    """The traced forward ``route_norm_relu_conv`` gave ``block`` (None: it runs its own)."""
    return block.__dict__.get(_ROUTED)


class _LeafCompactTracer(fx.Tracer):
    """torch.fx's tracer, with compact sparse layers as leaves: their forward (whose positions change
    at each rewiring) is called, never traced."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return bool(compact_names(module)) or super().is_leaf_module(module, qualified_name)


def _conv_takes_recomputed_input(module: nn.Module | None) -> bool:
    """A plain 2-D convolution, dense or compact sparse (``recomputed_norm_relu_conv`` takes either)."""
    return (
        type(module) in (nn.Conv2d, CompactConv2d)
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    )


def _through_identities(node: object, modules: dict[str, nn.Module]) -> object:
    """The node feeding ``node`` past ``nn.Identity`` modules used once (timm's BasicBlock has a
    disabled DropBlock and anti-aliasing between its BatchNorm, ReLU and convolution): they hand
    their input on, so the triple is still one computation."""
    while (
        isinstance(node, fx.Node)
        and node.op == "call_module"
        and type(modules.get(node.target)) is nn.Identity
        and len(node.users) == 1
        and node.args
    ):
        node = node.args[0]
    return node


def _is_relu(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """A ReLU module or function (in place or not: the routed triple computes it anew)."""
    if node.op == "call_module":
        return type(modules.get(node.target)) is nn.ReLU
    if node.op == "call_function":
        return node.target in _RELU_FUNCTIONS
    return node.op == "call_method" and node.target in ("relu", "relu_")


class _RoutedForward:
    """A block's forward as its traced graph, each triple through ``norm_relu_conv``."""

    def __init__(self, block: nn.Module, graph: fx.Graph, triples: dict) -> None:
        self.module = fx.GraphModule(block, graph)  # shares the block's submodules and parameters
        self.block = block
        self.norms = {node.name: norm.target for node, (norm, _) in triples.items()}  # conv -> its BatchNorm
        self.passed = {n.name for norm, relu in triples.values() for n in (norm, relu)}

    def __call__(self, *args: Any) -> Any:
        return _TripleInterpreter(self).run(*args)


class _TripleInterpreter(fx.Interpreter):
    def __init__(self, routed: _RoutedForward) -> None:
        super().__init__(routed.module, garbage_collect_values=True)
        self.routed = routed

    def run_node(self, node: fx.Node) -> Any:
        if node.name in self.routed.passed:
            # A triple's BatchNorm or ReLU hands its input on: the convolution computes all three.
            return self.env[node.args[0]]
        if node.name in self.routed.norms:
            block = self.routed.block
            norm, conv = block.get_submodule(self.routed.norms[node.name]), block.get_submodule(node.target)
            return norm_relu_conv(block, norm, conv, self.env[node.args[0]])
        return super().run_node(node)
