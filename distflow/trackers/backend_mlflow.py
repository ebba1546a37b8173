"""MLflow backend: metrics, evaluation and sample tables of one MLflow run.

The tracking URI is ``tracker_uri``, else ``$MLFLOW_TRACKING_URI``, else a local SQLite
store ``OUTPUT_DIR/mlflow.db`` with artifacts in ``OUTPUT_DIR/mlartifacts`` (``mlflow ui
--backend-store-uri sqlite:///OUTPUT_DIR/mlflow.db``): MLflow 3 refuses its old ``mlruns``
file store by default (maintenance mode), and SQLite is its own recommendation for one
machine. Only the tracking client is needed (``mlflow-skinny`` with SQLAlchemy and alembic:
no server, UI or pandas). The run's id is kept in ``OUTPUT_DIR/trackers.json``, so a
resumed run continues the same MLflow run.

Step metrics go by verl's names where verl has the figure (:mod:`distflow.trackers.names`), the
others keep their flat keys; evaluation metrics are ``eval/NAME``. A step's sample table
is the artifact ``samples/step_NNNNNN.json`` in the split layout MLflow's ``log_table``
writes (``{"columns": [...], "data": [[...], ...]}``), so ``mlflow.load_table`` reads it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from distflow.trackers.base import SAMPLE_COLUMNS, Tracker
from distflow.trackers.names import tracker_name


def tracking_uri(explicit: str | None, output_dir: Path) -> str:
    import os

    return explicit or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, output_dir: Path, uri: str | None, experiment: str, run_name: str,
                 config: dict[str, Any], resume: bool):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri(uri, output_dir))
        state_file = Path(output_dir) / "trackers.json"
        state = json.loads(state_file.read_text()) if state_file.is_file() else {}
        run_id = state.get("mlflow_run_id") if resume else None
        if run_id is None:
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
                experiment, artifact_location=(Path(output_dir).resolve() / "mlartifacts").as_uri())
            run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            self.client.log_dict(run_id, config, "config.json")
            state_file.write_text(json.dumps({**state, "mlflow_run_id": run_id}))
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def _log(self, step: int, metrics: dict[str, float], prefix: str | None) -> None:
        """``prefix`` None: a step's metrics, by their tracker names; else evaluation's, ``prefix`` + key."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(tracker_name(k, "") if prefix is None else prefix + k, v, now, step)
                 for k, v in metrics.items() if k != "step"]
        for i in range(0, len(batch), 1000):  # MLflow's limit per log_batch
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._log(step, metrics, None)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        self._log(step, metrics, "eval/")

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = {"columns": list(SAMPLE_COLUMNS), "data": [[r.get(c) for c in SAMPLE_COLUMNS] for r in rows]}
        self.client.log_dict(self.run_id, table, f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
