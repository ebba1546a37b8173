"""GPU placement: which GPUs each node process of a run may see.

Why it exists: a node must never open a GPU its launcher did not give it, and two
trainer ranks on one GPU is a configuration NCCL refuses. Every launcher (``distflow
run``, the pdsh launcher, the compose GPU variant) hands each node its devices through
``CUDA_VISIBLE_DEVICES``, so inside a node its GPU is always ``cuda:0``
(:func:`distflow.device.node_device`). This module is the one rule for that, pure (no
torch, no GPU needed): given the nodes, the config keys ``device``, ``gpus`` and
``colocate``, and how many GPUs are present, it returns each node's environment, or
refuses an impossible placement before anything starts, naming the key;
:func:`plan_placement` applies it to a config's nodes, asking torch how many GPUs are
present only then (``device: cuda``).

The rule: one GPU per trainer rank, always, distinct. Rollout nodes take the GPUs left
over (round-robin; several rollout nodes may share one; with ``rollout_tensor_parallel: N`` each
takes a group of N distinct GPUs, its engine's TP ranks), or with ``colocate: true`` share
the trainers' GPUs round-robin. Nodes of a worker group (role ``worker``, e.g. a reward
model) are placed like rollout nodes. Controller nodes get no GPU. On ``device: cpu`` every node
gets ``CUDA_VISIBLE_DEVICES=""``. Each node on a GPU also learns how many nodes share it
(``DISTFLOW_GPU_NODES``), so a rollout engine's KV cache leaves the others their share, and
NCCL's async error handling and flight recorder (:data:`NCCL_FAULT_ENV`), unless the user set them.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from distflow.core.config import Config, ConfigError
from distflow.core.launch_env import GPU_NODES_ENV  # how many nodes of the run share this node's GPU
from distflow.launch.roles import node_roles

__all__ = ["GPU_NODES_ENV", "NCCL_FAULT_ENV", "PlacementError", "Slot", "describe", "gpus_present", "place", "plan_placement"]


# On by default on a GPU node: a collective whose peer died or hangs fails the rank (async error
# handling) instead of blocking it for ever, and the flight recorder keeps the last collectives of
# each rank, dumped when one times out (to TORCH_NCCL_DEBUG_INFO_TEMP_FILE, /tmp/nccl_trace_rank_<r>
# by default): what a hang's post-mortem needs, at a few MB of host memory. A value the user set in
# the launcher's environment wins (the children inherit it).
NCCL_FAULT_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                  "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def nccl_fault_env(environ: Mapping[str, str]) -> dict[str, str]:
    """:data:`NCCL_FAULT_ENV`'s keys that ``environ`` (the launcher's environment) does not set."""
    return {k: v for k, v in NCCL_FAULT_ENV.items() if k not in environ}


class PlacementError(ValueError):
    """An impossible placement; the message names the config key to change."""


@dataclass(frozen=True)
class Slot:
    """One node's placement: the physical GPU id it gets (None = no GPU) and its environment."""

    node_id: str
    role: str
    gpu: str | None  # its CUDA_VISIBLE_DEVICES: one id, or several comma-separated (rollout_tensor_parallel)
    env: dict[str, str]


def _usable(gpus: int | Sequence[int] | None, present: int | None, visible: Sequence[str] | None) -> list[str]:
    """The GPU ids (as the children's CUDA_VISIBLE_DEVICES names them) this run may use."""
    if present is not None and present < 1:
        raise PlacementError("device: cuda, but no GPU is present (CUDA_VISIBLE_DEVICES="
                             f"{','.join(visible) if visible is not None else '(unset)'}); use device: cpu")
    if gpus is None:
        if present is None:
            raise PlacementError("gpus: null (every visible GPU) needs the GPU count; give gpus as a list")
        indices = list(range(present))
    elif isinstance(gpus, int):
        if present is not None and gpus > present:
            raise PlacementError(f"gpus: {gpus} GPUs asked for, but only {present} present")
        indices = list(range(gpus))
    else:
        indices = list(gpus)
        twice = sorted({g for g in indices if indices.count(g) > 1})
        if twice or any(g < 0 for g in indices):  # two trainer ranks on one GPU: NCCL refuses at the first collective
            raise PlacementError(f"gpus: {list(gpus)} must name distinct GPU ids >= 0"
                                 + (f" ({', '.join(map(str, twice))} given twice)" if twice else ""))
        bad = [g for g in indices if present is not None and g >= present]
        if bad:
            raise PlacementError(f"gpus: {list(gpus)} names GPU(s) {bad}, but only {present} present "
                                 f"(ids 0..{present - 1})")
    # Indices count within what this launcher itself sees: map them through its CUDA_VISIBLE_DEVICES.
    return [visible[i] if visible is not None and i < len(visible) else str(i) for i in indices]


def place(nodes: Sequence[tuple[str, str]], *, device: str, gpus: int | Sequence[int] | None = None,
          colocate: bool = False, present: int | None = None,
          visible: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
          rollout_gpus: int = 1) -> list[Slot]:
    """Each node's GPU and environment.

    ``nodes``: (node_id, role) in launch order, role in trainer/rollout/worker/controller; trainer
    ranks follow sorted ids, so the i-th trainer in this list gets the i-th GPU.
    ``present``: GPUs the launcher sees (None = unknown, e.g. on a remote host: trust ``gpus``).
    ``visible``: the launcher's own CUDA_VISIBLE_DEVICES entries (None = unset), so that
    ``gpus`` indices stay relative to what the launcher was given.
    ``environ``: the launcher's environment (None: ``os.environ``); a node on a GPU gets
    :data:`NCCL_FAULT_ENV`'s keys it does not set.
    ``rollout_gpus`` (``rollout_tensor_parallel``): GPUs per rollout node, distinct, consecutive in
    the pool (its engine's TP ranks: ``cuda:0`` .. ``cuda:N-1`` of its CUDA_VISIBLE_DEVICES); rollout
    nodes take such groups round-robin (several may share one group, as they share a GPU).
    Raises :class:`PlacementError` naming the key for an impossible placement.
    """
    if device == "cpu":
        if gpus is not None:
            raise PlacementError(f"gpus: {gpus!r} is set, but device is cpu; set device: cuda or gpus: null")
        return [Slot(i, r, None, {"CUDA_VISIBLE_DEVICES": ""}) for i, r in nodes]
    if device != "cuda":
        raise PlacementError(f"device: {device!r} must be cpu or cuda")
    usable = _usable(gpus, present, visible)
    trainers = [i for i, r in nodes if r == "trainer"]
    rollouts = [i for i, r in nodes if r in ("rollout", "worker")]  # worker-group nodes place like rollout ones
    if len(trainers) > len(usable):
        raise PlacementError(f"gpus: {len(usable)} GPU(s) usable ({','.join(usable)}), but trainer_nodes="
                             f"{len(trainers)} needs one GPU per trainer rank (two NCCL ranks cannot share a GPU)")
    pool = usable[:len(trainers)] if colocate else usable[len(trainers):]
    if rollouts and not pool:
        raise PlacementError(f"gpus: the {len(trainers)} trainer rank(s) take every usable GPU "
                             f"({','.join(usable)}), none is left for the rollout nodes; give more GPUs "
                             f"or set colocate: true (rollout nodes share the trainers' GPUs)")
    given: dict[str, list[str]] = {t: [usable[k]] for k, t in enumerate(sorted(trainers))}
    engines = [i for i, r in nodes if r == "rollout"]
    if engines and rollout_gpus > 1:
        groups = [pool[k:k + rollout_gpus] for k in range(0, len(pool) - rollout_gpus + 1, rollout_gpus)]
        if not groups:
            raise PlacementError(f"rollout_tensor_parallel: {rollout_gpus} GPUs per rollout node, but only {len(pool)} "
                                 f"{'trainer GPU(s) to colocate on' if colocate else 'GPU(s) left after the trainers'}"
                                 f" ({','.join(pool)}); give more GPUs (gpus) or lower rollout_tensor_parallel")
        given.update({r: groups[k % len(groups)] for k, r in enumerate(engines)})
        rollouts = [i for i in rollouts if i not in given]  # worker-group nodes: one GPU each, as before
    given.update({r: [pool[k % len(pool)]] for k, r in enumerate(rollouts)})
    sharing = Counter(g for gs in given.values() for g in gs)  # nodes per GPU: an engine's KV cache leaves room
    slots = []
    for node_id, role in nodes:
        mine = given.get(node_id)
        gpu = ",".join(mine) if mine else None
        env = {"CUDA_VISIBLE_DEVICES": gpu if gpu is not None else "", "DISTFLOW_LOCAL_GPU": "0"}
        if mine:
            env[GPU_NODES_ENV] = str(max(sharing[g] for g in mine))
            env.update(nccl_fault_env(os.environ if environ is None else environ))
        slots.append(Slot(node_id, role, gpu, env))
    return slots


def describe(slots: Sequence[Slot]) -> str:
    """One line per GPU: which nodes it serves (or the CPU line)."""
    if all(s.gpu is None for s in slots):
        return "placement: every node on cpu (CUDA_VISIBLE_DEVICES='')"
    by_gpu: dict[str, list[str]] = {}
    for s in slots:
        by_gpu.setdefault(s.gpu if s.gpu is not None else "none", []).append(s.node_id)
    return "placement: " + "; ".join(f"GPU {g}: {', '.join(ids)}" for g, ids in by_gpu.items())


def gpus_present() -> tuple[int, list[str] | None]:
    """How many GPUs this launcher sees, and its own CUDA_VISIBLE_DEVICES entries (None = unset)."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = None if raw is None else [v.strip() for v in raw.split(",") if v.strip()]
    import torch

    return torch.cuda.device_count(), visible


def plan_placement(cfg: Config, present: int | None = None, visible: list[str] | None = None):
    """Each node's GPU environment (:func:`place` for this config's nodes); a ConfigError naming
    the key when the placement is impossible. ``present`` None: ask torch (cuda only)."""
    if cfg.device == "cuda" and present is None:
        present, visible = gpus_present()
    try:
        return place(node_roles(cfg), device=cfg.device, gpus=cfg.gpus, colocate=cfg.colocate, present=present,
                     visible=visible, rollout_gpus=cfg.rollout_tensor_parallel)
    except PlacementError as e:
        raise ConfigError(str(e)) from None
