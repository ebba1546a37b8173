"""Runs that cannot learn, named at the step they show it: a diverging run, and a run whose
every step trains on nothing.

Why it exists: a non-finite loss or gradient skips its optimizer step (``model.clip_and_step``:
the weights stay as they were), which saves a run from one bad batch. A run whose every step is
non-finite (``lr: 1e9``) would otherwise skip step after step in silence, or crash somewhere far
away (the engine sampling from exploded weights). :class:`DivergenceWatch` warns at each such
step, naming it, and after ``max_nonfinite_steps`` in a row raises :class:`DivergedError`: the
trainer exits 2 (a deterministic failure, never restarted) with one line that says what to change.
Every trainer rank sees the same reduced loss and norm, so all stop at the same step.

:class:`EmptyRunWatch`: a run whose first steps all train on 0 samples (every prompt skipped:
``max_new_tokens`` leaves no room for the prompts, every row bad) would run to its end and say
"done", exit 0. It stops after ``EMPTY_STEPS`` such steps with :class:`NothingTrainedError`
(exit 2) naming the rollout counters that say why. Torch-free.
"""

from __future__ import annotations

import logging
import math
from typing import Mapping

log = logging.getLogger(__name__)

__all__ = ["DivergedError", "DivergenceWatch", "NothingTrainedError", "EmptyRunWatch", "EMPTY_STEPS"]

EMPTY_STEPS = 3  # steps in a row with no sample, before any sample was trained, that stop a run


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


class NothingTrainedError(RuntimeError):
    """The run's first steps all trained on no sample at all: it can train nothing."""


class EmptyRunWatch:
    """Stops a run whose first :data:`EMPTY_STEPS` steps brought no sample (a run that trained
    once and later meets an empty step, e.g. every group dropped by a filter, goes on)."""

    def __init__(self, limit: int = EMPTY_STEPS):
        self.limit, self.empty, self.trained = limit, 0, False

    def after_step(self, step: int, samples: int, rollout_stats: Mapping[str, float] | None = None) -> None:
        if samples > 0 or self.trained:
            self.trained = True
            return
        self.empty += 1
        if self.empty >= self.limit:
            why = ", ".join(f"{k} {int(v)}" for k, v in sorted((rollout_stats or {}).items())
                            if k in ("skipped_prompts", "bad_prompts", "bad_rows", "dropped_prompts") and v)
            raise NothingTrainedError(
                f"the first {self.empty} steps trained on 0 samples" + (f" (last step: {why})" if why else "")
                + ": the run would train nothing. skipped_prompts counts prompts with no room left for "
                  "max_new_tokens (or longer than max_prompt_length); bad_rows rows the dataset could not give")
