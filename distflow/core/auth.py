"""Message authentication with the cluster secret: the one MAC module and the one replay guard.

Every control message and every data-plane message carries an HMAC-SHA256 tag over
its frames, keyed by a key derived from the cluster secret. A process without the
secret can neither join the mesh nor inject data. Domains (``b"ctrl"``, ``b"data"``)
keep a tag valid for one plane from being replayed on the other.

Payload bytes of data-plane messages are covered by one-time MACs (:func:`payload_tag`,
:class:`ChunkMac`): keys are derived per message from the cluster secret and a nonce in the
signed header, so GMAC's nonce rule holds trivially. Two shapes:

* :func:`payload_tag` - one tag over all frames of a single-message payload, carried in the
  signed header (the receiver checks it once the whole message is in);
* :class:`ChunkMac` - one tag per chunk of a streamed payload, carried with the chunk, so the
  sender MACs chunk k+1 while chunk k is on the wire and the receiver checks chunk k while
  chunk k+1 arrives. The nonce space (index ``0xFFFFFFFF``) is disjoint from payload_tag's.

:class:`ReplayGuard` is what both planes use to drop replays: the mesh with a window of
counters (gossip may arrive out of order), the data plane with a window of one (a connection
delivers in order, so a sequence number must grow).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
import time
from typing import Any, Iterable, Sequence

try:  # AES-GMAC from OpenSSL via `cryptography` (~17 GB/s with VAES/VPCLMULQDQ); optional.
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM as _AESGCM
except Exception:  # pragma: no cover - depends on the environment
    _AESGCM = None

TAG_SIZE = 32
SECRET_ENV = "DISTFLOW_SECRET"


class Authenticator:
    """Computes and checks tags over a sequence of frames."""

    def __init__(self, secret: str | bytes):
        if isinstance(secret, str):
            secret = secret.encode()
        if len(secret) < 16:
            raise ValueError("cluster secret must be at least 16 bytes (DISTFLOW_SECRET)")
        # Derive a dedicated key so the raw secret is never used directly as a MAC key.
        self._key = hashlib.sha256(b"distflow-v1-mac" + secret).digest()

    def tag(self, frames: Iterable[bytes | memoryview], domain: bytes = b"ctrl") -> bytes:
        mac = hmac.new(self._key, domain, hashlib.sha256)
        for f in frames:
            mac.update(struct.pack("<Q", memoryview(f).nbytes))
            mac.update(f)
        return mac.digest()

    def verify(self, frames: Iterable[bytes | memoryview], tag: bytes, domain: bytes = b"ctrl") -> bool:
        return hmac.compare_digest(self.tag(frames, domain), bytes(tag))

    def digest(self, data: bytes, domain: bytes) -> bytes:
        """One-shot tag over ``domain + data`` (one C call: the same-host post records' MAC). A domain
        used here is never used with :meth:`tag`, whose input is length-prefixed frames."""
        return hmac.digest(self._key, domain + data, "sha256")


class MacError(ValueError):
    """A payload MAC algorithm this process cannot compute (the NACK code is :attr:`code`)."""

    code = "unsupported_mac"


GMAC_CHUNK = 1 << 30  # AES-GCM takes at most 2**31-1 bytes of associated data per call


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
            raise MacError("payload MAC aes-gmac needs the `cryptography` package")
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
    raise MacError(f"unknown payload MAC algorithm {alg!r}")


_CHUNK_NONCE = 0xFFFFFFFF  # payload_tag uses (frame index < 2**32 - 1, chunk index)


class ChunkMac:
    """Tags for the chunks of one streamed payload (one key, one nonce per chunk index)."""

    def __init__(self, alg: str, key: bytes):
        if alg == "aes-gmac":
            if _AESGCM is None:
                raise MacError("payload MAC aes-gmac needs the `cryptography` package")
            self._gmac = _AESGCM(key)
        elif alg != "hmac-sha256":
            raise MacError(f"unknown payload MAC algorithm {alg!r}")
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


class ReplayGuard:
    """Per-sender newest boot plus a sliding bitmap of accepted counters.

    ``boot`` is anything ordered (the mesh: a boot nonce; the data plane: (start time, session)).
    A newer boot starts the sender afresh; an older one is refused (``"stale"``), as is a counter
    seen before or more than ``window`` behind the highest (``"replay"``). ``window=1``: counters
    must strictly grow. A sender silent for longer than ``forget_after_s`` may come back with a
    *lower* boot (its clock stepped back across a restart): the mesh sets it to its timestamp
    horizon, past which every message sent before is refused anyway, so forgetting opens no replay;
    the data plane has no such horizon and never forgets (``None``).
    """

    def __init__(self, window: int = 256, max_senders: int = 65536, forget_after_s: float | None = 300.0):
        if window < 1:
            raise ValueError("replay window must be >= 1")
        self.window = window
        self.max_senders = max_senders
        self.forget_after_s = forget_after_s
        self._state: dict[str, list] = {}  # sender -> [boot, highest, bitmap, last accept (monotonic)]

    def check(self, sender: str, boot: Any, counter: int, now: float | None = None) -> str:
        """Record ``(sender, boot, counter)`` and return "" if it was never seen, else why not
        (``"stale"``: an older boot; ``"replay"``: a counter seen or too old)."""
        if now is None:  # (a guard that never forgets needs no clock: one call fewer per message)
            now = time.monotonic() if self.forget_after_s is not None else 0.0
        st = self._state.get(sender)
        if st is not None and self.forget_after_s is not None and boot < st[0] and now - st[3] > self.forget_after_s:
            st = None
        if st is None or boot > st[0]:
            if sender not in self._state and len(self._state) >= self.max_senders:
                self._state.pop(next(iter(self._state)))
            self._state[sender] = [boot, counter, 1, now]
            return ""
        if boot < st[0]:
            return "stale"
        highest, bits = st[1], st[2]
        if counter > highest:
            shift = counter - highest
            bits = ((bits << shift) | 1) if shift < self.window else 1
            st[1], st[2], st[3] = counter, bits & ((1 << self.window) - 1), now
            return ""
        offset = highest - counter
        if offset >= self.window or (bits >> offset) & 1:
            return "replay"
        st[2], st[3] = bits | (1 << offset), now
        return ""

    def accept(self, sender: str, boot: Any, counter: int, now: float | None = None) -> bool:
        """Record and return True if ``(sender, boot, counter)`` was never seen."""
        return not self.check(sender, boot, counter, now)

    def highest(self, sender: str) -> int | None:
        st = self._state.get(sender)
        return None if st is None else st[1]

    def forget(self, sender: str) -> None:
        self._state.pop(sender, None)

    def __len__(self) -> int:
        return len(self._state)


def new_secret() -> str:
    """A fresh random cluster secret (hex, 256 bits)."""
    return secrets.token_hex(32)


def secret_from_env(required: bool = True) -> str | None:
    value = os.environ.get(SECRET_ENV)
    if not value and required:
        raise RuntimeError(
            f"{SECRET_ENV} is not set: every node of a cluster needs the same cluster secret "
            f"(generate one with `python -c 'import secrets; print(secrets.token_hex(32))'`)"
        )
    return value
