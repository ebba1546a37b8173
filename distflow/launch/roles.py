"""The nodes of a run and the loop each runs, written once for the three ways nodes start.

Why it exists: ``distflow-node`` (one node in this process), ``distflow run`` (one process per
node) and ``--in-process`` (every node in one asyncio loop) must agree on which nodes a config
has, what they are called, and which coroutine each runs. Each used to spell that itself;
now :func:`cluster_nodes` is the one list of nodes and :func:`role_loop` the one table from a
node's role to its loop. The loops' modules (torch) are imported only when a loop is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Coroutine

from distflow.core.config import Config

if TYPE_CHECKING:
    from distflow.runtime import Runtime

__all__ = ["KINDS", "NodeSpec", "RESTARTABLE", "cluster_nodes", "node_roles", "role_loop", "trainers_recoverable"]

# ``distflow-node --role``: controller only with `controller: single`; worker: a node of the group of
# worker_groups named by --group (its mesh role is the group's name).
KINDS = ("rollout", "trainer", "controller", "worker")
RESTARTABLE = ("rollout", "worker")  # kinds a dead node of which `distflow run` restarts alone (trainers: all ranks
# at once from a checkpoint, distflow.launch.recovery)

Loop = Callable[["Runtime"], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class NodeSpec:
    """One node of a run: its id, its kind (``--role``) and, for a worker, its group."""

    node_id: str
    kind: str
    group: str | None = None

    @property
    def role(self) -> str:
        """Its role in the mesh: the kind, or a worker's group name."""
        return self.group or self.kind


def cluster_nodes(cfg: Config) -> list[NodeSpec]:
    """Every node of ``cfg``'s run, in start order: the trainer ranks (the first is the seed
    the others join through), the rollout nodes, the controller (``controller: single``), the
    nodes of each worker group (``<group>-<i>``)."""
    counts = (("trainer", cfg.trainer_nodes), ("rollout", cfg.rollout_nodes), ("controller", cfg.controller_nodes))
    nodes = [NodeSpec(f"{kind}-{i}", kind) for kind, n in counts for i in range(n)]
    return nodes + [NodeSpec(f"{g}-{i}", "worker", g) for g, n in cfg.worker_groups.items() for i in range(n)]


def trainers_recoverable(cfg: Config) -> bool:
    """Whether `distflow run` restarts dead trainer ranks from a checkpoint (``recover_retries``):
    only where the rollout nodes feed the trainers directly. A controller (``controller: single``)
    or a worker group between them holds parts of the dead trainers' steps and does not go back
    to the checkpoint's step: there the run stops, as before."""
    return cfg.recover_retries > 0 and cfg.controller_nodes == 0 and not cfg.worker_groups


def node_roles(cfg: Config) -> list[tuple[str, str]]:
    """(node_id, kind) of every node of the run, in start order (what placement takes)."""
    return [(n.node_id, n.kind) for n in cluster_nodes(cfg)]


def role_loop(role: str) -> Loop:
    """The coroutine function a node of mesh role ``role`` runs until the run ends: the trainer's,
    the rollout's, the controller's, else (a worker group's name) the stage worker's."""
    if role == "trainer":
        from distflow.trainer.worker import run_trainer

        return run_trainer
    if role == "rollout":
        from distflow.rollout.worker import run_rollout

        return run_rollout
    if role == "controller":
        from distflow.controller import run_controller

        return run_controller
    from distflow.stage_worker import run_stage_worker

    return run_stage_worker
