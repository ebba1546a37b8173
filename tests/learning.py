"""One example's learning run in this process (the synchronous loop of distflow/step.py), shared by
the tests that assert an example learns: a toy model of its kind built locally, the example's own
config, and its reward curve summed up as first-10 and last-10 means."""

from __future__ import annotations

import time
from pathlib import Path


def learning_run(example: Path, kind: str, tmp_path: Path) -> tuple:
    """(config, metrics rows, first-10 mean reward, last-10 mean reward, wall seconds) of ``example``."""
    import torch

    from distflow.core.config import load_config
    from distflow.step import synchronous_run
    from distflow.toy import ensure_toy_model
    from tests.process_group import process_group, store_path

    torch.set_num_threads(1)
    model = ensure_toy_model(tmp_path / "model", kind=kind)
    cfg = load_config(example, [f"model_path={model}", "toy_model=false", f"output_dir={tmp_path / 'out'}"])
    t0 = time.perf_counter()
    with process_group(store_path(tmp_path)):
        rows = list(synchronous_run(cfg, cfg.max_steps))
    rewards = [r["reward_mean"] for r in rows]
    return cfg, rows, sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10, time.perf_counter() - t0
