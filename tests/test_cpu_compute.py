"""``precision.cpu_compute``: 16-bit convolutions, matrix products and attention computed in FP32
on a CPU and rounded once (``lowmem.techniques.cpu_compute``).

Math: each op under ``Fp32Arithmetic`` is bit for bit the FP32 op applied to the 16-bit operands,
rounded once; what autograd stores stays 16-bit. Wiring: a WRN-28-2 and a DynamicConv BF16 step
under ``fp32`` and ``native`` agree within 16-bit rounding; the choice is recorded; a resnet18
step's measured peak under ``fp32`` is within 10% of ``native``. Bad input: the knob is named.
The probe's decision is tested with fake timings, so no test's length depends on how slow this
CPU's native 16-bit kernels are beyond one small native step per model.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import multiprocessing
import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import lowmem
from lowmem.config import ConfigError
from lowmem.libraries import configure_libraries
from lowmem.profiler import track_peak
from lowmem.techniques import cpu_compute
from lowmem.techniques.cpu_compute import CLOSE_CALL, KINDS, NATIVE_MUST_WIN, Fp32Arithmetic, choices, decide
from lowmem.techniques.precision import make_policy
from lowmem.trainer import build_trainer
from tests.helpers import SMALL_DC, TINY_WRN, make_config

aten = torch.ops.aten
SIXTEEN_BIT = [torch.bfloat16, torch.float16]


def _operands(dtype: torch.dtype, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(sum(map(sum, shapes)))
    return [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]


def _conv_backward(grad, x, weight):
    return aten.convolution_backward(
        grad, x, weight, [weight.shape[0]], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]
    )


# (name, kind, the op on its operands, the operands' shapes)
OPS = [
    ("conv2d", "convolution", lambda x, w: F.conv2d(x, w, padding=1), [(2, 3, 7, 7), (5, 3, 3, 3)]),
    ("conv1d_grouped", "convolution", lambda x, w: F.conv1d(x, w, groups=2), [(2, 4, 9), (6, 2, 3)]),
    ("conv_transpose2d", "convolution", lambda x, w: F.conv_transpose2d(x, w, stride=2), [(2, 3, 5, 5), (3, 4, 3, 3)]),
    ("convolution_backward", "convolution_backward", _conv_backward, [(2, 5, 7, 7), (2, 3, 7, 7), (5, 3, 3, 3)]),
    ("mm", "matmul", torch.mm, [(7, 9), (9, 5)]),
    ("addmm", "matmul", lambda b, m1, m2: torch.addmm(b, m1, m2, beta=0.5, alpha=2.0), [(5,), (7, 9), (9, 5)]),
    ("linear_3d", "matmul", lambda x, w, b: F.linear(x, w, b), [(3, 4, 9), (6, 9), (6,)]),
    ("bmm", "matmul", torch.bmm, [(3, 7, 9), (3, 9, 5)]),
    ("baddbmm", "matmul", lambda c, a, b: torch.baddbmm(c, a, b, alpha=0.5), [(3, 7, 5), (3, 7, 9), (3, 9, 5)]),
    ("einsum", "matmul", lambda a, b: torch.einsum("bik,bjk->bij", a, b), [(3, 7, 9), (3, 5, 9)]),
    ("mv", "matmul", torch.mv, [(7, 9), (9,)]),
    ("dot", "matmul", torch.dot, [(33,), (33,)]),
    # out= overloads, as compiled code calls them (inductor's extern_kernels.mm(a, b, out=buf))
    ("mm_out", "matmul", lambda a, b: torch.mm(a, b, out=torch.empty(0, dtype=a.dtype)), [(7, 9), (9, 5)]),
    ("addmm_out", "matmul", lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0, out=torch.empty_like(c)),
     [(7, 5), (7, 9), (9, 5)]),
    ("bmm_out", "matmul", lambda a, b: torch.bmm(a, b, out=torch.empty(3, 7, 5, dtype=a.dtype)),
     [(3, 7, 9), (3, 9, 5)]),
    ("baddbmm_out", "matmul", lambda c, a, b: torch.baddbmm(c, a, b, alpha=0.5, out=torch.empty_like(c)),
     [(3, 7, 5), (3, 7, 9), (3, 9, 5)]),
    ("addbmm_out", "matmul", lambda c, a, b: torch.addbmm(c, a, b, out=torch.empty_like(c)),
     [(7, 5), (3, 7, 9), (3, 9, 5)]),
    ("addmv_out", "matmul", lambda c, a, b: torch.addmv(c, a, b, out=torch.empty_like(c)), [(7,), (7, 9), (9,)]),
    ("mv_out", "matmul", lambda a, b: torch.mv(a, b, out=torch.empty(7, dtype=a.dtype)), [(7, 9), (9,)]),
    ("dot_out", "matmul", lambda a, b: torch.dot(a, b, out=torch.empty((), dtype=a.dtype)), [(33,), (33,)]),
    ("convolution_out", "convolution", lambda x, w: aten.convolution.out(
        x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, out=torch.empty(0, dtype=x.dtype)),
     [(2, 3, 7, 7), (5, 3, 3, 3)]),
    ("attention", "matmul", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
     [(2, 3, 6, 8), (2, 3, 6, 8), (2, 3, 6, 8)]),
    ("attention_masked", "matmul", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
     [(2, 3, 6, 8), (2, 3, 5, 8), (2, 3, 5, 8), (6, 5)]),
]  # fmt: skip


def _rounded(result, dtype) -> tuple[torch.Tensor, ...]:
    """The op's outputs as a tuple, each in ``dtype``."""
    return (result.to(dtype),) if isinstance(result, torch.Tensor) else tuple(t.to(dtype) for t in result)


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
@pytest.mark.parametrize(("name", "kind", "op", "shapes"), OPS, ids=[op[0] for op in OPS])
def test_each_op_is_the_fp32_op_on_the_16_bit_operands_rounded_once(name, kind, op, shapes, dtype):
    operands = _operands(dtype, *shapes)
    expected = _rounded(op(*(t.float() for t in operands)), dtype)
    with Fp32Arithmetic() as mode:
        result = op(*operands)
    assert mode.computed[kind] >= 1, f"{name} was not computed in FP32"
    result = (result,) if isinstance(result, torch.Tensor) else result
    assert len(result) == len(expected)
    for got, want in zip(result, expected, strict=True):
        assert got.dtype == dtype
        assert torch.equal(got, want), f"{name}: not the rounded FP32 result"


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
def test_attention_backward_is_the_fp32_backward_rounded_once(dtype):
    q, k, v, grad = _operands(dtype, (2, 3, 6, 8), (2, 3, 6, 8), (2, 3, 6, 8), (2, 3, 6, 8))
    out, logsumexp = aten._scaled_dot_product_flash_attention_for_cpu(q.float(), k.float(), v.float(), is_causal=True)
    # Backward gets the output as autograd stored it: rounded to 16 bits (the log-sum-exp stays FP32).
    expected = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad.float(), q.float(), k.float(), v.float(), out.to(dtype).float(), logsumexp, 0.0, True
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with Fp32Arithmetic() as mode:
        result = F.scaled_dot_product_attention(*leaves, is_causal=True)
        result.backward(grad)
    assert mode.computed["matmul"] == 2  # forward and backward
    assert torch.equal(result, out.to(dtype))
    for leaf, want in zip(leaves, expected, strict=True):
        assert leaf.grad.dtype == dtype and torch.equal(leaf.grad, want.to(dtype))


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_large_convolutions_run_in_blocks_of_output_channels(monkeypatch, channels_last):
    # Weights above CHUNK_BYTES in FP32 run 16 output channels at a time: the same FP32 arithmetic
    # per block (a block's sums may be ordered differently: within one BF16 rounding), never the
    # whole FP32 weight and weight gradient at once.
    x, weight, bias, grad = _operands(torch.bfloat16, (2, 8, 6, 6), (40, 8, 3, 3), (40,), (2, 40, 6, 6))
    if channels_last:
        x, grad = x.contiguous(memory_format=torch.channels_last), grad.contiguous(memory_format=torch.channels_last)
    arguments = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    whole_forward = aten.convolution(x.float(), weight.float(), bias.float(), *arguments).to(torch.bfloat16)
    whole_backward = _rounded(aten.convolution_backward(grad.float(), x.float(), weight.float(), [40], *arguments,
                                                        [True, True, True]), torch.bfloat16)  # fmt: skip
    monkeypatch.setattr(cpu_compute, "CHUNK_BYTES", 16 * 8 * 9 * 4)
    assert len(cpu_compute._channel_blocks(weight, False, 1)) == 3  # 16 + 16 + 8 channels
    with Fp32Arithmetic():
        forward = aten.convolution(x, weight, bias, *arguments)
        backward = aten.convolution_backward(grad, x, weight, [40], *arguments, [True, True, True])
    assert forward.is_contiguous(memory_format=torch.channels_last) == channels_last
    for got, want in zip((forward, *backward), (whole_forward, *whole_backward), strict=True):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=torch.finfo(torch.bfloat16).eps, atol=1e-6)


@pytest.mark.parametrize(
    ("rows", "shared", "columns", "exact"),
    [(96, 8, 8, True), (8, 8, 96, True), (8, 96, 8, False)],
    ids=["by_rows", "by_columns", "by_shared_dimension"],
)
def test_large_matrix_products_run_in_blocks(monkeypatch, rows, shared, columns, exact):
    # Above BLOCK_BYTES, blocks along the largest dimension: along a's rows or b's columns each
    # result element is the one FP32 product (bit for bit); along the shared dimension the blocks'
    # products are summed in FP32 and rounded once (within one BF16 rounding).
    bias, a, b = _operands(torch.bfloat16, (columns,), (rows, shared), (shared, columns))
    want = [torch.mm(a.float(), b.float()).to(torch.bfloat16),
            torch.addmm(bias.float(), a.float(), b.float(), beta=0.5, alpha=2.0).to(torch.bfloat16)]  # fmt: skip
    monkeypatch.setattr(cpu_compute, "BLOCK_BYTES", 4 * 8 * 8 * 4)
    with Fp32Arithmetic() as mode:
        got = [torch.mm(a, b), torch.addmm(bias, a, b, beta=0.5, alpha=2.0), torch.mm(a.t().contiguous().t(), b)]
    assert mode.computed["matmul"] == 3
    for result, expected in zip(got, [*want, want[0]], strict=True):
        assert result.dtype == torch.bfloat16 and result.shape == expected.shape
        if exact:
            assert torch.equal(result, expected)
        else:
            eps = torch.finfo(torch.bfloat16).eps
            torch.testing.assert_close(result.float(), expected.float(), rtol=eps, atol=1e-5)


def test_what_autograd_saves_and_every_gradient_stay_16_bit():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).bfloat16()
    x = torch.randn(2, 3, 6, 6, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(tensor):
        saved.append(tensor.dtype)
        return tensor

    with Fp32Arithmetic() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).square().sum().backward()
    assert mode.computed["convolution"] == 1 and mode.computed["convolution_backward"] == 1
    assert saved and set(saved) == {torch.bfloat16}
    assert {p.grad.dtype for p in model.parameters()} | {x.grad.dtype} == {torch.bfloat16}


def test_compiled_matrix_products_are_computed_in_fp32():
    """Inductor calls a compiled graph's matrix products with ``out=`` (``extern_kernels.mm(a, b,
    out=buf)``): without the ``.out`` overrides a compiled BF16 transformer step ran torch's native
    kernels, 3.3-3.75x slower than its eager step where those are reference kernels (AVX2)."""
    torch._dynamo.reset()
    layer = nn.Linear(9, 5).to(torch.bfloat16)
    x = _operands(torch.bfloat16, (7, 9))[0].requires_grad_()
    compiled = torch.compile(layer, backend="inductor")
    with Fp32Arithmetic() as mode:
        compiled(x).sum().backward()
    assert mode.computed["matmul"] == 3  # forward, input gradient, weight gradient
    with torch.no_grad():
        expected = F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(torch.bfloat16)
    with Fp32Arithmetic(), torch.no_grad():
        assert torch.equal(compiled(x), expected)


def test_fp32_operands_and_other_ops_pass_through_untouched():
    a, b = _operands(torch.float32, (5, 6), (6, 4))
    with Fp32Arithmetic() as mode:
        assert torch.equal(a @ b, torch.mm(a, b))
        torch.ones(3, dtype=torch.bfloat16).add(1)
    assert sum(mode.computed.values()) == 0


def test_only_the_chosen_kinds_are_computed_in_fp32():
    x, w, a, b = _operands(torch.bfloat16, (1, 2, 5, 5), (3, 2, 3, 3), (4, 4), (4, 4))
    with Fp32Arithmetic({"matmul"}) as mode:
        F.conv2d(x, w)
        a @ b
    assert dict(mode.computed) == {"matmul": 1}
    with pytest.raises(ValueError, match="unknown kinds of op"):
        Fp32Arithmetic({"softmax"})



def test_the_kernels_act_on_the_entering_thread_only_and_until_it_exits():
    a, b = _operands(torch.bfloat16, (4, 4), (4, 4))
    native = torch.mm(a, b)
    elsewhere = {}

    def other_thread():
        elsewhere["active"] = cpu_compute.active()
        elsewhere["product"] = a @ b  # the kernel it replaced, on a thread without a context

    with Fp32Arithmetic() as mode:
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert mode.computed["matmul"] == 0 and elsewhere["active"] is False
    assert torch.equal(elsewhere["product"], native)
    assert not cpu_compute.active() and torch.equal(a @ b, native) and mode.computed["matmul"] == 0
    with pytest.raises(RuntimeError, match="boom"), Fp32Arithmetic():
        raise RuntimeError("boom")
    assert not cpu_compute.active()


def test_nested_the_innermost_context_that_wants_the_kind_acts():
    x, w, a, b = _operands(torch.bfloat16, (1, 2, 5, 5), (3, 2, 3, 3), (4, 4), (4, 4))
    with Fp32Arithmetic() as outer, Fp32Arithmetic({"matmul"}) as inner:
        F.conv2d(x, w)
        a @ b
    assert dict(inner.computed) == {"matmul": 1} and dict(outer.computed) == {"convolution": 1}


def test_scratch_is_measured_inside_the_kernel():
    x, w = _operands(torch.bfloat16, (2, 8, 16, 16), (8, 8, 3, 3))
    with Fp32Arithmetic(live_bytes=lambda: 1000) as mode:
        F.conv2d(x, w, padding=1)
    # The FP32 input, weight and output at once (the copies die before the output is rounded).
    assert mode.scratch_peak_bytes == 4 * (2 * 2 * 8 * 16 * 16 + 8 * 8 * 9)
    assert mode.peak_with_scratch_bytes == 1000 + mode.scratch_peak_bytes

# --- the choice ----------------------------------------------------------------------------------


def _fake_seconds(native: dict[str, float]):
    """Every kind takes 1 s in FP32 and ``native[kind]`` s natively; records the limits passed."""
    limits = {}

    def seconds(kind, dtype, fp32, limit=None):
        if not fp32:
            limits[kind] = limit
        return 1.0 if fp32 else native[kind]

    return seconds, limits


@pytest.mark.parametrize("features", ["fp32", "native"])
def test_auto_keeps_native_only_where_it_clearly_wins(monkeypatch, features):
    monkeypatch.setattr(cpu_compute, "feature_choices", lambda dtype: dict.fromkeys(KINDS, features))
    seconds, limits = _fake_seconds({"convolution": 40.0, "convolution_backward": 0.5, "matmul": 0.8})
    assert decide(torch.bfloat16, seconds) == {
        "convolution": "fp32",  # a reference kernel, 40x slower
        "convolution_backward": "native",  # twice as fast (AMX-like)
        "matmul": features,  # 1.25x faster on the probe: a close call, as the CPU's flags say
    }
    # Native runs may stop timing as soon as they are clearly slower than the bar.
    assert limits == dict.fromkeys(KINDS, pytest.approx(CLOSE_CALL / NATIVE_MUST_WIN))
    # Just outside the close calls either way: timed, whatever the flags say.
    seconds, _ = _fake_seconds(dict.fromkeys(KINDS, 0.99 / (NATIVE_MUST_WIN * CLOSE_CALL)))
    assert decide(torch.bfloat16, seconds) == dict.fromkeys(KINDS, "native")
    seconds, _ = _fake_seconds(dict.fromkeys(KINDS, 1.01 * CLOSE_CALL / NATIVE_MUST_WIN))
    assert decide(torch.bfloat16, seconds) == dict.fromkeys(KINDS, "fp32")


def _scripted_clock(run_seconds: list[float]):
    """A clock under which runs take ``run_seconds`` in turn (the warm-up first), and the list of
    runs not yet taken."""
    left = list(run_seconds)
    state = {"now": 0.0, "started": False}

    def clock() -> float:
        if state["started"]:  # a run's end: it took the next scripted time
            state["now"] += left.pop(0)
        state["started"] = not state["started"]
        return state["now"]

    return clock, left


def test_one_slow_native_run_does_not_decide_the_kind(monkeypatch):
    monkeypatch.setattr(cpu_compute, "_probe_work", lambda kind, dtype: lambda: None)
    # Bar 1.0: one run slowed 2x by the machine is dropped, the fastest of the five counts.
    clock, left = _scripted_clock([9.0, 0.6, 2.0, 0.6, 0.6, 0.6])
    seconds = cpu_compute.probe_seconds("convolution", torch.bfloat16, False, limit=1.0, repeats=5, clock=clock)
    assert seconds == pytest.approx(0.6)
    assert left == []
    # One run far over the bar (preempted for a time slice of a loaded machine) decides nothing either.
    clock, left = _scripted_clock([9.0, 40.0, 0.6, 0.6, 0.6, 0.6])
    seconds = cpu_compute.probe_seconds("convolution", torch.bfloat16, False, limit=1.0, repeats=5, clock=clock)
    assert seconds == pytest.approx(0.6)
    # A reference kernel, far over the bar run after run: timing stops after ABANDON_AFTER timed runs.
    clock, left = _scripted_clock([40.0] * 6)
    seconds = cpu_compute.probe_seconds("convolution", torch.bfloat16, False, limit=1.0, repeats=5, clock=clock)
    assert seconds == pytest.approx(40.0)
    assert len(left) == 5 - cpu_compute.ABANDON_AFTER


@pytest.fixture
def record_dir(monkeypatch, tmp_path):
    """A cache directory of the test's own for ``auto``'s record (fake timings must never reach the
    user's), read afresh as by a new process."""
    monkeypatch.setenv("LOWMEM_CACHE_DIR", str(tmp_path / "cache"))
    cpu_compute._machine_choices.cache_clear()
    yield tmp_path / "cache"
    cpu_compute._machine_choices.cache_clear()


def _new_process() -> None:
    """What a new process starts with: nothing read or probed yet."""
    cpu_compute._machine_choices.cache_clear()


def test_auto_is_probed_once_per_machine_and_recorded(monkeypatch, record_dir):
    calls = []

    def seconds(kind, dtype, fp32, limit=None):
        calls.append((kind, dtype, fp32))
        return 1.0 if fp32 else 10.0

    monkeypatch.setattr(cpu_compute, "probe_seconds", seconds)
    first = choices("auto", torch.float16, "cpu")
    assert first == choices("auto", torch.float16, "cpu") == dict.fromkeys(KINDS, "fp32")
    assert len(calls) == 2 * len(KINDS)
    _new_process()
    assert choices("auto", torch.float16, "cpu") == first
    assert len(calls) == 2 * len(KINDS)  # read from the record: not timed again
    records = json.loads((record_dir / cpu_compute.RECORD).read_text())["records"]
    (record,) = records.values()
    assert record["machine"] == cpu_compute.machine_key(torch.float16, torch.get_num_threads())
    assert record["choices"] == first and record["seconds"]["matmul"] == {"fp32": 1.0, "native": 10.0}
    # Another dtype or thread count is another record.
    choices("auto", torch.bfloat16, "cpu")
    cpu_compute._machine_choices(torch.float16, torch.get_num_threads() + 1)
    assert len(calls) == 3 * 2 * len(KINDS)
    assert len(json.loads((record_dir / cpu_compute.RECORD).read_text())["records"]) == 3


def test_the_probe_is_timed_on_one_thread(monkeypatch, record_dir):
    # On several threads of a loaded machine each probe run waits for a preempted thread.
    seen = []
    monkeypatch.setattr(cpu_compute, "probe_seconds", lambda kind, dtype, fp32, limit=None: seen.append(
        torch.get_num_threads()) or 1.0)  # fmt: skip
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        choices("auto", torch.bfloat16, "cpu")
        assert torch.get_num_threads() == 2  # the run's own again
    finally:
        torch.set_num_threads(threads)
    assert seen and set(seen) == {1}


def _probe_in_a_process(native_seconds: float, results) -> None:
    """(In a forked child.) ``auto``'s choice for BF16 under a probe on which native takes
    ``native_seconds`` and FP32 1 s (0.1 s of real time each, so that both children probe at once
    if nothing stops them); the choice and the number of probes timed, into ``results``."""
    timed = []

    def seconds(kind, dtype, fp32, limit=None):
        timed.append(kind)
        time.sleep(0.1)
        return 1.0 if fp32 else native_seconds

    cpu_compute.probe_seconds = seconds
    results.put((cpu_compute.probe_choices(torch.bfloat16), len(timed)))


def test_processes_probing_at_once_use_one_recorded_choice(record_dir):
    # Two processes whose probes would choose apart (native 2x faster for one, 2x slower for the
    # other) start together: the one that comes second waits for the record and uses the first's.
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    children = [context.Process(target=_probe_in_a_process, args=(native, results)) for native in (0.5, 2.0)]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=60) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    (first, first_timed), (second, second_timed) = outcomes
    assert first == second and set(dict(first).values()) <= {"native", "fp32"}
    assert sorted([first_timed, second_timed]) == [0, 2 * len(KINDS)]  # one probed, the other read
    records = json.loads((record_dir / cpu_compute.RECORD).read_text())["records"]
    assert [tuple(r["choices"].items()) for r in records.values()] == [first]


@pytest.mark.parametrize(
    "damage",
    ["garbage", "a list", "a damaged record"],
)
def test_an_unreadable_record_is_probed_again_with_a_warning(monkeypatch, record_dir, caplog, damage):
    seconds, _ = _fake_seconds({"convolution": 0.5, "convolution_backward": 2.0, "matmul": 0.5})
    monkeypatch.setattr(cpu_compute, "probe_seconds", seconds)
    record_dir.mkdir(mode=0o700)
    path = record_dir / cpu_compute.RECORD
    if damage == "garbage":
        path.write_bytes(os.urandom(200))
    elif damage == "a list":
        path.write_text("[1, 2]")
    else:
        choices("auto", torch.bfloat16, "cpu")
        _new_process()
        document = json.loads(path.read_text())
        (record,) = document["records"].values()
        record["choices"]["matmul"] = "fast"
        path.write_text(json.dumps(document))
    with caplog.at_level(logging.WARNING, logger=cpu_compute.__name__):
        chosen = choices("auto", torch.bfloat16, "cpu")
    assert chosen == {"convolution": "native", "convolution_backward": "fp32", "matmul": "native"}
    assert "probing again" in caplog.text
    (record,) = json.loads(path.read_text())["records"].values()  # rewritten whole
    assert record["choices"] == chosen


def test_a_cache_directory_others_may_write_to_is_not_trusted_with_the_record(monkeypatch, record_dir, caplog):
    seconds, _ = _fake_seconds(dict.fromkeys(KINDS, 0.5))
    monkeypatch.setattr(cpu_compute, "probe_seconds", seconds)
    record_dir.mkdir()
    record_dir.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger=cpu_compute.__name__):
        assert choices("auto", torch.bfloat16, "cpu") == dict.fromkeys(KINDS, "native")
    assert "cannot record its choice" in caplog.text and "LOWMEM_CACHE_DIR" in caplog.text
    assert list(record_dir.iterdir()) == []


def test_deterministic_runs_decide_from_the_cpus_flags_never_by_timing(monkeypatch, record_dir):
    def never(*args, **kwargs):
        raise AssertionError("timed under trainer.deterministic=true")

    monkeypatch.setattr(cpu_compute, "probe_seconds", never)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_compute.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    cpus = [
        ("Intel(R) Xeon(R) Platinum 8375C", "avx2 avx512f avx512_bf16", "fp32"),  # no AMX: 1.4x slower natively
        ("AMD EPYC 9R14", "avx2 avx512f", "fp32"),  # Zen 3-like: no BF16 instructions
        ("AMD EPYC 9R14", "avx2 avx512f avx512_bf16", "native"),  # Zen 4: 0.5-0.6x FP32's step
        ("CPU", "avx512f avx512_bf16 amx_bf16 amx_tile", "native"),
    ]
    for model, flags, bf16 in cpus:
        monkeypatch.setattr(cpu_compute.kernel_cache, "cpu_identity", lambda m=model, f=flags: (m, f"flags : {f}"))
        assert choices("auto", torch.bfloat16, "cpu", deterministic=True) == dict.fromkeys(KINDS, bf16), model
        assert choices("auto", torch.float16, "cpu", deterministic=True) == dict.fromkeys(KINDS, "fp32")
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # AVX-512-BF16 or AMX there, but oneDNN may not use them
        assert choices("auto", torch.bfloat16, "cpu", deterministic=True) == dict.fromkeys(KINDS, "fp32")
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    # trainer.deterministic=true turns torch's deterministic algorithms on: auto follows them.
    trainer = build_trainer(make_config(*TINY_WRN, "precision=bf16", "trainer.deterministic=true"))
    try:
        assert trainer.cpu_compute == dict.fromkeys(KINDS, "native")
    finally:
        configure_libraries(torch.device("cpu"))  # a later test's trainer must not find them on
    assert not torch.are_deterministic_algorithms_enabled()


def _flipping_probe_clock(monkeypatch) -> list:
    """``probe_seconds`` on a synthetic clock that flips, as a second job loading the CPU can: in
    the first probe a native run takes 1 s and an FP32 run 2 s, in the second 0.5 s (and so on), so
    that each probe, made anew, would choose otherwise. The kinds timed, in order."""
    probe = cpu_compute.probe_seconds
    timed = []

    def seconds(kind, dtype, fp32, limit=None):
        native_wins = len(timed) // (2 * len(KINDS)) % 2 == 0  # which probe this run belongs to
        timed.append(kind)
        run = (2.0 if native_wins else 0.5) if fp32 else 1.0
        return probe(kind, dtype, fp32, limit, clock=itertools.count(0.0, run).__next__)

    monkeypatch.setattr(cpu_compute, "_probe_work", lambda kind, dtype: lambda: None)
    monkeypatch.setattr(cpu_compute, "probe_seconds", seconds)
    return timed


def test_two_identical_runs_under_a_flipping_probe_clock_give_the_same_bits(monkeypatch, record_dir, tmp_path):
    from lowmem.train import run

    monkeypatch.setenv("LOWMEM_KERNELS", "torch")  # the same bits without compiling the C kernels into record_dir
    timed = _flipping_probe_clock(monkeypatch)
    # Probed anew, the clock flips the choice:
    assert decide(torch.bfloat16, cpu_compute.probe_seconds) == dict.fromkeys(KINDS, "native")
    assert decide(torch.bfloat16, cpu_compute.probe_seconds) == dict.fromkeys(KINDS, "fp32")
    timed.clear()
    overrides = (*TINY_WRN, "precision=bf16", "trainer.epochs=1", "trainer.device=cpu")
    results = []
    for name in ("first", "second"):
        _new_process()
        (tmp_path / name).mkdir()
        results.append(run(make_config(*overrides), tmp_path / name))
    assert len(timed) == 2 * len(KINDS)  # the first run probed; the second read its record
    chosen = {"setting": "auto", **dict.fromkeys(KINDS, "native")}  # the first probe's
    assert results[0]["cpu_compute"] == results[1]["cpu_compute"] == chosen
    first, second = (torch.load(tmp_path / name / "model.pt", weights_only=True) for name in ("first", "second"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_the_knob_changes_nothing_on_cuda_or_for_fp32():
    assert choices("fp32", torch.bfloat16, "cuda") == {}
    assert choices("fp32", torch.float32, "cpu") == {}
    assert choices("native", torch.bfloat16, "cpu") == dict.fromkeys(KINDS, "native")
    assert not isinstance(cpu_compute.compute_context("native", torch.bfloat16, "cpu"), Fp32Arithmetic)
    assert isinstance(cpu_compute.compute_context("fp32", torch.bfloat16, "cpu"), Fp32Arithmetic)


def test_a_bad_setting_names_the_knob_and_the_allowed_values():
    with pytest.raises(ConfigError, match=r"precision\.cpu_compute.*auto, native, fp32"):
        build_trainer(make_config(*SMALL_DC, "precision=bf16", "precision.cpu_compute=fast"))
    with pytest.raises(ValueError, match=r"precision\.cpu_compute='fast' is not one of auto, native, fp32"):
        make_policy("bf16", "cpu", cpu_compute="fast")


# --- whole steps ------------------------------------------------------------------------------------


def _one_step(overrides, setting):
    """The trainer after one step from seed 0, the step's loss and every weight's gradient as the
    optimizer received it (FP32 copies: optimizers may clip or decay gradients in place)."""
    torch.manual_seed(0)
    trainer = build_trainer(make_config(*overrides, f"precision.cpu_compute={setting}"))
    grads = {}
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        for name, param in trainer.unwrapped_model.named_parameters():
            if param.grad is not None:
                grads[name] = param.grad.float().clone()
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    record = trainer.train_step(trainer.example_batch())
    return trainer, record["loss"], grads


WRN_28_2 = ("+recipe=wrn_cifar", "data=fake", "data.batch_size=4", "data.train_size=4", "data.test_size=4",
            "trainer.progress=none", "trainer.device=cpu", "precision=bf16")  # fmt: skip


def _flat(grads) -> torch.Tensor:
    return torch.cat([grads[name].flatten().double() for name in sorted(grads)])


# Without dropout: a 16-bit tensor's dropout mask is drawn differently from an FP32 one's.
SMALL_DC_BF16 = (*SMALL_DC, "data.batch_size=300", "model.dropout=0", "model.weight_dropout=0",
                 "model.attention_dropout=0", "precision=bf16")  # fmt: skip


@pytest.mark.parametrize("overrides", [WRN_28_2, SMALL_DC_BF16],
                         ids=["wrn_28_2", "dynamicconv"])  # fmt: skip
def test_a_bf16_step_in_fp32_agrees_with_native_within_16_bit_rounding(overrides):
    native, native_loss, native_grads = _one_step(overrides, "native")
    fp32, fp32_loss, fp32_grads = _one_step(overrides, "fp32")
    _, reference_loss, reference_grads = _one_step([o for o in overrides if o != "precision=bf16"], "auto")
    assert fp32.cpu_compute_record() == {"setting": "fp32", **dict.fromkeys(KINDS, "fp32")}
    assert native.cpu_compute_record() == {"setting": "native", **dict.fromkeys(KINDS, "native")}
    assert fp32.result(None)["cpu_compute"]["setting"] == "fp32"
    eps = torch.finfo(torch.bfloat16).eps
    assert fp32_loss == pytest.approx(native_loss, rel=4 * eps)
    assert fp32_loss == pytest.approx(reference_loss, rel=4 * eps)
    # Gradients: BF16 roundings compound through the backward pass (a WRN-28-2's at batch 4 is
    # tens of percent off the FP32 gradient natively), and the two ways round at different points.
    # The FP32 way must point as close to the FP32 step's gradient as the native kernels do, with
    # the native size: a mistake in it (an operand dropped, a result rounded twice or not at all)
    # would not.
    assert native_grads.keys() == fp32_grads.keys() == reference_grads.keys()
    native, fp32, reference = _flat(native_grads), _flat(fp32_grads), _flat(reference_grads)
    native_cosine = float(F.cosine_similarity(native, reference, dim=0))
    fp32_cosine = float(F.cosine_similarity(fp32, reference, dim=0))
    assert native_cosine > 0.9
    assert fp32_cosine >= native_cosine - 0.02, (fp32_cosine, native_cosine)
    assert float(fp32.norm() / native.norm()) == pytest.approx(1.0, abs=0.1)


def test_a_resumed_run_computes_as_its_checkpoint_chose():
    # auto's probe may decide otherwise in another process; a resumed run must compute the same bits.
    first = build_trainer(make_config(*SMALL_DC_BF16))
    assert set(first.cpu_compute) == set(KINDS)
    state = first.checkpoint_state()
    flipped = {"fp32": "native", "native": "fp32"}
    state["cpu_compute"] = {**first.cpu_compute, "matmul": flipped[first.cpu_compute["matmul"]]}
    second = build_trainer(make_config(*SMALL_DC_BF16))
    second.load_checkpoint(state)
    assert second.cpu_compute == state["cpu_compute"]
    assert second.cpu_compute_record() == {"setting": "auto", **state["cpu_compute"]}
    # An explicit setting is the user's: it stays.
    explicit = build_trainer(make_config(*SMALL_DC_BF16, "precision.cpu_compute=fp32"))
    explicit.load_checkpoint(state)
    assert explicit.cpu_compute == dict.fromkeys(KINDS, "fp32")


def test_peak_with_the_fp32_copies_counted_is_within_10_percent_of_native():
    # Table 3 row 7's combination (density 0.1, FP16, true microbatches of 4, residual_star every 2)
    # on torchvision's resnet18 through lowmem.prepare. Its weights dominate at this batch: natively
    # the FP16 weight gradients are slow (~15 s on an AVX-512 CPU), and the FP32 way would add
    # twice each weight without the blocks of output channels. A tracker of live tensors sees the
    # ops' 16-bit operands and results, not the FP32 copies made inside their kernels (as it sees no
    # native kernel's scratch); the arithmetic measures them at each op on top of the tracker's
    # live bytes then.
    row7 = ["sparsity.density=0.1", "precision=fp16", "microbatch.size=4", "checkpointing.strategy=residual_star",
            "checkpointing.every=2", "trainer.device=cpu"]  # fmt: skip
    batch = (torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))

    def loss_fn(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    peaks = {}
    for setting in ("native", "fp32"):
        torch.manual_seed(0)
        run = lowmem.prepare(torchvision.models.resnet18(num_classes=10), loss_fn, batch,
                             overrides=[*row7, f"precision.cpu_compute={setting}"])  # fmt: skip
        assert run.profile(measure=False)["cpu_compute"]["setting"] == setting
        with track_peak(device="cpu", owners=[run.trainer, batch]) as tracker:
            live = (lambda: sum(tracker.live.values())) if setting == "fp32" else None
            with Fp32Arithmetic(live_bytes=live) if live else contextlib.nullcontext() as arithmetic:
                run.step(batch)  # the run's own arithmetic is nested in this one: this one acts
        peaks[setting] = tracker.peak_bytes
        if setting == "fp32":
            assert sum(arithmetic.computed.values()) > 0 and arithmetic.scratch_peak_bytes > 0
            peaks["fp32"] = max(peaks["fp32"], arithmetic.peak_with_scratch_bytes)
        del run
    assert peaks["fp32"] <= 1.10 * peaks["native"], peaks
