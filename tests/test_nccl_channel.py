"""NCCL channel bookkeeping that needs no GPU: a communicator whose posted calls may never be
matched is aborted and forgotten, a gap in a communicator's message indices refuses the message
(later receives would take the lost one's bytes), a new init frees the communicator it
replaces, and a post always closes its NCCL group and never has its communicator aborted
under it (fake cupy/NCCL modules): the first tests build the channel without its constructor
(that needs cupy and a GPU); the last runs two real channels whose NCCL pair is an in-process
queue, so the whole protocol (init, replacement, refusals) runs on a CPU; close joins the threads
its aborts unblock and names one it cannot. NCCL moving real bytes is tested in tests/test_channels.py and tests/test_weights.py (gpu marker)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
import types
from collections import Counter

import pytest
import torch

from distflow.transport import ChannelError, Envelope, make_transport
from distflow.transport.api import Endpoint, PayloadError
from distflow.transport.movers import nccl as nccl_channel
from distflow.transport.movers.nccl import INIT_KIND, NcclMover, _Comm, communicator, uid_bytes

SECRET = "nccl-test-secret-0123456789abcdef"


class FakeNccl:
    def __init__(self) -> None:
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1


def bare_channel() -> NcclMover:
    ch = NcclMover.__new__(NcclMover)
    ch.node_id, ch.device, ch._nccl_timeout = "rollout", 0, 5.0
    ch._counters = Counter()
    ch._out, ch._in, ch._replaced = {}, {}, {}
    return ch


def test_discard_aborts_once_forgets_and_names_the_replaced_comm() -> None:
    ch = bare_channel()
    peer = Endpoint("trainer", "127.0.0.1", 5555)
    out, inn = _Comm(FakeNccl(), "c-out", None), _Comm(FakeNccl(), "c-in", None)
    ch._out[peer], ch._in[("trainer", "c-in")] = out, inn
    ch._discard_comm(out)
    ch._discard_comm(out)  # a second failure on the same communicator
    assert out.broken and ch._out == {} and ch._replaced == {peer: "c-out"}
    assert ch._counters["nccl_aborts"] == 1
    ch._discard_comm(inn)
    assert inn.broken and ch._in == {} and ch._counters["nccl_aborts"] == 2


def test_a_dropped_communicators_stream_outlives_it() -> None:
    """Tensors sent or received on a communicator were record_stream()ed on its stream; the
    allocator records an event there when they are freed, possibly after the communicator was
    dropped. The (cupy) stream must not be collected with it: it would destroy the CUDA stream."""
    import gc
    import weakref

    class Owner:  # stands for the cupy stream (destroys its CUDA stream when collected)
        pass

    ch = bare_channel()
    peer = Endpoint("trainer", "127.0.0.1", 5555)
    owner, stream = Owner(), object()
    ch._out[peer] = _Comm(FakeNccl(), "c-out", stream, owner)
    alive = weakref.ref(owner)
    ch._discard_comm(ch._out[peer])
    ch._discard_comm(_Comm(FakeNccl(), "c-none", None))  # a communicator without a stream of its own
    del owner
    gc.collect()
    assert ch._out == {} and alive() is not None
    assert nccl_channel._RETIRED_STREAMS[id(alive())] == (stream, alive())
    nccl_channel._RETIRED_STREAMS.pop(id(alive()))


def nccl_header(comm_id: str, n: int) -> dict:
    return {"pay": "nccl", "from": "trainer", "nccl": {"comm": comm_id, "n": n, "tens": []}}


def test_a_gap_in_message_indices_aborts_the_communicator() -> None:
    async def main() -> None:
        ch = bare_channel()
        c = _Comm(FakeNccl(), "c1", None)
        c.next_n = 4
        ch._in[("trainer", "c1")] = c
        with pytest.raises(PayloadError) as e:
            await ch._receive_payload(nccl_header("c1", 5), [], b"")  # #4 never reached this side
        assert e.value.code == "nccl_out_of_order" and c.broken and c.comm.aborts == 1 and ch._in == {}
        with pytest.raises(PayloadError, match="unknown NCCL communicator 'c1'"):
            await ch._receive_payload(nccl_header("c1", 4), [], b"")  # the sender gets refused and aborts too

    asyncio.run(main())


def test_init_frees_the_communicator_it_replaces() -> None:
    async def main() -> None:
        ch = bare_channel()
        old, other = _Comm(FakeNccl(), "old", None), _Comm(FakeNccl(), "x", None)
        ch._in[("trainer", "old")], ch._in[("learner", "x")] = old, other
        made = []

        async def new_comm(uid, rank, comm_id):
            made.append((len(uid), rank, comm_id))
            return _Comm(FakeNccl(), comm_id, None)

        ch._new_comm = new_comm
        await ch._accept_comm(Envelope("trainer", INIT_KIND, {"uid": [0] * 128, "comm": "new", "replaces": "old"}, {}))
        assert made == [(128, 1, "new")] and old.broken and old.comm.aborts == 1
        assert set(ch._in) == {("trainer", "new"), ("learner", "x")} and not other.broken
        await ch._accept_comm(Envelope("trainer", INIT_KIND, {"uid": bytes(128), "comm": "b"}, {}))  # cupy >= 14 peers
        assert made[-1] == (128, 1, "b")
        for bad in ("zz", b"short", [300] * 128):
            with pytest.raises(ValueError, match="malformed nccl init"):
                await ch._accept_comm(Envelope("trainer", INIT_KIND, {"uid": bad, "comm": "n2"}, {}))

    asyncio.run(main())


def test_the_unique_id_crosses_cupy_versions() -> None:
    """cupy 14 gives and takes the NCCL unique id as bytes, cupy 13 as a tuple of signed chars: the
    id travels as its raw bytes and each end builds its communicator in its own cupy's form."""
    raw = bytes(range(128))
    signed = tuple(b - 256 if b > 127 else b for b in raw)
    assert uid_bytes(signed) == raw and uid_bytes(raw) == raw and uid_bytes(list(raw)) == raw

    class Cupy14:
        def __init__(self, ndev: int, comm_id: bytes, rank: int) -> None:
            if not isinstance(comm_id, bytes):
                raise TypeError("Argument 'commId' has incorrect type (expected bytes)")
            self.uid, self.rank = comm_id, rank

    class Cupy13:
        def __init__(self, ndev: int, comm_id: tuple, rank: int) -> None:
            if not isinstance(comm_id, tuple):
                raise TypeError("Argument 'commId' has incorrect type (expected tuple)")
            assert all(-128 <= x <= 127 for x in comm_id)  # stored into a C char array
            self.uid, self.rank = comm_id, rank

    assert communicator(types.SimpleNamespace(NcclCommunicator=Cupy14), raw, 1).uid == raw
    assert communicator(types.SimpleNamespace(NcclCommunicator=Cupy13), raw, 0).uid == signed


class FakeNcclModule:
    """What _post calls of cupy.cuda.nccl: the group calls; the comm's send/recv raise on demand."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def groupStart(self) -> None:  # noqa: N802 - cupy's name
        self.calls.append("start")

    def groupEnd(self) -> None:  # noqa: N802
        self.calls.append("end")


class PostingComm(FakeNccl):
    def __init__(self, calls: list[str], fail_at: int = -1, during=None) -> None:
        super().__init__()
        self.calls, self.fail_at, self.during = calls, fail_at, during

    def send(self, ptr, count, dtype, peer, stream) -> None:
        self.calls.append(f"send{count}->{peer}")
        if self.during is not None:
            self.during()
        if len([c for c in self.calls if c.startswith("send")]) - 1 == self.fail_at:
            raise RuntimeError("NCCL error: unhandled cuda error")


def test_post_always_closes_the_group_and_defers_an_abort_until_it_returns(monkeypatch) -> None:
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda _i: contextlib.nullcontext()))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    ch = bare_channel()
    ch._nccl, ch._uint8 = FakeNcclModule(), 1
    stream = types.SimpleNamespace(cuda_stream=0)
    bufs = [torch.zeros(3, dtype=torch.uint8), torch.zeros(0, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8)]

    c = _Comm(PostingComm(ch._nccl.calls, fail_at=1), "c", stream)
    with pytest.raises(RuntimeError, match="unhandled cuda error"):
        ch._post(c, bufs, True)
    assert ch._nccl.calls == ["start", "send3->1", "send5->1", "end"]  # empty skipped; the group closed anyway

    ch._nccl.calls.clear()
    seen = []
    c = _Comm(PostingComm(ch._nccl.calls, during=lambda: (c.abort(), seen.append(c.comm.aborts))), "c", stream)
    ch._post(c, bufs[:1], True)
    assert seen == [0] and c.broken and c.comm.aborts == 1  # aborted once the post returned, not under it
    with pytest.raises(ChannelError, match="was aborted"):
        ch._post(c, bufs, True)  # a broken communicator is never posted on
    assert ch._nccl.calls == ["start", "send3->1", "end"]


# ----------------------------------------------------------------------------- whole protocol, faked
class LoopbackComm:
    """An NCCL pair member over an in-process queue: sends are matched by receives in order."""

    def __init__(self, pipe: collections.deque) -> None:
        self.pipe, self.aborts = pipe, 0

    def send(self, ptr, count, dtype, peer, stream) -> None:
        self.pipe.append(ctypes.string_at(ptr, count))

    def recv(self, ptr, count, dtype, peer, stream) -> None:
        data = self.pipe.popleft()  # the earliest unmatched send, as NCCL matches them
        assert len(data) == count, (len(data), count)
        ctypes.memmove(ptr, data, count)

    def abort(self) -> None:
        self.aborts += 1


class FakeStream:
    cuda_stream = 0

    def wait_stream(self, _other) -> None:
        pass

    def wait_event(self, _event) -> None:
        pass


class FakeEvent:
    def record(self, _stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class OnGpu(torch.Tensor):
    """A CPU tensor the channel takes for one on cuda:0 (no stream bookkeeping)."""

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)

    def record_stream(self, _stream) -> None:
        pass


def fake_gpu(monkeypatch, module: FakeNcclModule) -> None:
    """cupy, its NCCL (``module``) and CUDA as far as a real NcclMover touches them, on a CPU."""
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=lambda _i: contextlib.nullcontext())))
    monkeypatch.setattr(nccl_channel, "_import_nccl", lambda: module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda _d=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)


@pytest.mark.parametrize("cupy_uid", ["tuple", "bytes"])  # get_unique_id of cupy 13 / cupy >= 14
def test_a_refusal_before_the_receive_replaces_the_communicator_and_a_handler_refusal_does_not(monkeypatch, cupy_uid):
    from distflow.transport import RemoteError, make_transport
    from distflow.transport.movers import nccl as nccl_channel

    pipes: dict[tuple, collections.deque] = {}
    module = FakeNcclModule()
    module.get_unique_id = lambda: (tuple(b - 256 if b > 127 else b for b in os.urandom(128)) if cupy_uid == "tuple"
                                    else os.urandom(128))
    fake_gpu(monkeypatch, module)
    monkeypatch.setattr(NcclMover, "_make_comm", lambda self, uid, rank, made: (
        LoopbackComm(pipes.setdefault(uid, collections.deque())), FakeStream(), None))

    async def main() -> None:
        a, b = make_transport("nccl", "a", SECRET, device=0), make_transport("nccl", "b", SECRET, device=0)
        b.nccl.device = "cpu"  # where the receiver allocates: this machine has no GPU
        await a.start()
        await b.start()
        got: list[dict] = []

        async def handler(env: Envelope) -> None:
            if env.kind == "stale":
                raise ValueError("step 3 is too old")
            got.append(dict(env.tensors))

        b.set_handler(handler)
        peer = Endpoint("b", "127.0.0.1", b.port)
        x = torch.arange(12, dtype=torch.float32).as_subclass(OnGpu)
        try:
            await a.send(peer, "k", {}, {"x": x, "cpu": torch.ones(2)}, timeout=10)
            assert torch.equal(got[0]["x"], torch.arange(12, dtype=torch.float32)) and got[0]["cpu"].sum() == 2
            first = a.nccl._out[peer]
            with pytest.raises(RemoteError, match="handler_error"):  # refused after the bytes arrived
                await a.send(peer, "stale", {}, {"x": x}, timeout=10)
            assert a.nccl._out[peer] is first and not first.broken and a.stats()["nccl_aborts"] == 0

            (theirs,) = b.nccl._in.values()
            theirs.next_n += 1  # as if a message of this communicator never reached b's handler
            with pytest.raises(RemoteError, match="nccl_out_of_order"):
                await a.send(peer, "k", {}, {"x": x}, timeout=10)
            assert first.broken and peer not in a.nccl._out and a.nccl._replaced == {peer: first.comm_id}
            assert theirs.broken and b.nccl._in == {}
            await a.send(peer, "k", {}, {"x": x * 2}, timeout=10)  # a new communicator, the old one named
            assert torch.equal(got[-1]["x"], torch.arange(12, dtype=torch.float32) * 2)
            assert list(b.nccl._in) == [("a", a.nccl._out[peer].comm_id)] and a.nccl._replaced == {}
            assert a.stats()["nccl_sends"] == 2 and a.stats()["nccl_aborts"] == 1  # the acked ones
            assert b.stats()["nccl_recvs"] == 3 and b.stats()["nccl_aborts"] == 1  # "stale" was received
        finally:
            await a.close()
            await b.close()

    asyncio.run(asyncio.wait_for(main(), 60))


# ----------------------------------------------------------------------------- close joins its threads
class AbortedSend(FakeNccl):
    """A send blocked in NCCL until its communicator is aborted, then a moment unwinding."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.unblocked, self.returned = threading.Event(), threading.Event(), threading.Event()

    def send(self, ptr, count, dtype, peer, stream) -> None:
        self.entered.set()
        self.unblocked.wait(30)
        time.sleep(0.5)
        self.returned.set()

    def abort(self) -> None:
        super().abort()
        self.unblocked.set()


def test_close_joins_the_posts_its_aborts_unblock(monkeypatch) -> None:
    fake_gpu(monkeypatch, FakeNcclModule())

    async def main() -> None:
        ch = make_transport("nccl", "a", SECRET, device=0, close_timeout=10.0)
        await ch.start()
        send = AbortedSend()
        comm = ch.nccl._out[Endpoint("b", "127.0.0.1", 5555)] = _Comm(send, "c", FakeStream())
        post = asyncio.ensure_future(ch.nccl._post_in_thread(comm, [torch.zeros(4, dtype=torch.uint8)], True))
        assert await asyncio.to_thread(send.entered.wait, 10)
        try:
            await asyncio.wait_for(ch.close(), 20)
            assert send.returned.is_set() and ch.nccl._threads.running() == []  # joined, not left running
            assert send.aborts == 1 and comm.broken
        finally:
            send.unblocked.set()
            await asyncio.wait_for(post, 20)

    asyncio.run(main())


def test_close_names_a_call_it_cannot_unblock_and_returns(monkeypatch, caplog) -> None:
    """An NCCL init whose peer never joins cannot be aborted: close waits the close timeout for
    its thread, names the call in the log, and returns."""
    module = FakeNcclModule()
    entered, freed = threading.Event(), threading.Event()

    def never_joined(ndev, uid, rank):
        entered.set()
        freed.wait(30)
        raise RuntimeError("the peer never joined")

    module.NcclCommunicator = never_joined
    fake_gpu(monkeypatch, module)

    async def main() -> None:
        ch = make_transport("nccl", "a", SECRET, device=0, close_timeout=0.3)
        await ch.start()
        init = asyncio.ensure_future(ch.nccl._new_comm(bytes(128), 1, "c"))
        try:
            assert await asyncio.to_thread(entered.wait, 10)
            t0 = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="distflow.aio"):
                await asyncio.wait_for(ch.close(), 20)
            assert time.monotonic() - t0 < 10
            assert "NcclMover._make_comm" in caplog.text and "nccl-a" in caplog.text
        finally:
            freed.set()
            await asyncio.gather(init, return_exceptions=True)

    asyncio.run(main())
