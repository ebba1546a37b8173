"""Receiving streamed payloads: chunk messages land straight in their tensors, MAC-checked one by one.

Why it exists: a payload MAC checked only once the whole message is in puts a full pass over
the bytes on the critical path. For payloads of ``stream_min_bytes`` and more the sender
(:class:`~distflow.transport.link.Link`) sends a signed header with the frame and chunk sizes,
then one ``[MAGIC_CHUNK, (seq, index), tag, data]`` message per chunk. :class:`Streams`, a part
of the link's receiving side, keeps the state of those streams: buffers taken when the header
arrives (from a pool: a buffer whose tensors are gone is reused warm), each chunk received
into place by :meth:`_chunk_sink` and checked by :meth:`_accept_chunk` while the next one is
on the wire, the handler started by the last one.
A stream is bound to the connection its header came on; anything wrong NACKs the message by
name, and a stream that stops arriving is dropped after ``stream_timeout``.
"""

from __future__ import annotations

import asyncio
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from distflow.core.auth import ChunkMac, MacError
from distflow.transport.api import PayloadError
from distflow.transport.pool import CopyPool

MAGIC_CHUNK = b"DFC1"


@dataclass
class _StreamIn:
    """A streamed payload being received: its buffers, the chunk plan and the next chunk due."""

    ident: bytes
    header: dict[str, Any]
    bufs: list[np.ndarray]
    plan: list[tuple[int, int, int]]  # chunk index -> (frame, offset, length)
    mac: ChunkMac
    timer: asyncio.TimerHandle
    next: int = 0


class Streams:
    """The receive side of streamed payloads (see module docstring). What it needs of the link is
    given, not assumed: counters, the drop counter, a NACK, the handler start and the payload key."""

    def __init__(self, *, max_frames: int, max_message_bytes: int, timeout: float, counters: Counter[str],
                 drop: Callable[[str, str], None], nack: Callable[[bytes, dict[str, Any], str, str], None],
                 start_handler: Callable[[bytes, dict[str, Any], list[Any]], bool],
                 payload_key: Callable[[bytes, bytes], bytes]) -> None:
        self.open: dict[tuple[bytes, int], _StreamIn] = {}
        self.pool = CopyPool()  # warm receive buffers (weight buckets), reused once the handler's tensors are gone
        self._max_frames, self._max_message_bytes, self._stream_timeout = max_frames, max_message_bytes, timeout
        self._counters, self._drop, self._spawn_nack = counters, drop, nack
        self._start_handler, self._payload_key = start_handler, payload_key

    def close(self) -> None:
        for st in self.open.values():
            st.timer.cancel()
        self.open.clear()
        self.pool.clear()  # buffers still viewed by tensors go back to the allocator when those die

    def open_stream(self, ident: bytes, header: dict[str, Any], payload: list[Any]) -> bool:
        """An authentic header of a streamed payload: allocate its buffers; chunks follow."""
        fs, cs, pm = header.get("fs"), header.get("cs"), header.get("pm")
        problem = ""
        if payload:
            problem = "streamed payload header with inline frames"
        elif not isinstance(fs, list) or len(fs) > self._max_frames or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in fs):
            problem = "stream frame sizes 'fs' must be a list of non-negative ints"
        elif not isinstance(cs, int) or not 4096 <= cs <= 1 << 30:
            problem = f"stream chunk size {cs!r} is not between 4096 and 2**30"
        elif not isinstance(pm, dict) or not isinstance(pm.get("nonce"), bytes):
            problem = "streamed payload without a payload MAC"
        if problem:
            return self._refuse(ident, header, "bad_header", problem)
        if sum(fs) > self._max_message_bytes:
            return self._refuse(ident, header, "oversized",
                                f"payload of {sum(fs)} bytes is over the {self._max_message_bytes}-byte limit")
        try:
            mac = ChunkMac(str(pm.get("alg")), self._payload_key(header["sess"], pm["nonce"]))
            bufs = [self.pool.empty(n) for n in fs]
        except (PayloadError, MacError) as e:
            return self._refuse(ident, header, e.code, str(e))
        except MemoryError:
            return self._refuse(ident, header, "oversized", f"receiver cannot allocate {sum(fs)} bytes")
        plan = [(i, o, min(cs, n - o)) for i, n in enumerate(fs) for o in range(0, n, cs)]
        if not plan:
            return self._start_handler(ident, header, bufs)
        key = (ident, header["seq"])
        timer = asyncio.get_running_loop().call_later(self._stream_timeout, self._expire_stream, key)
        self.open[key] = _StreamIn(ident, header, bufs, plan, mac, timer)
        return False

    def chunk_sink(self, frames: list[Any]) -> memoryview | None:
        """Where the data frame of a chunk message goes: straight into its stream's buffer."""
        if len(frames) != 4 or frames[1] != MAGIC_CHUNK or len(frames[2]) != 16:
            return None
        seq, k = struct.unpack("<QQ", frames[2])
        st = self.open.get((frames[0], seq))
        if st is None or k != st.next:
            return None
        fi, off, n = st.plan[k]
        return memoryview(st.bufs[fi])[off:off + n]

    def accept_chunk(self, frames: list[Any]) -> bool:
        """One chunk of a streamed payload (already in its buffer when the sink placed it): check
        order, length and MAC; the last one starts the handler."""
        if len(frames[2]) != 16:
            self._drop("bad_frames", "chunk id")
            return False
        (seq, k), data = struct.unpack("<QQ", frames[2]), frames[4]
        st = self.open.get((frames[0], seq))
        if st is None:
            self._drop("orphan_chunk", f"chunk {k} of an unknown or failed stream #{seq}")
            return False
        if not isinstance(data, int):  # the sink places only the chunk due next
            return self._fail_stream(st, "bad_payload", f"chunk {k} out of order (expected {st.next})")
        fi, off, n = st.plan[k]
        view = memoryview(st.bufs[fi])[off:off + n]
        if data != view.nbytes:
            return self._fail_stream(st, "bad_payload", f"chunk {k} has {data} bytes, the header says {view.nbytes}")
        if not st.mac.verify(k, view, frames[3]):
            return self._fail_stream(st, "bad_payload_mac", f"payload chunk {k} does not match its MAC (tampered?)")
        st.next += 1
        if st.next < len(st.plan):
            return False
        st.timer.cancel()
        del self.open[(st.ident, st.header["seq"])]
        self._counters["streams_received"] += 1
        return self._start_handler(st.ident, st.header, st.bufs)

    def _fail_stream(self, st: _StreamIn, code: str, msg: str) -> bool:
        st.timer.cancel()
        self.open.pop((st.ident, st.header["seq"]), None)
        return self._refuse(st.ident, st.header, code, msg)

    def _refuse(self, ident: bytes, header: dict[str, Any], code: str, msg: str) -> bool:
        """Drop a streamed message, counted under ``code``, and NACK it to its sender; False."""
        self._drop(code, f"from {header['from']}: {msg}")
        self._spawn_nack(ident, header, code, msg)
        return False

    def _expire_stream(self, key: tuple[bytes, int]) -> None:
        st = self.open.get(key)
        if st is not None:
            self._fail_stream(st, "stream_timeout", f"stream incomplete after {self._stream_timeout:g}s "
                                                    f"({st.next} of {len(st.plan)} chunks)")
