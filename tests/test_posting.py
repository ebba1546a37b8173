"""Same-host posting: parts as records in a consumer's shared-memory mailbox (transport/movers/posting.py).

Real shm channels, real mailboxes, locks and doorbell sockets; several channels in this process
where one process is enough, child processes where a death matters (a consumer killed while
producers post to it, a producer killed after posting). Every sample is counted by id and its
bytes compared.
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

import pytest
import torch

from distflow.buffer.batch import SampleBatch
from distflow.buffer.redistribute import ScatterError, gather_step, open_ingress, scatter, shard_receiver
from distflow.buffer.routing import owner
from distflow.buffer.shard import BufferShard
from distflow.transport import Endpoint, make_transport
from distflow.transport.ring import MAX_WRITERS, RING
from distflow.transport.movers.posting import MAC_OFF, NAME_OFF, REC, Inbox
from distflow.transport.shared_buffers import HEADER
from distflow.transport.arena import sweep_stale_segments

SECRET = "posting-test-secret-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[1]


def run(coro, timeout: float = 60.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def batch(node: str, step: int, n: int, seed: int) -> SampleBatch:
    """Uneven samples (empty responses too) with a bf16 per-token field and a bool per-sample one."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(1, 9, (n,), generator=g)
    rlens = torch.randint(0, 12, (n,), generator=g)
    r = int(rlens.sum())
    t = {"prompt_lens": plens, "prompt_tokens": torch.randint(0, 5000, (int(plens.sum()),), generator=g),
         "response_lens": rlens, "response_tokens": torch.randint(0, 5000, (r,), generator=g),
         "logprobs": -torch.rand(r, generator=g), "values": torch.randn(r, generator=g).to(torch.bfloat16),
         "truncated": torch.rand(n, generator=g) > 0.5, "policy_version": torch.full((n,), step)}
    return SampleBatch([f"{node}:{step}:{i}" for i in range(n)], [f"e0:{step}:{i}" for i in range(n)], t,
                       [{"i": i} for i in range(n)])


def samples(b: SampleBatch) -> dict[str, tuple]:
    """Per sample id: its tokens, logprobs, values (raw bits), flags and extras, exactly."""
    out = {}
    for k, sid in enumerate(b.sample_ids):
        sub = b.select([k])
        out[sid] = (sub.tensors["prompt_tokens"].tolist(), sub.tensors["response_tokens"].tolist(),
                    sub.tensors["logprobs"].tolist(), sub.tensors["values"].view(torch.int16).tolist(),
                    bool(sub.tensors["truncated"]), int(sub.tensors["policy_version"]), b.extras[k])
    return out


async def consumers(n: int, ingress: bool = True, first: int = 0, **kw) -> list[tuple]:
    out = []
    for j in range(first, first + n):
        ch = make_transport("shm", f"c{j}", SECRET, **kw)
        shard = BufferShard(1 << 16, name=f"c{j}")
        ch.set_handler(shard_receiver(shard, put_timeout=30))
        await ch.start()
        if ingress:
            assert open_ingress(ch, shard)
        out.append((ch, shard))
    return out


def ep(ch) -> Endpoint:
    return Endpoint(ch.node_id, ch.host, ch.port)


def test_every_posted_sample_arrives_once_byte_exact_and_buffers_are_reused():
    """3 producers -> 2 consumers for 6 steps, every part posted (no message), every sample once at its
    owner with its bytes; the producers' shared buffers are reused (released by the consumers' stores)."""

    async def main():
        cons = await consumers(2)
        prods = [make_transport("shm", f"p{i}", SECRET) for i in range(3)]
        for p in prods:
            await p.start()
        eps = [ep(c) for c, _ in cons]
        sent, got = {}, {}
        for step in range(6):
            for i, p in enumerate(prods):
                b = batch(p.node_id, step, [5, 9, 0][(i + step) % 3], seed=100 * step + i)
                sent.update(samples(b))
                r = await scatter(p, b, eps, step=step, source_rank=i, timeout=10, extra_meta={"tag": step})
                assert r["posted"] == 2
            for j, (_, shard) in enumerate(cons):
                taken = await gather_step(shard, step, [p.node_id for p in prods], timeout=10)
                for sid, v in samples(taken).items():
                    assert owner(sid, 2) == j and sid not in got
                    got[sid] = v
                del taken
        assert got == sent and len(sent) == 6 * 14
        for p in prods:
            st = p.stats()
            assert (st["sent_msgs"], st["mailbox"]["posts"]) == (0, 12)
            assert st["mailbox"]["shared_buffers"] == 1  # one buffer, reused every step
        for c, shard in cons:
            assert c.stats()["recv_msgs"] == 0 and c.stats()["mailbox"]["inboxes"]["samples"]["read"] == 18
            assert shard.stats()["posted_parts"] == 18 and shard.stats()["samples_held"] == 0
        for c in [*prods, *(c for c, _ in cons)]:
            await c.close()

    run(main())


def test_a_waiting_taker_is_woken_once_per_step():
    """The taker arms its mailbox for the step; of 4 producers' posts only the last rings its doorbell."""

    async def main():
        ((c, shard),) = await consumers(1)
        prods = [make_transport("shm", f"p{i}", SECRET) for i in range(4)]
        for p in prods:
            await p.start()
        srcs = [p.node_id for p in prods]
        for step in range(5):
            take = asyncio.create_task(gather_step(shard, step, srcs, timeout=10))
            await asyncio.sleep(0.05)  # the taker is asleep, armed
            for i, p in enumerate(prods):
                await scatter(p, batch(p.node_id, step, 3, i), [ep(c)], step=step, source_rank=i, timeout=10)
            assert len(await take) == 12
        assert sum(p.stats()["mailbox"]["rings_sent"] for p in prods) == 5
        assert c.stats()["mailbox"]["rings_received"] == 5
        for ch in [*prods, c]:
            await ch.close()

    run(main())


@pytest.mark.parametrize("message_first", [True, False])
def test_a_step_completed_by_a_message_and_a_post_wakes_the_taker(message_first):
    """Source A posts (same host, shm), source B sends a message (a zmq channel cannot post); whichever
    comes last, the waiting taker (no alive-polling) returns at once."""

    async def main():
        ((c, shard),) = await consumers(1)
        a, b = make_transport("shm", "a", SECRET), make_transport("zmq", "b", SECRET)
        await a.start()
        await b.start()
        take = asyncio.create_task(gather_step(shard, 0, ["a", "b"], timeout=20))
        await asyncio.sleep(0.05)
        order = [(b, 1), (a, 0)] if message_first else [(a, 0), (b, 1)]
        for ch, rank in order:
            await scatter(ch, batch(ch.node_id, 0, 4, rank), [ep(c)], step=0, source_rank=rank, timeout=10)
            await asyncio.sleep(0.05)
        t0 = time.monotonic()
        got = await take
        assert time.monotonic() - t0 < 1.0 and len(got) == 8
        assert a.stats()["mailbox"]["posts"] == 1 and b.stats()["sent_msgs"] == 1
        for ch in (a, b, c):
            await ch.close()

    run(main())


def test_a_full_ring_sends_the_rest_as_messages_and_nothing_is_lost():
    """A producer RING + 3 steps ahead of its consumer: a part that finds the ring full travels as a
    message; the consumer then takes every step, each sample once."""

    async def main():
        ((c, shard),) = await consumers(1)
        p = make_transport("shm", "p", SECRET)
        await p.start()
        sent = {}
        for step in range(RING + 3):
            b = batch("p", step, 2, step)
            sent.update(samples(b))
            await scatter(p, b, [ep(c)], step=step, source_rank=0, timeout=10)
        st = p.stats()
        # the part after RING posts finds the ring full and goes as a message; taking that message in, the
        # consumer's shard reads its mailbox, which frees the ring for the posts after it
        assert (st["mailbox"]["posts"], st["sent_msgs"], st["mailbox"]["posts_ring_full"]) == (RING + 2, 1, 1)
        got = {}
        for step in range(RING + 3):
            got.update(samples(await gather_step(shard, step, ["p"], timeout=10)))
        assert got == sent
        await p.close()
        await c.close()

    run(main())


def test_a_kept_part_holds_its_buffer_until_the_batch_dies():
    """One producer's part is taken zero-copy (views of its buffer): the producer's next step needs a
    second buffer while the first batch lives, and reuses the first once that batch is freed."""

    async def main():
        ((c, shard),) = await consumers(1)
        p = make_transport("shm", "p", SECRET)
        await p.start()
        await scatter(p, batch("p", 0, 6, 0), [ep(c)], step=0, source_rank=0, timeout=10)
        kept = await gather_step(shard, 0, ["p"], timeout=10)
        want = samples(batch("p", 0, 6, 0))
        await scatter(p, batch("p", 1, 6, 1), [ep(c)], step=1, source_rank=0, timeout=10)
        assert p.stats()["mailbox"]["shared_buffers"] == 2  # the first is still viewed by `kept`
        assert samples(kept) == want  # and was not overwritten
        del kept
        gc.collect()
        await gather_step(shard, 1, ["p"], timeout=10)
        for step in range(2, 6):
            await scatter(p, batch("p", step, 6, step), [ep(c)], step=step, source_rank=0, timeout=10)
            await gather_step(shard, step, ["p"], timeout=10)
        assert p.stats()["mailbox"]["shared_buffers"] == 2
        await p.close()
        await c.close()

    run(main())


def test_a_tampered_record_or_meta_is_dropped_and_counted():
    """A record whose fields, or whose meta in the producer's buffer, changed after posting fails its
    MAC: dropped and counted, never delivered."""

    async def main():
        ((c, shard),) = await consumers(1)
        p = make_transport("shm", "p", SECRET)
        await p.start()
        inbox: Inbox = c.open_mailbox("samples")
        await scatter(p, batch("p", 0, 3, 0), [ep(c)], step=0, source_rank=0, timeout=10)
        mm = inbox.mailbox._seg.mm
        from distflow.transport.ring import record_offset

        w = inbox.mailbox._active[0]
        off = record_offset(w, 0)
        mm[off + 8:off + 9] = bytes([mm[off + 8] ^ 1])  # the record's tag
        assert inbox.drain() == [] and inbox.counters["dropped_bad_mac"] == 1
        await scatter(p, batch("p", 1, 3, 1), [ep(c)], step=1, source_rank=0, timeout=10)
        rec = bytes(mm[record_offset(w, 1):record_offset(w, 1) + MAC_OFF])
        fields = REC.unpack_from(rec)
        name = rec[NAME_OFF:NAME_OFF + fields[-1]].decode()
        # (a second buffer: the first still waits for the release of the post the consumer dropped, since
        # an unverified record cannot be trusted to name the cell to release)
        (buf,) = [b for b in p.posting._shared.buffers if b.name == name]
        buf.mm[HEADER + fields[3]] ^= 1  # a byte of the meta blob in the shared buffer
        assert inbox.drain() == [] and inbox.counters["dropped_bad_mac"] == 2
        await p.close()
        await c.close()

    run(main())


def test_no_mailbox_means_messages_and_the_question_is_asked_again_later():
    """A consumer that opened no mailbox answers the introduction with none: parts travel as messages."""

    async def main():
        ((c, shard),) = await consumers(1, ingress=False)
        p = make_transport("shm", "p", SECRET)
        await p.start()
        for step in range(3):
            r = await scatter(p, batch("p", step, 2, step), [ep(c)], step=step, source_rank=0, timeout=10)
            assert r["posted"] == 0
            assert len(await gather_step(shard, step, ["p"], timeout=10)) == 2
        st = p.stats()
        assert (st["sent_msgs"], st["internal_msgs"], st["mailbox"]["posts"]) == (3, 1, 0)  # asked once
        await p.close()
        await c.close()

    run(main())


def test_writer_cells_run_out_cleanly_and_a_dead_writers_cell_is_reused():
    async def main():
        ch = make_transport("shm", "c", SECRET)
        await ch.start()
        inbox = ch.open_mailbox("samples")
        me = os.getpid(), Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19]
        cells = [inbox.register(f"p{i}", os.urandom(16), me[0], int(me[1])) for i in range(MAX_WRITERS)]
        assert sorted(cells) == list(range(MAX_WRITERS))
        assert inbox.register("late", os.urandom(16), me[0], int(me[1])) is None  # all cells have live writers
        inbox._writers[5].pid, inbox._writers[5].ticks = 0, 1  # writer 5's process is gone
        assert inbox.register("late", os.urandom(16), me[0], int(me[1])) == 5
        await ch.close()

    run(main())


CHILD = textwrap.dedent("""
    import asyncio, sys, json, signal, os
    import torch
    from distflow.buffer.redistribute import open_ingress, scatter, shard_receiver
    from distflow.buffer.shard import BufferShard
    from distflow.transport import Endpoint, make_transport
    sys.path.insert(0, sys.argv[3])
    from tests.test_posting import batch

    async def main():
        role = sys.argv[2]
        ch = make_transport("shm", role, sys.argv[1])
        await ch.start()
        if role == "consumer":
            shard = BufferShard(1000)
            ch.set_handler(shard_receiver(shard, put_timeout=30))
            open_ingress(ch, shard)
            print(json.dumps({"port": ch.port}), flush=True)
            await asyncio.sleep(3600)
        else:  # producer: post step 0 to the consumer named on stdin, say so, then wait to be killed
            port = int(sys.stdin.readline())
            r = await scatter(ch, batch("producer", 0, 5, 7), [Endpoint("consumer", "127.0.0.1", port)], step=0,
                              source_rank=0, timeout=10)
            print(json.dumps({"posted": r["posted"]}), flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main())
""")


def child(role: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, SECRET, role, str(ROOT)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)


def test_a_part_posted_by_a_producer_that_died_is_still_taken_intact():
    """The consumer mapped the producer's buffer when introduced: the producer's SIGKILL, and the sweep
    of its segment names, leave the posted part readable."""

    async def main():  # (the child addresses its consumer as "consumer")
        ch = make_transport("shm", "consumer", SECRET)
        shard = BufferShard(1000)
        ch.set_handler(shard_receiver(shard, put_timeout=30))
        await ch.start()
        assert open_ingress(ch, shard)
        proc = child("producer")
        try:
            proc.stdin.write(f"{ch.port}\n")
            proc.stdin.flush()
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
            assert '"posted": 1' in line, line
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        await asyncio.sleep(2.1)
        sweep_stale_segments(0.0)
        got = await gather_step(shard, 0, ["producer"], timeout=10)
        assert samples(got) == samples(batch("producer", 0, 5, 7))
        await ch.close()

    run(main())


def test_a_dead_consumer_is_not_posted_to():
    """After the consumer's SIGKILL the producer's next scatter notices its mailbox has no owner and
    falls back to a message, which fails naming the consumer: the part is not silently 'delivered'."""

    async def main():
        proc = child("consumer")
        p = make_transport("shm", "p", SECRET)
        await p.start()
        try:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
            import json

            peer = Endpoint("consumer", "127.0.0.1", json.loads(line)["port"])
            r = await scatter(p, batch("p", 0, 3, 0), [peer], step=0, source_rank=0, timeout=10)
            assert r["posted"] == 1
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        await asyncio.sleep(0.6)  # past ALIVE_CHECK_S: the next post probes the owner
        with pytest.raises(ScatterError, match="consumer"):
            await scatter(p, batch("p", 1, 3, 1), [peer], step=1, source_rank=0, timeout=3)
        assert p.stats()["mailbox"]["posts_owner_gone"] == 1
        await p.close()

    run(main())


def test_a_scatter_posts_to_local_consumers_and_sends_to_the_others():
    """Consumers 0 and 2 take posts, 1 has no mailbox and 3 is reached over TCP only (another 'host'):
    one step's four parts go two ways, every sample still once, at its owner, byte-exact."""

    async def main():
        cons = (await consumers(1) + await consumers(1, ingress=False, first=1) + await consumers(1, first=2)
                + await consumers(1, first=3, host="127.0.0.2"))  # (loopback, but not this channel's address)
        p = make_transport("shm", "p", SECRET)
        await p.start()
        eps = [ep(c) for c, _ in cons]
        assert not p.is_local(eps[3])
        sent, got = {}, {}
        for step in range(3):
            b = batch("p", step, 23, step)
            sent.update(samples(b))
            r = await scatter(p, b, eps, step=step, source_rank=0, timeout=10)
            assert r["posted"] == 2 and sum(r["samples"]) == 23
        for j, (_, shard) in enumerate(cons):
            for step in range(3):
                for sid, v in samples(await gather_step(shard, step, ["p"], timeout=10)).items():
                    assert owner(sid, 4) == j and sid not in got
                    got[sid] = v
        assert got == sent
        await p.close()
        for c, _ in cons:
            await c.close()

    run(main())


def test_parts_of_discarded_or_duplicate_steps_are_released():
    """A resumed consumer discards steps below its start; a part posted twice is kept once: what the
    shard drops goes back to its producer, whose buffer is reused (one buffer for the whole run)."""

    async def main():
        ((c, shard),) = await consumers(1)
        p = make_transport("shm", "p", SECRET)
        await p.start()
        for step in range(3):
            await scatter(p, batch("p", step, 4, step), [ep(c)], step=step, source_rank=0, timeout=10)
        assert p.stats()["mailbox"]["shared_buffers"] == 3  # three steps in flight, none taken yet
        assert await shard.discard_before(2) == 2  # steps 0 and 1, read from the mailbox first
        assert len(await gather_step(shard, 2, ["p"], timeout=10)) == 4
        gc.collect()
        await scatter(p, batch("p", 3, 4, 3), [ep(c)], step=3, source_rank=0, timeout=10)
        await scatter(p, batch("p", 3, 4, 3), [ep(c)], step=3, source_rank=0, timeout=10)  # a repeat
        got = await gather_step(shard, 3, ["p"], timeout=10)
        assert len(got) == 4 and shard.stats()["posts_refused"] == 1  # (DuplicatePartError, logged)
        del got
        gc.collect()
        for step in range(4, 8):
            await scatter(p, batch("p", step, 4, step), [ep(c)], step=step, source_rank=0, timeout=10)
            await gather_step(shard, step, ["p"], timeout=10)
        assert p.stats()["mailbox"]["shared_buffers"] == 3  # the discarded, repeated and taken parts came back
        await p.close()
        await c.close()

    run(main())


def test_two_takers_of_different_steps_are_both_woken():
    async def main():
        ((c, shard),) = await consumers(1)
        p = make_transport("shm", "p", SECRET)
        await p.start()
        takes = [asyncio.create_task(gather_step(shard, s, ["p"], timeout=10)) for s in (1, 0)]
        await asyncio.sleep(0.05)
        for step in (0, 1):
            await scatter(p, batch("p", step, 3, step), [ep(c)], step=step, source_rank=0, timeout=10)
        t0 = time.monotonic()
        assert [len(b) for b in await asyncio.gather(*takes)] == [3, 3]
        assert time.monotonic() - t0 < 1.0
        await p.close()
        await c.close()

    run(main())
