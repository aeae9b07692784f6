"""Activation checkpointing over a model's residual blocks (report §3.4).

Strategies (``checkpointing.strategy``, with ``checkpointing.every=m``):

- ``none``: autograd keeps every activation.
- ``no_bn``: every BN-ReLU-conv triple stores only the BN input (and, for a plain BatchNorm on
  CPU, its per-channel batch statistics); backward recomputes BN and ReLU (cheap, no convolution is
  recomputed: from the kept statistics, one multiply-add) and feeds the recomputed ReLU output to
  the convolution's backward. Needs blocks that route their triples through
  ``lowmem.residual.norm_relu_conv``.
- ``residual``: the blocks run in segments of ``m``; only each segment's input is stored and
  backward recomputes the segment (each block's forward once), then backpropagates it block by
  block, last block first, releasing each block's recomputed tensors as soon as its backward is
  done. The segment's output is never held: backward starts from its gradient edge. Works for any
  block.
- ``residual_star``: the report's recursive variant. Only each segment's input is stored. Backward
  first recomputes the segment's block outputs without a graph (the last block's is never needed)
  and holds them until the block that reads them is backpropagated; then, last block first, it
  recomputes each block's graph from its input, backpropagates it and drops it. Inside a block the
  first convolution's output is held, BN and ReLU outputs never (``no_bn``: backward recomputes
  them on the fly, into one buffer, and applies the ReLU backward in place). The recomputations
  normalize with the batch statistics the segment's forward computed (plain BatchNorm2d on a CPU:
  ``_NormReluConvCalls``), never computing them again. A block that declares
  ``residual_branch_ends_with_norm_relu_conv`` (its last norm-ReLU-conv output is only added to
  the shortcut) has that last convolution skipped when its graph is rebuilt for backprop: its
  output is never read, and its backward needs only its input.
- ``optimal``: any *schedule* (``apply_schedule``): each stack's blocks partitioned into
  ``Segment``s, each stored, backpropagated all at once or recursively, with or without BN-ReLU
  recomputation. The four strategies above are the uniform schedules; ``lowmem.planning`` chooses
  one per stack by dynamic programming under an activation budget.

A tensor a block of a checkpointed segment lets out other than by its output (stored on a module,
collected by a hook; a block output inside the segment that is also kept elsewhere) is an extra
output of the segment's autograd node, found in every forward and again in the recomputation
(``lowmem.techniques.side_outputs``): its gradient flows like the output's.

Recomputation replays the RNG state (identical dropout masks) and the autocast state, and sends
BatchNorm running-statistic updates to scratch copies, so the statistics are updated exactly once
per forward (SPEC §6). Both recomputations are custom ``autograd.Function``s rather than
``torch.utils.checkpoint``, whose non-reentrant mode stops recomputing early and does not nest
the way ``residual_star`` needs (SPEC §6).

Under ``torch.compile`` each checkpointed stack's executor runs eagerly (``outside_compiler``: one
graph break per stack). With ``trainer.compile_segments=blocks`` its segments run as above, each
block compiled, in forward and in the recomputation alike; a compiled block's norm-ReLU-conv triple
is the plain one (``lowmem.techniques.compilation``). With ``stack`` (the default), once a run of
the stack as above let no side output out, the whole stack is one compiled call
(``_segments_in_graph``): torch's non-reentrant checkpoint as the compiler traces it, whose
partitioner recomputes each region in backward from its input; ``residual_star``'s segments are one
region per block (each block's input kept, one block's graph at a time; the compiler leaves the last
convolution of each block unrecomputed), ``residual``'s one region per segment.

Apply before wrapping the model in DistributedDataParallel; the transformation changes no module,
parameter or state-dict key, so it composes with precision conversion and sparsity in any order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from lowmem import kernels
from lowmem.kernels import cpu as cpu_kernels
from lowmem.residual import (
    COMPILED_TRIPLES,
    compiled_backend,
    compiled_segments,
    conv_output_shape,
    plain_norm_relu_conv,
    relu_of_norm,
    residual_stacks,
    routes_norm_relu_conv,
    run_sequentially,
    set_block_executor,
    set_norm_relu_conv,
)
from lowmem.techniques.chains import find_block_chains, install_chains, installed_runners, route_blocks
from lowmem.techniques.compact import conv2d_backward, dense_weight, index_of, trained_weight
from lowmem.techniques.compilation import (
    NOT_WHOLE,
    checked_key,
    compiled_call,
    outside_compiler,
    run_whole,
    whole_allowed,
)
from lowmem.techniques.compression import compressed_saves, stored_saves
from lowmem.techniques.recomputation import (
    BACKPROPS,
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
    one_op,
)

STRATEGIES = ("none", "no_bn", "residual", "residual_star")  # the fixed patterns (`optimal`: lowmem.planning)
_CHECKED = "_lowmem_checked_inputs"  # on a segment's first block: inputs its compiled blocks may run on
_CHECKED_WHOLE = "_lowmem_checked_stack_inputs"  # on a stack's first block: inputs its whole compiled runner may run on
_COMPILED_TRIPLE_COUNT = "_lowmem_compiled_triples"  # on a compiled block: its triples, as a watched forward counted
_FP32_SLICE = 1 << 15  # elements of a 16-bit tensor widened to FP32 at a time when BN is recomputed


def uniform_schedule(strategy: str, every: int, blocks: int) -> tuple[Segment, ...]:
    """The segments a fixed ``strategy`` runs a stack of ``blocks`` blocks in."""
    validate_checkpointing(strategy, every)
    recompute_norm = strategy in ("no_bn", "residual_star")
    if strategy in ("none", "no_bn"):
        return (Segment(blocks, "stored", recompute_norm),)
    backprop = "recursively" if strategy == "residual_star" else "all_at_once"
    return tuple(Segment(min(every, blocks - start), backprop, recompute_norm) for start in range(0, blocks, every))


def validate_checkpointing(strategy: str, every: int) -> None:
    """Raise ValueError naming the knob if ``strategy`` or ``every`` (blocks per segment) is invalid."""
    if strategy not in STRATEGIES:
        raise ValueError(f"checkpointing.strategy={strategy!r} is unknown; allowed: {', '.join(STRATEGIES)}")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(
            f"checkpointing.every={every!r} must be an integer >= 1 (residual blocks per segment)"
        )


def apply_checkpointing(model: nn.Module, strategy: str, every: int = 1, blocks: Sequence[str] = ()) -> None:
    """Make every residual stack of ``model`` run with ``strategy``, segments of ``every`` blocks.

    A model that declares no residual stacks (any model lowmem did not write), or ``blocks``
    (``checkpointing.blocks``) given, is checkpointed over its chains of blocks, found or named
    (``lowmem.techniques.chains``). Changes only how blocks are executed (no module, parameter or
    state-dict key changes); calling it again replaces the previous strategy (or schedule).
    """
    validate_checkpointing(strategy, every)
    stacks = residual_stacks(model)
    if blocks or not stacks:
        apply_to_chains(model, strategy, every, blocks)
        return
    blocks = [block for stack in stacks for block in stack.residual_blocks]
    recompute_norm = strategy in ("no_bn", "residual_star")
    if recompute_norm:
        unsupported = sorted({type(b).__name__ for b in blocks if not routes_norm_relu_conv(b)})
        if unsupported:
            raise ValueError(
                f"checkpointing.strategy={strategy!r} recomputes BatchNorm-ReLU outputs, which needs blocks "
                f"that route them through lowmem.residual.norm_relu_conv; {', '.join(unsupported)} "
                "does not; use checkpointing.strategy=residual (works for any block) or none"
            )
    for block in blocks:
        set_recompute_norm(block, recompute_norm)
    if strategy in ("residual", "residual_star"):
        # Segments cut from each stack's own length when it runs: nested stacks work too.
        executor = functools.partial(run_uniform_segments, strategy=strategy, every=every)
        set_block_executor(model, outside_compiler(executor))
    else:
        set_block_executor(model, run_sequentially)


def apply_schedule(model: nn.Module, schedules: Sequence[Sequence[Segment]]) -> None:
    """Run residual stack ``i`` of ``model`` (``lowmem.residual.residual_stacks`` order) in the
    segments ``schedules[i]``, which must cover its blocks exactly. Like ``apply_checkpointing``,
    it changes only how blocks run, and calling it again replaces the previous schedule."""
    stacks = residual_stacks(model)
    if not stacks:
        apply_schedule_to_chains(model, schedules)
        return
    if len(schedules) != len(stacks):
        raise ValueError(f"{len(schedules)} schedules for the {len(stacks)} residual stacks of {type(model).__name__}")
    for index, (stack, segments) in enumerate(zip(stacks, schedules, strict=True)):
        blocks = stack.residual_blocks
        if any(residual_stacks(block) for block in blocks):
            raise ValueError(f"residual stack {index} holds residual stacks in its blocks: schedules need flat stacks")
        segments = tuple(segments)
        malformed = any(
            s.blocks < 1
            or s.backprop not in BACKPROPS
            or ((s.bits is not None or s.offload) and s.backprop != "stored")
            for s in segments
        )
        if malformed or sum(s.blocks for s in segments) != len(blocks):
            raise ValueError(
                f"schedule {' '.join(map(str, segments))} does not cover the {len(blocks)} blocks of residual stack "
                f"{index}: segments of >= 1 blocks, backprop one of {', '.join(BACKPROPS)} (a width or offload only "
                "when stored)"
            )
        start = 0
        for segment in segments:
            for block in blocks[start : start + segment.blocks]:
                if segment.recompute_norm and not routes_norm_relu_conv(block):
                    raise ValueError(
                        f"segment {segment} recomputes BatchNorm-ReLU outputs, but {type(block).__name__} does not "
                        "route them through lowmem.residual.norm_relu_conv"
                    )
                set_recompute_norm(block, segment.recompute_norm)
            start += segment.blocks
        stored = all(s.backprop == "stored" and s.bits is None and not s.offload for s in segments)
        executor = functools.partial(run_segments, segments=segments)
        set_block_executor(stack, run_sequentially if stored else outside_compiler(executor))


def apply_to_chains(model: nn.Module, strategy: str, every: int, blocks: Sequence[str] = ()) -> None:
    """``checkpointing.strategy`` on ``model``'s chains of blocks (found or named by ``blocks``)."""
    runners = installed_runners(model)
    if blocks or not runners:
        if strategy == "none" and not blocks and not runners:
            return
        runners = install_chains(model, find_block_chains(model, blocks))
    chained = [block for runner in runners for block in runner.blocks]
    recompute_norm = strategy in ("no_bn", "residual_star")
    if recompute_norm:
        route_blocks(chained)
    routing = [block for block in chained if routes_norm_relu_conv(block)]
    if strategy == "no_bn" and not routing:
        kinds = sorted({type(b).__name__ for b in chained})
        raise ValueError(
            "checkpointing.strategy='no_bn' recomputes BatchNorm-ReLU outputs that feed a convolution inside "
            f"blocks; {', '.join(kinds)} have no BatchNorm-ReLU-Conv2d sequence lowmem can find: use "
            "checkpointing.strategy=residual or residual_star (any block)"
        )
    for block in routing:
        set_recompute_norm(block, recompute_norm)
    for runner in runners:
        runner.set_segments(uniform_schedule(strategy, every, len(runner.blocks)))


def apply_schedule_to_chains(model: nn.Module, schedules: Sequence[Sequence[Segment]]) -> None:
    """Run chain ``i`` of ``model`` (installed order) in the segments ``schedules[i]``."""
    runners = installed_runners(model)
    if len(schedules) != len(runners):
        raise ValueError(f"{len(schedules)} schedules for the {len(runners)} block chains of {type(model).__name__}")
    for runner, segments in zip(runners, schedules, strict=True):
        start = 0
        for segment in segments:
            for block in runner.blocks[start : start + segment.blocks]:
                if segment.recompute_norm and not routes_norm_relu_conv(block):
                    raise ValueError(f"segment {segment} recomputes BatchNorm-ReLU outputs, but {type(block).__name__} "
                                     "does not route them through lowmem.residual.norm_relu_conv")
                set_recompute_norm(block, segment.recompute_norm)
            start += segment.blocks
        runner.set_segments(segments)


def set_recompute_norm(block: nn.Module, recompute: bool) -> None:
    """Make ``block`` recompute its BN-ReLU outputs in backward (``no_bn``) or keep them; a block
    that does not route its triples through ``norm_relu_conv`` always keeps them."""
    if routes_norm_relu_conv(block):
        set_norm_relu_conv(block, recomputed_norm_relu_conv if recompute else plain_norm_relu_conv)


# --- residual / residual_star: recompute a segment of blocks --------------------------------------


def run_uniform_segments(
    blocks: Sequence[nn.Module], x: torch.Tensor, context: tuple, strategy: str, every: int
) -> torch.Tensor:
    """Block executor of ``residual`` / ``residual_star``: segments of ``every`` blocks."""
    return run_segments(blocks, x, context, uniform_schedule(strategy, every, len(blocks)))


def run_segments(
    blocks: Sequence[nn.Module], x: torch.Tensor, context: tuple, segments: Sequence[Segment]
) -> torch.Tensor:
    """Block executor: run ``blocks`` in ``segments``; a checkpointed segment stores only its input.

    Stored segments run plainly; ``all_at_once`` and ``recursively`` segments are one
    ``_CheckpointedSegment`` each. (Which blocks recompute BN-ReLU is set per block by the caller.)
    """
    if not torch.is_grad_enabled():
        return run_sequentially(blocks, x, context)
    # trainer.compile_segments=stack: the whole stack as one compiled call, once a run of it as below
    # (its first, eager and watched) let no side output out for this input.
    whole = _whole_stack_backend(blocks, segments)
    key = (*checked_key(blocks, x, context), tuple(segments)) if whole is not None else None
    if whole is not None and key in blocks[0].__dict__.get(_CHECKED_WHOLE, ()):
        output = run_whole(_segments_in_graph, whole, blocks[0], blocks, x, context, tuple(segments))
        if output is not NOT_WHOLE:
            return output
        whole = None
    escaped = False
    is_tensor = [isinstance(item, torch.Tensor) for item in context]
    context_tensors = [item for item in context if isinstance(item, torch.Tensor)]
    start = 0
    for segment in segments:
        part = blocks[start : start + segment.blocks]
        start += segment.blocks
        if segment.backprop == "stored":
            with stored_saves(segment.bits, segment.offload):
                x = run_sequentially(part, x, context)
            continue
        # Parameters are explicit inputs so their gradients are returned through autograd (hooks,
        # DDP and torch.autograd.grad see them) instead of being accumulated behind its back. Blocks
        # sharded by FSDP2 are the exception: their parameters exist whole only while FSDP2 has
        # gathered them (in each forward, the recomputation's too), and FSDP2 reduce-scatters the
        # gradients accumulated in those gathered parameters from its own hooks, which run inside
        # the recomputation's backward (``_SegmentBackprop.sharded``).
        sharded = any(is_fsdp_module(block) for block in part)
        params = [p for block in part for p in block.parameters() if p.requires_grad]
        if sharded:  # a leaf standing for them, so that backward reaches the segment whatever its input
            params = [torch.zeros((), device=x.device, requires_grad=True)] if params else []
        recursive = segment.backprop == "recursively"
        with compressed_saves(None):  # recomputation starts from the exact input
            # Its side outputs (lowmem.techniques.side_outputs) come after x: the autograd node
            # connected them where the blocks left them.
            x, *side = _CheckpointedSegment.apply(
                part, context, is_tensor, (recursive, sharded), x, len(context_tensors), *context_tensors, *params
            )
            escaped = escaped or bool(side)
    if whole is not None and not escaped:
        blocks[0].__dict__.setdefault(_CHECKED_WHOLE, set()).add(key)
    return x


def _whole_stack_backend(blocks: Sequence[nn.Module], segments: Sequence[Segment]) -> str | Callable | None:
    """The compiler backend a whole checkpointed stack runs with (``_segments_in_graph``) where its
    blocks may run compiled whole now (``compilation.whole_allowed``), none is sharded and no
    segment stores compressed or offloaded activations; else None (the segments run block by
    block)."""
    first = blocks[0]
    backend = compiled_backend(first)
    if backend is None or not whole_allowed(first):
        return None
    if any(compiled_backend(b) != backend or compiled_segments(b) != "stack" or is_fsdp_module(b) for b in blocks):
        return None
    if any(s.bits is not None or s.offload for s in segments):
        return None
    return backend


def _segments_in_graph(
    blocks: Sequence[nn.Module], x: torch.Tensor, context: tuple, segments: tuple[Segment, ...]
) -> torch.Tensor:
    """A checkpointed stack as the compiler traces it (``trainer.compile_segments=stack``): each
    checkpointed segment a ``torch.utils.checkpoint`` region, whose activations the compiler's
    partitioner recomputes in backward from the region's input instead of saving them (torch's
    non-reentrant checkpoint traced: the graph keeps only what the backward graph reads, and the
    BatchNorm running statistics are updated by the forward only)."""
    start = 0
    for segment in segments:
        part = blocks[start : start + segment.blocks]
        start += segment.blocks
        if segment.backprop == "stored":
            x = run_sequentially(part, x, context)
        elif segment.backprop == "recursively":  # a region per block: one block's graph at a time
            for block in part:
                x = torch.utils.checkpoint.checkpoint(block, x, *context, use_reentrant=False)
        else:
            x = torch.utils.checkpoint.checkpoint(run_sequentially, part, x, context, use_reentrant=False)
    return x


class _CheckpointedSegment(torch.autograd.Function):
    """Forward without storing the segment's activations; backward recomputes and backprops it."""

    @staticmethod
    def forward(ctx, segment, context, is_tensor, modes, x, num_context_tensors, *tensors):
        ctx.segment, ctx.is_tensor, (ctx.recursive, ctx.sharded) = segment, is_tensor, modes
        ctx.skeleton = [None if t else item for t, item in zip(is_tensor, context, strict=True)]
        ctx.params = tensors[num_context_tensors:]
        ctx.rng, ctx.autocast = _RngState(x.device), _AutocastState.capture(x.device)
        ctx.save_for_backward(x, *tensors[:num_context_tensors])
        # How many norm-ReLU-conv triples each block computes: the last one's convolution can be
        # skipped when the block's graph is rebuilt for backprop (see _NormReluConvCalls). And each
        # triple's batch statistics, which the recomputations reuse instead of computing them again.
        ctx.triples, ctx.statistics = [], []
        # Every tensor a block lets out other than by its output is found once the whole segment
        # has run (a block output stored elsewhere, not only passed on, is one too) and returned
        # after x: per block, its op indices and layout, for the recomputation to find it again.
        ctx.set_materialize_grads(False)  # a side output nobody used has no gradient
        # trainer.compile: the blocks run compiled, unwatched, once a watched eager forward found no
        # side output for this input (lowmem.techniques.compilation); the recomputation runs as the
        # forward ran, so that its self-check compares like with like.
        compiled = compiled_call(segment[0]) if all(compiled_backend(b) is not None for b in segment) else None
        key = checked_key(segment, x, context) if compiled is not None else None
        checked = segment[0].__dict__.setdefault(_CHECKED, set()) if compiled is not None else set()
        ctx.compiled = compiled if key in checked else None
        if ctx.compiled is not None:
            for block in segment:
                x = ctx.compiled(block, x, *context)
            # Triples as the watched forward counted them: the rebuild leaves the last one's
            # convolution output uncomputed (compilation's "unread" runner).
            ctx.triples = [block.__dict__.get(_COMPILED_TRIPLE_COUNT, 0) for block in segment]
            ctx.statistics = [[] for _ in segment]
            ctx.side = [([], []) for _ in segment]
            return (x,)
        watches, marked = [], {}
        for block in segment:
            watch = ForwardWatch(marked)  # each block reads what the one before it made
            COMPILED_TRIPLES.count = 0
            with _NormReluConvCalls(statistics=[]) as calls, watch:
                x = block(x, *context)
            if compiled is not None:  # its triples are plain, counted by lowmem.residual
                block.__dict__[_COMPILED_TRIPLE_COUNT] = COMPILED_TRIPLES.count
            ctx.triples.append(calls.count)
            ctx.statistics.append(calls.statistics)
            watches.append(watch)
        ctx.side = []
        side_tensors = []
        for block, watch in zip(segment, watches, strict=True):
            try:
                side = watch.escaped([x])
            except SideOutputRefused as refused:
                raise ValueError(
                    f"checkpointing: block {type(block).__name__} {refused}, or use checkpointing.strategy=none"
                ) from None
            ctx.side.append(([index for index, _ in side], [(tuple(t.shape), t.dtype) for _, t in side]))
            side_tensors.extend(t for _, t in side)
        if compiled is not None and not side_tensors:
            checked.add(key)
        return (x, *side_tensors)

    @staticmethod
    def backward(ctx, grad_output, *side_grads):
        if grad_output is None:  # only a side output reaches the loss
            grad_output = torch.zeros_like(ctx.saved_tensors[0])
        leaves, aliases = zip(*(_recomputation_input(t) for t in ctx.saved_tensors), strict=True)
        remaining = iter(aliases[1:])
        context = tuple(
            next(remaining) if t else item for t, item in zip(ctx.is_tensor, ctx.skeleton, strict=True)
        )
        # needs_input_grad covers (segment, context, is_tensor, recursive, x, num_context_tensors, *tensors).
        needed = [ctx.needs_input_grad[4]] + list(ctx.needs_input_grad[6:])
        segment = _SegmentBackprop(ctx, context, leaves[1:], needed, side_grads)
        with ctx.autocast.restore(), scratch_running_stats(m for block in ctx.segment for m in block.modules()):
            if ctx.recursive:
                grad = segment.recursively(leaves[0], aliases[0], grad_output)
            else:
                grad = segment.all_at_once(leaves[0], aliases[0], grad_output)
        return (None, None, None, None, grad, None, *segment.accumulated)


class _SegmentBackprop:
    """Backward of one checkpointed segment, block by block, last block first.

    Gradients of the context tensors and parameters are summed over the blocks into
    ``accumulated`` (each parameter of a plain model is in one block; context tensors are read by
    every block). Held at any moment: what the schedule keeps for the blocks still to
    backpropagate, the graph of the block being backpropagated and the gradient flowing back;
    never a block's output for its own sake (backward starts from the output's gradient edge).
    """

    def __init__(
        self, ctx, context: tuple, context_leaves: Sequence[torch.Tensor], needed: list[bool], side_grads: Sequence
    ) -> None:
        self.blocks, self.rng, self.triples, self.statistics = ctx.segment, ctx.rng, ctx.triples, ctx.statistics
        self.compiled = ctx.compiled  # the blocks' compiled runner, where forward ran them compiled
        # Per block: its side outputs' op indices and layouts, and the gradients they received.
        grads = iter(side_grads)
        self.side = [(indices, layout, [next(grads) for _ in indices]) for indices, layout in ctx.side]
        self.sharded = ctx.sharded  # FSDP2 blocks: parameter gradients accumulate where FSDP2 reads them
        self.context = context
        self.outer = [*context_leaves, *ctx.params]
        self.outer_needed = needed[1:]
        self.need_segment_input = needed[0]
        self.accumulated: list[torch.Tensor | None] = [None] * len(self.outer)

    def all_at_once(self, x_leaf: torch.Tensor, x_alias: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        """``residual``: recompute every block's graph (one forward of each), then backprop them.

        Block k's input is a fresh leaf sharing the storage of block k-1's output, so after block
        k is backpropagated its saved tensors are released while the earlier blocks' graphs stay.
        """
        block_inputs, output_edges = [], []
        with self.rng.replayed(), torch.enable_grad():
            for index in range(len(self.blocks)):
                with _NormReluConvCalls(statistics=self.statistics[index], replay=True):
                    output, side_edges = self._recompute(index, x_alias)
                block_inputs.append(x_leaf)
                output_edges.append((torch.autograd.graph.get_gradient_edge(output), side_edges))
                if index + 1 < len(self.blocks):
                    x_leaf, x_alias = _recomputation_input(output)
                del output
        del x_leaf, x_alias  # the last block's input lives on in its graph only
        for index in range(len(self.blocks) - 1, -1, -1):
            grad = self._backprop_block(index, output_edges.pop(), block_inputs.pop(), grad)
        return grad

    def recursively(self, x_leaf: torch.Tensor, x_alias: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        """``residual_star``: recompute the block inputs without a graph, then for each block (last
        first) rebuild its graph from its input, backprop it and drop it with the input.

        Costs the same FLOPs as ``all_at_once`` when the blocks let the last convolution be skipped
        (each block's first convolution runs twice, the last block's second never), and holds one
        block's graph instead of the segment's.
        """
        inputs = [(x_leaf, x_alias, None)]  # per block: leaf, alias fed to the block, hold token
        rng_states = []
        with self.rng.replayed():
            x = x_alias.detach()
            for index, block in enumerate(self.blocks):
                rng_states.append(_RngState(x.device))
                if index + 1 < len(self.blocks):
                    with torch.no_grad(), _NormReluConvCalls(statistics=self.statistics[index], replay=True):
                        x = self._run(block, x)
                    leaf, alias = _recomputation_input(x, requires_grad=x_leaf.requires_grad)
                    inputs.append((leaf, alias, _hold(leaf)))
        del x
        for index in range(len(self.blocks) - 1, -1, -1):
            leaf, alias, token = inputs.pop()
            block = self.blocks[index]
            # The last convolution's output is not computed when only the block output reads it
            # (not when a side output may).
            skip = _branch_ends_with_norm_relu_conv(block) and not self.side[index][0] and self.triples[index] > 0
            skipped = self.triples[index] - 1 if skip else None
            replayed = _NormReluConvCalls(skip=skipped, statistics=self.statistics[index], replay=True)
            with rng_states.pop().replayed(), torch.enable_grad(), replayed:
                output, side_edges = self._recompute(index, alias, unread=skipped)
            edges = (torch.autograd.graph.get_gradient_edge(output), side_edges)
            del output, alias, token
            grad = self._backprop_block(index, edges, leaf, grad)
            del leaf
        return grad

    def _recompute(self, index: int, x: torch.Tensor, unread: int | None = None) -> tuple[torch.Tensor, list]:
        """Block ``index`` run again on ``x``: its output, and its side outputs' gradient edges
        (found by op index; None where a side output has no graph). ``unread``: the triple whose
        convolution output a compiled rebuild leaves uncomputed (eagerly ``_NormReluConvCalls``
        skips it)."""
        indices, layout, _ = self.side[index]
        block = self.blocks[index]
        if not indices:
            return self._run(block, x, unread), []
        with RecomputeCollect(indices) as collect:
            output = block(x, *self.context)
        try:
            side = collect.collected(indices, layout)
        except SideOutputMismatch as mismatch:
            raise SideOutputMismatch(
                f"checkpointing: block {type(block).__name__} recomputed in backward differs from its forward "
                f"({mismatch}); use checkpointing.strategy=none for this model"
            ) from None
        return output, [torch.autograd.graph.get_gradient_edge(t) if t.requires_grad else None for t in side]

    def _run(self, block: nn.Module, x: torch.Tensor, unread: int | None = None) -> torch.Tensor:
        """``block`` on ``x`` as the segment's forward ran it: compiled, or eagerly."""
        if self.compiled is None:
            return block(x, *self.context)
        if unread is None:
            return self.compiled(block, x, *self.context)
        return compiled_call(block, "unread")(block, unread, x, *self.context)

    def _backprop_block(
        self, index: int, edges: tuple, block_input: torch.Tensor, grad: torch.Tensor
    ) -> torch.Tensor | None:
        """Backprop block ``index`` from its output's gradient edge and its side outputs' (``edges``);
        the gradient of its input."""
        need_input = index > 0 or self.need_segment_input
        wanted = ([block_input] if need_input else []) + [
            t for t, need in zip(self.outer, self.outer_needed, strict=True) if need
        ]
        output_edge, side_edges = edges
        side_grads = self.side[index][2]
        flowing = [(e, g) for e, g in zip(side_edges, side_grads, strict=True) if e is not None and g is not None]
        edge, grad = [output_edge, *(e for e, _ in flowing)], [grad, *(g for _, g in flowing)]
        if self.sharded:
            grads = _backward_into_gathered_parameters(edge, grad, wanted)
        else:
            grads = list(torch.autograd.grad(edge, wanted, grad, allow_unused=True)) if wanted else []
        grad_input = grads.pop(0) if need_input else None
        if index > 0 and grad_input is None:  # a block that ignores its input
            grad_input = torch.zeros_like(block_input)
        extra = iter(grads)
        for position, need in enumerate(self.outer_needed):
            if need:
                value = next(extra)
                if value is not None:
                    previous = self.accumulated[position]
                    self.accumulated[position] = value if previous is None else previous + value
        return grad_input


def _backward_into_gathered_parameters(edge: list, grad: list, wanted: list[torch.Tensor]) -> list:
    """Backprop a block of FSDP2-sharded blocks from its output's gradient ``edge``: the gradients of
    its parameters accumulate in the gathered parameters' ``.grad``, from which FSDP2's hooks (run
    during this backward) reduce-scatter them; those of ``wanted`` (fresh leaves: the block's input
    and the context, made for this recomputation) are returned."""
    for leaf in wanted:
        leaf.grad = None
    torch.autograd.backward(edge, grad)
    grads = [leaf.grad for leaf in wanted]
    for leaf in wanted:
        leaf.grad = None
    return grads


def _branch_ends_with_norm_relu_conv(block: nn.Module) -> bool:
    return routes_norm_relu_conv(block) and bool(getattr(block, "residual_branch_ends_with_norm_relu_conv", False))


class _NormReluConvCalls:
    """Counts the norm-ReLU-conv triples a block computes; with ``skip``, the triple of that index
    (0-based) saves its input but does not compute: its output is never read (it only reaches the
    block's output, whose value a backprop-only recomputation drops).

    ``statistics``: per triple, the batch mean and inverse standard deviation its BatchNorm
    computed, or None (a norm whose kernel the kept statistics do not reproduce: see
    ``_keeps_batch_statistics``). A checkpointed segment's forward records them (``replay=False``:
    each triple appends its own); its recomputations replay them (``replay=True``): the triple
    normalizes its input, the same bits as the forward's, with them, as one pass fused with the ReLU,
    instead of computing the statistics again, and leaves the running statistics alone (which a
    recomputation sends to scratch copies anyway). Two floats per channel, as ``no_bn`` keeps.
    """

    _active: _NormReluConvCalls | None = None

    def __init__(
        self,
        skip: int | None = None,
        statistics: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
        replay: bool = False,
    ) -> None:
        self.count, self.skip = 0, skip
        self.statistics, self.replay = statistics, replay

    def __enter__(self) -> _NormReluConvCalls:
        self._outer, _NormReluConvCalls._active = _NormReluConvCalls._active, self
        return self

    def __exit__(self, *exc) -> None:
        _NormReluConvCalls._active = self._outer

    @classmethod
    def next_is_skipped(cls) -> bool:
        """Count one triple; whether it is the one whose convolution is skipped."""
        calls = cls._active
        if calls is None:
            return False
        calls.count += 1
        return calls.count - 1 == calls.skip

    @classmethod
    def recording(cls) -> list | None:
        """The list the current triple's statistics go to (a segment's forward), or None."""
        calls = cls._active
        return calls.statistics if calls is not None and not calls.replay else None

    @classmethod
    def replayed(cls) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The current (last counted) triple's statistics from its segment's forward, or None."""
        calls = cls._active
        if calls is None or not calls.replay or calls.statistics is None or calls.count > len(calls.statistics):
            return None
        return calls.statistics[calls.count - 1]


# --- no_bn: recompute BN-ReLU, never the convolution --------------------------------------------


def recomputed_norm_relu_conv(norm: nn.Module, conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``conv(relu(norm(x)))`` storing only ``x`` (and the conv weight) for backward.

    x: (N, C_in, H, W); returns (N, C_out, H', W'). ``norm`` may be any module (a BatchNorm, also
    one converted by precision or simulated microbatching): backward calls it again.
    """
    if not torch.is_grad_enabled():
        _NormReluConvCalls.next_is_skipped()  # counted, never skipped: the output is the result
        return one_op(lambda: _norm_relu_conv_without_graph(norm, conv, x), x, *conv.parameters(),
                      *norm.parameters())
    if not isinstance(conv, nn.Conv2d) or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        raise ValueError(
            f"checkpointing.strategy=no_bn/residual_star recompute BN-ReLU before an nn.Conv2d with numeric "
            f"zero padding; got {conv!r}"
        )
    norm_params = list(norm.parameters())
    output_read = not _NormReluConvCalls.next_is_skipped()
    # The trained weight: the dense parameter, or the compact values of a sparse convolution (whose
    # dense weight is built where it is used and dropped: lowmem.techniques.compact).
    weight = trained_weight(conv)
    # One op for a side output's numbering: the forward without a graph computes it by other ops.
    return one_op(lambda: _NormReluConvRecomputed.apply(norm, conv, output_read, x, weight, conv.bias, *norm_params),
                  x, *conv.parameters(), *norm_params)


def _norm_relu_conv_without_graph(norm: nn.Module, conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``plain_norm_relu_conv`` without autograd; in a checkpointed segment's forward it records the
    norm's batch statistics, in its recomputations it reuses them (``_NormReluConvCalls``)."""
    recording = _NormReluConvCalls.recording()
    keeps = _keeps_batch_statistics(norm, x)
    if recording is not None:
        if not keeps:
            recording.append(None)
            return plain_norm_relu_conv(norm, conv, x)
        normalized, mean, invstd = _batch_norm_with_statistics(norm, x)  # the running-statistics update
        recording.append((mean, invstd))
        return conv(relu_of_norm(normalized, x))
    kept = _NormReluConvCalls.replayed() if keeps else None
    if kept is None:
        return plain_norm_relu_conv(norm, conv, x)
    return conv(_norm_relu_from_statistics(norm, x, *kept))


class _NormReluConvRecomputed(torch.autograd.Function):
    """Fused norm-ReLU-conv whose backward recomputes norm-ReLU and calls the conv backward kernel.

    For a plain ``nn.BatchNorm2d`` on CPU outside autocast, the forward keeps the batch mean and
    inverse standard deviation (two floats per channel: the report's "caching small quantities",
    Bulò et al. 2017): backward then recomputes the normalized output as one multiply-add, with the
    kernel's own rounding, and calls the BN backward kernel directly, instead of running BN's
    forward (its statistics passes) again. Gradients are the same bits as autograd's. Any other
    norm module (simulated-microbatching BN, CUDA's cuDNN BN) is recomputed by calling it again.
    """

    @staticmethod
    def forward(ctx, norm, conv, output_read, x, weight, bias, *norm_params):
        ctx.norm, ctx.conv = norm, conv
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.autocast = _AutocastState.capture(x.device)
        ctx.index = index_of(conv)  # a compact weight's positions (sharded training binds them for the forward)
        # In a recomputation, the statistics the segment's forward computed (_NormReluConvCalls).
        keeps = _keeps_batch_statistics(norm, x)
        kept = _NormReluConvCalls.replayed() if keeps else None
        ctx.kept = None
        if not output_read:  # a recomputation that needs this node, not its value: a broadcast zero
            ctx.save_for_backward(x, weight)
            # Not saved again: the segment holds them (and its accounting counts what it saves).
            ctx.kept = kept
            return x.new_zeros((), dtype=_conv_dtype(x, weight)).expand(_conv_output_shape(conv, x))
        trained, weight = weight, dense_weight(conv)
        if kept is not None:  # a recomputation: the segment's forward computed the statistics
            ctx.save_for_backward(x, trained, *kept)
            activation = _norm_relu_from_statistics(norm, x, *kept)
            return F.conv2d(activation, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)
        # Forward runs the norm once: this is the one running-statistics update.
        if keeps:
            normalized, mean, invstd = _batch_norm_with_statistics(norm, x)
            ctx.save_for_backward(x, trained, mean, invstd)
        else:
            normalized = norm(x)
            ctx.save_for_backward(x, trained)
        activation = relu_of_norm(normalized, x)  # forward runs without autograd: in place
        return F.conv2d(activation, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)

    @staticmethod
    def backward(ctx, grad_output):
        saved_x, trained, *statistics = ctx.saved_tensors
        statistics = statistics or list(ctx.kept or ())
        norm, conv = ctx.norm, ctx.conv
        normalized_by = None  # the recomputed norm's graph (generic path)
        if statistics:
            with torch.no_grad():
                activation = _norm_relu_from_statistics(norm, saved_x, *statistics)
        else:
            x, x_alias = _recomputation_input(saved_x)
            with ctx.autocast.restore(), scratch_running_stats([norm]), torch.enable_grad():
                normalized_by = norm(x_alias)
            # The ReLU is applied in place on a detached alias of the norm output: the norm's
            # backward needs its input, not its output, so one buffer holds both, and no ReLU node
            # is recorded.
            with torch.no_grad():
                activation = normalized_by.detach().relu_()
        need_x = ctx.needs_input_grad[3] or any(ctx.needs_input_grad[6:])
        need_weight, need_bias = ctx.needs_input_grad[4], ctx.needs_input_grad[5]
        # The kernels autograd itself calls for a convolution (under autocast in the output's
        # dtype): gradients are bitwise the plain ones. A compact sparse weight is built for the
        # input gradient and dropped before its own gradient is computed and gathered.
        grad_activation, grad_weight, grad_bias = conv2d_backward(
            conv, grad_output, activation.detach(), trained, ctx.bias_shape, (need_x, need_weight, need_bias), ctx.index
        )
        needed = [ctx.needs_input_grad[3], *ctx.needs_input_grad[6:]]  # x, then the norm's parameters
        norm_grads: list[torch.Tensor | None] = [None] * len(needed)
        if any(needed):
            # ReLU's backward (autograd's own kernel) in place, so the norm backward reads the
            # buffer the conv backward wrote: zero where the ReLU output is not positive.
            grad_normalized = grad_activation.to(activation.dtype)
            torch.ops.aten.threshold_backward.grad_input(grad_normalized, activation, 0, grad_input=grad_normalized)
            del grad_activation, activation
            if statistics:
                # BN's backward kernel with the forward's statistics: what autograd would call.
                norm_grads = list(
                    torch.ops.aten.native_batch_norm_backward(
                        grad_normalized, saved_x, norm.weight, None, None, *statistics, True, norm.eps, needed
                    )
                )
            else:
                norm_inputs = [x, *norm.parameters()]
                wanted = [t for t, need in zip(norm_inputs, needed, strict=True) if need]
                grads = iter(torch.autograd.grad(normalized_by, wanted, grad_normalized, allow_unused=True))
                norm_grads = [next(grads) if need else None for need in needed]
        grad_bias = None if grad_bias is None else grad_bias.to(conv.bias.dtype)
        return (None, None, None, norm_grads[0], grad_weight, grad_bias, *norm_grads[1:])


def _keeps_batch_statistics(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``norm`` is a plain affine ``nn.BatchNorm2d`` normalizing ``x`` (CPU, no autocast)
    by its batch statistics, whose BN kernel the fast path reproduces exactly."""
    return (
        type(norm) is nn.BatchNorm2d
        and norm.training
        and norm.affine
        and x.device.type == "cpu"
        and not torch.is_autocast_enabled("cpu")
    )


def _batch_norm_with_statistics(norm: nn.BatchNorm2d, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``norm(x)`` in training mode (the same kernel, the same running-statistics update), also
    returning the batch mean and inverse standard deviation the kernel computed."""
    factor = 0.0 if norm.momentum is None else norm.momentum
    if norm.track_running_stats and norm.num_batches_tracked is not None:
        norm.num_batches_tracked.add_(1)
        if norm.momentum is None:  # cumulative moving average
            factor = 1.0 / float(norm.num_batches_tracked)
    running_mean, running_var = (norm.running_mean, norm.running_var) if norm.track_running_stats else (None, None)
    return torch.ops.aten.native_batch_norm(
        x, norm.weight, norm.bias, running_mean, running_var, True, factor, norm.eps
    )


def _norm_relu_from_statistics(
    norm: nn.BatchNorm2d, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor
) -> torch.Tensor:
    """``relu(_normalized_from_statistics(...))``: on a CPU with lowmem's C kernels, one pass over
    ``x`` with no FP32 temporary (``lowmem.kernels.cpu.norm_relu``, the same bits); else (or with
    ``LOWMEM_KERNELS=torch``) torch's ops."""
    scale, shift = _scale_and_shift(norm, mean, invstd)
    if kernels.backend(x.device) == "cpu" and cpu_kernels.norm_relu_fits(x, scale, shift):
        return cpu_kernels.norm_relu(x, scale, shift)
    return _normalized_from_statistics(norm, x, mean, invstd).relu_()


def _scale_and_shift(norm: nn.BatchNorm2d, mean: torch.Tensor, invstd: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per channel, a = invstd * weight and b = bias - mean * a (BN's CPU kernel's own)."""
    scale = invstd * norm.weight
    return scale, torch.addcmul(norm.bias, mean, scale, value=-1)


def _normalized_from_statistics(
    norm: nn.BatchNorm2d, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor
) -> torch.Tensor:
    """BN's training-mode output from the kept statistics: ``x * a + b`` per channel with
    a = invstd * weight and b = bias - mean * a, each multiply-add rounded once as the CPU kernel
    rounds it (bitwise the kernel's output). A 16-bit ``x`` is computed in FP32 a few examples at a
    time, so the FP32 temporary stays small."""
    scale, shift = _scale_and_shift(norm, mean, invstd)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    shift, scale = shift.view(shape), scale.view(shape)
    if x.dtype == scale.dtype:
        return torch.addcmul(shift, x, scale)
    out = torch.empty_like(x)
    examples = max(1, _FP32_SLICE // max(1, x[0].numel()))
    for start in range(0, len(x), examples):
        out[start : start + examples] = torch.addcmul(shift, x[start : start + examples], scale)
    return out


def _conv_output_shape(conv: nn.Conv2d, x: torch.Tensor) -> tuple[int, ...]:
    """The shape ``conv(x)`` returns (numeric padding)."""
    return conv_output_shape(x.shape, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation)


def _conv_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.conv2d(x, weight)`` returns here (the autocast dtype under autocast)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight.dtype
