"""Translation data mechanics: dictionaries, token files, and minibatches measured in tokens.

Conventions are fairseq's, so that fairseq-preprocessed data and fairseq-trained state dicts fit:

- ``Dictionary``: ``<s>``=0, ``<pad>``=1, ``</s>``=2, ``<unk>``=3, then the vocabulary, read and written
  as fairseq's ``dict.xx.txt`` ("word count" per line, special symbols not listed).
- Every stored sentence ends with ``</s>`` (fairseq's binarizer appends it); lengths count it.
- Batches: source **left-padded**, target and ``prev_output_tokens`` right-padded (fairseq's
  ``left_pad_source=True, left_pad_target=False``); ``prev_output_tokens`` is the target shifted
  right with ``</s>`` first.

Token files (``write_token_file`` / ``read_token_file``) hold one split of one language: a flat
``<prefix>.tokens.npy`` (uint16, or int32 for vocabularies above 65,536 symbols) and
``<prefix>.offsets.npy`` (int64, sentence i = tokens[offsets[i]:offsets[i+1]]), where prefix is
e.g. ``train.de-en.de``. ``read_fairseq_indexed`` reads fairseq's ``mmap`` data-bin files
(``<prefix>.bin`` + ``<prefix>.idx``).
"""

from __future__ import annotations

import io
import os
import struct
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BOS_WORD, PAD_WORD, EOS_WORD, UNK_WORD = "<s>", "<pad>", "</s>", "<unk>"
BOS, PAD, EOS, UNK = 0, 1, 2, 3
OVERWRITE_FLAG = " #fairseq:overwrite"  # lets a dict.txt line repeat a word (fairseq)


class DataUnavailableError(RuntimeError):
    """Translation data is missing or unreadable; the message names the files and what to do."""


# -------------------------------------------------------------------------------------- Dictionary


class Dictionary:
    """Symbols <-> ids with fairseq's special symbols and file format.

    ``counts[i]`` is how often symbol i occurred in the text the dictionary was built from (what the
    ``dict.xx.txt`` file records; fairseq's preprocessing orders symbols by it).
    """

    def __init__(self) -> None:
        self.symbols: list[str] = []
        self.counts: list[int] = []
        self._ids: dict[str, int] = {}
        for word in (BOS_WORD, PAD_WORD, EOS_WORD, UNK_WORD):
            self.add_symbol(word, count=0)
        self.nspecial = len(self.symbols)
        self.bos, self.pad, self.eos, self.unk = BOS, PAD, EOS, UNK

    def add_symbol(self, word: str, count: int = 1) -> int:
        """Add ``count`` occurrences of ``word`` (a new word gets the next id); returns its id."""
        if word in self._ids:
            index = self._ids[word]
            self.counts[index] += count
            return index
        self._ids[word] = len(self.symbols)
        self.symbols.append(word)
        self.counts.append(count)
        return self._ids[word]

    def __len__(self) -> int:
        return len(self.symbols)

    def __contains__(self, word: str) -> bool:
        return word in self._ids

    def __getitem__(self, index: int) -> str:
        return self.symbols[index]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Dictionary) and (self.symbols, self.counts) == (other.symbols, other.counts)

    def index(self, word: str) -> int:
        """The id of ``word``, or ``unk`` for a word outside the vocabulary."""
        return self._ids.get(word, self.unk)

    def encode(self, tokens: str | Sequence[str]) -> torch.Tensor:
        """A whitespace-tokenised line (or a token list) -> int64 ids [len + 1], ``</s>`` appended."""
        words = tokens.split() if isinstance(tokens, str) else tokens
        return torch.tensor([self.index(word) for word in words] + [self.eos], dtype=torch.long)

    def encode_lines(self, lines: Iterable[str]) -> TokenSequences:
        """Many whitespace-tokenised lines at once (``encode`` per line, without a tensor per line)."""
        ids: list[int] = []
        offsets = [0]
        for line in lines:
            ids.extend(self._ids.get(word, self.unk) for word in line.split())
            ids.append(self.eos)
            offsets.append(len(ids))
        dtype = token_dtype(len(self))
        return TokenSequences(np.array(ids, dtype=dtype), np.array(offsets, dtype=np.int64))

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """ids -> space-separated tokens, without ``<s>``, ``<pad>`` and ``</s>`` (as fairseq's
        ``Dictionary.string``); BPE separators are kept (``bleu.remove_bpe`` removes them)."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        skip = (self.bos, self.pad, self.eos)
        return " ".join(self.symbols[i] for i in values if i not in skip)

    @classmethod
    def from_counts(cls, counts: Mapping[str, int], *, padding_factor: int = 8) -> Dictionary:
        """A dictionary of every word in ``counts``, ordered as fairseq's ``finalize`` does: by count,
        descending, ties alphabetically; then ``madeupword0000``... (count 0) until the size is a
        multiple of ``padding_factor`` (fairseq-preprocess pads to 8, which is why IWSLT'14's
        dictionaries have 8,848 and 6,632 entries)."""
        dictionary = cls()
        for word, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
            dictionary.add_symbol(word, count)
        filler = 0
        while len(dictionary) % padding_factor:
            dictionary.add_symbol(f"madeupword{filler:04d}", 0)
            filler += 1
        return dictionary

    @classmethod
    def from_lines(cls, lines: Iterable[str], *, padding_factor: int = 8) -> Dictionary:
        """Count whitespace-separated tokens of ``lines`` and build with ``from_counts``."""
        counts: dict[str, int] = {}
        for line in lines:
            for word in line.split():
                counts[word] = counts.get(word, 0) + 1
        return cls.from_counts(counts, padding_factor=padding_factor)

    @classmethod
    def load(cls, path: str | Path) -> Dictionary:
        """Read fairseq's ``dict.xx.txt``: "word count" lines (the word may contain spaces; a trailing
        ``#fairseq:overwrite`` flag allows a word listed twice, as fairseq does)."""
        dictionary = cls()
        with open(path, encoding="utf-8") as file:
            for number, line in enumerate(file, start=1):
                text = line.rstrip("\n")
                overwrite = text.endswith(OVERWRITE_FLAG)
                word, _, count = text.removesuffix(OVERWRITE_FLAG).rpartition(" ")
                if not word or not count.isdigit():
                    raise DataUnavailableError(f"{path}, line {number}: expected 'word count', got {line!r}")
                if word in dictionary and not overwrite:
                    raise DataUnavailableError(f"{path}, line {number}: {word!r} is listed twice")
                dictionary.add_symbol(word, int(count))
        return dictionary

    def save(self, path: str | Path) -> None:
        """Write fairseq's ``dict.xx.txt`` (the vocabulary after the special symbols), atomically."""
        vocabulary = zip(self.symbols[self.nspecial :], self.counts[self.nspecial :], strict=True)
        lines = "".join(f"{word} {count}\n" for word, count in vocabulary)
        _write_atomically(Path(path), lines.encode("utf-8"))


# ---------------------------------------------------------------------------------- token storage


@dataclass(frozen=True)
class TokenSequences:
    """Many token sequences in one flat array: sequence i is ``tokens[offsets[i]:offsets[i + 1]]``.

    tokens: [total tokens] integer ids (uint16 or int32 on disk; any integer dtype here).
    offsets: [n + 1] int64, starting at 0 and non-decreasing.
    """

    tokens: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        if self.offsets.ndim != 1 or len(self.offsets) == 0 or self.offsets[0] != 0:
            raise ValueError("offsets must be a 1-D array starting at 0")
        if self.offsets[-1] != len(self.tokens) or np.any(np.diff(self.offsets) < 0):
            raise ValueError(f"offsets (last {self.offsets[-1]}) do not describe {len(self.tokens)} tokens")

    @classmethod
    def from_sequences(
        cls, sequences: Iterable[Sequence[int] | np.ndarray | torch.Tensor], dtype: np.dtype | type = np.int32
    ) -> TokenSequences:
        """Pack separate sequences (lists, arrays or tensors of ids) into one flat array."""
        arrays = [np.asarray(s.numpy() if isinstance(s, torch.Tensor) else s, dtype=dtype) for s in sequences]
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
        return cls(tokens, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        return self.tokens[self.offsets[index] : self.offsets[index + 1]]

    @property
    def sizes(self) -> np.ndarray:
        """Tokens per sequence (``</s>`` included), int64 [n]."""
        return np.diff(self.offsets)

    def select(self, indices: np.ndarray) -> TokenSequences:
        """The sequences at ``indices``, in that order (a copy)."""
        indices = np.asarray(indices, dtype=np.int64)
        sizes = self.sizes[indices]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        return TokenSequences(self.tokens[_gather_positions(self.offsets[indices], sizes)], offsets)


@dataclass(frozen=True)
class ParallelCorpus:
    """Sentence pairs: ``source[i]`` translates to ``target[i]``."""

    source: TokenSequences
    target: TokenSequences

    def __post_init__(self) -> None:
        if len(self.source) != len(self.target):
            raise ValueError(f"{len(self.source)} source but {len(self.target)} target sentences")

    def __len__(self) -> int:
        return len(self.source)

    def select(self, indices: np.ndarray) -> ParallelCorpus:
        return ParallelCorpus(self.source.select(indices), self.target.select(indices))

    @property
    def pair_sizes(self) -> np.ndarray:
        """max(source, target) tokens per pair, int64 [n]: what a pair costs in a padded batch."""
        return np.maximum(self.source.sizes, self.target.sizes)


def token_dtype(vocabulary_size: int) -> type:
    """The smallest integer dtype the token files use for ids below ``vocabulary_size``."""
    return np.uint16 if vocabulary_size <= 1 << 16 else np.int32


def write_token_file(prefix: str | Path, sequences: TokenSequences, vocabulary_size: int) -> None:
    """Write ``<prefix>.tokens.npy`` and ``<prefix>.offsets.npy``, each atomically (temp + rename).

    The offsets are renamed last: a reader that finds offsets consistent with the tokens has a
    complete pair.
    """
    prefix = Path(prefix)
    if len(sequences.tokens) and int(sequences.tokens.max()) >= vocabulary_size:
        raise ValueError(
            f"token id {int(sequences.tokens.max())} is outside a vocabulary of {vocabulary_size}"
        )
    tokens_path, offsets_path = token_file_paths(prefix)
    tokens = sequences.tokens.astype(token_dtype(vocabulary_size), copy=False)
    _write_atomically(tokens_path, _npy_bytes(tokens))
    _write_atomically(offsets_path, _npy_bytes(sequences.offsets))


def token_file_paths(prefix: str | Path) -> tuple[Path, Path]:
    """The (tokens, offsets) files of ``prefix``."""
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + ".tokens.npy"), prefix.with_name(prefix.name + ".offsets.npy")


def read_token_file(prefix: str | Path) -> TokenSequences:
    """Read what ``write_token_file`` wrote (fully into memory: IWSLT'14 is ~8 MB of tokens)."""
    tokens_path, offsets_path = token_file_paths(prefix)
    try:
        return TokenSequences(np.load(tokens_path), np.load(offsets_path))
    except (OSError, ValueError) as error:
        raise DataUnavailableError(
            f"cannot read token files {tokens_path} and {offsets_path}: {error}"
        ) from error


# fairseq's mmap IndexedDataset: <prefix>.idx = magic, little-endian uint64 version (1), uint8 dtype
# code, uint64 sequence count n, int32 sizes [n], int64 byte offsets into .bin [n];
# <prefix>.bin = the tokens of every sequence, back to back, in that dtype.
FAIRSEQ_MMAP_MAGIC = b"MMIDIDX\x00\x00"
FAIRSEQ_LEGACY_MAGIC = b"TNTIDX\x00\x00"
# fairseq's dtype codes; 6 and 7 (floats) never hold token ids and are refused.
FAIRSEQ_DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    8: np.uint16,
    9: np.uint32,
    10: np.uint64,
}


def read_fairseq_indexed(prefix: str | Path) -> TokenSequences:
    """Read fairseq's ``mmap`` data-bin pair ``<prefix>.idx`` / ``<prefix>.bin`` into memory."""
    index_path, data_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    with open(index_path, "rb") as file:
        magic = file.read(len(FAIRSEQ_MMAP_MAGIC))
        if magic != FAIRSEQ_MMAP_MAGIC:
            legacy = magic.startswith(FAIRSEQ_LEGACY_MAGIC)
            raise DataUnavailableError(
                f"{index_path} is not a fairseq mmap index (magic {magic!r})"
                + (
                    "; it is fairseq's legacy 'lazy/cached' format: re-run fairseq-preprocess with "
                    "--dataset-impl mmap"
                    if legacy
                    else ""
                )
            )
        (version,) = struct.unpack("<Q", file.read(8))
        (dtype_code,) = struct.unpack("<B", file.read(1))
        (count,) = struct.unpack("<Q", file.read(8))
        if version != 1 or dtype_code not in FAIRSEQ_DTYPES:
            raise DataUnavailableError(
                f"{index_path}: unsupported version {version} or dtype code {dtype_code} (not token ids)"
            )
        sizes = np.fromfile(file, dtype="<i4", count=count).astype(np.int64)
        pointers = np.fromfile(file, dtype="<i8", count=count)
    dtype = np.dtype(FAIRSEQ_DTYPES[dtype_code]).newbyteorder("<")
    if len(sizes) != count or len(pointers) != count:
        raise DataUnavailableError(f"{index_path} is truncated: {count} sequences announced")
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    # fairseq writes sequences back to back; the pointers (bytes) must say the same.
    if not np.array_equal(pointers, offsets[:-1] * dtype.itemsize):
        raise DataUnavailableError(f"{index_path}: sequences are not stored contiguously in {data_path}")
    tokens = np.fromfile(data_path, dtype=dtype)
    if len(tokens) != offsets[-1]:
        raise DataUnavailableError(
            f"{data_path} holds {len(tokens)} tokens, {index_path} expects {offsets[-1]}"
        )
    if dtype.kind == "u" and dtype.itemsize >= 4:
        tokens = tokens.astype(np.int64)  # torch has no uint32/uint64 indexing
    return TokenSequences(tokens, offsets)


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array))
    return buffer.getvalue()


def _write_atomically(path: Path, payload: bytes) -> None:
    """Write to a temporary file next to ``path``, then rename over it: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(payload)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------- batching


def _gather_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Flat positions of the runs [starts[i], starts[i] + lengths[i]) one after another, int64."""
    within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + within


def _pad(sequences: TokenSequences, indices: np.ndarray, pad: int, *, left: bool) -> np.ndarray:
    """The sequences at ``indices`` as an int64 matrix [B, max length] filled up with ``pad``
    (before the tokens if ``left``, after them otherwise)."""
    lengths = sequences.sizes[indices]
    width = int(lengths.max())
    out = np.full((len(indices), width), pad, dtype=np.int64)
    rows = np.repeat(np.arange(len(indices)), lengths)
    columns = _gather_positions(np.zeros(len(indices), dtype=np.int64), lengths)
    if left:
        columns += np.repeat(width - lengths, lengths)
    out[rows, columns] = sequences.tokens[_gather_positions(sequences.offsets[indices], lengths)]
    return out


def _shift_right(target: np.ndarray, lengths: np.ndarray, first: int, pad: int) -> np.ndarray:
    """Right-padded target [B, T] -> [first, t_1, ..., t_{n-1}] per row, right-padded (fairseq's
    ``move_eos_to_beginning``: each row's last token, its ``</s>``, drops out)."""
    shifted = np.concatenate([np.full((len(target), 1), first, dtype=np.int64), target[:, :-1]], axis=1)
    short = np.flatnonzero(lengths < target.shape[1])
    shifted[short, lengths[short]] = pad  # where the row's </s> moved into the padding
    return shifted


class TokenBatches:
    """Minibatches of sentence pairs measured in tokens, as fairseq's ``--max-tokens`` builds them.

    A pair costs max(source, target) tokens (``</s>`` included; ``ParallelCorpus.pair_sizes``); a
    batch of B pairs whose costliest pair costs L holds B·L ≤ ``max_tokens``, so both its padded
    source [B, S] and padded target [B, T] have at most ``max_tokens`` entries. Batches are cut
    once, from the pairs sorted by source then target length with ties in a seeded random order;
    every epoch visits all of them once in a seeded random order: the batches of an epoch are a
    function of (seed, epoch) only, so a run resumed at ``epoch(e, start_batch=k)`` sees exactly the
    batches it would have seen. ``shuffle=False`` keeps length order in both steps (evaluation).

    Each batch is a dict (tensors on ``device``, rows sorted by source length, longest first):
    ``id`` [B] int64 pair indices; ``src_tokens`` [B, S] int64, left-padded; ``src_lengths`` [B];
    ``target`` [B, T] int64, right-padded, ending in ``</s>``; ``prev_output_tokens`` [B, T] the
    target shifted right with ``</s>`` first; ``target_lengths`` [B]; ``ntokens`` (int, target
    tokens without padding: the unit of the loss) and ``nsentences`` (int).
    """

    def __init__(
        self,
        pairs: ParallelCorpus,
        max_tokens: int,
        *,
        seed: int,
        shuffle: bool = True,
        pad: int = PAD,
        eos: int = EOS,
        device: torch.device | str = "cpu",
    ) -> None:
        if len(pairs) == 0:
            raise ValueError("cannot batch an empty corpus")
        sizes = pairs.pair_sizes
        longest = int(np.argmax(sizes))
        if sizes[longest] > max_tokens:
            raise ValueError(
                f"data.batch_size={max_tokens} tokens is smaller than sentence pair {longest} "
                f"({pairs.source.sizes[longest]} source / {pairs.target.sizes[longest]} target tokens, "
                f"</s> included): set data.batch_size to at least {sizes[longest]}"
            )
        self.pairs, self.max_tokens, self.seed, self.shuffle = pairs, max_tokens, seed, shuffle
        self.pad, self.eos, self.device = pad, eos, torch.device(device)
        self.batches = _cut_batches(self._length_order(), sizes, max_tokens)

    def _length_order(self) -> np.ndarray:
        """Pair indices sorted by source length, then target length; ties random if shuffling."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, 0]).permutation(len(self.pairs))
        else:
            order = np.arange(len(self.pairs))
        order = order[np.argsort(self.pairs.target.sizes[order], kind="stable")]
        return order[np.argsort(self.pairs.source.sizes[order], kind="stable")]

    def __len__(self) -> int:
        """Minibatches per epoch."""
        return len(self.batches)

    @property
    def longest_pair(self) -> int:
        """Tokens of the costliest pair, max(source, target): the smallest workable microbatch.size."""
        return int(self.pairs.pair_sizes.max())

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[dict]:
        """The minibatches of ``epoch`` from the ``start_batch``-th on."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, 1, epoch]).permutation(len(self.batches))
        else:
            order = np.arange(len(self.batches))
        for index in order[start_batch:]:
            yield self.collate(self.batches[index])

    def collate(self, indices: np.ndarray) -> dict:
        """The batch dict (see the class) of the pairs at ``indices``."""
        source, target = self.pairs.source, self.pairs.target
        indices = indices[np.argsort(-source.sizes[indices], kind="stable")]  # fairseq's row order
        tensors = {
            "id": indices,
            "src_tokens": _pad(source, indices, self.pad, left=True),
            "src_lengths": source.sizes[indices],
            "target": _pad(target, indices, self.pad, left=False),
            "target_lengths": target.sizes[indices],
        }
        tensors["prev_output_tokens"] = _shift_right(
            tensors["target"], target.sizes[indices], self.eos, self.pad
        )
        batch: dict = {
            name: torch.from_numpy(np.ascontiguousarray(value, dtype=np.int64)).to(self.device)
            for name, value in tensors.items()
        }
        batch["ntokens"] = int(target.sizes[indices].sum())
        batch["nsentences"] = len(indices)
        return batch


def _cut_batches(order: np.ndarray, sizes: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Greedily group consecutive pairs of ``order`` while count · max(size) ≤ max_tokens."""
    batches: list[np.ndarray] = []
    start, longest = 0, 0
    for position, index in enumerate(order.tolist()):
        longest_with = max(longest, int(sizes[index]))
        if (position - start + 1) * longest_with > max_tokens:
            batches.append(order[start:position])
            start, longest_with = position, int(sizes[index])
        longest = longest_with
    batches.append(order[start:])
    return batches


def split_batch_by_tokens(batch: dict, max_tokens: int) -> list[tuple[dict, float]]:
    """Split a minibatch into microbatches of consecutive sentences, each re-padded to its own length.

    The same rule as ``TokenBatches``, applied within the batch: a microbatch of n sentences whose
    costliest sentence costs L = max(source, target) tokens holds n·L ≤ ``max_tokens``, so its
    padded source and target each have at most ``max_tokens`` entries (that bound is what caps
    activation memory). Returns ``(microbatch, weight)`` pairs, weight = the microbatch's
    ``ntokens`` / the batch's ``ntokens`` (the weights sum to 1: the loss is a mean over target
    tokens). Microbatch dicts have the batch's keys. A sentence costing more than ``max_tokens``
    raises ValueError naming ``microbatch.size``.
    """
    sizes = torch.maximum(batch["src_lengths"], batch["target_lengths"]).tolist()
    too_long = [i for i, size in enumerate(sizes) if size > max_tokens]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"microbatch.size={max_tokens} tokens is smaller than sentence {i} of the batch "
            f"({int(batch['src_lengths'][i])} source / {int(batch['target_lengths'][i])} target tokens); "
            f"the longest sentence must fit in one microbatch: set microbatch.size to at least {sizes[i]}"
        )
    groups = _cut_batches(np.arange(len(sizes)), np.asarray(sizes), max_tokens)
    microbatches = [_microbatch(batch, int(group[0]), int(group[-1]) + 1) for group in groups]
    return [(micro, micro["ntokens"] / batch["ntokens"]) for micro in microbatches]


def _microbatch(batch: dict, start: int, stop: int) -> dict:
    """Rows [start, stop) of ``batch``, with padding columns no row of the slice needs removed."""
    src_lengths = batch["src_lengths"][start:stop]
    target_lengths = batch["target_lengths"][start:stop]
    source_width, target_width = int(src_lengths.max()), int(target_lengths.max())
    return {
        "id": batch["id"][start:stop],
        "src_tokens": batch["src_tokens"][start:stop, batch["src_tokens"].shape[1] - source_width :],
        "src_lengths": src_lengths,
        "prev_output_tokens": batch["prev_output_tokens"][start:stop, :target_width],
        "target": batch["target"][start:stop, :target_width],
        "target_lengths": target_lengths,
        "ntokens": int(target_lengths.sum()),
        "nsentences": stop - start,
    }
