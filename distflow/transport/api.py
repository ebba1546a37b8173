"""The one transport API every data-plane caller uses: send / receive / ack / close / stats.

The rest of DistFlow (redistribution, weight sync, the pipeline) moves named tensors between
nodes without knowing whether they travel as ZeroMQ frames, through shared memory, over CUDA
IPC or NCCL. This module holds that contract - ``Endpoint``, ``Envelope``, :class:`Transport`,
the errors a send can raise and a small per-kind handler mux - so callers depend on nothing
backend-specific. What a transport can do beyond messages is explicit, never probed: every
method below exists on every transport, with a defined answer where it has no such mover
(``lend`` -> None, ``open_mailbox`` -> None, ``poster`` -> None ...), and :meth:`Transport.supports`
names the movers it has (``"socket"``, ``"shm"``, ``"posting"``, ``"nccl"``).

Delivery contract (all transports):

* ``send`` returns only after the receiver's handler has *accepted* the message (the
  ack is sent after the handler returns), so an awaiting handler is backpressure. What the
  handler returned (a small msgpack-able value) rides on the ack and ``send`` returns it:
  receiving is installing a handler, acking is returning from it.
* A handler that raises makes the receiver NACK with the error text; the sender
  raises :class:`RemoteError`. No answer before the deadline: :class:`TimeoutError`
  naming the peer and the kind.
* Malformed, unauthenticated, replayed or oversized input is dropped and counted in
  ``stats()["dropped"]``; it never crashes the receiving node.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import torch

log = logging.getLogger("distflow.transport")

MOVERS = ("socket", "shm", "posting", "nccl")  # cuda_ipc rides on any of them (handles in the header)


@dataclass(frozen=True)
class Endpoint:
    """A peer's data endpoint: the node id and the host/port its transport is bound to."""

    node_id: str
    host: str
    port: int

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not self.node_id:
            raise ValueError(f"Endpoint.node_id must be a non-empty str, got {self.node_id!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"Endpoint.host must be a non-empty str, got {self.host!r}")
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"Endpoint.port must be an int in 1..65535, got {self.port!r}")

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


@dataclass
class Envelope:
    """One received message: authenticated sender node id, kind, msgpack meta, tensors."""

    sender: str
    kind: str
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


Handler = Callable[[Envelope], Awaitable[Any]]


class ChannelError(RuntimeError):
    """Base class of data-plane errors."""


class ChannelClosed(ChannelError):
    """The local transport was closed while an operation was in flight."""


class RemoteError(ChannelError):
    """The receiver rejected a message (its handler raised, or the payload was invalid)."""

    def __init__(self, peer: str, kind: str, code: str, message: str):
        super().__init__(f"{peer} rejected {kind!r} message ({code}): {message}")
        self.peer = peer
        self.kind = kind
        self.code = code
        self.message = message


class PayloadError(ChannelError):
    """An authentic message whose payload cannot be accepted; the code goes back in the NACK."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Transport(ABC):
    """A node's data-plane endpoint: receives from any peer, sends to any peer."""

    node_id: str
    port: int = 0

    @abstractmethod
    async def start(self) -> None:
        """Bind the data port (``self.port`` is valid afterwards) and start receiving."""

    @abstractmethod
    def set_handler(self, handler: Handler) -> None:
        """Install the coroutine called for each received message (see module docstring)."""

    @abstractmethod
    async def send(self, peer: Endpoint, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
                   timeout: float) -> Any:
        """Deliver one message; returns once the peer's handler accepted it, with what the handler
        returned (None for most handlers; a transport's own internal kinds answer with a small map)."""

    @abstractmethod
    async def close(self) -> None:
        """Stop, bounded in time, releasing sockets, tasks and shared-memory segments."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: messages/bytes sent and received, drops by reason, errors."""

    # ---------------------------------------------------------------- capabilities (always there)
    @property
    @abstractmethod
    def movers(self) -> frozenset[str]:
        """The movers this transport has (a subset of :data:`MOVERS`)."""

    def supports(self, mover: str) -> bool:
        if mover not in MOVERS:
            raise ValueError(f"unknown mover {mover!r}; expected one of {MOVERS}")
        return mover in self.movers

    @abstractmethod
    def is_local(self, peer: Endpoint) -> bool:
        """Whether ``peer`` runs on this host (same-host movers can reach it)."""

    @abstractmethod
    def lend(self, peer: Endpoint, nbytes: int) -> torch.Tensor | None:
        """A uint8 [nbytes] tensor the next send to ``peer`` moves without copying (fill it in
        place, send views of it), or None: no shared memory to that peer."""

    @abstractmethod
    def open_mailbox(self, kind: str) -> Any:
        """This node's mailbox (``movers.posting.Inbox``) for same-host posts of ``kind``, or None
        without posting."""

    @abstractmethod
    def known_poster(self, peer: Endpoint, kind: str) -> Any:
        """What :meth:`poster` would return without waiting, or ``movers.posting.UNKNOWN``."""

    @abstractmethod
    async def poster(self, peer: Endpoint, kind: str) -> Any:
        """A handle (``movers.posting.Poster``) on ``peer``'s mailbox for ``kind``, or None: parts to it
        travel as messages."""

    @abstractmethod
    async def shared_buffer(self, nbytes: int, reserve: int = 0) -> Any:
        """A buffer shared with every same-host consumer posted to, or None (post nothing)."""

    @abstractmethod
    def post(self, poster: Any, buf: Any, tag: int, meta: dict[str, Any] | bytes, lo: int,
             hi: int) -> bool:
        """Post bytes [lo, hi) of ``buf`` to ``poster``'s mailbox; False: send that part as a message."""

    @abstractmethod
    def finish(self, buf: Any) -> None:
        """Done posting from ``buf``."""

    async def __aenter__(self) -> "Transport":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class HandlerMux:
    """Routes envelopes to one handler per message kind (a transport has one handler).

    Usage: ``mux = HandlerMux(); mux.register("samples", h); transport.set_handler(mux)``.
    A kind with no handler raises, so the sender gets a RemoteError naming the kind.
    """

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}

    def register(self, kind: str, handler: Handler) -> None:
        if kind in self._handlers:
            raise ValueError(f"a handler for kind {kind!r} is already registered")
        self._handlers[kind] = handler

    def unregister(self, kind: str) -> None:
        self._handlers.pop(kind, None)

    async def __call__(self, env: Envelope) -> None:
        handler = self._handlers.get(env.kind)
        if handler is None:
            raise LookupError(f"no handler registered for kind {env.kind!r} (known: {sorted(self._handlers)})")
        await handler(env)
