"""Streamed payloads on the zmq channel: chunk by chunk, each chunk MACed, straight into its tensor.

Real ZeroMQ sockets on 127.0.0.1. Messages are captured on a trap socket and replayed (whole,
tampered, reordered, cut short, or from a second connection) to a real channel, which must
deliver exactly the authentic payload and NACK or drop everything else, naming the problem.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from distflow.core.auth import Authenticator
from distflow.transport import Endpoint, RemoteError, make_transport
from distflow.transport.loop_socket import LoopSocket
from distflow.core.auth import ChunkMac, MacError
from distflow.transport.link import MAGIC_CHUNK, MAGIC_MSG

SECRET = "stream-test-secret-0123456789abcdef"
CHUNK = 4096
STREAM = {"stream_min_bytes": 16 << 10, "stream_chunk": CHUNK}


def run(coro, timeout: float = 30.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def payload() -> dict[str, torch.Tensor]:
    """Big and small tensors, a size that is not a multiple of the chunk, an empty one, bf16."""
    g = torch.Generator().manual_seed(3)
    return {
        "tokens": torch.randint(0, 50_000, (3 * CHUNK // 8 + 5,), generator=g),  # 3+ chunks, ragged end
        "logprobs": -torch.rand(2, 2500, generator=g).t(),  # non-contiguous
        "lens": torch.tensor([7, 9], dtype=torch.int64),  # packed with the other small ones
        "empty": torch.empty(0, 4),
        "bf16": torch.randn(CHUNK, generator=g).to(torch.bfloat16),
    }


async def receiver(**kw):
    b = make_transport("zmq", "b", SECRET, **{**STREAM, **kw})
    got: list[dict[str, torch.Tensor]] = []

    async def handler(env):
        got.append(env.tensors)

    b.set_handler(handler)
    await b.start()
    return b, got


async def capture(tensors: dict[str, torch.Tensor]) -> list[list[bytes]]:
    """Every message (header, then chunks) a real sender puts on the wire for one streamed send."""
    a = make_transport("zmq", "a", SECRET, **STREAM)
    await a.start()
    ctx = zmq.asyncio.Context()
    trap = ctx.socket(zmq.ROUTER)
    trap.setsockopt(zmq.LINGER, 0)
    port = trap.bind_to_random_port("tcp://127.0.0.1")
    send = asyncio.create_task(a.send(Endpoint("b", "127.0.0.1", port), "k", {"m": 1}, tensors, timeout=5),
                               name="captured-stream-send")
    msgs = [(await asyncio.wait_for(trap.recv_multipart(), 5))[1:]]
    assert msgs[0][0] == MAGIC_MSG
    header = msgpack.unpackb(msgs[0][1])
    assert header["pay"] == "chunks"
    n_chunks = sum(-(-n // header["cs"]) for n in header["fs"])
    for _ in range(n_chunks):
        msgs.append((await asyncio.wait_for(trap.recv_multipart(), 5))[1:])
        assert msgs[-1][0] == MAGIC_CHUNK
    send.cancel()
    await asyncio.gather(send, return_exceptions=True)
    trap.close()
    ctx.term()
    await a.close()
    return msgs


async def replay(port: int, msgs: list[list[bytes]], want_ack: bool = True) -> dict | None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    for m in msgs:
        await sock.send_multipart(m)
    ack = None
    if want_ack:
        ack = msgpack.unpackb((await asyncio.wait_for(sock.recv_multipart(), 5))[1])
    else:
        await asyncio.sleep(0.2)  # delivered before the socket goes (LINGER 0 would drop it)
    sock.close()
    ctx.term()
    return ack


@pytest.mark.parametrize("mac_alg", ["aes-gmac", "hmac-sha256"])
def test_streamed_payload_arrives_byte_exact(mac_alg):
    async def main():
        b, got = await receiver()
        a = make_transport("zmq", "a", SECRET, mac_alg=mac_alg, **STREAM)
        await a.start()
        want = payload()
        await a.send(Endpoint("b", "127.0.0.1", b.port), "k", {}, want, timeout=10)
        small = {"x": torch.arange(10)}  # under stream_min_bytes: one inline message
        await a.send(Endpoint("b", "127.0.0.1", b.port), "k", {}, small, timeout=10)
        assert [list(g) for g in got] == [list(want), ["x"]]
        for k, w in want.items():
            assert got[0][k].dtype == w.dtype and tuple(got[0][k].shape) == tuple(w.shape), k
            assert raw(got[0][k]) == raw(w), k
        assert torch.equal(got[1]["x"], small["x"])
        assert a.stats()["streams_sent"] == 1 and a.stats()["sent_msgs"] == 2
        st = b.stats()
        assert (st["streams_received"], st["recv_msgs"], st["streams_open"], st["dropped_total"]) == (1, 2, 0, 0)
        await a.close()
        await b.close()

    run(main())


def test_captured_stream_replays_once_then_is_a_replay():
    async def main():
        msgs = await capture(payload())
        assert len(msgs) >= 6  # header + several chunks
        b, got = await receiver()
        assert (await replay(b.port, msgs))["ok"] is True
        assert await replay(b.port, msgs[:1], want_ack=False) is None  # the header again
        await asyncio.sleep(0.2)
        assert len(got) == 1 and raw(got[0]["tokens"]) == raw(payload()["tokens"])
        assert b.stats()["dropped"] == {"replay": 1}
        await b.close()

    run(main())


@pytest.mark.parametrize("how, code", [
    ("flip a data byte", "bad_payload_mac"),
    ("swap two chunks", "bad_payload"),
    ("cut a chunk short", "bad_payload"),
    ("tag of another chunk", "bad_payload_mac"),
])
def test_tampered_stream_is_nacked_naming_the_problem(how, code):
    async def main():
        msgs = await capture(payload())
        if how == "flip a data byte":
            data = bytearray(msgs[2][3])
            data[17] ^= 0x01
            msgs[2] = [*msgs[2][:3], bytes(data)]
        elif how == "swap two chunks":
            msgs[1], msgs[2] = msgs[2], msgs[1]
        elif how == "cut a chunk short":
            msgs[1] = [*msgs[1][:3], msgs[1][3][:-8]]
        else:
            msgs[2] = [msgs[2][0], msgs[2][1], msgs[3][2], msgs[2][3]]
        b, got = await receiver()
        ack = await replay(b.port, msgs)
        assert ack["ok"] is False and ack["code"] == code, ack
        await asyncio.sleep(0.2)
        assert got == []
        st = b.stats()
        assert st["dropped"][code] == 1 and st["streams_open"] == 0
        # the chunks after the failed one belong to no stream any more: drained and counted
        assert st["dropped"].get("orphan_chunk", 0) >= 1
        await b.close()

    run(main())


def test_chunks_from_another_connection_cannot_join_a_stream():
    """Chunks are bound to the connection the signed header came on: a second connection's copy
    of chunk 0 is an orphan, and the real stream still completes."""

    async def main():
        msgs = await capture(payload())
        b, got = await receiver()
        assert await replay(b.port, [msgs[1]], want_ack=False) is None  # before the header: orphan
        ctx = zmq.asyncio.Context()
        real = ctx.socket(zmq.DEALER)
        real.setsockopt(zmq.LINGER, 0)
        real.connect(f"tcp://127.0.0.1:{b.port}")
        await real.send_multipart(msgs[0])
        await real.send_multipart(msgs[1])
        await asyncio.sleep(0.1)
        assert b.stats()["streams_open"] == 1
        assert await replay(b.port, [msgs[2]], want_ack=False) is None  # another connection: orphan
        for m in msgs[2:]:
            await real.send_multipart(m)
        ack = msgpack.unpackb((await asyncio.wait_for(real.recv_multipart(), 5))[1])
        assert ack["ok"] is True
        assert len(got) == 1 and raw(got[0]["bf16"]) == raw(payload()["bf16"])
        assert b.stats()["dropped"] == {"orphan_chunk": 2}
        real.close()
        ctx.term()
        await b.close()

    run(main())


def test_a_stream_cut_off_midway_times_out_and_frees_its_buffers():
    async def main():
        msgs = await capture(payload())
        b, got = await receiver(stream_timeout=0.3)
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{b.port}")
        for m in msgs[:3]:  # the sender "dies" after two chunks
            await sock.send_multipart(m)
        await asyncio.sleep(0.1)
        assert b.stats()["streams_open"] == 1
        ack = msgpack.unpackb((await asyncio.wait_for(sock.recv_multipart(), 5))[1])
        assert ack["ok"] is False and ack["code"] == "stream_timeout"
        assert "2 of" in ack["err"]
        assert b.stats()["streams_open"] == 0 and got == []
        sock.close()
        ctx.term()
        # the channel keeps serving
        a = make_transport("zmq", "a2", SECRET, **STREAM)
        await a.start()
        await a.send(Endpoint("b", "127.0.0.1", b.port), "k", {}, payload(), timeout=10)
        assert len(got) == 1
        await a.close()
        await b.close()

    run(main())


def test_oversized_streams_are_refused_by_sender_and_receiver():
    async def main():
        b, got = await receiver(max_message_bytes=1 << 20)
        small = make_transport("zmq", "a3", SECRET, max_message_bytes=1 << 20, **STREAM)
        await small.start()
        big = {"x": torch.zeros(2 << 20, dtype=torch.uint8)}
        with pytest.raises(ValueError, match="payload of 2097152 bytes is over the 1048576-byte message limit"):
            await small.send(Endpoint("b", "127.0.0.1", b.port), "k", {}, big, timeout=10)
        # a sender with a bigger limit than the receiver: the receiver refuses the header, by name
        a = make_transport("zmq", "a", SECRET, **STREAM)
        await a.start()
        with pytest.raises(RemoteError, match=r"\(oversized\): payload of 2097152 bytes is over the 1048576-byte limit"):
            await a.send(Endpoint("b", "127.0.0.1", b.port), "k", {}, big, timeout=10)
        assert got == [] and b.stats()["dropped"]["oversized"] == 1  # (+ the chunks sent before the NACK)
        assert b.stats()["streams_open"] == 0
        await a.close()
        await small.close()
        await b.close()

    run(main())


@pytest.mark.parametrize("fields, problem", [
    ({"fs": [8192, -1]}, "stream frame sizes 'fs' must be a list of non-negative ints"),
    ({"fs": "8192"}, "stream frame sizes 'fs' must be a list of non-negative ints"),
    ({"cs": 100}, "stream chunk size 100 is not between 4096 and 2**30"),
    ({"pm": {"alg": "aes-gmac"}}, "streamed payload without a payload MAC"),
    ({"pm": {"alg": "md5", "nonce": b"n" * 16}}, "unknown payload MAC algorithm 'md5'"),
])
def test_signed_stream_headers_with_bad_fields_are_nacked_by_name(fields, problem):
    """A header that authenticates but whose stream fields are wrong (a sender bug) is refused."""

    async def main():
        b, got = await receiver()
        header = {"t": "msg", "v": 1, "from": "z", "to": "b", "sess": b"s" * 16, "st": 1, "seq": 1, "kind": "k",
                  "meta": {}, "pay": "chunks", "tens": [], "fs": [8192], "cs": 4096,
                  "pm": {"alg": "aes-gmac", "nonce": b"n" * 16}, **fields}
        hbytes = msgpack.packb(header, use_bin_type=True)
        ack = await replay(b.port, [[MAGIC_MSG, hbytes, Authenticator(SECRET).tag([hbytes], b"data")]])
        assert ack["ok"] is False and ack["err"] == problem
        assert got == [] and b.stats()["streams_open"] == 0 and b.stats()["dropped_total"] == 1
        await b.close()

    run(main())


def test_chunk_mac_binds_index_and_data():
    for alg in ("aes-gmac", "hmac-sha256"):
        m = ChunkMac(alg, b"k" * 32)
        data = bytes(range(256)) * 16
        t0 = m.tag(0, data)
        assert m.verify(0, data, t0)
        assert not m.verify(1, data, t0)  # another index
        assert not m.verify(0, data[:-1] + b"\0", t0)  # another byte
        assert not ChunkMac(alg, b"j" * 32).verify(0, data, t0)  # another message's key
    with pytest.raises(MacError, match="unknown payload MAC algorithm 'md5'") as e:
        ChunkMac("md5", b"k" * 32)
    assert e.value.code == "unsupported_mac"  # the NACK code a receiver refuses such a stream with


def test_loop_socket_receives_a_frame_into_a_buffer():
    async def main():
        ctx = zmq.Context()
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        for s in (a, b):
            s.setsockopt(zmq.LINGER, 0)
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")
        la, lb = LoopSocket(a), LoopSocket(b)
        buf = bytearray(8)
        await lb.send([b"head", b"12345678", b"tail"])
        frames = await la.recv(copy=False, into=lambda fs: memoryview(buf) if len(fs) == 1 else None, copy_head=1)
        assert frames[0] == b"head" and frames[1] == 8 and bytes(frames[2].buffer) == b"tail"
        assert bytes(buf) == b"12345678"
        await lb.send([b"head", b"0123456789"])  # longer than the buffer: cut off, and the size says so
        frames = await la.recv(into=lambda fs: memoryview(buf))
        assert frames == [b"head", 10] and bytes(buf) == b"01234567"
        la.close()
        lb.close()
        ctx.term()

    run(main())


def test_stream_buffers_are_reused_warm_once_the_handler_lets_go():
    """A streamed payload is received into a pooled buffer: once the handler's tensors of one
    message are gone, the next stream of that size class lands in the same memory (no page
    faults, no zeroing), while a message the handler keeps is never overwritten."""
    async def main():
        b = make_transport("zmq", "b", SECRET, **STREAM)
        seen: list[tuple[int, bool]] = []
        kept: list[torch.Tensor] = []

        async def handler(env):
            x = env.tensors["x"]
            seen.append((x.data_ptr(), bool(torch.equal(x, torch.full_like(x, len(seen))))))
            if env.meta.get("keep"):
                kept.append(x)

        b.set_handler(handler)
        await b.start()
        a = make_transport("zmq", "a", SECRET, **STREAM)
        await a.start()
        peer = Endpoint("b", "127.0.0.1", b.port)
        for i, keep in enumerate((False, False, True, False)):
            x = torch.full((40_000,), i, dtype=torch.int64)  # 320,000 bytes: streamed, the 320 KiB class
            await a.send(peer, "k", {"keep": keep}, {"x": x}, timeout=10)
        assert all(ok for _, ok in seen), seen
        ptrs = [p for p, _ in seen]
        assert ptrs[1] == ptrs[0] and ptrs[2] == ptrs[0]  # reused once the previous message was let go
        assert ptrs[3] != ptrs[2]  # the kept one is not reused ...
        assert torch.equal(kept[0], torch.full((40_000,), 2))  # ... nor overwritten
        assert b.stats()["streams_received"] == 4
        await a.close()
        await b.close()

    run(main())


def test_copy_pool_bounds_its_idle_memory():
    import gc

    import numpy as np

    from distflow.transport.pool import CopyPool

    pool = CopyPool(max_idle_bytes=3 << 20)
    bufs = [pool.empty(1 << 20) for _ in range(5)]  # 1 MiB class each
    bases = [b.base.obj for b in bufs]  # the pooled buffers (each array views one through a memoryview)
    del bufs
    gc.collect()
    assert pool.idle_bytes == 3 << 20  # three kept warm, two handed back to the allocator
    again = [pool.empty(700_000) for _ in range(4)]
    assert sum(any(a.base.obj is b for b in bases) for a in again) == 3 and pool.idle_bytes == 0
    src = np.arange(1000, dtype=np.uint8)
    assert bytes(pool.copy(src)) == bytes(src)


def test_copy_pool_returns_take_no_lock_and_views_of_views_keep_their_buffer():
    """A buffer's return runs in a finalizer, which may fire inside the garbage collector in the
    middle of the pool's own locked code: it must not take the pool's lock (a self-deadlock).
    And a view of a pooled array (a slice of a slice) keeps its buffer out of the pool."""
    import gc
    import threading

    import numpy as np

    from distflow.transport.pool import CopyPool

    pool = CopyPool()
    box = [pool.empty(5000)]

    def drop_while_locked() -> None:
        with pool._lock:  # as if the collector ran the finalizer inside empty()
            box.clear()

    t = threading.Thread(target=drop_while_locked, name="copy-pool-finalizer-under-lock", daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "returning a buffer while the pool's lock is held deadlocked"
    assert pool.idle_bytes == 8192  # filed by the next call that takes the lock
    a = pool.empty(5000)
    assert pool.idle_bytes == 0
    view = a[100:200].view(np.int32)  # a view of a view of the pooled array
    view[:] = 7
    del a
    gc.collect()
    b = pool.empty(5000)  # the buffer is still viewed: a fresh one
    b[:] = 0
    assert not np.shares_memory(view, b) and (view == 7).all()
    pool.clear()
    del view
    gc.collect()
    assert pool.idle_bytes == 8192  # returned after the clear: kept again, within the caps
    pool.clear()
    assert pool.idle_bytes == 0
