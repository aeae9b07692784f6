"""Prepare IWSLT'14 German→English as the standard recipe does (fairseq's prepare-iwslt14.sh).

    python scripts/prepare_iwslt14.py --out data/iwslt14.de-en          # downloads ~20 MB
    python scripts/prepare_iwslt14.py --out data/iwslt14.de-en --archive de-en.tgz   # offline

Steps, in fairseq's order:
1. Get the IWSLT'14 release archive ``de-en.tgz`` (or take ``--archive``), check its MD5, extract.
2. Training text ``train.tags.de-en.{de,en}``: drop the ``<url>``, ``<talkid>``, ``<keywords>`` lines,
   strip the ``<title>``/``<description>`` tags; Moses-tokenise (sacremoses, with Moses' escaping);
   drop pairs with an empty side, more than 175 tokens or a length ratio above 1.5
   (clean-corpus-n.perl); lowercase.
3. valid = every 23rd training pair, train = the rest; test = the TED dev2010, TEDX dev2012 and TED
   tst2010-2012 segments (XML stripped, ’ → ', tokenised, lowercased).
4. Learn 10,000 joint BPE merges on train.de + train.en and apply them to every split (this file's
   own implementation of subword-nmt's algorithm; codes in subword-nmt's format).
5. Dictionaries from the training split (fairseq-preprocess: by count, padded to a multiple of 8)
   and the recipe's binary token files, plus the BPE'd text (fairseq-preprocess can read it).

Needs ``sacremoses`` (``pip install sacremoses``). Everything is written into a temporary folder next
to ``--out`` and renamed into place at the end, so a failure leaves no partial output. Offline, the
download fails within ``--timeout`` seconds with a message saying what to do instead.
"""

from __future__ import annotations

import argparse
import heapq
import http.client
import json
import logging
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from lowmem.download import fetch, file_md5  # noqa: E402
from recipes.dc_iwslt.data import Dictionary, write_token_file  # noqa: E402

log = logging.getLogger("prepare_iwslt14")

# The WIT3 release (the URL of the original script) is gone; fairseq mirrors the same archive.
ARCHIVE_URLS = (
    "http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz",
    "https://wit3.fbk.eu/archive/2014-01/texts/de/en/de-en.tgz",
)
ARCHIVE_MD5 = "10936dfdf616504ddbd844e91b94ef4a"  # as published with the mirror's URL; --md5 "" skips
SRC, TGT = "de", "en"
ARCHIVE_FOLDER = "de-en"
TEST_SETS = (
    "IWSLT14.TED.dev2010",
    "IWSLT14.TEDX.dev2012",
    "IWSLT14.TED.tst2010",
    "IWSLT14.TED.tst2011",
    "IWSLT14.TED.tst2012",
)
VALID_EVERY = 23  # valid = training lines 23, 46, ... (1-based)
MAX_TOKENS, LENGTH_RATIO = 175, 1.5
BPE_MERGES = 10_000
EXPECTED_SENTENCES = {"train": 160_239, "valid": 7_283, "test": 6_750}  # the standard split's sizes
END_OF_WORD = "</w>"


class PreparationError(RuntimeError):
    """The preparation cannot go on; the message says why and what to do."""


# ------------------------------------------------------------------------------------- download


def download_archive(urls: Sequence[str], destination: Path, md5: str | None, timeout_s: float) -> str:
    """Try each URL in turn; returns the one that worked. Raises PreparationError if none does."""
    failures = []
    for url in urls:
        log.info("downloading %s", url)
        try:
            actual = fetch(url, destination, timeout_s)
        except (OSError, http.client.HTTPException) as error:  # URLError, timeouts, refusals, cut-offs
            failures.append(f"{url}: {type(error).__name__}: {error}")
            continue
        if md5 and actual != md5:
            failures.append(f"{url}: the archive is damaged or different (MD5 {actual}, expected {md5})")
            continue
        return url
    raise PreparationError(
        "could not download the IWSLT'14 archive de-en.tgz:\n  " + "\n  ".join(failures) + "\n"
        "Without internet: fetch de-en.tgz on another machine and run "
        "`python scripts/prepare_iwslt14.py --out <dir> --archive de-en.tgz` (pass --md5 '' if your copy "
        "is a different but trusted release), or train without IWSLT'14: data=phrases (the embedded "
        "generated German→English corpus) or data=fake (random tokens, for profiling)."
    )


# ----------------------------------------------------------------------------------- text steps

_DROP_TRAIN_LINE = re.compile(r"<url>|<talkid>|<keywords>")
_TRAIN_TAGS = re.compile(r"</?(title|description)>")
_SEGMENT = re.compile(r'<seg id="[0-9]*">\s*(.*?)\s*</seg>')


def read_train_tags(path: Path) -> list[str]:
    """The lines of a ``train.tags`` file without metadata lines and title/description tags."""
    with open(path, encoding="utf-8") as file:
        return [_TRAIN_TAGS.sub("", line.rstrip("\n")) for line in file if not _DROP_TRAIN_LINE.search(line)]


def read_segments(path: Path) -> list[str]:
    """The ``<seg id="...">`` texts of an IWSLT XML file, with ’ written as '."""
    with open(path, encoding="utf-8") as file:
        return [match.group(1).replace("\u2019", "'") for line in file if (match := _SEGMENT.search(line))]


def clean_pairs(
    source: Sequence[str], target: Sequence[str], *, max_tokens: int = MAX_TOKENS, ratio: float = LENGTH_RATIO
) -> tuple[list[str], list[str]]:
    """clean-corpus-n.perl with min 1, max ``max_tokens`` and ``-ratio``: normalise whitespace and
    keep a pair only if both sides hold 1 to ``max_tokens`` tokens and neither is more than
    ``ratio`` times longer than the other."""
    kept_source, kept_target = [], []
    for src_line, tgt_line in zip(source, target, strict=True):
        src_words, tgt_words = src_line.replace("|", "").split(), tgt_line.replace("|", "").split()
        n_src, n_tgt = len(src_words), len(tgt_words)
        if not (1 <= n_src <= max_tokens and 1 <= n_tgt <= max_tokens):
            continue
        if n_src / n_tgt > ratio or n_tgt / n_src > ratio:
            continue
        kept_source.append(" ".join(src_words))
        kept_target.append(" ".join(tgt_words))
    return kept_source, kept_target


def moses_tokenizer(lang: str) -> Callable[[str], str]:
    """Moses' tokenizer.perl for ``lang`` (with its escaping of ' " & < > | [ ]), via sacremoses."""
    try:
        from sacremoses import MosesTokenizer
    except ImportError as error:
        raise PreparationError(
            "IWSLT'14 preparation needs the Moses tokenizer from sacremoses: pip install sacremoses"
        ) from error
    tokenizer = MosesTokenizer(lang=lang)
    return lambda line: tokenizer.tokenize(line, escape=True, return_str=True, aggressive_dash_splits=False)


# -------------------------------------------------------------------------------------------- BPE


class _LargerPairFirst:
    """Heap key that orders symbol pairs descending, so ties in count go to the larger pair."""

    __slots__ = ("pair",)

    def __init__(self, pair: tuple[str, str]) -> None:
        self.pair = pair

    def __lt__(self, other: _LargerPairFirst) -> bool:
        return self.pair > other.pair


def _merge_word(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    """Replace every occurrence of ``pair`` in ``symbols``, left to right, without overlaps."""
    merged, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            merged.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return tuple(merged)


def learn_bpe(word_counts: Mapping[str, int], merges: int, min_frequency: int = 2) -> list[tuple[str, str]]:
    """Learn up to ``merges`` BPE merge operations (Sennrich et al., 2016; subword-nmt's rules).

    Words are characters with ``</w>`` glued to the last one; each step merges the most frequent
    adjacent pair (ties: the larger pair, as subword-nmt's ``max((count, pair))``) and stops early
    when no pair occurs ``min_frequency`` times. Pair counts are updated incrementally, only for
    the words containing the merged pair, and a lazy heap finds the best pair.
    """
    words = [tuple(word[:-1]) + (word[-1] + END_OF_WORD,) for word in word_counts]
    frequencies = list(word_counts.values())
    counts: Counter[tuple[str, str]] = Counter()
    containing: defaultdict[tuple[str, str], set[int]] = defaultdict(set)  # pair -> indices of words
    for index, word in enumerate(words):
        for pair in pairwise(word):
            counts[pair] += frequencies[index]
            containing[pair].add(index)
    heap = [(-count, _LargerPairFirst(pair)) for pair, count in counts.items()]
    heapq.heapify(heap)
    codes: list[tuple[str, str]] = []
    while heap and len(codes) < merges:
        negative_count, key = heapq.heappop(heap)
        best = key.pair
        if counts.get(best, 0) != -negative_count:
            continue  # a stale entry: the pair's count changed after it was pushed
        if -negative_count < min_frequency:
            break
        codes.append(best)
        changed: set[tuple[str, str]] = set()
        for index in containing.pop(best):
            old, frequency = words[index], frequencies[index]
            new = _merge_word(old, best)
            old_pairs, new_pairs = list(pairwise(old)), list(pairwise(new))
            for pair in old_pairs:
                counts[pair] -= frequency
            for pair in new_pairs:
                counts[pair] += frequency
            for pair in set(old_pairs) - set(new_pairs):
                if pair != best:
                    containing[pair].discard(index)
            for pair in new_pairs:
                containing[pair].add(index)
            changed.update(old_pairs, new_pairs)
            words[index] = new
        for pair in changed:
            if counts[pair] > 0 and pair != best:
                heapq.heappush(heap, (-counts[pair], _LargerPairFirst(pair)))
            else:
                counts.pop(pair, None)
    return codes


class BytePairEncoder:
    """Apply learned merges the way subword-nmt's apply_bpe does: in each word, repeatedly merge the
    adjacent pair learned earliest; mark every unit but a word's last with ``@@``."""

    def __init__(self, codes: Sequence[tuple[str, str]]) -> None:
        self.ranks = {pair: rank for rank, pair in enumerate(codes)}
        self._cache: dict[str, tuple[str, ...]] = {}

    def segment(self, word: str) -> tuple[str, ...]:
        """One word -> its subword units (without ``@@`` and ``</w>``)."""
        if word in self._cache:
            return self._cache[word]
        symbols = tuple(word[:-1]) + (word[-1] + END_OF_WORD,)
        while len(symbols) > 1:
            ranked = [(self.ranks[pair], pair) for pair in pairwise(symbols) if pair in self.ranks]
            if not ranked:
                break
            symbols = _merge_word(symbols, min(ranked)[1])
        units = symbols[:-1] + (symbols[-1].removesuffix(END_OF_WORD),)
        self._cache[word] = units
        return units

    def __call__(self, line: str) -> str:
        """A tokenised line -> the same line in subword units ("gesehen" -> "ge@@ sehen")."""
        pieces: list[str] = []
        for word in line.split():
            units = self.segment(word)
            pieces.extend(unit + "@@" for unit in units[:-1])
            pieces.append(units[-1])
        return " ".join(pieces)


def write_codes(path: Path, codes: Iterable[tuple[str, str]]) -> None:
    """subword-nmt's codes file (version 0.2: ``</w>`` glued to word-final units)."""
    path.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in codes), encoding="utf-8")


# ---------------------------------------------------------------------------------------- pipeline


TextSplits = dict[str, tuple[list[str], list[str]]]  # split -> (German lines, English lines)


def preprocess(folder: Path, tokenizers: Mapping[str, Callable[[str], str]]) -> TextSplits:
    """Steps 2-3 on the extracted ``de-en`` folder: tokenised, lowercased lines per split."""
    train = {}
    for lang in (SRC, TGT):
        path = folder / f"train.tags.de-en.{lang}"
        log.info("tokenising %s", path.name)
        train[lang] = [tokenizers[lang](line) for line in read_train_tags(path)]
    if len(train[SRC]) != len(train[TGT]):
        raise PreparationError(f"train.tags.de-en.de has {len(train[SRC])} lines but .en {len(train[TGT])}")
    source, target = clean_pairs(train[SRC], train[TGT])
    source, target = [line.lower() for line in source], [line.lower() for line in target]
    in_valid = [(number + 1) % VALID_EVERY == 0 for number in range(len(source))]
    splits = {
        split: (
            [line for line, v in zip(source, in_valid, strict=True) if v == wanted],
            [line for line, v in zip(target, in_valid, strict=True) if v == wanted],
        )
        for split, wanted in (("train", False), ("valid", True))
    }
    test: dict[str, list[str]] = {SRC: [], TGT: []}
    for name in TEST_SETS:
        for lang in (SRC, TGT):
            segments = read_segments(folder / f"{name}.de-en.{lang}.xml")
            test[lang].extend(tokenizers[lang](segment).lower() for segment in segments)
        if len(test[SRC]) != len(test[TGT]):
            raise PreparationError(f"{name}: the German and English files have different segment counts")
    splits["test"] = (test[SRC], test[TGT])
    return splits


def write_prepared(text: TextSplits, out: Path, merges: int) -> dict:
    """Steps 4-5 into ``out``; returns the summary written to ``prepare.json``."""
    train_source, train_target = text["train"]
    word_counts = Counter(word for line in (*train_source, *train_target) for word in line.split())
    log.info("learning %d BPE merges over %d word types", merges, len(word_counts))
    codes = learn_bpe(word_counts, merges)
    write_codes(out / "code", codes)
    encoder = BytePairEncoder(codes)
    bpe = {
        split: ([encoder(line) for line in source], [encoder(line) for line in target])
        for split, (source, target) in text.items()
    }
    dictionaries = {lang: Dictionary.from_lines(bpe["train"][side]) for side, lang in enumerate((SRC, TGT))}
    for lang, dictionary in dictionaries.items():
        dictionary.save(out / f"dict.{lang}.txt")
    for split, sides in bpe.items():
        for lang, lines in zip((SRC, TGT), sides, strict=True):
            (out / f"{split}.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
            sequences = dictionaries[lang].encode_lines(lines)
            write_token_file(out / f"{split}.{SRC}-{TGT}.{lang}", sequences, len(dictionaries[lang]))
    return {
        "sentences": {split: len(sides[0]) for split, sides in bpe.items()},
        "bpe_merges": len(codes),
        "dictionary_sizes": {lang: len(d) for lang, d in dictionaries.items()},
    }


def prepare_iwslt14(
    out: Path,
    *,
    archive: Path | None = None,
    urls: Sequence[str] = ARCHIVE_URLS,
    md5: str | None = ARCHIVE_MD5,
    timeout_s: float = 10.0,
    merges: int = BPE_MERGES,
    tokenizers: Mapping[str, Callable[[str], str]] | None = None,
    force: bool = False,
) -> dict:
    """The whole preparation into ``out``; returns the summary (also written to ``out/prepare.json``).

    ``archive``: a local de-en.tgz instead of downloading from ``urls``. ``tokenizers``: per language,
    a function from a raw line to a tokenised line (default: Moses via sacremoses).
    """
    out = Path(out).expanduser().resolve()
    if out.exists() and any(out.iterdir()) and not force:
        raise PreparationError(f"{out} exists and is not empty; pass --force to replace it")
    tokenizers = tokenizers or {lang: moses_tokenizer(lang) for lang in (SRC, TGT)}  # fail before downloading
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        started = time.time()
        if archive is None:
            archive = staging / "de-en.tgz"
            origin = download_archive(urls, archive, md5, timeout_s)
        else:
            origin = str(archive)
            actual = file_md5(archive)
            if md5 and actual != md5:
                raise PreparationError(
                    f"{archive} has MD5 {actual}, expected {md5} (pass --md5 '' to accept it)"
                )
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(staging / "orig", filter="data")
        folder = staging / "orig" / ARCHIVE_FOLDER
        missing = [name for name in _required_files() if not (folder / name).is_file()]
        if missing:
            raise PreparationError(
                f"{origin} is not the IWSLT'14 de-en release: missing {', '.join(missing)}"
            )
        result = staging / "result"
        result.mkdir()
        summary = {
            "archive": origin,
            "md5": file_md5(archive),
            **write_prepared(preprocess(folder, tokenizers), result, merges),
        }
        summary["seconds"] = round(time.time() - started, 1)
        (result / "prepare.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        if summary["sentences"] != EXPECTED_SENTENCES:
            log.warning(
                "sentence counts %s differ from the standard split's %s",
                summary["sentences"],
                EXPECTED_SENTENCES,
            )
        if out.exists():
            shutil.rmtree(out)  # empty, or --force
        os.rename(result, out)
        return summary
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _required_files() -> list[str]:
    return [f"train.tags.de-en.{lang}" for lang in (SRC, TGT)] + [
        f"{name}.de-en.{lang}.xml" for name in TEST_SETS for lang in (SRC, TGT)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", required=True, type=Path, help="directory to create (the recipe's data.root)"
    )
    parser.add_argument("--archive", type=Path, help="a local de-en.tgz instead of downloading it")
    parser.add_argument("--md5", default=ARCHIVE_MD5, help="expected MD5 of the archive ('' = do not check)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server")
    parser.add_argument("--merges", type=int, default=BPE_MERGES, help="joint BPE merge operations")
    parser.add_argument("--force", action="store_true", help="replace an existing --out directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        summary = prepare_iwslt14(
            args.out,
            archive=args.archive,
            md5=args.md5 or None,
            timeout_s=args.timeout,
            merges=args.merges,
            force=args.force,
        )
    except PreparationError as error:
        print(f"prepare_iwslt14: {error}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
