"""A container of a chain's blocks run whole by the compiler (``trainer.compile_segments=stack``).

Most chains ``lowmem.techniques.chains`` finds are the children of an ``nn.Sequential`` that calls
them one after another: MobileNet's ``features``, ViT's ``encoder.layers``, ResNet's ``layer1`` ..
``layer4``, and the layer runs of a plain-layer Sequential (VGG's ``features``). Compiled, each
checkpointed block call is lowmem's Python (``ChainRunner``): a compiled call per block, with its
guards and its Python around it, and a container loop with a graph break in each pass, which dynamo
gives up on (the loop runs eagerly).

``ContainerForward`` is such a container's instance ``forward`` (the module tree, parameter names
and state-dict keys stay the model's own). Without a checkpointing plan, or without the compiler,
it is the container's loop. With both, a container whose run (eager, each block watched for side
outputs, ``lowmem.techniques.side_outputs``) let no side output out for what
``compilation.checked_key`` records runs whole from then on: one compiled call, ``fullgraph``,
whose checkpointed segments are ``torch.utils.checkpoint`` regions the compiler's partitioner
recomputes in backward, as a residual stack runs (``checkpointing._segments_in_graph``). A
container the compiler cannot take whole runs block by block from then on, with a warning
(``compilation.run_whole``).

Where the container and the chain's segments meet: a region never crosses the container's edges
(a segment running on into the next container starts a new region there, which keeps its input:
memory, never correctness), and a parameter-free child between blocks (a ReLU, a pooling layer)
runs plainly between regions. Blocks with hooks of their own, a forward of their own instance,
sharded blocks, compressed or offloaded segments, and the planner's measuring runs keep the block
by block path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from lowmem.residual import compiled_backend, compiled_segments
from lowmem.techniques.compilation import (
    NOT_WHOLE,
    checked_key,
    outside_compiler,
    run_whole,
    whole_allowed,
    whole_refused,
)
from lowmem.techniques.shards import is_fsdp_module

# Per child of the container, in its order: (the module, whether it is a block of the chain).
Members = tuple[tuple[nn.Module, bool], ...]
# What the compiled call runs: (whether a checkpoint region, its members) in order.
Parts = tuple[tuple[bool, Members], ...]


class ContainerForward:
    """The instance ``forward`` of ``owner``, a container whose children (``items``, in call order)
    include consecutive blocks of ``runner``'s chain; ``indices[i]``: item ``i``'s index in the chain,
    or None."""

    def __init__(
        self, runner: Any, owner: nn.Module, items: Sequence[nn.Module], indices: Sequence[int | None]
    ) -> None:
        self.runner, self.owner, self.items, self.indices = runner, owner, list(items), list(indices)
        self.checked: set[tuple] = set()  # keys of runs that let no side output out
        self._parts: tuple[object, Parts | None] = (None, None)  # (the plan they were made for, parts)
        self._eager = outside_compiler(self._run)
        self.whole_calls = 0  # compiled whole calls so far (tests assert the path taken)

    def __getstate__(self) -> dict[str, Any]:
        # A copy or a pickled model (torch.save(run.model)) watches its containers' first runs again.
        return {"runner": self.runner, "owner": self.owner, "items": self.items, "indices": self.indices}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["runner"], state["owner"], state["items"], state["indices"])

    def loop(self, x: Any) -> Any:
        for item in self.items:
            x = item(x)
        return x

    def __call__(self, x: Any) -> Any:
        if self.runner.plan is None:  # no checkpointing: the container's own loop, traced as it is
            return self.loop(x)
        return self._eager(x)

    def _run(self, x: Any) -> Any:
        """A training or evaluation call with a checkpointing plan: whole where it may, else block by
        block, establishing (when the blocks run compiled) that the container may run whole."""
        parts = self.parts()
        if parts is None or not (torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.is_floating_point()):
            return self.loop(x)
        key = (*checked_key(self.blocks(), x), parts)
        if key in self.checked:
            output = run_whole(_container_in_graph, compiled_backend(self.blocks()[0]), self.owner, parts, x)
            if output is not NOT_WHOLE:
                self.whole_calls += 1
                self.runner.forget_last()  # the next block call starts a segment of its own
                return output
        unchecked = self.runner.unchecked_calls
        output = self.loop(x)
        if self.runner.unchecked_calls == unchecked:
            self.checked.add(key)
        return output

    def blocks(self) -> list[nn.Module]:
        return [item for item, index in zip(self.items, self.indices, strict=True) if index is not None]

    def parts(self) -> Parts | None:
        """The regions and plain runs of the compiled call for the runner's current plan, or None
        where the container runs block by block (see the module)."""
        plan = self.runner.plan
        if self._parts[0] is not plan:
            self._parts = (plan, self._make_parts(plan))
        parts = self._parts[1]
        if parts is None or self.runner.observer is not None or whole_refused(self.owner):
            return None
        return parts if self._blocks_may_run_whole() else None

    def _blocks_may_run_whole(self) -> bool:
        """What may change between calls under one plan (checked at every call): the blocks compiled
        alike with ``stack`` (``whole_allowed``: the compiler's stance, no saved-tensor hooks), none
        with a forward of its own instance or sharded, and no hook that would run around a block's
        own call (the compiled call runs its class's forward): the block's, or a global one."""
        blocks = self.blocks()
        backend = compiled_backend(blocks[0])
        if backend is None or not whole_allowed(blocks[0]) or _global_hooks():
            return False
        return all(
            compiled_backend(block) == backend
            and compiled_segments(block) == "stack"
            and self.runner.forwards[index].own is None
            and not is_fsdp_module(block)
            and not _has_own_hooks(block)
            for block, index in zip(blocks, (i for i in self.indices if i is not None), strict=True)
        )

    def _make_parts(self, plan: Sequence | None) -> Parts | None:
        if plan is None or any(
            plan[index][1].bits is not None or plan[index][1].offload for index in self.indices if index is not None
        ):
            return None
        parts: list[tuple[bool, list[tuple[nn.Module, bool]]]] = []
        joined = None  # the segment number the last region runs (all_at_once), else None
        for item, index in zip(self.items, self.indices, strict=True):
            if index is None or plan[index][1].backprop == "stored":
                if not parts or parts[-1][0]:
                    parts.append((False, []))
                parts[-1][1].append((item, index is not None))
                joined = None
                continue
            number, segment = plan[index]
            if joined is None or joined != number:
                parts.append((True, []))
            parts[-1][1].append((item, True))
            joined = number if segment.backprop == "all_at_once" else None
        return tuple((region, tuple(members)) for region, members in parts)


def _global_hooks() -> bool:
    from torch.nn.modules import module as hooks

    return bool(
        hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    )


def _has_own_hooks(module: nn.Module) -> bool:
    """Hooks on the block module itself run around its call, which the compiled call does not make
    (it runs the block's class ``forward``); its submodules' hooks run inside it."""
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )


def _container_in_graph(parts: Parts, x: torch.Tensor) -> torch.Tensor:
    """A container as the compiler traces it: each checkpointed segment's part a
    ``torch.utils.checkpoint`` region (its input kept, the rest recomputed by the partitioner)."""
    for region, members in parts:
        if region:
            x = torch.utils.checkpoint.checkpoint(_run_members, members, x, use_reentrant=False)
        else:
            x = _run_members(members, x)
    return x


def _run_members(members: Members, x: torch.Tensor) -> torch.Tensor:
    for module, is_block in members:
        # A block by its class's forward: its instance forward is lowmem's runner.
        x = type(module).forward(module, x) if is_block else module(x)
    return x


def sequential_containers(
    model: nn.Module, names: Sequence[str], blocks: Sequence[nn.Module]
) -> list[tuple[nn.Module, list[nn.Module], list[int | None]]]:
    """The ``nn.Sequential`` containers (exactly that class, no forward of their own instance) whose
    parameterized children are two or more consecutive blocks of a chain (``names``/``blocks``), each
    child once: (container, its children in call order, each child's index in the chain or None)."""
    found = []
    position = {id(block): index for index, block in enumerate(blocks)}
    groups: dict[str, list[int]] = {}
    for index, name in enumerate(names):
        parent = name.rpartition(".")[0]
        if parent:
            groups.setdefault(parent, []).append(index)
    for parent, indices in groups.items():
        try:
            container = model.get_submodule(parent)
        except AttributeError:
            continue
        if type(container) is not nn.Sequential or "forward" in container.__dict__ or len(indices) < 2:
            continue
        items = list(container._modules.values())
        if len({id(item) for item in items}) != len(items) or any(item is None for item in items):
            continue
        chained = [position.get(id(item)) for item in items]
        inside = sorted(i for i in chained if i is not None)
        with_parameters = [item for item in items if any(True for _ in item.parameters())]
        if inside != indices or inside != list(range(inside[0], inside[-1] + 1)) or len(with_parameters) != len(inside):
            continue
        found.append((container, items, chained))
    return found
