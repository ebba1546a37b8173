"""Same-host tensor channel: payload through reused POSIX shared memory, control over ZMQ.

Why it exists: between two processes on one host, copying a batch into a shared segment
and out again is several times cheaper than pushing it through TCP loopback, and it
keeps big payloads off the sockets. Everything else — signed headers, sequence numbers,
acks, backpressure, error reporting — is the :class:`ZmqChannel` protocol unchanged; the
header carries ``{"seg": name, "size", "offsets"}`` instead of payload frames.

Segment life cycle (no segment may outlive its processes, even under SIGKILL):

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
   unlink the process's own names, and every ShmChannel start (or a call to
   :func:`sweep_stale_segments`) removes segments whose owner pid is gone or was reused.

Zero copy on the receiving side: the handler gets tensors that *view the segment*, and
may keep them as long as it likes. A slot is busy from the send until every tensor of
that message has been freed on the receiver (a ``weakref.finalize`` on the shared numpy
view); the release then goes back to the sender, which may reuse the slot: inside the
ack when the handler kept nothing (the common case: the slot is free, and warm, as soon as
``send`` returns), else in a signed ``release`` message over the ZMQ connection. The ack still
comes when the handler returns (backpressure is unchanged). Slots a receiver keeps simply
make the sender's pool grow. Payloads under ``shm_copy_below`` (1 MiB) are copied out of the
segment on receipt instead, and their slot is released in the ack: copying a small part costs
less than a release message (a wake-up of two processes), and an all-to-all step sends many
small parts. A receiver that wants private memory of a large payload copies
(``SampleBatch.concat``/``select`` do). Payload bytes in shared
memory are not MACed (the signed header names the segment; segments are 0600 files of
the same uid, and any process of that uid can read the cluster secret anyway).
Peers on another host, or payloads under ``shm_min_bytes``, travel as inline frames.

Zero-copy sends (``lend``): a producer that writes its payload itself (the weight gather) can
ask for a slot first and fill it in place; the first send of tensors viewing that slot copies
nothing. A lent slot is reused only after the receiver released it *and* the lender freed every
view of it (a ``weakref.finalize`` on the lent array), so the lender may keep its views.
"""

from __future__ import annotations

import asyncio
import atexit
import errno
import mmap
import os
import re
import signal
import socket
import stat
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from distflow.core.channels import codec
from distflow.core.channels.base import Endpoint, RemoteError, log
from distflow.core.channels.zmq_channel import (
    DOMAIN,
    Outgoing,
    PayloadError,
    ZmqChannel,
    _PeerOut,
    _to_cpu,
)

MAGIC_REL = b"DFR1"

SHM_DIR = "/dev/shm"
PREFIX = "distflow-shm"
_NAME_RE = re.compile(rf"^{re.escape(PREFIX)}\.(\d+)\.(\d+)\.([0-9a-f]{{8}})\.(\d+)$")
MIN_SEGMENT = 1 << 20
# Copies below this run inline: a thread hop costs more than ~2 ms of copying, and the loop
# is only held for a few milliseconds (numpy releases the GIL in a worker thread above it).
COPY_OFFLOAD_BYTES = 32 << 20

# ---------------------------------------------------------------------- process-wide registry
_owned: set[str] = set()  # names this process created and that may still exist
_owned_lock = threading.Lock()
_hooks_installed = False
_counter = 0


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def _proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/pid/stat); None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


_MY_TAG = f"{os.getpid()}.{_proc_start_ticks(os.getpid()) or 0}"


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
    except OSError as e:  # pragma: no cover - permissions etc.
        log.warning("shm: could not unlink %s: %s", name, e)
    with _owned_lock:
        _owned.discard(name)


def cleanup_owned() -> int:
    """Unlink every segment name this process still owns. Returns how many were removed."""
    with _owned_lock:
        names = list(_owned)
    for n in names:
        _unlink(n)
    return len(names)


def _on_sigterm(signum: int, frame: Any) -> None:
    cleanup_owned()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_hooks() -> None:
    global _hooks_installed, _MY_TAG
    if _hooks_installed:
        return
    _hooks_installed = True
    _MY_TAG = f"{os.getpid()}.{_proc_start_ticks(os.getpid()) or 0}"  # after a fork the pid differs
    atexit.register(cleanup_owned)
    if threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):  # pragma: no cover
            pass


def sweep_stale_segments(min_age_s: float = 2.0) -> list[str]:
    """Remove DistFlow segments whose creating process is gone (crash, SIGKILL).

    A segment belongs to ``pid`` started at ``ticks`` (both in its name); it is stale
    when no live process has that pid *and* start time. ``min_age_s`` spares segments
    created moments ago (a process in another pid namespace sharing /dev/shm).
    Returns the removed names.
    """
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        m = _NAME_RE.match(name)
        if not m:
            continue
        pid, ticks = int(m.group(1)), int(m.group(2))
        if _proc_start_ticks(pid) == ticks:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if now - os.stat(path).st_mtime < min_age_s:
                continue
            os.unlink(path)
            removed.append(name)
        except FileNotFoundError:
            continue
        except OSError as e:
            log.warning("shm sweep: could not remove %s: %s", name, e)
    if removed:
        log.info("shm sweep: removed %d stale segment(s)", len(removed))
    return removed


def _map_segment(path: str, size: int | None = None, create: bool = False) -> mmap.mmap:
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            assert size is not None
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError:
                os.close(fd)
                fd = -1
                os.unlink(path)
                raise
        else:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise PermissionError(f"{path} is not a regular file owned by this user")
            size = st.st_size
        return mmap.mmap(fd, size)
    finally:
        if fd >= 0:
            os.close(fd)


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


@dataclass(eq=False)
class _Mapping:
    mm: mmap.mmap
    size: int
    last_used: float


class ShmChannel(ZmqChannel):
    """ZmqChannel whose payloads to same-host peers go through reused shared memory."""

    transport = "shm"

    def __init__(
        self,
        node_id: str,
        secret: str | bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        shm_min_bytes: int = 64 << 10,
        shm_copy_below: int = 1 << 20,
        max_free_slots: int = 4,
        mapping_idle_s: float = 300.0,
        sweep_min_age: float = 2.0,
        **kw: Any,
    ) -> None:
        super().__init__(node_id, secret, host, port, **kw)
        if not shm_available():
            raise OSError(f"shared memory directory {SHM_DIR} is not available; use the zmq channel")
        if not isinstance(shm_copy_below, int) or isinstance(shm_copy_below, bool) or shm_copy_below < 0:
            raise ValueError(f"shm_copy_below must be a non-negative int (bytes), got {shm_copy_below!r}")
        self._shm_min_bytes = shm_min_bytes
        self._copy_below = shm_copy_below
        self._max_free_slots = max_free_slots
        self._mapping_idle_s = mapping_idle_s
        self._sweep_min_age = sweep_min_age
        self._pools: dict[Endpoint, _Pool] = {}
        self._maps: dict[tuple[str, str], _Mapping] = {}  # (sender, segment name) -> mapping
        self._local_hosts = _local_addresses(host)
        self._rel_pending: dict[bytes, tuple[str, bytes, list[list[Any]]]] = {}  # ident -> (sender, sess, slots)
        self._rel_flush: asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._rx_pool = _CopyPool()

    async def start(self) -> None:
        _install_hooks()
        sweep_stale_segments(self._sweep_min_age)
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        await super().start()

    async def close(self) -> None:
        await super().close()
        for pool in self._pools.values():
            for s in pool.slots:
                s.close()
        self._pools.clear()
        self._maps.clear()  # a mapping still viewed by live tensors is unmapped when they die

    def _extra_stats(self) -> dict[str, Any]:
        slots = [s for p in self._pools.values() for s in p.slots]
        return {
            "shm_sends": self._counters["shm_sends"],
            "shm_recvs": self._counters["shm_recvs"],
            "shm_fallbacks": self._counters["shm_fallbacks"],
            "shm_slots": len(slots),
            "shm_slot_bytes": sum(s.size for s in slots),
            "shm_slots_busy": sum(s.busy for s in slots),
            "shm_mapped": len(self._maps),
            "shm_releases_sent": self._counters["shm_releases_sent"],
            "shm_zero_copy_sends": self._counters["shm_zero_copy_sends"],
        }

    def is_local(self, peer: Endpoint) -> bool:
        return peer.host in self._local_hosts

    # ------------------------------------------------------------------ send
    async def _send(self, peer: Endpoint, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        # These NACKs mean the handler did not run. "shm_unavailable": the receiver could not open
        # the segment; retry once with a fresh one (the failed one is retired), then go inline.
        # "unsupported_payload": the receiver is a plain zmq channel; go inline at once.
        for attempt in range(3):
            try:
                await super()._send(peer, kind, meta, tensors)
                return
            except RemoteError as e:
                if e.code not in ("shm_unavailable", "unsupported_payload") or attempt == 2:
                    raise
                self._counters["shm_fallbacks"] += 1
                if attempt == 1 or e.code == "unsupported_payload":
                    self._pools.setdefault(peer, _Pool()).shm_ok = False
                    log.warning("channel %s: shared memory to %s unavailable (%s); using inline frames",
                                self.node_id, peer.node_id, e.message)

    async def _prepare_payload(self, peer: Endpoint, tensors: dict[str, torch.Tensor]) -> Outgoing:
        tensors = _to_cpu(tensors)
        headers = [codec.tensor_header(n, t) for n, t in tensors.items()] if all(
            isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in tensors.items()) else None
        if headers is None:
            return await super()._prepare_payload(peer, tensors)  # raises a clear CodecError
        offsets, total = codec.packed_layout(headers)
        pool = self._pools.setdefault(peer, _Pool())
        lent = self._lent_slot(pool, tensors, total) if pool.shm_ok else None
        if lent is not None:  # the caller filled a lent slot in place: nothing to copy
            slot, offsets = lent
            slot.lent_ptr, slot.busy = 0, True
            slot.use += 1
            self._counters["shm_zero_copy_sends"] += 1
        elif total == 0 or total < self._shm_min_bytes or not pool.shm_ok or not self.is_local(peer):
            return await super()._prepare_payload(peer, tensors)
        else:
            try:
                slot = self._acquire(pool, total)
            except OSError as e:
                log.warning("channel %s: cannot allocate %d bytes of shared memory (%s); sending inline",
                            self.node_id, total, e)
                self._counters["shm_fallbacks"] += 1
                return await super()._prepare_payload(peer, tensors)
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
        if nbytes < max(self._shm_min_bytes, 1) or not pool.shm_ok or not self.is_local(peer):
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
        free = [s for s in pool.slots if not s.busy and not s.lent]
        fitting = [s for s in free if s.size >= nbytes]
        if fitting:
            slot = min(fitting, key=lambda s: s.size)
            slot.busy = True
            slot.use += 1
            return slot
        if len(free) >= self._max_free_slots:
            self._retire(pool, min(free, key=lambda s: s.size))
        size = max(MIN_SEGMENT, 1 << (nbytes - 1).bit_length())
        global _counter
        _counter += 1
        name = f"{PREFIX}.{_MY_TAG}.{os.urandom(4).hex()}.{_counter}"
        path = os.path.join(SHM_DIR, name)
        with _owned_lock:
            _owned.add(name)
        try:
            mm = _map_segment(path, size, create=True)
        except BaseException:
            with _owned_lock:
                _owned.discard(name)
            raise
        slot = _Slot(name, size, mm, np.frombuffer(mm, dtype=np.uint8), busy=True)
        pool.slots.append(slot)
        return slot

    def _retire(self, pool: _Pool, slot: _Slot) -> None:
        if slot in pool.slots:
            pool.slots.remove(slot)
        pool.retired.append(slot.name)
        slot.close()

    # ------------------------------------------------------------------ releases (sender side)
    def _on_peer_message(self, p: _PeerOut, frames: list[bytes]) -> None:
        try:
            msg = self._parse_reply(frames, p.endpoint, MAGIC_REL, "rel")
        except ValueError as e:
            self._drop("bad_release", str(e))
            return
        self._apply_releases(p, msg.get("slots"))

    def _on_ack(self, p: _PeerOut, ack: dict[str, Any]) -> None:
        if "rel" in ack:  # releases that rode on the ack (the handler kept no view of its tensors)
            self._apply_releases(p, ack["rel"])

    def _apply_releases(self, p: _PeerOut, slots: Any) -> None:
        pool = self._pools.get(p.endpoint)
        if pool is None or not isinstance(slots, list):
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
        if header["pay"] != "shm":
            return await super()._receive_payload(header, payload, ident)
        info = header.get("shm")
        if not isinstance(info, dict) or payload:
            raise PayloadError("bad_header", "shm message without a valid 'shm' section")
        sender = header["from"]
        for name in info.get("retire") or []:
            if isinstance(name, str):
                self._maps.pop((sender, name), None)
        self._expire_mappings()
        headers = codec.validate_headers(header.get("tens"), self._max_message_bytes)
        name, use, offsets = info.get("seg"), info.get("use"), info.get("offsets")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise PayloadError("bad_header", f"invalid shared-memory segment name {name!r}")
        if (not isinstance(offsets, list) or len(offsets) != len(headers) or not isinstance(use, int)
                or not all(isinstance(o, int) and o >= 0 and o % codec.ALIGN == 0 for o in offsets)):
            raise PayloadError("bad_header", "shm offsets do not match the tensor headers")
        m = self._maps.get((sender, name))
        if m is None:
            m = self._open(sender, name)
        m.last_used = time.monotonic()
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
                fin = weakref.finalize(arr, self._release_threadsafe, ident, sender, header["sess"], name, use)
                fin.atexit = False
            base = torch.from_numpy(arr)
            del arr
            for h, o in zip(headers, offsets):
                n = h["nbytes"]
                if n:
                    out[h["name"]] = base[o - lo:o - lo + n].view(codec.DTYPES[h["dtype"]]).view(h["shape"])
            del base
        for h in headers:
            if not h["nbytes"]:
                out[h["name"]] = torch.empty(h["shape"], dtype=codec.DTYPES[h["dtype"]])
        self._counters["shm_recvs"] += 1
        return {h["name"]: out[h["name"]] for h in headers}

    def _open(self, sender: str, name: str) -> _Mapping:
        path = os.path.join(SHM_DIR, name)
        try:
            mm = _map_segment(path)
        except FileNotFoundError:
            raise PayloadError("shm_unavailable", f"segment {name} does not exist on {self.node_id}'s host") from None
        except (OSError, ValueError) as e:
            raise PayloadError("shm_unavailable", f"cannot map segment {name}: {e}") from None
        try:
            os.unlink(path)  # the mapping keeps the memory; the name must not outlive us
        except OSError as e:
            if e.errno != errno.ENOENT:
                log.warning("channel %s: could not unlink %s: %s", self.node_id, name, e)
        m = _Mapping(mm, len(mm), time.monotonic())
        self._maps[(sender, name)] = m
        return m

    def _expire_mappings(self) -> None:
        now = time.monotonic()
        for key in [k for k, m in self._maps.items() if now - m.last_used > self._mapping_idle_s]:
            del self._maps[key]  # unmapped once no tensor views it

    # ------------------------------------------------------------------ releases (receiver side)
    def _release_threadsafe(self, ident: bytes, sender: str, sess: bytes, name: str, use: int) -> None:
        """Runs when the last tensor of a message dies (any thread): queue a release to its sender."""
        loop = self._loop
        if loop is None or self._closed:
            return
        if threading.get_ident() == self._loop_thread:  # the usual case: no self-pipe wake-up needed
            self._queue_release(ident, sender, sess, name, use)
            return
        try:
            loop.call_soon_threadsafe(self._queue_release, ident, sender, sess, name, use)
        except RuntimeError:  # loop closed
            pass

    def _queue_release(self, ident: bytes, sender: str, sess: bytes, name: str, use: int,
                       flush: bool = True) -> None:
        entry = self._rel_pending.get(ident)
        if entry is None or entry[1] != sess:
            if entry is not None:  # a new session on the same connection: flush the old one first
                self._flush_releases()
            entry = self._rel_pending[ident] = (sender, sess, [])
        entry[2].append([name, use])
        if flush and self._rel_flush is None and not self._closed and self._loop is not None:
            self._rel_flush = self._loop.call_soon(self._flush_releases)

    def _ack_extra(self, ident: bytes, header: dict[str, Any]) -> dict[str, Any]:
        """Releases queued for this sender ride on the ack (one message fewer per send)."""
        entry = self._rel_pending.get(ident)
        if entry is None or entry[1] != header["sess"]:
            return {}
        del self._rel_pending[ident]
        self._counters["shm_releases_sent"] += len(entry[2])
        return {"rel": entry[2]}

    def _flush_releases(self) -> None:
        self._rel_flush = None
        pending, self._rel_pending = self._rel_pending, {}
        if self._router is None or self._closed:
            return
        for ident, (sender, sess, slots) in pending.items():
            body = msgpack.packb({"t": "rel", "from": self.node_id, "to": sender, "sess": sess, "slots": slots},
                                 use_bin_type=True)
            try:
                self._router.send_now([ident, MAGIC_REL, body, self._auth.tag([body], DOMAIN)], copy=True)
                self._counters["shm_releases_sent"] += len(slots)
            except zmq.ZMQError as e:  # the sender's pool just grows; it never reuses an unreleased slot
                log.warning("channel %s: could not send shm release to %s: %s", self.node_id, sender, e)


class _CopyPool:
    """Warm buffers for the private copies of small received payloads.

    A fresh 0.5 MiB numpy array is mmapped and page-faults on every write (~4x the cost of the
    copy itself); these buffers come back here when the last tensor viewing them dies (a
    ``weakref.finalize``, any thread: list append/pop are atomic under the GIL) and are reused.
    Sizes are rounded up to powers of two; at most ``max_free`` idle buffers per size.
    """

    def __init__(self, max_free: int = 32):
        self._free: dict[int, list[np.ndarray]] = {}
        self._max_free = max_free

    def copy(self, src: np.ndarray) -> np.ndarray:
        """A private copy of ``src`` (uint8 [n]) in a pooled buffer."""
        n = src.nbytes
        size = max(4096, 1 << (n - 1).bit_length()) if n else 4096
        free = self._free.setdefault(size, [])
        try:
            base = free.pop()
        except IndexError:
            base = np.empty(size, dtype=np.uint8)
        out = base[:n]
        np.copyto(out, src)
        fin = weakref.finalize(out, self._give_back, free, base)
        fin.atexit = False
        return out

    def _give_back(self, free: list[np.ndarray], base: np.ndarray) -> None:
        if len(free) < self._max_free:
            free.append(base)


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


def _local_addresses(host: str) -> frozenset[str]:
    names = {"127.0.0.1", "localhost", "::1", host}
    try:
        hn = socket.gethostname()
        names.add(hn)
        names.update(socket.gethostbyname_ex(hn)[2])
    except OSError:
        pass
    names.discard("0.0.0.0")
    return frozenset(names)
