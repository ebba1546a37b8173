"""The learning-rate schedule: a pure function of the optimizer step.

Why it exists: the actor sets each step's learning rate from the step number alone, so a
resumed run (which restarts at its checkpoint's policy version) continues the same curve
with no scheduler state to save. ``constant``, ``linear`` (decay to 0 at ``total_steps``)
and ``cosine`` (to 0 at ``total_steps``), each after ``warmup_steps`` of linear warm-up
from ``base_lr / warmup_steps`` (step 0) to ``base_lr``.
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "lr_at"]

SCHEDULES = ("constant", "linear", "cosine")


def lr_at(step: int, base_lr: float, kind: str = "constant", warmup_steps: int = 0,
          total_steps: int | None = None) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    Warm-up: ``base_lr * (step + 1) / warmup_steps`` for ``step < warmup_steps``. Then
    ``constant``: ``base_lr``; ``linear``: ``base_lr * (1 - p)``; ``cosine``:
    ``base_lr * 0.5 * (1 + cos(pi * p))`` with ``p = (step - warmup) / (total - warmup)``
    clamped to [0, 1]. ``linear``/``cosine`` without ``total_steps`` stay at ``base_lr``.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {SCHEDULES}, got {kind!r}")
    if step < 0 or warmup_steps < 0:
        raise ValueError(f"lr_at: step ({step}) and warmup_steps ({warmup_steps}) must be >= 0")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if kind == "constant" or not total_steps or total_steps <= warmup_steps:
        return base_lr
    p = min(1.0, max(0.0, (step - warmup_steps) / (total_steps - warmup_steps)))
    if kind == "linear":
        return base_lr * (1.0 - p)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * p))
