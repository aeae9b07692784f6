"""The output layer and its cross-entropy, a chunk of tokens at a time: ``loss.chunk_tokens``.

A language model's largest activation is its logits, ``[tokens, vocabulary]``: 2,048 tokens of a
32k vocabulary are 262 MB in FP32, and plain PyTorch holds them, their log-softmax (saved for
backward) and their gradient, all outside the blocks that checkpointing, compression and offloading
reach. Here the product of the hidden states with the output weight and the cross-entropy are one
autograd node (``_LinearCrossEntropy``) that never holds more than one chunk of logits:

- **forward**, a chunk of ``chunk_tokens`` tokens at a time: the chunk's logits (in the layer's
  compute dtype, widened to FP32 — FP64 stays FP64), their log-sum-exp, the target's logit and (label
  smoothing) their sum; the chunk is freed before the next. Saved for backward: the hidden states (an
  input: a block-level technique may compress or offload them like any saved tensor), the targets
  and one log-sum-exp per token.
- **backward**, a slice of the vocabulary at a time (as many logits per slice as a forward chunk
  has): the slice's logits again, their gradient ``scale · (softmax − a·onehot − b)``, its product
  with the slice of the weight added into the hidden states' gradient (accumulated in FP32), and the
  slice of the weight's gradient as one product over every token (so it is written once, with the
  matrix product's own accumulation, never summed across chunks in 16 bits). Where the logits are
  asked for narrower than the product computes them (FP64 weights and ``.float()`` logits, as
  transformers' loss does in an FP64 run), backward goes a chunk of tokens at a time through plain
  PyTorch's own ``log_softmax`` and its backward, so each token's gradient has plain's bits.

Its one extra cost is one more product of the hidden states with the weight (the logits computed
again in backward): 4 products of the head instead of 3. On a CPU, each chunk's buffers are freed
and allocated again, so the node has glibc keep freed memory in its heap
(``cpu_compute.reuse_freed_memory``): page faults on fresh buffers otherwise made 64 chunks of a 32k
vocabulary cost 3-5x the unchunked loss.

The loss per token is ``a · nll + b · Σ_v (lse − z_v)`` (``LossForm``): PyTorch's label smoothing ε
is a = 1 − ε, b = ε/V; fairseq's (the DynamicConv recipe's) a = 1 − ε − ε/(V−1), b = ε/(V−1).
Ignored targets give 0 and no gradient. The node returns the loss per token; the reduction (sum,
mean over the targets that count, or over the examples as the caller defines it) is ordinary
autograd outside it.

Where it is used (``install``): a head is an output layer the model names (``lowmem_output_heads``,
the DynamicConv recipe's ``decoder.embed_out``) or a ``transformers`` model's
``get_output_embeddings()`` (an ``nn.Linear``, compact sparse or not, tied or not). While training
(grad enabled, the module in training mode) such a head returns ``LazyLogits``: a tensor of the
logits' shape and dtype that holds no data, only the hidden states and the head. Reshaping it,
widening it (``.float()``), selecting tokens from it keep it lazy; ``F.cross_entropy`` (and so
``nn.CrossEntropyLoss`` and transformers' own loss functions) on it is the chunked node. Anything
else that reads it — the caller's own use of ``output.logits``, a logit soft-cap, a bias added —
computes the logits in full through the head, with gradient, at plain PyTorch's cost (each such read
computes them again: they are never cached). Nothing is lost either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from lowmem.techniques import compact
from lowmem.techniques.cpu_compute import reuse_freed_memory

AUTO_MIN_BYTES = 8 * 2**20  # `auto` chunks when the FP32 logits would exceed this
AUTO_CHUNK_BYTES = 4 * 2**20  # `auto`'s chunk: FP32 logits of at most max(this, the hidden states' bytes)
# ... but never fewer tokens than this: a product of fewer rows runs far below the CPU's speed (2 cores
# of an AMD EPYC: 32 rows x 256 x 32,000 at 10 GFLOP/s, 256 rows at 27-35, 1,024 rows at 34-44).
AUTO_MIN_TOKENS = 128
IGNORE_INDEX = -100
_CHUNK_ATTR = "_lowmem_chunk_tokens"  # on a head module (its __dict__): the setting installed


def validate_chunk_tokens(value: Any) -> int | str | None:
    """``loss.chunk_tokens``: "auto", None / "none" (never chunked) or a positive number of tokens.
    Raises ValueError naming the knob and the allowed values."""
    if value is None or value == "none":
        return None
    if value == "auto":
        return "auto"
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"loss.chunk_tokens={value!r} is not allowed: auto, none or a positive number of tokens per chunk"
        )
    return value


def chunk_for(setting: int | str | None, tokens: int, vocab: int, hidden: int) -> int | None:
    """Tokens per chunk for ``tokens`` of ``vocab`` logits from ``hidden`` features, or None: unchunked."""
    setting = validate_chunk_tokens(setting)
    if setting is None:
        return None
    if setting == "auto":
        chunk = max(AUTO_MIN_TOKENS, max(AUTO_CHUNK_BYTES, tokens * hidden * 4) // (vocab * 4))
        return None if tokens * vocab * 4 <= AUTO_MIN_BYTES or chunk >= tokens else chunk
    return setting


@dataclass(frozen=True)
class LossForm:
    """The loss per token, ``nll_weight · nll + smooth_weight · Σ_v (lse − z_v)``, and its target to ignore."""

    nll_weight: float = 1.0
    smooth_weight: float = 0.0
    ignore_index: int = IGNORE_INDEX

    @classmethod
    def torch(cls, vocab: int, label_smoothing: float = 0.0, ignore_index: int = IGNORE_INDEX) -> LossForm:
        """``F.cross_entropy``'s: ε spread over all V classes."""
        return cls(1.0 - label_smoothing, label_smoothing / vocab, ignore_index)

    @classmethod
    def fairseq(cls, vocab: int, epsilon: float, ignore_index: int) -> LossForm:
        """fairseq's label-smoothed cross entropy: ε spread over the V − 1 other classes."""
        eps_i = epsilon / (vocab - 1)
        return cls(1.0 - epsilon - eps_i, eps_i, ignore_index)


# --- the node ---------------------------------------------------------------------------------------


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's product runs in: autocast's where it is on, else the weight's."""
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _sixteen_bit(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


class _LinearCrossEntropy(torch.autograd.Function):
    """(loss per token, nll per token) of ``x [N, H] @ W.T + bias`` against ``target [N]``, a chunk of
    ``chunk`` tokens at a time; W dense ``[V, H]`` or compact (``values``, ``columns``, ``row_starts``
    and its ``shape``). The product runs in ``compute``; the logits' arithmetic in ``logit_dtype``.
    The nll is not differentiable (a metric).

    Backward has two forms. As a rule, a slice of the vocabulary at a time from the saved
    log-sum-exp (FP32; FP64 for FP64): the weight's gradient is one product over every token,
    written once (in 16 bits, rounded once), and every product has all tokens as rows or as its
    inner dimension, so it runs at full speed. Where the logits are asked for narrower than the
    product computes them (FP64 weights with FP32 logits: transformers' ``.float()`` in an FP64
    run), a chunk of tokens at a time with the very ops plain PyTorch runs on each row
    (``log_softmax`` and its backward), so each token's logit gradient has plain's bits; the
    weight's gradient is then accumulated over chunks."""

    @staticmethod
    def forward(ctx, x, weight, columns, row_starts, bias, target, shape, form, chunk, compute, logit_dtype):
        if x.device.type == "cpu":
            # Each chunk's buffers are freed and allocated again: kept in glibc's heap, not faulted
            # in anew each time (64 chunks of a 32k vocabulary took 3-5x the unchunked loss without).
            reuse_freed_memory()
        # By slices of the vocabulary in backward, unless the logits were asked for narrower than the
        # product computes them (FP64 weights, FP32 logits: transformers' `.float()` in an FP64 run).
        by_vocab = _sixteen_bit(compute) or logit_dtype == _accumulation_dtype(compute)
        if by_vocab:
            logit_dtype = _accumulation_dtype(compute)
        w, b = _dense(weight, columns, row_starts, shape, bias, compute)
        tokens = x.shape[0]
        ignored = target.eq(form.ignore_index)
        safe = target.masked_fill(ignored, 0).unsqueeze(1)
        nll = x.new_empty(tokens, dtype=logit_dtype)
        smooth = x.new_zeros(tokens, dtype=logit_dtype)
        lse = x.new_empty(tokens, dtype=logit_dtype) if by_vocab else None
        with torch.autocast(x.device.type, enabled=False):
            for start in range(0, tokens, chunk):
                stop = min(start + chunk, tokens)
                logits = F.linear(x[start:stop].to(compute), w, b).to(logit_dtype)
                if by_vocab:  # from the log-sum-exp, which backward reads
                    lse[start:stop] = lse_chunk = torch.logsumexp(logits, -1)
                    nll[start:stop] = lse_chunk - logits.gather(1, safe[start:stop]).squeeze(1)
                    if form.smooth_weight:
                        smooth[start:stop] = logits.shape[1] * lse_chunk - logits.sum(-1)
                    del logits
                    continue
                log_probs = torch.log_softmax(logits, -1)  # plain's op, whose backward backward runs
                del logits
                nll[start:stop] = log_probs.gather(1, safe[start:stop]).squeeze(1).neg_()
                if form.smooth_weight:
                    smooth[start:stop] = log_probs.sum(-1).neg_()
                del log_probs
        nll.masked_fill_(ignored, 0.0)
        loss = form.nll_weight * nll
        if form.smooth_weight:
            loss = loss + form.smooth_weight * smooth.masked_fill_(ignored, 0.0)
        ctx.form, ctx.chunk, ctx.compute, ctx.shape, ctx.logit_dtype = form, chunk, compute, shape, logit_dtype
        ctx.save_for_backward(x, weight, columns, row_starts, bias, target, lse)
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        x, weight, columns, row_starts, bias, target, lse = ctx.saved_tensors
        form, compute, shape = ctx.form, ctx.compute, ctx.shape
        wants = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[4]
        w, b = _dense(weight, columns, row_starts, shape, bias, compute)
        ignored = target.eq(form.ignore_index)
        scale = grad_loss.to(ctx.logit_dtype).masked_fill(ignored, 0.0).unsqueeze(1)
        with torch.autocast(x.device.type, enabled=False):
            if lse is None:
                grads = _backward_by_tokens(x, w, b, target, ignored, scale, form, ctx.chunk, compute, wants)
            else:
                grads = _backward_by_vocab(x, w, b, target, ignored, scale, lse, form, ctx.chunk, compute, wants)
        grad_x, grad_w, grad_b = grads
        del w, b
        grad_x = None if grad_x is None else grad_x.to(x.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        if grad_w is not None:
            grad_w = (
                grad_w.to(weight.dtype) if shape is None else compact.gather(grad_w, columns, row_starts, weight.dtype)
            )
        return grad_x, grad_w, None, None, grad_b, None, None, None, None, None, None


def _dense(weight, columns, row_starts, shape, bias, compute):
    """The head's dense weight and bias in ``compute`` (a compact weight built dense for the call)."""
    dense = weight if shape is None else compact.densify(weight, columns, row_starts, shape)
    return dense.to(compute), None if bias is None else bias.to(compute)


def _backward_by_tokens(x, w, b, target, ignored, scale, form, chunk, compute, wants):
    """Logits narrower than the product: each chunk's logits and log-softmax again, and log-softmax's
    own backward (plain's bits per token)."""
    tokens, vocab = x.shape[0], w.shape[0]
    logit_dtype = scale.dtype
    grad_x = torch.empty_like(x, dtype=compute) if wants[0] else None
    grad_w = torch.zeros_like(w) if wants[1] else None
    grad_b = w.new_zeros(vocab) if wants[2] else None
    safe = target.masked_fill(ignored, 0).unsqueeze(1)
    for start in range(0, tokens, chunk):
        stop = min(start + chunk, tokens)
        xc = x[start:stop].to(compute)
        log_probs = torch.log_softmax(F.linear(xc, w, b).to(logit_dtype), -1)
        # d loss / d log_probs: -a at the target, -b everywhere (label smoothing), times the token's scale.
        grad = log_probs.new_zeros(log_probs.shape)
        if form.smooth_weight:
            grad.fill_(-form.smooth_weight)
            grad.mul_(scale[start:stop])
        grad.scatter_add_(1, safe[start:stop], scale[start:stop] * -form.nll_weight)
        grad = torch._log_softmax_backward_data(grad, log_probs, -1, logit_dtype)
        del log_probs
        grad = grad.to(compute)
        if wants[2]:
            grad_b.add_(grad.sum(0))
        if wants[0]:
            torch.mm(grad, w, out=grad_x[start:stop])
        if wants[1]:
            torch.addmm(grad_w, grad.t(), xc, out=grad_w)  # (addmm_ escapes the FLOP counters)
        del grad
    return grad_x, grad_w, grad_b


def _backward_by_vocab(x, w, b, target, ignored, scale, lse, form, chunk, compute, wants):
    """Slices of the vocabulary with as many logits as a forward chunk (at least one column); the
    weight's gradient written once per slice, the hidden states' accumulated in FP32 (FP64)."""
    tokens, vocab = x.shape[0], w.shape[0]
    acc = lse.dtype
    width = max(1, min(vocab, chunk * vocab // max(tokens, 1)))
    xc = x.to(compute)
    grad_x = x.new_zeros(x.shape, dtype=acc) if wants[0] else None
    grad_w = torch.empty_like(w) if wants[1] else None
    grad_b = w.new_empty(vocab, dtype=acc) if wants[2] else None
    for start in range(0, vocab, width):
        stop = min(start + width, vocab)
        logits = F.linear(xc, w[start:stop], None if b is None else b[start:stop]).to(acc)
        grad = logits.sub_(lse.unsqueeze(1)).exp_()  # the softmax's slice, in place
        if form.smooth_weight:
            grad.sub_(form.smooth_weight)
        # -a at each target inside the slice (a target elsewhere adds 0 at a clamped column).
        inside = (target >= start) & (target < stop) & ~ignored
        column = (target - start).clamp_(0, stop - start - 1).unsqueeze(1)
        grad.scatter_add_(1, column, (inside.to(acc) * -form.nll_weight).unsqueeze(1))
        grad.mul_(scale)
        if wants[2]:
            grad_b[start:stop] = grad.sum(0)
        grad = grad.to(compute)
        if wants[0]:
            grad_x.add_(grad.mm(w[start:stop]))
        if wants[1]:
            torch.mm(grad.t(), xc, out=grad_w[start:stop])
        del grad
    return grad_x, grad_w, grad_b


def linear_cross_entropy_per_token(
    x: torch.Tensor,
    head: Head,
    target: torch.Tensor,
    form: LossForm,
    chunk: int,
    logit_dtype: torch.dtype | None = None,
    offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, nll) per token, each [N], of ``x [N, H]`` through ``head`` (plus ``offset`` [V], a bias
    added to its logits): in ``logit_dtype`` (default: FP32, FP64 for FP64) where the head computes
    in FP32/FP64, in FP32 where it computes in 16 bits."""
    weight, columns, row_starts, shape = head.weight_parts()
    compute = _compute_dtype(x, weight)
    logit_dtype = logit_dtype or _accumulation_dtype(compute)
    bias = head.bias()
    if offset is not None:  # one bias for the node; autograd gives each its gradient
        bias = offset if bias is None else bias + offset
    return _LinearCrossEntropy.apply(x, weight, columns, row_starts, bias, target, shape, form, chunk, compute,
                                     logit_dtype)


def chunked_per_token(
    logits: LazyLogits, target: torch.Tensor, form: LossForm, logit_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, nll) per token of lazy ``logits [..., V]`` against ``target [...]`` (flattened)."""
    hidden = logits.hidden.reshape(-1, logits.hidden.shape[-1])
    tokens, vocab = hidden.shape[0], logits.shape[-1]
    chunk = chunk_for(logits.head.setting, tokens, vocab, hidden.shape[-1]) or tokens
    return linear_cross_entropy_per_token(
        hidden, logits.head, target.reshape(-1), form, chunk, logit_dtype, logits.offset
    )


# --- heads ------------------------------------------------------------------------------------------


class Head:
    """An output layer: ``module.<name>`` (a dense parameter or a compact sparse weight) and an
    optional bias ``module.<bias_name>``."""

    def __init__(self, module: nn.Module, name: str = "weight", bias_name: str | None = "bias") -> None:
        self.module, self.name, self.bias_name = module, name, bias_name

    def weight_parts(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Size | None]:
        """(dense weight, None, None, None) or (compact values, columns, row_starts, dense shape)."""
        if compact.is_compact(self.module, self.name):
            columns, row_starts = compact.index_of(self.module, self.name)
            return compact.trained_weight(self.module, self.name), columns, row_starts, self.shape()
        return getattr(self.module, self.name), None, None, None

    def shape(self) -> torch.Size:
        if compact.is_compact(self.module, self.name):
            return compact.compact_names(self.module)[self.name]
        return getattr(self.module, self.name).shape

    def bias(self) -> torch.Tensor | None:
        return None if self.bias_name is None else getattr(self.module, self.bias_name, None)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The full logits of ``x``, with gradient, as the layer itself computes them."""
        return compact.linear(self.module, self.name, x, self.bias())

    @property
    def setting(self) -> int | str | None:
        return self.module.__dict__.get(_CHUNK_ATTR)

    def lazy(self, x: torch.Tensor) -> torch.Tensor:
        """``LazyLogits`` of ``x`` while training with chunking installed, else the logits themselves."""
        if self.setting is None or not torch.is_grad_enabled() or not self.module.training:
            return self.logits(x)
        weight = self.weight_parts()[0]
        return LazyLogits(x, self, _compute_dtype(x, weight), x.requires_grad or weight.requires_grad)


# --- the lazy logits --------------------------------------------------------------------------------


_METADATA = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.ndimension,
    torch.Tensor.element_size, torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.get_device,
    torch.Tensor.__len__, torch.Tensor.stride, torch.Tensor.is_contiguous, torch.Tensor.requires_grad_,
}


class LazyLogits(torch.Tensor):
    """The logits ``head(hidden)`` of shape ``hidden.shape[:-1] + [V]``, not computed: see the module
    docstring. ``dtype``: the logits' (the head's compute dtype, or what ``.float()`` made it)."""

    @staticmethod
    def __new__(
        cls,
        hidden: torch.Tensor,
        head: Head,
        dtype: torch.dtype,
        requires_grad: bool,
        offset: torch.Tensor | None = None,
    ) -> LazyLogits:
        shape = (*hidden.shape[:-1], head.shape()[0])
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=hidden.device, requires_grad=requires_grad
        )

    def __init__(
        self,
        hidden: torch.Tensor,
        head: Head,
        dtype: torch.dtype,
        requires_grad: bool,
        offset: torch.Tensor | None = None,
    ) -> None:
        self.hidden, self.head, self.offset = hidden, head, offset  # offset: [V] added to the logits (a bias)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype}: computed where read)"

    def materialize(self) -> torch.Tensor:
        """The logits, computed through the head now (with gradient when it is on)."""
        logits = self.head.logits(self.hidden)
        return (logits if self.offset is None else logits + self.offset).to(self.dtype)

    def _with(
        self, hidden: torch.Tensor | None = None, dtype: torch.dtype | None = None, offset: torch.Tensor | None = None
    ) -> LazyLogits:
        return LazyLogits(
            self.hidden if hidden is None else hidden,
            self.head,
            dtype or self.dtype,
            self.requires_grad or (offset is not None and offset.requires_grad),
            self.offset if offset is None else offset,
        )

    @classmethod
    def __torch_function__(cls, func: Callable, types: Sequence[type], args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        if func in _METADATA or getattr(func, "__name__", "") == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        handler = _LAZY.get(func)
        if handler is not None:
            result = handler(*args, **kwargs)
            if result is not NotImplemented:
                return result
        args, kwargs = tree_map(_materialized, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Callable, types: Sequence[type], args: tuple = (), kwargs: dict | None = None):
        raise RuntimeError(
            f"lowmem's lazy logits reached {func} below torch's Python API, where their gradient would be lost; "
            "set loss.chunk_tokens=none to compute this model's logits in full"
        )


def _materialized(value: Any) -> Any:
    return value.materialize() if isinstance(value, LazyLogits) else value


def _dtype_of(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype a ``Tensor.to`` call asks for, if it asks for nothing else (no device, no copy...)."""
    extra = {k: v for k, v in kwargs.items() if k not in ("dtype", "non_blocking", "copy")}
    if extra or kwargs.get("copy"):
        return None
    options = list(args) + ([kwargs["dtype"]] if "dtype" in kwargs else [])
    if len(options) == 1 and isinstance(options[0], torch.dtype):
        return options[0]
    if len(options) == 1 and isinstance(options[0], torch.Tensor) and not isinstance(options[0], LazyLogits):
        return options[0].dtype if options[0].device == args[0].device else None
    return None


def _to(self: LazyLogits, *args: Any, **kwargs: Any) -> Any:
    dtype = _dtype_of(args, kwargs)
    if dtype is None or not dtype.is_floating_point:
        return NotImplemented
    return self if dtype == self.dtype else self._with(dtype=dtype)


def _reshape(self: LazyLogits, *shape: Any) -> Any:
    sizes = shape[0] if len(shape) == 1 and isinstance(shape[0], Sequence) else shape
    sizes = list(sizes)
    vocab = self.shape[-1]
    if sizes.count(-1) > 1:
        return NotImplemented
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if known == 0:
            return NotImplemented
        sizes[sizes.index(-1)] = self.numel() // known
    if not sizes or sizes[-1] != vocab or math.prod(sizes) != self.numel():
        return NotImplemented
    return self._with(hidden=self.hidden.reshape(*sizes[:-1], self.hidden.shape[-1]))


def _getitem(self: LazyLogits, index: Any) -> Any:
    """Tokens selected by slices and integers over the leading dims; the vocabulary left whole."""
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        if index.count(Ellipsis) > 1:
            return NotImplemented
        index = index[:at] + (slice(None),) * (self.dim() - len(index) + 1) + index[at + 1 :]
    if len(index) > self.dim() or not all(isinstance(i, slice | int) and not isinstance(i, bool) for i in index):
        return NotImplemented
    if len(index) == self.dim():
        if index[-1] != slice(None):
            return NotImplemented
        index = index[:-1]
    return self._with(hidden=self.hidden[index])


def _add(a: Any, b: Any, *, alpha: Any = None) -> Any:
    """Lazy logits plus a bias over the vocabulary (BART's ``final_logits_bias``): still lazy."""
    lazy, other = (a, b) if isinstance(a, LazyLogits) else (b, a)
    vocab = lazy.shape[-1]
    if (
        alpha is not None
        or not isinstance(other, torch.Tensor)
        or isinstance(other, LazyLogits)
        or other.dim() < 1
        or other.shape[-1] != vocab
        or any(size != 1 for size in other.shape[:-1])
        or other.dim() > lazy.dim()
        or other.device != lazy.device
        or not other.is_floating_point()
    ):
        return NotImplemented
    offset = other.reshape(vocab)
    if lazy.offset is not None:
        offset = lazy.offset + offset
    return lazy._with(dtype=torch.promote_types(lazy.dtype, other.dtype), offset=offset)


def _cross_entropy(
    input: Any,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: Any = None,
    ignore_index: int = IGNORE_INDEX,
    reduce: Any = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Any:
    """``F.cross_entropy`` on lazy logits of [N, V] with class targets: the chunked node."""
    if (
        not isinstance(input, LazyLogits)
        or input.dim() != 2
        or weight is not None
        or size_average is not None
        or reduce is not None
        or target.dim() != 1
        or target.is_floating_point()
        or reduction not in ("mean", "sum", "none")
    ):
        return NotImplemented
    form = LossForm.torch(input.shape[-1], label_smoothing, ignore_index)
    loss, _ = chunked_per_token(input, target, form, logit_dtype=input.dtype)
    if reduction == "none":
        return loss.to(input.dtype)
    total = loss.sum()
    if reduction == "mean":
        total = total / target.ne(ignore_index).sum()
    return total.to(input.dtype)


_LAZY: dict[Callable, Callable] = {
    torch.Tensor.to: _to,
    torch.Tensor.float: lambda self, *a, **k: NotImplemented if a or k else self._with(dtype=torch.float32),
    torch.Tensor.double: lambda self, *a, **k: NotImplemented if a or k else self._with(dtype=torch.float64),
    torch.Tensor.contiguous: lambda self, *a, **k: self,
    torch.Tensor.view: _reshape,
    torch.Tensor.reshape: _reshape,
    torch.reshape: lambda self, shape: _reshape(self, shape),
    torch.Tensor.__getitem__: _getitem,
    torch.Tensor.__add__: _add,
    torch.Tensor.__radd__: lambda self, other: _add(other, self),
    torch.Tensor.add: _add,
    torch.add: _add,
    F.cross_entropy: _cross_entropy,
}


# --- where heads are -------------------------------------------------------------------------------


def output_heads(model: nn.Module) -> list[Head]:
    """The model's output layers: those it declares (``lowmem_output_heads()``: (module, weight name,
    bias name or None) triples) or a ``transformers`` model's linear ``get_output_embeddings()``."""
    declared = getattr(model, "lowmem_output_heads", None)
    if callable(declared):
        return [Head(module, name, bias) for module, name, bias in declared()]
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            layer = getter()
        except (NotImplementedError, AttributeError):
            return []
        if isinstance(layer, nn.Linear):
            return [Head(layer)]
    return []


def install(model: nn.Module, setting: Any) -> list[Head]:
    """Chunk the loss of ``model``'s output layers (``output_heads``) as ``setting`` says; the heads."""
    setting = validate_chunk_tokens(setting)
    heads = output_heads(model)
    for head in heads:
        module = head.module
        if setting is None:
            module.__dict__.pop(_CHUNK_ATTR, None)
            if isinstance(module.__dict__.get("forward"), _HeadForward):
                del module.__dict__["forward"]
            continue
        module.__dict__[_CHUNK_ATTR] = setting
        if isinstance(module, nn.Linear) and head.name == "weight":
            module.__dict__["forward"] = _HeadForward(module)
    return heads


class _HeadForward:
    """An ``nn.Linear`` head's forward under chunking (picklable, unlike a bound lambda)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return Head(self.module).lazy(x)


def installed(model: nn.Module) -> bool:
    """Whether any output layer of ``model`` has chunking installed."""
    return any(head.setting is not None for head in output_heads(model))
