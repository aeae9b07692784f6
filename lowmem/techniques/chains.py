"""Activation checkpointing for a model lowmem did not write: find its chains of blocks, wrap them.

A model written for lowmem declares its residual blocks (``lowmem.residual``); any other model is
read as it is. ``find_block_chains`` finds the chains of blocks a model runs one after another —
torchvision ResNet's BasicBlocks across ``layer1..layer4``, MobileNet's ``features``, ViT's
``encoder.layers``, a GPT's ``nn.ModuleList`` of blocks called in a Python loop with a mask —
or takes them from ``checkpointing.blocks`` (module paths, or a block class name). A model with no
such container but an ``nn.Sequential`` of plain layers (VGG's and AlexNet's ``features``) has
that Sequential cut into *layer runs*, as ``torch.utils.checkpoint.checkpoint_sequential`` cuts
it: each run one layer with weights and the norms and parameter-free layers after it (an in-place
ReLU stays with the layer whose output it changes); the runs are the chain's blocks.
``install_chains`` then wraps each block's ``forward`` on the instance, as torch's
``apply_activation_checkpointing`` wraps modules, without touching the user's class, module tree,
parameter names or state-dict keys; the model's own forward keeps calling its blocks as before. The
``nn.Sequential`` calling a chain's blocks (and a plain-layer Sequential, its runs) gets an instance
``forward`` too: its own loop, which compiled runs whole (``lowmem.techniques.chain_containers``).

How a chain runs is its *plan*: one ``Segment`` (``lowmem.techniques.recomputation``) per block,
shared by consecutive blocks of one segment. ``stored`` blocks run plainly. In a checkpointed
segment each block call becomes one ``_ChainedBlock`` autograd node: the segment's first block
saves its input, the others save nothing of the activation they receive (only their context,
e.g. a mask), and backward recomputes:

- ``all_at_once`` (``residual``): the first block backward reaches rebuilds the graphs of every
  block of the segment from the segment's input, then each block backpropagates its own graph;
- ``recursively`` (``residual_star``): the first block backward reaches recomputes the block
  inputs without a graph and holds them; each block then rebuilds its own graph from its input,
  backpropagates it and drops it.

A block called with keyword arguments only (diffusers' ``down_block(hidden_states=h, temb=emb)``)
is called with its forward's first parameter moved to the front, which binds it alike. A block may
return a tensor or a tuple, list, dict or ModelOutput of tensors and other values
(T5's layers return ``(hidden, position_bias, None)``): the first tensor is the one chained to the
next block, every tensor is an output of the autograd node (a position bias later blocks read gets
its gradient), and the structure is returned as the block returned it.

A block joins the running segment only if its input is the very tensor (same object, unchanged
since) the previous block of the chain returned in this forward; otherwise it starts a new segment
and saves its input. So code between blocks (``x = x * 2``), an in-place op on a block's output,
blocks skipped or called out of order cost memory, never correctness. Recomputation replays each
block's RNG state (the same dropout masks) and autocast state, and sends BatchNorm running-statistic
updates to scratch buffers, so statistics are updated exactly once per forward (SPEC §6). ``no_bn``
and the BatchNorm recomputation of ``residual_star`` apply to blocks whose BatchNorm-ReLU-conv
triples ``lowmem.techniques.norm_routing`` finds.

Checkpointing cannot be silently wrong. Every tensor a block lets out other than by its output (a
hook's router logits or attention maps, a tensor a module stores) is an output of its autograd node
too, found in every forward (``lowmem.techniques.side_outputs``), so its gradient flows through the
recomputation. And (``lowmem.techniques.block_checks``), checked once per block and input shape:

- a block that changes its input or a context tensor in place, or an object passed into it (a
  key/value cache it appends to: found by a bounded walk of the argument's attributes and items
  before and after forward), is refused with a ValueError naming the block, the argument and
  ``checkpointing.blocks``. A Hugging Face model's cache (its config's ``use_cache``) is switched
  off while it trains with checkpointed blocks, as transformers' own gradient checkpointing does;
  a cache the caller asks for explicitly is refused so;
- a block's first recomputation for an input shape is compared with a fingerprint of its forward's
  output (bitwise on CPU and under deterministic algorithms, ``trainer.deterministic``; else the
  float64 sums within ``block_checks.RELATIVE_TOLERANCE``): a difference (a forward that depends on
  state outside its inputs) stops the step with ``RecomputationMismatch`` naming the block and
  ``checkpointing.blocks`` before any weight is updated. Stopping, rather than dropping the block
  from checkpointing, because the gradients of the step already under way are wrong.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_flatten, tree_unflatten

from lowmem.residual import compiled_backend, residual_stacks
from lowmem.techniques.block_checks import OutputFingerprint, argument_state, has_values
from lowmem.techniques.chain_containers import ContainerForward, sequential_containers
from lowmem.techniques.compact_shards import gathered_for
from lowmem.techniques.compilation import (
    NOT_WHOLE,
    checked_key,
    compiled_call,
    outside_compiler,
    run_whole,
    whole_allowed,
)
from lowmem.techniques.compression import compressed_saves, stored_saves
from lowmem.techniques.norm_routing import route_norm_relu_conv, routed_forward
from lowmem.techniques.recomputation import (
    Segment,
    _AutocastState,
    _hold,
    _recomputation_input,
    _RngState,
    scratch_running_stats,
)
from lowmem.techniques.shards import is_fsdp_module
from lowmem.techniques.side_outputs import (
    ForwardWatch,
    RecomputeCollect,
    SideOutputMismatch,
    SideOutputRefused,
)

_CONTAINERS = (nn.Sequential, nn.ModuleList)
_RUNNERS = "_lowmem_block_chains"  # attribute of the root model: its ChainRunners
_CACHE_SWITCHED = "_lowmem_caches_switched_off"  # attribute of the root model during a training forward
_CACHE_LOGGED = "_lowmem_caches_off_logged"
_CACHE_CONFIGS = "_lowmem_cache_configs"  # attribute of the root model: its configs with use_cache
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockChain:
    """Blocks a model runs one after another, in forward order, with their module paths."""

    names: tuple[str, ...]
    blocks: tuple[nn.Module, ...]
    container: nn.Sequential | None = None  # a plain-layer Sequential whose layer runs are the blocks

    def __str__(self) -> str:
        return f"{len(self.blocks)} x {_describe(self.blocks)} ({_span(self.names)})"


# --- finding the chains ----------------------------------------------------------------------------


def find_block_chains(model: nn.Module, blocks: Sequence[str] = ()) -> list[BlockChain]:
    """The chains of blocks of ``model``: detected, or those ``blocks`` names (``checkpointing.blocks``:
    module paths — a container's children are its blocks — or one class name). Raises ValueError
    naming ``checkpointing.blocks`` when nothing is found."""
    found, layer_chains = _named_blocks(model, blocks) if blocks else (_detected_blocks(model), [])
    if not found and not blocks:
        layer_chains = _layer_chains(model)
    if not found and not layer_chains and not blocks:
        found = _root_blocks(model)
    if not found and not layer_chains:
        raise ValueError(
            f"checkpointing: no chain of blocks found in {type(model).__name__} (lowmem looks for nn.Sequential / "
            "nn.ModuleList containers of composite modules); name them with checkpointing.blocks=<module path(s) or "
            f"block class name>, e.g. checkpointing.blocks=[{_example_paths(model)}]"
        )
    return _group_by_owner(found) + layer_chains


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _is_composite(module: nn.Module) -> bool:
    return any(True for _ in module.children()) and _has_parameters(module)


def _detected_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Outermost containers holding composite modules: their parameterized children are blocks."""
    found: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, _CONTAINERS) and any(_is_composite(c) for c in child.children()):
                found.extend(
                    (f"{path}.{n}", c) for n, c in child.named_children() if _has_parameters(c)
                )
            elif any(True for _ in child.children()):
                visit(child, path)

    visit(model, "")
    return found


def _root_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The last resort: the model's own composite children (Inception v3's ``Conv2d_1a_3x3`` ..
    ``Mixed_7c``, attributes its forward calls one after another) when it has two or more. A child
    its forward does not call on the previous one's output (an auxiliary head) starts a new segment
    that stores its input: memory, never correctness."""
    children = [(name, child) for name, child in model.named_children() if _is_composite(child)]
    return children if len(children) >= 2 else []


def _named_blocks(model: nn.Module, names: Sequence[str]) -> tuple[list[tuple[str, nn.Module]], list[BlockChain]]:
    """The blocks ``names`` names, and the chains of layer runs of the plain-layer Sequentials it names."""
    modules = dict(model.named_modules())
    classes = {type(m).__name__ for m in modules.values()}
    if len(names) == 1 and names[0] not in modules and names[0] in classes:
        matches = [(path, m) for path, m in modules.items() if type(m).__name__ == names[0] and path]
        outermost = [(p, m) for p, m in matches if not any(p.startswith(q + ".") for q, _ in matches)]
        return outermost, []
    found, layer_chains = [], []
    for name in names:
        if name not in modules or not name:
            close = difflib.get_close_matches(name, [*modules, *classes], n=4)
            raise ValueError(
                f"checkpointing.blocks={name!r} is neither a module path nor a block class of "
                f"{type(model).__name__}" + (f"; close: {', '.join(close)}" if close else "")
            )
        module = modules[name]
        if _is_plain_layer_sequence(module):
            layer_chains.append(_layer_chain(name, module))
        elif isinstance(module, _CONTAINERS):
            found.extend((f"{name}.{n}", c) for n, c in module.named_children() if _has_parameters(c))
        else:
            found.append((name, module))
    return found, layer_chains


# A chain of plain layers (VGG's and AlexNet's ``features``) is cut into runs, each one layer with
# weights (a convolution, a linear layer) and the normalizations and parameter-free layers
# (activations, pooling, dropout) after it, as torch's checkpoint_sequential cuts a Sequential:
# an in-place activation then stays with the layer whose output it changes.
_NORMS = (_BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm, nn.modules.instancenorm._InstanceNorm)


class LayerRun(nn.Sequential):
    """Consecutive layers of a plain-layer ``nn.Sequential``, run as one block of its chain. Not part
    of the model's module tree: it holds the model's own layers (no copy, no state-dict key)."""


def _is_plain_layer_sequence(module: nn.Module) -> bool:
    """An ``nn.Sequential`` of leaf layers, two or more of them with weights."""
    layers = list(module.children())
    return (
        type(module) is nn.Sequential
        and all(not any(True for _ in layer.children()) for layer in layers)
        and sum(_starts_a_run(layer) for layer in layers) >= 2
    )


def _starts_a_run(layer: nn.Module) -> bool:
    return _has_parameters(layer) and not isinstance(layer, _NORMS)


def _layer_chains(model: nn.Module) -> list[BlockChain]:
    """The outermost plain-layer Sequentials of ``model``, each a chain of layer runs."""
    chains: list[BlockChain] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if _is_plain_layer_sequence(child):
                chains.append(_layer_chain(path, child))
            else:
                visit(child, path)

    visit(model, "")
    return chains


def _layer_chain(path: str, sequence: nn.Sequential) -> BlockChain:
    """``sequence`` cut into runs: a new run at each layer with weights other than a norm (layers
    before the first join the first run)."""
    runs: list[list[tuple[str, nn.Module]]] = []
    for name, layer in sequence.named_children():
        if not runs or (_starts_a_run(layer) and any(_starts_a_run(m) for _, m in runs[-1])):
            runs.append([])
        runs[-1].append((name, layer))
    names = tuple(f"{path}.{run[0][0]}" + (f"-{run[-1][0]}" if len(run) > 1 else "") for run in runs)
    blocks = tuple(LayerRun(*(layer for _, layer in run)) for run in runs)
    return BlockChain(names, blocks, container=sequence)


def _group_by_owner(found: list[tuple[str, nn.Module]]) -> list[BlockChain]:
    """One chain per calling module, blocks in registration order, each block once. The children of
    a container (``layer1.0``, ``layer1.1``) belong to the container's caller, so that sibling
    containers run back to back (``layer1``, ``layer2``) make one chain."""
    chains: dict[str, list[tuple[str, nn.Module]]] = {}
    seen: set[int] = set()
    for path, module in found:
        if id(module) not in seen:
            seen.add(id(module))
            parent = path.rpartition(".")[0]
            owner = parent.rpartition(".")[0] if path.rpartition(".")[2].isdigit() else parent
            chains.setdefault(owner, []).append((path, module))
    return [BlockChain(tuple(p for p, _ in members), tuple(m for _, m in members)) for members in chains.values()]


def _describe(blocks: Sequence[nn.Module]) -> str:
    names = sorted({type(b).__name__ for b in blocks})
    return "/".join(names[:3]) + ("/..." if len(names) > 3 else "")


def _span(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def _example_paths(model: nn.Module) -> str:
    containers = [p for p, m in model.named_modules() if isinstance(m, _CONTAINERS) and p]
    return ",".join(containers[:2]) or "features"


# --- wrapping ---------------------------------------------------------------------------------------


def installed_runners(model: nn.Module) -> list[ChainRunner]:
    """The chain runners ``install_chains`` attached to ``model`` (empty if none)."""
    return list(getattr(model, _RUNNERS, ()))


def install_chains(model: nn.Module, chains: Sequence[BlockChain]) -> list[ChainRunner]:
    """Wrap every block of ``chains`` (plain until a plan is set); replaces earlier wrapping."""
    uninstall_chains(model)
    runners = [ChainRunner(chain) for chain in chains]
    for runner in runners:
        if runner.chain.container is None:
            for container, items, indices in sequential_containers(model, runner.chain.names, runner.blocks):
                runner.add_container(container, items, indices)
    # A plain attribute, not a submodule: no parameters, no state-dict keys.
    object.__setattr__(model, _RUNNERS, runners)
    configs = _cache_configs(model)
    if configs:
        # Found once here, not at every forward: the hook runs in the training step.
        object.__setattr__(model, _CACHE_CONFIGS, configs)
        model.register_forward_pre_hook(_caches_off)
        model.register_forward_hook(_caches_restored, always_call=True)
    return runners


def uninstall_chains(model: nn.Module) -> None:
    """Give every wrapped block its own forward back."""
    for runner in installed_runners(model):
        runner.unwrap()
    for attribute in (_RUNNERS, _CACHE_CONFIGS):
        model.__dict__.pop(attribute, None)
    for hooks in (model._forward_pre_hooks, model._forward_hooks):
        for key in [key for key, hook in hooks.items() if hook in (_caches_off, _caches_restored)]:
            del hooks[key]
            model._forward_hooks_always_called.pop(key, None)


# --- caches of transformers models ------------------------------------------------------------------
# A Hugging Face model with use_cache (the default) hands a key/value cache to every layer, which
# appends to it in forward and would append again in recomputation: attention over doubled keys.
# So, as transformers' own gradient_checkpointing_enable() does, the cache is off while the model
# trains with checkpointed blocks; evaluation and generation keep the model's setting. A cache the
# caller asks for explicitly (use_cache=True) is refused at the block (``_check_arguments``).


def _cache_configs(model: nn.Module) -> list:
    """The configs (each once) of ``model``'s modules that carry a ``use_cache`` flag."""
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(getattr(config, "use_cache", None), bool):
            configs[id(config)] = config
    return list(configs.values())


def _caches_off(model: nn.Module, args: tuple) -> None:
    """Forward pre-hook of the root model: caches off for a training forward with checkpointed blocks."""
    runners = installed_runners(model)
    checkpointed = any(r.plan is not None or r.observer is not None for r in runners)
    if not (model.training and torch.is_grad_enabled() and checkpointed):
        return
    switched = [config for config in model.__dict__.get(_CACHE_CONFIGS, ()) if config.use_cache]
    for config in switched:
        config.use_cache = False
    if switched and not model.__dict__.get(_CACHE_LOGGED):
        object.__setattr__(model, _CACHE_LOGGED, True)
        log.info("checkpointing: %s trains with use_cache=False (a key/value cache appended to in forward would "
                 "be appended to again when blocks are recomputed); evaluation keeps its setting",
                 type(model).__name__)
    object.__setattr__(model, _CACHE_SWITCHED, switched)


def _caches_restored(model: nn.Module, args: tuple, output: Any) -> None:
    """Forward hook of the root model: the caches ``_caches_off`` switched off are on again."""
    for config in model.__dict__.pop(_CACHE_SWITCHED, ()):
        config.use_cache = True


# --- running the blocks -----------------------------------------------------------------------------


class _ChainedForward:
    """The instance ``forward`` of a wrapped block: hands the call to its chain's runner. Remembers
    the input shapes for which the block's arguments and its recomputation were checked."""

    def __init__(self, runner: ChainRunner, index: int, own: Callable | None) -> None:
        self.runner, self.index, self.own = runner, index, own
        self.arguments_checked: set[tuple] = set()
        self.recomputation_checked: set[tuple] = set()
        self.side_checked: set[tuple] = set()  # trainer.compile: inputs it may run compiled on (_BlockCall)
        self.first_parameter = _first_parameter(own if own is not None else type(runner.blocks[index]).forward,
                                                bound=own is not None)

    def positional(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call with its chained input first: a block called with keyword arguments only
        (diffusers' ``down_block(hidden_states=h, temb=emb)``) has the keyword of its forward's first
        parameter moved to the front, which binds it to the same parameter."""
        name = self.first_parameter
        if args or name is None or name not in kwargs:
            return args, kwargs
        rest = dict(kwargs)
        return (rest.pop(name),), rest

    def plain(self, *args, **kwargs):
        block = self.runner.blocks[self.index]
        routed = routed_forward(block)
        if routed is not None and not kwargs:  # BatchNorm-ReLU-conv triples through norm_relu_conv
            return routed(*args)
        if self.own is not None:
            return self.own(*args, **kwargs)
        return type(block).forward(block, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.runner.call(self.index, args, kwargs)


def _first_parameter(forward: Callable, bound: bool) -> str | None:
    """The name of ``forward``'s first parameter after ``self`` if it may be passed by keyword."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    parameters = parameters if bound else parameters[1:]
    if not parameters or parameters[0].kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD,):
        return None
    return parameters[0].name


@dataclass
class _Last:
    """The block call a chained block's input must come from."""

    index: int
    segment: int
    output: weakref.ref
    version: int
    runtime: _Runtime


class ChainRunner:
    """Runs one chain's blocks by its plan: plainly, or checkpointed segment by segment."""

    def __init__(self, chain: BlockChain) -> None:
        self.chain = chain
        self.blocks = list(chain.blocks)
        self.forwards: list[_ChainedForward] = []
        for index, block in enumerate(self.blocks):
            forward = _ChainedForward(self, index, block.__dict__.get("forward"))
            block.forward = forward
            self.forwards.append(forward)
        # Containers calling the blocks (a plain-layer Sequential's runs; an nn.Sequential of blocks,
        # added by install_chains): run whole when compiled (lowmem.techniques.chain_containers).
        self.containers: list[ContainerForward] = []
        if chain.container is not None:
            self.add_container(chain.container, self.blocks, range(len(self.blocks)))
        # Block calls of checkpointed segments that ran neither compiled nor watched clean (a side
        # output found, a block not compiled, an input not checkpointed): a container's run that
        # added none may run whole next time.
        self.unchecked_calls = 0
        self.plan: list[tuple[int, Segment]] | None = None  # per block: (segment number, segment)
        self.observer: Callable | None = None  # the planner's recorder (lowmem.planning.measure)
        self._last: _Last | None = None
        # Checkpointed calls run eagerly under torch.compile (lowmem.techniques.compilation): in
        # forward and in the recomputation alike; RNG replay and the self-check are Python.
        self._checkpointed = outside_compiler(self._checkpointed_call)

    def __getstate__(self) -> dict[str, Any]:
        # The last block call (a weak reference to its output) lives for one forward only: a
        # pickled model (torch.save(run.model)) or a copy starts its next forward without it.
        return {**self.__dict__, "_last": None, "_checkpointed": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._checkpointed = outside_compiler(self._checkpointed_call)

    def add_container(self, container: nn.Module, items: Sequence[nn.Module], indices: Sequence[int | None]) -> None:
        """``container`` calls ``items`` (``indices``: each one's block index, or None): its forward
        becomes a ``ContainerForward``."""
        forward = ContainerForward(self, container, items, indices)
        container.forward = forward
        self.containers.append(forward)

    def forget_last(self) -> None:
        """The next block call starts a segment of its own (a container ran whole before it)."""
        self._last = None

    def unwrap(self) -> None:
        for block, forward in zip(self.blocks, self.forwards, strict=True):
            if forward.own is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = forward.own
        for container in self.containers:
            container.owner.__dict__.pop("forward", None)

    def set_segments(self, segments: Sequence[Segment] | None) -> None:
        """Run the blocks in ``segments`` (covering the chain exactly), or plainly (None)."""
        self._last = None
        if segments is None or all(s.backprop == "stored" and s.bits is None and not s.offload for s in segments):
            self.plan = None
            return
        plan = []
        for number, segment in enumerate(segments):
            plan.extend((number, segment) for _ in range(segment.blocks))
        if len(plan) != len(self.blocks):
            raise ValueError(f"a schedule of {len(plan)} blocks for a chain of {len(self.blocks)}")
        self.plan = plan

    def call(self, index: int, args: tuple, kwargs: dict) -> Any:
        forward = self.forwards[index]
        args, kwargs = forward.positional(args, kwargs)
        if self.observer is not None:
            return self.observer(self, index, args, kwargs)
        x = args[0] if args else None
        usable = isinstance(x, torch.Tensor) and x.is_floating_point() and torch.is_grad_enabled()
        if self.plan is None:
            self._last = None
            return forward.plain(*args, **kwargs)
        if not usable or self.plan[index][1].backprop == "stored":
            self._last = None
            segment = self.plan[index][1]
            self.unchecked_calls += segment.backprop != "stored"
            with stored_saves(segment.bits, segment.offload):
                return forward.plain(*args, **kwargs)
        return self._checkpointed(index, args, kwargs)

    def _checkpointed_call(self, index: int, args: tuple, kwargs: dict) -> Any:
        """A block call of a checkpointed segment: one autograd node (``_ChainedBlock``), eager
        under ``torch.compile`` (``_checkpointed``)."""
        forward, x = self.forwards[index], args[0]
        number, segment = self.plan[index]
        last = self._last
        chained = (
            last is not None
            and last.index == index - 1
            and last.segment == number
            and last.output() is x
            and x._version == last.version
        )
        runtime = last.runtime if chained else _Runtime(segment.backprop)
        call = _BlockCall(forward, len(runtime.calls), args[1:], kwargs, x)
        context = _BlockCall.tensors(args[1:], kwargs)
        block = self.blocks[index]
        call.compile_for(block, x, context)
        if call.compiled is not None and whole_allowed(block):
            # trainer.compile_segments=stack, and watched before on such an input: the block is one
            # compiled checkpoint region (its own; its input kept), recomputed by the compiler.
            output = run_whole(_block_in_graph, compiled_backend(block), block, block, args, kwargs)
            if output is not NOT_WHOLE:
                self._last = None
                return output
        runtime.calls.append(call)
        params = [p for p in self.blocks[index].parameters() if p.requires_grad]
        with compressed_saves(None):  # recomputation starts from the exact input
            tensors = _ChainedBlock.apply(runtime, call, x, call.num_context, *context, *params)
        # After the block's own outputs come its side outputs (lowmem.techniques.side_outputs): the
        # autograd node connected them where the block left them; the caller does not see them here.
        tensors = tensors[: len(tensors) - len(call.side_indices)]
        if call.compiled is None and (call.checked is None or call.checked not in forward.side_checked):
            self.unchecked_calls += 1
        self._last = _Last(index, number, weakref.ref(tensors[0]), tensors[0]._version, runtime)
        return call.rebuild_output(tensors)


def _block_in_graph(block: nn.Module, args: tuple, kwargs: dict) -> Any:
    """A chained block's call as the compiler traces it (``trainer.compile_segments=stack``): one
    ``torch.utils.checkpoint`` region, which the compiler's partitioner recomputes in backward from
    its inputs (its class's ``forward``: the instance's is lowmem's runner)."""
    return torch.utils.checkpoint.checkpoint(_class_forward, block, *args, use_reentrant=False, **kwargs)


def _class_forward(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Not compilation's "forward" runner, which resets COMPILED_TRIPLES: a Python side effect a
    # checkpoint region may not have under fullgraph.
    return type(block).forward(block, *args, **kwargs)


class _BlockCall:
    """One block call of a checkpointed segment: how to run it again, and under which state. Its
    tensor arguments are handed to the autograd node (saved there, visible to the profiler), not
    kept here; of its output, only the structure (which leaves are tensors) and, at the first call
    for an input shape, a fingerprint to check the recomputation against."""

    def __init__(self, forward: _ChainedForward, position: int, args: tuple, kwargs: dict, x: torch.Tensor):
        self.forward, self.position = forward, position  # position: in the segment
        leaves, self.spec = tree_flatten((args, kwargs))
        self.is_tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        self.skeleton = [None if t else leaf for t, leaf in zip(self.is_tensor, leaves, strict=True)]
        self.num_context = sum(self.is_tensor)
        self.ctx: weakref.ref | None = None  # the autograd node's ctx, for its saved tensors
        self.rng = _RngState(x.device)
        self.autocast = _AutocastState.capture(x.device)
        self.shape = (tuple(x.shape), x.dtype, x.device)  # the key of the once-per-shape checks
        self.output_spec = None  # tree spec of the block's output
        self.output_is_tensor: list[bool] = []  # per leaf of the output
        self.output_skeleton: list = []  # its non-tensor leaves (None where a tensor is)
        self.fingerprint: OutputFingerprint | None = None
        # The tensors the block let out other than by its output (lowmem.techniques.side_outputs):
        # their op indices in its forward, and their shapes and dtypes.
        self.side_indices: list[int] = []
        self.side_layout: list[tuple[tuple[int, ...], torch.dtype]] = []
        # Recomputation must give the forward's bits where kernels are deterministic.
        self.bitwise = x.device.type == "cpu" or torch.are_deterministic_algorithms_enabled()
        # trainer.compile: the block's compiled runner where this call runs it compiled (its input
        # was watched eagerly before and let no side output out), else None; ``checked``: the key a
        # watched eager forward without side outputs establishes (lowmem.techniques.compilation).
        self.compiled: Callable | None = None
        self.checked: tuple | None = None

    def compile_for(self, block: nn.Module, x: torch.Tensor, context: Sequence[torch.Tensor]) -> None:
        """Decide whether this call runs ``block`` compiled (``trainer.compile``): not a block with a
        forward of its own instance (``forward.own``), and only once a watched eager forward on such
        an input (and such other arguments) found no side output."""
        runner = compiled_call(block, "forward") if self.forward.own is None else None
        if runner is None:
            return
        self.checked = (*checked_key([block], x, tuple(context)), str(self.spec), tuple(map(repr, self.skeleton)))
        if self.checked in self.forward.side_checked:
            self.compiled = runner

    @staticmethod
    def tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensor arguments of a call, in the order ``run`` takes them back."""
        return [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)]

    def arguments(self, context: Sequence[torch.Tensor]) -> tuple[tuple, dict]:
        """The call's arguments after the chained input, with ``context`` as their tensors."""
        tensors = iter(context)
        leaves = [next(tensors) if t else leaf for t, leaf in zip(self.is_tensor, self.skeleton, strict=True)]
        return tree_unflatten(leaves, self.spec)

    def run(self, x: torch.Tensor, context: Sequence[torch.Tensor]) -> Any:
        args, kwargs = self.arguments(context)
        if self.compiled is not None:
            return self.compiled(self.block(), x, *args, **kwargs)
        return self.forward.plain(x, *args, **kwargs)

    def run_watched(self, run: Callable, x: torch.Tensor, context: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Forward: ``run(self, x, context)``'s output tensors, then the block's side outputs (every
        tensor that needs a gradient and leaves the block another way), whose op indices are kept
        for the recomputation to find them again."""
        watch = ForwardWatch()
        with watch:
            output = self.output_tensors(run(self, x, context))
        try:
            side = watch.escaped(output)
        except SideOutputRefused as refused:
            raise ValueError(
                f"checkpointing: block {self.name()} ({type(self.block()).__name__}) {refused}, or leave it out of "
                "the checkpointed blocks with checkpointing.blocks=..."
            ) from None
        self.side_indices = [index for index, _ in side]
        self.side_layout = [(tuple(t.shape), t.dtype) for _, t in side]
        return [*output, *(t for _, t in side)]

    def run_collecting(self, x: torch.Tensor, context: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Recomputation: the output tensors, then the recomputed side outputs (found by op index)."""
        if not self.side_indices:
            return self.output_tensors(self.run(x, context))
        collect = RecomputeCollect(self.side_indices)
        with collect:
            output = self.output_tensors(self.run(x, context))
        try:
            return [*output, *collect.collected(self.side_indices, self.side_layout)]
        except SideOutputMismatch as mismatch:
            raise RecomputationMismatch(
                f"checkpointing: block {self.name()} ({type(self.block()).__name__}) recomputed in backward differs "
                f"from its forward ({mismatch}); leave it out of the checkpointed blocks with checkpointing.blocks=..."
            ) from None

    def output_tensors(self, output: Any) -> list[torch.Tensor]:
        """The tensors of the block's ``output`` (a tensor, or a tuple, list, dict or ModelOutput of
        them and other values); at forward, its structure is recorded for ``rebuild_output``. The
        first one must be a floating-point tensor: the one that flows to the next block."""
        leaves, spec = tree_flatten(output)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if self.output_spec is None:
            if not tensors or not tensors[0].is_floating_point():
                raise ValueError(
                    f"checkpointing: block {self.name()} ({type(self.block()).__name__}) returns "
                    f"{type(output).__name__} whose first tensor is no floating-point tensor; checkpoint other "
                    "blocks with checkpointing.blocks=..."
                )
            self.output_spec = spec
            self.output_is_tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
            self.output_skeleton = [None if t else leaf for t, leaf in zip(self.output_is_tensor, leaves, strict=True)]
        return tensors

    def rebuild_output(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The block's output as the block returned it, with ``tensors`` (the autograd node's) in it."""
        if self.output_spec.is_leaf():
            return tensors[0]
        given = iter(tensors)
        pairs = zip(self.output_is_tensor, self.output_skeleton, strict=True)
        leaves = [next(given) if is_tensor else leaf for is_tensor, leaf in pairs]
        return tree_unflatten(leaves, self.output_spec)

    def check_recomputation(self, tensors: Sequence[torch.Tensor]) -> None:
        """Compare a recomputed output with the forward's fingerprint (once per input shape): a
        difference stops the run, naming the block."""
        if self.fingerprint is None:
            return
        reason = self.fingerprint.differs(tensors, self.bitwise)
        self.fingerprint = None
        if reason is not None:
            raise RecomputationMismatch(
                f"checkpointing: block {self.name()} ({type(self.block()).__name__}) recomputed in backward differs "
                f"from its forward ({reason}); leave it out of the checkpointed blocks with checkpointing.blocks=..."
            )
        self.forward.recomputation_checked.add(self.shape)

    def saved(self) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The segment input (first block only) and this call's context tensors, as saved."""
        ctx = self.ctx() if self.ctx is not None else None
        if ctx is None:
            raise RuntimeError("checkpointing: a block's saved tensors were released before its segment's backward")
        saved = ctx.saved_tensors
        return (saved[0], list(saved[1:])) if self.position == 0 else (None, list(saved))

    def block(self) -> nn.Module:
        return self.forward.runner.blocks[self.forward.index]

    def name(self) -> str:
        runner = self.forward.runner
        return runner.chain.names[self.forward.index]


class RecomputationMismatch(RuntimeError):
    """A checkpointed block's recomputation gave another output than its forward."""


def _named_arguments(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """The non-tensor arguments of a block call (after the chained input), named for a message."""
    named = [*((f"argument {i + 1}", value) for i, value in enumerate(args)),
             *((f"argument {key!r}", value) for key, value in kwargs.items())]  # fmt: skip
    return [(name, value) for name, value in named if not isinstance(value, torch.Tensor)]


def _run_checking_arguments(call: _BlockCall, x: torch.Tensor, context: Sequence[torch.Tensor]) -> Any:
    """Run ``call`` (in forward), refusing a block that changes an object passed into it:
    recomputation would see the object changed."""
    args, kwargs = call.arguments(context)
    named = _named_arguments(args, kwargs)
    before = [argument_state(value) for _, value in named]
    output = call.forward.plain(x, *args, **kwargs)
    for (name, value), state in zip(named, before, strict=True):
        if argument_state(value) != state:
            raise ValueError(
                f"checkpointing: block {call.name()} ({type(call.block()).__name__}) changes its {name} "
                f"({type(value).__name__}) in forward, and recomputing it in backward would change it again (a "
                "cache appended to twice); don't pass it when training (e.g. use_cache=False), or leave the block "
                "out with checkpointing.blocks=..."
            )
    return output


class _Runtime:
    """One checkpointed segment of one forward: its block calls and what backward recomputed."""

    def __init__(self, backprop: str) -> None:
        self.backprop = backprop
        self.calls: list[_BlockCall] = []
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # recursively: block inputs
        self.graphs: dict[int, tuple] = {}  # all_at_once: position -> (output edges, input leaf, context leaves)
        # position -> (gathered values, reduce) of the block's compact sparse weights recomputed under
        # grad (trainer.parallel=fsdp): their gradients are taken with the block's parameters'.
        self.gathered: dict[int, list[tuple[torch.Tensor, Callable]]] = {}

    def recompute(self, call: _BlockCall, x: torch.Tensor, context: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run ``call`` again as it ran in forward (RNG, autocast; BatchNorm statistics to scratch);
        its output tensors and side outputs (the autograd node's outputs), checked against the
        forward's the first time for an input shape."""
        block = call.block()
        if is_fsdp_module(block):
            # Sharded by FSDP2 (trainer.parallel=fsdp): the recomputation calls the block's own forward,
            # past FSDP2's hooks, so its weights are gathered here (a no-op when FSDP2's pre-backward
            # hook has; its post-backward hook frees them again), and its compact sparse weights
            # (lowmem's own hooks) around it.
            block.unshard()
        with (
            gathered_for(block) as gathered,
            call.rng.replayed(),
            call.autocast.restore(),
            scratch_running_stats(block.modules()),
        ):
            tensors = call.run_collecting(x, context)
        if gathered:
            self.gathered[call.position] = gathered
        call.check_recomputation(tensors)
        return tensors

    def input_of(self, position: int) -> torch.Tensor:
        """Block ``position``'s input, without a graph: saved (first block), held, or recomputed
        from the nearest earlier one, holding the inputs computed on the way for their blocks."""
        if position in self.held:
            return self.held.pop(position)[0]
        start = max((p for p in self.held if p < position), default=0)
        x = self.held[start][0] if start in self.held else self.calls[0].saved()[0]
        with torch.no_grad():
            for p in range(start, position):
                x = self.recompute(self.calls[p], x, self.calls[p].saved()[1])[0]
                if p + 1 < position:
                    leaf, _ = _recomputation_input(x, requires_grad=True)
                    self.held[p + 1] = (x, _hold(leaf))
        return x

    def build_graphs(self, upto: int) -> None:
        """``all_at_once``: every block's graph up to ``upto`` from the segment input, each block's
        input a fresh leaf sharing the previous output's storage."""
        x = self.calls[0].saved()[0]
        for position in range(upto + 1):
            call = self.calls[position]
            leaf, alias = _recomputation_input(x, requires_grad=True if position else None)
            context = [_recomputation_input(t) for t in call.saved()[1]]
            with torch.enable_grad():
                tensors = self.recompute(call, alias, [a for _, a in context])
            self.graphs[position] = (_gradient_edges(tensors), leaf, [c for c, _ in context])
            x = tensors[0].detach()
            del tensors


def _gradient_edges(tensors: Sequence[torch.Tensor]) -> list:
    """Each output tensor's gradient edge (None for one without a graph): backward starts there,
    so the recomputed outputs themselves need not be held."""
    return [torch.autograd.graph.get_gradient_edge(t) if t.requires_grad else None for t in tensors]


class _ChainedBlock(torch.autograd.Function):
    """One block of a checkpointed segment: forward without autograd, backward by recomputation.
    Its outputs are all the tensors the block returns: the one chained to the next block first,
    the others (a position bias a later block reads) get their gradients too."""

    @staticmethod
    def forward(ctx, runtime, call, x, num_context, *tensors):
        ctx.runtime, ctx.call = runtime, call
        ctx.set_materialize_grads(False)  # an output nobody used has no gradient
        context = tensors[:num_context]
        ctx.save_for_backward(*((x,) if call.position == 0 else ()), *context)
        call.ctx = weakref.ref(ctx)
        versions = [t._version for t in (x, *context)]
        check_arguments = call.shape not in call.forward.arguments_checked
        run = _run_checking_arguments if check_arguments else _BlockCall.run
        if call.compiled is not None:  # watched before on such an input: no side output
            output = call.output_tensors(call.run(x, context))
        else:
            output = call.run_watched(run, x, context)
            if call.checked is not None and not call.side_indices:
                call.forward.side_checked.add(call.checked)
        if [t._version for t in (x, *context)] != versions:
            raise ValueError(
                f"checkpointing: block {call.name()} ({type(call.block()).__name__}) changes its input in place, "
                "which recomputation cannot undo; checkpoint other blocks with checkpointing.blocks=..."
            )
        if check_arguments:
            call.forward.arguments_checked.add(call.shape)
        if call.shape not in call.forward.recomputation_checked and has_values(output):
            call.fingerprint = OutputFingerprint.of(output)
        return tuple(output)

    @staticmethod
    def backward(ctx, *grad_outputs):
        runtime, call = ctx.runtime, ctx.call
        position = call.position
        # needs_input_grad covers (runtime, call, x, num_context, *context, *params).
        need_x = ctx.needs_input_grad[2]
        needed = list(ctx.needs_input_grad[4:])
        num_context = call.num_context
        params = [p for p in call.block().parameters() if p.requires_grad]
        if runtime.backprop == "all_at_once":
            if position not in runtime.graphs:
                runtime.build_graphs(position)
            edges, leaf, context_leaves = runtime.graphs.pop(position)
        else:
            x = runtime.input_of(position)
            leaf, alias = _recomputation_input(x, requires_grad=True)
            del x
            saved = ctx.saved_tensors[1:] if position == 0 else ctx.saved_tensors
            context = [_recomputation_input(t) for t in saved]
            context_leaves = [c for c, _ in context]
            with torch.enable_grad():
                edges = _gradient_edges(runtime.recompute(call, alias, [a for _, a in context]))
            del alias, context, saved
        flowing = [(e, g) for e, g in zip(edges, grad_outputs, strict=True) if e is not None and g is not None]
        inputs = [leaf, *context_leaves, *params]
        wanted = [need_x, *needed[:num_context], *needed[num_context:]]
        chosen = [t for t, w in zip(inputs, wanted, strict=True) if w and t.requires_grad]
        gathered = runtime.gathered.pop(position, [])  # sharded compact values: not parameters of the block
        grads = iter(())
        if (chosen or gathered) and flowing:
            edges, grad_outputs = zip(*flowing, strict=True)
            taken = [*chosen, *(values for values, _ in gathered)]
            all_grads = torch.autograd.grad(list(edges), taken, list(grad_outputs), allow_unused=True)
            for (_, reduce), grad in zip(gathered, all_grads[len(chosen) :], strict=True):
                if grad is not None:
                    reduce(grad)
            grads = iter(all_grads[: len(chosen)])
        results = [next(grads, None) if w and t.requires_grad else None for t, w in zip(inputs, wanted, strict=True)]
        if need_x and results[0] is None:  # a block that ignores its input
            results[0] = torch.zeros_like(leaf)
        del edges, leaf, context_leaves, flowing
        return (None, None, results[0], None, *results[1:])


def ensure_chains(model: nn.Module, blocks: Sequence[str] = ()) -> None:
    """Install ``model``'s chains of blocks (named by ``blocks``, else found) unless the model declares
    residual stacks and no ``blocks`` are named, or chains are installed already; their blocks'
    BatchNorm-ReLU-conv triples routed, so that a schedule may recompute them."""
    if blocks:
        install_chains(model, find_block_chains(model, blocks))
    elif not residual_stacks(model) and not installed_runners(model):
        install_chains(model, find_block_chains(model))
    route_blocks([block for runner in installed_runners(model) for block in runner.blocks])


def route_blocks(blocks: Sequence[nn.Module]) -> None:
    """Route every block's BatchNorm-ReLU-conv triples it has (``lowmem.techniques.norm_routing``)."""
    for block in blocks:
        route_norm_relu_conv(block)
