"""scripts/bench_head_loss.py's own measuring pieces, on a small linear model: an optimizer update
measured outside the tracker (through torch.profiler's allocations, as torchao's compiled update is)
gives the tracker's figure, and no correction is made for state held in plain tensors."""

from __future__ import annotations

import torch
from torch import nn

from lowmem.profiler import measure_peak
from scripts.bench_head_loss import profiled_update, wrapped_state_excess


def test_an_update_measured_through_the_profiler_matches_the_tracker() -> None:
    torch.manual_seed(0)
    model = nn.Linear(512, 512)
    batch = torch.randn(64, 512)
    peaks = []
    for through_profiler in (False, True):
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)

        def step(optimizer: torch.optim.Optimizer = optimizer, through_profiler: bool = through_profiler) -> None:
            optimizer.zero_grad(set_to_none=True)
            model(batch).square().mean().backward()
            # a peak inside the update: its temporaries on top of the gradients, parameters and state
            profiled_update(optimizer) if through_profiler else optimizer.step()

        step()  # the state exists before the measured step
        measured = measure_peak(step, model, optimizer, data=[batch], owners=(model, optimizer, batch))
        peaks.append(measured.peak_bytes)
        assert wrapped_state_excess(optimizer) == 0
    assert abs(peaks[1] - peaks[0]) <= 0.02 * peaks[0], peaks
