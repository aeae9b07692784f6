"""The translation data pipeline: dictionaries, token files, batching, corpora, BLEU, IWSLT'14 preparation."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import re
import socket
import struct
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch

from lowmem.config import ConfigError
from recipes.dc_iwslt import bleu
from recipes.dc_iwslt.corpus import (
    FAKE_MAX_TOKENS,
    generate_phrase_pairs,
    load_phrases_corpus,
    load_translation_data,
    make_fake_translation,
)
from recipes.dc_iwslt.data import (
    EOS,
    PAD,
    UNK,
    DataUnavailableError,
    Dictionary,
    ParallelCorpus,
    TokenBatches,
    TokenSequences,
    read_fairseq_indexed,
    read_token_file,
    split_batch_by_tokens,
    write_token_file,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prepare():
    """scripts/prepare_iwslt14.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("prepare_iwslt14", ROOT / "scripts" / "prepare_iwslt14.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fake_pairs() -> ParallelCorpus:
    return make_fake_translation(600, seed=1)


def _unpadded(sequences: TokenSequences, index: int) -> list[int]:
    return sequences[index].astype(np.int64).tolist()


# ------------------------------------------------------------------------------------ dictionary


def test_dictionary_conventions_round_trip_and_fairseq_file_format(tmp_path):
    dictionary = Dictionary.from_lines(["b a b", "d c b a ."])
    assert dictionary.symbols[:4] == ["<s>", "<pad>", "</s>", "<unk>"]
    assert dictionary.symbols[4:9] == ["b", "a", ".", "c", "d"]  # by count, ties alphabetically (fairseq)
    assert len(dictionary) == 16 and dictionary.symbols[9:] == [f"madeupword{i:04d}" for i in range(7)]
    ids = dictionary.encode("a b zebra")
    assert ids.dtype == torch.long and ids.tolist() == [5, 4, UNK, EOS]
    assert dictionary.decode(torch.tensor([5, 4, EOS, PAD, PAD])) == "a b"

    path = tmp_path / "dict.de.txt"
    dictionary.save(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[:6] == ["b 3", "a 2", ". 1", "c 1", "d 1", "madeupword0000 0"]
    assert Dictionary.load(path) == dictionary
    assert [p.name for p in tmp_path.iterdir()] == ["dict.de.txt"]  # no temporary file left

    # A file as fairseq writes it, including a word with a space and an overwrite flag.
    path.write_text("hallo 7\nein wort 3\nhallo 2 #fairseq:overwrite\n", encoding="utf-8")
    loaded = Dictionary.load(path)
    assert loaded.index("hallo") == 4 and loaded.index("ein wort") == 5 and loaded.counts[4] == 9
    path.write_text("hallo 7\nhallo 2\n", encoding="utf-8")
    with pytest.raises(DataUnavailableError, match="listed twice"):
        Dictionary.load(path)


# --------------------------------------------------------------------------------- token storage


def test_token_files_round_trip_atomically(tmp_path):
    sequences = TokenSequences.from_sequences([[5, 6, EOS], [7, EOS], [EOS]])
    write_token_file(tmp_path / "train.de-en.de", sequences, vocabulary_size=100)
    read = read_token_file(tmp_path / "train.de-en.de")
    assert read.tokens.dtype == np.uint16
    assert [read[i].tolist() for i in range(3)] == [[5, 6, EOS], [7, EOS], [EOS]]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["train.de-en.de.offsets.npy", "train.de-en.de.tokens.npy"]  # no temporary file left

    big = TokenSequences.from_sequences([[70_000, EOS]])
    write_token_file(tmp_path / "big", big, vocabulary_size=70_001)
    assert read_token_file(tmp_path / "big").tokens.dtype == np.int32
    with pytest.raises(ValueError, match="outside a vocabulary"):
        write_token_file(tmp_path / "bad", big, vocabulary_size=100)


def _write_fairseq_mmap(prefix: Path, sequences: list[list[int]], dtype: type, code: int) -> None:
    """fairseq's MMapIndexedDataset layout, written independently of the reader under test."""
    sizes = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) * np.dtype(dtype).itemsize
    with open(f"{prefix}.idx", "wb") as file:
        file.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        file.write(struct.pack("<Q", len(sequences)) + sizes.tobytes() + pointers.tobytes())
    with open(f"{prefix}.bin", "wb") as file:
        for sequence in sequences:
            file.write(np.array(sequence, dtype=dtype).tobytes())


def test_fairseq_mmap_reader(tmp_path):
    sequences = [[10, 11, 12, EOS], [13, EOS], [60_000, 14, EOS]]
    _write_fairseq_mmap(tmp_path / "u16", sequences, np.uint16, 8)
    _write_fairseq_mmap(tmp_path / "i32", sequences, np.int32, 4)
    for prefix in ("u16", "i32"):
        read = read_fairseq_indexed(tmp_path / prefix)
        assert [read[i].tolist() for i in range(len(read))] == sequences
        assert read.sizes.tolist() == [4, 2, 3]
    (tmp_path / "legacy.idx").write_bytes(b"TNTIDX\x00\x00" + bytes(40))
    (tmp_path / "legacy.bin").write_bytes(b"")
    with pytest.raises(DataUnavailableError, match="--dataset-impl mmap"):
        read_fairseq_indexed(tmp_path / "legacy")


# -------------------------------------------------------------------------------------- batching


def _check_batch(batch: dict, pairs: ParallelCorpus, max_tokens: int) -> None:
    src, target, prev = batch["src_tokens"], batch["target"], batch["prev_output_tokens"]
    assert src.numel() <= max_tokens and target.numel() <= max_tokens
    assert batch["ntokens"] == int(batch["target_lengths"].sum()) == int(target.ne(PAD).sum())
    assert batch["nsentences"] == len(batch["id"]) == src.shape[0] == target.shape[0]
    for row, index in enumerate(batch["id"].tolist()):
        source_tokens, target_tokens = _unpadded(pairs.source, index), _unpadded(pairs.target, index)
        n, m = len(source_tokens), len(target_tokens)
        assert src[row, src.shape[1] - n :].tolist() == source_tokens  # left-padded
        assert src[row, : src.shape[1] - n].eq(PAD).all()
        assert target[row, :m].tolist() == target_tokens and target[row, m:].eq(PAD).all()  # right-padded
        assert prev[row, :m].tolist() == [EOS, *target_tokens[:-1]] and prev[row, m:].eq(PAD).all()
        assert batch["src_lengths"][row] == n and batch["target_lengths"][row] == m


def test_batches_respect_max_tokens_and_cover_every_pair_once(fake_pairs):
    batches = TokenBatches(fake_pairs, 700, seed=3)
    for epoch in range(2):
        seen = []
        for batch in batches.epoch(epoch):
            _check_batch(batch, fake_pairs, 700)
            seen.extend(batch["id"].tolist())
        assert sorted(seen) == list(range(len(fake_pairs)))
    assert sum(1 for _ in batches.epoch(0)) == len(batches)
    # Length-sorted batching pads little: most of each padded source is real tokens.
    padded = sum(b["src_tokens"].numel() for b in batches.epoch(0))
    assert fake_pairs.source.sizes.sum() / padded > 0.8


def test_epoch_is_a_function_of_seed_and_epoch_and_resumes_exactly(fake_pairs):
    batches = TokenBatches(fake_pairs, 700, seed=3)
    again = TokenBatches(fake_pairs, 700, seed=3)
    full = [b["id"].tolist() for b in batches.epoch(4)]
    assert [b["id"].tolist() for b in again.epoch(4)] == full
    assert [b["id"].tolist() for b in again.epoch(4, start_batch=5)] == full[5:]
    assert [b["id"].tolist() for b in batches.epoch(5)] != full  # a new order every epoch
    other_seed = [b["id"].tolist() for b in TokenBatches(fake_pairs, 700, seed=4).epoch(4)]
    assert other_seed != full
    ordered = TokenBatches(fake_pairs, 700, seed=0, shuffle=False)
    lengths = [int(b["src_lengths"].max()) for b in ordered.epoch(0)]
    assert lengths == sorted(lengths)  # evaluation order: by length


def test_split_batch_by_tokens_weights_and_sentences(fake_pairs):
    batch = next(TokenBatches(fake_pairs, 2000, seed=0).epoch(0))
    micro = split_batch_by_tokens(batch, 250)
    assert len(micro) > 1
    assert sum(weight for _, weight in micro) == pytest.approx(1.0)
    assert torch.cat([m["id"] for m, _ in micro]).tolist() == batch["id"].tolist()
    for part, weight in micro:
        assert part["src_tokens"].numel() <= 250 and part["target"].numel() <= 250
        assert part["src_tokens"].shape[1] == int(part["src_lengths"].max())  # re-padded to its own length
        assert part["target"].shape[1] == int(part["target_lengths"].max())
        assert weight == part["ntokens"] / batch["ntokens"]
        _check_batch(part, fake_pairs, 250)


def test_too_long_sentences_name_the_knob(fake_pairs):
    longest = int(fake_pairs.pair_sizes.max())
    with pytest.raises(ValueError, match=rf"data\.batch_size=100 tokens.*at least {longest}"):
        TokenBatches(fake_pairs, 100, seed=0)
    batches = TokenBatches(fake_pairs, 4000, seed=0, shuffle=False)
    assert batches.longest_pair == longest
    last = list(batches.epoch(0))[-1]  # the longest pairs come last in length order
    with pytest.raises(ValueError, match=rf"microbatch\.size=100 tokens.*at least {longest}"):
        split_batch_by_tokens(last, 100)


# --------------------------------------------------------------------------------------- corpora


def test_phrases_corpus_is_deterministic_with_disjoint_splits():
    pairs = generate_phrase_pairs(seed=0, size=3000)
    assert pairs == generate_phrase_pairs(seed=0, size=3000)
    assert pairs != generate_phrase_pairs(seed=1, size=3000)
    assert len({g for g, _ in pairs}) == len({e for _, e in pairs}) == 3000
    joined = "\n".join(g + " | " + e for g, e in pairs)
    for example in ("äpfel", "geboren", "o'clock", "yesterday", "?"):
        assert example in joined
    assert all(g == g.lower() and e == e.lower() for g, e in pairs)

    src_dict, tgt_dict, splits = load_phrases_corpus(seed=0, size=2500, valid_size=200, test_size=300)
    assert {name: len(split) for name, split in splits.items()} == {"train": 2500, "valid": 200, "test": 300}
    assert len(src_dict) % 8 == 0 and len(tgt_dict) % 8 == 0

    def sentences(split: str, side: str, dictionary: Dictionary) -> set[str]:
        sequences = getattr(splits[split], side)
        return {dictionary.decode(sequences[i].tolist()) for i in range(len(sequences))}

    for side, dictionary in (("source", src_dict), ("target", tgt_dict)):
        train, valid, test = (sentences(s, side, dictionary) for s in ("train", "valid", "test"))
        assert not (train & test) and not (train & valid) and not (valid & test)
    english_to_german = load_phrases_corpus(
        seed=0, size=2500, valid_size=200, test_size=300, src_lang="en", tgt_lang="de"
    )
    assert english_to_german[0] == tgt_dict and english_to_german[1] == src_dict


def test_fake_data_has_iwslt_like_lengths():
    pairs = make_fake_translation(20_000, seed=0)
    assert pairs.source.sizes.mean() == pytest.approx(24, abs=0.5)
    assert pairs.target.sizes.mean() == pytest.approx(23, abs=0.5)
    assert pairs.pair_sizes.max() <= FAKE_MAX_TOKENS and pairs.source.sizes.min() >= 2
    assert np.corrcoef(np.log(pairs.source.sizes), np.log(pairs.target.sizes))[0, 1] > 0.8
    ends = pairs.target.offsets[1:] - 1
    assert (pairs.target.tokens[ends] == EOS).all() and pairs.target.tokens.max() < 6632
    data = load_translation_data("fake", size=100, test_size=50)
    assert (len(data.src_dict), len(data.tgt_dict)) == (8848, 6632)
    assert (len(data.train), len(data.valid), len(data.test)) == (100, 200, 50)
    assert "8,848 (de)" in data.description


def test_missing_or_mismatched_data_gives_clear_errors(tmp_path):
    with pytest.raises(DataUnavailableError) as missing:
        load_translation_data("iwslt14", tmp_path, "de", "en")
    assert isinstance(missing.value, RuntimeError)
    message = str(missing.value)
    for expected in (
        str(tmp_path),
        "data.root",
        f"prepare_iwslt14.py --out {tmp_path}",
        "data=phrases",
        "data=fake",
        "dict.de.txt",
        "train.de-en.de.tokens.npy",
    ):
        assert expected in message
    with pytest.raises(ConfigError, match=r"data\.src_lang='fr'.*de→en"):
        load_translation_data("phrases", None, "fr", "en")
    with pytest.raises(ConfigError, match="phrases, iwslt14, fake"):
        load_translation_data("wmt", None)


def test_fairseq_data_bin_directory_loads_in_both_directions(tmp_path):
    for lang, words in (("de", ["hallo", "welt"]), ("en", ["hello", "world"])):
        dictionary = Dictionary.from_lines([" ".join(words)])
        dictionary.save(tmp_path / f"dict.{lang}.txt")
        for split in ("train", "valid", "test"):
            _write_fairseq_mmap(tmp_path / f"{split}.de-en.{lang}", [[4, 5, EOS], [5, EOS]], np.uint16, 8)
    data = load_translation_data("iwslt14", tmp_path, "de", "en")
    assert data.src_dict.index("hallo") == 4 and data.tgt_dict.index("hello") == 4 and len(data.train) == 2
    reverse = load_translation_data("iwslt14", tmp_path, "en", "de")
    assert reverse.src_dict.index("hello") == 4 and reverse.src_lang == "en"
    with pytest.raises(ConfigError, match=r"data\.src_lang='fr'.*de→en or en→de"):
        load_translation_data("iwslt14", tmp_path, "fr", "en")


# ------------------------------------------------------------------------------------------ BLEU


def test_bleu_helpers():
    assert bleu.remove_bpe("ge@@ sehen hat@@") == "gesehen hat"
    assert bleu._simple_detokenize("it &apos;s a test , isn &apos;t it ?") == "it's a test, isn't it?"
    assert bleu.detokenize("i have three red apples .", "en") == "i have three red apples."

    references = ["the cat sat on the mat .", "there is a dog in the gar@@ den ."]
    perfect = bleu.corpus_bleu(references, references)
    assert perfect == {"bleu": pytest.approx(100.0), "tokenized_bleu": pytest.approx(100.0)}
    assert bleu.corpus_bleu(["x y z w", "q r s t"], references)["tokenized_bleu"] == 0.0

    hypotheses = ["the cat sat on a mat .", "there is the dog in the garden ."]
    scores = bleu.corpus_bleu(hypotheses, references)
    # By hand: 15 hypothesis and 15 reference tokens (no brevity penalty); clipped n-gram matches
    # 13/15, 9/13, 5/11, 3/9 (the second "the" of the second hypothesis matches nothing).
    by_hand = 100 * np.exp(np.mean(np.log([13 / 15, 9 / 13, 5 / 11, 3 / 9])))
    assert scores["tokenized_bleu"] == pytest.approx(by_hand)
    detokenized = [bleu.detokenize(h, "en") for h in hypotheses]
    plain_references = [bleu.detokenize(bleu.remove_bpe(r), "en") for r in references]
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(detokenized, [plain_references]).score)


# -------------------------------------------------------------------------------- IWSLT'14 prep


def test_bpe_learns_subword_nmt_merges(prepare):
    # Sennrich et al.'s example; ties in count go to the larger pair, as subword-nmt's max((count, pair)).
    codes = prepare.learn_bpe({"low": 5, "lower": 2, "newest": 6, "widest": 3}, 4)
    assert codes == [("s", "t</w>"), ("e", "st</w>"), ("l", "o"), ("w", "est</w>")]
    encoder = prepare.BytePairEncoder(codes)
    assert encoder("lowest newer") == "lo@@ west n@@ e@@ w@@ e@@ r"
    assert bleu.remove_bpe(encoder("lowest newer")) == "lowest newer"


def _simple_tokenizer(line: str) -> str:
    return " ".join(re.findall(r"\w+|[^\w\s]", line))


TOKENIZERS = {"de": _simple_tokenizer, "en": _simple_tokenizer}


def _synthetic_archive(path: Path, prepare) -> None:
    """A tiny de-en.tgz laid out like the IWSLT'14 release."""
    pairs = [(f"Das ist Satz {i} .", f"This is sentence {i} .") for i in range(60)]
    header = [
        "<url>http://www.ted.com/talks/x.html</url>",
        "<keywords>talks</keywords>",
        "<talkid>1</talkid>",
    ]
    files = {
        "train.tags.de-en.de": header
        + ["<title>Ein Titel</title>"]
        + [g for g, _ in pairs]
        + ["eins zwei drei vier", " ".join(["wort"] * 180)],
        "train.tags.de-en.en": header
        + ["<title>A title</title>"]
        + [e for _, e in pairs]
        + ["one", " ".join(["word"] * 180)],
    }
    for name in prepare.TEST_SETS:
        for lang in ("de", "en"):
            files[f"{name}.de-en.{lang}.xml"] = [
                "<doc>",
                f'<seg id="1"> {name} {lang} Eins </seg>',
                f'<seg id="2">It\u2019s {name}</seg>',
                "</doc>",
            ]
    with tarfile.open(path, "w:gz") as tar:
        for name, lines in files.items():
            payload = ("\n".join(lines) + "\n").encode("utf-8")
            info = tarfile.TarInfo(f"de-en/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


def test_prepare_pipeline_on_a_synthetic_release(prepare, tmp_path):
    archive = tmp_path / "de-en.tgz"
    _synthetic_archive(archive, prepare)
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    out = tmp_path / "iwslt14"
    # The download step reads the archive from a file:// URL: the real code path, no network.
    summary = prepare.prepare_iwslt14(
        out, urls=[archive.as_uri()], md5=md5, merges=200, tokenizers=TOKENIZERS
    )
    # 61 pairs survive cleaning (title + 60; the 4:1 and 180-token pairs go); every 23rd is valid.
    assert summary["sentences"] == {"train": 59, "valid": 2, "test": 10}
    assert summary["md5"] == md5 and 0 < summary["bpe_merges"] <= 200
    test_english = (out / "test.en").read_text(encoding="utf-8").splitlines()
    assert [bleu.remove_bpe(line) for line in test_english[:2]] == [
        "iwslt14 . ted . dev2010 en eins",
        "it ' s iwslt14 . ted . dev2010",
    ]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left

    data = load_translation_data("iwslt14", out, "de", "en")
    assert (len(data.train), len(data.valid), len(data.test)) == (59, 2, 10)
    train_german = (out / "train.de").read_text(encoding="utf-8").splitlines()
    decoded = data.src_dict.decode(data.train.source[0].tolist())
    assert decoded == train_german[0] and bleu.remove_bpe(decoded) == "ein titel"
    assert Dictionary.load(out / "dict.en.txt") == data.tgt_dict and len(data.tgt_dict) % 8 == 0

    with pytest.raises(prepare.PreparationError, match="not empty"):
        prepare.prepare_iwslt14(out, archive=archive, md5=md5, tokenizers=TOKENIZERS)
    broken = tmp_path / "broken"
    with pytest.raises(prepare.PreparationError, match="MD5"):
        prepare.prepare_iwslt14(broken, archive=archive, md5="0" * 32, tokenizers=TOKENIZERS)
    assert not broken.exists()


def test_prepare_offline_fails_within_seconds(prepare, tmp_path):
    silent = socket.socket()  # accepts connections (backlog) but never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    refused = socket.socket()  # a port nobody listens on
    refused.bind(("127.0.0.1", 0))
    urls = [
        f"http://127.0.0.1:{refused.getsockname()[1]}/de-en.tgz",
        f"http://127.0.0.1:{silent.getsockname()[1]}/de-en.tgz",
    ]
    out = tmp_path / "iwslt14"
    started = time.monotonic()
    try:
        with pytest.raises(prepare.PreparationError) as error:
            prepare.prepare_iwslt14(out, urls=urls, timeout_s=1.0, tokenizers=TOKENIZERS)
    finally:
        silent.close()
        refused.close()
    assert time.monotonic() - started < 5
    message = str(error.value)
    for expected in ("could not download", "--archive de-en.tgz", "data=phrases", "data=fake", urls[0]):
        assert expected in message
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_prepare_without_sacremoses_says_how_to_install(prepare, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "sacremoses", None)
    with pytest.raises(prepare.PreparationError, match="pip install sacremoses"):
        prepare.moses_tokenizer("de")
