"""trainer.compile=true: compiled runs end where eager runs end, lowmem adds no graph break to a model
that compiles whole, and the measured peak of a compiled step is what the allocator saw
(``lowmem.techniques.compilation``)."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn

import lowmem
from lowmem.config import ConfigError
from lowmem.profiler.peak import measure_peak
from lowmem.techniques import chains
from lowmem.trainer import build_trainer
from tests.helpers import SMALL_DC, TINY_WRN, load_script, make_config, slow

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh_compiler():
    """Each test compiles its own models: graphs of an earlier test's identical model are not reused."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _steps(overrides: tuple[str, ...], steps: int = 3) -> tuple[dict[str, torch.Tensor], object]:
    trainer = build_trainer(make_config("trainer.device=cpu", "precision=fp64", *overrides))
    batches = iter(trainer.data.train.epoch(0))
    for _ in range(steps):
        trainer.train_step(next(batches))
    return {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()}, trainer


def _relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(
        ((a[k].double() - b[k].double()).abs().max() / a[k].double().abs().max().clamp(min=1)).item()
        for k in a if a[k].is_floating_point() and a[k].numel()
    )


WRN_TECHNIQUES = {
    "plain": (),
    "compact sparse": ("sparsity.density=0.3",),
    "true microbatches": ("microbatch.size=5", "microbatch.mode=true"),
    "simulated microbatches": ("microbatch.size=5", "microbatch.mode=simulated"),
    "no_bn": ("checkpointing.strategy=no_bn",),
    "residual": ("checkpointing.strategy=residual",),
    "residual_star": ("checkpointing.strategy=residual_star",),
    "optimal": ("checkpointing.strategy=optimal", "checkpointing.budget_mb=15"),
    "compressed activations": ("checkpointing.strategy=residual", "checkpointing.compress=8"),
    "8-bit state": ("optim.state_bits=8", "precision=fp32"),  # FP32: 8-bit state is for 32- and 16-bit weights
}
TOLERANCE = {"8-bit state": 1e-5}


@pytest.mark.parametrize("technique", list(WRN_TECHNIQUES))
def test_each_technique_compiled_ends_where_eager_ends(technique):
    """FP64 WRN-10-1, 3 steps, graphs captured and run through AOTAutograd (``aot_eager``: what
    lowmem changes under the compiler; inductor's kernels are the full combination's test)."""
    overrides = (*TINY_WRN, *WRN_TECHNIQUES[technique])
    eager, _ = _steps(overrides)
    compiled, trainer = _steps((*overrides, "trainer.compile=true", "trainer.compile_backend=aot_eager"))
    assert _relative_difference(eager, compiled) <= TOLERANCE.get(technique, 1e-9)
    assert trainer.compiled.graphs >= 1


@pytest.mark.parametrize("strategy", ["residual", "residual_star"])
def test_compact_sparse_compiled_trains_through_rewirings_where_eager_does(strategy):
    """A rewiring every step changes the compact layers' counts. Their graphs compiled for static
    counts recompiled at every rewiring, and the traced inputs of those compilations (reference cycles
    until the garbage collector runs) held the values' old gradient accumulators: the third step
    failed ("expected shape compatible with" the old count) before a rewiring cut them loose
    (``compact.repoint``). The counts are dynamic sizes now (``compact.mark_counts_dynamic``): the
    first step compiles, the rewired ones compile nothing. FP64, ends where eager ends."""
    overrides = (*TINY_WRN, "sparsity.density=0.3", f"checkpointing.strategy={strategy}", "checkpointing.every=2",
                 "sparsity.rewire_freq_mult=1000")
    eager, _ = _steps(overrides)
    trainer = build_trainer(make_config("trainer.device=cpu", "precision=fp64", *overrides, "trainer.compile=true",
                                        "trainer.compile_backend=aot_eager"))
    initial = list(trainer.sparsity.compact.counts)
    graphs = []
    for batch in trainer.data.train.epoch(0):  # 3 steps, as _steps
        trainer.train_step(batch)
        graphs.append(trainer.compiled.graphs)
    compiled = {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()}
    assert len(graphs) == 3 and trainer.sparsity.compact.counts != initial  # rewirings moved the counts
    assert _relative_difference(eager, compiled) <= 1e-9
    # Blocks compile at their second call (the first is watched eagerly): by the second step all is
    # compiled; the third, after a rewiring, compiles nothing.
    assert graphs[1] > 0 and graphs[2] == graphs[1], graphs


@pytest.mark.parametrize("strategy", ["none", "residual_star"])
def test_compact_layers_compiled_as_operators_end_where_eager_ends(strategy, monkeypatch):
    """A compact weight above ``compact.TRACED_BYTES`` runs in compiled code as one operator
    (``lowmem.techniques.compact_ops``), a smaller one as traced ops. WRN-10-1's weights are all small:
    with the bound at 0 every layer is an operator, and a compiled run still ends where eager ends."""
    from lowmem.techniques import compact

    monkeypatch.setattr(compact, "TRACED_BYTES", 0)
    overrides = (*TINY_WRN, "sparsity.density=0.3", "microbatch.size=5", "microbatch.mode=true",
                 f"checkpointing.strategy={strategy}")
    eager, _ = _steps(overrides)
    compiled, trainer = _steps((*overrides, "trainer.compile=true", "trainer.compile_backend=aot_eager"))
    assert _relative_difference(eager, compiled) <= 1e-9
    assert trainer.compiled.graph_breaks == (0 if strategy == "none" else 3)


def test_a_compiled_compact_layer_saves_no_dense_weight_for_backward():
    """Compiled code builds a small compact weight (traced ops) where its layer computes and again in
    backward, as the eager layer does: the tensors the compiler saves for backward (inductor's
    decompositions and min-cut partitioner) hold no dense weight, nor a zero tensor of a dense
    weight's size (three layers of one shape: inductor's decompositions and the compiler's merging of
    equal calls made one ``zeros`` of the layers, saved: measured); and the gradients are eager's.
    (An operator saves its inputs only.)"""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    saved: list[int] = []

    def backward_compiler(graph: torch.fx.GraphModule, inputs: list) -> torch.fx.GraphModule:
        sizes = (t.numel() for t in inputs if isinstance(t, torch.Tensor))
        saved.extend(size for size in sizes if isinstance(size, int))  # a compact count may be a symbol
        return graph

    backend = aot_autograd(fw_compiler=lambda graph, _: graph, bw_compiler=backward_compiler,
                           partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())
    torch.manual_seed(0)
    conv = lambda: [nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.ReLU()]  # noqa: E731
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), *conv(), *conv(), *conv(), nn.Flatten(),
                          nn.Linear(16 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10)).double()  # fmt: skip
    batch = (torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randint(0, 10, (4,)))
    run = lowmem.prepare(model, _classify, batch, ["precision=fp64", "sparsity.density=0.3"])
    assert len(run.trainer.sparsity.compact.counts) == 4  # the three convolutions and the first linear
    _classify(run.model, batch).backward()
    eager = {name: p.grad.clone() for name, p in run.model.named_parameters()}
    run.model.zero_grad(set_to_none=True)
    _classify(torch.compile(run.model, backend=backend, fullgraph=True), batch).backward()
    assert saved, "no backward graph was compiled"
    assert not {16 * 16 * 9, 16 * 8 * 8 * 64} & set(saved), saved
    assert all(torch.equal(eager[name], p.grad) for name, p in run.model.named_parameters())


# Inductor's kernels in `make test-all` only (compiling them from a cold cache takes a minute on a Zen 3
# core); `make test` compiles the same graphs with aot_eager, and runs inductor's kernels for compact layers
# (traced ops) in the AMP compact-sparse (inductor) test below, and inductor's dropout replay in
# test_dropout_under_inductor_is_replayed_by_the_recomputation_as_eagerly.
@pytest.mark.parametrize(("segments", "backend"), [("stack", "aot_eager"), slow("stack", "inductor"),
                                                   slow("blocks", "inductor")])  # fmt: skip
def test_the_full_combination_compiled_ends_where_eager_ends(segments, backend):
    """Compact sparse, true microbatches, residual_star, FP64: the compiled step (inductor's kernels,
    or aot_eager's) ends where the eager one does, and the recomputation's self-check never fires
    (blocks recompute eagerly, as they ran)."""
    overrides = (*TINY_WRN, "sparsity.density=0.3", "microbatch.size=5", "microbatch.mode=true",
                 "checkpointing.strategy=residual_star")
    eager, _ = _steps(overrides)
    compiled, trainer = _steps((*overrides, "trainer.compile=true", f"trainer.compile_segments={segments}",
                                f"trainer.compile_backend={backend}"))
    assert _relative_difference(eager, compiled) <= 1e-9
    # One break per checkpointed stack (3) and none else: the stem and head are dense here.
    assert trainer.compiled.graph_breaks == 3
    assert set(trainer.compiled.reasons) == {r for r in trainer.compiled.reasons if "torch.compiler.disable" in r}


@pytest.mark.parametrize(("strategy", "backend"), [("residual", "aot_eager"), ("residual_star", "aot_eager"),
                                                   ("residual_star", "eager")])  # fmt: skip
def test_a_checked_stack_runs_as_one_compiled_call_and_ends_where_eager_ends(strategy, backend, monkeypatch):
    """``trainer.compile_segments=stack``: a stack's first run is lowmem's own segments, eager and
    watched for side outputs; from the second step on the whole stack is one compiled call, whose
    checkpoint regions the compiler recomputes, and no segment of lowmem's runs. FP64 ends where eager
    ends, BatchNorm's running statistics (counts too) updated once per forward, as eagerly.
    The ``eager`` backend (dynamo alone, no AOTAutograd) would run a checkpoint region as eager
    ``torch.utils.checkpoint``, whose recomputation updates BatchNorm a second time (here backward
    stopped: a count it saved was changed in place): its stacks run by lowmem's segments, every step."""
    from lowmem.techniques import checkpointing

    overrides = (*TINY_WRN, "sparsity.density=0.3", "microbatch.size=5", "microbatch.mode=true",
                 f"checkpointing.strategy={strategy}", "checkpointing.every=2")
    eager, _ = _steps(overrides)
    runs = []
    segment_apply = checkpointing._CheckpointedSegment.apply
    monkeypatch.setattr(checkpointing._CheckpointedSegment, "apply", lambda *a: (runs.append(1), segment_apply(*a))[1])
    trainer = build_trainer(make_config("trainer.device=cpu", "precision=fp64", *overrides, "trainer.compile=true",
                                        f"trainer.compile_backend={backend}", "trainer.compile_segments=stack"))
    per_step = []
    for batch in trainer.data.train.epoch(0):  # 3 steps, as _steps
        trainer.train_step(batch)
        per_step.append(len(runs))
    compiled = {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()}
    # lowmem's segments ran in the first step only (the eager backend: in every step)
    assert per_step[0] > 0 and per_step[2] == per_step[0] * (3 if backend == "eager" else 1), per_step
    assert _relative_difference(eager, compiled) <= 1e-9
    counts = [k for k in eager if k.endswith("num_batches_tracked")]
    assert counts and all(torch.equal(eager[k], compiled[k]) for k in counts)
    assert int(compiled[counts[0]]) == 3 * 4  # once per microbatch's forward, 3 steps of 4


def test_dynamicconv_compiled_ends_where_eager_ends():
    overrides = (*SMALL_DC, "loss.chunk_tokens=none", "checkpointing.strategy=residual")
    eager, _ = _steps(overrides, steps=2)
    compiled, _ = _steps((*overrides, "trainer.compile=true", "trainer.compile_backend=aot_eager"), steps=2)
    assert _relative_difference(eager, compiled) <= 1e-9


def test_dynamicconv_compact_sparse_compiles_without_a_break_and_ends_where_eager_ends():
    """Compact linear layers (small: traced ops), the bare output weight and the embeddings (operators)
    compile without a break.
    One layer each side: dynamo traces the whole model twice (the second batch's shape recompiles it
    with dynamic sizes), which for SMALL_DC's five layers took 40 s on a Zen 3 core."""
    overrides = (*SMALL_DC, "model.encoder_layers=1", "model.decoder_layers=1", "sparsity.density=0.3",
                 "loss.chunk_tokens=none")
    eager, _ = _steps(overrides, steps=2)
    compiled, trainer = _steps((*overrides, "trainer.compile=true", "trainer.compile_backend=aot_eager"), steps=2)
    assert _relative_difference(eager, compiled) <= 1e-9
    assert trainer.compiled.graph_breaks == 0, trainer.compiled.reasons


def _gpt2(dropout: float = 0.1) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=100, n_positions=32,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                     loss_type="ForCausalLM")
    return transformers.GPT2LMHeadModel(config)


def _lm_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


# `make test-all` only (its cold inductor compile: 50-70 s on a Zen 3 core): `make test` checks inductor's
# dropout replay on a small residual model (the next test), and GPT-2's chain blocks with aot_eager.
@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["none", "residual", "residual sparse"])
def test_gpt2_with_dropout_compiled_ends_where_eager_ends(checkpointing):
    """Dropout draws the eager run's masks when compiled (inductor's fallback_random), and a
    checkpointed block's recomputation replays them."""
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(1))
    base = _gpt2().double()
    ends = []
    for compile_ in ("false", "true"):
        torch.manual_seed(2)
        strategy, *sparse = checkpointing.split()
        overrides = ["precision=fp64", f"checkpointing.strategy={strategy}", f"trainer.compile={compile_}",
                     *(["sparsity.density=0.5"] if sparse else [])]
        run = lowmem.prepare(copy.deepcopy(base), _lm_loss, ids, overrides)
        losses = [run.step(ids)["loss"] for _ in range(3)]
        ends.append(({k: v.detach().clone() for k, v in run.model.state_dict().items()}, losses))
    assert _relative_difference(ends[0][0], ends[1][0]) <= 1e-9
    assert ends[0][1] == pytest.approx(ends[1][1], rel=1e-6)  # the step's loss is recorded in FP32


class _DropoutBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.dropout = nn.Linear(16, 16), nn.Dropout(0.3)

    def forward(self, x):
        return x + self.dropout(torch.tanh(self.linear(x)))


def test_dropout_under_inductor_is_replayed_by_the_recomputation_as_eagerly():
    """Inductor draws dropout's masks as eager code does (``fallback_random``), and a checkpointed
    block's compiled recomputation replays them: FP64, 3 steps, end where eager ends. (The GPT-2
    tests below do the same on a library model in `make test-all`: 50-70 s of inductor compiling
    from a cold cache on a Zen 3 core, this model a few.)"""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), *[_DropoutBlock() for _ in range(3)], nn.Linear(16, 4)).double()
    batch = (torch.randn(12, 8, dtype=torch.float64), torch.randint(0, 4, (12,)))
    ends = []
    for compile_ in ("false", "true"):
        torch.manual_seed(2)
        run = lowmem.prepare(copy.deepcopy(base), _classify, batch,
                             ["precision=fp64", "checkpointing.strategy=residual", f"trainer.compile={compile_}"])
        for _ in range(3):
            run.step(batch)
        ends.append({k: v.detach().clone() for k, v in run.model.state_dict().items()})
        assert compile_ == "false" or run.trainer.compiled.graphs >= 1
    assert _relative_difference(ends[0], ends[1]) <= 1e-9


@pytest.mark.parametrize(("segments", "backend"), [("stack", "aot_eager"), slow("stack", "inductor"),
                                                   slow("blocks", "inductor")])  # fmt: skip
def test_checked_chain_blocks_run_as_the_segments_mode_says_and_end_where_eager_ends(segments, backend, monkeypatch):
    """A transformers GPT-2 (dropout, FP64, ``residual_star`` every 2): with ``compile_segments=stack``
    each block watched once runs as one compiled checkpoint region from the second step on (no
    autograd node of lowmem's per block); with ``blocks`` through lowmem's node, compiled inside.
    Both end where eager ends, dropout masks included. (`make test`: aot_eager, the graphs lowmem
    makes; inductor's kernels for them in `make test-all`.)"""

    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(1))
    base = _gpt2().double()
    nodes = []
    chained_apply = chains._ChainedBlock.apply
    ends = []
    for compile_ in ("false", "true"):
        torch.manual_seed(2)
        overrides = ["precision=fp64", "checkpointing.strategy=residual_star", "checkpointing.every=2",
                     f"trainer.compile={compile_}", f"trainer.compile_segments={segments}",
                     f"trainer.compile_backend={backend}"]
        run = lowmem.prepare(copy.deepcopy(base), _lm_loss, ids, overrides)
        monkeypatch.setattr(chains._ChainedBlock, "apply", lambda *a: (nodes.append(1), chained_apply(*a))[1])
        per_step = []
        for _ in range(3):
            run.step(ids)
            per_step.append(len(nodes))
        nodes.clear()
        ends.append({k: v.detach().clone() for k, v in run.model.state_dict().items()})
    assert per_step[0] > 0
    if segments == "stack":
        assert per_step[2] == per_step[0], per_step  # lowmem's nodes in the first (watched) step only
    else:
        assert per_step[2] == 3 * per_step[0], per_step
    assert _relative_difference(ends[0], ends[1]) <= 1e-9


class _DropBlock(nn.Module):
    """A residual block with BatchNorm and dropout, for containers of chained blocks."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(torch.relu(self.norm(self.conv(x))))


def _container_model() -> nn.Module:
    """A chain of four blocks in an ``nn.Sequential``, a parameter-free ReLU between the second and
    third (found as a chain: the Sequential is no block of the root's own)."""
    body = nn.Sequential(_DropBlock(), _DropBlock(), nn.ReLU(), _DropBlock(), _DropBlock())
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), body, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def _container_runs(model: nn.Module, strategy: str, compile_: str, steps: int = 3, batch=None):
    """``steps`` steps of ``model`` (FP64, true microbatches of 3 of 6, aot_eager): the state dict at the
    end, lowmem's chained-block nodes per step, and the container's whole compiled calls."""
    batch = batch or (torch.randn(6, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3)),
                      torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(4)))
    torch.manual_seed(2)
    run = lowmem.prepare(model, _classify, batch, ["precision=fp64", f"checkpointing.strategy={strategy}",
                                                   "checkpointing.every=2", "microbatch.size=3", "microbatch.mode=true",
                                                   f"trainer.compile={compile_}", "trainer.compile_backend=aot_eager"])
    nodes, per_step = [], []
    apply = chains._ChainedBlock.apply
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chains._ChainedBlock, "apply", lambda *a: (nodes.append(1), apply(*a))[1])
        for _ in range(steps):
            run.step(batch)
            per_step.append(len(nodes))
    (container,) = [c for runner in chains.installed_runners(run.model) for c in runner.containers]
    return {k: v.detach().clone() for k, v in run.model.state_dict().items()}, per_step, container.whole_calls


@pytest.mark.parametrize("strategy", ["residual", "residual_star"])
def test_a_sequential_of_checked_blocks_runs_as_one_compiled_call_and_ends_where_eager_ends(strategy):
    """``compile_segments=stack``: a container of chained blocks whose first run let no side output
    out runs whole from then on, one compiled call (its segments checkpoint regions, a ReLU between
    them) per microbatch, no node of lowmem's per block; it ends where eager ends (FP64, dropout masks,
    BatchNorm statistics updated once per microbatch forward)."""
    torch.manual_seed(0)
    base = _container_model().double()
    eager, eager_nodes, eager_whole = _container_runs(copy.deepcopy(base), strategy, "false")
    compiled, nodes, whole = _container_runs(copy.deepcopy(base), strategy, "true")
    assert eager_whole == 0 and eager_nodes[2] == 3 * eager_nodes[0] > 0
    assert whole == 2 * 3 - 1, whole  # every microbatch after the first (watched) one
    assert nodes[0] == nodes[2] == eager_nodes[0] // 2, nodes  # lowmem's nodes: the first microbatch only
    assert _relative_difference(eager, compiled) <= 1e-9
    counts = [k for k in eager if k.endswith("num_batches_tracked")]
    assert len(counts) == 4 and all(int(compiled[k]) == int(eager[k]) == 6 for k in counts)


@pytest.mark.parametrize("hook", ["side output", "output changed", "output changed after 2 steps"])
def test_a_container_whose_block_has_hooks_runs_block_by_block_and_ends_where_eager_ends(hook):
    """A block's own hook runs around the block's call, which a whole compiled container does not make;
    a hook that lets a tensor out makes it a side output. Either way the container runs block by block
    (never whole while the hook is there; a hook added to a container already running whole too) and
    ends where eager ends, the side output's gradient included."""
    torch.manual_seed(0)
    base = _container_model().double()
    kept: list[torch.Tensor] = []

    def add_hook(model):
        target = model[1][3]  # the third block
        if hook == "side output":  # its conv output leaves the block: the loss reads it
            target.conv.register_forward_hook(lambda module, args, output: kept.append(output))
        else:
            target.register_forward_hook(lambda module, args, output: output * 2)

    later = hook.endswith("after 2 steps")
    if not later:
        add_hook(base)

    def loss(model, batch):
        kept.clear()
        value = _classify(model, batch)
        return value + sum(t.square().mean() for t in kept)

    ends = []
    for compile_ in ("false", "true"):
        torch.manual_seed(2)
        batch = (torch.randn(6, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3)),
                 torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(4)))
        run = lowmem.prepare(copy.deepcopy(base), loss, batch, [
            "precision=fp64", "checkpointing.strategy=residual", "checkpointing.every=2", "microbatch.size=3",
            "microbatch.mode=true", f"trainer.compile={compile_}", "trainer.compile_backend=aot_eager"])
        (container,) = [c for r in chains.installed_runners(run.model) for c in r.containers]
        for step in range(3):
            if later and step == 2:
                add_hook(run.model)
                whole = container.whole_calls
            run.step(batch)
        if later:  # whole before the hook (compiled), never after it
            assert whole == (3 if compile_ == "true" else 0) and container.whole_calls == whole
        else:
            assert container.whole_calls == 0
        ends.append({k: v.detach().clone() for k, v in run.model.state_dict().items()})
    assert _relative_difference(ends[0], ends[1]) <= 1e-9


class _BreakingBlock(nn.Module):
    """A residual block the compiler cannot take in one graph (an explicit graph break)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(16, 16), nn.BatchNorm1d(16)

    def forward(self, x):
        y = torch.tanh(self.norm(self.linear(x)))
        torch._dynamo.graph_break()
        return x + y


def test_a_block_the_compiler_cannot_take_whole_runs_by_blocks_with_a_warning():
    """``compile_segments=stack`` compiles a block whole or not at all (``fullgraph``): a block with a
    graph break would otherwise run as eager ``torch.utils.checkpoint``, whose recomputation updates
    BatchNorm's running statistics twice. It runs by blocks instead, with a warning saying why, and
    ends where eager ends, running statistics and their counts included."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), *[_BreakingBlock() for _ in range(3)], nn.Linear(16, 4)).double()
    batch = (torch.randn(12, 8, dtype=torch.float64), torch.randint(0, 4, (12,)))
    ends = []
    for compile_ in ("false", "true"):
        run = lowmem.prepare(copy.deepcopy(base), _classify, batch,
                             ["precision=fp64", "checkpointing.strategy=residual", f"trainer.compile={compile_}",
                              "trainer.compile_backend=aot_eager"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                run.step(batch)
        ends.append({k: v.detach().clone() for k, v in run.model.state_dict().items()})
        said = [str(w.message) for w in caught if "cannot be compiled whole" in str(w.message)]
        assert bool(said) == (compile_ == "true"), said
    assert _relative_difference(ends[0], ends[1]) <= 1e-9
    counts = [k for k in ends[0] if k.endswith("num_batches_tracked")]
    assert counts and all(int(ends[1][k]) == 3 for k in counts)


def _breaks(model: nn.Module, loss, batch, overrides: list[str]) -> int:
    torch._dynamo.reset()
    run = lowmem.prepare(model, loss, batch, ["trainer.compile=true", "trainer.compile_backend=eager", *overrides])
    run.step(batch)
    return run.trainer.compiled.graph_breaks


def _plain_breaks(model: nn.Module, loss, batch) -> int:
    """The graph breaks of ``torch.compile`` of the model alone (dynamo's count, as lowmem's)."""
    return load_script("compile_breaks").plain_breaks(model, loss, batch)


def _classify(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def test_graph_breaks_resnet18_and_gpt2():
    """lowmem adds no break to a model that compiles whole; each checkpointed chain a stated few: a
    Sequential of blocks (resnet18) at its call, a model's own loop (GPT-2) at each block's call, the
    loop then running as frames of its own."""
    torchvision = pytest.importorskip("torchvision")
    images = (torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))
    resnet = torchvision.models.resnet18(num_classes=10)
    assert _plain_breaks(copy.deepcopy(resnet), _classify, images) == 0
    assert _breaks(copy.deepcopy(resnet), _classify, images, []) == 0
    assert _breaks(copy.deepcopy(resnet), _classify, images, ["sparsity.density=0.5"]) == 0  # compact layers: operators
    # 8 checkpointed blocks in 4 Sequentials (layer1..4), measured 9: each Sequential's call (lowmem's
    # container forward, chain_containers), counted by dynamo in each frame that traces it (20 when
    # each block's call broke and the Sequentials' loops ran as frames of their own)
    assert 4 <= _breaks(copy.deepcopy(resnet), _classify, images, ["checkpointing.strategy=residual"]) <= 3 * 4
    ids = torch.randint(0, 100, (4, 16))
    gpt2 = _gpt2(0.0)
    plain = _plain_breaks(copy.deepcopy(gpt2), _lm_loss, ids)
    assert _breaks(copy.deepcopy(gpt2), _lm_loss, ids, []) == plain
    # 3 checkpointed blocks, measured plain + 10 (lowmem's use_cache line once, 3 per block)
    assert 3 <= _breaks(copy.deepcopy(gpt2), _lm_loss, ids, ["checkpointing.strategy=residual"]) - plain <= 3 * 3 + 1


def test_breaks_of_a_first_step_that_compiles_nothing_are_counted_and_a_frame_run_eagerly_is_said():
    """A model looping over checkpointed blocks in Python: the break at each block call is inside the
    loop, so dynamo gives up on the loop's frame (it runs eagerly) and, the blocks running watched in
    the first step, that step compiles no graph. Its breaks are still the count (it read 0)."""
    from lowmem.techniques.compilation import SKIPPED_FRAMES
    from tests.helpers import lm_loss, tiny_gpt

    torch._dynamo.reset()
    tokens = torch.randint(0, 97, (4, 17), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    run = lowmem.prepare(tiny_gpt(d=32, layers=4, ctx=16, dropout=0.0), lm_loss, batch, [
        "trainer.compile=true", "trainer.compile_backend=eager", "checkpointing.strategy=residual_star"])
    for _ in range(2):
        run.step(batch)
    record = run.trainer.compiled
    assert record.graph_breaks >= 4, record.reasons  # one at least per block call
    assert record.reasons[SKIPPED_FRAMES] >= 1, record.reasons
    assert run.trainer.compile_summary()["graph_break_reasons"][SKIPPED_FRAMES] >= 1


def test_cpu_compute_fp32_adds_no_graph_break_where_a_frame_runs_eagerly():
    """``precision.cpu_compute=fp32`` (AVX2's choice) computes 16-bit ops in Python CPU kernels. Called
    from a frame dynamo gave up on (the model's loop over checkpointed blocks), dynamo tried to compile
    those kernels and broke in each: 11 breaks against 7 natively for this model. They run with
    compilation off now: the same breaks as natively."""
    from tests.helpers import lm_loss, tiny_gpt

    tokens = torch.randint(0, 97, (4, 17), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    reasons = {}
    for setting in ("native", "fp32"):
        torch._dynamo.reset()
        run = lowmem.prepare(tiny_gpt(d=32, layers=4, ctx=16, dropout=0.0), lm_loss, batch, [
            "precision=bf16", f"precision.cpu_compute={setting}", "trainer.compile=true",
            "trainer.compile_backend=eager", "checkpointing.strategy=residual_star"])
        for _ in range(2):
            run.step(batch)
        reasons[setting] = dict(run.trainer.compiled.reasons)
    assert reasons["fp32"] == reasons["native"], reasons


def test_graph_breaks_wrn28_and_dynamicconv_in_the_profile():
    wrn = (*TINY_WRN, "model.depth=28", "model.width=2", "trainer.device=cpu", "trainer.compile=true",
           "trainer.compile_backend=eager")
    for overrides, expected in (((), 0), (("checkpointing.strategy=residual", "checkpointing.every=2"), 3)):
        torch._dynamo.reset()
        trainer = build_trainer(make_config(*wrn, *overrides))
        trainer.train_step(trainer.example_batch())
        assert trainer.compiled.graph_breaks == expected, trainer.compiled.reasons
    torch._dynamo.reset()
    dc = build_trainer(make_config(*SMALL_DC, "trainer.device=cpu", "trainer.compile=true",
                                   "trainer.compile_backend=eager"))
    dc.train_step(dc.example_batch())
    assert dc.compiled.graph_breaks == 0, dc.compiled.reasons  # loss.chunk_tokens=auto is off when compiled
    torch._dynamo.reset()
    dc = build_trainer(make_config(*SMALL_DC, "trainer.device=cpu", "trainer.compile=true",
                                   "trainer.compile_backend=eager", "checkpointing.strategy=residual"))
    dc.train_step(dc.example_batch())
    assert 5 <= dc.compiled.graph_breaks <= 2 * 5, dc.compiled.reasons  # 5 checkpointed layers, measured 8


def test_the_measured_peak_of_a_compiled_step_agrees_with_the_profiler_memory_timeline():
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    batch = (torch.randn(256, 64), torch.randint(0, 10, (256,)))
    fresh = copy.deepcopy(model)
    run = lowmem.prepare(model, _classify, batch, ["trainer.compile=true"])
    run.step(batch)  # compiles; the optimizer state exists from here on
    trainer = run.trainer
    peak = measure_peak(lambda: trainer.train_step(batch), trainer.unwrapped_model, trainer.optimizer,
                        data=list(batch), owners=(trainer, batch))
    assert peak.source == "cpu allocator events"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        trainer.train_step(batch)
    times, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    totals = [sum(s) for s in sizes]
    assert abs(peak.peak_bytes - max(totals)) <= 0.05 * max(totals), (peak.peak_bytes, max(totals))
    # The same step measured eagerly (lowmem's tensor tracker): the compiled one holds no more.
    eager = lowmem.prepare(fresh, _classify, batch).profile(measure=True)["peak_bytes"]
    assert peak.peak_bytes < eager * 1.05


_QUIET_SCRIPT = """
import torch
from torch import nn
import torch.nn.functional as F
import lowmem

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
batch = (torch.randn(32, 16), torch.randint(0, 4, (32,)))
run = lowmem.prepare(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), batch,
                     ["trainer.compile=true", "trainer.compile_backend=aot_eager"])
run.step(batch)
for _ in range(2):
    run.profile(measure=True)
print("measured", run.profile(measure=True)["peak_bytes"] > 0)
"""


def test_measuring_compiled_steps_prints_no_profiler_chatter():
    """The compiled step's tracker runs torch.profiler at every measured step: kineto's banners and
    c10's warning about a block allocated before profiling stay off the user's stderr."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", _QUIET_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "measured True" in done.stdout
    for chatter in ("USDT", "profiler_start", "gpuGetDeviceCount", "Memory block of unknown size"):
        assert chatter not in done.stderr, done.stderr[-2000:]


def test_a_model_compiled_before_prepare_is_compiled_with_the_techniques():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    keys = set(model.state_dict())
    batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
    run = lowmem.prepare(torch.compile(model, backend="eager"), _classify, batch)
    assert run.model is model and run.config.trainer.compile and set(run.model.state_dict()) == keys
    run.step(batch)
    assert run.trainer.compiled.graphs >= 1


def test_a_chunked_loss_of_a_number_of_tokens_is_refused_when_compiled():
    ids = torch.randint(0, 100, (2, 16))
    with pytest.raises(ConfigError, match=r"loss.chunk_tokens=64 is not allowed with trainer.compile=true"):
        lowmem.prepare(_gpt2(0.0), _lm_loss, ids, ["trainer.compile=true", "loss.chunk_tokens=64"])
    with pytest.raises(ConfigError, match="trainer.compile_backend='tvm'"):
        lowmem.prepare(_gpt2(0.0), _lm_loss, ids, ["trainer.compile=true", "trainer.compile_backend=tvm"])
    with pytest.raises(ConfigError, match="trainer.compile_segments='whole'.*stack, blocks"):
        lowmem.prepare(_gpt2(0.0), _lm_loss, ids, ["trainer.compile=true", "trainer.compile_segments=whole"])


def test_a_hooked_feature_of_a_compiled_checkpointed_block_keeps_its_gradient_every_step():
    """A block that lets a tensor out by a forward hook stays eager and watched when compiled: the
    feature loss's gradient reaches its weights at every step, as plain PyTorch's does."""
    from tests.test_checkpointing_real_models import SGD
    from tests.test_side_outputs import batch, hooked_mlps, llama

    torch.manual_seed(0)
    model = llama().double()
    reference, checkpointed = copy.deepcopy(model), copy.deepcopy(model)
    data = batch()
    loss = hooked_mlps(reference)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        loss(reference, data).backward()
        optimizer.step()
    loss = hooked_mlps(checkpointed)
    run = lowmem.prepare(checkpointed, loss, data, [*SGD, "checkpointing.strategy=residual", "trainer.compile=true",
                                                    "trainer.compile_backend=aot_eager"])
    for _ in range(3):
        run.step(data)
    assert _relative_difference(reference.state_dict(), run.model.state_dict()) <= 1e-9


class _StoringBlock(nn.Module):
    """A block that stores a feature on itself, which the loss reads: a side output."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        self.feat = h
        return x + self.fc2(h)


class _StoringNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.Sequential(*[_StoringBlock(16) for _ in range(3)])

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def _feature_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y) + sum(block.feat.pow(2).mean() for block in model.blocks)


def test_a_block_watched_while_frozen_is_watched_again_once_trained():
    """The watched eager forward's verdict (no side output needs a gradient) holds only while the
    blocks are frozen: unfrozen, their stored features get their gradients, as without checkpointing."""
    torch.manual_seed(0)
    model = _StoringNet().double()
    batch = (torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,)))
    ends = []
    for overrides in (["checkpointing.strategy=none"],
                      ["checkpointing.strategy=residual", "checkpointing.blocks=[blocks]", "trainer.compile=true",
                       "trainer.compile_backend=aot_eager"]):
        run = lowmem.prepare(copy.deepcopy(model), _feature_loss, batch, ["precision=fp64", *overrides])
        for name, param in run.model.named_parameters():  # step 1: the backbone frozen (a linear probe)
            param.requires_grad_(name.startswith("head"))
        run.step(batch)
        for param in run.model.parameters():
            param.requires_grad_(True)
        for _ in range(2):
            run.step(batch)
        ends.append(run.model.state_dict())
    assert _relative_difference(*ends) <= 1e-9


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_amp_with_compact_sparse_layers_compiled_ends_where_eager_ends(backend):
    """Under autocast the compact layers (traced ops here: small weights) compute in autocast's dtype
    as the eager layer does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    batch = (torch.randn(16, 32), torch.randint(0, 10, (16,)))
    ends = []
    for compile_ in ("false", "true"):
        overrides = ["precision=amp", "sparsity.density=0.5", f"trainer.compile={compile_}",
                     f"trainer.compile_backend={backend}"]
        run = lowmem.prepare(copy.deepcopy(model), _classify, batch, overrides)
        for _ in range(3):
            run.step(batch)
        ends.append(run.model.state_dict())
    assert _relative_difference(*ends) <= 1e-6


def test_a_profiled_compiled_step_with_checkpointed_blocks_measures_no_compilation(monkeypatch):
    """Checkpointed blocks compile on their second call (the first is watched eagerly): the warm-up
    runs until nothing compiles, so the profile's measured step compiles nothing."""
    import lowmem.profiler.report as report
    from lowmem.techniques.compilation import graphs_compiled

    compiled_while_measured = []

    def measured(*args, **kwargs):
        before = graphs_compiled()
        result = measure_peak(*args, **kwargs)
        compiled_while_measured.append(graphs_compiled() - before)
        return result

    monkeypatch.setattr(report, "measure_peak", measured)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), *[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)],
                          nn.Linear(64, 4))
    batch = (torch.randn(32, 8), torch.randint(0, 4, (32,)))
    run = lowmem.prepare(model, _classify, batch, ["checkpointing.strategy=residual", "trainer.compile=true"])
    assert run.profile(measure=True)["peak_bytes"] > 0
    assert compiled_while_measured == [0]
    assert run.trainer.compiled.graphs >= 1  # the blocks' checkpoint region (compile_segments=stack), shared


def _convolutions(step) -> int:
    """Convolutions computed (forward kernels) by one call of ``step``, as torch.profiler counts them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        step()
    return sum(e.count for e in profiled.key_averages() if e.key == "aten::convolution")


@pytest.mark.parametrize(("density", "backend"),
                         [slow("1.0", "inductor"), slow("0.3", "inductor"), ("0.3", "aot_eager")],
                         ids=["dense", "compact sparse", "compact sparse, aot_eager"])
def test_a_compiled_residual_star_rebuild_computes_no_last_convolution(density, backend):
    """``residual_star`` rebuilds each block for backprop without its last convolution's output
    (only the block output reads it): compiled as eagerly, the step computes as many convolutions.
    (Inductor's kernels for WRN-10-1 take a minute to compile from a cold cache on a Zen 3 core:
    ``make test`` runs the same graphs through AOTAutograd alone.)"""
    overrides = (*TINY_WRN, "precision=fp32", "checkpointing.strategy=residual_star", f"sparsity.density={density}",
                 f"trainer.compile_backend={backend}")
    counts = []
    for compiled in ("false", "true"):
        trainer = build_trainer(make_config("trainer.device=cpu", *overrides, f"trainer.compile={compiled}"))
        batch = next(iter(trainer.data.train.epoch(0)))
        for _ in range(2):  # the blocks run compiled from their second call
            trainer.train_step(batch)
        counts.append(_convolutions(functools.partial(trainer.train_step, batch)))
    eager, compiled = counts
    assert compiled == eager, f"compiled step computes {compiled} convolutions, eager {eager}"


def test_inductor_cache_keys_hold_the_version_of_lowmem_operators():
    """Inductor's cache keys name lowmem's operators, not their fake kernels (a graph cached against
    another version's output layouts fails its stride checks on load): a graph pass that changes
    nothing puts a digest of their source into every key, beside any pass of yours."""
    import hashlib

    import torch._inductor.config as inductor_config

    from lowmem.techniques import compact_ops

    digest = hashlib.sha256(open(compact_ops.__file__, "rb").read()).hexdigest()[:16]
    assert compact_ops.OperatorsVersion().uuid().startswith(f"lowmem operators {digest} ")
    assert torch.backends.cpu.get_cpu_capability() in compact_ops.OperatorsVersion().uuid()
    assert isinstance(inductor_config.post_grad_custom_post_pass, compact_ops.OperatorsVersion)

    class Yours(compact_ops.CustomGraphPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return "yours"

    yours = Yours()
    with inductor_config.patch(post_grad_custom_post_pass=yours):
        compact_ops._enter_version()
        compact_ops._enter_version()  # once only
        passes = inductor_config.post_grad_custom_post_pass
    assert passes[0] is yours and [type(p) for p in passes] == [Yours, compact_ops.OperatorsVersion]
    assert isinstance(inductor_config.post_grad_custom_post_pass, compact_ops.OperatorsVersion)


@pytest.mark.slow
@pytest.mark.parametrize("density", ["1.0", "0.3"], ids=["dense", "compact sparse"])
def test_amp_residual_star_compiled_ends_where_eager_ends(density):
    """Under autocast the rebuild's unread last convolution backprops in autocast's dtype, as the
    eager rebuild's skipped one does (dense: lowmem.residual.UnreadConvolution; compact: its own)."""
    overrides = (*TINY_WRN, "precision=amp", "checkpointing.strategy=residual_star", f"sparsity.density={density}")
    ends = []
    for compiled in ("false", "true"):
        trainer = build_trainer(make_config("trainer.device=cpu", *overrides, f"trainer.compile={compiled}"))
        batches = iter(trainer.data.train.epoch(0))
        for _ in range(3):
            trainer.train_step(next(batches))
        ends.append({k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()})
    assert _relative_difference(*ends) <= 4e-3, _relative_difference(*ends)  # BF16 unit roundoff 3.9e-3


def test_an_unread_triple_left_set_is_never_skipped_by_eager_code():
    """A compiled rebuild stopped by an error leaves ``COMPILED_TRIPLES.unread`` set: eager code (a
    watched forward of a compiled block) still computes every convolution."""
    from lowmem.residual import COMPILED_BLOCK, COMPILED_TRIPLES, CompiledMark
    from recipes.wrn_cifar.model import WideResNet

    torch.manual_seed(0)
    model = WideResNet(depth=10, width=1).double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    expected = model(x)
    for block in model.residual_blocks:
        block.__dict__[COMPILED_BLOCK] = CompiledMark("inductor")
    COMPILED_TRIPLES.count, COMPILED_TRIPLES.unread = 0, 1
    try:
        assert torch.equal(model(x), expected)
    finally:
        COMPILED_TRIPLES.count, COMPILED_TRIPLES.unread = 0, -1


def test_a_copied_or_saved_compiled_model_runs_its_blocks_eagerly(tmp_path):
    """``nn.Module`` drops its compiled forward from copies (``copy.deepcopy``, ``torch.save``); the
    marks that run lowmem's checkpointed blocks compiled are dropped with it, so a copy (an EMA
    model, a saved model loaded for evaluation or further training) compiles nothing until it is
    compiled again, and computes what the compiled original computes."""
    from lowmem.residual import compiled_backend
    from lowmem.techniques.compilation import checkpointed_blocks, graphs_compiled

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), *[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)],
                          nn.Linear(64, 4)).double()  # fmt: skip
    batch = (torch.randn(32, 8, dtype=torch.float64), torch.randint(0, 4, (32,)))
    overrides = ["precision=fp64", "checkpointing.strategy=residual", "trainer.compile=true",
                 "trainer.compile_backend=aot_eager"]  # fmt: skip
    run = lowmem.prepare(model, _classify, batch, overrides)
    for _ in range(2):
        run.step(batch)
    blocks = checkpointed_blocks(run.model)
    assert blocks and all(compiled_backend(block) == "aot_eager" for block in blocks)
    torch.save(run.model, tmp_path / "model.pt")
    copies = [copy.deepcopy(run.model), torch.load(tmp_path / "model.pt", weights_only=False)]
    assert all(compiled_backend(block) is not None for block in blocks)  # the original stays compiled
    for clone in copies:
        assert all(compiled_backend(block) is None for block in checkpointed_blocks(clone))
        before = graphs_compiled()
        _classify(clone, batch).backward()
        assert graphs_compiled() == before, "a copy compiled its blocks"
        with torch.no_grad():
            assert torch.allclose(clone(batch[0]), run.model(batch[0]), rtol=1e-12, atol=1e-12)
