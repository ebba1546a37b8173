"""Tensor channels: byte-exact transport of every dtype, authentication, drops, shm hygiene.

Real ZeroMQ sockets on 127.0.0.1, real child processes where a second process matters
(cross-process round trips, segment cleanup after exit / SIGTERM / SIGKILL).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from distflow.core.auth import Authenticator
from distflow.transport import (
    ChannelClosed,
    Endpoint,
    Envelope,
    HandlerMux,
    RemoteError,
    Transport,
    make_transport,
)
from distflow.transport import codec
from distflow.transport.arena import SHM_DIR, sweep_stale_segments
from distflow.transport.api import PayloadError
from distflow.transport.link import MAGIC_MSG

SECRET = "channel-test-secret-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[1]
KINDS = ["zmq", "shm"]


def run(coro, timeout: float = 30.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def chan(kind: str, node_id: str, secret: str = SECRET, **kw) -> Transport:
    if kind == "shm":
        kw.setdefault("shm_min_bytes", 0)  # force the shared-memory path even for tiny tensors
    return make_transport(kind, node_id, secret, **kw)


def ep(ch: Transport) -> Endpoint:
    return Endpoint(ch.node_id, "127.0.0.1", ch.port)


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype, k
        assert tuple(g.shape) == tuple(w.shape), k
        assert raw_bytes(g) == raw_bytes(w), k


def every_dtype() -> dict[str, torch.Tensor]:
    """Every wire dtype: 2-D, non-contiguous, empty and 0-d; floats include NaN/inf bit patterns."""
    g = torch.Generator().manual_seed(7)
    out: dict[str, torch.Tensor] = {}
    for name, dt in codec.DTYPES.items():
        if dt == torch.bool:
            base = torch.rand(6, 5, generator=g) > 0.5
        elif dt.is_floating_point:
            bits = torch.randint(0, 256, (6 * 5 * dt.itemsize,), dtype=torch.uint8, generator=g)
            base = bits.view(dt).reshape(6, 5)  # arbitrary bit patterns, NaN payloads included
        else:
            base = torch.randint(0 if dt == torch.uint8 else -100, 100, (6, 5), generator=g).to(dt)
        out[name] = base
        out[f"{name}_noncontig"] = base.t()[1:, ::2]
        out[f"{name}_empty"] = torch.empty(0, 3, dtype=dt)
        out[f"{name}_scalar"] = base[2, 3].clone()
    out["big"] = torch.arange(300_000, dtype=torch.int64)  # > the thread-offload threshold
    return out


async def pair(kind: str, **kw):
    a, b = chan(kind, "a", **kw), chan(kind, "b", **kw)
    await a.start()
    await b.start()
    return a, b


def own_segments(pid: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"distflow-shm.{pid}.")]


# ---------------------------------------------------------------------------------------- codec
def test_codec_round_trips_every_dtype_byte_exact():
    tensors = every_dtype()
    headers, frames = codec.encode(tensors)
    assert [h["name"] for h in headers] == list(tensors)
    assert headers[0] == {"name": "float32", "dtype": "float32", "shape": [6, 5], "nbytes": 120}
    copies = [bytearray(f) for f in frames]  # as if received: fresh writable buffers
    assert_same(codec.decode(msgpack.unpackb(msgpack.packb(headers)), copies), tensors)


def test_codec_packs_small_tensors_into_one_frame():
    tensors = {"big": torch.arange(5000, dtype=torch.int64), "lens": torch.tensor([3, 4]),
               "bf": torch.ones(3, dtype=torch.bfloat16), "empty": torch.zeros(0), "flag": torch.tensor(True)}
    headers, frames = codec.encode(tensors, pack_below=1024)
    assert len(frames) == 2 and memoryview(frames[0]).nbytes == 40000  # big alone, zero-copy
    assert [(h["name"], h["f"], h.get("o")) for h in headers] == [
        ("big", 0, None), ("lens", 1, 0), ("bf", 1, 16), ("empty", 1, 32), ("flag", 1, 32)]
    assert_same(codec.decode(headers, [bytearray(f) for f in frames]), tensors)
    bad = [dict(h) for h in headers]
    bad[1]["f"] = 7
    with pytest.raises(codec.CodecError, match="'lens': frame index 7 out of range"):
        codec.decode(bad, [bytearray(f) for f in frames])
    with pytest.raises(codec.CodecError, match="1 payload frame\\(s\\) not referenced"):
        codec.decode(headers[:1], [bytearray(f) for f in frames])
    bad = [dict(h) for h in headers]
    bad[2]["o"] = 1000
    with pytest.raises(codec.CodecError, match="'bf': frame has 33 bytes, header says 6 at offset 1000"):
        codec.decode(bad, [bytearray(f) for f in frames])


@pytest.mark.parametrize(
    "headers, frames, problem",
    [
        ([{"name": "x", "dtype": "complex64", "shape": [1], "nbytes": 8}], [b"\0" * 8], "unknown dtype"),
        ([{"name": "x", "dtype": "float32", "shape": [2], "nbytes": 4}], [b"\0" * 4], "does not match"),
        ([{"name": "x", "dtype": "int8", "shape": [-1], "nbytes": 1}], [b"\0"], "non-negative"),
        ([{"name": "x", "dtype": "int8", "shape": [2], "nbytes": 2}], [b"\0"], "frame has 1 bytes"),
        ([{"name": "x", "dtype": "int8", "shape": [1], "nbytes": 1}] * 2, [b"\0", b"\0"], "appears twice"),
        ([{"name": "x", "dtype": "int8", "shape": [1], "nbytes": 1}], [], "payload frames"),
        ({"name": "x"}, [], "must be a list"),
    ],
)
def test_codec_rejects_bad_headers_with_a_clear_error(headers, frames, problem):
    with pytest.raises(codec.CodecError, match=problem):
        codec.decode(headers, [bytearray(f) for f in frames])


def test_codec_rejects_unsupported_tensors_naming_them():
    with pytest.raises(codec.CodecError, match="'z'.*complex"):
        codec.encode({"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(codec.CodecError, match="'s'.*layout"):
        codec.encode({"s": torch.zeros(2, 2).to_sparse()})
    with pytest.raises(codec.CodecError, match="'n'.*torch.Tensor"):
        codec.encode({"n": [1, 2]})


# ---------------------------------------------------------------------------------------- transport
@pytest.mark.parametrize("kind", KINDS)
def test_every_dtype_round_trips_in_process(kind):
    async def main():
        a, b = await pair(kind)
        got: list[Envelope] = []

        async def handler(env: Envelope) -> None:
            got.append(env)

        b.set_handler(handler)
        want = every_dtype()
        await a.send(ep(b), "t", {"note": "hello", "n": [1, 2]}, want, timeout=10)
        assert len(got) == 1
        env = got[0]
        assert (env.sender, env.kind, env.meta) == ("a", "t", {"note": "hello", "n": [1, 2]})
        assert_same(env.tensors, want)
        sa, sb = a.stats(), b.stats()
        assert sa["sent_msgs"] == 1 and sb["recv_msgs"] == 1 and sb["dropped_total"] == 0
        nbytes = sum(t.numel() * t.element_size() for t in want.values())
        assert sa["sent_bytes"] == nbytes and sb["recv_bytes"] == nbytes
        if kind == "shm":
            assert sa["shm_sends"] == 1 and sb["shm_recvs"] == 1
        await a.close()
        await b.close()

    run(main())


ECHO_CHILD = textwrap.dedent("""
    import asyncio, sys
    from distflow.transport import make_transport, Endpoint
    kind, secret = sys.argv[1], sys.argv[2]

    async def main():
        ch = make_transport(kind, "echo", secret, **({"shm_min_bytes": 0} if kind == "shm" else {}))
        done = asyncio.Event()

        async def handler(env):
            if env.kind == "stop":
                done.set()
                return
            back = Endpoint(env.sender, "127.0.0.1", env.meta["reply_port"])
            await ch.send(back, "reply", {"n": env.meta["n"]}, dict(env.tensors), timeout=20)

        ch.set_handler(handler)
        await ch.start()
        print(ch.port, flush=True)
        await asyncio.wait_for(done.wait(), 60)
        print("STATS", ch.stats(), flush=True)
        await ch.close()

    asyncio.run(main())
""")


@pytest.mark.parametrize("kind", KINDS)
def test_every_dtype_round_trips_through_another_process(kind):
    proc = subprocess.Popen([sys.executable, "-c", ECHO_CHILD, kind, SECRET], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        port = int(proc.stdout.readline())

        async def main():
            me = chan(kind, "me")
            replies: dict[int, dict[str, torch.Tensor]] = {}

            async def handler(env: Envelope) -> None:
                replies[env.meta["n"]] = dict(env.tensors)

            me.set_handler(handler)
            await me.start()
            peer = Endpoint("echo", "127.0.0.1", port)
            want = every_dtype()
            for n in range(3):  # repeated sends reuse shm slots in both directions
                await me.send(peer, "echo", {"reply_port": me.port, "n": n}, want, timeout=20)
            await me.send(peer, "stop", {}, {}, timeout=10)
            assert sorted(replies) == [0, 1, 2]
            for n in range(3):
                assert_same(replies[n], want)
            if kind == "shm":
                assert me.stats()["shm_recvs"] == 3 and me.stats()["shm_sends"] == 3
            await me.close()

        run(main())
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "'dropped_total': 0" in out
    finally:
        proc.kill()
        proc.wait()
    assert own_segments(proc.pid) == []


@pytest.mark.parametrize("kind", KINDS)
def test_works_under_uvloop(kind):
    uvloop = pytest.importorskip("uvloop")

    async def main():
        a, b = await pair(kind)
        got = []

        async def handler(env):
            got.append(env.tensors["x"].sum().item())

        b.set_handler(handler)
        for i in range(5):
            await a.send(ep(b), "k", {}, {"x": torch.full((1000,), float(i))}, timeout=10)
        await a.close()
        await b.close()
        return got

    assert uvloop.run(main()) == [0.0, 1000.0, 2000.0, 3000.0, 4000.0]


# ---------------------------------------------------------------------------------------- semantics
@pytest.mark.parametrize("kind", KINDS)
def test_handler_error_is_a_remote_error_and_the_channel_keeps_working(kind):
    async def main():
        a, b = await pair(kind)
        mux = HandlerMux()
        seen = []

        async def ok(env):
            seen.append(env.meta["i"])

        async def bad(env):
            raise ValueError("step 3 is not wanted here")

        mux.register("ok", ok)
        mux.register("bad", bad)
        b.set_handler(mux)
        with pytest.raises(RemoteError, match="step 3 is not wanted here") as ei:
            await a.send(ep(b), "bad", {}, {"x": torch.ones(3)}, timeout=5)
        assert (ei.value.peer, ei.value.kind, ei.value.code) == ("b", "bad", "handler_error")
        with pytest.raises(RemoteError, match="no handler registered for kind 'nope'"):
            await a.send(ep(b), "nope", {}, {}, timeout=5)
        await a.send(ep(b), "ok", {"i": 1}, {"x": torch.ones(3)}, timeout=5)
        assert seen == [1]
        assert b.stats()["handler_errors"] == 2 and a.stats()["remote_errors"] == 2
        await a.close()
        await b.close()

    run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_ack_waits_for_the_handler(kind):
    """A handler that awaits holds back the sender: this is how backpressure reaches producers."""

    async def main():
        a, b = await pair(kind)
        gate = asyncio.Event()

        async def handler(env):
            await gate.wait()

        b.set_handler(handler)
        send = asyncio.create_task(a.send(ep(b), "k", {}, {"x": torch.ones(10)}, timeout=10), name="send")
        await asyncio.sleep(0.3)
        assert not send.done()
        assert b.stats()["handlers_running"] == 1
        gate.set()
        await asyncio.wait_for(send, 5)
        await a.close()
        await b.close()

    run(main())


def test_send_timeout_names_the_peer_and_kind():
    async def main():
        a = chan("zmq", "a")
        await a.start()
        dead = chan("zmq", "ghost")
        await dead.start()
        port = dead.port
        await dead.close()  # nobody listens there any more
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"'weights' to ghost \(127.0.0.1:{port}\).*0.5s"):
            await a.send(Endpoint("ghost", "127.0.0.1", port), "weights", {}, {"x": torch.ones(2)}, timeout=0.5)
        assert time.monotonic() - t0 < 2.0
        assert a.stats()["send_timeouts"] == 1
        await a.close()

    run(main())


def test_meta_that_msgpack_cannot_encode_is_a_clear_error():
    async def main():
        a, b = await pair("zmq")
        with pytest.raises(TypeError, match="meta of 'k' message is not msgpack-serializable"):
            await a.send(ep(b), "k", {"obj": object()}, {}, timeout=5)
        await a.close()
        await b.close()

    run(main())


def test_close_is_bounded_and_fails_pending_sends():
    async def main():
        a, b = await pair("zmq")
        never = asyncio.Event()

        async def stuck(env):
            await never.wait()

        b.set_handler(stuck)
        send = asyncio.create_task(a.send(ep(b), "k", {}, {}, timeout=30), name="send")
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        await a.close()
        await b.close()
        assert time.monotonic() - t0 < 3.0
        with pytest.raises(ChannelClosed):
            await send

    run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_inflight_limit_holds_messages_back_without_spinning(kind):
    """With every handler slot busy the receiver stops reading (TCP pushes back); it must idle, not
    spin on the socket, and deliver everything in order once the handler lets go."""

    async def main():
        a, b = await pair(kind, max_inflight=1)
        gate = asyncio.Event()
        got = []

        async def handler(env):
            await gate.wait()
            got.append(env.meta["i"])

        b.set_handler(handler)
        sends = [asyncio.create_task(a.send(ep(b), "k", {"i": i}, {"x": torch.ones(20_000)}, timeout=10),
                                     name=f"send-{i}") for i in range(4)]
        await asyncio.sleep(0.2)
        c0, t0 = time.process_time(), time.monotonic()
        await asyncio.sleep(0.5)
        busy = (time.process_time() - c0) / (time.monotonic() - t0)
        assert busy < 0.2, f"blocked receiver used {busy:.0%} of a core"
        assert got == [] and b.stats()["handlers_running"] == 1
        gate.set()
        await asyncio.wait_for(asyncio.gather(*sends), 10)
        assert got == [0, 1, 2, 3]
        await a.close()
        await b.close()

    run(main())


def test_loop_socket_send_waits_for_room_and_both_directions_wake():
    """LoopSocket on its own: a send blocked on a full pipe resumes once the peer drains it, and a
    pending receive is not lost when a send on the same socket consumes the FD's edge."""
    from distflow.transport.link import LoopSocket

    async def main():
        ctx = zmq.Context()
        raw_a, raw_b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        for s_ in (raw_a, raw_b):
            s_.setsockopt(zmq.SNDHWM, 1)
            s_.setsockopt(zmq.RCVHWM, 1)
            s_.setsockopt(zmq.LINGER, 0)
        raw_a.bind("inproc://loop-socket-test")
        raw_b.connect("inproc://loop-socket-test")
        a, b = LoopSocket(raw_a), LoopSocket(raw_b)
        sent = 0
        with pytest.raises(zmq.Again):
            for _ in range(100):
                a.send_now([b"x%d" % sent])
                sent += 1
        assert 1 <= sent < 100  # the pipe filled up
        blocked = asyncio.create_task(a.send([b"last"]), name="blocked-send")
        await asyncio.sleep(0.1)
        assert not blocked.done()
        got = [(await asyncio.wait_for(b.recv(), 5))[0] for _ in range(sent + 1)]
        await asyncio.wait_for(blocked, 5)
        assert got == [b"x%d" % i for i in range(sent)] + [b"last"]
        # a receiver waits on b; a's reply arrives while b itself sends (which drains b's FD signal)
        recv = asyncio.create_task(b.recv(), name="waiting-recv")
        await asyncio.sleep(0.05)
        a.send_now([b"ping"])
        b.send_now([b"pong"])
        assert (await asyncio.wait_for(recv, 5)) == [b"ping"]
        assert (await asyncio.wait_for(a.recv(), 5)) == [b"pong"]
        a.close()
        b.close()
        with pytest.raises(zmq.ZMQError):
            await b.recv()
        ctx.term()

    run(main())


# ---------------------------------------------------------------------------------------- hostile input
@pytest.mark.parametrize("kind", KINDS)
def test_wrong_secret_is_dropped_and_counted(kind):
    async def main():
        a, b = await pair(kind)
        intruder = chan(kind, "a", secret="not-the-cluster-secret-at-all-0000")
        await intruder.start()
        got = []

        async def handler(env):
            got.append(env.meta)

        b.set_handler(handler)
        with pytest.raises(TimeoutError):
            await intruder.send(ep(b), "k", {"evil": 1}, {"x": torch.ones(4)}, timeout=0.5)
        assert got == [] and b.stats()["dropped"] == {"bad_mac": 1}
        await a.send(ep(b), "k", {"good": 1}, {"x": torch.ones(4)}, timeout=5)
        assert got == [{"good": 1}]
        for ch in (a, b, intruder):
            await ch.close()

    run(main())


def test_garbage_and_oversized_messages_are_dropped_and_counted():
    async def main():
        a = chan("zmq", "a")
        b = chan("zmq", "b", max_message_bytes=1 << 16)
        await a.start()
        await b.start()
        got = []

        async def handler(env):
            got.append(env.tensors["x"].numel())

        b.set_handler(handler)
        auth = Authenticator(SECRET)
        good_header = msgpack.packb({"t": "msg", "v": 1, "from": "z", "to": "b", "sess": b"s" * 16, "st": 1,
                                     "seq": 1, "kind": "k", "meta": {}, "pay": "inline"}, use_bin_type=True)
        not_a_map = msgpack.packb([1, 2, 3])
        ctx = zmq.asyncio.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"tcp://127.0.0.1:{b.port}")
        junk = [
            [b"hello"],  # too few frames
            [b"XXXX", b"h", b"t" * 32, b"p"],  # wrong magic
            [MAGIC_MSG, b"\xc1garbage", b"t" * 32],  # not signed
            [MAGIC_MSG, good_header, b"short-tag"],  # bad tag size
            [MAGIC_MSG, not_a_map, auth.tag([not_a_map], b"data")],  # signed but not a header
            [MAGIC_MSG, good_header, auth.tag([good_header], b"ctrl")],  # tag from the control plane
            [MAGIC_MSG, good_header, auth.tag([good_header], b"data"), b"\0" * 40000, b"\0" * 40000],  # oversized
        ]
        for frames in junk:
            await raw.send_multipart(frames)
        for _ in range(200):
            if b.stats()["dropped_total"] >= len(junk):
                break
            await asyncio.sleep(0.01)
        assert b.stats()["dropped"] == {"bad_frames": 2, "bad_mac": 3, "bad_header": 1, "oversized": 1}
        await a.send(ep(b), "k", {}, {"x": torch.ones(100)}, timeout=5)  # still serving
        assert got == [100]
        with pytest.raises(ValueError, match="over the 65536-byte message limit"):  # the sender's own limit
            await b.send(ep(a), "k", {}, {"x": torch.ones(1 << 15)}, timeout=5)
        raw.close()
        ctx.term()
        await a.close()
        await b.close()

    run(main())


def test_replayed_and_tampered_messages_are_dropped():
    """Capture a real message on a fake peer, then replay it (and a tampered copy) to the real one."""

    async def main():
        a, b = await pair("zmq")
        got = []

        async def handler(env):
            got.append(raw_bytes(env.tensors["x"]))

        b.set_handler(handler)
        ctx = zmq.asyncio.Context()
        trap = ctx.socket(zmq.ROUTER)
        trap.setsockopt(zmq.LINGER, 0)
        trap_port = trap.bind_to_random_port("tcp://127.0.0.1")
        payload = torch.arange(5000, dtype=torch.int32)
        send = asyncio.create_task(a.send(Endpoint("b", "127.0.0.1", trap_port), "k", {}, {"x": payload},
                                          timeout=2), name="captured-send")
        captured = (await asyncio.wait_for(trap.recv_multipart(), 5))[1:]
        send.cancel()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"tcp://127.0.0.1:{b.port}")
        await raw.send_multipart(captured)  # first delivery: authentic, accepted
        ack = await asyncio.wait_for(raw.recv_multipart(), 5)
        assert msgpack.unpackb(ack[1])["ok"] is True
        await raw.send_multipart(captured)  # the same bytes again: a replay
        tampered = list(captured)
        body = bytearray(tampered[3])
        body[100] ^= 0xFF
        tampered[3] = bytes(body)
        await raw.send_multipart(tampered)  # same seq, so also a replay
        await asyncio.sleep(0.3)
        assert got == [raw_bytes(payload)]
        assert b.stats()["dropped"] == {"replay": 2}
        raw.close()
        trap.close()
        ctx.term()
        await a.close()
        await b.close()

    run(main())


def test_tampered_payload_with_a_fresh_header_is_rejected():
    """Payload frames are bound to the signed header by the one-time payload MAC."""

    async def main():
        a, b = await pair("zmq")
        got = []

        async def handler(env):
            got.append(1)

        b.set_handler(handler)
        ctx = zmq.asyncio.Context()
        trap = ctx.socket(zmq.ROUTER)
        trap.setsockopt(zmq.LINGER, 0)
        trap_port = trap.bind_to_random_port("tcp://127.0.0.1")
        send = asyncio.create_task(a.send(Endpoint("b", "127.0.0.1", trap_port), "k", {}, {"x": torch.ones(64)},
                                          timeout=2), name="captured-send")
        frames = (await asyncio.wait_for(trap.recv_multipart(), 5))[1:]
        send.cancel()
        frames[3] = b"\0" * len(frames[3])  # keep the authentic header, swap the payload
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"tcp://127.0.0.1:{b.port}")
        await raw.send_multipart(frames)
        ack = msgpack.unpackb((await asyncio.wait_for(raw.recv_multipart(), 5))[1])
        assert (ack["ok"], ack["code"]) == (False, "bad_payload_mac")
        assert got == [] and b.stats()["dropped"] == {"bad_payload_mac": 1}
        raw.close()
        trap.close()
        ctx.term()
        await a.close()
        await b.close()

    run(main())


# ---------------------------------------------------------------------------------------- shared memory
def test_shm_slots_are_reused_released_and_never_left_named():
    async def main():
        a, b = await pair("shm", shm_copy_below=0)  # zero-copy views for every payload size
        kept: list[dict[str, torch.Tensor]] = []
        keep = False

        async def handler(env):
            if keep:
                kept.append(env.tensors)

        b.set_handler(handler)
        x = {"x": torch.randn(100_000)}
        for _ in range(6):
            await a.send(ep(b), "k", {}, x, timeout=5)
            await asyncio.sleep(0.02)  # let the release come back
        st = a.stats()
        assert st["shm_sends"] == 6 and st["shm_slots"] == 1 and st["shm_slots_busy"] == 0
        assert own_segments(os.getpid()) == []  # names are unlinked once the receiver mapped them
        keep = True  # the receiver keeps zero-copy views: the sender may not reuse those slots
        for _ in range(3):
            await a.send(ep(b), "k", {}, x, timeout=5)
        assert a.stats()["shm_slots_busy"] == 3
        assert all(torch.equal(k["x"], x["x"]) for k in kept)
        kept.clear()
        gc.collect()  # the releases wait for the next ack to this sender (no message of their own)
        assert a.stats()["shm_slots_busy"] == 3
        keep = False
        await a.send(ep(b), "k", {}, x, timeout=5)
        st = a.stats()
        assert st["shm_slots_busy"] == 0 and st["shm_slots"] == 4  # the 4th send needed a fresh slot
        assert b.stats()["shm_releases_sent"] == 10 and b.stats()["shm_release_msgs"] == 0
        await a.close()
        await b.close()

    run(main())


def test_shm_release_rides_on_the_ack_when_the_handler_keeps_nothing():
    """Zero-copy views the handler dropped are released in the ack itself: the slot is free (and
    reused, warm) as soon as send() returns, with no separate release message."""

    async def main():
        a, b = await pair("shm", shm_copy_below=0)
        sums = []

        async def handler(env):
            sums.append(int(env.tensors["x"].sum()))

        b.set_handler(handler)
        for i in range(5):
            await a.send(ep(b), "k", {}, {"x": torch.full((50_000,), i, dtype=torch.int64)}, timeout=5)
            st = a.stats()
            assert (st["shm_slots"], st["shm_slots_busy"]) == (1, 0)  # no sleep: the ack carried the release
        assert sums == [50_000 * i for i in range(5)]
        assert b.stats()["shm_releases_sent"] == 5
        await a.close()
        await b.close()

    run(main())


def test_shm_small_payloads_are_copied_out_so_handlers_may_keep_them():
    """Below ``shm_copy_below`` the receiver copies out of the segment and frees the slot in the ack:
    kept tensors stay intact although the sender reuses (overwrites) the same slot right away."""

    async def main():
        a, b = await pair("shm", shm_copy_below=1 << 20)
        kept: list[torch.Tensor] = []

        async def handler(env):
            kept.append(env.tensors["x"])

        b.set_handler(handler)
        for i in range(4):
            await a.send(ep(b), "k", {}, {"x": torch.full((100_000,), float(i))}, timeout=5)
            assert a.stats()["shm_slots_busy"] == 0
        assert a.stats()["shm_slots"] == 1 and a.stats()["shm_sends"] == 4
        assert [float(k.min()) for k in kept] == [0.0, 1.0, 2.0, 3.0]
        assert [float(k.max()) for k in kept] == [0.0, 1.0, 2.0, 3.0]
        big = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: over the threshold, zero-copy view
        await a.send(ep(b), "k", {}, {"x": big}, timeout=5)
        assert torch.equal(kept[-1], big) and a.stats()["shm_slots_busy"] == 1  # kept view pins its slot
        kept.clear()
        gc.collect()  # 1 MiB or more: released at once, in a message of its own
        for _ in range(1000):  # poll for it (bounded)
            if a.stats()["shm_slots_busy"] == 0:
                break
            await asyncio.sleep(0.01)
        assert a.stats()["shm_slots_busy"] == 0 and b.stats()["shm_releases_sent"] == 5
        assert b.stats()["shm_release_msgs"] == 1
        await a.close()
        await b.close()

    run(main())


def test_shm_immediate_release_goes_to_its_sender_only():
    """A freed view of 1 MiB or more goes back to its sender at once; the deferred releases of
    smaller payloads from OTHER senders keep waiting for their next ack instead of being flushed
    along in messages of their own (each of which wakes a process)."""

    async def main():
        small_from, big_from = chan("shm", "a", shm_copy_below=0), chan("shm", "c", shm_copy_below=0)
        b = chan("shm", "b", shm_copy_below=0, shm_release_delay=30)  # no timer flush during the test
        for ch in (small_from, big_from, b):
            await ch.start()
        kept: list[torch.Tensor] = []

        async def handler(env):
            if env.meta.get("keep"):
                kept.append(env.tensors["x"])

        b.set_handler(handler)
        await small_from.send(ep(b), "k", {"keep": 1}, {"x": torch.arange(10_000)}, timeout=5)  # 80 KB: deferred
        await big_from.send(ep(b), "k", {"keep": 1}, {"x": torch.arange(300_000)}, timeout=5)  # 2.4 MB: at once
        assert small_from.stats()["shm_slots_busy"] == 1 and big_from.stats()["shm_slots_busy"] == 1
        kept.clear()
        gc.collect()
        for _ in range(1000):  # the big one's release travels alone: poll for it (bounded)
            if big_from.stats()["shm_slots_busy"] == 0:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # room for a (wrong) flush of the deferred one
        assert big_from.stats()["shm_slots_busy"] == 0
        assert small_from.stats()["shm_slots_busy"] == 1  # still deferred: waiting for an ack to ride on
        assert b.stats()["shm_release_msgs"] == 1
        await small_from.send(ep(b), "k", {}, {"x": torch.arange(10)}, timeout=5)  # its ack carries the release
        assert small_from.stats()["shm_slots_busy"] == 0
        assert b.stats()["shm_release_msgs"] == 1 and b.stats()["shm_releases_sent"] == 3  # the last in its own ack
        assert b.shm._rel_timer is None  # nothing is deferred any more: no flush armed for a later one to inherit
        for ch in (small_from, big_from, b):
            await ch.close()

    run(main())


def test_shm_copy_threshold_is_validated():
    with pytest.raises(ValueError, match="shm_copy_below must be a non-negative int"):
        make_transport("shm", "a", SECRET, shm_copy_below=-1)
    with pytest.raises(ValueError, match="shm_release_delay must be a number of seconds"):
        make_transport("shm", "a", SECRET, shm_release_delay=-1)


def test_shm_release_of_a_kept_view_goes_alone_when_no_ack_comes():
    """A view freed after the ack, with no later message to that sender, is released in a signed
    message of its own once ``shm_release_delay`` passed (the sender may reuse the slot)."""

    async def main():
        a, b = await pair("shm", shm_copy_below=0, shm_release_delay=0.05)
        kept: list[torch.Tensor] = []

        async def handler(env):
            kept.append(env.tensors["x"])

        b.set_handler(handler)
        await a.send(ep(b), "k", {}, {"x": torch.arange(100_000)}, timeout=5)
        assert a.stats()["shm_slots_busy"] == 1 and torch.equal(kept[0], torch.arange(100_000))
        kept.clear()
        gc.collect()
        for _ in range(1000):  # the release travels as its own message: poll for it (bounded)
            if a.stats()["shm_slots_busy"] == 0:
                break
            await asyncio.sleep(0.01)
        assert a.stats()["shm_slots_busy"] == 0
        assert b.stats()["shm_release_msgs"] == 1 and b.stats()["shm_releases_sent"] == 1
        await a.close()
        await b.close()

    run(main())


def test_shm_falls_back_to_frames_when_the_receiver_cannot_map():
    async def main():
        a, b = await pair("shm")
        got = []

        async def handler(env):
            got.append(raw_bytes(env.tensors["x"]))

        def cannot_map(sender, name):
            raise PayloadError("shm_unavailable", f"segment {name} is in another /dev/shm")

        b.shm._open = cannot_map  # as if b lived in another container's /dev/shm
        b.set_handler(handler)
        x = torch.randn(5000)
        await a.send(ep(b), "k", {}, {"x": x}, timeout=5)
        await a.send(ep(b), "k", {}, {"x": x}, timeout=5)
        assert got == [raw_bytes(x)] * 2
        assert a.stats()["shm_fallbacks"] == 2 and a.stats()["shm_sends"] == 2  # one retry, then inline
        await a.close()
        await b.close()
        assert own_segments(os.getpid()) == []

    run(main())


def test_shm_sender_and_zmq_receiver_interoperate():
    async def main():
        a = chan("shm", "a")
        b = chan("zmq", "b")
        await a.start()
        await b.start()
        got = []

        async def handler(env):
            got.append(raw_bytes(env.tensors["x"]))

        b.set_handler(handler)
        x = torch.randn(50_000)
        for _ in range(2):
            await a.send(ep(b), "k", {}, {"x": x}, timeout=5)
        assert got == [raw_bytes(x)] * 2 and a.stats()["shm_fallbacks"] == 1
        await a.close()
        await b.close()
        assert own_segments(os.getpid()) == []

    run(main())


SHM_CHILD = textwrap.dedent("""
    import asyncio, os, sys, torch
    from distflow.transport import make_transport, Endpoint
    mode, port, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    async def main():
        ch = make_transport("shm", "child", secret, shm_min_bytes=0)
        await ch.start()
        # The peer never opens the segment, so its name stays in /dev/shm while we live.
        asyncio.create_task(ch.send(Endpoint("sink", "127.0.0.1", port), "x", {}, {"a": torch.ones(1 << 18)},
                                    timeout=120), name="send")
        while not any(n.startswith(f"distflow-shm.{os.getpid()}.") for n in os.listdir("/dev/shm")):
            await asyncio.sleep(0.01)
        print("READY", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # the parent has seen the segment
        if mode == "raise":
            raise RuntimeError("boom")
        if mode == "exit":
            sys.exit(3)
        await asyncio.sleep(120)  # wait for a signal

    asyncio.run(main())
""")


def _spawn_holder(mode: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SHM_CHILD, mode, str(port), SECRET], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
    assert len(own_segments(proc.pid)) == 1
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return proc


@pytest.fixture
def sink_port():
    """A port nobody will ever ack on (a bound, never-read ROUTER)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    yield port
    s.close()
    ctx.term()


@pytest.mark.parametrize("mode, code", [("exit", 3), ("raise", 1), ("sigterm", -signal.SIGTERM)])
def test_shm_segments_removed_when_the_owner_exits_or_is_terminated(mode, code, sink_port):
    proc = _spawn_holder(mode, sink_port)
    try:
        if mode == "sigterm":
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == code
    finally:
        proc.kill()
    assert own_segments(proc.pid) == []  # the process cleaned up after itself


def test_shm_segment_of_a_sigkilled_process_is_swept_by_the_next_process(sink_port):
    proc = _spawn_holder("kill", sink_port)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    left = own_segments(proc.pid)
    assert len(left) == 1  # SIGKILL cannot be caught: the name is still there...
    nxt = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(f"""
            import asyncio
            from distflow.transport import make_transport
            async def main():
                ch = make_transport("shm", "next", {SECRET!r}, sweep_min_age=0)
                await ch.start()  # startup sweeps segments whose owner is gone
                await ch.close()
            asyncio.run(main())
        """)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert nxt.returncode == 0, nxt.stderr
    assert own_segments(proc.pid) == []  # ...until the next process starts and sweeps it


def test_sweep_spares_live_owners():
    path = os.path.join(SHM_DIR, f"distflow-shm.{os.getpid()}.0.0123abcd.1")  # wrong start time: stale
    with open(path, "wb") as f:
        f.write(b"x")
    try:
        live = [n for n in os.listdir(SHM_DIR) if n.startswith("distflow-shm.")]
        removed = sweep_stale_segments(min_age_s=0)
        assert os.path.basename(path) in removed and not os.path.exists(path)
        assert not (set(removed) - set(live))
    finally:
        if os.path.exists(path):
            os.unlink(path)


# ---------------------------------------------------------------------------------------- factory
def test_make_channel_kinds():
    assert make_transport("zmq", "n", SECRET).movers == {"socket"}
    assert make_transport("shm", "n", SECRET).movers == {"socket", "shm", "posting"}
    assert make_transport("auto", "n", SECRET).supports("socket")
    with pytest.raises(ValueError, match="unknown channel kind 'tcp'"):
        make_transport("tcp", "n", SECRET)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        make_transport("zmq", "n", "short")


@pytest.mark.gpu
def test_nccl_moves_cuda_tensors_between_devices():
    pytest.importorskip("cupy")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (NCCL ranks may not share a GPU)")

    async def main():
        a, b = make_transport("nccl", "a", SECRET, device=0), make_transport("nccl", "b", SECRET, device=1)
        await a.start()
        await b.start()
        got = []

        async def handler(env):
            got.append(env.tensors)

        b.set_handler(handler)
        want = {k: v.cuda() for k, v in every_dtype().items()}
        want["cpu_side"] = torch.arange(10)
        await a.send(ep(b), "k", {}, want, timeout=60)
        assert got[0]["float32"].is_cuda and not got[0]["cpu_side"].is_cuda
        assert_same({k: v.cpu() for k, v in got[0].items()}, {k: v.cpu() for k, v in want.items()})
        assert a.stats()["nccl_sends"] == 1
        await a.close()
        await b.close()

    run(main(), timeout=120)


# ---------------------------------------------------------------------------------------- shm lend
def test_shm_lend_sends_a_filled_slot_without_copying_and_keeps_it_until_both_sides_let_go():
    async def main():
        a, b = await pair("shm", shm_copy_below=0, shm_release_delay=0.05)  # the receiver keeps views
        got: list[dict[str, torch.Tensor]] = []

        async def keep(env):
            got.append(env.tensors)

        b.set_handler(keep)
        try:
            buf = a.lend(ep(b), 4096)
            x = buf[:1024].view(torch.float32)  # 256 floats at offset 0
            y = buf[1024:1024 + 80].view(torch.int64)  # 10 int64 at offset 1024 (64-aligned)
            x.copy_(torch.arange(256, dtype=torch.float32))
            y.copy_(torch.arange(10) * 7)
            await a.send(ep(b), "w", {}, {"x": x, "y": y}, timeout=10)
            assert a.stats()["shm_zero_copy_sends"] == 1 and a.stats()["shm_sends"] == 1
            assert torch.equal(got[0]["x"], torch.arange(256, dtype=torch.float32))
            assert torch.equal(got[0]["y"], torch.arange(10) * 7)
            await a.send(ep(b), "w", {}, {"x": x}, timeout=10)  # a second send of the same views copies
            assert a.stats()["shm_zero_copy_sends"] == 1 and a.stats()["shm_sends"] == 2
            slot = next(s for p in a.shm._pools.values() for s in p.slots if s.lent)
            got.clear()  # the receiver lets go: released, but still lent here -> never reused
            for _ in range(1000):  # the release travels as its own message: poll for it (bounded)
                if not slot.busy:
                    break
                await asyncio.sleep(0.01)
            assert not slot.busy and slot.lent
            del buf, x, y
            gc.collect()
            assert not slot.lent  # every lent view freed: the slot is reusable
            assert a.lend(Endpoint("far", "10.255.255.1", 9), 4096) is None  # not on this host
        finally:
            await a.close()
            await b.close()

    run(main())


def test_small_payload_copies_reuse_warm_buffers_once_freed():
    """The receiver's private copies (payloads under shm_copy_below) come from a pool: a buffer goes
    back when the last tensor viewing it dies and the next copy of that size class reuses it."""
    import numpy as np

    from distflow.transport.pool import CopyPool

    pool = CopyPool(max_free=1)
    src = np.arange(100_000, dtype=np.int64).view(np.uint8)  # 800,000 bytes -> the 896 KiB class
    a = pool.copy(src)
    t = torch.from_numpy(a).view(torch.int64)
    assert torch.equal(t, torch.arange(100_000)) and a.base.obj.nbytes == 7 << 17  # a view of the pooled buffer
    base = a.base.obj
    b = pool.copy(src[:1000])  # another class: its own buffer
    assert b.base.obj is not base
    del a, t
    gc.collect()
    c = pool.copy(src[: 600_000])
    assert c.base.obj is base and bytes(c[:16]) == bytes(src[:16])  # reused, rewritten


def test_size_classes_keep_at_most_a_quarter_more_than_the_payload():
    """Buffers and shared-memory segments come in four classes per doubling (not powers of two):
    an embedding bucket of 272 MB is kept in 320 MiB, not 512; a bucket just over 64 MiB in 80."""
    from distflow.transport.pool import size_class

    assert size_class(0) == size_class(4096) == 4096 and size_class(4097) == 8192
    assert size_class(800_000) == 7 << 17 and size_class(1 << 20) == 1 << 20  # 896 KiB; a power of two stays
    assert size_class((64 << 20) + 1) == 80 << 20 and size_class(272_000_000) == 320 << 20
    assert size_class(3000, 1 << 20) == 1 << 20 and size_class((5 << 20) + 1, 1 << 20) == 6 << 20
    for n in (5000, 123_456, (3 << 20) + 7, 999_999_999):
        assert n <= size_class(n) <= 1.25 * n + 4096

    async def main():
        a, b = await pair("shm")

        async def sink(env):
            return None

        b.set_handler(sink)
        try:
            await a.send(ep(b), "k", {}, {"x": torch.ones((5 << 20) + 1, dtype=torch.uint8)}, timeout=10)
            assert [s.size for p in a.shm._pools.values() for s in p.slots] == [6 << 20]  # was 8 MiB
        finally:
            await a.close()
            await b.close()

    run(main())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["zmq", "shm"])
def test_cuda_tensor_on_a_host_channel_is_copied_off_the_loop(kind):
    """A CUDA tensor sent over zmq/shm goes through host memory; its device-to-host copy waits for
    the GPU work queued before it (here ~0.5 s of torch.cuda._sleep) in a worker thread, while the
    event loop keeps running (a ticker task measures its longest gap)."""
    async def main():
        a, b = await pair(kind)
        got = []

        async def handler(env):
            got.append(env.tensors)

        b.set_handler(handler)
        x = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(1 << 20)  # calibrate: cycles per second on this GPU
        torch.cuda.synchronize()
        cycles = int((1 << 20) * 0.5 / max(time.perf_counter() - t0, 1e-6))
        gaps, stop = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker(), name="ticker")
        await asyncio.sleep(0.02)
        torch.cuda._sleep(cycles)  # queued before the copy on the default stream
        await a.send(ep(b), "k", {}, {"x": x}, timeout=60)
        stop.set()
        await tick
        assert torch.equal(got[0]["x"], x.cpu())
        assert max(gaps) < 0.25, max(gaps)  # the loop was never held for the ~0.5 s the copy waited
        await a.close()
        await b.close()

    run(main(), timeout=120)
