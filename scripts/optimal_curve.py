"""FLOPs against activation budget: ``checkpointing.strategy=optimal`` next to the fixed strategies.

WRN-28-2, batch 100, FP32 (``data=fake``): the report's accounting of every fixed strategy, and
optimal checkpointing at each fixed strategy's own accounted activations and on a grid of budgets
from the smallest any schedule reaches to what ``none`` needs. Accounting only, on fake tensors (no
training step); every figure is what ``lowmem.profile`` prints for that configuration. Prints a
markdown table and writes the plot to ``docs/optimal_checkpointing.png``; ~10 s on 2 cores.

    python scripts/optimal_curve.py [--out docs/optimal_checkpointing.png] [--points 24]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from lowmem.config import compose  # noqa: E402
from lowmem.planning.optimal import CheckpointPlacement  # noqa: E402
from lowmem.planning.schedule import describe  # noqa: E402
from lowmem.profiler import MB, profile_trainer  # noqa: E402
from lowmem.run.files import measured_on  # noqa: E402
from lowmem.techniques.checkpointing import apply_checkpointing  # noqa: E402
from lowmem.trainer import build_trainer  # noqa: E402

FIXED = [("none", 1), ("no_bn", 1), ("residual", 1), ("residual", 2), ("residual", 3),
         ("residual_star", 1), ("residual_star", 2), ("residual_star", 3), ("residual_star", 4)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "optimal_checkpointing.png")
    parser.add_argument("--points", type=int, default=24, help="budgets on the grid")
    args = parser.parse_args()
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU

    trainer = build_trainer(compose("+recipe=wrn_cifar", "data=fake", "data.batch_size=100", "precision=fp32"))
    fixed = {}
    for strategy, every in FIXED:
        apply_checkpointing(trainer.unwrapped_model, strategy, every)
        report = profile_trainer(trainer, measure=False)
        fixed[(strategy, every)] = (report.activation_bytes, report.flops)
    placement = CheckpointPlacement(trainer)
    none_bytes, none_flops = fixed[("none", 1)]
    smallest = placement.smallest().activation_bytes
    step = (none_bytes - smallest) / (args.points - 1)
    grid = sorted({smallest + round(i * step) for i in range(args.points)} | {b for b, _ in fixed.values()})
    curve = [(budget, placement.cheapest(budget)) for budget in grid]

    print("WRN-28-2, batch 100, FP32; accounted activations (report's definition) and GFLOPs of one minibatch")
    print("(forward + backward + recomputation); optimal at each fixed strategy's own activations:\n")
    print("| fixed strategy | accounted activations MB | GFLOPs (x none) | optimal: activations MB | GFLOPs (x none) "
          "| FLOPs saved | optimal schedule |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for (strategy, every), (activation, flops) in fixed.items():
        label = strategy if strategy in ("none", "no_bn") else f"{strategy} every {every}"
        if activation < smallest:
            print(f"| {label} | {activation / MB:.1f} | {flops / 1e9:.1f} | below what optimal reaches | | | |")
            continue
        chosen = placement.cheapest(activation)
        saved = 1 - chosen.flops / flops
        print(
            f"| {label} | {activation / MB:.1f} | {flops / 1e9:.1f} ({flops / none_flops:.2f}) "
            f"| {chosen.activation_bytes / MB:.1f} | {chosen.flops / 1e9:.1f} ({chosen.flops / none_flops:.2f}) "
            f"| {saved:.1%} | `{describe(chosen.plan.schedules)}` |"
        )
    print(f"\nsmallest accounted activations any schedule reaches: {smallest / MB:.1f} MB "
          f"({describe(placement.smallest().plan.schedules)})")  # fmt: skip

    figure = Figure(figsize=(8, 5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    # FLOPs as a function of the budget: each schedule found holds from its own accounted
    # activations until a larger budget buys a cheaper one.
    reached = sorted({(a.activation_bytes, a.flops) for _, a in curve})
    xs, ys = [b / MB for b, _ in reached] + [none_bytes / MB], [f / 1e9 for _, f in reached] + [reached[-1][1] / 1e9]
    axes.step(xs, ys, where="post", color="tab:blue", label="optimal: fewest FLOPs within the budget")
    axes.plot(xs[:-1], ys[:-1], ".", color="tab:blue")
    for (strategy, every), (activation, flops) in fixed.items():
        short = {"residual": f"res/{every}", "residual_star": f"res*/{every}"}
        label = short.get(strategy, strategy)
        axes.plot(activation / MB, flops / 1e9, "o", color="tab:red")
        axes.annotate(label, (activation / MB, flops / 1e9), textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes.plot([], [], "o", color="tab:red", label="fixed strategies")
    axes.set_xscale("log")
    axes.set_xlabel("accounted activations / budget (MB, log scale)")
    axes.set_ylabel("GFLOPs per minibatch (forward + backward + recomputation)")
    axes.set_title("WRN-28-2, batch 100, FP32: recomputation FLOPs against the activation budget")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=150)
    print(f"\nplot: {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
