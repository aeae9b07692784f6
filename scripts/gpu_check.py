"""``make gpu-check``: does everything lowmem offers run correctly on this GPU? One PASS/FAIL line per case.

On one GPU, in a few minutes:

1. **train**: a few steps and an evaluation of every recipe and data set (WRN-28-2 on ``fake`` and
   ``digits``, DynamicConv on ``phrases`` and ``fake``) under every precision (fp32, fp16, bf16,
   amp) with each technique alone (sparsity, true and simulated microbatching, each checkpointing
   strategy) and all of them together; losses must be finite. A combination the configuration
   refuses by design (BatchNorm recomputation on a model without BatchNorm, say) prints ``N/A`` with
   the reason, never PASS.
2. **run**: the whole CLI path (``lowmem.train``: fit, evaluation, run files, DynamicConv's final BLEU)
   once per data set with every technique on.
3. **resume**: a sparse FP16 Adam run with stochastic rounding (``trainer.deterministic=true``) is
   killed after its first checkpoint and rerun into the same directory; its ``model.pt`` must equal,
   bit for bit, that of a run never interrupted.
4. **profile**: Table 3's and Table 4's rows profiled on the GPU: the accounting must equal the CPU
   accounting of the same configuration within 1% (the measured GPU peak is printed beside it).
5. **replay**: WRN microbatches replayed from CUDA graphs (``trainer.cuda_graphs=auto``) must have
   been captured and train bit for bit as eager ones (both deterministic), FP32 and FP16, with and
   without residual_star checkpointing.

Without CUDA it says so and exits 0. ``--device cpu --tiny`` runs the same cases on small models on
the CPU (what the tests run); ``--only WORD [WORD ...]`` keeps the cases whose name contains one of them.
Exit status: 1 if any case failed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lowmem.config import ConfigError, compose  # noqa: E402
from lowmem.train import run  # noqa: E402
from lowmem.trainer import build_trainer  # noqa: E402

PRECISIONS = ("fp32", "fp16", "bf16", "amp")
DATA = {"wrn_cifar": ("fake", "digits"), "dc_iwslt": ("phrases", "fake")}


@dataclass(frozen=True)
class Case:
    name: str
    check: Callable[[], str]  # returns a detail for the PASS line; raises on failure


class NotApplicable(Exception):
    """The configuration refuses this combination by design (the message says why)."""


# --- shapes --------------------------------------------------------------------------------------


def recipe_overrides(recipe: str, data: str, tiny: bool) -> list[str]:
    """A small but real run of ``recipe`` on ``data``: the recipe's model (tiny: a toy one)."""
    common = [f"+recipe={recipe}", f"data={data}", "trainer.progress=none", "trainer.epochs=1"]
    if recipe == "wrn_cifar":
        sizes = ["data.batch_size=20"]
        if data == "fake":
            sizes += ["data.train_size=200", "data.test_size=40"]
        if tiny:
            sizes += ["model.depth=10", "model.width=1"]
        return common + sizes
    sizes = ["data.batch_size=1000", "data.test_size=16"]
    if data == "fake":
        sizes += ["data.train_size=400"]
    if tiny:
        sizes += ["model.encoder_layers=2", "model.decoder_layers=2", "model.embed_dim=32", "model.ffn_dim=64",
                  "model.heads=2", "data.batch_size=600"]
    return common + sizes


def techniques(recipe: str) -> dict[str, list[str]]:
    """Each technique alone, and all together (microbatches: 10 images / 250 tokens)."""
    microbatch = "microbatch.size=10" if recipe == "wrn_cifar" else "microbatch.size=250"
    return {
        "plain": [],
        "sparsity": ["sparsity.density=0.3"],
        "microbatch-true": [microbatch, "microbatch.mode=true"],
        "microbatch-simulated": [microbatch, "microbatch.mode=simulated"],
        "ckpt-no_bn": ["checkpointing.strategy=no_bn"],
        "ckpt-residual": ["checkpointing.strategy=residual", "checkpointing.every=2"],
        "ckpt-residual_star": ["checkpointing.strategy=residual_star", "checkpointing.every=2"],
        "ckpt-compress4": ["checkpointing.compress=4"],
        "all": ["sparsity.density=0.3", microbatch, "microbatch.mode=true", "checkpointing.strategy=residual",
                "checkpointing.every=1"],
    }


# --- the checks ------------------------------------------------------------------------------------


def build(overrides: list[str]):
    """The trainer of ``overrides``; NotApplicable when the configuration refuses it at build time
    (a ConfigError: lowmem validates before it runs; any other error is a failure)."""
    try:
        return build_trainer(compose(*overrides))
    except ConfigError as error:
        raise NotApplicable(str(error).splitlines()[0]) from error


def train_steps(overrides: list[str], steps: int = 3) -> str:
    trainer = build(overrides)
    batch = trainer.example_batch()
    losses = [trainer.train_step(batch)["loss"] for _ in range(steps)]
    if not all(math.isfinite(loss) for loss in losses):
        raise AssertionError(f"losses {losses}")
    metrics = trainer.evaluate()
    if not all(math.isfinite(value) for value in metrics.values()):
        raise AssertionError(f"evaluation {metrics}")
    primary = trainer.recipe.primary_metric
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, {primary} {metrics[primary]:.3g}"


def replay_equals_eager(overrides: list[str], steps: int = 4) -> str:
    """Microbatches replayed from CUDA graphs train exactly as eager ones (deterministic kernels on
    both sides, so any difference is the replay's), and graphs were really captured."""
    deterministic = [*overrides, "trainer.deterministic=true"]
    results = []
    for setting in ("auto", "off"):
        trainer = build(deterministic + [f"trainer.cuda_graphs={setting}"])
        batch = trainer.example_batch()
        for _ in range(steps):
            trainer.train_step(batch)
        results.append((trainer.unwrapped_model.state_dict(), getattr(trainer.microbatch_runner, "captures", 0)))
    (replayed, captures), (eager, _) = results
    if captures == 0:
        raise AssertionError("no microbatch shape was captured (see the log's capture warnings)")
    differing = [key for key in eager if not torch.equal(eager[key], replayed[key])]
    if differing:
        raise AssertionError(f"replayed training differs from eager after {steps} steps: {differing[:3]}")
    return f"{captures} capture(s); weights, BatchNorm statistics bit-identical to eager after {steps} steps"


def full_run(overrides: list[str]) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        result = run(compose(*overrides, "trainer.max_steps=3"), Path(tmp))
        files = ("result.json", "metrics.jsonl", "model.pt", "checkpoint.pt")
        missing = [name for name in files if not (Path(tmp) / name).exists()]
    if missing:
        raise AssertionError(f"missing run files {missing}")
    scores = {k: v for k, v in result.items() if k.startswith(("best_", "bleu")) and isinstance(v, float)}
    return f"{result['steps']} steps, peak {result['peak_bytes'] / 1e6:.1f} MB, " + ", ".join(
        f"{k} {v:.3g}" for k, v in scores.items()
    )


def _train_command(overrides: list[str], run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "lowmem.train", *overrides, f"hydra.run.dir={run_dir}"]


def kill_and_resume(overrides: list[str], device: str) -> str:
    """Kill a run after its first checkpoint, rerun it into its directory (it continues): the final
    weights equal an uninterrupted run's bit for bit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as tmp:
        straight, killed = Path(tmp) / "straight", Path(tmp) / "killed"
        for directory in (straight, killed):
            directory.mkdir()
        done = subprocess.run(_train_command(overrides, straight), cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise AssertionError(f"uninterrupted run failed: {done.stderr.strip().splitlines()[-1:]}")
        process = subprocess.Popen(_train_command(overrides, killed), cwd=ROOT, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        checkpoint = killed / "checkpoint.pt"
        deadline = time.monotonic() + 300
        while not checkpoint.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if process.poll() is not None:
            raise AssertionError("the run ended before it could be killed after its first checkpoint")
        process.send_signal(signal.SIGKILL)
        process.wait()
        if (killed / "result.json").exists():
            raise AssertionError("the run finished before the kill")
        again = subprocess.run(_train_command(overrides, killed), cwd=ROOT, env=env, capture_output=True, text=True)
        if again.returncode != 0:
            raise AssertionError(f"rerun failed: {again.stderr.strip().splitlines()[-1:]}")
        a = torch.load(straight / "model.pt", weights_only=True)
        b = torch.load(killed / "model.pt", weights_only=True)
    differing = [key for key in a if not torch.equal(a[key], b[key])]
    if a.keys() != b.keys() or differing:
        raise AssertionError(f"resumed weights differ: {differing[:3]}")
    return f"killed after its first checkpoint, continued: {len(a)} tensors bit-identical on {device}"


def accounting_matches_cpu(overrides: list[str], device: str) -> str:
    """The configuration's accounting on ``device`` equals the CPU's within 1%; its measured peak."""
    from lowmem.profiler import profile_trainer

    cpu = build(overrides + ["trainer.device=cpu"]).account_memory()
    trainer = build(overrides + [f"trainer.device={device}"])
    report = profile_trainer(trainer, measure=device != "cpu")
    here = {"total_bytes": report.total_bytes, "activation_bytes": report.activation_bytes, "flops": report.flops}
    off = {k: here[k] / cpu[k] - 1 for k in here if cpu[k]}
    if any(abs(value) > 0.01 for value in off.values()):
        raise AssertionError(", ".join(f"{k} {here[k]:,} vs cpu {cpu[k]:,}" for k in here))
    peak = "" if report.peak_bytes is None else f", measured peak {report.peak_bytes / 1e6:.1f} MB"
    return f"accounted {report.total_bytes / 1e6:.1f} MB (cpu {cpu['total_bytes'] / 1e6:.1f} MB){peak}"


def quantized_paths_agree(device: str, steps: int = 5) -> str:
    """8- and 4-bit optimizer state: the device's fused kernel (Triton on CUDA, C on the CPU) against
    the torch fallback from the same weights and state, ``steps`` SGD and Adam updates each.
    Bit-identical on the CPU; on CUDA the fallback divides by the loss scale as torch's CUDA kernels
    do, so the weights may differ in the last bit: counted and bounded, not required equal."""
    from lowmem import kernels
    from lowmem.kernels import quantized, reference

    if kernels.backend(torch.device(device)) == "torch":
        raise NotApplicable(f"no fused kernel on {device} here (Triton or a C compiler missing)")
    native = kernels._native(torch.device(device))
    differing = weights_off = 0
    values = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for bits in (8, 4):
            runs = []
            for _ in range(2):
                generator = torch.Generator().manual_seed(1)
                sizes = (70_000, 1025, 77)
                w = [(torch.randn(n, generator=generator) * 0.1).to(dtype).to(device) for n in sizes]
                runs.append((w, [x.clone() for x in w],
                             [quantized.zeros(n, bits, 128, True, torch.device(device)) for n in sizes],
                             [quantized.zeros(n, bits, 128, True, torch.device(device)) for n in sizes],
                             [quantized.zeros(n, bits, 128, False, torch.device(device)) for n in sizes]))
            generator = torch.Generator().manual_seed(2)
            for step in range(1, steps + 1):
                grads = [(torch.randn(n, generator=generator) * 50).to(dtype).to(device) for n in sizes]
                keys = reference.tensor_keys(3, step, len(sizes)) if dtype != torch.float32 else None
                state_keys = reference.tensor_keys(4, step, len(sizes))
                for (sgd, adam), (ws, wa, mom, m, v) in zip(
                    ((quantized.sgd, quantized.adam), (native.sgd_quantized, native.adam_quantized)), runs, strict=True
                ):
                    sgd(ws, grads, mom, keys, state_keys, bits=bits, block_size=128, lr=0.1, momentum=0.9,
                        nesterov=True, weight_decay=5e-4, grad_scale=64.0)
                    adam(wa, grads, m, v, [1e-3] * len(sizes), keys, state_keys, bits=bits, block_size=128, beta1=0.9,
                         beta2=0.999, eps=1e-8, decay=0.9999, grad_scale=64.0)
            (ws0, wa0, mom0, m0, v0), (ws1, wa1, mom1, m1, v1) = runs
            for a, b in zip([*ws0, *wa0], [*ws1, *wa1], strict=True):
                weights_off += int((a != b).sum())
                values += a.numel()
                scale = a.float().abs().max().clamp_min(1e-30)
                if float((a.float() - b.float()).abs().max() / scale) > 1e-2:
                    raise AssertionError(f"{dtype} {bits} bits: weights differ by more than rounding")
            for x, y in zip([*mom0, *m0, *v0], [*mom1, *m1, *v1], strict=True):
                differing += int((x.codes != y.codes).sum())
    if device == "cpu" and (differing or weights_off):
        raise AssertionError(f"C kernel vs fallback: {weights_off} weights, {differing} codes differ")
    if differing > 0.01 * values:
        raise AssertionError(f"{differing} codes of {values} differ between the kernel and the fallback")
    if not (differing or weights_off):
        return "same bits"
    return f"{weights_off} of {values} weights, {differing} codes differ"


# --- the cases ------------------------------------------------------------------------------------

TABLE3 = ("t3_fp32_baseline", "t3_d100_mb100", "t3_d100_mb10", "t3_d30_mb10", "t3_d20_mb10", "t3_d20_mb4", "t3_d10_mb4")
TABLE4 = ("t4_fp32_baseline", "t4_fp32_d100", "t4_fp16_d100", "t4_fp32_d50", "t4_fp16_d50", "t4_fp32_d40",
          "t4_fp16_d40", "t4_fp32_d30", "t4_fp16_d30")


def cases(device: str, tiny: bool) -> list[Case]:
    on = [f"trainer.device={device}"]
    found: list[Case] = []
    for recipe, datasets in DATA.items():
        for data in datasets:
            base = recipe_overrides(recipe, data, tiny) + on
            for precision in PRECISIONS:
                for technique, knobs in techniques(recipe).items():
                    overrides = base + [f"precision={precision}", *knobs]
                    found.append(Case(f"train {recipe}/{data} {precision} {technique}",
                                      lambda o=overrides: train_steps(o)))
            everything = base + ["precision=fp16", *techniques(recipe)["all"]]
            found.append(Case(f"run {recipe}/{data} fp16 all", lambda o=everything: full_run(o)))
    if device.startswith("cuda"):  # graphs are CUDA's: elsewhere every microbatch runs eagerly
        for precision in ("fp32", "fp16"):
            for name, knobs in (("true", []), ("residual_star", ["checkpointing.strategy=residual_star",
                                                                  "checkpointing.every=2"])):
                overrides = recipe_overrides("wrn_cifar", "fake", tiny) + on + [
                    f"precision={precision}", "microbatch.size=10", "microbatch.mode=true", *knobs
                ]
                found.append(Case(f"replay wrn_cifar/fake {precision} microbatch-{name}",
                                  lambda o=overrides: replay_equals_eager(o)))
    found.append(Case(f"kernels: 8- and 4-bit state, fused vs fallback on {device}",
                      lambda: quantized_paths_agree(device)))
    for recipe, data, precision, bits in (("wrn_cifar", "fake", "fp16", 4), ("dc_iwslt", "phrases", "bf16", 8)):
        overrides = recipe_overrides(recipe, data, tiny) + on + [
            f"precision={precision}", *techniques(recipe)["all"], f"optim.state_bits={bits}"]
        found.append(Case(f"train {recipe}/{data} {precision} all optim.state_bits={bits}",
                          lambda o=overrides: train_steps(o)))
    resume = recipe_overrides("dc_iwslt", "fake", True) + on + [
        "data.train_size=200", "data.batch_size=300", "trainer.epochs=3", "precision=fp16",
        "precision.stochastic_rounding=true", "sparsity.density=0.5", "trainer.deterministic=true",
    ]
    found.append(Case("resume dc_iwslt sparse fp16 adam stochastic rounding, killed",
                      lambda: kill_and_resume(resume, device)))
    profile_on = ["data=fake", "profile.measure_peak=true"]
    for setting in TABLE3:
        overrides = ["+recipe=wrn_cifar", f"+setting={setting}", *profile_on, *on]
        found.append(Case(f"profile table 3 {setting}", lambda o=overrides: accounting_matches_cpu(o, device)))
    for setting in TABLE4:
        overrides = ["+recipe=dc_iwslt", f"+setting={setting}", *profile_on, *on]
        found.append(Case(f"profile table 4 {setting}", lambda o=overrides: accounting_matches_cpu(o, device)))
    if tiny:  # the profiles at the report's full shapes are what the GPU check is for
        found = [c for c in found if not c.name.startswith("profile")] + [
            c for c in found if c.name in ("profile table 3 t3_d10_mb4", "profile table 4 t4_fp16_d30")
        ]
    return found


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Keep the runs' own logging and prints out of the PASS/FAIL lines."""
    import logging

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (with --tiny: the tests)")
    parser.add_argument("--tiny", action="store_true", help="toy models: the same cases in seconds on a CPU")
    parser.add_argument("--only", nargs="+", default=[""], metavar="WORD",
                        help="run only the cases whose name contains one of these")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine; nothing to check (run it where a GPU is)")
        return 0
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(f"gpu-check on {where}, torch {torch.__version__}")
    counts = {"PASS": 0, "FAIL": 0, "N/A": 0}
    started = time.perf_counter()
    for case in cases(args.device, args.tiny):
        if not any(word in case.name for word in args.only):
            continue
        began = time.perf_counter()
        try:
            with quiet():
                detail = case.check()
            status = "PASS"
        except NotApplicable as reason:
            status, detail = "N/A", str(reason)
        except Exception as error:  # noqa: BLE001 - every failure is reported, the others still run
            lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
            # A compiler's message starts with where ("at 22:4:") and ends with what: show both.
            message = " ... ".join(dict.fromkeys(lines[:1] + lines[-1:]))
            status, detail = "FAIL", f"{type(error).__name__}: {message}"
        counts[status] += 1
        print(f"{status:<4} {case.name} ({time.perf_counter() - began:.1f} s): {detail}", flush=True)
    print(
        f"gpu-check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['N/A']} not applicable "
        f"in {time.perf_counter() - started:.0f} s on {where}"
    )
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
