"""A trainer node's side of replica groups (``trainer_replicas``): the torchft quorum in the run.

Why it exists: :mod:`distflow.trainer.replicas` is the mechanism (quorum, share, gradient average,
commit, heal); this module is what a trainer node of ``distflow run`` does with it, kept out of the
node loop (:mod:`distflow.trainer.worker`) that runs the same with or without replicas:

- :func:`start_replicas`: replica 0's first rank hosts torchft's lighthouse (named in the mesh);
  every replica group builds its :class:`~distflow.trainer.replicas.ReplicaSync` on the actor and
  waits (bounded) for the others' managers before the first quorum.
- :class:`ReplicaSteps`: each step's quorum (``begin``: a restarted group heals there, and its
  step becomes the quorum's), this group's share of the step's samples (the rollout nodes send
  every group the whole step), and the step taken again when the quorum did not commit it.
- :class:`Lead`: which group publishes weights and writes the metrics rows: one at a time, the
  lowest at the start; when it dies, the lowest live group takes over (a restarted one does not).
- :class:`ReplicaRows`: ``metrics.jsonl`` written by the leading group, each step's row once (under
  a file lock; a group that takes over writes the rows it holds that the file lacks).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from distflow.buffer.batch import SampleBatch
from distflow.runtime import Groups, Runtime
from distflow.trainer.metrics import MetricsWriter, read_metrics
from distflow.trainer.replicas import ReplicaSync, StepNotCommitted, actor_state_fns, find_lighthouse, publish_lighthouse

log = logging.getLogger(__name__)

__all__ = ["Lead", "ReplicaRows", "ReplicaSteps", "replica_index", "start_replicas", "wait_for_replicas"]

READY_META = "ft_ready"  # mesh meta: this replica group's torchft manager is up
LEAD_META = "replica_lead"  # mesh meta: this replica group publishes weights and writes the metrics rows (Lead)
ATTEMPTS = 3  # quorums a step may take before the node fails (each a dead group's worth of retry)
ROWS_KEPT = 64  # metrics rows a group holds for a takeover (a lead dies between its commit and its row)


def replica_index(rt: Runtime, groups: Groups) -> int:
    """This trainer's replica group (0 .. trainer_replicas - 1)."""
    me = rt.node.node_id
    return next(g for g, ms in enumerate(groups.replicas(rt.cfg.trainer_replicas)) if any(m.node_id == me for m in ms))


def _heads(rt: Runtime, groups: Groups) -> list[str]:
    return [ms[0].node_id for ms in groups.replicas(rt.cfg.trainer_replicas)]


async def start_replicas(rt: Runtime, groups: Groups, actor: Any, on_gpu: Callable[..., Awaitable[Any]]) -> tuple:
    """(ReplicaSync, lighthouse server or None) of this replica group, its actor wired to it."""
    cfg, replica = rt.cfg, replica_index(rt, groups)
    host = rt.node.member(rt.node.node_id).host
    first = groups.replicas(cfg.trainer_replicas)[0][0].node_id == rt.node.node_id
    server = publish_lighthouse(rt.node, host) if first else None
    address = await find_lighthouse(rt.node, timeout=cfg.mesh.join_timeout_s)
    state_dict, load_state_dict = actor_state_fns(actor)
    sync = await on_gpu(lambda: ReplicaSync(f"replica{replica}", address, state_dict, load_state_dict, host=host,
                                            timeout_s=cfg.step_timeout_s))
    actor.replicas = sync
    rt.node.set_meta(**{READY_META: True})
    # Every live group's manager up before the first quorum: torchft's lighthouse forms one at once from the
    # groups it knows, so a group a moment ahead would train alone and the others heal into the run.
    heads = _heads(rt, groups)

    def ready(_: list) -> bool:
        return all((m := rt.node.member(h)) is not None and m.meta.get(READY_META) is True
                   for h in heads if rt.node.is_alive(h))

    await rt.node.wait_for(ready, timeout=cfg.mesh.join_timeout_s, what="every trainer replica group's torchft manager")
    log.info("trainer replica group %d of %d: lighthouse %s%s", replica, cfg.trainer_replicas, address,
             " (hosted here)" if server is not None else "")
    return sync, server


class Lead:
    """Whether this trainer's replica group is the one that publishes weights and writes the
    metrics rows (call it once a step). One group leads at a time, and keeps leading while it
    lives (mesh meta ``LEAD_META``): two groups publishing the same version would interleave their
    buckets at the rollout nodes. At the start the lowest group takes it; when the leading group
    dies (the mesh declares it dead), the lowest live group takes it over; a restarted group
    finds another leading and does not."""

    def __init__(self, rt: Runtime, groups: Groups):
        self.rt, self.mine, self.heads = rt, replica_index(rt, groups), _heads(rt, groups)
        self.on = False

    def __call__(self) -> bool:
        if self.on:
            return True
        node, me = self.rt.node, self.heads[self.mine]
        alive = [g for g, h in enumerate(self.heads) if h != me and node.is_alive(h)]
        if any((m := node.member(self.heads[g])) is not None and m.meta.get(LEAD_META) is True for g in alive):
            return False  # another group leads
        if any(g < self.mine for g in alive):
            return False  # a lower live group takes it
        self.on = True
        node.set_meta(**{LEAD_META: True})
        log.info("trainer replica group %d leads: it publishes the weights and writes the metrics rows", self.mine)
        return True


class ReplicaSteps:
    """One replica group's steps under the quorum: :meth:`begin` before the step's samples are
    taken, :meth:`step` to train them. ``train(share)``: the trainer pipeline on a share (in a
    worker thread, through ``on_gpu``)."""

    def __init__(self, sync: ReplicaSync, actor: Any, on_gpu: Callable[..., Awaitable[Any]],
                 train: Callable[[SampleBatch], Any]):
        self.sync, self.actor, self.on_gpu, self.train = sync, actor, on_gpu, train

    async def begin(self, step: int) -> int:
        """A quorum for the next step; returns the step to train: the quorum's (a group that was
        behind, restarted, has just copied a live group's state, its policy version with it)."""
        await self.on_gpu(self.sync.begin)
        if self.actor.version != step:
            log.warning("trainer replica group healed from a live one: at step %d (was %d), %d heal(s)",
                        self.actor.version, step, self.sync.healed)
        return self.actor.version

    async def step(self, step: int, batch: SampleBatch) -> tuple[SampleBatch, dict]:
        """Train this group's share of ``batch`` (step ``step``, its quorum begun); when the quorum
        does not commit it (a group died in it), a new quorum and the share of that one, the
        weights untouched meanwhile. Returns (the share trained, the update's stats)."""
        for attempt in range(1, ATTEMPTS + 1):
            share = batch.select(self.sync.share(batch.sample_ids))
            try:
                return share, await self.on_gpu(self.train, share)
            except StepNotCommitted as e:
                self.sync.retries += 1
                log.warning("step %d not committed by the replica quorum (attempt %d of %d): %s", step, attempt,
                            ATTEMPTS, e)
            if await self.begin(step) != step:
                raise RuntimeError(f"step {step}: the replica quorum moved to step {self.actor.version} while "
                                   "this group retried it")
        raise StepNotCommitted(f"step {step}: no replica quorum committed it in {ATTEMPTS} attempts")


class ReplicaRows:
    """``metrics.jsonl`` under replica groups: every group's rank 0 keeps its last rows, and the
    leading group (:func:`leads`) appends those the file lacks (steps after its last row), under
    a file lock, so each step's row is written once whoever leads when. ``fresh``: this process
    starts the file (replica 0 at the run's start; a resume keeps the rows before its step).
    ``lead``: a :class:`Lead`."""

    def __init__(self, output_dir: Path, fresh: bool, resume_step: int | None, lead: Callable[[], bool]):
        if fresh:
            self.path = MetricsWriter(output_dir, resume_step=resume_step).path
        else:
            output_dir.mkdir(parents=True, exist_ok=True)
            self.path = output_dir / "metrics.jsonl"
        self.rows: list[dict] = []
        self.lead = lead

    def write(self, record: dict[str, Any]) -> None:
        self.rows = [*self.rows[-(ROWS_KEPT - 1):], record]
        if not self.lead():
            return
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                done = [r["step"] for r in read_metrics(self.path) if isinstance(r.get("step"), int)]
                last = max(done, default=-1)
                with self.path.open("a") as f:
                    for r in self.rows:
                        if r["step"] > last:
                            f.write(json.dumps(r, sort_keys=True) + "\n")
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


async def wait_for_replicas(rt: Runtime, groups: Groups, timeout: float) -> None:
    """The lighthouse's host, done: wait (bounded) until every other group is done or dead, whose
    last quorums need the lighthouse."""
    me, deadline = rt.node.node_id, time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(not rt.node.is_alive(h) or ((m := rt.node.member(h)) is not None and m.meta.get("state") == "done")
               for h in _heads(rt, groups) if h != me):
            return
        await asyncio.sleep(0.1)
    log.warning("trainer replica groups not done %.0fs after this one: closing the lighthouse", timeout)
