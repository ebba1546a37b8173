"""Message authentication with the cluster secret.

Every control message and every data-plane message carries an HMAC-SHA256 tag over
its frames, keyed by a key derived from the cluster secret. A process without the
secret can neither join the mesh nor inject data. Domains (``b"ctrl"``, ``b"data"``)
keep a tag valid for one plane from being replayed on the other.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from typing import Iterable

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
