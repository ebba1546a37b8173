"""The shared-memory mover: message payloads to same-host peers through reused POSIX shared memory.

Why it exists: between two processes on one host, copying a batch into a shared segment
and out again is several times cheaper than pushing it through TCP loopback, and it
keeps big payloads off the sockets. Everything else — signed headers, sequence numbers,
acks, backpressure, error reporting — is the link's protocol unchanged (:mod:`..link`); the
header carries ``{"seg": name, "size", "offsets"}`` instead of payload frames. The mover plugs
into its link through the link's registries (the ``shm`` payload kind, ack extras for releases,
the ``release`` reply), and the transport asks it to prepare payloads; it subclasses nothing.

Segment life cycle (no segment may outlive its processes, even under SIGKILL; names, creation
and the sweep live in :mod:`..arena`):

1. The sender owns a per-peer pool of segments in ``/dev/shm`` named
   ``distflow-shm.<pid>.<pid start time>.<random>.<n>``, created with mode 0600 and
   ``posix_fallocate`` (so a full tmpfs is a clean error, never SIGBUS). A slot is
   reused once the receiver released it (below); the pool grows as needed and keeps at
   most ``max_free_slots`` idle slots per peer.
2. The receiver maps a segment the first time it sees it, **unlinks the name right
   away** and keeps the mapping (cached) for later messages in the same slot; the
   sender unlinks it too when the first ack arrives. From then on the name is gone and
   the memory dies with the last process that maps it, whatever the way it exits.
3. A name exists only between creation and the receiver's first open. For that window:
   ``atexit`` and a SIGTERM hook (installed only if SIGTERM still has the default action)
   unlink the process's own names, and every shared-memory transport's start (or a call to
   :func:`sweep_stale_segments`) removes segments whose owner pid is gone or was reused.

Zero copy on the receiving side: the handler gets tensors that *view the segment*, and
may keep them as long as it likes. A slot is busy from the send until every tensor of
that message has been freed on the receiver (a ``weakref.finalize`` on the shared numpy
view); the release then goes back to the sender, which may reuse the slot: inside the
ack when the handler kept nothing (the slot is free, and warm, as soon as ``send`` returns),
else inside the *next* ack to that sender if one goes out within ``shm_release_delay``
(5 s; payloads under 1 MiB: an all-to-all step's parts are kept until the step is assembled,
and the next step's ack carries their releases; larger ones, e.g. weight buckets, go back to
their sender at once, without flushing other senders' deferred ones), else in a signed
``release`` message of its own over the ZMQ connection (a message of its own wakes two
processes: the cost this avoids). The ack still
comes when the handler returns (backpressure is unchanged). Slots a receiver keeps simply
make the sender's pool grow (an all-to-all producer holds two slots per consumer). Payloads
under ``shm_copy_below`` (default 0: off) are copied out of the segment on receipt instead,
and their slot is released in the ack. A receiver that wants private memory of a payload
copies (``SampleBatch.concat``/``select`` do: one copy of each byte on the receiving side).
Payload bytes in shared memory are not MACed (the signed header names the segment; segments are 0600 files of
the same uid, and any process of that uid can read the cluster secret anyway).
Peers on another host, or payloads under ``shm_min_bytes``, travel as inline frames.

Posting (:mod:`.posting`, a mover of its own, same host, kinds a peer opened a mailbox for): a part is a record in the
peer's shared-memory mailbox pointing into a buffer both map, with no message, ack or wake-up per
part; the stage handoff uses it (``buffer.redistribute.scatter``).

Zero-copy sends (``lend``): a producer that writes its payload itself (the weight gather) can
ask for a slot first and fill it in place; the first send of tensors viewing that slot copies
nothing. A lent slot is reused only after the receiver released it *and* the lender freed every
view of it (a ``weakref.finalize`` on the lent array), so the lender may keep its views.
"""

from __future__ import annotations

import asyncio
import mmap
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

import distflow.transport.codec as codec
from distflow.transport.api import Endpoint, PayloadError, RemoteError, log
from distflow.transport.arena import (
    _NAME_RE,
    MIN_SEGMENT,
    SHM_DIR,
    Mapped,
    Mappings,
    _unlink,
    create_segment,
    install_hooks,
    shm_available,
    sweep_stale_segments,
)
from distflow.transport.link import DOMAIN, Link, Outgoing, to_cpu
from distflow.transport.pool import CopyPool, size_class, smallest_fitting
from distflow.transport.select import payload_mover

MOVERS = frozenset({"socket", "shm"})

MAGIC_REL = b"DFR1"
# Copies below this run inline: a thread hop costs more than ~2 ms of copying, and the loop
# is only held for a few milliseconds (numpy releases the GIL in a worker thread above it).
COPY_OFFLOAD_BYTES = 32 << 20
# Releases of kept payloads under this size wait for the next ack (``shm_release_delay``); larger
# ones (weight buckets: a model's worth of slots) go back at once, so a sender never holds two sets.
DEFER_RELEASE_BELOW = 1 << 20


@dataclass(eq=False)
class _Slot:
    name: str
    size: int
    mm: mmap.mmap
    view: np.ndarray  # uint8 [size] over mm
    busy: bool = False
    linked: bool = True  # the /dev/shm name still exists
    use: int = 0  # incremented on every acquire; releases name the use they free
    lent: bool = False  # a caller holds tensors of it from lend(): never reused until they are freed
    lent_ptr: int = 0  # data_ptr of the lent tensor while its first send (zero-copy) is pending, else 0

    def close(self) -> None:
        if self.linked:
            _unlink(self.name)
            self.linked = False
        self.view = np.empty(0, dtype=np.uint8)
        try:
            self.mm.close()
        except BufferError:  # a tensor still views it; the mapping goes when that tensor dies
            pass


@dataclass
class _Pool:
    slots: list[_Slot] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)  # names the receiver should unmap
    shm_ok: bool = True


class ShmMover:
    """Payloads of messages to same-host peers through reused shared-memory slots (see module docstring)."""

    name = "shm"

    def __init__(
        self,
        link: Link,
        *,
        shm_min_bytes: int = 64 << 10,
        shm_copy_below: int = 0,
        shm_release_delay: float = 5.0,
        max_free_slots: int = 4,
        mapping_idle_s: float = 300.0,
        sweep_min_age: float = 2.0,
    ) -> None:
        if not shm_available():
            raise OSError(f"shared memory directory {SHM_DIR} is not available; use the zmq channel")
        if not isinstance(shm_copy_below, int) or isinstance(shm_copy_below, bool) or shm_copy_below < 0:
            raise ValueError(f"shm_copy_below must be a non-negative int (bytes), got {shm_copy_below!r}")
        if not isinstance(shm_release_delay, (int, float)) or isinstance(shm_release_delay, bool) \
                or not 0 <= shm_release_delay <= 60:
            raise ValueError(f"shm_release_delay must be a number of seconds in [0, 60], got {shm_release_delay!r}")
        self.link = link
        self.node_id = link.node_id
        self._counters = link.counters
        self._release_delay = float(shm_release_delay)
        self._shm_min_bytes = shm_min_bytes
        self._copy_below = shm_copy_below
        self._max_free_slots = max_free_slots
        self._sweep_min_age = sweep_min_age
        self._pools: dict[Endpoint, _Pool] = {}
        self.maps = Mappings(mapping_idle_s)  # senders' message slots and producers' shared buffers
        self._rel_pending: dict[bytes, tuple[str, bytes, list[list[Any]]]] = {}  # ident -> (sender, sess, slots)
        self._rel_timer: asyncio.TimerHandle | None = None  # flushes what is still deferred (shm_release_delay)
        self._rel_now: set[bytes] = set()  # senders owed a release at once (a payload >= DEFER_RELEASE_BELOW)
        self._rel_soon: asyncio.Handle | None = None  # flushes _rel_now's senders only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._rx_pool = CopyPool()  # private copies of payloads under shm_copy_below
        link.payload_movers["shm"] = self._receive_payload
        link.ack_extras.append(self._ack_extra)
        link.ack_hooks.append(self._on_ack)
        link.reply_handlers[MAGIC_REL] = self._on_release

    def start(self) -> None:
        """Before the link starts: the exit hooks, a sweep of dead processes' segments, the loop."""
        install_hooks()
        sweep_stale_segments(self._sweep_min_age)
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    def close(self) -> None:
        """After the link closed."""
        for h in (self._rel_timer, self._rel_soon):
            if h is not None:
                h.cancel()
        for pool in self._pools.values():
            for s in pool.slots:
                s.close()
        self._pools.clear()
        self.maps.clear()
        self._rx_pool.clear()

    def stats(self) -> dict[str, Any]:
        slots = [s for p in self._pools.values() for s in p.slots]
        return {
            "shm_sends": self._counters["shm_sends"],
            "shm_recvs": self._counters["shm_recvs"],
            "shm_fallbacks": self._counters["shm_fallbacks"],
            "shm_slots": len(slots),
            "shm_slot_bytes": sum(s.size for s in slots),
            "shm_slots_busy": sum(s.busy for s in slots),
            "shm_mapped": len(self.maps),
            "shm_releases_sent": self._counters["shm_releases_sent"],
            "shm_release_msgs": self._counters["shm_release_msgs"],
            "shm_zero_copy_sends": self._counters["shm_zero_copy_sends"],
        }

    # ------------------------------------------------------------------ send
    async def send(self, peer: Endpoint, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
        """One message over the link, its payload in shared memory where it can be."""
        # These NACKs mean the handler did not run. "shm_unavailable": the receiver could not open
        # the segment; retry once with a fresh one (the failed one is retired), then go inline.
        # "unsupported_payload": the receiver is a plain zmq channel; go inline at once.
        for attempt in range(3):
            try:
                return await self.link.send_message(peer, kind, meta, tensors, self.prepare)
            except RemoteError as e:
                if e.code not in ("shm_unavailable", "unsupported_payload") or attempt == 2:
                    raise
                self._counters["shm_fallbacks"] += 1
                if attempt == 1 or e.code == "unsupported_payload":
                    self._pools.setdefault(peer, _Pool()).shm_ok = False
                    log.warning("channel %s: shared memory to %s unavailable (%s); using inline frames",
                                self.node_id, peer.node_id, e.message)

    async def prepare(self, peer: Endpoint, tensors: dict[str, torch.Tensor]) -> Outgoing:
        """The payload in a slot (a lent one as is, else copied in), or the link's inline frames."""
        tensors = await to_cpu(tensors)
        headers = [codec.tensor_header(n, t) for n, t in tensors.items()] if all(
            isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in tensors.items()) else None
        if headers is None:
            return await self.link.prepare_payload(peer, tensors)  # raises a clear CodecError
        offsets, total = codec.packed_layout(headers)
        pool = self._pools.setdefault(peer, _Pool())
        lent = self._lent_slot(pool, tensors, total) if pool.shm_ok else None
        if lent is not None:  # the caller filled a lent slot in place: nothing to copy
            slot, offsets = lent
            slot.lent_ptr, slot.busy = 0, True
            slot.use += 1
            self._counters["shm_zero_copy_sends"] += 1
        elif payload_mover(MOVERS, local=self.link.is_local(peer), nbytes=total, shm_min_bytes=self._shm_min_bytes,
                           shm_ok=pool.shm_ok, lent=False) == "socket":
            return await self.link.prepare_payload(peer, tensors)
        else:
            try:
                slot = self._acquire(pool, total)
            except OSError as e:
                log.warning("channel %s: cannot allocate %d bytes of shared memory (%s); sending inline",
                            self.node_id, total, e)
                self._counters["shm_fallbacks"] += 1
                return await self.link.prepare_payload(peer, tensors)
            try:
                views = [codec.byte_view(t, n) for n, t in tensors.items()]
                if total >= COPY_OFFLOAD_BYTES:
                    await asyncio.to_thread(_copy_in, slot.view, views, offsets)
                else:
                    _copy_in(slot.view, views, offsets)
            except BaseException:  # a cancelled copy thread may still write: never reuse the slot
                self._retire(pool, slot)
                raise
        retire, pool.retired = pool.retired, []
        use = slot.use
        header = {"tens": headers, "shm": {"seg": slot.name, "use": use, "size": slot.size, "offsets": offsets,
                                           "retire": retire}}

        def release(acked: bool) -> None:
            if slot.use != use:  # already released by the receiver and reused
                return
            if acked:  # the receiver has it mapped: drop the name; the slot frees on its release
                if slot.linked:
                    _unlink(slot.name)
                    slot.linked = False
            elif slot.busy:  # the receiver may still read it later: never reuse this slot
                self._retire(pool, slot)

        self._counters["shm_sends"] += 1
        return Outgoing("shm", header, [], sum(h["nbytes"] for h in headers), release)

    def lend(self, peer: Endpoint, nbytes: int) -> torch.Tensor | None:
        """A uint8 [nbytes] tensor in a shared-memory slot for ``peer``, or None (peer not on this
        host, shared memory off, or under ``shm_min_bytes``).

        Fill it (or views of it) in place, then ``send`` tensors that view it: the first such send
        moves no payload bytes (the header names the slot and the offsets, which must be multiples
        of 64). The slot is reused only once the receiver released it AND every tensor viewing the
        lent memory here was freed, so the lender may keep its views (a retained weight version)
        as long as it likes; a later send of the same views copies them like any tensor.
        """
        pool = self._pools.setdefault(peer, _Pool())
        if nbytes < max(self._shm_min_bytes, 1) or not pool.shm_ok or not self.link.is_local(peer):
            return None
        slot = self._acquire(pool, nbytes)
        arr = np.frombuffer(slot.mm, dtype=np.uint8, count=nbytes)
        lent = torch.from_numpy(arr)  # views of it keep arr (and so the lease) alive
        slot.lent, slot.lent_ptr = True, lent.data_ptr()
        slot.busy = False  # busy again only when it is sent
        fin = weakref.finalize(arr, _end_lease, slot)
        fin.atexit = False
        return lent

    def _lent_slot(self, pool: _Pool, tensors: dict[str, torch.Tensor], total: int) -> tuple[_Slot, list[int]] | None:
        """The lent slot every tensor views (first send only), with their offsets; else None."""
        if not any(s.lent_ptr for s in pool.slots) or not tensors:
            return None
        ptrs = [t.data_ptr() for t in tensors.values()]
        for slot in pool.slots:
            if not slot.lent_ptr:
                continue
            offsets = [p - slot.lent_ptr for p in ptrs]
            if all(0 <= o and o % codec.ALIGN == 0 and o + t.numel() * t.element_size() <= slot.size
                   and t.is_contiguous() and t.device.type == "cpu"
                   for o, t in zip(offsets, tensors.values())):
                return slot, offsets
        return None

    def _acquire(self, pool: _Pool, nbytes: int) -> _Slot:
        slot = smallest_fitting(pool.slots, nbytes, lambda s: s.size, lambda s: not s.busy and not s.lent)
        if slot is not None:
            slot.busy = True
            slot.use += 1
            return slot
        free = [s for s in pool.slots if not s.busy and not s.lent]
        if len(free) >= self._max_free_slots:
            self._retire(pool, min(free, key=lambda s: s.size))
        size = size_class(nbytes, MIN_SEGMENT)
        name, mm = create_segment(size)
        slot = _Slot(name, size, mm, np.frombuffer(mm, dtype=np.uint8), busy=True)
        pool.slots.append(slot)
        return slot

    def _retire(self, pool: _Pool, slot: _Slot) -> None:
        if slot in pool.slots:
            pool.slots.remove(slot)
        pool.retired.append(slot.name)
        slot.close()

    # ------------------------------------------------------------------ releases (sender side)
    def _on_release(self, peer: Endpoint, frames: list[bytes]) -> None:
        try:
            msg = self.link.parse_reply(frames, peer, MAGIC_REL, "rel")
        except ValueError as e:
            self.link.drop("bad_release", str(e))
            return
        self._apply_releases(peer, msg.get("slots"))

    def _on_ack(self, peer: Endpoint, ack: dict[str, Any]) -> None:
        if "rel" in ack:  # releases that rode on the ack (the handler kept no view of its tensors)
            self._apply_releases(peer, ack["rel"])

    def _apply_releases(self, peer: Endpoint, slots: Any) -> None:
        pool = self._pools.get(peer)
        if pool is None or not isinstance(slots, list) or not slots:
            return
        by_name = {s.name: s for s in pool.slots}
        for item in slots:
            if not (isinstance(item, list) and len(item) == 2):
                continue
            slot = by_name.get(item[0])
            if slot is not None and slot.use == item[1]:
                slot.busy = False
                if slot.linked:
                    _unlink(slot.name)
                    slot.linked = False

    # ------------------------------------------------------------------ receive
    async def _receive_payload(self, header: dict[str, Any], payload: list[zmq.Frame],
                               ident: bytes) -> dict[str, torch.Tensor]:
        info = header.get("shm")
        if not isinstance(info, dict) or payload:
            raise PayloadError("bad_header", "shm message without a valid 'shm' section")
        sender = header["from"]
        for name in info.get("retire") or []:
            if isinstance(name, str):
                self.maps.drop(sender, name)
        self.maps.expire()
        headers = codec.validate_headers(header.get("tens"), self.link.max_message_bytes)
        name, use, offsets = info.get("seg"), info.get("use"), info.get("offsets")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise PayloadError("bad_header", f"invalid shared-memory segment name {name!r}")
        if (not isinstance(offsets, list) or len(offsets) != len(headers) or not isinstance(use, int)
                or not all(isinstance(o, int) and o >= 0 and o % codec.ALIGN == 0 for o in offsets)):
            raise PayloadError("bad_header", "shm offsets do not match the tensor headers")
        m = self.maps.get(sender, name) or self._open(sender, name)
        if any(o + h["nbytes"] > m.size for o, h in zip(offsets, headers)):
            raise PayloadError("bad_payload", f"tensor extends past the end of segment {name} ({m.size} bytes)")
        spans = [(o, o + h["nbytes"]) for o, h in zip(offsets, headers) if h["nbytes"]]
        out: dict[str, torch.Tensor] = {}
        if spans:
            lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
            arr = np.frombuffer(m.mm, dtype=np.uint8, count=hi - lo, offset=lo)
            if hi - lo < self._copy_below:  # a private copy is cheaper than a release round trip
                arr = self._rx_pool.copy(arr)
                self._queue_release(ident, sender, header["sess"], name, use, flush=False)  # rides on the ack
            else:
                fin = weakref.finalize(arr, self._release_threadsafe, ident, sender, header["sess"], name, use,
                                       hi - lo < DEFER_RELEASE_BELOW)
                fin.atexit = False
            for h, o in zip(headers, offsets):  # torch.frombuffer: one call per tensor, not three
                n = h["nbytes"]
                if n:
                    dtype, shape = codec.DTYPES[h["dtype"]], h["shape"]
                    t = torch.frombuffer(arr, dtype=dtype, count=n // dtype.itemsize, offset=o - lo)
                    out[h["name"]] = t if len(shape) == 1 else t.view(shape)
            del arr
        for h in headers:
            if not h["nbytes"]:
                out[h["name"]] = torch.empty(h["shape"], dtype=codec.DTYPES[h["dtype"]])
        self._counters["shm_recvs"] += 1
        return {h["name"]: out[h["name"]] for h in headers}

    def _open(self, sender: str, name: str) -> Mapped:
        try:
            return self.maps.open(sender, name, unlink=True)
        except FileNotFoundError:
            raise PayloadError("shm_unavailable", f"segment {name} does not exist on {self.node_id}'s host") from None
        except (OSError, ValueError) as e:
            raise PayloadError("shm_unavailable", f"cannot map segment {name}: {e}") from None

    # ------------------------------------------------------------------ releases (receiver side)
    def _release_threadsafe(self, ident: bytes, sender: str, sess: bytes, name: str, use: int,
                            defer: bool) -> None:
        """Runs when the last tensor of a message dies (any thread): queue a release to its sender."""
        loop = self._loop
        if loop is None or self.link.closed:
            return
        if threading.get_ident() == self._loop_thread:  # the usual case: no self-pipe wake-up needed
            self._queue_release(ident, sender, sess, name, use, defer=defer)
            return
        try:
            loop.call_soon_threadsafe(lambda: self._queue_release(ident, sender, sess, name, use, defer=defer))
        except RuntimeError:  # loop closed
            pass

    def _queue_release(self, ident: bytes, sender: str, sess: bytes, name: str, use: int,
                       flush: bool = True, defer: bool = False) -> None:
        entry = self._rel_pending.get(ident)
        if entry is None or entry[1] != sess:
            old, entry = entry, (sender, sess, [])
            self._rel_pending[ident] = entry  # before the send below: a release queued meanwhile lands here
            if old is not None:  # a new session on the same connection: the old one's releases go first
                self._send_releases({ident: old})
        entry[2].append([name, use])
        if not flush or self.link.closed or self._loop is None:
            return
        if defer and self._release_delay > 0:
            # the next ack to this sender carries it if one goes out within the delay (no message of
            # its own: a release message wakes two processes); else it goes alone
            if self._rel_timer is None:
                self._rel_timer = self._loop.call_later(self._release_delay, self._flush_releases)
        else:  # now, to this sender only (its deferred ones go along; other senders' keep waiting for an ack)
            self._rel_now.add(ident)
            if self._rel_soon is None:
                self._rel_soon = self._loop.call_soon(self._flush_now)

    def _ack_extra(self, ident: bytes, header: dict[str, Any]) -> dict[str, Any]:
        """Releases queued for this sender ride on the ack (one message fewer per send)."""
        entry = self._rel_pending.get(ident)
        if entry is None or entry[1] != header["sess"]:
            return {}
        del self._rel_pending[ident]
        self._rel_now.discard(ident)
        self._disarm_if_idle()
        self._counters["shm_releases_sent"] += len(entry[2])
        return {"rel": entry[2]}

    def _flush_now(self) -> None:
        """The senders owed a release at once get theirs, each in a message of its own."""
        self._rel_soon = None
        idents, self._rel_now = self._rel_now, set()
        self._send_releases({i: self._rel_pending.pop(i) for i in idents if i in self._rel_pending})
        self._disarm_if_idle()

    def _disarm_if_idle(self) -> None:
        """No release is queued any more: cancel the deferred flush, so a later deferred release
        gets its full delay to meet an ack, not the remainder of this one's."""
        if not self._rel_pending and self._rel_timer is not None:
            self._rel_timer.cancel()
            self._rel_timer = None

    def _flush_releases(self) -> None:
        """Every queued release goes now (the deferred ones whose ack did not come in time)."""
        self._rel_timer = None
        self._rel_now.clear()
        pending, self._rel_pending = self._rel_pending, {}
        self._send_releases(pending)

    def _send_releases(self, pending: dict[bytes, tuple[str, bytes, list[list[Any]]]]) -> None:
        if self.link.router is None or self.link.closed:
            return
        for ident, (sender, sess, slots) in pending.items():
            self._counters["shm_release_msgs"] += 1
            body = msgpack.packb({"t": "rel", "from": self.node_id, "to": sender, "sess": sess, "slots": slots},
                                 use_bin_type=True)
            try:
                self.link.reply_socket(ident).send_now([ident, MAGIC_REL, body, self.link.auth.tag([body], DOMAIN)],
                                                   copy=True)
                self._counters["shm_releases_sent"] += len(slots)
            except zmq.ZMQError as e:  # the sender's pool just grows; it never reuses an unreleased slot
                log.warning("channel %s: could not send shm release to %s: %s", self.node_id, sender, e)


def _end_lease(slot: _Slot) -> None:
    """Every tensor of a lend() is gone (any thread): the slot may be reused once released."""
    slot.lent = False
    slot.lent_ptr = 0


def _copy_in(dst: np.ndarray, views: list[memoryview], offsets: list[int]) -> None:
    """dst: uint8 [segment bytes]; copies each tensor's bytes to its offset.

    numpy's copy is one thread and releases the GIL: a memory-bound copy gains little from
    more threads, and an OpenMP pool in every process of a busy host would oversubscribe it.
    """
    for v, off in zip(views, offsets):
        n = v.nbytes
        if n:
            np.copyto(dst[off:off + n], np.frombuffer(v, dtype=np.uint8))
