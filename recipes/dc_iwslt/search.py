"""Greedy and beam-search decoding with the model's incremental decoder.

Conventions follow fairseq's ``SequenceGenerator`` (the report's BLEU comes from it): the decoder
is started with EOS (fairseq's translation task teacher-forces ``[eos] + target[:-1]``), padding is
never produced, the output is at least one token long, every sentence stops after at most
``int(max_len_a * src_length + max_len_b)`` tokens plus EOS, a finished hypothesis scores
sum(log p) / length**length_penalty (length counts the EOS), and a sentence is done once it holds
``beam`` finished hypotheses (only EOS among the ``beam`` best candidates finishes one).
Results do not depend on batch composition: lengths come from each sentence's own ``src_lengths``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from recipes.dc_iwslt.data import EOS, PAD


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Decode without dropout, then give the model back in the mode it came in."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _max_lengths(src_lengths: torch.Tensor, max_len_a: float, max_len_b: int) -> list[int]:
    """Per-sentence cap on generated tokens (EOS not counted), at least 1."""
    return [max(1, int(max_len_a * n + max_len_b)) for n in src_lengths.tolist()]


def _next_token_log_probs(
    logits: torch.Tensor, step: int, must_end: torch.Tensor, eos: int, pad: int
) -> torch.Tensor:
    """Log-probabilities [N, V] (at least FP32) with the search's rules applied: never pad, no EOS as the
    first token, only EOS where ``must_end`` [N] (the length cap is reached)."""
    dtype = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
    log_probs = F.log_softmax(logits.to(dtype), dim=-1)
    log_probs[:, pad] = float("-inf")
    if step == 0:
        log_probs[:, eos] = float("-inf")
    eos_only = torch.full_like(log_probs[0], float("-inf"))
    eos_only[eos] = 0.0
    return torch.where(must_end.unsqueeze(1), eos_only, log_probs)


def greedy_decode(
    model: nn.Module,
    src_tokens: torch.Tensor,
    src_lengths: torch.Tensor,
    *,
    max_len_a: float = 1.2,
    max_len_b: int = 10,
    bos: int = EOS,
    eos: int = EOS,
    pad: int = PAD,
) -> list[list[int]]:
    """The most probable next token at every step. src_tokens [B, S], src_lengths [B] (tokens,
    EOS included) -> one token list per sentence, without the start token and the final EOS.
    ``bos`` is the decoder's first input: fairseq-trained translation models start with EOS."""
    with _eval_mode(model):
        state = model.decoder.init_state(model.encoder(src_tokens, src_lengths))
        max_lengths = torch.tensor(_max_lengths(src_lengths, max_len_a, max_len_b), device=src_tokens.device)
        tokens = torch.full((src_tokens.size(0),), bos, dtype=torch.long, device=src_tokens.device)
        finished = torch.zeros_like(tokens, dtype=torch.bool)
        outputs = []
        for step in range(int(max_lengths.max()) + 1):
            log_probs = _next_token_log_probs(
                model.decoder.step(tokens, state), step, step >= max_lengths, eos, pad
            )
            tokens = log_probs.argmax(dim=-1).masked_fill(finished, eos)
            outputs.append(tokens)
            finished |= tokens.eq(eos)
            if finished.all():
                break
        hypotheses = torch.stack(outputs, dim=1).tolist()
    return [hypothesis[: hypothesis.index(eos)] for hypothesis in hypotheses]


def beam_search(
    model: nn.Module,
    src_tokens: torch.Tensor,
    src_lengths: torch.Tensor,
    *,
    beam: int = 5,
    max_len_a: float = 1.2,
    max_len_b: int = 10,
    length_penalty: float = 1.0,
    bos: int = EOS,
    eos: int = EOS,
    pad: int = PAD,
) -> list[list[int]]:
    """Beam search; arguments and result as ``greedy_decode`` (``beam=1`` gives the same output).

    Hypotheses are ranked by sum(log p) / length**length_penalty (0 = no normalisation).
    All sentences stay in the batch until the last one is done (simple, a little wasted compute).
    """
    if beam < 1:
        raise ValueError(f"beam={beam}: must be a positive integer")
    with _eval_mode(model):
        B, device = src_tokens.size(0), src_tokens.device
        state = model.decoder.init_state(model.encoder(src_tokens, src_lengths))
        state.reorder(torch.arange(B, device=device).repeat_interleave(beam))
        max_lengths = _max_lengths(src_lengths, max_len_a, max_len_b)
        must_end_at = torch.tensor(max_lengths, device=device).repeat_interleave(beam)
        prefixes = torch.full((B * beam, 1), bos, dtype=torch.long, device=device)  # [B*beam, step+1]
        # All beams of a sentence start identical: keep only the first alive at step 0.
        scores = torch.full((B, beam), float("-inf"), device=device)
        scores[:, 0] = 0.0
        finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
        done = [False] * B
        for step in range(max(max_lengths) + 1):
            log_probs = _next_token_log_probs(
                model.decoder.step(prefixes[:, -1], state), step, step >= must_end_at, eos, pad
            )
            vocab = log_probs.size(-1)
            candidates = (scores.unsqueeze(-1) + log_probs.view(B, beam, vocab)).view(B, beam * vocab)
            top_scores, top_index = candidates.topk(2 * beam, dim=1)  # 2*beam: enough to refill after EOS
            top_beam, top_token = top_index // vocab, top_index % vocab
            is_eos = top_token.eq(eos)

            for b, j in is_eos[:, :beam].nonzero().tolist():
                score = top_scores[b, j].item()
                if done[b] or score == float("-inf") or len(finished[b]) == beam:
                    continue
                tokens = prefixes[b * beam + top_beam[b, j].item(), 1:].tolist()
                finished[b].append((score / (step + 1) ** length_penalty, tokens))
            done = [done[b] or len(finished[b]) == beam or step >= max_lengths[b] for b in range(B)]
            if all(done):
                break

            # The best `beam` candidates that do not end continue (topk keeps their order).
            scores, keep = top_scores.masked_fill(is_eos, float("-inf")).topk(beam, dim=1)
            order = (torch.arange(B, device=device).unsqueeze(1) * beam + top_beam.gather(1, keep)).view(-1)
            prefixes = torch.cat([prefixes[order], top_token.gather(1, keep).view(-1, 1)], dim=1)
            state.reorder(order)
    return [max(hypotheses, key=lambda scored: scored[0])[1] for hypotheses in finished]
