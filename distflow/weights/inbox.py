"""The rollout side of weight sync: buckets of a version collected as they arrive, committed
whole, deltas merged (see :mod:`distflow.weights.publisher` for the protocol), and the
bucketing helpers both sides share."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, Callable, NamedTuple

import torch

from distflow.core.aio import woken
from distflow.transport import Envelope
from distflow.transport.movers.cuda_ipc import import_ipc, release_ipc
from distflow.transport.pool import PinnedPool
from distflow.weights.tiers import GPU_HOLD_RESERVE, spill_needed, to_host

BUCKET_BYTES = 64 << 20
MAX_DELTA_LAG = 8
SEND_WINDOW = 2  # bucket messages in flight per peer (their handlers may finish in any order)
CHECKSUMS_KEPT = 16  # versions whose commit checksum the inbox remembers (an engine lags a few at most)
log = logging.getLogger(__name__)


def tied_names(model: torch.nn.Module) -> list[tuple[str, ...]]:
    """The names of each parameter, in ``named_parameters`` order: a tuple of several names is one
    tensor under aliases (a tied LM head). The trainer publishes such a tensor under its first
    name only; a rollout model accepts it under any of them."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [tuple(g) for g in groups.values()]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def buckets(state: dict[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[dict[str, torch.Tensor]]:
    """A state dict cut into dicts of at most ``bucket_bytes`` (a bigger tensor alone), order kept."""
    out: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        n = _nbytes(t)
        if out[-1] and size + n > bucket_bytes:
            out.append({})
            size = 0
        out[-1][name] = t
        size += n
    return out


class _Partial:
    """A version being received: its base, the sender's attempt (``(sender, send)``), and the
    buckets that are in, by index (``{}`` for one already streamed into the engine)."""

    def __init__(self, base: int | None, attempt: tuple[str, Any]):
        self.base, self.attempt = base, attempt
        self.buckets: dict[int, dict[str, torch.Tensor]] = {}
        self.nbytes = 0  # of the buckets received, streamed ones included

    def older_than(self, attempt: tuple[str, Any]) -> bool:
        """``attempt`` is an earlier attempt of this one's sender (a late message of an abandoned send)."""
        (me, n), (them, m) = self.attempt, attempt
        return me == them and isinstance(n, int) and isinstance(m, int) and m < n


class WeightUpdate(NamedTuple):
    """What the rollout engine applies: buckets in order (later ones win on a repeated name)."""

    version: int
    buckets: list[dict[str, torch.Tensor]]
    is_delta: bool


# ============================================================================ rollout side
class WeightInbox:
    """Rollout side: collects bucket messages, keeps the newest complete version for the engine."""

    def __init__(self, device: torch.device | None = None, gpu_reserve: int = GPU_HOLD_RESERVE) -> None:
        self.gpu_reserve = gpu_reserve  # device memory kept free beside held buckets (weight_transport.hold)
        self.version = 0  # newest complete version received (0 = the initial weights)
        self.device = device  # where cuda_ipc buckets are opened (None: the exporter's device index)
        self.pending: WeightUpdate | None = None
        self.dirty = False  # a streamed version stopped half-way: the engine holds a mix, deltas are refused
        self.streaming: int | None = None  # the version being applied bucket by bucket as it arrives
        self._apply: Callable[[int, dict[str, torch.Tensor]], Any] | None = None
        self._streaming_apply: Callable[[int, dict[str, torch.Tensor]], Any] | None = None
        self.received_bytes = 0
        # Bytes received for the pending update (its deltas merged in, buckets streamed into the engine
        # included), and for the update take_update last handed out: the bytes of one weight sync.
        self.pending_bytes = self.taken_bytes = 0
        self.received = Counter()  # "full" / "delta" versions completed
        self._partial: dict[int, _Partial] = {}
        self.stale_dropped = 0  # bucket messages of an abandoned send that arrived after its successor began
        self.lives: dict[str, int] = {}  # sender -> its newest life seen (a restarted trainer has a newer one)
        # version -> the checksum its commit carried (LoRA: the whole adapter's), the newest CHECKSUMS_KEPT
        # versions; the rollout node compares what its engine applied with it (rollout.lora_apply)
        self.checksums: dict[int, str | None] = {}
        self._changed = asyncio.Condition()
        # NCCL buckets spilled off a GPU short of memory go into page-locked buffers of this pool, never
        # pageable memory (tiers.to_host); by version until the engine has the version, then lent to it
        # until the next take_update (the engine loads one update before it takes the next)
        self._pool = PinnedPool()
        self._spilled: dict[int, list[torch.Tensor]] = {}
        self._lent: list[torch.Tensor] = []
        self.spilled_bytes = 0  # bytes of NCCL buckets that had to leave the GPU (kept in page-locked memory)

    async def receive(self, env: Envelope) -> None:
        meta = env.meta
        try:
            v = int(meta["version"])
            base = meta.get("base")
            base = None if base is None else int(base)
        except (KeyError, TypeError, ValueError) as e:
            release_ipc(meta.get("ipc") if isinstance(meta, dict) else None)
            raise ValueError(f"weights message from {env.sender} has bad meta {meta!r}: {e}") from None
        life = meta.get("life")
        if isinstance(life, int) and not self.follow(env.sender, life):  # a late message of a dead trainer
            release_ipc(meta.get("ipc"))
            self.stale_dropped += 1
            return
        if v <= self.version:  # an old version (e.g. resent after an ack timeout): newer weights are here
            release_ipc(meta.get("ipc"))  # never opened, so the exporter's IPC counts go back now
            return
        attempt = (env.sender, meta.get("send"))
        if meta.get("commit"):
            checksum = meta.get("checksum")  # known before the version is: a waiter may take it at once
            self.checksums[v] = checksum if isinstance(checksum, str) else None
            for old in sorted(self.checksums)[:-CHECKSUMS_KEPT]:
                del self.checksums[old]
            try:
                await self._commit(env.sender, v, base, meta.get("num_buckets"), attempt)
            except BaseException:
                self.checksums.pop(v, None)
                raise
            return
        k = meta.get("bucket")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            release_ipc(meta.get("ipc"))
            raise ValueError(f"weights v{v} from {env.sender}: 'bucket' must be an int >= 0, got {k!r}")
        part = self._partial.get(v)
        if part is not None and part.older_than(attempt):  # a late bucket of a send that was started over
            release_ipc(meta.get("ipc"))
            self.stale_dropped += 1
            return
        tensors = import_ipc(meta["ipc"], self.device) if "ipc" in meta else dict(env.tensors)
        nbytes = sum(_nbytes(t) for t in tensors.values())
        self.received_bytes += nbytes
        # a new attempt at v (a resend after a timeout or a flap; another sender), or an index seen twice
        # (a sender that does not number its attempts) replaces the partial version: its stale buckets
        # could never match the commit
        if part is None or part.base != base or part.attempt != attempt or k in part.buckets:
            if self.streaming is not None and self.streaming != v or (part is not None and self.streaming == v):
                self.dirty = True  # the streamed version will never complete: the engine holds a mix
                self.streaming = None
            part = self._partial[v] = _Partial(base, attempt)
            if self._apply is not None and (base is None or (base == self.version and self.pending is None
                                                             and not self.dirty)):
                self.streaming, self._streaming_apply = v, self._apply  # a started version streams to its end
                if base is None:
                    self.pending, self.pending_bytes = None, 0  # superseded by the version being streamed in
        part.nbytes += nbytes
        if self.streaming == v:
            apply = self._streaming_apply
            assert apply is not None
            result = apply(v, tensors)
            if asyncio.iscoroutine(result):
                await result
            part.buckets[k] = {}  # counted, not kept
        elif "ipc" in meta or not spill_needed(tensors, self.gpu_reserve):  # kept until the engine takes it
            part.buckets[k] = tensors
        else:  # NCCL buckets leave a GPU that is short of memory, copied off the event loop
            part.buckets[k] = {}  # index claimed while the copy runs (the commit comes after this ack)
            try:
                part.buckets[k], buf = await asyncio.to_thread(to_host, tensors, self._pool)
            except BaseException:
                part.buckets.pop(k, None)  # never committed as an empty bucket
                raise
            if buf is not None:
                self._spilled.setdefault(v, []).append(buf)
                self.spilled_bytes += nbytes

    async def _commit(self, sender: str, v: int, base: int | None, num_buckets: Any, attempt: tuple[str, Any]) -> None:
        part = self._partial.get(v)
        if part is not None and part.older_than(attempt):  # a late commit of an abandoned send: keep the new one
            raise ValueError(f"weights v{v} from {sender}: commit of send {attempt[1]}, superseded by send "
                             f"{part.attempt[1]}")
        part = self._partial.pop(v, None) or _Partial(base, attempt)
        if (not isinstance(num_buckets, int) or set(part.buckets) != set(range(num_buckets)) or part.base != base
                or part.attempt != attempt):
            raise ValueError(f"weights v{v} from {sender}: commit of send {attempt[1]} for {num_buckets!r} buckets "
                             f"(base {base}) but buckets {sorted(part.buckets)} of send {part.attempt[1]} arrived "
                             f"(base {part.base})")
        got = [part.buckets[i] for i in range(num_buckets)]
        if base is not None and (base != self.version or self.dirty):
            raise ValueError(f"weights v{v} from {sender} is a delta on v{base}, but this node holds "
                             f"v{self.version}: a full version is needed")
        streamed = self.streaming == v
        if streamed:  # already in the engine: what is left is an empty partial set (moves the version on)
            self.streaming = None
            got = [b for b in got if b]
        if base is None:
            self.dirty = False
        update = WeightUpdate(v, got, base is not None or streamed)
        nbytes = part.nbytes
        if update.is_delta and self.pending is not None:  # not applied yet: the delta goes on top of it
            update = WeightUpdate(v, _merge(self.pending.buckets, got), self.pending.is_delta)
            nbytes += self.pending_bytes
        self.pending, self.pending_bytes = update, nbytes
        self.received["delta" if base is not None else "full"] += 1
        for old in [k for k in self._partial if k < v]:
            del self._partial[old]
            self._give_back(self._spilled.pop(old, []))  # never committed: nobody holds its buckets
        async with self._changed:
            self.version = v
            self._changed.notify_all()

    def follow(self, sender: str, life: int) -> bool:
        """Whether messages of ``sender``'s life ``life`` (its mesh meta "boot") count: False for an
        older life than one already seen (a late message of a process that died). A newer life of a
        known sender is a trainer restarted from a checkpoint (``recover_retries``): what this inbox
        holds is forgotten (version -1, nothing pending or half received), so the checkpoint's
        version is taken although it is older, and the node regenerates from there. Called on every
        message, and by the rollout loop as soon as the mesh shows the new life (before its weights)."""
        known = self.lives.get(sender)
        if known is not None and life < known:
            return False
        self.lives[sender] = life
        if known is not None and life > known:
            self.version, self.pending, self.streaming, self._partial = -1, None, None, {}
            self.dirty = True  # the engine holds weights of the dead life: only a full version applies
        return True

    def stream_to(self, apply: Callable[[int, dict[str, torch.Tensor]], Any] | None) -> None:
        """Apply the next versions' buckets as they arrive: ``apply(version, bucket)`` (sync or async;
        e.g. the engine's in-place load of one bucket) instead of keeping them for
        :meth:`take_update`, which then hands over an update with no buckets and ``is_delta``
        True (nothing left to copy; the engine just takes the version number).

        Only for an engine that is idle (a rollout node blocked waiting for weights): until the
        version's commit (``self.streaming`` is None again) the engine holds a mix of versions. A
        full version streams; a delta streams only onto the version the engine already holds (no
        pending update). A streamed version that never completes leaves ``dirty`` set: deltas are
        refused (the trainer resends in full) until a full version arrives. ``None`` stops."""
        self._apply = apply

    def take_update(self) -> WeightUpdate | None:
        """The newest complete weights not yet applied, as buckets (apply each in order), if any."""
        update, self.pending = self.pending, None
        self.taken_bytes, self.pending_bytes = self.pending_bytes, 0
        if update is not None:  # the engine loaded the update taken before this one: its spill buffers go back
            self._give_back(self._lent)
            self._lent = [b for old in [k for k in self._spilled if k <= update.version]
                          for b in self._spilled.pop(old)]
        return update

    def _give_back(self, bufs: list[torch.Tensor]) -> None:
        for b in bufs:
            self._pool.give_back(b)

    def take(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Like :meth:`take_update`, merged into one dict (for engines that take a state dict)."""
        update = self.take_update()
        if update is None:
            return None
        merged: dict[str, torch.Tensor] = {}
        for b in update.buckets:
            merged.update(b)
        return update.version, merged

    async def wait_for(self, version: int, timeout: float, check: Callable[[], None]) -> None:
        """Wait until weights of at least ``version`` have arrived; ``check`` raises if the trainers are gone."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.version < version:
            check()
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"no weights of version {version} within {timeout:.0f}s (have {self.version})")
            async with self._changed:
                await woken(self._changed.wait(), min(left, 1.0))


def _merge(first: list[dict[str, torch.Tensor]], then: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """``first`` then ``then``, with tensors that ``then`` replaces removed from ``first``."""
    newer = {n for b in then for n in b}
    kept = [{n: t for n, t in b.items() if n not in newer} for b in first]
    return [b for b in kept if b] + list(then)


# ============================================================================ trainer side

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape and dtype hold the same bytes. ``torch.equal`` compares
    values: +0.0 equals -0.0 (a sign flip would never be sent) and NaN equals nothing (a NaN
    would be resent every version)."""
    bits = _BITS.get(a.element_size())
    if bits is None or not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)  # integers and bools: equal values are equal bytes
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
