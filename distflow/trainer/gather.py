"""Bucketed gather of an FSDP2 model's full weights, for publishing to rollout nodes.

Why it exists: publishing used to gather the whole unsharded model to pageable CPU memory on
every trainer rank before the first byte was sent (``Actor.full_state_dict``). That costs a
whole model of host memory on every rank, a slow pageable device->host copy on GPU, and it
serialises gather and send. :func:`iter_weight_buckets` walks the state dict in order,
gathers one parameter at a time (a collective: EVERY rank of the group must call it, in the
same order) and yields buckets of at most ``bucket_bytes`` (a single larger tensor is a
bucket of its own) as soon as they fill, so the sender can put bucket k on the wire while
bucket k+1 is gathered. Only the ranks that serve rollout peers (``keep=True``) need the full
weights: when not every rank serves, each shard owner sends its rows point-to-point to the
serving ranks only (with one serving rank of T, 1/T of an all-gather's bytes on the wire, and
the other ranks receive and copy nothing); when every rank serves, one all-gather; when none
does, nothing moves. Which of these runs is decided from the set of serving ranks, which
every rank learns the same way (a tiny all-gather of the ``keep`` flags, once per sync), so
the collectives always line up. Ranks with ``keep=False`` yield nothing.

Where a bucket lives (``place``):

* ``"device"``: the gathered tensors stay where the collective left them (the GPU on NCCL):
  for CUDA IPC export or an NCCL broadcast, no host copy at all;
* ``"pinned"`` (CUDA only): staged into one of two reusable page-locked host buffers (a
  double buffer, so bucket k+1 is copied while bucket k is sent): device->host at full PCIe
  speed, no allocation per step. The consumer must be done with a bucket before asking for
  the one after next (the buffer is reused);
* ``"cpu"``: fresh plain host tensors (the gloo/CPU case, or a consumer that keeps them).

Buckets are dicts name -> tensor (contiguous), in state-dict order; concatenated they are
exactly ``model.state_dict()`` unsharded (optionally cast to ``dtype``: every rank casts its
own rows before they travel, so fp32 master weights cross the wire as the engine's bf16, half
the bytes).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from distflow.trainer.collectives import counted
from distflow.device import iterate_on

PLACES = ("device", "pinned", "cpu")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class PinnedStaging:
    """Two reusable page-locked host buffers that CUDA buckets are staged into, in turn.

    ``stage(bucket)`` copies a dict of CUDA tensors into the next buffer (async copies on the
    current stream, then one synchronisation) and returns views of it. A buffer grows (is
    reallocated) only when a bucket does not fit.
    """

    def __init__(self, nbytes: int):
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._size = int(nbytes)
        self._turn = 0

    def stage(self, bucket: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        need = sum(_nbytes(t) + 63 for t in bucket.values())  # 64-byte aligned views
        i, self._turn = self._turn, 1 - self._turn
        buf = self._bufs[i]
        if buf is None or buf.numel() < need:
            buf = self._bufs[i] = torch.empty(max(need, self._size), dtype=torch.uint8, pin_memory=True)
        out: dict[str, torch.Tensor] = {}
        off = 0
        for name, t in bucket.items():
            off = (off + 63) // 64 * 64
            n = _nbytes(t)
            view = buf[off:off + n].view(t.dtype).view(t.shape)
            view.copy_(t, non_blocking=True)
            out[name] = view
            off += n
        cuda = [t.device for t in bucket.values() if t.is_cuda]
        if cuda:  # the copies' stream on THEIR device (the calling thread's current device may differ)
            torch.cuda.current_stream(cuda[0]).synchronize()  # the views are complete when returned
        return out


class _Gatherer:
    """Runs the per-tensor collectives of one sync; the choice of collective is the same on every rank.

    Per process group (the mesh of a DTensor) the ranks that keep the result are learnt once
    (a 1-element all-gather of the ``keep`` flags, on the group's device): every rank then
    knows the same serving set. Exactly which collective runs for a tensor depends only on
    that set, the global shape and the placements:

    * every rank keeps: one all-gather (as ``full_tensor()``), straight into ``out``;
    * some ranks keep: each shard owner sends its rows point-to-point to each keeping rank,
      which receives them straight into its rows of ``out`` (no rank that serves nobody
      receives or copies anything; on the wire: (S/T)x the all-gather's bytes for S of T ranks);
    * no rank keeps: nothing runs at all.

    Operations are issued asynchronously and waited for a bucket at a time (:meth:`take`,
    :meth:`wait`), so the small tensors of a bucket do not each pay a round trip, and the
    next bucket's transfers are under way while one is handed out.
    """

    def __init__(self, keep: bool):
        self.keep = keep
        self._servers: dict[Any, list[int]] = {}
        self._pending: list[tuple[Any, Callable[[], None] | None]] = []

    def servers(self, group: Any, world: int, device: torch.device) -> list[int]:
        """Group ranks (in order) that keep the unsharded weights (a tiny collective, once per group).

        device: the group's device (that of the shards it moves: the GPU on NCCL, also from a
        worker thread whose current CUDA device may differ)."""
        key = id(group)
        if key not in self._servers:
            import torch.distributed as dist

            flag = torch.tensor([1 if self.keep else 0], dtype=torch.int32, device=device)
            flags = torch.empty(world, dtype=torch.int32, device=device)
            counted("all_gather", getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor, flags, flag,
                    group=group)
            self._servers[key] = [r for r, f in enumerate(flags.tolist()) if f]
        return self._servers[key]

    @torch.no_grad()
    def gather_into(self, t: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype | None = None) -> None:
        """Start writing the unsharded value of ``t`` (a DTensor or a plain tensor) into ``out``
        (None on ranks that keep nothing). Complete after :meth:`wait`.

        FSDP2 shards dim 0 in ``torch.chunk`` pieces: the rows are moved straight into ``out``
        (when it is on the collective's device, else through one temporary). Other placements
        (a tensor-parallel layer's 2-D DTensor: ``docs/parallelism.md``), and uneven rows when every
        rank keeps, take ``full_tensor()`` (all-gathers over its whole mesh, on every rank) and one copy.
        ``dtype`` (the same on every rank): each rank casts its rows before they travel (fp32
        master weights -> the engine's bf16: half the bytes on the wire); ``out`` is in it.
        """
        if not hasattr(t, "full_tensor"):
            if out is not None:
                out.copy_(t.detach())
            return
        from torch.distributed.tensor import Shard

        import torch.distributed as dist

        mesh = t.device_mesh
        world = mesh.size()
        local = t.to_local().detach()
        if world == 1:
            if out is not None:
                out.copy_(local.reshape(out.shape))
            return
        rows = t.shape[0] if t.dim() else 0
        group = mesh.get_group() if tuple(t.placements) == (Shard(0),) and rows else None
        servers = self.servers(group, world, local.device) if group is not None else None
        if servers is not None and not servers:
            return  # nobody keeps the weights: no rank moves a byte
        if servers is None or (len(servers) == world and rows % world):
            # not row-sharded, or uneven rows that every rank keeps (each rank casts its shard first)
            full = (t if dtype is None else t.to(dtype)).full_tensor()
            if out is not None:
                out.copy_(full)
            return
        local = local.contiguous() if dtype is None else local.to(dtype, memory_format=torch.contiguous_format)
        direct = out is not None and out.device == local.device and out.dtype == local.dtype
        dst = out if direct else (torch.empty(t.shape, dtype=local.dtype, device=local.device)
                                  if out is not None else None)
        finish = (lambda: out.copy_(dst)) if (out is not None and not direct) else None
        if len(servers) == world:
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
            self._pending.append((counted("all_gather", gather, dst, local, group=group, async_op=True), finish))
            return
        # Shard(0) rows as torch.chunk cuts them: ceil(rows / world) each, the last ones shorter or empty
        size = -(-rows // world)
        span = [(min(r * size, rows), min((r + 1) * size, rows)) for r in range(world)]
        me = dist.get_rank(group)
        if local.shape[0] != span[me][1] - span[me][0]:
            raise RuntimeError(f"rank {me} holds {local.shape[0]} rows of a {tuple(t.shape)} tensor sharded "
                               f"{world} ways; expected {span[me][1] - span[me][0]}")
        ops = []
        if local.shape[0]:
            ops += [dist.P2POp(dist.isend, local, group=group, group_peer=s) for s in servers if s != me]
        if me in servers:
            assert dst is not None
            ops += [dist.P2POp(dist.irecv, dst[lo:hi], group=group, group_peer=r)
                    for r, (lo, hi) in enumerate(span) if r != me and hi > lo]
        works = dist.batch_isend_irecv(ops) if ops else []
        for w in works:
            self._pending.append((w, None))
        if me in servers:
            dst[span[me][0]:span[me][1]].copy_(local)  # while the other rows arrive
        if finish is not None:
            self._pending.append((None, finish))  # after every operation of this tensor

    def take(self) -> list:
        """The operations started since the last take (one bucket's), for :meth:`wait`."""
        pending, self._pending = self._pending, []
        return pending

    @staticmethod
    def wait(pending: list) -> None:
        """Wait for the operations of :meth:`take`, then run their finishing copies (the bucket is complete)."""
        for work, finish in pending:
            if work is not None:
                work.wait()
        for work, finish in pending:
            if finish is not None:
                finish()


def tied_duplicates(model: torch.nn.Module) -> list[str]:
    """Names of parameters that are another parameter under a second name (a tied LM head), all
    but the first name of each: publishing those would move the same matrix twice (for a 0.5B
    model with a 136M-parameter tied embedding, over a quarter of the bytes of every sync)."""
    from distflow.weights import tied_names

    return [name for names in tied_names(model) for name in names[1:]]


def _plan(state: dict, bucket_bytes: int, dtype: torch.dtype | None) -> list[list[tuple[str, torch.dtype, int, int]]]:
    """Buckets as lists of (name, dtype, bytes, offset in the bucket's buffer), 64-byte aligned."""
    plan: list[list[tuple[str, torch.dtype, int, int]]] = []
    size = 0
    for name, t in state.items():
        dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        n = t.numel() * dt.itemsize
        if plan and plan[-1] and size + n > bucket_bytes:
            plan.append([])
            size = 0
        if not plan:
            plan.append([])
        off = (size + 63) // 64 * 64 if plan[-1] else 0
        plan[-1].append((name, dt, n, off))
        size = off + n
    return plan


def iter_weight_buckets(model: torch.nn.Module, bucket_bytes: int, keep: bool, device: torch.device | str,
                        place: str | None = None, dtype: torch.dtype | None = None,
                        alloc: Callable[[int], torch.Tensor | None] | None = None,
                        only: Callable[[str], bool] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the model's unsharded weights in buckets of at most ``bucket_bytes`` (a collective).

    model: an FSDP2 (``fully_shard``) module, or a plain one (then no collective runs).
    bucket_bytes: > 0; a tensor bigger than this is a bucket of its own.
    keep: False on ranks that serve no rollout peer: they send their shards and yield nothing.
    device: the model's device (``distflow.device.node_device``); picks the default ``place``:
      "device" on CUDA (for IPC/NCCL), "cpu" on CPU.
    place: "device" | "pinned" | "cpu" (see the module docstring).
    dtype: cast floating-point tensors to this dtype (e.g. the rollout engine's bfloat16).
    alloc: ``alloc(nbytes) -> uint8 [nbytes] tensor or None``: where a "cpu" bucket's bytes go (e.g.
      a shared-memory slot lent by the channel, so sending it copies nothing); None = a new buffer.
    only: the state-dict names to gather (e.g. LoRA adapters only: ``weights.adapter.is_adapter``);
      None = all. The same on every rank (it decides which collectives run).
    Each bucket's tensors are 64-byte aligned views of one flat uint8 buffer. Every rank must
    consume the generator to the end (the collectives must line up). Each ``next()`` runs with
    ``device`` as the current CUDA device, from whatever thread asks.
    """
    yield from iterate_on(device, _buckets(model, bucket_bytes, keep, device, place, dtype, alloc, only))


def _buckets(model: torch.nn.Module, bucket_bytes: int, keep: bool, device: torch.device | str,
             place: str | None, dtype: torch.dtype | None, alloc: Callable[[int], torch.Tensor | None] | None,
             only: Callable[[str], bool] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    device = torch.device(device)
    place = place or ("device" if device.type == "cuda" else "cpu")
    if place not in PLACES:
        raise ValueError(f"place must be one of {PLACES}, got {place!r}")
    if place == "pinned" and device.type != "cuda":
        raise ValueError(f"place='pinned' stages CUDA tensors; the model is on {device}")
    staging = PinnedStaging(bucket_bytes) if place == "pinned" else None
    state = model.state_dict()
    for name in tied_duplicates(model):  # a tied embedding once, not twice (the engines take any alias)
        state.pop(name, None)
    if only is not None:
        state = {name: t for name, t in state.items() if only(name)}
    gatherer = _Gatherer(keep)
    # No grad-mode context may span a yield: it would leak into whatever thread runs next().
    # Two buckets in flight: bucket k+1's transfers are started before bucket k is handed out.
    started: tuple[dict[str, torch.Tensor], list] | None = None
    for bucket in _plan(state, bucket_bytes, dtype):
        buf = None
        if keep and place != "pinned":
            total = bucket[-1][3] + bucket[-1][2]
            if place == "cpu" and alloc is not None:
                buf = alloc(total)
            if buf is None:
                buf = torch.empty(max(total, 1), dtype=torch.uint8, device=device if place == "device" else "cpu")
        out: dict[str, torch.Tensor] = {}
        for name, dt, n, off in bucket:
            t = state[name]
            cast = dt if dt != t.dtype else None  # rows are cast where they live, before they travel
            if not keep:
                gatherer.gather_into(t, None, dtype=cast)
            elif place == "pinned":  # gathered on the device, staged once the bucket is complete
                out[name] = torch.empty(t.shape, dtype=dt, device=device)
                gatherer.gather_into(t, out[name], dtype=cast)
            else:
                out[name] = buf[off:off + n].view(dt).view(t.shape)
                gatherer.gather_into(t, out[name], dtype=cast)
        if started is not None:
            yield from _complete(started, keep, staging)
        started = (out, gatherer.take())
    if started is not None:
        yield from _complete(started, keep, staging)


def _complete(started: tuple[dict[str, torch.Tensor], list], keep: bool,
              staging: PinnedStaging | None) -> Iterator[dict[str, torch.Tensor]]:
    out, pending = started
    _Gatherer.wait(pending)
    if keep:
        yield staging.stage(out) if staging is not None else out
