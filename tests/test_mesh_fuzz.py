"""Fuzz a live node's ROUTER with >= 10,000 bad frames; it must survive and account for each one."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any, Callable

import msgpack
import zmq
import zmq.asyncio

from distflow.core.auth import Authenticator
from distflow.core.mesh import MeshConfig
from distflow.core.node import Node
from distflow.core.wire import PROTOCOL_VERSION, Codec

SECRET = "fuzz-test-secret-0123456789abcdef"
MAX_FRAME = 64 * 1024


class Fuzzer:
    """Builds frames together with the reason the node must drop each one for."""

    def __init__(self, rng: random.Random, target: str, ack_addr: str):
        self.rng, self.target, self.addr = rng, target, ack_addr
        self.auth = Authenticator(SECRET)
        self.codec = Codec(self.auth, "fuzzer", 777, max_frame_bytes=MAX_FRAME)  # holds the secret
        self.counter = 10_000_000  # manual messages use their own, increasing, counters
        self.items: list[tuple[Any, str]] = []

    def valid(self, msg_type: str = "echo", body: dict | None = None, **kw) -> list[bytes]:
        return self.codec.encode(msg_type, body if body is not None else {"x": 1}, to=self.target, **kw)

    def signed_map(self, **over) -> list[bytes]:
        self.counter += 1
        m = {"v": PROTOCOL_VERSION, "t": "echo", "f": "fuzzer", "b": 777, "c": self.counter,
             "ts": int(time.time() * 1000), "to": self.target, "ti": 0, "k": 0, "r": 0, "a": self.addr, "d": {}}
        for k, v in over.items():
            if v is _DELETE:
                m.pop(k, None)
            else:
                m[k] = v
        p = msgpack.packb(m, use_bin_type=True)
        return [p, self.auth.tag([p], b"ctrl")]

    def add(self, frames: list[bytes] | Callable[[], list[bytes]], reason: str) -> None:
        self.items.append((frames, reason))

    def rbytes(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    def build(self) -> None:
        r = self.rng
        for _ in range(3000):  # random bytes, 1..4 frames
            n = r.randint(1, 4)
            frames = [self.rbytes(r.randint(0, 300)) for _ in range(n)]
            self.add(frames, "truncated" if n == 1 else "malformed" if n > 2 else "bad_mac")
        for _ in range(3000):  # mutated valid messages: any change breaks the tag
            payload, tag = self.valid(body={"x": r.random(), "s": "y" * r.randint(0, 50)})
            how = r.randint(0, 4)
            if how == 0:
                i = r.randrange(len(payload))
                payload = payload[:i] + bytes([payload[i] ^ (1 << r.randrange(8))]) + payload[i + 1:]
            elif how == 1:
                payload = payload[: r.randrange(len(payload))]
            elif how == 2:
                payload = payload + self.rbytes(r.randint(1, 10))
            elif how == 3:
                i = r.randrange(32)
                tag = tag[:i] + bytes([tag[i] ^ 0xFF]) + tag[i + 1:]
            else:
                tag = tag[: r.randrange(32)]
            self.add([payload, tag], "bad_mac")
        mutations = [
            (dict(v=2), "bad_version"), (dict(v=99), "bad_version"), (dict(v="1"), "wrong_types"),
            (dict(v=_DELETE), "malformed"), (dict(t=_DELETE), "malformed"), (dict(d=_DELETE), "malformed"),
            (dict(t=7), "wrong_types"), (dict(t=""), "wrong_types"), (dict(f=None), "wrong_types"),
            (dict(c=-1), "wrong_types"), (dict(c="9"), "wrong_types"), (dict(b=1.5), "wrong_types"),
            (dict(k=4), "wrong_types"), (dict(d=[1, 2]), "wrong_types"), (dict(g="x"), "wrong_types"),
            (dict(a=123), "wrong_types"), (dict(to="someone-else"), "misrouted"),
            (dict(ts=int(time.time() * 1000) - 3_600_000), "stale"),
            (dict(g=[[0, "ghost", 1]]), "wrong_types"), (dict(g=[[0, "ghost", 1, "r", "h", 0, {}, 0.0]]), "wrong_types"),
            (dict(t="swim.ping", d={"s": "x"}), "wrong_types"), (dict(t="swim.ack", d={}), "wrong_types"),
            (dict(t="swim.ping_req", d={"s": 1, "n": 5}), "wrong_types"),
            (dict(t="swim.join_ack", d={"state": "nope"}), "wrong_types"),
            (dict(t="swim.join", to="", d={"u": [1]}), "wrong_types"),
            (dict(t="swim.bogus"), "unknown_type"), (dict(t="mesh.bogus"), "unknown_type"),
            (dict(t="app.no_handler"), "unknown_type"),
        ]
        for _ in range(2500):  # valid signatures over wrong content (signed in send order, below)
            over, reason = r.choice(mutations)
            self.add(lambda over=over: self.signed_map(**over), reason)
        for _ in range(300):  # signed non-maps and signed garbage bytes
            p = r.choice([msgpack.packb([1, 2, 3]), msgpack.packb("str"), b"\xc1", self.rbytes(r.randint(1, 40))])
            self.add([p, self.auth.tag([p], b"ctrl")], "malformed")
        for _ in range(700):  # truncated multipart: the payload without its tag
            self.add(self.valid()[:1], "truncated")
        for _ in range(100):  # oversized (below ZMQ's own hard cap of 4x)
            self.add([self.rbytes(MAX_FRAME + r.randint(1, 100_000)), self.rbytes(32)], "oversized")
        original = self.valid("app.replayed")
        self.add(original, "unknown_type")
        for _ in range(400):  # replays of a message the node already accepted
            self.add(list(original), "replay")
        r.shuffle(self.items)
        # the replays must come after the original
        first = next(i for i, (f, _) in enumerate(self.items) if f is original)
        self.items.insert(0, self.items.pop(first))
        # counters increase in send order, so only the deliberate replays are replays
        self.items = [(f() if callable(f) else f, reason) for f, reason in self.items]


_DELETE = object()


def test_fuzz_router_survives_and_accounts(tmp_path):
    async def body():
        cfg = MeshConfig(max_frame_bytes=MAX_FRAME, piggyback_bytes=16 * 1024)
        target = Node("target", "worker", secret=SECRET, config=cfg)
        await target.start()
        peer = Node("peer", "worker", secret=SECRET, seeds=[target.address], config=cfg)
        await peer.start()

        async def echo(sender: str, msg: dict) -> dict:
            return {"x": msg.get("x"), "sender": sender}

        target.on("echo", echo)
        ctx = zmq.asyncio.Context.instance()
        inbox = ctx.socket(zmq.ROUTER)  # where the fuzzer's valid ping gets its ack
        inbox_port = inbox.bind_to_random_port("tcp://127.0.0.1")
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://{target.address}")
        try:
            await peer.wait_for(lambda ms: len(ms) == 2, 5, "target")
            fz = Fuzzer(random.Random(1234), "target", f"127.0.0.1:{inbox_port}")
            fz.build()
            assert len(fz.items) >= 10_000
            expected = Counter(reason for _, reason in fz.items)
            before = Counter(target.stats()["dropped_by_reason"])
            assert sum(before.values()) == 0
            t0 = time.perf_counter()
            for frames, _ in fz.items:
                await dealer.send_multipart(frames)
            deadline = time.monotonic() + 20
            while target.stats()["dropped"] < len(fz.items) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            elapsed = time.perf_counter() - t0
            st = target.stats()
            got = Counter(st["dropped_by_reason"])
            assert got == expected, (got - expected, expected - got)
            assert st["task_restarts"] == 0 and st["handler_errors"] == 0
            assert st["members"] == {"alive": 2, "suspect": 0, "dead": 0, "left": 0}
            print(f"fuzz: {len(fz.items)} frames handled in {elapsed:.2f}s: {dict(got)}")

            # still answers a valid probe (ack decoded with the fuzzer's key) ...
            prober = Codec(fz.auth, "prober", 1)
            await dealer.send_multipart(prober.encode("swim.ping", {"s": 99, "l": 0.0}, to="target",
                                                      addr=f"127.0.0.1:{inbox_port}"))
            frames = await asyncio.wait_for(inbox.recv_multipart(), 3)
            env = prober.decode(frames[1:])
            assert (env.type, env.body["s"], env.body["n"], env.sender) == ("swim.ack", 99, "target", "target")
            # ... and requests from a real peer, and it is still a healthy member
            assert await peer.request("target", "echo", {"x": 5}, timeout=3) == {"x": 5, "sender": "peer"}
            assert peer.member("target").state == "alive"
        finally:
            dealer.close(linger=0)
            inbox.close(linger=0)
            await peer.stop(graceful=False)
            await target.stop(graceful=False)

    asyncio.run(asyncio.wait_for(body(), 90))
