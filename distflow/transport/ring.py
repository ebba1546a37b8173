"""Same-host posts: fixed-size records in a consumer's shared-memory mailbox, one wake-up per wait.

Why it exists: in an all-to-all stage handoff on one host every producer hands every consumer one
part per step. As a channel message with its ack, each part costs both processes a wake-up and a
few hundred Python calls (framing, signed header, replay checks, handler task, ack), so the N x N
parts of a peer-to-peer step cost more CPU than a single controller that gathers and re-splits
every byte (docs/benchmarks.md). Posting a part is writing one record into the consumer's mailbox
under a file lock; the part's bytes stay in a buffer the producer shares with its same-host
consumers (:mod:`.shared_buffers`). Nothing wakes the consumer unless it is waiting and the record
completes what it waits for (:meth:`Mailbox.arm`); it reads every new record in one pass.

A mailbox is a 0600 segment its owner (the consumer) creates, one per message kind (little-endian):

* header (64 B): magic, version, owner pid, armed flag, wanted tag, records still needed;
* ``MAX_WRITERS`` writer cells (64 B): records posted (the writer's count), records drained (the
  owner's count);
* per writer a ring of ``RING`` records of ``RECORD`` bytes: seq, tag, buffer use, blob offset and
  length, release cell, buffer name, MAC (the fields are the poster's business: :mod:`.movers.posting`).

Locking: every read-modify-write of the header, a cell or a ring holds ``flock`` on the segment
for a few microseconds, never across an await (a writer killed while holding it releases it).
Liveness: the owner holds an open-file-description write lock on byte 0 for its whole life; a
writer's non-blocking probe of it tells a live owner from a dead one, however the owner ended.
A writer is the only one to advance its own ``posted`` count, the owner the only one to advance
``drained``: a ring is full when they are ``RING`` apart, and a full ring is the writer's cue to
send the part as a message instead.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import struct
from typing import Callable

from distflow.transport.api import log
from distflow.transport.arena import open_segment

MAGIC = b"DFMB"
VERSION = 1
MAX_WRITERS = 64
RING = 8  # records a writer may have undrained: steps a producer runs ahead of its consumer
RECORD = 256
CELL = 64
HEADER = 64
WRITERS_OFF = HEADER
RINGS_OFF = WRITERS_OFF + MAX_WRITERS * CELL
SIZE = RINGS_OFF + MAX_WRITERS * RING * RECORD

_HDR = struct.Struct("<4sIIIqq")  # magic, version, owner pid, armed, wanted tag, records still needed
_ARMED = struct.Struct("<Iqq")  # armed, wanted tag, still needed (at offset 12)
_ARMED_OFF = 12
_COUNTS = struct.Struct("<QQ")  # posted, drained (a writer cell)
_U64 = struct.Struct("<Q")
_TAG = struct.Struct("<q")  # a record's tag, at offset 8
ANY_TAG = -(1 << 63)  # arm(None): any record wakes the owner

POSTED, FULL, DEAD = 0, 1, 2  # MailboxWriter.post results (RANG: POSTED and the owner must be woken)
RANG = 3


def _lock_struct(kind: int) -> bytes:
    return struct.pack("hhqqi4x", kind, 0, 0, 1, 0)  # struct flock: byte 0 only, l_pid 0 (OFD locks)


def record_offset(writer: int, seq: int) -> int:
    return RINGS_OFF + (writer * RING + seq % RING) * RECORD


class _Segment:
    """A mapped mailbox file and its fd (for the locks)."""

    def __init__(self, fd: int, mm: mmap.mmap):
        self.fd, self.mm = fd, mm

    def lock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a view still exists; the mapping goes with it
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass


class Mailbox:
    """The owner's side: created at ``path`` (an absent /dev/shm file), read by :meth:`drain`."""

    def __init__(self, path: str):
        mm, fd = open_segment(path, SIZE, create=True)
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _lock_struct(fcntl.F_WRLCK))  # held for life: liveness
        except BaseException:
            _Segment(fd, mm).close()
            os.unlink(path)
            raise
        self._seg = _Segment(fd, mm)
        _HDR.pack_into(mm, 0, MAGIC, VERSION, os.getpid(), 0, 0, 0)
        self._drained = [0] * MAX_WRITERS
        self._active: list[int] = []  # writer cells in use, in registration order

    def register(self, writer: int) -> None:
        """(Re)start writer cell ``writer`` empty: its previous writer's records are forgotten."""
        seg = self._seg
        seg.lock()
        try:
            _COUNTS.pack_into(seg.mm, WRITERS_OFF + writer * CELL, 0, 0)
        finally:
            seg.unlock()
        self._drained[writer] = 0
        if writer not in self._active:
            self._active.append(writer)

    def drain(self) -> list[tuple[int, int, bytes]]:
        """Every record posted since the last drain, as (writer, seq, record bytes); their ring slots
        are free again when this returns. An armed wait stays armed: it counts posts still to come."""
        seg, out = self._seg, []
        mm = seg.mm
        # Nothing new (a lock-free look: each count is one aligned 8-byte store): no lock taken. A post
        # landing right after is not lost: a taker arms under the lock before it sleeps, and arm() counts it.
        if all(_U64.unpack_from(mm, WRITERS_OFF + w * CELL)[0] == self._drained[w] for w in self._active):
            return out
        seg.lock()
        try:
            for w in self._active:
                cell = WRITERS_OFF + w * CELL
                posted = _U64.unpack_from(mm, cell)[0]
                start = self._drained[w]
                if posted == start:
                    continue
                if not start < posted <= start + RING:  # a writer that broke the ring protocol: skip it all
                    log.warning("mailbox: writer %d posted count %d is out of range (drained %d); skipped",
                                w, posted, start)
                    start = posted
                for seq in range(start, posted):
                    off = record_offset(w, seq)
                    out.append((w, seq, mm[off:off + RECORD]))
                self._drained[w] = posted
                _U64.pack_into(mm, cell + 8, posted)
        finally:
            seg.unlock()
        return out

    def arm(self, tag: int | None, need: int) -> bool:
        """Ask to be woken (the owner's doorbell) once ``need`` undrained records tagged ``tag`` (None:
        any) are there. True (and not armed) when they are already there: drain instead of waiting."""
        seg = self._seg
        mm = seg.mm
        want = ANY_TAG if tag is None else tag
        seg.lock()
        try:
            have = 0
            for w in self._active:
                posted = _U64.unpack_from(mm, WRITERS_OFF + w * CELL)[0]
                for seq in range(self._drained[w], min(posted, self._drained[w] + RING)):
                    if want == ANY_TAG or _TAG.unpack_from(mm, record_offset(w, seq) + 8)[0] == want:
                        have += 1
            if have >= need:
                _ARMED.pack_into(mm, _ARMED_OFF, 0, 0, 0)
                return True
            _ARMED.pack_into(mm, _ARMED_OFF, 1, want, need - have)
            return False
        finally:
            seg.unlock()

    def close(self) -> None:
        """Drops the mapping and the liveness lock: writers see the owner gone from now on."""
        self._seg.close()


class MailboxWriter:
    """A writer's side of another process's mailbox (mapped by path; the owner keeps it linked)."""

    def __init__(self, path: str, writer: int, owner_pid: int):
        if not 0 <= writer < MAX_WRITERS:
            raise ValueError(f"mailbox writer cell {writer} out of range")
        mm, fd = open_segment(path)  # (a regular file of this user)
        seg = _Segment(fd, mm)
        if len(mm) != SIZE or bytes(mm[:4]) != MAGIC or _HDR.unpack_from(mm, 0)[2] != owner_pid:
            seg.close()
            raise ValueError(f"{path} is not the mailbox of process {owner_pid} ({len(mm)} bytes)")
        self._seg = seg
        self.writer = writer
        self.owner_pid = owner_pid
        self.posted = 0  # my records so far (only I advance my cell's count)

    def alive(self) -> bool:
        """The owner still holds its life lock (a non-blocking probe; no lock is left behind)."""
        fd = self._seg.fd
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _lock_struct(fcntl.F_RDLCK))
        except OSError:
            return True  # held: the owner lives
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _lock_struct(fcntl.F_UNLCK))
        return False

    def post(self, record: bytes | bytearray, tag: int) -> int:
        """Write ``record`` (RECORD bytes, its seq field = ``self.posted``) into my ring: POSTED, RANG
        (posted, and the owner waits for it: ring its doorbell), FULL (my ring is full: nothing
        written) or DEAD (the owner re-registered my cell). The caller checks :meth:`alive`."""
        seg, cell = self._seg, WRITERS_OFF + self.writer * CELL
        mm = seg.mm
        seg.lock()
        try:
            posted, drained = _COUNTS.unpack_from(mm, cell)
            if posted != self.posted or posted - drained >= RING:
                if posted != self.posted:  # the owner re-registered my cell: I am not its writer any more
                    return DEAD
                return FULL
            off = record_offset(self.writer, posted)
            mm[off:off + RECORD] = record
            self.posted = posted + 1
            _U64.pack_into(mm, cell, self.posted)
            armed, want, need = _ARMED.unpack_from(mm, _ARMED_OFF)
            if armed and (want == ANY_TAG or want == tag):
                if need <= 1:
                    _ARMED.pack_into(mm, _ARMED_OFF, 0, 0, 0)
                    return RANG
                _ARMED.pack_into(mm, _ARMED_OFF, 1, want, need - 1)
            return POSTED
        finally:
            seg.unlock()

    def close(self) -> None:
        self._seg.close()


def bell_name(port: int) -> str:
    """The abstract datagram socket that wakes the channel whose TCP data port is ``port``."""
    return f"\0distflow-bell.{port}"


class Doorbell:
    """A channel's wake-up socket: any datagram to it (from a same-host poster) runs ``on_ring`` once
    per loop turn, however many arrived. A ring carries nothing: a forged one only wakes."""

    def __init__(self, port: int, loop, on_ring: Callable[[], None]):
        self.name = bell_name(port)
        self._loop = loop
        self._on_ring = on_ring
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(self.name)
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._out.setblocking(False)
        self.rings_sent = 0
        self.rings_received = 0
        loop.add_reader(self._sock.fileno(), self._readable)

    def _readable(self) -> None:
        got = 0
        while True:
            try:
                self._sock.recv(16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            got += 1
        if got:
            self.rings_received += got
            self._on_ring()

    def ring(self, name: str) -> None:
        """Wake the channel behind ``name`` (a full queue means a wake is pending; a gone peer is the
        poster's liveness check's business)."""
        try:
            self._out.sendto(b"!", name)
            self.rings_sent += 1
        except OSError:
            pass

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._out.close()
