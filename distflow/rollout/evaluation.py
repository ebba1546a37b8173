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

import asyncio
import functools
import logging
import time
from typing import Any, Awaitable, Callable

from distflow.buffer.dataloader import PromptShard
from distflow.core.config import Config
from distflow.core.dag import WorkflowNode
from distflow.device import call_on, chosen_device
from distflow.rl.eval_report import EVAL_KIND, SUMMARY_KEYS, due_point, eval_points, report_meta, summarize
from distflow.rollout.engine import RolloutEngine
from distflow.rollout.stages import RolloutContext
from distflow.step import rollout_half, step_seed

log = logging.getLogger(__name__)
SEND_TIMEOUT_S = 30.0  # the longest a shard's report waits for trainer rank 0's ack


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
    nodes, eval_cfg, size = eval_pipeline(pipeline), eval_config(cfg), cfg.rollout_batch
    if on_chunk is not None:
        on_chunk(0)
    for k, i in enumerate(range(0, len(rows), size)):
        batch = rollout_half(nodes, RolloutContext(engine, eval_cfg, rows[i:i + size], seed + k, nodes, stats))
        for key, v in summarize(batch).items():  # a prompt's responses are all in its chunk: sums add up
            out[key] += v
        if on_chunk is not None:
            on_chunk(k + 1)
    skipped = sum(stats.get(k, 0) for k in ("skipped_prompts", "bad_prompts", "bad_rows"))
    return {**{k: int(v) if k not in ("reward_sum", "best_sum") else v for k, v in out.items()},
            "skipped_prompts": int(skipped + loader.bad_rows_skipped - bad_before),
            "seconds": time.perf_counter() - t0}


class NodeEvaluator:
    """One rollout node's evaluations: its points, its eval shards' loaders, its progress gossip.
    The node's loop asks :meth:`if_due` at the top of every turn and :meth:`final` after the
    final weights; the engine is the node's own (evaluation pauses the node's generation)."""

    def __init__(self, rt: Any, pipeline: list[WorkflowNode], engine: RolloutEngine, inbox: Any, total: int,
                 trainer0: str, covered: Callable[[], list[int]], load_weights: Callable[[], Awaitable[None]],
                 rank: int):
        self.rt, self.cfg, self.pipeline, self.engine, self.inbox = rt, rt.cfg, pipeline, engine, inbox
        self.total, self.trainer0, self.rank = total, trainer0, rank
        self.covered = covered  # the shards this node covers now (its own, and adopted ones)
        self.load_weights = load_weights  # applies the newest weights received to the engine
        self.todo: list[int] | None = None  # points not reached yet; None until this node holds current weights
        self.loaders: dict[int, PromptShard] = {}
        self.chunks = 0  # chunks evaluated so far (gossiped as eval_progress)

    async def if_due(self, start: int | None, done: int) -> bool:
        """Evaluate when the newest weights received have reached an evaluation point, whether the
        node is about to generate or waiting for weights (the last steps' points come while it
        waits); True if it evaluated. The points are fixed once the node holds current weights
        (a restarted node evaluates only the points ahead of it). ``start``: the trainers' start
        step (None until gossiped); ``done``: the steps the trainers need no more samples for."""
        if self.todo is None:
            if self.inbox.version < done - self.cfg.max_staleness:
                return False  # catching up (a restarted node): its first weights are not current yet
            # (the trainers' start_step may not have been gossiped yet: a resumed run's first weights,
            # version R, already say where it starts)
            first = start if start is not None else done
            self.todo = [p for p in eval_points(self.cfg, first, self.total) if p >= self.inbox.version]
        if due_point(self.todo, self.inbox.version) is None:
            return False
        await self.load_weights()
        await self.evaluate_due()
        return True

    async def final(self) -> None:
        """Evaluate the final weights (loaded by the caller)."""
        if self.todo is None:
            self.todo = [self.total]  # (restarted with the final weights: its loop never evaluated)
        await self.evaluate_due()

    async def evaluate_due(self) -> None:
        """Evaluate the newest point the engine's weights have reached on every eval shard this
        node covers, and report each shard's summary to trainer rank 0. A failure is logged and
        reported as failed, never raised."""
        point = due_point(self.todo or [], self.engine.version)
        if point is None:
            return
        self.todo = [p for p in self.todo or [] if p > point]
        cfg, rank, version = self.cfg, self.rank, self.engine.version
        for shard in self.covered():
            summary, error = None, ""
            try:
                loader = self.loaders.get(shard)
                if loader is None:
                    loader = self.loaders[shard] = eval_shard(cfg, shard)
                seed = step_seed(cfg.seed, shard, point + 0xE7A1)
                summary = await asyncio.to_thread(call_on, chosen_device(), evaluate, self.pipeline, self.engine, cfg,
                                                  loader, seed, self._progress_reporter())
            except Exception as e:  # noqa: BLE001 - an evaluation never stops training
                error = f"{type(e).__name__}: {e}"
                log.error("rollout rank %d: evaluation at step %d of eval shard %d failed (%s); reported as failed",
                          rank, point, shard, error)
            if summary is not None:
                n = summary["samples"]
                log.info("rollout rank %d: eval at step %d (weights v%d), shard %d: reward_mean %s over %d samples "
                         "in %.1fs", rank, point, version, shard, f"{summary['reward_sum'] / n:.4f}" if n else "-", n,
                         summary["seconds"])
            try:  # a failure is reported too: the point then closes at once, naming the failed shard
                await self.rt.channel.send(self.rt.endpoint(self.trainer0), EVAL_KIND,
                                           report_meta(point, shard, version, summary, cfg.rollout_nodes, error), {},
                                           timeout=min(SEND_TIMEOUT_S, cfg.step_timeout_s))
            except Exception as e:  # noqa: BLE001 - a lost report loses one row of eval.jsonl, nothing else
                log.warning("rollout rank %d: could not report the eval of step %d shard %d to %s (%s: %s)",
                            rank, point, shard, self.trainer0, type(e).__name__, e)

    def _progress_reporter(self) -> Callable[[int], None]:
        """``on_chunk`` for :func:`evaluate`, called from its worker thread: gossips this node's
        evaluation progress (``eval_progress``) from the loop, so the trainers' and the other rollout
        nodes' deadlines run from the last chunk, not the start."""
        loop, node = asyncio.get_running_loop(), self.rt.node

        def on_chunk(_: int) -> None:
            self.chunks += 1
            loop.call_soon_threadsafe(functools.partial(node.set_meta, eval_progress=self.chunks))

        return on_chunk
