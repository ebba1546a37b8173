"""Buffers a producer shares with the same-host consumers it posts to, and their release cells.

Why: a posted part (:mod:`.ring`, :mod:`.movers.posting`) is a record pointing into memory both
processes map. A producer packs a step's batch once into one such buffer (every consumer's part)
and posts each consumer a record naming its span. Each consumer maps the producer's buffers when
the producer introduces them (a signed channel message, acked after the mapping), before any
record names them; so a part posted and then orphaned by the producer's death stays readable:
the memory lives while any process maps it.

A buffer is a 0600 segment: ``HEADER`` bytes of release cells (one u64 per consumer, at the cell
index the producer gave it), then the data. A buffer's ``use`` counts its acquisitions; a consumer
done with its part of use u (every view freed, or the part dropped) stores u in its cell: a plain
store, no message, no wake-up. The producer reuses the buffer once every consumer it posted that
use to has stored it (or is dead). Names stay linked while the producer lives (a consumer that
comes later maps the same buffers) and go at exit like every segment of :mod:`.arena`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from distflow.transport.pool import size_class, smallest_fitting
from distflow.transport.arena import _map_segment, _unlink, release_name, reserve_name

HEADER = 4096  # release cells, then the data (64-byte aligned)
CELLS_OFF = 64
MAX_CELLS = (HEADER - CELLS_OFF) // 8
MIN_BUFFER = 1 << 20
_U64 = struct.Struct("<Q")


@dataclass(eq=False)
class SharedBuffer:
    """One producer buffer: ``data`` (uint8 numpy view of the data region) and its use bookkeeping."""

    name: str
    mm: mmap.mmap
    capacity: int
    data: np.ndarray
    use: int = 0
    expect: dict[Any, tuple[int, int]] = field(default_factory=dict)  # poster -> (its cell, the use to release)
    busy: bool = False  # acquired and not yet finished (a scatter is writing and posting it)
    blob_pos: int = 0  # where the next post's meta goes (after the data)

    def __post_init__(self) -> None:
        self.name_bytes = self.name.encode()

    def released(self, cell: int, use: int) -> bool:
        return _U64.unpack_from(self.mm, CELLS_OFF + 8 * cell)[0] == use

    def close(self) -> None:
        _unlink(self.name)
        self.data = np.empty(0, dtype=np.uint8)
        try:
            self.mm.close()
        except BufferError:  # a tensor still views it: the mapping goes with the last one
            pass


class SharedBufferPool:
    """A producer's buffers (all of them mapped by every consumer it posts to)."""

    def __init__(self, max_buffers: int = 16):
        self.buffers: list[SharedBuffer] = []
        self.max_buffers = max_buffers

    def acquire(self, nbytes: int, gone: Callable[[Any], bool]) -> SharedBuffer | None:
        """The smallest free buffer of at least ``nbytes`` (its use advanced, busy), else None. A buffer
        is free once each poster it was posted to released that use, or is ``gone(poster)``."""
        best = smallest_fitting(self.buffers, nbytes, lambda b: b.capacity, lambda b: _free(b, gone))
        if best is not None:
            best.use += 1
            best.expect = {}
            best.busy = True
        return best

    def full(self) -> bool:
        return len(self.buffers) >= self.max_buffers

    def create(self, nbytes: int, gone: Callable[[Any], bool]) -> SharedBuffer | None:
        """A new busy buffer for at least ``nbytes`` (OSError when /dev/shm has no room). A full pool
        first retires its smallest buffer that is free and too small; None if it has none."""
        if self.full():
            idle = [b for b in self.buffers if b.capacity < nbytes and _free(b, gone)]
            if not idle:
                return None
            self.retire(min(idle, key=lambda b: b.capacity))
        capacity = size_class(max(nbytes, MIN_BUFFER), MIN_BUFFER)
        name, path = reserve_name()
        try:
            mm = _map_segment(path, HEADER + capacity, create=True)
        except BaseException:
            release_name(name)
            raise
        buf = SharedBuffer(name, mm, capacity, np.frombuffer(mm, dtype=np.uint8, count=capacity, offset=HEADER),
                           use=1, busy=True)
        self.buffers.append(buf)
        return buf

    def retire(self, buf: SharedBuffer) -> None:
        if buf in self.buffers:
            self.buffers.remove(buf)
        buf.close()

    def names(self) -> list[str]:
        return [b.name for b in self.buffers]

    def close(self) -> None:
        for b in self.buffers:
            b.close()
        self.buffers.clear()


def _free(b: SharedBuffer, gone: Callable[[Any], bool]) -> bool:
    return not b.busy and all(b.released(c, u) or gone(p) for p, (c, u) in b.expect.items())


def release_cell(mm: mmap.mmap, cell: int, use: int) -> None:
    try:
        _U64.pack_into(mm, CELLS_OFF + 8 * cell, use)
    except (ValueError, TypeError):  # the mapping was closed meanwhile (channel closed)
        pass
