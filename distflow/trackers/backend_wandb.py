"""Weights & Biases backend, offline by default: ``OUTPUT_DIR/wandb/offline-run-*/run-ID.wandb``.

Why offline by default: a training cluster often has no route to api.wandb.ai, and an
offline run needs no API key and no process besides wandb's own local service; upload it
later with ``wandb sync OUTPUT_DIR/wandb/offline-run-*``. ``wandb_mode: online`` streams to
the server; ``shared`` is W&B's multi-writer mode (several processes write one run, each
labelled by its node id, with no collector process of ours): every node of a cluster
derives the same run id from the output directory and run name, so a requeued or resumed
attempt continues the same run too.

Names: a step's metrics go by verl's names where verl has the figure
(:mod:`distflow.trackers.names`), the others as ``train/KEY``. Steps: training rows use
``train/step`` and evaluation rows ``eval/step`` as their x axes (``define_metric``), because
evaluation rows arrive after later training steps and W&B drops rows logged at a step below
its current one. Each step's sample table is a
``wandb.Table`` logged under ``samples``: every logged table is kept, not overwritten.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from distflow.trackers.base import SAMPLE_COLUMNS, Tracker
from distflow.trackers.names import tracker_name, verl_groups


def run_id(output_dir: Path, run_name: str) -> str:
    """The same id on every node and every attempt of one run (W&B ids: up to 64 of [a-z0-9])."""
    return hashlib.sha256(f"{Path(output_dir).resolve()}\0{run_name}".encode()).hexdigest()[:16]


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, output_dir: Path, project: str, run_name: str, mode: str, node_id: str,
                 primary: bool, config: dict[str, Any]):
        import wandb

        self.wandb = wandb
        kwargs: dict[str, Any] = {}
        if mode == "shared":
            kwargs["settings"] = wandb.Settings(mode="shared", x_label=node_id, x_primary=primary,
                                                silent=True)
        else:
            kwargs["mode"] = mode
            kwargs["settings"] = wandb.Settings(silent=True)
        self.run = wandb.init(project=project, name=run_name, id=run_id(output_dir, run_name), resume="allow",
                              dir=str(output_dir), config=config, reinit="create_new", **kwargs)
        self.run.define_metric("train/step")
        for group in ("train", *verl_groups()):  # verl's names (actor/..., perf/...) too
            self.run.define_metric(f"{group}/*", step_metric="train/step")
        self.run.define_metric("eval/step")
        self.run.define_metric("eval/*", step_metric="eval/step")
        self.run.define_metric("samples", step_metric="train/step")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({"train/step": step, **{tracker_name(k): v for k, v in metrics.items() if k != "step"}})

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({"eval/step": step, **{f"eval/{k}": v for k, v in metrics.items() if k != "step"}})

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[r.get(c) for c in SAMPLE_COLUMNS] for r in rows])
        self.run.log({"train/step": step, "samples": table})

    def close(self) -> None:
        self.run.finish()
