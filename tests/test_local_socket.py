"""The same-host control path of the shm channel (transport/local_socket.py): real Unix
sockets, real processes.

Same-host peers exchange headers, acks and releases over an abstract Unix socket instead of
zmq/TCP; everything else is the channel protocol unchanged. Checked here: it is used (and TCP is
not) between two shm channels of one host; big inline and streamed payloads frame correctly
(partial writes, direct reads into place); a peer that dies mid-message fails the send at once,
naming it, instead of at the deadline; garbage on the socket costs the sender its connection and
nothing else; and with ``local_socket=False`` (or a plain zmq peer) TCP carries it as before.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from distflow.transport import ChannelError, Endpoint, make_transport
from distflow.transport.local_socket import local_name
from tests.test_channels import SECRET, assert_same, run


def ep(ch) -> Endpoint:
    return Endpoint(ch.node_id, "127.0.0.1", ch.port)


async def pair(**kw):
    a, b = make_transport("shm", "a", SECRET, **kw), make_transport("shm", "b", SECRET, **kw)
    await a.start()
    await b.start()
    return a, b


def test_same_host_peers_talk_over_the_unix_socket():
    async def main():
        a, b = await pair()
        got = []

        async def handler(env):
            got.append((env.sender, env.meta["i"], env.tensors))

        b.set_handler(handler)
        x = {"x": torch.arange(100_000, dtype=torch.float32), "n": torch.tensor([3])}
        for i in range(5):
            await a.send(ep(b), "k", {"i": i}, x, timeout=10)
        assert [(s, i) for s, i, _ in got] == [("a", i) for i in range(5)]
        assert_same(got[-1][2], x)
        sa, sb = a.stats(), b.stats()
        assert sa["local_connects"] == 1 and sb["local_socket"] and sa["sent_msgs"] == 5 and sb["recv_msgs"] == 5
        assert sb["shm_recvs"] == 5  # the payload still travels in shared memory
        await a.close()
        await b.close()

    run(main())


@pytest.mark.parametrize("nbytes", [1 << 20, 24 << 20])  # inline frames; a streamed payload (chunks)
def test_big_inline_payloads_frame_correctly(nbytes):
    """shm_min_bytes above the payload: the bytes themselves cross the Unix socket (the kernel takes
    them in pieces: queued writes on one side, reads straight into place on the other)."""

    async def main():
        a, b = await pair(shm_min_bytes=1 << 40)
        got = []

        async def handler(env):
            got.append(env.tensors)

        b.set_handler(handler)
        g = torch.Generator().manual_seed(nbytes)
        xs = [{"x": torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=g), "y": torch.ones(7)}
              for _ in range(3)]
        await asyncio.gather(*[a.send(ep(b), "k", {}, x, timeout=30) for x in xs])
        assert len(got) == 3
        for x in xs:  # concurrent sends: any order
            assert any(torch.equal(x["x"], t["x"]) and torch.equal(x["y"], t["y"]) for t in got)
        assert b.stats()["shm_recvs"] == 0 and a.stats()["local_connects"] == 1
        assert (b.stats()["streams_received"] == 3) == (nbytes >= 4 << 20)
        await a.close()
        await b.close()

    run(main(), timeout=60)


DYING_RECEIVER = textwrap.dedent("""
    import asyncio, os, sys
    from distflow.transport import make_transport

    async def main():
        ch = make_transport("shm", "dying", sys.argv[1])
        async def handler(env):
            os._exit(17)  # dies holding the message: no ack will ever come
        ch.set_handler(handler)
        await ch.start()
        print(ch.port, flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
""")


def test_a_peer_that_dies_mid_message_fails_the_send_at_once_naming_it():
    proc = subprocess.Popen([sys.executable, "-c", DYING_RECEIVER, SECRET], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())

        async def main():
            a = make_transport("shm", "a", SECRET)
            await a.start()
            t0 = time.monotonic()
            with pytest.raises(ChannelError, match="connection to dying lost"):
                await a.send(Endpoint("dying", "127.0.0.1", port), "k", {}, {"x": torch.ones(4)}, timeout=30)
            assert time.monotonic() - t0 < 5  # not the 30 s deadline
            assert a.stats()["local_connects"] == 1
            await a.close()

        run(main())
        assert proc.wait(timeout=10) == 17
    finally:
        proc.kill()


def test_garbage_on_the_socket_drops_that_connection_only():
    async def main():
        a, b = await pair()
        got = []

        async def handler(env):
            got.append(env.meta["i"])

        b.set_handler(handler)
        loop = asyncio.get_running_loop()
        for junk in (struct.pack("<QI", 1 << 62, 1), struct.pack("<QI", 16, 0), b"\xff" * 64,
                     struct.pack("<QI1Q", 8, 1, 5)):  # too big; no frames; nonsense; lengths that do not add up
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(local_name(b.port))
            s.setblocking(False)
            await loop.sock_sendall(s, junk)
            s.close()
        await a.send(ep(b), "k", {"i": 1}, {"x": torch.ones(3)}, timeout=10)  # the channel still serves
        assert got == [1] and b.stats()["dropped_total"] == 0
        await a.close()
        await b.close()

    run(main())


@pytest.mark.parametrize("which", ["local_socket_off", "zmq_peer"])
def test_tcp_carries_it_without_a_unix_socket(which):
    async def main():
        if which == "local_socket_off":
            a, b = await pair(local_socket=False)
        else:
            a, b = make_transport("shm", "a", SECRET), make_transport("zmq", "b", SECRET)
            await a.start()
            await b.start()
        got = []

        async def handler(env):
            got.append(env.meta["i"])

        b.set_handler(handler)
        await a.send(ep(b), "k", {"i": 1}, {"x": torch.ones(3)}, timeout=10)
        assert got == [1] and a.stats()["local_connects"] == 0
        await a.close()
        await b.close()

    run(main())
