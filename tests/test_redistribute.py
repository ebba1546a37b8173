"""Stage-to-stage redistribution between real processes over the real zmq and shm channels.

A pool of worker processes hosts producer and consumer nodes (each node its own channel
and port). For every DP-size pair, each producer scatters an uneven batch for a step;
each consumer takes the step from its shard. Every sample must arrive exactly once, at
its owner, with its tokens intact — checked by sample id and per-sample checksums.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from distflow.buffer.routing import owner

ROOT = Path(__file__).resolve().parents[1]
SECRET = "redistribute-test-secret-0123456789"

WORKER = textwrap.dedent("""
    import asyncio, json, sys, threading, time
    import torch
    from distflow.buffer.batch import SampleBatch
    from distflow.buffer.redistribute import gather_step, open_ingress, scatter, shard_receiver
    from distflow.buffer.shard import BufferShard
    from distflow.transport import Endpoint, make_transport

    SECRET = sys.argv[1]
    nodes = {}   # node id -> (channel, shard or None)
    out_lock = threading.Lock()

    def reply(rid, **kw):
        with out_lock:
            sys.stdout.write(json.dumps({"id": rid, **kw}) + "\\n")
            sys.stdout.flush()

    def make_batch(node, step, n, seed, version):
        g = torch.Generator().manual_seed(seed)
        ids = [f"{node}:s{step}:{i}" for i in range(n)]
        plens = torch.randint(1, 20, (n,), generator=g).tolist()
        rlens = torch.randint(0, 30, (n,), generator=g).tolist()  # zero-length responses too
        prompts = [torch.randint(0, 1000, (k,), generator=g).tolist() for k in plens]
        resps = [torch.randint(0, 1000, (k,), generator=g).tolist() for k in rlens]
        lps = [(-torch.rand(k, generator=g)).tolist() for k in rlens]
        return SampleBatch.from_lists(ids, [f"e0:{step * 1000 + i}" for i in range(n)], prompts, resps,
                                      logprobs=lps, policy_version=version)

    def checksums(b):
        return {s: [int(p.sum()), int(r.sum()), round(float(l.sum()), 4)]
                for s, p, r, l in zip(b.sample_ids, b.ragged("prompt_tokens"), b.ragged("response_tokens"),
                                      b.ragged("logprobs"))}

    async def node(nid, capacity=None, channel=None):
        if nid not in nodes:
            kw = dict(channel or {"kind": "zmq"})
            ingress = kw.pop("ingress", False)
            ch = make_transport(kw.pop("kind"), nid, SECRET, **kw)
            shard = BufferShard(capacity) if capacity else None
            if shard is not None:
                ch.set_handler(shard_receiver(shard, put_timeout=60))
            await ch.start()
            if shard is not None and ingress:
                assert open_ingress(ch, shard)  # same-host producers post their parts
            nodes[nid] = (ch, shard)
        return nodes[nid]

    async def handle(req):
        rid, cmd = req["id"], req["cmd"]
        try:
            if cmd == "consumer":
                ch, _ = await node(req["node"], req["capacity"], req.get("channel"))
                reply(rid, port=ch.port)
            elif cmd == "produce":
                ch, _ = await node(req["node"], channel=req.get("channel"))
                consumers = [Endpoint(*c) for c in req["consumers"]]
                sums, times = {}, []
                for step, n in zip(req["steps"], req["sizes"]):
                    b = make_batch(req["node"], step, n, req["seed"] + step, req.get("version", 0))
                    sums.update(checksums(b))
                    t0 = time.monotonic()
                    r = await scatter(ch, b, consumers, step=step, source_rank=req["rank"], timeout=60,
                                      num_sources=req["num_sources"], extra_meta={"epoch": 0})
                    times.append(time.monotonic() - t0)
                    assert sum(r["samples"]) == n
                st = ch.stats()
                reply(rid, sums=sums, times=times, sent=st["sent_msgs"], shm_sends=st.get("shm_sends", 0),
                      posts=st.get("mailbox", {}).get("posts", 0))
            elif cmd == "take":
                ch, shard = await node(req["node"])
                got, max_waiting, max_held = {}, 0, 0
                for step in req["steps"]:
                    await asyncio.sleep(req.get("delay", 0))
                    st = shard.stats()
                    max_waiting, max_held = max(max_waiting, st["waiting"]), max(max_held, st["samples_held"])
                    b = await gather_step(shard, step, req["sources"], timeout=60)
                    for s, c in checksums(b).items():
                        got.setdefault(s, []).append(c)
                reply(rid, got=got, max_waiting=max_waiting, max_held=max_held, stats=shard.stats())
            elif cmd == "close":
                for ch, _ in nodes.values():
                    await ch.close()
                nodes.clear()
                reply(rid, ok=True)
        except BaseException as e:
            reply(rid, error=f"{type(e).__name__}: {e}")

    async def main():
        loop = asyncio.get_running_loop()
        q = asyncio.Queue()

        def read_stdin():
            for line in sys.stdin:
                loop.call_soon_threadsafe(q.put_nowait, line)
            loop.call_soon_threadsafe(q.put_nowait, None)

        threading.Thread(target=read_stdin, daemon=True).start()
        tasks = set()
        while (line := await q.get()) is not None:
            t = asyncio.create_task(handle(json.loads(line)), name="request")
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        for ch, _ in nodes.values():
            await ch.close()

    asyncio.run(main())
""")


class Worker:
    """A worker process; requests are JSON lines, answered asynchronously by id."""

    _ids = itertools.count()

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, SECRET], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        self.pending: dict[int, Future] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.lock:
                fut = self.pending.pop(msg["id"])
            fut.set_result(msg)
        with self.lock:
            for fut in self.pending.values():
                fut.set_exception(RuntimeError(f"worker died: {self.proc.stderr.read()[-3000:]}"))

    def request(self, cmd: str, **kw) -> Future:
        rid = next(self._ids)
        fut: Future = Future()
        with self.lock:
            self.pending[rid] = fut
        self.proc.stdin.write(json.dumps({"id": rid, "cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        return fut

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        finally:
            self.proc.kill()


def result(fut: Future, timeout: float = 90) -> dict:
    msg = fut.result(timeout=timeout)
    assert "error" not in msg, msg["error"]
    return msg


@pytest.fixture(scope="module")
def workers():
    pool = [Worker() for _ in range(5)]
    yield pool
    for w in pool:
        w.stop()


# Uneven batch sizes per producer (zero included): no equal-chunk requirement.
SIZES = [7, 0, 13, 4]


# The zmq channel, and the shm channel (what "auto" picks on one host) both copying small parts out of
# shared memory and handing out zero-copy views of it.
# shm-post: the consumers open a mailbox for samples (open_ingress), so same-host parts are posted.
CHANNELS = {"zmq": {"kind": "zmq"}, "shm-copy": {"kind": "shm", "shm_min_bytes": 0},
            "shm-view": {"kind": "shm", "shm_min_bytes": 0, "shm_copy_below": 0},
            "shm-post": {"kind": "shm", "ingress": True}}
CASES = ([("zmq", p, c) for p, c in [(1, 2), (2, 2), (3, 2), (4, 3), (2, 5)]]
         + [(k, p, c) for k in ("shm-copy", "shm-view") for p, c in [(2, 2), (4, 3)]]
         + [("shm-post", p, c) for p, c in [(2, 2), (4, 3), (3, 1), (2, 5)]])


@pytest.mark.parametrize("channel, num_producers, num_consumers", CASES)
def test_every_sample_arrives_exactly_once_at_its_owner(workers, channel, num_producers, num_consumers):
    tag = f"{channel}-{num_producers}to{num_consumers}"
    chan = CHANNELS[channel]
    steps = [0, 1]
    # producers on workers 0.., consumers on the last workers: some pairs share a process, most do not
    cons = [(f"c{j}-{tag}", workers[len(workers) - 1 - j]) for j in range(num_consumers)]
    ports = [result(w.request("consumer", node=n, capacity=1000, channel=chan))["port"] for n, w in cons]
    endpoints = [[n, "127.0.0.1", p] for (n, _), p in zip(cons, ports)]
    prods = [(f"p{i}-{tag}", workers[i]) for i in range(num_producers)]
    takes = [w.request("take", node=n, steps=steps, sources=[p for p, _ in prods]) for n, w in cons]
    sizes = {p: [SIZES[(i + s) % len(SIZES)] for s in steps] for i, (p, _) in enumerate(prods)}
    produced = [w.request("produce", node=p, consumers=endpoints, steps=steps, sizes=sizes[p], seed=10 * i,
                          rank=i, num_sources=num_producers, channel=chan) for i, (p, w) in enumerate(prods)]
    sent: dict[str, list] = {}
    for (p, _), fut in zip(prods, produced):
        r = result(fut)
        assert len(r["sums"]) == sum(sizes[p])
        if chan.get("ingress"):  # every part, empty or not, is posted: no message at all
            assert (r["posts"], r["sent"]) == (len(steps) * num_consumers, 0)
        else:
            assert r["sent"] == len(steps) * num_consumers  # one message per consumer per step, empty or not
            assert r["posts"] == 0
        if chan["kind"] == "shm" and not chan.get("ingress"):  # every non-empty part went through shared memory
            assert r["shm_sends"] > 0
        sent.update(r["sums"])
    received: dict[str, list] = {}
    for j, ((n, _), fut) in enumerate(zip(cons, takes)):
        got = result(fut)["got"]
        for sid, copies in got.items():
            assert len(copies) == 1, f"{sid} arrived {len(copies)} times at {n}"
            assert owner(sid, num_consumers) == j, f"{sid} reached consumer {j}, owner is {owner(sid, num_consumers)}"
            assert sid not in received, f"{sid} arrived at two consumers"
            received[sid] = copies[0]
    assert len(sent) == sum(sum(v) for v in sizes.values())
    assert received == sent  # every sample exactly once, tokens and logprobs intact


def test_slow_consumer_backpressures_producers_without_losing_samples(workers):
    """Capacity 6 samples, a consumer that sleeps before each step: producers must wait, nothing is lost."""
    steps = list(range(6))
    port = result(workers[4].request("consumer", node="slow", capacity=6))["port"]
    consumer = [["slow", "127.0.0.1", port]]
    sources = ["bp0", "bp1"]
    take = workers[4].request("take", node="slow", steps=steps, sources=sources, delay=0.25)
    produced = [workers[i].request("produce", node=p, consumers=consumer, steps=steps, sizes=[3] * len(steps),
                                   seed=100 + i, rank=i, num_sources=2) for i, p in enumerate(sources)]
    sent = {}
    slowest = 0.0
    for fut in produced:
        r = result(fut)
        sent.update(r["sums"])
        slowest = max(slowest, max(r["times"][2:]))
    taken = result(take)
    assert taken["max_waiting"] >= 1  # producers were seen blocked on the full shard
    assert taken["max_held"] <= 6 + 3  # never more than capacity (+ one part of the step being awaited)
    assert slowest >= 0.15  # a scatter waited for the consumer (its ack is the backpressure)
    assert {s: c[0] for s, c in taken["got"].items()} == sent and len(sent) == 36
    assert all(len(c) == 1 for c in taken["got"].values())
    st = taken["stats"]
    assert (st["in"], st["out"], st["samples_held"]) == (36, 36, 0)


def test_shm_scatter_writes_parts_straight_into_lent_slots():
    """Same-host parts of at least shm_min_bytes are packed straight into shared-memory slots the
    channel lends (one copy, then a zero-copy send); contents and accounting are unchanged, with
    owner or token balancing and for a retry to one consumer."""
    import asyncio

    import torch

    from distflow.buffer.batch import SampleBatch
    from distflow.buffer.redistribute import gather_step, open_ingress, scatter, shard_receiver
    from distflow.buffer.routing import split_by_owner, token_partition
    from distflow.buffer.shard import BufferShard
    from distflow.transport import Endpoint, make_transport

    n, plen, rlen = 24, 300, 700  # ~8 KiB per sample: each of the 2 parts is well over 64 KiB
    g = torch.Generator().manual_seed(3)
    batch = SampleBatch([f"s{i}" for i in range(n)], [f"e0:{i}" for i in range(n)], {
        "prompt_lens": torch.full((n,), plen), "prompt_tokens": torch.randint(0, 999, (n * plen,), generator=g),
        "response_lens": torch.arange(n) + rlen,
        "response_tokens": torch.randint(0, 999, (n * rlen + n * (n - 1) // 2,), generator=g),
        "policy_version": torch.arange(n)})

    async def main():
        prod = make_transport("shm", "p", SECRET)
        cons = [make_transport("shm", f"c{i}", SECRET) for i in range(2)]
        shards = [BufferShard(1000) for _ in cons]
        for c, s in zip(cons, shards):
            c.set_handler(shard_receiver(s, put_timeout=10))
        for c in (prod, *cons):
            await c.start()
        try:
            eps = [Endpoint(c.node_id, "127.0.0.1", c.port) for c in cons]
            await scatter(prod, batch, eps, step=0, source_rank=0, timeout=10)
            assert prod.stats()["shm_zero_copy_sends"] == 2
            got = [await gather_step(s, 0, ["p"], timeout=10) for s in shards]
            for part, want in zip(got, split_by_owner(batch, 2)):
                assert part.sample_ids == want.sample_ids
                for k, t in want.tensors.items():
                    assert torch.equal(part.tensors[k], t), k
            assert sorted(i for p in got for i in p.sample_ids) == sorted(batch.sample_ids)

            # token balancing packs its parts the same way; a retry (``only``) sends just the named
            # consumer's part, the same part a full send would have given it
            parts = token_partition(batch.num_tokens(), 2)
            res = await scatter(prod, batch, eps, step=1, source_rank=0, timeout=10, balance="tokens")
            assert res["samples"] == [len(p) for p in parts] and res["bytes"] == batch.nbytes()
            res = await scatter(prod, batch, eps, step=2, source_rank=0, timeout=10, balance="tokens", only=[1])
            assert res["samples"] == [len(p) for p in parts]
            for step, takers in ((1, [0, 1]), (2, [1])):
                for k in takers:
                    part = await gather_step(shards[k], step, ["p"], timeout=10)
                    want = batch.select(parts[k])
                    assert part.sample_ids == want.sample_ids, (step, k)
                    for name, t in want.tensors.items():
                        assert torch.equal(part.tensors[name], t), (step, k, name)
            assert shards[0].steps_held() == {}  # consumer 0 got nothing for step 2
            assert cons[0].stats()["recv_msgs"] == 2 and cons[1].stats()["recv_msgs"] == 3
        finally:
            for c in (prod, *cons):
                await c.close()

    asyncio.run(main())


def test_parse_part_names_a_misrouted_sample_and_a_bad_step():
    """The consumer checks every sample of an owner-balanced part against its owner (by id)."""
    import torch

    from distflow.buffer.batch import SampleBatch
    from distflow.buffer.redistribute import parse_part
    from distflow.transport import Envelope

    ids = ["a", "b", "c", "d"]
    part = owner(ids[0], 2)
    mine = [s for s in ids if owner(s, 2) == part]
    other = next(s for s in ids if owner(s, 2) != part)

    def env(sids, step=3):
        b = SampleBatch.from_lists(sids, [f"e0:{i}" for i in range(len(sids))], [[1]] * len(sids), [[2, 3]] * len(sids))
        meta, tensors = b.to_wire()
        meta.update(step=step, source_rank=0, num_sources=1, part=part, num_parts=2, balance="owner")
        return Envelope("p0", "samples", meta, tensors)

    step, got = parse_part(env(mine))
    assert step == 3 and got.sample_ids == mine and got.tensors["response_tokens"].tolist() == [2, 3] * len(mine)
    with pytest.raises(ValueError, match=f"sample '{other}' from p0 was routed to consumer {part} of 2"):
        parse_part(env(mine + [other]))
    with pytest.raises(ValueError, match="'step' must be a non-negative int"):
        parse_part(env(mine, step=-1))
    assert torch.equal(got.tensors["prompt_lens"], torch.ones(len(mine), dtype=torch.int64))


def test_bench_message_smoke():
    """bench/message.py runs end to end (two real processes, the shm channel and the raw socket
    baseline) and ends with its JSON line of per-message CPU figures."""
    bench = Path(__file__).parent.parent / "bench" / "message.py"
    r = subprocess.run([sys.executable, str(bench), "--msgs", "40", "--rounds", "2"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    fig = json.loads(r.stdout.strip().splitlines()[-1])
    assert fig["transport"] == "shm" and fig["msgs"] == 40 and fig["rounds"] == 2
    for key in ("channel_tx_us", "channel_rx_us", "raw_tx_us", "raw_rx_us", "channel_vs_raw"):
        assert fig[key] > 0, key
