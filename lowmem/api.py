"""lowmem for a training loop of the user's own: ``prepare`` a model, then ``run.step`` per minibatch.

::

    import lowmem
    run = lowmem.prepare(model, loss_fn, example_batch, overrides=["sparsity.density=0.3", "precision=bf16",
        "microbatch.size=10", "checkpointing.strategy=residual_star", "checkpointing.every=2"])
    for batch in loader:
        metrics = run.step(batch)      # one optimizer step over the minibatch: {"loss": float, ...}
    run.model                          # the model being trained (its own class, keys and forward)
    run.profile()                      # lowmem.profile's JSON row, as a dict
    sd = run.state_dict(); run.load_state_dict(sd)    # resume (bit-identical on CPU)
    lowmem.plan(model, loss_fn, example_batch, budget_mb=8)   # {"overrides": [...], "total_bytes": ...}

``loss_fn(model, batch)`` returns the mean loss over the batch's examples (a scalar tensor). A batch
is a tensor or any (nested) tuple / list / dict of tensors with one length along dimension 0, the
examples: true microbatches are slices along it, each loss weighted by its share of examples.
Floating-point batch tensors are cast to the precision's input dtype and every tensor is moved
to the training device. ``overrides`` are the command line's knobs (``lowmem/config.py``), with the
same validation and messages; a user's loop has no epochs, so the defaults here differ in two:
``optim.schedule=constant`` (the LR is ``optim.lr``) and DSR's rewiring schedule counts updates
(the report's DynamicConv schedule of 50,000 updates, scaled to ``trainer.max_steps`` when set).

This is the path the built-in recipes take too: the model goes through
``lowmem.trainer.apply_techniques`` and is trained by the same ``Trainer``; only the task (loss,
batch splitting) is the user's (``LoopTask``).
"""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from omegaconf import DictConfig, open_dict
from torch import nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map_only, tree_unflatten

from lowmem.config import ConfigError, validate
from lowmem.knobs import check_overrides
from lowmem.planning.budget import plan_search
from lowmem.planning.search import compose_config
from lowmem.recipe import RecipeData, TechniqueDefaults
from lowmem.techniques.compact import use_dense_keys
from lowmem.techniques.compilation import uncompiled
from lowmem.techniques.sparsity import DC_SCHEDULE, RewireSchedule
from lowmem.techniques.targets import default_sparse_weights

LossFn = Callable[[nn.Module, Any], torch.Tensor]
RECIPE_NAME = "python"  # cfg.recipe of a run prepared from Python (no recipe group)
REPORT_UPDATES = 50_000  # the DynamicConv run DC_SCHEDULE's update counts are stated for
# Knobs that belong to the command line's recipes and runs, not to a loop of the user's own.
_NOT_FOR_LOOPS = ("recipe", "data", "logger", "hydra", "plan", "data.name", "data.root", "trainer.resume")


def batch_examples(batch: Any, what: str = "batch") -> int:
    """Examples in ``batch``: the common length of its tensors along dimension 0; raises ValueError
    naming the tensors that disagree (or a batch without tensors)."""
    lengths = {}
    for path, leaf in tree_flatten_with_path(batch)[0]:
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise ValueError(
                    f"{what}{keystr(path)} is 0-dimensional; every batch tensor has its examples along dim 0"
                )
            lengths[f"{what}{keystr(path)}"] = int(leaf.shape[0])
    if not lengths:
        raise ValueError(f"{what} holds no tensor: pass a tensor or a tuple/list/dict of tensors")
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{path} has {n}" for path, n in lengths.items())
        raise ValueError(
            f"{what}: its tensors disagree on dimension 0 ({shown}); a batch is split into microbatches along "
            "dimension 0, the examples, so every tensor must have the same length there"
        )
    examples = next(iter(lengths.values()))
    if examples == 0:
        # An empty batch's mean loss is 0/0: a step of it would be a NaN step, not a no-op.
        raise ValueError(f"{what} has 0 examples (its tensors are empty along dimension 0): pass at least one example")
    return examples


def split_examples(batch: Any, size: int) -> list[tuple[Any, float]]:
    """``batch`` cut along dimension 0 into microbatches of ``size`` examples (views), each with its
    share of the examples (a short last one included)."""
    total = batch_examples(batch)
    leaves, spec = tree_flatten(batch)
    parts = []
    for start in range(0, total, size):
        stop = min(start + size, total)
        piece = [leaf[start:stop] if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        parts.append((tree_unflatten(piece, spec), (stop - start) / total))
    return parts


class LoopTask:
    """The recipe of a loop of the user's own: their loss; batches cut along dimension 0.

    It implements the ``lowmem.recipe.Recipe`` interface the trainer reads (no data set, no
    evaluation: the loop is the user's).
    """

    name = RECIPE_NAME
    data_names: tuple[str, ...] = ()
    primary_metric = "loss"
    higher_is_better = False
    sparse_init = "model"  # DSR keeps the model's own initialisation (inactive entries zeroed)

    def __init__(self, loss_fn: LossFn) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(model, batch); got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__qualname__)
        self.loss_name = f"{getattr(loss_fn, '__module__', None) or type(loss_fn).__module__}.{name}"

    def build_model(self, cfg: Any) -> nn.Module:
        raise RuntimeError("a loop of the user's own brings its model (lowmem.prepare)")

    def sparsifiable_weights(self, model: nn.Module) -> list[str]:
        return default_sparse_weights(model)

    def table_defaults(self, density: float) -> TechniqueDefaults:
        return TechniqueDefaults(lr_mult=1.0, rewire_fraction_mult=1.0, rewire_freq_mult=1.0)

    def rewire_schedule(self, cfg: Any, run_epochs: float) -> RewireSchedule:
        # The report's update-counted schedule, its phases scaled to the run's updates when known.
        scale = (cfg.trainer.max_steps or REPORT_UPDATES) / REPORT_UPDATES
        return RewireSchedule(
            starts=tuple(s * scale for s in DC_SCHEDULE.starts),
            periods=DC_SCHEDULE.periods,
            stop=DC_SCHEDULE.stop * scale,
            unit="update",
        )

    def build_data(self, cfg: Any, device: torch.device, input_dtype: torch.dtype) -> RecipeData:
        raise RuntimeError("a loop of the user's own brings its data (lowmem.prepare)")

    def batch_size(self, batch: Any) -> int:
        return batch_examples(batch)

    def shard(self, batch: Any, rank: int, world_size: int) -> Any:
        share = self.batch_size(batch) // world_size
        return split_examples(batch, share)[rank][0]

    def split(self, batch: Any, microbatch_size: int) -> Sequence[tuple[Any, float]]:
        return split_examples(batch, microbatch_size)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        loss = self.loss_fn(model, batch)
        wanted = "it must return the mean loss over the batch's examples, a floating-point scalar tensor"
        which = f"loss_fn is {self.loss_name}"
        if not isinstance(loss, torch.Tensor):
            raise ValueError(f"loss_fn(model, batch) returned a {type(loss).__name__}: {wanted}; {which}")
        if loss.numel() != 1:
            raise ValueError(f"loss_fn(model, batch) returned {list(loss.shape)}: {wanted} (e.g. .mean()); {which}")
        if not loss.is_floating_point():
            raise ValueError(
                f"loss_fn(model, batch) returned a {loss.dtype} tensor: {wanted} (an integer count such as "
                f"(pred == y).sum() has no gradient; e.g. F.cross_entropy(logits, labels)); {which}"
            )
        # Under torch.no_grad (the profiler's accounting passes) no loss requires grad: only a
        # training forward can tell a loss cut off from the model's weights.
        if torch.is_grad_enabled() and not loss.requires_grad:
            raise ValueError(
                "loss_fn(model, batch) returned a loss that does not require grad, so backward cannot reach the "
                "model's weights: compute it from the model's outputs (no .item(), .detach(), torch.no_grad() or "
                f"torch.tensor(...) on the way); {which}"
            )
        return loss.reshape(())

    def evaluate(self, model: nn.Module, test: Any) -> dict[str, float]:
        raise RuntimeError("a loop of the user's own evaluates its model itself (run.model)")


class _ExampleBatches:
    """The example batch as the trainer's "training data": the minibatch the profiler measures."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __len__(self) -> int:
        return 1

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        if start_batch == 0:
            yield self.batch


def loop_config(overrides: Sequence[str], examples: int) -> DictConfig:
    """The configuration of a loop of the user's own: the CLI's schema, knobs and validation."""
    overrides = list(overrides)
    for override in overrides:
        if not isinstance(override, str) or "=" not in override:
            raise ConfigError(f"overrides: {override!r} is not a knob=value string (e.g. 'precision=bf16')")
        knob = override.split("=", 1)[0].lstrip("+~")
        if knob in _NOT_FOR_LOOPS or knob.startswith(("hydra.", "plan.", "logger.")):
            raise ConfigError(
                f"overrides: {knob} belongs to the command line's recipes and runs, not to lowmem.prepare "
                "(it takes optim.*, sparsity.*, precision, microbatch.*, checkpointing.*, trainer.* knobs)"
            )
    check_overrides(overrides)  # a misspelt knob: one line naming the closest ones
    return as_loop_config(compose_config(*loop_defaults(examples), *overrides))


def loop_defaults(examples: int) -> list[str]:
    """The knobs a loop of the user's own sets before the user's: no epochs, one example batch."""
    return ["optim.schedule=constant", f"data.batch_size={examples}", f"data.eval_batch_size={examples}"]


def as_loop_config(cfg: DictConfig) -> DictConfig:
    """``cfg`` (composed without a recipe) marked as a loop's, and validated."""
    with open_dict(cfg):
        cfg.recipe = RECIPE_NAME
        cfg.data.name = "batches"
    validate(cfg)
    return cfg


class Run:
    """A model prepared for a loop of the user's own (see the module docstring)."""

    def __init__(self, trainer: Any, task: LoopTask) -> None:
        self.trainer, self.task = trainer, task

    @property
    def model(self) -> nn.Module:
        """The model being trained: the user's own module and forward; its state-dict keys are the
        model's own under every technique (a compact sparse weight is saved as its dense tensor and
        loads from one; its parameters are ``<name>_values``, the active entries)."""
        return self.trainer.unwrapped_model

    @property
    def config(self) -> DictConfig:
        return self.trainer.config

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trainer.optimizer

    def step(self, batch: Any) -> dict[str, Any]:
        """One optimizer step over ``batch`` (all its microbatches): ``{"loss": float, "loss_scale": float,
        "skipped": bool, "lr": float}`` (``lr`` when the step was applied; ``rewiring`` when DSR rewired)."""
        trainer = self.trainer
        batch = to_training(batch, trainer.device, trainer.policy.input_dtype)
        record = trainer.train_step(batch)
        trainer.state.step += 1
        trainer.state.batch_in_epoch += 1
        return record

    def profile(self, measure: bool | None = None) -> dict[str, Any]:
        """``lowmem.profile``'s JSON row for the example batch: the report's accounting
        (``model_bytes``, ``optimizer_bytes``, ``activation_bytes``, ``total_bytes``), ``flops``,
        ``params`` and, with ``measure`` (default ``profile.measure_peak``), the measured
        ``peak_bytes`` of one real step, after which the training state is put back as it was."""
        from lowmem.profiler import profile_row

        measure = self.config.profile.measure_peak if measure is None else measure
        if not measure:
            return profile_row(self.trainer, False)[1]
        # The state is kept as serialized bytes, not tensors: nothing the measurement counts.
        saved = io.BytesIO()
        torch.save(self.trainer.checkpoint_state(), saved)
        try:
            return profile_row(self.trainer, True)[1]
        finally:
            saved.seek(0)
            self.trainer.load_checkpoint(torch.load(saved, map_location="cpu", weights_only=True))

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume from: model, optimizer, loss scaler, sparsity, counters, RNG states.

        Like torch's ``state_dict()``, its tensors are views of the live state, not copies (no
        memory): they change as the run trains. Save it (``torch.save``) or copy it to keep this
        moment; ``load_state_dict`` of it right away changes nothing."""
        return self.trainer.checkpoint_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``: of this run (its own views load safely) or of another run of the
        same configuration, e.g. ``torch.load`` of a saved one into a fresh ``lowmem.prepare`` of a
        freshly built model, which then continues bit-identically on CPU."""
        self.trainer.load_checkpoint(state)


def to_training(batch: Any, device: torch.device, input_dtype: torch.dtype, what: str = "batch") -> Any:
    """``batch`` on the training ``device``, floating-point tensors in the precision's ``input_dtype``."""
    batch_examples(batch, what)
    return tree_map_only(
        torch.Tensor, lambda t: t.to(device=device, dtype=input_dtype if t.is_floating_point() else t.dtype), batch
    )


# The attribute ``_build`` leaves on a model it modified: PREPARED, or PART_WAY when it failed after
# changing the model. Preparing modifies a model in place, once; a second time finds the first's
# wrappers, casts and compact weights and fails deep in torch, so it is refused up front.
MARKER = "_lowmem_prepared"
PREPARED, PART_WAY = "prepared", "part-way"
_DTYPE_PRECISIONS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def check_model(model: nn.Module, precision: str) -> None:
    """Refuse, before anything is changed, a model ``lowmem.prepare`` cannot train under
    ``precision``: one prepared before, one without trainable parameters, or one whose weights are
    not FP32 under ``fp32`` / ``amp`` (which keep the model's dtype; the others cast it)."""
    name = type(model).__name__
    state = model.__dict__.get(MARKER)
    if state == PREPARED:
        raise ValueError(
            f"model {name} was already prepared by lowmem.prepare, which modifies a model in place, once: prepare "
            "a fresh model (copy.deepcopy(model) before preparing) or keep using the first Run"
        )
    if state == PART_WAY:
        raise ValueError(
            f"model {name} was left part-way modified by a lowmem.prepare that failed: prepare a freshly built "
            "model (or a copy.deepcopy(model) made before the first call)"
        )
    params = list(model.named_parameters())
    if not any(p.requires_grad for _, p in params):
        held = f"all {len(params)} have requires_grad=False" if params else "it has none"
        raise ValueError(
            f"model {name} has no trainable parameters ({held}): lowmem.prepare trains a model's parameters; "
            "pass one with some that require grad"
        )
    # Frozen parameters (a LoRA model's 16-bit base) are not trained: their dtype is the model's own.
    other = [(n, p.dtype) for n, p in params if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32]
    if precision in ("fp32", "amp") and other:
        first, dtype = other[0]
        cast = f", or train in its dtype with precision={_DTYPE_PRECISIONS[dtype]} (lowmem casts the model)"
        raise ConfigError(
            f"precision={precision} keeps the model's dtype and trains FP32 weights, but model {name} has "
            f"{len(other)} trainable {dtype} parameters (e.g. {first}): call model.float() before lowmem.prepare"
            f"{cast if dtype in _DTYPE_PRECISIONS else ''}"
        )


def _model_state(model: nn.Module) -> list[Any]:
    """What ``_build`` changes when it changes a model: its modules' attributes, hooks, children,
    parameters and buffers (which objects), and their tensors' dtypes, devices and in-place
    versions. No tensor data is read."""
    state: list[Any] = []
    for path, module in model.named_modules():
        for key, value in vars(module).items():
            if isinstance(value, dict):
                value = [(k, id(v)) for k, v in value.items()]
            elif not isinstance(value, bool | int | float | str | None):
                value = id(value)
            state.append((path, key, value))
        for key, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            state.append((path, key, tensor.dtype, tensor.device, tensor.shape, tensor._version))
    return state


def _build(cfg: DictConfig, model: nn.Module, task: LoopTask, example_batch: Any) -> Any:
    """``model`` prepared under ``cfg``, marked so that it is not prepared again (``check_model``);
    left unmarked when refused before any change."""
    check_model(model, cfg.precision.name)
    before = _model_state(model)
    try:
        trainer = _build_trainer(cfg, model, task, example_batch)
    except ConfigError:
        # A knob's refusal (optimal's budget below its floor names the smallest that works) is
        # retried on the same model with that knob changed: what was installed before it is
        # installed again (tests/test_side_outputs.py retries so, bit for bit).
        raise
    except BaseException:
        if _model_state(model) != before:
            object.__setattr__(model, MARKER, PART_WAY)
        raise
    object.__setattr__(model, MARKER, PREPARED)
    return trainer


def _build_trainer(cfg: DictConfig, model: nn.Module, task: LoopTask, example_batch: Any) -> Any:
    from lowmem import distributed
    from lowmem.trainer import apply_techniques, start_run

    device, policy = start_run(cfg)
    distributed.init_from_environment(device)
    model.to(device)
    example = to_training(example_batch, device, policy.input_dtype, "example_batch")
    data = RecipeData(
        train=_ExampleBatches(example), test=None, description=f"example batch of {batch_examples(example)} examples"
    )
    trainer = apply_techniques(cfg, task, model, data, device, policy)
    # The user's checkpoint and evaluation code read the dense model's keys, sparse or not.
    use_dense_keys(trainer.unwrapped_model)
    return trainer


def prepare(model: nn.Module, loss_fn: LossFn, example_batch: Any, overrides: Sequence[str] = ()) -> Run:
    """``model`` (any ``nn.Module``, modified in place) prepared for a loop of the user's own.

    example_batch: a minibatch like those the loop will pass to ``run.step`` (its number of
        examples is ``data.batch_size``: microbatch sizes are checked against it, and
        ``run.profile()`` and ``plan`` measure it).
    overrides: knobs as on the command line, e.g. ``["precision=bf16", "microbatch.size=10"]``.

    A model you compiled (``torch.compile(model)``, or ``model.compile()``) is prepared as the module
    itself and compiled again over the techniques (``trainer.compile=true``, unless you set it);
    ``run.model.compile()`` after ``prepare`` works too, with the graph breaks of lowmem's eager code.

    Refused in one line before anything changes (``check_model``): a model prepared before (a
    prepare modifies it once), one without trainable parameters, one whose parameters are not FP32
    under ``precision=fp32`` (the default) or ``amp`` (a ConfigError: ``model.float()`` or the
    16-bit precision), and an empty ``example_batch``. A loss that is not a floating-point scalar
    requiring grad is refused at the first ``run.step``, before any update.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
    # A model you compiled (torch.compile or nn.Module.compile) is prepared uncompiled and compiled
    # again with the techniques in place, unless trainer.compile is given.
    model, was_compiled = uncompiled(model)
    if was_compiled and not any(str(o).lstrip("+").startswith("trainer.compile=") for o in overrides):
        overrides = [*overrides, "trainer.compile=true"]
    task = LoopTask(loss_fn)
    cfg = loop_config(overrides, batch_examples(example_batch, "example_batch"))
    return Run(_build(cfg, model, task, example_batch), task)


def plan(
    model: nn.Module,
    loss_fn: LossFn,
    example_batch: Any,
    budget_mb: float,
    overrides: Sequence[str] = (),
    top: int = 10,
    verify: bool = True,
) -> dict[str, Any]:
    """The best configuration of ``model`` that fits ``budget_mb`` (MB = 1e6 bytes), searched as
    ``python -m lowmem.plan`` searches (``lowmem.planning.search``): its accounted total with the
    step's temporaries fits, and with ``verify`` (``plan.verify``, the default) so does the measured
    peak of one real step of it built alone (one that does not is skipped for the next).

    Returns a dict with ``"overrides"`` (knob=value strings for ``prepare``), ``"total_bytes"``,
    ``"budget_total_bytes"``, ``"peak_bytes"`` (measured; None unverified), the accounting,
    ``"refused"`` (a line per configuration that could not be built or accounted, whatever it
    raised, with why: skipped) and ``"tried"`` (every configuration built, in order: ``overrides``,
    ``searched_mb``, ``accounted_mb``, ``measured_mb``, ``verdict``). ``model`` is not modified (each
    configuration is built on a copy). Raises ``lowmem.planning.budget.NothingFits`` (a ConfigError)
    when nothing fits, naming the smallest figure reached (measured, with ``verify``): its
    ``tried`` is the same table, its ``smallest`` the smallest configuration's entry."""
    if not isinstance(budget_mb, int | float) or isinstance(budget_mb, bool) or not math.isfinite(budget_mb):
        raise ConfigError(f"budget_mb={budget_mb!r} is not allowed: a finite number of MB > 0")
    task = LoopTask(loss_fn)
    examples = batch_examples(example_batch, "example_batch")
    # A model prepared before, or without trainable parameters, refused up front (not as every
    # configuration refused when built); its dtype is each precision's to check ("fp64" casts any).
    check_model(model, "fp64")
    # The overrides are checked before any search; checkpointing.budget_mb is the search's to
    # choose (lowmem.plan refuses one given), so a fixed checkpointing.strategy=optimal is checked with one.
    optimal = "checkpointing.strategy=optimal" in [str(o).lstrip("+") for o in overrides]
    loop_config([*overrides, *(["checkpointing.budget_mb=1"] if optimal else [])], examples)

    def build(cfg: DictConfig) -> Any:
        return _build(as_loop_config(cfg), copy.deepcopy(model), task, example_batch)

    return plan_search(
        [*loop_defaults(examples), *overrides], budget_mb, top=top, verify=verify, build=build, echo=False
    )
