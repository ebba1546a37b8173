"""The always-on backend: ``samples.jsonl`` beside ``metrics.jsonl`` and ``eval.jsonl``.

The step and evaluation rows are already written by trainer rank 0's MetricsWriter (the
launcher's progress bar tails them), so this backend only adds the sample tables: one JSON
line per sample row, every step's rows kept. A resumed run drops the rows of the steps it
trains again, as metrics.jsonl does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distflow.trackers.base import Tracker
from distflow.trainer.metrics import MetricsWriter


class JsonlTracker(Tracker):
    name = "jsonl"

    def __init__(self, output_dir: Path, resume_step: int | None):
        self.writer = MetricsWriter(output_dir, resume_step=resume_step, name="samples.jsonl")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        pass  # metrics.jsonl: MetricsWriter

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        pass  # eval.jsonl: MetricsWriter

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            self.writer.write(r)

    def close(self) -> None:
        pass
