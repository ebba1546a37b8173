"""GPU tensor channel: CUDA tensors over NCCL point-to-point, control over ZMQ.

Why it exists: on GPU hosts, batches and weights already live in device memory; staging
them through host memory would cost two PCIe copies each way. This channel moves CUDA
tensors GPU to GPU with NCCL send/recv, while the signed header, the sequence number,
the ack and the error reporting stay the :class:`ZmqChannel` protocol. CPU tensors in
the same message travel as inline frames (or shared memory, via :class:`ShmChannel`).

Communicators are created on demand, one per *direction* between two peers (the sender
is rank 0, the receiver rank 1), so A->B and B->A traffic can never interleave their
NCCL calls in different orders. The sender makes the NCCL unique id and sends it in an
internal ``__nccl_init__`` message; both sides then run ``NcclCommunicator(2, uid, r)``
concurrently (each in a worker thread, under a deadline). Message order = NCCL call
order: the sender holds a per-communicator lock from posting its sends until its header
is on the wire; the receiver posts its receives under the same kind of lock before its
first await, in arrival order. Tensors are sent as raw bytes (``uint8``), so every
dtype, bfloat16 included, works. A timed-out NCCL operation aborts that communicator
(it is re-created on the next send).

cupy is imported lazily: importing this module without cupy or without a GPU is fine;
constructing the channel then raises a clear error. Tests skip without a GPU.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from distflow.core.channels import codec
from distflow.core.channels.base import Endpoint, Envelope, Handler, RemoteError, log
from distflow.core.channels.shm_channel import ShmChannel
from distflow.core.channels.zmq_channel import PayloadError

INIT_KIND = "__nccl_init__"


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
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    broken: bool = False

    def abort(self) -> None:
        self.broken = True
        try:
            self.comm.abort()
        except Exception:  # pragma: no cover - best effort on a broken communicator
            pass


class NcclChannel(ShmChannel):
    """ShmChannel that moves CUDA tensors with NCCL; CPU tensors as before."""

    transport = "nccl"

    def __init__(
        self,
        node_id: str,
        secret: str | bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        device: int | None = None,
        nccl_timeout: float = 120.0,
        **kw: Any,
    ) -> None:
        super().__init__(node_id, secret, host, port, **kw)
        self._nccl = _import_nccl()
        if not torch.cuda.is_available():
            raise RuntimeError("the nccl channel needs a CUDA device (torch.cuda.is_available() is False)")
        self.device = torch.cuda.current_device() if device is None else int(device)
        self._nccl_timeout = nccl_timeout
        self._uint8 = getattr(self._nccl, "NCCL_UINT8", 1)
        self._out: dict[Endpoint, _Comm] = {}  # I am rank 0
        self._in: dict[tuple[str, str], _Comm] = {}  # (sender, comm id) -> comm, I am rank 1
        self._out_init: dict[Endpoint, asyncio.Lock] = {}
        self._no_nccl: set[Endpoint] = set()  # peers that refused a communicator
        self._user_handler: Handler | None = None
        super().set_handler(self._dispatch)

    def set_handler(self, handler: Handler) -> None:
        if not callable(handler):
            raise TypeError(f"handler must be an async callable, got {type(handler).__name__}")
        self._user_handler = handler

    async def close(self) -> None:
        await super().close()
        for c in [*self._out.values(), *self._in.values()]:
            try:
                c.comm.destroy()
            except Exception:  # pragma: no cover
                pass
        self._out.clear()
        self._in.clear()

    def _extra_stats(self) -> dict[str, Any]:
        return {**super()._extra_stats(), "nccl_sends": self._counters["nccl_sends"],
                "nccl_recvs": self._counters["nccl_recvs"], "nccl_comms": len(self._out) + len(self._in)}

    # ------------------------------------------------------------------ communicators
    async def _dispatch(self, env: Envelope) -> None:
        if env.kind == INIT_KIND:
            await self._accept_comm(env)
            return
        if self._user_handler is None:
            raise PayloadError("no_handler", f"node {self.node_id} has no handler installed")
        await self._user_handler(env)

    async def _accept_comm(self, env: Envelope) -> None:
        uid, comm_id = env.meta.get("uid"), env.meta.get("comm")
        if not isinstance(uid, list) or not isinstance(comm_id, str):
            raise ValueError("malformed nccl init message")
        comm = await asyncio.wait_for(asyncio.to_thread(self._make_comm, tuple(uid), 1), self._nccl_timeout)
        self._in[(env.sender, comm_id)] = _Comm(comm, comm_id)

    def _make_comm(self, uid: tuple, rank: int) -> Any:
        import cupy  # noqa: PLC0415

        with cupy.cuda.Device(self.device):
            return self._nccl.NcclCommunicator(2, uid, rank)

    async def _comm_to(self, peer: Endpoint) -> _Comm:
        c = self._out.get(peer)
        if c is not None and not c.broken:
            return c
        lock = self._out_init.setdefault(peer, asyncio.Lock())
        async with lock:
            c = self._out.get(peer)
            if c is not None and not c.broken:
                return c
            uid = self._nccl.get_unique_id()
            comm_id = os.urandom(8).hex()
            mine = asyncio.create_task(asyncio.to_thread(self._make_comm, uid, 0),
                                       name=f"nccl-init-{self.node_id}->{peer.node_id}")
            try:
                await super()._send(peer, INIT_KIND, {"uid": list(uid), "comm": comm_id}, {})
                comm = await asyncio.wait_for(mine, self._nccl_timeout)
            except BaseException:
                mine.cancel()
                raise
            c = _Comm(comm, comm_id)
            self._out[peer] = c
            return c

    # ------------------------------------------------------------------ send
    async def _send(self, peer: Endpoint, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        cuda = {k: t for k, t in tensors.items() if isinstance(t, torch.Tensor) and t.is_cuda}
        if not cuda or peer in self._no_nccl:
            await super()._send(peer, kind, meta, tensors)  # CUDA tensors, if any, go through host memory
            return
        self._check_send_args(peer, kind, meta, tensors)
        cpu = {k: t for k, t in tensors.items() if k not in cuda}
        try:
            comm = await self._comm_to(peer)
        except RemoteError as e:  # the peer has no NCCL channel (CPU node, other backend)
            log.warning("channel %s: no NCCL to %s (%s); CUDA tensors go through host memory",
                        self.node_id, peer.node_id, e.message)
            self._no_nccl.add(peer)
            await super()._send(peer, kind, meta, tensors)
            return
        headers = [codec.tensor_header(k, t) for k, t in cuda.items()]
        bufs = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in cuda.values()]
        out = await self._inline_outgoing(*codec.encode(cpu))  # CPU side-tensors go inline
        out.pay = "nccl"
        out.header["nccl"] = {"comm": comm.comm_id, "tens": headers}
        out.nbytes += sum(h["nbytes"] for h in headers)
        stream = torch.cuda.current_stream(self.device)
        try:
            async with comm.lock:
                self._nccl.groupStart()
                for b in bufs:
                    if b.numel():
                        comm.comm.send(b.data_ptr(), b.numel(), self._uint8, 1, stream.cuda_stream)
                self._nccl.groupEnd()
                sent = asyncio.create_task(self._send_prepared(peer, kind, meta, out),
                                           name=f"nccl-send-{self.node_id}->{peer.node_id}")
                await asyncio.sleep(0)  # let the header reach the socket before the next NCCL post
            await sent
            self._counters["nccl_sends"] += 1
        except (asyncio.CancelledError, TimeoutError):
            comm.abort()  # posted sends may never be matched now; the next send makes a new communicator
            raise
        finally:
            del bufs

    # ------------------------------------------------------------------ receive
    async def _receive_payload(self, header: dict[str, Any], payload: list[zmq.Frame],
                               ident: bytes) -> dict[str, torch.Tensor]:
        if header["pay"] != "nccl":
            return await super()._receive_payload(header, payload, ident)
        info = header.get("nccl")
        if not isinstance(info, dict):
            raise PayloadError("bad_header", "nccl message without an 'nccl' section")
        comm = self._in.get((header["from"], info.get("comm")))
        if comm is None or comm.broken:
            raise PayloadError("bad_payload", f"unknown NCCL communicator {info.get('comm')!r} from {header['from']}")
        ntens = codec.validate_headers(info.get("tens"))
        stream = torch.cuda.current_stream(self.device)
        out: dict[str, torch.Tensor] = {}
        async with comm.lock:  # first await of the handler task: posts happen in arrival order
            self._nccl.groupStart()
            for h in ntens:
                t = torch.empty(h["shape"], dtype=codec.DTYPES[h["dtype"]], device=self.device)
                if h["nbytes"]:
                    b = t.reshape(-1).view(torch.uint8)
                    comm.comm.recv(b.data_ptr(), b.numel(), self._uint8, 0, stream.cuda_stream)
                out[h["name"]] = t
            self._nccl.groupEnd()
        event = torch.cuda.Event()
        event.record(stream)
        try:
            await asyncio.wait_for(asyncio.to_thread(event.synchronize), self._nccl_timeout)
        except TimeoutError:
            comm.abort()
            raise PayloadError("nccl_timeout", f"NCCL receive from {header['from']} timed out") from None
        self._counters["nccl_recvs"] += 1
        out.update(await self._decode_inline(header, payload))
        return out

