"""Tensor channels: the data plane between nodes (zmq frames, shared memory, NCCL).

Callers use :func:`make_channel` and the :class:`TensorChannel` API only; the backend is
a deployment choice. ``"auto"`` picks the best one this process can run: NCCL for CUDA
tensors when cupy+NCCL and a GPU are present, shared memory for peers on this host,
ZeroMQ frames otherwise — every backend also speaks the inline-frame protocol, so any
two channels interoperate.
"""

from __future__ import annotations

from typing import Any

from distflow.core.channels.base import (
    ChannelClosed,
    ChannelError,
    Endpoint,
    Envelope,
    Handler,
    HandlerMux,
    RemoteError,
    TensorChannel,
)
from distflow.core.channels.codec import CodecError
from distflow.core.channels.shm_channel import ShmChannel, shm_available, sweep_stale_segments
from distflow.core.channels.zmq_channel import ZmqChannel

KINDS = ("zmq", "shm", "nccl", "auto")
_SHM_KW = frozenset({"shm_min_bytes", "shm_copy_below", "shm_release_delay", "max_free_slots", "mapping_idle_s",
                     "sweep_min_age", "local_socket", "posting", "max_shared_buffers"})
_NCCL_KW = frozenset({"device", "nccl_timeout"})

__all__ = [
    "ChannelClosed", "ChannelError", "CodecError", "Endpoint", "Envelope", "Handler", "HandlerMux",
    "RemoteError", "ShmChannel", "TensorChannel", "ZmqChannel", "make_channel", "sweep_stale_segments",
]


def make_channel(kind: str, node_id: str, secret: str | bytes, host: str = "127.0.0.1", port: int = 0,
                 **kw: Any) -> TensorChannel:
    """A channel endpoint for ``node_id`` bound (on ``start()``) to host:port (0 = ephemeral).

    kind: "zmq" | "shm" | "nccl" | "auto". Extra keywords go to the backend
    (e.g. ``max_message_bytes``, ``max_inflight``, ``stream_min_bytes``, ``stream_chunk``, ``stream_timeout``,
    ``shm_min_bytes``, ``shm_copy_below``, ``device``).
    """
    if kind == "zmq":
        return ZmqChannel(node_id, secret, host, port, **kw)
    if kind == "shm":
        return ShmChannel(node_id, secret, host, port, **kw)
    if kind == "nccl":
        from distflow.core.channels.nccl_channel import NcclChannel  # noqa: PLC0415 - cupy is optional

        return NcclChannel(node_id, secret, host, port, **kw)
    if kind == "auto":  # backend-specific keywords are dropped for a backend that does not take them
        from distflow.core.channels.nccl_channel import NcclChannel, nccl_available  # noqa: PLC0415

        if nccl_available():
            return NcclChannel(node_id, secret, host, port, **kw)
        kw = {k: v for k, v in kw.items() if k not in _NCCL_KW}
        if shm_available():
            return ShmChannel(node_id, secret, host, port, **kw)
        return ZmqChannel(node_id, secret, host, port, **{k: v for k, v in kw.items() if k not in _SHM_KW})
    raise ValueError(f"unknown channel kind {kind!r}; expected one of {', '.join(KINDS)}")
