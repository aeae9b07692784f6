"""BLEU as the report (fairseq) and as sacrebleu compute it, from the model's token strings.

Hypotheses and references come in as the dictionary decodes them: tokenised, lowercased, possibly
with subword-nmt's "@@ " separators. ``corpus_bleu`` returns both scores:

- ``tokenized_bleu``: BLEU-4 over the whitespace tokens after BPE removal, no smoothing, as fairseq's
  ``--scoring bleu`` (and multi-bleu.perl) compute it; the report's 35.15 is this number.
- ``bleu``: sacrebleu's default (13a tokenisation, exponential smoothing) on detokenised text, the
  comparable figure across papers.

Detokenisation uses sacremoses' Moses detokeniser when it is installed (``pip install sacremoses``);
otherwise a small fallback undoes Moses' escaping (``&apos;`` ...) and reattaches punctuation and
clitics, which is enough for the generated ``phrases`` corpus but not byte-identical to Moses on
real text.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import sacrebleu

BPE_SEPARATOR = "@@ "

# Moses' tokenizer escapes these characters; its detokenizer (and the fallback) restores them.
MOSES_ESCAPES = {
    "&bar;": "|",
    "&#124;": "|",
    "&lt;": "<",
    "&gt;": ">",
    "&bra;": "[",
    "&ket;": "]",
    "&#91;": "[",
    "&#93;": "]",
    "&quot;": '"',
    "&apos;": "'",
    "&amp;": "&",
}


def remove_bpe(text: str) -> str:
    """Join subword units: "ge@@ sehen" -> "gesehen" (fairseq's ``--remove-bpe``, subword-nmt)."""
    return (text + " ").replace(BPE_SEPARATOR, "").rstrip()


@functools.cache
def _moses_detokenizer(lang: str):
    try:
        from sacremoses import MosesDetokenizer
    except ImportError:
        return None
    return MosesDetokenizer(lang=lang)


def detokenize(text: str, lang: str) -> str:
    """Undo Moses-style tokenisation of one sentence in language ``lang`` (e.g. "en")."""
    detokenizer = _moses_detokenizer(lang)
    if detokenizer is not None:
        return detokenizer.detokenize(text.split())
    return _simple_detokenize(text)


def _simple_detokenize(text: str) -> str:
    """The fallback: unescape, glue punctuation to the word before it and clitics ("'s", "n't") too."""
    for escaped, character in MOSES_ESCAPES.items():
        text = text.replace(escaped, character)
    text = re.sub(r" ([.,!?;:%)\]}])", r"\1", text)
    text = re.sub(r"([(\[{]) ", r"\1", text)
    text = re.sub(r" ('s|'re|'ve|'ll|'d|'m|'t)\b", r"\1", text)
    return text.strip()


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str], lang: str = "en") -> dict[str, float]:
    """Corpus BLEU (0-100) of tokenised hypotheses against one tokenised reference each.

    Returns ``{"bleu": sacrebleu on detokenised text, "tokenized_bleu": fairseq's BLEU-4 on the
    tokens}``; both after BPE removal. ``lang`` is the target language (for detokenisation).
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    hypotheses = [remove_bpe(h) for h in hypotheses]
    references = [remove_bpe(r) for r in references]
    # The text is tokenised already: split on whitespace only and do not smooth, as multi-bleu.perl.
    tokenized = sacrebleu.corpus_bleu(
        hypotheses, [references], tokenize="none", smooth_method="none", force=True
    )
    detokenized = sacrebleu.corpus_bleu(
        [detokenize(h, lang) for h in hypotheses], [[detokenize(r, lang) for r in references]]
    )
    return {"bleu": detokenized.score, "tokenized_bleu": tokenized.score}
