"""The receive side of the data-plane protocol: framing, header MAC, replay, handler tasks, acks.

Why a module of its own: :class:`~distflow.core.channels.zmq_channel.ZmqChannel` is the sender
and the receiver of one protocol, and the two halves share nothing but the wire constants and
the channel's state. This mixin holds the receiving half, as :mod:`.stream_receiver` holds the
receiving half of streamed payloads; the channel composes both. Every receiving socket (the
ROUTER, and the shared-memory channel's same-host Unix socket) runs :meth:`_recv_loop`.

What a received message goes through, in order: framing and size limits, the header MAC
(:class:`~distflow.core.auth.Authenticator`, domain ``b"data"``), the header's shape, replay
(per sender: newest session, increasing sequence numbers), the recipient; then a named handler
task (at most ``max_inflight`` at once, beyond which sockets are not read, so senders feel
backpressure), the payload (its MAC checked, or its shared memory mapped: ``_receive_payload``,
which subclasses extend), the user's handler, and the ack, sent only after the handler returned.
Anything wrong is dropped and counted, or NACKed with its reason; nothing kills the loop.
"""

from __future__ import annotations

import asyncio
import hmac
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import torch
import zmq

from distflow.core.auth import TAG_SIZE, Authenticator
from distflow.core.channels import codec
from distflow.core.channels.base import Envelope, Handler, log
from distflow.core.channels.payload_mac import PayloadError, payload_tag
from distflow.core.channels.stream_receiver import MAGIC_CHUNK

MAGIC_MSG = b"DFD1"
MAGIC_ACK = b"DFA1"
PROTOCOL = 1
WRONG_RECIPIENT = "wrong_recipient"  # the nack of a message addressed to another node (see the sender's ack check)
DOMAIN = b"data"
OFFLOAD_BYTES = 1 << 20  # copies / hashing that release the GIL run in a worker thread above this size
GMAC_OFFLOAD_BYTES = 64 << 20  # GMAC runs at 10-25 GB/s: below this a thread hop costs more than it saves


@dataclass
class _PeerIn:
    start_ns: int
    session: bytes
    last_seq: int


class MessageReceiver:
    """Mixin for :class:`ZmqChannel`: the receive side of the protocol (see module docstring)."""

    node_id: str
    transport: str
    _auth: Authenticator
    _handler: Handler | None
    _slots: asyncio.Semaphore | None
    _handler_tasks: set[asyncio.Task]
    _peers_in: dict[str, _PeerIn]
    _max_frames: int
    _max_header_bytes: int
    _max_message_bytes: int
    _closed: bool
    _router: Any
    _counters: Counter[str]

    if TYPE_CHECKING:  # provided by the channel and the stream mixin
        def _drop(self, reason: str, detail: str = "") -> None: ...
        def _chunk_sink(self, frames: list[Any]) -> memoryview | None: ...
        def _accept_chunk(self, frames: list[Any]) -> bool: ...
        def _open_stream(self, ident: bytes, header: dict[str, Any], payload: list[Any]) -> bool: ...
        def _reply_socket(self, ident: bytes) -> Any: ...
        def _ack_extra(self, ident: bytes, header: dict[str, Any]) -> dict[str, Any]: ...

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
        if header["to"] != self.node_id:  # before the replay check: a message not for us leaves no state
            self._drop(WRONG_RECIPIENT, f"for {header['to']!r}")
            self._spawn_nack(ident, header, WRONG_RECIPIENT,
                             f"message for node {header['to']!r} reached node {self.node_id!r}")
            return False
        if not self._check_replay(sender, header):
            return False
        if header["pay"] == "chunks":
            return self._open_stream(ident, header, frames[4:])
        return self._start_handler(ident, header, frames[4:])

    def _start_handler(self, ident: bytes, header: dict[str, Any], payload: list[Any]) -> bool:
        self._counters["internal_msgs_in" if header["kind"].startswith("__") else "recv_msgs"] += 1
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
        code, err, reply = "ok", "", None
        try:
            tensors = await self._receive_payload(header, payload, ident)
            self._counters["recv_bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
            env = Envelope(header["from"], header["kind"], header["meta"], tensors)
            del tensors
            try:
                reply = await self._call_handler(env)
                del env  # tensors the handler did not keep die now, before the ack (shm: release rides on it)
            except (asyncio.CancelledError, PayloadError):  # (no handler, or a refused internal message)
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
        await self._send_ack(ident, header, code, err, reply)

    async def _call_handler(self, env: Envelope) -> Any:
        """The user's handler (subclasses answer their own internal kinds first). What it returns
        (a small msgpack-able value, or None) rides on the ack and is what ``send`` returns."""
        if self._handler is None:
            raise PayloadError("no_handler", f"node {self.node_id} has no handler installed")
        return await self._handler(env)

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

    async def _send_ack(self, ident: bytes, header: dict[str, Any], code: str, err: str, reply: Any = None) -> None:
        if self._closed or self._router is None:
            return
        ack = {"t": "ack", "from": self.node_id, "to": header["from"], "sess": header["sess"],
               "seq": header["seq"], "ok": code == "ok", "code": code, "err": err[:4000],
               **self._ack_extra(ident, header)}
        if reply is not None:
            ack["reply"] = reply
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
