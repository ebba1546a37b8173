"""A plain zmq socket driven by the running asyncio loop: the data plane's socket wrapper.

Why it exists: ``zmq.asyncio``'s per-call futures, poller re-registration and flag enums cost
more Python time per message than the channel protocol itself, and with N producers x N
consumers messages per step that time is the peer-to-peer handoff's main cost. This wrapper
makes only non-blocking calls and waits on the socket's FD when one would block. It can also
receive a frame straight into a caller's buffer (``recv(into=...)``), which is how streamed
payload chunks land in their tensors with one copy.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

import zmq

# plain ints and the backend socket methods: pyzmq's flag enums and multipart wrappers cost a
# Python-level call per bitwise operation / frame, more than the frames themselves
_NOBLOCK, _EVENTS, _POLLIN, _POLLOUT = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)
_SNDMORE, _RCVMORE = int(zmq.SNDMORE), int(zmq.RCVMORE)
_zsend, _zrecv, _zget = zmq.backend.Socket.send, zmq.backend.Socket.recv, zmq.backend.Socket.get
_zrecv_into = zmq.backend.Socket.recv_into  # pyzmq >= 26.4




class LoopSocket:
    """A plain zmq socket driven by the running asyncio loop (used from the loop thread only).

    Why not ``zmq.asyncio``: its per-call futures, poller re-registration and flag enums cost
    more Python time per message than the channel protocol itself. Every call here is
    ``NOBLOCK``; only one that would block waits on the socket's FD. That FD is edge-triggered
    (any zmq call may consume its signal), so a wait re-checks ``ZMQ_EVENTS`` first, a send
    (recv) wakes the waiters for input (output) that is ready, and an FD signal nobody waits
    for is drained by reading ``ZMQ_EVENTS`` (the level-triggered loop would spin on it).
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self._waiters: dict[int, list[asyncio.Future]] = {_POLLIN: [], _POLLOUT: []}
        self._loop.add_reader(self._fd, self._wake)
        self.closed = False

    def _wake(self, event: int = _POLLIN | _POLLOUT) -> None:
        woke = False
        for ev, waiters in self._waiters.items():
            if ev & event and waiters:
                self._waiters[ev], woke = [], True
                for w in waiters:
                    if not w.done():
                        w.set_result(None)
        if not woke:
            _zget(self.sock, _EVENTS)  # drains the FD's signal; a later waiter checks EVENTS itself

    async def _wait(self, event: int) -> None:
        """Return once ``event`` (POLLIN or POLLOUT) may be ready (spurious wake-ups are fine)."""
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket closed")
        if _zget(self.sock, _EVENTS) & event:
            return
        fut = self._loop.create_future()
        self._waiters[event].append(fut)
        try:
            await fut
        finally:
            if fut in self._waiters[event]:  # cancelled
                self._waiters[event].remove(fut)

    async def recv(self, copy: bool = True, into: Callable[[list[Any]], memoryview | None] | None = None,
                   copy_head: int = 0) -> list[Any]:
        """The next multipart message: bytes frames, or zmq.Frame objects with ``copy=False``.

        The first ``copy_head`` frames are bytes whatever ``copy`` says (small routing/header
        frames: bytes are cheaper than Frame objects there).
        ``into(frames_so_far)``, called before each frame after the first, may return a writable
        buffer: that frame is then received straight into it and appears in the result as the
        int number of bytes it had (more than ``len(buffer)`` means it was cut off; the rest is lost).
        """
        sock = self.sock
        while True:
            if _zget(sock, _EVENTS) & _POLLIN:  # checked first: a NOBLOCK recv that fails raises (slow)
                try:
                    frames = [_zrecv(sock, _NOBLOCK, copy or copy_head > 0)]
                    break
                except zmq.Again:  # pragma: no cover - defensive: EVENTS and recv disagreed
                    pass
            await self._wait(_POLLIN)
        while _zget(sock, _RCVMORE):  # the rest of a multipart message is there already
            buf = into(frames) if into is not None else None
            if buf is None:
                frames.append(_zrecv(sock, _NOBLOCK, copy or len(frames) < copy_head))
            else:
                frames.append(_zrecv_into(sock, buf, flags=_NOBLOCK))
        if self._waiters[_POLLOUT] and _zget(sock, _EVENTS) & _POLLOUT:
            self._wake(_POLLOUT)  # the recv consumed the FD signal a blocked sender is after
        return frames

    def send_now(self, frames: Sequence[Any], copy: bool = False) -> None:
        """Send without waiting; zmq.Again when the pipe is full (never for a ROUTER). Only the first
        frame can meet a full pipe: zmq takes a message's other frames once it took the first."""
        sock, last = self.sock, len(frames) - 1
        for i, f in enumerate(frames):
            _zsend(sock, f, _NOBLOCK | _SNDMORE if i < last else _NOBLOCK, copy=copy)
        if self._waiters[_POLLIN] and _zget(sock, _EVENTS) & _POLLIN:
            self._wake(_POLLIN)  # the send consumed the FD signal of input a receiver is after

    async def send(self, frames: Sequence[Any], copy: bool = False) -> None:
        while True:
            try:
                return self.send_now(frames, copy)
            except zmq.Again:
                await self._wait(_POLLOUT)

    def close(self, linger: int = 0) -> None:
        if self.closed:
            return
        self.closed = True
        if not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        for waiters in self._waiters.values():
            for w in waiters:
                if not w.done():
                    w.set_exception(zmq.ZMQError(zmq.ENOTSOCK, "socket closed"))
            waiters.clear()
        self.sock.close(linger=linger)
