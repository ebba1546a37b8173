"""Held-out evaluation on the rollout nodes: the policy's score on prompts it never trains on.

Why it exists: the training reward is measured on the prompts being trained, with the
training temperature, by a policy that moves every step; a run needs the score of fixed,
held-out prompts at fixed points to tell learning from overfitting or noise (verl's
``val_files``/``test_freq``, OpenRLHF's ``--eval_steps``).

How it stays driverless: ``eval_dataset`` is sharded over the rollout ranks as the training
prompts are. At each evaluation point (:func:`distflow.rl.eval_report.eval_points`: the start with
``eval_before_train``, every ``eval_every`` steps, and the last), every rollout node
evaluates the eval shards it covers (its own and any it adopted from a node that is down)
with the newest weights it has received once they reach that version: the rollout group's own generate
and REWARD stages (:func:`eval_pipeline`), ``eval_samples_per_prompt`` responses per prompt at
``eval_temperature``, in chunks of a step's prompts (each gossiped as progress). It sends one
small summary per shard (:func:`distflow.rl.eval_report.summarize`: counts and sums, no
tensors) to trainer rank 0, which writes one row of ``eval.jsonl`` per point once every shard
has reported (:class:`distflow.trainer.evaluation.EvalBook`). An evaluation that fails (a bad
row, a reward that raises) is logged and reported as failed: it never stops training.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from distflow.buffer.batch import SampleBatch
from distflow.buffer.dataloader import PromptShard
from distflow.core.config import Config
from distflow.core.dag import WorkflowNode
from distflow.rl.eval_report import SUMMARY_KEYS, summarize
from distflow.rollout.engine import RolloutEngine
from distflow.rollout.stages import run_pipeline

log = logging.getLogger(__name__)


def eval_config(cfg: Config) -> Config:
    """The run's config with evaluation's sampling: ``eval_samples_per_prompt`` responses per
    prompt at ``eval_temperature`` (a copy: the training config is not validated again, since
    greedy sampling is refused for training only)."""
    return cfg.model_copy(update={"group_size": cfg.eval_samples_per_prompt, "temperature": cfg.eval_temperature})


def eval_pipeline(pipeline: list[WorkflowNode]) -> list[WorkflowNode]:
    """The rollout group's generate and REWARD nodes, in plan order (no estimator, no filter)."""
    return [n for n in pipeline if n.role.value == "REWARD"
            or (n.role.value == "ACTOR" and n.type.value == "MODEL_INFERENCE")]


def eval_shard(cfg: Config, shard: int) -> PromptShard:
    """Shard ``shard`` of ``eval_dataset`` over the rollout ranks, in file order."""
    assert cfg.eval_dataset is not None
    return PromptShard(cfg.eval_dataset, shard, cfg.rollout_nodes, seed=cfg.seed, shuffle=False,
                       bad_rows=cfg.bad_rows, required_keys=(cfg.prompt_key,))


def evaluate(pipeline: list[WorkflowNode], engine: RolloutEngine, cfg: Config, loader: PromptShard,
             seed: int, on_chunk: Callable[[int], None] | None = None) -> dict[str, float]:
    """Generate and score every row of ``loader`` (blocking: call in a thread); the summary,
    with ``skipped_prompts`` (unusable or too long) and ``seconds``. The rows go in chunks of a
    training step's prompts (``rollout_batch``), ``on_chunk(k)`` called before the first (k = 0)
    and after the k-th: a long evaluation is then progress the others can see, a step's prompts
    at a time (the trainers' and peers' deadlines, ``step_timeout_s``, count from the last chunk,
    so each chunk must finish within it, as a step's generation must)."""
    t0 = time.perf_counter()
    bad_before = loader.bad_rows_skipped
    rows = loader.batch(0, 0, max(1, len(loader.rank_rows(0))))  # the whole shard, in file order
    out = {k: 0.0 for k in SUMMARY_KEYS}
    stats: dict[str, float] = {}
    size = cfg.rollout_batch
    if on_chunk is not None:
        on_chunk(0)
    for k, i in enumerate(range(0, len(rows), size)):
        batch = run_pipeline(eval_pipeline(pipeline), engine, eval_config(cfg), rows[i:i + size], seed + k, stats)
        for key, v in summarize(batch).items():  # a prompt's responses are all in its chunk: sums add up
            out[key] += v
        if on_chunk is not None:
            on_chunk(k + 1)
    skipped = sum(stats.get(k, 0) for k in ("skipped_prompts", "bad_prompts", "bad_rows"))
    return {**{k: int(v) if k not in ("reward_sum", "best_sum") else v for k, v in out.items()},
            "skipped_prompts": int(skipped + loader.bad_rows_skipped - bad_before),
            "seconds": time.perf_counter() - t0}
