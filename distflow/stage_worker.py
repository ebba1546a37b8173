"""A node of a middle worker group: receive a shard's whole batch, run the group's pipeline, forward.

Why it exists: the paper's claim is that every worker runs its own execution flow, not only
the two built-in groups. A ``worker_groups`` entry (e.g. ``reward: 1``) starts nodes whose
mesh role is the group's name; the planner gives the group the workflow nodes that name it
in ``group`` (and the COMPUTE nodes downstream of them, e.g. a GRPO advantage after a
reward model). The rollout node of shard s sends its WHOLE batch of a step to the group's
rank ``s % size`` (:meth:`distflow.runtime.Runtime.targets_after`), so every prompt group
is on one node; this node runs its pipeline with the rollout stage registry
(:func:`distflow.step.rollout_half` on the batch; the context's ``engine`` is only asked for
its ``tokenizer``: no policy is loaded, a reward model stage loads its own model), and
forwards the result to the next group through ``buffer.redistribute.scatter``, keeping
``source_rank`` (the shard), so the trainers still see exactly one part per (step, shard).

The sender's ack waits until the result is forwarded (backpressure passes through); when a
forward fails, the handler raises, the sender's send fails and is retried (rollout
``send_parts``), and the consumers keep the first copy of a (step, shard) they get. A stage
that raises (a bad reward function, a missing model) ends this node with that error, as it
would end a rollout node: `distflow run` restarts it up to ``restarts`` times, then stops.

``controller: single`` (the hybrid-controller baseline) is the same loop with an empty
pipeline: :mod:`distflow.controller`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from distflow.buffer.redistribute import RESERVED_META, parse_part, scatter
from distflow.core.channels import Envelope
from distflow.runtime import PeerLostError, Runtime

log = logging.getLogger(__name__)


@dataclass
class TokenizerOnly:
    """The part of a rollout engine a non-generating stage uses (rule rewards decode with it)."""

    tokenizer: Any
    version: int = 0


async def run_stage_worker(rt: Runtime) -> None:
    """Serve the group ``rt.role`` (a worker group, or ``controller``) until every trainer is done."""
    cfg, group = rt.cfg, rt.role
    pipeline = [] if group == "controller" else cfg.plan().pipeline(group)
    forwarded = {"parts": 0, "samples": 0}
    lock = asyncio.Lock()  # one pipeline at a time, as on a rollout node
    engine: TokenizerOnly | None = None
    trace = None

    ready = asyncio.Event()  # set once the groups are formed
    failed: asyncio.Future = asyncio.get_running_loop().create_future()  # a pipeline error ends this node

    async def on_samples(env: Envelope) -> None:
        await ready.wait()
        step, batch = parse_part(env)
        shard = int(env.meta["source_rank"])
        extra = {k: v for k, v in env.meta.items() if k not in RESERVED_META}
        if pipeline:
            from distflow.rollout.stages import RolloutContext
            from distflow.step import rollout_half, step_seed

            stats: dict[str, int] = {}
            ctx = RolloutContext(engine, cfg, [], step_seed(cfg.seed, shard, step), list(pipeline), stats)
            async with lock:
                try:
                    batch = await asyncio.to_thread(rollout_half, list(pipeline), ctx, batch)
                except Exception as e:  # a failing stage fails this node (the launcher restarts it), not the send
                    if not failed.done():
                        failed.set_exception(e)
                    raise
            if stats:
                merged = dict(extra.get("stage_stats") or {})
                for k, v in stats.items():
                    merged[k] = merged.get(k, 0) + v
                extra["stage_stats"] = merged
            if trace is not None and trace.path is not None:
                from distflow.rollout.worker import sent_summary

                trace.write(step=step, shard=shard, rank=groups.rank, sample_ids=batch.sample_ids,
                            **sent_summary(batch))
        targets = ([m.node_id for m in groups.trainer] if group == "controller"
                   else rt.targets_after(group, shard))
        # The sender's ack waits until every consumer accepted its part: backpressure passes through.
        await scatter(rt.channel, batch, [rt.endpoint(t) for t in targets], step=step, source_rank=shard,
                      num_sources=env.meta.get("num_sources"), timeout=cfg.step_timeout_s, balance=cfg.route_by,
                      extra_meta=extra)
        forwarded["parts"] += 1
        forwarded["samples"] += len(batch)

    if pipeline:
        from distflow.hf import load_tokenizer
        from distflow.trace import Trace

        # Before joining the groups: a message that arrives meanwhile waits for the handler.
        engine = TokenizerOnly(await asyncio.to_thread(load_tokenizer, cfg.model_path))
        trace = Trace(cfg.output_dir, rt.node.node_id, cfg.trace_samples)
    rt.on_data("samples", on_samples)
    groups = await rt.form_groups()
    ready.set()
    if group == "controller":
        log.info("controller: routing %d rollout -> %d trainer nodes", len(groups.rollout), len(groups.trainer))
    else:
        log.info("%s rank %d of %d: pipeline %s", group, groups.rank, len(groups.members(group)),
                 [n.id for n in pipeline])
    down_since: float | None = None  # since when some trainer is dead (or forgotten by the mesh)
    while True:  # until every trainer has finished (done, or left the mesh)
        if failed.done():
            failed.result()  # raises the pipeline's error
        members = {t.node_id: rt.node.member(t.node_id) for t in groups.trainer}
        if all(m is not None and (m.state == "left" or m.meta.get("state") == "done") for m in members.values()):
            break
        rt.trainers_gone()  # a dead trainer ends the run with an error naming it (not "done": exit 0)
        down = sorted(i for i, m in members.items() if m is None or m.state == "dead")
        now = time.monotonic()
        down_since = (down_since or now) if down else None
        if down and now - down_since > cfg.step_timeout_s:  # this node may be the one cut off: bounded anyway
            raise PeerLostError(f"trainer {', '.join(down)} down for {cfg.step_timeout_s:.0f}s (step_timeout_s) "
                                f"and no live peer seen to confirm it: giving up")
        await asyncio.sleep(0.2)
    rt.node.set_meta(state="done")
    log.info("%s: done, forwarded %d parts / %d samples", group, forwarded["parts"], forwarded["samples"])
