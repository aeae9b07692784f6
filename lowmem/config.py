"""The configuration schema: dataclasses registered with Hydra's ConfigStore.

Because every node is typed, a mistyped knob (``trainer.epocs=3``) or a wrong type
(``data.batch_size=ten``) fails before anything is built, naming the knob. Values that a type
cannot check (ranges, names) are checked by ``validate`` with errors that name the knob, the bad
value and the allowed values.

Units: ``data.batch_size`` and ``microbatch.size`` count examples for vision recipes and target
tokens for translation recipes.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from lowmem.libraries import WORKSPACES
from lowmem.techniques.compilation import BACKENDS as COMPILE_BACKENDS
from lowmem.techniques.compilation import SEGMENT_MODES as COMPILE_SEGMENTS
from lowmem.techniques.compression import validate_compress
from lowmem.techniques.cpu_compute import CPU_COMPUTE
from lowmem.techniques.head_loss import validate_chunk_tokens
from lowmem.techniques.precision import PRECISIONS
from lowmem.techniques.replay import CUDA_GRAPHS


class ConfigError(ValueError):
    """A knob has a value that cannot work; the message names the knob and the allowed values."""


def knob(default: Any, help: str) -> Any:
    """A schema field and its help text, which the documentation's knob reference prints
    (``lowmem.knobs``; a test fails on a knob without one). A list or dict default is copied per config."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class DataConfig:
    """The data set and its batches (``data=<name>`` picks one of the recipe's data sets)."""

    name: str = knob(
        MISSING,
        "The data set, chosen with `data=<name>`. `wrn_cifar` and `vision`: `digits` (the default: scikit-learn's "
        "handwritten digits at 32x32x3, 1,297 train / 500 test images, no download), `cifar10` (downloaded and "
        "checksummed into `data.root`), `fake` (generated, for tests). `dc_iwslt`: `phrases` (the default: a "
        "German-English corpus generated with num2words and a small lexicon, 28,500 / 500 / 1,000 pairs), "
        "`iwslt14` (prepared by `scripts/prepare_iwslt14.py`, or a fairseq `data-bin`), `fake` (the report's "
        "dictionary sizes, IWSLT-like lengths).",
    )
    root: str = knob("data", "Where real data sets are read from and downloaded to.")
    batch_size: int = knob(
        100,
        "The (global) minibatch: examples for vision recipes; target tokens for translation, as fairseq's "
        "`--max-tokens` counts them (`dc_iwslt` sets 4000). Under data parallelism each of N ranks trains on "
        "its 1/N share (it must divide evenly).",
    )
    eval_batch_size: int = knob(
        100,
        "Examples (tokens) per evaluation batch (`dc_iwslt` sets 4000); never more than `microbatch.size` when "
        "microbatching is on, so evaluation (and beam search) needs no more memory than training. 100, not more: "
        "on a CPU, WRN-28-2's evaluation of 500 images at once ran 1.5-1.8x slower than in batches of 100 "
        "(activations of 65 MB outgrow the caches and are mapped afresh each time; `scripts/bench_evaluation.py`).",
    )
    device: str = knob(
        "auto",
        "`auto`: the image data set lives on the training device as uint8 (fastest); `cpu`: in pinned host "
        "memory, each minibatch copied over (when device memory matters more than the copy; on a CPU run it "
        "changes nothing).",
    )
    train_size: int | None = knob(None, "Generated data only: the number of training examples (null: its default).")
    test_size: int | None = knob(None, "Generated data only: the number of test examples (null: its default).")
    image_size: int | None = knob(
        None,
        "`vision` recipe: the side, in pixels, images are resized to (each batch on its device, bilinear, after "
        "augmentation; the data set stays 32x32). Null: 32. A model that cannot classify that size is refused at "
        "start naming `data.image_size` and the smallest size that works.",
    )
    src_lang: str = knob("de", "Translation: the source language.")
    tgt_lang: str = knob("en", "Translation: the target language.")


@dataclass
class OptimConfig:
    """The optimizer, its learning-rate schedule and its state's width."""

    name: str = knob("sgd", "`sgd` (momentum; WRN's) or `adam` (DynamicConv's); each recipe sets its own.")
    lr: float = knob(0.1, "The base learning rate, before `optim.lr_mult`.")
    lr_mult: float | None = knob(
        None,
        "Multiplier of `optim.lr`. Null: the report's table value for the configured density (Table 6 for WRN, "
        "Table 7 for DynamicConv; printed at start).",
    )
    momentum: float = knob(0.9, "SGD's momentum.")
    nesterov: bool = knob(True, "SGD: Nesterov momentum.")
    betas: tuple[float, float] = knob((0.9, 0.98), "Adam's (beta1, beta2).")
    eps: float = knob(1e-8, "Adam's epsilon.")
    weight_decay: float = knob(5e-4, "Weight decay.")
    state_bits: int | None = knob(
        None,
        "SGD's momentum and Adam's two moments: `32` (with `fp32`/`amp`) or `16` (with `fp16`/`bf16`) keeps them "
        "in the weights' dtype, as the report does; `8` or `4` keeps them blockwise quantized, with any of "
        "`fp32`, `amp`, `fp16`, `bf16`. Null: the precision's width. A checkpoint resumes only with its own width.",
    )
    state_block_size: int = knob(
        128,
        "8- and 4-bit state: values per quantization block (one FP32 scale each), a power of two from 16 to 4096; "
        "128 is the largest that keeps 4-bit Adam's update error under 20% and the smallest that keeps 8-bit state "
        "1.9x below 16-bit.",
    )
    schedule: str = knob(
        "multistep",
        "The learning-rate schedule: `multistep` (times `optim.gamma` at the epochs `optim.milestones`), "
        "`inverse_sqrt` (DynamicConv's: linear warm-up, then the inverse square root of the update) or "
        "`constant` (the default of `lowmem.prepare`).",
    )
    milestones: list[int] = knob(
        [60, 120, 160], "`multistep`: the epochs at which the LR is multiplied by `optim.gamma`."
    )
    gamma: float = knob(0.2, "`multistep`: the LR's factor at each milestone.")
    warmup_updates: int = knob(4000, "`inverse_sqrt`: updates of linear warm-up.")
    warmup_init_lr: float = knob(1e-7, "`inverse_sqrt`: the LR the warm-up starts from.")


@dataclass
class SparsityConfig:
    """Dynamic sparse reparameterization (DSR): which weights are sparse, how many, how stored."""

    density: float = knob(
        1.0,
        "Fraction of nonzeros in the sparsifiable layers (1.0: dense): WRN's 24 3x3 convolutions in its blocks, "
        "DynamicConv's linear weights and embeddings, any other model's as `sparsity.include`/`exclude` choose; "
        "of a mixture of experts' stacked weights, each expert's matrix starts with this density. The multiplying "
        "weights left dense (routers, first and last layer, frozen, zero-initialised) are logged once and listed "
        "in the profile JSON (`dense_weights`). "
        "WRN's sparse convolutions are drawn again He-normal (DSR's rule); DynamicConv and other models keep "
        "their own initialisation (fairseq's Xavier-uniform linears, N(0, 1/d) embeddings, zero padding rows) "
        "with the inactive entries zeroed, as the dense model has it, so a density sweep compares densities under "
        "one initialisation. A checkpoint resumes only with its own density.",
    )
    rewire_fraction: float = knob(
        0.01377866,
        "N_p, the weights DSR aims to prune and regrow per rewiring, as a fraction of the sparsifiable weights "
        "(DSR's WRN setting: 20,000 / 1,451,520).",
    )
    rewire_fraction_mult: float | None = knob(
        None, "Multiplier of `sparsity.rewire_fraction`. Null: the report's table value for the density (Table 8 / 9)."
    )
    rewire_freq_mult: float | None = knob(
        None,
        "Multiplier of the rewiring frequency (k: every period/k updates). Null: the report's table value for the "
        "density (Table 8 / 9).",
    )
    init_threshold: float = knob(
        1e-3, "DSR's initial global pruning threshold (halved or doubled after each rewiring)."
    )
    storage: str = knob(
        "compact",
        "`compact`: each sparse weight is stored as its active values and their positions, int16 column indices "
        "over rows of 2^15 entries (views into flat buffers whose size never changes; a checkpoint of the former "
        "int32 positions converts on load); gradients and optimizer state exist for the active entries only; the "
        "dense weight is built while its layer computes and never saved (a mixture of experts' stacked weights: built "
        "once per experts call and held until backward, since the experts' own ops save it). `masked`: the report's "
        "dense weight and bool mask (same draws, same FP64 results; `tests/test_compact.py`). A checkpoint resumes "
        "only with its own storage.",
    )
    include: Any = knob(
        None,
        "Any model: a shell-style pattern or a list of patterns over parameter names naming exactly the weights to "
        "sparsify (`sparsity.include='layer*.conv*.weight'`): Linear, Conv1d/2d/3d, Embedding and `transformers` "
        "`Conv1D` weights, and stacked matrices (a parameter of 3 or more dims of another module: "
        "`sparsity.include='*.experts.*'`), frozen ones too (pruned once to their largest entries, never rewired, "
        "with a warning). Null: every `nn.Linear`, `nn.Conv1d/2d/3d` and `Conv1D` weight and every experts "
        "module's stacked matrices that train (`requires_grad`), except the routers, the zero-initialised (LoRA's "
        "`lora_B`) and the model's first and last layer (`lowmem/techniques/targets.py`); the built-in recipes name "
        "their own.",
    )
    exclude: Any = knob(
        None,
        "Any model: a pattern or a list of patterns of weights to keep dense "
        "(`sparsity.exclude=[fc.weight,'*.downsample.*']`).",
    )


@dataclass
class PrecisionConfig:
    """The number format of weights, gradients, optimizer state and activations (``precision=<name>``)."""

    name: str = knob(
        "fp32",
        "Chosen with `precision=<name>`: `fp32`; `fp16` (pure: weights, gradients, optimizer state and "
        "activations in FP16, no FP32 master copy, dynamic loss scaling, normalization layers in FP32); `bf16` "
        "(pure); `amp` (autocast with FP32 master weights: the conventional peer); `fp64` (reference runs for "
        "equivalence tests).",
    )
    stochastic_rounding: bool = knob(False, "`fp16`/`bf16`: round each weight update to 16 bits stochastically.")
    init_scale: float = knob(65536.0, "`fp16`: the dynamic loss scale's initial value.")
    growth_interval: int = knob(2000, "`fp16`: steps without overflow before the loss scale doubles.")
    reduce_dtype: str | None = knob(
        None,
        "`trainer.parallel=fsdp`: the dtype gradients are reduce-scattered in: null (the weights' own: 16 bits "
        "under `fp16`/`bf16`), `fp32` or `fp64`.",
    )
    cpu_compute: str = knob(
        "auto",
        "On a CPU, where 16-bit convolutions and matrix products are computed: `native` (PyTorch's 16-bit kernels, "
        "20-200x slower than FP32 on CPUs without AVX-512-BF16/AMX), `fp32` (the 16-bit operands computed in FP32, "
        "each result rounded once to 16 bits, as a GPU does: FP32's speed; stored tensors stay 16-bit), `auto` "
        "(per kind of op, native only where a probe timed once per process shows it clearly faster; "
        "`lowmem/techniques/cpu_compute.py`). No effect on CUDA.",
    )


@dataclass
class MicrobatchConfig:
    """Splitting each minibatch into microbatches."""

    size: int | None = knob(
        None,
        "Examples per microbatch (tokens for translation; the longest sentence must fit), at most "
        "`data.batch_size`. Null: no microbatching (one pass over the minibatch).",
    )
    mode: Any = knob(
        "true",
        "`true`: microbatches run one after another, gradients accumulated, each loss weighted by its share of the "
        "examples (cuts activation memory); `simulated`: one pass over the minibatch, BatchNorm statistics per "
        "group of `microbatch.size` (needs BatchNorm). Hydra reads `true` as a boolean; both are accepted.",
    )


@dataclass
class CheckpointingConfig:
    """Activation checkpointing: which activations backward gets by recomputation."""

    strategy: str = knob(
        "none",
        "`none`; `no_bn` (BatchNorm-ReLU outputs recomputed, never a convolution); `residual` (segments of "
        "`checkpointing.every` blocks recomputed as one graph); `residual_star` (the report's recursive schedule, "
        "BatchNorm-ReLU recomputed); `optimal` (the placement with the fewest FLOPs within "
        "`checkpointing.budget_mb`, by dynamic programming). On any model: over its detected chains of blocks "
        "(`checkpointing.blocks`).",
    )
    every: int = knob(
        1, "`residual`, `residual_star`: blocks per checkpointed segment (every m-th block's output kept)."
    )
    budget_mb: float | None = knob(
        None,
        "`optimal` only (an error with any other strategy, and required there): the most accounted activation MB "
        "(1e6 bytes) of a minibatch; the fewest-FLOPs schedule within it is chosen at start, and a budget no "
        "schedule reaches fails at start naming the smallest reachable figure.",
    )
    blocks: Any = knob(
        None,
        "The blocks to checkpoint, when detection is not wanted: module paths (a container's children are its "
        "blocks: `checkpointing.blocks=[layer3,layer4]`) or one block class name (`checkpointing.blocks=BasicBlock`)."
        " Null: a model that declares residual blocks (the built-in recipes) uses them; any other model's chains "
        "of blocks are detected.",
    )
    compress: Any = knob(
        "none",
        "`none`, `8`, `4` or `2`: bits per element of the activations kept blocks save for backward, stored "
        "blockwise quantized (per-group ranges, unbiased counter-based stochastic rounding; ReLU masks stay 1-bit). "
        "With `optimal`: the narrowest width the dynamic program may choose, block by block.",
    )
    offload: bool = knob(
        False,
        "CUDA only (a CPU run is refused): what kept blocks save is copied to pinned host memory on a side stream "
        "in forward and prefetched back in reverse order during backward; host bytes are accounted.",
    )


@dataclass
class LossConfig:
    """The output layer and its cross-entropy: a language model's largest activation (its logits)."""

    chunk_tokens: Any = knob(
        "auto",
        "`auto`, `none` or a number of tokens: the output layer and its cross-entropy computed that many tokens at a "
        "time in forward (and a slice of the vocabulary at a time in backward), saving only the hidden states and one "
        "FP32 log-sum-exp per token, never the logits. `auto`: chunked when the FP32 logits would exceed 8 MiB, each "
        "chunk's logits at most max(4 MiB, the hidden states' size) but at least 128 tokens. Applies where a model's "
        "loss reads its output layer's logits: the DynamicConv recipe and `transformers` models trained from "
        "`labels=`.",
    )


@dataclass
class TrainerConfig:
    """The run: its length, device, resumption, logging and the CUDA libraries' settings."""

    epochs: int = knob(200, "Training length in epochs (each recipe sets its own).")
    max_steps: int | None = knob(None, "Stop after this many minibatches (null: every epoch).")
    seed: int = knob(0, "The run's random seed.")
    device: str = knob("auto", "`auto` (CUDA when present, else the CPU), `cpu`, `cuda` or `cuda:N`.")
    resume: str | None = knob(
        None,
        "A run directory: continue from its `checkpoint.pt` (with the same `recipe`, `model.*`, `precision`, "
        "`optim.name`, `optim.state_bits` and `sparsity.density`, `storage`, `include`, `exclude`; knobs that do "
        "not change the state, such as `trainer.epochs` or `microbatch.*`, may change).",
    )
    log_every: int = knob(50, "Minibatches between progress lines and `metrics.jsonl` step records.")
    progress: str = knob(
        "auto", "`auto` (a tqdm bar on a terminal, plain log lines otherwise), `bar`, `lines` or `none`."
    )
    num_threads: int | None = knob(None, "CPU threads for torch (null: torch's default).")
    sync_batchnorm: bool = knob(
        False, "Data parallel on CUDA: `SyncBatchNorm` instead of per-rank BatchNorm statistics (refused on a CPU)."
    )
    parallel: str = knob(
        "ddp",
        "Data parallel under torchrun: `ddp` (DistributedDataParallel: every rank holds the whole model, gradients "
        "and optimizer state) or `fsdp` (PyTorch FSDP2: weights, gradients and optimizer state sharded across the "
        "ranks, each block gathered while it computes; `docs/distributed.md`). `fsdp` in one process is a shard of "
        "1 (it runs, and resumes a sharded checkpoint on one rank).",
    )
    reshard_after_forward: bool = knob(
        True,
        "`trainer.parallel=fsdp`: free each block's gathered weights after its forward and gather them again for "
        "backward (ZeRO-3: least memory); false keeps them gathered until backward (ZeRO-2: one gather fewer).",
    )
    gradient_sync: str = knob(
        "microbatch",
        "`trainer.parallel=fsdp` with true microbatching: `microbatch` (gradients reduce-scattered after every "
        "microbatch: each rank accumulates only its shard) or `minibatch` (once, after the last microbatch: "
        "fewer collectives, but every rank accumulates unsharded gradients of the whole model).",
    )
    compile: bool = knob(
        False,
        "`torch.compile` the model's forward (and, through AOTAutograd, its backward) with every technique: "
        "in place, the state-dict keys unchanged. lowmem's own eager code (each checkpointed stack or block, each "
        "compact sparse layer) runs outside the compiled graphs, one graph break each; a model that compiles whole "
        "gets none from lowmem. `lowmem.profile` reports `graph_breaks` and why; compiled kernels are cached under "
        "lowmem's cache directory (`docs/compile.md`).",
    )
    compile_backend: str = knob(
        "inductor",
        "`trainer.compile=true`: the `torch.compile` backend: `inductor` (compiled kernels), or `aot_eager` / "
        "`eager` (graphs captured, run by eager kernels) to tell a compiler bug from a lowmem one.",
    )
    compile_segments: str = knob(
        "stack",
        "`trainer.compile=true`: how checkpointed residual stacks and chains of blocks run compiled. `stack`: "
        "each stack (and each nn.Sequential of a chain's blocks; each other chain block) one compiled call whose "
        "checkpointed segments the compiler recomputes (its partitioner; fastest, the peak may be a little above "
        "the eager run's); `blocks`: lowmem's own segments, block by block, each block compiled (the eager run's "
        "memory exactly). Either way a stack's first run is eager and watched for side outputs "
        "(`docs/compile.md`).",
    )
    cuda_graphs: str = knob(
        "auto",
        "`auto`: on CUDA in one process, each microbatch shape that repeats is captured once (forward, loss "
        "scaling, backward, checkpointing's recomputation) as a CUDA graph and replayed; other shapes, "
        "data-parallel runs, `precision=amp` and CPU runs go eagerly. `off`: always eager "
        "(`lowmem/techniques/replay.py`).",
    )
    workspaces: str = knob(
        "default",
        "CUDA libraries' scratch memory: `default`, or `capped`: cuBLAS (`CUBLAS_WORKSPACE_CONFIG=:16:8`), "
        "cuBLASLt (128 KiB) and cuDNN's convolution algorithms (at most 4 MiB of workspace) limited, for runs "
        "whose whole budget is a few MB; possibly slower kernels (`lowmem/libraries.py`). Set before the first "
        "CUDA call of the process; variables you set yourself are kept.",
    )
    stop_on_nonfinite: bool = knob(
        True,
        "A step whose loss or gradients are not finite is skipped in every precision (FP16's loss scaler also "
        "halves its scale), counted in `skipped_steps` and warned once; when they persist (10 such steps in a row, "
        "or FP16 overflowing at the scaler's minimum scale) the run stops with one line naming the step, the loss "
        "and the knobs to look at, its last checkpoint kept. false: FP32, BF16 and amp apply every step as "
        "computed, FP16 keeps skipping at its minimum scale.",
    )
    deterministic: bool = knob(
        False,
        "Deterministic kernels only (`torch.use_deterministic_algorithms`, cuDNN deterministic, a reproducible "
        "cuBLAS workspace): a CUDA run then repeats bit for bit, and a resumed one ends as the uninterrupted one "
        "(CPU runs do anyway).",
    )


@dataclass
class LoggerConfig:
    """Where metrics go besides `metrics.jsonl` (``logger=<name>``)."""

    name: str = knob(
        "none", "Chosen with `logger=<name>`: `none`, or `wandb` (the same metrics to Weights & Biases)."
    )
    project: str = knob("lowmem", "`wandb`: the project.")
    mode: str = knob("offline", "`wandb`: `offline`, `online` or `disabled`.")


@dataclass
class ProfileConfig:
    """`python -m lowmem.profile`."""

    measure_peak: bool = knob(
        True, "Also run one real step for the measured peak (false: the accounting and FLOPs only, on fake tensors)."
    )


@dataclass
class PlanConfig:
    """`python -m lowmem.plan`."""

    budget_mb: float | None = knob(
        None, "Required: the accounted total plus the step's temporaries to fit, in MB (1e6 bytes)."
    )
    verify: bool = knob(
        True,
        "Run one real step of the chosen configuration built alone: one whose measured peak exceeds the budget is "
        "skipped for the next (false: trust the accounted total with the step's temporaries, no step run).",
    )
    top: int = knob(10, "Rows of the table of configurations that fit.")
    world_size: int = knob(
        1,
        "Ranks to plan for: above 1, per-rank memory with `trainer.parallel=fsdp` (weights, gradients and "
        "optimizer state divided among the ranks, plus the largest gathered block), without starting the ranks.",
    )


@dataclass
class Config:
    """Every knob of `lowmem.train`, `lowmem.profile`, `lowmem.plan` and `lowmem.prepare`."""

    recipe: str = knob(
        MISSING,
        "Chosen with `+recipe=<name>`: `wrn_cifar` (WRN-28-2, image classification), `dc_iwslt` (DynamicConv, "
        "German-English translation) or `vision` (any image classifier: torchvision's by name, or your own class).",
    )
    data: DataConfig = field(default_factory=DataConfig)
    model: dict[str, Any] = knob({}, "The recipe's model: its keys are the recipe's (`conf/recipe/<name>.yaml`).")
    optim: OptimConfig = field(default_factory=OptimConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    microbatch: MicrobatchConfig = field(default_factory=MicrobatchConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
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
        cfg.trainer.compile_backend in COMPILE_BACKENDS,
        "trainer.compile_backend",
        cfg.trainer.compile_backend,
        f"one of {', '.join(COMPILE_BACKENDS)}",
    )
    _require(
        cfg.trainer.compile_segments in COMPILE_SEGMENTS,
        "trainer.compile_segments",
        cfg.trainer.compile_segments,
        f"one of {', '.join(COMPILE_SEGMENTS)}",
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
    _validate_parallel(cfg)
    name_list(cfg.checkpointing.blocks, "checkpointing.blocks")
    try:
        validate_compress(cfg.checkpointing.compress)
        validate_chunk_tokens(cfg.loss.chunk_tokens)
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


PARALLELS = ("ddp", "fsdp")
GRADIENT_SYNCS = ("microbatch", "minibatch")
REDUCE_DTYPES = ("fp32", "fp64")


def _validate_parallel(cfg: DictConfig | Config) -> None:
    """``trainer.parallel`` and the knobs of sharded training; what ``fsdp`` does not shard yet is
    refused here, naming the knob, rather than trained wrongly."""
    parallel = cfg.trainer.parallel
    _require(parallel in PARALLELS, "trainer.parallel", parallel, f"one of {', '.join(PARALLELS)}")
    _require(
        cfg.trainer.gradient_sync in GRADIENT_SYNCS,
        "trainer.gradient_sync",
        cfg.trainer.gradient_sync,
        f"one of {', '.join(GRADIENT_SYNCS)}",
    )
    reduce_dtype = cfg.precision.reduce_dtype
    _require(
        reduce_dtype is None or reduce_dtype in REDUCE_DTYPES,
        "precision.reduce_dtype",
        reduce_dtype,
        f"null (the weights' dtype) or one of {', '.join(REDUCE_DTYPES)}",
    )
    world_size = cfg.plan.world_size
    _require(
        isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1,
        "plan.world_size",
        world_size,
        "an integer >= 1",
    )
    if parallel != "fsdp":
        return
    _require(
        not cfg.trainer.sync_batchnorm,
        "trainer.sync_batchnorm",
        cfg.trainer.sync_batchnorm,
        "false with trainer.parallel=fsdp (SyncBatchNorm is not sharded yet)",
    )
    _require(
        not cfg.checkpointing.offload,
        "checkpointing.offload",
        cfg.checkpointing.offload,
        "false with trainer.parallel=fsdp (offloaded saved activations are not tested with sharding yet)",
    )
