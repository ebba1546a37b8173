"""The link: the data plane's one protocol (framing, MAC, replay, ack) over ZeroMQ and Unix sockets.

Why it exists: every transport, whatever mover carries its payload bytes (socket frames, shared
memory, NCCL), sends a signed header, waits for an ack and checks what it receives the same way.
That protocol lives here once; movers plug in through explicit registries (``payload_movers``:
receive a ``pay`` kind; ``internal``: answer an internal message kind; ``ack_extras`` /
``ack_hooks``: add to and read acks; ``reply_handlers``: signed replies other than acks), never by
subclassing. The socket mover (inline frames and streamed chunks) is the link itself.

Wire format (every frame after the ZMQ routing identity)::

    message  DEALER -> ROUTER : [b"DFD1", header, tag, payload_0, ..., payload_k]
    chunk    DEALER -> ROUTER : [b"DFC1", (seq, index) as 2 x u64, chunk_tag, data]
    ack      ROUTER -> DEALER : [b"DFA1", ack_header, tag]

``header`` is msgpack: sender/recipient node ids, a per-process session id and start
time, a per-sender sequence number, the message kind, user meta, the tensor headers
(:mod:`.codec`) and how the payload travels (``inline`` frames, ``chunks``, ``shm`` or
``nccl``). ``tag`` is :class:`distflow.core.auth.Authenticator` (domain ``b"data"``) over
the header. Payload bytes are covered by one-time MACs (:mod:`distflow.core.auth`): AES-GMAC keyed
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
number seen, and drops anything not newer (:class:`~distflow.core.auth.ReplayGuard`).

Receive side: one ROUTER (and, with ``local_socket``, one same-host Unix socket: :mod:`.local_socket`),
read by the link's :class:`.receive.Receiver` (as :class:`.streams.Streams` is for streamed payloads). Each authentic message runs
the handler in its own named task (at most ``max_inflight`` at once, beyond which the socket is
not read, so TCP pushes back on senders); the ack goes out only after the handler returns. Send side: one
DEALER per peer, an ack reader task per DEALER, and a future per outstanding sequence
number. The DEALER is not ``IMMEDIATE`` (with it, libzmq discards acks that arrived but
were not read yet when the peer closes); instead a send that times out resets that peer's
DEALER, so nothing stale stays queued for a dead peer and delivered long after.

Sockets are plain zmq sockets driven by the loop through :class:`LoopSocket` (non-blocking
calls, FD wake-ups), not ``zmq.asyncio``: its per-call machinery cost more Python time than the
protocol itself, and with N producers x N consumers messages per step that time is the
peer-to-peer handoff's main cost. Movers may add fields to acks (``ack_extras``) and read them
(``ack_hooks``): the shared-memory mover returns its slot releases that way.

Same-host control path (``local_socket``): a peer on this host gets the signed headers, acks and
releases over its Unix socket (one wake-up per message instead of four); TCP when it has none (a
plain socket-only transport, another user, another network namespace).
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import msgpack
import torch
import zmq

from distflow.core.auth import TAG_SIZE, Authenticator, ChunkMac, default_mac_alg, payload_tag
import distflow.transport.codec as codec
from distflow.transport.api import ChannelClosed, ChannelError, Endpoint, Envelope, Handler, RemoteError, log
from distflow.transport.local_socket import IDENT_TAG, LocalDealer, LocalRouter, local_available
from distflow.transport.loop_socket import LoopSocket
from distflow.transport.receive import DOMAIN, MAGIC_ACK, MAGIC_MSG, PROTOCOL, WRONG_RECIPIENT, Receiver, _offload_threshold
from distflow.transport.streams import MAGIC_CHUNK

__all__ = ["Link", "LoopSocket", "Outgoing", "MAGIC_MSG", "MAGIC_ACK", "MAGIC_CHUNK", "DOMAIN"]

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


class Link:
    """One node's end of the protocol: binds the data port, sends to any peer, receives from any.

    Not a transport by itself: :class:`~distflow.transport.composed.ComposedTransport` has one and
    puts the movers around it. ``kind`` names the transport in stats and refusals."""

    def __init__(
        self,
        node_id: str,
        secret: str | bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        kind: str = "zmq",
        local_socket: bool = False,
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
        if not isinstance(local_socket, bool):
            raise ValueError(f"local_socket must be a bool, got {local_socket!r}")
        self.node_id = node_id
        self.kind = kind
        self.host = host
        self.port = port
        self.auth = Authenticator(secret)
        self.max_message_bytes = max_message_bytes
        self.max_header_bytes = max_header_bytes
        self.max_frames = max_frames
        self._mac_alg = mac_alg or default_mac_alg()
        if self._mac_alg not in ("aes-gmac", "hmac-sha256"):
            raise ValueError(f"mac_alg must be 'aes-gmac' or 'hmac-sha256', got {self._mac_alg!r}")
        if self._mac_alg == "aes-gmac" and default_mac_alg() != "aes-gmac":
            raise ValueError("mac_alg 'aes-gmac' needs the `cryptography` package")
        self.close_timeout = close_timeout
        self._pack_below = pack_below
        if not isinstance(stream_min_bytes, int) or stream_min_bytes < 0:
            raise ValueError(f"stream_min_bytes must be an int >= 0 (0: never stream), got {stream_min_bytes!r}")
        if not 4096 <= stream_chunk <= 1 << 30:
            raise ValueError(f"stream_chunk must be between 4096 and 2**30 bytes, got {stream_chunk!r}")
        self._stream_min_bytes = stream_min_bytes  # 0: never stream
        self._stream_chunk = stream_chunk
        self.use_local = local_socket and local_available()
        self.local_hosts = _local_addresses(host)
        self.session = os.urandom(16)
        self._start_ns = time.time_ns()
        self.handler: Handler | None = None
        self._ctx: zmq.Context | None = None
        self.router: LoopSocket | None = None
        self.local: LocalRouter | None = None
        self._receivers: list[tuple[Any, asyncio.Task]] = []  # (socket, its receive loop): the ROUTER, ...
        self._peers_out: dict[Endpoint, _PeerOut] = {}
        self._next_seq: dict[str, int] = {}  # per node id; survives a reset of a peer's DEALER
        self.closed = False
        self.started = False
        self.counters: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        # what movers plug in (explicit registries: nothing is overridden or probed)
        self.payload_movers: dict[str, Callable[[dict[str, Any], list[Any], bytes], Awaitable[dict[str, torch.Tensor]]]] = {}
        self.internal: dict[str, Callable[[Envelope], Awaitable[Any]]] = {}
        self.ack_extras: list[Callable[[bytes, dict[str, Any]], dict[str, Any]]] = []
        self.ack_hooks: list[Callable[[Endpoint, dict[str, Any]], None]] = []
        self.reply_handlers: dict[bytes, Callable[[Endpoint, list[bytes]], None]] = {}
        self.receiver = Receiver(self, max_inflight, stream_timeout)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.started:
            raise RuntimeError(f"channel {self.node_id} already started")
        self.started = True
        freeze_startup_objects()
        self._ctx = zmq.Context(io_threads=1)
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
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
        self.router = LoopSocket(router)
        self.port = int(router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        self.receiver.start()
        self._serve(self.router, "recv")
        if self.use_local:
            try:
                self.local = LocalRouter(self.port, self.max_message_bytes + self.max_header_bytes,
                                         self.max_frames + 4)
            except OSError as e:  # the name is taken (by another user?): same-host peers use TCP
                log.warning("channel %s: no same-host socket (%s); same-host peers use TCP", self.node_id, e)
            else:
                self._serve(self.local, "recv-local")

    def _serve(self, router: Any, name: str) -> None:
        """Receive on ``router`` (closed with the link)."""
        task = asyncio.create_task(self.receiver.recv_loop(router), name=f"channel-{name}-{self.node_id}")
        self._receivers.append((router, task))

    def set_handler(self, handler: Handler) -> None:
        if not callable(handler):
            raise TypeError(f"handler must be an async callable, got {type(handler).__name__}")
        self.handler = handler

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        tasks = [*(t for _, t in self._receivers), *self.receiver.handler_tasks]
        for p in self._peers_out.values():
            for fut in p.pending.values():
                if not fut.done():
                    fut.set_exception(ChannelClosed(f"channel {self.node_id} closed"))
            if p.reader is not None:
                tasks.append(p.reader)
        for t in tasks:
            t.cancel()
        for st in self.receiver.streams.open.values():
            st.timer.cancel()
        self.receiver.streams.open.clear()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=self.close_timeout)
            if pending:
                log.warning("channel %s: %d tasks did not stop within %.1fs", self.node_id, len(pending),
                            self.close_timeout)
        for p in self._peers_out.values():
            p.sock.close(linger=0)
        for router, _ in self._receivers:
            router.close(linger=int(self.close_timeout * 500))  # let queued acks reach their senders
        if self._ctx is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self._ctx.term), self.close_timeout)
            except TimeoutError:
                log.warning("channel %s: zmq context did not terminate within %.1fs", self.node_id,
                            self.close_timeout)
        self._peers_out.clear()
        self.receiver.streams.close()

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        c = self.counters
        out: dict[str, Any] = {
            "node_id": self.node_id,
            "transport": self.kind,
            "port": self.port,
            "sent_msgs": c["sent_msgs"],
            "sent_bytes": c["sent_bytes"],
            "recv_msgs": c["recv_msgs"],
            "internal_msgs": c["internal_msgs_out"] + c["internal_msgs_in"],  # (channel-to-channel, e.g. posting)
            "recv_bytes": c["recv_bytes"],
            "handler_errors": c["handler_errors"],
            "nacks_sent": c["nacks_sent"],
            "remote_errors": c["remote_errors"],
            "send_timeouts": c["send_timeouts"],
            "handlers_running": len(self.receiver.handler_tasks),
            "streams_sent": c["streams_sent"],
            "streams_received": c["streams_received"],
            "streams_open": len(self.receiver.streams.open),
            "dropped": dict(self.dropped),
            "dropped_total": sum(self.dropped.values()),
        }
        out.update({"local_socket": self.local is not None, "local_connects": c["local_connects"],
                    "local_refused": self.local.refused if self.local is not None else 0})  # another user's
        return out

    def drop(self, reason: str, detail: str = "") -> None:
        self.dropped[reason] += 1
        n = self.dropped[reason]
        if n <= 3 or n % 1000 == 0:
            log.warning("channel %s: dropped message (%s, #%d) %s", self.node_id, reason, n, detail)

    def is_local(self, peer: Endpoint) -> bool:
        return peer.host in self.local_hosts

    def payload_key(self, session: bytes, nonce: bytes) -> bytes:
        """The one-time payload MAC key of a message (sender session + nonce from the signed header)."""
        return self.auth.tag([b"payload-key", session, nonce], DOMAIN)

    def ack_extra(self, ident: bytes, header: dict[str, Any]) -> dict[str, Any]:
        """What the movers add to the ack to ``ident`` (shared-memory releases)."""
        extra: dict[str, Any] = {}
        for f in self.ack_extras:
            extra.update(f(ident, header))
        return extra

    # ------------------------------------------------------------------ send
    async def within(self, peer: Endpoint, kind: str, timeout: float, sending: Awaitable[Any]) -> Any:
        """Await ``sending`` (one message to ``peer``) under ``timeout``; past it the connection to
        ``peer`` is reset (nothing stale stays queued for a dead peer) and TimeoutError names both."""
        try:
            async with asyncio.timeout(timeout):
                return await sending
        except TimeoutError:
            self.counters["send_timeouts"] += 1
            self.reset_peer(peer)
            raise TimeoutError(
                f"channel {self.node_id}: send of {kind!r} to {peer.node_id} ({peer.host}:{peer.port}) "
                f"not acknowledged within {timeout:g}s"
            ) from None

    def check_send_args(self, peer: Endpoint, kind: str, meta: Any, tensors: Any) -> None:
        if self.closed:
            raise ChannelClosed(f"channel {self.node_id} is closed")
        if not self.started:
            raise RuntimeError(f"channel {self.node_id}: call start() before send()")
        if not isinstance(peer, Endpoint):
            raise TypeError(f"peer must be an Endpoint, got {type(peer).__name__}")
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"kind must be a non-empty str, got {kind!r}")
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
        if not isinstance(tensors, dict):
            raise TypeError(f"tensors must be a dict of name -> torch.Tensor, got {type(tensors).__name__}")

    async def send_message(self, peer: Endpoint, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
                           prepare: Callable[[Endpoint, dict[str, torch.Tensor]], Awaitable[Outgoing]]) -> Any:
        """Check, prepare the payload with ``prepare`` (a mover's, or :meth:`prepare_payload`), send,
        await the ack; the payload's release hook learns whether it was acked."""
        self.check_send_args(peer, kind, meta, tensors)
        out = await prepare(peer, tensors)
        acked = False
        try:
            reply = await self.send_prepared(peer, kind, meta, out)
            acked = True
            return reply
        finally:
            if out.release is not None:
                out.release(acked)

    async def send_prepared(self, peer: Endpoint, kind: str, meta: dict[str, Any], out: Outgoing) -> Any:
        p = self._peer_out(peer)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        async with p.order:  # sequence numbers go on the wire in increasing order
            seq = p.next_seq
            p.next_seq += 1
            header = {
                "t": "msg", "v": PROTOCOL, "from": self.node_id, "to": peer.node_id,
                "sess": self.session, "st": self._start_ns, "seq": seq, "kind": kind,
                "meta": meta, "pay": out.pay, **out.header,
            }
            try:
                hbytes = msgpack.packb(header, use_bin_type=True)
            except (TypeError, ValueError, OverflowError) as e:
                raise TypeError(f"meta of {kind!r} message is not msgpack-serializable: {e}") from None
            if len(hbytes) > self.max_header_bytes:
                raise ValueError(f"{kind!r} message header is {len(hbytes)} bytes, "
                                 f"over the {self.max_header_bytes}-byte limit")
            tag = self.auth.tag([hbytes], DOMAIN)
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
            self.counters["remote_errors"] += 1
            raise RemoteError(peer.node_id, kind, str(ack.get("code", "error")), str(ack.get("err", "")))
        if kind.startswith("__"):  # the channel's own (a same-host introduction): not the caller's traffic
            self.counters["internal_msgs_out"] += 1
        else:
            self.counters["sent_msgs"] += 1
            self.counters["sent_bytes"] += out.nbytes
        return ack.get("reply")

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
        self.counters["streams_sent"] += 1

    async def prepare_payload(self, peer: Endpoint, tensors: dict[str, torch.Tensor]) -> Outgoing:
        """Inline frames: zero-copy views of the tensors, payload MAC tag in the header; at least
        ``stream_min_bytes``: streamed in chunks, each with its own MAC."""
        headers, frames = codec.encode(await to_cpu(tensors), pack_below=self._pack_below)
        if 0 < self._stream_min_bytes <= sum(h["nbytes"] for h in headers):
            return self._stream_outgoing(headers, frames)
        return await self.inline_outgoing(headers, frames)

    def _new_payload_key(self, headers: list[dict[str, Any]]) -> tuple[int, bytes, bytes]:
        """(payload bytes, nonce, one-time MAC key) for an outgoing payload within the size limit."""
        nbytes = sum(h["nbytes"] for h in headers)
        if nbytes > self.max_message_bytes:
            raise ValueError(f"payload of {nbytes} bytes is over the {self.max_message_bytes}-byte message limit")
        nonce = os.urandom(16)
        return nbytes, nonce, self.payload_key(self.session, nonce)

    def _stream_outgoing(self, headers: list[dict[str, Any]], frames: list[Any]) -> Outgoing:
        nbytes, nonce, key = self._new_payload_key(headers)
        views = [memoryview(f).cast("B") for f in frames]
        cs = self._stream_chunk
        header = {"tens": headers, "fs": [v.nbytes for v in views], "cs": cs,
                  "pm": {"alg": self._mac_alg, "nonce": nonce}}
        return Outgoing("chunks", header, [], nbytes, chunks=[v[o:o + cs] for v in views for o in range(0, v.nbytes, cs)],
                        chunk_mac=ChunkMac(self._mac_alg, key))

    async def inline_outgoing(self, headers: list[dict[str, Any]], frames: list[Any]) -> Outgoing:
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
        # One connection per node: sequence numbers are per node (the receiver checks them per
        # sender), so a node reached at another address replaces its older connection.
        for old in [e for e in self._peers_out if e.node_id == peer.node_id]:
            self.reset_peer(old, f"({old.host}:{old.port}) replaced by {peer.host}:{peer.port}")
        p = _PeerOut(peer, self._connect(peer), next_seq=self._next_seq.pop(peer.node_id, 1))
        p.reader = asyncio.create_task(self._ack_loop(p), name=f"channel-acks-{self.node_id}->{peer.node_id}")
        self._peers_out[peer] = p
        return p

    def _connect(self, peer: Endpoint) -> Any:
        """The sending socket to ``peer``: its same-host Unix socket when it has one, else a DEALER."""
        if self.use_local and self.is_local(peer):
            try:
                local = LocalDealer(peer.port, 1 << 20, lambda why: self.reset_peer(peer, f"lost ({why})"))
            except OSError:
                pass
            else:
                self.counters["local_connects"] += 1
                return local
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # acks are small
        if ":" in peer.host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(peer.address)
        return LoopSocket(sock)

    def reply_socket(self, ident: bytes) -> Any:
        """The socket that answers (acks, releases) the connection ``ident`` came on."""
        return self.local if ident[:1] == IDENT_TAG and self.local is not None else self.router

    def reset_peer(self, peer: Endpoint, why: str = "reset after a send timed out") -> None:
        """Drop the socket to ``peer`` and whatever it still queues (after a timeout: the peer may be
        dead, and a message delivered much later would be stale; or the connection was lost).
        Sends waiting for an ack fail at once, naming the peer. Sequence numbers carry on."""
        p = self._peers_out.pop(peer, None)
        if p is None:
            return
        self._next_seq[peer.node_id] = p.next_seq
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
                if self.closed or p.sock.closed:
                    return
                log.warning("channel %s: ack socket to %s failed: %s", self.node_id, p.endpoint.node_id, e)
                await asyncio.sleep(0.05)
                continue
            if frames and frames[0] != MAGIC_ACK:
                on_reply = self.reply_handlers.get(frames[0])
                if on_reply is None:
                    self.drop("bad_ack", "unknown reply type")
                else:
                    on_reply(p.endpoint, frames)
                continue
            try:
                ack = self._parse_ack(frames, p.endpoint)
            except ValueError as e:
                self.drop("bad_ack", str(e))
                continue
            for hook in self.ack_hooks:
                hook(p.endpoint, ack)
            fut = p.pending.get(ack["seq"])
            if fut is None or fut.done():
                self.counters["late_acks"] += 1
                continue
            fut.set_result(ack)

    def parse_reply(self, frames: list[bytes], peer: Endpoint, magic: bytes, typ: str) -> dict[str, Any]:
        """Check a signed reply (ack, release) from ``peer`` to this channel session."""
        if len(frames) != 3 or frames[0] != magic or len(frames[2]) != TAG_SIZE:
            raise ValueError(f"malformed {typ} frames")
        if not self.auth.verify([frames[1]], frames[2], DOMAIN):
            raise ValueError(f"{typ} with a bad MAC")
        msg = msgpack.unpackb(frames[1], raw=False)
        if (not isinstance(msg, dict) or msg.get("t") != typ or msg.get("to") != self.node_id
                or msg.get("sess") != self.session):
            raise ValueError(f"{typ} not addressed to this channel session")
        if msg.get("from") != peer.node_id and not (typ == "ack" and msg.get("code") == WRONG_RECIPIENT
                                                    and msg.get("ok") is False):
            # (A wrong_recipient refusal comes from whoever listens at the address we used for
            # ``peer``: authentic, addressed to this session, and the one answer that says so.)
            raise ValueError(f"{typ} from {msg.get('from')!r}, expected {peer.node_id!r}")
        return msg

    def _parse_ack(self, frames: list[bytes], peer: Endpoint) -> dict[str, Any]:
        ack = self.parse_reply(frames, peer, MAGIC_ACK, "ack")
        if not isinstance(ack.get("seq"), int):
            raise ValueError("ack without a sequence number")
        return ack


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


async def to_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CUDA tensors travel through host memory on the zmq/shm channels, copied in a worker
    thread: a device-to-host copy waits for every kernel queued before it on the device, which
    must not stall the event loop (callers that can stage the copy themselves do: the weight
    publisher's pinned buffers)."""
    if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors.values()):
        return await asyncio.to_thread(
            lambda: {k: (t.cpu() if isinstance(t, torch.Tensor) else t) for k, t in tensors.items()})
    return tensors


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
