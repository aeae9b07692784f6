"""The search behind ``python -m lowmem.plan``: the best configuration whose accounted total fits.

Searched knobs (one fixed on the command line is searched over its value only):

- ``sparsity.density``: the report's values 1.0, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05;
- ``precision``: fp32, then one 16-bit precision (``precisions_for``): bf16 wherever BF16 runs at
  full speed (a CPU whose ``precision.cpu_compute`` computes the products at FP32's speed at least,
  natively where that is faster; a GPU of compute capability 8.0 or later), else fp16 (accounted on
  fake tensors, which compute nothing: planning a 16-bit precision costs no 16-bit arithmetic);
- ``optim.state_bits``: the precision's own width (the knob's null: 32 with fp32, 16 with bf16 or
  fp16), then 8 and 4 (blockwise-quantized momentum buffers, ``optim.state_block_size`` values a scale);
- ``microbatch.size``: none, then every divisor of ``data.batch_size`` from half of it down to 1
  (WRN's 100: 50, 25, 20, 10, 5, 4, 2, 1, with the report's 10 and 4) that the recipe can cut the
  first minibatch into (token microbatches must hold the longest sentence pair);
- ``loss.chunk_tokens``, where the model has an output layer to chunk
  (``lowmem.techniques.head_loss.output_heads``): none, then auto, toggled on the searched models
  between accountings. The unchunked loss computes no logits again in backward: fewer FLOPs, so it
  ranks first where both fit; where auto does not chunk (logits below its size) the two account
  alike and the configuration is listed unchunked only;
- checkpointing: none, no_bn, residual every 1 and 2, residual_star every 1 to 4 (those the model's
  blocks support), and ``optimal`` with the activation budget the other knobs leave;
- ``checkpointing.compress``, when the command line allows compressed saved activations down to a
  width (``checkpointing.compress=4``: 8 or 4 bits): none, then each allowed width, widest first,
  with ``optimal`` only (its schedule compresses the stored blocks it chooses, at that width or
  wider; every trainer of the search then carries compression hooks without a width of their own,
  which change no figure until a schedule sets one). Without it nothing is compressed, as before.
- ``checkpointing.offload``, when the command line allows it (``checkpointing.offload=true``, a
  CUDA device): ``optimal``'s dynamic program may offload stored blocks, priced at the host link
  measured once (``lowmem.techniques.offload.link_flops_per_byte``). Offloading is exact, so it is
  no level of the preference below: a schedule offloads where that costs fewer FLOP-equivalents
  than recomputing or compressing, and so may let a larger microbatch fit. On a CPU it is refused,
  as ``lowmem.train`` refuses it.

Preference, in this order: the highest density (accuracy: the report's Tables 3 and 4 lose accuracy
as density falls), then the widest optimizer state (the precision's own width, then 8, then 4 bits:
quantization error), then the widest saved activations (uncompressed, then 8, 4, 2 bits), then the
largest microbatch (speed: fewer, larger kernels), then the fewest
FLOPs (recomputation, the chunked loss's logits computed again), then fp32 before the 16-bit
precision (no rounding), then the smallest figure.

Every figure is the report's accounting as ``lowmem.profile`` prints it for the first minibatch,
each knob's share accounted once and combined. What fits the budget is that total plus what a real
step holds beyond it (``Candidate.budget_total_bytes``, the profile's ``budget_total_bytes``):
what depends on density and the data (``lowmem.profiler.step_temporaries``: compact sparse
positions as stored, the model's buffers; a compact layer's dense weight; the minibatch), and what
the step's own tensors hold beyond the activations, read off each accounting's pass
(``Accounted.beyond_bytes_at``: every temporary of forward and backward at its moment, saved tensors
at their real size, weight gradients until they are added to the previous microbatches' sum, a
recomputed block's first check). ``lowmem.plan`` then builds the chosen configuration and, with
``plan.verify``, measures it (``lowmem.planning.budget``). ``optimal``, whose schedules fill the
activation budget they are given to the byte, is given the room less the step's largest op (every
schedule holds it), then less what the schedule found held beyond the room, a few times
(``_within``). Model and optimizer bytes depend on density,
precision and state bits only: counted per triple on the precision's trainer, without drawing
masks or building an optimizer (``lowmem.profiler.account_state``; sparse weights as CSR).
Activation bytes and FLOPs depend on precision, microbatch and checkpointing only: one model per
precision, seen through one trainer per microbatch size (sizes beyond the ones built to learn which
the recipe accepts share the model: only the microbatches differ), whose schedule is swapped
between accountings; each accounting (``lowmem.planning.optimal.MinibatchAccounting``) runs one
distinct microbatch shape at a time, largest first, and stops at the first that exceeds the room the
other knobs leave (a schedule that does not fit costs one fake pass, not one per shape). ``optimal``
reuses one ``CheckpointPlacement`` per trainer, which measures the blocks once and knows the
smallest activations any schedule reaches there: the microbatch sizes that can fit are found by
bisection on it. All of it is cached, and the search runs in preference order and stops once
``plan.top`` configurations fit. A configuration whose accounting raises, whatever the exception
(a strategy the blocks cannot run, a block optimal cannot measure, a step neither a fake nor a real
pass runs), is refused there, never chosen, and the reason kept (``refusals``).

Microbatch sizes are ruled out first by what the model holds outside its residual stacks
(``CheckpointPlacement.below_floor``, a lower bound of every schedule: one fake pass per shape,
no block measured); blocks are measured only for the sizes the search reaches. With two CPUs or
more, a forked child (``lowmem.planning.ahead``) accounts the next size while this process
accounts the current one, and ``lowmem.plan`` (unverified) has the best configuration built and
profiled by another as soon as it is known: the caches they fill are the answer a single process
finds. (torch refuses autograd in a child forked after this process ran a backward pass on fake
tensors, which the search's first accounting does: the first child says so, and the work is then
done in this process alone.)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import hydra
import torch
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from lowmem.config import QUANTIZED_STATE_BITS, ConfigError, compose, state_width
from lowmem.planning import ahead
from lowmem.planning.optimal import AccountedSchedule, CheckpointPlacement, MinibatchAccounting, reusing_placement
from lowmem.planning.reported import reported_metric
from lowmem.profiler import MB, StateBytes, account_state, step_temporaries
from lowmem.profiler.activations import quieted
from lowmem.profiler.real_passes import named_first_line
from lowmem.profiler.report import data_bytes
from lowmem.profiler.state import dense_weight_bytes
from lowmem.profiler.step import data_tensors
from lowmem.sharding import planned_gathered_bytes
from lowmem.techniques.checkpointing import apply_checkpointing
from lowmem.techniques.compression import allowed_widths, apply_compression, compression_of, validate_compress
from lowmem.techniques.cpu_compute import choices
from lowmem.techniques.head_loss import install as install_chunking
from lowmem.techniques.head_loss import output_heads, validate_chunk_tokens
from lowmem.techniques.offload import apply_offload, link_flops_per_byte, offload_of
from lowmem.trainer import Trainer, build_trainer, resolve_device

# Optimal's activation budget lowered by what its schedule held beyond the room, then bisected (``_within``).
TEMPORARY_STEPS, TEMPORARY_BISECTIONS = 2, 3
DENSITIES = (1.0, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05)  # the report's Table 3 / 4 and figure values
# loss.chunk_tokens searched where a model has an output layer to chunk: none first (faster: no
# logits computed again in backward; its fewer FLOPs rank it first where both fit), then auto.
CHUNKS = ("none", "auto")
FIXED_STRATEGIES = (
    ("none", 1), ("no_bn", 1), ("residual", 1), ("residual", 2),
    ("residual_star", 1), ("residual_star", 2), ("residual_star", 3), ("residual_star", 4),
)  # fmt: skip
# Command-line knobs the planner chooses; fixing one restricts the search to its value.
T = TypeVar("T")
SEARCHED = (
    "sparsity.density", "precision", "optim.state_bits", "microbatch.size", "checkpointing.strategy",
    "checkpointing.every", "checkpointing.compress", "checkpointing.offload", "trainer.gradient_sync",
    "loss.chunk_tokens",
)  # fmt: skip


def precisions_for(cfg: DictConfig) -> tuple[str, ...]:
    """The precisions searched on ``cfg``'s device, in preference order among equal FLOPs: fp32 (no
    rounding), then one 16-bit precision: bf16 wherever BF16 runs at full speed (no loss scale, no
    skipped steps), else fp16. On CUDA, bf16 where the GPU computes it natively (compute capability
    8.0 and later); on a CPU, bf16 unless ``precision.cpu_compute=native`` leaves BF16 to kernels
    slower than FP32 there (with ``auto`` or ``fp32``, lowmem.techniques.cpu_compute computes the
    products at FP32's speed at least, natively where that is faster)."""
    device = resolve_device(cfg.trainer.device)
    if device.type == "cuda":
        fast = torch.cuda.is_bf16_supported(including_emulation=False)
    elif device.type == "cpu":
        setting = cfg.precision.cpu_compute
        fast = setting != "native" or all(c == "native" for c in choices("auto", torch.bfloat16, device).values())
    else:
        fast = False
    return ("fp32", "bf16" if fast else "fp16")


@dataclass(frozen=True)
class Candidate:
    """One configuration and its accounting (bytes; FLOPs of one minibatch)."""

    density: float
    precision: str
    microbatch: int | None  # examples (vision) or tokens (translation); None: the whole minibatch
    strategy: str  # a checkpointing.strategy
    every: int | None  # residual strategies' checkpointing.every
    budget_bytes: int | None  # optimal: its checkpointing.budget_mb, in bytes
    model_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    flops: int
    schedule: str = ""  # optimal: the schedule chosen (lowmem.planning.schedule.describe)
    state_bits: int | None = None  # optim.state_bits: 8 or 4; None: the precision's own width
    temporary_bytes: int = 0  # a real step's temporaries beyond the accounting (step_temporaries)
    compress: int | None = None  # checkpointing.compress (optimal only): the narrowest width allowed
    offload: bool = False  # checkpointing.offload: optimal's schedule offloads blocks
    gradient_sync: str | None = None  # plan.world_size > 1 with microbatches: trainer.gradient_sync
    chunk: str | None = None  # loss.chunk_tokens (None: not searched, the model has no output layer to chunk)

    @property
    def total_bytes(self) -> int:
        return self.model_bytes + self.optimizer_bytes + self.activation_bytes

    @property
    def budget_total_bytes(self) -> int:
        """What the budget is compared with: the accounted total and the step's temporaries."""
        return self.total_bytes + self.temporary_bytes

    @property
    def bits(self) -> int:
        """The optimizer state's bits per value."""
        return state_width(self.precision) if self.state_bits is None else self.state_bits

    @property
    def checkpointing(self) -> str:
        if self.compress is not None or self.offload:
            forms = [f"{self.compress}-bit"] if self.compress is not None else []
            return " ".join([self.strategy, *forms, *(["offload"] if self.offload else [])])
        return f"{self.strategy}/{self.every}" if self.strategy in ("residual", "residual_star") else self.strategy

    def knobs(self) -> dict[str, str]:
        """Every searched knob's value as an override value."""
        knobs = {"sparsity.density": f"{self.density}", "precision": self.precision}
        if self.state_bits is not None:
            knobs["optim.state_bits"] = f"{self.state_bits}"
        knobs["microbatch.size"] = "null" if self.microbatch is None else f"{self.microbatch}"
        knobs["checkpointing.strategy"] = self.strategy
        if self.every is not None:
            knobs["checkpointing.every"] = f"{self.every}"
        if self.budget_bytes is not None:
            knobs["checkpointing.budget_mb"] = repr(self.budget_bytes / MB)  # round(x * MB) gives the bytes back
        if self.compress is not None:
            knobs["checkpointing.compress"] = f"{self.compress}"
        if self.offload:
            knobs["checkpointing.offload"] = "true"
        if self.gradient_sync is not None:
            knobs["trainer.gradient_sync"] = self.gradient_sync
        if self.chunk is not None:
            knobs["loss.chunk_tokens"] = self.chunk
        return knobs


def compose_config(*overrides: str) -> DictConfig:
    """``lowmem.config.compose``, also from inside a running Hydra app (``lowmem.plan``'s CLI, where
    Hydra is initialized on lowmem's config directory already)."""
    if GlobalHydra.instance().is_initialized():
        return hydra.compose("config", overrides=list(overrides))
    return compose(*overrides)


def knob_of(override: str) -> str:
    """``+recipe=wrn_cifar`` -> ``recipe``; ``sparsity.density=0.3`` -> ``sparsity.density``."""
    return override.split("=", 1)[0].lstrip("+~")


class Planner:
    """The search for one recipe and budget (see the module docstring).

    overrides: the command line's overrides (``plan.*`` ones included, ignored); those of searched
        knobs restrict the search to their value.
    budget_bytes: the accounted total (model + optimizer + activations) plus the step's
        temporaries (``Candidate.budget_total_bytes``) to fit.
    """

    def __init__(
        self,
        overrides: Sequence[str],
        budget_bytes: int,
        build: Callable[[DictConfig], Trainer] | None = None,
        world_size: int = 1,
    ) -> None:
        self.build = build_trainer if build is None else build  # a trainer from a configuration
        self.parallel = True  # a forked child accounts ahead where it can (lowmem.planning.ahead)
        given = [o for o in overrides if not knob_of(o).startswith(("hydra.", "plan."))]
        if any(knob_of(o) == "checkpointing.budget_mb" for o in given):
            raise ConfigError(
                "checkpointing.budget_mb is chosen by lowmem.plan (for checkpointing.strategy=optimal); "
                "set the budget with plan.budget_mb"
            )
        self.budget = budget_bytes
        # checkpointing.compress on the command line is the narrowest width allowed, searched down to;
        # checkpointing.offload=true allows offloading, searched (on CUDA) after keeping on the device.
        allowed = {"checkpointing.compress", "checkpointing.offload"}
        self.fixed = {knob_of(o) for o in given if knob_of(o) in SEARCHED} - allowed
        self.base = [o for o in given if knob_of(o) not in SEARCHED]
        self.cfg = compose_config(*given)
        cfg = self.cfg
        self.device = resolve_device(cfg.trainer.device)
        # plan.world_size=N: per-rank memory under trainer.parallel=fsdp, planned in this process:
        # the activations of one rank's share of the minibatch (built with data.batch_size / N), the
        # first rank's shards of the weights, gradients and state, and the weights gathered at once.
        self.world_size = world_size
        if world_size > 1:
            if cfg.data.batch_size % world_size:
                raise ConfigError(
                    f"plan.world_size={world_size}: data.batch_size={cfg.data.batch_size} is the global minibatch "
                    "and must be divisible by the number of ranks"
                )
            self.base.append(f"data.batch_size={cfg.data.batch_size // world_size}")
            cfg = compose_config(*given, f"data.batch_size={cfg.data.batch_size // world_size}")
        self.densities = (cfg.sparsity.density,) if "sparsity.density" in self.fixed else DENSITIES
        self.precisions = (cfg.precision.name,) if "precision" in self.fixed else precisions_for(cfg)
        # Per precision, the optim.state_bits searched: None (its own width), 8, 4, or the fixed value.
        self.state_bits = {precision: self._state_bits_for(precision) for precision in self.precisions}
        batch = cfg.data.batch_size
        divisors = [size for size in range(batch // 2, 0, -1) if batch % size == 0]
        self.microbatches: tuple[int | None, ...] = (
            (cfg.microbatch.size,) if "microbatch.size" in self.fixed else (None, *divisors)
        )
        strategies: list[tuple[str, int | None]] = [*FIXED_STRATEGIES, ("optimal", None)]
        if "checkpointing.strategy" in self.fixed:
            strategies = [(s, e) for s, e in strategies if s == cfg.checkpointing.strategy]
        if "checkpointing.every" in self.fixed:
            strategies = [(s, cfg.checkpointing.every if e is not None else None) for s, e in strategies]
        self.strategies = tuple(dict.fromkeys(strategies))
        self.compressions = self._compressions()
        self.offload_allowed = self._offload_allowed()
        self.syncs = self._syncs()
        self.chunk_values = self._chunk_values()
        self._states: dict[tuple[float, str, int | None], StateBytes] = {}
        self._temporaries: dict[tuple[float, str, int | None], int] = {}
        self._trainers: dict[tuple[str, int | None], Trainer | None] = {}
        self._valid: dict[str, tuple[int | None, ...]] = {}
        # Per (precision, microbatch, compress, chunk).
        self._placements: dict[tuple[str, int | None, int | None, str | None], CheckpointPlacement] = {}
        self._accountings: dict[tuple[str, int | None], MinibatchAccounting] = {}
        self._chunking: dict[tuple[str, int | None], bool] = {}  # per (precision, microbatch): ``_chunking_changes``
        # Schedules the blocks cannot run, or whose build or accounting raised, with why, by
        # (precision, microbatch, strategy, every, chunk) (a refused optimal: (precision, microbatch,
        # "optimal", compress, chunk)); never chosen.
        self._refused: dict[tuple[str, int | None, str, int | None, str | None], str] = {}

    def _state_bits_for(self, precision: str) -> tuple[int | None, ...]:
        """The optim.state_bits values searched with ``precision``, widest first (None: its width)."""
        width = state_width(precision)
        quantized = QUANTIZED_STATE_BITS if width != 64 else ()  # FP64 reference runs keep FP64 state
        if "optim.state_bits" not in self.fixed:
            return (None, *quantized)
        bits = self.cfg.optim.state_bits
        if bits is None or bits == width:
            return (None,)
        if bits in quantized:
            return (bits,)
        if "precision" in self.fixed:
            raise ConfigError(
                f"optim.state_bits={bits!r} is not allowed: with precision={precision} one of "
                f"{', '.join(map(str, (width, *quantized)))} or null (the precision's width)"
            )
        return ()  # the width of another searched precision: not this one's

    def _compressions(self) -> tuple[int | None, ...]:
        """The checkpointing.compress values searched, widest first (None: uncompressed): none, then
        every width down to the command line's (none given: none only)."""
        narrowest = validate_compress(self.cfg.checkpointing.compress)
        if narrowest is None:
            return (None,)
        if not self._optimal_allowed:
            raise ConfigError(
                f"checkpointing.compress={narrowest} is planned with checkpointing.strategy=optimal only (whose "
                "schedule compresses the blocks it chooses); leave checkpointing.strategy unset, or set it to optimal"
            )
        return (None, *allowed_widths(narrowest))

    def _offload_allowed(self) -> bool:
        """Whether optimal's schedules may offload blocks: where the command line allows it (a CUDA
        device's run). Offloading is exact, so it is no level of the preference: the dynamic program
        offloads a block where that costs fewer FLOP-equivalents at the measured host link than
        recomputing or compressing it, which may let a larger microbatch fit."""
        if not self.cfg.checkpointing.offload:
            return False
        device = resolve_device(self.cfg.trainer.device)
        if device.type != "cuda":
            raise ConfigError(
                "checkpointing.offload=true needs a CUDA device (it copies saved activations to pinned host memory "
                f"on a side stream); this plan is for {device.type}: use checkpointing.offload=false"
            )
        if not self._optimal_allowed:
            raise ConfigError(
                "checkpointing.offload=true is planned with checkpointing.strategy=optimal only (whose schedule "
                "offloads the blocks it chooses); leave checkpointing.strategy unset, or set it to optimal"
            )
        return True

    def _chunk_values(self) -> tuple[str, ...]:
        """The loss.chunk_tokens values searched where the model has an output layer to chunk: none,
        then auto (fixed on the command line: that value)."""
        if "loss.chunk_tokens" in self.fixed:
            value = validate_chunk_tokens(self.cfg.loss.chunk_tokens)
            return ("none" if value is None else str(value),)
        return CHUNKS

    def _chunks_at(self, precision: str, microbatch: int | None) -> tuple[str | None, ...]:
        """The loss.chunk_tokens values searched at (precision, microbatch): ``chunk_values`` where the
        model has an output layer (``lowmem.techniques.head_loss.output_heads``) and chunking changes
        its step there, else the first alone (auto leaves logits below its size whole: the same
        step), or None (nothing to chunk: the knob is left as it is)."""
        trainer = self._trainer_for(precision, microbatch)
        if trainer is None or not output_heads(trainer.unwrapped_model):
            return (None,)
        if len(self.chunk_values) > 1 and not self._chunking_changes(precision, microbatch):
            return self.chunk_values[:1]
        return self.chunk_values

    def _chunking_changes(self, precision: str, microbatch: int | None) -> bool:
        """Whether the chunk settings searched account differently at (precision, microbatch): one
        pass each without checkpointing (the first fixed strategy's, reused by the search), where
        every strategy would otherwise be accounted once per setting for the same figures."""
        key = (precision, microbatch)
        if key not in self._chunking:
            model = self._trainer_for(precision, microbatch).unwrapped_model
            figures = set()
            try:
                for chunk in self.chunk_values:

                    def apply(chunk: str = chunk) -> None:
                        self._chunked(precision, microbatch, chunk)
                        apply_checkpointing(model, "none", 1)

                    accounted = self._accounting(precision, microbatch).account((chunk, "none", 1), apply)
                    figures.add((accounted.activation_bytes, accounted.flops, accounted.live_bytes))
            except Exception:  # noqa: BLE001 - unknown: both settings are searched, and refused there if so
                if ahead.in_child():
                    raise
                figures = {"unknown", "either"}
            self._chunking[key] = len(figures) > 1
        return self._chunking[key]

    def _least_chunk(self, precision: str, microbatch: int | None) -> str | None:
        """The chunk setting of the least memory at (precision, microbatch): the last searched (None:
        nothing to chunk)."""
        trainer = self._trainer_for(precision, microbatch)
        if trainer is None or not output_heads(trainer.unwrapped_model):
            return None
        return self.chunk_values[-1]

    def _chunked(self, precision: str, microbatch: int | None, chunk: str | None) -> None:
        """Make the model of (precision, microbatch) compute its loss as ``chunk`` says (the searched
        trainers share one model per precision: set before each of its passes)."""
        if chunk is not None:
            install_chunking(self._trainer_for(precision, microbatch).unwrapped_model, chunk)

    def _syncs(self) -> tuple[str, ...]:
        """The trainer.gradient_sync values searched where they differ (plan.world_size > 1, with
        microbatches): ``minibatch`` first (one reduce-scatter per minibatch instead of one per
        microbatch: less communication, as fast or faster), then ``microbatch`` (each rank
        accumulates only its shards of the gradients, not every gradient whole: less memory)."""
        if self.world_size == 1:
            return ()
        if "trainer.gradient_sync" in self.fixed:
            return (self.cfg.trainer.gradient_sync,)
        return ("minibatch", "microbatch")

    # --- the search ----------------------------------------------------------------------------
    def search(self, top: int, first: Callable[[Candidate], None] | None = None) -> list[Candidate]:
        """Up to ``top`` configurations that fit, best first (the preference order). ``first`` is
        called with the best one as soon as it is known (later ones rank below it), while the
        search goes on."""
        found: list[Candidate] = []
        with _quiet_builds():
            levels = sorted({_quantization(b) for bits in self.state_bits.values() for b in bits})
            for density, level, compress in itertools.product(self.densities, levels, self.compressions):
                pairs = [
                    (precision, bits)
                    for precision in self.precisions
                    for bits in self.state_bits[precision]
                    if _quantization(bits) == level
                ]
                # Per precision and state bits, the microbatch sizes worth accounting at this density.
                sizes = {pair: self._sizes_that_may_fit(density, *pair) for pair in pairs}
                tasks = [
                    (density, *pair, microbatch, compress)
                    for microbatch in self.microbatches
                    for pair in pairs
                    if microbatch in sizes[pair]
                ]
                with self._ahead_of(tasks, top) as next_task:
                    for microbatch in self.microbatches:
                        group = []
                        for task in tasks:
                            if task[3] == microbatch:
                                next_task(task, len(found) + len(group))
                                group.extend(self._fitting(*task))
                        group.sort(key=lambda c: (c.flops, self.precisions.index(c.precision), c.budget_total_bytes))
                        if group and not found and first is not None:
                            first(group[0])
                        found.extend(group)
                        if len(found) >= top:
                            return found[:top]
        return found

    @contextlib.contextmanager
    def _ahead_of(self, tasks: list[tuple], top: int) -> Iterator[Callable[[tuple, int], None]]:
        """Yields ``next_task(task, found)``, called before this process runs ``_fitting(*task)`` with
        ``found`` configurations found so far. Where it can (``parallel``), a forked child
        (``lowmem.planning.ahead``) computes the task after the one this process computes next, and
        its figures are merged here before that task is reached. While the child still computes
        ``task``, this process computes later tasks the search is sure to reach (even if every
        task before them yielded the most configurations a task can, fewer than ``top``)."""
        if not self.parallel or len(tasks) < 2 or not ahead.usable():
            yield lambda task, found: None
            return
        merged: set[tuple] = set()  # tasks whose figures are here (the child's, or computed ahead)
        most = len(self.strategies)  # configurations one task can yield at most

        def compute(task: tuple) -> dict:
            self._fitting(*task)
            return self.export(task[1], task[3], task[4])

        def merge(task: tuple, data: dict) -> None:
            self.merge(task[1], task[3], data, task[4])
            merged.add(task)

        with ahead.Ahead(compute, merge) as helper:

            def next_task(task: tuple, found: int) -> None:
                index = tasks.index(task)
                while helper.running() == task and not helper.finished():
                    later = [t for t in tasks[index + 1 :] if t not in merged]
                    if not later or found + most * (tasks.index(later[0]) - index) >= top:
                        break
                    self._fitting(*later[0])
                    merged.add(later[0])
                if helper.running() == task:
                    helper.collect()
                # What this process computes next (``task`` itself unless merged), then the child's.
                pending = [t for t in tasks[index:] if t not in merged]
                if helper.running() is None and len(pending) >= 2 and ahead.usable():
                    helper.start(pending[1])

            yield next_task

    def export(self, precision: str, microbatch: int | None, compress: int | None = None) -> dict:
        """What this planner measured and accounted for (precision, microbatch, compress), every
        chunk setting: plain data."""
        key = (precision, microbatch)
        placements = {
            chunk: placement.found()
            for (*at, chunk), placement in self._placements.items()
            if tuple(at) == (*key, compress)
        }
        accounting = self._accountings.get(key)
        return {
            "placements": placements,
            "figures": None if accounting is None else accounting.found(),
            "refused": {refused: why for refused, why in self._refused.items() if refused[:2] == key},
        }

    def merge(self, precision: str, microbatch: int | None, data: dict, compress: int | None = None) -> None:
        """Take another process's ``export`` for (precision, microbatch, compress) into the caches."""
        if self._trainer_for(precision, microbatch) is None:
            return
        for chunk, found in data["placements"].items():
            self._placement(precision, microbatch, compress, chunk).merge(found)
        if data["figures"] is not None:
            self._accounting(precision, microbatch).merge(data["figures"])
        self._refused |= data["refused"]

    def smallest(self) -> Candidate:
        """The configuration with the smallest accounted total and step temporaries
        (``Candidate.budget_total_bytes``) in the searched space: the lowest density at the smallest
        microbatch (activations grow with it), at its smallest schedule, the loss chunked where it can be."""
        density = min(self.densities)
        with _quiet_builds():
            found = [
                candidate
                for precision in self.precisions
                for bits in self.state_bits[precision]
                for candidate in self._smallest_at(density, precision, bits)
                if candidate is not None
            ]
        if not found:
            raise ConfigError("lowmem.plan: the fixed checkpointing.strategy does not run on this model's blocks")
        return min(found, key=lambda candidate: candidate.budget_total_bytes)

    def _smallest_at(self, density: float, precision: str, bits: int | None) -> list[Candidate | None]:
        microbatch = self._valid_sizes(precision)[-1]
        chunk = self._least_chunk(precision, microbatch)
        state = self.state_bytes(density, precision, bits)
        temporary = self.temporary_bytes(density, precision, microbatch)
        found = []
        for compress in self.compressions if self._optimal_allowed else ():
            least = self._with_placement(precision, microbatch, compress, lambda placement: placement.smallest(), chunk)
            if least is not None:
                room = least.activation_bytes
                found.append(
                    self._optimal(density, precision, bits, microbatch, state, least, room, temporary, compress, chunk)
                )
        # Optimal's smallest is the least activations; a fixed strategy may hold fewer temporaries.
        return [
            *found,
            *(
                self._fixed(density, precision, bits, microbatch, s, e, state, temporary=temporary, chunk=chunk)
                for s, e in self.strategies
                if s != "optimal"
            ),
        ]

    def overrides(self, candidate: Candidate) -> list[str]:
        """The overrides to add to the command line planned with (knobs it fixed are left out)."""
        overrides = [f"{knob}={value}" for knob, value in candidate.knobs().items() if knob not in self.fixed]
        if candidate.compress is None and len(self.compressions) > 1:  # the command line allowed compression
            overrides.append("checkpointing.compress=none")
        if not candidate.offload and self.offload_allowed:  # ... or offloading
            overrides.append("checkpointing.offload=false")
        return overrides

    def compose(self, candidate: Candidate) -> DictConfig:
        """The configuration ``lowmem.train <command line> <overrides>`` runs for ``candidate``."""
        return compose_config(*self.base, *(f"{k}={v}" for k, v in candidate.knobs().items()))

    def release(self, keep: Sequence[Candidate] = ()) -> None:
        """Drop the search's trainers and accountings (models, fake-pass caches), keeping only the
        placements ``keep``'s optimal schedules are built from: what the search leaves alive is not
        the chosen run's, and is freed before that run is built and measured."""
        needed = {(c.precision, c.microbatch, c.compress, c.chunk) for c in keep if c.strategy == "optimal"}
        self._placements = {key: placement for key, placement in self._placements.items() if key in needed}
        self._trainers.clear()
        self._accountings.clear()
        gc.collect()

    def build_chosen(self, candidate: Candidate, reuse: bool = True) -> Trainer:
        """The trainer ``lowmem.train`` builds for ``candidate``. With ``reuse``, optimal
        checkpointing takes the search's measurements and accountings for its schedule instead of
        measuring again (the caller accounts the trainer, and builds again without ``reuse`` when the
        figures differ from the candidate's)."""
        cfg = self.compose(candidate)
        key = (candidate.precision, candidate.microbatch, candidate.compress, candidate.chunk)
        if not reuse or candidate.strategy != "optimal" or key not in self._placements:
            return self.build(cfg)
        with reusing_placement(self._placements[key]):
            return self.build(cfg)

    def reported(self, candidate: Candidate) -> tuple[str, float, float] | None:
        """The report's accuracy figure for ``candidate`` (``lowmem.planning.reported``)."""
        cfg = self.cfg
        if OmegaConf.is_missing(cfg, "recipe"):  # a loop of the user's own (lowmem.api.plan)
            return None
        if candidate.state_bits is not None or candidate.compress is not None:  # the report's own widths only
            return None
        return reported_metric(
            cfg.recipe, cfg.model, cfg.data.batch_size, candidate.density, candidate.microbatch, candidate.precision
        )

    @property
    def _optimal_allowed(self) -> bool:
        return any(strategy == "optimal" for strategy, _ in self.strategies)

    def _room(
        self, density: float, precision: str, bits: int | None, microbatch: int | None = None, sync: str | None = None
    ) -> int:
        """What ``density``, ``precision``, ``bits`` and the step's temporaries at ``microbatch``
        (and gradient ``sync``) leave of the budget for activations (bytes). (The default, the whole
        minibatch, has no accumulation: the least temporaries of any size.)"""
        state = self.state_bytes(density, precision, bits)
        temporary = self.temporary_bytes(density, precision, microbatch, sync)
        return self.budget - state.model_bytes - state.optimizer_bytes - temporary

    def _fitting(
        self, density: float, precision: str, bits: int | None, microbatch: int | None, compress: int | None = None
    ) -> list[Candidate]:
        """The configurations at (density, precision, bits, microbatch, compress) whose total fits the
        budget: with ``compress``, optimal schedules that compress (at that width or
        wider) only. With microbatches on several ranks, those of the first gradient sync (``syncs``)
        where any fits."""
        if microbatch is None or not self.syncs:
            return self._fitting_with(density, precision, bits, microbatch, compress, None)
        for sync in self.syncs:
            found = self._fitting_with(density, precision, bits, microbatch, compress, sync)
            if found:
                return [dataclasses.replace(candidate, gradient_sync=sync) for candidate in found]
        return []

    def _fitting_with(
        self,
        density: float,
        precision: str,
        bits: int | None,
        microbatch: int | None,
        compress: int | None,
        sync: str | None,
    ) -> list[Candidate]:
        """``_fitting``'s configurations at one gradient ``sync``, every chunk setting of the loss."""
        if self._trainer_for(precision, microbatch) is None:
            return []
        fitting: list[Candidate] = []
        for chunk in self._chunks_at(precision, microbatch):
            for candidate in self._fitting_chunked(density, precision, bits, microbatch, compress, sync, chunk):
                # Chunking that changes nothing here (logits below auto's size): listed unchunked only.
                if not any(_same_figures(candidate, other) for other in fitting):
                    fitting.append(candidate)
        return fitting

    def _fitting_chunked(
        self, density: float, precision: str, bits: int | None, microbatch: int | None, compress: int | None,
        sync: str | None, chunk: str | None,
    ) -> list[Candidate]:  # fmt: skip
        """``_fitting_with``'s configurations with the loss chunked as ``chunk`` says."""
        state = self.state_bytes(density, precision, bits)
        room = self._room(density, precision, bits, microbatch, sync)
        temporary = self.temporary_bytes(density, precision, microbatch, sync)
        if room <= 0:
            return []
        # No schedule goes below optimal's smallest.
        reaches = self._with_placement(
            precision, microbatch, compress, lambda placement: placement.reaches(room), chunk
        )
        if reaches is False:
            return []
        optimal = self._with_placement(
            precision, microbatch, compress, lambda placement: _within(placement, room, density), chunk
        )
        if compress is not None:
            if optimal is None or "bit" not in str(optimal[0].plan):  # compresses nothing: listed without compression
                return []
            return [self._optimal(density, precision, bits, microbatch, state, *optimal, temporary, compress, chunk)]
        fitting = []
        for strategy, every in self.strategies:
            if strategy != "optimal":
                candidate = self._fixed(
                    density, precision, bits, microbatch, strategy, every, state, room, temporary, chunk
                )
                if candidate is not None:
                    fitting.append(candidate)
        if optimal is not None:
            accounted = optimal[0]
            # A schedule that is one of the fixed patterns is listed under its simpler name only.
            if not any((c.activation_bytes, c.flops) == (accounted.activation_bytes, accounted.flops) for c in fitting):
                fitting.append(
                    self._optimal(density, precision, bits, microbatch, state, *optimal, temporary, None, chunk)
                )
        return fitting

    @staticmethod
    def _optimal(
        density: float, precision: str, bits: int | None, microbatch: int | None, state: StateBytes,
        accounted: AccountedSchedule, budget: int, temporary: int, compress: int | None = None,
        chunk: str | None = None,
    ) -> Candidate:  # fmt: skip
        """Optimal checkpointing within ``budget`` activation bytes, as ``accounted`` (its schedule);
        its temporaries: ``temporary`` (the state's) and what its passes held beyond the activations."""
        schedule = str(accounted.plan)
        return Candidate(
            density, precision, microbatch, "optimal", None, budget, state.model_bytes, state.optimizer_bytes,
            accounted.activation_bytes, accounted.flops, schedule, bits, temporary + accounted.beyond_bytes_at(density),
            compress,
            "offload" in schedule, chunk=chunk,
        )  # fmt: skip

    def _fixed(
        self, density: float, precision: str, bits: int | None, microbatch: int | None, strategy: str,
        every: int | None, state: StateBytes, room: int | None = None, temporary: int = 0, chunk: str | None = None,
    ) -> Candidate | None:  # fmt: skip
        """A fixed strategy's candidate with the loss chunked as ``chunk`` says; None when the blocks
        cannot run it, or (with ``room``) when its activations and what its passes hold beyond them
        exceed ``room`` bytes."""
        key = (precision, microbatch, strategy, every, chunk)
        if key in self._refused:
            return None
        model = self._trainer_for(precision, microbatch).unwrapped_model
        try:
            apply_checkpointing(model, strategy, every)
        except ValueError:  # the blocks do not support it (no_bn / residual_star on any block)
            self._refused[key] = ""
            return None

        def apply() -> None:
            self._chunked(precision, microbatch, chunk)
            apply_checkpointing(model, strategy, every)

        try:
            accounted = self._accounting(precision, microbatch).account((chunk, strategy, every), apply, above=room)
        except Exception as error:  # noqa: BLE001 - whatever stops it, the configuration is refused, not chosen
            if ahead.in_child():
                raise
            self._refused[key] = named_first_line(error)
            return None
        beyond = accounted.beyond_bytes_at(density)
        if room is not None and accounted.activation_bytes + beyond > room:
            return None
        every = every if strategy in ("residual", "residual_star") else None
        return Candidate(
            density, precision, microbatch, strategy, every, None, state.model_bytes, state.optimizer_bytes,
            accounted.activation_bytes, accounted.flops, state_bits=bits,
            temporary_bytes=temporary + beyond, chunk=chunk,
        )  # fmt: skip

    def _valid_sizes(self, precision: str) -> tuple[int | None, ...]:
        """The searched microbatch sizes (largest first) the recipe can cut the first minibatch
        into: all but token microbatches smaller than its longest sentence pair, which are the
        smallest sizes (one that holds the longest pair, any larger one does)."""
        if precision not in self._valid:
            sizes = self.microbatches
            low, high = 1, len(sizes)  # sizes[:low] are valid (the first, possibly none, always is); sizes[high:] not
            while low < high:
                middle = (low + high) // 2
                if self._trainer_for(precision, sizes[middle]) is None:
                    high = middle
                else:
                    low = middle + 1
            self._valid[precision] = sizes[:low]
        return self._valid[precision]

    def _sizes_that_may_fit(self, density: float, precision: str, bits: int | None) -> tuple[int | None, ...]:
        """The valid microbatch sizes where what the model holds outside its residual stacks alone
        (``CheckpointPlacement.below_floor``: a lower bound of every schedule's activations) is
        within what ``density``, ``precision`` and ``bits`` leave of the budget: a suffix of
        ``_valid_sizes``, as it grows with the microbatch, found by bisection (a few fake passes
        without measuring any block). ``_fitting`` then tells, size by size in preference order,
        whether the smallest schedule fits: no blocks are measured for sizes the search never
        reaches. Without optimal among the strategies, every valid size."""
        room = self._room(density, precision, bits)
        if room <= 0:
            return ()
        sizes = self._valid_sizes(precision)
        if not self._optimal_allowed:
            return sizes
        if self._below_floor(precision, sizes[-1], room):
            return ()  # not even the smallest size (the likeliest answer where nothing fits: one probe)
        low, high = 0, len(sizes) - 1  # sizes[high:] fit; sizes[:low] do not
        while low < high:
            middle = (low + high) // 2
            if not self._below_floor(precision, sizes[middle], room):
                high = middle
            else:
                low = middle + 1
        return sizes[low:]

    # --- cached builds -------------------------------------------------------------------------
    def _build(self, density: float, precision: str, microbatch: int | None) -> Trainer:
        size = "null" if microbatch is None else microbatch
        knobs = [f"sparsity.density={density}", f"precision={precision}", f"microbatch.size={size}"]
        return self.build(compose_config(*self.base, *knobs, "checkpointing.strategy=none"))

    def state_bytes(self, density: float, precision: str, bits: int | None = None) -> StateBytes:
        """Model and optimizer bytes at ``density``, ``precision`` and optim.state_bits ``bits``
        (None: the precision's width); microbatching changes neither.

        Accounted on the precision's trainer without drawing masks: DSR keeps round(density ·
        numel) weights of every sparsifiable tensor (``lowmem.techniques.sparsity``), counted as
        CSR like ``DynamicSparsity.trained_parameters()`` has them (``tests/test_planning.py`` pins
        the equality with built sparse trainers); building one per density would cost ~1 s each.
        8- and 4-bit state is counted without building its optimizer (``account_state``'s what-if).
        """
        key = (density, precision, bits)
        if key not in self._states:
            trainer = self._trainer_for(precision, None)
            model = trainer.unwrapped_model
            sparse = self._sparse_weights(trainer, density)
            block = self.cfg.optim.state_block_size
            self._states[key] = account_state(
                model, trainer.optimizer, sparse, state_bits=bits, state_block_size=block, shards=self.world_size
            )
        return self._states[key]

    def temporary_bytes(self, density: float, precision: str, microbatch: int | None, sync: str | None = None) -> int:
        """The step's temporaries beyond the accounting and its passes at ``density`` and
        ``microbatch`` (``lowmem.profiler.step_temporaries``, weights as ``state_bytes`` counts them;
        the data the step reads), with ``plan.world_size`` above 1 the weights gathered and their
        gradients under gradient ``sync`` (None: ``microbatch``, the least memory). What the passes
        hold beyond the activations comes with each accounting (``Accounted.beyond_bytes``)."""
        key = (density, precision, microbatch, sync)
        if key not in self._temporaries:
            trainer = self._trainer_for(precision, None)
            model = trainer.unwrapped_model
            sparse = self._sparse_weights(trainer, density)
            batch = self.cfg.data.batch_size // self.world_size
            microbatches = 1 if microbatch is None else -(-batch // microbatch)
            data = data_bytes(data_tensors(trainer, trainer.example_batch()))
            self._temporaries[key] = step_temporaries(model, sparse).total + dense_weight_bytes(model, sparse) + data
            self._temporaries[key] += self.gathered_bytes(density, precision, sync if microbatches > 1 else None)
        return self._temporaries[key]

    def gathered_bytes(self, density: float, precision: str, sync: str | None = None) -> int:
        """``plan.world_size`` above 1: the weights FSDP2 gathers at once at most
        (``lowmem.sharding.planned_gathered_bytes``) and the gradients held before a reduce-scatter:
        theirs, or with gradient ``sync`` ``minibatch`` (microbatches accumulated before one
        reduce-scatter) every gradient whole, as ``lowmem.profile`` counts them; else 0."""
        if self.world_size == 1:
            return 0
        trainer = self._trainer_for(precision, None)
        sparse, policy = self._sparse_weights(trainer, density), trainer.policy
        model = trainer.unwrapped_model
        gathered = planned_gathered_bytes(
            model, sparse, param_dtype=policy.param_dtype, autocast_dtype=policy.autocast_dtype
        )
        if sync != "minibatch":
            return 2 * gathered
        return gathered + account_state(model, trainer.optimizer, sparse).model_bytes

    def _sparse_weights(self, trainer: Trainer, density: float) -> dict | None:
        """The sparse weights at ``density`` (name -> dense shape, active count), as DSR keeps them."""
        model = trainer.unwrapped_model
        if trainer.sparsity is not None:  # sparsity.density was fixed: that trainer's own masks
            return trainer.sparsity.trained_parameters()
        if density < 1.0:
            params = dict(model.named_parameters())
            names = trainer.recipe.sparsifiable_weights(model)
            return {name: (params[name].shape, round(density * params[name].numel())) for name in names}
        return None

    def _trainer_for(self, precision: str, microbatch: int | None) -> Trainer | None:
        """The trainer whose activations stand for every density at (precision, microbatch); None
        when the recipe cannot cut the first minibatch into such microbatches."""
        key = (precision, microbatch)
        if key not in self._trainers:
            # Activations do not depend on density: the first searched one stands for all (dense,
            # unless sparsity.density was fixed).
            base = self._trainers.get((precision, None))
            if microbatch in self._valid.get(precision, ()) and getattr(base, "microbatch_mode", None) == "true":
                # A size the recipe is known to accept: the precision's model, cut into other
                # microbatches (true microbatching changes nothing else of a built trainer).
                trainer = copy.copy(base)
                trainer.microbatch_size = microbatch
            else:
                try:
                    trainer = self._build(self.densities[0], precision, microbatch)
                    trainer.microbatches(trainer.example_batch())
                except Exception:  # noqa: BLE001 - any refusal of a microbatch size skips that size
                    if microbatch is None:  # the command line's own configuration fails: the user's error
                        raise
                    trainer = None  # only the microbatch size differs: token microbatches too small for a pair
            if trainer is not None and self.offload_allowed and offload_of(trainer.unwrapped_model) is None:
                # Hooks that offload only where a schedule says (installed first, as the trainer does).
                install_offload(trainer.unwrapped_model, trainer.device)
            if trainer is not None and any(self.compressions) and compression_of(trainer.unwrapped_model) is None:
                # Hooks without a width of their own: no figure changes until a schedule sets one.
                apply_compression(trainer.unwrapped_model, None, seed=self.cfg.trainer.seed)
            self._trainers[key] = trainer
        return self._trainers[key]

    def _below_floor(self, precision: str, microbatch: int | None, room: int) -> bool:
        """``CheckpointPlacement.below_floor`` at (precision, microbatch), the loss chunked where it can
        be (the least memory); False where the pass it takes is refused (no bound known: the
        strategies are accounted one by one)."""
        chunk = self._least_chunk(precision, microbatch)
        below = self._with_placement(precision, microbatch, None, lambda placement: placement.below_floor(room), chunk)
        return bool(below)

    def _with_placement(
        self, precision: str, microbatch: int | None, compress: int | None, ask: Callable[[CheckpointPlacement], T],
        chunk: str | None = None,
    ) -> T | None:  # fmt: skip
        """``ask(placement)`` of optimal at (precision, microbatch, compress), the loss chunked as
        ``chunk`` says; None where optimal is not searched, or is refused there: whatever its
        measurement raises (a block it cannot measure, a step fake and real passes cannot run)
        refuses optimal at that configuration, never the plan."""
        key = (precision, microbatch, "optimal", compress, chunk)
        if not self._optimal_allowed or key in self._refused:
            return None
        try:
            placement = self._placement(precision, microbatch, compress, chunk)
            self._chunked(precision, microbatch, chunk)
            return ask(placement)
        except Exception as error:  # noqa: BLE001 - whatever stops it, the configuration is refused, not chosen
            if ahead.in_child():
                raise
            self._refused[key] = named_first_line(error)
            return None

    def refusals(self) -> list[str]:
        """Why configurations were refused during the search, one line per distinct reason (the
        strategies a model's blocks do not support, refused silently, left out)."""
        lines: dict[tuple[str, str], None] = {}
        for (_, _, strategy, every, chunk), why in self._refused.items():
            if why:
                label = strategy if strategy == "optimal" or every is None else f"{strategy} every {every}"
                if chunk is not None:
                    label += f" with loss.chunk_tokens={chunk}"
                lines[(label, why)] = None
        return [f"checkpointing.strategy={label}: {why}" for label, why in lines]

    def _placement(
        self, precision: str, microbatch: int | None, compress: int | None = None, chunk: str | None = None
    ) -> CheckpointPlacement:
        """The placement at (precision, microbatch) with compression down to ``compress``, and offloading
        where the command line allows it, for the loss chunked as ``chunk`` says (its passes outside
        the blocks differ: the logits)."""
        key = (precision, microbatch, compress, chunk)
        if key not in self._placements:
            trainer = self._trainer_for(precision, microbatch)
            link = link_price(trainer) if self.offload_allowed else None
            self._placements[key] = CheckpointPlacement(trainer, allowed_widths(compress), link)
        return self._placements[key]

    def _accounting(self, precision: str, microbatch: int | None) -> MinibatchAccounting:
        key = (precision, microbatch)
        if key not in self._accountings:
            self._accountings[key] = MinibatchAccounting(self._trainer_for(precision, microbatch))
        return self._accountings[key]


def install_offload(model: torch.nn.Module, device: torch.device) -> None:
    """Offload hooks on a searched trainer's ``model`` that offload only where a schedule says."""
    apply_offload(model, device=device, everywhere=False)


def link_price(trainer: Trainer) -> float:
    """The host link's price for ``trainer``'s device and compute dtype, in FLOPs per byte."""
    policy = trainer.policy
    return link_flops_per_byte(trainer.device, policy.autocast_dtype or policy.param_dtype)


def _within(placement: CheckpointPlacement, room: int, density: float) -> tuple[AccountedSchedule, int] | None:
    """Optimal's cheapest schedule whose activations, with what its passes hold beyond them at
    ``density`` (``beyond_bytes_at``), fit ``room`` bytes, and the activation budget it was planned
    for; None when none fits.

    Its schedules fill their activation budget to the byte, and a built configuration's check adds
    what the step holds beyond the activations, which grows as a schedule recomputes more: the
    budget starts at the room less the step's largest op (every schedule holds it) and is lowered by
    what the schedule found there held beyond the room (``TEMPORARY_STEPS`` times at most); where
    that still does not fit, the largest budget that does is bisected for between the smallest
    schedule's activations and the last budget tried (``TEMPORARY_BISECTIONS`` times)."""
    budget = room - placement.largest_op()
    if not placement.reaches(budget):
        budget = None
    over = None  # the lowest activation budget tried whose schedule held more than the room
    for _ in range(TEMPORARY_STEPS if budget is not None else 0):
        accounted = placement.cheapest(budget)
        excess = accounted.activation_bytes + accounted.beyond_bytes_at(density) - room
        if excess <= 0:
            return accounted, budget
        over, budget = budget, budget - excess
        if not placement.reaches(budget):
            break
    smallest = placement.smallest()
    if smallest.activation_bytes + smallest.beyond_bytes_at(density) > room:
        return None
    best, low = (smallest, smallest.activation_bytes), smallest.activation_bytes
    high = over if over is not None else low
    for _ in range(TEMPORARY_BISECTIONS):
        if high - low <= 1:
            break
        middle = (low + high) // 2
        accounted = placement.cheapest(middle)
        if accounted.activation_bytes + accounted.beyond_bytes_at(density) <= room:
            best, low = (accounted, middle), middle
        else:
            high = middle
    return best


def _same_figures(candidate: Candidate, other: Candidate) -> bool:
    """Whether two configurations differing in the chunk setting alone account alike (auto does not
    chunk logits below its size): the first is then listed alone."""
    figures = ("strategy", "every", "activation_bytes", "flops", "temporary_bytes", "microbatch", "precision")
    return candidate.chunk != other.chunk and all(getattr(candidate, f) == getattr(other, f) for f in figures)


def _quantization(bits: int | None) -> int:
    """Rank of optim.state_bits in the preference: the precision's own width, then 8, then 4."""
    return 0 if bits is None else QUANTIZED_STATE_BITS.index(bits) + 1


def _quiet_builds() -> contextlib.AbstractContextManager:
    """The search builds dozens of trainers: their start-up lines are not the user's news."""
    return quieted(logging.getLogger("lowmem"), logging.WARNING)
