"""Learning-rate schedules as pure functions of the update count: nothing to save or restore."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence


def multistep_lr(base_lr: float, epoch: int, milestones: Sequence[int], gamma: float) -> float:
    """``base_lr`` times ``gamma`` for every milestone (in epochs) reached: 0.1, 0.02, 0.004, 0.0008."""
    return base_lr * gamma ** bisect.bisect_right(sorted(milestones), epoch)


def inverse_sqrt_lr(base_lr: float, update: int, warmup_updates: int, warmup_init_lr: float) -> float:
    """fairseq's inverse_sqrt: linear warm-up from ``warmup_init_lr`` to ``base_lr`` over
    ``warmup_updates`` updates, then ``base_lr * sqrt(warmup_updates / update)``.

    ``update`` counts from 0 (the first update uses ``warmup_init_lr``).
    """
    if warmup_updates > 0 and update < warmup_updates:
        return warmup_init_lr + (base_lr - warmup_init_lr) * update / warmup_updates
    return base_lr * math.sqrt(max(warmup_updates, 1) / max(update, 1))


def learning_rate(optim_cfg, base_lr: float, update: int, epoch: int) -> float:
    """The LR of update number ``update`` (0-based) in integer ``epoch`` under ``optim.schedule``."""
    if optim_cfg.schedule == "multistep":
        return multistep_lr(base_lr, epoch, optim_cfg.milestones, optim_cfg.gamma)
    if optim_cfg.schedule == "inverse_sqrt":
        return inverse_sqrt_lr(base_lr, update, optim_cfg.warmup_updates, optim_cfg.warmup_init_lr)
    return base_lr
