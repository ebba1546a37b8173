"""How weight buckets travel from a serving trainer rank to one rollout peer: the tiers.

Why it exists: the cheapest way to move a GiB of weights depends on where both ends are,
exactly as for sample parts. The tier per peer is chosen where every data-plane choice is
(:func:`distflow.transport.select.weight_tier`); the movers live in :mod:`distflow.transport`
(CUDA IPC handles, NCCL, pinned staging in :class:`distflow.transport.pool.PinnedPool`). What
stays here is weight-specific: which trainer rank serves whom, and what a rollout node does with
a bucket it holds on its GPU. The tiers:

* ``cuda_ipc`` (trainer and rollout on one GPU): the message carries CUDA IPC handles, no bytes
  (:mod:`distflow.transport.movers.cuda_ipc`, where the handles' lifetime rules are written down).
* ``nccl`` (different GPUs, on one host or several, with the NCCL data channel): the buckets
  stay on the GPU and go through the NCCL
  mover (``distflow/transport/movers/nccl.py``: one cupy communicator per direction,
  unique id over the authenticated channel, every wait under ``nccl_timeout``); per-peer
  point-to-point sends, not one broadcast communicator, because every rollout peer is served
  by its own task at its own pace (a broadcast would make the fastest wait for the slowest).
  Buckets are pipelined: bucket k+1 is gathered while bucket k is on the wire.
* ``channel`` (anything else, CPU): shared memory / ZeroMQ frames; CUDA buckets are staged
  into reusable pinned host buffers first (:class:`~distflow.transport.pool.PinnedPool`).

Which trainer rank serves which rollout node is chosen by locality too (:func:`serving_plan`):
a rollout node is served from its own GPU when a trainer rank runs there (CUDA IPC), else
from its own host (NVLink/PCIe NCCL or shared memory instead of the network), the load kept even.
"""

from __future__ import annotations

import logging

import torch

from distflow.transport.pool import PinnedPool

SYNC_MODES = ("full", "delta")
log = logging.getLogger(__name__)


def serving_plan(trainers: list[tuple[str, ...]], rollouts: list[tuple[str, ...]]) -> dict[str, list[str]]:
    """Which rollout nodes each trainer rank serves: ``{trainer id: [rollout ids]}``.

    trainers, rollouts: ``(node id, host)`` or ``(node id, host, gpu)`` (``device.gpu_identity``;
    None on CPU) in rank order. Every trainer rank computes this alone from the same member
    lists, so it is a pure, deterministic rule: each rollout node (in order) goes to the
    least-loaded trainer rank that serves fewer than ``ceil(rollouts / trainers)`` on its own
    GPU (CUDA IPC: no copy leaves the device), else on its own host, else anywhere (ties: the
    lower rank). On one host without GPU ids this is round-robin; across hosts a rollout node
    is never sent to another host while a trainer on its own host has room.
    """
    if not trainers:
        raise ValueError("serving_plan needs at least one trainer rank")
    cap = -(-len(rollouts) // len(trainers))
    plan: dict[str, list[str]] = {t[0]: [] for t in trainers}

    def gpu(node: tuple[str, ...]) -> str | None:
        return node[2] if len(node) > 2 else None

    for r in rollouts:
        rid, rhost = r[0], r[1]
        room = [t for t in trainers if len(plan[t[0]]) < cap]
        one_gpu = [t[0] for t in room if t[1] == rhost and gpu(r) is not None and gpu(t) == gpu(r)]
        pool = one_gpu or [t[0] for t in room if t[1] == rhost] or [t[0] for t in trainers]
        plan[min(pool, key=lambda t: len(plan[t]))].append(rid)  # min keeps the first (lowest rank) on ties
    return plan


# ---------------------------------------------------------------------------- held buckets
GPU_HOLD_RESERVE = 4 << 30  # device memory a rollout GPU keeps free beside buckets it holds (activations)


def spill_needed(bucket: dict[str, torch.Tensor], reserve: int = GPU_HOLD_RESERVE) -> bool:
    """Whether a received bucket must leave the GPU while the rollout node keeps it until its engine
    takes the version: it holds CUDA tensors (the NCCL tier delivers buckets in device memory) and
    the device has less than ``reserve`` bytes free (the bucket is already allocated: free memory
    is what is left beside it). Why: a version held whole on a GPU whose KV cache took most of it
    (15 GB for a 7B model in bf16) would run the engine or the next receive out of memory; the
    engine loads host buckets just as well. Cheap (no copy, no sync): call it on the event loop."""
    cuda = [t for t in bucket.values() if t.is_cuda]
    if not cuda:
        return False
    free, _ = torch.cuda.mem_get_info(cuda[0].device)
    return free < reserve


def to_host(bucket: dict[str, torch.Tensor], pool: PinnedPool) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(the bucket with its CUDA tensors copied into one page-locked host buffer of ``pool``, that
    buffer; None when nothing was on a GPU). Blocking: run it in a worker thread (it waits for the
    copy on the device's current stream, behind the engine's queued kernels, which must not stall
    the event loop). Page-locked, never pageable: the engine loads the bucket back with a
    ``non_blocking`` DMA (a pageable source makes that copy synchronous and staged through a
    driver bounce buffer, twice the traffic), and the pool's buffers are reused version after
    version (give them back once the engine has loaded the version), so torch's pinned-memory
    cache, which keeps every freed block rounded up to a power of two, never grows past what one
    held version needs."""
    cuda = [t for t in bucket.values() if t.is_cuda]
    if not cuda:
        return dict(bucket), None
    with torch.cuda.device(cuda[0].device):
        host, buf = pool.stage({k: t for k, t in bucket.items() if t.is_cuda})
    return {k: host.get(k, t) for k, t in bucket.items()}, buf


def rpc_copy(bucket: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bucket with its CUDA tensors copied to (pageable) host memory, for vLLM's
    ``collective_rpc``, which pickles its arguments to the worker processes: a copy made to be
    sent and dropped, not a bucket held while the engine waits (that is :func:`to_host`)."""
    cuda = [t for t in bucket.values() if t.is_cuda]
    if not cuda:
        return dict(bucket)
    with torch.cuda.device(cuda[0].device):
        return {k: t.to("cpu") if t.is_cuda else t for k, t in bucket.items()}
