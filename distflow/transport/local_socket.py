"""Same-host control path: multipart messages over a Unix stream socket, read and written by the loop.

Why it exists: a zmq TCP message between two processes of one host crosses four threads (the
sender's loop, its zmq I/O thread, the receiver's I/O thread, the receiver's loop) and a
round trip with its ack eight. In an all-to-all handoff (N producers x N consumers messages per
step) those wake-ups, and the zmq calls that drive them, were the largest share of the
peer-to-peer path's CPU. Here the event-loop thread itself writes a message to a Unix socket
(one ``sendmsg``) and the peer's loop reads it (one ``recv_into`` for many messages): one wake-up
per message. The shared-memory channel sends its signed headers, acks and slot releases to
same-host peers this way; payload bytes travel in shared memory as before. Nothing about the
protocol changes: the frames are the zmq channel's frames, signed and checked the same way.

Addresses live in Linux's abstract socket namespace, derived from the channel's TCP data port
(``\\0distflow-data.<port>``): unique on the host (network namespace) while that port is bound,
and no file to clean up whatever way a process dies. Both ends check with ``SO_PEERCRED`` that the
other end runs as the same user; every message is authenticated as on TCP anyway.

Wire format of one message: ``<u64 body bytes><u32 frames>`` then ``u64`` per frame length, then
the frames. The classes mimic the parts of :class:`LoopSocket` the channel uses (``send``,
``send_now``, ``recv``, ``close``, ``closed``) and raise ``zmq.ZMQError`` where it would, so the
channel drives both the same way. Unlike a zmq DEALER, a connection that breaks is not silently
re-established: the owner is told (``on_lost``) and fails what was in flight at once, naming the peer.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import socket
import struct
import sys
from collections import deque
from typing import Any, Callable, Sequence

import zmq

_PREFIX = struct.Struct("<QI")
SCRATCH = 256 << 10  # bytes read per recv_into; larger messages are received straight into place
IOV_MAX = 512
PAUSE_BACKLOG = 1000  # messages queued unread by the channel before the router stops reading sockets
PAUSE_BACKLOG_BYTES = 64 << 20  # ... or bytes
PAUSE_WRITE_BYTES = 64 << 20  # unsent bytes at which send() waits for the socket to drain
IDENT_TAG = b"\x01"  # zmq ROUTER identities start with \x00: the channel tells the two apart by this


def local_name(port: int) -> str:
    """The abstract Unix socket name of the channel whose TCP data port is ``port``."""
    return f"\0distflow-data.{port}"


def local_available() -> bool:
    return sys.platform.startswith("linux") and hasattr(socket, "SO_PEERCRED")


def _same_user(sock: socket.socket) -> bool:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


def _byte_view(f: Any) -> memoryview:
    v = f if isinstance(f, memoryview) else memoryview(f)
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")


def _closed_error() -> zmq.ZMQError:
    return zmq.ZMQError(errno.ENOTSOCK, "socket closed")


class _Conn:
    """One non-blocking Unix stream connection: framed reads into ``on_message``, buffered writes."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, max_body: int, max_frames: int,
                 on_message: Callable[[list[Any]], None], on_lost: Callable[[str], None]):
        self.sock = sock
        self.loop = loop
        self.fd = sock.fileno()
        self.max_body, self.max_frames = max_body, max_frames
        self.on_message, self.on_lost = on_message, on_lost
        self.closed = False
        self.reading = False
        self._scratch = bytearray(SCRATCH)
        self._scratch_view = memoryview(self._scratch)
        self._pre = bytearray()  # a prefix split across reads
        self._body: bytearray | None = None
        self._nframes = 0
        self._got = 0
        self._out: deque[memoryview] = deque()
        self._out_bytes = 0
        self._drained: list[asyncio.Future] = []
        self.resume()

    # ------------------------------------------------------------------ reading
    def pause(self) -> None:
        if self.reading and not self.closed:
            self.loop.remove_reader(self.fd)
            self.reading = False

    def resume(self) -> None:
        if not self.reading and not self.closed:
            self.loop.add_reader(self.fd, self._on_readable)
            self.reading = True

    def _on_readable(self) -> None:
        # A read shorter than asked for emptied the socket: return instead of paying one more
        # system call to hear EAGAIN (the loop's readiness is level-triggered: more data, or the
        # peer's close, calls this again).
        while self.reading and not self.closed:
            try:
                if self._body is not None and len(self._body) - self._got >= SCRATCH:
                    want = len(self._body) - self._got
                    n = self.sock.recv_into(memoryview(self._body)[self._got:])  # a big frame: straight into place
                    if n:
                        self._got += n
                        if self._got == len(self._body):
                            self._finish()
                        if n < want:
                            return
                        continue
                else:
                    n = self.sock.recv_into(self._scratch)
                    if n:
                        self._parse(n)
                        if n < SCRATCH:
                            return
                        continue
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.lose(f"{e.strerror or e}")
                return
            except ValueError as e:  # a protocol violation by the peer
                self.lose(str(e))
                return
            self.lose("closed by the peer")
            return

    def _parse(self, n: int) -> None:
        data, pos = self._scratch_view, 0
        while pos < n:
            if self._body is None:
                take = min(_PREFIX.size - len(self._pre), n - pos)
                self._pre += data[pos:pos + take]
                pos += take
                if len(self._pre) < _PREFIX.size:
                    return
                size, self._nframes = _PREFIX.unpack(self._pre)
                self._pre.clear()
                if not 0 < self._nframes <= self.max_frames or size > self.max_body or size < 8 * self._nframes:
                    raise ValueError(f"bad message prefix ({self._nframes} frames, {size} bytes)")
                self._body, self._got = bytearray(size), 0
            take = min(len(self._body) - self._got, n - pos)
            self._body[self._got:self._got + take] = data[pos:pos + take]
            self._got += take
            pos += take
            if self._got == len(self._body):
                self._finish()

    def _finish(self) -> None:
        body, k = self._body, self._nframes
        self._body = None
        assert body is not None
        lens = struct.unpack_from(f"<{k}Q", body)
        if 8 * k + sum(lens) != len(body):
            raise ValueError("frame lengths do not add up to the message size")
        view, pos, frames = memoryview(body), 8 * k, []
        for n in lens:
            frames.append(view[pos:pos + n])
            pos += n
        self.on_message(frames)

    # ------------------------------------------------------------------ writing
    def write(self, frames: Sequence[Any]) -> None:
        if self.closed:
            raise _closed_error()
        views = [_byte_view(f) for f in frames]
        lens = [v.nbytes for v in views]
        bufs = [memoryview(struct.pack(f"<QI{len(lens)}Q", 8 * len(lens) + sum(lens), len(lens), *lens)), *views]
        if self._out:  # keep the order behind what is still queued
            self._queue(bufs)
            return
        try:
            sent = self.sock.sendmsg(bufs) if len(bufs) <= IOV_MAX else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as e:
            self.lose(f"{e.strerror or e}")
            raise zmq.ZMQError(e.errno or errno.EPIPE, f"send failed: {e}") from None
        rest = []
        for v in bufs:  # queue what the kernel did not take
            if sent >= v.nbytes:
                sent -= v.nbytes
            else:
                rest.append(v[sent:])
                sent = 0
        if rest:
            self._queue(rest)

    def _queue(self, views: list[memoryview]) -> None:
        was_empty = not self._out
        for v in views:
            if v.nbytes:
                self._out.append(v)
                self._out_bytes += v.nbytes
        if was_empty and self._out:
            self.loop.add_writer(self.fd, self._on_writable)

    def _on_writable(self) -> None:
        while self._out and not self.closed:
            batch = list(itertools.islice(self._out, IOV_MAX))
            try:
                sent = self.sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.lose(f"{e.strerror or e}")
                return
            self._out_bytes -= sent
            while sent and self._out:
                head = self._out[0]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    self._out.popleft()
                else:
                    self._out[0] = head[sent:]
                    sent = 0
        if not self._out and not self.closed:
            self.loop.remove_writer(self.fd)
            self._wake_drained(None)

    async def drain(self) -> None:
        """Wait while more than PAUSE_WRITE_BYTES are unsent (backpressure, like a zmq high-water mark)."""
        while self._out_bytes > PAUSE_WRITE_BYTES and not self.closed:
            fut = self.loop.create_future()
            self._drained.append(fut)
            await fut
        if self.closed:
            raise _closed_error()

    def _wake_drained(self, exc: BaseException | None) -> None:
        waiters, self._drained = self._drained, []
        for w in waiters:
            if not w.done():
                w.set_exception(exc) if exc is not None else w.set_result(None)

    # ------------------------------------------------------------------ closing
    def lose(self, why: str) -> None:
        if self.closed:
            return
        self.close()
        self.on_lost(why)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.loop.is_closed():
            if self.reading:
                self.loop.remove_reader(self.fd)
            if self._out:
                self.loop.remove_writer(self.fd)
        self.reading = False
        self._out.clear()
        self._wake_drained(_closed_error())
        self.sock.close()


class _Inbox:
    """Received messages waiting for ``recv()``, with one waiter at a time (the channel's reader task)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque[list[Any]] = deque()
        self.waiter: asyncio.Future | None = None
        self.error: BaseException | None = None

    def put(self, frames: list[Any]) -> None:
        self.items.append(frames)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    async def get(self) -> list[Any]:
        while not self.items:
            if self.error is not None:
                raise self.error
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


def _deliver(frames: list[Any], into: Callable[[list[Any]], memoryview | None] | None, copy_head: int) -> list[Any]:
    """The LoopSocket.recv result for a received message: the first ``copy_head`` frames as bytes;
    a frame ``into`` gives a buffer for is copied there and appears as its byte count."""
    out: list[Any] = []
    for i, f in enumerate(frames):
        buf = into(out) if into is not None and i > 0 else None
        if buf is not None:
            n = min(buf.nbytes, f.nbytes)
            buf[:n] = f[:n]
            out.append(f.nbytes)
        else:
            out.append(bytes(f) if i < copy_head else f)
    return out


class LocalRouter:
    """The receiving end: accepts same-user connections on ``local_name(port)``; ``recv()`` gives
    ``[identity, *frames]``; ``send_now([identity, *frames])`` answers on that connection (dropped
    when it is gone, as a zmq ROUTER does)."""

    def __init__(self, port: int, max_body: int, max_frames: int):
        self.loop = asyncio.get_running_loop()
        self.max_body, self.max_frames = max_body, max_frames
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(local_name(port))
            self._listener.listen(512)
        except OSError:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        self._conns: dict[bytes, _Conn] = {}
        self._ids = itertools.count(1)
        self._inbox = _Inbox(self.loop)
        self._paused = False
        self._backlog_bytes = 0
        self.closed = False
        self.refused = 0  # connections from another user
        self.loop.add_reader(self._listener.fileno(), self._on_accept)

    def _on_accept(self) -> None:
        while not self.closed:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if not _same_user(sock):
                self.refused += 1
                sock.close()
                continue
            sock.setblocking(False)
            ident = IDENT_TAG + next(self._ids).to_bytes(8, "little")
            self._conns[ident] = _Conn(sock, self.loop, self.max_body, self.max_frames,
                                       lambda frames, i=ident: self._on_message(i, frames),
                                       lambda why, i=ident: self._conns.pop(i, None))
            if self._paused:
                self._conns[ident].pause()

    def _on_message(self, ident: bytes, frames: list[Any]) -> None:
        self._backlog_bytes += sum(f.nbytes for f in frames)
        frames.insert(0, ident)
        self._inbox.put(frames)
        if (len(self._inbox.items) >= PAUSE_BACKLOG or self._backlog_bytes >= PAUSE_BACKLOG_BYTES) \
                and not self._paused:
            self._paused = True  # the channel is not reading: push back on the senders (their socket buffers fill)
            for c in self._conns.values():
                c.pause()

    async def recv(self, copy: bool = True, into: Callable[[list[Any]], memoryview | None] | None = None,
                   copy_head: int = 0) -> list[Any]:
        frames = await self._inbox.get()
        self._backlog_bytes -= sum(f.nbytes for f in frames[1:])
        if self._paused and len(self._inbox.items) < PAUSE_BACKLOG // 2 and self._backlog_bytes < PAUSE_BACKLOG_BYTES // 2:
            self._paused = False
            for c in self._conns.values():
                c.resume()
        return _deliver(frames, into, copy_head)

    def send_now(self, frames: Sequence[Any], copy: bool = False) -> None:
        conn = self._conns.get(bytes(frames[0]))
        if conn is None or conn.closed:
            return  # the peer is gone (a ROUTER drops too)
        try:
            conn.write(frames[1:])
        except zmq.ZMQError:
            pass

    def close(self, linger: int = 0) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.loop.is_closed():
            self.loop.remove_reader(self._listener.fileno())
        self._listener.close()
        for c in list(self._conns.values()):
            c.close()
        self._conns.clear()
        self._inbox.fail(_closed_error())


class LocalDealer:
    """The sending end to one peer. ``connect`` raises OSError when nothing (of this user) listens."""

    def __init__(self, port: int, max_body: int, on_lost: Callable[[str], None]):
        self.loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(local_name(port))
            if not _same_user(sock):
                raise PermissionError(f"the local data socket of port {port} belongs to another user")
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._inbox = _Inbox(self.loop)
        self._on_lost = on_lost
        self._conn = _Conn(sock, self.loop, max_body, 64, self._inbox.put, self._lost)

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def _lost(self, why: str) -> None:
        self._inbox.fail(_closed_error())
        self._on_lost(why)

    def send_now(self, frames: Sequence[Any], copy: bool = False) -> None:
        self._conn.write(frames)

    async def send(self, frames: Sequence[Any], copy: bool = False) -> None:
        self._conn.write(frames)
        await self._conn.drain()

    async def recv(self, copy: bool = True, into: Any = None, copy_head: int = 0) -> list[Any]:
        return [bytes(f) for f in await self._inbox.get()]

    def close(self, linger: int = 0) -> None:
        self._conn.close()
        self._inbox.fail(_closed_error())
