"""The one concrete transport: a link with the movers this node has, composed, none subclassing another.

Why it exists: which mover carries a message's bytes (socket frames, shared memory, a same-host
post, NCCL) is a property of the peer and the tensors, not of a class. A
:class:`ComposedTransport` *has* a :class:`~.link.Link` (the protocol, and the socket mover), and
optionally a :class:`~.movers.shm.ShmMover`, a :class:`~.movers.posting.Posting` and a
:class:`~.movers.nccl.NcclMover`; :mod:`.select` decides which ones a node gets, and
:func:`~.select.message_mover` / :func:`~.select.payload_mover` which one carries each message. What it has is public (:attr:`movers`,
:meth:`supports`), and every capability method of :class:`~.api.Transport` answers with a defined
"no" when the mover behind it is absent, so callers never probe.
"""

from __future__ import annotations

from typing import Any, Awaitable

import torch

from distflow.transport.api import Endpoint, Handler, Transport
from distflow.transport.link import Link
from distflow.transport.movers.nccl import NcclMover
from distflow.transport.movers.posting import UNKNOWN, Inbox, Poster, Posting
from distflow.transport.movers.shm import ShmMover
from distflow.transport.select import message_mover
from distflow.transport.shared_buffers import SharedBuffer


class ComposedTransport(Transport):
    """A link plus optional movers (build one with :func:`distflow.transport.make_transport`)."""

    def __init__(self, link: Link, *, shm: ShmMover | None = None) -> None:
        self.link, self.shm = link, shm
        self.posting: Posting | None = None
        self.nccl: NcclMover | None = None
        self.node_id = link.node_id
        self._movers = frozenset({"socket"} | ({"shm"} if shm is not None else set()))

    def attach(self, mover: Posting | NcclMover) -> None:
        """Add posting or NCCL (before start): both send through this transport, so they come after it."""
        if self.link.started:
            raise RuntimeError("movers are attached before the transport starts")
        if isinstance(mover, Posting):
            if self.shm is None:
                raise ValueError("posting needs the shared-memory mover (its buffers' mappings)")
            self.posting = mover
        else:
            self.nccl = mover
        self._movers = self._movers | {mover.name}

    @property
    def port(self) -> int:  # type: ignore[override]
        return self.link.port

    @property
    def host(self) -> str:
        return self.link.host

    @property
    def transport(self) -> str:
        """The transport's name as configured ("zmq" | "shm" | "nccl"), as in ``stats()``."""
        return self.link.kind

    @property
    def movers(self) -> frozenset[str]:
        return self._movers

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.shm is not None:
            self.shm.start()
        await self.link.start()
        if self.posting is not None and self.link.local is not None:  # the doorbell is named after the port
            self.posting.start(self.link.port)

    def set_handler(self, handler: Handler) -> None:
        self.link.set_handler(handler)

    async def close(self) -> None:
        if self.link.closed:
            return
        await self.link.close()
        if self.posting is not None:
            self.posting.close()
        if self.shm is not None:
            self.shm.close()
        if self.nccl is not None:
            await self.nccl.close()

    def stats(self) -> dict[str, Any]:
        out = self.link.stats()
        if self.shm is not None:
            out.update(self.shm.stats())
        if self.posting is not None:
            out["mailbox"] = self.posting.stats()
        if self.nccl is not None:
            out.update(self.nccl.stats())
        return out

    # ------------------------------------------------------------------ send
    async def send(self, peer: Endpoint, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
                   timeout: float) -> Any:
        if self.nccl is not None and message_mover(self._movers, cuda_tensors=self.nccl.has_cuda(tensors),
                                                   peer_refused_nccl=self.nccl.refused(peer)) == "nccl":
            return await self.link.within(peer, kind, timeout, self.nccl.send(peer, kind, meta, tensors))
        return await self.link.within(peer, kind, timeout, self.send_host(peer, kind, meta, tensors))

    def send_host(self, peer: Endpoint, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Awaitable[Any]:
        """A message whose bytes live in host memory: shared memory where the mover can, else frames
        (the mover's coroutine itself, not one wrapping it: a frame fewer per message)."""
        if self.shm is not None:
            return self.shm.send(peer, kind, meta, tensors)
        return self.link.send_message(peer, kind, meta, tensors, self.link.prepare_payload)

    # ------------------------------------------------------------------ capabilities
    def is_local(self, peer: Endpoint) -> bool:
        return self.link.is_local(peer)

    def lend(self, peer: Endpoint, nbytes: int) -> torch.Tensor | None:
        return None if self.shm is None else self.shm.lend(peer, nbytes)

    def open_mailbox(self, kind: str) -> Inbox | None:
        return None if self.posting is None else self.posting.open_mailbox(kind)

    def known_poster(self, peer: Endpoint, kind: str) -> Poster | None | object:
        return None if self.posting is None else self.posting.known_poster(peer, kind)

    async def poster(self, peer: Endpoint, kind: str) -> Poster | None:
        return None if self.posting is None else await self.posting.poster(peer, kind)

    async def shared_buffer(self, nbytes: int, reserve: int = 0) -> SharedBuffer | None:
        return None if self.posting is None else await self.posting.shared_buffer(nbytes, reserve)

    def post(self, poster: Poster, buf: SharedBuffer, tag: int, meta: dict[str, Any] | bytes, lo: int,
             hi: int) -> bool:
        return False if self.posting is None else self.posting.post(poster, buf, tag, meta, lo, hi)

    def finish(self, buf: SharedBuffer) -> None:
        if self.posting is not None:
            self.posting.finish(buf)


__all__ = ["ComposedTransport", "UNKNOWN"]
