"""Outgoing control-plane sockets shared by every Node of a process and event loop.

Why it exists: a node only receives on its own ROUTER; everything it sends goes out through
DEALER sockets created on demand per destination and shared by all nodes of one event loop
(hundreds of nodes can share a process). One ZMQ context per process (re-created after a
fork), and one LRU-capped pool of DEALERs per loop, released when its last node stops.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections import OrderedDict

import zmq
import zmq.asyncio

__all__ = ["OutPool", "acquire_pool", "endpoint", "parse_address", "release_pool", "shared_context"]


def parse_address(addr: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``; ValueError naming the input."""
    host, sep, port = addr.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad address {addr!r}: expected HOST:PORT with a port in 1..65535")
    return host, int(port)


def endpoint(host: str, port: int) -> str:
    """The ZMQ tcp endpoint of ``host:port`` (IPv6 hosts bracketed)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


_ctx: zmq.asyncio.Context | None = None
_ctx_pid = -1


def shared_context() -> zmq.asyncio.Context:
    """One ZMQ context per process (re-created after fork)."""
    global _ctx, _ctx_pid
    if _ctx is None or _ctx_pid != os.getpid():
        _ctx = zmq.asyncio.Context()
        _ctx.set(zmq.MAX_SOCKETS, 16384)
        _ctx_pid = os.getpid()
    return _ctx


class OutPool:
    """Outgoing DEALER sockets of one event loop, one per destination endpoint (LRU-capped)."""

    def __init__(self, ctx: zmq.Context, cap: int = 4096):
        self._ctx, self._cap = ctx, cap
        self._socks: OrderedDict[str, zmq.Socket] = OrderedDict()
        self.users = 0

    def send(self, endpoint: str, frames: list[bytes]) -> bool:
        sock = self._socks.get(endpoint)
        if sock is None:
            if len(self._socks) >= self._cap:
                self._socks.popitem(last=False)[1].close(linger=200)
            sock = zmq.Socket(self._ctx, zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 200)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            sock.connect(endpoint)
            self._socks[endpoint] = sock
        else:
            self._socks.move_to_end(endpoint)
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def close(self) -> None:
        for s in self._socks.values():
            s.close(linger=200)
        self._socks.clear()


_pools: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, OutPool]" = weakref.WeakKeyDictionary()


def acquire_pool(loop: asyncio.AbstractEventLoop) -> OutPool:
    pool = _pools.get(loop)
    if pool is None:
        pool = _pools[loop] = OutPool(shared_context())
    pool.users += 1
    return pool


def release_pool(loop: asyncio.AbstractEventLoop, pool: OutPool) -> None:
    pool.users -= 1
    if pool.users <= 0:
        pool.close()
        if _pools.get(loop) is pool:
            del _pools[loop]
