"""The trainer: the one place where the four techniques meet.

``build_trainer`` applies them in a fixed order (see the comments there for why that order);
``Trainer.train_step`` runs one minibatch — microbatches, loss scaling, gradient masking, the
optimizer step and rewiring, in that order; ``Trainer.fit`` loops, evaluates, logs and saves.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import math
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils._pytree import tree_leaves

from lowmem import distributed, kernels, sharding
from lowmem.config import ConfigError, microbatch_mode, name_list, state_width, validate
from lowmem.libraries import configure_libraries
from lowmem.metrics_log import MetricsLog, Progress
from lowmem.planning.optimal import apply_optimal_checkpointing
from lowmem.profiler import profile_trainer, track_peak
from lowmem.profiler.peak import measure_peak
from lowmem.profiler.report import MemoryReport
from lowmem.profiler.step import data_tensors
from lowmem.recipe import Recipe, RecipeData, TechniqueDefaults, get_recipe
from lowmem.run.files import (
    CHECKPOINT,
    METRICS,
    MODEL,
    RESULT,
    WriteFailed,
    copy_file,
    disk_error,
    provenance,
    read_checkpoint,
    save_bytes,
    save_json,
    save_torch,
)
from lowmem.run.refusals import RunRefused
from lowmem.schedules import learning_rate
from lowmem.signals import Interrupted, StopOnSignal
from lowmem.techniques.checkpointing import apply_checkpointing
from lowmem.techniques.compact import compact_state_dict_keys, dense_copy, dense_state_dict
from lowmem.techniques.compilation import CompileRecord, apply_compile, compile_record, graphs_compiled
from lowmem.techniques.compression import allowed_widths, apply_compression, compression_of, validate_compress
from lowmem.techniques.convolutions import tune_convolutions
from lowmem.techniques.cpu_compute import choices as cpu_compute_choices
from lowmem.techniques.cpu_compute import context_for, summary
from lowmem.techniques.head_loss import install as install_head_loss
from lowmem.techniques.head_loss import validate_chunk_tokens
from lowmem.techniques.microbatch import apply_simulated_microbatching, no_sync_except_last
from lowmem.techniques.offload import apply_offload, link_flops_per_byte, offload_of
from lowmem.techniques.optimizers import LowPrecisionAdam, LowPrecisionSGD
from lowmem.techniques.precision import (
    NONFINITE_AT_END,
    NONFINITE_LIMIT,
    PrecisionPolicy,
    TrainingDiverged,
    autocast_context,
    convert_model,
    has_nonfinite_grad,
    make_loss_scaler,
    make_policy,
)
from lowmem.techniques.replay import EagerMicrobatches, ReplayedMicrobatches, make_microbatch_runner
from lowmem.techniques.sparsity import DynamicSparsity
from lowmem.techniques.targets import default_sparse_weights

log = logging.getLogger("lowmem")
SNAPSHOTS = "snapshots"  # dense model states after the last evaluations (recipes with ``average_last``)


def resolve_device(name: str) -> torch.device:
    """``trainer.device``: auto picks CUDA when present."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={name!r}: no CUDA device is available here; use cpu or auto")
    return device


@dataclass
class TrainState:
    """Counters that, with the model, optimizer and technique states, define where training is."""

    step: int = 0  # minibatches processed (applied or skipped)
    updates: int = 0  # optimizer steps applied
    skipped: int = 0  # steps skipped for FP16 overflow
    epoch: int = 0  # current epoch
    batch_in_epoch: int = 0  # minibatches of `epoch` already done
    best_metric: float | None = None  # best of the recipe's primary metric over evaluations
    final_metric: float | None = None
    train_seconds: float = 0.0
    history: list[dict] = field(default_factory=list)  # per-epoch evaluation records


class Trainer:
    def __init__(
        self,
        cfg: DictConfig,
        recipe: Recipe,
        model: nn.Module,
        data: RecipeData | None,
        policy: PrecisionPolicy,
        sparsity: DynamicSparsity | None,
        defaults: TechniqueDefaults,
        device: torch.device,
    ) -> None:
        self.config, self.recipe, self.device, self.policy = cfg, recipe, device, policy
        self.model = model  # possibly DistributedDataParallel-wrapped, or sharded by FSDP2 in place
        self.sharded = sharding.is_sharded(model)  # trainer.parallel=fsdp
        # Sharded: the accounting of one rank's step made before sharding (activations and FLOPs of
        # this rank's share; apply_techniques sets it), to which the profiler adds what it holds.
        self.unsharded_report: MemoryReport | None = None
        self.sharded_report = self._sharded_report if self.sharded else None
        self.running_statistics = sharding.RunningStatistics(self.unwrapped_model) if self.sharded else None
        self.data = data
        self.sparsity = sparsity
        self.lr_mult = cfg.optim.lr_mult if cfg.optim.lr_mult is not None else defaults.lr_mult
        self.base_lr = cfg.optim.lr * self.lr_mult
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = _build_optimizer(cfg.optim, self.params, self.base_lr, policy)
        self.scaler = make_loss_scaler(policy, optimizer=self.optimizer, device=device)
        self.microbatch_size = cfg.microbatch.size
        self.microbatch_mode = microbatch_mode(cfg)
        # Each microbatch's forward and backward: eagerly, or (trainer.cuda_graphs=auto, CUDA, one
        # process) captured once per repeating shape and replayed. Autocast on the device the
        # model's parameters are on: the training device, or the CPU for the profiler's fake pass
        # (lowmem.profiler.activations swaps them for CPU stand-ins).
        self.eager_microbatches = EagerMicrobatches(
            recipe.loss,
            self.scaler,
            lambda part: autocast_context(policy, model_device(self.unwrapped_model, device)),
        )
        # Compressed or offloaded saved activations draw their random bits per step (and offloading
        # synchronises streams) outside what a captured graph can replay: those runs stay eager.
        self.compression = compression_of(self.unwrapped_model)
        self.offload = offload_of(self.unwrapped_model)
        # Compiled runs stay eager too: captures of compiled code are not measured yet (no GPU here).
        eager_only = self.compression is not None or self.offload is not None or cfg.trainer.compile
        self.microbatch_runner = make_microbatch_runner(
            "off" if eager_only else cfg.trainer.cuda_graphs,
            self.eager_microbatches,
            self.unwrapped_model,
            device,
            data_parallel=distributed.world_size() > 1 or self.sharded,
        )
        tune_convolutions(self.unwrapped_model, device, cfg.trainer.workspaces)  # CUDA: cuDNN timing
        # Where 16-bit convolutions and matrix products are computed on a CPU, decided once (auto:
        # probed); a resumed run takes its checkpoint's choices, so that it computes the same bits.
        # Ranks take rank 0's: each probes its own CPU, and where native and FP32 kernels are about as
        # fast (BF16 on AVX-512) a loaded core can tip one rank's probe the other way.
        self.cpu_compute = distributed.rank0s(cpu_compute_choices(policy.cpu_compute, policy.sixteen_bit, device))
        # trainer.compile: what the model's calls compiled (graph breaks, compile time), else None.
        self.compiled = compile_record(self.unwrapped_model)
        self.state = TrainState()
        self.nonfinite_in_row, self.nonfinite_warned = 0, False  # trainer.stop_on_nonfinite
        self.nonfinite_loss = math.nan  # the last skipped step's loss
        # The normalization layers' running statistics, and a copy made before each step: a skipped
        # step (non-finite) must not leave its forward's statistics behind either.
        self.running_buffers = [
            b for m in self.unwrapped_model.modules() if isinstance(m, nn.modules.batchnorm._NormBase)
            for b in (m.running_mean, m.running_var) if b is not None
        ]
        self.running_before: list[torch.Tensor] | None = None

    @property
    def unwrapped_model(self) -> nn.Module:
        return getattr(self.model, "module", self.model)

    @property
    def replays_microbatches(self) -> bool:
        """Whether repeating microbatch shapes are captured and replayed (``trainer.cuda_graphs=auto``
        on CUDA): their activations then stay reserved in the graphs' memory pool for the run, and
        the accounting counts eager microbatches on top of it (``MemoryReport.graph_pool_bytes``)."""
        runner = self.microbatch_runner
        return isinstance(runner, ReplayedMicrobatches) and runner.disabled is None

    # --- one minibatch -------------------------------------------------------------------------
    def microbatches(self, batch: Any) -> list[tuple[Any, float]]:
        """The parts of ``batch`` this rank runs forward and backward, each with its loss weight."""
        # 0. Data parallel: this rank's share of the global minibatch. DDP averages gradients over
        #    ranks, so a share's loss is weighted by (its units / global units) x ranks: the result is
        #    the global mean even when shares differ in size (tokens).
        rank_weight = 1.0
        if distributed.world_size() > 1:
            shard = self.recipe.shard(batch, distributed.rank(), distributed.world_size())
            rank_weight = self.recipe.batch_size(shard) * distributed.world_size() / self.recipe.batch_size(batch)
            batch = shard
        # 1. True microbatching: sequential microbatches, each loss weighted by its share of the
        #    minibatch so the accumulated gradient is the minibatch mean (a short last one is exact).
        if self.microbatch_size is not None and self.microbatch_mode == "true":
            parts = self.recipe.split(batch, self.microbatch_size)
        else:
            parts = [(batch, 1.0)]
        parts = [(part, weight * rank_weight) for part, weight in parts]
        # 2. Sharded (fsdp): FSDP2 gathers and reduce-scatters once per microbatch on every rank, so
        #    the ranks must run as many: a rank its token budget cuts into fewer microbatches than
        #    another's would wait in a collective the other never joins. It runs the difference as
        #    copies of its smallest microbatch weighted 0: every gradient gets exact zeros added.
        if self.sharded and distributed.world_size() > 1:
            most = distributed.most_over_ranks(len(parts), self.device)
            smallest = min(parts, key=lambda item: self.recipe.batch_size(item[0]))[0]
            parts += [(smallest, 0.0)] * (most - len(parts))
        return parts

    def _first_microbatch(self, count: int) -> int:
        """The index this rank's first microbatch of a step draws compression's random bits for:
        0 in one process; under data parallelism rank r starts at r x the most microbatches any rank
        runs, so ranks never draw the same bits, and where shares split into equally many
        microbatches (examples) each draws the bits of the same microbatch in one process (rank r's
        share is the r-th slice of the minibatch). Without compression: 0, no collective."""
        if self.compression is None or distributed.world_size() == 1:
            return 0
        return distributed.rank() * distributed.most_over_ranks(count, self.device)

    def microbatch_backward(
        self, part: Any, weight: float, index: int = 0, count: int = 1, *, local: bool = False
    ) -> torch.Tensor:
        """Forward and backward of one microbatch; returns its (unweighted, detached) mean loss.

        Under data parallelism the gradient all-reduce waits for the last of ``count`` microbatches;
        ``local=True`` bypasses the data-parallel wrapper and graph replay (no collective, every
        operation dispatched: what one rank alone does, as the profiler needs, on fake tensors too).
        """
        model = self.unwrapped_model if local else self.model
        # 2. Forward, loss scaling (FP16: gradients stay scaled; the optimizer unscales them in FP32)
        #    and backward, accumulating into the gradients.
        runner = self.eager_microbatches if local else self.microbatch_runner
        if self.sharded and not local and self.config.trainer.gradient_sync == "minibatch":
            sharding.set_gradient_sync(model, index == count - 1)
        watch = self.compiled.watch() if self.compiled is not None and not local else contextlib.nullcontext()
        with no_sync_except_last(model, index, count), watch:
            return runner.forward_backward(model, part, weight)

    def warm_up_compiled(self, batch: Any) -> None:
        """Compile what ``batch``'s step compiles without training on it: forward and backward of each
        of its distinct microbatch shapes, then the gradients, the running statistics and the RNG as
        they were (a measured step then measures the step, not the compiler). Nothing without
        ``trainer.compile``; a pass over them when compiled."""
        if self.compiled is None:
            return
        grads = [p.grad for p in self.params]
        running = [b.clone() for b in self.running_buffers]
        parts = {}
        for part, weight in self.microbatches(batch):
            parts.setdefault(tuple(tuple(t.shape) for t in tree_leaves(part) if isinstance(t, torch.Tensor)),
                             (part, weight))
        # Two passes, then until one compiles nothing (4 at most): checkpointed blocks run eagerly
        # (watched) on a shape's first call and compiled from its second.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), self.arithmetic():
            for done in range(4):
                before = graphs_compiled()
                for part, weight in parts.values():
                    self.model.train()
                    with self.compiled.watch():
                        self.eager_microbatches.forward_backward(self.unwrapped_model, part, weight)
                if done >= 1 and graphs_compiled() == before:
                    break
        for param, grad in zip(self.params, grads, strict=True):
            param.grad = grad
        if running:
            torch._foreach_copy_(self.running_buffers, running)

    def account_memory(self) -> dict[str, int]:
        """Accounted bytes (model, optimizer, activations, total) and FLOPs of one minibatch."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            report = profile_trainer(self, measure=False).to_json()
        keys = ("model_bytes", "optimizer_bytes", "optimizer_state_bytes", "activation_bytes", "total_bytes", "flops")
        return {key: report[key] for key in keys}

    def _sharded_report(self, measure: bool, batch: Any) -> MemoryReport:
        """``profile_trainer`` of a sharded trainer: this rank's shards, the gathered weights, and
        (``measure``) the measured peak of one real sharded step over ``batch``."""
        gathered_dtype = self.policy.autocast_dtype  # amp: FSDP2 gathers the FP32 shards in it
        shards = sharding.account_shards(self.unwrapped_model, self.optimizer, self.sparsity, gathered_dtype)
        peak = None
        if measure:
            owners, data = (self, batch), data_tensors(self, batch)
            peak = measure_peak(
                lambda: self.train_step(batch), self.unwrapped_model, self.optimizer, data=data, owners=owners,
                arithmetic=self.arithmetic(),
            )  # fmt: skip
        return sharding.per_rank_report(self.unsharded_report, shards, peak, self.config.trainer.gradient_sync)

    def example_batch(self) -> Any:
        """The first training minibatch (what the profiler measures)."""
        return next(iter(self.data.train.epoch(0)))

    def arithmetic(self) -> contextlib.AbstractContextManager:
        """Where this run's 16-bit convolutions and matrix products are computed on a CPU: natively
        or in FP32 (``precision.cpu_compute``, ``lowmem.techniques.cpu_compute``). The FP32 copies
        are made inside the ops' kernels: scratch that the measured CPU peaks do not see, as they do
        not see native kernels'. Inside an enclosing one it does nothing."""
        return context_for(self.cpu_compute)

    def compile_summary(self) -> dict[str, Any]:
        """``trainer.compile`` and what compiling the model gave (profile JSON, result.json)."""
        if self.compiled is None:
            return {"compile": False, **CompileRecord.not_compiled()}
        return {"compile": True, **self.compiled.to_json()}

    def cpu_compute_record(self) -> dict[str, Any]:
        """``precision.cpu_compute`` and what it chose per kind of op (result.json, profile JSON)."""
        return {"setting": self.policy.cpu_compute, **self.cpu_compute}

    def train_step(self, batch: Any) -> dict[str, Any]:
        """Forward/backward over all microbatches of ``batch``, then one (possibly skipped) update."""
        with self.arithmetic():
            return self._train_step(batch)

    def _train_step(self, batch: Any) -> dict[str, Any]:
        self.model.train()
        # Gradients start at None, or at zero in place when microbatches are replayed (captures
        # accumulate into those very tensors; the optimizer consumes them in place).
        self.microbatch_runner.start_step(self.params)
        parts = self.microbatches(batch)
        loss_total = torch.zeros((), device=self.device, dtype=torch.float32)
        if self.running_buffers:
            if self.running_before is None:
                self.running_before = [torch.empty_like(b) for b in self.running_buffers]
            torch._foreach_copy_(self.running_before, self.running_buffers)
        if self.running_statistics is not None:
            self.running_statistics.before_step()
        first = self._first_microbatch(len(parts))
        for index, (part, weight) in enumerate(parts):
            if self.compression is not None:  # the random bits of this microbatch (a resume draws the same)
                self.compression.start_microbatch(self.state.step, first + index)
            loss_total += self.microbatch_backward(part, weight, index, len(parts)).float() * weight
        if self.running_statistics is not None:  # sharded: BatchNorm statistics as one process's
            self.running_statistics.after_step()
            sharding.average_replicated_gradients(self.unwrapped_model)
        # 3. Sparsity: zero gradients at inactive positions (torch.where, so a NaN/inf there
        #    cannot trigger an overflow skip) before the overflow check.
        if self.sparsity is not None:
            self.sparsity.mask_gradients()
        # 4. Overflow check; under data parallelism an overflow on any rank skips the step everywhere.
        #    FP16's loss scaler checks the gradients; in every other precision a non-finite loss or
        #    gradient skips the step too (trainer.stop_on_nonfinite), as FP16's would be skipped.
        loss = float(loss_total)
        overflow = self.scaler.found_overflow(self.params)
        if self.config.trainer.stop_on_nonfinite:
            if not self.scaler.enabled:
                overflow = not math.isfinite(loss) or has_nonfinite_grad(self.params)
            # Running statistics gone non-finite (a finite loss from overflowing activations) too.
            overflow = overflow or (bool(self.running_buffers) and not _all_finite(self.running_buffers))
        overflow = distributed.any_rank(overflow, self.device)
        record: dict[str, Any] = {"loss": loss, "loss_scale": self.scaler.loss_scale}
        epoch_position = self.state.epoch + self.state.batch_in_epoch / len(self.data.train)
        if overflow:
            self.state.skipped += 1
            if self.running_buffers:  # the statistics as they were before the step
                torch._foreach_copy_(self.running_buffers, self.running_before)
            self._nonfinite_step(loss)
        else:
            self.nonfinite_in_row = 0
            lr = learning_rate(self.config.optim, self.base_lr, self.state.updates, self.state.epoch)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            # 5. The update, computed per tensor in FP32 and written back in the parameter's dtype.
            self.optimizer.step(grad_scale=self.scaler.scale)
            self.state.updates += 1
            record["lr"] = lr
            # 6. Rewiring counts applied updates only (never microbatches, never skipped steps).
            if self.sparsity is not None:
                rewiring = self.sparsity.after_optimizer_step(self.optimizer, epoch_position)
                if rewiring is not None:
                    record["rewiring"] = rewiring
                    distributed.check_identical(self.sparsity.mask_checksum(), "sparsity masks", self.device)
                    if self.sparsity.compact is not None:
                        # Compact weights changed size: the data-parallel wrapper's buckets are rebuilt.
                        self.model = distributed.rewrap_model(self.model)
        try:
            self.scaler.update(overflow)
        except FloatingPointError:  # FP16 overflowing at the scaler's minimum scale
            if self.config.trainer.stop_on_nonfinite:
                raise self._diverged(loss, f"gradients overflow FP16 even at the minimum loss scale "
                                           f"{self.scaler.min_scale:g}") from None
        record["skipped"] = bool(overflow)
        return record

    def _nonfinite_step(self, loss: float) -> None:
        """A skipped step: warned of once; too many in a row stop the run (trainer.stop_on_nonfinite)."""
        if self.policy.name == "fp16" and self.scaler.loss_scale > 1:
            self.nonfinite_in_row = 0  # FP16 overflowing with an amplified loss: the scaler's business
            return
        self.nonfinite_in_row += 1
        self.nonfinite_loss = loss
        if not self.config.trainer.stop_on_nonfinite:
            return
        if not self.nonfinite_warned and distributed.is_rank0():
            log.warning(
                "step %d: loss %.4g or its gradients are not finite: the step is skipped; %d in a row stop the run "
                "(trainer.stop_on_nonfinite)",
                self.state.step + 1, loss, NONFINITE_LIMIT,
            )
            self.nonfinite_warned = True
        # FP16 counts overflows at a loss scale of 1 or less (its scaler also stops at its minimum
        # scale, in update); amp's GradScaler gets as many halvings as FP16's range spans.
        limit = AMP_OVERFLOW_LIMIT if self.policy.name == "amp" and self.scaler.enabled else NONFINITE_LIMIT
        if limit is not None and self.nonfinite_in_row >= limit:
            raise self._diverged(loss, f"{self.nonfinite_in_row} steps in a row with a non-finite loss or gradients")

    def _diverged(self, loss: float, what: str, at: str | None = None) -> TrainingDiverged:
        return TrainingDiverged(
            f"training diverged at {at or f'step {self.state.step + 1}'}: {what} (loss {loss:.4g}); nothing of it "
            "was applied. "
            f"Look at optim.lr (now {self.base_lr:g}) and precision ({self.policy.name}); "
            "trainer.stop_on_nonfinite=false trains on regardless"
        )

    # --- the loop ------------------------------------------------------------------------------
    def fit(self, run_dir: Path) -> dict[str, Any]:
        cfg, state = self.config, self.state
        rank0 = distributed.is_rank0()
        # The report's accounting of this configuration (fake tensors: no compute, no RNG drawn),
        # kept with the result so that tables need no second profiling pass.
        accounting = self.account_memory() if rank0 else None
        metrics = MetricsLog(run_dir, cfg.logger, OmegaConf.to_container(cfg, resolve=True), enabled=rank0)
        progress = Progress(cfg.trainer.progress, cfg.trainer.log_every, enabled=rank0)
        max_steps = cfg.trainer.max_steps
        recorded = [r["peak_bytes"] for r in state.history if r.get("peak_bytes") is not None]
        peak = PeakTracker(self, previous=max(recorded, default=None))
        train = self.data.train
        # SIGINT / SIGTERM: the loop stops after the step it is in, with a checkpoint at that step.
        stop = StopOnSignal().install()
        try:
            while state.epoch < cfg.trainer.epochs and not _done(state, max_steps):
                progress.start_epoch(state.epoch, len(train), state.batch_in_epoch)
                started = time.perf_counter()
                for batch in train.epoch(state.epoch, state.batch_in_epoch):
                    with peak.track("step", batch):
                        record = self.train_step(batch)
                    state.step += 1
                    state.batch_in_epoch += 1
                    if "rewiring" in record:
                        metrics.log({"step": state.step, "epoch": state.epoch, "rewiring": record.pop("rewiring")})
                    if state.step % cfg.trainer.log_every == 0 or state.step == max_steps:
                        metrics.log({"step": state.step, "epoch": state.epoch, **record})
                    progress.step(state.step, {"loss": record["loss"], "lr": record.get("lr", 0.0)})
                    if _done(state, max_steps):
                        break
                    signum = stop.requested(self.device)
                    if signum is not None:
                        state.train_seconds += time.perf_counter() - started
                        progress.end_epoch(f"epoch {state.epoch}: stopped at step {state.step}")
                        self._save_checkpoint(run_dir, metrics)
                        raise Interrupted(signum, state.step, run_dir / CHECKPOINT)
                state.train_seconds += time.perf_counter() - started
                epoch_finished = state.batch_in_epoch >= len(train)
                with peak.track("evaluation"):
                    evaluation = self.evaluate()
                metric = evaluation[self.recipe.primary_metric]
                if cfg.trainer.stop_on_nonfinite and not math.isfinite(metric):  # before any checkpoint of it
                    raise self._diverged(float(record["loss"]) if "loss" in record else math.nan,
                                         f"the evaluation's {self.recipe.primary_metric} is {metric}")
                state.best_metric = metric if state.best_metric is None else self._better(state.best_metric, metric)
                state.final_metric = metric
                record = {
                    "epoch": state.epoch,
                    "step": state.step,
                    "updates": state.updates,
                    "skipped": state.skipped,
                    "train_seconds": round(state.train_seconds, 3),
                    "peak_bytes": peak.peak_bytes,
                    **evaluation,
                }
                state.history.append(record)
                metrics.log(record)
                progress.end_epoch(
                    f"epoch {state.epoch}: "
                    + " ".join(f"{k}={v:.4g}" for k, v in evaluation.items())
                    + f" ({state.train_seconds:.1f}s)"
                )
                if epoch_finished:
                    state.epoch += 1
                    state.batch_in_epoch = 0
                # The snapshot before the checkpoint, old snapshots dropped after it: a run killed
                # in between resumes with every snapshot its checkpoint counts on. (Sharded: every
                # rank gathers its shards; rank 0 writes.)
                self._save_snapshot(run_dir)
                self._save_checkpoint(run_dir, metrics)
                if rank0:
                    self._drop_old_snapshots(run_dir)
                signum = stop.requested(self.device)
                if signum is not None:
                    raise Interrupted(signum, state.step, run_dir / CHECKPOINT)
            # (Stopped before the final scoring: the checkpoint is at the last step; resuming scores.)
            signum = stop.requested(self.device)
            if signum is not None:
                raise Interrupted(signum, state.step, run_dir / CHECKPOINT)
            # (amp's GradScaler overflows in a row as it calibrates, its loss finite: its business.)
            scaled = self.policy.name == "amp" and self.scaler.enabled and math.isfinite(self.nonfinite_loss)
            if cfg.trainer.stop_on_nonfinite and self.nonfinite_in_row >= NONFINITE_AT_END and not scaled:
                # The end reached in a streak of skipped steps: not "done" (the checkpoints hold the
                # last good weights; a run resumed from one with other knobs trains on).
                raise self._diverged(
                    self.nonfinite_loss,
                    f"its last {self.nonfinite_in_row} steps had a non-finite loss or gradients",
                    at=f"the end of the run (step {state.step})",
                )
            # The peak is read before the final scoring below (averaged snapshots on a dense copy).
            result = self.result(peak.peak_bytes)
            result["peak_scope"] = peak.scope
            result["memory"] = accounting
            # Recipes whose final score needs more than the per-epoch evaluation (BLEU of averaged
            # snapshots, for translation) compute it here.
            final_evaluation = getattr(self.recipe, "final_evaluation", None)
            # Sharded: rank 0 scores a plain model built again from the gathered weights.
            gathered = self.dense_state() if final_evaluation is not None and self.sharded else None
            if final_evaluation is not None and rank0:
                self.model.eval()
                with self.arithmetic(), autocast_context(self.policy, self.device):
                    # A dense copy: the snapshots are plain dense state dicts, averaged across masks.
                    dense_model = dense_copy(self.unwrapped_model) if gathered is None else self._rebuilt(gathered)
                    keep = getattr(self.recipe, "average_last", 0)
                    snapshots = self._snapshots(run_dir)[-keep:] if keep > 0 else []
                    scores = final_evaluation(dense_model, self.data.test, snapshots)
                result.update(scores)
                metrics.log({"step": state.step, "final": scores})
            model_state = self.dense_state() if rank0 or self.sharded else None
            if rank0:
                save_torch(model_state, run_dir / MODEL)
                save_json(result, run_dir / RESULT)
        finally:
            metrics.close()
            stop.restore()
        return result

    def _better(self, a: float, b: float) -> float:
        return max(a, b) if getattr(self.recipe, "higher_is_better", True) else min(a, b)

    def _snapshots(self, run_dir: Path) -> list[Path]:
        return sorted((run_dir / SNAPSHOTS).glob("step_*.pt"))

    def _save_snapshot(self, run_dir: Path) -> None:
        """Keep the model after each of the last ``recipe.average_last`` evaluations (translation
        averages them for its final score; ``_drop_old_snapshots`` removes the older ones). Rank 0
        writes it; a write the disk refuses stops every rank (``_save_checkpoint``)."""
        if getattr(self.recipe, "average_last", 0) <= 0:
            return
        failure = None
        if self.sharded or distributed.is_rank0():
            state = self.dense_state()
            if distributed.is_rank0():
                try:
                    save_torch(state, run_dir / SNAPSHOTS / f"step_{self.state.step:09d}.pt")
                except WriteFailed as error:
                    failure = error
        _refuse_together(failure)

    def _rebuilt(self, state: dict[str, torch.Tensor]) -> nn.Module:
        """The recipe's model, plain (no technique), in this run's precision, holding ``state``."""
        model = self.recipe.build_model(self.config).to(self.device)
        convert_model(model, self.policy)
        model.load_state_dict(state)
        return model.eval()

    def dense_state(self) -> dict[str, torch.Tensor]:
        """The model's plain state dict (compact weights dense, the model's own keys), whole: what
        ``model.pt`` holds. Sharded: gathered from every rank (call it on every rank)."""
        if self.sharded:
            return sharding.full_state_dict(self.unwrapped_model, self.sparsity)
        return dense_state_dict(self.unwrapped_model)

    def _drop_old_snapshots(self, run_dir: Path) -> None:
        keep = getattr(self.recipe, "average_last", 0)
        if keep > 0:
            for old in self._snapshots(run_dir)[:-keep]:
                old.unlink()

    def _save_checkpoint(self, run_dir: Path, metrics: MetricsLog) -> None:
        """``checkpoint.pt``, with the number of ``metrics.jsonl`` lines written up to it: a resumed
        run drops the lines after (a run killed after logging steps its checkpoint does not hold
        would log them again).

        Sharded (call it on every rank): each rank writes its rows of the model and optimizer state
        into ``checkpoint.shards.<step>/`` (``torch.distributed.checkpoint``), then rank 0 writes
        ``checkpoint.pt`` naming that directory, then drops the older ones: a run killed at any
        moment leaves a checkpoint.pt whose shards are complete.

        A file the disk refuses (full, a file size limit, read-only) raises ``WriteFailed`` naming it,
        and a refusal on every other rank (rank 0 alone writes checkpoint.pt: the others would wait
        for it forever); the previous checkpoint and its shards are left as they were."""
        failure = None
        try:
            self._write_checkpoint(run_dir, metrics)
        except WriteFailed as error:
            failure = error
        except OSError as error:  # a file of the shards' directory (save_shards names it)
            if disk_error(error) is None:
                raise
            failure = WriteFailed(error.filename or run_dir, error)
        _refuse_together(failure)

    def _write_checkpoint(self, run_dir: Path, metrics: MetricsLog) -> None:
        if self.sharded:
            # Rank 0's run directory (under torchrun the other ranks' differ): every rank writes there.
            shards = Path(distributed.gather_objects(str(sharding.shards_directory(run_dir, self.state.step)))[0])
            # The same step's shards written again (a run resumed at an epoch's end saves its step
            # again): the directory the checkpoint on disk names, never removed below.
            existed = distributed.is_rank0() and shards.exists()
            sharding.save_shards(self.unwrapped_model, self.optimizer, shards)
            state = {**self.checkpoint_state(tensors=False), "shards": shards.name}
        elif distributed.is_rank0():
            state = self.checkpoint_state()
        else:
            return
        if distributed.is_rank0():
            try:
                save_torch({**state, "metrics_lines": metrics.lines}, run_dir / CHECKPOINT)
            except WriteFailed:
                if self.sharded and not existed:  # the new shards, which no checkpoint.pt names: room for the next try
                    shutil.rmtree(shards, ignore_errors=True)
                raise
            if self.sharded:
                for old in run_dir.glob(sharding.SHARDS_PREFIX + "*"):
                    if old != shards:
                        shutil.rmtree(old, ignore_errors=True)

    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        with self.arithmetic(), autocast_context(self.policy, self.device):
            return self.recipe.evaluate(self.unwrapped_model, self.data.test)

    def result(self, peak_bytes: int | None) -> dict[str, Any]:
        state, metric = self.state, self.recipe.primary_metric
        return {
            f"best_{metric}": state.best_metric,
            f"final_{metric}": state.final_metric,
            "steps": state.step,
            "updates": state.updates,
            "skipped_steps": state.skipped,
            "epochs": state.epoch,
            "wall_s": round(state.train_seconds, 3),
            "peak_bytes": peak_bytes,
            "lr_mult": self.lr_mult,
            "cpu_compute": self.cpu_compute_record(),
            **({"compile": self.compile_summary()} if self.compiled is not None else {}),
            "config": OmegaConf.to_container(self.config, resolve=True),
            "provenance": provenance(self.device),
        }

    # --- resume --------------------------------------------------------------------------------
    def checkpoint_state(self, tensors: bool = True) -> dict[str, Any]:
        """Everything a resumed run needs; ``tensors=False``: without the model's and the optimizer's
        state (a sharded checkpoint writes them apart). Sharded, with them: whole tensors gathered
        from every rank (call it on every rank), which any number of ranks resumes."""
        model_state = optimizer_state = None
        if tensors:
            with compact_state_dict_keys():  # positions and values, as they are: the exact state
                model_state = self.unwrapped_model.state_dict()
            optimizer_state = self.optimizer.state_dict()
        if self.sharded and tensors:
            model_state, optimizer_state = sharding.whole(model_state), sharding.whole(optimizer_state)
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "scaler": self.scaler.state_dict(),
            "sparsity": self.sparsity.state_dict() if self.sparsity is not None else None,
            "trainer": vars(self.state).copy(),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            },
            "config": OmegaConf.to_container(self.config, resolve=True),
            "optimizer_kernels": self.optimizer_kernels(),
            "cpu_compute": dict(self.cpu_compute),
        }

    def optimizer_kernels(self) -> str:
        """What computes this run's fused optimizer updates: "cpu" (the C kernel), "triton" or "torch"
        (the fallback, also after a fused kernel failed its check); "torch" too for FP32/FP64/amp
        weights with state in their own dtype (torch's own updates)."""
        quantized_state = getattr(self.optimizer, "state_bits", None) is not None
        if self.policy.param_dtype not in (torch.float16, torch.bfloat16) and not quantized_state:
            return "torch"
        return kernels.backend(self.device)

    def load_checkpoint(self, checkpoint: dict[str, Any], directory: Path | None = None) -> None:
        """Load ``checkpoint_state()``'s output; a sharded checkpoint's tensors are read from its
        shards' directory in ``directory`` (the run directory that holds it)."""
        check_resumable(checkpoint.get("config", {}), OmegaConf.to_container(self.config, resolve=True))
        theirs, mine = checkpoint.get("optimizer_kernels"), self.optimizer_kernels()
        # The CPU paths give the same bits (tests/test_optimizers.py); Triton and the torch fallback
        # may differ in the last bit, so a resume across them is said, not hidden.
        if theirs is not None and theirs != mine and "triton" in (theirs, mine):
            log.warning(
                "trainer.resume: the checkpoint's 16-bit optimizer updates ran on %s, this run's run on %s: the "
                "resumed run may differ from an uninterrupted one in the last bits (LOWMEM_KERNELS=torch "
                "chooses the fallback)",
                theirs,
                mine,
            )
        recorded = checkpoint.get("cpu_compute")
        if recorded and self.cpu_compute and self.policy.cpu_compute == "auto" and recorded != self.cpu_compute:
            log.info("trainer.resume: 16-bit CPU arithmetic as the checkpoint's run chose it (%s)", recorded)
            self.cpu_compute = dict(recorded)
        if (checkpoint["sparsity"] is None) != (self.sparsity is None):
            raise ConfigError("trainer.resume: the checkpoint's sparsity.density differs from this run's")
        # Sparsity first: compact storage lays the weights out for the checkpoint's active counts,
        # then the model's state dict fills in their values and positions. A layout that has them
        # already is kept: the checkpoint may view these very buffers (run.load_state_dict(run.state_dict())).
        if self.sparsity is not None:
            self.sparsity.load_state_dict(checkpoint["sparsity"])
        compact = self.sparsity.compact if self.sparsity is not None else None
        if checkpoint.get("shards"):  # written by every rank apart: each reads its rows
            if not self.sharded or directory is None:
                raise ConfigError("trainer.resume: a sharded checkpoint resumes with trainer.parallel=fsdp")
            sharding.load_shards(self.unwrapped_model, self.optimizer, Path(directory) / checkpoint["shards"], compact)
        elif self.sharded:  # whole tensors: each rank keeps its rows
            sharding.load_whole_model_state(self.unwrapped_model, checkpoint["model"], compact)
            sharding.load_whole_optimizer_state(self.optimizer, checkpoint["optimizer"])
        else:
            with compact_state_dict_keys():
                self.unwrapped_model.load_state_dict(checkpoint["model"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scaler.load_state_dict(checkpoint["scaler"])
        self.state = TrainState(**checkpoint["trainer"])
        # Generator states are CPU byte tensors whatever device the checkpoint was mapped to.
        torch.set_rng_state(checkpoint["rng"]["torch"].cpu())
        # The CUDA generators this machine has (a checkpoint from a machine with more GPUs resumes).
        states = checkpoint["rng"]["cuda"][: torch.cuda.device_count() if torch.cuda.is_available() else 0]
        for index, state in enumerate(states):
            torch.cuda.set_rng_state(state.cpu(), index)


# The knobs a checkpoint's state depends on (weights' dtypes and shapes, the optimizer's and the
# loss scaler's state, sparse layouts): resuming with another value is refused, naming the knob.
STATE_KNOBS = (
    "recipe",
    "model",
    "precision.name",
    "optim.name",
    "optim.state_bits",
    "optim.state_block_size",
    "sparsity.density",
    "sparsity.storage",
    "sparsity.include",
    "sparsity.exclude",
    "trainer.parallel",
)
_ABSENT = object()


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    return bool(torch.stack(torch._foreach_norm(tensors, math.inf)).isfinite().all())


AMP_OVERFLOW_LIMIT = 40  # amp's loss scale halved 40 times in a row (2^40: past FP16's whole range)


def _knob(config: dict, knob: str) -> Any:
    for key in knob.split("."):
        if not isinstance(config, dict) or key not in config:
            return _ABSENT
        config = config[key]
    return config


def _state_layout(config: dict) -> dict:
    """``config`` with the optimizer state's layout spelt one way: ``optim.state_bits`` null is the
    precision's width, and the block size matters only to 8- and 4-bit state."""
    optim = config.get("optim")
    if not isinstance(optim, dict) or "state_bits" not in optim:
        return config
    precision = _knob(config, "precision.name")
    bits = optim["state_bits"]
    if bits is None and isinstance(precision, str):
        bits = state_width(precision)
    optim = {**optim, "state_bits": bits}
    if bits not in (8, 4):
        optim.pop("state_block_size", None)
    return {**config, "optim": optim}


def check_resumable(saved: dict, mine: dict) -> None:
    """Refuse to resume a checkpoint trained with ``saved`` (its configuration) under ``mine`` when
    a knob of ``STATE_KNOBS`` differs; the error names the knob and the value to resume with."""
    if _knob(saved, "sparsity.storage") is _ABSENT and isinstance(saved.get("sparsity"), dict):
        saved = {**saved, "sparsity": {**saved["sparsity"], "storage": "masked"}}  # before compact storage
    saved, mine = _state_layout(saved), _state_layout(mine)
    for knob in STATE_KNOBS:
        theirs, ours = _knob(saved, knob), _knob(mine, knob)
        if theirs is _ABSENT or ours is _ABSENT or theirs == ours:
            continue
        if isinstance(theirs, dict) and isinstance(ours, dict):  # model.*: name the first key that differs
            key = sorted(k for k in {*theirs, *ours} if theirs.get(k) != ours.get(k))[0]
            knob, theirs, ours = f"{knob}.{key}", theirs.get(key), ours.get(key)
        name = "precision" if knob == "precision.name" else knob
        raise ConfigError(
            f"trainer.resume: the checkpoint was trained with {name}={theirs}, this run has {name}={ours}; "
            f"resume with {name}={theirs} (the checkpoint's state depends on it)"
        )


def model_device(model: nn.Module, default: torch.device) -> torch.device:
    """The device of ``model``'s first parameter (``default`` for a model without parameters)."""
    return next((p.device for p in model.parameters()), default)


def _done(state: TrainState, max_steps: int | None) -> bool:
    return max_steps is not None and state.step >= max_steps


class PeakTracker:
    """The measured peak of a run (bytes): training steps and evaluations alike, on every device.

    CUDA: the allocator's ``max_memory_allocated`` since this process started training (every step
    and every evaluation), plus what the CUDA graphs' pool holds idle (``graph_pool_bytes``: replays
    allocate nothing, so the allocated peak never sees it). CPU, where the allocator keeps no
    statistics: lowmem's tensor tracker over the first training step and the first evaluation of
    this process (tracking slows what it measures, and later steps repeat the first).
    ``previous``: the peak a resumed run had measured before this process; the run's peak is the
    larger of the two. The trainer's model, optimizer and data let the tracker name what it sees
    (it counts every tensor alive either way).
    """

    SCOPE = {
        "cuda": "cuda allocator: every training step and evaluation, CUDA graph pool included",
        "cpu": "cpu tensor tracker: the first training step and the first evaluation",
    }

    def __init__(self, trainer: Trainer, previous: int | None = None) -> None:
        self.trainer, self.device, self.previous = trainer, trainer.device, previous
        self.measured: dict[str, int] = {}  # CPU: "step" / "evaluation" -> tracked peak
        self.compiled_steps = 0  # steps tracked or not (trainer.compile: the first is not)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def peak_bytes(self) -> int | None:
        known = [value for value in (self.previous, *self.measured.values()) if value is not None]
        if self.device.type == "cuda":
            from lowmem.profiler.peak import graph_pool_bytes  # the graphs' pool, which replays never allocate

            known.append(int(torch.cuda.max_memory_allocated(self.device)) + graph_pool_bytes(self.device))
        return max(known) if known else None

    @property
    def scope(self) -> str:
        return self.SCOPE.get(self.device.type, self.SCOPE["cpu"])

    @contextmanager
    def track(self, what: str, batch: Any = None) -> Iterator[None]:
        """Measure a training step (``what="step"``) or an evaluation (``"evaluation"``)."""
        trainer = self.trainer
        # Compiled: the first step compiles (the allocator events would count the compiler's own
        # tensors); the next step that compiles nothing is measured.
        first_compiled = what == "step" and trainer.compiled is not None and not self.compiled_steps
        if what == "step":
            self.compiled_steps += 1
        if self.device.type == "cuda" or what in self.measured or first_compiled:
            yield
            return
        graphs = graphs_compiled()
        data = data_tensors(trainer, batch)
        with trainer.arithmetic(), track_peak(trainer.unwrapped_model, trainer.optimizer, self.device, data) as tracker:
            yield
        if trainer.compiled is not None and graphs_compiled() != graphs:
            return  # it compiled (a checkpointed block's first compiled run): the next one is measured
        self.measured[what] = tracker.peak_bytes


def _build_optimizer(optim_cfg, params: list[nn.Parameter], lr: float, policy: PrecisionPolicy):
    # optim.state_bits 8 or 4: blockwise-quantized state; otherwise (null, or the precision's own
    # width, which validation allows alone) state in the weights' dtype.
    bits = getattr(optim_cfg, "state_bits", None)
    quantized = {"state_bits": bits, "block_size": optim_cfg.state_block_size} if bits in (8, 4) else {}
    if optim_cfg.name == "sgd":
        return LowPrecisionSGD(
            params,
            lr=lr,
            momentum=optim_cfg.momentum,
            nesterov=optim_cfg.nesterov,
            weight_decay=optim_cfg.weight_decay,
            stochastic_rounding=policy.stochastic_rounding,
            **quantized,
        )
    return LowPrecisionAdam(
        params,
        lr=lr,
        betas=tuple(optim_cfg.betas),
        eps=optim_cfg.eps,
        weight_decay=optim_cfg.weight_decay,
        stochastic_rounding=policy.stochastic_rounding,
        **quantized,
    )


def build_trainer(cfg: DictConfig) -> Trainer:
    """Build a recipe's model, data and techniques from ``cfg`` (``python -m lowmem.train``)."""
    validate(cfg)
    recipe = get_recipe(cfg.recipe)
    if cfg.data.name not in recipe.data_names:
        raise ConfigError(
            f"data={cfg.data.name!r} is not available for recipe {recipe.name}: "
            f"choose one of {', '.join(recipe.data_names)}"
        )
    device, policy = start_run(cfg)
    # 0. The data (the rewiring schedule scales with the run's length in epochs).
    data = recipe.build_data(cfg, device, policy.input_dtype)
    # 1. The recipe's model, in FP32, from the seed (the same weights whatever the techniques).
    model = recipe.build_model(cfg).to(device)
    return apply_techniques(cfg, recipe, model, data, device, policy)


def start_run(cfg: DictConfig) -> tuple[torch.device, PrecisionPolicy]:
    """What every run sets up before its model exists: threads, device, seed, CUDA libraries and
    the precision policy. ``cfg`` must be validated."""
    if cfg.trainer.sync_batchnorm and cfg.microbatch.size is not None and microbatch_mode(cfg) == "simulated":
        raise ConfigError(
            "trainer.sync_batchnorm=true cannot be combined with microbatch.mode=simulated "
            "(simulated microbatching defines per-group statistics; SyncBatchNorm pools all ranks)"
        )
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    device = resolve_device(cfg.trainer.device)
    distributed.check_batch_divisible(cfg.data.batch_size)
    torch.manual_seed(cfg.trainer.seed)
    if cfg.trainer.sync_batchnorm and device.type == "cpu" and distributed.launched_ranks() > 1:
        raise ConfigError(
            "trainer.sync_batchnorm=true needs a CUDA device: torch's SyncBatchNorm refuses CPU tensors when it "
            "synchronizes ranks; on cpu use trainer.sync_batchnorm=false (per-rank BatchNorm statistics)"
        )
    if cfg.checkpointing.offload and device.type != "cuda":
        raise ConfigError(
            "checkpointing.offload=true needs a CUDA device (it copies saved activations to pinned host memory "
            f"on a side stream); this run is on {device.type}: use checkpointing.offload=false"
        )
    # A technique refusing the configuration raises ValueError naming the knob: a ConfigError here.
    with _refusals_as_config_errors():
        # Before anything runs on the device: the CUDA libraries read their workspace sizes once.
        configure_libraries(device, cfg.trainer.workspaces, cfg.trainer.deterministic)
        policy = make_policy(
            cfg.precision.name,
            device,
            stochastic_rounding=cfg.precision.stochastic_rounding,
            init_scale=cfg.precision.init_scale,
            growth_interval=cfg.precision.growth_interval,
            cpu_compute=cfg.precision.cpu_compute,
        )
    return device, policy


def sparse_weights(cfg: DictConfig, recipe: Recipe, model: nn.Module) -> list[str]:
    """The weights DSR trains sparse: the recipe's rule, or ``sparsity.include``'s patterns, less
    ``sparsity.exclude``'s (``lowmem.techniques.targets``)."""
    include = name_list(cfg.sparsity.include, "sparsity.include")
    exclude = name_list(cfg.sparsity.exclude, "sparsity.exclude")
    if include:
        return default_sparse_weights(model, include, exclude)
    names = recipe.sparsifiable_weights(model)
    kept = [name for name in names if not any(fnmatch.fnmatchcase(name, pattern) for pattern in exclude)]
    if not kept:
        raise ValueError(
            f"sparsity.exclude={exclude!r} leaves no weight of {type(model).__name__} to sparsify; "
            "use sparsity.density=1.0 or exclude fewer weights"
        )
    return kept


def apply_techniques(
    cfg: DictConfig, recipe: Recipe, model: nn.Module, data: RecipeData, device: torch.device, policy: PrecisionPolicy
) -> Trainer:
    """The techniques on ``model`` (on ``device``, FP32, any ``nn.Module``), in the order they
    require, and the trainer over them: the one path of the recipes and of ``lowmem.prepare``."""
    defaults = recipe.table_defaults(cfg.sparsity.density)
    # 2. Simulated microbatching makes every BatchNorm compute statistics per group of examples
    #    (in place: same modules, parameters and state-dict keys).
    if cfg.microbatch.size is not None and microbatch_mode(cfg) == "simulated":
        apply_simulated_microbatching(model, cfg.microbatch.size)
    # 3. Precision: 16-bit weights except normalization layers (amp keeps FP32 weights). The
    #    optimizer, built afterwards, creates its state in each parameter's dtype.
    convert_model(model, policy)
    # 4. Sparsity after the precision cast, so compact storage holds the values in their final
    #    dtype and no dense weight is kept. Masks and the sparse init are drawn in FP32 from the
    #    sparsity generator whatever the precision, so precision never changes which weights are
    #    active.
    sparsity = None
    if cfg.sparsity.density < 1.0:
        with _refusals_as_config_errors():
            names = sparse_weights(cfg, recipe, model)
            sparsity = DynamicSparsity(
                model,
                names,
                cfg.sparsity.density,
                schedule=recipe.rewire_schedule(cfg, _run_epochs(cfg, data)),
                rewire_fraction=cfg.sparsity.rewire_fraction,
                fraction_mult=_pick(cfg.sparsity.rewire_fraction_mult, defaults.rewire_fraction_mult),
                freq_mult=_pick(cfg.sparsity.rewire_freq_mult, defaults.rewire_freq_mult),
                init_threshold=cfg.sparsity.init_threshold,
                seed=cfg.trainer.seed,
                storage=cfg.sparsity.storage,
                init=recipe.sparse_init,
            )
    # 4b. The head and the loss: the output layer and its cross-entropy a chunk of tokens at a
    #     time (lowmem.techniques.head_loss); the model's own modules keep their weights and ties.
    #     Not under FSDP2, whose gathered head weight is gone by the time the loss's backward runs.
    install_head_loss(model, _chunk_setting(cfg))
    # 5. Checkpointing last among the model transforms: it changes how blocks are *run* (a model's
    #    declared residual stacks, or the chains of blocks found in any model), so it wraps
    #    whatever the blocks have become. `optimal` places checkpoints for this rank's first
    #    minibatch, accounted through a provisional trainer over the unwrapped model: the very step
    #    lowmem.profile accounts, so its budget holds for the figure lowmem.profile prints.
    #    Compressed saved activations are saved-tensor hooks around the model's forward: a fixed
    #    strategy stores everything kept at one width; under `optimal` the schedule sets a width per
    #    stored segment, so the hooks go on first (the planner accounts through them).
    #    Offloading (CUDA) goes on first: its hooks are then the outer ones, and what compression
    #    stores is what it copies to the host.
    #    Under `optimal` offloading is one more choice per stored block, priced at this device's
    #    measured host link; with a fixed strategy everything kept is offloaded.
    blocks = name_list(cfg.checkpointing.blocks, "checkpointing.blocks")
    compress = validate_compress(cfg.checkpointing.compress)
    optimal = cfg.checkpointing.strategy == "optimal"
    if cfg.checkpointing.offload:
        with _refusals_as_config_errors():
            apply_offload(model, device=device, everywhere=not optimal)
    if optimal:
        if compress is not None:
            apply_compression(model, None, seed=cfg.trainer.seed)
        compute_dtype = policy.autocast_dtype or policy.param_dtype
        link = link_flops_per_byte(device, compute_dtype) if cfg.checkpointing.offload else None
        provisional = Trainer(cfg, recipe, model, data, policy, sparsity, defaults, device)
        with _refusals_as_config_errors():
            apply_optimal_checkpointing(
                provisional, cfg.checkpointing.budget_mb, blocks, widths=allowed_widths(compress), offload=link
            )
        del provisional  # its optimizer state must not coexist with the real trainer's
    else:
        if cfg.checkpointing.strategy != "none" or blocks:
            with _refusals_as_config_errors():
                apply_checkpointing(model, cfg.checkpointing.strategy, cfg.checkpointing.every, blocks)
        if compress is not None:
            apply_compression(model, compress, seed=cfg.trainer.seed)
    # 6. Data parallel last, over the final parameters: DDP's wrapper (it hooks their gradients), or
    #    FSDP2's sharding after checkpointing, as torchtitan orders them (a checkpointed block's
    #    recomputation is gathered by FSDP2's hooks; lowmem.sharding).
    if cfg.trainer.parallel == "fsdp":
        # What one rank's step needs besides its shards (activations and FLOPs of its share of the
        # minibatch), accounted on fake tensors while the model is whole, as `optimal` does.
        provisional = Trainer(cfg, recipe, model, data, policy, sparsity, defaults, device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            unsharded = profile_trainer(provisional, measure=False)
        del provisional  # its optimizer state must not coexist with the real trainer's
        model = sharding.shard_model(
            model,
            device,
            param_dtype=policy.param_dtype,
            autocast_dtype=policy.autocast_dtype,
            blocks=blocks,
            reshard_after_forward=cfg.trainer.reshard_after_forward,
            reduce_dtype=cfg.precision.reduce_dtype,
            sparsity=sparsity,
        )
    else:
        model = distributed.wrap_model(model, device, sync_batchnorm=cfg.trainer.sync_batchnorm)
    if sparsity is not None:
        distributed.check_identical(sparsity.mask_checksum(), "initial sparsity masks", device)
    # 7. Compilation (trainer.compile) over the model as every technique left it: its forward and
    #    backward compiled, lowmem's own eager code (checkpointed stacks and blocks, compact layers)
    #    outside the graphs (lowmem.techniques.compilation). The accounting passes run it eagerly.
    if cfg.trainer.compile:
        apply_compile(getattr(model, "module", model), cfg.trainer.compile_backend, cfg.trainer.compile_segments)
    trainer = Trainer(cfg, recipe, model, data, policy, sparsity, defaults, device)
    if trainer.sharded:
        trainer.unsharded_report = unsharded
    if distributed.is_rank0():
        log.info(
            "recipe %s on %s | %s | density %.3g, lr x%g, rewire fraction x%g, frequency x%g | "
            "precision %s (cpu compute %s) | microbatch %s (%s) | checkpointing %s every %d",
            recipe.name,
            device,
            data.description if data else "no data",
            cfg.sparsity.density,
            trainer.lr_mult,
            sparsity.fraction_mult if sparsity else defaults.rewire_fraction_mult,
            sparsity.freq_mult if sparsity else defaults.rewire_freq_mult,
            policy.name,
            summary(trainer.cpu_compute_record()),
            cfg.microbatch.size,
            microbatch_mode(cfg),
            cfg.checkpointing.strategy,
            cfg.checkpointing.every,
        )
    return trainer


def _chunk_setting(cfg: DictConfig) -> int | str | None:
    """``loss.chunk_tokens`` as this run applies it: ``auto`` is off under ``trainer.parallel=fsdp``
    and ``trainer.compile=true``, where a number of tokens is refused."""
    setting = validate_chunk_tokens(cfg.loss.chunk_tokens)
    if (cfg.trainer.parallel != "fsdp" and not cfg.trainer.compile) or setting is None:
        return setting
    if setting == "auto":
        return None
    if cfg.trainer.compile:
        raise ConfigError(
            f"loss.chunk_tokens={setting} is not allowed with trainer.compile=true: the chunked head hands the loss "
            "lazy logits, a tensor subclass the compiler cannot trace; use loss.chunk_tokens=auto or none (unchunked "
            "when compiled), or trainer.compile=false"
        )
    raise ConfigError(
        f"loss.chunk_tokens={setting} is not allowed with trainer.parallel=fsdp: the chunked loss reads the output "
        "layer's weight after FSDP2 has resharded it; use loss.chunk_tokens=auto or none (unchunked there)"
    )


@contextmanager
def _refusals_as_config_errors() -> Iterator[None]:
    """A technique's ValueError (it names the knob and the allowed values) as a ConfigError: the
    configuration is refused, nothing is wrong with the run."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(str(error)) from error


def _run_epochs(cfg: DictConfig, data: RecipeData) -> float:
    """How long this run trains, in epochs: ``trainer.epochs``, or less if ``trainer.max_steps`` stops it."""
    epochs = float(cfg.trainer.epochs)
    if cfg.trainer.max_steps is not None:
        epochs = min(epochs, cfg.trainer.max_steps / max(len(data.train), 1))
    return epochs


def _pick(value: float | None, default: float) -> float:
    return default if value is None else value


def resume_from(trainer: Trainer, resume_dir: str, run_dir: Path) -> None:
    """Load ``resume_dir/checkpoint.pt`` into ``trainer``; then ``run_dir`` holds what the run's
    result depends on as of the checkpoint: ``metrics.jsonl`` up to the checkpoint (carried over
    from ``resume_dir`` when it is another directory, lines logged after the checkpoint dropped)
    and the snapshots up to its step (``snapshots/``, averaged by translation's final score)."""
    source = Path(resume_dir)
    path = source / CHECKPOINT
    if not path.is_file():
        raise ConfigError(f"trainer.resume={resume_dir!r}: no {CHECKPOINT} there (expected {path})")
    # Loaded on the CPU: each piece of state is copied to where it belongs as it is loaded (the
    # model's and optimizer's tensors to their parameters' device), and generator states must stay
    # CPU byte tensors (torch.set_rng_state and Generator.set_state accept nothing else).
    checkpoint = read_checkpoint(path, f"trainer.resume={resume_dir}")
    failure = None
    try:
        trainer.load_checkpoint(checkpoint, source)
    except sharding.DamagedShards as error:  # names the shards' directory and file
        failure = RunRefused(f"trainer.resume={resume_dir}: {error}")
        failure.__cause__ = error
    except (KeyError, IndexError, TypeError, RuntimeError) as error:
        failure = RunRefused(f"trainer.resume={resume_dir}: {path} does not fit this run or is damaged ({error})")
        failure.__cause__ = error
    if failure is None and distributed.is_rank0():
        try:
            carry_run_files(source, Path(run_dir), checkpoint)
        except WriteFailed as error:
            failure = error
    _refuse_together(failure)


def _refuse_together(failure: RunRefused | None) -> None:
    """Raise ``failure`` (this rank's, or None) on this rank, or on every rank the first rank's: ranks
    that went on after another stopped would wait for it forever (a collective: call it on every rank)."""
    first = distributed.first_failure(None if failure is None else str(failure))
    if failure is not None:
        raise failure
    if first is not None:
        raise RunRefused(first)


def carry_run_files(source: Path, run_dir: Path, checkpoint: dict[str, Any]) -> None:
    """``run_dir``'s metrics and snapshots as they were when ``checkpoint`` (read from ``source``) was
    written; ``source`` may be ``run_dir`` itself."""
    step = checkpoint["trainer"]["step"]
    same = source.resolve() == run_dir.resolve()
    if (source / METRICS).is_file():
        lines = (source / METRICS).read_bytes().splitlines(keepends=True)
        count = checkpoint.get("metrics_lines")
        if count is not None:
            kept = lines[:count]
        else:  # a checkpoint from before the count was recorded: the records up to its step
            kept = [line for line in lines if _logged_by(line, step)]
        if not same or kept != lines:
            save_bytes(b"".join(kept), run_dir / METRICS)
    for snapshot in sorted((source / SNAPSHOTS).glob("step_*.pt")):
        after = int(snapshot.stem.removeprefix("step_")) > step
        if same and after:
            snapshot.unlink()  # written after the checkpoint: the resumed run writes it again
        elif not same and not after:
            copy_file(snapshot, run_dir / SNAPSHOTS / snapshot.name)


def _logged_by(line: bytes, step: int) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False  # a line cut short by a kill
    return "final" not in record and record.get("step", 0) <= step
