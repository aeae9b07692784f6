"""The output layer and its cross-entropy a chunk at a time (``loss.chunk_tokens``): equal to plain
cross-entropy (FP64 to rounding, FP32 logit gradients bit for bit), the lazy logits keep every
gradient, and the logits no longer set the peak."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowmem
from lowmem.config import ConfigError
from lowmem.losses import linear_cross_entropy
from lowmem.techniques import compact, head_loss
from lowmem.techniques.head_loss import Head, LazyLogits, LossForm, chunk_for, install, validate_chunk_tokens

SGD = ["optim.name=sgd", "optim.lr=0.1", "optim.momentum=0", "optim.nesterov=false", "optim.weight_decay=0",
       "trainer.device=cpu"]


def _worst(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _setup(dtype=torch.float64, tokens=37, features=8, vocab=50, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, features, generator=g, dtype=dtype).requires_grad_()
    layer = nn.Linear(features, vocab, bias=bias).to(dtype)
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[::5] = -100
    return x, layer, target


@pytest.mark.parametrize("chunk", [1, 7, 37, 100])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fp64_equals_plain_cross_entropy(chunk, smoothing, reduction):
    x, layer, target = _setup()
    plain = F.cross_entropy(layer(x), target, label_smoothing=smoothing, reduction=reduction)
    seed = torch.randn(plain.shape, dtype=torch.float64) if reduction == "none" else torch.ones((), dtype=torch.float64)
    want = torch.autograd.grad(plain, (x, layer.weight, layer.bias), seed)
    chunked = linear_cross_entropy(x, layer, target, label_smoothing=smoothing, reduction=reduction, chunk_tokens=chunk)
    got = torch.autograd.grad(chunked, (x, layer.weight, layer.bias), seed)
    assert _worst(chunked.detach(), plain.detach()) < 1e-12
    for g, w in zip(got, want, strict=True):
        assert _worst(g, w) < 1e-12


def test_fp32_equals_plain_to_rounding():
    x, layer, target = _setup(torch.float32, tokens=64, vocab=300)
    want = torch.autograd.grad(F.cross_entropy(layer(x), target), (x, layer.weight, layer.bias))
    got = torch.autograd.grad(linear_cross_entropy(x, layer, target, chunk_tokens=16), (x, layer.weight, layer.bias))
    for g, w in zip(got, want, strict=True):
        assert _worst(g, w) < 1e-5


def test_fp64_weights_with_fp32_logits_have_plain_bits():
    """An FP64 model whose loss narrows its logits to FP32 (transformers' ``.float()``):
    each chunk runs plain's own log-softmax and its backward, so every token's logit gradient has
    plain's FP32 bits and the weights' gradients differ only by FP64 summation order."""
    x, layer, target = _setup(torch.float64, tokens=64, vocab=300)
    layer.__dict__[head_loss._CHUNK_ATTR] = 16
    want = torch.autograd.grad(F.cross_entropy(layer(x).float(), target), (x, layer.weight, layer.bias))
    lazy = Head(layer).lazy(x).float()
    got = torch.autograd.grad(F.cross_entropy(lazy, target), (x, layer.weight, layer.bias))
    for g, w in zip(got, want, strict=True):
        assert _worst(g, w) < 1e-14


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_accumulates_in_fp32(dtype):
    """16-bit weights: the loss in FP32 from the 16-bit logits; the weight's gradient one product over
    all tokens per vocabulary slice: within 16-bit rounding of an FP32 computation on the same operands."""
    x, layer, target = _setup(dtype, tokens=96, vocab=700)
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, layer.weight, layer.bias))
    logits = F.linear(x32, w32, b32).to(dtype).float()  # the 16-bit logits, as the layer rounds them
    ref = F.cross_entropy(logits, target, label_smoothing=0.1)
    want = torch.autograd.grad(ref, (x32, w32, b32))
    loss = linear_cross_entropy(x, layer, target, label_smoothing=0.1, chunk_tokens=10)
    got = torch.autograd.grad(loss, (x, layer.weight, layer.bias))
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) < 1e-5
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        assert _worst(g.float(), w) < 2e-2


def test_fairseq_label_smoothing_form():
    """The DynamicConv recipe's loss: ε spread over the V - 1 other classes, summed over tokens."""
    x, layer, target = _setup(bias=False)
    vocab, eps = 50, 0.1
    log_probs = F.log_softmax(layer(x), -1)
    keep = target.ne(-100)
    nll = -log_probs.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1) * keep
    smooth = -log_probs.sum(-1) * keep
    eps_i = eps / (vocab - 1)
    plain = ((1 - eps - eps_i) * nll + eps_i * smooth).sum()
    form = LossForm.fairseq(vocab, eps, -100)
    layer.__dict__[head_loss._CHUNK_ATTR] = 8
    loss, got_nll = head_loss.linear_cross_entropy_per_token(x, Head(layer), target, form, 8)
    assert _worst(loss.sum().detach(), plain.detach()) < 1e-13
    assert _worst(got_nll.sum(), nll.sum().detach()) < 1e-13
    want = torch.autograd.grad(plain, (x, layer.weight))
    got = torch.autograd.grad(loss.sum(), (x, layer.weight))
    for g, w in zip(got, want, strict=True):
        assert _worst(g, w) < 1e-12


def test_tied_weight_gets_both_gradients():
    """A head tied to the embedding: the weight's gradient is the lookup's plus the head's."""
    torch.manual_seed(0)
    embedding = nn.Embedding(40, 8).double()
    head = nn.Linear(8, 40, bias=False).double()
    head.weight = embedding.weight
    tokens = torch.randint(0, 40, (5, 9))

    def loss_of(chunked: bool) -> torch.Tensor:
        hidden = torch.tanh(embedding(tokens[:, :-1]))
        if chunked:
            return linear_cross_entropy(hidden, head, tokens[:, 1:], chunk_tokens=3)
        return F.cross_entropy(head(hidden).flatten(0, 1), tokens[:, 1:].flatten())

    want = torch.autograd.grad(loss_of(False), embedding.weight)[0]
    got = torch.autograd.grad(loss_of(True), embedding.weight)[0]
    assert _worst(got, want) < 1e-12


def test_compact_sparse_head_equals_its_dense_weight():
    """A compact sparse output layer (DSR): the chunked loss gives the values' gradient at the active
    positions, as the dense weight's would be there."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 60).double()
    with torch.no_grad():
        layer.weight.mul_((torch.rand_like(layer.weight) < 0.3).double())
    dense = copy.deepcopy(layer)
    mask = layer.weight.detach() != 0
    positions = mask.flatten().nonzero().squeeze(1)
    weights = compact.CompactWeights(layer, ["weight"], {"weight": mask})
    assert compact.is_compact(layer, "weight")
    x, _, target = _setup(tokens=21, vocab=60)
    want_x, want_w = torch.autograd.grad(F.cross_entropy(dense(x), target), (x, dense.weight))
    values = compact.trained_weight(layer)
    got_x, got_values = torch.autograd.grad(linear_cross_entropy(x, layer, target, chunk_tokens=4), (x, values))
    assert _worst(got_x, want_x) < 1e-12
    assert _worst(got_values, want_w.flatten()[positions]) < 1e-12
    del weights


def test_chunk_setting():
    assert validate_chunk_tokens("auto") == "auto"
    assert validate_chunk_tokens("none") is None and validate_chunk_tokens(None) is None
    assert validate_chunk_tokens(64) == 64 and validate_chunk_tokens("64") == 64
    for bad in (0, -3, "some", 1.5, True):
        with pytest.raises(ValueError, match="loss.chunk_tokens"):
            validate_chunk_tokens(bad)
    # auto: unchunked while the FP32 logits stay within 8 MiB; then chunks of at most
    # max(4 MiB, the hidden states) of FP32 logits, but at least 128 tokens.
    assert chunk_for("auto", 100, 1000, 64) is None
    assert chunk_for("auto", 4096, 32000, 64) == 128
    assert chunk_for("auto", 4096, 6000, 64) == 4 * 2**20 // (6000 * 4)
    assert chunk_for("auto", 8192, 32000, 4096) == 8192 * 4096 * 4 // (32000 * 4)
    assert chunk_for("auto", 120, 100000, 64) is None  # one chunk would hold every token
    assert chunk_for(16, 10, 10, 10) == 16


def test_config_refuses_bad_values():
    with pytest.raises(ConfigError, match=r"loss.chunk_tokens='many' is not allowed: auto, none or a positive"):
        lowmem.prepare(nn.Linear(3, 3), lambda m, b: m(b).sum(), torch.randn(2, 3),
                       overrides=["trainer.device=cpu", "loss.chunk_tokens=many"])


class _Lm(nn.Module):
    """A tiny language model whose loss reads its head's logits in several ways."""

    def __init__(self, vocab=30, features=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, features)
        self.lm_head = nn.Linear(features, vocab)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, tokens):
        return self.lm_head(torch.tanh(self.embed(tokens)))


def test_lazy_logits_stay_lazy_where_the_loss_only_reshapes_them(monkeypatch):
    model = _Lm().double().train()
    install(model, 4)
    tokens = torch.randint(0, 30, (3, 7))
    calls = []
    monkeypatch.setattr(Head, "logits", lambda self, x: calls.append(x.shape) or F.linear(x, self.module.weight,
                                                                                          self.module.bias))
    logits = model(tokens)
    assert isinstance(logits, LazyLogits) and logits.shape == (3, 7, 30) and logits.dtype == torch.float64
    assert logits.requires_grad
    shifted = logits[..., :-1, :].contiguous().float().view(-1, 30)
    assert isinstance(shifted, LazyLogits) and shifted.shape == (18, 30) and shifted.dtype == torch.float32
    loss = nn.CrossEntropyLoss()(shifted, tokens[:, 1:].reshape(-1))
    loss.backward()
    assert calls == []  # never computed whole
    assert model.lm_head.weight.grad is not None and model.embed.weight.grad is not None
    with torch.no_grad():
        assert not isinstance(model(tokens), LazyLogits)  # no gradient, nothing to save: plain logits
    model.eval()
    assert not isinstance(model(tokens), LazyLogits)


def test_reading_the_logits_computes_them_with_their_gradient():
    """A caller who reads the logits gets them (computed in full, at plain PyTorch's cost), and
    every gradient through them is kept."""
    torch.manual_seed(0)
    model = _Lm().double().train()
    plain = copy.deepcopy(model)
    install(model, 4)
    tokens = torch.randint(0, 30, (3, 7))

    def loss_of(m):
        logits = m(tokens)
        # A loss that reads the logits as a whole, beside the cross-entropy.
        extra = logits.logsumexp(-1).pow(2).mean() + (logits * 0.5).softmax(-1)[..., 3].sum()
        return F.cross_entropy(logits.view(-1, 30), tokens.view(-1)) + extra

    loss_of(model).backward()
    loss_of(plain).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert _worst(p.grad, q.grad) < 1e-12, name
    lazy = model(tokens)
    assert torch.equal(lazy.argmax(-1), plain(tokens).argmax(-1))
    assert "LazyLogits" in repr(lazy)


def test_lazy_logits_refuse_to_lose_a_gradient_below_python():
    model = _Lm().double().train()
    install(model, 4)
    logits = model(torch.randint(0, 30, (2, 3)))
    assert not isinstance(torch.ops.aten.mul.Tensor(logits, 2.0), LazyLogits)  # computed, with its gradient
    with torch._C.DisableTorchFunctionSubclass(), pytest.raises(RuntimeError, match="loss.chunk_tokens=none"):
        logits * 2.0  # what C++ code calling an op on them would do


def test_install_none_restores_the_layer():
    model = _Lm().train()
    install(model, 8)
    assert "forward" in model.lm_head.__dict__
    install(model, "none")
    assert "forward" not in model.lm_head.__dict__
    assert not isinstance(model(torch.randint(0, 30, (2, 3))), LazyLogits)


transformers = pytest.importorskip("transformers")


def _lm_loss(model, batch):
    return model(**batch).loss


def _one_step(model, batch, overrides):
    run = lowmem.prepare(copy.deepcopy(model), _lm_loss, batch, overrides=SGD + ["precision=fp64"] + overrides)
    run.step(batch)
    return run


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=300, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).double()


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config).double()


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=300, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(config).double()


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(vocab_size=300, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0,
                        max_position_embeddings=32, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                        decoder_start_token_id=2)
    model = BartForConditionalGeneration(config).double()
    with torch.no_grad():  # a bias worth testing (BART's is zeros until trained)
        model.final_logits_bias.normal_()
    return model


def _batch(seq2seq: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 300, (3, 12), generator=g)
    labels = ids.clone()
    labels[:, -3:] = -100
    if seq2seq:
        return {"input_ids": ids, "labels": torch.randint(2, 300, (3, 9), generator=g)}
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("build,seq2seq", [(_gpt2, False), (_llama, False), (_t5, True), (_bart, True)],
                         ids=["gpt2", "llama", "t5", "bart"])
def test_transformers_labels_loss_is_chunked_and_equal(build, seq2seq, monkeypatch):
    """Through lowmem.prepare, a transformers model's own loss from ``labels=`` is the chunked one
    (the node runs, the logits are never computed whole) and one FP64 step equals the unchunked
    step; a tied head (GPT-2, T5, BART) stays tied; BART's final_logits_bias joins the head's bias."""
    model, batch = build(), _batch(seq2seq)
    plain = _one_step(model, batch, ["loss.chunk_tokens=none"])
    nodes = []
    original = head_loss._LinearCrossEntropy.apply
    monkeypatch.setattr(head_loss._LinearCrossEntropy, "apply", lambda *a: nodes.append(1) or original(*a))
    monkeypatch.setattr(Head, "logits", lambda self, x: pytest.fail("the logits were computed whole"))
    chunked = _one_step(model, batch, ["loss.chunk_tokens=5"])
    assert nodes
    want, got = plain.model.state_dict(), chunked.model.state_dict()
    start = model.state_dict()
    updates = {k: v - start[k] for k, v in want.items() if v.is_floating_point()}
    # Relative to each tensor's update, or a billionth of the largest (gradients that are zero in exact
    # arithmetic, such as attention's key bias, are rounding noise in both).
    floor = 1e-9 * max(float(u.abs().max()) for u in updates.values())
    for key, update in updates.items():
        difference = float((got[key] - start[key] - update).abs().max())
        assert difference <= 1e-10 * max(float(update.abs().max()), floor), key
    head, inputs = chunked.model.get_output_embeddings(), chunked.model.get_input_embeddings()
    if getattr(chunked.model.config, "tie_word_embeddings", False):
        assert head.weight is inputs.weight


def test_llama_peak_is_no_longer_the_logits():
    """A 32k vocabulary: the measured peak with loss.chunk_tokens=auto is under half the unchunked one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128))
    ids = torch.randint(0, 32000, (2, 128))
    batch = {"input_ids": ids, "labels": ids}
    peaks = {}
    for chunk in ("none", "auto"):
        run = lowmem.prepare(copy.deepcopy(model), _lm_loss, batch, overrides=["trainer.device=cpu",
                                                                             f"loss.chunk_tokens={chunk}"])
        run.step(batch)
        peaks[chunk] = run.profile()["peak_bytes"]
        del run
    assert peaks["auto"] < 0.5 * peaks["none"], peaks


@pytest.mark.slow
def test_data_parallel_ranks_train_the_chunked_loss_as_the_unchunked(tmp_path):
    """DDP over two CPU ranks (gloo): DynamicConv's chunked head and loss give the unchunked weights
    (FP64; the reducer's gradient hooks fire on the chunked node's weight gradient)."""
    from tests.helpers import SMALL_DC, start_ranks
    from tests.test_distributed import _free_port, _rank_main

    weights = {}
    for chunk in ("none", "16"):
        run_dir = tmp_path / chunk
        run_dir.mkdir()
        overrides = (*SMALL_DC, "precision=fp64", "sparsity.density=0.5", "trainer.max_steps=2", "trainer.epochs=1",
                     f"loss.chunk_tokens={chunk}")
        start_ranks(_rank_main, (2, _free_port(), str(run_dir), overrides), 2)
        weights[chunk] = torch.load(run_dir / "rank0.pt", weights_only=True)["params"]
    for name, value in weights["none"].items():
        # (absolute for the attention key biases, whose gradient is zero in exact arithmetic: ~1e-19 noise)
        torch.testing.assert_close(weights["16"][name], value, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "amp"])
def test_16_bit_runs_train_alike_chunked_and_whole(precision):
    """Pure BF16, pure FP16 (its loss scale multiplies the chunked gradient as any other) and amp
    (the head computes under autocast): three steps chunked follow the unchunked losses."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=2000, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 2000, (3, 24))
    batch = {"input_ids": ids, "labels": ids}
    losses = {}
    for chunk in ("none", "8"):
        run = lowmem.prepare(copy.deepcopy(model), _lm_loss, batch, overrides=[
            "trainer.device=cpu", f"precision={precision}", f"loss.chunk_tokens={chunk}", "optim.name=adam",
            "optim.lr=1e-3"])
        losses[chunk] = [run.step(batch)["loss"] for _ in range(3)]
    assert losses["8"][0] == pytest.approx(losses["none"][0], rel=1e-3)
    assert losses["8"] == pytest.approx(losses["none"], rel=2e-3)
    assert losses["8"][-1] < losses["8"][0]
