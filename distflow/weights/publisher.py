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
soon as no send reads them (their pinned staging buffers are reused). Once every alive peer has
the newest version (its commit acked: the bytes are in the peer's memory, or for CUDA IPC held by
the peer's handles, which keep the blocks alive until it lets go), a full-sync publisher drops
its GPU copy (:meth:`WeightPublisher._drop_device_copy`): a whole model in the compute dtype
would otherwise sit on the serving rank's GPU through the next training step. A page-locked host
copy (the reused pool) stays for a peer that comes back. Delta sync keeps the GPU copy: the next
version is compared against it.

Transport per peer (``weight_transport``, see :mod:`distflow.weights.tiers`):
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
"commit": True, "num_buckets", "base", "send"}`` (plus ``"checksum"``, the whole adapter's, with
LoRA), each with the sender's ``life`` when it has one; ``send`` numbers the publisher's attempts at
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
from typing import Any, Callable, Iterable, Iterator

import torch

from distflow.core.aio import cancel_and_wait, woken
from distflow.transport import Endpoint, RemoteError, Transport
from distflow.transport.movers.nccl import sends_ready_after
from distflow.device import private_stream
from distflow.weights.inbox import BUCKET_BYTES, MAX_DELTA_LAG, SEND_WINDOW, _nbytes, _same_bytes, buckets
from distflow.transport.movers.cuda_ipc import export_ready, send_ipc
from distflow.transport.pool import PinnedPool
from distflow.weights.tiers import SYNC_MODES

log = logging.getLogger(__name__)


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
        self.commit_meta: dict[str, Any] = {}  # extra keys of the commit message (a LoRA adapter's checksum)
        self.nbytes = 0
        self.done = False
        self.aborted = False
        self.dropping = False  # its GPU buckets are being (or were) replaced by a host copy
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
    "cuda_ipc", "nccl"; see :func:`distflow.transport.select.weight_tier`). Endpoints
    are resolved at send time (a restarted node may have a new data port).
    """

    def __init__(self, channel: Transport, peers: list[str], endpoint_of: Callable[[str], Endpoint],
                 is_alive: Callable[[str], bool], timeout: float, *, sync: str = "full",
                 transport_of: Callable[[str], str] | None = None, bucket_bytes: int = BUCKET_BYTES,
                 max_delta_lag: int = MAX_DELTA_LAG, life: int | None = None):
        if sync not in SYNC_MODES:
            raise ValueError(f"weight_sync must be one of {SYNC_MODES}, got {sync!r}")
        self.channel, self.endpoint_of, self.is_alive, self.timeout = channel, endpoint_of, is_alive, timeout
        self.sync, self.bucket_bytes, self.max_delta_lag = sync, bucket_bytes, max_delta_lag
        self.transport_of = transport_of or (lambda _peer: "channel")
        self.peers = list(peers)
        # This trainer process's life (its mesh meta "boot"), on every message: a rollout node tells the
        # weights of trainers restarted from a checkpoint (an older version, accepted) from late ones.
        self.life = {} if life is None else {"life": life}
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

    async def publish_iter(self, version: int, bucket_iter: Iterator[dict[str, torch.Tensor]],
                           commit_meta: Callable[[], dict[str, Any]] | None = None) -> int:
        """Publish ``version`` from a (blocking) bucket iterator, e.g. ``iter_weight_buckets``.

        Each ``next()`` (a collective gather on the trainer) and the bucket's staging run in a
        worker thread; the peers' senders start on bucket 0 while bucket 1 is gathered. Returns
        when the iterator is exhausted (every rank must exhaust it: the gathers are collectives;
        a rank serving no peer passes ``keep=False`` and simply drains it). Returns the bytes held.
        ``commit_meta()``, called once the iterator is exhausted: keys every commit message of the
        version carries (a LoRA adapter's checksum, which only the whole version gives); a commit
        is sent only after that, since each sender waits for the version to be complete."""
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
        if commit_meta is not None:
            ver.commit_meta = dict(commit_meta())
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
        peers = [p for p in self.peers if self.transport_of(p) == "channel"]
        if not self.channel.supports("shm") or not peers:
            return None
        lend = self.channel.lend
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
                self._drop_when_loaded(ver)

    def _drop_when_loaded(self, ver: _Version) -> None:
        """Start :meth:`_drop_device_copy` of ``ver`` once every alive peer has it (full sync, GPU buckets)."""
        if (ver is not self._latest or not ver.done or ver.aborted or ver.dropping or self.sync != "full"
                or not self._keep_device or any(self.sent[p] < ver.version for p in self.peers if self.is_alive(p))):
            return
        ver.dropping = True
        task = asyncio.create_task(self._drop_device_copy(ver), name=f"weights-v{ver.version}-drop-gpu-copy")
        self._tasks.append(task)  # close() ends it with the senders

    async def _drop_device_copy(self, ver: _Version) -> None:
        """Replace ``ver``'s GPU buckets by page-locked host copies (the channel tier's, when it has
        them, else staged now in a worker thread, off the loop) and let go of the GPU ones. A send
        that starts meanwhile reads whichever it finds; both hold the same bytes."""
        host = list(ver.host) if ver.host is not None else [None] * len(ver.buckets)
        bufs = []
        for i, bucket in enumerate(list(ver.buckets)):
            if host[i] is None:
                if ver.ready[i] is not None:  # the gather's event: long done (every peer read the bucket)
                    await asyncio.to_thread(ver.ready[i].synchronize)
                host[i], buf = await asyncio.to_thread(self._pool.stage, bucket)
                bufs.append(buf)
        if ver is not self._latest or ver.aborted:  # superseded meanwhile: its memory goes with it
            for b in bufs:
                self._pool.give_back(b)
            return
        nbytes = ver.nbytes
        ver.buckets, ver.host, ver.ready = host, None, [None] * len(host)
        ver.index = {n: t for b in host for n, t in b.items()}
        ver.bufs.extend(bufs)
        self.stats["dropped_versions"] += 1
        self.stats["dropped_bytes"] += nbytes
        log.info("weights v%d: every peer has it; the GPU copy (%.1f MiB) is dropped, a host copy serves a peer "
                 "that comes back", ver.version, nbytes / (1 << 20))

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
                meta: dict[str, Any] = {"version": v, "bucket": sent, "base": base, "send": send_id, **self.life}
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
            await self.channel.send(endpoint, "weights", {**ver.commit_meta, "version": v, "commit": True,
                                                          "num_buckets": sent, "base": base, "send": send_id,
                                                          **self.life}, {},
                                    timeout=self.timeout)
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
