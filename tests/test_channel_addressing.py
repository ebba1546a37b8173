"""Channel addressing: a message that reaches the wrong node, and a node reached at a new address.

Both used to end in a send timeout (the full deadline, for a fault the receiver had already
named): the wrong node's refusal was dropped by the sender as an ack "from the wrong node", and a
second Endpoint for a node restarted its sequence numbers, so the receiver dropped every message
as a replay. Real ZeroMQ sockets (and same-host Unix sockets for shm) on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from distflow.transport import ChannelError, Endpoint, RemoteError, make_transport

SECRET = "addressing-test-secret-0123456789abcdef"
KINDS = ["zmq", "shm"]


def run(coro, timeout: float = 30.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def started(kind: str, node_id: str):
    ch = make_transport(kind, node_id, SECRET, **({"shm_min_bytes": 0} if kind == "shm" else {}))
    await ch.start()
    return ch


def record(ch) -> list[int]:
    """Install a handler on ``ch`` that records each message's ``meta["i"]``; returns the record."""
    got: list[int] = []

    async def handler(env):
        got.append(env.meta["i"])

    ch.set_handler(handler)
    return got


@pytest.mark.parametrize("kind", KINDS)
def test_message_for_another_node_fails_fast_naming_both_and_leaves_no_replay_state(kind):
    async def main():
        a, c = await started(kind, "a"), await started(kind, "c")
        got = record(c)
        stale = Endpoint("b", "127.0.0.1", c.port)  # b's old address, now c's
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match="message for node 'b' reached node 'c'") as ei:
            await a.send(stale, "samples", {"i": 0}, {"x": torch.ones(4)}, timeout=20)
        assert time.monotonic() - t0 < 5.0  # the refusal, not the deadline
        assert (ei.value.peer, ei.value.code) == ("b", "wrong_recipient")
        assert c.stats()["dropped"] == {"wrong_recipient": 1} and got == []
        assert a.stats()["dropped_total"] == 0  # the refusal was not taken for a forged ack
        # Sequence numbers are per node: a's next message to c (seq 1, as the refused one to b had)
        # is not a replay to c, which did not record a message that was not for it.
        await a.send(Endpoint("c", "127.0.0.1", c.port), "samples", {"i": 1}, {"x": torch.ones(4)}, timeout=5)
        assert got == [1] and c.stats()["dropped"] == {"wrong_recipient": 1}
        await a.close()
        await c.close()

    run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_a_node_reached_at_a_new_address_keeps_its_sequence(kind):
    """Two Endpoints for one node (another host name for the same process, or its new address)
    share one sequence: the receiver keeps accepting, and the older connection is closed."""

    async def main():
        a, b = await started(kind, "a"), await started(kind, "b")
        got = record(b)
        first, second = Endpoint("b", "127.0.0.1", b.port), Endpoint("b", "localhost", b.port)
        for i, peer in enumerate([first, first, second, second, first]):
            await a.send(peer, "samples", {"i": i}, {"x": torch.full((3,), float(i))}, timeout=5)
        assert got == [0, 1, 2, 3, 4]
        assert b.stats()["dropped_total"] == 0 and a.stats()["send_timeouts"] == 0
        await a.close()
        await b.close()

    run(main())


def test_pending_sends_on_the_replaced_connection_fail_naming_the_move():
    async def main():
        a, b = await started("zmq", "a"), await started("zmq", "b")
        gate = asyncio.Event()

        async def handler(env):
            if env.meta["i"] == 0:
                await gate.wait()

        b.set_handler(handler)
        old = asyncio.create_task(a.send(Endpoint("b", "127.0.0.1", b.port), "k", {"i": 0}, {}, timeout=20),
                                  name="send-old")
        await asyncio.sleep(0.2)
        await a.send(Endpoint("b", "localhost", b.port), "k", {"i": 1}, {}, timeout=5)
        with pytest.raises(ChannelError, match=r"connection to b .*replaced by localhost:"):
            await asyncio.wait_for(old, 5)
        gate.set()
        await a.close()
        await b.close()

    run(main())
