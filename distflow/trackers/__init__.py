"""Experiment trackers: where trainer rank 0's step metrics, evaluation rows and sample tables go.

``trackers: [jsonl, tensorboard, wandb, mlflow]`` in the config (jsonl is always on:
metrics.jsonl, eval.jsonl, samples.jsonl). Why a package of its own: the trainer loop
should not know any tracker's library; it hands rows to a :class:`TrackerSet` and goes on.
Each library is imported only when its backend is configured, here, so a run without
trackers never pays their import time. A backend that cannot start is a ConfigError before
the first step; see :mod:`distflow.trackers.base` for what happens mid-run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BACKENDS = ("jsonl", "tensorboard", "wandb", "mlflow")


def open_trackers(cfg: Any, node_id: str = "trainer-0", resume_step: int | None = None) -> Any:
    """The run's TrackerSet (trainer rank 0 calls this once, before its first step). Raises
    ConfigError naming the backend that cannot start, and why."""
    from distflow.core.config import ConfigError
    from distflow.trackers.backend_jsonl import JsonlTracker
    from distflow.trackers.base import TrackerSet

    out = Path(cfg.output_dir)
    run_name = cfg.tracker_run_name or cfg.name
    config = cfg.model_dump(mode="json")
    trackers: list[Any] = [JsonlTracker(out, resume_step)]
    try:
        for name in dict.fromkeys(cfg.trackers):
            if name == "tensorboard":
                from distflow.trackers.backend_tensorboard import TensorBoardTracker

                trackers.append(TensorBoardTracker(out / "tensorboard", resume_step))
            elif name == "wandb":
                from distflow.trackers.backend_wandb import WandbTracker

                trackers.append(WandbTracker(out, cfg.tracker_project, run_name, cfg.wandb_mode, node_id,
                                             primary=True, config=config))
            elif name == "mlflow":
                from distflow.trackers.backend_mlflow import MlflowTracker

                trackers.append(MlflowTracker(out, cfg.tracker_uri, cfg.tracker_project, run_name, config,
                                              resume=resume_step is not None))
    except ImportError as e:
        for t in trackers:
            t.close()
        raise ConfigError(f"trackers: {name} is configured but its library is not installed ({e}); "
                          f"pip install 'distflow[trackers]'") from None
    except Exception as e:  # noqa: BLE001 - any backend's own start-up error, named
        for t in trackers:
            t.close()
        raise ConfigError(f"trackers: {name} cannot start: {type(e).__name__}: {e}") from None
    decode = None
    if cfg.sample_table_k > 0:
        try:
            from distflow.hf import load_tokenizer

            tok = load_tokenizer(cfg.model_path)
            decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
        except Exception as e:  # noqa: BLE001 - the table is still written, as token ids
            log.warning("trackers: no tokenizer at %s (%s); sample tables hold token ids", cfg.model_path, e)
    log.info("trackers: %s", ", ".join(t.name for t in trackers))
    return TrackerSet(trackers, sample_k=cfg.sample_table_k, sample_every=cfg.sample_table_every, decode=decode)
