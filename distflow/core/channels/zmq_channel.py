"""Tensor channel over ZeroMQ: authenticated, acknowledged, zero-copy multipart frames.

Why it exists: this is the data plane between any two hosts, and the control path that
the shared-memory and NCCL channels reuse (they only move the payload differently).

Wire format (every frame after the ZMQ routing identity)::

    message  DEALER -> ROUTER : [b"DFD1", header, tag, payload_0, ..., payload_k]
    chunk    DEALER -> ROUTER : [b"DFC1", (seq, index) as 2 x u64, chunk_tag, data]
    ack      ROUTER -> DEALER : [b"DFA1", ack_header, tag]

``header`` is msgpack: sender/recipient node ids, a per-process session id and start
time, a per-sender sequence number, the message kind, user meta, the tensor headers
(:mod:`.codec`) and how the payload travels (``inline`` frames, ``chunks``, ``shm`` or
``nccl``). ``tag`` is :class:`distflow.core.auth.Authenticator` (domain ``b"data"``) over
the header. Payload bytes are covered by one-time MACs (:mod:`.payload_mac`): AES-GMAC keyed
per message by ``Authenticator.tag([session, nonce])``, or HMAC-SHA256 when the
``cryptography`` package is missing.

* ``inline`` (under ``stream_min_bytes``, 4 MiB): the payload frames ride in the message and
  their tag sits inside the signed header.
* ``chunks`` (larger): the signed header carries frame and chunk sizes; the bytes follow as
  chunk messages, each with its own tag (nonce = chunk index). The sender MACs chunk k+1 while
  libzmq sends chunk k; the receiver allocates the tensors when the header arrives and
  receives every chunk straight into place, checking it while the next one is on the wire.
  A whole-payload MAC would put two full passes over the bytes on the critical path, which on
  loopback (where the "network" is itself a memory copy) cost as much as the transfer.
  Chunks count only on the connection their header came on; a bad one NACKs the message.

Replay: the receiver keeps, per sender, the newest session and the highest sequence
number seen, and drops anything not newer.

Receive side: one ROUTER. Each authentic message runs the handler in its own named task
(at most ``max_inflight`` at once, beyond which the socket is not read, so TCP pushes
back on senders); the ack goes out only after the handler returns. Send side: one
DEALER per peer, an ack reader task per DEALER, and a future per outstanding sequence
number. The DEALER is not ``IMMEDIATE`` (with it, libzmq discards acks that arrived but
were not read yet when the peer closes); instead a send that times out resets that peer's
DEALER, so nothing stale stays queued for a dead peer and delivered long after.

Sockets are plain zmq sockets driven by the loop through :class:`LoopSocket` (non-blocking
calls, FD wake-ups), not ``zmq.asyncio``: its per-call machinery cost more Python time than the
protocol itself, and with N producers x N consumers messages per step that time is the
peer-to-peer handoff's main cost. Subclasses may add fields to acks (``_ack_extra``) and
read them (``_on_ack``): the shm channel returns its slot releases that way.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import os
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import torch
import zmq

from distflow.core.auth import TAG_SIZE, Authenticator
from distflow.core.channels import codec
from distflow.core.channels.base import (
    ChannelClosed,
    ChannelError,
    Endpoint,
    Envelope,
    Handler,
    RemoteError,
    TensorChannel,
    log,
)
from distflow.core.channels.loop_socket import LoopSocket
from distflow.core.channels.payload_mac import ChunkMac, PayloadError, default_mac_alg, payload_tag
from distflow.core.channels.stream_receiver import MAGIC_CHUNK, StreamReceiver, _StreamIn

__all__ = ["ZmqChannel", "LoopSocket", "PayloadError", "Outgoing", "MAGIC_MSG", "MAGIC_ACK", "MAGIC_CHUNK"]

MAGIC_MSG = b"DFD1"
MAGIC_ACK = b"DFA1"
PROTOCOL = 1
DOMAIN = b"data"
OFFLOAD_BYTES = 1 << 20  # copies / hashing that release the GIL run in a worker thread above this size
GMAC_OFFLOAD_BYTES = 64 << 20  # GMAC runs at 10-25 GB/s: below this a thread hop costs more than it saves
STREAM_MIN_BYTES = 4 << 20  # inline payloads this big are streamed in chunks (MAC overlaps the transfer)
STREAM_CHUNK = 1 << 20  # fits L2: the receiver MACs each chunk while it is still in cache

@dataclass
class Outgoing:
    """A prepared payload: how it travels, extra header fields, frames, and a release hook."""

    pay: str
    header: dict[str, Any]
    frames: list[Any]
    nbytes: int
    release: Callable[[bool], None] | None = None  # called once with acked=True/False
    chunks: list[memoryview] | None = None  # a streamed payload: sent after the header, one message each
    chunk_mac: ChunkMac | None = None


@dataclass
class _PeerOut:
    endpoint: Endpoint
    sock: LoopSocket
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    next_seq: int = 1
    order: asyncio.Lock = field(default_factory=asyncio.Lock)
    reader: asyncio.Task | None = None


@dataclass
class _PeerIn:
    start_ns: int
    session: bytes
    last_seq: int


class ZmqChannel(StreamReceiver, TensorChannel):
    """ZeroMQ tensor channel (any host, CPU tensors). See the module docstring."""

    transport = "zmq"

    def __init__(
        self,
        node_id: str,
        secret: str | bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_message_bytes: int = 4 << 30,
        max_header_bytes: int = 64 << 20,
        max_frames: int = 4096,
        max_inflight: int = 64,
        mac_alg: str | None = None,
        pack_below: int = 16 << 10,
        close_timeout: float = 2.0,
        stream_min_bytes: int = STREAM_MIN_BYTES,
        stream_chunk: int = STREAM_CHUNK,
        stream_timeout: float = 120.0,
    ) -> None:
        if not isinstance(node_id, str) or not node_id:
            raise ValueError(f"node_id must be a non-empty str, got {node_id!r}")
        self.node_id = node_id
        self.host = host
        self.port = port
        self._auth = Authenticator(secret)
        self._max_message_bytes = max_message_bytes
        self._max_header_bytes = max_header_bytes
        self._max_frames = max_frames
        self._max_inflight = max_inflight
        self._mac_alg = mac_alg or default_mac_alg()
        if self._mac_alg not in ("aes-gmac", "hmac-sha256"):
            raise ValueError(f"mac_alg must be 'aes-gmac' or 'hmac-sha256', got {self._mac_alg!r}")
        if self._mac_alg == "aes-gmac" and default_mac_alg() != "aes-gmac":
            raise ValueError("mac_alg 'aes-gmac' needs the `cryptography` package")
        self._close_timeout = close_timeout
        self._pack_below = pack_below
        if not isinstance(stream_min_bytes, int) or stream_min_bytes < 0:
            raise ValueError(f"stream_min_bytes must be an int >= 0 (0: never stream), got {stream_min_bytes!r}")
        if not 4096 <= stream_chunk <= 1 << 30:
            raise ValueError(f"stream_chunk must be between 4096 and 2**30 bytes, got {stream_chunk!r}")
        self._stream_min_bytes = stream_min_bytes  # 0: never stream
        self._stream_chunk = stream_chunk
        self._stream_timeout = stream_timeout
        self._streams: dict[tuple[bytes, int], _StreamIn] = {}
        self._session = os.urandom(16)
        self._start_ns = time.time_ns()
        self._handler: Handler | None = None
        self._ctx: zmq.Context | None = None
        self._router: LoopSocket | None = None
        self._receivers: list[tuple[Any, asyncio.Task]] = []  # (socket, its receive loop): the ROUTER, ...
        self._handler_tasks: set[asyncio.Task] = set()
        self._slots: asyncio.Semaphore | None = None
        self._peers_out: dict[Endpoint, _PeerOut] = {}
        self._next_seq: dict[Endpoint, int] = {}  # survives a reset of a peer's DEALER
        self._peers_in: dict[str, _PeerIn] = {}
        self._closed = False
        self._started = False
        self._counters: Counter[str] = Counter()
        self._dropped: Counter[str] = Counter()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._started:
            raise RuntimeError(f"channel {self.node_id} already started")
        self._started = True
        freeze_startup_objects()
        self._ctx = zmq.Context(io_threads=1)
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        router.setsockopt(zmq.RCVHWM, 1000)
        router.setsockopt(zmq.SNDHWM, 10000)
        host = f"[{self.host}]" if ":" in self.host else self.host
        if ":" in self.host:
            router.setsockopt(zmq.IPV6, 1)
        try:
            router.bind(f"tcp://{host}:{self.port if self.port else '*'}")
        except zmq.ZMQError as e:
            router.close(0)
            raise OSError(f"channel {self.node_id}: cannot bind data port {self.host}:{self.port}: {e}") from e
        self._router = LoopSocket(router)
        self.port = int(router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        self._slots = asyncio.Semaphore(self._max_inflight)
        self._serve(self._router, "recv")

    def _serve(self, router: Any, name: str) -> None:
        """Receive on ``router`` (closed with the channel); a subclass may add sockets (same-host)."""
        task = asyncio.create_task(self._recv_loop(router), name=f"channel-{name}-{self.node_id}")
        self._receivers.append((router, task))

    def set_handler(self, handler: Handler) -> None:
        if not callable(handler):
            raise TypeError(f"handler must be an async callable, got {type(handler).__name__}")
        self._handler = handler

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [*(t for _, t in self._receivers), *self._handler_tasks]
        for p in self._peers_out.values():
            for fut in p.pending.values():
                if not fut.done():
                    fut.set_exception(ChannelClosed(f"channel {self.node_id} closed"))
            if p.reader is not None:
                tasks.append(p.reader)
        for t in tasks:
            t.cancel()
        for st in self._streams.values():
            st.timer.cancel()
        self._streams.clear()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=self._close_timeout)
            if pending:
                log.warning("channel %s: %d tasks did not stop within %.1fs", self.node_id, len(pending),
                            self._close_timeout)
        for p in self._peers_out.values():
            p.sock.close(linger=0)
        for router, _ in self._receivers:
            router.close(linger=int(self._close_timeout * 500))  # let queued acks reach their senders
        if self._ctx is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self._ctx.term), self._close_timeout)
            except TimeoutError:
                log.warning("channel %s: zmq context did not terminate within %.1fs", self.node_id,
                            self._close_timeout)
        self._peers_out.clear()

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        c = self._counters
        return {
            "node_id": self.node_id,
            "transport": self.transport,
            "port": self.port,
            "sent_msgs": c["sent_msgs"],
            "sent_bytes": c["sent_bytes"],
            "recv_msgs": c["recv_msgs"],
            "recv_bytes": c["recv_bytes"],
            "handler_errors": c["handler_errors"],
            "nacks_sent": c["nacks_sent"],
            "remote_errors": c["remote_errors"],
            "send_timeouts": c["send_timeouts"],
            "handlers_running": len(self._handler_tasks),
            "streams_sent": c["streams_sent"],
            "streams_received": c["streams_received"],
            "streams_open": len(self._streams),
            "dropped": dict(self._dropped),
            "dropped_total": sum(self._dropped.values()),
            **self._extra_stats(),
        }

    def _extra_stats(self) -> dict[str, Any]:
        return {}

    def _drop(self, reason: str, detail: str = "") -> None:
        self._dropped[reason] += 1
        n = self._dropped[reason]
        if n <= 3 or n % 1000 == 0:
            log.warning("channel %s: dropped message (%s, #%d) %s", self.node_id, reason, n, detail)

    # ------------------------------------------------------------------ send
    async def send(
        self,
        peer: Endpoint,
        kind: str,
        meta: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        timeout: float,
    ) -> None:
        try:
            async with _timeout(timeout):
                await self._send(peer, kind, meta, tensors)
        except TimeoutError:
            self._counters["send_timeouts"] += 1
            self._reset_peer(peer)
            raise TimeoutError(
                f"channel {self.node_id}: send of {kind!r} to {peer.node_id} ({peer.host}:{peer.port}) "
                f"not acknowledged within {timeout:g}s"
            ) from None

    def _check_send_args(self, peer: Endpoint, kind: str, meta: Any, tensors: Any) -> None:
        if self._closed:
            raise ChannelClosed(f"channel {self.node_id} is closed")
        if not self._started:
            raise RuntimeError(f"channel {self.node_id}: call start() before send()")
        if not isinstance(peer, Endpoint):
            raise TypeError(f"peer must be an Endpoint, got {type(peer).__name__}")
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"kind must be a non-empty str, got {kind!r}")
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
        if not isinstance(tensors, dict):
            raise TypeError(f"tensors must be a dict of name -> torch.Tensor, got {type(tensors).__name__}")

    async def _send(self, peer: Endpoint, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self._check_send_args(peer, kind, meta, tensors)
        out = await self._prepare_payload(peer, tensors)
        acked = False
        try:
            await self._send_prepared(peer, kind, meta, out)
            acked = True
        finally:
            if out.release is not None:
                out.release(acked)

    async def _send_prepared(self, peer: Endpoint, kind: str, meta: dict[str, Any], out: Outgoing) -> None:
        p = self._peer_out(peer)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        async with p.order:  # sequence numbers go on the wire in increasing order
            seq = p.next_seq
            p.next_seq += 1
            header = {
                "t": "msg", "v": PROTOCOL, "from": self.node_id, "to": peer.node_id,
                "sess": self._session, "st": self._start_ns, "seq": seq, "kind": kind,
                "meta": meta, "pay": out.pay, **out.header,
            }
            try:
                hbytes = msgpack.packb(header, use_bin_type=True)
            except (TypeError, ValueError, OverflowError) as e:
                raise TypeError(f"meta of {kind!r} message is not msgpack-serializable: {e}") from None
            if len(hbytes) > self._max_header_bytes:
                raise ValueError(f"{kind!r} message header is {len(hbytes)} bytes, "
                                 f"over the {self._max_header_bytes}-byte limit")
            tag = self._auth.tag([hbytes], DOMAIN)
            p.pending[seq] = fut
            try:
                await p.sock.send([MAGIC_MSG, hbytes, tag, *out.frames], copy=False)
            except zmq.ZMQError as e:
                p.pending.pop(seq, None)
                raise ChannelError(f"channel {self.node_id}: cannot send {kind!r} to {peer.node_id}: {e}") from None
            except BaseException:
                p.pending.pop(seq, None)
                raise
        try:
            if out.chunks:
                await self._send_chunks(p, seq, out, fut)
            ack = await fut
        finally:
            p.pending.pop(seq, None)
        if not ack.get("ok"):
            self._counters["remote_errors"] += 1
            raise RemoteError(peer.node_id, kind, str(ack.get("code", "error")), str(ack.get("err", "")))
        self._counters["sent_msgs"] += 1
        self._counters["sent_bytes"] += out.nbytes

    async def _send_chunks(self, p: _PeerOut, seq: int, out: Outgoing, answered: asyncio.Future) -> None:
        """Stream chunk messages ``[MAGIC_CHUNK, (seq, index), tag, data]``: while libzmq's I/O thread
        puts chunk k on the wire (zero-copy), this thread MACs chunk k+1. Every few chunks the loop
        gets a turn (acks, other tasks); an early answer (the receiver refused the header) stops it."""
        assert out.chunks is not None and out.chunk_mac is not None
        mac, sock = out.chunk_mac, p.sock
        for k, chunk in enumerate(out.chunks):
            if k % 8 == 7:
                await asyncio.sleep(0)
                if answered.done():
                    return
            await sock.send([MAGIC_CHUNK, struct.pack("<QQ", seq, k), mac.tag(k, chunk), chunk], copy=False)
        self._counters["streams_sent"] += 1

    async def _prepare_payload(self, peer: Endpoint, tensors: dict[str, torch.Tensor]) -> Outgoing:
        """Inline frames: zero-copy views of the tensors, payload MAC tag in the header; at least
        ``stream_min_bytes``: streamed in chunks, each with its own MAC."""
        headers, frames = codec.encode(_to_cpu(tensors), pack_below=self._pack_below)
        if 0 < self._stream_min_bytes <= sum(h["nbytes"] for h in headers):
            return self._stream_outgoing(headers, frames)
        return await self._inline_outgoing(headers, frames)

    def _new_payload_key(self, headers: list[dict[str, Any]]) -> tuple[int, bytes, bytes]:
        """(payload bytes, nonce, one-time MAC key) for an outgoing payload within the size limit."""
        nbytes = sum(h["nbytes"] for h in headers)
        if nbytes > self._max_message_bytes:
            raise ValueError(f"payload of {nbytes} bytes is over the {self._max_message_bytes}-byte message limit")
        nonce = os.urandom(16)
        return nbytes, nonce, self._payload_key(self._session, nonce)

    def _stream_outgoing(self, headers: list[dict[str, Any]], frames: list[Any]) -> Outgoing:
        nbytes, nonce, key = self._new_payload_key(headers)
        views = [memoryview(f).cast("B") for f in frames]
        cs = self._stream_chunk
        header = {"tens": headers, "fs": [v.nbytes for v in views], "cs": cs,
                  "pm": {"alg": self._mac_alg, "nonce": nonce}}
        return Outgoing("chunks", header, [], nbytes, chunks=[v[o:o + cs] for v in views for o in range(0, v.nbytes, cs)],
                        chunk_mac=ChunkMac(self._mac_alg, key))

    async def _inline_outgoing(self, headers: list[dict[str, Any]], frames: list[Any]) -> Outgoing:
        nbytes, nonce, key = self._new_payload_key(headers)
        if nbytes >= _offload_threshold(self._mac_alg):
            ptag = await asyncio.to_thread(payload_tag, self._mac_alg, key, frames)
        else:
            ptag = payload_tag(self._mac_alg, key, frames)
        return Outgoing("inline", {"tens": headers, "pm": {"alg": self._mac_alg, "nonce": nonce, "tag": ptag}},
                        frames, nbytes)

    def _peer_out(self, peer: Endpoint) -> _PeerOut:
        p = self._peers_out.get(peer)
        if p is not None:
            return p
        p = _PeerOut(peer, self._connect(peer), next_seq=self._next_seq.pop(peer, 1))
        p.reader = asyncio.create_task(self._ack_loop(p), name=f"channel-acks-{self.node_id}->{peer.node_id}")
        self._peers_out[peer] = p
        return p

    def _connect(self, peer: Endpoint) -> Any:
        """The sending socket to ``peer``: a DEALER (subclasses: a same-host Unix socket)."""
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # acks are small
        if ":" in peer.host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(peer.address)
        return LoopSocket(sock)

    def _reply_socket(self, ident: bytes) -> Any:
        """The socket that answers (acks, releases) the connection ``ident`` came on."""
        return self._router

    def _reset_peer(self, peer: Endpoint, why: str = "reset after a send timed out") -> None:
        """Drop the socket to ``peer`` and whatever it still queues (after a timeout: the peer may be
        dead, and a message delivered much later would be stale; or the connection was lost).
        Sends waiting for an ack fail at once, naming the peer. Sequence numbers carry on."""
        p = self._peers_out.pop(peer, None)
        if p is None:
            return
        self._next_seq[peer] = p.next_seq
        for fut in p.pending.values():
            if not fut.done():
                fut.set_exception(ChannelError(f"connection to {peer.node_id} {why}"))
        if p.reader is not None:
            p.reader.cancel()
        p.sock.close(linger=0)

    async def _ack_loop(self, p: _PeerOut) -> None:
        while True:
            try:
                frames = await p.sock.recv()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if self._closed or p.sock.closed:
                    return
                log.warning("channel %s: ack socket to %s failed: %s", self.node_id, p.endpoint.node_id, e)
                await asyncio.sleep(0.05)
                continue
            if frames and frames[0] != MAGIC_ACK:
                self._on_peer_message(p, frames)
                continue
            try:
                ack = self._parse_ack(frames, p.endpoint)
            except ValueError as e:
                self._drop("bad_ack", str(e))
                continue
            self._on_ack(p, ack)
            fut = p.pending.get(ack["seq"])
            if fut is None or fut.done():
                self._counters["late_acks"] += 1
                continue
            fut.set_result(ack)

    def _on_peer_message(self, p: _PeerOut, frames: list[bytes]) -> None:
        """Messages other than acks coming back on a DEALER (subclasses: shm slot releases)."""
        self._drop("bad_ack", "unknown reply type")

    def _on_ack(self, p: _PeerOut, ack: dict[str, Any]) -> None:
        """An authentic ack from ``p`` arrived (subclasses: releases it carries)."""

    def _ack_extra(self, ident: bytes, header: dict[str, Any]) -> dict[str, Any]:
        """Extra fields for the ack to ``ident`` (subclasses: piggybacked shm releases)."""
        return {}

    def _parse_reply(self, frames: list[bytes], peer: Endpoint, magic: bytes, typ: str) -> dict[str, Any]:
        """Check a signed reply (ack, release) from ``peer`` to this channel session."""
        if len(frames) != 3 or frames[0] != magic or len(frames[2]) != TAG_SIZE:
            raise ValueError(f"malformed {typ} frames")
        if not self._auth.verify([frames[1]], frames[2], DOMAIN):
            raise ValueError(f"{typ} with a bad MAC")
        msg = msgpack.unpackb(frames[1], raw=False)
        if (not isinstance(msg, dict) or msg.get("t") != typ or msg.get("to") != self.node_id
                or msg.get("sess") != self._session):
            raise ValueError(f"{typ} not addressed to this channel session")
        if msg.get("from") != peer.node_id:
            raise ValueError(f"{typ} from {msg.get('from')!r}, expected {peer.node_id!r}")
        return msg

    def _parse_ack(self, frames: list[bytes], peer: Endpoint) -> dict[str, Any]:
        ack = self._parse_reply(frames, peer, MAGIC_ACK, "ack")
        if not isinstance(ack.get("seq"), int):
            raise ValueError("ack without a sequence number")
        return ack

    # ------------------------------------------------------------------ receive
    async def _recv_loop(self, router: Any) -> None:
        """Read ``router`` only while a handler slot is free (beyond that the socket pushes back on
        senders). A message that starts no handler (dropped, or a chunk of an unfinished stream)
        hands its slot on."""
        assert self._slots is not None
        while True:
            try:
                frames = await router.recv(copy=False, into=self._chunk_sink, copy_head=4)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if self._closed:
                    return
                log.warning("channel %s: receive failed: %s", self.node_id, e)
                await asyncio.sleep(0.01)
                continue
            # the slot is taken after the read (a channel may read several sockets: a slot held while
            # waiting on one would starve the others); the next read waits for it: one message held
            await self._slots.acquire()
            try:
                started = self._accept(frames)
            except Exception as e:  # never let one message kill the receive loop
                log.exception("channel %s: unexpected error on a received message", self.node_id)
                self._drop("internal_error", repr(e))
                started = False
            if not started:
                self._slots.release()

    def _accept(self, frames: list[Any]) -> bool:
        """Validate framing, MAC and replay; spawn the handler task. False if dropped (or, for a
        streamed payload, not complete yet)."""
        if len(frames) == 5 and frames[1] == MAGIC_CHUNK:
            return self._accept_chunk(frames)
        if len(frames) < 4 or len(frames) > self._max_frames + 4:
            self._drop("bad_frames", f"{len(frames)} frames")
            return False
        ident = frames[0]
        if frames[1] != MAGIC_MSG:
            self._drop("bad_frames", "bad magic")
            return False
        hframe, tframe = frames[2], frames[3]
        if len(hframe) > self._max_header_bytes:
            self._drop("oversized", f"header of {len(hframe)} bytes")
            return False
        total = sum(len(f) for f in frames[4:])
        if total > self._max_message_bytes:
            self._drop("oversized", f"payload of {total} bytes")
            return False
        hbytes = hframe
        if len(tframe) != TAG_SIZE or not self._auth.verify([hbytes], tframe, DOMAIN):
            self._drop("bad_mac", "header MAC does not verify")
            return False
        try:
            header = msgpack.unpackb(hbytes, raw=False)
        except Exception as e:
            self._drop("bad_header", f"undecodable header: {e}")
            return False
        problem = _header_problem(header)
        if problem:
            self._drop("bad_header", problem)
            return False
        sender = header["from"]
        if not self._check_replay(sender, header):
            return False
        if header["to"] != self.node_id:
            self._drop("wrong_recipient", f"for {header['to']!r}")
            self._spawn_nack(ident, header, "wrong_recipient",
                             f"message for node {header['to']!r} reached node {self.node_id!r}")
            return False
        if header["pay"] == "chunks":
            return self._open_stream(ident, header, frames[4:])
        return self._start_handler(ident, header, frames[4:])

    def _start_handler(self, ident: bytes, header: dict[str, Any], payload: list[Any]) -> bool:
        self._counters["recv_msgs"] += 1
        task = asyncio.create_task(self._handle(ident, header, payload),
                                   name=f"channel-handle-{self.node_id}<-{header['from']}#{header['seq']}")
        self._handler_tasks.add(task)
        task.add_done_callback(self._handler_done)
        return True

    def _payload_key(self, session: bytes, nonce: bytes) -> bytes:
        """The one-time payload MAC key of a message (sender session + nonce from the signed header)."""
        return self._auth.tag([b"payload-key", session, nonce], DOMAIN)

    def _handler_done(self, task: asyncio.Task) -> None:
        self._handler_tasks.discard(task)
        if self._slots is not None:
            self._slots.release()
        if not task.cancelled() and task.exception() is not None:
            log.error("channel %s: handler task %s failed: %r", self.node_id, task.get_name(), task.exception())

    def _check_replay(self, sender: str, header: dict[str, Any]) -> bool:
        st, sess, seq = header["st"], header["sess"], header["seq"]
        cur = self._peers_in.get(sender)
        if cur is None or (sess != cur.session and st > cur.start_ns):
            self._peers_in[sender] = _PeerIn(st, sess, seq)  # first message of a (newer) session
            return True
        if sess != cur.session:
            self._drop("stale_session", f"from {sender}")
            return False
        if seq <= cur.last_seq:
            self._drop("replay", f"from {sender}: seq {seq} <= {cur.last_seq}")
            return False
        cur.last_seq = seq
        return True

    async def _handle(self, ident: bytes, header: dict[str, Any], payload: list[zmq.Frame]) -> None:
        code, err = "ok", ""
        try:
            tensors = await self._receive_payload(header, payload, ident)
            self._counters["recv_bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
            if self._handler is None:
                raise PayloadError("no_handler", f"node {self.node_id} has no handler installed")
            env = Envelope(header["from"], header["kind"], header["meta"], tensors)
            del tensors
            try:
                await self._handler(env)
                del env  # tensors the handler did not keep die now, before the ack (shm: release rides on it)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._counters["handler_errors"] += 1
                log.warning("channel %s: handler for %r from %s raised %s: %s", self.node_id, header["kind"],
                            header["from"], type(e).__name__, e)
                code, err = "handler_error", f"{type(e).__name__}: {e}"
        except PayloadError as e:
            self._drop(e.code, str(e))
            code, err = e.code, str(e)
        except codec.CodecError as e:
            self._drop("bad_payload", str(e))
            code, err = "bad_payload", str(e)
        except Exception as e:  # a bug or resource failure while unpacking: report, keep serving
            log.exception("channel %s: failed to unpack %r from %s", self.node_id, header["kind"], header["from"])
            self._drop("internal_error", repr(e))
            code, err = "internal_error", f"{type(e).__name__}: {e}"
        await self._send_ack(ident, header, code, err)

    async def _receive_payload(self, header: dict[str, Any], payload: list[Any],
                               ident: bytes) -> dict[str, torch.Tensor]:
        if header["pay"] == "chunks":  # every chunk was checked on arrival
            return codec.decode(header.get("tens"), payload)
        if header["pay"] != "inline":
            raise PayloadError("unsupported_payload",
                               f"payload transport {header['pay']!r} is not supported by a {self.transport} channel")
        return await self._decode_inline(header, payload)

    async def _decode_inline(self, header: dict[str, Any], payload: list[zmq.Frame]) -> dict[str, torch.Tensor]:
        pm = header.get("pm")
        if not isinstance(pm, dict) or not isinstance(pm.get("nonce"), bytes) or not isinstance(pm.get("tag"), bytes):
            raise PayloadError("bad_header", "inline payload without a payload MAC")
        bufs = [getattr(f, "buffer", f) for f in payload]  # zmq.Frame, or a memoryview (local socket)
        key = self._payload_key(header["sess"], pm["nonce"])
        total = sum(len(f) for f in payload)
        alg = str(pm.get("alg"))
        if total >= _offload_threshold(alg):
            expect = await asyncio.to_thread(payload_tag, alg, key, bufs)
        else:
            expect = payload_tag(alg, key, bufs)
        if not hmac.compare_digest(expect, pm["tag"]):
            raise PayloadError("bad_payload_mac", "payload frames do not match the signed header (tampered?)")
        return codec.decode(header.get("tens"), bufs)

    def _spawn_nack(self, ident: bytes, header: dict[str, Any], code: str, err: str) -> None:
        t = asyncio.create_task(self._send_ack(ident, header, code, err),
                                name=f"channel-nack-{self.node_id}->{header.get('from')}")
        self._handler_tasks.add(t)
        t.add_done_callback(self._handler_tasks.discard)

    async def _send_ack(self, ident: bytes, header: dict[str, Any], code: str, err: str) -> None:
        if self._closed or self._router is None:
            return
        ack = {"t": "ack", "from": self.node_id, "to": header["from"], "sess": header["sess"],
               "seq": header["seq"], "ok": code == "ok", "code": code, "err": err[:4000],
               **self._ack_extra(ident, header)}
        if code != "ok":
            self._counters["nacks_sent"] += 1
        body = msgpack.packb(ack, use_bin_type=True)
        frames = [ident, MAGIC_ACK, body, self._auth.tag([body], DOMAIN)]
        # A ROUTER send never blocks (a full pipe drops), so the ack leaves in the same loop step as
        # the handler's return (a handler that triggers close() still gets its ack out).
        try:
            self._reply_socket(ident).send_now(frames, copy=True)
        except zmq.ZMQError as e:
            log.warning("channel %s: could not ack %s#%s: %s", self.node_id, header["from"], header["seq"], e)


def freeze_startup_objects() -> None:
    """Move every object alive now (torch, transformers, the model: ~170k objects) out of the
    cyclic garbage collector's reach (``gc.freeze``), so its periodic full collections stop
    rescanning them.

    Why here: each data-plane message allocates a few dozen short-lived objects, and every so
    many allocations CPython runs a full collection over *all* tracked objects: ~70 ms with
    torch imported. Spread over messages that was most of a small message's CPU on the sending
    side (~300 us of ~320 us per acked empty message; ~90 us after freezing). Objects created later
    are collected as usual; only startup objects, which live for the whole process anyway, are
    exempt. Idempotent and cheap (it moves a list), so every channel start calls it."""
    gc.freeze()


def _timeout(seconds: float) -> Any:
    """asyncio.timeout (3.11+: no extra task per call), else a wait_for-based equivalent."""
    if hasattr(asyncio, "timeout"):
        return asyncio.timeout(seconds)
    return _WaitForTimeout(seconds)  # pragma: no cover - Python 3.10


class _WaitForTimeout:  # pragma: no cover - Python 3.10 only
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.handle: asyncio.TimerHandle | None = None
        self.fired = False

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        assert task is not None

        def fire() -> None:
            self.fired = True
            task.cancel()

        self.handle = asyncio.get_running_loop().call_later(self.seconds, fire)

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        assert self.handle is not None
        self.handle.cancel()
        if self.fired and exc_type is asyncio.CancelledError:
            raise TimeoutError
        return False


def _offload_threshold(alg: str) -> int:
    return GMAC_OFFLOAD_BYTES if alg == "aes-gmac" else OFFLOAD_BYTES


def _header_problem(h: Any) -> str:
    """'' when an (authentic) header has the expected shape, else what is wrong."""
    if not isinstance(h, dict):
        return "header is not a map"
    if h.get("t") != "msg" or h.get("v") != PROTOCOL:
        return f"unknown message type/version {h.get('t')!r}/{h.get('v')!r}"
    for key, typ in (("from", str), ("to", str), ("sess", bytes), ("st", int), ("seq", int), ("kind", str),
                     ("meta", dict), ("pay", str)):
        if not isinstance(h.get(key), typ):
            return f"header field {key!r} missing or not {typ.__name__}"
    return ""


def _to_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CUDA tensors travel through host memory on the zmq/shm channels."""
    if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors.values()):
        return {k: (t.cpu() if isinstance(t, torch.Tensor) else t) for k, t in tensors.items()}
    return tensors
