"""The per-block figures the checkpointing DP reasons with, measured on fake tensors (or real ones).

``measure_chain(trainer)`` profiles the trainer's own microbatch step (``microbatch_backward``,
what ``lowmem.profile`` accounts) on the first minibatch, every figure through
``lowmem.profiler.account_activations`` (fake tensors: shapes, no compute):

1. passes with every residual stack *detached*: a recording executor notes what each stack is
   called with (inputs, context, autocast), runs its blocks without autograd and hands on their
   output. The pass then holds everything but the stacks' own memory: its peak is what the rest
   of the model needs with the stacks' stored bytes on top (``outside_peak``: in forward and the
   head's backward); with the output's gradient passed on to the stack's input as zeros (the
   backward of what precedes the stacks runs too), its FLOPs less the blocks' forwards are the
   rest's.
2. per stack, the peak of that pass so far where the stack starts: what forward holds outside the
   stacks while it runs (``held_outside``; read off the pass as it reaches each stack).
3. every distinct block (same module, parameters, input and context shapes) alone, once per way it
   can run: stored with and without BN-ReLU recomputation, and as a one-block checkpointed segment
   ``all_at_once`` and ``recursively``, from a fake input, backward from a fake gradient.

A chain of blocks (``lowmem.techniques.chains``) need not run as one: the recorder cuts it into
*runs*, as ``ChainRunner.call`` cuts it into segments, each run blocks ``i, i+1, ...`` called one
after another on the previous one's output (diffusers' UNet: its down blocks, the middle block's
three, each alone as they are called out of registration order, then its up blocks, called on the
middle block's output); the programme plans each run as a stack of its own
(``ChainCosts.stack_starts``), and a block no run holds (called on something other than a
floating-point tensor) is stored. A block in two runs (its weights shared) is refused, naming it.

Several microbatch shapes (translation's token microbatches) are measured one by one and merged:
bytes take the largest (so the modelled peak bounds every shape's), FLOPs add up over the
minibatch. Every pass of one shape runs on one set of fake parameters (``FakePasses``). Measuring
WRN-28-2 takes about a second; the model and its recorded inputs stay the trainer's, and every
stack runs plainly afterwards (apply a schedule).

A model fake tensors cannot run (a mixture of experts: ``lowmem.profiler.real_passes``) is
measured the same way on real tensors: a fake pass that stops notes the model and the measurement
starts again (``measured``), every pass now real with the training state kept; each block is then
measured alone on the values it was called with in the recorded pass (``_TensorSpec.value``), so
that it routes its tokens as in the step, and none stands for another.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only, tree_unflatten

from lowmem.planning.schedule import BlockCosts, ChainCosts
from lowmem.profiler import ActivationTrace, ActivationTracer
from lowmem.profiler.activations import cpu_fake, maybe_fake, model_state
from lowmem.profiler.real_passes import noted_fake_pass_limit, real_pass, real_pass_reason
from lowmem.profiler.step import distinct_microbatches
from lowmem.residual import residual_stacks, routes_norm_relu_conv, run_sequentially, set_block_executor
from lowmem.techniques.chains import find_block_chains, install_chains, installed_runners
from lowmem.techniques.checkpointing import Segment, apply_checkpointing, run_segments, set_recompute_norm
from lowmem.techniques.compression import ActivationCompression, compression_of
from lowmem.techniques.offload import ActivationOffload, exposed_transfer_flops, offload_of


@dataclass(frozen=True)
class _TensorSpec:
    """Shape, strides, dtype and device of a tensor, to make a fake one like it in another pass;
    recorded on real tensors (``lowmem.profiler.real_passes``), also its values (``value``, a
    detached alias: a block measured alone then routes its tokens as in the step)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    value: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, tensor: torch.Tensor, requires_grad: bool | None = None) -> _TensorSpec:
        grad = tensor.requires_grad if requires_grad is None else requires_grad
        value = None if isinstance(tensor, FakeTensor) else tensor.detach()
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device, grad, value)

    def make(self) -> torch.Tensor:
        """A tensor like the recorded one: fake inside the accounting's fake mode; its recorded
        values in a real pass (zeros when none were recorded)."""
        if self.value is not None and not _faking():
            tensor = self.value.detach()
        else:
            tensor = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
            if not _faking():
                tensor.zero_()
        return tensor.requires_grad_(self.requires_grad and tensor.is_floating_point())


def _faking() -> bool:
    """Whether a fake tensor mode is active (a fake pass runs)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


@dataclass
class _StackCall:
    """What one residual stack, or one run of a chain of blocks, was called with in the recorded
    pass. A run is blocks ``start``, ``start + 1``, ... of one chain, each called on the previous
    one's output, in that order (a chain's blocks that are not, diffusers' UNet's down and up blocks
    with the middle block between them, make several runs)."""

    stack: int  # index in _stacks order
    inputs: list[_TensorSpec]  # each block's input, then the run's output
    contexts: list[tuple]  # per block, its other arguments: _TensorSpec for tensors, the values otherwise
    autocast: tuple[str, bool, torch.dtype]
    keywords: list[dict] = field(default_factory=list)  # per block, its keyword arguments (chains only)
    start: int = 0  # the run's first block, its index in the stack

    @property
    def blocks(self) -> int:
        return len(self.inputs) - 1

    def make_context(self, index: int) -> tuple:
        return tuple(_made(item) for item in self.contexts[index])

    def make_keywords(self, index: int) -> dict:
        return {key: _made(item) for key, item in (self.keywords[index] if self.keywords else {}).items()}

    def autocast_context(self) -> torch.autocast:
        device_type, enabled, dtype = self.autocast
        return torch.autocast(device_type, dtype=dtype, enabled=enabled)


def _spec(item: Any) -> Any:
    """An argument with its tensors (also those in tuples, lists, dicts: a UNet's skip connections)
    as ``_TensorSpec``s."""
    return tree_map_only(torch.Tensor, _TensorSpec.of, item)


def _made(item: Any) -> Any:
    return tree_map_only(_TensorSpec, _TensorSpec.make, item)


class FakePassStopped(Exception):
    """A fake pass met what fake tensors cannot run (``lowmem.profiler.real_passes``): the model is
    noted, and the measurement that ran the pass runs again, on real tensors (``measured``)."""


T = TypeVar("T")


def measured(measure: Callable[[], T]) -> T:
    """``measure()``; if one of its fake passes stopped (``FakePassStopped``), ``measure()`` again,
    whose passes then run on real tensors."""
    try:
        return measure()
    except FakePassStopped:
        return measure()


class FakePasses:
    """``account_activations(run, model, inputs=...)`` for several passes in a row over one model:
    its fake parameters and buffers are made once (``maybe_fake``), not once a pass (~60 ms for
    DynamicConv's 245 tensors). Each pass has its own tracer and starts, as a pass of its own
    would, with no gradient on the fake parameters or inputs: the figures are the same.

    A model fake tensors cannot run (``lowmem.profiler.real_passes.real_pass_reason``) has every
    pass run on real tensors, its training state kept. A fake pass that stops at such a limit
    notes the model and raises ``FakePassStopped``; the passes after it here run on real tensors."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._stack = contextlib.ExitStack()
        self.reason: str | None = None  # why the passes run on real tensors (None: on fake ones)

    def __enter__(self) -> FakePasses:
        self.reason = real_pass_reason(self.model)
        if self.reason is None:
            self.mode = self._stack.enter_context(maybe_fake(self.model, True))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def tracer(self) -> ActivationTracer:
        return ActivationTracer(exclude=model_state(self.model))

    def account(
        self, run: Callable[..., object], inputs: Any = None, tracer: ActivationTracer | None = None
    ) -> ActivationTrace:
        """``run(inputs)`` (fake CPU stand-ins of ``inputs``' tensors) or ``run()``, traced."""
        tracer = self.tracer() if tracer is None else tracer
        if self.reason is not None:

            def traced() -> ActivationTrace:
                with tracer:
                    run() if inputs is None else run(inputs)
                return tracer.trace

            return real_pass(self.model, traced, self.reason)
        fake_inputs = None if inputs is None else tree_map_only(torch.Tensor, self._fake, inputs)
        try:
            try:
                with tracer:
                    run() if inputs is None else run(fake_inputs)
            finally:
                for tensor in [*self.model.parameters(), *tree_leaves(fake_inputs)]:
                    if isinstance(tensor, torch.Tensor):
                        tensor.grad = None
        except Exception as error:  # noqa: BLE001 - sorted here: fake tensors' limit, or the step's error
            reason = noted_fake_pass_limit(error, self.model)
            if reason is None:
                raise
            self._stack.close()  # the real parameters back
            self.reason = reason
            raise FakePassStopped(reason) from error
        return tracer.trace

    def _fake(self, tensor: torch.Tensor) -> torch.Tensor:
        return cpu_fake(self.mode, tensor)


class _Recorder:
    """Block executor of a measuring pass (see the module docstring, steps 1 and 2).

    peak: the pass's activation peak so far (``held_outside`` is read off it as each stack starts).
    """

    def __init__(self, backprop_before: bool = False, peak: Callable[[], int] | None = None) -> None:
        self.calls: list[_StackCall] = []
        self.kept: list[torch.Tensor] = []
        self.held_at_start: list[int] = []  # per stack call, in forward order: the pass's peak so far
        self._open: tuple[_StackCall, bool] | None = None  # the run of a chain being recorded
        self._last: torch.Tensor | None = None  # its last block's output
        self._last_version = 0  # that output's version then (changed in place: not chained)
        self.backprop_before = backprop_before  # run the backward of what comes before the stacks
        self.peak = peak

    def _stack_starts(self) -> None:
        if self.peak is not None:
            self.held_at_start.append(self.peak())

    def run(self, stack: int, blocks: Sequence[nn.Module], x: torch.Tensor, context: tuple) -> torch.Tensor:
        self._stack_starts()
        if not torch.is_grad_enabled():
            raise RuntimeError("measuring checkpoint costs needs a training step with autograd on")
        self.kept.append(x)  # the graph before the stack stays alive, as in the real step
        device = x.device.type
        context_values, context = context, tuple(_spec(item) for item in context)
        autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        call = _StackCall(stack, [], [context] * len(blocks), autocast)
        needs_grad = x.requires_grad
        with torch.no_grad():
            for block in blocks:
                call.inputs.append(_TensorSpec.of(x, needs_grad))
                x = block(x, *context_values)
                needs_grad = needs_grad or any(p.requires_grad for p in block.parameters())
            call.inputs.append(_TensorSpec.of(x, needs_grad))
        self.calls.append(call)
        return self._finish(x, needs_grad)

    def _finish(self, x: torch.Tensor, needs_grad: bool) -> torch.Tensor:
        if self.backprop_before and self.kept[-1].requires_grad:
            return _Bridge.apply(self.kept[-1], x)
        return x.requires_grad_(needs_grad)

    def observe(self, stack: int, runner: Any, index: int, args: tuple, kwargs: dict) -> Any:
        """The same for a chain of blocks (``lowmem.techniques.chains``), one block call at a time.
        A block called on the tensor the chain's previous block returned (unchanged since) extends
        that block's run; any other block call starts a run, as it starts a segment in
        ``ChainRunner.call``. A call the chain runs plainly under every schedule (its first argument
        no floating-point tensor, or autograd off) is part of what lies outside the stacks."""
        x = args[0] if args else None
        forward = runner.forwards[index]
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and torch.is_grad_enabled()):
            self._open = self._last = None
            return forward.plain(*args, **kwargs)
        open_call = self._open[0] if self._open is not None else None
        continues = (
            open_call is not None
            and open_call.stack == stack
            and open_call.start + open_call.blocks == index
            and self._last is x
            and x._version == self._last_version
        )
        if continues:
            call, needs_grad = self._open
        else:
            self._stack_starts()
            self.kept.append(x)  # the graph before the run stays alive, as in the real step
            device = x.device.type
            autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            call = _StackCall(stack, [_TensorSpec.of(x)], [], autocast, [], start=index)
            self.calls.append(call)
            needs_grad = x.requires_grad
        call.contexts.append(tuple(_spec(item) for item in args[1:]))
        call.keywords.append({key: _spec(item) for key, item in kwargs.items()})
        with torch.no_grad():
            output = forward.plain(*args, **kwargs)
        # A block may return a tuple, list or ModelOutput (T5's layers): its first tensor is the one
        # the next block is called on; the rest goes back as the block returned it.
        leaves, spec = tree_flatten(output)
        first = next((i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)), None)
        if first is None:
            raise ValueError(
                f"checkpointing.strategy=optimal: block {runner.chain.names[index]} returns no tensor; leave it out "
                "of checkpointing.blocks, or use checkpointing.strategy=residual / residual_star"
            )
        needs_grad = needs_grad or any(p.requires_grad for p in runner.blocks[index].parameters())
        call.inputs.append(_TensorSpec.of(leaves[first], needs_grad))
        # Every output may be the run's last: it joins the graph as the run's output would.
        leaves[first] = self._finish(leaves[first], needs_grad)
        self._open, self._last, self._last_version = (call, needs_grad), leaves[first], leaves[first]._version
        return tree_unflatten(leaves, spec)


class _Bridge(torch.autograd.Function):
    """``output``, whose gradient reaches ``stack_input`` as zeros: the graph before a detached
    stack is still backpropagated (its FLOPs), the stack costs nothing."""

    @staticmethod
    def forward(ctx, stack_input: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        ctx.input_shape, ctx.input_dtype, ctx.input_device = stack_input.shape, stack_input.dtype, stack_input.device
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.zeros(ctx.input_shape, dtype=ctx.input_dtype, device=ctx.input_device), None


@dataclass(frozen=True)
class OutsidePass:
    """Step 1's memory pass for one microbatch shape: the stacks detached (run without autograd),
    the backward of what precedes them left out. Its peak (``activation_bytes``) is a lower bound of
    the accounted activations of every schedule at that shape: a schedule adds the stacks' own
    memory to the same moments, and what precedes them to the end of backward."""

    activation_bytes: int
    calls: tuple[_StackCall, ...]  # what each stack (run of a chain) was called with, in forward order
    held_at_start: tuple[int, ...]  # per stack call: the pass's peak so far where it starts
    real: bool = False  # run on real tensors (its calls hold the values: ``_TensorSpec.value``)
    # The largest forward op's new outputs (``ActivationTrace.largest_op_bytes``): the same ops run
    # forward under every schedule, so the same figure as the step's under any of them.
    largest_op_bytes: int = 0


def outside_pass(trainer: Any, part: Any, weight: float, passes: FakePasses | None = None) -> OutsidePass:
    """The ``OutsidePass`` of ``trainer``'s microbatch ``part`` (of loss ``weight``), on ``passes``'
    fake parameters or on a set of its own (on real tensors where a fake pass cannot run). Stacks
    are measured the way ``measure_chain`` does."""
    model = _ready_to_measure(trainer)
    if passes is None:

        def measure() -> OutsidePass:
            with FakePasses(model) as own:
                return outside_pass(trainer, part, weight, own)

        return measured(measure)
    step = functools.partial(trainer.microbatch_backward, weight=weight, local=True)
    tracer = passes.tracer()
    recorder = _Recorder(backprop_before=False, peak=lambda: tracer.trace.activation_bytes)
    _record_with(model, recorder)
    try:
        trace = passes.account(step, part, tracer)
    finally:
        _record_with(model, None)
    real = passes.reason is not None
    calls, held = tuple(recorder.calls), tuple(recorder.held_at_start)
    return OutsidePass(trace.activation_bytes, calls, held, real, trace.largest_op_bytes)


def measure_chain(
    trainer: Any,
    outside_flops: bool = True,
    outside: Sequence[OutsidePass | None] = (),
    widths: Sequence[int] = (),
    offload: float | None = None,
) -> ChainCosts:
    """The DP's figures for ``trainer``'s first minibatch (see the module docstring).

    trainer: a ``lowmem.trainer.Trainer`` (only ``unwrapped_model``, ``example_batch``,
        ``microbatches`` and ``microbatch_backward`` are used: the planner does not import it).
        Its model declares residual stacks, or has chains of blocks installed
        (``lowmem.techniques.chains``); one without either gets them detected here.
    outside_flops: also measure the FLOPs outside the stacks (one more fake pass per microbatch
        shape); without, ``ChainCosts.outside_flops`` is 0 and the plans' ``flops`` leave them out.
        They add the same to every schedule: the DP chooses the same ones either way.
    outside: ``OutsidePass``es already run, per distinct microbatch shape in
        ``distinct_microbatches`` order (None or missing: run here).
    widths: the widths a stored block may be compressed at (``checkpointing.compress``: the model
        has compression hooks installed, ``lowmem.techniques.compression``); each is measured.
    offload: the host link's price in FLOPs per byte (``lowmem.techniques.offload.link_flops_per_byte``)
        when a stored block may be offloaded (the model has offload hooks installed that offload only
        where a schedule says); None: it may not.
    """
    model = _ready_to_measure(trainer)
    distinct = distinct_microbatches(trainer, trainer.example_batch())
    try:
        chains = []
        for (part, weight, count), known in itertools.zip_longest(distinct, outside[: len(distinct)]):

            def measure(known: OutsidePass | None = known, part: Any = part, weight: float = weight) -> ChainCosts:
                # An outside pass recorded on fake tensors holds no values for a real pass's blocks.
                if known is not None and real_pass_reason(model) is not None and not known.real:
                    known = None
                return _measure_microbatch(trainer, part, weight, outside_flops, known, widths, offload)

            chains.append((measured(measure), count))
    finally:
        _record_with(model, None)
        apply_checkpointing(model, "none")
    return _merge(chains)


def _ready_to_measure(trainer: Any) -> nn.Module:
    """``trainer``'s model in training mode, with its chains of blocks detected and installed if it
    declares no residual stacks and has none installed."""
    model = trainer.unwrapped_model
    if not residual_stacks(model) and not installed_runners(model):
        install_chains(model, find_block_chains(model))
    model.train()
    return model


def _stacks(model: nn.Module) -> list[list[nn.Module]]:
    """The blocks of each stack: the model's declared residual stacks, or its installed chains."""
    declared = residual_stacks(model)
    if declared:
        return [list(stack.residual_blocks) for stack in declared]
    return [runner.blocks for runner in installed_runners(model)]


def _record_with(model: nn.Module, recorder: _Recorder | None) -> None:
    """Make every stack (chain) of ``model`` report to ``recorder``, or run plainly again (None)."""
    declared = residual_stacks(model)
    for index, stack in enumerate(declared):
        set_block_executor(stack, run_sequentially if recorder is None else functools.partial(recorder.run, index))
    if not declared:
        for index, runner in enumerate(installed_runners(model)):
            runner.observer = None if recorder is None else functools.partial(recorder.observe, index)


def _measure_microbatch(
    trainer: Any,
    part: Any,
    weight: float,
    outside_flops: bool,
    outside: OutsidePass | None = None,
    widths: Sequence[int] = (),
    offload: float | None = None,
) -> ChainCosts:
    model = trainer.unwrapped_model
    hooks = SavingHooks(compression_of(model), offload_of(model) if offload is not None else None, offload)
    stacks = _stacks(model)
    step = functools.partial(trainer.microbatch_backward, weight=weight, local=True)
    with FakePasses(model) as passes:
        # Memory: without the backward of what comes before the stacks, which runs after theirs,
        # when they hold nothing (it is block 0's moment: its incoming gradient leaves it), so the
        # stacks' stored bytes never sit on top of it.
        if outside is None:
            outside = outside_pass(trainer, part, weight, passes)
        whole = None
        if outside_flops:  # FLOPs: the whole step but the stacks
            _record_with(model, _Recorder(backprop_before=True))
            whole = passes.account(step, part)
        calls = outside.calls
        _check_runs_once(model, calls)
        held_outside = outside.held_at_start
        _record_with(model, None)
        apply_checkpointing(model, "none")
        costs: dict[tuple, BlockCosts] = {}
        blocks = []
        for call in calls:
            for index, block in enumerate(stacks[call.stack][call.start : call.start + call.blocks]):
                key = _signature(block, call, index)
                if key not in costs:
                    costs[key] = _measure_block(block, call, index, passes, hooks, widths)
                blocks.append(costs[key])
    outside_peak = outside.activation_bytes
    sizes = tuple(call.blocks for call in calls)
    # The recorded pass ran every block's forward once, without autograd, besides the rest.
    flops = 0 if whole is None else whole.flops - sum(block.forward_flops for block in blocks)
    order = tuple(call.stack for call in calls)
    starts = tuple(call.start for call in calls)
    return ChainCosts(
        tuple(blocks), sizes, held_outside, outside_peak, flops, order, starts, tuple(len(stack) for stack in stacks)
    )


def _check_runs_once(model: nn.Module, calls: Sequence[_StackCall]) -> None:
    """Each block in one run at most: a schedule gives every block one way to run, and the
    programme counts each block once per forward. Raises ValueError naming a block called twice
    (its weights shared between two places of the forward) and the knobs that avoid it."""
    seen: set[tuple[int, int]] = set()
    for call in calls:
        for index in range(call.start, call.start + call.blocks):
            if (call.stack, index) in seen:
                name = _block_name(model, call.stack, index)
                raise ValueError(
                    f"checkpointing.strategy=optimal: block {name} runs more than once per forward (shared between "
                    "places of the model); leave it out of checkpointing.blocks, or use "
                    "checkpointing.strategy=residual / residual_star"
                )
            seen.add((call.stack, index))


def _block_name(model: nn.Module, stack: int, index: int) -> str:
    """The module path of block ``index`` of ``model``'s stack (chain) ``stack``."""
    runners = installed_runners(model)
    if not residual_stacks(model) and stack < len(runners):
        return runners[stack].chain.names[index]
    block = _stacks(model)[stack][index]
    return next((name for name, module in model.named_modules() if module is block), type(block).__name__)


def _signature(block: nn.Module, call: _StackCall, index: int) -> tuple:
    """Blocks with equal signatures cost the same: same structure, parameters and inputs. Recorded
    on real tensors, each block is its own (a mixture of experts routes each block's tokens its way)."""
    params = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in block.named_parameters())
    arguments = repr((call.contexts[index], call.keywords[index] if call.keywords else {}))
    position = (call.stack, call.start + index) if call.inputs[index].value is not None else None
    key = (repr(block), params, call.inputs[index], arguments, call.autocast, routes_norm_relu_conv(block))
    return (*key, position)


class _WithKeywords(nn.Module):
    """A chain's block called with its recorded keyword arguments, as one-argument-list module
    returning the tensor that flows to the next block (the first of a tuple / ModelOutput)."""

    def __init__(self, block: nn.Module, keywords: dict) -> None:
        super().__init__()
        self.block, self.keywords = block, keywords

    def forward(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        return _chained_tensor(self.block(x, *args, **self.keywords))


def _chained_tensor(output: Any) -> torch.Tensor:
    """The tensor of a block's output that flows to the next block (the first of a tuple / ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return output
    return next(leaf for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor))


@dataclass(frozen=True)
class SavingHooks:
    """The model's saved-tensor hooks a block is measured through: compression (its widths are
    measured when it has them), offload (with ``flops_per_byte``, the host link's price: an
    offloaded block is measured when given)."""

    compression: ActivationCompression | None = None
    offload: ActivationOffload | None = None
    flops_per_byte: float | None = None

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """The hooks around a block run alone, nested as around the model's forward (offload
        installed first: the outer one)."""
        with contextlib.ExitStack() as stack:
            for hooks in (self.offload, self.compression):
                if hooks is not None:
                    stack.enter_context(hooks.saving())
            yield


def _measure_block(
    block: nn.Module,
    call: _StackCall,
    index: int,
    passes: FakePasses,
    hooks: SavingHooks = SavingHooks(),
    widths: Sequence[int] = (),
) -> BlockCosts:
    """One block's figures: a fake forward + backward per way it can run (``passes``: the model's,
    whose fake parameters the block reads); stored compressed at each of ``widths`` through the
    model's compression hooks, and offloaded through its offload hooks, when it has them."""
    spec = call.inputs[index]

    def run(segment: Segment) -> Callable[[], None]:
        def step() -> None:
            set_recompute_norm(block, segment.recompute_norm)
            x = spec.make()
            keywords = call.make_keywords(index)
            runnable = _WithKeywords(block, keywords) if keywords else block
            # The model's saved-tensor hooks around the block alone, as around the model's forward.
            with call.autocast_context(), hooks.saving():
                out = run_segments([runnable], x.view_as(x), call.make_context(index), (segment,))
            out = _chained_tensor(out)
            out.backward(torch.empty_like(out) if _faking() else torch.zeros_like(out))

        return step

    routes = routes_norm_relu_conv(block)
    norms = (False, True) if routes else (False,)
    traces = {
        (backprop, norm): passes.account(run(Segment(1, backprop, norm)))
        for backprop in ("stored", "all_at_once")
        for norm in norms
    }
    if routes:
        traces[("recursively", True)] = passes.account(run(Segment(1, "recursively", True)))
    else:  # one block recursively is all_at_once: no input to recompute, no convolution to skip
        traces[("recursively", False)] = traces[("all_at_once", False)]
    stored = traces[("stored", False)]
    compressed = {}
    for bits in widths if hooks.compression is not None else ():
        for norm in norms:
            trace = passes.account(run(Segment(1, "stored", norm, bits)))
            compressed[(norm, bits)] = (trace.stored_before_backward, trace.activation_bytes, trace.flops)
    offloaded = {}
    forward_flops = traces[("all_at_once", False)].flops - stored.flops
    if hooks.offload is not None and hooks.flops_per_byte is not None:
        for norm in norms:
            kept, trace = traces[("stored", norm)], passes.account(run(Segment(1, "stored", norm, offload=True)))
            # Backward brings back what the block saved before it runs: its work is its stored peak.
            exposed = exposed_transfer_flops(
                trace.offloaded_bytes, forward_flops, stored.flops - forward_flops, hooks.flops_per_byte
            )
            offloaded[norm] = (trace.stored_before_backward, kept.activation_bytes, trace.flops + exposed)
    output = call.inputs[index + 1]
    return BlockCosts(
        input_bytes=traces[("all_at_once", False)].stored_before_backward,
        output_bytes=math.prod(output.shape) * output.dtype.itemsize,
        stored_bytes={norm: traces[("stored", norm)].stored_before_backward for norm in norms},
        peak_bytes={key: trace.activation_bytes for key, trace in traces.items()},
        flops=stored.flops,
        forward_flops=forward_flops,
        rebuild_flops=traces[("recursively", routes)].flops - stored.flops,
        routes_norm=routes,
        compressed=compressed,
        offloaded=offloaded,
    )


def _merged_variants(variants: list[tuple[Mapping[Any, tuple[int, int, int]], int]]) -> dict:
    """One block's (stored bytes, peak bytes, FLOPs) per way of storing (compressed, offloaded),
    over microbatch shapes, ``count`` of each: the bytes the largest, the FLOPs summed."""
    keys = variants[0][0]
    return {
        k: (
            max(v[k][0] for v, _ in variants),
            max(v[k][1] for v, _ in variants),
            sum(v[k][2] * n for v, n in variants),
        )
        for k in keys
    }


def _merge(chains: list[tuple[ChainCosts, int]]) -> ChainCosts:
    """One chain standing for microbatches of several shapes, ``count`` of each: bytes are the
    largest over the shapes, FLOPs the sum over the minibatch."""
    first = chains[0][0]
    runs = {(chain.stack_indices, chain.stack_starts, chain.stack_sizes) for chain, _ in chains}
    if len(runs) > 1:
        raise ValueError(
            "checkpointing.strategy=optimal: microbatches of different shapes run the model's blocks in different "
            "orders; name the blocks to checkpoint with checkpointing.blocks=..., or use "
            "checkpointing.strategy=residual / residual_star"
        )
    blocks = []
    for position in range(len(first.blocks)):
        figures = [(chain.blocks[position], count) for chain, count in chains]
        costs = [block for block, _ in figures]
        blocks.append(
            BlockCosts(
                input_bytes=max(b.input_bytes for b in costs),
                output_bytes=max(b.output_bytes for b in costs),
                stored_bytes={k: max(b.stored_bytes[k] for b in costs) for k in first.blocks[position].stored_bytes},
                peak_bytes={k: max(b.peak_bytes[k] for b in costs) for k in first.blocks[position].peak_bytes},
                flops=sum(b.flops * n for b, n in figures),
                forward_flops=sum(b.forward_flops * n for b, n in figures),
                rebuild_flops=sum(b.rebuild_flops * n for b, n in figures),
                routes_norm=first.blocks[position].routes_norm,
                compressed=_merged_variants([(b.compressed, n) for b, n in figures]),
                offloaded=_merged_variants([(b.offloaded, n) for b, n in figures]),
            )
        )
    return ChainCosts(
        tuple(blocks),
        first.stack_sizes,
        tuple(max(chain.held_outside[i] for chain, _ in chains) for i in range(len(first.held_outside))),
        max(chain.outside_peak for chain, _ in chains),
        sum(chain.outside_flops * count for chain, count in chains),
        first.stack_indices,
        first.stack_starts,
        first.model_sizes,
    )
