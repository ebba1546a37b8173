"""``controller: single``: the hybrid-controller design DistFlow replaces, kept to measure against.

One extra process sits between the stages: every rollout node sends its whole output to
it, and it splits each batch by owner and forwards the parts to the trainer ranks, the
way a single driver gathers one stage's output and scatters it to the next. The data and
the owner rule are exactly those of the distributed mode, so a run produces the same
training result for the same seed; only the path differs. Weights still go peer to peer.
"""

from __future__ import annotations

import asyncio
import logging

from distflow.buffer.redistribute import RESERVED_META, parse_part, scatter
from distflow.core.channels import Envelope
from distflow.runtime import Runtime

log = logging.getLogger(__name__)


async def run_controller(rt: Runtime) -> None:
    cfg = rt.cfg
    forwarded = {"parts": 0, "samples": 0}

    async def on_samples(env: Envelope) -> None:
        step, batch = parse_part(env)
        trainers = [rt.endpoint(m.node_id) for m in groups.trainer]
        extra = {k: v for k, v in env.meta.items() if k not in RESERVED_META}
        # The rollout node's ack waits until every trainer accepted its part: backpressure passes through.
        await scatter(rt.channel, batch, trainers, step=step, source_rank=int(env.meta["source_rank"]),
                      num_sources=env.meta.get("num_sources"), timeout=cfg.step_timeout_s, balance=cfg.route_by,
                      extra_meta=extra)
        forwarded["parts"] += 1
        forwarded["samples"] += len(batch)

    rt.on_data("samples", on_samples)
    groups = await rt.form_groups()
    log.info("controller: routing %d rollout -> %d trainer nodes", len(groups.rollout), len(groups.trainer))
    while True:  # until every trainer has finished (done, or left the mesh)
        members = [rt.node.member(t.node_id) for t in groups.trainer]
        if all(m is None or m.state in ("left", "dead") or m.meta.get("state") == "done" for m in members):
            break
        await asyncio.sleep(0.2)
    log.info("controller: done, forwarded %d parts / %d samples", forwarded["parts"], forwarded["samples"])
