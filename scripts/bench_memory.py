"""Memory and speed of every lowmem technique and of the conventional peer stack, side by side.

WRN-28-2, batch 100, on this device, in one run (machines are noisy: compare the ratios). For
each configuration: the stored activations (the most saved-for-backward bytes alive at once, no
gradients), the report's accounting (activations with the backward gradients at their peak, and
the total with model and optimizer), the measured allocator peak of one real training step, the
FLOPs (forward + backward + recomputation) and the median step time, each also as a ratio to plain
FP32 PyTorch. Step times are taken round-robin: every row's trainer is built, then each repeat
times one step of every row in turn, so a machine that slows down or speeds up during the run
(other work, frequency) moves every row alike and the ratios hold; memory is measured first, row by
row, with only that row's configuration alive.

Rows:
- plain PyTorch FP32 (no lowmem code: torch.optim.SGD, the same WRN);
- the conventional peer stack: torch.autocast + torch's GradScaler + torch.utils.checkpoint
  (non-reentrant) over the same residual blocks, every 2;
- each lowmem technique alone; the report's Table 3 combinations (rows 2-7, true microbatching).

On a CPU, 16-bit rows use BF16 (no loss scaling; BF16 and FP16 take the same bytes), computed as
``precision.cpu_compute=auto`` chooses (the peer's too); on CUDA they use FP16 as in the report.
``--workspaces capped`` runs every row with the
capped library workspaces (``trainer.workspaces=capped``; the libraries read them once per process,
so capped and default rows are separate runs); ``--tiny`` the same rows on WRN-10-1 (seconds on a
CPU: what ``make gpu-report TINY=1`` runs); ``--json`` also writes the rows as JSON.

    .venv/bin/python scripts/bench_memory.py [--repeats 5] [--out bench_memory.md] [--tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lowmem.config import compose
from lowmem.libraries import configure_libraries
from lowmem.profiler import account_activations, count_flops, measure_peak, profile_trainer
from lowmem.run.files import measured_on, save_bytes
from lowmem.techniques.cpu_compute import compute_context, summary
from lowmem.trainer import build_trainer
from recipes.wrn_cifar.model import WideResNet

BATCH = 100  # images a step
BASE = ["+recipe=wrn_cifar", "data=fake", "trainer.progress=none"]
WRN = (28, 2)  # depth, width
WORKSPACES = "default"  # trainer.workspaces of every lowmem row
TINY = ["model.depth=10", "model.width=1", "data.train_size=40", "data.test_size=20"]  # batches of 20


def lowmem_rows(sixteen: str) -> dict[str, list[str]]:
    star = [
        f"precision={sixteen}",
        "checkpointing.strategy=residual_star",
        "checkpointing.every=2",
        "microbatch.mode=true",
    ]
    return {
        "lowmem FP32 (no technique)": [],
        "checkpointing no_bn": ["checkpointing.strategy=no_bn"],
        "checkpointing residual/1": ["checkpointing.strategy=residual", "checkpointing.every=1"],
        "checkpointing residual/2": ["checkpointing.strategy=residual", "checkpointing.every=2"],
        "checkpointing residual_star/1": ["checkpointing.strategy=residual_star", "checkpointing.every=1"],
        "checkpointing residual_star/2": ["checkpointing.strategy=residual_star", "checkpointing.every=2"],
        "true microbatches of 10": ["microbatch.size=10", "microbatch.mode=true"],
        f"pure {sixteen.upper()}": [f"precision={sixteen}"],
        "sparsity 0.3": ["sparsity.density=0.3"],
        # Compact storage against the report's dense weight + mask, same density, same 16-bit step.
        f"sparsity 0.3 {sixteen.upper()}, compact storage": ["sparsity.density=0.3", f"precision={sixteen}"],
        f"sparsity 0.3 {sixteen.upper()}, masked storage": [
            "sparsity.density=0.3", f"precision={sixteen}", "sparsity.storage=masked"
        ],
        f"T3 row 2: d1.0 mb{BATCH}": [*star, f"microbatch.size={BATCH}"],
        "T3 row 3: d1.0 mb10": [*star, "microbatch.size=10"],
        "T3 row 4: d0.3 mb10": [*star, "sparsity.density=0.3", "microbatch.size=10"],
        "T3 row 5: d0.2 mb10": [*star, "sparsity.density=0.2", "microbatch.size=10"],
        "T3 row 6: d0.2 mb4": [*star, "sparsity.density=0.2", "microbatch.size=4"],
        "T3 row 7: d0.1 mb4": [*star, "sparsity.density=0.1", "microbatch.size=4"],
        "T3 row 7, masked storage": [*star, "sparsity.density=0.1", "microbatch.size=4", "sparsity.storage=masked"],
    }


def median_seconds_round_robin(
    steps: dict[str, Callable[[], object]], repeats: int, device: torch.device
) -> dict[str, float]:
    """Per name, the median wall time (seconds) of its step over ``repeats`` rounds, each round two
    steps of every name in turn of which the second is timed, after warm-up; on CUDA each step is
    waited for. (The untimed step gives the row its memory back: the first step after another
    row's reuses little of the allocator's cache and faults in fresh pages, which a run of one
    configuration never does; measured, batch-100 rows ran 8-12% slower timed that way.)"""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in steps.values():
        for _ in range(3 if device.type == "cuda" else 1):  # warm-up (CUDA: cuDNN's choices, graph capture)
            step()
    synchronize()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            step()
            synchronize()
            started = time.perf_counter()
            step()
            synchronize()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def plain_pytorch(batch, device, peer: bool, sixteen: torch.dtype, measure: bool = True) -> tuple[dict, Callable]:
    """Plain PyTorch (peer=False) or autocast + GradScaler + torch.utils.checkpoint (peer=True): its
    memory and FLOPs (``measure``), and its training step."""
    torch.manual_seed(0)
    model = WideResNet(*WRN).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scaler = torch.amp.GradScaler(device.type, enabled=peer and device.type == "cuda")
    images, labels = batch

    def forward(x):
        x = model.conv1(x)
        blocks = list(model.residual_blocks)
        for i in range(0, len(blocks), 2):
            segment = blocks[i : i + 2]

            def run(h, segment=segment):
                for block in segment:
                    h = block(h)
                return h

            x = checkpoint(run, x, use_reentrant=False) if peer else run(x)
        x = F.relu(model.bn(x))
        return model.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))

    # The peer's 16-bit operands computed as lowmem's runs compute them (precision.cpu_compute=auto):
    # on a CPU without fast 16-bit kernels, natively they would take 20-60x longer.
    arithmetic = (lambda: compute_context("auto", sixteen, device)) if peer else contextlib.nullcontext

    def forward_backward():
        with arithmetic():
            with torch.autocast(device.type, dtype=sixteen, enabled=peer):
                loss = F.cross_entropy(forward(images).float(), labels)
            scaler.scale(loss).backward()

    def step():
        optimizer.zero_grad(set_to_none=True)
        forward_backward()
        scaler.step(optimizer)
        scaler.update()

    if not measure:
        return {}, step
    trace = account_activations(forward_backward, model, fake=False)
    peak = measure_peak(step, model, optimizer, arithmetic=arithmetic())
    row = {
        "stored": trace.max_saved_bytes,
        "accounted": trace.activation_bytes,
        "total": None,
        "peak": peak.peak_bytes,
        "flops": count_flops(forward_backward),
    }
    return row, step


def lowmem_row(overrides: list[str], measure: bool = True) -> tuple[dict, Callable]:
    """A lowmem configuration's memory and FLOPs (``measure``: the profiler's real step), and its
    training step."""
    trainer = build_trainer(compose(*BASE, *overrides, f"trainer.workspaces={WORKSPACES}"))
    batch = trainer.example_batch()
    step = lambda: trainer.train_step(batch)  # noqa: E731
    if not measure:
        return {}, step
    report = profile_trainer(trainer, measure=True)
    row = {
        "stored": report.activation_saved_bytes,
        "accounted": report.activation_bytes,
        "total": report.total_bytes,
        "peak": report.peak_bytes,
        "flops": report.flops,
        "precision": trainer.policy.name,
        "cpu_compute": trainer.cpu_compute_record(),
    }
    return row, step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_memory.md")
    parser.add_argument("--only", nargs="*", help="substrings of row names to run")
    parser.add_argument("--workspaces", choices=("default", "capped"), default="default",
                        help="the CUDA libraries' workspaces for every row (trainer.workspaces)")
    parser.add_argument("--tiny", action="store_true", help="WRN-10-1 on 200 fake images: the rows in seconds")
    parser.add_argument("--json", help="also write the rows here (bytes, seconds, FLOPs)")
    args = parser.parse_args(argv)
    print(measured_on(), flush=True)  # when, with which torch, on which CPU / GPU
    global WRN, WORKSPACES, BATCH
    WORKSPACES = args.workspaces
    if args.tiny:
        BASE.extend(TINY)
        WRN, BATCH = (10, 1), 20
    BASE.append(f"data.batch_size={BATCH}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    configure_libraries(device, args.workspaces)  # before anything runs: the plain rows too
    sixteen = "fp16" if device.type == "cuda" else "bf16"
    plain = {"plain PyTorch FP32": False, f"peer: autocast {sixteen.upper()} + GradScaler + torch checkpoint/2": True}
    dtype = torch.float16 if sixteen == "fp16" else torch.bfloat16
    makers: dict[str, Callable[[bool], tuple[dict, Callable]]] = {}
    for name, peer in plain.items():
        makers[name] = lambda measure, peer=peer: plain_pytorch(plain_batch(), device, peer, dtype, measure)
    for name, overrides in lowmem_rows(sixteen).items():
        makers[name] = lambda measure, overrides=overrides: lowmem_row(overrides, measure)
    makers = {name: make for name, make in makers.items() if not args.only or any(s in name for s in args.only)}
    rows: dict[str, dict] = {}
    for name, make in makers.items():  # memory, one configuration alive at a time
        gc.collect()  # the previous rows' trainers must not count in this row's measured peak
        rows[name] = make(True)[0]
        print(name, rows[name], flush=True)
    gc.collect()
    steps = {name: make(False)[1] for name, make in makers.items()}  # then time, every row alive
    for name, seconds in median_seconds_round_robin(steps, args.repeats, device).items():
        rows[name]["seconds"] = seconds
        print(f"{name}: {seconds:.3f} s a step", flush=True)
    del steps
    table = render(rows, device, args.workspaces)
    print(table)
    save_bytes(table.encode(), args.out)
    if args.json:
        save_bytes(json.dumps(rows, indent=1).encode(), args.json)


def plain_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The minibatch the plain PyTorch rows train on: the lowmem rows' own, in FP32."""
    images, labels = build_trainer(compose(*BASE)).example_batch()
    return images.float(), labels


def render(rows: dict[str, dict], device: torch.device, workspaces: str = "default") -> str:
    base = rows.get("plain PyTorch FP32") or next(iter(rows.values()))
    # Each lowmem row against lowmem's own run without techniques in the same precision.
    nones = {
        r["precision"]: r
        for name, r in rows.items()
        if name == "lowmem FP32 (no technique)" or name.startswith("pure ")
    }
    mb = lambda b: "—" if b is None else f"{b / 1e6:.1f}"  # noqa: E731
    lines = [
        f"WRN-{WRN[0]}-{WRN[1]}, batch {BATCH}, {device} ({torch.get_num_threads()} threads), torch "
        f"{torch.__version__}, {workspaces} library workspaces; "
        "ratios to plain PyTorch FP32; last column: lowmem's step-time ratio to its own run without "
        "techniques in the same precision (FP32, or pure 16-bit), over the FLOPs ratio (1.00 = time grows "
        "exactly as FLOPs); 16-bit convolutions and matrix products: "
        + next((summary(r["cpu_compute"]) for r in rows.values() if r.get("cpu_compute", {}).get("convolution")),
               "native (CUDA)"),
        "",
        "| configuration | stored activations MB (x fewer) | accounted activations MB (x fewer) "
        "| accounted total MB | measured peak MB (x lower) | GFLOPs (ratio) | step s (ratio) | time/FLOPs vs none |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        versus_none = "—"
        none = nones.get(r.get("precision"))
        if none is not None and r["total"] is not None:  # a lowmem row (plain PyTorch has no accounting)
            versus_none = f"{(r['seconds'] / none['seconds']) / (r['flops'] / none['flops']):.2f}"
        lines.append(
            f"| {name} | {mb(r['stored'])} ({base['stored'] / r['stored']:.2f}x) | "
            f"{mb(r['accounted'])} ({base['accounted'] / r['accounted']:.2f}x) | {mb(r['total'])} | "
            f"{mb(r['peak'])} ({base['peak'] / r['peak']:.2f}x) | {r['flops'] / 1e9:.1f} "
            f"({r['flops'] / base['flops']:.2f}) | {r['seconds']:.2f} ({r['seconds'] / base['seconds']:.2f}) | "
            f"{versus_none} |"
        )
    for compact, masked in (("compact storage", "masked storage"), ("T3 row 7: d0.1 mb4", "T3 row 7, masked storage")):
        a = next((r for name, r in rows.items() if name.endswith(compact) or name == compact), None)
        b = next((r for name, r in rows.items() if name.endswith(masked)), None)
        if a is not None and b is not None:
            lines.append(
                f"\n{compact} against {masked}: step time x{a['seconds'] / b['seconds']:.2f}, "
                f"measured peak x{a['peak'] / b['peak']:.2f}"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
