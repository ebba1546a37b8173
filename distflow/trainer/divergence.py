"""Naming a diverging run at the step it diverges, and stopping it after a bounded number of
such steps.

Why it exists: a non-finite loss or gradient skips its optimizer step (``model.clip_and_step``:
the weights stay as they were), which saves a run from one bad batch. A run whose every step is
non-finite (``lr: 1e9``) would otherwise skip step after step in silence, or crash somewhere far
away (the engine sampling from exploded weights). :class:`DivergenceWatch` warns at each such
step, naming it, and after ``max_nonfinite_steps`` in a row raises :class:`DivergedError`: the
trainer exits 2 (a deterministic failure, never restarted) with one line that says what to change.
Every trainer rank sees the same reduced loss and norm, so all stop at the same step. Torch-free.
"""

from __future__ import annotations

import logging
import math
from typing import Mapping

log = logging.getLogger(__name__)

__all__ = ["DivergedError", "DivergenceWatch"]


class DivergedError(RuntimeError):
    """Training diverged: ``max_nonfinite_steps`` steps in a row had a non-finite loss or gradient."""


class DivergenceWatch:
    """Counts steps in a row whose optimizer steps were all skipped or whose loss is not finite."""

    def __init__(self, limit: int, lr: float):
        self.limit, self.lr = limit, lr
        self.bad: list[int] = []  # the current run of non-finite steps

    def after_step(self, step: int, stats: Mapping[str, float]) -> None:
        """Look at one step's metrics (``loss``, ``grad_norm``, ``skipped_steps``, ``optimizer_steps``)."""
        loss, norm = stats.get("loss", 0.0), stats.get("grad_norm", 0.0)
        skipped = stats.get("skipped_steps", 0.0) >= stats.get("optimizer_steps", 1.0) > 0
        if not (skipped or not math.isfinite(loss) or not math.isfinite(norm)):
            self.bad.clear()
            return
        self.bad.append(step)
        log.warning("step %d: the loss (%s) or the gradient norm (%s) is not finite: the optimizer step was skipped "
                    "(%d such step(s) in a row; the run stops at max_nonfinite_steps: %d)", step + 1, loss, norm,
                    len(self.bad), self.limit)
        if len(self.bad) >= self.limit:
            steps = ", ".join(str(s + 1) for s in self.bad)
            raise DivergedError(f"training diverged: the loss or gradient was not finite at steps {steps} in a row "
                                f"(max_nonfinite_steps: {self.limit}); lower lr (now {self.lr:g}) or grad_clip")
