"""Warm buffers for the private copies of small received payloads (the shm channel's ``shm_copy_below``).

Why it exists: a fresh 0.5 MiB numpy array is mmapped and page-faults on every write (~4x the
cost of the copy itself); these buffers come back to the pool when the last tensor viewing them
dies (a ``weakref.finalize``, any thread: list append/pop are atomic under the GIL) and are reused.
"""

from __future__ import annotations

import weakref

import numpy as np


class CopyPool:
    """Pooled uint8 buffers, reused once no tensor views them. Sizes are rounded up to powers
    of two; at most ``max_free`` idle buffers per size."""

    def __init__(self, max_free: int = 32):
        self._free: dict[int, list[np.ndarray]] = {}
        self._max_free = max_free

    def copy(self, src: np.ndarray) -> np.ndarray:
        """A private copy of ``src`` (uint8 [n]) in a pooled buffer."""
        n = src.nbytes
        size = max(4096, 1 << (n - 1).bit_length()) if n else 4096
        free = self._free.setdefault(size, [])
        try:
            base = free.pop()
        except IndexError:
            base = np.empty(size, dtype=np.uint8)
        out = base[:n]
        np.copyto(out, src)
        fin = weakref.finalize(out, self._give_back, free, base)
        fin.atexit = False
        return out

    def _give_back(self, free: list[np.ndarray], base: np.ndarray) -> None:
        if len(free) < self._max_free:
            free.append(base)
