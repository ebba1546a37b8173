"""The CUDA IPC mover: weight buckets between two processes on one GPU, as handles, no bytes.

Why it exists: a trainer rank and a rollout node sharing one GPU need not copy a bucket at all;
the message (over any transport: the handles ride in its signed header) carries CUDA IPC handles
of the serving rank's gathered buckets and the rollout engine copies device-to-device.
Which pair uses it is :func:`distflow.transport.select.weight_tier`'s choice.

``cuda_ipc`` (trainer and rollout on one GPU: each node sees only its own, and IPC handles
  open only on the GPU that holds the memory): the message carries no bytes,
  only CUDA IPC handles of the serving rank's gathered GPU buckets, one per storage (a bucket is
  views of one flat buffer: one handle, its tensors described as views; ``storage._share_cuda_``,
  the handle format of ``torch.multiprocessing``, encoded as plain msgpack fields, never
  pickled) inside the signed channel header. The rollout opens them and its engine copies
  device-to-device. Lifetime: torch's CUDA IPC reference counter (a shared counter per
  exported block) keeps an exported block alive on the exporter, even after the publisher
  drops the version (superseded), until every importer has freed its views, so a rollout
  node never reads memory that was reused. Each exported block holds one count: the exporter
  exports right before the send, and the importer opens or releases every block it
  gets, the ones it drops (an old version) or fails to open included, or the block leaks.
  The exporter gives counts back in one case only (:func:`send_ipc`): an export whose message the
  receiving channel refused before any handler saw it (a NACK code in ``REFUSED_UNSEEN``: no
  handler installed, a malformed message): nobody opened it and nobody will (a refused message
  is never delivered again). Not for a peer declared dead or restarted, nor for a send that
  timed out or was abandoned, although those counts then stay held until the trainer exits (a
  rollout node killed while it holds a version pins those blocks): the mesh's "dead" is
  refutable (the node may be alive, copying out of the block), and a new life does not tell
  whose count it is: a message sent to the old life may still sit in the channel's queue (a zmq
  DEALER delivers what it queued once the port accepts again: to the new life, whose channel
  runs before it joins the mesh), a send that timed out may have been handled, and an ack names
  no process. Releasing there could let the trainer reuse memory a live rollout node is loading
  from. Lifting this needs the importer's help: exports naming the life they are for, opened by
  that life only (another releases them unopened), and released by the exporter once it has ended.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from distflow.transport.api import Endpoint, RemoteError, Transport
from distflow.transport.codec import DTYPE_NAMES, DTYPES

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- CUDA IPC
# A bucket's tensors are views of one flat buffer (``trainer/gather.py``), so a bucket is exported
# as its *storages*, each shared once: one IPC handle, one event and one count of torch's CUDA IPC
# reference counter per storage (a whole bucket: one), with the tensors described as views of it.
# Exporting each tensor instead made a counter slot and an event per tensor, all for one block:
# hundreds per version, and past 1000 blocks in limbo torch syncs the device on every export.
# A count keeps the exporter's block (in "limbo" once it freed it) until the importer releases
# it, by freeing every view it opened or, for a block it never opens, by ``release_ipc``. So
# the exporter exports right before the send, and the importer opens or releases every block
# it receives, even the ones it drops.
_IPC_FIELDS = (("handle", bytes), ("ref_handle", bytes), ("ref_offset", int), ("size_bytes", int),
               ("offset_bytes", int), ("device", int))


def storage_views(bucket: dict[str, torch.Tensor]) -> tuple[list[tuple[torch.Tensor, list[dict[str, Any]]]],
                                                           list[dict[str, Any]]]:
    """A bucket as the storages it views: ([(flat uint8 tensor over one whole storage, [view
    entries])], [empty tensors]). An entry is ``{"name", "dtype", "size", "stride", "offset"}``
    (``offset`` in bytes from the storage's start); :func:`open_views` rebuilds the tensors.
    Pure layout: runs on any device (the CPU tests), :func:`export_ipc` shares the flat ones."""
    blocks: dict[tuple[str, int], tuple[torch.Tensor, list[dict[str, Any]]]] = {}
    empty: list[dict[str, Any]] = []
    for name, t in bucket.items():
        if t.numel() == 0:  # an empty storage has no IPC handle: described, re-created on import
            empty.append({"name": name, "dtype": DTYPE_NAMES[t.dtype], "size": list(t.shape),
                          "device": int(t.device.index or 0)})
            continue
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        if key not in blocks:
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))
            blocks[key] = (flat, [])
        blocks[key][1].append({"name": name, "dtype": DTYPE_NAMES[t.dtype], "size": list(t.shape),
                               "stride": list(t.stride()), "offset": t.storage_offset() * t.element_size()})
    return list(blocks.values()), empty


def open_views(flat: torch.Tensor, entries: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The tensors ``entries`` describe, as views of ``flat`` (checked by :func:`_check_ipc`)."""
    out = {}
    for e in entries:
        dtype = DTYPES[e["dtype"]]
        n = _extent(e["size"], e["stride"]) * dtype.itemsize
        out[e["name"]] = flat[e["offset"]:e["offset"] + n].view(dtype).as_strided(e["size"], e["stride"])
    return out


def _extent(size: list[int], stride: list[int]) -> int:
    """Elements a strided view of ``size``/``stride`` spans (0 for an empty one)."""
    return 0 if 0 in size else 1 + sum((n - 1) * s for n, s in zip(size, stride))


def export_ipc(bucket: dict[str, torch.Tensor]) -> dict[str, Any]:
    """msgpack-able IPC descriptors of a bucket of CUDA tensors (no bytes are copied):
    ``{"blocks": [one per storage: its handle fields and "tensors", its view entries], "empty": [...]}``.

    Each block holds a count of the exporter's IPC reference counter until the importer opens
    it and frees every view, or releases it (:func:`release_ipc`)."""
    from torch.multiprocessing.reductions import reduce_tensor

    for name, t in bucket.items():
        if not t.is_cuda:
            raise ValueError(f"cuda_ipc export: tensor {name!r} is on {t.device}, not CUDA")
    flats, empty = storage_views(bucket)
    blocks = []
    for flat, entries in flats:
        _, a = reduce_tensor(flat)
        (_, _, _, _, _, _, device, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset,
         event_handle, event_sync) = a
        blocks.append({"device": int(device), "handle": bytes(handle), "size_bytes": int(size_bytes),
                       "offset_bytes": int(offset_bytes), "ref_handle": bytes(ref_handle),
                       "ref_offset": int(ref_offset),
                       "event_handle": bytes(event_handle) if event_handle is not None else None,
                       "event_sync": bool(event_sync), "tensors": entries})
    return {"blocks": blocks, "empty": empty}


def export_ready(bucket: dict[str, torch.Tensor], ready: Any, stream: Any) -> dict[str, Any]:
    """:func:`export_ipc`, with the event the importer waits on ordered after ``ready`` only.

    torch records an export's event on the exporter's current stream, so the importer waits for
    everything queued there when the export runs: on a trainer, by then, its next step's kernels,
    and the rollout engine's weight load (and the decoding after it, on the same stream) would
    wait for them. Here the export runs on ``stream`` (the exporter's own), which first waits
    on ``ready``, an event recorded when the bucket was gathered. ``ready`` None: torch's way."""
    if ready is None:
        return export_ipc(bucket)
    stream.wait_event(ready)
    with torch.cuda.stream(stream):  # synchronous: no other coroutine sees this stream as current
        return export_ipc(bucket)


def _release_counter(ref_handle: bytes, ref_offset: int) -> None:
    """Give back one count of an exporter's IPC reference counter (what torch's rebuild does
    for a storage it already has open)."""
    torch.UntypedStorage._release_ipc_counter_cuda(ref_handle, ref_offset)


def _blocks(ipc: Any) -> list[Any]:
    blocks = ipc.get("blocks") if isinstance(ipc, dict) else None
    return blocks if isinstance(blocks, list) else []


def release_ipc(ipc: Any, start: int = 0) -> int:
    """Release the exporter's reference count of the blocks (from #``start``) that will not be
    opened (best effort: malformed ones are skipped, as is a counter whose exporter is gone).
    Returns how many were released."""
    n = 0
    for b in _blocks(ipc)[start:]:
        if not isinstance(b, dict) or not isinstance(b.get("ref_handle"), bytes) \
                or not isinstance(b.get("ref_offset"), int):
            continue
        try:
            _release_counter(b["ref_handle"], b["ref_offset"])
            n += 1
        except Exception as e:  # noqa: BLE001 - the exporter may have exited; nothing is held then
            log.warning("cuda_ipc: could not release block %r: %s", b.get("handle"), e)
    return n


# NACK codes a receiving transport refuses a message with before any handler saw it (receive,
# streams, the payload MACs, shm and nccl movers). Listed, not "all but handler_error": a code
# added later is then kept (a leak at worst), never released under a handler that opened it.
REFUSED_UNSEEN = frozenset({"no_handler", "wrong_recipient", "bad_header", "bad_payload", "bad_payload_mac",
                            "unsupported_payload", "unsupported_mac", "internal_error", "oversized",
                            "stream_timeout", "shm_unavailable", "nccl_timeout", "nccl_aborted",
                            "nccl_out_of_order"})


async def send_ipc(channel: Transport, peer: Endpoint, kind: str, meta: dict[str, Any], ipc: dict[str, Any],
                   timeout: float) -> None:
    """Send ``meta`` with the export ``ipc`` (no tensors). A refusal before any handler ran gives its
    counts back here (the only case the exporter knows to be nobody's, see the module docstring);
    any other outcome leaves them to the importer."""
    try:
        await channel.send(peer, kind, {**meta, "ipc": ipc}, {}, timeout=timeout)
    except RemoteError as e:
        if e.code in REFUSED_UNSEEN:
            n = release_ipc(ipc)
            log.warning("cuda_ipc: %s refused the export unseen (%s): released its %d block(s)", peer.node_id,
                        e.code, n)
        raise


def _check_ipc(ipc: Any) -> None:
    """Every field of an (untrusted) export, every view inside its storage, every name once."""
    if not isinstance(ipc, dict) or not isinstance(ipc.get("blocks"), list) or not isinstance(ipc.get("empty"), list):
        raise ValueError("cuda_ipc bucket: expected {'blocks': [...], 'empty': [...]}")
    ints = lambda v: isinstance(v, list) and all(isinstance(x, int) and x >= 0 for x in v)  # noqa: E731
    names: set[str] = set()

    def entry(e: Any, keys: tuple[str, ...]) -> None:
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or e.get("dtype") not in DTYPES \
                or e["name"] in names:
            raise ValueError(f"cuda_ipc bucket: tensor entry {e!r} is malformed or repeated")
        names.add(e["name"])
        for key in keys:
            ok = isinstance(e.get(key), int) and e[key] >= 0 if key in ("offset", "device") else ints(e.get(key))
            if not ok:
                raise ValueError(f"cuda_ipc bucket: tensor {e['name']!r} lacks {key!r} (or it is malformed)")

    for i, b in enumerate(ipc["blocks"]):
        if not isinstance(b, dict) or not isinstance(b.get("tensors"), list) or not b["tensors"]:
            raise ValueError(f"cuda_ipc bucket: block #{i} is malformed")
        for key, typ in _IPC_FIELDS:
            if not isinstance(b.get(key), typ) or (typ is int and b[key] < 0):
                raise ValueError(f"cuda_ipc bucket: block #{i} lacks {key!r} (or it is malformed)")
        for e in b["tensors"]:
            entry(e, ("size", "stride", "offset"))
            itemsize = DTYPES[e["dtype"]].itemsize
            if len(e["size"]) != len(e["stride"]) or 0 in e["size"] or e["offset"] % itemsize \
                    or e["offset"] + _extent(e["size"], e["stride"]) * itemsize > b["size_bytes"]:
                raise ValueError(f"cuda_ipc bucket: tensor {e['name']!r} reaches outside its storage")
    for e in ipc["empty"]:
        entry(e, ("size", "device"))


def import_ipc(ipc: Any, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Open an export (from an authenticated header) as CUDA tensors viewing the exporter's memory.

    The views keep the exporter's blocks alive until they are freed; copy out of them (the
    engine's device-to-device load) and drop them. On any error, the blocks not opened are
    released (:func:`release_ipc`) before it is raised; the ones opened are freed.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    opened = 0
    try:
        _check_ipc(ipc)
        out: dict[str, torch.Tensor] = {}
        for b in ipc["blocks"]:
            dev = int(b["device"]) if device is None else (device.index or 0)
            # torch's own wait on the exporter's event (event_sync) opens that event and never
            # destroys it: one CUDA event leaked per block per version. Opened here instead, as an
            # Event object, it is destroyed when dropped (CUDA frees it once the wait is done).
            if b.get("event_sync") and b.get("event_handle"):
                torch.cuda.Event.from_ipc_handle(dev, b["event_handle"]).wait(torch.cuda.current_stream(dev))
            flat = rebuild_cuda_tensor(
                torch.Tensor, torch.Size([b["size_bytes"]]), (1,), 0, torch.storage.TypedStorage, torch.uint8,
                dev, b["handle"], b["size_bytes"], b["offset_bytes"], False, b["ref_handle"], b["ref_offset"],
                b.get("event_handle"), False)
            opened += 1
            out.update(open_views(flat, b["tensors"]))
        for e in ipc["empty"]:
            dev = int(e["device"]) if device is None else (device.index or 0)
            out[e["name"]] = torch.empty(e["size"], dtype=DTYPES[e["dtype"]], device=torch.device("cuda", dev))
    except BaseException:
        # The ones opened are freed with ``out``; the rest (all, when a check failed) are released.
        # A failure inside rebuild comes before it takes the count over (the views were checked to fit).
        release_ipc(ipc, opened)
        raise
    return out
