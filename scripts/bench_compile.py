"""``trainer.compile=true`` against plain PyTorch compiled: time per FLOP, side by side in one run.

For each of the report's Table 3 rows 2-7 (WRN-28-2, batch 100, 16-bit weights, residual_star
every 2, true microbatches; ``--tiny``: WRN-10-1, batch 20) and the full FP32 combination, lowmem's
step eagerly and compiled, and plain PyTorch's (the same WRN, ``torch.optim.SGD``, gradients
accumulated over the same microbatches, weights in the same precision) eagerly and compiled
(``torch.compile``, inductor). Per row: the FLOPs (forward + backward + recomputation, as
``lowmem.profile`` counts them), the median step time, time per FLOP as a ratio to plain PyTorch
compiled at the same microbatch size and precision (a row's recomputation FLOPs are the price of its
memory, not overhead), compiled against eager, the measured peak, the graph breaks and the compile
time (first step less a steady one). Steps are timed round-robin (every configuration's step in
turn, each round), so a machine that slows down moves every row alike.

On a CPU, 16-bit rows use BF16 computed as ``precision.cpu_compute=auto`` chooses (plain PyTorch's
BF16 ops run natively). ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` restricts oneDNN's
convolutions, torch's own kernels and inductor's code to AVX2 (the CPU line then names the setting).

``--models``: the same for the any-model rows of ``scripts/bench_your_model.py`` (torchvision's
resnet18 and mobilenet_v3_small, a small ViT, a GPT-style model; batch 100) through
``lowmem.prepare`` with its full combination (density 0.3, BF16, microbatches of 10,
``residual_star`` every 2), against plain PyTorch at microbatches of 10 in BF16 and in FP32.

    .venv/bin/python scripts/bench_compile.py [--tiny] [--repeats 5] [--rows 2,3,4,5,6,7,full] [--out FILE]
    .venv/bin/python scripts/bench_compile.py --models [--only NAME] [--cpu-compute native]
    .venv/bin/python scripts/bench_compile.py --rewirings 8 [--tiny] [--rows 4]

``--models --attribute``: an any-model row's compiled lowmem step taken apart (the combination,
dense with its checkpointing, compact sparse without it, dense without either) against plain
PyTorch compiled at the same microbatch size and precision: what each technique costs.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lowmem.config import compose
from lowmem.profiler import count_flops, measure_peak, profile_trainer
from lowmem.profiler.peak import CompiledStepTracker
from lowmem.run.files import save_bytes
from lowmem.techniques.compilation import SEGMENT_MODES, inductor_cache
from lowmem.trainer import build_trainer
from recipes.wrn_cifar.model import WideResNet

BASE = ["+recipe=wrn_cifar", "data=fake", "trainer.progress=none", "trainer.device=cpu"]


def rows(batch: int) -> dict[str, tuple[list[str], int, str]]:
    """name -> (overrides, microbatch size, precision)."""
    star = ["checkpointing.strategy=residual_star", "checkpointing.every=2", "microbatch.mode=true"]
    small = max(1, batch // 10)
    tiny = max(1, batch // 25)
    return {
        "2": ([*star, "precision=bf16", f"microbatch.size={batch}"], batch, "bf16"),
        "3": ([*star, "precision=bf16", f"microbatch.size={small}"], small, "bf16"),
        "4": ([*star, "precision=bf16", "sparsity.density=0.3", f"microbatch.size={small}"], small, "bf16"),
        "5": ([*star, "precision=bf16", "sparsity.density=0.2", f"microbatch.size={small}"], small, "bf16"),
        "6": ([*star, "precision=bf16", "sparsity.density=0.2", f"microbatch.size={tiny}"], tiny, "bf16"),
        "7": ([*star, "precision=bf16", "sparsity.density=0.1", f"microbatch.size={tiny}"], tiny, "bf16"),
        "full": ([*star, "precision=fp32", "sparsity.density=0.3", f"microbatch.size={small}"], small, "fp32"),
    }


def lowmem_step(overrides: list[str], compiled: bool) -> tuple[Callable[[], object], object, object]:
    torch._dynamo.reset()  # its own graphs: graph breaks and compile time counted for it
    trainer = build_trainer(compose(*BASE, *overrides, f"trainer.compile={str(compiled).lower()}"))
    batch = trainer.example_batch()
    return (lambda: trainer.train_step(batch)), trainer, batch


def compiled_flops(make_trainer: Callable[[], object], segments: str, run_step: Callable | None = None) -> int:
    """FLOPs of a compiled lowmem step, as its graphs run them: ``make_trainer()`` (uncompiled)
    compiled by AOTAutograd with inductor's partitioner (what it recomputes in backward, what it
    drops), every graph run op by op under torch's FLOP counter; counted at the third step (the
    first runs checkpointed stacks eagerly, watched). A count of the step run eagerly
    (``force_eager``) is not this: it computes what compiled code leaves out (a ``residual_star``
    rebuild's unread convolution, the last convolution of a checkpoint region). ``run_step(trainer)``:
    one step (default: ``train_step`` on its example batch)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from lowmem.techniques.compilation import apply_compile

    total = [0]

    def counted(graph: torch.fx.GraphModule, _example) -> Callable:
        def run(*args):
            outputs = []  # node by node (fx's Interpreter), so no module hook of the counter's fires
            total[0] += count_flops(lambda: outputs.append(torch.fx.Interpreter(graph).run(*args)))
            return outputs[0]

        return make_boxed_func(run)

    backend = aot_autograd(fw_compiler=counted, bw_compiler=counted, partition_fn=min_cut_rematerialization_partition,
                           keep_inference_input_mutations=True)  # fmt: skip
    torch._dynamo.reset()
    trainer = make_trainer()
    apply_compile(trainer.unwrapped_model, backend, segments)
    if run_step is None:
        batch = trainer.example_batch()
        run_step = lambda trainer: trainer.train_step(batch)  # noqa: E731
    for _ in range(2):
        run_step(trainer)
    total[0] = 0
    run_step(trainer)
    torch._dynamo.reset()
    return total[0]


def plain_step(depth: int, width: int, batch, micro: int, dtype: torch.dtype, compiled: bool):
    """Plain PyTorch: the same WRN in ``dtype``, SGD with momentum, gradients accumulated over
    microbatches of ``micro`` examples; ``compiled``: the model through ``torch.compile``."""
    torch.manual_seed(0)
    model = WideResNet(depth=depth, width=width, num_classes=10).to(dtype)
    if compiled:
        model.compile()
    runner = model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = batch
    x = x.to(dtype)
    parts = [(x[i : i + micro], y[i : i + micro]) for i in range(0, len(x), micro)]

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for xs, ys in parts:
            (F.cross_entropy(runner(xs).float(), ys) * (len(xs) / len(x))).backward()
        optimizer.step()

    return step, model


def median_round_robin(steps: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="WRN-10-1, batch 20 (minutes on a CPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default="2,3,4,5,6,7,full")
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    parser.add_argument("--cpu-compute", default="auto", help="precision.cpu_compute of the lowmem rows")
    parser.add_argument("--segments", default="stack", choices=SEGMENT_MODES,
                        help="trainer.compile_segments of the compiled lowmem rows")
    parser.add_argument("--profile", action="store_true",
                        help="also print where each lowmem step's time goes (torch.profiler, one step each; "
                             "with --models, plain BF16 compiled's too)")
    parser.add_argument("--models", action="store_true", help="the any-model rows instead of Table 3's")
    parser.add_argument("--only", default=None, help="with --models: the models whose name contains this")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                        help="with --models: lowmem's precision (fp32: lowmem's techniques against plain FP32 at "
                             "the same precision, on a CPU without native BF16 kernels)")
    parser.add_argument("--attribute", action="store_true",
                        help="with --models: each model's compiled lowmem step with its techniques taken apart")
    parser.add_argument("--optimizer", action="store_true",
                        help="the optimizer step alone: lowmem's (eager) against torch.optim's eager and compiled")
    parser.add_argument("--rewirings", type=int, default=0, metavar="STEPS",
                        help="a Table 3 row (the first of --rows) compiled, rewiring after every update, for STEPS "
                             "steps: the graphs each step compiles and its time")
    args = parser.parse_args()
    inductor_cache()
    if args.rewirings:
        through_rewirings(args)
        return
    if args.models and args.attribute:
        attribution(args)
        return
    if args.models:
        any_models(args)
        return
    if args.optimizer:
        optimizer_steps(args)
        return
    depth, width, batch = (10, 1, 20) if args.tiny else (28, 2, 100)
    size = [f"model.depth={depth}", f"model.width={width}", f"data.batch_size={batch}",
            f"data.train_size={2 * batch}", "data.test_size=20"]
    chosen = {k: v for k, v in rows(batch).items() if k in args.rows.split(",")}
    steps: dict[str, Callable[[], object]] = {}
    info: dict[str, dict] = {}
    example = None
    for name, (overrides, micro, precision) in chosen.items():
        for compiled in (False, True):
            key = f"lowmem {name} {'compiled' if compiled else 'eager'}"
            if compiled:  # the FLOPs its compiled graphs run (the compiler's recomputation included)
                config = compose(*BASE, *size, *overrides)
                graph_flops = compiled_flops(lambda: build_trainer(config), args.segments)  # noqa: B023 - called here
            step, trainer, batch_ = lowmem_step([*size, *overrides, f"precision.cpu_compute={args.cpu_compute}",
                                                 f"trainer.compile_segments={args.segments}"], compiled)
            example = batch_
            flops = graph_flops if compiled else profile_trainer(trainer, measure=False).flops
            started = time.perf_counter()
            step()  # compiles (the checkpointed stacks: at the second step, after an eager watched one)
            step()
            first = time.perf_counter() - started
            started = time.perf_counter()
            step()
            steady = time.perf_counter() - started
            peak = measure_peak(step, trainer.unwrapped_model, trainer.optimizer, owners=(trainer,),
                                arithmetic=trainer.arithmetic())
            with CompiledStepTracker("cpu", trainer.unwrapped_model, trainer.optimizer, owners=(trainer,)) as events:
                step()  # the allocator's events, eager or compiled alike
            summary = trainer.compile_summary()
            info[key] = {"flops": flops, "peak": peak.peak_bytes, "events": events.peak_bytes, "micro": micro,
                         "precision": precision, "breaks": summary["graph_breaks"],
                         "compile_s": max(0.0, first - 2 * steady) if compiled else 0.0}
            steps[key] = step  # train_step computes in the trainer's arithmetic itself
    plains = {(v[1], v[2]) for v in chosen.values()} | {(v[1], "fp32") for v in chosen.values()}
    for micro, precision in sorted(plains):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        for compiled in (False, True):
            key = f"plain mb{micro} {precision} {'compiled' if compiled else 'eager'}"
            step, model = plain_step(depth, width, example, micro, dtype, compiled)
            started = time.perf_counter()
            step()
            first = time.perf_counter() - started
            step()
            with torch.compiler.set_stance("force_eager"):
                flops = count_flops(step)
            with CompiledStepTracker("cpu", model, None, owners=(model,)) as events:
                step()
            info[key] = {"flops": flops, "peak": None, "events": events.peak_bytes, "micro": micro,
                         "precision": precision, "breaks": None, "compile_s": first if compiled else 0.0}
            steps[key] = step
    gc.collect()
    medians = median_round_robin(steps, args.repeats)
    if args.profile:
        for key, step in steps.items():
            if key.startswith("lowmem"):
                print(f"\n{key}: {where_time_goes(step)}")
    lines = [
        f"CPU: {cpu_name()} | ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '(default)')}, "
        f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '(default)')} | "
        f"lowmem precision.cpu_compute={args.cpu_compute} | torch {torch.__version__} | threads "
        f"{torch.get_num_threads()} | {'WRN-10-1 batch 20' if args.tiny else 'WRN-28-2 batch 100'} | "
        f"median of {args.repeats} | trainer.compile_segments={args.segments}",
        "",
        "| row | mb | precision | GFLOPs compiled, eager (plain) | lowmem eager s | lowmem compiled s | "
        "compiled / eager | "
        "time/FLOP vs plain compiled, same precision | vs plain FP32 compiled | plain eager s | plain compiled s "
        "| peak eager MB (tracker / allocator) | peak compiled MB (allocator) | plain compiled MB (allocator) "
        "| breaks | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (_, micro, precision) in chosen.items():
        eager, compiled = info[f"lowmem {name} eager"], info[f"lowmem {name} compiled"]
        plain_e, plain_c = (f"plain mb{micro} {precision} {kind}" for kind in ("eager", "compiled"))
        plain32 = f"plain mb{micro} fp32 compiled"
        t_e, t_c = medians[f"lowmem {name} eager"], medians[f"lowmem {name} compiled"]
        per_flop = (t_c / compiled["flops"]) / (medians[plain_c] / info[plain_c]["flops"])
        per_flop32 = (t_c / compiled["flops"]) / (medians[plain32] / info[plain32]["flops"])
        lines.append(
            f"| {name} | {micro} | {precision} | {compiled['flops'] / 1e9:.1f}, {eager['flops'] / 1e9:.1f} "
            f"({info[plain_c]['flops'] / 1e9:.1f}) | "
            f"{t_e:.3f} | {t_c:.3f} | {t_c / t_e:.2f}x | {per_flop:.2f}x | {per_flop32:.2f}x | "
            f"{medians[plain_e]:.3f} | {medians[plain_c]:.3f} | "
            f"{eager['peak'] / 1e6:.1f} / {eager['events'] / 1e6:.1f} | "
            f"{compiled['events'] / 1e6:.1f} | {info[plain_c]['events'] / 1e6:.1f} | {compiled['breaks']} | "
            f"{compiled['compile_s']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        save_bytes(text.encode(), args.out)


def through_rewirings(args: argparse.Namespace) -> None:
    """A compiled compact sparse row trained with a rewiring after every update (DSR's WRN schedule
    rewires every 100-800): what each step compiles (``graphs``) and takes. The first steps compile
    the model and its blocks; the later ones show what a rewiring costs the compiled run."""
    from lowmem.techniques.compilation import graphs_compiled

    depth, width, batch = (10, 1, 20) if args.tiny else (28, 2, 100)
    name = args.rows.split(",")[0]
    overrides, _, _ = rows(batch)[name]
    trainer = build_trainer(compose(
        *BASE, *overrides, f"model.depth={depth}", f"model.width={width}", f"data.batch_size={batch}",
        f"precision.cpu_compute={args.cpu_compute}", "trainer.compile=true",
        f"trainer.compile_segments={args.segments}", "sparsity.rewire_freq_mult=1000",
    ))  # fmt: skip
    if trainer.sparsity is None or trainer.sparsity.compact is None:
        raise SystemExit(f"--rewirings: row {name} has no compact sparse layers; choose one of rows 4-7 or full")
    example = trainer.example_batch()
    print(f"CPU: {cpu_name()} | torch {torch.__version__} | threads {torch.get_num_threads()} | "
          f"WRN-{depth}-{width} batch {batch}, Table 3 row {name}, compiled, a rewiring after every update\n")
    print("| step | graphs compiled | step s | nonzeros per layer (first 4) |\n|---|---|---|---|")
    for step in range(args.rewirings):
        before, started = graphs_compiled(), time.perf_counter()
        trainer.train_step(example)
        seconds = time.perf_counter() - started
        print(f"| {step} | {graphs_compiled() - before} | {seconds:.2f} | {trainer.sparsity.compact.counts[:4]} |",
              flush=True)


def any_models(args: argparse.Namespace) -> None:
    """The any-model rows: lowmem's full combination eager and compiled against plain PyTorch at
    microbatches of 10, BF16 and FP32, eager and compiled, timed round-robin per model."""
    from bench_your_model import MICROBATCH, models

    lines = [
        f"CPU: {cpu_name()} | ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '(default)')}, "
        f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '(default)')} | "
        f"lowmem precision={args.precision}, cpu_compute={args.cpu_compute} | torch {torch.__version__} | threads "
        f"{torch.get_num_threads()} | batch 100, microbatches of {MICROBATCH} | median of {args.repeats} | "
        f"trainer.compile_segments={args.segments}",
        "",
        "| model | GFLOPs lowmem (plain) | lowmem eager s | lowmem compiled s | compiled / eager | time/FLOP vs plain "
        "compiled, BF16 | vs plain FP32 compiled | plain BF16 eager s | plain BF16 compiled s | plain FP32 compiled s "
        "| breaks | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (make_model, batch, loss_fn) in models(100).items():
        if args.only is None or args.only in name:
            lines.append(any_model_row(name, make_model, batch, loss_fn, args))
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        save_bytes(text.encode(), args.out)


def _warm_up(run, batch) -> float:
    """Three steps of a prepared run: the first two compile (checkpointed stacks at the second, after
    an eager watched one). The compile time: the first two less twice the third (0 run eagerly)."""
    started = time.perf_counter()
    run.step(batch)
    run.step(batch)
    first = time.perf_counter() - started
    started = time.perf_counter()
    run.step(batch)
    return max(0.0, first - 2 * (time.perf_counter() - started))


def _plain_warmed_up(make_model: Callable, batch: tuple, loss_fn: Callable, dtype: torch.dtype,
                     compiled: bool) -> Callable[[], None]:
    """Plain PyTorch's step (SGD, microbatches of ``bench_your_model.MICROBATCH``) of a new model in
    ``dtype``, compiled or not, after two steps (the first compiles)."""
    from bench_your_model import MICROBATCH, plain_microbatched_step

    torch.manual_seed(0)
    model = make_model().to(dtype)
    if compiled:
        model.compile()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    typed = tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)
    step = plain_microbatched_step(model, optimizer, loss_fn, typed, MICROBATCH)
    step()
    step()
    return step


def any_model_row(name: str, make_model: Callable, batch: tuple, loss_fn: Callable, args: argparse.Namespace) -> str:
    from bench_your_model import COMBINATION

    import lowmem
    from lowmem.api import to_training

    steps: dict[str, Callable[[], object]] = {}
    flops: dict[str, float] = {}
    compile_s, breaks = 0.0, None
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        techniques = [o for o in COMBINATION if not o.startswith("precision=")]
        overrides = ["trainer.device=cpu", *techniques, f"precision={args.precision}",
                     f"precision.cpu_compute={args.cpu_compute}"]
        key = f"lowmem {'compiled' if compiled else 'eager'}"
        if compiled:  # the FLOPs its compiled graphs run
            flops[key] = compiled_flops(
                lambda: lowmem.prepare(make_model(), loss_fn, batch, overrides=overrides).trainer,  # noqa: B023
                args.segments,
                lambda trainer: trainer.train_step(to_training(batch, trainer.device, trainer.policy.input_dtype)),
            )
            torch.manual_seed(0)
        run = lowmem.prepare(make_model(), loss_fn, batch, overrides=[
            *overrides, f"trainer.compile={str(compiled).lower()}", f"trainer.compile_segments={args.segments}"])
        if not compiled:
            flops[key] = run.profile(measure=False)["flops"]
        warm_up_s = _warm_up(run, batch)
        if compiled:
            compile_s = warm_up_s
            breaks = run.trainer.compile_summary()["graph_breaks"]
        steps[key] = functools.partial(run.step, batch)
    for dtype in (torch.bfloat16, torch.float32):
        for compiled in (False, True):
            step = _plain_warmed_up(make_model, batch, loss_fn, dtype, compiled)
            key = f"plain {dtype} {'compiled' if compiled else 'eager'}"
            with torch.compiler.set_stance("force_eager"):
                flops[key] = count_flops(step)
            steps[key] = step
    gc.collect()
    t = median_round_robin(steps, args.repeats)
    if args.profile:
        for key in ("lowmem eager", "lowmem compiled", f"plain {torch.bfloat16} compiled"):
            print(f"\n{name} {key}: {where_time_goes(steps[key])}")
    plain16, plain32 = f"plain {torch.bfloat16} compiled", f"plain {torch.float32} compiled"
    ours = t["lowmem compiled"] / flops["lowmem compiled"]
    return (
        f"| {name} | {flops['lowmem compiled'] / 1e9:.1f} ({flops[plain16] / 1e9:.1f}) | {t['lowmem eager']:.3f} | "
        f"{t['lowmem compiled']:.3f} | {t['lowmem compiled'] / t['lowmem eager']:.2f}x | "
        f"{ours / (t[plain16] / flops[plain16]):.2f}x | {ours / (t[plain32] / flops[plain32]):.2f}x | "
        f"{t[f'plain {torch.bfloat16} eager']:.3f} | {t[plain16]:.3f} | {t[plain32]:.3f} | {breaks} | "
        f"{compile_s:.1f} |"
    )


def attribution(args: argparse.Namespace) -> None:
    """Per model: lowmem's compiled step with its techniques taken apart, timed round-robin with
    plain PyTorch compiled at microbatches of 10 in lowmem's precision (the same FLOPs but for the
    recomputation's: ratios of step times)."""
    from bench_your_model import COMBINATION, MICROBATCH, models

    import lowmem

    star = [o for o in COMBINATION if o.startswith("checkpointing.")]
    sparse = [o for o in COMBINATION if o.startswith("sparsity.")]
    parts = {"combination": [*sparse, *star], "dense, checkpointed": star, "compact sparse alone": sparse,
             "dense, no checkpointing": []}  # fmt: skip
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.precision]
    print(f"CPU: {cpu_name()} | lowmem precision={args.precision}, cpu_compute={args.cpu_compute} | torch "
          f"{torch.__version__} | threads {torch.get_num_threads()} | batch 100, microbatches of {MICROBATCH} "
          f"(true) | median of {args.repeats} | compiled, trainer.compile_segments={args.segments}\n")
    print("| model | lowmem configuration | step s | vs plain compiled | compile s |\n|---|---|---|---|---|")
    for name, (make_model, batch, loss_fn) in models(100).items():
        if args.only is not None and args.only not in name:
            continue
        steps: dict[str, Callable[[], object]] = {}
        compile_s: dict[str, float] = {}
        for part, techniques in parts.items():
            torch._dynamo.reset()
            torch.manual_seed(0)
            run = lowmem.prepare(make_model(), loss_fn, batch, overrides=[
                "trainer.device=cpu", f"precision={args.precision}", f"precision.cpu_compute={args.cpu_compute}",
                f"microbatch.size={MICROBATCH}", "microbatch.mode=true", *techniques, "trainer.compile=true",
                f"trainer.compile_segments={args.segments}"])  # fmt: skip
            compile_s[part] = _warm_up(run, batch)
            steps[part] = functools.partial(run.step, batch)
        steps["plain"] = _plain_warmed_up(make_model, batch, loss_fn, dtype, compiled=True)
        gc.collect()
        t = median_round_robin(steps, args.repeats)
        for part in parts:
            print(f"| {name} | {part} | {t[part]:.3f} | {t[part] / t['plain']:.2f}x | {compile_s[part]:.1f} |")
        print(f"| {name} | plain PyTorch compiled | {t['plain']:.3f} | 1.00x | |", flush=True)


def optimizer_steps(args: argparse.Namespace) -> None:
    """WRN-28-2's optimizer step alone (gradients given): lowmem's optimizers, which run eagerly
    (one C loop over the parameters: stochastic rounding of 16-bit weights, 8/4-bit state), against
    ``torch.optim``'s (foreach) eagerly and with the step compiled (``torch.compile``), on the same
    parameters in the same dtypes. Whether compiling the step would pay."""
    size = ["model.depth=28", "model.width=2", "data.batch_size=100", "data.train_size=200", "data.test_size=20"]
    configurations = {
        "SGD momentum, BF16 weights": (["precision=bf16"], "sgd"),
        "SGD momentum, FP32": (["precision=fp32"], "sgd"),
        "SGD momentum 8-bit state, BF16 weights": (["precision=bf16", "optim.state_bits=8"], "sgd"),
        "Adam 8-bit state, BF16 weights": (["precision=bf16", "optim.state_bits=8", "optim.name=adam",
                                            "optim.lr=0.001"], "adam"),
    }  # fmt: skip
    lines = [
        f"CPU: {cpu_name()} | torch {torch.__version__} | threads {torch.get_num_threads()} | WRN-28-2 "
        f"(1.5 M parameters) | median of {args.repeats * 4} steps",
        "",
        "| optimizer | lowmem eager ms | torch.optim eager ms | torch.optim compiled ms | lowmem / torch.optim "
        "compiled |",
        "|---|---|---|---|---|",
    ]
    for name, (overrides, kind) in configurations.items():
        trainer = build_trainer(compose(*BASE, *size, *overrides))
        ours = [p for p in trainer.unwrapped_model.parameters() if p.requires_grad]
        plain = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        for p in (*ours, *plain):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(p.dtype) * 1e-3
        make = {
            "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4),
            "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=(0.9, 0.98), weight_decay=5e-4),
        }[kind]
        eager_plain = make(plain)
        compiled_plain = make([torch.nn.Parameter(p.detach().clone()) for p in plain])
        for p, q in zip(compiled_plain.param_groups[0]["params"], plain, strict=True):
            p.grad = q.grad.clone()
        compiled_step = torch.compile(compiled_plain.step)
        steps = {"lowmem": trainer.optimizer.step, "eager": eager_plain.step, "compiled": compiled_step}
        for step in steps.values():
            step()
            step()
        with torch.no_grad():
            t = median_round_robin(steps, args.repeats * 4)
        lines.append(f"| {name} | {t['lowmem'] * 1e3:.2f} | {t['eager'] * 1e3:.2f} | {t['compiled'] * 1e3:.2f} | "
                     f"{t['lowmem'] / t['compiled']:.2f}x |")  # fmt: skip
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        save_bytes(text.encode(), args.out)


def where_time_goes(step: Callable[[], object], top: int = 8) -> str:
    """One step under torch.profiler: its convolutions (calls), dynamo's guard lookups and the ops
    taking the most time of their own."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        step()
    events = profiled.key_averages()
    count = {e.key: e.count for e in events}
    busiest = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    name = lambda key: "compiled graph" if "CompiledFxGraph" in key else key  # noqa: E731
    parts = [f"{name(e.key)} {e.self_cpu_time_total / 1e3:.0f} ms" for e in busiest]
    return (f"{count.get('aten::mkldnn_convolution', 0)} convolutions, "
            f"{count.get('TorchDynamo Cache Lookup', 0)} guard lookups "
            f"({sum(e.self_cpu_time_total for e in events if e.key == 'TorchDynamo Cache Lookup') / 1e3:.0f} ms) | "
            + ", ".join(parts))


def cpu_name() -> str:
    """The CPU's model name and its AVX-512 flags (AVX2 where it has none)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wide = sorted(f for f in flags if f in ("avx512f", "avx512_bf16", "amx_bf16", "avx2"))
    return f"{name} ({', '.join(wide)})"


if __name__ == "__main__":
    main()
