"""Payload authentication for inline data-plane frames: one MAC per message or per streamed chunk.

Why it exists: the signed header says who sent a message; these MACs say its payload bytes
are the ones that sender wrote. Keys are one-time (derived per message from the cluster
secret and a nonce in the signed header), so GMAC's nonce rule holds trivially. Two shapes:

* :func:`payload_tag` - one tag over all frames of a single-message payload, carried in the
  signed header (the receiver checks it once the whole message is in);
* :func:`chunk_tag` - one tag per chunk of a streamed payload, carried with the chunk, so the
  sender MACs chunk k+1 while chunk k is on the wire and the receiver checks chunk k while
  chunk k+1 arrives. The nonce space (index ``0xFFFFFFFF``) is disjoint from payload_tag's.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any, Sequence

from distflow.core.channels.base import ChannelError

try:  # AES-GMAC from OpenSSL via `cryptography` (~17 GB/s with VAES/VPCLMULQDQ); optional.
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM as _AESGCM
except Exception:  # pragma: no cover - depends on the environment
    _AESGCM = None

GMAC_CHUNK = 1 << 30  # AES-GCM takes at most 2**31-1 bytes of associated data per call


class PayloadError(ChannelError):
    """An authentic message whose payload cannot be accepted; the code goes back in the NACK."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def default_mac_alg() -> str:
    return "aes-gmac" if _AESGCM is not None else "hmac-sha256"


def payload_tag(alg: str, key: bytes, frames: Sequence[Any]) -> bytes:
    """One-time MAC over payload frames. ``key``: 32 bytes, unique per message.

    aes-gmac: one 16-byte GMAC tag per (frame, chunk of <= 1 GiB), nonce = (frame index, chunk
    index), all concatenated; frame lengths are fixed by the signed header. hmac-sha256: one tag
    over the length-prefixed frames.
    """
    if alg == "aes-gmac":
        if _AESGCM is None:
            raise PayloadError("unsupported_mac", "payload MAC aes-gmac needs the `cryptography` package")
        gmac = _AESGCM(key)
        tags = []
        for i, f in enumerate(frames):
            mv = memoryview(f).cast("B")
            for j, off in enumerate(range(0, max(mv.nbytes, 1), GMAC_CHUNK)):
                tags.append(gmac.encrypt(struct.pack("<IQ", i, j), b"", mv[off:off + GMAC_CHUNK]))
        return b"".join(tags)
    if alg == "hmac-sha256":
        h = hmac.new(key, digestmod=hashlib.sha256)
        for f in frames:
            h.update(struct.pack("<Q", memoryview(f).nbytes))
            h.update(f)
        return h.digest()
    raise PayloadError("unsupported_mac", f"unknown payload MAC algorithm {alg!r}")


_CHUNK_NONCE = 0xFFFFFFFF  # payload_tag uses (frame index < 2**32 - 1, chunk index)


class ChunkMac:
    """Tags for the chunks of one streamed payload (one key, one nonce per chunk index)."""

    def __init__(self, alg: str, key: bytes):
        if alg == "aes-gmac":
            if _AESGCM is None:
                raise PayloadError("unsupported_mac", "payload MAC aes-gmac needs the `cryptography` package")
            self._gmac = _AESGCM(key)
        elif alg != "hmac-sha256":
            raise PayloadError("unsupported_mac", f"unknown payload MAC algorithm {alg!r}")
        self.alg, self._key = alg, key

    def tag(self, index: int, data: Any) -> bytes:
        """16 (aes-gmac) or 32 (hmac-sha256) bytes over chunk number ``index`` (< 2**63)."""
        if self.alg == "aes-gmac":
            return self._gmac.encrypt(struct.pack("<IQ", _CHUNK_NONCE, index), b"", data)
        h = hmac.new(self._key, struct.pack("<Q", index), hashlib.sha256)
        h.update(data)
        return h.digest()

    def verify(self, index: int, data: Any, tag: bytes) -> bool:
        return hmac.compare_digest(self.tag(index, data), tag)
