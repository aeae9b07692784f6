"""``torch.compile`` with lowmem's techniques (``trainer.compile=true``).

**What is compiled**: the model's forward, whole, with AOTAutograd's backward
(``nn.Module.compile``: in place, so the module tree, the parameters and the state-dict keys stay
what they were; a checkpoint of a compiled run loads into an uncompiled model and back). The loss,
the loss scaling, the optimizer step and rewiring stay eager: they run once per step, not per op.

**What runs eagerly inside it** (``outside_compiler``: the compiler stops its graph at the call,
runs the call in Python, and starts a new graph after it: one *graph break* each):

- each checkpointed residual stack's block executor, and each call of a block in a checkpointed
  segment of a chain (``lowmem.techniques.chains``). Their custom autograd nodes replay RNG state,
  watch the blocks for side outputs and fingerprint a block's first recomputation: Python the
  compiler cannot trace. Inside them a block runs compiled (``compiled_call``) once a watched eager
  forward found no side output for what ``checked_key`` records, else eagerly and watched; its
  recomputation runs as its forward ran, so the self-check (on a shape's first, eager, call)
  compares like with like. With ``trainer.compile_segments=stack`` (the default) a residual stack
  whose first run let no side output out for what ``checked_key`` records runs whole as one compiled
  call instead (``run_whole``; ``checkpointing._segments_in_graph``): each checkpointed segment
  a ``torch.utils.checkpoint`` region the compiler's partitioner recomputes in backward, no Python
  of lowmem's per block or microbatch left (``blocks``: the segments as above, the eager run's
  memory exactly). So does an ``nn.Sequential`` of a chain's blocks (MobileNet's ``features``,
  ViT's ``encoder.layers``: ``lowmem.techniques.chain_containers``), and a chain block called
  otherwise (a model's own loop) is one compiled region of its own.
- each compact sparse experts' module (stacked matrices), and a compact embedding under sharded
  training. Compact convolutions, linear layers and embeddings are one operator each in the graph
  (``lowmem.techniques.compact_ops``): no break.

A model without those compiles whole: lowmem adds no break. ``no_bn``'s BatchNorm-ReLU
recomputation needs no code of lowmem's under the compiler: a compiled block's triple is the plain
``conv(relu(norm(x)))`` and AOTAutograd's partitioner recomputes the pointwise norm and ReLU in
backward instead of saving their outputs (its min-cut rematerialization), which is what ``no_bn``
does eagerly.

**Counting**: ``CompileRecord`` counts the graph breaks (with their reasons) and the compile time of
the calls of one model that compiled something, from ``torch._dynamo``'s counters; a model identical
to one compiled before in the process reuses that one's graphs and compiles nothing.

**The inductor cache** (``TORCHINDUCTOR_CACHE_DIR``) is put under lowmem's cache directory
(``lowmem.kernels.cpu.cache_dir()``; one you set yourself is kept), so a second run of a
configuration loads its compiled kernels instead of building them again.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lowmem.kernels import cpu as kernel_cache
from lowmem.profiler.report import CHAINS_ATTRIBUTE
from lowmem.residual import (
    COMPILED_BLOCK,
    COMPILED_TRIPLES,
    CompiledMark,
    compiled_backend,
    compiled_segments,
    residual_stacks,
)
from lowmem.techniques.compact import compact_layers, compiles_whole, mark_counts_dynamic
from lowmem.techniques.shards import is_fsdp_module

BACKENDS = ("inductor", "aot_eager", "eager")  # trainer.compile_backend
SEGMENT_MODES = ("stack", "blocks")  # trainer.compile_segments
_RECORD = "_lowmem_compile_record"  # the CompileRecord of a model compiled by apply_compile


def validate_backend(backend: str | Callable) -> None:
    """``backend`` one of ``BACKENDS`` (``trainer.compile_backend``), or a ``torch.compile`` backend
    function of your own (``apply_compile``; the benchmarks count FLOPs with one)."""
    if not callable(backend) and backend not in BACKENDS:
        raise ValueError(f"trainer.compile_backend={backend!r} is unknown; allowed: {', '.join(BACKENDS)}")


def validate_segments(segments: str) -> None:
    if segments not in SEGMENT_MODES:
        raise ValueError(f"trainer.compile_segments={segments!r} is unknown; allowed: {', '.join(SEGMENT_MODES)}")


def outside_compiler(function: Callable) -> Callable:
    """``function`` run eagerly when compiled code calls it (one graph break per call site)."""
    return _Eager(function)


class _Eager:
    """A callable the compiler does not trace (``torch.compiler.disable``), picklable when its
    function is: a checkpointed model saved whole (``torch.save(run.model)``) or copied keeps it."""

    def __init__(self, function: Callable) -> None:
        self.function = function
        self._eager = torch.compiler.disable(function, recursive=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._eager(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"function": self.function}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["function"])


def inductor_cache() -> str:
    """The inductor cache directory: ``$TORCHINDUCTOR_CACHE_DIR`` if set (by you, or by inductor itself
    for a process that compiled before lowmem did), else ``inductor`` under lowmem's cache directory
    (set for this process, before inductor first reads it)."""
    own = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if own:
        return own
    directory = kernel_cache.cache_dir() / "inductor"
    kernel_cache.private_directory(directory)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    return str(directory)


# --- blocks of checkpointed segments -----------------------------------------------------------------


def _call_module(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    COMPILED_TRIPLES.count, COMPILED_TRIPLES.unread = 0, -1
    return block(*args, **kwargs)


def _call_forward(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    COMPILED_TRIPLES.count, COMPILED_TRIPLES.unread = 0, -1
    return type(block).forward(block, *args, **kwargs)


def _call_module_unread(block: nn.Module, unread: int, *args: Any, **kwargs: Any) -> Any:
    COMPILED_TRIPLES.count, COMPILED_TRIPLES.unread = 0, unread
    output = block(*args, **kwargs)
    COMPILED_TRIPLES.unread = -1
    return output


_FUNCTIONS = {"module": _call_module, "forward": _call_forward, "unread": _call_module_unread}
_COMPILED: dict[tuple[Callable, str | Callable, bool], Callable] = {}


def _compiled(function: Callable, backend: str | Callable, fullgraph: bool = False) -> Callable:
    """``function`` through ``torch.compile`` (static shapes), one compiled function per function,
    backend and ``fullgraph``: its graphs are shared by every block (or stack) alike in classes and
    shapes, their parameters being graph inputs."""
    key = (function, backend, fullgraph)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(function, backend=backend, dynamic=False, fullgraph=fullgraph)
    return _COMPILED[key]


def compiled_call(block: nn.Module, how: str = "module") -> Callable | None:
    """How a checkpointed segment runs ``block`` compiled: ``runner(block, *args)``, the block
    called as a module (``how="module"``) or its class's ``forward`` (``"forward"``: a chained
    block, whose instance ``forward`` is lowmem's runner), or ``runner(block, unread, *args)``
    (``"unread"``): a rebuild for backprop whose norm-ReLU-conv triple ``unread`` computes no
    convolution output (``lowmem.residual.COMPILED_TRIPLES``); None where ``block`` is not marked
    compiled (``mark_compiled_blocks``). One compiled function for all blocks: the compiler's
    graphs are shared by blocks of one class and shapes (their parameters are graph inputs)."""
    backend = compiled_backend(block)
    return None if backend is None else _compiled(_FUNCTIONS[how], backend)


_NOT_WHOLE = "_lowmem_not_whole"  # on a block: why it cannot run compiled whole (compile_segments=stack)
NOT_WHOLE = object()  # what run_whole returns when the compiler could not take the call whole


def whole_allowed(block: nn.Module) -> bool:
    """Whether a checkpointed stack or chain block (by its first block) may run compiled whole now
    (``trainer.compile_segments=stack``): its blocks say so, the compiler may compile (its stance is
    the default one: not ``force_eager``, as lowmem's accounting passes run a compiled model), it has
    not failed to compile it whole before (``run_whole``), and no saved-tensor hooks (compressed or
    offloaded activations) are active, which a compiled checkpoint region would not hand its saved
    tensors to. Not with the ``eager`` backend: dynamo alone, without AOTAutograd, runs a checkpoint
    region as eager ``torch.utils.checkpoint``, whose recomputation updates BatchNorm's running
    statistics a second time (backward then stops: a count it saved was changed in place). A backend
    function of your own must trace the joint graph (``aot_autograd``), as the benchmarks' does."""
    from torch._dynamo import eval_frame

    return (
        compiled_segments(block) == "stack"
        and compiled_backend(block) != "eager"
        and _NOT_WHOLE not in block.__dict__
        and getattr(eval_frame._stance, "stance", "default") == "default"
        and torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    )


def whole_refused(owner: nn.Module) -> bool:
    """Whether ``run_whole`` failed to compile ``owner``'s calls whole before."""
    return _NOT_WHOLE in owner.__dict__


def run_whole(function: Callable, backend: str | Callable, owner: nn.Module, *args: Any) -> Any:
    """``function(*args)`` compiled whole by ``backend`` (one compiled function per ``function``, whose
    graphs calls alike in classes and shapes share), or ``NOT_WHOLE`` where the compiler cannot take
    it in one graph (a graph break in a block, the recompilation limit): ``fullgraph``, so that a
    checkpoint region never runs as eager ``torch.utils.checkpoint``, whose recomputation updates
    BatchNorm's running statistics a second time. ``owner`` (the stack's or chain block's first
    block) then runs by blocks from there on, with a warning that says why."""
    try:
        return _compiled(function, backend, fullgraph=True)(*args)
    except torch._dynamo.exc.TorchDynamoException as error:
        reason = _first_line(str(error))
        owner.__dict__[_NOT_WHOLE] = reason
        warnings.warn(
            f"trainer.compile_segments=stack: {type(owner).__name__} cannot be compiled whole ({reason}); its "
            "checkpointed segments run block by block (as trainer.compile_segments=blocks)",
            stacklevel=2,
        )
        return NOT_WHOLE


def mark_compiled_blocks(blocks: list[nn.Module], backend: str, segments: str) -> None:
    """Run ``blocks`` (of checkpointed segments) compiled, in forward and in the recomputation
    alike, once a forward watched eagerly found no side outputs for their input (``checked_key``);
    their norm-ReLU-conv triples plain (``lowmem.residual.COMPILED_BLOCK``). ``segments``: how
    (``trainer.compile_segments``)."""
    for block in blocks:
        block.__dict__[COMPILED_BLOCK] = CompiledMark(backend, segments)


def checked_key(blocks: list[nn.Module], x: torch.Tensor, context: tuple = ()) -> tuple:
    """What a watched eager forward of ``blocks`` on ``x`` (and ``context``, the other arguments)
    established (no side outputs) holds for: what the watch's verdict depends on. The input's shape,
    dtype, device and whether it requires grad; the other arguments' (tensors: shape, dtype,
    requires grad; other values: their repr); each block's mode and which of its parameters are
    trained (a frozen block lets out no tensor that needs a gradient); the autocast state; and the
    hooks that could collect a tensor (every forward hook of the blocks' modules, and the global
    ones). Any of these changed, the next forward is watched eagerly again."""
    from torch.nn.modules import module as module_hooks

    hooks = tuple(
        (len(m._forward_hooks), len(m._forward_pre_hooks)) for block in blocks for m in block.modules()
    )
    global_hooks = (len(module_hooks._global_forward_hooks), len(module_hooks._global_forward_pre_hooks))
    autocast = torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type)
    trained = tuple((block.training, tuple(p.requires_grad for p in block.parameters())) for block in blocks)
    others = tuple(
        (tuple(item.shape), item.dtype, item.requires_grad) if isinstance(item, torch.Tensor) else repr(item)
        for item in context
    )
    return tuple(x.shape), x.dtype, x.device, x.requires_grad, others, trained, autocast, hooks, global_hooks


def apply_compile(model: nn.Module, backend: str | Callable = "inductor", segments: str = "stack") -> CompileRecord:
    """Compile ``model``'s forward in place (``nn.Module.compile``) with ``backend``, its checkpointed
    segments as ``segments`` says (``trainer.compile_segments``); returns the record the trainer
    fills as the model compiles (``compile_record``)."""
    validate_backend(backend)
    validate_segments(segments)
    if backend == "inductor":
        inductor_cache()
        # Random ops (dropout) draw from torch's generator as eager ops do: a compiled run draws the
        # eager run's masks (inductor's own RNG would draw others).
        import torch._inductor.config as inductor_config

        inductor_config.fallback_random = True
    # The blocks of checkpointed stacks and chains run compiled inside lowmem's eager segments.
    # More graphs than torch's default of 8 per function: a block class of each stack, with and
    # without grad, every microbatch shape.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, 4096
    )
    mark_compiled_blocks([b for b in checkpointed_blocks(model) if not is_fsdp_module(b)], backend, segments)
    # Compact sparse convolutions, linear layers and embeddings are operators of the graph
    # (compact_ops); stacked experts and sharded embeddings run eagerly: one break each.
    from lowmem.techniques import compact_ops  # noqa: F401 - registers the operators

    layers = compact_layers(model)
    for layer in layers:
        if not compiles_whole(layer) and not isinstance(layer.__dict__.get("forward"), _Eager):
            layer.forward = outside_compiler(layer.forward)
    # Their counts of active values change at each rewiring: a dynamic size in the graphs, not a
    # recompilation per rewiring (compact.mark_counts_dynamic). The values are parameters, whose sizes
    # dynamo keeps static unless told (force_parameter_static_shapes).
    if layers:
        torch._dynamo.config.force_parameter_static_shapes = False
        for layer in layers:
            mark_counts_dynamic(layer)
    # A model the user compiled (nn.Module.compile) is compiled again with lowmem's settings.
    model._compiled_call_impl = None
    model.compile(backend=backend)
    record = CompileRecord(backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend)),
                           segments)
    object.__setattr__(model, _RECORD, record)  # a plain attribute: no module, parameter or key
    return record


def checkpointed_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model``'s residual stacks and of its installed chains of blocks."""
    blocks = [block for stack in residual_stacks(model) for block in stack.residual_blocks]
    for runner in getattr(model, CHAINS_ATTRIBUTE, None) or ():
        blocks.extend(runner.blocks)
    return blocks


def compile_record(model: nn.Module) -> CompileRecord | None:
    """The record of a model ``apply_compile`` compiled, else None."""
    return getattr(model, _RECORD, None)


def uncompiled(model: nn.Module) -> tuple[nn.Module, bool]:
    """The module ``model`` compiles, and whether you compiled it: the module a ``torch.compile``
    wrapper holds, or the module itself (``nn.Module.compile``, which ``apply_compile`` replaces).
    ``lowmem.prepare`` compiles it again, with the techniques in place (``trainer.compile=true``)."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module):
        return inner, True
    return model, getattr(model, "_compiled_call_impl", None) is not None


# A reason ``CompileRecord`` adds to dynamo's: frames it gave up on, which then run eagerly, every call
# (a graph break inside a loop, as a model's loop over checkpointed blocks has; any frame that failed).
SKIPPED_FRAMES = "frames run eagerly (dynamo gave up on them: e.g. a graph break inside a loop)"


def _frames_skipped(counters) -> int:
    return int(counters["frames"]["total"]) - int(counters["frames"]["ok"])


def graphs_compiled() -> int:
    """Graphs ``torch.compile`` has compiled in this process so far (0 before dynamo is imported)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    return 0 if dynamo_utils is None else int(dynamo_utils.counters["stats"]["unique_graphs"])


class CompileRecord:
    """Graph breaks, recompilations and compile time of one compiled model, as its calls compile.

    ``graph_breaks``: the breaks of its first compilation (every microbatch shape after it compiles
    the same code again, breaking at the same places: ``recompilations`` counts those);
    ``reasons``: each break's first line, with how many times it occurred.
    """

    def __init__(self, backend: str, segments: str) -> None:
        self.backend, self.segments = backend, segments
        self.graph_breaks: int | None = None
        self.reasons: collections.Counter[str] = collections.Counter()
        self.graphs = 0  # graphs compiled, every compilation included
        self.compilations = 0  # calls that compiled something
        self.compile_seconds = 0.0  # wall time of those calls (compilation and one run)

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Around one call of the model (forward and backward): what it compiled. The breaks are those
        of the first call in which dynamo traced anything, whether it compiled a graph or not (a model
        whose loop over checkpointed blocks breaks runs that loop's frame eagerly and may compile
        nothing in that call)."""
        from torch._dynamo.utils import counters

        breaks_before = collections.Counter(counters["graph_break"])
        skipped_before = _frames_skipped(counters)
        graphs_before = graphs_compiled()
        started = time.perf_counter()
        yield
        graphs = graphs_compiled() - graphs_before
        breaks = collections.Counter(counters["graph_break"]) - breaks_before
        skipped = _frames_skipped(counters) - skipped_before
        if self.graph_breaks is None and (graphs > 0 or breaks or skipped > 0):
            self.graph_breaks = sum(breaks.values())
            for reason, count in breaks.items():
                self.reasons[_first_line(reason)] += count
            if skipped > 0:
                self.reasons[SKIPPED_FRAMES] += skipped
        if graphs <= 0:
            return
        self.compile_seconds += time.perf_counter() - started
        self.graphs += graphs
        self.compilations += 1

    @staticmethod
    def not_compiled() -> dict[str, Any]:
        """``to_json``'s fields for a model that is not compiled."""
        return {"compile_backend": None, "compile_segments": None, "graph_breaks": None, "graph_break_reasons": {},
                "compiled_graphs": 0, "recompilations": 0, "compile_seconds": 0.0}

    def to_json(self) -> dict[str, Any]:
        return {
            "compile_backend": self.backend,
            "compile_segments": self.segments,
            "graph_breaks": self.graph_breaks,
            "graph_break_reasons": dict(self.reasons.most_common()),
            "compiled_graphs": self.graphs,
            "recompilations": max(0, self.compilations - 1),
            "compile_seconds": round(self.compile_seconds, 2),
        }


def _first_line(reason: str) -> str:
    """A break's reason in one line: torch's first line and its debug context, without addresses."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    head = lines[0] if lines else reason
    context = next((line for line in lines if line.startswith("Developer debug context:")), "")
    line = f"{head} ({context.removeprefix('Developer debug context:').strip()[:160]})" if context else head
    return re.sub(r" at 0x[0-9a-f]+", "", line)
