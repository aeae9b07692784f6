"""DynamicConv encoder-decoder (Wu et al., 2019): fairseq's ``lightconv_iwslt_de_en`` with dynamic
convolutions in the encoder and the decoder, in plain PyTorch.

Defaults (``Architecture``) are that architecture: 7 encoder / 6 decoder layers, d=512, FFN 1024,
4 heads, kernels 3,7,15,31,31,31,31 (decoder 3,7,15,31,31,31), softmax-normalised kernels, no GLU,
post-norm, sinusoidal positions, embeddings scaled by sqrt(d), encoder-decoder attention, untied
output projection. With 8,848 source and 6,632 target types it has 38,691,840 parameters (SPEC §3.2).

Parameter names are fairseq's, so state dicts are interchangeable (``i`` = layer index)::

    encoder.embed_tokens.weight                              [V_src, d]
    encoder.layers.i.linear1.{weight,bias}                   d -> d, the convolution's input projection
    encoder.layers.i.conv.weight_linear.weight               [H*K_i, d], predicts the kernels (no bias)
    encoder.layers.i.conv.conv_bias                          [d]
    encoder.layers.i.linear2.{weight,bias}                   d -> d
    encoder.layers.i.fc1.{weight,bias}, fc2.{weight,bias}    d -> ffn -> d
    encoder.layers.i.layer_norms.{0,1}.{weight,bias}         after the convolution / the FFN block
    decoder.embed_tokens.weight                              [V_tgt, d]
    decoder.layers.i.{linear1,conv.weight_linear,conv.conv_bias,linear2,fc1,fc2}   as in the encoder
    decoder.layers.i.conv_layer_norm.{weight,bias}
    decoder.layers.i.encoder_attn.{q_proj,k_proj,v_proj,out_proj}.{weight,bias}    (modern fairseq naming)
    decoder.layers.i.encoder_attn_layer_norm.{weight,bias}
    decoder.layers.i.final_layer_norm.{weight,bias}
    decoder.embed_out                                        [V_tgt, d], the output projection

The convolution bias (``conv_bias``, fairseq's ``DynamicConv(..., conv_bias=True)``) is on by default:
the SPEC's count is fairseq's stock ``lightconv_iwslt_de_en`` (38,685,184, no convolution bias) plus
one d-vector per layer (13 x 512 = 6,656). ``conv_bias=False`` builds fairseq's stock model, whose
checkpoints then load after ``drop_fairseq_buffers`` (fairseq also stores two ``version`` buffers).

One deliberate departure from fairseq: a causal kernel is always normalised over all K taps, the taps
before the sequence start reading zeros. fairseq does this in its band-matrix path and when decoding
step by step, but its unfolded training path normalises over only T taps when T < K; here training
and incremental decoding agree (tested).

LayerNorm, softmax and dropout (and the loss's log-softmax) go through the model's ``ops``
(``model.ops``, ``recipes/dc_iwslt/ops.py``): today's PyTorch operators by default, or PyTorch 1.0.1's,
which compute the same function but hold more for backward, to reproduce the report's accounting.

Tokens and logits are batch-first ([B, T], [B, T, V]); activations inside are time-major [T, B, d],
fairseq's layout, because there the heads of a batch (B·H) are adjacent and the convolution's
batched matrix product reads its input in place instead of saving a copy for backward. The encoder
and the decoder each expose their layers as ``residual_blocks`` (``lowmem.residual``), so
checkpointing needs no model code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from lowmem.residual import run_residual_blocks
from lowmem.techniques import compact
from lowmem.techniques.head_loss import Head
from recipes.dc_iwslt.ops import LayerNorm, Ops, ops_named

# fairseq's kernel-size schedule: layer i uses _KERNEL_SCHEDULE[min(i, 3)] (3, 7, 15, 31, 31, ...).
_KERNEL_SCHEDULE = (3, 7, 15, 31)


@dataclass(frozen=True)
class Architecture:
    """The knobs of the model; the defaults are fairseq's ``lightconv_iwslt_de_en`` (dynamic convs).

    Kernel sizes: ``None`` follows fairseq's schedule (3, 7, 15, then 31) for any depth; a single
    size is repeated over all layers; otherwise one size per layer. ``heads`` is both the number of
    convolution heads and of encoder-decoder attention heads.
    """

    encoder_layers: int = 7
    decoder_layers: int = 6
    embed_dim: int = 512
    ffn_dim: int = 1024
    heads: int = 4
    encoder_kernel_sizes: tuple[int, ...] | None = None
    decoder_kernel_sizes: tuple[int, ...] | None = None
    dropout: float = 0.1
    weight_dropout: float = 0.1
    attention_dropout: float = 0.1
    relu_dropout: float = 0.0
    input_dropout: float = 0.0
    weight_softmax: bool = True
    conv_bias: bool = True
    ops: str = "current"  # recipes/dc_iwslt/ops.py: today's PyTorch operators, or PyTorch 1.0.1's

    def __post_init__(self) -> None:
        for knob in ("encoder_layers", "decoder_layers", "embed_dim", "ffn_dim", "heads"):
            if getattr(self, knob) < 1:
                raise ValueError(f"model.{knob}={getattr(self, knob)}: must be a positive integer")
        if self.embed_dim % self.heads != 0:
            raise ValueError(f"model.heads={self.heads}: must divide model.embed_dim={self.embed_dim}")
        for knob in ("dropout", "weight_dropout", "attention_dropout", "relu_dropout", "input_dropout"):
            if not 0.0 <= getattr(self, knob) < 1.0:
                raise ValueError(f"model.{knob}={getattr(self, knob)}: must be in [0, 1)")
        ops_named(self.ops)  # an unknown name fails here, naming model.ops
        for side in ("encoder", "decoder"):
            # Hydra hands lists over as ListConfig; store plain tuples of ints.
            sizes = _kernel_sizes(
                f"{side}_kernel_sizes", getattr(self, f"{side}_kernel_sizes"), getattr(self, f"{side}_layers")
            )
            object.__setattr__(self, f"{side}_kernel_sizes", sizes)


def _kernel_sizes(knob: str, sizes: Any, layers: int) -> tuple[int, ...]:
    if sizes is None:
        return tuple(_KERNEL_SCHEDULE[min(i, len(_KERNEL_SCHEDULE) - 1)] for i in range(layers))
    sizes = tuple(int(k) for k in sizes)
    if len(sizes) == 1:
        sizes = sizes * layers
    if len(sizes) != layers or min(sizes) < 1:
        raise ValueError(
            f"model.{knob}={list(sizes)}: need {layers} positive kernel sizes (one per layer) or a single one"
        )
    return sizes


def _linear(in_features: int, out_features: int, bias: bool = True, gain: float = 1.0) -> nn.Linear:
    """fairseq's initialisation: Xavier-uniform weight, zero bias."""
    linear = nn.Linear(in_features, out_features, bias=bias)
    nn.init.xavier_uniform_(linear.weight, gain=gain)
    if bias:
        nn.init.zeros_(linear.bias)
    return linear


def _embedding(num_embeddings: int, dim: int, padding_idx: int) -> nn.Embedding:
    embedding = nn.Embedding(num_embeddings, dim, padding_idx=padding_idx)
    nn.init.normal_(embedding.weight, mean=0.0, std=dim**-0.5)
    with torch.no_grad():
        embedding.weight[padding_idx].zero_()
    return embedding


def _softmax(x: torch.Tensor, dim: int, ops: Ops) -> torch.Tensor:
    """Softmax computed in at least FP32 (pure-FP16 training), returned in the input's dtype."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return ops.softmax(x.float(), dim).to(x.dtype)
    return ops.softmax(x, dim)


def sinusoidal_positions(positions: torch.Tensor, dim: int, padding_idx: int) -> torch.Tensor:
    """fairseq's sinusoidal embedding of integer positions [...] -> [..., dim] (float32).

    Row p is [sin(p·w_0..w_{h-1}), cos(p·w_0..w_{h-1})] with h = dim // 2 and w_i = 10000^(-i/(h-1));
    position ``padding_idx`` (padding tokens) maps to zeros. Real tokens count from padding_idx + 1.
    """
    half = dim // 2
    frequencies = torch.exp(
        torch.arange(half, dtype=torch.float32, device=positions.device) * -(math.log(10000.0) / (half - 1))
    )
    angles = positions.to(torch.float32).unsqueeze(-1) * frequencies
    embedding = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
    if dim % 2 == 1:
        embedding = F.pad(embedding, (0, 1))
    return embedding.masked_fill(positions.eq(padding_idx).unsqueeze(-1), 0.0)


def _band_matrix(kernels: torch.Tensor, padding_l: int) -> torch.Tensor:
    """Per-position kernels [..., T, K] -> convolution matrix [..., T, T].

    ``band[..., t, s] = kernels[..., t, s - t + padding_l]`` inside the band, 0 outside: output t reads
    inputs t - padding_l ... t - padding_l + K - 1, and taps that fall outside the sequence drop out
    (they would read the zero padding). Built by skewing: append T zeros to each row and re-read the
    flat buffer with rows one element shorter, so row t is shifted right by t.
    """
    T, K = kernels.shape[-2:]
    padded = F.pad(kernels, (0, T))  # [..., T, K + T]
    skewed = padded.flatten(-2)[..., : T * (T + K - 1)].unflatten(-1, (T, T + K - 1))
    return skewed[..., padding_l : padding_l + T]


class DynamicConv(nn.Module):
    """Depthwise 1-D convolution whose kernel is predicted from the input at every position.

    The C channels form H heads of C/H channels; at position t all channels of a head use one
    kernel of K taps, ``softmax_K(weight_linear(x_t))`` (with ``weight_softmax``), DropConnect'ed
    with ``weight_dropout`` in training. Positions outside the sequence read zeros, and the kernel is
    always normalised over all K taps, so a short causal sequence and step-by-step decoding agree.
    ``padding_l`` = taps to the left of t: (K - 1) // 2 for the encoder, K - 1 (causal) for the decoder.
    """

    def __init__(
        self,
        channels: int,
        kernel_size: int,
        num_heads: int,
        padding_l: int,
        weight_softmax: bool = True,
        weight_dropout: float = 0.0,
        conv_bias: bool = True,
        ops: Ops | None = None,
    ) -> None:
        super().__init__()
        if channels % num_heads != 0 or not 0 <= padding_l < kernel_size:
            raise ValueError(
                f"DynamicConv: need heads ({num_heads}) | channels ({channels}) and "
                f"0 <= padding_l ({padding_l}) < kernel_size ({kernel_size})"
            )
        self.channels, self.kernel_size, self.num_heads = channels, kernel_size, num_heads
        self.padding_l = padding_l
        self.weight_softmax, self.weight_dropout = weight_softmax, weight_dropout
        self.ops = ops or Ops()
        self.weight_linear = _linear(channels, num_heads * kernel_size, bias=False)
        self.conv_bias = nn.Parameter(torch.zeros(channels)) if conv_bias else None

    def kernels(self, x: torch.Tensor) -> torch.Tensor:
        """Input [T, B, C] -> normalised, dropped-out kernels [T, B, H, K]."""
        weights = self.weight_linear(x).unflatten(-1, (self.num_heads, self.kernel_size))
        if self.weight_softmax:
            weights = _softmax(weights, -1, self.ops)
        return self.ops.dropout(weights, self.weight_dropout, self.training)

    def _add_bias(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.conv_bias is None else out + self.conv_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Whole sequences: x [T, B, C] -> [T, B, C], as a banded matrix product per (sequence, head).

        The band costs B·H·T² elements; unfolding the input would cost B·T·C·K, ~100x more at d=512,
        K=31 for sentence-length T.
        """
        T, B, C = x.shape
        H = self.num_heads
        kernels = self.kernels(x).view(T, B * H, self.kernel_size).transpose(0, 1)
        band = _band_matrix(kernels, self.padding_l)  # [B·H, T, T]
        out = torch.bmm(band, x.view(T, B * H, C // H).transpose(0, 1))  # [B·H, T, C/H]
        return self._add_bias(out.transpose(0, 1).reshape(T, B, C))

    def empty_buffer(self, batch_size: int, like: torch.Tensor) -> torch.Tensor:
        """The step state before the first token: K - 1 zero inputs [K-1, B, C] (the causal padding)."""
        return like.new_zeros(self.kernel_size - 1, batch_size, self.channels)

    def step(self, x: torch.Tensor, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One causal step: x [1, B, C] and the last K-1 inputs [K-1, B, C] -> (out [1, B, C], new buffer)."""
        if self.padding_l != self.kernel_size - 1:
            raise ValueError(
                f"DynamicConv.step needs a causal convolution (padding_l = kernel_size - 1 = "
                f"{self.kernel_size - 1}), got padding_l={self.padding_l}"
            )
        _, B, C = x.shape
        H = self.num_heads
        window = torch.cat([buffer, x], dim=0)  # [K, B, C], oldest first like the kernel taps
        kernels = self.kernels(x)[0]  # [B, H, K]
        out = torch.einsum("kbhr,bhk->bhr", window.view(self.kernel_size, B, H, C // H), kernels)
        return self._add_bias(out.reshape(1, B, C)), window[1:]


class EncoderDecoderAttention(nn.Module):
    """fairseq's ``MultiheadAttention(encoder_decoder_attention=True)``: queries from the decoder,
    keys and values from the encoder output, padded source positions masked out."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float, ops: Ops | None = None) -> None:
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.ops = ops or Ops()
        self.scaling = (embed_dim // num_heads) ** -0.5
        # fairseq scales the input projections' init by 1/sqrt(2) (they used to be one fused matrix).
        self.q_proj = _linear(embed_dim, embed_dim, gain=2**-0.5)
        self.k_proj = _linear(embed_dim, embed_dim, gain=2**-0.5)
        self.v_proj = _linear(embed_dim, embed_dim, gain=2**-0.5)
        self.out_proj = _linear(embed_dim, embed_dim)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:  # [T, B, d] -> [B, H, T, d/H]
        return x.unflatten(-1, (self.num_heads, -1)).permute(1, 2, 0, 3)

    def keys_values(self, encoder_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder output [S, B, d] -> keys and values [B, H, S, d/H] (cached when decoding)."""
        return self._split_heads(self.k_proj(encoder_out)), self._split_heads(self.v_proj(encoder_out))

    def forward(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_padding_mask: torch.Tensor
    ) -> torch.Tensor:
        """query [T, B, d], keys/values [B, H, S, d/H], key_padding_mask [B, S] (True = pad) -> [T, B, d]."""
        q = self._split_heads(self.q_proj(query) * self.scaling)
        scores = (q @ keys.transpose(-1, -2)).masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        probs = self.ops.dropout(_softmax(scores, -1, self.ops), self.dropout, self.training)
        return self.out_proj((probs @ values).permute(2, 0, 1, 3).flatten(2))


class _ConvLayer(nn.Module):
    """What encoder and decoder layers share: the convolution block's projections around the dynamic
    convolution (linear1 -> conv -> linear2) and the feed-forward block (fc1 -> ReLU -> fc2)."""

    def __init__(self, arch: Architecture, kernel_size: int, padding_l: int) -> None:
        super().__init__()
        d = arch.embed_dim
        self.arch = arch
        self.ops = ops_named(arch.ops)
        self.linear1 = _linear(d, d)
        self.conv = DynamicConv(
            d, kernel_size, arch.heads, padding_l, arch.weight_softmax, arch.weight_dropout, arch.conv_bias, self.ops
        )
        self.linear2 = _linear(d, d)
        self.fc1 = _linear(d, arch.ffn_dim)
        self.fc2 = _linear(arch.ffn_dim, d)

    def conv_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear1(self.ops.dropout(x, self.arch.input_dropout, self.training))

    def conv_output(self, h: torch.Tensor) -> torch.Tensor:
        return self.ops.dropout(self.linear2(h), self.arch.dropout, self.training)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ops.dropout(F.relu(self.fc1(x)), self.arch.relu_dropout, self.training)
        return self.ops.dropout(self.fc2(h), self.arch.dropout, self.training)


class EncoderLayer(_ConvLayer):
    """x + DynamicConv block, LayerNorm; x + FFN, LayerNorm (post-norm)."""

    def __init__(self, arch: Architecture, kernel_size: int) -> None:
        super().__init__(arch, kernel_size, padding_l=(kernel_size - 1) // 2)
        self.layer_norms = nn.ModuleList([LayerNorm(arch.embed_dim, self.ops) for _ in range(2)])

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        """x [S, B, d], padding_mask [B, S] (True = pad) -> [S, B, d]."""
        h = self.conv_input(x)
        # Padded positions must read as the zeros beyond the sequence ends, or padding leaks into the output.
        h = h.masked_fill(padding_mask.t().unsqueeze(-1), 0.0)
        x = self.layer_norms[0](x + self.conv_output(self.conv(h)))
        return self.layer_norms[1](x + self.feed_forward(x))


@dataclass
class LayerCache:
    """One decoder layer's incremental state."""

    conv_buffer: torch.Tensor  # [K-1, B, d]: the last K-1 convolution inputs (zeros before the start)
    keys: torch.Tensor  # [B, H, S, d/H]: encoder-decoder attention keys
    values: torch.Tensor  # [B, H, S, d/H]


class DecoderLayer(_ConvLayer):
    """Causal DynamicConv block, encoder-decoder attention block, FFN block; each x + f(x), LayerNorm."""

    def __init__(self, arch: Architecture, kernel_size: int) -> None:
        super().__init__(arch, kernel_size, padding_l=kernel_size - 1)
        d = arch.embed_dim
        self.conv_layer_norm = LayerNorm(d, self.ops)
        self.encoder_attn = EncoderDecoderAttention(d, arch.heads, arch.attention_dropout, self.ops)
        self.encoder_attn_layer_norm = LayerNorm(d, self.ops)
        self.final_layer_norm = LayerNorm(d, self.ops)

    def forward(
        self,
        x: torch.Tensor,
        encoder_out: torch.Tensor | None,
        encoder_padding_mask: torch.Tensor,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """Whole target prefixes x [T, B, d] with encoder_out [S, B, d] (``cache`` None), or one step
        x [1, B, d] with ``cache`` (updated in place; ``encoder_out`` unused, its keys/values are
        cached) -> same shape as x. encoder_padding_mask [B, S], True at padding."""
        h = self.conv_input(x)
        if cache is None:
            h = self.conv(h)
            keys, values = self.encoder_attn.keys_values(encoder_out)
        else:
            h, cache.conv_buffer = self.conv.step(h, cache.conv_buffer)
            keys, values = cache.keys, cache.values
        x = self.conv_layer_norm(x + self.conv_output(h))
        attended = self.encoder_attn(x, keys, values, encoder_padding_mask)
        x = self.encoder_attn_layer_norm(x + self.ops.dropout(attended, self.arch.dropout, self.training))
        return self.final_layer_norm(x + self.feed_forward(x))


class EncoderOutput(NamedTuple):
    out: torch.Tensor  # [S, B, d], time-major
    padding_mask: torch.Tensor  # [B, S], True at padding


@dataclass
class DecoderState:
    """Incremental decoding state of a whole batch (from ``Decoder.init_state``)."""

    layers: list[LayerCache]
    encoder_padding_mask: torch.Tensor  # [B, S]
    steps: int = 0  # target tokens consumed so far

    def reorder(self, order: torch.Tensor) -> None:
        """Row i becomes old row ``order[i]`` (select, reorder or repeat hypotheses; beam search)."""
        self.encoder_padding_mask = self.encoder_padding_mask.index_select(0, order)
        for cache in self.layers:
            cache.conv_buffer = cache.conv_buffer.index_select(1, order)
            cache.keys = cache.keys.index_select(0, order)
            cache.values = cache.values.index_select(0, order)


class _Embedder(nn.Module):
    """Scaled token embedding plus sinusoidal positions, then dropout (encoder and decoder inputs)."""

    def __init__(self, vocab: int, arch: Architecture, padding_idx: int) -> None:
        super().__init__()
        self.arch, self.padding_idx = arch, padding_idx
        self.ops = ops_named(arch.ops)
        self.embed_tokens = _embedding(vocab, arch.embed_dim, padding_idx)
        self.embed_scale = math.sqrt(arch.embed_dim)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens and positions [B, T] -> time-major [T, B, d]."""
        tokens, positions = tokens.t(), positions.t()
        x = self.embed_scale * self.embed_tokens(tokens)
        x = x + sinusoidal_positions(positions, self.arch.embed_dim, self.padding_idx).to(x.dtype)
        return self.ops.dropout(x, self.arch.dropout, self.training)

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """fairseq's positions: real tokens count padding_idx+1, +2, ...; padding gets padding_idx.
        Counting only real tokens makes left- and right-padded batches embed alike."""
        real = tokens.ne(self.padding_idx).long()
        return torch.cumsum(real, dim=1) * real + self.padding_idx


class Encoder(_Embedder):
    def __init__(self, vocab: int, arch: Architecture, padding_idx: int) -> None:
        super().__init__(vocab, arch, padding_idx)
        self.layers = nn.ModuleList(EncoderLayer(arch, k) for k in arch.encoder_kernel_sizes)

    @property
    def residual_blocks(self) -> nn.ModuleList:
        """The layers, under the name ``lowmem.residual`` looks for (state-dict names stay ``layers.i``)."""
        return self.layers

    def forward(self, src_tokens: torch.Tensor, src_lengths: torch.Tensor | None = None) -> EncoderOutput:
        """src_tokens [B, S] (padded with padding_idx on either side) -> EncoderOutput.

        ``src_lengths`` is accepted for fairseq's signature; the padding mask comes from the tokens.
        """
        padding_mask = src_tokens.eq(self.padding_idx)
        x = self.embed(src_tokens, self.positions(src_tokens))
        return EncoderOutput(run_residual_blocks(self, x, padding_mask), padding_mask)


class Decoder(_Embedder):
    def __init__(self, vocab: int, arch: Architecture, padding_idx: int) -> None:
        super().__init__(vocab, arch, padding_idx)
        self.layers = nn.ModuleList(DecoderLayer(arch, k) for k in arch.decoder_kernel_sizes)
        self.embed_out = nn.Parameter(torch.empty(vocab, arch.embed_dim))
        nn.init.normal_(self.embed_out, mean=0.0, std=arch.embed_dim**-0.5)

    @property
    def residual_blocks(self) -> nn.ModuleList:
        """The layers, under the name ``lowmem.residual`` looks for (state-dict names stay ``layers.i``)."""
        return self.layers

    def forward(self, prev_output_tokens: torch.Tensor, encoder_out: EncoderOutput) -> torch.Tensor:
        """Teacher forcing: prev_output_tokens [B, T] (right-padded) -> logits [B, T, V_tgt]."""
        x = self.embed(prev_output_tokens, self.positions(prev_output_tokens))
        x = run_residual_blocks(self, x, encoder_out.out, encoder_out.padding_mask)
        # Lazy logits while training with loss.chunk_tokens (the loss computes them a chunk at a time).
        return Head(self, "embed_out", None).lazy(x.transpose(0, 1))

    def init_state(self, encoder_out: EncoderOutput) -> DecoderState:
        """State before the first target token; computes each layer's attention keys/values once."""
        out = encoder_out.out
        caches = [
            LayerCache(layer.conv.empty_buffer(out.size(1), out), *layer.encoder_attn.keys_values(out))
            for layer in self.layers
        ]
        return DecoderState(caches, encoder_out.padding_mask)

    def step(self, tokens: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """Feed the next target token of every row, tokens [B] -> logits [B, V_tgt] for the token after it.

        Equals ``forward`` on the whole prefix (which must hold no padding) at its last position.
        """
        position = torch.full_like(tokens, self.padding_idx + state.steps + 1)
        x = self.embed(tokens.unsqueeze(1), position.unsqueeze(1))  # [1, B, d]
        for layer, cache in zip(self.layers, state.layers, strict=True):
            x = layer(x, None, state.encoder_padding_mask, cache=cache)
        state.steps += 1
        return compact.linear(self, "embed_out", x[0])


class DynamicConvModel(nn.Module):
    """The encoder-decoder. ``arch`` are ``Architecture``'s knobs (defaults: lightconv_iwslt_de_en).

    Token ids follow fairseq's dictionaries (bos=0, pad=1, eos=2, unk=3); only ``padding_idx``
    matters to the model.
    """

    def __init__(self, src_vocab: int, tgt_vocab: int, padding_idx: int = 1, **arch: Any) -> None:
        super().__init__()
        self.arch = Architecture(**arch)
        self.ops = ops_named(self.arch.ops)  # the loss's log-softmax is the model's too
        self.padding_idx = padding_idx
        self.encoder = Encoder(src_vocab, self.arch, padding_idx)
        self.decoder = Decoder(tgt_vocab, self.arch, padding_idx)

    def forward(
        self, src_tokens: torch.Tensor, src_lengths: torch.Tensor, prev_output_tokens: torch.Tensor
    ) -> torch.Tensor:
        """src_tokens [B, S], src_lengths [B], prev_output_tokens [B, T] -> logits [B, T, V_tgt]."""
        return self.decoder(prev_output_tokens, self.encoder(src_tokens, src_lengths))

    def sparsifiable_weights(self) -> list[str]:
        """What DSR may sparsify (SPEC §3.2): every fully connected weight (the convolutions' kernel
        predictors, attention projections and the output projection included) and the embeddings."""
        names = [
            f"{name}.weight"
            for name, module in self.named_modules()
            if isinstance(module, nn.Linear | nn.Embedding)
        ]
        return names + ["decoder.embed_out"]

    def lowmem_output_heads(self) -> list[tuple[nn.Module, str, str | None]]:
        """The output layer, for ``loss.chunk_tokens`` (``lowmem.techniques.head_loss``)."""
        return [(self.decoder, "embed_out", None)]


def drop_fairseq_buffers(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A fairseq lightconv state dict without its non-parameter buffers (``*.version``,
    ``*._float_tensor``), ready for ``DynamicConvModel(..., conv_bias=False).load_state_dict``."""
    return {k: v for k, v in state_dict.items() if not k.endswith((".version", "._float_tensor"))}
