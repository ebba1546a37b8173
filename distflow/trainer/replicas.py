"""Trainer replica groups kept in step by torchft: a group that dies does not stop the others.

Why it exists: the ranks of one torch.distributed group cannot be replaced one by one, so a dead
trainer rank ends its group (``docs/recovery.md``: every rank restarts from a checkpoint). With R
replica groups, each its own FSDP group, only the dead *group* is lost: the others commit the step
without it and go on, and the restarted group copies the live weights, optimizer state and step
from a peer instead of reloading a checkpoint. The quorum, the replica-dimension process group that
is reconfigured at each quorum, and the live-state transfer are torchft's (``Manager``,
``ProcessGroupGloo``, ``LighthouseServer``): distflow writes no quorum protocol of its own. What
is distflow's here: where the lighthouse is found (the gossip mesh, :func:`publish_lighthouse` /
:func:`find_lighthouse`), which of a step's samples each replica trains (:func:`replica_share`),
and the order of one optimizer step (:class:`ReplicaSync`).

One step, on every replica group (``ReplicaSync``):

1. ``begin()``: a quorum (torchft ``start_quorum``, synchronous). A replica behind the quorum's
   step (restarted) heals first: torchft fetches a live peer's state dict and hands it to
   ``load_state_dict`` (weights, optimizer, distflow's step counter).
2. ``share(sample_ids)``: the step's samples this replica trains: ``crc32(id) mod participants ==
   participating rank``. Every replica receives the whole step, so the shares of the quorum's
   participants cover it exactly once whoever is in it.
3. Forward/backward on the share, then ``average_gradients(model)``: one flat all-reduce (AVG) over
   the quorum's replicas.
4. ``commit()`` (torchft ``should_commit``): True only when every participant got through the
   step; then the optimizer steps. False (a replica died mid-step: the all-reduce failed) leaves
   the weights untouched (the actor raises :class:`StepNotCommitted`) and ``take_step`` takes the
   same step again from ``begin()``: the new quorum's
   participants split the whole step between them, so the dead group's share is trained by the
   survivors and no sample is trained twice into the weights.

Where the lighthouse lives: in a trainer process, which names it in its mesh metadata
(``ft_lighthouse``, :func:`publish_lighthouse`); the others read it there (:func:`find_lighthouse`).
Which process hosts it, and how the groups move to another when its host dies, is the run's
business (:class:`distflow.trainer.replica_run.ReplicaLink`).
"""

from __future__ import annotations

import logging
import zlib
from datetime import timedelta
from typing import Any, Callable

import torch

from distflow.core.config import replica_layout  # noqa: F401 - the groups' ranks, the rule the config checks
from distflow.core.once import log_once

log = logging.getLogger(__name__)

__all__ = ["LIGHTHOUSE_META", "ReplicaSync", "StepNotCommitted", "actor_state_fns", "find_lighthouse", "publish_lighthouse", "replica_layout",
           "replica_share", "shard_state_fns"]

LIGHTHOUSE_META = "ft_lighthouse"  # mesh meta key: the torchft lighthouse's address, set by its host
# The lighthouse's clocks: a replica whose heartbeats stop for HEARTBEAT_S is out of the next quorum,
# and a quorum waits at most JOIN_S for replicas beyond those alive (a restarted one joins the next).
HEARTBEAT_S, JOIN_S, QUORUM_TICK_S = 2.0, 1.0, 0.1


class StepNotCommitted(RuntimeError):
    """The replica groups' quorum did not commit this optimizer step (a group died in it): the
    weights, the optimizer state and the policy version are unchanged; the step is taken again
    from a new quorum (:meth:`ReplicaSync.take_step`)."""


def replica_share(sample_ids: list[str], participants: int, rank: int) -> list[int]:
    """Indices of the samples that participant ``rank`` of ``participants`` trains: a hash of the
    sample id (crc32, the same in every process, unlike ``hash``), so the shares of one quorum are
    disjoint and cover the step whoever takes part."""
    if not 0 <= rank < participants:
        raise ValueError(f"participating rank {rank} is not one of {participants}")
    return [i for i, s in enumerate(sample_ids) if zlib.crc32(str(s).encode()) % participants == rank]


def publish_lighthouse(node: Any, host: str, min_replicas: int = 1) -> Any:
    """Start the torchft lighthouse in this process and name it in this node's mesh metadata
    (``node.set_meta``); returns the server (``shutdown()`` at the end). ``min_replicas`` 1: one
    live replica group keeps training."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"{host}:0", min_replicas=min_replicas, join_timeout_ms=int(JOIN_S * 1000),
                              quorum_tick_ms=int(QUORUM_TICK_S * 1000), heartbeat_timeout_ms=int(HEARTBEAT_S * 1000))
    node.set_meta(**{LIGHTHOUSE_META: server.address()})
    log.info("%s: torchft lighthouse at %s", node.node_id, server.address())
    return server


async def find_lighthouse(node: Any, timeout: float) -> str:
    """The lighthouse's address, from the mesh metadata of the live member that hosts it (bounded
    by ``timeout``: a TimeoutError naming what was awaited)."""
    def hosted(ms: list) -> bool:
        return any(isinstance(m.meta.get(LIGHTHOUSE_META), str) for m in ms)

    members = await node.wait_for(hosted, timeout=timeout, what="the torchft lighthouse (mesh meta ft_lighthouse)")
    return next(m.meta[LIGHTHOUSE_META] for m in members if isinstance(m.meta.get(LIGHTHOUSE_META), str))


def actor_state_fns(actor: Any) -> tuple[Callable[[], dict], Callable[[dict], None]]:
    """``(state_dict, load_state_dict)`` of an :class:`~distflow.trainer.actor.Actor` for
    :class:`ReplicaSync`: what a restarted replica copies from a live one: the weights, the optimizer
    state and the policy version. A one-rank group: the full state dicts (host copies). A group of
    several FSDP ranks: each rank's own shards (:func:`shard_state_fns`), copied rank to rank (the
    same rank of a live group has the same shards): torchft calls these from its own thread, where a
    full state dict, a collective of the group, could pair with the training's."""
    if getattr(actor, "world", 1) > 1:
        return shard_state_fns(actor)
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def state_dict() -> dict:
        return {"model": get_model_state_dict(actor.model, options=full),
                "optim": get_optimizer_state_dict(actor.model, actor.optim, options=full), "version": actor.version}

    def load_state_dict(state: dict) -> None:
        set_model_state_dict(actor.model, state["model"], options=StateDictOptions(full_state_dict=True))
        set_optimizer_state_dict(actor.model, actor.optim, state["optim"], options=StateDictOptions(full_state_dict=True))
        actor.version = int(state["version"])

    return state_dict, load_state_dict


def shard_state_fns(actor: Any) -> tuple[Callable[[], dict], Callable[[dict], None]]:
    """:func:`actor_state_fns` of one rank of a group of several: its parameter shards, buffers and
    optimizer state as host tensors (no collective), loaded into the same shards of the same rank of
    another group (its optimizer's sharded states rebuilt on this rank's mesh)."""

    def host(v: Any) -> Any:
        return _local(v).detach().cpu().clone() if torch.is_tensor(v) else v

    def state_dict() -> dict:
        optim = actor.optim.state_dict()
        return {"model": {n: host(p) for n, p in actor.model.named_parameters()},
                "buffers": {n: host(b) for n, b in actor.model.named_buffers()},
                "optim": {"state": {i: {k: host(v) for k, v in st.items()} for i, st in optim["state"].items()},
                          "param_groups": optim["param_groups"]},
                "version": actor.version}

    def load_state_dict(state: dict) -> None:
        with torch.no_grad():
            for n, p in actor.model.named_parameters():
                _local(p.data).copy_(state["model"][n])
            for n, b in actor.model.named_buffers():
                b.copy_(state["buffers"][n])
        params = [p for g in actor.optim.param_groups for p in g["params"]]
        optim = {"state": {i: {k: _like(v, params[int(i)]) for k, v in st.items()}
                           for i, st in state["optim"]["state"].items()},
                 "param_groups": state["optim"]["param_groups"]}
        actor.optim.load_state_dict(optim)
        actor.version = int(state["version"])

    return state_dict, load_state_dict


def _like(v: Any, param: torch.Tensor) -> Any:
    """An optimizer state value read as a host shard, back where ``param`` is: a sharded state (its
    local shape) as a DTensor placed as the parameter; anything else (Adam's step count) as it was."""
    if not torch.is_tensor(v) or not hasattr(param, "to_local") or v.dim() == 0 or v.shape != param.to_local().shape:
        return v
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(v.to(param.device), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _local(t: torch.Tensor) -> torch.Tensor:
    """A gradient's local tensor (an FSDP2 DTensor's shard; the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


class ReplicaSync:
    """One rank's side of its replica group's torchft manager. Rank 0 of the group (``group_rank``)
    hosts the group's torchft store (``store`` None) and manager server; the group's other ranks are
    given that store's address (``store``) and reach the server through it. Each rank all-reduces its
    own gradient shard with the ranks of the same position in the other groups, and a healing rank
    copies the state of the same rank of a live group. ``state_dict`` / ``load_state_dict``: what a
    restarted replica copies from a live one (weights, optimizer state, the step counter).
    Every wait has a deadline: ``timeout_s`` for the quorum, the all-reduce and the commit.
    ``start_step``: the steps this replica has committed already (a resumed run's, or a manager
    built again on a new lighthouse): torchft's step count, which decides who heals from whom.
    No heal at step 0 (torchft's ``init_sync`` off): the replicas start from the same weights (one
    seed, one checkpoint), and the state dict a heal reads would initialise an optimizer that has
    not stepped yet by stepping it on zero gradients (``get_optimizer_state_dict``): Adam's step
    count, one ahead, would change every later update's bias correction."""

    def __init__(self, replica_id: str, lighthouse: str, state_dict: Callable[[], dict],
                 load_state_dict: Callable[[dict], None], *, host: str, timeout_s: float, start_step: int = 0,
                 group_rank: int = 0, group_world: int = 1, store: tuple[str, int] | None = None):
        import torch.distributed as dist
        from torchft import Manager, ProcessGroupGloo

        limit = timedelta(seconds=timeout_s)
        if store is None:  # (rank 0 of the group: the store its torchft side shares with the group's other ranks)
            self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=limit)
            store = (host, self.store.port)
        self.healed = 0  # live-state copies this replica took from a peer
        self.retries = 0  # steps taken again because a quorum did not commit them
        self._load = load_state_dict

        def load(state: dict) -> None:
            self.healed += 1
            self._load(state)

        self.manager = Manager(pg=ProcessGroupGloo(timeout=limit), min_replica_size=1, load_state_dict=load,
                               state_dict=state_dict, replica_id=replica_id, store_addr=store[0],
                               store_port=store[1], rank=group_rank, world_size=group_world, lighthouse_addr=lighthouse,
                               hostname=host, port=0, use_async_quorum=False, init_sync=False, timeout=limit,
                               quorum_timeout=limit, connect_timeout=limit)
        self.manager.load_state_dict({"step": start_step, "batches_committed": 0})

    def begin(self) -> None:
        """A new quorum for the next optimizer step (heals this replica first when it is behind)."""
        self.manager.start_quorum()

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    @property
    def step(self) -> int:
        """Steps committed by the quorum (torchft's count; a healed replica takes its peer's)."""
        return self.manager.current_step()

    def share(self, sample_ids: list[str]) -> list[int]:
        """Indices of the step's samples this replica trains in the current quorum."""
        rank = self.manager.participating_rank()
        if rank is None:  # (a spare: only with torchft's FIXED_WITH_SPARES, never set here)
            return []
        return replica_share(sample_ids, self.participants, rank)

    def average_gradients(self, model: torch.nn.Module) -> None:
        """Average ``model``'s gradients over the quorum's replicas: one flat all-reduce (a
        parameter without a gradient counts as zeros, so every replica sends the same layout). The
        replica dimension's group is gloo: the tensor it is given lives on the host (a GPU's gradients
        are copied there and back, said once in the log)."""
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p.data)) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads]).float()
        if flat.device.type != "cpu":
            log_once(log, "replicas.host_gradients", logging.WARNING, "trainer replica groups average their "
                     "gradients through host memory (%.1f MiB a step on this rank): the replica dimension's "
                     "process group is gloo", flat.numel() * 4 / 2**20)
            flat = flat.cpu()
        self.manager.allreduce(flat).wait()
        off = 0
        for p, g in zip(params, grads):
            n = g.numel()
            if p.grad is not None:
                g.copy_(flat[off:off + n].view_as(g))
            off += n

    def commit(self) -> bool:
        """Whether every participant got through this step (torchft ``should_commit``): step the
        optimizer only when True; when False take the step again from :meth:`begin`."""
        return self.manager.should_commit()

    def take_step(self, train: Callable[[int], Any], attempts: int = 3) -> Any:
        """One committed step: :meth:`begin` (a quorum; a heal when behind), then ``train(step)``
        (the quorum's step: it trains :meth:`share` of that step's samples, averages the
        gradients and steps the optimizer only when :meth:`commit` says so, else raises
        :class:`StepNotCommitted`); again from :meth:`begin` while a step is not committed, at
        most ``attempts`` times. Returns what ``train`` returned."""
        for attempt in range(1, attempts + 1):
            self.begin()
            try:
                return train(self.step)
            except StepNotCommitted as e:
                self.retries += 1
                log.warning("replica step %d not committed (attempt %d of %d): %s", self.step, attempt, attempts, e)
        raise StepNotCommitted(f"step {self.step}: no quorum committed it in {attempts} attempts")

    def close(self) -> None:
        self.manager.shutdown(wait=False)
