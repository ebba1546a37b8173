"""Tensor (de)serialization for data-plane frames — never pickle.

A message carries tensors as a list of small msgpack-able headers
``{"name", "dtype", "shape", "nbytes"}`` plus one raw buffer per tensor: the contiguous
tensor viewed as ``uint8`` (which works for every dtype, bfloat16 included). Sending is
zero-copy (a memoryview of the tensor's own memory); receiving rebuilds each tensor with
``torch.frombuffer`` on the received frame, zero-copy as well. Headers coming off the
wire are untrusted: :func:`decode` validates every field and raises :class:`CodecError`
naming the problem instead of building a wrong tensor.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

# Every dtype the framework moves. Names are stable wire identifiers.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
MAX_DIMS = 16
ALIGN = 64  # byte alignment of tensors packed into one buffer (shared memory)


class CodecError(ValueError):
    """A tensor cannot be encoded, or a received tensor header/frame is invalid."""


def byte_view(t: torch.Tensor, name: str = "tensor") -> memoryview:
    """The tensor's bytes as a flat read/write memoryview, without copying when contiguous.

    t: any shape, a dtype of :data:`DTYPES`, on CPU. Returns ``t.numel()*t.element_size()`` bytes.
    """
    if not isinstance(t, torch.Tensor):
        raise CodecError(f"tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise CodecError(f"tensor {name!r}: only dense (strided) tensors can be sent, got layout {t.layout}")
    if t.dtype not in DTYPE_NAMES:
        raise CodecError(f"tensor {name!r}: dtype {t.dtype} is not supported on the wire (supported: {sorted(DTYPES)})")
    if t.device.type != "cpu":
        raise CodecError(f"tensor {name!r} is on {t.device}; move it to CPU (or use the nccl channel)")
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: view the bits as uint8
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())
    return memoryview(t.reshape(-1).numpy()).cast("B")


def tensor_header(name: str, t: torch.Tensor) -> dict[str, Any]:
    """The wire header of one tensor (no data)."""
    if t.dtype not in DTYPE_NAMES:
        raise CodecError(f"tensor {name!r}: dtype {t.dtype} is not supported on the wire (supported: {sorted(DTYPES)})")
    return {"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "nbytes": t.numel() * t.element_size()}


def encode(tensors: Mapping[str, torch.Tensor], pack_below: int = 0) -> tuple[list[dict[str, Any]], list[Any]]:
    """(headers, buffers) for a dict of tensors.

    Each tensor of at least ``pack_below`` bytes gets its own zero-copy buffer; smaller ones
    are copied into one shared buffer (header fields ``f`` = buffer index, ``o`` = byte offset),
    which saves per-frame costs for the many tiny tensors of a batch (lengths, scalars).
    With ``pack_below=0`` there is exactly one buffer per tensor, in order.
    """
    if not isinstance(tensors, Mapping):
        raise CodecError(f"tensors must be a dict of name -> torch.Tensor, got {type(tensors).__name__}")
    headers: list[dict[str, Any]] = []
    buffers: list[Any] = []
    small: list[tuple[dict[str, Any], memoryview]] = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise CodecError(f"tensor names must be str, got {name!r}")
        buf = byte_view(t, name)
        h = tensor_header(name, t)
        headers.append(h)
        if buf.nbytes < pack_below:
            small.append((h, buf))
        else:
            if pack_below > 0:
                h["f"] = len(buffers)
            buffers.append(buf)
    if small:
        offsets, total = packed_layout([h for h, _ in small], align=16)
        packed = bytearray(total)
        for (h, buf), off in zip(small, offsets):
            packed[off:off + buf.nbytes] = buf
            h["f"], h["o"] = len(buffers), off
        buffers.append(packed)
    return headers, buffers


def validate_headers(headers: Any, max_bytes: int | None = None) -> list[dict[str, Any]]:
    """Check untrusted tensor headers; returns them. Raises CodecError naming the bad field."""
    if not isinstance(headers, list):
        raise CodecError(f"tensor headers must be a list, got {type(headers).__name__}")
    seen: set[str] = set()
    total = 0
    for i, h in enumerate(headers):
        if not isinstance(h, dict):
            raise CodecError(f"tensor header #{i} must be a map, got {type(h).__name__}")
        name, dtype, shape, nbytes = h.get("name"), h.get("dtype"), h.get("shape"), h.get("nbytes")
        if not isinstance(name, str):
            raise CodecError(f"tensor header #{i}: name must be str, got {name!r}")
        if name in seen:
            raise CodecError(f"tensor {name!r} appears twice")
        seen.add(name)
        if dtype not in DTYPES:
            raise CodecError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise CodecError(f"tensor {name!r}: shape must be a list of at most {MAX_DIMS} non-negative ints, "
                             f"got {shape!r}")
        expected = math.prod(shape) * DTYPES[dtype].itemsize
        if not isinstance(nbytes, int) or nbytes != expected:
            raise CodecError(f"tensor {name!r}: nbytes {nbytes!r} does not match {dtype}{shape} ({expected} bytes)")
        total += nbytes
    if max_bytes is not None and total > max_bytes:
        raise CodecError(f"tensors total {total} bytes, over the limit of {max_bytes}")
    return headers


def tensor_from_buffer(buf: Any, header: dict[str, Any], offset: int = 0) -> torch.Tensor:
    """A tensor of header's dtype/shape viewing ``buf[offset:offset+nbytes]`` (zero-copy)."""
    dtype, shape, nbytes = DTYPES[header["dtype"]], header["shape"], header["nbytes"]
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset).view(shape)


def decode(headers: Any, frames: Sequence[Any]) -> dict[str, torch.Tensor]:
    """Rebuild tensors from validated headers and writable received buffers (zero-copy).

    Headers without ``f`` take one frame each, in order; with ``f``/``o`` they view
    ``frames[f][o:o+nbytes]`` (see :func:`encode`). Every frame must be used.
    """
    validate_headers(headers)
    sizes = [memoryview(f).nbytes for f in frames]
    indexed = any("f" in h for h in headers)
    if not indexed and len(frames) != len(headers):
        raise CodecError(f"{len(headers)} tensor headers but {len(frames)} payload frames")
    out: dict[str, torch.Tensor] = {}
    used: set[int] = set()
    for i, h in enumerate(headers):
        fi, off = (h.get("f"), h.get("o", 0)) if indexed else (i, 0)
        if not isinstance(fi, int) or not 0 <= fi < len(frames):
            raise CodecError(f"tensor {h['name']!r}: frame index {fi!r} out of range ({len(frames)} frames)")
        itemsize = DTYPES[h["dtype"]].itemsize
        if not isinstance(off, int) or off < 0 or off % itemsize:
            raise CodecError(f"tensor {h['name']!r}: bad offset {off!r}")
        end = off + h["nbytes"]
        if end > sizes[fi] or (not indexed and sizes[fi] != h["nbytes"]):
            raise CodecError(f"tensor {h['name']!r}: frame has {sizes[fi]} bytes, header says {h['nbytes']}"
                             + (f" at offset {off}" if off else ""))
        used.add(fi)
        out[h["name"]] = tensor_from_buffer(frames[fi], h, off)
    if len(used) != len(frames):
        raise CodecError(f"{len(frames) - len(used)} payload frame(s) not referenced by any tensor header")
    return out


def packed_layout(headers: Sequence[dict[str, Any]], align: int = ALIGN) -> tuple[list[int], int]:
    """Offsets of each tensor when packed into one buffer at ``align``-byte boundaries, and the total size."""
    offsets: list[int] = []
    pos = 0
    for h in headers:
        pos = (pos + align - 1) // align * align
        offsets.append(pos)
        pos += h["nbytes"]
    return offsets, pos
