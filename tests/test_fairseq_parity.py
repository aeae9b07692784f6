"""Parity with fairseq itself (optional extra; skipped when fairseq is not installed).

fairseq 0.12.2 from PyPI does not import on Python 3.11 (its dataclass configs use mutable defaults),
so the extra is a 3.11 fork: ``pip install bitarray regex cffi cython`` then ``pip install --no-deps
--no-build-isolation fairseq-fixed==0.12.3.1`` (builds its C++/Cython parts against the installed torch;
``--no-deps`` because it pins hydra-core 1.3.2 / omegaconf 2.3.0 and wants torchaudio, which
lightconv does not use). ``ve-fairseq==0.12.3`` (a prebuilt wheel, no pins) passes as well. Checked here:

- the same weights give the same logits in fairseq's ``lightconv_iwslt_de_en`` (dynamic convolutions)
  and in ``DynamicConvModel``, teacher forcing and step-by-step decoding, in float64;
- both have 38,691,840 parameters at IWSLT'14 size;
- fairseq's ``mmap`` data-bin files and ``dict.xx.txt`` files read back as fairseq reads them.

The forks carry fairseq's TorchScript-able ``lightconv``, whose names differ from 0.12.2's (and ours):
encoder ``layer_norm1``/``layer_norm2`` for ``layer_norms.0``/``.1``, ``decoder.output_projection.weight``
for ``decoder.embed_out``, and a ``conv_bias`` of shape [1, 1, d] registered in every convolution but
added only when ``has_conv_bias`` is set (the stock model never sets it). ``_to_fairseq`` maps the names.
"""

from __future__ import annotations

import argparse
import copy
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra.core.config_store import ConfigStore

from recipes.dc_iwslt.corpus import SPLITS, load_translation_data
from recipes.dc_iwslt.data import EOS, PAD, TokenSequences, read_fairseq_indexed
from recipes.dc_iwslt.data import Dictionary as OurDictionary
from recipes.dc_iwslt.model import Architecture, DynamicConvModel

# Importing fairseq stores its own "config" (and more) in Hydra's process-wide ConfigStore, which
# would break every later lowmem compose in this test process: keep Hydra's store as it was.
_hydra_store = copy.deepcopy(ConfigStore.instance().repo)
try:
    fairseq = pytest.importorskip("fairseq")

    from fairseq import utils as fairseq_utils
    from fairseq.data import Dictionary as FairseqDictionary
    from fairseq.data.indexed_dataset import MMapIndexedDataset, make_builder
    from fairseq.models.lightconv import LightConvModel, lightconv_iwslt_de_en
finally:
    ConfigStore.instance().repo = _hydra_store

SMALL = dict(
    encoder_layers=3,
    decoder_layers=3,
    embed_dim=32,
    ffn_dim=64,
    heads=4,
    encoder_kernel_sizes=(3, 7, 15),
    decoder_kernel_sizes=(3, 7, 15),
)
SRC_VOCAB, TGT_VOCAB = 50, 40


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """Models this small only pay for thread synchronisation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- building both models ---------------------------------------------------------------------


def _fairseq_dictionary(size: int) -> FairseqDictionary:
    """A fairseq dictionary of ``size`` symbols (its 4 special symbols included)."""
    dictionary = FairseqDictionary()
    for i in range(size - len(dictionary)):
        dictionary.add_symbol(f"w{i}")
    return dictionary


def _fairseq_model(src_vocab: int, tgt_vocab: int, **arch: object) -> LightConvModel:
    """fairseq's ``lightconv_iwslt_de_en`` with dynamic convolutions and our architecture ``arch``."""
    a = Architecture(**arch)
    args = argparse.Namespace(
        encoder_conv_type="dynamic",
        decoder_conv_type="dynamic",
        weight_softmax=a.weight_softmax,
        encoder_layers=a.encoder_layers,
        decoder_layers=a.decoder_layers,
        encoder_embed_dim=a.embed_dim,
        decoder_embed_dim=a.embed_dim,
        encoder_ffn_embed_dim=a.ffn_dim,
        decoder_ffn_embed_dim=a.ffn_dim,
        encoder_attention_heads=a.heads,
        decoder_attention_heads=a.heads,
        encoder_kernel_size_list=list(a.encoder_kernel_sizes),
        decoder_kernel_size_list=list(a.decoder_kernel_sizes),
        dropout=a.dropout,
        weight_dropout=a.weight_dropout,
        attention_dropout=a.attention_dropout,
        relu_dropout=a.relu_dropout,
        input_dropout=a.input_dropout,
    )
    lightconv_iwslt_de_en(args)  # fills the remaining defaults (no GLU, post-norm, sinusoidal positions, ...)
    task = types.SimpleNamespace(
        source_dictionary=_fairseq_dictionary(src_vocab), target_dictionary=_fairseq_dictionary(tgt_vocab)
    )
    model = LightConvModel.build_model(args, task)
    convs = [layer.conv for layer in (*model.encoder.layers, *model.decoder.layers)]
    if a.conv_bias:
        if not all(hasattr(conv, "has_conv_bias") for conv in convs):
            pytest.skip("this fairseq's lightconv has no switch for the convolution bias")
        for conv in convs:
            conv.has_conv_bias = True  # fairseq's lightconv never asks for it; the module supports it
    return model


def _to_fairseq(state_dict: dict[str, torch.Tensor], model: LightConvModel) -> dict[str, torch.Tensor]:
    """Our state dict under the names and shapes of ``model``'s (0.12.2's names are ours already)."""
    theirs = model.state_dict()
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        target = name
        if target not in theirs:
            target = target.replace(".layer_norms.0.", ".layer_norm1.").replace(".layer_norms.1.", ".layer_norm2.")
            if target == "decoder.embed_out":
                target = "decoder.output_projection.weight"
        assert target in theirs, f"{name} has no counterpart in fairseq's model"
        renamed[target] = tensor.reshape(theirs[target].shape)
    for name, tensor in theirs.items():
        if name in renamed:
            continue
        if name.endswith(".version"):
            renamed[name] = tensor  # fairseq's format version buffers
        elif name.endswith(".conv.conv_bias") and not model.get_submodule(name.rsplit(".", 1)[0]).has_conv_bias:
            renamed[name] = torch.zeros_like(tensor)  # registered by the fork but never added
        else:
            raise AssertionError(f"fairseq's {name} has no counterpart in ours")
    return renamed


def _model_pair(conv_bias: bool) -> tuple[DynamicConvModel, LightConvModel]:
    """Ours (random non-zero biases, so none can hide) and fairseq's with the same weights, float64, eval."""
    ours = DynamicConvModel(SRC_VOCAB, TGT_VOCAB, padding_idx=PAD, conv_bias=conv_bias, **SMALL).double().eval()
    with torch.no_grad():
        for name, parameter in ours.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.1)
    theirs = _fairseq_model(SRC_VOCAB, TGT_VOCAB, conv_bias=conv_bias, **SMALL).double().eval()
    theirs.load_state_dict(_to_fairseq(ours.state_dict(), theirs), strict=True)
    return ours, theirs


def _exact_attention_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """fairseq's attention softmax runs in float32 whatever the input dtype; make it float64 for exact
    comparisons (the stock behaviour is compared with a float32 tolerance separately)."""
    monkeypatch.setattr(fairseq_utils, "softmax", lambda x, dim, onnx_trace=False: F.softmax(x, dim=dim))


def _batch(source_length: int, target_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fairseq's batch layout: source left-padded and ending in ``</s>``, ``prev_output_tokens``
    starting with ``</s>`` and right-padded; three sentences of different lengths."""
    src = torch.randint(4, SRC_VOCAB, (3, source_length))
    src[:, -1] = EOS
    src[1, :3] = PAD
    src[2, :5] = PAD
    prev = torch.randint(4, TGT_VOCAB, (3, target_length))
    prev[:, 0] = EOS
    prev[1, -2:] = PAD
    return src, src.ne(PAD).sum(1), prev


def _fairseq_step_logits(model: LightConvModel, src: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """fairseq's incremental decoding, one target token at a time -> logits [B, T, V]."""
    encoder_out = model.encoder(src, src.ne(PAD).sum(1))
    state: dict = {}
    steps = [
        model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)[0][:, -1]
        for t in range(prev.size(1))
    ]
    return torch.stack(steps, dim=1)


def _our_step_logits(model: DynamicConvModel, src: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    state = model.decoder.init_state(model.encoder(src))
    return torch.stack([model.decoder.step(prev[:, t], state) for t in range(prev.size(1))], dim=1)


# --- the model --------------------------------------------------------------------------------


@pytest.mark.parametrize("conv_bias", [True, False], ids=["conv-bias", "stock"])
def test_same_weights_same_logits(conv_bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Teacher forcing on targets at least as long as the longest decoder kernel: equal to rounding."""
    ours, theirs = _model_pair(conv_bias)
    src, src_lengths, prev = _batch(source_length=20, target_length=max(SMALL["decoder_kernel_sizes"]) + 2)
    with torch.no_grad():
        expected = theirs(src, src_lengths, prev)[0]
        actual = ours(src, src_lengths, prev)
        # Stock fairseq: its attention softmax is float32, so agreement is to float32 precision.
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
        _exact_attention_softmax(monkeypatch)
        torch.testing.assert_close(actual, theirs(src, src_lengths, prev)[0], rtol=1e-12, atol=1e-12)
        encoder_out = theirs.encoder(src, src_lengths)["encoder_out"][0]
        torch.testing.assert_close(ours.encoder(src, src_lengths).out, encoder_out, rtol=1e-12, atol=1e-12)


def test_step_by_step_decoding_matches_fairseqs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Incremental decoding, across prefixes shorter and longer than the kernels: ours equals fairseq's."""
    _exact_attention_softmax(monkeypatch)
    ours, theirs = _model_pair(conv_bias=True)
    src, _, prev = _batch(source_length=12, target_length=18)
    prev[1, -2:] = 9  # step-by-step decoding feeds real tokens only
    with torch.no_grad():
        expected = _fairseq_step_logits(theirs, src, prev)
        torch.testing.assert_close(_our_step_logits(ours, src, prev), expected, rtol=1e-12, atol=1e-12)
        # Teacher forcing agrees with both, short prefixes included (see the next test).
        torch.testing.assert_close(ours(src, src.ne(PAD).sum(1), prev), expected, rtol=1e-12, atol=1e-12)


def test_short_targets_differ_where_lowmem_documents_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Targets shorter than a decoder kernel (T < K): fairseq's teacher forcing normalises the causal
    kernel over its last T taps only, while its own step-by-step decoding (and lowmem, in both modes)
    normalises over all K taps. So lowmem equals fairseq's decoding, not fairseq's training forward."""
    _exact_attention_softmax(monkeypatch)
    ours, theirs = _model_pair(conv_bias=True)
    src, src_lengths, prev = _batch(source_length=12, target_length=5)  # 5 < 7 and 15
    prev[1, -2:] = 9
    with torch.no_grad():
        teacher_forced = theirs(src, src_lengths, prev)[0]
        step_by_step = _fairseq_step_logits(theirs, src, prev)
        ours_logits = ours(src, src_lengths, prev)
    torch.testing.assert_close(ours_logits, step_by_step, rtol=1e-12, atol=1e-12)
    assert (teacher_forced - step_by_step).abs().max() > 1e-3  # fairseq disagrees with itself
    # Only the layers with K > T differ: with kernels 3, 3, 3 both of fairseq's paths agree.
    kernels = dict(SMALL, decoder_kernel_sizes=(3, 3, 3))
    model = _fairseq_model(SRC_VOCAB, TGT_VOCAB, conv_bias=False, **kernels).double().eval()
    with torch.no_grad():
        torch.testing.assert_close(
            model(src, src_lengths, prev)[0], _fairseq_step_logits(model, src, prev), rtol=1e-12, atol=1e-12
        )


def test_full_size_parameter_count() -> None:
    """38,691,840 parameters with IWSLT'14's 8,848 / 6,632 types, in both implementations.

    In the fork 6,656 of them (13 convolution biases of 512) are registered but unused: the stock
    model computes with 38,685,184, where ours uses its convolution biases (``conv_bias=True``).
    """
    with torch.device("meta"):
        ours = DynamicConvModel(8848, 6632)
        theirs = _fairseq_model(8848, 6632, conv_bias=False)
    assert sum(p.numel() for p in ours.parameters()) == 38_691_840
    assert sum(p.numel() for p in theirs.parameters()) == 38_691_840
    unused = sum(
        p.numel() for name, p in theirs.named_parameters() if name.endswith("conv.conv_bias")
    )  # has_conv_bias is False in every layer of the stock model
    assert unused == 13 * 512
    assert sum(p.numel() for p in theirs.parameters()) - unused == 38_685_184
    assert [layer.conv.kernel_size for layer in theirs.encoder.layers] == [3, 7, 15, 31, 31, 31, 31]
    assert [layer.conv.kernel_size for layer in theirs.decoder.layers] == [3, 7, 15, 31, 31, 31]


# --- data-bin files ---------------------------------------------------------------------------


def _lines(count: int, words: int, seed: int) -> list[str]:
    """Whitespace-tokenised sentences over a Zipf-like vocabulary (so counts tie and differ)."""
    rng = np.random.default_rng(seed)
    vocabulary = [f"tok{i}" for i in range(words)]
    weights = 1.0 / np.arange(1, words + 1)
    return [" ".join(rng.choice(vocabulary, size=rng.integers(1, 12), p=weights / weights.sum())) for _ in range(count)]


def _binarize(prefix: Path, sequences: list[torch.Tensor], vocab_size: int) -> None:
    """fairseq's own writer: ``<prefix>.bin`` and ``<prefix>.idx`` (``mmap``)."""
    builder = make_builder(f"{prefix}.bin", impl="mmap", vocab_size=vocab_size)
    for sequence in sequences:
        builder.add_item(sequence)
    builder.finalize(f"{prefix}.idx")


def _assert_same_sequences(ours: TokenSequences, prefix: Path) -> None:
    """``ours`` holds what fairseq's own reader finds in ``<prefix>.bin/.idx``."""
    theirs = MMapIndexedDataset(str(prefix))
    assert len(ours) == len(theirs)
    np.testing.assert_array_equal(ours.sizes, theirs.sizes)
    for i in range(len(theirs)):
        np.testing.assert_array_equal(np.asarray(ours[i], dtype=np.int64), theirs[i].numpy().astype(np.int64))


def _assert_same_dictionary(ours: OurDictionary, theirs: FairseqDictionary) -> None:
    """Same symbols at the same ids, same counts past the special symbols (which fairseq counts as 1 and
    we as 0; no file records them)."""
    assert ours.symbols == theirs.symbols
    assert (ours.nspecial, ours.counts[ours.nspecial :]) == (theirs.nspecial, theirs.count[theirs.nspecial :])


@pytest.mark.parametrize("vocab_size", [50, 70_000], ids=["uint16", "uint32"])
def test_read_fairseq_indexed_reads_fairseqs_mmap_files(tmp_path: Path, vocab_size: int) -> None:
    """Every sequence, in every dtype fairseq picks for token ids (uint16 below 65,500 types, else uint32)."""
    generator = torch.Generator().manual_seed(0)
    sequences = [
        torch.cat([torch.randint(4, vocab_size, (int(n),), generator=generator), torch.tensor([EOS])])
        for n in torch.randint(0, 30, (40,), generator=generator)
    ]
    prefix = tmp_path / "train.de-en.de"
    _binarize(prefix, sequences, vocab_size)
    _assert_same_sequences(read_fairseq_indexed(prefix), prefix)


def test_iwslt14_loader_reads_a_fairseq_data_bin(tmp_path: Path) -> None:
    """A data-bin directory written by fairseq's API (dictionaries and the three splits) loads with our
    corpus loader, in both directions, and our dictionaries agree with fairseq's."""
    text = {split: {"de": _lines(30, 40, seed), "en": _lines(30, 30, seed + 10)} for seed, split in enumerate(SPLITS)}
    dictionaries: dict[str, FairseqDictionary] = {}
    for lang in ("de", "en"):
        dictionary = FairseqDictionary()
        for line in text["train"][lang]:
            for word in line.split():
                dictionary.add_symbol(word)
        dictionary.finalize(padding_factor=8)  # fairseq-preprocess's ordering and padding
        dictionary.save(str(tmp_path / f"dict.{lang}.txt"))
        dictionaries[lang] = dictionary
        # Our dictionary construction and encoding are fairseq's.
        built = OurDictionary.from_lines(text["train"][lang])
        _assert_same_dictionary(built, dictionary)
        for line in [*text["valid"][lang], "unseen tok0 words"]:  # unknown words included
            expected = dictionary.encode_line(line, add_if_not_exist=False).long()
            assert torch.equal(built.encode(line), expected)
        for split in SPLITS:
            sequences = [dictionary.encode_line(line, add_if_not_exist=False) for line in text[split][lang]]
            _binarize(tmp_path / f"{split}.de-en.{lang}", sequences, len(dictionary))

    for src_lang, tgt_lang in (("de", "en"), ("en", "de")):
        data = load_translation_data("iwslt14", root=tmp_path, src_lang=src_lang, tgt_lang=tgt_lang)
        _assert_same_dictionary(data.src_dict, dictionaries[src_lang])
        _assert_same_dictionary(data.tgt_dict, dictionaries[tgt_lang])
        for split in SPLITS:
            corpus = getattr(data, split)
            _assert_same_sequences(corpus.source, tmp_path / f"{split}.de-en.{src_lang}")
            _assert_same_sequences(corpus.target, tmp_path / f"{split}.de-en.{tgt_lang}")
