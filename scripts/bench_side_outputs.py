"""What finding side outputs costs: a checkpointed step with and without the watch, side by side.

Every checkpointed block's forward runs under ``lowmem.techniques.side_outputs.ForwardWatch`` (a
torch-function mode that numbers the tensors the block makes and follows which need a gradient), so
that a tensor leaving the block other than by its output keeps its gradient. This script measures
what that costs on models with no side output at all, the common case: WRN-28-2 (lowmem's own
residual stacks, CIFAR-10 shapes) and GPT-2 small (transformers, 12 layers of width 768, through
``lowmem.prepare``), each under ``checkpointing.strategy=residual``, FP32, SGD, on the CPU:

- "without": the watch replaced by one that sees nothing (what lowmem did before side outputs);
- "with": as shipped.

Step time: the median of ``--repeats`` rounds, the two rows alternating (``bench_memory``'s
round robin); measured peak: ``run.profile()``'s ``peak_bytes`` after the timed steps. Writes a
Markdown table. Run: ``.venv/bin/python scripts/bench_side_outputs.py`` (~2 min on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lowmem  # noqa: E402
from lowmem.run.files import measured_on  # noqa: E402
from lowmem.techniques import chains, checkpointing  # noqa: E402
from recipes.wrn_cifar.model import WideResNet  # noqa: E402
from scripts.bench_memory import median_seconds_round_robin  # noqa: E402

MB = 1e6
OVERRIDES = ["trainer.device=cpu", "precision=fp32", "optim.name=sgd", "checkpointing.strategy=residual"]


class _NoWatch:
    """A watch that sees nothing: checkpointing as it was before side outputs were kept."""

    def __init__(self, marked: dict | None = None) -> None:
        pass

    def __enter__(self) -> _NoWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def escaped(self, returned, kept=()) -> list:
        return []


@contextlib.contextmanager
def watch_off() -> Iterator[None]:
    saved = chains.ForwardWatch, checkpointing.ForwardWatch
    chains.ForwardWatch = checkpointing.ForwardWatch = _NoWatch
    try:
        yield
    finally:
        chains.ForwardWatch, checkpointing.ForwardWatch = saved


def wrn(batch: int) -> tuple[Callable, tuple, Callable]:
    generator = torch.Generator().manual_seed(0)
    data = (torch.randn(batch, 3, 32, 32, generator=generator), torch.randint(0, 10, (batch,), generator=generator))
    return (lambda: WideResNet(depth=28, width=2)), data, lambda model, b: F.cross_entropy(model(b[0]), b[1])


def gpt2(batch: int) -> tuple[Callable, tuple, Callable]:
    import transformers

    config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=128, vocab_size=50257)
    tokens = torch.randint(0, config.vocab_size, (batch, 128), generator=torch.Generator().manual_seed(0))
    return (lambda: transformers.GPT2LMHeadModel(config)), tokens, lambda model, b: model(input_ids=b, labels=b).loss


def bench(name: str, make: Callable, data, loss: Callable, repeats: int) -> list[str]:
    runs = {}
    for row in ("without", "with"):
        torch.manual_seed(0)
        runs[row] = lowmem.prepare(make(), loss, data, overrides=OVERRIDES)

    def step(row: str) -> Callable[[], object]:
        def run() -> object:
            with watch_off() if row == "without" else contextlib.nullcontext():
                return runs[row].step(data)

        return run

    seconds = median_seconds_round_robin({row: step(row) for row in runs}, repeats, torch.device("cpu"))
    peaks = {}
    for row, run in runs.items():
        with watch_off() if row == "without" else contextlib.nullcontext():
            peaks[row] = run.profile()["peak_bytes"] / MB
    return [
        f"| {name} | {seconds['without']:.3f} s | {seconds['with']:.3f} s | {seconds['with'] / seconds['without']:.3f} "
        f"| {peaks['without']:.1f} MB | {peaks['with']:.1f} MB |"
    ]


def block_forward_overhead(repeats: int) -> str:
    """The watch's own cost, out of the step's noise: one GPT-2 small block's forward without autograd
    (as a checkpointed block's first forward runs), plain and under the watch, median of ``repeats``."""
    import statistics
    import time

    import transformers

    from lowmem.techniques.side_outputs import ForwardWatch

    config = transformers.GPT2Config(n_layer=1, n_embd=768, n_head=12, n_positions=128)
    block = transformers.GPT2LMHeadModel(config).transformer.h[0]
    x = torch.randn(2, 128, 768, requires_grad=True)
    times: dict[str, list[float]] = {"plain": [], "watched": []}
    calls = 0
    with torch.no_grad():
        for _ in range(repeats + 1):
            for row in times:
                watch = ForwardWatch() if row == "watched" else contextlib.nullcontext()
                started = time.perf_counter()
                with watch:
                    block(x)
                times[row].append(time.perf_counter() - started)
                calls = watch.count if row == "watched" else calls
    plain, watched = (statistics.median(times[row][1:]) * 1e3 for row in ("plain", "watched"))
    return (
        f"One GPT-2 small block's forward without autograd (batch 2 x 128): {plain:.2f} ms plain, {watched:.2f} ms "
        f"watched: +{(watched - plain) * 1e3:.0f} us ({watched / plain - 1:+.1%}; {calls} tensors numbered)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--wrn-batch", type=int, default=32)
    parser.add_argument("--gpt2-batch", type=int, default=2)
    args = parser.parse_args(argv)
    lines = [
        measured_on("cpu"),
        "",
        f"checkpointing.strategy=residual, FP32, SGD; WRN-28-2 batch {args.wrn_batch} (32x32), GPT-2 small batch "
        f"{args.gpt2_batch} x 128 tokens; median of {args.repeats} round-robin steps",
        "",
        "| model | step without the watch | with | ratio | measured peak without | with |",
        "|---|---|---|---|---|---|",
    ]
    lines += bench("WRN-28-2", *wrn(args.wrn_batch), args.repeats)
    lines += bench("GPT-2 small", *gpt2(args.gpt2_batch), args.repeats)
    lines += ["", block_forward_overhead(20 * args.repeats)]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
