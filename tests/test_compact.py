"""Compact sparse storage (lowmem.techniques.compact): the position format (int16 columns over rows of
2^15 entries) against flat positions, the layers against dense-masked references (bitwise), the
fixed-capacity buffers, the plain state dict, the former layout's checkpoints, and compact vs
dense-masked training in FP64."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import lowmem
from lowmem.profiler import account_activations
from lowmem.techniques import compact
from lowmem.techniques.checkpointing import apply_checkpointing
from lowmem.techniques.optimizers import LowPrecisionAdam, LowPrecisionSGD
from lowmem.techniques.sparsity import DynamicSparsity, RewireSchedule
from recipes.wrn_cifar.model import WideResNet
from tests.helpers import lm_loss, tiny_gpt


class Mixed(nn.Module):
    """Every kind of layer compact storage runs: strided grouped conv with bias, 3-D linear with bias,
    embedding with a padding row, and a bare output matrix applied with ``compact.linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)
        self.embed = nn.Embedding(11, 6, padding_idx=1)
        self.proj = nn.Linear(6, 8)
        self.out = nn.Parameter(torch.randn(5, 8) * 0.3)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        pooled = F.relu(self.conv(images)).mean((2, 3))  # [B, 6]
        h = torch.tanh(self.proj(self.embed(tokens) + pooled[:, None, :]))  # [B, T, 8]
        return compact.linear(self, "out", h)  # [B, T, 5]


NAMES = ["conv.weight", "embed.weight", "proj.weight", "out"]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    images = torch.randn(3, 4, 9, 9, generator=generator, dtype=torch.float64)
    tokens = torch.randint(0, 11, (3, 7), generator=generator)
    tokens[0, -2:] = 1  # padding
    return images, tokens, torch.randint(0, 5, (3, 7), generator=generator)


def every(updates: int) -> RewireSchedule:
    return RewireSchedule(starts=(0,), periods=(updates,), stop=1e12, unit="update")


def sparse_model(storage: str, density: float = 0.4, **kwargs) -> tuple[Mixed, DynamicSparsity]:
    torch.manual_seed(0)
    model = Mixed().double()
    kwargs.setdefault("init_threshold", 0.05)
    sparsity = DynamicSparsity(model, NAMES, density, schedule=every(3), rewire_fraction=0.1, storage=storage, **kwargs)
    return model, sparsity


def exact(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# A convolution's backward: one kernel call for a small weight, or, for a large one (1 byte stands for
# it), the input's gradient and then the weight's, each dense weight-sized tensor dropped in between.
@pytest.mark.parametrize("one_call_bytes", [compact.ONE_CALL_BYTES, 1])
def test_compact_layers_equal_dense_masked_ones_forward_and_backward_bitwise(one_call_bytes, monkeypatch):
    monkeypatch.setattr(compact, "ONE_CALL_BYTES", one_call_bytes)
    model, sparsity = sparse_model("compact")
    reference = compact.dense_copy(model)
    images, tokens, _ = batch(0)
    images_a, images_b = images.clone().requires_grad_(), images.clone().requires_grad_()
    out = model(images_a, tokens)
    expected = reference(images_b, tokens)
    exact(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    exact(images_a.grad, images_b.grad)
    for name in NAMES:
        values, positions = sparsity.compact.layer(name)
        exact(values.grad, reference.get_parameter(name).grad.reshape(-1)[positions])
    exact(model.conv.bias.grad, reference.conv.bias.grad)
    exact(model.proj.bias.grad, reference.proj.bias.grad)


class MoreLayers(nn.Module):
    """The other layers compact storage runs: an embedding, a grouped Conv1d, a strided Conv3d and
    transformers' Conv1D (weight [in, out]) when transformers is installed (else an nn.Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 6, padding_idx=0)
        self.conv1 = nn.Conv1d(6, 6, 3, padding=1, groups=2)
        self.conv3 = nn.Conv3d(6, 4, (1, 2, 2), stride=(1, 1, 2))
        try:
            from transformers.pytorch_utils import Conv1D
        except ImportError:
            self.proj = nn.Linear(4, 5)
        else:
            self.proj = Conv1D(5, 4)
            nn.init.normal_(self.proj.bias, std=0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv1(self.embed(tokens).transpose(1, 2)))  # [B, 6, T]
        volume = self.conv3(h.unflatten(2, (1, 2, -1)))  # [B, 4, 1, 1, T/2 - 1]
        return self.proj(volume.flatten(2).transpose(1, 2).contiguous())  # [B, T/2 - 1, 5]


MORE_NAMES = ["embed.weight", "conv1.weight", "conv3.weight", "proj.weight"]


def more_layers(storage: str) -> tuple[MoreLayers, DynamicSparsity]:
    torch.manual_seed(0)
    model = MoreLayers().double()
    sparsity = DynamicSparsity(model, MORE_NAMES, 0.4, schedule=every(3), init="model", storage=storage)
    return model, sparsity


def tokens_of(step: int) -> torch.Tensor:
    return torch.randint(0, 13, (3, 16), generator=torch.Generator().manual_seed(step))


def test_conv1d_conv3d_embedding_and_transformers_conv1d_compact_equal_dense_masked_ones():
    model, sparsity = more_layers("compact")
    if not compact.is_transformers_conv1d(MoreLayers().proj):
        pytest.skip("transformers is not installed")
    assert [type(module).__name__ for module in model.children()] == [
        "CompactEmbedding", "CompactConv1d", "CompactConv3d", "CompactConv1D"]  # fmt: skip
    reference = compact.dense_copy(model)
    assert type(reference.proj).__name__ == "Conv1D" and reference.proj.weight.shape == (4, 5)
    out, expected = model(tokens_of(0)), reference(tokens_of(0))
    exact(out, expected)  # the forward runs the layers' own kernels: bitwise
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for name in MORE_NAMES:
        values, positions = sparsity.compact.layer(name)
        torch.testing.assert_close(values.grad, reference.get_parameter(name).grad.reshape(-1)[positions],
                                   rtol=1e-13, atol=1e-15, msg=name)  # fmt: skip
    for name in ("conv1.bias", "conv3.bias", "proj.bias"):
        torch.testing.assert_close(model.get_parameter(name).grad, reference.get_parameter(name).grad,
                                   rtol=1e-13, atol=1e-15, msg=name)  # fmt: skip


def test_conv1d_conv3d_embedding_and_conv1d_one_fp64_step_compact_equals_masked():
    weights = {}
    for storage in ("compact", "masked"):
        model, sparsity = more_layers(storage)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(2):
            optimizer.zero_grad()
            model(tokens_of(step)).square().mean().backward()
            sparsity.mask_gradients()
            optimizer.step()
        weights[storage] = {name: sparsity.dense_weight(name).detach().clone() for name in MORE_NAMES}
        weights[storage]["proj.bias"] = model.proj.bias.detach().clone()
    for name, value in weights["compact"].items():
        torch.testing.assert_close(value, weights["masked"][name], rtol=1e-12, atol=1e-14, msg=name)
        assert value.count_nonzero() > 0, name


class Tied(nn.Module):
    """A language model whose output projection is its embedding (GPT-2's, T5's tie)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, 40, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


def test_a_tied_weight_is_sparsified_once_and_stays_tied_in_every_place():
    torch.manual_seed(0)
    model = Tied().double()
    reference_dense = copy.deepcopy(model)
    sparsity = DynamicSparsity(model, ["embed.weight"], 0.3, schedule=every(2), init="model")
    assert model.head.weight_values is model.embed.weight_values
    assert [name for name, _ in model.named_parameters()].count("embed.weight_values") == 1
    assert len(list(model.named_parameters())) == len(list(reference_dense.named_parameters()))
    for suffix in ("_columns", "_row_starts"):
        assert getattr(model.head, "weight" + suffix) is getattr(model.embed, "weight" + suffix)
    assert torch.equal(model.head.weight, model.embed.weight)
    reference = compact.dense_copy(model)
    assert reference.head.weight is reference.embed.weight  # the dense copy is tied too
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(4):  # two rewirings: both places follow the new positions
        optimizer.zero_grad()
        F.cross_entropy(model(tokens_of(step) % 40).flatten(0, 1), tokens_of(step + 1).flatten() % 40).backward()
        optimizer.step()
        sparsity.after_optimizer_step(optimizer, epoch=0.0)
        for suffix in ("_columns", "_row_starts"):
            assert getattr(model.head, "weight" + suffix) is getattr(model.embed, "weight" + suffix)
    assert sparsity.compact.capacity == round(0.3 * 40 * 8)
    # One gradient for both uses: the tied values gradient is the embedding's plus the projection's.
    reference = compact.dense_copy(model)
    tokens = tokens_of(9) % 40
    model.zero_grad()
    model(tokens).sum().backward()
    reference(tokens).sum().backward()
    values, positions = sparsity.compact.layer("embed.weight")
    torch.testing.assert_close(values.grad, reference.embed.weight.grad.reshape(-1)[positions], rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("layer", ["linear", "conv1d", "embedding"])
def test_a_compact_layers_output_can_be_modified_in_place_by_the_next_op(layer):
    # F.linear returns a 3-D input's product as a view; swin_v2_t writes into its linears' outputs.
    torch.manual_seed(0)
    module = {"linear": nn.Linear(6, 4), "conv1d": nn.Conv1d(6, 4, 1), "embedding": nn.Embedding(6, 4)}[layer].double()
    DynamicSparsity(module, ["weight"], 0.5, schedule=every(10), init="model")
    reference = compact.dense_copy(module)
    x = torch.arange(12).view(2, 6) % 6 if layer == "embedding" else torch.randn(2, 3, 6, dtype=torch.float64)
    if layer == "conv1d":
        x = x.transpose(1, 2)
    outputs = []
    for net in (module, reference):
        out = net(x)
        out[..., :2] = out[..., :2] * 3  # in place on the output and on a view of it
        out.add_(1).mul_(2)
        out.square().sum().backward()
        outputs.append(out)
    exact(outputs[0], outputs[1])
    values, positions = module.weight_values, compact.flat_positions(module.weight_columns, module.weight_row_starts)
    exact(values.grad, reference.weight.grad.reshape(-1)[positions])


# --- the position format ---------------------------------------------------------------------------


def random_positions(numel: int, density: float, empty_rows: tuple[int, ...] = ()) -> torch.Tensor:
    """Increasing flat positions, about ``density`` of ``numel``, none in the rows ``empty_rows``."""
    mask = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < density
    for row in empty_rows:
        mask[row * compact.ROW : (row + 1) * compact.ROW] = False
    return mask.nonzero().squeeze(1)


def test_positions_round_trip_through_int16_columns_and_row_starts_in_chunks_of_any_size():
    numel = 9 * compact.ROW + 123  # ten rows, the last partial, the third empty
    positions = random_positions(numel, 0.6, empty_rows=(2,))
    assert positions.numel() > compact.DENSIFY_CHUNK > compact.GATHER_CHUNK  # densify and gather: several chunks
    columns, row_starts = compact.encode(positions.int(), numel)
    assert columns.dtype == torch.int16 and columns.shape == positions.shape
    assert row_starts.dtype == torch.int64 and row_starts.numel() == 10 + 1
    assert row_starts[2] == row_starts[3]  # the empty row
    exact(compact.flat_positions(columns, row_starts), positions)
    # Chunks that end exactly at a row start (the empty row's too), just before or after one, or anywhere.
    first, empty = int(row_starts[1]), int(row_starts[2])
    for size in (first - 1, first, first + 1, empty, 7777, compact.GATHER_CHUNK, positions.numel() + 5):
        for dtype in (torch.int32, torch.int64):
            chunks = list(compact.positions_by_chunk(columns, row_starts, size, dtype))
            assert [entries.start for entries, _ in chunks] == list(range(0, positions.numel(), size))
            for entries, got in chunks:
                exact(got, positions[entries].to(dtype))


@pytest.mark.parametrize("numel", [3 * 3 * 16 * 16, compact.ROW, 9 * compact.ROW + 123], ids=["one row", "a full row",
                                                                                              "ten rows"])
def test_the_traced_dense_weight_of_compiled_code_is_densify_bitwise_and_its_gradient_is_gather(numel):
    """``compact.traced_dense`` (small weights in compiled code: ops the compiler traces) builds
    ``densify``'s weight, an empty row and the last partial one included, and autograd gives the
    values' gradient ``gather`` gives. A layer with no active entry builds zeros."""
    positions = random_positions(numel, 0.6, empty_rows=(2,) if numel > 3 * compact.ROW else ())
    index = compact.encode(positions, numel)
    values = torch.randn(positions.numel(), dtype=torch.float64, requires_grad=True)
    traced = compact.traced_dense(values, *index, (numel,))
    exact(traced, compact.densify(values.detach(), *index, (numel,)))
    dense_grad = torch.randn(numel, dtype=torch.float64)
    traced.backward(dense_grad)
    exact(values.grad, compact.gather(dense_grad, *index, torch.float64))
    nothing = compact.encode(positions[:0], numel)
    exact(compact.traced_dense(values[:0], *nothing, (numel,)), torch.zeros(numel, dtype=torch.float64))


@pytest.mark.parametrize(("dtype", "grad_dtype"), [(torch.float64, torch.float64), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float32, torch.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_densify_and_gather_give_the_flat_positions_results_bitwise(dtype, grad_dtype, kernels, monkeypatch):
    # auto: one C loop each on the CPU (lowmem.kernels.cpu); torch: the chunked torch ops.
    monkeypatch.setenv("LOWMEM_KERNELS", kernels)
    shape = (300, 77, 3, 3)  # 207,900 entries: 7 rows, 2 or 3 chunks of active entries at density 0.7
    positions = random_positions(math.prod(shape), 0.7)
    assert positions.numel() > compact.DENSIFY_CHUNK > compact.GATHER_CHUNK
    index = compact.encode(positions, math.prod(shape))
    values = torch.randn(positions.numel(), dtype=torch.float64).to(dtype)
    assert compact._copied_in_c(values, *index) == (kernels == "auto" and lowmem.kernels.cpu.library() is not None)
    # What the former layout (int32 flat positions) computed:
    expected = values.new_zeros(math.prod(shape)).index_put_((positions.int(),), values).view(shape)
    exact(compact.densify(values, *index, shape), expected)
    dense_grad = torch.randn(shape, dtype=torch.float64).to(grad_dtype)
    gathered = compact.gather(dense_grad, *index, dtype)
    exact(gathered, dense_grad.reshape(-1).index_select(0, positions.int()).to(dtype))
    # Channels-last (compiled compact convolutions on a CPU): the C loops write and read each entry
    # where that layout has it (no copy through the contiguous layout), wherever they run.
    copied = []
    for name in ("densify", "gather"):
        kernel = getattr(lowmem.kernels.cpu, name)
        spy = lambda *args, kernel=kernel: copied.append(kernel(*args)) or copied[-1]  # noqa: E731
        monkeypatch.setattr(lowmem.kernels.cpu, name, spy)
    laid_out = compact.densify(values, *index, shape, torch.channels_last)
    assert laid_out.is_contiguous(memory_format=torch.channels_last) and not laid_out.is_contiguous()
    exact(laid_out, expected)
    exact(compact.gather(dense_grad.contiguous(memory_format=torch.channels_last), *index, dtype), gathered)
    assert copied == ([True, True] if compact._copied_in_c(values, *index) and dtype == grad_dtype else
                      [True] if compact._copied_in_c(values, *index) else [])  # fmt: skip


@pytest.mark.parametrize("shape", [(8, 3, 1, 1), (5, 4, 7, 1), (2, 40_000, 1, 3), (70_000, 1, 2, 2)])
@pytest.mark.parametrize("density", [0.001, 0.3, 1.0])
def test_channels_last_copies_of_any_shape_and_density_are_the_contiguous_ones_relaid(shape, density):
    # Kernels of one entry (both layouts alike), planes wider than a row of 2^15 entries, gaps between
    # entries of many planes (density 0.001), every entry.
    positions = random_positions(math.prod(shape), density)
    index = compact.encode(positions, math.prod(shape))
    values = torch.randn(positions.numel(), dtype=torch.float64).to(torch.bfloat16)
    laid_out = compact.densify(values, *index, shape, torch.channels_last)
    assert laid_out.is_contiguous(memory_format=torch.channels_last)
    exact(laid_out, compact.densify(values, *index, shape))
    dense_grad = torch.randn(shape, dtype=torch.float64).to(torch.bfloat16)
    exact(compact.gather(dense_grad.contiguous(memory_format=torch.channels_last), *index, torch.bfloat16),
          compact.gather(dense_grad, *index, torch.bfloat16))


def test_a_weight_of_any_width_keeps_16_bit_columns_and_computes_exactly():
    # 70,000 inputs per output: wider than 16 bits could index within an output row; rows of 2^15
    # entries need no wider fallback.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(70_000, 3)).double()
    sparsity = DynamicSparsity(model, ["0.weight"], 0.4, schedule=every(100), storage="compact")
    assert model[0].weight_columns.dtype == torch.int16 and model[0].weight_columns.numel() == 84_000
    reference = compact.dense_copy(model)
    x = torch.randn(2, 70_000, dtype=torch.float64)
    out, expected = model(x), reference(x)
    exact(out, expected)
    out.sum().backward()
    expected.sum().backward()
    values, positions = sparsity.compact.layer("0.weight")
    exact(values.grad, reference[0].weight.grad.reshape(-1)[positions])
    exact(sparsity.masks["0.weight"], reference[0].weight != 0)


def test_positions_hold_2_bytes_per_active_weight_where_int32_took_4():
    conv = nn.Conv2d(512, 512, 3, bias=False)  # resnet18's largest layer
    sparsity = DynamicSparsity(conv, ["weight"], 0.3, schedule=every(100))
    active = sparsity.nonzero_count()
    rows = compact.row_count(512 * 512 * 9)
    held = sum(buffer.untyped_storage().nbytes() for buffer in (sparsity.compact.columns, sparsity.compact.row_starts))
    assert held == 2 * active + 8 * (rows + 1)
    assert sum(b.nbytes for b in conv.buffers()) == held  # the module's buffers: views of these
    assert held / active < 2.001  # the former int32 flat positions: 4 bytes per active weight


def test_compact_storage_holds_active_entries_only_in_fixed_buffers():
    model, sparsity = sparse_model("compact")
    store = sparsity.compact
    names = dict(model.named_parameters())
    assert not set(NAMES) & set(names)  # no dense weight is left
    buffers = (store.values.data_ptr(), store.columns.data_ptr(), store.row_starts.data_ptr(), store.capacity)
    optimizer = LowPrecisionSGD(model.parameters(), lr=0.05)
    for step in range(7):
        images, tokens, target = batch(step)
        F.cross_entropy(model(images, tokens).flatten(0, 1), target.flatten()).backward()
        for name in NAMES:
            values, positions = store.layer(name)
            assert values.grad.shape == values.shape == positions.shape  # gradients: active entries only
            module, attr = store.owner(name)
            assert getattr(module, attr + "_columns").shape == values.shape
            assert (positions[1:] > positions[:-1]).all()  # strictly increasing
        optimizer.step()
        report = sparsity.after_optimizer_step(optimizer, epoch=0.0)
        for param in model.parameters():
            param.grad = None
        if report is not None:
            assert report["pruned"] > 0
            # Rewiring moved entries inside the same buffers, whose capacity does not change.
            assert (store.values.data_ptr(), store.columns.data_ptr(), store.row_starts.data_ptr(),
                    store.capacity) == buffers  # fmt: skip
            assert sum(store.counts) == store.capacity == sparsity.nonzero_count()
            for name in NAMES:
                values, _ = store.layer(name)
                assert optimizer.state[values]["momentum_buffer"].shape == values.shape


@pytest.mark.parametrize("optimizer_class", [LowPrecisionSGD, LowPrecisionAdam])
def test_compact_and_dense_masked_training_give_the_same_weights_in_fp64(optimizer_class):
    runs = {}
    for storage in ("compact", "masked"):
        model, sparsity = sparse_model(storage)
        optimizer = optimizer_class(model.parameters(), lr=0.05, weight_decay=1e-3)
        rewirings = 0
        for step in range(12):
            images, tokens, target = batch(step)
            for param in model.parameters():
                param.grad = None
            F.cross_entropy(model(images, tokens).flatten(0, 1), target.flatten()).backward()
            sparsity.mask_gradients()
            optimizer.step()
            rewirings += sparsity.after_optimizer_step(optimizer, epoch=0.0) is not None
        assert rewirings == 4
        runs[storage] = ({n: sparsity.dense_weight(n).detach() for n in NAMES}, sparsity.masks, model.conv.bias)
    (compact_weights, compact_masks, compact_bias), (masked_weights, masked_masks, masked_bias) = runs.values()
    for name in NAMES:
        assert torch.equal(compact_masks[name], masked_masks[name]), name
        torch.testing.assert_close(compact_weights[name], masked_weights[name], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(compact_bias, masked_bias, rtol=1e-12, atol=1e-14)


def test_dense_state_dict_is_a_plain_state_dict_and_the_compact_one_resumes():
    model, sparsity = sparse_model("compact")
    plain = compact.dense_state_dict(model)
    assert list(plain) == list(Mixed().state_dict())
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    buffer.seek(0)
    dense = Mixed().double()
    dense.load_state_dict(torch.load(buffer, weights_only=True))
    for name in NAMES:
        assert torch.equal(dense.get_parameter(name), sparsity.dense_weight(name))
    # The compact state dict (what checkpoints hold) restores the layout after a rewiring.
    sparsity.rewire()
    state = {"model": model.state_dict(), "sparsity": sparsity.state_dict()}
    assert any(key.endswith("_columns") for key in state["model"])
    resumed_model, resumed = sparse_model("compact")
    resumed.load_state_dict(state["sparsity"])
    resumed_model.load_state_dict(state["model"])
    for name in NAMES:
        assert torch.equal(resumed.dense_weight(name), sparsity.dense_weight(name))


def former_layout(state: dict) -> dict:
    """``state`` as the code before int16 columns saved it: each compact weight's positions as one int32
    tensor of flat positions, ``<name>_positions``."""
    out = {}
    for key, value in state.items():
        if key.endswith("_columns"):
            name = key.removesuffix("_columns")
            out[name + "_positions"] = compact.flat_positions(value, state[name + "_row_starts"]).int()
        elif not key.endswith("_row_starts"):
            out[key] = value
    return out


def test_a_state_dict_of_the_former_flat_positions_loads():
    model, sparsity = sparse_model("compact")
    sparsity.rewire()
    state = {"model": former_layout(model.state_dict()), "sparsity": sparsity.state_dict()}
    assert {key for key in state["model"] if "_positions" in key} == {name + "_positions" for name in NAMES}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_model, resumed = sparse_model("compact")
    resumed.load_state_dict(saved["sparsity"])
    resumed_model.load_state_dict(saved["model"])
    for key, value in model.state_dict().items():
        exact(resumed_model.state_dict()[key], value)


def test_a_checkpoint_of_the_former_flat_positions_resumes_bit_identically():
    overrides = ["trainer.device=cpu", "precision=bf16", "sparsity.density=0.3", "optim.name=adam", "optim.lr=1e-3",
                 "microbatch.size=2"]  # fmt: skip
    first = (torch.randint(0, 97, (4, 17), generator=torch.Generator().manual_seed(2)),)
    first, second = [(tokens[:, :-1], tokens[:, 1:]) for tokens in (first[0], first[0].roll(1, 0))]
    torch.manual_seed(0)
    model = tiny_gpt()
    interrupted = lowmem.prepare(copy.deepcopy(model), lm_loss, first, overrides=overrides)
    interrupted.step(first)
    interrupted.trainer.sparsity.rewire(interrupted.optimizer)
    saved = copy.deepcopy(interrupted.state_dict())
    saved["model"] = former_layout(saved["model"])
    interrupted.step(second)
    resumed = lowmem.prepare(copy.deepcopy(model), lm_loss, first, overrides=overrides)
    resumed.load_state_dict(saved)
    resumed.step(second)
    expected = interrupted.model.state_dict()
    for key, value in resumed.model.state_dict().items():
        exact(value, expected[key])


def test_compact_layers_under_bf16_autocast_keep_fp32_gradients_and_follow_a_cast_model():
    model, sparsity = sparse_model("compact")
    model.float()  # after attaching: the buffers follow at the next rewiring
    images, tokens, target = batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(images.float(), tokens)
    assert out.dtype == torch.bfloat16
    F.cross_entropy(out.float().flatten(0, 1), target.flatten()).backward()
    for name in NAMES:
        values, _ = sparsity.compact.layer(name)
        assert values.grad.dtype == torch.float32 and values.grad.isfinite().all()
    before = {name: sparsity.dense_weight(name) for name in NAMES}
    sparsity.threshold = 0.0  # a rewiring that prunes nothing: the layout moves into new buffers
    sparsity.rewire()
    assert sparsity.compact.values.dtype == torch.float32
    for name in NAMES:
        assert torch.equal(sparsity.dense_weight(name), before[name])
        values, _ = sparsity.compact.layer(name)
        assert values.untyped_storage().data_ptr() == sparsity.compact.values.untyped_storage().data_ptr()


@pytest.mark.parametrize("strategy", ["no_bn", "residual", "residual_star"])
def test_checkpointed_compact_convolutions_give_the_gradients_of_no_checkpointing(strategy):
    def run(strategy: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = WideResNet(10, 1).double()
        DynamicSparsity(model, model.sparsifiable_weights(), 0.3, schedule=every(100))
        apply_checkpointing(model, strategy, every=2)
        x, y = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.tensor([1, 2, 3, 4])
        F.cross_entropy(model(x), y).backward()
        return {name: p.grad for name, p in model.named_parameters()}

    plain, checkpointed = run("none"), run(strategy)
    assert any(name.endswith("weight_values") for name in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_a_torch_fx_trace_through_a_compact_layer_is_refused_and_leaves_nothing_behind():
    # A trace would keep the current positions as constants, stale after the next rewiring.
    model, _ = sparse_model("compact")
    with pytest.raises(TypeError, match="torch.fx"):
        fx.symbolic_trace(model)
    assert not [name for module in model.modules() for name in vars(module) if name.startswith("_tensor_constant")]


def test_unsupported_layers_are_refused_naming_the_knob():
    def unsupported() -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(2, 2, 3, padding="same"), nn.Conv1d(2, 2, 3, padding=1, padding_mode="reflect"),
                             nn.ConvTranspose2d(2, 2, 3))
    for name in ("0.weight", "1.weight", "2.weight"):
        with pytest.raises(ValueError, match="sparsity.storage=masked"):
            DynamicSparsity(unsupported(), [name], 0.5, schedule=every(10))
        DynamicSparsity(unsupported(), [name], 0.5, schedule=every(10), storage="masked")


def test_a_fake_pass_makes_positions_in_one_op_and_accounts_as_the_computed_chunks_would(monkeypatch):
    """Fake passes (the profiler's, the planner's) make each layer's positions as one valueless
    tensor: a fake op costs the same at any size, and integer scratch is never counted, so the
    figures are those of the chunked computation a real step runs."""
    model, _ = sparse_model("compact")
    images, tokens, _ = batch(0)

    def step(inputs) -> None:
        images, tokens = inputs
        model(images.requires_grad_(), tokens).square().sum().backward()

    shortcuts = []
    without_values = compact._without_values
    recorded = lambda columns: shortcuts.append(without_values(columns)) or shortcuts[-1]  # noqa: E731
    monkeypatch.setattr(compact, "_without_values", recorded)
    at_once = account_activations(step, model, inputs=(images, tokens))
    assert shortcuts and all(shortcuts)  # every layer's positions made without computing
    monkeypatch.setattr(compact, "_without_values", lambda columns: False)  # computed, as in a real step
    monkeypatch.setattr(compact, "DENSIFY_CHUNK", 3)
    monkeypatch.setattr(compact, "GATHER_CHUNK", 2)
    assert account_activations(step, model, inputs=(images, tokens)) == at_once
