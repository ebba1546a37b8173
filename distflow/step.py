"""One RL step, as plain functions: the rollout half and the train half.

Read top to bottom, this is the algorithm every DistFlow run executes::

    rollout half   (a rollout node, one step's prompts of its shard)
        prompts -> generate -> rewards -> advantages -> samples
    train half     (every trainer rank, on the samples it owns)
        samples -> reference / old logprobs -> values -> advantages -> update -> metrics
    then the new weights go back to the engines.

Which workflow nodes run in which half is the planner's answer (:func:`distflow.core.dag.plan`
splits the config's DAG into one pipeline per worker group); each node runs through the catalog
(:mod:`distflow.rl.catalog`): its ``(role, type)`` names the stage, whose implementation for
the group is ``distflow.rollout.stages`` or ``distflow.trainer.stages``, and its ``fn`` the
function inside it. Nothing here knows an algorithm by name.

The nodes only decide *where* each half runs and move its inputs and outputs: a rollout node
(:mod:`distflow.rollout.worker`) calls :func:`rollout_half` and routes the samples to their
owners; a trainer rank (:mod:`distflow.trainer.worker`) takes its samples of a step, calls
:func:`train_half` and publishes the weights. :func:`synchronous_run` calls the same two
functions in one process, one after the other: with ``max_staleness: 0`` the distributed run
reproduces it step for step (``tests/test_sync_equivalence.py``), and the algorithm tests learn
on it without starting a cluster.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

from distflow.rl.catalog import ROLLOUT, STAGES, TRAINER, StageError

if TYPE_CHECKING:  # the halves take what the node built; importing them here would pull torch in
    from distflow.buffer.batch import SampleBatch
    from distflow.core.config import Config
    from distflow.core.dag import WorkflowNode
    from distflow.rollout.stages import RolloutContext
    from distflow.trainer.stages import TrainerContext

__all__ = ["rollout_half", "train_half", "synchronous_run", "step_seed", "StageError"]


def step_seed(seed: int, shard: int, step: int) -> int:
    """The sampling seed of one shard's step: the same on every node, whoever generates it (an
    adopted shard is regenerated with the seed its owner would have used)."""
    return (seed * 1_000_003 + shard) * 100_003 + step


def _walk(pipeline: list[WorkflowNode], group: str, local: set[str] | None = None
          ) -> Iterator[tuple[WorkflowNode, Any, Callable[..., Any]]]:
    """(node, stage spec, implementation) in plan order; a node whose in-group deps have not run
    yet, or whose stage has no implementation on ``group``, is refused naming it."""
    local_ids = local if local is not None else {n.id for n in pipeline}
    done: set[str] = set()
    side = TRAINER if group == TRAINER else ROLLOUT
    for node in pipeline:
        missing = [d for d in node.deps if d in local_ids and d not in done]
        if missing:
            raise StageError(f"workflow node {node.id!r}: deps {missing} have not run on the {side} group "
                             f"(pipeline out of plan order)")
        spec = STAGES.get((node.role.value, node.type.value))
        if spec is None or side not in spec.impl:
            raise StageError(f"workflow node {node.id!r}: no {side} stage for {node.role.value} {node.type.value}")
        yield node, spec, spec.load(group)
        done.add(node.id)


def rollout_half(pipeline: list[WorkflowNode], ctx: RolloutContext, batch: SampleBatch | None = None) -> SampleBatch:
    """prompts -> generate -> rewards -> advantages -> samples: the rollout group's nodes of one step
    on ``ctx.rows`` (or, on a worker group of its own, on the ``batch`` another group made). Blocking
    (engine and reward models): call it in a worker thread. Counters go to ``ctx.stats``."""
    if ctx.rerun is None:  # a filter (dynamic sampling) re-runs a prefix of the pipeline through the same walk
        ctx.rerun = rollout_half
    for node, _, stage in _walk(pipeline, ROLLOUT, {n.id for n in ctx.pipeline or pipeline}):
        batch = stage(node, ctx, batch)
    if batch is None:
        raise StageError("the rollout pipeline has no generate node")
    return batch


def train_half(pipeline: list[WorkflowNode], ctx: TrainerContext, batch: SampleBatch,
               at_stage: Callable[[int, str], None] | None = None) -> dict[str, float]:
    """samples -> reference / old logprobs -> values -> advantages -> update -> metrics: the trainer
    group's nodes on this rank's samples of one step. Every rank calls it (its stages are
    collectives). Returns every stage's metrics and where the time went (``time_logprobs_s``,
    ``time_update_s``, ``time_critic_s``, ``time_reward_s``, ``time_compute_s``). ``at_stage(i, id)``
    is told before the i-th stage starts (a trainer node gossips it: a rank stuck in a stage is named)."""
    stats: dict[str, float] = {"time_logprobs_s": 0.0, "time_update_s": 0.0}
    for i, (node, spec, stage) in enumerate(_walk(pipeline, TRAINER)):
        if at_stage is not None:
            at_stage(i, node.id)
        t0 = time.perf_counter()
        out = dict(stage(node, ctx, batch))
        took = time.perf_counter() - t0
        logprobs = out.pop("time_logprobs_s", 0.0)  # an update that recomputed the old logprobs says how long
        stats.update(out)
        stats["time_logprobs_s"] += logprobs
        stats[spec.timer] = stats.get(spec.timer, 0.0) + took - logprobs
    return stats


def synchronous_run(cfg: Config, steps: int | None = None) -> Iterator[dict[str, Any]]:
    """The whole loop in this process, one step after the other: read the prompts, run the rollout
    half, the train half, load the new weights into the engine. Yields each step's metrics
    (``step``, the step's sample statistics and peak memory as a trainer node writes them, the
    rollout counters with ``generated_reward_mean``, and the train half's). ``steps`` (default:
    the config's ``max_steps``, else every step of ``epochs``) bounds the run. One rollout shard
    and one trainer rank; needs a torch.distributed group of one (the caller's, or one it makes
    here)."""
    import torch.distributed as dist

    from distflow.buffer.dataloader import PromptShard
    from distflow.rollout.engine import make_engine
    from distflow.rollout.stages import RolloutContext
    from distflow.trainer.actor import Actor
    from distflow.trainer.metrics import with_generated_mean
    from distflow.trainer.stages import build_context
    from distflow.trainer.step_stats import peak_memory, step_statistics

    own_group = not dist.is_initialized()
    if own_group:
        import tempfile

        store = tempfile.mkdtemp(prefix="distflow-sync-")  # the FileStore's directory, removed at the end
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    try:
        plan = cfg.plan()
        rollout, trainer = plan.pipeline(ROLLOUT), plan.pipeline(TRAINER)
        loader = PromptShard(cfg.dataset, 0, 1, seed=cfg.seed, shuffle=cfg.shuffle)
        engine = make_engine("torch", cfg.model_path, dtype=cfg.dtype,  # a CPU or one-GPU reference: no vLLM
                             **({"lora": cfg.lora.model_dump()} if cfg.lora is not None else {}))
        actor = Actor(cfg, with_reference=any(n.role.value == "REFERENCE" for n in trainer))
        ctx = build_context(cfg, trainer, actor)
        limit = steps if steps is not None else (cfg.max_steps or None)  # as the nodes: max_steps ends the run
        for step, (epoch, in_epoch, rows) in enumerate(loader.iterate(cfg.rollout_batch, cfg.epochs)):
            if limit is not None and step >= limit:
                break
            stage_stats: dict[str, float] = {}
            refill = (lambda attempt, n, e=epoch, i=in_epoch:  # noqa: E731 - a filter's fresh prompts, as a node draws them
                      loader.reserve(e, i, attempt, n, local_batch=cfg.rollout_batch))
            batch = rollout_half(rollout, RolloutContext(engine, cfg, rows, step_seed(cfg.seed, 0, step), rollout,
                                                         stage_stats, refill=refill))
            stats = train_half(trainer, ctx, batch)
            summary = step_statistics(batch, cfg, step, peaks=peak_memory(actor.device))
            engine.load_weights(actor.version, actor.full_state_dict())
            yield {"step": step, **summary, "samples": len(batch), **with_generated_mean(stage_stats), **stats}
    finally:
        if own_group:
            import shutil

            dist.destroy_process_group()
            shutil.rmtree(store, ignore_errors=True)
