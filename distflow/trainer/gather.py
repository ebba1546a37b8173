"""Bucketed gather of an FSDP2 model's full weights, for publishing to rollout nodes.

Why it exists: publishing used to gather the whole unsharded model to pageable CPU memory on
every trainer rank before the first byte was sent (``Actor.full_state_dict``). That costs a
whole model of host memory on every rank, a slow pageable device->host copy on GPU, and it
serialises gather and send. :func:`iter_weight_buckets` walks the state dict in order,
all-gathers one parameter at a time (``DTensor.full_tensor`` is a collective: EVERY rank of
the group must call it, in the same order) and yields buckets of at most ``bucket_bytes``
(a single larger tensor is a bucket of its own) as soon as they fill, so the sender can
put bucket k on the wire while bucket k+1 is gathered. Ranks that serve no rollout peer
(``keep=False``) take part in the collectives and discard the result: they yield nothing.

Where a bucket lives (``place``):

* ``"device"``: the gathered tensors stay where the collective left them (the GPU on NCCL):
  for CUDA IPC export or an NCCL broadcast, no host copy at all;
* ``"pinned"`` (CUDA only): staged into one of two reusable page-locked host buffers (a
  double buffer, so bucket k+1 is copied while bucket k is sent): device->host at full PCIe
  speed, no allocation per step. The consumer must be done with a bucket before asking for
  the one after next (the buffer is reused);
* ``"cpu"``: fresh plain host tensors (the gloo/CPU case, or a consumer that keeps them).

Buckets are dicts name -> tensor (contiguous), in state-dict order; concatenated they are
exactly ``model.state_dict()`` unsharded (optionally cast to ``dtype``).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

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
        if any(t.is_cuda for t in bucket.values()):
            torch.cuda.current_stream().synchronize()  # the views are complete when returned
        return out


@torch.no_grad()
def _gather_into(t: torch.Tensor, out: torch.Tensor | None) -> None:
    """Write the unsharded value of ``t`` (a DTensor or a plain tensor) into ``out`` (a collective
    for a sharded DTensor: every rank calls it, ``out`` None on ranks that discard the result).

    FSDP2 shards dim 0 in equal chunks: when the rows divide evenly and ``out`` is on the
    collective's device, the all-gather writes straight into ``out`` (no temporary copy of the
    full tensor); otherwise ``full_tensor()`` and one copy. The choice depends only on the global
    shape and the devices, so every rank makes the same collective calls.
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
    if tuple(t.placements) == (Shard(0),) and rows and rows % world == 0 and local.shape[0] == rows // world:
        local = local.contiguous()
        direct = out is not None and out.device == local.device and out.dtype == local.dtype
        dst = out if direct else torch.empty(t.shape, dtype=local.dtype, device=local.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(dst, local, group=mesh.get_group())
        if out is not None and not direct:
            out.copy_(dst)
        return
    full = t.full_tensor()
    if out is not None:
        out.copy_(full)


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
                        ) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the model's unsharded weights in buckets of at most ``bucket_bytes`` (a collective).

    model: an FSDP2 (``fully_shard``) module, or a plain one (then no collective runs).
    bucket_bytes: > 0; a tensor bigger than this is a bucket of its own.
    keep: False on ranks that serve no rollout peer: they run every all-gather and yield nothing.
    device: the model's device (``distflow.device.node_device``); picks the default ``place``:
      "device" on CUDA (for IPC/NCCL), "cpu" on CPU.
    place: "device" | "pinned" | "cpu" (see the module docstring).
    dtype: cast floating-point tensors to this dtype (e.g. the rollout engine's bfloat16).
    alloc: ``alloc(nbytes) -> uint8 [nbytes] tensor or None``: where a "cpu" bucket's bytes go (e.g.
      a shared-memory slot lent by the channel, so sending it copies nothing); None = a new buffer.
    Each bucket's tensors are 64-byte aligned views of one flat uint8 buffer. Every rank must
    consume the generator to the end (the collectives must line up).
    """
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
    # No grad-mode context may span a yield: it would leak into whatever thread runs next().
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
            if not keep:
                _gather_into(t, None)
                continue
            if place == "pinned" or dt != t.dtype:  # gather on the device, then cast / stage
                tmp = torch.empty(t.shape, dtype=t.dtype, device=device)
                _gather_into(t, tmp)
                if place == "pinned":
                    out[name] = tmp.to(dt)
                    continue
                view = buf[off:off + n].view(dt).view(t.shape)
                view.copy_(tmp)
            else:
                view = buf[off:off + n].view(dt).view(t.shape)
                _gather_into(t, view)
            out[name] = view
        if keep:
            yield staging.stage(out) if staging is not None else out
