"""The configuration schema: dataclasses registered with Hydra's ConfigStore.

Because every node is typed, a mistyped knob (``trainer.epocs=3``) or a wrong type
(``data.batch_size=ten``) fails before anything is built, naming the knob. Values that a type
cannot check (ranges, names) are checked by ``validate`` with errors that name the knob, the bad
value and the allowed values.

Units: ``data.batch_size`` and ``microbatch.size`` count examples for vision recipes and target
tokens for translation recipes.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from lowmem.libraries import WORKSPACES
from lowmem.techniques.compression import validate_compress
from lowmem.techniques.cpu_compute import CPU_COMPUTE
from lowmem.techniques.precision import PRECISIONS
from lowmem.techniques.replay import CUDA_GRAPHS


class ConfigError(ValueError):
    """A knob has a value that cannot work; the message names the knob and the allowed values."""


@dataclass
class DataConfig:
    name: str = MISSING  # chosen with `data=<name>`; each recipe lists the names it accepts
    root: str = "data"  # where real data sets are read from / downloaded to
    batch_size: int = 100  # minibatch: examples (vision) or target tokens (translation)
    eval_batch_size: int = 500  # examples/tokens per evaluation batch (at most microbatch.size when set)
    device: str = "auto"  # auto: the data set lives on the training device | cpu: in (pinned) host memory
    train_size: int | None = None  # generated data only: number of training examples
    test_size: int | None = None  # generated data only: number of test examples
    image_size: int | None = None  # vision recipe: images resized to this side (None: the data set's own, 32)
    src_lang: str = "de"
    tgt_lang: str = "en"


@dataclass
class OptimConfig:
    name: str = "sgd"  # sgd | adam
    lr: float = 0.1  # base learning rate, before `lr_mult`
    lr_mult: float | None = None  # None: the recipe's table default for the configured density
    momentum: float = 0.9
    nesterov: bool = True
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    weight_decay: float = 5e-4
    state_bits: int | None = None  # momentum / Adam moments: 32 | 16 | 8 | 4 bits (None: the precision's width)
    state_block_size: int = 128  # 8- and 4-bit state: elements per quantization block (one FP32 scale each)
    schedule: str = "multistep"  # multistep | inverse_sqrt | constant
    milestones: list[int] = field(default_factory=lambda: [60, 120, 160])  # epochs (multistep)
    gamma: float = 0.2  # multistep factor
    warmup_updates: int = 4000  # inverse_sqrt
    warmup_init_lr: float = 1e-7  # inverse_sqrt


@dataclass
class SparsityConfig:
    density: float = 1.0  # fraction of nonzeros in the sparsifiable layers; 1.0 = dense
    rewire_fraction: float = 0.01377866  # of the sparsifiable weights, per rewiring (DSR's WRN default)
    rewire_fraction_mult: float | None = None  # None: the recipe's table default for the density
    rewire_freq_mult: float | None = None  # None: the recipe's table default for the density
    init_threshold: float = 1e-3
    storage: str = "compact"  # compact (values + positions) | masked (dense weight + bool mask, the report's)
    include: Any = None  # any model: a pattern or list of patterns of the weights to sparsify (None: default rule)
    exclude: Any = None  # any model: a pattern or list of patterns of weights to keep dense


@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32 | fp16 | bf16 | amp | fp64 (reference runs) — chosen with `precision=<name>`
    stochastic_rounding: bool = False  # fp16/bf16: stochastic rounding of the weight write-back
    init_scale: float = 65536.0  # fp16: initial dynamic loss scale
    growth_interval: int = 2000  # fp16: clean steps before the loss scale doubles
    # auto | native | fp32: 16-bit convolutions and matrix products on a CPU in its native 16-bit
    # kernels or in FP32 (rounded once); auto probes which is faster (lowmem.techniques.cpu_compute)
    cpu_compute: str = "auto"


@dataclass
class MicrobatchConfig:
    size: int | None = None  # None: no microbatching (one pass over the minibatch)
    mode: Any = "true"  # true | simulated (Hydra reads `true` as a boolean; both are accepted)


@dataclass
class CheckpointingConfig:
    strategy: str = "none"  # none | no_bn | residual | residual_star | optimal
    every: int = 1  # residual strategies: keep the output of every m-th residual block
    budget_mb: float | None = None  # optimal only (required there): most accounted activation MB (1e6 bytes)
    blocks: Any = None  # any model: module path(s) or a block class name (None: detected)
    # none | 8 | 4 | 2: bits per element of saved activations (optimal: the narrowest the planner may choose)
    compress: Any = "none"
    offload: bool = False  # CUDA: saved activations copied to pinned host memory in forward, prefetched in backward


@dataclass
class TrainerConfig:
    epochs: int = 200
    max_steps: int | None = None  # stop after this many minibatches (smoke runs)
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    resume: str | None = None  # a run directory holding checkpoint.pt
    log_every: int = 50  # minibatches between progress lines / metrics.jsonl step records
    progress: str = "auto"  # auto (bar on a terminal, lines otherwise) | bar | lines | none
    num_threads: int | None = None  # CPU threads for torch (None: torch's default)
    sync_batchnorm: bool = False  # data parallel: SyncBatchNorm instead of per-rank statistics
    cuda_graphs: str = "auto"  # auto (CUDA, one process: repeating microbatches captured + replayed) | off
    workspaces: str = "default"  # CUDA libraries' scratch memory: default | capped (lowmem/libraries.py)
    deterministic: bool = False  # repeat bit for bit on CUDA too (deterministic kernels only)


@dataclass
class LoggerConfig:
    name: str = "none"  # none | wandb
    project: str = "lowmem"
    mode: str = "offline"  # wandb mode: offline | online | disabled


@dataclass
class ProfileConfig:
    measure_peak: bool = True  # lowmem.profile: also run one real step for the measured peak


@dataclass
class PlanConfig:
    budget_mb: float | None = None  # lowmem.plan (required): the accounted total to fit, MB (1e6 bytes)
    verify: bool = False  # lowmem.plan: also measure the chosen configuration's real peak (one real step)
    top: int = 10  # lowmem.plan: rows of the table of configurations that fit


@dataclass
class Config:
    recipe: str = MISSING  # chosen with `+recipe=<name>`
    data: DataConfig = field(default_factory=DataConfig)
    model: dict[str, Any] = field(default_factory=dict)  # recipe-specific; the recipe checks the keys
    optim: OptimConfig = field(default_factory=OptimConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    microbatch: MicrobatchConfig = field(default_factory=MicrobatchConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


def register_configs() -> None:
    ConfigStore.instance().store(name="lowmem_schema", node=Config)
    # `${lowmem.pid:}` in the default run directory: runs started in the same second never share one.
    OmegaConf.register_new_resolver("lowmem.pid", os.getpid, replace=True)


CONF_DIR = Path(__file__).resolve().parent / "conf"


def compose(*overrides: str) -> DictConfig:
    """The configuration ``python -m lowmem.train <overrides>`` would run, for use from Python."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


def _require(condition: bool, knob: str, value: Any, allowed: str) -> None:
    if not condition:
        raise ConfigError(f"{knob}={value!r} is not allowed: {allowed}")


QUANTIZED_STATE_BITS = (8, 4)
STATE_BLOCK_SIZES = tuple(2**k for k in range(4, 13))  # 16 .. 4096


def state_width(precision: str) -> int:
    """The bits of optimizer state a precision keeps by default: its weights' width."""
    return {"fp16": 16, "bf16": 16, "fp64": 64}.get(precision, 32)


def _validate_state_bits(cfg: DictConfig | Config) -> None:
    """``optim.state_bits``: the precision's own width, or 8 / 4 (blockwise quantized state)."""
    bits, precision = cfg.optim.state_bits, cfg.precision.name
    width = state_width(precision)
    allowed = (width, *QUANTIZED_STATE_BITS) if width != 64 else (64,)
    _require(
        bits is None or bits in allowed,
        "optim.state_bits",
        bits,
        f"with precision={precision} one of {', '.join(map(str, allowed))} or null (the precision's width, "
        f"{width}); 16-bit state goes with 16-bit weights (fp16, bf16), 32-bit with fp32 and amp",
    )
    _require(
        cfg.optim.state_block_size in STATE_BLOCK_SIZES,
        "optim.state_block_size",
        cfg.optim.state_block_size,
        f"a power of two from {STATE_BLOCK_SIZES[0]} to {STATE_BLOCK_SIZES[-1]}",
    )


def effective_state_bits(cfg: DictConfig | Config) -> int:
    """The optimizer state's bits: ``optim.state_bits``, or the precision's width when it is null."""
    bits = cfg.optim.state_bits
    return state_width(cfg.precision.name) if bits is None else int(bits)


def evaluation_batch_size(cfg: DictConfig | Config) -> int:
    """Examples (tokens) per evaluation batch: ``data.eval_batch_size``, but no more than a training
    microbatch when microbatching is on, so that evaluation never needs more memory than training."""
    if cfg.microbatch.size is None:
        return cfg.data.eval_batch_size
    return min(cfg.data.eval_batch_size, cfg.microbatch.size)


def data_device(cfg: DictConfig | Config, device: torch.device) -> torch.device:
    """Where the data set lives: the training ``device`` (``data.device=auto``) or host memory (``cpu``)."""
    return device if cfg.data.device == "auto" else torch.device("cpu")


def microbatch_mode(cfg: DictConfig | Config) -> str:
    """``microbatch.mode`` normalised to "true" or "simulated" (Hydra parses `true` as a bool)."""
    mode = cfg.microbatch.mode
    if mode is True or str(mode).lower() == "true":
        return "true"
    _require(str(mode).lower() == "simulated", "microbatch.mode", mode, "one of true, simulated")
    return "simulated"


def name_list(cfg_value: Any, knob: str) -> list[str]:
    """A knob that takes one name or a list of names (``checkpointing.blocks``, ``sparsity.include``)
    as a list of strings (``None``: empty)."""
    if cfg_value is None:
        return []
    if isinstance(cfg_value, str):
        return [cfg_value] if cfg_value else []
    values = OmegaConf.to_container(cfg_value) if isinstance(cfg_value, DictConfig | ListConfig) else cfg_value
    if not isinstance(values, list | tuple) or not all(isinstance(v, str) and v for v in values):
        raise ConfigError(f"{knob}={cfg_value!r} is not allowed: a name or a list of names, e.g. {knob}=[a,b]")
    return list(values)


def require_finite(values: Any, prefix: str = "") -> None:
    """Refuse ``inf`` and ``nan`` in any float knob (a budget, a learning rate, a model's dropout...):
    none of lowmem's knobs has a meaning for them. ``values``: a config or a plain container."""
    if isinstance(values, DictConfig | ListConfig):
        values = OmegaConf.to_container(values, resolve=True)
    elif is_dataclass(values) and not isinstance(values, type):
        values = asdict(values)
    if isinstance(values, dict):
        items = [(f"{prefix}.{key}" if prefix else str(key), value) for key, value in values.items()]
    elif isinstance(values, list | tuple):
        items = [(f"{prefix}[{index}]", value) for index, value in enumerate(values)]
    else:
        items = []
    for knob, value in items:
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{knob}={value!r} is not allowed: it must be a finite number")
        require_finite(value, knob)


def validate(cfg: DictConfig | Config) -> None:
    """Range and name checks that types cannot express. Raises ConfigError naming the knob."""
    if OmegaConf.is_missing(cfg, "recipe") or not cfg.recipe:
        raise ConfigError("no recipe chosen: add +recipe=wrn_cifar, +recipe=dc_iwslt or +recipe=vision")
    require_finite(cfg)
    _require(cfg.data.batch_size > 0, "data.batch_size", cfg.data.batch_size, "must be a positive integer")
    _require(cfg.data.eval_batch_size > 0, "data.eval_batch_size", cfg.data.eval_batch_size, "must be > 0")
    _require(cfg.data.device in ("auto", "cpu"), "data.device", cfg.data.device, "one of auto, cpu")
    _require(cfg.trainer.epochs > 0, "trainer.epochs", cfg.trainer.epochs, "must be a positive integer")
    _require(
        cfg.trainer.max_steps is None or cfg.trainer.max_steps > 0,
        "trainer.max_steps",
        cfg.trainer.max_steps,
        "must be a positive integer or null",
    )
    _require(cfg.trainer.log_every > 0, "trainer.log_every", cfg.trainer.log_every, "must be > 0")
    _require(
        cfg.trainer.cuda_graphs in CUDA_GRAPHS,
        "trainer.cuda_graphs",
        cfg.trainer.cuda_graphs,
        f"one of {', '.join(CUDA_GRAPHS)}",
    )
    _require(
        cfg.trainer.workspaces in WORKSPACES,
        "trainer.workspaces",
        cfg.trainer.workspaces,
        f"one of {', '.join(WORKSPACES)}",
    )
    _require(
        cfg.trainer.progress in ("auto", "bar", "lines", "none"),
        "trainer.progress",
        cfg.trainer.progress,
        "one of auto, bar, lines, none",
    )
    device = cfg.trainer.device
    _require(
        device in ("auto", "cpu", "cuda") or str(device).startswith("cuda:"),
        "trainer.device",
        device,
        "one of auto, cpu, cuda, cuda:N",
    )
    _require(cfg.optim.name in ("sgd", "adam"), "optim.name", cfg.optim.name, "one of sgd, adam")
    _require(cfg.optim.lr > 0, "optim.lr", cfg.optim.lr, "must be > 0")
    _require(
        cfg.optim.lr_mult is None or cfg.optim.lr_mult > 0,
        "optim.lr_mult",
        cfg.optim.lr_mult,
        "must be > 0 or null (the recipe's table default)",
    )
    _validate_state_bits(cfg)
    _require(
        cfg.optim.schedule in ("multistep", "inverse_sqrt", "constant"),
        "optim.schedule",
        cfg.optim.schedule,
        "one of multistep, inverse_sqrt, constant",
    )
    _require(
        0 < cfg.sparsity.density <= 1,
        "sparsity.density",
        cfg.sparsity.density,
        "must be in (0, 1]; 1.0 means dense",
    )
    for knob in ("rewire_fraction_mult", "rewire_freq_mult"):
        value = cfg.sparsity[knob] if isinstance(cfg, DictConfig) else getattr(cfg.sparsity, knob)
        _require(value is None or value > 0, f"sparsity.{knob}", value, "must be > 0 or null (table default)")
    _require(
        cfg.sparsity.storage in ("compact", "masked"),
        "sparsity.storage",
        cfg.sparsity.storage,
        "one of compact, masked",
    )
    _require(
        0 < cfg.sparsity.rewire_fraction < 1,
        "sparsity.rewire_fraction",
        cfg.sparsity.rewire_fraction,
        "must be in (0, 1)",
    )
    _require(
        cfg.precision.name in PRECISIONS,
        "precision",
        cfg.precision.name,
        f"one of {', '.join(PRECISIONS)}",
    )
    _require(
        cfg.precision.cpu_compute in CPU_COMPUTE,
        "precision.cpu_compute",
        cfg.precision.cpu_compute,
        f"one of {', '.join(CPU_COMPUTE)}",
    )
    if cfg.microbatch.size is not None:
        _require(
            cfg.microbatch.size > 0,
            "microbatch.size",
            cfg.microbatch.size,
            "must be a positive integer (examples or tokens) or null",
        )
        _require(
            cfg.microbatch.size <= cfg.data.batch_size,
            "microbatch.size",
            cfg.microbatch.size,
            f"must not exceed data.batch_size={cfg.data.batch_size}",
        )
    microbatch_mode(cfg)
    _require(
        cfg.checkpointing.strategy in ("none", "no_bn", "residual", "residual_star", "optimal"),
        "checkpointing.strategy",
        cfg.checkpointing.strategy,
        "one of none, no_bn, residual, residual_star, optimal",
    )
    # budget_mb belongs to optimal alone: set with another strategy it would silently do nothing.
    budget = cfg.checkpointing.budget_mb
    if cfg.checkpointing.strategy == "optimal":
        _require(
            budget is not None and math.isfinite(budget) and budget > 0,
            "checkpointing.budget_mb",
            budget,
            "checkpointing.strategy=optimal needs a budget: a number of MB > 0",
        )
    else:
        _require(
            budget is None,
            "checkpointing.budget_mb",
            budget,
            "only with checkpointing.strategy=optimal (leave it unset, or null, otherwise)",
        )
    _require(
        cfg.checkpointing.every >= 1,
        "checkpointing.every",
        cfg.checkpointing.every,
        "must be an integer >= 1",
    )
    name_list(cfg.checkpointing.blocks, "checkpointing.blocks")
    try:
        validate_compress(cfg.checkpointing.compress)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    _require(
        isinstance(cfg.checkpointing.offload, bool),
        "checkpointing.offload",
        cfg.checkpointing.offload,
        "true or false",
    )
    name_list(cfg.sparsity.include, "sparsity.include")
    name_list(cfg.sparsity.exclude, "sparsity.exclude")
    _require(cfg.logger.name in ("none", "wandb"), "logger", cfg.logger.name, "one of none, wandb")
