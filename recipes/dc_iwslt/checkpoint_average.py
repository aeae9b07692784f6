"""Average the parameters of the last N saved state dicts (the report evaluates the average of the
last 10 checkpoints, as fairseq's ``scripts/average_checkpoints.py`` does)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from os import PathLike

import torch

StateDict = Mapping[str, torch.Tensor]


def _load(source: str | PathLike | StateDict) -> StateDict:
    if isinstance(source, Mapping):
        state = source
    else:
        state = torch.load(source, map_location="cpu", weights_only=True)
    # Training checkpoints (ours and fairseq's) keep the weights under "model"; model.pt is the plain dict.
    if isinstance(state.get("model"), Mapping):
        state = state["model"]
    return state


def average_state_dicts(sources: Sequence[str | PathLike | StateDict]) -> dict[str, torch.Tensor]:
    """Element-wise mean of state dicts (given as dicts or as ``torch.save`` files).

    Floating-point tensors are summed in FP64 and the mean cast back to each tensor's own dtype, so
    FP16 weights neither overflow nor lose the small differences between checkpoints. Other tensors
    (integer or bool buffers: step counters, masks) are taken from the last state dict. Files are
    loaded one at a time: memory holds the FP64 sums and one state dict, not N state dicts.
    """
    if not sources:
        raise ValueError("average_state_dicts: got no state dicts to average")
    sums: dict[str, torch.Tensor] = {}
    last: StateDict = {}
    for index, source in enumerate(sources):
        state = _load(source)
        if index > 0 and state.keys() != last.keys():
            differing = sorted(set(state.keys()) ^ set(last.keys()))
            raise ValueError(f"average_state_dicts: state dict {index} has different keys: {differing[:5]}")
        for name, tensor in state.items():
            if not tensor.is_floating_point():
                continue
            if name not in sums:
                sums[name] = tensor.to(torch.float64, copy=True)
            elif sums[name].shape == tensor.shape:
                sums[name] += tensor.to(torch.float64)
            else:  # checked, because += would broadcast a smaller tensor silently
                raise ValueError(
                    f"average_state_dicts: {name} has shape {tuple(tensor.shape)} in state dict "
                    f"{index}, {tuple(sums[name].shape)} before"
                )
        last = state
    return {
        name: (sums[name] / len(sources)).to(tensor.dtype) if name in sums else tensor.clone()
        for name, tensor in last.items()
    }
