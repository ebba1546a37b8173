"""A trainer node's side of replica groups (``trainer_replicas``): the torchft quorum in the run.

Why it exists: :mod:`distflow.trainer.replicas` is the mechanism (quorum, share, gradient average,
commit, heal); this module is what a trainer node of ``distflow run`` does with it, kept out of the
node loop (:mod:`distflow.trainer.worker`) that runs the same with or without replicas:

- :class:`ReplicaLink`: every replica group builds its :class:`~distflow.trainer.replicas.ReplicaSync`
  on the actor; whenever no live member publishes torchft's lighthouse (in the mesh), the lowest
  live group's first rank hosts one (at the start, replica 0's), and when its host dies every
  group builds its side again on the next one.
- :class:`ReplicaSteps`: each step's quorum (``begin``: a restarted group heals there, and its
  step becomes the quorum's), this group's share of the step's samples (the rollout nodes send
  every group the whole step), and the step taken again when the quorum did not commit it.
- :class:`Lead`: which group publishes weights and writes the metrics rows: one at a time, the
  lowest at the start; when it dies, the lowest live group takes over (a restarted one does not).
- :class:`ReplicaRows`: ``metrics.jsonl`` written by the leading group, each step's row once (under
  a file lock; a group that takes over writes the rows it holds that the file lacks).
- The end: :func:`writes_final_checkpoint` (the lead's, or another group's when it died first),
  :func:`wait_for_replicas` (the lighthouse's host outlives the others' last quorums), and
  :class:`NothingToHeal` (a group restarted as the run ended stops without training).
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
from distflow.core.launch_env import healing_replica, run_start
from distflow.launch.checkpoint import STATE_FILE, checkpoint_version
from distflow.rl.shaping import trained_token_counts
from distflow.runtime import Groups, Runtime
from distflow.trainer.actor import all_reduce
from distflow.trainer.metrics import MetricsWriter, read_metrics
from distflow.trainer.replicas import (LIGHTHOUSE_META, ReplicaSync, StepNotCommitted, actor_state_fns, find_lighthouse,
                                       publish_lighthouse)

log = logging.getLogger(__name__)

__all__ = ["Lead", "NothingToHeal", "ReplicaLink", "ReplicaRows", "ReplicaSteps", "replica_index", "wait_for_replicas",
           "writes_final_checkpoint"]

READY_META = "ft_ready"  # mesh meta: the lighthouse this replica group's torchft manager uses
LEAD_META = "replica_lead"  # mesh meta: this replica group publishes weights and writes the metrics rows (Lead)
ATTEMPTS = 3  # quorums a step may take before the node fails (each a dead group's worth of retry)
ROWS_KEPT = 64  # metrics rows a group holds for a takeover (a lead dies between its commit and its row)


def replica_index(rt: Runtime, groups: Groups) -> int:
    """This trainer's replica group (0 .. trainer_replicas - 1)."""
    me = rt.node.node_id
    return next(g for g, ms in enumerate(groups.replicas(rt.cfg.trainer_replicas)) if any(m.node_id == me for m in ms))


def _heads(rt: Runtime, groups: Groups) -> list[str]:
    return [ms[0].node_id for ms in groups.replicas(rt.cfg.trainer_replicas)]


def _published(rt: Runtime) -> tuple[str, str] | None:
    """(holder, address) of the lighthouse in use: the one the live member with the lowest node id
    publishes (two published for a moment, after a move, converge on one)."""
    return next(((m.node_id, m.meta[LIGHTHOUSE_META]) for m in rt.node.members()
                 if isinstance(m.meta.get(LIGHTHOUSE_META), str)), None)


class ReplicaLink:
    """This replica group's torchft side (:class:`ReplicaSync`, its actor wired to it) and the
    lighthouse it uses. The lighthouse lives in a trainer process, which may die: the lowest live
    replica group's first rank hosts one whenever no live member publishes one (at the start:
    replica 0's), and a group whose lighthouse is no longer published by a live member builds its
    torchft side again on the one that is (:meth:`connect`): the state (weights, optimizer, step)
    stays in the actor, and the new lighthouse's first quorum starts from the groups' steps."""

    def __init__(self, rt: Runtime, groups: Groups, actor: Any, on_gpu: Callable[..., Awaitable[Any]]):
        self.rt, self.groups, self.actor, self.on_gpu = rt, groups, actor, on_gpu
        self.replica, self.heads = replica_index(rt, groups), _heads(rt, groups)
        self.rank = groups.own_rank("trainer", rt.cfg.trainer_replicas)  # in the group (its torch.distributed rank)
        self.world = len(groups.own_group("trainer", rt.cfg.trainer_replicas))
        self.host = rt.node.member(rt.node.node_id).host
        self.sync: ReplicaSync | None = None
        self.server: Any = None  # the lighthouse this process hosts, if any
        self.address: str | None = None

    def moved(self) -> bool:
        """Whether the lighthouse this group uses is no longer the one in use (its host died)."""
        got = _published(self.rt)
        return got is None or got[1] != self.address

    async def connect(self) -> None:
        """(Re)build this group's torchft side on the lighthouse in use, hosting one when none is
        published and this is the lowest live replica group (bounded by ``mesh.join_timeout_s``)."""
        cfg, node = self.rt.cfg, self.rt.node
        if self.sync is not None:
            self.sync.close()
            self.actor.replicas = self.sync = None
        me = node.node_id
        lowest = next(h for h in self.heads if h == me or node.is_alive(h)) == me
        if _published(self.rt) is None and self.server is None and lowest:
            self.server = publish_lighthouse(node, self.host)
        await find_lighthouse(node, timeout=cfg.mesh.join_timeout_s)
        holder, self.address = _published(self.rt)
        state_dict, load_state_dict = actor_state_fns(self.actor)

        def build(store: tuple[str, int] | None) -> ReplicaSync:
            return ReplicaSync(f"replica{self.replica}", self.address, state_dict, load_state_dict, host=self.host,
                               timeout_s=cfg.step_timeout_s, start_step=self.actor.version, group_rank=self.rank,
                               group_world=self.world, store=store)

        def build_in_group() -> ReplicaSync:
            """Rank 0 of the group builds its side first (its manager server, the store the group's torchft
            sides share); the others get that store's address (a broadcast over the group: every rank of
            it builds its side again together) and reach the new server through it."""
            if self.world == 1:
                return build(None)
            import torch.distributed as dist

            from distflow.trainer.collectives import counted

            sync = build(None) if self.rank == 0 else None
            box = [(self.host, sync.store.port) if sync is not None else None]
            counted("broadcast_object", dist.broadcast_object_list, box, src=0)
            return sync if sync is not None else build(tuple(box[0]))

        self.sync = await self.on_gpu(build_in_group)
        self.actor.replicas = self.sync
        node.set_meta(**{READY_META: self.address})
        log.info("trainer replica group %d of %d: torchft lighthouse %s (hosted by %s)", self.replica,
                 cfg.trainer_replicas, self.address, holder)

    async def start(self) -> None:
        """The first :meth:`connect`, then wait (bounded) until every live group's manager is on the
        same lighthouse: torchft's lighthouse forms a quorum at once from the groups it knows, so a
        group a moment ahead would train alone and the others heal into the run; and a restarted
        group (``launch_env.HEAL_ENV``) alone at a new lighthouse would start the run again at step
        0 instead of healing (it also waits for one live group on it)."""
        await self.connect()
        node, me = self.rt.node, self.rt.node.node_id

        def ready(_: list) -> bool:
            if self.moved():  # (the lighthouse's host died meanwhile: build again on the one in use)
                return True
            busy = [m for h in self.heads if h != me and node.is_alive(h) and (m := node.member(h)) is not None
                    and m.meta.get("state") != "done"]  # (a group done with the run: nothing to wait for)
            on = [m for m in busy if m.meta.get(READY_META) == self.address]
            return len(on) == len(busy) and (bool(on) or not healing_replica() or not busy)

        while True:
            await node.wait_for(ready, timeout=self.rt.cfg.mesh.join_timeout_s,
                                what="every live trainer replica group's torchft manager on one lighthouse")
            if not self.moved():
                return
            await self.connect()

        await node.wait_for(ready, timeout=self.rt.cfg.mesh.join_timeout_s,
                            what="every trainer replica group's torchft manager")

    async def close(self, timeout: float) -> None:
        """At the end: the lighthouse's host waits (bounded) until every other group is done or
        dead (their last quorums need it), then stops it."""
        if self.sync is not None:
            self.sync.close()
        if self.server is not None:
            await wait_for_replicas(self.rt, self.groups, timeout)
            self.server.shutdown()


class Lead:
    """Whether this trainer's replica group is the one that publishes weights and writes the
    metrics rows (call it once a step). One group leads at a time, and keeps leading while it
    lives (mesh meta ``LEAD_META``): two groups publishing the same version would interleave their
    buckets at the rollout nodes. At the start the lowest group takes it; when the leading group
    dies (the mesh declares it dead), the lowest live group takes it over. A restarted group (mesh
    meta ``heal``) does not while another lives: it holds no metrics rows of the steps before its
    heal, which the group taking over writes when the one that led died before writing them."""

    def __init__(self, rt: Runtime, groups: Groups):
        self.rt, self.mine, self.heads = rt, replica_index(rt, groups), _heads(rt, groups)
        self.on = False

    def __call__(self) -> bool:
        if self.on:
            return True
        node, me = self.rt.node, self.heads[self.mine]
        alive = {g: node.member(h) for g, h in enumerate(self.heads) if h != me and node.is_alive(h)}
        if any(m is not None and m.meta.get(LEAD_META) is True for m in alive.values()):
            return False  # another group leads
        if healing_replica() and alive:
            return False  # restarted: another group takes it
        if any(g < self.mine and m is not None and m.meta.get("heal") is not True for g, m in alive.items()):
            return False  # a lower live group takes it
        self.on = True
        node.set_meta(**{LEAD_META: True})
        log.info("trainer replica group %d leads: it publishes the weights and writes the metrics rows", self.mine)
        return True


class NothingToHeal(RuntimeError):
    """A restarted replica group found no live group to heal from, and every other group is done:
    the run ended while it restarted; it stops without training (its quorum was itself alone)."""


class ReplicaSteps:
    """One replica group's steps under the quorum: :meth:`begin` before the step's samples are
    taken, :meth:`step` to train them. ``train(share)``: the trainer pipeline on a share (in a
    worker thread, through ``on_gpu``)."""

    def __init__(self, link: ReplicaLink, train: Callable[[SampleBatch], Any]):
        self.link, self.actor, self.on_gpu, self.train = link, link.actor, link.on_gpu, train

    @property
    def sync(self) -> ReplicaSync:
        assert self.link.sync is not None
        return self.link.sync

    async def begin(self, step: int) -> int:
        """A quorum for the next step; returns the step to train: the quorum's (a group that was
        behind, restarted, has just copied a live group's state, its policy version with it). A
        quorum asked of a lighthouse that died is given up as soon as another is in use: the
        torchft side is built again on that one (:meth:`ReplicaLink.connect`), and asked again."""
        while True:
            if self.link.moved():
                await self.link.connect()
            asked = asyncio.ensure_future(self.on_gpu(self.sync.begin))
            while not asked.done() and not self.link.moved():
                await asyncio.wait([asked], timeout=0.2)
            if asked.done():
                asked.result()
                break
            log.warning("the torchft lighthouse moved (its host died): asking the new one for the quorum")
            asked.add_done_callback(lambda f: f.cancelled() or f.exception())  # (the old manager's thread ends alone)
        if healing_replica() and self.actor.version == 0 and self.sync.participants == 1:
            node, me = self.link.rt.node, self.link.rt.node.node_id
            others = [h for h in self.link.heads if h != me]
            if all(not node.is_alive(h) or ((m := node.member(h)) is not None and m.meta.get("state") == "done")
                   for h in others):
                raise NothingToHeal("restarted to heal, but every other replica group is done: nothing to train")
            raise RuntimeError("a restarted replica group formed a quorum alone, with no live group to heal from "
                               f"(the others: {others}); it would start the run again at step {step}")
        if self.actor.version != step:
            log.warning("trainer replica group healed from a live one: at step %d (was %d), %d heal(s)",
                        self.actor.version, step, self.sync.healed)
        return self.actor.version

    async def step(self, step: int, batch: SampleBatch) -> tuple[SampleBatch, dict]:
        """Train this group's share of ``batch`` (step ``step``, its quorum begun); when the quorum
        does not commit it (a group died in it), a new quorum and the share of that one, the
        weights untouched meanwhile. Returns (the share trained, the update's stats)."""
        lens = trained_token_counts(batch, self.actor.cfg)  # the whole step's: the loss's (Actor.step_counts)
        counts = [float(lens.sum()), float((lens > 0).sum())]
        if self.link.world > 1:  # (this rank holds its position's samples of the step: the group's sum is the step's)
            counts = await self.on_gpu(all_reduce, counts)
        self.actor.step_counts = (counts[0], counts[1])
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


async def writes_final_checkpoint(lead: Callable[[], bool], path: Path, step: int, timeout: float) -> bool:
    """Whether this group writes the run's final checkpoint (``path``, of ``step`` steps): when it
    leads, or when the leading group dies before that checkpoint is complete (a group that does not
    lead waits for one or the other, bounded by ``timeout``), so a lead killed at the very end
    still leaves the run its final checkpoint."""
    deadline = time.monotonic() + timeout
    while not lead():
        try:
            if checkpoint_version(path) == step and (path / STATE_FILE).stat().st_mtime >= run_start():
                return False
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if time.monotonic() > deadline:
            log.warning("the leading replica group's final checkpoint is not complete after %.0fs; not written here",
                        timeout)
            return False
        await asyncio.sleep(0.2)
    return True


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
