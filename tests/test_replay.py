"""Captured-and-replayed microbatches equal eager ones bit for bit; layout choices for CUDA.

The replaying runner runs here with ``RecordingBackend`` (a capture is the call, a replay calls it
again on the capture's input buffers), checked by ``CheckedRecorder``: a replay must find every
parameter, gradient and buffer where the capture found them, as a CUDA graph would.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lowmem.config import ConfigError
from lowmem.techniques.convolutions import input_memory_format, tune_convolutions
from lowmem.techniques.precision import AmpLossScaler, LossScaler
from lowmem.techniques.replay import (
    WARM_UP_PASSES,
    CudaGraphBackend,
    EagerMicrobatches,
    RecordingBackend,
    ReplayedMicrobatches,
    make_microbatch_runner,
)
from lowmem.trainer import Trainer, build_trainer
from recipes.wrn_cifar.data import load_image_dataset, training_batches
from tests.helpers import SMALL_DC, TINY_WRN, make_config


class CheckedRecorder(RecordingBackend):
    """``RecordingBackend`` that counts captures and replays and fails a replay of a stale capture:
    one whose parameters, gradients or buffers moved since it was made (freed memory, on CUDA).
    While it runs a call, ``inside`` is set: a ``GuardedScaler`` then refuses to be read (a CUDA
    capture would freeze the value read)."""

    inside = False

    def __init__(self, model: nn.Module, params: list[nn.Parameter] | None = None) -> None:
        self.model = model
        self.params = list(model.parameters()) if params is None else params
        self.captures = self.replays = 0

    def where(self) -> list:
        tensors = [*self.params, *(p.grad for p in self.params), *self.model.buffers()]
        return [None if t is None else (t.data_ptr(), tuple(t.shape)) for t in tensors]

    @staticmethod
    def guarded(call):
        def run() -> torch.Tensor:
            CheckedRecorder.inside = True
            try:
                return call()
            finally:
                CheckedRecorder.inside = False

        return run

    def warm_up(self, call, passes):
        super().warm_up(self.guarded(call), passes)

    def capture(self, call):
        self.captures += 1
        recorded, where = super().capture(self.guarded(call)), self.where()
        backend = self

        class Checked:
            def replay(self) -> torch.Tensor:
                assert backend.where() == where, "a capture was replayed after its memory moved"
                backend.replays += 1
                return recorded.replay()

        return Checked()


class GuardedScaler(LossScaler):
    """A ``LossScaler`` whose scale cannot be read inside a captured call: captures must read the
    scale from a tensor, as a Python float would be frozen into a CUDA graph."""

    @property
    def scale(self) -> float:
        assert not CheckedRecorder.inside, "a captured call read the loss scale as a Python float"
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = value


# --- through the trainer ---------------------------------------------------------------------------


def tiny_trainer(*overrides: str) -> Trainer:
    return build_trainer(make_config(*TINY_WRN, *overrides))


def replaying(trainer: Trainer) -> CheckedRecorder:
    """Make ``trainer`` replay its microbatches (as trainer.cuda_graphs=auto does on CUDA)."""
    recorder = CheckedRecorder(trainer.unwrapped_model, trainer.params)
    trainer.microbatch_runner = make_microbatch_runner(
        "auto", trainer.eager_microbatches, trainer.unwrapped_model, trainer.device, data_parallel=False,
        backend=recorder,
    )
    assert isinstance(trainer.microbatch_runner, ReplayedMicrobatches)
    return recorder


def train(trainer: Trainer, steps: int) -> list[dict]:
    batches = itertools.chain.from_iterable(trainer.data.train.epoch(e) for e in itertools.count())
    return [trainer.train_step(batch) for batch in itertools.islice(batches, steps)]


def assert_same_training(eager: Trainer, replayed: Trainer, eager_log: list[dict], replayed_log: list[dict]) -> None:
    assert replayed_log == eager_log  # losses, loss scales, rewirings, skipped steps
    a, b = eager.unwrapped_model.state_dict(), replayed.unwrapped_model.state_dict()
    assert a.keys() == b.keys()
    for key in a:  # weights, compact positions, BatchNorm statistics and num_batches_tracked
        assert torch.equal(a[key], b[key]), key
    for p, q in zip(eager.params, replayed.params, strict=True):
        for name, value in eager.optimizer.state[p].items():
            other = replayed.optimizer.state[q][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, name


@pytest.mark.parametrize(
    "checkpointing, precision, density, storage",
    [("none", "fp32", "1.0", "compact"), ("residual_star", "bf16", "0.5", "compact"),
     ("residual_star", "fp32", "0.5", "compact"), ("none", "bf16", "1.0", "compact"),
     ("none", "fp32", "0.5", "masked")],
)  # fmt: skip
def test_replayed_microbatches_train_exactly_as_eager(checkpointing, precision, density, storage):
    # 4 true microbatches per step; at density 0.5 sparsity rewires every 2 updates.
    overrides = (
        "microbatch.size=5", f"checkpointing.strategy={checkpointing}", "checkpointing.every=2",
        f"precision={precision}", f"sparsity.density={density}", "sparsity.rewire_freq_mult=50",
        f"sparsity.storage={storage}",
    )  # fmt: skip
    eager, replayed = tiny_trainer(*overrides), tiny_trainer(*overrides)
    recorder = replaying(replayed)
    steps = 5
    eager_log, replayed_log = train(eager, steps), train(replayed, steps)
    assert_same_training(eager, replayed, eager_log, replayed_log)
    # Step 1 runs eagerly, the shape repeats at step 2 and is captured; every later microbatch replays.
    assert recorder.replays > 0 and recorder.captures == replayed.microbatch_runner.captures
    rewirings = sum("rewiring" in record for record in replayed_log)
    if density == "1.0":
        assert rewirings == 0 and recorder.captures == 1 and recorder.replays == 4 * (steps - 1)
    elif storage == "masked":  # a rewiring writes the weights in place: the capture stays valid
        assert rewirings >= 1 and recorder.captures == 1 and recorder.replays == 4 * (steps - 1)
    else:  # each rewiring moves the compact weights: the next step captures again
        assert rewirings >= 1 and recorder.captures == 1 + rewirings
    # BatchNorm statistics: one update per microbatch, none for warm-up or capture passes.
    tracked = replayed.unwrapped_model.residual_blocks[0].bn1.num_batches_tracked
    assert int(tracked) == 4 * steps


def test_fp16_overflows_change_the_loss_scale_between_replays():
    # Scales 2**20 and 2**19 overflow FP16 gradients (steps skipped), 2**18 does not: the capture
    # (step 2) is made at 2**19, and the replays of steps 3-5 must multiply by 2**18.
    overrides = ("microbatch.size=5", "precision=fp16", "precision.init_scale=1048576",
                 "checkpointing.strategy=residual_star", "checkpointing.every=2")  # fmt: skip
    eager, replayed = tiny_trainer(*overrides), tiny_trainer(*overrides)
    recorder = replaying(replayed)
    eager_log, replayed_log = train(eager, 5), train(replayed, 5)
    assert_same_training(eager, replayed, eager_log, replayed_log)
    assert [r["skipped"] for r in replayed_log] == [True, True, False, False, False]
    assert recorder.captures == 1 and recorder.replays == 4 * 4


def test_short_last_microbatch_runs_eagerly_and_the_rest_replays():
    # 20 examples in microbatches of 6: three of 6 (weight 0.3) are replayed, the last of 2 never
    # starts a step, so it is never captured and runs eagerly into the same gradients.
    eager, replayed = tiny_trainer("microbatch.size=6"), tiny_trainer("microbatch.size=6")
    recorder = replaying(replayed)
    eager_log, replayed_log = train(eager, 3), train(replayed, 3)
    assert_same_training(eager, replayed, eager_log, replayed_log)
    runner = replayed.microbatch_runner
    assert recorder.captures == 1 and recorder.replays == 3 + 3  # steps 2 and 3 (the capturing one replays too)
    assert [key[2][0] for key in runner.graphs] == [(6, 3, 32, 32)]
    assert sorted(shape[0] for shape in (key[2][0] for key in runner.sightings)) == [2, 6]


def test_knob_off_and_cpu_run_eagerly():
    assert type(tiny_trainer("trainer.cuda_graphs=off").microbatch_runner) is EagerMicrobatches
    assert type(tiny_trainer().microbatch_runner) is EagerMicrobatches  # auto: graphs are for CUDA
    with pytest.raises(ConfigError, match=r"trainer.cuda_graphs='sometimes' .*one of auto, off"):
        tiny_trainer("trainer.cuda_graphs=sometimes")


def test_runner_choice_on_cuda():
    model, device = nn.Linear(2, 2), torch.device("cuda")
    eager = EagerMicrobatches(lambda m, part: m(part).sum(), LossScaler(enabled=False), no_autocast)
    recorder = RecordingBackend()

    def choose(setting="auto", data_parallel=False, runner=eager):
        return make_microbatch_runner(setting, runner, model, device, data_parallel=data_parallel, backend=recorder)

    assert isinstance(choose(), ReplayedMicrobatches)
    assert choose("off") is eager
    assert choose(data_parallel=True) is eager  # DDP's deferred all-reduce is not captured
    amp = EagerMicrobatches(eager.loss, AmpLossScaler(torch.amp.GradScaler("cpu", enabled=False), None), eager.autocast)
    assert choose(runner=amp) is amp
    with pytest.raises(ValueError, match=r"trainer.cuda_graphs='on' is unknown; allowed: auto, off"):
        choose("on")


def no_autocast(part) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


# --- the runner alone: loss weight and scale, random numbers, BatchNorm, failures --------------------


class SmallNet(nn.Module):
    """Linear, BatchNorm, dropout: state a forward mutates and random numbers it draws."""

    def __init__(self, unused_parameter: bool = False) -> None:
        super().__init__()
        self.hidden, self.norm, self.out = nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)
        self.unused = nn.Parameter(torch.zeros(2)) if unused_parameter else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.dropout(F.relu(self.norm(self.hidden(x))), 0.5, self.training))


def small_loss(model: nn.Module, part: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = part
    return F.cross_entropy(model(x), y)


def runners(backend_for=None, **net) -> tuple[list, list]:
    """(model, params, eager runner) and the same for a replaying runner, identical models."""
    torch.manual_seed(0)
    model = SmallNet(**net)
    other = copy.deepcopy(model)
    made = []
    for m in (model, other):
        scaler = GuardedScaler(init_scale=1024.0)
        made.append([m, list(m.parameters()), EagerMicrobatches(small_loss, scaler, no_autocast)])
    params = made[1][1]
    backend = backend_for(other, params) if backend_for else CheckedRecorder(other, params)
    made[1][2] = ReplayedMicrobatches(made[1][2], other, backend, torch.device("cpu"))
    return made[0], made[1]


def microbatch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 6, generator=generator), torch.randint(0, 3, (size,), generator=generator)


def run_steps(model, params, runner, steps: int, scales: dict[int, float]) -> list:
    """Per step: microbatches of 8, 8 and 4 examples with loss weights 0.5, 0.3, 0.2 (one shape,
    two weights: a replay must read the weight it is given; the 4 never starts a step: it stays
    eager); the loss scale changes at the steps in ``scales``."""
    torch.manual_seed(1)
    model.train()
    seen = []
    for step in range(steps):
        if step in scales:
            scaler = runner.scaler if isinstance(runner, EagerMicrobatches) else runner.eager.scaler
            scaler.scale = scales[step]
        runner.start_step(params)
        losses = [
            runner.forward_backward(model, microbatch(size, seed=10 * step + index), weight)
            for index, (size, weight) in enumerate([(8, 0.5), (8, 0.3), (4, 0.2)])
        ]
        state = [*(None if p.grad is None else p.grad.clone() for p in params), *(b.clone() for b in model.buffers())]
        seen.append((losses, state))
        with torch.no_grad():  # a stand-in update, so the parameters change between steps
            for p in params:
                if p.grad is not None:
                    p -= 1e-4 * p.grad
    return seen


def assert_same(a: list, b: list) -> None:
    for (losses_a, state_a), (losses_b, state_b) in zip(a, b, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(losses_a, losses_b, strict=True))
        for x, y in zip(state_a, state_b, strict=True):
            assert (x is None and y is None) or torch.equal(x, y)


def test_weight_scale_dropout_and_batchnorm_match_eager_across_replays():
    (model, params, eager), (other, other_params, replayed) = runners()
    scales = {2: 8.0, 3: 0.25}  # the loss scale moves after the capture: replays must read the new one
    expected, got = run_steps(model, params, eager, 5, scales), run_steps(other, other_params, replayed, 5, scales)
    assert_same(expected, got)
    # The 8-example shape is captured at step 2 and replayed twice a step from then on.
    assert replayed.captures == 1 and replayed.backend.replays == 2 * 4
    # Dropout draws anew at every replay (the same microbatch replayed twice gives two losses).
    first = replayed.forward_backward(other, microbatch(8, seed=99), 0.4)
    second = replayed.forward_backward(other, microbatch(8, seed=99), 0.4)
    assert not torch.equal(first, second)


def test_capture_that_fails_runs_eagerly_and_is_logged_once(caplog):
    class Failing(CheckedRecorder):
        def capture(self, call):
            self.captures += 1
            call()  # half-way through, as a real capture would get
            raise RuntimeError("operation not permitted when stream is capturing")

    (model, params, eager), (other, other_params, replayed) = runners(backend_for=Failing)
    with caplog.at_level(logging.INFO, logger="lowmem"):
        expected, got = run_steps(model, params, eager, 4, {}), run_steps(other, other_params, replayed, 4, {})
    assert_same(expected, got)  # statistics, gradients and random numbers restored after the failure
    assert replayed.backend.captures == 1 and len(replayed.refused) == 1 and not replayed.graphs
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "operation not permitted" in warnings[0].getMessage()


def test_a_replay_that_differs_from_eager_is_dropped_and_the_eager_results_kept(caplog):
    class Drifting(CheckedRecorder):
        """A capture whose replays add a little to one gradient (a kernel that differs in a graph)."""

        def capture(self, call):
            recorded = super().capture(call)
            params = self.params

            class Wrong:
                def replay(self) -> torch.Tensor:
                    loss = recorded.replay()
                    params[0].grad.add_(1e-6)
                    return loss

            return Wrong()

    (model, params, eager), (other, other_params, replayed) = runners(backend_for=Drifting)
    with caplog.at_level(logging.WARNING, logger="lowmem"):
        expected, got = run_steps(model, params, eager, 4, {}), run_steps(other, other_params, replayed, 4, {})
    assert_same(expected, got)  # the differing replay's microbatch keeps the eager run's results
    assert replayed.backend.captures == 1 and replayed.backend.replays == 1 and not replayed.graphs
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "does not replay as it runs eagerly" in warnings[0]


def test_a_replay_whose_recomputed_dropout_draws_other_masks_is_dropped(caplog):
    class OtherMasks(CheckedRecorder):
        """Replays that draw other random numbers than the eager run (as a capture whose
        recomputation did not rewind the generator would)."""

        def capture(self, call):
            recorded = super().capture(call)

            class Redrawn:
                def replay(self) -> torch.Tensor:
                    torch.manual_seed(12345)
                    return recorded.replay()

            return Redrawn()

    (model, params, eager), (other, other_params, replayed) = runners(backend_for=OtherMasks)
    with caplog.at_level(logging.WARNING, logger="lowmem"):
        replayed_steps = run_steps(other, other_params, replayed, 3, {})
    expected = run_steps(model, params, eager, 3, {})
    assert_same(expected[:1], replayed_steps[:1])
    # Step 2's first microbatch is captured; its replay drew other masks, so the eager loss is kept.
    # (The replay reseeded the generator: what follows it draws otherwise, as it would on a device.)
    assert torch.equal(expected[1][0][0], replayed_steps[1][0][0])
    assert not replayed.graphs and sum("does not replay" in r.getMessage() for r in caplog.records) == 1


def test_a_verified_capture_is_checked_once():
    (model, params, eager), (other, other_params, replayed) = runners()
    checks = []
    original = replayed._verified_replay
    replayed._verified_replay = lambda *args: checks.append(1) or original(*args)
    assert_same(run_steps(model, params, eager, 4, {}), run_steps(other, other_params, replayed, 4, {}))
    assert len(checks) == 1 and all(captured.verified for captured in replayed.graphs.values())


class FakeStream:
    def wait_stream(self, other: FakeStream) -> None:
        pass


class FakeCuda:
    """torch.cuda's streams and graphs, recorded on a CPU: ``torch.cuda.graph`` whose capture_end
    raises, and whose exit then skips restoring the stream (as torch's does)."""

    def __init__(self, monkeypatch) -> None:
        self.main = self.current = FakeStream()
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream())
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
        monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: setattr(self, "current", stream))
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(torch.cuda, "graph", self.graph)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    @contextlib.contextmanager
    def graph(self, graph, pool=None, stream=None):
        self.current = stream
        yield
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


def test_a_capture_failing_in_capture_end_restores_the_stream_and_stops_capturing(monkeypatch, caplog):
    fake = FakeCuda(monkeypatch)
    (model, params, eager), (other, other_params, replayed) = runners(
        backend_for=lambda model, params: CudaGraphBackend(torch.device("cpu"))
    )
    with caplog.at_level(logging.WARNING, logger="lowmem"):
        expected, got = run_steps(model, params, eager, 4, {}), run_steps(other, other_params, replayed, 4, {})
    assert fake.current is fake.main  # not the abandoned capture stream
    assert_same(expected, got)
    assert replayed.disabled is not None and "no further capture" in replayed.disabled and not replayed.graphs
    assert sum("no further capture" in r.getMessage() for r in caplog.records) == 1


def test_parameter_without_gradient_turns_the_runner_eager(caplog):
    (model, params, eager), (other, other_params, replayed) = runners(unused_parameter=True)
    with caplog.at_level(logging.WARNING, logger="lowmem"):
        expected, got = run_steps(model, params, eager, 3, {}), run_steps(other, other_params, replayed, 3, {})
    assert_same(expected, got)  # ``unused`` keeps a None gradient, as eagerly
    assert replayed.disabled is not None and "unused" in replayed.disabled and replayed.backend.replays == 0
    assert any("no gradient" in r.getMessage() for r in caplog.records)


def test_every_buffer_a_forward_changes_counts_replays_only():
    class Counting(SmallNet):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

        def forward(self, x):
            self.calls += 1
            return super().forward(x)

    torch.manual_seed(0)
    model = Counting()
    params = list(model.parameters())
    eager = EagerMicrobatches(small_loss, LossScaler(enabled=False), no_autocast)
    runner = ReplayedMicrobatches(eager, model, CheckedRecorder(model, params), torch.device("cpu"))
    for _ in range(3):
        runner.start_step(params)
        runner.forward_backward(model, microbatch(8, seed=0), 1.0)
    assert runner.captures == 1 and runner.backend.replays == 2
    # One count per microbatch: the capture's WARM_UP_PASSES + 1 passes were undone.
    assert WARM_UP_PASSES >= 1 and int(model.calls) == 3


# --- layout on CUDA: channels-last activations, tuned convolutions --------------------------------


class ConvolutionInputs(TorchDispatchMode):
    """Records, for every convolution forward and backward, whether its input is channels-last."""

    def __init__(self) -> None:
        super().__init__()
        self.layouts: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default):
            # convolution(input, weight, ...); convolution_backward(grad_output, input, weight, ...)
            x = args[0] if func is torch.ops.aten.convolution.default else args[1]
            self.layouts.append((func.__name__, x.is_contiguous(memory_format=torch.channels_last)))
        return func(*args, **(kwargs or {}))


def test_channels_last_reaches_every_convolution_compact_and_recomputed():
    # What CUDA runs in 16 bits, here on the CPU: compact sparse convolutions under residual_star,
    # whose recomputation reruns the convolutions of each segment.
    trainer = tiny_trainer("precision=bf16", "sparsity.density=0.5", "checkpointing.strategy=residual_star",
                           "checkpointing.every=2")  # fmt: skip
    images, labels = trainer.example_batch()
    with ConvolutionInputs() as seen:
        trainer.train_step((images.contiguous(memory_format=torch.channels_last), labels))
    forward = [cl for name, cl in seen.layouts if name == "convolution.default"]
    backward = [cl for name, cl in seen.layouts if name == "convolution_backward.default"]
    assert len(forward) > 7 and all(forward), seen.layouts  # 7 convolutions, and their recomputation
    assert len(backward) >= 7 and all(backward), seen.layouts


def test_wrn_images_are_channels_last_in_16_bits_on_cuda_only():
    assert input_memory_format(torch.bfloat16, torch.device("cuda")) == torch.channels_last
    assert input_memory_format(torch.float16, torch.device("cuda", 0)) == torch.channels_last
    assert input_memory_format(torch.float32, torch.device("cuda")) == torch.preserve_format
    assert input_memory_format(torch.bfloat16, torch.device("cpu")) == torch.preserve_format
    data = load_image_dataset("fake", "unused", torch.device("cpu"), train_size=40, test_size=10)
    plain = training_batches(data, 20, seed=0, dtype=torch.bfloat16)
    laid_out = training_batches(data, 20, seed=0, dtype=torch.bfloat16, memory_format=torch.channels_last)
    for (x, y), (u, v) in zip(plain.epoch(0), laid_out.epoch(0), strict=True):
        assert x.is_contiguous() and u.is_contiguous(memory_format=torch.channels_last) and not u.is_contiguous()
        assert torch.equal(x, u) and torch.equal(y, v)


def test_cudnn_times_convolutions_on_cuda_unless_deterministic():
    saved = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    conv_model = nn.Sequential(nn.Conv2d(3, 4, 3))
    try:
        torch.backends.cudnn.benchmark = torch.backends.cudnn.deterministic = False
        assert not tune_convolutions(conv_model, torch.device("cpu")) and not torch.backends.cudnn.benchmark
        assert not tune_convolutions(nn.Linear(2, 2), torch.device("cuda")) and not torch.backends.cudnn.benchmark
        torch.backends.cudnn.deterministic = True  # trainer.deterministic=true
        assert not tune_convolutions(conv_model, torch.device("cuda")) and not torch.backends.cudnn.benchmark
        torch.backends.cudnn.deterministic = False
        assert tune_convolutions(conv_model, torch.device("cuda")) and torch.backends.cudnn.benchmark
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved


def test_translation_microbatches_with_repeating_shapes_replay_exactly():
    # DynamicConv: dict microbatches (token tensors plus integer counts, which the capture bakes in
    # and so belong to the shape), dropout drawn in the forward. The same minibatch, three times.
    overrides = (*SMALL_DC, "data.train_size=60", "data.batch_size=300", "microbatch.size=150",
                 "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=32")  # fmt: skip
    eager, replayed = build_trainer(make_config(*overrides)), build_trainer(make_config(*overrides))
    recorder = replaying(replayed)
    batch = eager.example_batch()
    torch.manual_seed(5)
    eager_log = [eager.train_step(batch) for _ in range(3)]
    torch.manual_seed(5)
    replayed_log = [replayed.train_step(batch) for _ in range(3)]
    assert_same_training(eager, replayed, eager_log, replayed_log)
    assert recorder.captures == 1 and recorder.replays >= 1


def test_shapes_waiting_to_repeat_are_remembered_up_to_a_bound(monkeypatch):
    monkeypatch.setattr("lowmem.techniques.replay.MAX_REMEMBERED_SHAPES", 3)
    (_, _, _), (model, params, runner) = runners()
    model.train()
    for size in (2, 3, 4, 5, 2):  # the fourth new shape forgets the first three
        runner.start_step(params)
        runner.forward_backward(model, microbatch(size, seed=0), 1.0)
    assert len(runner.sightings) == 2 and not runner.graphs  # shape 2 counted afresh: not captured


# --- the graph pool in the accounting ------------------------------------------------------------


def test_accounting_holds_the_replayed_shape_in_the_graph_pool_and_eager_microbatches_on_top():
    # 20 examples in microbatches of 6: the shape of 6 is replayed (its activations stay in the
    # graphs' pool for the run), the last of 2 runs eagerly on top of that pool.
    from lowmem.profiler.step import profile_trainer

    plain = profile_trainer(tiny_trainer("microbatch.size=6"), measure=False)
    assert plain.graph_pool_bytes == 0 and plain.total_with_graph_pool_bytes == plain.total_bytes
    assert "with CUDA graph replay" not in plain.table()
    trainer = tiny_trainer("microbatch.size=6")
    replaying(trainer)
    assert trainer.replays_microbatches
    report = profile_trainer(trainer, measure=False)
    two = profile_trainer(tiny_trainer("data.batch_size=2"), measure=False)  # one eager microbatch of 2
    assert report.total_bytes == plain.total_bytes
    assert report.graph_pool_bytes == report.activation_bytes  # the shape of 6 is the largest
    assert two.activation_bytes > 0
    assert report.total_with_graph_pool_bytes == report.total_bytes + two.activation_bytes
    assert "with CUDA graph replay" in report.table()
    # Every microbatch replayed (no short one): nothing on top of the pool.
    even = tiny_trainer("microbatch.size=5")
    replaying(even)
    evenly = profile_trainer(even, measure=False)
    assert evenly.graph_pool_bytes == evenly.activation_bytes
    assert evenly.total_with_graph_pool_bytes == evenly.total_bytes
    # A runner that turned eager holds no pool.
    even.microbatch_runner.disabled = "a test"
    assert not even.replays_microbatches
    assert profile_trainer(even, measure=False).graph_pool_bytes == 0


def test_the_planners_accounting_adds_eager_microbatches_to_the_graph_pool():
    from lowmem.planning.optimal import MinibatchAccounting
    from lowmem.profiler.step import profile_trainer

    trainer = tiny_trainer("microbatch.size=6")
    eager = MinibatchAccounting(trainer).account("none", lambda: None)
    replaying(trainer)
    replayed = MinibatchAccounting(trainer).account("none", lambda: None)
    report = profile_trainer(trainer, measure=False)
    assert eager.activation_bytes == report.activation_bytes
    held = report.total_with_graph_pool_bytes - report.model_bytes - report.optimizer_bytes
    assert replayed.complete and replayed.activation_bytes == held > eager.activation_bytes
    assert replayed.flops == eager.flops
