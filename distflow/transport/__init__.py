"""The data plane: tensors between nodes, over one transport API with movers composed per node.

Callers use :func:`make_transport` and the :class:`~.api.Transport` API only (``api``); the
backend is a deployment choice made in :mod:`.select`. A transport is a :class:`~.link.Link`
(framing, MAC, replay, ack over ZeroMQ and same-host Unix sockets) with the movers its node has
(:mod:`.movers`: shared memory, posting, NCCL; CUDA IPC handles ride in any message's header).
"""

from __future__ import annotations

from typing import Any

from distflow.transport import select
from distflow.transport.api import (
    ChannelClosed,
    ChannelError,
    Endpoint,
    Envelope,
    Handler,
    HandlerMux,
    PayloadError,
    RemoteError,
    Transport,
)
from distflow.transport.arena import shm_available, sweep_stale_segments
from distflow.transport.codec import CodecError
from distflow.transport.composed import ComposedTransport
from distflow.transport.link import Link
from distflow.transport.movers import nccl as nccl_mover
from distflow.transport.movers.posting import Posting
from distflow.transport.movers.shm import ShmMover

KINDS = select.KINDS
_LINK_KW = frozenset({"max_message_bytes", "max_header_bytes", "max_frames", "max_inflight", "mac_alg", "pack_below",
                      "close_timeout", "stream_min_bytes", "stream_chunk", "stream_timeout"})
_SHM_KW = frozenset({"shm_min_bytes", "shm_copy_below", "shm_release_delay", "max_free_slots", "mapping_idle_s",
                     "sweep_min_age"})
_POSTING_KW = frozenset({"posting", "max_shared_buffers"})
_NCCL_KW = frozenset({"device", "nccl_timeout"})

__all__ = [
    "ChannelClosed", "ChannelError", "CodecError", "ComposedTransport", "Endpoint", "Envelope", "Handler",
    "HandlerMux", "PayloadError", "RemoteError", "Transport", "make_transport", "sweep_stale_segments",
]


def make_transport(kind: str, node_id: str, secret: str | bytes, host: str = "127.0.0.1", port: int = 0, *,
                   cuda_node: bool = True, **kw: Any) -> ComposedTransport:
    """A transport for ``node_id`` bound (on ``start()``) to host:port (0 = ephemeral).

    kind: "zmq" | "shm" | "nccl" | "auto" (:func:`.select.transport_kind`; ``cuda_node`` False: a
    cpu node, which ``auto`` never gives NCCL). Extra keywords go to the link or the mover that takes
    them (e.g. ``max_message_bytes``, ``stream_min_bytes``, ``shm_min_bytes``, ``posting``, ``device``);
    ``auto`` drops those of movers it did not pick, an explicit kind refuses them.
    """
    chosen = select.transport_kind(kind, cuda_node=cuda_node, nccl=cuda_node and nccl_mover.nccl_available(),
                                   shm=shm_available())
    if kind == "auto":
        kw = {k: v for k, v in kw.items() if k in _LINK_KW
              or (k in _SHM_KW | _POSTING_KW | {"local_socket"} and chosen != "zmq")
              or (k in _NCCL_KW and chosen == "nccl")}
    allowed = _LINK_KW | ({"local_socket"} | _SHM_KW | _POSTING_KW if chosen != "zmq" else set()) \
        | (_NCCL_KW if chosen == "nccl" else set())
    unknown = set(kw) - allowed
    if unknown:
        raise TypeError(f"make_transport({chosen!r}) got unexpected keyword argument(s) {sorted(unknown)}")
    posting, local_socket = kw.get("posting", True), kw.get("local_socket", True)
    if not isinstance(posting, bool):
        raise ValueError(f"posting must be a bool, got {posting!r}")
    movers = select.node_movers(chosen, posting=posting, local_socket=local_socket)
    link = Link(node_id, secret, host, port, kind=chosen, local_socket=local_socket if chosen != "zmq" else False,
                **{k: v for k, v in kw.items() if k in _LINK_KW})
    shm = ShmMover(link, **{k: v for k, v in kw.items() if k in _SHM_KW}) if "shm" in movers else None
    transport = ComposedTransport(link, shm=shm)
    if "posting" in movers and link.use_local:
        assert shm is not None
        transport.attach(Posting(link, shm.maps, transport.send, kw.get("max_shared_buffers", 16)))
    if "nccl" in movers:
        transport.attach(nccl_mover.NcclMover(link, transport.send_host,
                                              **{k: v for k, v in kw.items() if k in _NCCL_KW}))
    return transport
