"""Learning-rate schedules as pure functions of the optimizer step."""

from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["constant", "linear", "cosine"]


def lr_at(
    step: int,
    *,
    base_lr: float,
    schedule: Schedule,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> float:
    """The learning rate of optimizer step ``step`` (0-based).

    Warmup: lr = base * (step + 1) / W for step < W. Then with p = (step - W) / (T - W) clipped
    to [0, 1] and m = min_lr_ratio: constant 1, linear 1 - (1 - m) p, cosine
    m + (1 - m) (1 + cos(pi p)) / 2, times base.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    if schedule not in ("linear", "cosine"):
        raise ValueError(f"lr_scheduler must be constant, linear or cosine, got {schedule!r}")
    if total_steps is None or total_steps <= warmup_steps:
        raise ValueError(
            f"lr_scheduler={schedule!r} needs total_steps > warmup_steps={warmup_steps}, got "
            f"{total_steps}; pass the number of optimizer steps of the run"
        )
    p = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if schedule == "linear":
        factor = 1.0 - (1.0 - min_lr_ratio) * p
    else:
        factor = min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
    return base_lr * factor
