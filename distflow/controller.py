"""``controller: single``: the hybrid-controller design DistFlow replaces, kept to measure against.

One extra process sits between the stages: every rollout node sends its whole output to
it, and it splits each batch by owner and forwards the parts to the trainer ranks, the
way a single driver gathers one stage's output and scatters it to the next. The data and
the owner rule are exactly those of the distributed mode, so a run produces the same
training result for the same seed; only the path differs. Weights still go peer to peer.

It is a stage worker (:mod:`distflow.stage_worker`) with an empty pipeline.
"""

from __future__ import annotations

from distflow.runtime import Runtime
from distflow.stage_worker import run_stage_worker


async def run_controller(rt: Runtime) -> None:
    await run_stage_worker(rt)
