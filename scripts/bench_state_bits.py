"""8- and 4-bit optimizer state (``optim.state_bits``) against 16-bit state: bytes, plans and accuracy.

Four parts (``--part bytes|blocks|accuracy|all``):

- **bytes**: the accounted optimizer state (``optimizer_state_bytes``: codes + block scales) and the
  bytes of the state tensors the optimizer really holds (what a checkpoint stores), at 16, 8 and 4
  bits, for DynamicConv (IWSLT size, FP16, density 0.5, Adam) and WRN-28-2 (BF16, density 0.3, SGD);
  then the configuration ``lowmem.plan +recipe=dc_iwslt data=fake plan.budget_mb=200`` chooses with
  16-bit state, accounted again with 8- and 4-bit state (same density, precision, microbatch and
  checkpointing) — its total.
- **blocks**: the block size's trade-off (``optim.state_block_size``): bytes per value against the
  error of one Adam step with quantized state, relative to FP32 state's.
- **accuracy**: WRN-28-2 on the embedded digits (SGD; BF16, and the full combination: density 0.3,
  BF16, microbatches of 10, residual_star every 2) and a small DynamicConv on the embedded phrases
  (Adam, BF16, as ``scripts/demo_translation.py``), each at 16, 8 and 4 bits over ``--seeds``, through
  the CLI as a user runs them: the mean (and each seed's) best test accuracy / final BLEU.

Runs are kept under ``--out`` (a finished run is not trained again: rerun to resume an interrupted
sweep). Prints Markdown tables; ``--json`` also writes the figures. CPU: bytes ~2 min, accuracy
~90 min on 2 idle cores with the defaults (27 runs of 2.5-8 min each on one thread).

    .venv/bin/python scripts/bench_state_bits.py [--part all] [--seeds 0 1 2] [--epochs 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lowmem.run.files import measured_on  # noqa: E402

MB = 1e6
BITS = (16, 8, 4)
DC = ["+recipe=dc_iwslt", "data=fake", "precision=fp16", "sparsity.density=0.5"]
WRN = ["+recipe=wrn_cifar", "data=fake", "precision=bf16", "sparsity.density=0.3"]
COMBINATION = ["sparsity.density=0.3", "precision=bf16", "microbatch.size=10",
               "checkpointing.strategy=residual_star", "checkpointing.every=2"]  # fmt: skip
# lr 2e-3: at 1e-3 the 400 updates leave the 16-bit model far from trained (74-78 BLEU against ~97), and
# a comparison there measures which state takes larger steps (README: 8- and 4-bit optimizer state).
SMALL_DC = ["model.encoder_layers=3", "model.decoder_layers=3", "model.embed_dim=128", "model.ffn_dim=256",
            "model.heads=4", "model.dropout=0.1", "data=phrases", "data.batch_size=2000", "optim.warmup_updates=100",
            "optim.lr=2e-3", "microbatch.size=500", "checkpointing.strategy=residual", "precision=bf16"]  # fmt: skip


def state_bytes(overrides: list[str]) -> dict[int, dict[str, float]]:
    """Per state width: accounted optimizer state, the state tensors held, and the accounted total (MB)."""
    import torch

    from lowmem.config import compose
    from lowmem.profiler import profile_trainer
    from lowmem.trainer import build_trainer

    rows = {}
    for bits in BITS:
        trainer = build_trainer(compose(*overrides, "trainer.device=cpu", f"optim.state_bits={bits}"))
        report = profile_trainer(trainer, measure=False)
        held = sum(
            t.numel() * t.element_size()
            for state in trainer.optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim()
        )
        rows[bits] = {"accounted_state_mb": report.optimizer_state_bytes / MB, "held_state_mb": held / MB,
                      "total_mb": report.total_bytes / MB}  # fmt: skip
        del trainer
    return rows


def planned_dc(budget_mb: float = 200.0) -> tuple[list[str], dict[int, dict[str, float]]]:
    """The 16-bit-state plan for DynamicConv within ``budget_mb``, re-accounted with 8- and 4-bit state."""
    from lowmem.planning.budget import plan_search

    started = time.perf_counter()
    found = plan_search(["+recipe=dc_iwslt", "data=fake"], budget_mb, top=1, echo=False)
    print(f"lowmem.plan +recipe=dc_iwslt data=fake plan.budget_mb={budget_mb:g} (top 1): "
          f"{time.perf_counter() - started:.1f} s, {found['search_seconds']:.1f} s searching", flush=True)  # fmt: skip
    chosen = [o for o in found["overrides"] if not o.startswith("optim.state_bits=")]
    return chosen, state_bytes(["+recipe=dc_iwslt", "data=fake", *chosen])


def bytes_part() -> dict:
    figures = {"dc": state_bytes(DC), "wrn": state_bytes(WRN)}
    chosen, plan = planned_dc()
    figures["dc_plan"] = {"overrides": chosen, **plan}
    print("\n| model | state bits | accounted state (MB) | ratio vs 16 | state tensors held (MB) |")
    print("|---|---|---|---|---|")
    for name, label in (("dc", "DynamicConv, FP16, density 0.5, Adam"), ("wrn", "WRN-28-2, BF16, density 0.3, SGD")):
        rows = figures[name]
        for bits in BITS:
            ratio = rows[16]["accounted_state_mb"] / rows[bits]["accounted_state_mb"]
            print(f"| {label} | {bits} | {rows[bits]['accounted_state_mb']:.2f} | {ratio:.2f}x | "
                  f"{rows[bits]['held_state_mb']:.2f} |")  # fmt: skip
    print(f"\nDynamicConv plan within 200 MB with 16-bit state ({' '.join(chosen)}):")
    for bits in BITS:
        print(f"  {bits:2d}-bit state: total {plan[bits]['total_mb']:.1f} MB "
              f"(optimizer state {plan[bits]['accounted_state_mb']:.1f} MB)")  # fmt: skip
    return figures


def block_sizes_part(sizes=(32, 64, 128, 256, 512, 2048)) -> dict:
    """The block size's trade-off: bytes per value (codes + scales) against the error of one Adam step
    from FP32 Adam's state after 10 steps on WRN-28-2's largest convolution weights with real
    gradient-like noise (the error of the weights' update, relative to FP32 state's update)."""
    import torch

    from lowmem.kernels import quantized
    from lowmem.profiler import quantized_state_bytes
    from lowmem.techniques.optimizers import LowPrecisionAdam

    generator = torch.Generator().manual_seed(0)
    n = 128 * 128 * 9
    # Gradients whose scale varies by output channel (rows of 1,152 values), as a conv layer's do.
    rows = torch.logspace(-2, 1, 128)[torch.randperm(128, generator=generator)].repeat_interleave(n // 128)
    exact = torch.nn.Parameter(torch.randn(n, generator=generator) * 0.05)
    adam = LowPrecisionAdam([exact], lr=1e-3)
    for _ in range(10):
        exact.grad = torch.randn(n, generator=generator) * rows
        adam.step()
    exact.grad = torch.randn(n, generator=generator) * rows
    figures = {}
    print("\n| block size | bytes per value, 8 / 4 bits | update error, 8 / 4 bits "
          "| update size vs FP32 state's, 8 / 4 bits |\n|---|---|---|---|")  # fmt: skip
    for block in sizes:
        errors, per_value, sizes_ = [], [], []
        for bits in (8, 4):
            approx = torch.nn.Parameter(exact.detach().clone())
            approx.grad = exact.grad.clone()
            quantized_adam = LowPrecisionAdam([approx], lr=1e-3, state_bits=bits, block_size=block)
            state = quantized_adam.state[approx]
            state["step"] = adam.state[exact]["step"]
            for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                state[f"{name}_codes"], state[f"{name}_scales"] = quantized.quantize(
                    adam.state[exact][name], bits, block, signed)
            copy = LowPrecisionAdam([e := torch.nn.Parameter(exact.detach().clone())], lr=1e-3)
            copy.load_state_dict(adam.state_dict())
            e.grad = exact.grad.clone()
            before = exact.detach().clone()
            copy.step()
            quantized_adam.step()
            reference_update = e.detach() - before
            errors.append(float((approx.detach() - before - reference_update).norm() / reference_update.norm()))
            # Below 1: the second moment read back larger than it is (small values rounded up to the
            # map's smallest positive entry, zero being kept for exact zeros), so the update shrinks.
            sizes_.append(float((approx.detach() - before).norm() / reference_update.norm()))
            per_value.append(quantized_state_bytes(n, bits, block) / n)
        figures[block] = {"bytes_per_value": per_value, "update_error": errors, "update_size": sizes_}
        print(f"| {block} | {per_value[0]:.3f} / {per_value[1]:.3f} | {errors[0]:.2%} / {errors[1]:.2%} | "
              f"{sizes_[0]:.3f} / {sizes_[1]:.3f} |")  # fmt: skip
    return figures


def train(run_dir: Path, overrides: list[str]) -> dict:
    """One CLI run into ``run_dir`` (skipped when it finished before); its result.json."""
    result = run_dir / "result.json"
    if not result.exists():
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "lowmem.train", *overrides, "trainer.progress=none", f"hydra.run.dir={run_dir}"],
            cwd=ROOT, text=True, capture_output=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"{run_dir.name} failed:\n{done.stderr[-3000:]}")
        print(f"  {run_dir.name}: {time.perf_counter() - started:.0f} s", flush=True)
    return json.loads(result.read_text())


def accuracy_part(out: Path, seeds: list[int], epochs: int, dc_steps: int, widths: tuple[int, ...] = BITS) -> dict:
    milestones = f"optim.milestones=[{epochs // 2},{3 * epochs // 4}]"
    experiments = {
        "WRN-28-2 digits, BF16": (["+recipe=wrn_cifar", "data=digits", "precision=bf16"], "best_test_acc"),
        "WRN-28-2 digits, full combination": (["+recipe=wrn_cifar", "data=digits", *COMBINATION], "best_test_acc"),
        "DynamicConv phrases, BF16, Adam": (["+recipe=dc_iwslt", *SMALL_DC], "bleu"),
    }
    figures: dict[str, dict[int, list[float]]] = {name: {bits: [] for bits in widths} for name in experiments}
    # Seed by seed (each seed a complete comparison), so that an interrupted sweep still compares.
    for seed in seeds:
        for name, (overrides, metric) in experiments.items():
            is_wrn = overrides[0] == "+recipe=wrn_cifar"
            length = [f"trainer.epochs={epochs}", milestones] if is_wrn else [f"trainer.max_steps={dc_steps}"]
            slug = f"{name.split(',')[0].split()[0].lower()}-{'combo' if 'combination' in name else 'plain'}"
            for bits in widths:
                run_dir = out / f"{slug}-bits{bits}-seed{seed}"
                result = train(run_dir, [*overrides, *length, f"optim.state_bits={bits}", f"trainer.seed={seed}"])
                figures[name][bits].append(float(result[metric]))
    widths_row = " | ".join(f"{bits}-bit state" for bits in widths)
    print(f"\n| run | metric | {widths_row} | seeds |\n|---|---|{'---|' * len(widths)}---|")
    for name, rows in figures.items():
        metric = "BLEU" if "DynamicConv" in name else "best test acc %"
        cells = []
        for bits in widths:
            mean = statistics.mean(rows[bits])
            delta = "" if bits == 16 or 16 not in rows else f" ({mean - statistics.mean(rows[16]):+.2f})"
            cells.append(f"{mean:.2f}{delta} [{', '.join(f'{v:.1f}' for v in rows[bits])}]")
        print(f"| {name} | {metric} | {' | '.join(cells)} | {', '.join(map(str, seeds))} |")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("bytes", "blocks", "accuracy", "all"), default="all")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=12, help="WRN-28-2 epochs on digits")
    parser.add_argument("--bits", type=int, nargs="+", choices=BITS, default=list(BITS),
                        help="state widths compared (accuracy; runs in parallel processes can split them)")
    parser.add_argument("--dc-steps", type=int, default=400, help="DynamicConv updates on phrases")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_state_bits")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    figures = {}
    if args.part in ("bytes", "all"):
        figures["bytes"] = bytes_part()
    if args.part in ("blocks", "all"):
        figures["blocks"] = block_sizes_part()
    if args.part in ("accuracy", "all"):
        figures["accuracy"] = accuracy_part(args.out, args.seeds, args.epochs, args.dc_steps, tuple(args.bits))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
