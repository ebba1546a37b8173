"""What a launcher tells a node through its environment: the variable names both sides read,
and the node side's readers.

Why it exists: ``distflow run`` (and the pdsh and compose launchers) sit above the nodes, and a
node must not import its launcher to learn what it was handed (that was an import circle:
launcher -> in-process mode -> node loops -> launcher). The names live here, below both.
The cluster secret's variable is :data:`distflow.core.auth.SECRET_ENV`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["GPU_NODES_ENV", "HEAL_ENV", "LAUNCHER_PID_ENV", "RECOVER_ENV", "T0_ENV", "healing_replica", "recovering_trainers", "launch_time", "process_start_time", "run_start"]

T0_ENV = "DISTFLOW_T0"  # wall-clock start of the launcher process, for the start-up figure
LAUNCHER_PID_ENV = "DISTFLOW_LAUNCHER_PID"  # the launcher's pid, for the node's die_with_launcher
GPU_NODES_ENV = "DISTFLOW_GPU_NODES"  # how many nodes of the run share this node's GPU (distflow.launch.placement)
# Set ("1") by `distflow run` when it restarts dead trainer ranks from a checkpoint (recover_retries): a
# rollout node then waits for the trainers to come back instead of stopping at a trainer's death.
RECOVER_ENV = "DISTFLOW_RECOVER_TRAINERS"
# Set ("1") by `distflow run` on the ranks of a trainer replica group it restarts alone (trainer_replicas):
# the rank heals from a live replica; its mesh meta says so (``heal``), so the rollout nodes send it the
# steps it missed instead of going back to a checkpoint with every trainer.
HEAL_ENV = "DISTFLOW_HEAL_REPLICA"
# Set by `distflow run` on the trainer ranks it starts again (either recovery): which start of the trainers
# this is (its recovery attempt; 0 or unset: the first). The ranks of one torch.distributed group are of one
# start: a rank rendezvouses with its group's rank 0 of the same start, never with the gossiped port of that
# rank's previous life (a record the mesh may still hold for a moment).
TRAINER_START_ENV = "DISTFLOW_TRAINER_START"


def recovering_trainers() -> bool:
    """Whether this node's launcher restarts dead trainer ranks (``RECOVER_ENV``): a dead trainer is
    then a pause, not the end of the run (:meth:`distflow.runtime.Runtime.trainers_gone`)."""
    return os.environ.get(RECOVER_ENV) == "1"


def trainer_start() -> int:
    """Which start of the trainers this process is (``TRAINER_START_ENV``; 0: the first)."""
    try:
        return int(os.environ.get(TRAINER_START_ENV, "0"))
    except ValueError:
        return 0


def healing_replica() -> bool:
    """Whether this trainer process is a replica group's rank restarted alone (``HEAL_ENV``)."""
    return os.environ.get(HEAL_ENV) == "1"


def launch_time() -> float | None:
    """Wall-clock start of the ``distflow run`` that launched this process (``DISTFLOW_T0``), or None."""
    try:
        return float(os.environ[T0_ENV])
    except (KeyError, ValueError):
        return None


def process_start_time() -> float:
    """Wall-clock time this process started (from /proc; now, where there is no /proc)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # since boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def run_start() -> float:
    """When this run started: its launcher's start (``DISTFLOW_T0``), else this process's. A
    checkpoint marked before it belongs to another run (:func:`distflow.launch.checkpoint.resume_hint`)."""
    return launch_time() or process_start_time()
