"""DynamicConv recipe (SPEC §3.2): the model, beam search and checkpoint averaging.

Small configurations (d=32, 2+2 layers, kernels 3 and 7) except for the parameter count. Equivalence
tests run in float64 and eval mode so that differences are the algorithm's, not rounding's.
"""

import pytest
import torch
import torch.nn.functional as F

from lowmem.residual import residual_stacks, run_sequentially, set_block_executor
from recipes.dc_iwslt.checkpoint_average import average_state_dicts
from recipes.dc_iwslt.data import EOS, PAD
from recipes.dc_iwslt.model import DynamicConv, DynamicConvModel
from recipes.dc_iwslt.search import beam_search, greedy_decode
from tests.helpers import SMALL_DC_ARCH

SMALL = SMALL_DC_ARCH
SRC_VOCAB, TGT_VOCAB = 20, 17


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Models this small only pay for thread synchronisation (seconds per test on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_model(**overrides) -> DynamicConvModel:
    """An eval-mode float64 model with non-zero biases (zero-initialised ones would hide their use)."""
    model = DynamicConvModel(SRC_VOCAB, TGT_VOCAB, **{**SMALL, **overrides}).double().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("bias", "conv_bias")):
                parameter.normal_(0.0, 0.1)
    return model


def random_tokens(batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(4, vocab, (batch, length))  # ids 0-3 are fairseq's special symbols


# --- architecture -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_model() -> DynamicConvModel:
    return DynamicConvModel(8848, 6632)  # IWSLT'14 De→En dictionaries; built once, never run


def test_full_model_has_the_reports_parameter_count(full_model):
    total = sum(p.numel() for p in full_model.parameters())
    assert total == 38_691_840
    # fairseq's stock lightconv_iwslt_de_en (no convolution bias) + one 512-vector per layer (7 + 6).
    conv_biases = sum(p.numel() for name, p in full_model.named_parameters() if name.endswith("conv_bias"))
    assert (total - conv_biases, conv_biases) == (38_685_184, 13 * 512)
    kernels = [layer.conv.kernel_size for layer in full_model.encoder.layers]
    assert kernels == [3, 7, 15, 31, 31, 31, 31]
    assert [layer.conv.kernel_size for layer in full_model.decoder.layers] == [3, 7, 15, 31, 31, 31]


def test_sparsifiable_weights_are_fully_connected_weights_and_embeddings(full_model):
    parameters = dict(full_model.named_parameters())
    names = full_model.sparsifiable_weights()
    assert len(names) == len(set(names)) and set(names) <= parameters.keys()
    assert {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "decoder.embed_out",
            "encoder.layers.6.conv.weight_linear.weight", "decoder.layers.5.encoder_attn.q_proj.weight",
            "decoder.layers.5.encoder_attn.out_proj.weight"} <= set(names)
    assert all(parameters[name].dim() == 2 for name in names)
    dense = parameters.keys() - set(names)
    assert all(name.endswith(("bias", "norm.weight", "norms.0.weight", "norms.1.weight")) for name in dense)
    fraction = sum(parameters[name].numel() for name in names) / sum(p.numel() for p in parameters.values())
    assert fraction > 0.98  # the report: "over 98%"; here 99.78%


def test_parameter_names_are_fairseqs():
    model = DynamicConvModel(SRC_VOCAB, TGT_VOCAB, **SMALL)
    shared = ["linear1.weight", "linear1.bias", "conv.weight_linear.weight", "conv.conv_bias",
              "linear2.weight", "linear2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    encoder = shared + [f"layer_norms.{i}.{p}" for i in (0, 1) for p in ("weight", "bias")]
    norms = ("conv_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")
    decoder = shared + [f"{norm}.{p}" for norm in norms for p in ("weight", "bias")]
    decoder += [f"encoder_attn.{proj}.{p}" for proj in ("q_proj", "k_proj", "v_proj", "out_proj")
                for p in ("weight", "bias")]
    expected = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "decoder.embed_out"}
    expected |= {f"encoder.layers.{i}.{name}" for i in range(2) for name in encoder}
    expected |= {f"decoder.layers.{i}.{name}" for i in range(2) for name in decoder}
    state = model.state_dict()
    assert set(state) == expected
    assert state["encoder.layers.1.conv.weight_linear.weight"].shape == (4 * 7, 32)  # heads x taps
    assert state["decoder.embed_out"].shape == (TGT_VOCAB, 32)


def test_layers_are_the_residual_blocks_without_renaming_parameters():
    model = small_model()
    assert residual_stacks(model) == [model.encoder, model.decoder]
    calls = []

    def counting_executor(blocks, x, context):
        calls.append(len(blocks))
        return run_sequentially(blocks, x, context)

    names_before = list(model.state_dict())
    src, prev = random_tokens(2, 6, SRC_VOCAB), random_tokens(2, 4, TGT_VOCAB)
    expected = model(src, None, prev)
    set_block_executor(model, counting_executor)
    assert torch.equal(model(src, None, prev), expected)
    assert calls == [2, 2] and list(model.state_dict()) == names_before


def test_every_parameter_gets_a_gradient_in_training_mode():
    model = DynamicConvModel(SRC_VOCAB, TGT_VOCAB, **SMALL).train()
    src, prev = random_tokens(3, 6, SRC_VOCAB), random_tokens(3, 5, TGT_VOCAB)
    src[0, 4:] = PAD
    logits = model(src, None, prev)
    F.cross_entropy(logits.flatten(0, 1), random_tokens(3, 5, TGT_VOCAB).flatten()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_bad_architecture_knobs_name_the_knob():
    with pytest.raises(ValueError, match="decoder_kernel_sizes"):
        DynamicConvModel(SRC_VOCAB, TGT_VOCAB, **{**SMALL, "decoder_kernel_sizes": (3, 7, 15)})
    with pytest.raises(ValueError, match="model.heads=5"):
        DynamicConvModel(SRC_VOCAB, TGT_VOCAB, **{**SMALL, "heads": 5})
    with pytest.raises(TypeError, match="kernel_size"):
        DynamicConvModel(SRC_VOCAB, TGT_VOCAB, kernel_size=3)
    # Depth other than fairseq's: its kernel schedule 3, 7, 15, 31, 31, ... is followed.
    shallow = DynamicConvModel(SRC_VOCAB, TGT_VOCAB, encoder_layers=5, decoder_layers=1, embed_dim=32)
    assert shallow.arch.encoder_kernel_sizes == (3, 7, 15, 31, 31)
    assert shallow.arch.decoder_kernel_sizes == (3,)


# --- dynamic convolution ------------------------------------------------------------------------


def loop_dynamic_conv(conv: DynamicConv, x: torch.Tensor) -> torch.Tensor:
    """The definition, one output position and tap at a time, x [T, B, C]: kernels softmax-normalised
    over all K taps; taps outside the sequence read zeros."""
    T, B, C = x.shape
    H, K, left = conv.num_heads, conv.kernel_size, conv.padding_l
    kernels = torch.softmax((x @ conv.weight_linear.weight.T).view(T, B, H, K), dim=-1)
    out = torch.zeros_like(x)
    for t in range(T):
        for k in range(K):
            source = t - left + k
            if 0 <= source < T:
                out[t] += kernels[t, :, :, k].repeat_interleave(C // H, dim=1) * x[source]
    return out + conv.conv_bias


@pytest.mark.parametrize("kernel_size", [1, 3, 4, 7])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [2, 5, 12])
def test_dynamic_conv_matches_the_definition(kernel_size, causal, length):
    padding_l = kernel_size - 1 if causal else (kernel_size - 1) // 2
    conv = DynamicConv(16, kernel_size, num_heads=4, padding_l=padding_l).double().eval()
    torch.nn.init.normal_(conv.conv_bias)
    x = torch.randn(length, 3, 16, dtype=torch.float64)
    torch.testing.assert_close(conv(x), loop_dynamic_conv(conv, x), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("decoder_kernels", "length"),
                         [((3, 7), 12), ((3, 7), 5), ((3, 31), 5), ((31, 31), 1)])
def test_incremental_decoding_equals_full_sequence_decoding(decoder_kernels, length):
    # Targets shorter than the kernel are the SPEC §3.2 trap: both paths must normalise over all K taps.
    model = small_model(decoder_kernel_sizes=decoder_kernels)
    src = random_tokens(3, 9, SRC_VOCAB)
    src[1, 6:] = PAD
    prev = random_tokens(3, length, TGT_VOCAB)
    prev[:, 0] = EOS
    with torch.no_grad():
        full = model(src, torch.tensor([9, 6, 9]), prev)
        state = model.decoder.init_state(model.encoder(src))
        stepwise = torch.stack([model.decoder.step(prev[:, t], state) for t in range(length)], dim=1)
    assert (full - stepwise).abs().max() <= 1e-10


def test_decoder_state_reorder_selects_and_repeats_rows():
    model = small_model()
    src, prev = random_tokens(2, 7, SRC_VOCAB), random_tokens(2, 4, TGT_VOCAB)
    order = torch.tensor([1, 1, 0])
    with torch.no_grad():
        expected = model(src[order], None, prev[order])
        state = model.decoder.init_state(model.encoder(src))
        model.decoder.step(prev[:, 0], state)
        model.decoder.step(prev[:, 1], state)
        state.reorder(order)
        steps = [model.decoder.step(prev[order, t], state) for t in (2, 3)]
    torch.testing.assert_close(torch.stack(steps, dim=1), expected[:, 2:], rtol=0, atol=1e-10)


def test_source_padding_does_not_leak_into_real_positions():
    model = small_model()
    src = random_tokens(2, 8, SRC_VOCAB)
    src[1, 5:] = PAD
    prev = random_tokens(2, 6, TGT_VOCAB)
    more_padding = F.pad(src, (0, 11), value=PAD)
    # fairseq pads sources on the left by default: positions count real tokens only, so that is alike.
    left_padded = torch.stack([src[0], torch.cat([src[1, 5:], src[1, :5]])])
    with torch.no_grad():
        encoded, padded, left = (model.encoder(tokens).out.transpose(0, 1)  # [B, S, d]
                                 for tokens in (src, more_padding, left_padded))
        real = src.ne(PAD)
        torch.testing.assert_close(padded[:, :8][real], encoded[real], rtol=0, atol=1e-12)
        torch.testing.assert_close(left[1, 3:], encoded[1, :5], rtol=0, atol=1e-12)
        logits = model(src, None, prev)
        torch.testing.assert_close(model(more_padding, None, prev), logits, rtol=0, atol=1e-12)
        torch.testing.assert_close(model(left_padded, None, prev), logits, rtol=0, atol=1e-12)


# --- search -----------------------------------------------------------------------------------

SYMBOLS = 10  # toy vocabulary: fairseq's 4 special ids + 10 symbols


def reversal_batch(size: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
    """Source: 3-8 random symbols + EOS; target: the symbols reversed + EOS (right-padded)."""
    lengths = torch.randint(3, 9, (size,), generator=generator)
    src, prev, target = (torch.full((size, 9), PAD) for _ in range(3))
    for i, n in enumerate(lengths.tolist()):
        symbols = torch.randint(4, 4 + SYMBOLS, (n,), generator=generator)
        src[i, : n + 1] = torch.cat([symbols, torch.tensor([EOS])])
        target[i, : n + 1] = torch.cat([symbols.flip(0), torch.tensor([EOS])])
        prev[i, : n + 1] = torch.cat([torch.tensor([EOS]), symbols.flip(0)])  # fairseq's teacher forcing
    return src, lengths + 1, prev, target


@pytest.fixture(scope="module")
def reverser() -> DynamicConvModel:
    """A small model taught to reverse sequences: 250 Adam steps, ~5-10 s on one CPU thread."""
    torch.manual_seed(0)
    vocab = 4 + SYMBOLS
    no_dropout = dict(dropout=0.0, weight_dropout=0.0, attention_dropout=0.0)
    model = DynamicConvModel(vocab, vocab, **SMALL, **no_dropout)
    steps = 250
    optimizer = torch.optim.Adam(model.parameters(), lr=4e-3, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    for _ in range(steps):
        src, src_lengths, prev, target = reversal_batch(64)
        logits = model(src, src_lengths, prev)
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return model.eval()


def test_greedy_and_beam_search_reverse_sequences(reverser):
    src, src_lengths, _, target = reversal_batch(32, torch.Generator().manual_seed(1))
    expected = [row[: n - 1] for row, n in zip(target.tolist(), src_lengths.tolist(), strict=True)]
    assert greedy_decode(reverser, src, src_lengths) == expected
    assert beam_search(reverser, src, src_lengths, beam=5) == expected
    assert beam_search(reverser, src, src_lengths, beam=1) == expected


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_beam_of_one_is_greedy_on_an_untrained_model(length_penalty):
    model = small_model().float()
    src = random_tokens(6, 7, SRC_VOCAB)
    src[2, 4:] = PAD
    src_lengths = src.ne(PAD).sum(dim=1)
    greedy = greedy_decode(model, src, src_lengths, max_len_b=5)
    assert beam_search(model, src, src_lengths, beam=1, max_len_b=5, length_penalty=length_penalty) == greedy


def test_search_respects_the_length_cap_and_never_emits_padding():
    model = small_model().float().train()
    src = random_tokens(4, 6, SRC_VOCAB)
    src_lengths = torch.full((4,), 6)
    for outputs in (greedy_decode(model, src, src_lengths, max_len_a=0.5, max_len_b=1),
                    beam_search(model, src, src_lengths, beam=3, max_len_a=0.5, max_len_b=1)):
        assert len(outputs) == 4
        assert all(1 <= len(tokens) <= 4 and PAD not in tokens and EOS not in tokens for tokens in outputs)
    assert model.training  # the search switched to eval mode only while decoding


# --- checkpoint averaging -----------------------------------------------------------------------


def test_average_state_dicts_matches_a_hand_computed_average(tmp_path):
    states = [
        {"w": torch.tensor([1.0, 2.0]), "half": torch.tensor([60000.0], dtype=torch.float16),
         "steps": torch.tensor(10)},
        {"w": torch.tensor([3.0, 5.0]), "half": torch.tensor([60000.0], dtype=torch.float16),
         "steps": torch.tensor(20)},
        {"w": torch.tensor([5.0, 11.0]), "half": torch.tensor([36000.0], dtype=torch.float16),
         "steps": torch.tensor(30)},
    ]
    torch.save(states[0], tmp_path / "a.pt")
    torch.save({"model": states[1], "optimizer": {}}, tmp_path / "b.pt")  # a training checkpoint
    average = average_state_dicts([tmp_path / "a.pt", str(tmp_path / "b.pt"), states[2]])
    assert torch.equal(average["w"], torch.tensor([3.0, 6.0]))
    # Summed in FP16, 60000 + 60000 would overflow to inf.
    assert average["half"].dtype == torch.float16 and average["half"].item() == 52000.0
    assert average["steps"].item() == 30  # integer buffers: the last checkpoint's


def test_average_state_dicts_rejects_mismatched_state_dicts():
    with pytest.raises(ValueError, match="different keys"):
        average_state_dicts([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])
    with pytest.raises(ValueError, match="shape"):
        average_state_dicts([{"a": torch.zeros(3)}, {"a": torch.zeros(1)}])
    with pytest.raises(ValueError, match="no state dicts"):
        average_state_dicts([])
