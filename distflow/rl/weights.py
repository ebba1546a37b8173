"""Versioned, bucketed weight publication from trainers to rollout nodes (full or delta).

Why it exists: after every update the rollout nodes need the new weights, and the trainer
must never wait for them. Each rollout node is served by one trainer rank, on its own GPU or
host where one has room (``weight_transport.serving_plan``), so no trainer sends to everyone, and
only serving ranks materialise full weights.

Trainer side (:class:`WeightPublisher`): a version is ingested bucket by bucket, straight
from the bucketed FSDP gather (``distflow.trainer.gather.iter_weight_buckets`` through
:meth:`WeightPublisher.publish_iter`), while one background task per rollout peer already
sends the buckets that are in. Each task sends the newest version its peer does not have,
skips peers that are not alive, abandons a send when its peer dies, and starts over with a
full version when a peer comes back (``peer_up``). The publisher keeps the newest version
(its buckets, on the GPU for the CUDA tiers, in host memory for the channel tier) so a late
or returning peer is served without asking the trainer again; older versions are dropped as
soon as no send reads them (their pinned staging buffers are reused).

Transport per peer (``weight_transport``, see :mod:`distflow.rl.weight_transport`):
``channel`` (shm/zmq frames), ``cuda_ipc`` (handles only, device-to-device copy) or
``nccl`` (GPU buckets over the NCCL channel).

Delta sync (``weight_sync: delta``): while a version is ingested every tensor is compared,
byte for byte (:func:`_same_bytes`), with the same tensor of the previous version, which gives
each tensor the version it last changed in. A peer known to hold version h then gets only the
tensors changed after h (``base: h`` in the messages). A peer gets a full version when it
has nothing yet, (re)joined, refused a delta, or is more than ``max_delta_lag`` versions
behind.

Wire (data-plane messages of kind ``weights``): bucket messages ``{"version", "bucket": k,
"base", "send"}`` with the tensors (or ``"ipc"`` descriptors), then one commit ``{"version",
"commit": True, "num_buckets", "base", "send"}``; ``send`` numbers the publisher's attempts at
sending a version (a resend after a failure is a new attempt). Buckets may reach the handler
in any order: several are in flight, each handler runs in its own task, and a big bucket (an
embedding) is copied or streamed longer than the small one sent after it. Rollout side
(:class:`WeightInbox`): buckets are kept by index as they arrive (never concatenated); a new
attempt replaces the partial version, a late bucket of an older attempt is dropped; a version
is complete at its commit, when every index below ``num_buckets`` of that attempt is in; a
delta is accepted only on top of the version the inbox holds, and merged onto a pending, not
yet applied update. The engine gets ``(version, buckets,
is_delta)`` (:meth:`WeightInbox.take_update`) and must accept a partial set of tensors for a
delta (it applies them in place over the weights it has).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections import Counter
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch

from distflow.core.aio import cancel_and_wait, woken
from distflow.core.channels import Endpoint, Envelope, RemoteError, TensorChannel
from distflow.core.channels.nccl_channel import sends_ready_after
from distflow.device import private_stream
from distflow.rl.weight_transport import (GPU_HOLD_RESERVE, SYNC_MODES, PinnedPool, export_ready, import_ipc,
                                         release_ipc, send_ipc, spill_needed, to_host)

BUCKET_BYTES = 64 << 20
MAX_DELTA_LAG = 8
SEND_WINDOW = 2  # bucket messages in flight per peer (their handlers may finish in any order)
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
        self.received = Counter()  # "full" / "delta" versions completed
        self._partial: dict[int, _Partial] = {}
        self.stale_dropped = 0  # bucket messages of an abandoned send that arrived after its successor began
        self._changed = asyncio.Condition()

    async def receive(self, env: Envelope) -> None:
        meta = env.meta
        try:
            v = int(meta["version"])
            base = meta.get("base")
            base = None if base is None else int(base)
        except (KeyError, TypeError, ValueError) as e:
            release_ipc(meta.get("ipc") if isinstance(meta, dict) else None)
            raise ValueError(f"weights message from {env.sender} has bad meta {meta!r}: {e}") from None
        if v <= self.version:  # an old version (e.g. resent after an ack timeout): newer weights are here
            release_ipc(meta.get("ipc"))  # never opened, so the exporter's IPC counts go back now
            return
        attempt = (env.sender, meta.get("send"))
        if meta.get("commit"):
            await self._commit(env.sender, v, base, meta.get("num_buckets"), attempt)
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
        self.received_bytes += sum(_nbytes(t) for t in tensors.values())
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
                    self.pending = None  # superseded by the version being streamed in
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
                part.buckets[k] = await asyncio.to_thread(to_host, tensors)
            except BaseException:
                part.buckets.pop(k, None)  # never committed as an empty bucket
                raise

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
        if update.is_delta and self.pending is not None:  # not applied yet: the delta goes on top of it
            update = WeightUpdate(v, _merge(self.pending.buckets, got), self.pending.is_delta)
        self.pending = update
        self.received["delta" if base is not None else "full"] += 1
        for old in [k for k in self._partial if k < v]:
            del self._partial[old]
        async with self._changed:
            self.version = v
            self._changed.notify_all()

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
        return update

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
class _Superseded(Exception):
    """The version being sent was abandoned before it was complete (a newer one started)."""


class _Version:
    """One version as the publisher holds it: buckets (growing while ingested), change marks."""

    def __init__(self, version: int, floor: int):
        self.version = version
        self.floor = floor  # deltas are exact for peers holding any version >= floor
        self.buckets: list[dict[str, torch.Tensor]] = []  # as the peers' tier needs them
        self.host: list[dict[str, torch.Tensor]] | None = None  # staged host copies (GPU buckets, channel peers)
        self.changed: dict[str, int] = {}  # tensor name -> version its bytes last changed in
        self.index: dict[str, torch.Tensor] = {}
        self.bufs: list[torch.Tensor] = []  # pinned staging buffers to give back
        self.ready: list[Any] = []  # per bucket: a CUDA event recorded once it was gathered (None: host bucket)
        self.nbytes = 0
        self.done = False
        self.aborted = False
        self.readers = 0
        self.prev: _Version | None = None  # the version before, read while this one is ingested
        self._grew = asyncio.Event()

    def _notify(self) -> None:
        self._grew.set()
        self._grew = asyncio.Event()

    async def bucket(self, i: int) -> int | None:
        """Wait until bucket ``i`` is in (returns i) or the version is complete without it (None)."""
        while True:
            if self.aborted:
                raise _Superseded(f"weights v{self.version} was abandoned before it was complete")
            if i < len(self.buckets):
                return i
            if self.done:
                return None
            await self._grew.wait()


class WeightPublisher:
    """Trainer side: one background sender per rollout peer, always sending the newest version.

    ``sync``: "full" | "delta". ``transport_of(peer)``: that peer's tier ("channel" (default),
    "cuda_ipc", "nccl"; see :func:`distflow.rl.weight_transport.resolve_transport`). Endpoints
    are resolved at send time (a restarted node may have a new data port).
    """

    def __init__(self, channel: TensorChannel, peers: list[str], endpoint_of: Callable[[str], Endpoint],
                 is_alive: Callable[[str], bool], timeout: float, *, sync: str = "full",
                 transport_of: Callable[[str], str] | None = None, bucket_bytes: int = BUCKET_BYTES,
                 max_delta_lag: int = MAX_DELTA_LAG):
        if sync not in SYNC_MODES:
            raise ValueError(f"weight_sync must be one of {SYNC_MODES}, got {sync!r}")
        self.channel, self.endpoint_of, self.is_alive, self.timeout = channel, endpoint_of, is_alive, timeout
        self.sync, self.bucket_bytes, self.max_delta_lag = sync, bucket_bytes, max_delta_lag
        self.transport_of = transport_of or (lambda _peer: "channel")
        self.peers = list(peers)
        self._plan_staging({self.transport_of(p) for p in self.peers})  # an impossible tier fails here, at start
        self._pool = PinnedPool()
        self._streams: dict[str, tuple[Any, Any]] = {}  # device -> (export stream, owner)
        self._latest: _Version | None = None
        self.sent = {p: 0 for p in peers}
        self.stats: Counter[str] = Counter()  # bytes/tensors/messages sent, full and delta versions
        self._full_next: set[str] = set()
        # per peer, the future that abandons its send in flight (None when none is): a future per
        # send, so a peer_down/peer_up pair in one callback cannot set and clear it unseen
        self._abandon: dict[str, asyncio.Future | None] = {p: None for p in peers}
        self._boots: dict[str, Any] = {}  # peer -> the life (mesh meta "boot") last seen
        self._wake = asyncio.Event()
        self._sends = itertools.count(1)  # attempt numbers: the inbox tells a resend from a late message
        self._tasks = [asyncio.create_task(self._serve(p), name=f"publish-weights->{p}") for p in peers]

    @property
    def latest(self) -> tuple[int, list[dict[str, torch.Tensor]]] | None:
        v = self._latest
        return None if v is None else (v.version, v.buckets)

    # ------------------------------------------------------------------ ingest
    def _plan_staging(self, tiers: set[str]) -> None:
        """Where a version's GPU buckets are kept: on the GPU for the CUDA tiers, staged in host
        memory for the channel tier (both when the peers need both)."""
        self._keep_device = bool(tiers & {"cuda_ipc", "nccl"})
        self._need_host = "channel" in tiers or not self.peers

    def _current_tiers(self) -> set[str]:
        """The peers' tiers now: a peer's tier follows what the mesh says of it (its device, GPU and
        host), which a peer unknown at start or restarted elsewhere changes. A peer whose tier
        cannot be resolved now is left out here (its send fails, naming why, and is retried)."""
        tiers = set()
        for p in self.peers:
            try:
                tiers.add(self.transport_of(p))
            except Exception:  # noqa: BLE001 - a peer gone from the mesh (PeerLostError), an impossible tier
                continue
        return tiers

    def begin(self, version: int) -> _Version:
        prev = self._latest
        if prev is not None and version <= prev.version:
            raise ValueError(f"weights v{version} offered after v{prev.version}: versions must increase")
        if prev is not None and not prev.done:
            prev.aborted = True
            prev._notify()
            self._release(prev)
            prev = None
        tiers = self._current_tiers()
        if tiers:  # none resolves now (every peer gone or unplaceable): the last plan stands
            self._plan_staging(tiers)
        ver = _Version(version, prev.floor if prev is not None and self.sync == "delta" else version)
        self._latest = ver
        if self.sync == "delta":
            ver.prev = prev  # read while ingesting (change marks), dropped when complete
        elif prev is not None:  # full sync never reads it again: its memory (e.g. lent slots) goes back now
            self._release(prev)
        self._wake.set()
        return ver

    def _prepare(self, ver: _Version, bucket: dict[str, torch.Tensor]
                 ) -> tuple[dict, dict | None, torch.Tensor | None, dict, Any]:
        """Blocking part of ingesting one bucket (the gather's thread): staging, change marks, and
        for a bucket kept on the GPU an event recorded on the stream that gathered it, which a
        CUDA IPC export waits on (:func:`weight_transport.export_ready`) instead of everything the
        trainer has queued by the time the send runs (its next step, as a rule)."""
        host, buf, ready = None, None, None
        cuda = [t for t in bucket.values() if t.is_cuda]
        if cuda and self._need_host:
            host, buf = self._pool.stage(bucket)
        if cuda and self._keep_device:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(cuda[0].device))
        kept = bucket if (self._keep_device or not cuda) else host
        assert kept is not None
        prev = ver.prev
        marks = {}
        for name, t in kept.items():
            p = prev.index.get(name) if (prev is not None and self.sync == "delta") else None
            # (a previous version staged for another tier lives on another device: changed, sent whole once)
            same = (p is not None and p.shape == t.shape and p.dtype == t.dtype and p.device == t.device
                    and _same_bytes(p, t))
            marks[name] = prev.changed.get(name, ver.version) if same else ver.version
        return kept, (host if kept is not host else None), buf, marks, ready

    def _append(self, ver: _Version, prepared: tuple) -> None:
        kept, host, buf, marks, ready = prepared
        if ver.aborted:
            if buf is not None:
                self._pool.give_back(buf)
            return
        ver.buckets.append(kept)
        ver.ready.append(ready)
        if host is not None:
            ver.host = ver.host or [None] * (len(ver.buckets) - 1)  # type: ignore[list-item]
            ver.host.append(host)
        if buf is not None:
            ver.bufs.append(buf)
        ver.index.update(kept)
        ver.changed.update(marks)
        ver.nbytes += sum(_nbytes(t) for t in kept.values())
        ver._notify()

    def _finish(self, ver: _Version) -> None:
        if ver.aborted:
            return
        ver.done = True
        prev, ver.prev = ver.prev, None
        if prev is not None:
            self._release(prev)
        ver._notify()

    def offer(self, version: int, state: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]]) -> None:
        """Publish a whole version now: a state dict (cut into buckets) or an iterable of buckets.

        The publisher keeps the tensors (do not modify them afterwards). Blocking work (staging,
        delta comparison) runs in this call; use :meth:`publish_iter` from the trainer's loop."""
        ver = self.begin(version)
        parts = buckets(state, self.bucket_bytes) if isinstance(state, dict) else state
        for b in parts:
            if b:
                self._append(ver, self._prepare(ver, b))
        self._finish(ver)

    async def publish_iter(self, version: int, bucket_iter: Iterator[dict[str, torch.Tensor]]) -> int:
        """Publish ``version`` from a (blocking) bucket iterator, e.g. ``iter_weight_buckets``.

        Each ``next()`` (a collective gather on the trainer) and the bucket's staging run in a
        worker thread; the peers' senders start on bucket 0 while bucket 1 is gathered. Returns
        when the iterator is exhausted (every rank must exhaust it: the gathers are collectives;
        a rank serving no peer passes ``keep=False`` and simply drains it). Returns the bytes held."""
        ver = self.begin(version)
        it = iter(bucket_iter)

        def step() -> tuple | None:
            for b in it:
                if b:
                    return self._prepare(ver, b)
            return None

        try:
            while (prepared := await asyncio.to_thread(step)) is not None:
                self._append(ver, prepared)
        except BaseException:
            ver.aborted = True
            ver._notify()
            self._release(ver)
            raise
        self._finish(ver)
        return ver.nbytes

    def _release(self, ver: _Version) -> None:
        """Give a version's staging buffers back once nothing reads it (not newest, no sender)."""
        if ver is self._latest and not ver.aborted:
            return
        if self._latest is not None and self._latest.prev is ver:
            return  # the version being ingested compares against it: released by _finish
        if ver.readers == 0 and ver.bufs:
            for b in ver.bufs:
                self._pool.give_back(b)
            ver.bufs, ver.buckets, ver.host, ver.index, ver.ready = [], [], None, {}, []

    def gather_alloc(self) -> Callable[[int], torch.Tensor | None] | None:
        """An ``alloc`` for ``iter_weight_buckets``: bucket buffers lent by the channel (shared
        memory) for the first peer served over the channel tier, so the gather writes straight
        into the memory that peer reads and the send to it copies nothing (other peers get a
        copy). None when the channel cannot lend. Call on the event loop; the returned callable
        may be called from any thread (the gather runs in a worker thread)."""
        lend = getattr(self.channel, "lend", None)
        peers = [p for p in self.peers if self.transport_of(p) == "channel"]
        if lend is None or not peers:
            return None
        loop, loop_thread = asyncio.get_running_loop(), threading.get_ident()

        def on_loop(nbytes: int) -> torch.Tensor | None:
            alive = [p for p in peers if self.is_alive(p)]
            return lend(self.endpoint_of(alive[0]), nbytes) if alive else None

        def alloc(nbytes: int) -> torch.Tensor | None:
            if threading.get_ident() == loop_thread:
                return on_loop(nbytes)
            done: concurrent.futures.Future = concurrent.futures.Future()

            def run() -> None:
                try:
                    done.set_result(on_loop(nbytes))
                except BaseException as e:  # noqa: BLE001 - handed to the gather thread
                    done.set_exception(e)

            loop.call_soon_threadsafe(run)
            return done.result(timeout=self.timeout)

        return alloc

    # ------------------------------------------------------------------ peers
    def peer_up(self, node_id: str) -> None:
        """The peer restarted or returned: it may hold old weights, send it the current ones (in full)."""
        if node_id in self.sent:
            self.sent[node_id] = 0
            self._full_next.add(node_id)
            self._wake.set()

    def peer_down(self, node_id: str) -> None:
        """The peer is gone (or its life ended): the send in flight to it is abandoned."""
        f = self._abandon.get(node_id)
        if f is not None and not f.done():
            f.set_result(None)

    def member_event(self, event: str, node_id: str, boot: Any = None) -> None:
        """A mesh membership event of ``node_id`` whose life is ``boot`` (its meta "boot"; None if
        unknown): "dead" / "left" -> :meth:`peer_down`; "alive" -> :meth:`peer_up`; any other event
        with a new life (an "update": the peer restarted before anyone declared it dead) or "alive"
        with one -> both: its new life holds no weights, and the send to the old one will never be
        acked. Other events only record the life."""
        if node_id not in self.sent:
            return
        last = self._boots.get(node_id)
        if boot is not None:
            self._boots[node_id] = boot
        restarted = boot is not None and last is not None and boot != last
        if event in ("dead", "left"):
            self.peer_down(node_id)
        elif event == "alive" or restarted:
            if restarted:
                log.info("weights: %s restarted (new life): sending it the current version in full", node_id)
                self.peer_down(node_id)
            self.peer_up(node_id)

    def _delta_base(self, peer: str, ver: _Version) -> int | None:
        have = self.sent[peer]
        if (self.sync != "delta" or peer in self._full_next or have <= 0 or have < ver.floor
                or ver.version - have > self.max_delta_lag):
            return None
        return have

    async def _serve(self, peer: str) -> None:
        while True:
            ver = self._latest
            if ver is None or ver.aborted or ver.version <= self.sent[peer] or not self.is_alive(peer):
                self._wake.clear()
                await woken(self._wake.wait(), 0.5)
                continue
            send = asyncio.create_task(self._send_version(peer, ver, self._delta_base(peer, ver)),
                                       name=f"weights-v{ver.version}->{peer}")
            abandon = self._abandon[peer] = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait({send, abandon}, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:  # close(): no send outlives the publisher (nor its IPC counts)
                send.cancel()
                await asyncio.wait({send}, timeout=5.0)
                raise
            finally:
                self._abandon[peer] = None
            if not send.done():
                send.cancel()
                log.warning("weights v%d -> %s abandoned: the peer is down", ver.version, peer)
                await asyncio.gather(send, return_exceptions=True)
            elif isinstance(send.exception(), _Superseded):
                continue
            elif send.exception() is not None:
                log.warning("weights v%d -> %s failed: %s", ver.version, peer, send.exception())
                if isinstance(send.exception(), RemoteError):
                    self._full_next.add(peer)  # e.g. a delta it could not apply: resend in full
                await asyncio.sleep(0.5)
            else:
                self.sent[peer] = max(self.sent[peer], ver.version)
                self._full_next.discard(peer)

    async def _send_version(self, peer: str, ver: _Version, base: int | None) -> None:
        endpoint, tier, v = self.endpoint_of(peer), self.transport_of(peer), ver.version
        send_id = next(self._sends)
        ver.readers += 1
        window: set[asyncio.Task] = set()  # SEND_WINDOW buckets in flight: copy-in of k+1 overlaps apply of k
        try:
            i = sent = 0
            while (k := await ver.bucket(i)) is not None:
                i += 1
                src = ver.host[k] if (tier == "channel" and ver.host is not None) else ver.buckets[k]
                names = [n for n in src if base is None or ver.changed[n] > base]
                if not names:
                    continue
                part = src if len(names) == len(src) else {n: src[n] for n in names}
                meta: dict[str, Any] = {"version": v, "bucket": sent, "base": base, "send": send_id}
                if len(window) >= SEND_WINDOW:
                    done, window = await asyncio.wait(window, return_when=asyncio.FIRST_COMPLETED)
                    for t in done:  # every one looked at (no "exception never retrieved"), the first raised
                        _ = t.cancelled() or t.exception()
                    for t in done:
                        t.result()
                ready = ver.ready[k] if src is ver.buckets[k] else None
                window.add(asyncio.create_task(self._send_bucket(endpoint, tier, meta, part, ready)))
                sent += 1
                self.stats["tensors"] += len(names)
                self.stats["bytes"] += sum(_nbytes(src[n]) for n in names)
            for t in asyncio.as_completed(window):
                await t
            window = set()
            await self.channel.send(endpoint, "weights", {"version": v, "commit": True, "num_buckets": sent,
                                                          "base": base, "send": send_id}, {}, timeout=self.timeout)
            self.stats["messages"] += sent + 1
            self.stats["delta_versions" if base is not None else "full_versions"] += 1
        finally:
            for t in window:
                t.cancel()
            if window:
                await asyncio.gather(*window, return_exceptions=True)
            ver.readers -= 1
            self._release(ver)

    async def _send_bucket(self, endpoint: Endpoint, tier: str, meta: dict[str, Any],
                           part: dict[str, torch.Tensor], ready: Any = None) -> None:
        # cuda_ipc: exported right before the send (who gives its counts back: weight_transport's docstring).
        # A version staged in host memory (the peer's tier was the channel's when it was ingested) goes
        # through the channel: only CUDA memory has IPC handles.
        if tier == "cuda_ipc" and all(t.is_cuda for t in part.values()):
            stream = None if ready is None else self._export_stream(next(iter(part.values())).device)
            ipc = export_ready(part, ready, stream)
            await send_ipc(self.channel, endpoint, "weights", meta, ipc, self.timeout)
        else:  # an NCCL send waits for this bucket's gather only, as the IPC export does
            with sends_ready_after(ready):
                await self.channel.send(endpoint, "weights", meta, part, timeout=self.timeout)

    def _export_stream(self, device: torch.device) -> Any:
        """This publisher's own stream on ``device`` for IPC exports (made once)."""
        key = str(device)
        if key not in self._streams:
            self._streams[key] = private_stream(device)  # (stream, its owner: kept with it)
        return self._streams[key][0]

    async def flush(self, timeout: float) -> None:
        """Wait (bounded) until every alive peer has the newest version."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._latest is not None and loop.time() < deadline:
            if all(self.sent[p] >= self._latest.version for p in self.peers if self.is_alive(p)):
                return
            await asyncio.sleep(0.05)

    async def close(self, timeout: float = 10.0) -> None:
        """Stop every sender, bounded: a sender abandons its send in flight within 5 s; one still
        running after that is cancelled again (``cancel_and_wait``: a cancellation swallowed on
        Python 3.11, as ``wait_for`` did when it landed with the sender's wake-up, is not final)."""
        # every 6 s: past the 5 s a sender gives its send in flight to stop
        left = await cancel_and_wait(self._tasks, timeout, every=6.0)
        if left:
            log.warning("weights: %d sender(s) still running %.0fs after close: %s", len(left), timeout,
                        sorted(t.get_name() for t in left))
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                log.warning("weights: sender %s had failed: %r", t.get_name(), t.exception())


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape and dtype hold the same bytes. ``torch.equal`` compares
    values: +0.0 equals -0.0 (a sign flip would never be sent) and NaN equals nothing (a NaN
    would be resent every version)."""
    bits = _BITS.get(a.element_size())
    if bits is None or not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)  # integers and bools: equal values are equal bytes
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
