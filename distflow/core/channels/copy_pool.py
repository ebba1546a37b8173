"""Warm receive buffers: the shm channel's private copies of small payloads (``shm_copy_below``)
and the buffers streamed payloads (weight buckets) are received into.

Why it exists: a fresh buffer page-faults on every first write, and the kernel zeroes each
page first: a fresh 0.5 MiB numpy array costs ~4x the copy into it, and a 64 MiB weight
bucket (above glibc's mmap threshold, so mapped and unmapped for every message) is received
at a quarter of the speed of a warm one. Buffers come back to the pool when the last tensor
viewing them dies (a ``weakref.finalize``, any thread) and are reused by the next payload of
their size class.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np


class CopyPool:
    """Pooled uint8 buffers, reused once no array or tensor views them. Sizes are rounded up to
    powers of two (pages a smaller payload leaves untouched are never faulted in); at most
    ``max_free`` idle buffers per size and ``max_idle_bytes`` idle in all (beyond that a freed
    buffer goes back to the allocator)."""

    def __init__(self, max_free: int = 32, max_idle_bytes: int = 256 << 20):
        self._free: dict[int, list[np.ndarray]] = {}
        self._max_free = max_free
        self._max_idle = max_idle_bytes
        self._idle = 0  # bytes in the free lists
        self._lock = threading.Lock()  # finalizers may run on any thread

    @property
    def idle_bytes(self) -> int:
        return self._idle

    def empty(self, n: int) -> np.ndarray:
        """An uninitialised uint8 [n] array in a pooled buffer (the caller writes every byte)."""
        size = max(4096, 1 << (n - 1).bit_length()) if n > 0 else 4096
        with self._lock:
            free = self._free.setdefault(size, [])
            base = free.pop() if free else None
            if base is not None:
                self._idle -= size
        if base is None:
            base = np.empty(size, dtype=np.uint8)
        out = base[:n]
        fin = weakref.finalize(out, self._give_back, free, base)
        fin.atexit = False
        return out

    def copy(self, src: np.ndarray) -> np.ndarray:
        """A private copy of ``src`` (uint8 [n]) in a pooled buffer."""
        out = self.empty(src.nbytes)
        np.copyto(out, src)
        return out

    def _give_back(self, free: list[np.ndarray], base: np.ndarray) -> None:
        with self._lock:
            if len(free) < self._max_free and self._idle + base.nbytes <= self._max_idle:
                free.append(base)
                self._idle += base.nbytes
