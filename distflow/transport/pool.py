"""The data plane's one buffer-pool abstraction: size classes and the reuse rule, and the pools on it.

Why it exists: every pool of the data plane keeps buffers warm for the next payload of a similar
size, and they all follow one rule: a buffer is sized by :func:`size_class`, and a request takes
:func:`smallest_fitting`, the smallest idle buffer that holds it. What differs between them, and
is why they are several objects on this one rule, not one object, is only how a buffer becomes
idle again, which is where its memory lives:

* :class:`CopyPool` (here): process memory, idle again when the last array or tensor viewing it
  dies (a finalizer): the private copies of small shared-memory payloads and streamed payloads;
* :class:`PinnedPool` (here): page-locked host memory, given back explicitly once no sender reads
  the weight version it staged;
* the shared-memory mover's slots (:mod:`.movers.shm`): /dev/shm segments, idle again when the
  receiver's release comes back (a message or an ack);
* :class:`~.shared_buffers.SharedBufferPool`: /dev/shm segments shared with every same-host
  consumer, idle again once each consumer stored the buffer's use in its release cell.

(``core/allocator.py`` is not a pool: it tells glibc to keep freed blocks, so buffers outside
these pools are not page-faulted anew every step.)

CopyPool: a fresh buffer page-faults on every first write, and the kernel zeroes each
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
from typing import Callable, Iterable, TypeVar

import numpy as np
import torch

T = TypeVar("T")


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


def smallest_fitting(items: Iterable[T], nbytes: int, size: Callable[[T], int], idle: Callable[[T], bool],
                     at_most: int | None = None) -> T | None:
    """The reuse rule of every pool: the smallest idle item of at least ``nbytes`` (and at most
    ``at_most``, when a payload should not pin a much larger buffer), or None."""
    best, best_size = None, 0
    for it in items:
        n = size(it)
        if n < nbytes or (at_most is not None and n > at_most) or (best is not None and n >= best_size):
            continue
        if idle(it):
            best, best_size = it, n
    return best


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
            k = smallest_fitting(self._free, size, int, lambda k: bool(self._free[k]), at_most=2 * size)
            base = self._free[k].pop() if k is not None else None
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


class PinnedPool:
    """Reusable host buffers for staging CUDA buckets (page-locked when CUDA is present).

    ``stage(bucket)`` copies a bucket into a free buffer of sufficient size (or a new one) and
    returns (views, buffer); ``give_back(buffer)`` makes it reusable. A version's buffers are
    given back when no sender reads the version any more, so steady state allocates nothing.
    """

    def __init__(self, max_free: int = 64):
        self._free: list[torch.Tensor] = []
        self._max_free = max_free
        self._lock = threading.Lock()  # stage() runs in worker threads, give_back() on the loop

    def stage(self, bucket: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        need = sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in bucket.values())
        with self._lock:
            # by index: list.remove compares tensors with ==, elementwise (it raises on the first
            # buffer of another size it meets)
            i = smallest_fitting(range(len(self._free)), need, lambda i: self._free[i].numel(), lambda i: True)
            buf = self._free.pop(i) if i is not None else None
        if buf is None:
            buf = torch.empty(max(need, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        out, off = {}, 0
        for name, t in bucket.items():
            n = t.numel() * t.element_size()
            view = buf[off:off + n].view(t.dtype).view(t.shape)
            view.copy_(t, non_blocking=True)
            out[name] = view
            off += (n + 63) // 64 * 64
        for dev in {t.device for t in bucket.values() if t.is_cuda}:  # the copies ran on each tensor's device
            torch.cuda.current_stream(dev).synchronize()
        return out, buf

    def give_back(self, buf: torch.Tensor) -> None:
        with self._lock:
            if len(self._free) < self._max_free:
                self._free.append(buf)
