"""The DynamicConv / IWSLT'14 recipe: translation model, token batches, label-smoothed loss, BLEU.

Units: ``data.batch_size`` and ``microbatch.size`` are tokens as fairseq's ``--max-tokens`` counts
them: a sentence pair costs max(source, target) tokens, and B pairs whose costliest costs L take
B·L (so both padded tensors stay within the limit). The loss is a mean over target tokens.
Per-epoch evaluation is the validation loss (cheap); at the end the last ``AVERAGE_LAST`` epoch
snapshots are averaged and the test set is translated with beam search and scored (detokenized
sacreBLEU and tokenized BLEU).
Per-density defaults follow the report's Table 7 (LR) and Table 9 (rewiring fraction/frequency).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from lowmem.config import ConfigError, evaluation_batch_size
from lowmem.recipe import RecipeData, TechniqueDefaults, check_model_knobs
from lowmem.techniques.head_loss import LazyLogits, LossForm, chunked_per_token
from lowmem.techniques.sparsity import DC_SCHEDULE, RewireSchedule
from recipes.dc_iwslt.bleu import corpus_bleu
from recipes.dc_iwslt.checkpoint_average import average_state_dicts
from recipes.dc_iwslt.corpus import TranslationData, load_translation_data
from recipes.dc_iwslt.data import PAD, TokenBatches, split_batch_by_tokens
from recipes.dc_iwslt.model import Architecture, DynamicConvModel
from recipes.dc_iwslt.ops import Ops
from recipes.dc_iwslt.search import beam_search
from recipes.wrn_cifar.recipe import nearest_table_row

# density: (LR multiplier [Table 7], rewire fraction multiplier, rewire frequency multiplier [Table 9])
TABLE_DEFAULTS = {
    1.0: (1.0, 1.0, 1.0),
    0.5: (2.0, 4.0, 0.125),
    0.4: (2.0, 4.0, 0.125),
    0.3: (4.0, 4.0, 0.125),
    0.2: (4.0, 2.0, 0.25),
    0.1: (8.0, 1.0, 0.5),
    0.05: (8.0, 0.5, 0.5),
}
REPORT_UPDATES = 50_000  # the rewiring schedule's update ranges are stated for a 50,000-update run
LABEL_SMOOTHING = 0.1
AVERAGE_LAST = 10  # epoch snapshots averaged for the final test (the report, after Ott et al.)
BEAM = 5


@functools.lru_cache(maxsize=4)
def _corpus(
    name: str, root: str, src_lang: str, tgt_lang: str, seed: int, size: int | None, test_size: int | None
) -> TranslationData:
    # Cached: the model needs the dictionaries before the data is built, and generating the
    # embedded corpus takes seconds.
    options = {"test_size": test_size} if test_size is not None else {}
    return load_translation_data(name, root, src_lang, tgt_lang, seed=seed, size=size, **options)


def corpus_of(cfg) -> TranslationData:
    d = cfg.data
    return _corpus(d.name, d.root, d.src_lang, d.tgt_lang, 0, d.train_size, d.test_size)


def architecture(cfg) -> Architecture:
    """``model.*`` checked against Architecture: an unknown key fails naming it."""
    knobs = check_model_knobs(cfg.model, Architecture, "dc_iwslt")
    try:
        return Architecture(**{k: tuple(v) if isinstance(v, list) else v for k, v in knobs.items()})
    except ValueError as error:
        raise ConfigError(str(error)) from error


def label_smoothed_loss(
    logits: torch.Tensor, target: torch.Tensor, epsilon: float, ops: Ops | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fairseq's label-smoothed cross entropy, summed over non-pad target tokens, in at least FP32
    (FP16/BF16 logits are widened, FP64 ones kept: the equivalence tests' reference precision).

    Returns (smoothed loss sum, NLL sum); logits [B, T, V], target [B, T]; ``ops``: the model's
    (its log-softmax is the loss's). Lazy logits (``loss.chunk_tokens``) are never computed whole:
    the output layer and this loss run a chunk of tokens at a time (``lowmem.techniques.head_loss``).
    """
    if isinstance(logits, LazyLogits):
        form = LossForm.fairseq(logits.shape[-1], epsilon, PAD)
        loss, nll = chunked_per_token(logits, target, form)
        return loss.sum(), nll.sum()
    wide = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    lprobs = (ops or Ops()).log_softmax(wide, -1)
    # Masked sums, not boolean indexing: shapes stay static (the profiler traces on fake tensors).
    padding = target.eq(PAD)
    nll = (-lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)).masked_fill(padding, 0.0)
    smooth = (-lprobs.sum(-1)).masked_fill(padding, 0.0)
    eps_i = epsilon / (lprobs.size(-1) - 1)
    return ((1.0 - epsilon - eps_i) * nll + eps_i * smooth).sum(), nll.sum()


class DynamicConvIwsltRecipe:
    name = "dc_iwslt"
    data_names = ("phrases", "iwslt14", "fake")
    primary_metric = "valid_loss"
    higher_is_better = False
    average_last = AVERAGE_LAST
    # Sparse runs keep fairseq's initialisation (Xavier-uniform linears, N(0, 1/d) embeddings, zero
    # padding rows) with the inactive entries zeroed, as dense runs do: a density sweep compares
    # densities under one initialisation.
    sparse_init = "model"

    def build_model(self, cfg) -> nn.Module:
        corpus = corpus_of(cfg)
        arch = architecture(cfg)
        return DynamicConvModel(len(corpus.src_dict), len(corpus.tgt_dict), padding_idx=PAD, **vars(arch))

    def sparsifiable_weights(self, model: nn.Module) -> list[str]:
        return model.sparsifiable_weights()

    def table_defaults(self, density: float) -> TechniqueDefaults:
        return TechniqueDefaults(*nearest_table_row(TABLE_DEFAULTS, density))

    def rewire_schedule(self, cfg, run_epochs: float) -> RewireSchedule:
        # The update ranges scale with the run length, so a short run keeps its phases.
        scale = (cfg.trainer.max_steps or REPORT_UPDATES) / REPORT_UPDATES
        return RewireSchedule(
            starts=tuple(s * scale for s in DC_SCHEDULE.starts),
            periods=DC_SCHEDULE.periods,
            stop=DC_SCHEDULE.stop * scale,
            unit="update",
        )

    def build_data(self, cfg, device: torch.device, input_dtype: torch.dtype) -> RecipeData:
        corpus = corpus_of(cfg)
        seed = cfg.trainer.seed
        try:
            train = TokenBatches(corpus.train, cfg.data.batch_size, seed=seed, device=device)
            # Evaluation batches no larger than a training microbatch (but each sentence must fit).
            valid, test = (
                TokenBatches(
                    pairs, max(evaluation_batch_size(cfg), int(pairs.pair_sizes.max())), seed=seed, shuffle=False,
                    device=device,
                )
                for pairs in (corpus.valid, corpus.test)
            )
        except ValueError as error:
            raise ConfigError(str(error)) from error
        size, sizes = cfg.microbatch.size, corpus.train.pair_sizes
        if size is not None and size < sizes.max():
            longest, over = int(sizes.argmax()), int((sizes > size).sum())
            raise ConfigError(
                f"microbatch.size={size} tokens is smaller than training pair {longest} ({int(sizes[longest])} "
                f"tokens, source or target; {over:,} pairs are longer than {size}): the longest sentence must fit "
                f"in one microbatch, set microbatch.size to at least {int(sizes[longest])}"
            )
        description = (
            f"{corpus.description}; {len(train)} minibatches of ≤{cfg.data.batch_size} tokens per epoch"
        )
        return RecipeData(
            train=train, test={"valid": valid, "test": test, "corpus": corpus}, description=description
        )

    def batch_size(self, batch: dict) -> int:
        return int(batch["ntokens"])

    def shard(self, batch: dict, rank: int, world_size: int) -> dict:
        rows = batch["nsentences"]
        start, stop = rank * rows // world_size, (rank + 1) * rows // world_size
        return _rows(batch, start, stop)

    def split(self, batch: dict, microbatch_size: int) -> Sequence[tuple[dict, float]]:
        return split_batch_by_tokens(batch, microbatch_size)

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        logits = model(batch["src_tokens"], batch["src_lengths"], batch["prev_output_tokens"])
        loss, _ = label_smoothed_loss(logits, batch["target"], LABEL_SMOOTHING, _ops_of(model))
        return loss / batch["ntokens"]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, test: dict) -> dict[str, float]:
        loss_sum, nll_sum, tokens = 0.0, 0.0, 0
        for batch in test["valid"].epoch(0):
            logits = model(batch["src_tokens"], batch["src_lengths"], batch["prev_output_tokens"])
            loss, nll = label_smoothed_loss(logits, batch["target"], LABEL_SMOOTHING, _ops_of(model))
            loss_sum, nll_sum, tokens = (
                loss_sum + float(loss),
                nll_sum + float(nll),
                tokens + batch["ntokens"],
            )
        # fairseq reports losses in base 2.
        return {
            "valid_loss": loss_sum / tokens / math.log(2),
            "valid_nll_loss": nll_sum / tokens / math.log(2),
            "valid_ppl": 2 ** (nll_sum / tokens / math.log(2)),
        }

    def final_evaluation(self, model: nn.Module, test: dict, snapshots: Sequence[Path]) -> dict[str, float]:
        """BLEU of the average of the last snapshots (the final weights if there are none).

        ``model`` is a dense copy of the trained model (the trainer's), which this may overwrite.
        """
        if snapshots:
            model.load_state_dict(average_state_dicts(list(snapshots)))
        return {
            **translate_and_score(model, test["test"], test["corpus"]),
            "averaged_snapshots": len(snapshots),
        }


def translate_and_score(
    model: nn.Module, batches: TokenBatches, corpus: TranslationData, beam: int = BEAM
) -> dict:
    hypotheses, references = [], []
    for batch in batches.epoch(0):
        outputs = beam_search(model, batch["src_tokens"], batch["src_lengths"], beam=beam)
        for tokens, target, length in zip(outputs, batch["target"], batch["target_lengths"], strict=True):
            hypotheses.append(corpus.tgt_dict.decode(tokens))
            references.append(corpus.tgt_dict.decode(target[: int(length) - 1].tolist()))
    return corpus_bleu(hypotheses, references, lang=corpus.tgt_lang)


def _ops_of(model: nn.Module) -> Ops:
    """The operators of a DynamicConvModel, possibly DistributedDataParallel-wrapped."""
    return getattr(model, "module", model).ops


def _rows(batch: dict, start: int, stop: int) -> dict:
    out = {k: v[start:stop] for k, v in batch.items() if torch.is_tensor(v)}
    out["ntokens"] = int(out["target_lengths"].sum())
    out["nsentences"] = stop - start
    return out


RECIPE = DynamicConvIwsltRecipe()
