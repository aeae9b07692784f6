"""Checkpoint placement by dynamic programming: the fewest FLOPs whose activations fit a budget.

The chain is every residual stack's blocks in the order forward runs them (a classifier's one
stack; an encoder's, then a decoder's), cut into ``Segment``s that never cross the end of a stack.
Each segment is stored, or checkpointed and backpropagated ``all_at_once`` (``residual``) or
``recursively`` (``residual_star``'s nested recomputation), with or without BN-ReLU recomputation
(``no_bn``). This is the heterogeneous-chain setting of Beaumont et al.; the model below is the
one lowmem's executor and accounting (``lowmem.profiler.activations``) follow.

Cost model, from per-block figures measured alone on fake tensors (``lowmem.planning.measure``);
bytes as the report's accounting counts them. While segment ``s`` is backpropagated the count is

    held_outside[its stack] + sum of stored(s') over the segments before s + work(s)

and while the model's head runs forward and backward (every segment stored)

    outside_peak + sum of stored(s') over all segments.

- stored(s): a stored block keeps what it saves for backward (compressed at 8, 4 or 2 bits, when
  ``checkpointing.compress`` allows it: its codes, ranges and sign masks; offloaded to host memory,
  when ``checkpointing.offload`` allows it: what stays on the device, its small tensors); a
  checkpointed segment its input.
- work(s), the most alive while one of its blocks k is backpropagated (last block first):
  stored block: its own peak alone (what it saved, the gradient coming in, those it computes);
  all_at_once: the recomputed graphs of the blocks before k, plus k's peak as a one-block segment,
  plus the segment's incoming gradient (held until the segment is done) when k is not the last;
  recursively: the segment's input and the recomputed inputs of the blocks before k, plus k's peak
  as a one-block segment, plus the segment's incoming gradient when k is not the last.
- FLOPs: every block's forward and backward; ``all_at_once`` adds every block's forward,
  ``recursively`` the forward of every block but the last (the sweep recomputing block inputs) and
  every block's rebuilt graph (without a last convolution whose output is never read); a
  compressed stored block adds its quantization passes (``lowmem.techniques.compression``'s
  FLOP-equivalents per element quantized and read back, as the accounting counts them); an
  offloaded one the transfer time its own compute cannot hide, as FLOP-equivalents at the measured
  host link (``lowmem.techniques.offload.exposed_transfer_flops``). An offloaded block's work is its
  stored peak: backward brings what it saved back to the device before it runs.

The peak is a maximum of sums over prefixes of the chain, so a pass over block positions that keeps,
per position, the Pareto set of (bytes stored so far, cost so far) finds the model's exact optimum:
a partial schedule worse in both can never complete into a better one. Cost is compared as
(FLOPs, blocks whose BN-ReLU is recomputed, how narrow the compressed blocks are and how many are
offloaded): BN recomputation is not counted as FLOPs by ``torch.utils.flop_counter`` but takes time,
so among equal FLOPs the plan recomputes least; every width costs the same passes, so among those it
keeps the widest, and it keeps on the device what it can offload for free. The
model is an estimate of the real accounting (context tensors read by every block count once per
block, for one); ``lowmem.planning.optimal`` verifies the chosen schedule by the real accounting
and adjusts the budget it gives this module until the real figure fits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from lowmem.techniques.checkpointing import Segment


@dataclass(frozen=True)
class BlockCosts:
    """One residual block's figures for one microbatch (bytes; FLOPs), measured alone.

    peak_bytes and stored_bytes are keyed by how the block runs: ``(backprop, recompute_norm)``
    for peak_bytes, ``recompute_norm`` for stored_bytes (stored blocks only).
    """

    input_bytes: int  # what a checkpoint of its input keeps (the input; context tensors it saves)
    output_bytes: int  # its output: the gradient it receives in backward
    stored_bytes: Mapping[bool, int]  # kept from its forward to its backward when stored
    peak_bytes: Mapping[tuple[str, bool], int]  # its backward's peak as a one-block segment
    flops: int  # forward + backward
    forward_flops: int  # one forward more (a recomputation)
    rebuild_flops: int  # its graph rebuilt for a recursive backprop
    routes_norm: bool  # can recompute BN-ReLU (routes its triples through norm_relu_conv)
    # Stored compressed, per (recompute_norm, bits): (stored bytes, peak bytes, FLOPs) as above.
    compressed: Mapping[tuple[bool, int], tuple[int, int, int]] = field(default_factory=dict)
    # Stored offloaded, per recompute_norm: (bytes left on the device, peak bytes, FLOPs with the
    # exposed transfer's FLOP-equivalents); empty: offloading is not an option.
    offloaded: Mapping[bool, tuple[int, int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class ChainCosts:
    """Every residual stack's blocks in forward order, and the memory held outside the stacks."""

    blocks: tuple[BlockCosts, ...]
    stack_sizes: tuple[int, ...]  # blocks per stack, in forward order
    held_outside: tuple[int, ...]  # per stack: bytes held outside the stacks while it runs
    outside_peak: int  # the most held outside the stacks (head forward and backward), bytes
    outside_flops: int = 0  # FLOPs outside the stacks (stem, head, loss), forward and backward
    stack_indices: tuple[int, ...] = ()  # each stack's index in lowmem.residual.residual_stacks order
    # Where the stacks above are runs of the model's stacks (chains whose blocks are not all called
    # one after another, each on the previous one's output): each run's first block in its model
    # stack, and the blocks of every model stack (``lowmem.residual.residual_stacks`` order). Empty:
    # each stack above is a whole model stack.
    stack_starts: tuple[int, ...] = ()
    model_sizes: tuple[int, ...] = ()

    def in_model_order(self, schedules: Sequence[Sequence[Segment]]) -> list[tuple[Segment, ...]]:
        """Schedules given in forward order, reordered as ``apply_schedule`` takes them: per model
        stack, its runs' segments in block order, a block no run holds stored."""
        indices = self.stack_indices or tuple(range(len(self.stack_sizes)))
        if not self.stack_starts:
            ordered: list[tuple[Segment, ...]] = [()] * len(indices)
            for index, schedule in zip(indices, schedules, strict=True):
                ordered[index] = tuple(schedule)
            return ordered
        runs: list[list[tuple[int, Sequence[Segment]]]] = [[] for _ in self.model_sizes]
        for index, start, schedule in zip(indices, self.stack_starts, schedules, strict=True):
            runs[index].append((start, schedule))
        ordered = []
        for size, placed in zip(self.model_sizes, runs, strict=True):
            segments: list[Segment] = []
            position = 0
            for start, schedule in sorted(placed, key=lambda run: run[0]):
                if start > position:
                    segments.append(Segment(start - position))
                segments.extend(schedule)
                position = start + sum(segment.blocks for segment in schedule)
            if position < size:
                segments.append(Segment(size - position))
            ordered.append(tuple(segments))
        return ordered


@dataclass(frozen=True)
class Plan:
    """A schedule per stack (forward order) with the model's peak activation bytes and FLOPs."""

    schedules: tuple[tuple[Segment, ...], ...]
    peak_bytes: int
    flops: int

    def __str__(self) -> str:
        return describe(self.schedules)


def describe(schedules: Sequence[Sequence[Segment]]) -> str:
    """``stored/no_bn:4 recursively/no_bn:2 ...``, stacks separated by `` | ``."""
    return " | ".join(" ".join(str(segment) for segment in merge_stored(stack)) for stack in schedules)


def merge_stored(segments: Sequence[Segment]) -> tuple[Segment, ...]:
    """Consecutive stored segments of the same kind merged into one (the same execution)."""
    merged: list[Segment] = []
    for segment in segments:
        previous = merged[-1] if merged else None
        if (
            previous
            and segment.backprop == previous.backprop == "stored"
            and (segment.recompute_norm == previous.recompute_norm)
            and segment.bits == previous.bits
            and segment.offload == previous.offload
        ):
            merged[-1] = Segment(
                previous.blocks + segment.blocks, "stored", segment.recompute_norm, segment.bits, segment.offload
            )
        else:
            merged.append(segment)
    return tuple(merged)


@dataclass(frozen=True)
class _Option:
    """A segment starting at a chain position, with what it costs."""

    segment: Segment
    stored: int  # bytes kept from its forward to its backward
    work: int  # bytes alive at most while it is backpropagated
    flops: int
    norm_blocks: int  # blocks recomputing BN-ReLU
    narrowing: int = 0  # compressed blocks weighted by how narrow (8 bits 1, 4 bits 2, 2 bits 3), offloaded 1


def _norms(blocks: Sequence[BlockCosts]) -> tuple[bool, ...]:
    return (False, True) if all(block.routes_norm for block in blocks) else (False,)


def _option(blocks: Sequence[BlockCosts], segment: Segment) -> _Option:
    """The cost of ``segment`` over ``blocks`` (its blocks, in order)."""
    norm, last = segment.recompute_norm, len(blocks) - 1
    norm_blocks = len(blocks) if norm else 0
    if segment.backprop == "stored":
        (block,) = blocks
        if segment.offload:
            stored, peak, flops = block.offloaded[norm]
            return _Option(segment, stored, peak, flops, norm_blocks, 1)
        if segment.bits is not None:
            stored, peak, flops = block.compressed[(norm, segment.bits)]
            return _Option(segment, stored, peak, flops, norm_blocks, {8: 1, 4: 2, 2: 3}[segment.bits])
        return _Option(segment, block.stored_bytes[norm], block.peak_bytes[("stored", norm)], block.flops, norm_blocks)
    incoming = blocks[-1].output_bytes  # the segment's gradient, held until its backward returns
    work, before = 0, 0  # before: what the blocks before k hold while k is backpropagated
    for k, block in enumerate(blocks):
        work = max(work, before + block.peak_bytes[(segment.backprop, norm)] + (incoming if k < last else 0))
        if segment.backprop == "all_at_once":
            before += block.stored_bytes[norm]  # its recomputed graph
        else:
            before += block.input_bytes  # its recomputed input (the segment's own input for k = 0)
    flops = sum(block.flops for block in blocks)
    if segment.backprop == "all_at_once":
        flops += sum(block.forward_flops for block in blocks)
    else:
        flops += sum(block.forward_flops for block in blocks[:-1]) + sum(block.rebuild_flops for block in blocks)
    return _Option(segment, blocks[0].input_bytes, work, flops, norm_blocks)


def _options(costs: ChainCosts) -> list[list[_Option]]:
    """Every segment that can start at each chain position (none crosses a stack's end)."""
    options: list[list[_Option]] = [[] for _ in costs.blocks]
    start = 0
    for size in costs.stack_sizes:
        stop = start + size
        for a in range(start, stop):
            for norm in _norms(costs.blocks[a : a + 1]):
                options[a].append(_option(costs.blocks[a : a + 1], Segment(1, "stored", norm)))
                for compressed_norm, bits in costs.blocks[a].compressed:
                    if compressed_norm == norm:
                        options[a].append(_option(costs.blocks[a : a + 1], Segment(1, "stored", norm, bits)))
                if norm in costs.blocks[a].offloaded:
                    options[a].append(_option(costs.blocks[a : a + 1], Segment(1, "stored", norm, offload=True)))
            for b in range(a + 1, stop + 1):
                blocks = costs.blocks[a:b]
                for norm in _norms(blocks):
                    options[a].append(_option(blocks, Segment(b - a, "all_at_once", norm)))
                # Recursively: with BN-ReLU recomputed when the blocks can (residual_star), else as
                # they are; over blocks alike in that (each is measured one way).
                routes = {block.routes_norm for block in blocks}
                if len(routes) == 1:
                    options[a].append(_option(blocks, Segment(b - a, "recursively", routes.pop())))
        start = stop
    return options


def _stack_of(costs: ChainCosts) -> list[int]:
    return [stack for stack, size in enumerate(costs.stack_sizes) for _ in range(size)]


@dataclass(frozen=True)
class _State:
    """A schedule of the chain's first blocks: bytes it stores, its cost, its peak so far."""

    stored: int
    cost: tuple[int, int, int]  # (FLOPs, blocks recomputing BN-ReLU, compressed blocks' narrowing)
    peak: int
    previous: _State | None
    option: _Option | None

    def segments(self) -> list[Segment]:
        state, found = self, []
        while state.option is not None:
            found.append(state.option.segment)
            state = state.previous
        return found[::-1]


def _pareto(states: list[_State], key: Callable[[_State], tuple], second: Callable[[_State], object]) -> list[_State]:
    """States not dominated in (stored bytes, ``second``); ``key`` orders ties."""
    kept: list[_State] = []
    for state in sorted(states, key=key):
        if not kept or second(state) < second(kept[-1]):
            kept.append(state)
    return kept


def _search(costs: ChainCosts, budget: int | None, minimize_peak: bool) -> _State | None:
    """The forward pass over positions. budget: the most bytes any moment may hold (None: no
    limit). minimize_peak: keep the (stored, peak) Pareto sets and return the smallest peak;
    otherwise the (stored, cost) sets and the cheapest schedule within ``budget``."""
    options, stack_of = _options(costs), _stack_of(costs)
    count = len(costs.blocks)
    states: list[list[_State]] = [[] for _ in range(count + 1)]
    states[0] = [_State(0, (0, 0, 0), 0, None, None)]
    for position in range(count + 1):
        if minimize_peak:
            states[position] = _pareto(states[position], lambda s: (s.stored, s.peak, s.cost), lambda s: s.peak)
        else:
            states[position] = _pareto(states[position], lambda s: (s.stored, s.cost, s.peak), lambda s: s.cost)
        if position == count:
            break
        outside = costs.held_outside[stack_of[position]]
        for state in states[position]:
            for option in options[position]:
                moment = outside + state.stored + option.work
                if budget is not None and moment > budget:
                    continue
                cost = (
                    state.cost[0] + option.flops,
                    state.cost[1] + option.norm_blocks,
                    state.cost[2] + option.narrowing,
                )
                states[position + option.segment.blocks].append(
                    _State(state.stored + option.stored, cost, max(state.peak, moment), state, option)
                )
    finals = []
    for state in states[count]:
        peak = max(state.peak, costs.outside_peak + state.stored)
        if budget is None or peak <= budget:
            finals.append(_State(state.stored, state.cost, peak, state.previous, state.option))
    if not finals:
        return None
    order = (lambda s: (s.peak, s.cost)) if minimize_peak else (lambda s: (s.cost, s.peak))
    return min(finals, key=order)


def _plan(costs: ChainCosts, state: _State) -> Plan:
    segments = iter(state.segments())
    schedules = []
    for size in costs.stack_sizes:
        stack: list[Segment] = []
        while sum(s.blocks for s in stack) < size:
            stack.append(next(segments))
        schedules.append(merge_stored(stack))
    return Plan(tuple(schedules), state.peak, costs.outside_flops + state.cost[0])


def cheapest_plan(costs: ChainCosts, budget: int) -> Plan | None:
    """The schedule with the fewest FLOPs whose modelled peak is at most ``budget`` bytes (None if
    no schedule's is)."""
    state = _search(costs, budget, minimize_peak=False)
    return None if state is None else _plan(costs, state)


def smallest_plan(costs: ChainCosts) -> Plan:
    """The schedule with the smallest modelled peak, the cheapest among those."""
    smallest = _search(costs, None, minimize_peak=True)
    assert smallest is not None  # every chain has schedules
    return cheapest_plan(costs, smallest.peak)


def predict(costs: ChainCosts, schedules: Sequence[Sequence[Segment]]) -> tuple[int, int]:
    """The modelled (peak bytes, FLOPs) of a schedule per stack (forward order)."""
    stack_of = _stack_of(costs)
    position = stored = peak = flops = 0
    for segments in schedules:
        for segment in _split_stored(segments):
            option = _option(costs.blocks[position : position + segment.blocks], segment)
            peak = max(peak, costs.held_outside[stack_of[position]] + stored + option.work)
            stored, flops = stored + option.stored, flops + option.flops
            position += segment.blocks
    if position != len(costs.blocks):
        raise ValueError(f"the schedules cover {position} blocks; the chain has {len(costs.blocks)}")
    return max(peak, costs.outside_peak + stored), costs.outside_flops + flops


def exposed_transfer(costs: ChainCosts, schedules: Sequence[Sequence[Segment]]) -> int:
    """The FLOP-equivalents of a schedule's offloaded blocks' transfers that their compute cannot
    hide (the model's, ``BlockCosts.offloaded``): part of its modelled cost, never of a real
    accounting's FLOPs, which count arithmetic only."""
    position = exposed = 0
    for segments in schedules:
        for segment in _split_stored(segments):
            if segment.offload:
                block = costs.blocks[position]
                exposed += block.offloaded[segment.recompute_norm][2] - block.flops
            position += segment.blocks
    return exposed


def _split_stored(segments: Sequence[Segment]) -> Iterator[Segment]:
    """Stored segments one block at a time (the unit the model prices), others as they are."""
    for segment in segments:
        if segment.backprop == "stored":
            one = Segment(1, "stored", segment.recompute_norm, segment.bits, segment.offload)
            yield from (one for _ in range(segment.blocks))
        else:
            yield segment
