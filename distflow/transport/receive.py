"""The receive side of the link's protocol: framing, header MAC, replay, handler tasks, acks.

Why a module of its own: :class:`~distflow.transport.link.Link` is the sender and the receiver of
one protocol, and the two halves share nothing but the wire constants and a few counters. The
:class:`Receiver` (one per link, composed, not a mixin) holds the receiving half, as
:class:`~distflow.transport.streams.Streams` holds the receiving half of streamed payloads. Every
receiving socket (the ROUTER, and the same-host Unix socket) runs :meth:`Receiver.recv_loop`.

What a received message goes through, in order: framing and size limits, the header MAC
(:class:`~distflow.core.auth.Authenticator`, domain ``b"data"``), the header's shape, the recipient,
replay (:class:`~distflow.core.auth.ReplayGuard` with a window of one: per sender the newest
(start time, session), and increasing sequence numbers); then a named handler task (at most
``max_inflight`` at once, beyond which sockets are not read, so senders feel backpressure), the
payload (its MAC checked; or handed to the mover named by the header's ``pay``: shared memory,
NCCL), the transport's internal kinds or the user's handler, and the ack, sent only after the
handler returned, with what the movers add to it (shared-memory releases).
Anything wrong is dropped and counted, or NACKed with its reason; nothing kills the loop.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

import msgpack
import torch
import zmq

from distflow.core.auth import TAG_SIZE, MacError, ReplayGuard, payload_tag
import distflow.transport.codec as codec
from distflow.transport.api import Envelope, PayloadError, log
from distflow.transport.streams import MAGIC_CHUNK, Streams

MAGIC_MSG = b"DFD1"
MAGIC_ACK = b"DFA1"
PROTOCOL = 1
WRONG_RECIPIENT = "wrong_recipient"  # the nack of a message addressed to another node (see the sender's ack check)
DOMAIN = b"data"
OFFLOAD_BYTES = 1 << 20  # copies / hashing that release the GIL run in a worker thread above this size
GMAC_OFFLOAD_BYTES = 64 << 20  # GMAC runs at 10-25 GB/s: below this a thread hop costs more than it saves


class Receiver:
    """The receiving half of one :class:`~distflow.transport.link.Link` (see module docstring)."""

    def __init__(self, link: Any, max_inflight: int, stream_timeout: float) -> None:
        """``link``: the :class:`~distflow.transport.link.Link` this receives for (its node id, auth,
        counters, limits, registries and reply sockets)."""
        self.link = link
        self.slots: asyncio.Semaphore | None = None  # made in start() (needs the running loop)
        self._max_inflight = max_inflight
        self.handler_tasks: set[asyncio.Task] = set()
        # data plane: a connection delivers in order, so a sender's sequence numbers must grow
        # (window 1); a sender's (start time, session) orders its lives; nothing is forgotten
        self.replay = ReplayGuard(window=1, forget_after_s=None)
        self.streams = Streams(max_frames=link.max_frames, max_message_bytes=link.max_message_bytes,
                               timeout=stream_timeout, counters=link.counters, drop=link.drop, nack=self.spawn_nack,
                               start_handler=self._start_handler, payload_key=link.payload_key)

    def start(self) -> None:
        self.slots = asyncio.Semaphore(self._max_inflight)

    async def recv_loop(self, router: Any) -> None:
        """Read ``router`` only while a handler slot is free (beyond that the socket pushes back on
        senders). A message that starts no handler (dropped, or a chunk of an unfinished stream)
        hands its slot on."""
        assert self.slots is not None
        while True:
            try:
                frames = await router.recv(copy=False, into=self.streams.chunk_sink, copy_head=4)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if self.link.closed:
                    return
                log.warning("channel %s: receive failed: %s", self.link.node_id, e)
                await asyncio.sleep(0.01)
                continue
            # the slot is taken after the read (a channel may read several sockets: a slot held while
            # waiting on one would starve the others); the next read waits for it: one message held
            await self.slots.acquire()
            try:
                started = self._accept(frames)
            except Exception as e:  # never let one message kill the receive loop
                log.exception("channel %s: unexpected error on a received message", self.link.node_id)
                self.link.drop("internal_error", repr(e))
                started = False
            if not started:
                self.slots.release()

    def _accept(self, frames: list[Any]) -> bool:
        """Validate framing, MAC and replay; spawn the handler task. False if dropped (or, for a
        streamed payload, not complete yet)."""
        link = self.link
        if len(frames) == 5 and frames[1] == MAGIC_CHUNK:
            return self.streams.accept_chunk(frames)
        if len(frames) < 4 or len(frames) > link.max_frames + 4:
            link.drop("bad_frames", f"{len(frames)} frames")
            return False
        ident = frames[0]
        if frames[1] != MAGIC_MSG:
            link.drop("bad_frames", "bad magic")
            return False
        hframe, tframe = frames[2], frames[3]
        if len(hframe) > link.max_header_bytes:
            link.drop("oversized", f"header of {len(hframe)} bytes")
            return False
        total = sum(len(f) for f in frames[4:])
        if total > link.max_message_bytes:
            link.drop("oversized", f"payload of {total} bytes")
            return False
        hbytes = hframe
        if len(tframe) != TAG_SIZE or not link.auth.verify([hbytes], tframe, DOMAIN):
            link.drop("bad_mac", "header MAC does not verify")
            return False
        try:
            header = msgpack.unpackb(hbytes, raw=False)
        except Exception as e:
            link.drop("bad_header", f"undecodable header: {e}")
            return False
        problem = _header_problem(header)
        if problem:
            link.drop("bad_header", problem)
            return False
        sender = header["from"]
        if header["to"] != link.node_id:  # before the replay check: a message not for us leaves no state
            link.drop(WRONG_RECIPIENT, f"for {header['to']!r}")
            self.spawn_nack(ident, header, WRONG_RECIPIENT,
                             f"message for node {header['to']!r} reached node {link.node_id!r}")
            return False
        if not self._check_replay(sender, header):
            return False
        if header["pay"] == "chunks":
            return self.streams.open_stream(ident, header, frames[4:])
        return self._start_handler(ident, header, frames[4:])

    def _start_handler(self, ident: bytes, header: dict[str, Any], payload: list[Any]) -> bool:
        self.link.counters["internal_msgs_in" if header["kind"].startswith("__") else "recv_msgs"] += 1
        task = asyncio.create_task(self._handle(ident, header, payload),
                                   name=f"channel-handle-{self.link.node_id}<-{header['from']}#{header['seq']}")
        self.handler_tasks.add(task)
        task.add_done_callback(self._handler_done)
        return True

    def _handler_done(self, task: asyncio.Task) -> None:
        self.handler_tasks.discard(task)
        if self.slots is not None:
            self.slots.release()
        if not task.cancelled() and task.exception() is not None:
            log.error("channel %s: handler task %s failed: %r", self.link.node_id, task.get_name(), task.exception())

    def _check_replay(self, sender: str, header: dict[str, Any]) -> bool:
        why = self.replay.check(sender, (header["st"], header["sess"]), header["seq"])
        if why == "stale":
            self.link.drop("stale_session", f"from {sender}")
        elif why:
            self.link.drop("replay", f"from {sender}: seq {header['seq']} <= {self.replay.highest(sender)}")
        return not why

    async def _handle(self, ident: bytes, header: dict[str, Any], payload: list[zmq.Frame]) -> None:
        code, err, reply = "ok", "", None
        try:
            tensors = await self._receive_payload(header, payload, ident)
            self.link.counters["recv_bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
            env = Envelope(header["from"], header["kind"], header["meta"], tensors)
            del tensors
            try:
                reply = await self._call_handler(env)
                del env  # tensors the handler did not keep die now, before the ack (shm: release rides on it)
            except (asyncio.CancelledError, PayloadError):  # (no handler, or a refused internal message)
                raise
            except Exception as e:
                self.link.counters["handler_errors"] += 1
                log.warning("channel %s: handler for %r from %s raised %s: %s", self.link.node_id, header["kind"],
                            header["from"], type(e).__name__, e)
                code, err = "handler_error", f"{type(e).__name__}: {e}"
        except PayloadError as e:
            self.link.drop(e.code, str(e))
            code, err = e.code, str(e)
        except codec.CodecError as e:
            self.link.drop("bad_payload", str(e))
            code, err = "bad_payload", str(e)
        except Exception as e:  # a bug or resource failure while unpacking: report, keep serving
            log.exception("channel %s: failed to unpack %r from %s", self.link.node_id, header["kind"], header["from"])
            self.link.drop("internal_error", repr(e))
            code, err = "internal_error", f"{type(e).__name__}: {e}"
        await self._send_ack(ident, header, code, err, reply)

    async def _call_handler(self, env: Envelope) -> Any:
        """The transport's internal kinds (a mover's own messages), else the user's handler. What it
        returns (a small msgpack-able value, or None) rides on the ack and is what ``send`` returns."""
        internal = self.link.internal.get(env.kind)
        if internal is not None:
            return await internal(env)
        if self.link.handler is None:
            raise PayloadError("no_handler", f"node {self.link.node_id} has no handler installed")
        return await self.link.handler(env)

    async def _receive_payload(self, header: dict[str, Any], payload: list[Any],
                               ident: bytes) -> dict[str, torch.Tensor]:
        pay = header["pay"]
        if pay == "chunks":  # every chunk was checked on arrival
            return codec.decode(header.get("tens"), payload)
        if pay == "inline":
            return await self.decode_inline(header, payload)
        mover = self.link.payload_movers.get(pay)
        if mover is None:
            raise PayloadError("unsupported_payload",
                               f"payload transport {pay!r} is not supported by a {self.link.kind} channel")
        return await mover(header, payload, ident)

    async def decode_inline(self, header: dict[str, Any], payload: list[zmq.Frame]) -> dict[str, torch.Tensor]:
        pm = header.get("pm")
        if not isinstance(pm, dict) or not isinstance(pm.get("nonce"), bytes) or not isinstance(pm.get("tag"), bytes):
            raise PayloadError("bad_header", "inline payload without a payload MAC")
        bufs = [getattr(f, "buffer", f) for f in payload]  # zmq.Frame, or a memoryview (local socket)
        key = self.link.payload_key(header["sess"], pm["nonce"])
        total = sum(len(f) for f in payload)
        alg = str(pm.get("alg"))
        try:
            if total >= _offload_threshold(alg):
                expect = await asyncio.to_thread(payload_tag, alg, key, bufs)
            else:
                expect = payload_tag(alg, key, bufs)
        except MacError as e:
            raise PayloadError(e.code, str(e)) from None
        if not hmac.compare_digest(expect, pm["tag"]):
            raise PayloadError("bad_payload_mac", "payload frames do not match the signed header (tampered?)")
        return codec.decode(header.get("tens"), bufs)

    def spawn_nack(self, ident: bytes, header: dict[str, Any], code: str, err: str) -> None:
        t = asyncio.create_task(self._send_ack(ident, header, code, err),
                                name=f"channel-nack-{self.link.node_id}->{header.get('from')}")
        self.handler_tasks.add(t)
        t.add_done_callback(self.handler_tasks.discard)

    async def _send_ack(self, ident: bytes, header: dict[str, Any], code: str, err: str, reply: Any = None) -> None:
        if self.link.closed or self.link.router is None:
            return
        ack = {"t": "ack", "from": self.link.node_id, "to": header["from"], "sess": header["sess"],
               "seq": header["seq"], "ok": code == "ok", "code": code, "err": err[:4000],
               **self.link.ack_extra(ident, header)}
        if reply is not None:
            ack["reply"] = reply
        if code != "ok":
            self.link.counters["nacks_sent"] += 1
        body = msgpack.packb(ack, use_bin_type=True)
        frames = [ident, MAGIC_ACK, body, self.link.auth.tag([body], DOMAIN)]
        # A ROUTER send never blocks (a full pipe drops), so the ack leaves in the same loop step as
        # the handler's return (a handler that triggers close() still gets its ack out).
        try:
            self.link.reply_socket(ident).send_now(frames, copy=True)
        except zmq.ZMQError as e:
            log.warning("channel %s: could not ack %s#%s: %s", self.link.node_id, header["from"], header["seq"], e)


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
