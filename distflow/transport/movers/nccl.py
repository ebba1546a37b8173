"""The NCCL mover: CUDA tensors GPU to GPU over NCCL point-to-point, control over the link.

Why it exists: on GPU hosts, batches and weights already live in device memory; staging
them through host memory would cost two PCIe copies each way. This mover moves CUDA
tensors GPU to GPU with NCCL send/recv, while the signed header, the sequence number,
the ack and the error reporting stay the link's protocol (:mod:`..link`). CPU tensors in
the same message travel as inline frames. It plugs into the link through its registries (the
``nccl`` payload kind, the ``__nccl_init__`` internal kind); a message it does not take (no CUDA
tensor, a peer without NCCL) goes the transport's host way (``send_host``: shared memory or frames).

Communicators are created on demand, one per *direction* between two peers (the sender
is rank 0, the receiver rank 1), so A->B and B->A traffic can never interleave their
NCCL calls in different orders. The sender makes the NCCL unique id and sends it, as 128 raw
bytes, in an internal ``__nccl_init__`` message (cupy 14 gives and takes the id as ``bytes``,
cupy 13 as a tuple of signed chars: each end converts for its own cupy); both sides then run
``NcclCommunicator(2, uid, r)`` concurrently (each in a worker thread, under a deadline) and,
still there, move one warm-up byte from rank 0 to rank 1. The warm-up matters: NCCL connects
a send/recv pair lazily, inside the first ``groupEnd`` that moves data, and that call blocks
its thread until the peer posts the matching call; the receiver only posts once the header arrives,
and the header leaves after the sender's ``groupEnd``, so an unwarmed first send would
deadlock. Posting still runs in a worker thread under ``nccl_timeout``, so no NCCL call
can freeze the event loop. These threads are the channel's own daemon threads
(:class:`~distflow.core.aio.DaemonThreadPool`): an init whose peer never joins cannot be aborted
and blocks its thread until the process exits, but it takes none of the node's worker threads
and does not hold the process at exit. ``close`` aborts every communicator, then joins these
threads for at most the close timeout and names, in the log, the calls still running.

Each communicator has its own CUDA stream on the channel's device (``device``, else
:func:`distflow.device.node_device`), so NCCL traffic neither queues behind nor holds up
training or generation kernels: the stream first waits for the device's current stream
(the producer's work; memory the allocator just reused), or on the sending side only for the
event a caller named with :func:`sends_ready_after` (the weight publisher: the event recorded
when a bucket was gathered, not the trainer's next step), sent buffers are marked as used
on it (``record_stream``), and the receiver waits for its receives (an event, under the
deadline) before it hands the tensors over.

Message order = NCCL call order: the sender holds a per-communicator lock from posting
its sends until its header is on the wire; the receiver posts its receives under the same
kind of lock before its first await, in arrival order, and checks each message's index
on the communicator (a gap means a message whose sends it never matched: later receives
would take its bytes). Once sends or receives may have been posted, any failure (a refusal
before the bytes arrived, a timeout, a cancellation) aborts the communicator and drops it;
the next send makes a new one, whose init names the one it replaces so the receiver frees
its end. A refusal by the receiver's handler comes after its receives completed and keeps
the communicator (a stale sample must not kill the messages behind it). An abort waits
for a post running in a worker thread to return, unless that post is the one that hangs.
Tensors are sent as raw bytes (``uint8``), so every dtype, bfloat16 included, works.

cupy is imported lazily: importing this module without cupy or without a GPU is fine;
constructing the mover then raises a clear error. Tests skip without a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator

import torch
import zmq

from distflow.core.aio import DaemonThreadPool
import distflow.transport.codec as codec
from distflow.transport.api import ChannelClosed, ChannelError, Endpoint, Envelope, PayloadError, RemoteError, log
from distflow.transport.link import Link

INIT_KIND = "__nccl_init__"
UID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
NO_NCCL_RETRY_S = 60.0  # a peer that refused a communicator gets host-memory sends this long, then NCCL again
CONSUMED_CODES = frozenset({"handler_error", "no_handler"})  # refusals after the receive completed

# The streams of dropped communicators, kept for the life of the process. Every tensor sent or
# received on a communicator was record_stream()ed on its stream, so the caching allocator
# records an event on that stream whenever such a tensor is freed, which can be long after the
# communicator is gone (a rollout node keeps received buckets; a publisher keeps a version).
# The cupy stream behind it destroys the CUDA stream when collected: an event recorded on a
# destroyed stream fails in a destructor, or lands on a new stream that reused the handle. One
# stream handle per dropped communicator (a peer's failure or restart) is all this keeps.
_RETIRED_STREAMS: dict[int, tuple[Any, Any]] = {}


# The CUDA event after which the tensors of the sends made in this context are ready (None: all the
# device's current stream has queued). A contextvar, so it follows one task across its awaits.
_READY: contextvars.ContextVar[Any] = contextvars.ContextVar("distflow_nccl_ready", default=None)


@contextlib.contextmanager
def sends_ready_after(event: Any) -> Iterator[None]:
    """Sends made within this block (in this task) need only ``event`` done before their NCCL
    calls run, not all the device's current stream has queued by then.

    Why: a weight bucket is gathered, an event recorded, and its send runs later, when the
    trainer has usually queued its next step on the current stream; waiting for that stream
    would hold the rollout node's weights back by a step. ``event`` None: the default."""
    token = _READY.set(event)
    try:
        yield
    finally:
        _READY.reset(token)


def _after_producer(stream: Any, device: int, contiguous: bool) -> None:
    """Order a communicator's stream after the work that made a send's tensors: the event given
    to :func:`sends_ready_after`, else (or when a tensor needed a ``contiguous()`` copy, queued on
    the current stream) the device's whole current stream."""
    ready = _READY.get()
    if ready is not None and contiguous:
        stream.wait_event(ready)
    else:
        stream.wait_stream(torch.cuda.current_stream(device))


def _import_nccl() -> Any:
    try:
        from cupy.cuda import nccl  # noqa: PLC0415 - lazy on purpose
    except Exception as e:  # ImportError, or a CUDA library problem
        raise ImportError(f"the nccl channel needs cupy with NCCL support (pip install 'distflow[gpu]'): {e}") from e
    return nccl


def nccl_available() -> bool:
    """True when cupy+NCCL import and torch sees a CUDA device."""
    if not torch.cuda.is_available():
        return False
    try:
        _import_nccl()
    except ImportError:
        return False
    return True


@dataclass(eq=False)
class _Comm:
    comm: Any
    comm_id: str
    stream: Any  # the torch.cuda.ExternalStream all of this communicator's NCCL calls go on
    owner: Any = None  # the cupy stream behind it (kept alive with the communicator)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    broken: bool = False
    next_n: int = 0  # index of the next message posted (sender) / expected (receiver) on it
    posting: bool = False  # a worker thread is inside NCCL calls on it (_post)
    aborted: bool = False
    guard: threading.Lock = field(default_factory=threading.Lock)  # broken/posting/aborted across threads

    def abort(self, force: bool = False) -> None:
        """Mark it broken and abort it: now, or when the running post ends (ncclCommAbort frees
        the communicator under a thread still calling into it). ``force``: now anyway, for a
        post that hangs (the abort is what unblocks it). Also stops its kernels still waiting.
        Its stream is retired, never destroyed (see ``_RETIRED_STREAMS``)."""
        if self.owner is not None:
            _RETIRED_STREAMS.setdefault(id(self.owner), (self.stream, self.owner))
        with self.guard:
            self.broken = True
            if self.aborted or (self.posting and not force):
                return
            self.aborted = True
        try:
            self.comm.abort()
        except Exception:  # pragma: no cover - best effort on a broken communicator
            pass


class NcclMover:
    """Moves the CUDA tensors of a message with NCCL; the rest of the message as the host way does."""

    name = "nccl"

    def __init__(self, link: Link, send_host: Callable[..., Awaitable[Any]], *, device: int | None = None,
                 nccl_timeout: float = 120.0) -> None:
        self._nccl = _import_nccl()
        if not torch.cuda.is_available():
            raise RuntimeError("the nccl channel needs a CUDA device (torch.cuda.is_available() is False)")
        if device is None:  # this node's GPU, not whichever one the constructing thread has current
            from distflow.device import node_device  # noqa: PLC0415

            device = node_device("cuda").index
        self.device = int(device)
        if not 0 <= self.device < torch.cuda.device_count():
            raise ValueError(f"nccl channel device {self.device}: only {torch.cuda.device_count()} GPU(s) are visible")
        self.link = link
        self.node_id = link.node_id
        self._counters: Counter[str] = link.counters
        self._send_host = send_host  # the transport's way for what NCCL does not carry
        self._nccl_timeout = nccl_timeout
        self._uint8 = getattr(self._nccl, "NCCL_UINT8", 1)
        self._out: dict[Endpoint, _Comm] = {}  # I am rank 0
        self._in: dict[tuple[str, str], _Comm] = {}  # (sender, comm id) -> comm, I am rank 1
        self._out_init: dict[Endpoint, asyncio.Lock] = {}
        self._replaced: dict[Endpoint, str] = {}  # peer -> id of the dropped comm the next init replaces
        self._no_nccl: dict[Endpoint, float] = {}  # peer -> until when it gets host-memory sends (it refused
        # a communicator: no NCCL channel there, or its init failed; NCCL is tried again after NO_NCCL_RETRY_S)
        # NCCL calls that may block on a peer run in threads of their own: one stuck until its
        # process exits (an init whose peer never joined cannot be aborted) takes none of the
        # node's worker threads and does not keep the process from exiting
        self._threads = DaemonThreadPool(name=f"nccl-{link.node_id}", grace_s=link.close_timeout)
        link.payload_movers["nccl"] = self._receive_payload
        link.internal[INIT_KIND] = self._accept_comm

    @staticmethod
    def has_cuda(tensors: dict[str, Any]) -> bool:
        return any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors.values())

    def refused(self, peer: Endpoint) -> bool:
        """``peer`` refused a communicator less than ``NO_NCCL_RETRY_S`` ago (it gets host sends)."""
        return self._no_nccl.get(peer, 0.0) > time.monotonic()

    async def close(self) -> None:
        """After the link closed: abort every communicator, join the threads (bounded)."""
        for c in [*self._out.values(), *self._in.values()]:
            c.abort(force=True)  # not destroy(): that waits for unmatched calls of a peer that may be gone;
            # forced: a post hanging in NCCL would otherwise keep its worker thread (and exit) waiting
        self._out.clear()
        self._in.clear()
        # The posts those aborts unblocked return now: wait for them (off the loop), at most the close
        # timeout; any call still running then is named in the log (e.g. an init whose peer never joined)
        await asyncio.to_thread(self._threads.shutdown)

    def _in_thread(self, fn: Any, *args: Any) -> asyncio.Future:
        if self.link.closed:
            raise ChannelClosed(f"channel {self.node_id} is closed")
        return asyncio.get_running_loop().run_in_executor(self._threads, functools.partial(fn, *args))

    def stats(self) -> dict[str, Any]:
        return {"nccl_sends": self._counters["nccl_sends"],
                "nccl_recvs": self._counters["nccl_recvs"], "nccl_aborts": self._counters["nccl_aborts"],
                "nccl_comms": len(self._out) + len(self._in)}

    # ------------------------------------------------------------------ communicators
    async def _accept_comm(self, env: Envelope) -> None:
        """A peer's ``__nccl_init__``: join its new communicator (rank 1), freeing the one it replaces."""
        uid, comm_id, replaces = env.meta.get("uid"), env.meta.get("comm"), env.meta.get("replaces")
        if not isinstance(comm_id, str):
            raise ValueError("malformed nccl init message")
        uid = uid_bytes(uid)  # bytes; a list of ints from an older peer
        old = self._in.get((env.sender, replaces)) if isinstance(replaces, str) else None
        if old is not None:  # the sender dropped it: its receives can never complete
            self._discard_comm(old)
        self._in[(env.sender, comm_id)] = await self._new_comm(uid, 1, comm_id)

    async def _new_comm(self, uid: bytes, rank: int, comm_id: str) -> _Comm:
        made: list[Any] = []
        try:
            comm, stream, owner = await asyncio.wait_for(self._in_thread(self._make_comm, uid, rank, made),
                                                         self._nccl_timeout)
        except BaseException:
            for c in made:  # built, but the warm-up did not finish in time: unblock its thread
                _Comm(c, comm_id, None).abort(force=True)
            raise
        return _Comm(comm, comm_id, stream, owner)

    def _make_comm(self, uid: bytes, rank: int, made: list[Any]) -> tuple[Any, Any, Any]:
        """Worker thread: the communicator, its stream, and the warm-up byte (rank 0 -> rank 1)
        that makes NCCL connect the pair now rather than inside a message's groupEnd.

        The stream is a new one (``device.private_stream``), not one of torch's pool streams:
        those are shared with e.g. torch.distributed's NCCL streams, which would then queue
        behind a receive waiting on a slow or dead peer."""
        import cupy  # noqa: PLC0415

        from distflow.device import private_stream  # noqa: PLC0415

        with cupy.cuda.Device(self.device):
            comm = communicator(self._nccl, uid, rank)
            made.append(comm)
            stream, owner = private_stream(torch.device("cuda", self.device))
            byte = torch.zeros(1, dtype=torch.uint8, device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            if rank == 0:
                comm.send(byte.data_ptr(), 1, self._uint8, 1, stream.cuda_stream)
            else:
                comm.recv(byte.data_ptr(), 1, self._uint8, 0, stream.cuda_stream)
            stream.synchronize()
            return comm, stream, owner

    def _post(self, comm: _Comm, bufs: list[torch.Tensor], send: bool) -> None:
        """Worker thread: one NCCL group of sends to rank 1 (or receives from rank 0) on the
        communicator's stream. groupEnd always runs, so a failure never leaves the group open."""
        import cupy  # noqa: PLC0415

        with comm.guard:
            if comm.broken:  # aborted since the caller checked (e.g. by a failed sibling send)
                raise ChannelError(f"channel {self.node_id}: NCCL communicator {comm.comm_id} was aborted")
            comm.posting = True
        try:
            with cupy.cuda.Device(self.device):
                self._nccl.groupStart()
                try:
                    for b in bufs:
                        if not b.numel():
                            continue
                        if send:
                            comm.comm.send(b.data_ptr(), b.numel(), self._uint8, 1, comm.stream.cuda_stream)
                        else:
                            comm.comm.recv(b.data_ptr(), b.numel(), self._uint8, 0, comm.stream.cuda_stream)
                finally:
                    self._nccl.groupEnd()
        finally:
            with comm.guard:
                comm.posting = False
            if comm.broken:
                comm.abort()  # one deferred while this post ran

    async def _post_in_thread(self, comm: _Comm, bufs: list[torch.Tensor], send: bool) -> None:
        try:
            await asyncio.wait_for(self._in_thread(self._post, comm, bufs, send), self._nccl_timeout)
        except TimeoutError:
            self._discard_comm(comm, force=True)  # the post hangs in NCCL: only an abort unblocks it
            what = f"posting NCCL {'sends' if send else 'receives'} on {comm.comm_id} took over {self._nccl_timeout:g}s"
            if send:
                raise ChannelError(f"channel {self.node_id}: {what}; communicator aborted") from None
            raise PayloadError("nccl_timeout", what) from None

    def _discard_comm(self, comm: _Comm, force: bool = False) -> None:
        """Abort a communicator whose posted calls may never be matched, and forget it: a later
        send to that peer makes a new one (whose init names this one, so the receiver frees it)."""
        if not comm.broken:
            self._counters["nccl_aborts"] += 1
        comm.abort(force)
        for peer, c in list(self._out.items()):
            if c is comm:
                del self._out[peer]
                self._replaced[peer] = comm.comm_id
        for key, c in list(self._in.items()):
            if c is comm:
                del self._in[key]

    async def _comm_to(self, peer: Endpoint) -> _Comm:
        c = self._out.get(peer)
        if c is not None and not c.broken:
            return c
        lock = self._out_init.setdefault(peer, asyncio.Lock())
        async with lock:
            c = self._out.get(peer)
            if c is not None and not c.broken:
                return c
            uid = uid_bytes(self._nccl.get_unique_id())
            comm_id = os.urandom(8).hex()
            init: dict[str, Any] = {"uid": uid, "comm": comm_id}
            if peer in self._replaced:
                init["replaces"] = self._replaced[peer]
            mine = asyncio.create_task(self._new_comm(uid, 0, comm_id),
                                       name=f"nccl-init-{self.node_id}->{peer.node_id}")
            mine.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even when abandoned
            try:
                await self._send_host(peer, INIT_KIND, init, {})
                c = await mine  # under its own deadline
            except BaseException:
                mine.cancel()
                raise
            self._replaced.pop(peer, None)
            self._out[peer] = c
            return c

    # ------------------------------------------------------------------ send
    async def send(self, peer: Endpoint, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
        """One message whose CUDA tensors go over NCCL (when `select.message_mover` says "nccl")."""
        cuda = {k: t for k, t in tensors.items() if isinstance(t, torch.Tensor) and t.is_cuda}
        if not cuda:
            return await self._send_host(peer, kind, meta, tensors)
        self.link.check_send_args(peer, kind, meta, tensors)
        for k, t in cuda.items():
            if t.device.index != self.device:
                raise ValueError(f"channel {self.node_id}: tensor {k!r} is on {t.device}, but this NCCL channel "
                                 f"runs on cuda:{self.device}; move it there first")
        cpu = {k: t for k, t in tensors.items() if k not in cuda}
        try:
            comm = await self._comm_to(peer)
        except RemoteError as e:  # the peer has no NCCL channel (CPU node, other backend)
            log.warning("channel %s: no NCCL to %s (%s); CUDA tensors go through host memory for %.0f s",
                        self.node_id, peer.node_id, e.message, NO_NCCL_RETRY_S)
            self._no_nccl[peer] = time.monotonic() + NO_NCCL_RETRY_S
            return await self._send_host(peer, kind, meta, tensors)
        headers = [codec.tensor_header(k, t) for k, t in cuda.items()]
        contiguous = all(t.is_contiguous() for t in cuda.values())
        bufs = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in cuda.values()]
        out = await self.link.inline_outgoing(*codec.encode(cpu))  # CPU side-tensors go inline
        out.pay = "nccl"
        out.nbytes += sum(h["nbytes"] for h in headers)
        sent: asyncio.Task | None = None
        posted = False
        try:
            async with comm.lock:
                if comm.broken:  # a concurrent send on it failed and aborted it
                    raise ChannelError(f"channel {self.node_id}: the NCCL communicator to {peer.node_id} was "
                                       "aborted by a failed send; the next send makes a new one")
                posted = True  # from here on a failure leaves the comm's message count or sends behind
                out.header["nccl"] = {"comm": comm.comm_id, "n": comm.next_n, "tens": headers}
                comm.next_n += 1
                _after_producer(comm.stream, self.device, contiguous)  # the producer's work first
                for b in bufs:
                    b.record_stream(comm.stream)  # freed blocks are not reused before the sends ran
                await self._post_in_thread(comm, bufs, True)
                sent = asyncio.create_task(self.link.send_prepared(peer, kind, meta, out),
                                           name=f"nccl-send-{self.node_id}->{peer.node_id}")
                await asyncio.sleep(0)  # let the header reach the socket before the next NCCL post
            await sent
            self._counters["nccl_sends"] += 1
        except BaseException as e:
            if sent is not None:
                sent.cancel()
            # Refused before its receives completed, timed out or cancelled: unmatched sends would hang
            # the communicator (and match a later message's receives). A handler's refusal comes after
            # the bytes arrived (e.g. a stale sample): the communicator is clean, its other messages live.
            if posted and not (isinstance(e, RemoteError) and e.code in CONSUMED_CODES):
                self._discard_comm(comm)
            raise
        finally:
            del bufs

    # ------------------------------------------------------------------ receive
    async def _receive_payload(self, header: dict[str, Any], payload: list[zmq.Frame],
                               ident: bytes) -> dict[str, torch.Tensor]:
        info = header.get("nccl")
        if not isinstance(info, dict):
            raise PayloadError("bad_header", "nccl message without an 'nccl' section")
        sender = header["from"]
        comm = self._in.get((sender, info.get("comm")))
        if comm is None or comm.broken:
            raise PayloadError("bad_payload", f"unknown NCCL communicator {info.get('comm')!r} from {sender}")
        out: dict[str, torch.Tensor] = {}
        async with comm.lock:  # first await of the handler task: posts happen in arrival order
            try:
                if comm.broken:
                    raise PayloadError("nccl_aborted", f"NCCL communicator {comm.comm_id} from {sender} was aborted")
                if info.get("n") != comm.next_n:
                    raise PayloadError("nccl_out_of_order", f"message #{info.get('n')!r} on NCCL communicator "
                                       f"{comm.comm_id} from {sender}, expected #{comm.next_n}: one was lost")
                comm.next_n += 1
                recv = []
                for h in codec.validate_headers(info.get("tens")):  # allocated before the group opens
                    t = torch.empty(h["shape"], dtype=codec.DTYPES[h["dtype"]], device=self.device)
                    # NCCL writes it on comm.stream: after a timeout or abort the allocator must not
                    # hand its memory out again before that stream's work is done
                    if t.is_cuda:
                        t.record_stream(comm.stream)
                    out[h["name"]] = t
                    recv.append(t.reshape(-1).view(torch.uint8))
                comm.stream.wait_stream(torch.cuda.current_stream(self.device))  # reused memory is free
                await self._post_in_thread(comm, recv, False)
            except BaseException:
                self._discard_comm(comm)  # this message's sends stay unmatched: never reuse the communicator
                raise
        event = torch.cuda.Event()
        event.record(comm.stream)
        try:
            await asyncio.wait_for(self._in_thread(event.synchronize), self._nccl_timeout)
        except BaseException as e:
            self._discard_comm(comm)
            if isinstance(e, TimeoutError):
                raise PayloadError("nccl_timeout", f"NCCL receive from {sender} timed out") from None
            raise
        if comm.broken:  # aborted while we waited: its kernels stopped early, the bytes are incomplete
            raise PayloadError("nccl_aborted", f"NCCL communicator {comm.comm_id} from {sender} was aborted")
        torch.cuda.current_stream(self.device).wait_event(event)
        self._counters["nccl_recvs"] += 1
        out.update(await self.link.receiver.decode_inline(header, payload))
        return out


def uid_bytes(uid: Any) -> bytes:
    """An NCCL unique id as its 128 raw bytes, from what cupy's ``get_unique_id`` returns (``bytes``
    since cupy 14, a tuple of signed chars before) or what a peer sent (bytes; a list of ints)."""
    if isinstance(uid, (bytes, bytearray)):
        raw = bytes(uid)
    elif isinstance(uid, (list, tuple)) and all(isinstance(x, int) and -128 <= x <= 255 for x in uid):
        raw = bytes(x & 0xFF for x in uid)
    else:
        raise ValueError("malformed nccl init message: the unique id must be bytes or a list of byte values")
    if len(raw) != UID_BYTES:
        raise ValueError(f"malformed nccl init message: the unique id has {len(raw)} bytes, not {UID_BYTES}")
    return raw


def communicator(nccl: Any, uid: bytes, rank: int) -> Any:
    """``NcclCommunicator(2, uid, rank)`` with the id in the form this cupy takes: bytes (cupy >= 14),
    else a tuple of signed chars (cupy 13 refuses bytes with a TypeError, before NCCL is called)."""
    try:
        return nccl.NcclCommunicator(2, uid, rank)
    except TypeError:
        return nccl.NcclCommunicator(2, tuple(b - 256 if b > 127 else b for b in uid), rank)
