"""Compact storage of sparse weights: nonzero values and their positions, never a dense weight at rest.

A sparse weight of dense shape S with k active entries is held as

- ``<name>_values``: the k active values, a 1-D ``nn.Parameter`` in the weight's dtype (trained: its
  gradient and its optimizer state have k entries too), and
- ``<name>_positions``: their k flat indices into the dense weight, int32, strictly increasing (a
  buffer),

on the module that owned the dense weight, which is removed. Every compact weight of a model is a
view into two flat buffers (``CompactWeights.values`` / ``.positions``) whose capacity, the total
number of active weights, never changes: a rewiring rewrites entries and moves layer boundaries in
place, so nothing is reallocated.

A layer builds its dense weight when it computes and drops it right after: autograd saves the
layer's input (and the compact tensors, which are model state), not the dense weight; backward
builds it again, runs the layer's backward kernels and gathers the weight gradient at the positions.
The layers: ``nn.Conv2d``, ``nn.Linear`` and ``nn.Embedding`` (their class gains a compact
forward), and a bare 2-D parameter that the model applies with ``linear(module, name, x)`` (a
decoder's output projection, say). The state-dict keys change (``conv.weight`` becomes
``conv.weight_values`` + ``conv.weight_positions``); ``dense_state_dict`` gives the plain form.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

_VALUES, _POSITIONS = "_values", "_positions"
_SHAPES = "_compact_shapes"  # module attribute: {weight attribute: dense shape}


# --- building and reading dense weights ------------------------------------------------------------


def densify(values: torch.Tensor, positions: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The dense weight of ``shape``: ``values`` at flat ``positions``, zeros elsewhere (no autograd)."""
    dense = values.new_zeros(math.prod(shape))
    dense.index_put_((positions,), values)
    return dense.view(shape)


def gather(dense_grad: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The entries of ``dense_grad`` at flat ``positions`` (the gradient of the compact values)."""
    return dense_grad.reshape(-1).index_select(0, positions)


def is_compact(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s weight ``name`` is held in compact form."""
    return name in getattr(module, _SHAPES, {})


def compact_names(module: nn.Module) -> dict[str, torch.Size]:
    """The compact weights of ``module`` (its own, not its children's): attribute -> dense shape."""
    return dict(getattr(module, _SHAPES, {}))


def dense_weight(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """``module``'s weight ``name`` as a dense tensor: the parameter itself, or one built from the
    compact form (a new tensor outside autograd)."""
    if not is_compact(module, name):
        return getattr(module, name)
    with torch.no_grad():
        return densify(_values(module, name), _positions(module, name), getattr(module, _SHAPES)[name])


def trained_weight(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """The tensor the optimizer trains for weight ``name``: the dense parameter or the compact values."""
    return _values(module, name) if is_compact(module, name) else getattr(module, name)


def _values(module: nn.Module, name: str) -> torch.Tensor:
    return getattr(module, name + _VALUES)


def _positions(module: nn.Module, name: str) -> torch.Tensor:
    return getattr(module, name + _POSITIONS)


# --- the layers' computations ------------------------------------------------------------------


def _dtype_for(grad: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in ``grad``'s dtype (under autocast the forward computed in that dtype)."""
    return tensor if tensor.dtype == grad.dtype else tensor.to(grad.dtype)


def conv2d_backward(
    conv: nn.Conv2d,
    grad_output: torch.Tensor,
    x: torch.Tensor,
    trained: torch.Tensor,
    bias_shape: Sequence[int] | None,
    wanted: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``conv``'s input, trained weight (``trained_weight(conv)``) and bias from those of
    its output, with the kernels autograd calls (under autocast in ``grad_output``'s dtype). A
    compact weight is built for the input gradient only and dropped before the weight gradient,
    computed from the input alone (as ``torch.nn.grad.conv2d_weight`` does), is gathered: one
    dense weight-sized tensor at a time, never two."""
    args = (conv.stride, conv.padding, conv.dilation, False, [0, 0], conv.groups)
    x = _dtype_for(grad_output, x)
    need_x, need_weight, need_bias = wanted
    if not is_compact(conv, "weight"):
        weight = _dtype_for(grad_output, trained)
        return torch.ops.aten.convolution_backward(grad_output, x, weight, bias_shape, *args, list(wanted))
    grad_x = grad_values = grad_bias = None
    shape = conv.compact_shape("weight")
    positions = _positions(conv, "weight")
    if need_x:
        weight = _dtype_for(grad_output, densify(trained, positions, shape))
        grad_x = torch.ops.aten.convolution_backward(grad_output, x, weight, None, *args, [True, False, False])[0]
        del weight
    if need_weight or need_bias:
        shape_only = grad_output.new_empty(1).expand(shape)  # the kernel reads the weight's shape only
        _, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad_output, x, shape_only, bias_shape, *args, [False, need_weight, need_bias]
        )
        if grad_weight is not None:
            grad_values = gather(grad_weight, positions).to(trained.dtype)
    return grad_x, grad_values, grad_bias


class _CompactConv2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, values, positions, bias, conv):
        ctx.conv, ctx.bias_shape = conv, None if bias is None else bias.shape
        ctx.save_for_backward(x, values, positions)
        weight = densify(values, positions, conv.compact_shape("weight"))
        return F.conv2d(x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)

    @staticmethod
    def backward(ctx, grad_output):
        x, values, _ = ctx.saved_tensors
        wanted = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3])
        grad_x, grad_values, grad_bias = conv2d_backward(ctx.conv, grad_output, x, values, ctx.bias_shape, wanted)
        return grad_x, grad_values, None, grad_bias, None


class _CompactLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, values, positions, bias, shape):
        ctx.shape = shape
        ctx.save_for_backward(x, values, positions)
        return F.linear(x, densify(values, positions, shape), bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, values, positions = ctx.saved_tensors
        grad_x = grad_values = grad_bias = None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        if ctx.needs_input_grad[0]:
            weight = _dtype_for(grad_output, densify(values, positions, ctx.shape))
            grad_x = grad_output.matmul(weight)
            del weight
        if ctx.needs_input_grad[1]:
            x_2d = _dtype_for(grad_output, x).reshape(-1, x.shape[-1])
            grad_values = gather(grad_2d.t().mm(x_2d), positions).to(values.dtype)
        if ctx.needs_input_grad[3]:
            grad_bias = grad_2d.sum(0)
        return grad_x, grad_values, None, grad_bias, None


class _CompactEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, values, positions, embedding):
        ctx.embedding = embedding
        ctx.save_for_backward(tokens, values, positions)
        weight = densify(values, positions, embedding.compact_shape("weight"))
        padding_idx = -1 if embedding.padding_idx is None else embedding.padding_idx
        return torch.ops.aten.embedding(weight, tokens, padding_idx, embedding.scale_grad_by_freq, False)

    @staticmethod
    def backward(ctx, grad_output):
        tokens, values, positions = ctx.saved_tensors
        embedding = ctx.embedding
        padding_idx = -1 if embedding.padding_idx is None else embedding.padding_idx
        grad_weight = torch.ops.aten.embedding_dense_backward(
            grad_output, tokens, embedding.num_embeddings, padding_idx, embedding.scale_grad_by_freq
        )
        return None, gather(grad_weight, positions).to(values.dtype), None, None


def linear(module: nn.Module, name: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, module.<name>, bias)`` for a bare weight parameter, compact or dense."""
    if not is_compact(module, name):
        return F.linear(x, getattr(module, name), bias)
    return _CompactLinear.apply(x, _values(module, name), _positions(module, name), bias, module._compact_shapes[name])


class _CompactModule:
    """Mixin of the compact layer classes: ``weight`` reads as a dense tensor (built on demand)."""

    def compact_shape(self, name: str) -> torch.Size:
        return getattr(self, _SHAPES)[name]

    @property
    def weight(self) -> torch.Tensor:
        return dense_weight(self, "weight")


class CompactConv2d(_CompactModule, nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _CompactConv2d.apply(x, self.weight_values, self.weight_positions, self.bias, self)


class CompactLinear(_CompactModule, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.compact_shape("weight")
        return _CompactLinear.apply(x, self.weight_values, self.weight_positions, self.bias, shape)


class CompactEmbedding(_CompactModule, nn.Embedding):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return _CompactEmbedding.apply(tokens, self.weight_values, self.weight_positions, self)


_COMPACT_CLASSES = {nn.Conv2d: CompactConv2d, nn.Linear: CompactLinear, nn.Embedding: CompactEmbedding}
_DENSE_CLASSES = {compact: dense for dense, compact in _COMPACT_CLASSES.items()}


def check_compactable(module: nn.Module, name: str, qualified: str) -> None:
    """Raise ValueError (naming the weight) unless compact storage can hold and run ``module.<name>``."""
    kind = type(module)
    if name == "weight" and kind in _COMPACT_CLASSES:
        problem = None
        if kind is nn.Conv2d and (module.padding_mode != "zeros" or isinstance(module.padding, str)):
            problem = "a Conv2d with numeric zero padding"
        if kind is nn.Embedding and (module.max_norm is not None or module.sparse):
            problem = "an Embedding without max_norm and sparse=False"
        if problem is None:
            return
        raise ValueError(f"sparsity.storage=compact: {qualified} must be {problem}; use sparsity.storage=masked")
    if kind in _COMPACT_CLASSES or getattr(module, name).dim() != 2:
        raise ValueError(
            f"sparsity.storage=compact holds the weights of nn.Conv2d, nn.Linear and nn.Embedding, and 2-D "
            f"parameters that the model applies with lowmem.techniques.compact.linear; {qualified} is neither "
            "(use sparsity.storage=masked)"
        )


# --- the flat buffers ---------------------------------------------------------------------------------


class CompactWeights:
    """Every compact sparse weight of one model, as views into two flat buffers of fixed capacity.

    ``names`` are parameter names of ``model`` (``conv1.weight``, ``decoder.embed_out``); ``masks``
    says which entries are active (bool, the weights' shapes). Construction moves the active values
    of each weight into the buffers and removes the dense weights from the model.
    """

    def __init__(self, model: nn.Module, names: Sequence[str], masks: Mapping[str, torch.Tensor]) -> None:
        self.names = list(names)
        self._owners = {name: _owner(model, name) for name in self.names}
        dense = {name: getattr(module, attr) for name, (module, attr) in self._owners.items()}
        dtypes = {w.dtype for w in dense.values()}
        devices = {w.device for w in dense.values()}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"sparsity.storage=compact needs every sparse weight in one dtype on one device; got "
                f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}"
            )
        for name, (module, attr) in self._owners.items():
            check_compactable(module, attr, name)
        positions = {name: masks[name].flatten().nonzero().squeeze(1) for name in self.names}
        self.capacity = sum(p.numel() for p in positions.values())
        (dtype,), (device,) = dtypes, devices
        self.values = torch.empty(self.capacity, dtype=dtype, device=device)
        self.positions = torch.empty(self.capacity, dtype=torch.int32, device=device)
        self.counts = [0] * len(self.names)
        with torch.no_grad():
            layers = {name: (positions[name], dense[name].flatten()[positions[name]]) for name in self.names}
            for name, (module, attr) in self._owners.items():
                _install(module, attr, dense[name].shape)
            self.relayout(layers)

    # ------------------------------------------------------------------------------------ layers
    def layer(self, name: str) -> tuple[nn.Parameter, torch.Tensor]:
        """The values parameter and the positions of weight ``name`` (views into the buffers)."""
        module, attr = self._owners[name]
        return _values(module, attr), _positions(module, attr)

    def shape(self, name: str) -> torch.Size:
        module, attr = self._owners[name]
        return getattr(module, _SHAPES)[attr]

    def owner(self, name: str) -> tuple[nn.Module, str]:
        return self._owners[name]

    def dense(self, name: str) -> torch.Tensor:
        """Weight ``name`` as a new dense tensor."""
        module, attr = self._owners[name]
        return dense_weight(module, attr)

    def mask(self, name: str) -> torch.Tensor:
        """A new dense bool tensor, True at the active entries of weight ``name``."""
        _, positions = self.layer(name)
        mask = torch.zeros(math.prod(self.shape(name)), dtype=torch.bool, device=positions.device)
        return mask.index_put_((positions,), mask.new_ones(())).view(self.shape(name))

    @torch.no_grad()
    def relayout(self, layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store new (positions, values) for every weight, positions strictly increasing, their total
        at most the capacity; the layers' views move to their new places inside the same buffers
        (unused capacity, only when a rewiring could not regrow all it pruned, holds zeros)."""
        self._follow_the_model()
        total = sum(positions.numel() for positions, _ in layers.values())
        if total > self.capacity:
            raise ValueError(f"compact sparse weights: {total} active entries exceed the capacity {self.capacity}")
        # Stage everything first: a layer's new place may overlap another layer's old one.
        staged_values = torch.cat([layers[name][1].to(self.values.dtype) for name in self.names])
        staged_positions = torch.cat([layers[name][0].to(torch.int32) for name in self.names])
        self.values[:total].copy_(staged_values)
        self.positions[:total].copy_(staged_positions)
        self.values[total:].zero_()
        self.positions[total:].zero_()
        start = 0
        for index, name in enumerate(self.names):
            count = layers[name][0].numel()
            module, attr = self._owners[name]
            getattr(module, attr + _VALUES).data = self.values[start : start + count]
            module._buffers[attr + _POSITIONS] = self.positions[start : start + count]
            self.counts[index] = count
            start += count


    def _follow_the_model(self) -> None:
        """If the model was cast or moved since (``model.to(...)`` gives every parameter and buffer
        storage of its own), make buffers of the new dtype and device hold the layers again."""
        values, positions = zip(*(self.layer(name) for name in self.names), strict=True)
        if all(v.untyped_storage().data_ptr() == self.values.untyped_storage().data_ptr() for v in values):
            return
        used = sum(self.counts)
        self.values = torch.cat([*(v.detach() for v in values), values[0].new_zeros(self.capacity - used)])
        self.positions = torch.cat([*positions, positions[0].new_zeros(self.capacity - used)])


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, attr = name.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), attr


def _install(module: nn.Module, attr: str, shape: torch.Size) -> None:
    """Replace ``module.<attr>`` (a dense parameter) by an (empty, for now) compact pair."""
    dense = module._parameters[attr]
    shapes = dict(getattr(module, _SHAPES, {}))
    shapes[attr] = torch.Size(shape)
    object.__setattr__(module, _SHAPES, shapes)
    values = nn.Parameter(dense.new_empty(0), requires_grad=dense.requires_grad)
    _replace_in_order(module._parameters, attr, attr + _VALUES, values)  # state-dict keys keep their order
    module.register_buffer(attr + _POSITIONS, torch.empty(0, dtype=torch.int32, device=dense.device))
    compact_class = _COMPACT_CLASSES.get(type(module))
    if attr == "weight" and compact_class is not None:
        module.__class__ = compact_class


def _replace_in_order(table: dict, old: str, new: str, value: object) -> None:
    items = [(new, value) if key == old else (key, item) for key, item in table.items()]
    table.clear()
    table.update(items)


def _uninstall(module: nn.Module, attr: str, weight: torch.Tensor) -> None:
    _replace_in_order(module._parameters, attr + _VALUES, attr, nn.Parameter(weight))
    del module._buffers[attr + _POSITIONS]
    shapes = dict(getattr(module, _SHAPES))
    del shapes[attr]
    object.__setattr__(module, _SHAPES, shapes)
    if attr == "weight" and type(module) in _DENSE_CLASSES:
        module.__class__ = _DENSE_CLASSES[type(module)]


def compact_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(module prefix, module, weight attribute) of every compact weight of ``model``."""
    for prefix, module in model.named_modules():
        for attr in compact_names(module):
            yield prefix, module, attr


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every compact weight as its plain dense tensor, under the dense
    weight's own key and in its place: what a model without compact storage would save.

    The dense weights are CPU tensors: each is built on the model's device and copied out at once,
    so saving a sparse model never holds more than one dense weight on an accelerator."""
    state = model.state_dict()
    dense = {}
    for prefix, module, attr in compact_modules(model):
        key = f"{prefix}.{attr}" if prefix else attr
        dense[key + _VALUES] = (key, dense_weight(module, attr).detach().to("cpu", copy=True))
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key in dense:
            name, weight = dense[key]
            out[name] = weight
        elif not (key.endswith(_POSITIONS) and key[: -len(_POSITIONS)] + _VALUES in dense):
            out[key] = value
    return out


def dense_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` in which every compact weight is a plain dense parameter again."""
    clone = copy.deepcopy(model)
    for _, module, attr in list(compact_modules(clone)):
        _uninstall(module, attr, dense_weight(module, attr).clone())
    return clone


# --- the dense model's state-dict keys, for a model prepared for a user's own loop -------------------

_RAW_KEYS = [0]  # > 0 inside compact_state_dict_keys()


@contextlib.contextmanager
def compact_state_dict_keys() -> Iterator[None]:
    """Inside, a model given ``use_dense_keys`` saves and loads its compact entries as they are
    (``<name>_values`` / ``<name>_positions``): what a resumable checkpoint needs."""
    _RAW_KEYS[0] += 1
    try:
        yield
    finally:
        _RAW_KEYS[0] -= 1


def use_dense_keys(model: nn.Module) -> None:
    """Make ``model.state_dict()`` and ``model.load_state_dict()`` use the dense model's keys: each
    compact weight is saved as its dense tensor under its own key (``conv.weight``), in its place,
    and a dense weight loaded is stored at the current active positions (it must be zero elsewhere).
    So a user's checkpoint and evaluation code keep working on a sparse model."""
    if getattr(model, "_lowmem_dense_keys", False):
        return
    model._register_state_dict_hook(_save_dense_keys)
    model.register_load_state_dict_pre_hook(_load_dense_keys)
    object.__setattr__(model, "_lowmem_dense_keys", True)


def _save_dense_keys(model: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    if _RAW_KEYS[0]:
        return
    dense = {}
    for path, module, attr in compact_modules(model):
        key = prefix + (f"{path}.{attr}" if path else attr)
        dense[key + _VALUES] = (key, dense_weight(module, attr).detach())
    if not dense:
        return
    items = list(state.items())
    state.clear()
    for key, value in items:
        if key in dense:
            name, weight = dense[key]
            state[name] = weight
        elif not (key.endswith(_POSITIONS) and key[: -len(_POSITIONS)] + _VALUES in dense):
            state[key] = value


def _load_dense_keys(model: nn.Module, state: dict, prefix: str, *args: object) -> None:
    if _RAW_KEYS[0]:
        return
    for path, module, attr in compact_modules(model):
        key = prefix + (f"{path}.{attr}" if path else attr)
        if key not in state:
            continue
        weight = state.pop(key).reshape(-1)
        positions = _positions(module, attr)
        values = weight.index_select(0, positions.to(weight.device).long())
        if int(weight.count_nonzero()) != int(values.count_nonzero()):
            raise ValueError(
                f"load_state_dict: {key} has nonzero entries outside the sparse weight's active positions "
                "(a dense weight loads into a sparse model only where the model's mask is active)"
            )
        state[key + _VALUES] = values
        state[key + _POSITIONS] = positions.detach().clone()
