"""BufferShard: step assembly, capacity/backpressure, staleness, dead sources; owner routing.

(The cross-process backpressure test, producers in real processes, is in test_redistribute.py.)
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from distflow.buffer.batch import SampleBatch
from distflow.buffer.routing import balance_by_tokens, owner, split_by_owner, token_partition
from distflow.buffer.shard import BufferShard, DuplicatePartError, SourceLostError, StaleSampleError


def make_batch(prefix: str, n: int, version: int = 0, start: int = 0) -> SampleBatch:
    ids = [f"{prefix}{i}" for i in range(start, start + n)]
    return SampleBatch.from_lists(ids, [f"e0:{i}" for i in range(start, start + n)],
                                  [[i, i + 1] for i in range(n)], [[7] * (i % 3) for i in range(n)],
                                  logprobs=[[-0.5] * (i % 3) for i in range(n)], policy_version=version)


def run(coro, timeout: float = 20.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


# ---------------------------------------------------------------------------------------- routing
def test_owner_is_stable_and_hand_checked():
    import hashlib

    sid = "e0:17/s3"
    h = int.from_bytes(hashlib.blake2b(sid.encode(), digest_size=8).digest(), "little")
    assert owner(sid, 5) == h % 5
    assert [owner("a", 1), owner("a", 1)] == [0, 0]
    # pinned values: any change to the hash would re-route every run's data
    assert [owner(f"s{i}", 3) for i in range(16)] == [2, 2, 2, 0, 2, 2, 2, 2, 0, 0, 0, 1, 0, 2, 1, 0]
    with pytest.raises(ValueError, match="positive int"):
        owner("x", 0)
    with pytest.raises(TypeError, match="must be a str"):
        owner(5, 2)


def test_owner_spreads_ids_roughly_evenly():
    counts = [0] * 4
    for i in range(4000):
        counts[owner(f"sample-{i}", 4)] += 1
    assert all(850 < c < 1150 for c in counts), counts


def test_split_by_owner_sends_each_sample_to_its_owner_once():
    b = make_batch("x", 23)
    parts = split_by_owner(b, 3)
    assert len(parts) == 3
    seen = [sid for p in parts for sid in p.sample_ids]
    assert sorted(seen) == sorted(b.sample_ids)
    for r, p in enumerate(parts):
        assert all(owner(s, 3) == r for s in p.sample_ids)
        idx = [b.sample_ids.index(s) for s in p.sample_ids]
        assert idx == sorted(idx)  # order kept
        for s, resp in zip(p.sample_ids, p.ragged("response_tokens")):
            assert resp.tolist() == b.ragged("response_tokens")[b.sample_ids.index(s)].tolist()
    empty = split_by_owner(SampleBatch.empty(), 2)
    assert [len(p) for p in empty] == [0, 0]


def test_token_partition_is_greedy_longest_first():
    # hand-computed: 9->p0, 7->p1, 6->p2, 5->p2(6), 4->p1(7), 3->p0(9)... loads 12, 11, 11
    parts = token_partition([3, 9, 4, 7, 6, 5], 3)
    assert parts == [[0, 1], [2, 3], [4, 5]]
    assert token_partition([5, 5, 5], 2) == [[0, 2], [1]]  # ties: lower index first, lightest part
    b = make_batch("t", 10)
    halves = balance_by_tokens(b, 2)
    tok = [int(h.num_tokens().sum()) for h in halves]
    assert sum(tok) == int(b.num_tokens().sum()) and abs(tok[0] - tok[1]) <= 2


# ---------------------------------------------------------------------------------------- shard
def test_a_second_copy_waits_for_the_first_and_takes_its_place_when_it_gives_up():
    """A re-sent part that arrives while the first copy still waits for room is not dropped as a
    duplicate at once: if the first copy then times out (its sender may be dead, so nobody would
    re-send), the second is stored; if the first is stored, the second is the duplicate."""
    async def main():
        s = BufferShard(2)
        await s.put(make_batch("a", 2), step=1, source="shard-0", timeout=1)  # full
        first = asyncio.create_task(s.put(make_batch("x", 2), step=2, source="shard-1", timeout=0.3))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(s.put(make_batch("x", 2), step=2, source="shard-1", timeout=5))
        with pytest.raises(TimeoutError, match="for capacity"):
            await first
        await asyncio.sleep(0.05)
        assert not second.done()  # now waiting for room itself
        assert (await s.take_step(1, ["shard-0"], timeout=1)).sample_ids == ["a0", "a1"]
        await asyncio.wait_for(second, 1)
        assert (await s.take_step(2, ["shard-1"], timeout=1)).sample_ids == ["x0", "x1"]
        # the first copy stored: the waiting second one is the duplicate
        await s.put(make_batch("b", 2), step=3, source="shard-0", timeout=1)
        first = asyncio.create_task(s.put(make_batch("y", 2), step=4, source="shard-1", timeout=5))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(s.put(make_batch("y", 2), step=4, source="shard-1", timeout=5))
        await asyncio.sleep(0.05)
        await s.take_step(3, ["shard-0"], timeout=1)
        await asyncio.wait_for(first, 1)
        with pytest.raises(DuplicatePartError):
            await asyncio.wait_for(second, 1)

    run(main())


def test_discard_before_frees_the_steps_a_resumed_run_never_takes():
    """A resumed run starts at its checkpoint's step S: parts of steps below S sent before the
    rollout nodes knew it are dropped (their capacity freed), and a later copy is a duplicate."""
    async def main():
        s = BufferShard(6)
        for step in (0, 1, 2):
            await s.put(make_batch(f"s{step}", 2), step=step, source="shard-0", timeout=1)
        assert s.stats()["samples_held"] == 6
        waiting = asyncio.create_task(s.put(make_batch("x", 2), step=3, source="shard-0", timeout=5))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # full
        assert await s.discard_before(2) == 2
        await asyncio.wait_for(waiting, 1)  # the freed room let it in
        assert s.steps_held() == {2: ["shard-0"], 3: ["shard-0"]} and s.stats()["samples_held"] == 4
        with pytest.raises(DuplicatePartError):
            await s.put(make_batch("s0", 2), step=0, source="shard-0", timeout=1)
        assert (await s.take_step(2, ["shard-0"], timeout=1)).sample_ids == ["s20", "s21"]
        assert await s.discard_before(2) == 0

    run(main())


def test_take_step_concatenates_parts_in_sorted_source_order():
    async def main():
        s = BufferShard(100)
        await s.put(make_batch("c", 2), step=0, source="node-c", timeout=1)
        await s.put(make_batch("a", 3), step=0, source="node-a", timeout=1)
        await s.put(SampleBatch.empty(), step=0, source="node-b", timeout=1)  # an empty part still counts
        await s.put(make_batch("n", 1), step=1, source="node-a", timeout=1)
        assert s.stats()["samples_held"] == 6 and s.steps_held() == {0: ["node-a", "node-b", "node-c"], 1: ["node-a"]}
        got = await s.take_step(0, ["node-c", "node-a", "node-b"], timeout=1)
        assert got.sample_ids == ["a0", "a1", "a2", "c0", "c1"]
        st = s.stats()
        assert (st["in"], st["out"], st["samples_held"], st["parts_held"]) == (6, 5, 1, 1)
        assert st["bytes_held"] == make_batch("n", 1).nbytes()

    run(main())


def test_duplicate_parts_are_rejected():
    async def main():
        s = BufferShard(10)
        await s.put(make_batch("a", 1), step=3, source="p", timeout=1)
        with pytest.raises(DuplicatePartError, match="duplicate part for step 3 from 'p'"):
            await s.put(make_batch("a", 1), step=3, source="p", timeout=1)
        await s.take_step(3, ["p"], timeout=1)
        with pytest.raises(DuplicatePartError, match="duplicate part for step 3 from 'p'"):
            await s.put(make_batch("a", 1), step=3, source="p", timeout=1)
        with pytest.raises(ValueError, match="already taken"):
            await s.take_step(3, ["p"], timeout=1)

    run(main())


def test_full_shard_makes_the_producer_wait_then_admits_it():
    async def main():
        s = BufferShard(4)
        await s.put(make_batch("a", 2), step=0, source="p", timeout=1)
        await s.put(make_batch("b", 2), step=1, source="p", timeout=1)
        blocked = asyncio.create_task(s.put(make_batch("c", 2), step=2, source="p", timeout=5), name="put-2")
        await asyncio.sleep(0.1)
        assert not blocked.done() and s.stats()["waiting"] == 1
        got = await s.take_step(0, ["p"], timeout=1)
        assert got.sample_ids == ["a0", "a1"]
        await asyncio.wait_for(blocked, 1)
        assert s.stats()["waiting"] == 0 and s.stats()["samples_held"] == 4

    run(main())


def test_put_timeout_names_step_and_source():
    async def main():
        s = BufferShard(2)
        await s.put(make_batch("a", 2), step=0, source="p", timeout=1)
        with pytest.raises(TimeoutError, match=r"step 1 from 'q' \(1 samples\) waited 0.2s.*2/2"):
            await s.put(make_batch("b", 1), step=1, source="q", timeout=0.2)
        assert s.stats()["waiting"] == 0
        # the failed put left no trace: the same (step, source) can be retried once there is room
        await s.take_step(0, ["p"], timeout=1)
        await s.put(make_batch("b", 1), step=1, source="q", timeout=1)

    run(main())


def test_part_larger_than_capacity_enters_an_empty_shard():
    async def main():
        s = BufferShard(3)
        await s.put(make_batch("big", 10), step=0, source="p", timeout=1)
        assert s.stats()["samples_held"] == 10
        with pytest.raises(TimeoutError):
            await s.put(make_batch("x", 1), step=1, source="p", timeout=0.1)

    run(main())


def test_parts_of_the_awaited_step_enter_even_over_capacity():
    """Capacity smaller than a step must not deadlock: it bounds read-ahead, not the current step."""

    async def main():
        s = BufferShard(2)
        puts = [asyncio.create_task(s.put(make_batch(f"{src}-", 2), step=0, source=src, timeout=5),
                                    name=f"put-{src}") for src in ("p0", "p1", "p2")]
        await asyncio.sleep(0.05)
        assert s.stats()["waiting"] == 2
        got = await s.take_step(0, ["p0", "p1", "p2"], timeout=2)
        assert len(got) == 6
        await asyncio.gather(*puts)

    run(main())


def test_take_step_timeout_names_missing_sources():
    async def main():
        s = BufferShard(10)
        await s.put(make_batch("a", 1), step=5, source="p0", timeout=1)
        with pytest.raises(TimeoutError, match=r"step 5 incomplete after 0.2s; missing parts from \['p1', 'p2'\]"):
            await s.take_step(5, ["p0", "p1", "p2"], timeout=0.2)
        assert s.stats()["samples_held"] == 1  # nothing was consumed

    run(main())


def test_dead_source_is_reported_without_waiting_for_the_deadline():
    async def main():
        s = BufferShard(10)
        await s.put(make_batch("a", 1), step=0, source="p0", timeout=1)
        dead = {"p1"}
        t0 = time.monotonic()
        with pytest.raises(SourceLostError, match=r"\['p1'\] died") as ei:
            await s.take_step(0, ["p0", "p1"], timeout=30, alive=lambda n: n not in dead)
        assert time.monotonic() - t0 < 1.0
        assert ei.value.dead == ["p1"] and ei.value.missing == ["p1"]

        # a source dying *while* we wait is noticed too
        alive = {"p2": True}
        waiter = asyncio.create_task(s.take_step(1, ["p2"], timeout=30, alive=lambda n: alive[n]), name="take-1")
        await asyncio.sleep(0.1)
        alive["p2"] = False
        with pytest.raises(SourceLostError):
            await asyncio.wait_for(waiter, 1)

    run(main())


def test_stale_samples_are_rejected_and_counted():
    async def main():
        s = BufferShard(10)
        old = make_batch("old", 2, version=3)
        new = make_batch("new", 2, version=5)
        await s.put(old, step=0, source="a", timeout=1)
        await s.put(new, step=0, source="b", timeout=1)
        with pytest.raises(StaleSampleError, match=r"2 sample\(s\) have policy_version < 4: \['old0', 'old1'\]") as ei:
            await s.take_step(0, ["a", "b"], timeout=1, min_version=4)
        assert ei.value.stale_ids == ["old0", "old1"] and len(ei.value.batch) == 4  # nothing lost
        assert s.stats()["stale_rejected"] == 2 and s.stats()["samples_held"] == 0
        await s.put(make_batch("ok", 2, version=4), step=1, source="a", timeout=1)
        assert len(await s.take_step(1, ["a"], timeout=1, min_version=4)) == 2

    run(main())


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        BufferShard(0)

    async def main():
        s = BufferShard(3)
        with pytest.raises(TypeError, match="expects a SampleBatch"):
            await s.put({"x": torch.ones(1)}, step=0, source="a", timeout=1)
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            await s.put(make_batch("a", 1), step=-1, source="a", timeout=1)
        with pytest.raises(TypeError, match="not a single str"):
            await s.take_step(0, "a", timeout=1)

    run(main())


def test_packer_writes_parts_into_given_memory_and_matches_select():
    """Each part lands packed in its own buffer (fields 64-byte aligned views of it), bfloat16 and
    empty groups included, round-trips through the wire form and equals ``select``; a part whose
    allocator gives nothing is packed into private memory."""
    from distflow.buffer.batch import PACKED, PackedPart
    from distflow.buffer.routing import Packer, owner_groups, owners

    lens_p, lens_r = [2, 0, 3, 1, 4], [1, 3, 0, 2, 2]
    b = SampleBatch([f"q{i}" for i in range(5)], [f"e0:{i}" for i in range(5)], {
        "prompt_lens": torch.tensor(lens_p), "prompt_tokens": torch.arange(10),
        "response_lens": torch.tensor(lens_r), "response_tokens": torch.arange(100, 108),
        "logprobs": torch.arange(8, dtype=torch.bfloat16) / 4, "reward": torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5]),
        "truncated": torch.tensor([True, False, True, False, False])})
    assert owners(b.sample_ids, 3) == [owner(s, 3) for s in b.sample_ids]
    groups = [[4, 1], [], [0, 2, 3]]  # any order, an empty group too
    bufs = [torch.zeros(1024, dtype=torch.uint8), None, torch.zeros(1024, dtype=torch.uint8)]
    packer = Packer(b)
    packed = [packer.pack(g, lambda n, k=k: None if bufs[k] is None else bufs[k][:n]) for k, g in enumerate(groups)]
    for p, g, buf in zip(packed, groups, bufs):
        assert isinstance(p, PackedPart) and len(p) == len(g)
        meta, tensors = p.to_wire()
        assert list(tensors) == [PACKED] and meta[PACKED] == p.layout
        part = SampleBatch.from_wire(meta, tensors)
        want = b.select(g)
        assert part.sample_ids == want.sample_ids and part.prompt_ids == want.prompt_ids
        assert list(part.tensors) == list(want.tensors)
        assert p.nbytes() == want.nbytes()
        for name, t in want.tensors.items():
            assert part.tensors[name].dtype == t.dtype and torch.equal(part.tensors[name], t), name
            if buf is not None and t.numel():  # a view of the given memory, 64-byte aligned
                off = part.tensors[name].data_ptr() - buf.data_ptr()
                assert 0 <= off < 1024 and off % 64 == 0, name
    parts = [p.to_batch() for p in packed]
    # hand-checked: part 0 = samples 4, 1 -> prompt tokens [6..9] + [] ; responses [106, 107] + [101, 102, 103]
    assert parts[0].tensors["prompt_tokens"].tolist() == [6, 7, 8, 9]
    assert parts[0].tensors["response_tokens"].tolist() == [106, 107, 101, 102, 103]
    assert parts[0].tensors["logprobs"].tolist() == [1.5, 1.75, 0.25, 0.5, 0.75]
    assert parts[2].tensors["truncated"].tolist() == [True, True, False]
    assert packed[0].layout[0] == ["prompt_lens", "int64", 0, 2]
    assert [len(Packer(b).pack(g)) for g in owner_groups(b, 2)] == [len(g) for g in owner_groups(b, 2)]


def test_packed_wire_form_rejects_bad_layouts():
    """A packed part's layout is untrusted: each malformed form is a ValueError naming the problem."""
    from distflow.buffer.batch import PACKED

    buf = torch.zeros(256, dtype=torch.uint8)
    ok = [["prompt_lens", "int64", 0, 1], ["prompt_tokens", "int64", 64, 2],
          ["response_lens", "int64", 128, 1], ["response_tokens", "int64", 192, 0]]
    meta = {"sample_ids": ["a"], "prompt_ids": ["e0:0"], PACKED: ok}
    buf[0] = 2
    assert SampleBatch.from_wire(meta, {PACKED: buf}).tensors["prompt_tokens"].tolist() == [0, 0]
    bad = {
        "past the end": [*ok[:3], ["response_tokens", "int64", 256, 1]],
        "misaligned": [*ok[:3], ["response_tokens", "int64", 193, 0]],
        "unknown dtype": [*ok[:3], ["response_tokens", "complex32", 192, 0]],
        "repeated": [*ok, ["prompt_lens", "int64", 0, 1]],
        "negative": [*ok[:3], ["response_tokens", "int64", 192, -1]],
        "not an entry": [*ok, "x"],
    }
    for why, layout in bad.items():
        with pytest.raises(ValueError, match="packed"):
            SampleBatch.from_wire({**meta, PACKED: layout}, {PACKED: buf})
    with pytest.raises(ValueError, match="one tensor"):
        SampleBatch.from_wire(meta, {PACKED: buf, "x": buf})
    with pytest.raises(ValueError, match="uint8"):
        SampleBatch.from_wire(meta, {PACKED: buf.view(torch.int64)})
    with pytest.raises(ValueError, match="expected 2 flat values"):  # the layout fits, the lengths do not
        SampleBatch.from_wire({**meta, PACKED: [*ok[:1], ["prompt_tokens", "int64", 64, 3], *ok[2:]]},
                              {PACKED: buf})


def test_owners_rejects_non_str_ids():
    from distflow.buffer.routing import owners

    with pytest.raises(TypeError, match="sample_id must be a str"):
        owners(["a", 3], 2)


def test_take_step_deadline_runs_from_the_producers_last_progress():
    """A producer busy with something that moves (a rollout node evaluating held-out prompts,
    gossiping each chunk) extends the wait; one that stops moving fails it within a timeout."""

    async def main():
        shard = BufferShard(1000)
        ticks = [0]

        async def busy_then_send(moves: int, step: int | None):
            for _ in range(moves):
                await asyncio.sleep(0.15)
                ticks[0] += 1
            if step is not None:
                await shard.put(make_batch("p", 2), step=step, source="a", timeout=5)

        t0 = time.monotonic()
        producer = asyncio.create_task(busy_then_send(8, 0), name="busy-producer")  # 1.2 s of progress
        asked: list[list[str]] = []
        got = await shard.take_step(0, ["a"], timeout=0.4,
                                    progress=lambda missing: asked.append(missing) or ticks[0])
        assert asked and all(m == ["a"] for m in asked)  # asked about the parts still missing
        assert len(got) == 2 and time.monotonic() - t0 > 1.0
        await producer
        stuck = asyncio.create_task(busy_then_send(2, None), name="stuck-producer")  # moves for 0.3 s, then stops
        t1 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"step 1 incomplete after \d+s, the last 0.4s without progress"):
            await shard.take_step(1, ["a"], timeout=0.4, progress=lambda missing: ticks[0])
        assert time.monotonic() - t1 < 1.5  # 0.3 s of moves + at most two timeouts
        await stuck
        with pytest.raises(TimeoutError, match="step 2 incomplete after 0.3s;"):  # without progress: the plain deadline
            await shard.take_step(2, ["a"], timeout=0.3)

    run(main())


def test_a_shard_is_covered_by_its_owner_else_the_next_alive_node_in_ring_order():
    from distflow.runtime import shard_cover

    ids = ["r0", "r1", "r2"]
    up = {"r0", "r2"}
    assert [shard_cover(ids, up.__contains__, s) for s in range(3)] == ["r0", "r2", "r2"]
    assert [shard_cover(ids, {"r1"}.__contains__, s) for s in range(3)] == ["r1", "r1", "r1"]
    assert shard_cover(ids, set().__contains__, 0) is None
