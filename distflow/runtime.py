"""What every node process has, whatever its role: identity, mesh, channel, buffer shard.

A rollout node and a trainer node differ only in the pipeline they run. Both join the
gossip mesh, open a tensor channel for the data plane, keep a BufferShard, and derive
their rank from membership once the expected group sizes are present (sorted node ids:
every node computes the same ranks without asking anyone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from distflow.buffer.shard import BufferShard
from distflow.core.aio import woken
from distflow.transport import Endpoint, Envelope, Transport, make_transport
from distflow.core.config import Config, replica_layout
from distflow.core.launch_env import healing_replica, recovering_trainers
from distflow.core.node import MeshConfig, Member, Node
from distflow.progress import LAST_STAGE, PROGRESS, ProgressWatch, beat_of, position_of

log = logging.getLogger(__name__)

HANDLER_WAIT_S = 30.0


@dataclass
class Groups:
    """This node's view of the worker groups, fixed once formed."""

    rollout: list[Member]
    trainer: list[Member]
    rank: int
    controller: list[Member] = field(default_factory=list)  # controller: single only
    workers: dict[str, list[Member]] = field(default_factory=dict)  # worker_groups: name -> members by rank

    def members(self, group: str) -> list[Member]:
        """The members of a group (rollout, trainer, controller or a worker group), in rank order."""
        if group in ("rollout", "trainer", "controller"):
            return getattr(self, group)
        return self.workers[group]

    def replicas(self, n: int) -> list[list[Member]]:
        """The trainer ranks in ``n`` replica groups of consecutive ranks (``trainer_replicas``;
        :func:`distflow.core.config.replica_layout`): one group when ``n`` is 1."""
        return [[self.trainer[i] for i in ranks] for ranks in replica_layout(len(self.trainer), n)]

    def own_group(self, role: str, replicas: int = 1) -> list[Member]:
        """The members this node is one torch.distributed group with: a trainer's replica group
        (the whole trainer group without ``trainer_replicas``), else its role's group."""
        ms = self.members(role)
        if role != "trainer" or replicas == 1:
            return ms
        return next(g for g in self.replicas(replicas) if any(m.node_id == ms[self.rank].node_id for m in g))

    def own_rank(self, role: str, replicas: int = 1) -> int:
        """This node's rank in :meth:`own_group` (its torch.distributed rank)."""
        me = self.members(role)[self.rank].node_id
        return [m.node_id for m in self.own_group(role, replicas)].index(me)

    def node_ids(self) -> set[str]:
        """Every node of the run (a `distflow status` client in the mesh is not one)."""
        return {m.node_id for m in self.rollout + self.trainer + self.controller} | {
            m.node_id for ms in self.workers.values() for m in ms}


@dataclass
class Runtime:
    cfg: Config
    node: Node
    channel: Transport
    shard: BufferShard
    role: str
    groups: Groups | None = None
    handlers: dict[str, object] = field(default_factory=dict)
    _registered: asyncio.Event = field(default_factory=asyncio.Event)
    _plan: object = None
    _down: set = field(default_factory=set)  # this run's peers last seen dead (for "alive again")
    _said_coll: list | None = None  # the collective count last gossiped (meta ``coll``)

    @classmethod
    def create(cls, cfg: Config, role: str, node_id: str, secret: str, *, host: str, port: int,
               data_port: int, seeds: list[str], advertise_host: str | None = None) -> "Runtime":
        # the backend (a cpu node never takes NCCL with `auto`) is transport.select's choice
        channel = make_transport(cfg.channel, node_id, secret, host=host, port=data_port,
                                 cuda_node=cfg.device == "cuda",
                                 **({} if cfg.channel == "zmq" else {"posting": cfg.posting}))
        m = cfg.mesh
        mesh_cfg = MeshConfig(protocol_period_s=m.protocol_period_s, suspicion_timeout_s=m.suspicion_timeout_s,
                              request_timeout_s=m.request_timeout_s, join_timeout_s=m.join_timeout_s,
                              max_frame_bytes=m.max_frame_bytes,
                              advertise_host=advertise_host or cfg.advertise_host)
        meta = {"state": "starting", "policy_version": 0, "device": cfg.device,
                "boot": time.time_ns()}  # boot tells a restarted node (same id) from its previous life
        if role == "trainer" and healing_replica():
            meta["heal"] = True  # a replica group restarted alone: it heals from a live one (launch_env.HEAL_ENV)
        if cfg.device == "cuda":
            from distflow.device import gpu_identity

            meta["gpu"] = gpu_identity()  # who shares my GPU (CUDA IPC weights need the same one)
        node = Node(node_id, role, secret=secret, host=host, port=port, seeds=seeds, config=mesh_cfg, meta=meta)
        return cls(cfg, node, channel, BufferShard(cfg.buffer_capacity), role)

    async def start(self) -> None:
        self.channel.set_handler(self._dispatch)
        await self.channel.start()
        self.node.set_meta(data_port=self.channel.port)
        await self.node.start()

    def on_data(self, kind: str, handler) -> None:
        """Route received data-plane messages of one kind to a handler."""
        self.handlers[kind] = handler
        self._registered.set()

    async def _dispatch(self, env: Envelope) -> None:
        # Peers may send as soon as we are in the mesh, a moment before the role loop has
        # registered its handlers: hold the message (and so the sender's ack) briefly.
        deadline = asyncio.get_running_loop().time() + HANDLER_WAIT_S
        while env.kind not in self.handlers and asyncio.get_running_loop().time() < deadline:
            self._registered.clear()
            await woken(self._registered.wait(), 0.2)
        handler = self.handlers.get(env.kind)
        if handler is None:
            raise ValueError(f"{self.node.node_id}: no handler for data message kind {env.kind!r}")
        await handler(env)

    async def form_groups(self) -> Groups:
        """Wait until every expected node of every group is alive, then derive ranks. A node of a
        worker group has that group's name as its mesh role."""
        need = {"rollout": self.cfg.rollout_nodes, "trainer": self.cfg.trainer_nodes,
                "controller": self.cfg.controller_nodes, **self.cfg.worker_groups}

        def complete(ms: list[Member]) -> bool:
            roles = [m.role for m in ms if "data_port" in m.meta]
            return all(roles.count(role) >= n for role, n in need.items())

        what = " and ".join(f"{n} {role}" for role, n in need.items() if n) + " nodes to join the mesh"
        try:
            members = await self.node.wait_for(complete, timeout=self.cfg.mesh.join_timeout_s, what=what)
        except TimeoutError as e:  # one line naming the seeds and the deadline (the node exits 1, no traceback)
            from distflow.core.swim_driver import JoinTimeout

            seeds = ", ".join(f"{h}:{p}" for h, p in self.node._seeds) or "none (the first node: the others join it)"
            raise JoinTimeout(f"{e} (mesh.join_timeout_s: {self.cfg.mesh.join_timeout_s:.3g}); seeds tried: {seeds}; "
                              f"check that every node was started with --seeds naming a running node") from None
        by_role = {role: sorted((m for m in members if m.role == role), key=lambda m: m.node_id)[:n]
                   for role, n in need.items()}
        rollout, trainer = by_role["rollout"], by_role["trainer"]
        mine = by_role[self.role]
        ids = [m.node_id for m in mine]
        if self.node.node_id not in ids:
            raise RuntimeError(f"{self.node.node_id}: more {self.role} nodes than rollout/trainer_nodes/"
                               f"worker_groups configured; the group is {ids}")
        self.groups = Groups(rollout, trainer, ids.index(self.node.node_id), by_role["controller"],
                             {g: by_role[g] for g in self.cfg.worker_groups})
        self.node.set_meta(rank=self.groups.rank, group=self.role, state="running")
        log.info("%s: %s rank %d of %d", self.node.node_id, self.role, self.groups.rank, len(mine))
        cluster = self.groups.node_ids()
        self.node.subscribe(lambda event, m: self._log_peer(event, m) if m.node_id in cluster else None)
        return self.groups

    def refute_window_s(self) -> float:
        """How long a peer's death must stand before this node acts on it (the mesh's refute
        window for this run's size: a node declared dead by mistake refutes within it)."""
        return self.node.config.refute_window_s(len(self.groups.node_ids()) if self.groups is not None else 1)

    def _log_peer(self, event: str, m: Member) -> None:
        """This run's peers dying, leaving and coming back go to the node's log: the first thing
        to read when a run stops or stalls (a suspicion is not logged: it is often refuted)."""
        me = self.node.node_id
        if event == "dead":
            self._down.add(m.node_id)
            log.warning("%s: peer %s (%s) declared dead by the mesh", me, m.node_id, m.role)
        elif event == "left":
            self._down.discard(m.node_id)
            log.info("%s: peer %s (%s) left the mesh", me, m.node_id, m.role)
        elif event == "alive" and m.node_id in self._down:
            self._down.discard(m.node_id)
            log.info("%s: peer %s (%s) is alive again", me, m.node_id, m.role)

    def targets_after(self, group: str, shard: int) -> list[str]:
        """Node ids that receive ``group``'s output for rollout shard ``shard``: the controller
        with ``controller: single``; else the next group in flow order: a worker group's rank
        ``shard % size`` (one node sees a whole shard, so prompt groups stay whole), or every
        trainer (each takes the samples it owns)."""
        g = self.groups
        if g is None:
            raise RuntimeError(f"{self.node.node_id}: groups are not formed yet")
        if g.controller:
            return [g.controller[0].node_id]
        if self._plan is None:
            self._plan = self.cfg.plan()
        flow = self._plan.flow
        nxt = flow[flow.index(group) + 1]
        if nxt == "trainer":
            return [m.node_id for m in g.trainer]
        members = g.workers[nxt]
        return [members[shard % len(members)].node_id]

    def endpoint(self, node_id: str) -> Endpoint:
        """A peer's data endpoint as the mesh knows it now (a restarted node may have moved)."""
        m = self.node.member(node_id)
        if m is None or "data_port" not in m.meta:
            raise PeerLostError(f"{node_id} is not a member with a data endpoint")
        return Endpoint(m.node_id, m.host, int(m.meta["data_port"]))

    def dead_peers(self, role: str) -> list[str]:
        """Members of my ``role`` group (not me) the mesh has declared dead (not those that left); a
        trainer's: of its replica group (``trainer_replicas``), the ranks it shares a step with."""
        group = self.groups.own_group(role, self.cfg.trainer_replicas) if self.groups is not None else []
        out = []
        for g in group:
            m = self.node.member(g.node_id) if g.node_id != self.node.node_id else None
            if m is not None and m.state == "dead":
                out.append(g.node_id)
        return out

    def trainers_gone(self) -> None:
        """Raise when the trainers are gone for good: every one left (ClusterStopped), or one
        died (PeerLostError naming it). A trainer this node merely cannot reach (this node is
        cut off: it sees no other member alive) may come back, so that is waited for; so is a
        death younger than the refute window. The nodes that feed the trainers (rollout, worker
        groups, the controller) all decide with this one rule. Under a ``distflow run`` that recovers
        dead trainers (``recover_retries``) a dead trainer is waited for too: the launcher restarts
        every rank from a checkpoint (the waits stay bounded by ``step_timeout_s``). With replica
        groups (``trainer_replicas``) a dead trainer is waited for while one replica group is wholly
        alive: that group keeps training, and the dead one is restarted and heals from it."""
        assert self.groups is not None, "trainers_gone needs the groups (form_groups first)"
        node, now = self.node, time.time()
        trainers = [m for t in self.groups.trainer if (m := node.member(t.node_id)) is not None]
        states = {m.node_id: m.state for m in trainers}
        if len(states) == len(self.groups.trainer) and all(s == "left" for s in states.values()):
            raise ClusterStopped("every trainer left the mesh")
        dead = {m.node_id: m.since for m in trainers if m.state == "dead"}
        if not dead or recovering_trainers():  # `distflow run` restarts them from a checkpoint: wait for them
            return
        if any(all(node.is_alive(m.node_id) for m in g) for g in self.groups.replicas(self.cfg.trainer_replicas)):
            return  # a replica group lives: it trains on without the dead one (distflow.trainer.replicas)
        if all(s in ("left", "dead") for s in states.values()) and "left" in states.values():
            raise PeerLostError(f"trainer {', '.join(dead)} died and the other trainers left: the run is over")
        cluster = self.groups.node_ids()  # a `distflow status` client in the mesh is no witness
        spread = self.refute_window_s()  # a death believed only once it stands this long
        lasting = [i for i, at in dead.items() if now - at >= spread]
        if not lasting:
            return
        others = [m for m in node.members(include_dead=True)
                  if m.node_id != node.node_id and m.node_id in cluster and m.node_id not in dead]
        # A cut-off node that heals hears from its peers one by one: settle long enough for a
        # live trainer to refute its death too (one anti-entropy round plus the spreads).
        settle = node.config.push_pull_interval_s + spread
        witness = not_cut_off_witness(others, min(dead[i] for i in lasting), now, settle)
        if witness is not None:
            raise PeerLostError(f"trainer {', '.join(lasting)} died (the mesh declared it dead; "
                                f"{witness} is still reachable, so this node is not cut "
                                f"off): the trainer group cannot go on without it")

    async def wait_dead_peers(self, role: str, timeout: float) -> list[str]:
        """Dead members of my ``role`` group, waiting up to ``timeout`` for the mesh to notice one."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            dead = self.dead_peers(role)
            if dead or asyncio.get_running_loop().time() >= deadline:
                return dead
            await asyncio.sleep(0.1)

    async def watch_group(self, poll_s: float = 0.25, hang_s: float | None = None) -> None:
        """Raise GroupMemberLost once a peer of my own group has been dead for the mesh's
        refute window (a node declared dead by mistake refutes in that time). For the trainer group: the
        ranks of a torch.distributed group cannot be replaced, so a dead rank ends the group,
        and the surviving ranks must say which one instead of a transport error, promptly,
        whatever they are waiting for. A peer alive but stuck is treated the same way: its position (mesh
        meta ``beat`` and ``coll``) stays behind mine for ``hang_s`` (default ``hang_timeout_s``; 0: not
        watched); and so is the whole group when a collective every rank entered has not completed here
        for ``hang_s``: see :mod:`distflow.progress`."""
        hang_s = self.cfg.hang_timeout_s if hang_s is None else hang_s
        watch, said = ProgressWatch(hang_s), 0.0
        while True:
            if self.groups is not None:
                now, window = time.time(), self.refute_window_s()  # Member.since is time.time()
                gone = sorted(i for i in self.dead_peers(self.role)
                              if (m := self.node.member(i)) is not None and now - m.since >= window)
                if gone:
                    raise GroupMemberLost(self.role, gone)
                if hang_s > 0:
                    if time.monotonic() - said >= min(1.0, hang_s / 8):  # (a rank calls thousands a step:
                        said = time.monotonic()  # gossip its count a few times a hang_s, not at each poll)
                        self._say_collectives()
                    lost = watch.check(self._positions(), time.monotonic(), self.node.node_id, self.role, self._at(),
                                       PROGRESS.oldest_pending() if self.role == "trainer" else None)
                    if lost is not None:
                        raise GroupMemberLost(self.role, *lost, stuck=True)
            await asyncio.sleep(poll_s)

    def set_beat(self, step: int, point: int = 0, where: str = "samples") -> None:
        """Say how far this rank is (mesh meta ``beat``: :func:`~distflow.progress.beat_of`; ``at``: what it
        is doing there); its collectives count from 0 again (:data:`~distflow.progress.PROGRESS`). Call it
        on the loop while no collective is in flight (the step's start, publish and end)."""
        PROGRESS.mark(beat_of(step, point))
        self._say_beat(beat_of(step, point), where)

    def _say_beat(self, beat: int, where: str) -> None:
        self._said_coll = list(PROGRESS.position())
        self.node.set_meta(beat=beat, at=where, coll=self._said_coll)  # (one gossiped update)

    def _say_collectives(self) -> None:
        """Gossip this rank's collective count (mesh meta ``coll``: ``[beat, n]``) when it changed."""
        if self.role == "trainer" and (pos := list(PROGRESS.position())) != self._said_coll:
            self._said_coll = pos
            self.node.set_meta(coll=pos)

    def stage_beats(self, step: int) -> Callable[[int, str], None]:
        """``train_half``'s ``at_stage`` for ``step``: the training thread moves this rank's progress
        counter (in that thread: its next collective counts in the new stage), and its meta on the event
        loop (which owns the mesh metadata). Call it on the loop."""
        loop = asyncio.get_running_loop()

        def at_stage(i: int, stage: str) -> None:
            beat = beat_of(step, min(1 + i, LAST_STAGE))
            PROGRESS.mark(beat)
            loop.call_soon_threadsafe(self._say_beat, beat, stage)

        return at_stage

    def _watched(self) -> list[Member]:
        """The mesh view of every alive member of my own group (a trainer's: its replica group), mine included."""
        group = self.groups.own_group(self.role, self.cfg.trainer_replicas) if self.groups is not None else []
        return [m for g in group if (m := self.node.member(g.node_id)) is not None and self.node.is_alive(g.node_id)]

    def _at(self) -> dict[str, str]:
        """Where each member of my group says it is (meta ``at``: a stage's id), for the stuck message."""
        return {m.node_id: str(m.meta["at"]) for m in self._watched() if "at" in m.meta}

    def _positions(self) -> dict[str, tuple[int, int]]:
        """The position (meta ``beat`` and ``coll``: :func:`~distflow.progress.position_of`) of every alive
        member of my group, mine included."""
        return {m.node_id: pos for m in self._watched() if (pos := position_of(m.meta)) is not None}

    async def stop(self, graceful: bool = True) -> None:
        """Leave the mesh and close. ``graceful=False`` (this node failed): no leave announcement,
        so peers declare it dead and treat it as a failure (a dead rollout node's shard is
        adopted; a dead trainer ends the run), never as the orderly end of the cluster."""
        try:
            await asyncio.wait_for(self.node.stop(graceful=graceful), timeout=10)
        finally:
            await asyncio.wait_for(self.channel.close(), timeout=10)


def shard_cover(rollout_ids: list[str], alive: Callable[[str], bool], shard: int) -> str | None:
    """The rollout node that covers ``shard`` now: its owner (rank ``shard``) when alive, else the
    next alive node in ring order (elasticity: it adopts the shard); None when none is alive.
    The one rule both the rollout nodes (which shards to generate) and the trainers (whose
    progress a missing shard waits on) apply."""
    n = len(rollout_ids)
    return next((rollout_ids[(shard + k) % n] for k in range(n) if alive(rollout_ids[(shard + k) % n])), None)


def not_cut_off_witness(others: list, dead_at: float, now: float, settle_s: float) -> str | None:
    """A member whose state shows this node is not the one cut off, or None.

    ``others``: mesh members (``.node_id``, ``.state``, ``.since``: ``time.time()`` of their
    last state change here); ``dead_at``: when the trainer was declared dead. A member counts
    when its leave announcement reached this node, or it is alive (not merely suspect) and has been
    since before the trainer died. One that came back *after* (this node was cut off and is
    healing: its peers reappear one by one) counts only once it has been back ``settle_s``, by
    when a trainer that is alive has refuted its death too.
    """
    for m in others:
        if m.state == "left" or (m.state == "alive" and (m.since <= dead_at or now - m.since >= settle_s)):
            return m.node_id
    return None


class PeerLostError(RuntimeError):
    """A peer this node depends on died or left."""


class ClusterStopped(PeerLostError):
    """The peers this node works for left the mesh gracefully: the cluster is being stopped."""


class GroupMemberLost(PeerLostError):
    """A member of this node's own worker group died, or is alive but stuck, or the group is hung in a
    collective (:class:`~distflow.progress.ProgressWatch`); the group cannot go on without it."""

    def __init__(self, role: str, node_ids: list[str], message: str | None = None, stuck: bool = False):
        self.role, self.node_ids = role, node_ids
        # alive but stuck, or the group hung in a collective: this node fails with its group (it does not
        # leave the mesh gracefully, which its peers would take for the orderly end of the run)
        self.stuck = stuck
        super().__init__(message or f"{role} rank {', '.join(node_ids)} died (the mesh declared it dead): the {role} "
                                    f"group cannot go on without it")
