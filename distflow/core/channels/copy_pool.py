"""Warm receive buffers: the shm channel's private copies of small payloads (``shm_copy_below``)
and the buffers streamed payloads (weight buckets) are received into.

Why it exists: a fresh buffer page-faults on every first write, and the kernel zeroes each
page first: a fresh 0.5 MiB numpy array costs ~4x the copy into it, and a 64 MiB weight
bucket (above glibc's mmap threshold, so mapped and unmapped for every message) is received
at a fraction of the speed of a warm one. Buffers come back when the last array or tensor
viewing them dies and are reused by the next payload of their size class.

The return runs in a ``weakref.finalize`` callback, which may fire on any thread, or inside
the cyclic garbage collector in the middle of this pool's own code: it therefore only appends
to a deque (atomic) and takes no lock; :meth:`CopyPool.empty` files the returns under its lock.
"""

from __future__ import annotations

import collections
import threading
import weakref

import numpy as np


CLASSES_PER_OCTAVE = 4


def size_class(n: int, minimum: int = 4096) -> int:
    """The buffer size ``n`` bytes are kept in: at least ``minimum`` (a power of two), else ``n``
    rounded up to a multiple of an eighth of the next power of two, so four classes per doubling.

    Why not powers of two: a buffer holds its class's bytes (a shared-memory segment reserves them
    in /dev/shm), and weight buckets are often just over a power of two, or far above the bucket
    size (an embedding is a bucket of its own: 272 MB for Qwen2.5-0.5B, 1.1 GB for a 7B model).
    Powers of two kept up to 2x their bytes (512 MiB for that embedding); this keeps at most 1.25x
    (320 MiB), while payloads of one size, as every version's buckets are, still share a class.
    Pages a smaller payload leaves untouched are never faulted in either way."""
    if n <= minimum:
        return minimum
    step = max(minimum, (1 << (n - 1).bit_length()) // (2 * CLASSES_PER_OCTAVE))
    return -(-n // step) * step


class CopyPool:
    """Pooled uint8 buffers, reused once no array or tensor views them. Sizes are rounded up to
    their :func:`size_class`; at most
    ``max_free`` idle buffers per size and ``max_idle_bytes`` idle in all (beyond that a returned
    buffer goes back to the allocator)."""

    def __init__(self, max_free: int = 32, max_idle_bytes: int = 256 << 20):
        self._free: dict[int, list[np.ndarray]] = {}
        self._returned: collections.deque[np.ndarray] = collections.deque()  # filled by finalizers only
        self._max_free = max_free
        self._max_idle = max_idle_bytes
        self._idle = 0  # bytes in the free lists
        self._lock = threading.Lock()  # never taken by a finalizer

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            self._file_returns()
            return self._idle

    def empty(self, n: int) -> np.ndarray:
        """An uninitialised uint8 [n] array in a pooled buffer (the caller writes every byte)."""
        size = size_class(n)
        with self._lock:
            self._file_returns()
            # the smallest idle buffer that fits, up to twice the class (sizes vary from step to step)
            fits = [k for k, free in self._free.items() if free and size <= k <= 2 * size]
            base = self._free[min(fits)].pop() if fits else None
            if base is not None:
                self._idle -= base.nbytes
        if base is None:
            base = np.empty(size, dtype=np.uint8)
        # a view of a plain slice would hold `base`, not `out`: a view of `out` (a slice, .view())
        # could then outlive it and see the buffer reused. Over a memoryview, views hold `out`.
        out = np.frombuffer(memoryview(base)[:n], dtype=np.uint8)
        fin = weakref.finalize(out, self._returned.append, base)
        fin.atexit = False
        return out

    def copy(self, src: np.ndarray) -> np.ndarray:
        """A private copy of ``src`` (uint8 [n]) in a pooled buffer."""
        out = self.empty(src.nbytes)
        np.copyto(out, src)
        return out

    def clear(self) -> None:
        """Hand every idle buffer back to the allocator (the channel is closing)."""
        with self._lock:
            self._returned.clear()
            self._free.clear()
            self._idle = 0

    def _file_returns(self) -> None:
        """Put returned buffers in their free lists, within the caps (caller holds the lock)."""
        while True:
            try:
                base = self._returned.popleft()
            except IndexError:
                return
            free = self._free.setdefault(base.nbytes, [])
            if len(free) < self._max_free and self._idle + base.nbytes <= self._max_idle:
                free.append(base)
                self._idle += base.nbytes
