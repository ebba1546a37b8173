"""The posting mover: same-host stage handoffs without a message per part.

Why it exists: an all-to-all handoff of one step on one host is N x N parts, and as channel
messages each part costs both processes a wake-up and a few hundred Python calls with its ack.
Here a part is a record in the consumer's mailbox (:mod:`..ring`: one wake-up per wait, none
per part) pointing into a buffer the producer shares with every local consumer
(:mod:`..shared_buffers`: packed once, released by a store into a cell). :class:`Posting`, a mover
a shared-memory transport has beside its link and its shared-memory mover, gives it both ends:

* consumer: ``open_mailbox(kind)`` returns an :class:`Inbox`; ``Inbox.drain()`` turns every new
  record into a :class:`Post` (verified: its sender, its meta, a view of its bytes in the
  producer's buffer, released explicitly or when kept views die), ``Inbox.arm(tag, need)`` asks for
  the doorbell once ``need`` records tagged ``tag`` are there, and ``Inbox.waker`` is called when
  it rings.
* producer: ``await poster(peer, kind)`` (None when ``peer`` has no mailbox for ``kind`` on this
  host; asked again after ``RETRY_S``), ``await shared_buffer(nbytes, reserve)`` (a free pool
  buffer, else a new one, introduced to every consumer before use), ``post(poster, buf, tag, meta,
  lo, hi)`` (bytes [lo, hi) of the buffer; False: send that part as a message instead: the ring is
  full, the mailbox's owner is gone, or the buffer's meta area is), then ``finish(buf)``.

Introductions are signed channel messages of the internal kind ``__mbox``, acked after the consumer
mapped the buffers they name; the first one's reply names the mailbox, a writer cell, the owner's
pid and doorbell. A poster becomes active only once its consumer maps every buffer of the pool,
and a new buffer is introduced to every active poster before any record names it: a record never
names a buffer its consumer cannot read, and a part posted by a producer that then dies stays
readable (the consumer maps the memory).

Delivery: a post is delivered once its record is in the mailbox, which lives and dies with the
consumer's process as its buffer shard does; the consumer reads it when it needs it (when it takes
the step), not when it arrives. A post has no ack: what the consumer cannot use it drops and counts
(``stats()["mailbox"]``), as it does malformed messages.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import struct
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import msgpack
import numpy as np

import distflow.transport.codec as codec
from distflow.transport.api import Endpoint, Envelope, PayloadError, log
from distflow.transport.arena import (
    _NAME_RE,
    SHM_DIR,
    Mappings,
    _proc_start_ticks,
    _unlink,
    release_name,
    reserve_name,
)
from distflow.transport.link import Link
from distflow.transport.ring import DEAD, FULL, MAX_WRITERS, RANG, RECORD, Doorbell, Mailbox, MailboxWriter
from distflow.transport.shared_buffers import HEADER, MAX_CELLS, SharedBuffer, SharedBufferPool, release_cell

MBOX_KIND = "__mbox"
UNKNOWN = object()  # known_poster: not introduced yet (await poster())
DOMAIN = b"mbox1"
RETRY_S = 10.0  # a peer without a mailbox for a kind is asked again after this long
INTRO_TIMEOUT_S = 10.0
# seq, tag, buffer use, meta offset and length, data offset and length, release cell, buffer name length
REC = struct.Struct("<QqQQIQQHH")
NAME_OFF, NAME_MAX, MAC_OFF = REC.size, 100, 160
ALIVE_CHECK_S = 0.5  # a poster probes its mailbox owner's life at most this often


def _align(n: int) -> int:
    return (n + codec.ALIGN - 1) // codec.ALIGN * codec.ALIGN


def _ids(recipient: str, sender: str, kind: str, session: bytes) -> bytes:
    """What a record's MAC binds besides its own fields: who posts to whom, which kind, which session."""
    return f"{recipient}\0{sender}\0{kind}\0".encode() + session


@dataclass(eq=False)
class Poster:
    """A producer's handle on one consumer's mailbox of one kind."""

    peer: Endpoint
    kind: str
    writer: MailboxWriter
    cell: int  # the consumer's release cell in this producer's buffers
    bell: str
    ids: bytes
    dropped: bool = False
    alive_at: float = 0.0  # when the owner was last seen alive
    record: bytearray = field(default_factory=lambda: bytearray(RECORD))

    def gone(self) -> bool:
        return not self.writer.alive()


class Post:
    """A part posted to this node: who posted it, its meta, and its bytes in the producer's buffer.

    The producer reuses that memory once the post is released. :attr:`data` is a plain view for
    reading the bytes now (copy them out, then :meth:`release`); :meth:`keep` gives a view whose
    death releases the post instead (zero copy: keep it, and everything made from it, as long as
    needed). A post dropped unreleased is released when it is collected."""

    __slots__ = ("sender", "meta", "_m", "_lo", "_hi", "_cell", "_use", "_done")

    def __init__(self, sender: str, meta: dict[str, Any], m: Any, lo: int, hi: int, cell: int, use: int):
        self.sender, self.meta = sender, meta
        self._m, self._lo, self._hi, self._cell, self._use = m, lo, hi, cell, use
        self._done = False

    @property
    def data(self) -> np.ndarray:
        """uint8 view of the part's bytes, valid until :meth:`release`."""
        return self._m.arr[self._lo:self._hi]

    def keep(self) -> np.ndarray:
        """uint8 view of the part's bytes that releases the post when it (and every view of it) dies."""
        if self._done:
            raise RuntimeError("post already released")
        self._done = True
        arr = np.frombuffer(self._m.mm, dtype=np.uint8, count=self._hi - self._lo, offset=self._lo)
        fin = weakref.finalize(arr, release_cell, self._m.mm, self._cell, self._use)
        fin.atexit = False
        return arr

    def release(self) -> None:
        """The producer may reuse the part's memory (idempotent; after :meth:`keep` its views decide)."""
        if not self._done:
            self._done = True
            release_cell(self._m.mm, self._cell, self._use)

    def __del__(self) -> None:
        if not self._done:
            self.release()


@dataclass
class _Writer:
    node: str
    session: bytes
    pid: int
    ticks: int
    ids: bytes


class Inbox:
    """A consumer's mailbox of one kind, read into :class:`Post` s (see the module docstring)."""

    def __init__(self, ch: "Posting", kind: str):
        self._ch = ch
        self.kind = kind
        self.name, path = reserve_name()
        try:
            self.mailbox = Mailbox(path)
        except BaseException:
            release_name(self.name)
            raise
        self._writers: list[_Writer | None] = [None] * MAX_WRITERS
        self.waker: Callable[[], None] | None = None
        self.counters: Counter[str] = Counter()

    def register(self, node: str, session: bytes, pid: int, ticks: int) -> int | None:
        """A writer cell for a producer's channel session: its own again (emptied), else a free one,
        else one whose process is gone; None when every cell has a live writer."""
        cells = self._writers
        mine = next((i for i, w in enumerate(cells) if w is not None and w.node == node and w.session == session),
                    None)
        if mine is None:
            mine = next((i for i, w in enumerate(cells) if w is None), None)
        if mine is None:
            mine = next((i for i, w in enumerate(cells) if w is not None and _proc_start_ticks(w.pid) != w.ticks),
                        None)
        if mine is None:
            return None
        cells[mine] = _Writer(node, session, pid, ticks, _ids(self._ch.node_id, node, self.kind, session))
        self.mailbox.register(mine)
        return mine

    def arm(self, tag: int | None, need: int) -> bool:
        """See :meth:`Mailbox.arm`: True when ``need`` undrained records tagged ``tag`` are there now."""
        return self.mailbox.arm(tag, need)

    def drain(self) -> list[Post]:
        """Every record posted since the last drain, as :class:`Post` s (what does not verify is
        dropped and counted)."""
        raw = self.mailbox.drain()
        if not raw:
            return []
        ch = self._ch
        maps, digest, unpack = ch.maps, ch.auth.digest, msgpack.unpackb
        out = []
        for w, seq, rec in raw:
            reg = self._writers[w]
            r_seq, _tag, use, moff, mlen, doff, dlen, cell, nlen = REC.unpack_from(rec)
            if reg is None or r_seq != seq or nlen > NAME_MAX:
                self._drop("bad_record", f"cell {w}")
                continue
            name = rec[NAME_OFF:NAME_OFF + nlen].decode("ascii", "replace")
            m = maps.get(reg.node, name)
            room = -1 if m is None else m.size - HEADER  # the buffer's data bytes
            if not (0 <= moff and 0 < mlen <= room - moff):
                self._drop("unmapped_buffer", f"{name} from {reg.node}")
                continue
            blob = m.mm[HEADER + moff:HEADER + moff + mlen]
            if not hmac.compare_digest(digest(reg.ids + rec[:NAME_OFF + nlen] + blob, DOMAIN),
                                       rec[MAC_OFF:MAC_OFF + 32]):
                self._drop("bad_mac", f"from {reg.node}")
                continue
            try:
                meta = unpack(blob, raw=False)
            except (ValueError, msgpack.UnpackException) as e:
                meta = e
            if not isinstance(meta, dict) or not (0 <= doff and 0 <= dlen <= room - doff) or cell >= MAX_CELLS:
                if cell < MAX_CELLS:
                    release_cell(m.mm, cell, use)
                why = "data outside its buffer" if isinstance(meta, dict) else meta
                self._drop("bad_post", f"from {reg.node}: {why}")
                continue
            out.append(Post(reg.node, meta, m, HEADER + doff, HEADER + doff + dlen, cell, use))
        self.counters["read"] += len(out)
        maps.expire()
        return out

    def _drop(self, reason: str, detail: str) -> None:
        self.counters[f"dropped_{reason}"] += 1
        n = self.counters[f"dropped_{reason}"]
        if n <= 3 or n % 1000 == 0:
            log.warning("mailbox %s of %s: dropped a post (%s, #%d) %s", self.kind, self._ch.node_id, reason, n,
                        detail)

    def close(self) -> None:
        self.mailbox.close()
        _unlink(self.name)


class Posting:
    """Both ends of same-host posting for one transport (see the module docstring). ``send`` is the
    transport's (the introductions are signed messages); ``maps`` the table of segments this node
    mapped, shared with the shared-memory mover."""

    name = "posting"

    def __init__(self, link: Link, maps: Mappings, send: Callable[..., Awaitable[Any]],
                 max_shared_buffers: int = 16) -> None:
        self.link = link
        self.node_id = link.node_id
        self.auth = link.auth
        self._session = link.session
        self._counters = link.counters
        self.maps = maps
        self.send = send
        self._bell: Doorbell | None = None
        self._inboxes: dict[str, Inbox] = {}
        self._posters: dict[tuple[Endpoint, str], Poster | float] = {}  # a float: no mailbox, ask after it
        self._intro_locks: dict[tuple[Endpoint, str], asyncio.Lock] = {}
        self._shared = SharedBufferPool(max_shared_buffers)
        self._cells: dict[str, int] = {}  # consumer node id -> its release cell in my buffers
        link.internal[MBOX_KIND] = self._answer_intro  # a producer introducing itself or a new buffer

    def is_local(self, peer: Endpoint) -> bool:
        return self.link.is_local(peer)

    def start(self, port: int) -> None:
        try:
            self._bell = Doorbell(port, asyncio.get_running_loop(), self._rang)
        except OSError as e:  # the name is taken: no same-host posting (parts travel as messages)
            log.warning("channel %s: no doorbell (%s); same-host parts travel as messages", self.node_id, e)

    def close(self) -> None:
        if self._bell is not None:
            self._bell.close()
            self._bell = None
        for inbox in self._inboxes.values():
            inbox.close()
        self._inboxes.clear()
        for p in self._posters.values():
            if isinstance(p, Poster):
                p.writer.close()
        self._posters.clear()
        self._shared.close()

    def _rang(self) -> None:
        for inbox in list(self._inboxes.values()):
            if inbox.waker is not None:
                inbox.waker()

    def stats(self) -> dict[str, Any]:
        c = self._counters
        inboxes = {k: dict(i.counters) for k, i in self._inboxes.items()}
        return {"posts": c["posts"], "posts_ring_full": c["posts_ring_full"], "posts_owner_gone": c["posts_owner_gone"],
                "posts_blob_full": c["posts_blob_full"], "posters": sum(isinstance(p, Poster) and not p.dropped
                                                                        for p in self._posters.values()),
                "shared_buffers": len(self._shared.buffers),
                "shared_bytes": sum(b.capacity for b in self._shared.buffers),
                "inboxes": inboxes,
                "rings_sent": self._bell.rings_sent if self._bell else 0,
                "rings_received": self._bell.rings_received if self._bell else 0}

    # ------------------------------------------------------------------ consumer
    def open_mailbox(self, kind: str) -> Inbox | None:
        """This channel's mailbox for ``kind`` (one per kind), or None without same-host posting."""
        if self._bell is None:
            return None
        inbox = self._inboxes.get(kind)
        if inbox is None:
            inbox = self._inboxes[kind] = Inbox(self, kind)
        return inbox

    async def _answer_intro(self, env: Envelope) -> dict[str, Any]:
        """A producer introduces itself (``want``: a kind) and/or its buffers (``maps``): map them all,
        then name the mailbox and a writer cell (``{"mbox": None}``: posts of that kind not taken here)."""
        meta = env.meta
        maps, want = meta.get("maps"), meta.get("want")
        if not isinstance(maps, list) or not all(isinstance(n, str) and _NAME_RE.match(n) for n in maps):
            raise PayloadError("bad_header", "introduction: 'maps' must be a list of segment names")
        for name in maps:
            try:
                m = self.maps.open(env.sender, name, unlink=False)
            except (OSError, ValueError) as e:
                raise PayloadError("shm_unavailable", f"cannot map shared buffer {name}: {e}") from None
            if m.size <= HEADER:
                self.maps.drop(env.sender, name)
                raise PayloadError("shm_unavailable", f"shared buffer {name} is too small ({m.size} bytes)")
        if want is None:
            return {}
        session, pid, ticks = meta.get("session"), meta.get("pid"), meta.get("ticks")
        if not (isinstance(want, str) and isinstance(session, bytes) and type(pid) is int and type(ticks) is int):
            raise PayloadError("bad_header", "introduction: want/session/pid/ticks missing or mistyped")
        inbox = self._inboxes.get(want)
        writer = None if inbox is None else inbox.register(env.sender, session, pid, ticks)
        if inbox is None or writer is None or self._bell is None:
            return {"mbox": None}
        return {"mbox": inbox.name, "writer": writer, "pid": os.getpid(), "bell": self._bell.name}

    # ------------------------------------------------------------------ producer
    def known_poster(self, peer: Endpoint, kind: str) -> Poster | None | object:
        """What :meth:`poster` would return without waiting, or ``UNKNOWN`` (it must introduce first)."""
        if self._bell is None or not self.is_local(peer):
            return None
        p = self._posters.get((peer, kind))
        if isinstance(p, Poster):
            return None if p.dropped else p
        if isinstance(p, float) and p > time.monotonic():
            return None
        return UNKNOWN

    async def poster(self, peer: Endpoint, kind: str) -> Poster | None:
        """A handle on ``peer``'s mailbox for ``kind``, introducing this channel the first time; None
        when parts for ``peer`` must travel as messages (another host, no mailbox, unreachable)."""
        if self._bell is None or not self.is_local(peer):
            return None
        key = (peer, kind)
        p = self._posters.get(key)
        if isinstance(p, Poster) and not p.dropped:
            return p
        if isinstance(p, float) and p > time.monotonic():
            return None
        lock = self._intro_locks.setdefault(key, asyncio.Lock())
        async with lock:
            p = self._posters.get(key)
            if isinstance(p, Poster) and not p.dropped:
                return p
            if isinstance(p, float) and p > time.monotonic():
                return None
            try:
                p = await self._introduce(peer, kind)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure: this peer's parts go as messages for a while
                log.info("channel %s: no mailbox %r at %s (%s: %s); its parts travel as messages", self.node_id,
                         kind, peer.node_id, type(e).__name__, e)
                p = None
            self._posters[key] = p if p is not None else time.monotonic() + RETRY_S
            return p

    async def _introduce(self, peer: Endpoint, kind: str) -> Poster | None:
        cell = self._cells.get(peer.node_id)
        if cell is None:
            if len(self._cells) >= MAX_CELLS:
                return None
            cell = self._cells[peer.node_id] = len(self._cells)
        names = self._shared.names()
        reply = await self.send(peer, MBOX_KIND, {"want": kind, "maps": names, "session": self._session,
                                                  "pid": os.getpid(), "ticks": _proc_start_ticks(os.getpid()) or 0},
                                {}, timeout=INTRO_TIMEOUT_S)
        info = reply if isinstance(reply, dict) else {}
        name, writer, pid, bell = info.get("mbox"), info.get("writer"), info.get("pid"), info.get("bell")
        if name is None:
            return None
        if not (isinstance(name, str) and _NAME_RE.match(name) and type(writer) is int and type(pid) is int
                and isinstance(bell, str)):
            raise ValueError(f"malformed introduction reply {info!r}")
        mw = MailboxWriter(os.path.join(SHM_DIR, name), writer, pid)
        try:
            while True:  # buffers created meanwhile: this consumer maps them before the poster is active
                missing = [n for n in self._shared.names() if n not in names]
                if not missing:
                    break
                await self.send(peer, MBOX_KIND, {"maps": missing}, {}, timeout=INTRO_TIMEOUT_S)
                names += missing
        except BaseException:
            mw.close()
            raise
        return Poster(peer, kind, mw, cell, bell, _ids(peer.node_id, self.node_id, kind, self._session))

    def _drop_poster(self, p: Poster, why: str) -> None:
        """Its parts travel as messages from now on (re-introduced after RETRY_S); buffers holding its
        posts still wait for its releases unless its mailbox's owner is gone."""
        if p.dropped:
            return
        p.dropped = True
        key = (p.peer, p.kind)
        if self._posters.get(key) is p:
            self._posters[key] = time.monotonic() + RETRY_S
        log.info("channel %s: posting to %s stopped (%s)", self.node_id, p.peer.node_id, why)

    async def shared_buffer(self, nbytes: int, reserve: int = 0) -> SharedBuffer | None:
        """A buffer with ``nbytes`` of data (64-byte aligned views of ``buf.data``) plus ``reserve``
        bytes for the posts' meta, mapped by every active poster's consumer; None when the pool is
        full of busy buffers or /dev/shm has no room. Call :meth:`finish` when done posting."""
        need = _align(nbytes) + reserve
        buf = self._shared.acquire(need, Poster.gone)
        if buf is None:
            try:
                buf = self._shared.create(need, Poster.gone)
            except OSError as e:
                log.warning("channel %s: no shared buffer of %d bytes (%s); parts travel as messages",
                            self.node_id, need, e)
                return None
            if buf is None:
                return None
            live = [p for p in self._posters.values() if isinstance(p, Poster) and not p.dropped]
            try:
                results = await asyncio.gather(*(self.send(p.peer, MBOX_KIND, {"maps": [buf.name]}, {},
                                                           timeout=INTRO_TIMEOUT_S) for p in live),
                                               return_exceptions=True)
            except BaseException:
                buf.busy = False
                raise
            for p, r in zip(live, results):
                if isinstance(r, BaseException):
                    self._drop_poster(p, f"it could not map a new buffer: {type(r).__name__}: {r}")
        buf.blob_pos = _align(nbytes)
        return buf

    def post(self, poster: Poster, buf: SharedBuffer, tag: int, meta: dict[str, Any] | bytes, lo: int,
             hi: int) -> bool:
        """Post ``meta`` (msgpack-able, or already msgpack'd: bytes) and bytes [lo, hi) of ``buf.data``
        to ``poster``'s mailbox with ``tag`` (a step). False when this part must travel as a message
        instead (nothing was posted)."""
        if poster.dropped:
            return False
        if not 0 <= lo <= hi <= buf.capacity:
            raise ValueError(f"post: bytes [{lo}, {hi}) are outside the {buf.capacity}-byte buffer")
        blob = meta if isinstance(meta, bytes) else msgpack.packb(meta, use_bin_type=True)
        moff = buf.blob_pos
        if moff + len(blob) > buf.capacity:
            self._counters["posts_blob_full"] += 1
            return False
        buf.mm[HEADER + moff:HEADER + moff + len(blob)] = blob
        buf.blob_pos = moff + (len(blob) + 7) // 8 * 8
        name = buf.name_bytes
        rec = poster.record
        REC.pack_into(rec, 0, poster.writer.posted, tag, buf.use, moff, len(blob), lo, hi - lo, poster.cell, len(name))
        end = NAME_OFF + len(name)
        rec[NAME_OFF:end] = name
        rec[MAC_OFF:MAC_OFF + 32] = self.auth.digest(poster.ids + bytes(rec[:end]) + blob, DOMAIN)
        now = time.monotonic()
        if now - poster.alive_at > ALIVE_CHECK_S:  # (a probe per post would be a syscall per part)
            if poster.gone():
                r = DEAD
            else:
                poster.alive_at = now
                r = poster.writer.post(rec, tag)
        else:
            r = poster.writer.post(rec, tag)
        if r == DEAD:
            self._counters["posts_owner_gone"] += 1
            self._drop_poster(poster, "its mailbox's owner is gone")
            return False
        if r == FULL:
            self._counters["posts_ring_full"] += 1
            return False
        buf.expect[poster] = (poster.cell, buf.use)
        self._counters["posts"] += 1
        if r == RANG and self._bell is not None:
            self._bell.ring(poster.bell)
        return True

    def finish(self, buf: SharedBuffer) -> None:
        """Done posting from ``buf``: it is reusable once every consumer posted to released it."""
        buf.busy = False
