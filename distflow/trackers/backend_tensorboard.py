"""TensorBoard backend: event files under ``OUTPUT_DIR/tensorboard`` (``tensorboard --logdir``).

Written with torch's SummaryWriter (torch is there anyway; the ``tensorboard`` package
supplies the event-file protos). A resumed run opens the writer with ``purge_step``, so
TensorBoard hides the earlier attempt's events of the steps trained again, as metrics.jsonl
drops them. Step metrics go by verl's names where verl has the figure (``response_length/mean``:
:mod:`distflow.trackers.names`), the others under ``train/``; evaluation under ``eval/``; each step's
sample table is a markdown text summary ``samples`` at that step (every step kept).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distflow.trackers.base import SAMPLE_COLUMNS, Tracker
from distflow.trackers.names import tracker_name


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, log_dir: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.log_dir = log_dir
        self.writer = SummaryWriter(str(log_dir), purge_step=resume_step or None)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if k != "step":
                self.writer.add_scalar(tracker_name(k), v, step)
        self.writer.flush()

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if k != "step":
                self.writer.add_scalar(f"eval/{k}", v, step)
        self.writer.flush()

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        def cell(v: Any) -> str:
            return str(v).replace("|", "\\|").replace("\n", "<br>")

        lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
        lines += ["| " + " | ".join(cell(r.get(c, "")) for c in SAMPLE_COLUMNS) + " |" for r in rows]
        self.writer.add_text("samples", "\n".join(lines), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
