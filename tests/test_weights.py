"""Weight publication: bucketed, versioned, full or delta, over real channels.

The multi-process test runs the rollout side (channel + WeightInbox + a weight dict applied
in place, as an engine does) in a spawned process and the trainer side (WeightPublisher) here,
over shm and over zmq: a delta version sends exactly the changed tensors' bytes and the rollout
ends with the trainer's weights. In-process tests (two real channels on loopback) cover the
fallbacks: a peer that restarted or refused a delta gets a full version; a peer too far
behind gets a full version; a rank serving nobody drains the bucket generator.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing

import pytest
import torch

from distflow.transport import Endpoint, Envelope, make_transport
from distflow.weights import WeightInbox, WeightPublisher, buckets

SECRET = "test-weights-secret-0123456789abcdef"
T_BYTES = 64 << 10  # each toy tensor: 16384 fp32 = 64 KiB
NAMES = [f"layer{i}.weight" for i in range(6)]


def weights(version: int, changed: dict[int, list[int]]) -> dict[str, torch.Tensor]:
    """Deterministic weights of ``version``: tensor i was last rewritten at the latest v <= version
    whose changed list has i (all of them at v1)."""
    out = {}
    for i, n in enumerate(NAMES):
        last = max(v for v in range(1, version + 1) if v == 1 or i in changed.get(v, []))
        out[n] = torch.full((T_BYTES // 4,), float(last * 100 + i))
    return out


def _rollout_main(kind: str, q_out, q_in, out_path: str) -> None:
    from distflow.core.aio import run_loop

    torch.set_num_threads(1)

    async def main() -> None:
        ch = make_transport(kind, "rollout", SECRET)
        inbox = WeightInbox()
        ch.set_handler(inbox.receive)
        await ch.start()
        engine = {n: torch.zeros(T_BYTES // 4) for n in NAMES}  # the engine's weights, applied in place
        q_out.put(ch.port)
        loop = asyncio.get_running_loop()
        target = await loop.run_in_executor(None, q_in.get)
        while True:
            await inbox.wait_for(inbox.version + 1 if inbox.version < target else target, 60, lambda: None)
            upd = inbox.take_update()
            if upd is not None:
                names = set()
                for b in upd.buckets:  # bucket by bucket, never merged into one dict
                    for n, t in b.items():
                        engine[n].copy_(t)
                        names.add(n)
                if not upd.is_delta:
                    assert names == set(NAMES)
            if inbox.version >= target and inbox.pending is None:
                break
        torch.save({"weights": engine, "version": inbox.version, "received": dict(inbox.received),
                    "bytes": inbox.received_bytes}, out_path)
        q_out.put("saved")
        await ch.close()

    run_loop(main())


@pytest.mark.parametrize("kind", ["shm", "zmq"])
def test_delta_versions_send_only_changed_tensors_between_processes(kind: str, tmp_path) -> None:
    ctx = multiprocessing.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    out = str(tmp_path / "rollout.pt")
    proc = ctx.Process(target=_rollout_main, args=(kind, q_out, q_in, out), daemon=True)
    proc.start()
    changed = {2: [3], 3: [0, 5]}
    try:
        port = q_out.get(timeout=60)
        q_in.put(3)

        async def trainer() -> dict:
            ch = make_transport(kind, "trainer", SECRET)
            await ch.start()
            pub = WeightPublisher(ch, ["rollout"], lambda _: Endpoint("rollout", "127.0.0.1", port),
                                  lambda _: True, timeout=30, sync="delta", bucket_bytes=2 * T_BYTES)
            per_version = []
            try:
                for v in (1, 2, 3):
                    before = pub.stats["bytes"]
                    pub.offer(v, weights(v, changed))
                    await pub.flush(60)
                    assert pub.sent["rollout"] == v
                    per_version.append(pub.stats["bytes"] - before)
                return {"per_version": per_version, "stats": dict(pub.stats)}
            finally:
                await pub.close()
                await ch.close()

        res = asyncio.run(trainer())
        assert q_out.get(timeout=60) == "saved"
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    # v1 in full (6 tensors), v2 one changed tensor, v3 two
    assert res["per_version"] == [6 * T_BYTES, 1 * T_BYTES, 2 * T_BYTES]
    assert res["stats"]["full_versions"] == 1 and res["stats"]["delta_versions"] == 2
    got = torch.load(out)
    assert got["version"] == 3 and got["received"] == {"full": 1, "delta": 2}
    assert got["bytes"] == 9 * T_BYTES
    expect = weights(3, changed)
    for n in NAMES:
        assert torch.equal(got["weights"][n], expect[n]), n


async def _pair(kind: str = "zmq"):
    a, b = make_transport(kind, "trainer", SECRET), make_transport(kind, "rollout", SECRET)
    await a.start()
    await b.start()
    return a, b


@contextlib.asynccontextmanager
async def _serving(handler, *, kind: str = "zmq", alive: bool = True, **kw):
    """A publisher on real channels serving one peer, "rollout", whose handler is ``handler``
    (``alive``: what the publisher is told of it)."""
    a, b = await _pair(kind)
    b.set_handler(handler)
    pub = WeightPublisher(a, ["rollout"], lambda _: Endpoint("rollout", "127.0.0.1", b.port), lambda _: alive, **kw)
    try:
        yield pub
    finally:
        await pub.close()
        await a.close()
        await b.close()


def _idle_publisher(sync: str):
    """A publisher on real shm channels whose one peer is down: nothing reads a version once
    it is published, so what the publisher itself holds on to can be checked."""
    return _serving(WeightInbox().receive, kind="shm", alive=False, timeout=10, sync=sync)


def test_full_sync_buckets_and_inbox_keeps_them_unmerged() -> None:
    async def main() -> None:
        a, b = await _pair()
        inbox = WeightInbox()
        b.set_handler(inbox.receive)
        pub = WeightPublisher(a, ["rollout"], lambda _: Endpoint("rollout", "127.0.0.1", b.port),
                              lambda _: True, timeout=10, bucket_bytes=2 * T_BYTES)
        try:
            pub.offer(1, weights(1, {}))
            await pub.flush(10)
            upd = inbox.take_update()
            assert upd is not None and upd.version == 1 and not upd.is_delta
            assert [list(x) for x in upd.buckets] == [NAMES[0:2], NAMES[2:4], NAMES[4:6]]
            assert pub.stats["messages"] == 4  # three buckets and the commit
            pub.offer(2, weights(2, {2: [1]}))  # full mode: everything again
            await pub.flush(10)
            assert pub.stats["bytes"] == 12 * T_BYTES
            v, merged = inbox.take()
            assert v == 2 and list(merged) == NAMES and merged[NAMES[1]][0].item() == 201.0
            assert inbox.take() is None
        finally:
            await pub.close()
            await a.close()
            await b.close()

    asyncio.run(main())


def test_restarted_peer_or_refused_delta_gets_a_full_version() -> None:
    async def main() -> None:
        a, b = await _pair()
        inbox = WeightInbox()
        b.set_handler(lambda env: inbox.receive(env))
        pub = WeightPublisher(a, ["rollout"], lambda _: Endpoint("rollout", "127.0.0.1", b.port),
                              lambda _: True, timeout=10, sync="delta", bucket_bytes=2 * T_BYTES)
        changed = {2: [0], 3: [1], 4: [2]}
        try:
            pub.offer(1, weights(1, changed))
            await pub.flush(10)
            pub.offer(2, weights(2, changed))
            await pub.flush(10)
            assert pub.stats["full_versions"] == 1 and pub.stats["delta_versions"] == 1
            # the rollout restarts with fresh weights (version 0) unnoticed: the delta is refused by
            # name, and the next attempt is a full version
            inbox = WeightInbox()
            pub.offer(3, weights(3, changed))
            await pub.flush(15)
            assert pub.sent["rollout"] == 3 and pub.stats["full_versions"] == 2
            upd = inbox.take_update()
            assert upd.version == 3 and not upd.is_delta
            # announced restart: peer_up -> full version, no delta attempt
            inbox = WeightInbox()
            pub.peer_up("rollout")
            await pub.flush(10)
            assert pub.stats["full_versions"] == 3 and inbox.take_update().version == 3
            pub.offer(4, weights(4, changed))
            await pub.flush(10)
            upd = inbox.take_update()
            assert upd.is_delta and [n for bk in upd.buckets for n in bk] == [NAMES[2]]
        finally:
            await pub.close()
            await a.close()
            await b.close()

    asyncio.run(main())


def test_a_peer_whose_tier_changed_still_gets_every_version() -> None:
    """A peer's tier follows what the mesh says of it (device, GPU, host), which changes when a
    peer unknown at start shows up, or restarts elsewhere. The publisher decided where to keep
    buckets once, at start: a peer that became ``cuda_ipc`` was handed host buckets, export_ipc
    refused them, and the send was retried every 0.5 s for ever. Now each version is staged for
    the tiers of that moment, and host buckets go to an IPC peer through the channel."""
    async def main() -> None:
        tier = {"rollout": "channel"}
        inbox = WeightInbox()
        async with _serving(inbox.receive, kind="shm", timeout=10, transport_of=lambda p: tier[p],
                            bucket_bytes=2 * T_BYTES) as pub:
            assert pub._need_host and not pub._keep_device
            pub.offer(1, weights(1, {}))
            await pub.flush(10)
            assert inbox.take_update().version == 1
            tier["rollout"] = "cuda_ipc"  # known now to share the trainer's GPU; the buckets are host ones
            pub.offer(2, weights(2, {2: [1]}))
            assert pub._keep_device and not pub._need_host
            await pub.flush(10)
            assert pub.sent["rollout"] == 2
            v, got = inbox.take()
            assert v == 2 and list(got) == NAMES and got[NAMES[1]][0].item() == 201.0

    asyncio.run(main())


def test_a_peer_gone_from_the_mesh_does_not_stop_publishing() -> None:
    """A peer's tier is looked up per version. The trainer's lookup raises for a member the mesh
    has dropped (PeerLostError, 5 minutes after a death): that must not fail ``begin`` (the rank
    would skip the gather's collectives, and its peers would hang in them). The plan of the last
    version that resolved stands; the sends to that peer fail and are retried as before."""
    from distflow.runtime import PeerLostError

    async def main() -> None:
        gone = {"rollout": False}

        def transport_of(peer: str) -> str:
            if gone[peer]:
                raise PeerLostError(f"{peer} is not a member")
            return "channel"

        inbox = WeightInbox()
        async with _serving(inbox.receive, kind="shm", timeout=10, transport_of=transport_of,
                            bucket_bytes=2 * T_BYTES) as pub:
            pub.offer(1, weights(1, {}))
            await pub.flush(10)
            gone["rollout"] = True
            pub.offer(2, weights(2, {}))  # raised PeerLostError
            assert pub._need_host and not pub._keep_device and pub.latest[0] == 2
            gone["rollout"] = False
            await pub.flush(10)
            assert pub.sent["rollout"] == 2 and inbox.take_update().version == 2

    asyncio.run(main())


def test_a_peer_restarted_before_it_was_declared_dead_gets_the_current_version() -> None:
    """A rollout node restarted faster than failure detection shows up as a metadata "update"
    with a new life ("boot"), never as dead then alive. Full sync only sends newer versions, so
    the new life (no weights) would wait for the next one, which the trainers cannot make without
    its samples. The publisher sends it the current version again."""
    async def main() -> None:
        inbox = WeightInbox()
        async with _serving(lambda env: inbox.receive(env), timeout=10, bucket_bytes=2 * T_BYTES) as pub:
            pub.member_event("known", "rollout", 1.5)
            pub.offer(1, weights(1, {}))
            await pub.flush(10)
            assert inbox.take_update().version == 1
            inbox = WeightInbox()  # the node restarts
            pub.member_event("update", "rollout", 1.5)  # a metadata change of the same life: nothing
            pub.member_event("update", "learner", 7.0)  # not a peer of this publisher
            await asyncio.sleep(0.6)
            assert inbox.take_update() is None and pub.stats["full_versions"] == 1
            pub.member_event("update", "rollout", 2.5)  # its new life
            await pub.flush(10)
            upd = inbox.take_update()
            assert upd is not None and upd.version == 1 and not upd.is_delta and pub.stats["full_versions"] == 2

    asyncio.run(main())


def test_a_new_life_abandons_the_send_to_the_old_one() -> None:
    """A send its peer will never ack (its life ended) is abandoned when the new life shows up,
    "alive" or "update", not after the send timeout: the new life gets the version at once."""
    async def main() -> None:
        inbox, stuck = WeightInbox(), asyncio.Event()

        async def handler(env) -> None:
            if inbox is None:
                stuck.set()
                await asyncio.sleep(3600)  # the old life: never acks
            await inbox.receive(env)

        for event in ("alive", "update"):
            inbox = None
            async with _serving(lambda env: handler(env), timeout=60, bucket_bytes=2 * T_BYTES) as pub:
                pub.member_event("known", "rollout", 1.0)
                pub.offer(1, weights(1, {}))
                await asyncio.wait_for(stuck.wait(), 10)
                inbox = WeightInbox()
                pub.member_event(event, "rollout", 2.0)
                await pub.flush(10)
                upd = inbox.take_update()
                assert pub.sent["rollout"] == 1 and upd is not None and upd.version == 1, event
            stuck.clear()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_close_leaves_no_send_running() -> None:
    """Closing the publisher while a peer holds a send unacknowledged cancels that send (a CUDA
    IPC export's count would otherwise outlive the publisher, and its channel)."""
    async def main() -> None:
        held = asyncio.Event()

        async def stuck(env) -> None:
            held.set()
            await asyncio.sleep(3600)

        async with _serving(stuck, timeout=60, bucket_bytes=2 * T_BYTES) as pub:
            pub.offer(1, weights(1, {}))
            await asyncio.wait_for(held.wait(), 10)
            await asyncio.wait_for(pub.close(), 10)
            left = [t for t in asyncio.all_tasks() if t.get_name().startswith("weights-v")]
            assert left == []

    asyncio.run(main())


def test_close_stops_a_sender_woken_as_it_is_cancelled() -> None:
    """A sender idles in ``wait_for(wake, 0.5)``; on Python 3.11 a cancellation that lands in the
    loop turn its wake-up completes is swallowed (wait_for returns the result), and the sender
    went on for ever: close() never returned. Now close() cancels again until it stops."""
    async def main() -> None:
        inbox = WeightInbox()
        async with _serving(inbox.receive, timeout=10, bucket_bytes=2 * T_BYTES) as pub:
            pub.offer(1, weights(1, {}))
            await pub.flush(10)
            assert pub.sent["rollout"] == 1
            await asyncio.sleep(0.1)  # the sender is idle, waiting to be woken
            pub.peer_up("rollout")  # wakes it ...
            await asyncio.wait_for(pub.close(), 8)  # ... in the turn its cancellation lands
            assert all(t.done() for t in pub._tasks)

    asyncio.run(main())


def test_unapplied_delta_merges_onto_pending_and_lagging_peer_gets_full() -> None:
    async def main() -> None:
        a, b = await _pair()
        inbox = WeightInbox()
        b.set_handler(inbox.receive)
        alive = {"rollout": True}
        pub = WeightPublisher(a, ["rollout"], lambda _: Endpoint("rollout", "127.0.0.1", b.port),
                              lambda p: alive[p], timeout=10, sync="delta", bucket_bytes=2 * T_BYTES,
                              max_delta_lag=2)
        changed = {2: [4], 3: [4, 5], 4: [0], 5: [1], 6: [2], 7: [3]}
        try:
            for v in (1, 2, 3):  # nothing applied in between: the deltas pile onto the pending full v1
                pub.offer(v, weights(v, changed))
                await pub.flush(10)
            upd = inbox.take_update()
            assert upd.version == 3 and not upd.is_delta
            merged = {n: t for bk in upd.buckets for n, t in bk.items()}
            assert sorted(merged) == sorted(NAMES) and sum(len(bk) for bk in upd.buckets) == 6
            assert all(torch.equal(merged[n], t) for n, t in weights(3, changed).items())
            assert inbox.taken_bytes == (6 + 1 + 2) * T_BYTES  # the sync's bytes: full v1, v2's one, v3's two
            alive["rollout"] = False  # misses v4..v6
            for v in (4, 5, 6):
                pub.offer(v, weights(v, changed))
            alive["rollout"] = True
            pub._wake.set()
            await pub.flush(10)
            assert pub.stats["full_versions"] == 2  # 6 - 3 > max_delta_lag
            assert inbox.take_update().version == 6
        finally:
            await pub.close()
            await a.close()
            await b.close()

    asyncio.run(main())


def test_publish_iter_pipelines_and_non_serving_rank_drains() -> None:
    async def main() -> None:
        a, b = await _pair("shm")
        inbox = WeightInbox()
        b.set_handler(inbox.receive)
        pub = WeightPublisher(a, ["rollout"], lambda _: Endpoint("rollout", "127.0.0.1", b.port),
                              lambda _: True, timeout=10)
        nobody = WeightPublisher(a, [], lambda _: None, lambda _: True, timeout=10)
        pulled = []

        def gen(keep: bool):
            for bk in buckets(weights(1, {}), 2 * T_BYTES):
                pulled.append(keep)
                if keep:
                    yield bk

        try:
            assert await pub.publish_iter(1, gen(True)) == 6 * T_BYTES
            assert await nobody.publish_iter(1, gen(False)) == 0
            assert pulled == [True] * 3 + [False] * 3  # the non-serving rank ran every gather
            await pub.flush(10)
            upd = inbox.take_update()
            assert upd.version == 1 and len(upd.buckets) == 3
            with pytest.raises(ValueError, match="versions must increase"):
                pub.offer(1, weights(1, {}))
            with pytest.raises(ValueError, match="weight_sync"):
                WeightPublisher(a, [], lambda _: None, lambda _: True, timeout=1, sync="sometimes")
        finally:
            await pub.close()
            await nobody.close()
            await a.close()
            await b.close()

    asyncio.run(main())


def test_full_sync_lets_go_of_the_previous_version_when_the_next_begins() -> None:
    """Full sync never reads version v-1 again once v begins: its buffers (on shm: slots lent by
    the channel) must be free while v is gathered, so a serving rank holds one model, not two.
    Delta sync keeps v-1 until v is complete (it compares against it)."""
    import gc
    import weakref

    async def main() -> None:
        for sync, kept in (("full", False), ("delta", True)):
            async with _idle_publisher(sync) as pub:
                v1 = weights(1, {})
                refs = [weakref.ref(t) for t in v1.values()]
                pub.offer(1, v1)
                del v1
                ver = pub.begin(2)  # v2 is being ingested
                gc.collect()
                assert sum(r() is not None for r in refs) == (len(NAMES) if kept else 0), sync
                pub._finish(ver)
                gc.collect()
                assert all(r() is None for r in refs), sync  # complete: v1 is gone either way

    asyncio.run(main())


def test_delta_marks_survive_a_sender_of_the_previous_version_finishing_mid_ingest() -> None:
    """While v2 is ingested (delta sync) it compares against v1: a sender of v1 that finishes then
    (releasing v1's staging buffers, as a CUDA trainer's pinned ones) must not empty v1's index,
    or every later tensor of v2 counts as changed and the delta is a full version."""
    async def main() -> None:
        async with _idle_publisher("delta") as pub:
            pub.offer(1, weights(1, {}))
            v1 = pub._latest
            v1.bufs = [torch.empty(8, dtype=torch.uint8)]  # as if staged in pinned buffers
            v2 = pub.begin(2)
            w2 = weights(2, {2: [1]})  # only layer1 changes in v2
            pub._append(v2, pub._prepare(v2, {n: w2[n] for n in NAMES[:3]}))
            pub._release(v1)  # v1's last sender finished: nothing reads v1 but v2's ingest
            pub._append(v2, pub._prepare(v2, {n: w2[n] for n in NAMES[3:]}))
            pub._finish(v2)
            assert v2.changed == {n: (2 if n == NAMES[1] else 1) for n in NAMES}
            assert v1.index == {} and v1.bufs == []  # released once v2 was complete

    asyncio.run(main())


def test_delta_compares_bytes_not_values() -> None:
    """A sign flip of a zero (+0.0 -> -0.0: equal values) is a change; a NaN that stays the
    same NaN is not (NaN != NaN as values), so it is not resent every version."""
    async def main() -> None:
        async with _idle_publisher("delta") as pub:
            w1 = weights(1, {})
            w1[NAMES[0]][0], w1[NAMES[1]][0] = 0.0, float("nan")
            pub.offer(1, w1)
            w2 = {n: t.clone() for n, t in w1.items()}
            w2[NAMES[0]][0] = -0.0
            v2 = pub.begin(2)
            pub._append(v2, pub._prepare(v2, w2))
            pub._finish(v2)
            assert v2.changed == {n: (2 if n == NAMES[0] else 1) for n in NAMES}

    asyncio.run(main())


def test_resolve_transport_by_locality() -> None:
    from distflow.transport.select import weight_tier as resolve_transport

    assert resolve_transport("auto", same_host=True, trainer_cuda=True, rollout_cuda=True) == "cuda_ipc"
    assert resolve_transport("auto", same_host=False, trainer_cuda=True, rollout_cuda=True) == "nccl"
    assert resolve_transport("auto", same_host=True, trainer_cuda=True, rollout_cuda=False) == "channel"
    assert resolve_transport("channel", same_host=True, trainer_cuda=True, rollout_cuda=True) == "channel"
    # two GPUs of one host: a node cannot open IPC handles of a GPU it does not see, so NCCL (or host memory)
    assert resolve_transport("auto", same_host=True, trainer_cuda=True, rollout_cuda=True, same_gpu=False) == "nccl"
    assert resolve_transport("auto", same_host=True, trainer_cuda=True, rollout_cuda=True, same_gpu=False,
                             nccl_channel=False) == "channel"
    with pytest.raises(ValueError, match="cuda_ipc needs the trainer and the rollout node on one GPU"):
        resolve_transport("cuda_ipc", same_host=True, trainer_cuda=True, rollout_cuda=True, same_gpu=False)
    # across hosts without the NCCL data channel (channel: shm / zmq, or no cupy): through host memory
    assert resolve_transport("auto", same_host=False, trainer_cuda=True, rollout_cuda=True,
                             nccl_channel=False) == "channel"
    with pytest.raises(ValueError, match="nccl needs the NCCL data channel"):
        resolve_transport("nccl", same_host=False, trainer_cuda=True, rollout_cuda=True, nccl_channel=False)
    with pytest.raises(ValueError, match="nccl between two nodes on one GPU"):  # NCCL refuses duplicate GPUs
        resolve_transport("nccl", same_host=True, trainer_cuda=True, rollout_cuda=True)
    assert resolve_transport("nccl", same_host=True, trainer_cuda=True, rollout_cuda=True, same_gpu=False) == "nccl"
    assert resolve_transport("nccl", same_host=False, trainer_cuda=True, rollout_cuda=True) == "nccl"
    with pytest.raises(ValueError, match="cuda_ipc needs CUDA"):
        resolve_transport("cuda_ipc", same_host=True, trainer_cuda=False, rollout_cuda=False)
    with pytest.raises(ValueError, match="one host"):
        resolve_transport("cuda_ipc", same_host=False, trainer_cuda=True, rollout_cuda=True)
    with pytest.raises(ValueError, match="weight_transport must be one of"):
        resolve_transport("carrier-pigeon", True, True, True)


def test_rollout_nodes_are_served_from_their_own_host_with_the_load_even() -> None:
    from distflow.weights.tiers import serving_plan

    # one host (distflow run): round-robin by rank
    one = [("t0", "h"), ("t1", "h")]
    assert serving_plan(one, [(f"r{i}", "h") for i in range(5)]) == {"t0": ["r0", "r2", "r4"], "t1": ["r1", "r3"]}
    # two colocated hosts, ids sorted by host: round-robin by rank would cross hosts for half of them
    two = [("trainer-a-0", "10.0.0.1"), ("trainer-b-0", "10.0.0.2")]
    rollouts = [("rollout-a-0", "10.0.0.1"), ("rollout-a-1", "10.0.0.1"),
                ("rollout-b-0", "10.0.0.2"), ("rollout-b-1", "10.0.0.2")]
    assert serving_plan(two, rollouts) == {"trainer-a-0": ["rollout-a-0", "rollout-a-1"],
                                           "trainer-b-0": ["rollout-b-0", "rollout-b-1"]}
    # more rollout nodes on one host than its trainers' fair share: the surplus goes where there is room
    uneven = [("ra0", "a"), ("ra1", "a"), ("ra2", "a"), ("rb0", "b")]
    assert serving_plan(two[:1] + [("tb", "b")], [(r, "10.0.0.1" if h == "a" else "b") for r, h in uneven]) == {
        "trainer-a-0": ["ra0", "ra1"], "tb": ["ra2", "rb0"]}
    # rollout-only hosts (the pdsh example: trainers on gpu-a, rollouts on gpu-b): balanced, lower rank first
    plan = serving_plan(two[:1] + [("trainer-a-1", "10.0.0.1")], [(f"r{i}", "10.0.0.9") for i in range(3)])
    assert plan == {"trainer-a-0": ["r0", "r2"], "trainer-a-1": ["r1"]}
    # colocated on one host, each trainer sharing its GPU with a rollout node: served from its own GPU
    # (CUDA IPC), not round-robin (which pairs them across GPUs here)
    gpus = [("t0", "h", "0"), ("t1", "h", "1")]
    assert serving_plan(gpus, [("r0", "h", "1"), ("r1", "h", "0")]) == {"t0": ["r1"], "t1": ["r0"]}
    assert serving_plan(gpus, [("r0", "h", "1"), ("r1", "h", "1")]) == {"t0": ["r1"], "t1": ["r0"]}  # room first
    assert serving_plan(gpus, [("r0", "h", None), ("r1", "h", None)]) == {"t0": ["r0"], "t1": ["r1"]}  # cpu
    # every rollout node is served exactly once, whatever the layout
    hosts = ["x", "y", "z"]
    for nt in range(1, 5):
        for nr in range(0, 9):
            tr = [(f"t{i}", hosts[i % 2]) for i in range(nt)]
            ro = [(f"r{i}", hosts[i % 3]) for i in range(nr)]
            got = serving_plan(tr, ro)
            assert sorted(r for rs in got.values() for r in rs) == sorted(r for r, _ in ro)
            assert max(map(len, got.values())) <= -(-nr // nt)
    with pytest.raises(ValueError, match="at least one trainer"):
        serving_plan([], [("r0", "h")])


# ----------------------------------------------------------------------------- GPU tiers
def _gpu_rollout(kind: str, device: int, q_out, out_path: str, tier: str = "cuda_ipc") -> None:
    """The rollout end of a weight tier in its own process (NCCL ranks may not share a GPU, and a
    blocking NCCL call must never stall the other end's loop): receive v1, copy it into CUDA
    tensors (as the engine does), save it. The GPU tiers deliver CUDA tensors on ``device``; the
    channel tier delivers host ones (staged from the trainer's GPU through pinned memory)."""
    from distflow.core.aio import run_loop

    async def main() -> None:
        ch = make_transport(kind, "rollout", SECRET, **({"device": device} if kind == "nccl" else {}))
        inbox = WeightInbox(torch.device("cuda", device))
        ch.set_handler(inbox.receive)
        await ch.start()
        q_out.put(ch.port)
        await inbox.wait_for(1, 60, lambda: None)
        upd = inbox.take_update()
        engine = {n: torch.empty_like(t) for bk in upd.buckets for n, t in bk.items()}
        for bk in upd.buckets:  # device-to-device copy (out of the exporter's memory, for cuda_ipc)
            for n, t in bk.items():
                if tier == "channel":
                    assert t.device.type == "cpu", t.device
                    engine[n] = engine[n].to(torch.device("cuda", device))
                else:
                    assert t.is_cuda and t.device.index == device, t.device
                engine[n].copy_(t)
        del upd
        torch.cuda.synchronize(device)
        torch.save({n: t.cpu() for n, t in engine.items()}, out_path)
        q_out.put("saved")
        await ch.close()

    run_loop(main())


def _gpu_tier_between_processes(tmp_path, kind: str, tier: str, rollout_device: int) -> dict:
    """Publish v1 from cuda:0 of this process to a rollout process on ``rollout_device``;
    returns the trainer channel's stats and checks what the rollout saved."""
    ctx = multiprocessing.get_context("spawn")
    q_out = ctx.Queue()
    out = str(tmp_path / f"{tier}.pt")
    proc = ctx.Process(target=_gpu_rollout, args=(kind, rollout_device, q_out, out, tier), daemon=True)
    proc.start()
    state = {n: t.cuda(0) for n, t in weights(1, {}).items()}
    try:
        port = q_out.get(timeout=60)

        async def trainer() -> dict:
            ch = make_transport(kind, "trainer", SECRET, **({"device": 0} if kind == "nccl" else {}))
            await ch.start()
            pub = WeightPublisher(ch, ["rollout"], lambda _: Endpoint("rollout", "127.0.0.1", port),
                                  lambda _: True, timeout=60, transport_of=lambda _: tier,
                                  bucket_bytes=2 * T_BYTES)
            try:
                pub.offer(1, state)
                await pub.flush(90)
                assert pub.sent["rollout"] == 1
                assert await asyncio.get_running_loop().run_in_executor(None, q_out.get, True, 60) == "saved"
                return ch.stats()
            finally:
                await pub.close()
                await ch.close()

        stats = asyncio.run(asyncio.wait_for(trainer(), 240))
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    got = torch.load(out)
    for n, t in state.items():
        assert torch.equal(got[n], t.cpu()), n
    return stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_tier_between_processes(tmp_path) -> None:
    _gpu_tier_between_processes(tmp_path, "shm", "cuda_ipc", 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_channel_tier_stages_cuda_weights_through_host_memory(tmp_path) -> None:
    """GPU weights to a peer on the channel tier (another host without NCCL, or weight_transport:
    channel): each bucket is staged into the publisher's pinned buffers and arrives byte-exact."""
    _gpu_tier_between_processes(tmp_path, "shm", "channel", 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_exports_a_bucket_as_one_block() -> None:
    """A bucket gathered into one flat CUDA buffer is exported with one IPC handle (one event, one
    reference count), its tensors described as views; the count goes back with release_ipc."""
    from distflow.transport.movers.cuda_ipc import export_ipc, release_ipc

    flat = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    bucket = {"w": flat[:1024].view(torch.bfloat16).view(16, 32), "b": flat[1024:1088].view(torch.float32),
              "e": torch.zeros(0, device="cuda")}
    ipc = export_ipc(bucket)
    assert len(ipc["blocks"]) == 1 and ipc["blocks"][0]["size_bytes"] == 4096
    assert [e["name"] for e in ipc["blocks"][0]["tensors"]] == ["w", "b"] and ipc["empty"][0]["name"] == "e"
    assert release_ipc(ipc) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs (NCCL ranks may not share a GPU)")
def test_nccl_tier_keeps_buckets_on_gpu(tmp_path) -> None:
    pytest.importorskip("cupy")
    stats = _gpu_tier_between_processes(tmp_path, "nccl", "nccl", 1)
    assert stats["nccl_sends"] == 3 and stats["nccl_aborts"] == 0  # 3 buckets of 2 tensors, nothing refused


def test_streamed_versions_apply_buckets_as_they_arrive() -> None:
    async def main() -> None:
        a, b = await _pair("shm")
        inbox = WeightInbox()
        b.set_handler(inbox.receive)
        engine = {n: torch.zeros(T_BYTES // 4) for n in NAMES}
        seen: list[tuple[int, list[str]]] = []

        def apply(version: int, bucket: dict) -> None:  # an idle engine's in-place load of one bucket
            seen.append((version, list(bucket)))
            for n, t in bucket.items():
                engine[n].copy_(t)

        pub = WeightPublisher(a, ["rollout"], lambda _: Endpoint("rollout", "127.0.0.1", b.port),
                              lambda _: True, timeout=10, sync="delta", bucket_bytes=2 * T_BYTES)
        changed = {2: [5]}
        try:
            inbox.stream_to(apply)
            pub.offer(1, weights(1, changed))
            await pub.flush(10)
            assert seen == [(1, NAMES[0:2]), (1, NAMES[2:4]), (1, NAMES[4:6])]
            upd = inbox.take_update()
            assert upd == (1, [], True) and inbox.streaming is None  # nothing left: an empty partial set
            assert inbox.taken_bytes == 6 * T_BYTES  # streamed, yet counted: the sync's bytes
            pub.offer(2, weights(2, changed))  # a delta streams onto the version the engine holds
            await pub.flush(10)
            assert seen[-1] == (2, [NAMES[5]]) and inbox.take_update() == (2, [], True)
            assert inbox.taken_bytes == T_BYTES  # the one tensor changed
            assert all(torch.equal(engine[n], t) for n, t in weights(2, changed).items())
            # a streamed version cut off half-way (its sender restarted it): dirty, deltas refused
            await inbox.receive(Envelope("trainer", "weights", {"version": 3, "bucket": 0, "base": None},
                                         {NAMES[0]: torch.ones(T_BYTES // 4)}))
            await inbox.receive(Envelope("trainer", "weights", {"version": 3, "bucket": 0, "base": 2},
                                         {NAMES[0]: torch.ones(T_BYTES // 4)}))
            assert inbox.dirty
            with pytest.raises(ValueError, match="full version is needed"):
                await inbox.receive(Envelope("trainer", "weights", {"version": 3, "commit": True,
                                                                   "num_buckets": 1, "base": 2}, {}))
        finally:
            await pub.close()
            await a.close()
            await b.close()

    asyncio.run(main())


# ----------------------------------------------------------------------------- CUDA IPC counts (CPU)
def _block(handle: bytes, ref_offset: int, *names: str, size_bytes: int = 64, **kw) -> dict:
    """An exported storage holding float32 [4] views ``names`` at 16-byte steps."""
    b = {"device": 0, "handle": handle, "size_bytes": size_bytes, "offset_bytes": 0, "ref_handle": b"/torch_ref",
         "ref_offset": ref_offset, "event_handle": None, "event_sync": False,
         "tensors": [{"name": n, "dtype": "float32", "size": [4], "stride": [1], "offset": 16 * i}
                     for i, n in enumerate(names)]}
    b.update(kw)
    return b


def _ipc(*blocks: dict, empty: list | None = None) -> dict:
    return {"blocks": list(blocks), "empty": empty or []}


def test_ipc_blocks_never_opened_are_released(monkeypatch) -> None:
    """Every exported block holds one count of the exporter's IPC counter: the inbox gives back
    the ones of an old version it drops; a failed import gives back the ones it did not open."""
    from distflow.transport.movers import cuda_ipc as weight_transport

    released: list[tuple[bytes, int]] = []
    monkeypatch.setattr(weight_transport, "_release_counter", lambda h, o: released.append((h, o)))

    async def main() -> None:
        inbox = WeightInbox()
        inbox.version = 3
        ipc = _ipc(_block(b"h-a", 7, "a", "b"), _block(b"h-c", 8, "c"))
        old = {"version": 2, "bucket": 0, "base": None, "ipc": ipc}
        await inbox.receive(Envelope("trainer", "weights", old, {}))
        assert released == [(b"/torch_ref", 7), (b"/torch_ref", 8)] and inbox.pending is None
        released.clear()
        with pytest.raises(ValueError, match="bad meta"):
            await inbox.receive(Envelope("trainer", "weights", {"version": "x", "ipc": _ipc(_block(b"h", 9, "a"))}, {}))
        assert released == [(b"/torch_ref", 9)]

    asyncio.run(main())

    # a malformed export: nothing is opened, every well-formed count goes back (an empty tensor holds none)
    released.clear()
    empty = {"name": "e", "dtype": "float32", "size": [0], "device": 0}
    bad = _block(b"h-b", 2, "b")
    bad["tensors"][0]["stride"] = None
    with pytest.raises(ValueError, match="'b' lacks 'stride'"):
        weight_transport.import_ipc(_ipc(_block(b"h-a", 1, "a"), bad, empty=[empty]))
    assert released == [(b"/torch_ref", 1), (b"/torch_ref", 2)]
    for block, why in ((_block(b"h", 1, "a", "b", size_bytes=24), "'b' reaches outside its storage"),
                       (_block(b"h", 1, "a", "a"), "malformed or repeated"),
                       (_block(b"h", 1, "a", ref_handle=None), "block #0 lacks 'ref_handle'")):
        with pytest.raises(ValueError, match=why):
            weight_transport.import_ipc(_ipc(block))
    with pytest.raises(ValueError, match="expected"):
        weight_transport.import_ipc([_block(b"h", 1, "a")])  # the per-tensor list of older exports

    # opening block #1 fails: #0 was opened (freed with it), #1 and #2 go back
    released.clear()
    opened: list[bytes] = []

    def rebuild(*args):
        handle = args[7]
        if handle == b"h-b":
            raise RuntimeError("cudaIpcOpenMemHandle failed")
        opened.append(handle)
        assert args[1] == torch.Size([64]) and args[5] == torch.uint8  # the whole storage, as bytes
        return torch.zeros(64, dtype=torch.uint8)

    monkeypatch.setattr("torch.multiprocessing.reductions.rebuild_cuda_tensor", rebuild)
    with pytest.raises(RuntimeError, match="cudaIpcOpenMemHandle"):
        weight_transport.import_ipc(_ipc(_block(b"h-a", 1, "a"), _block(b"h-b", 2, "b"), _block(b"h-c", 3, "c")))
    assert opened == [b"h-a"] and released == [(b"/torch_ref", 2), (b"/torch_ref", 3)]

    # a good export: one open per block, its tensors are views of it
    opened.clear()
    got = weight_transport.import_ipc(_ipc(_block(b"h-a", 1, "a", "b", "c")))
    assert opened == [b"h-a"] and list(got) == ["a", "b", "c"] and all(t.shape == (4,) for t in got.values())
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1

    # the exporter's "ready" event: waited on through an Event object (destroyed when dropped),
    # before the block is opened, never by torch's own wait, which leaks the event it opens
    steps: list[tuple] = []

    class Ev:
        @classmethod
        def from_ipc_handle(cls, device, handle):
            steps.append(("open_event", device, handle))
            return cls()

        def wait(self, stream):
            steps.append(("wait", stream))

    def rebuild_sync(*args):
        steps.append(("rebuild", args[7], args[13], args[14]))
        return torch.zeros(64, dtype=torch.uint8)

    monkeypatch.setattr(torch.cuda, "Event", Ev)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: f"stream-{d}")
    monkeypatch.setattr("torch.multiprocessing.reductions.rebuild_cuda_tensor", rebuild_sync)
    weight_transport.import_ipc(_ipc(_block(b"h-e", 1, "a", device=2, event_handle=b"ev", event_sync=True),
                                     _block(b"h-f", 2, "b")))
    assert steps == [("open_event", 2, b"ev"), ("wait", "stream-2"), ("rebuild", b"h-e", b"ev", False),
                     ("rebuild", b"h-f", None, False)]


def test_an_ipc_export_waits_for_its_bucket_only(monkeypatch) -> None:
    """torch records an export's event on the current stream, so a rollout importing the bucket
    waited for everything the trainer had queued when the send ran (its next step). The export
    now runs on the publisher's own stream, after that stream waited on the event recorded when
    the bucket was gathered (recorders: no GPU here; the cuda_ipc GPU tests run the real path)."""
    from distflow.transport.movers import cuda_ipc as weight_transport

    steps: list[tuple] = []

    class Stream:
        def wait_event(self, event) -> None:
            steps.append(("wait", event))

    @contextlib.contextmanager
    def current(stream):
        steps.append(("enter", stream))
        yield
        steps.append(("exit", stream))

    def export(bucket):
        steps.append(("export", list(bucket)))
        return {"blocks": [], "empty": []}

    monkeypatch.setattr(torch.cuda, "stream", current)
    monkeypatch.setattr(weight_transport, "export_ipc", export)
    side = Stream()
    assert weight_transport.export_ready({"a": torch.zeros(1)}, "gathered", side) == {"blocks": [], "empty": []}
    assert steps == [("wait", "gathered"), ("enter", side), ("export", ["a"]), ("exit", side)]
    steps.clear()
    weight_transport.export_ready({"b": torch.zeros(1)}, None, None)  # no event: torch's own way
    assert steps == [("export", ["b"])]


def test_an_nccl_weight_send_waits_for_its_bucket_only(monkeypatch) -> None:
    """The NCCL channel ordered every send after the device's whole current stream: a bucket sent
    while the trainer had queued its next step waited for that step. The publisher names the
    bucket's gather event for its own send (a contextvar: concurrent sends each see theirs), and
    the channel's stream waits on that event alone, unless a tensor needed a contiguous() copy
    (queued on the current stream). Recorders: no GPU here; the two-GPU nccl tests run the real path."""
    from distflow.transport.movers import nccl as nccl_channel

    steps: list[tuple] = []

    class Stream:
        def wait_event(self, event) -> None:
            steps.append(("wait_event", event))

        def wait_stream(self, stream) -> None:
            steps.append(("wait_stream", stream))

    class Channel:  # what the publisher sees of the NCCL channel: which event its sends are under
        async def send(self, peer, kind, meta, tensors, timeout) -> None:
            await asyncio.sleep(0.01 * meta["bucket"])  # interleaved with the other send
            steps.append(("send", meta["bucket"], nccl_channel._READY.get()))

    async def main() -> None:
        pub = WeightPublisher(Channel(), [], lambda _: None, lambda _: True, 5.0)  # type: ignore[arg-type]
        part = {"w": torch.zeros(1)}
        await asyncio.gather(pub._send_bucket("ep", "nccl", {"bucket": 2}, part, "gathered-0"),
                             pub._send_bucket("ep", "nccl", {"bucket": 1}, part, "gathered-1"),
                             pub._send_bucket("ep", "channel", {"bucket": 0}, part, None))
        assert nccl_channel._READY.get() is None
        await pub.close()

    asyncio.run(main())
    assert sorted(steps) == [("send", 0, None), ("send", 1, "gathered-1"), ("send", 2, "gathered-0")]
    steps.clear()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: f"stream-{d}")
    with nccl_channel.sends_ready_after("gathered"):
        nccl_channel._after_producer(Stream(), 0, contiguous=True)
        nccl_channel._after_producer(Stream(), 0, contiguous=False)  # a copy was queued on the current stream
    nccl_channel._after_producer(Stream(), 0, contiguous=True)  # nobody named an event
    assert steps == [("wait_event", "gathered"), ("wait_stream", "stream-0"), ("wait_stream", "stream-0")]


def test_ipc_export_is_one_block_per_storage() -> None:
    """A bucket (views of one flat buffer, as the gather makes it) is described as the storage it
    views: one block per storage, whatever the tensors' dtypes, offsets and strides; the views
    rebuilt from the flat bytes equal the originals. An empty tensor has no storage to share."""
    from distflow.transport.movers.cuda_ipc import open_views, storage_views

    flat = torch.zeros(1024, dtype=torch.uint8)
    w = flat[0:96].view(torch.float32).view(4, 6)
    w.copy_(torch.arange(24, dtype=torch.float32).view(4, 6))
    b = flat[128:128 + 40].view(torch.bfloat16)
    b.copy_(torch.linspace(-1, 1, 20, dtype=torch.bfloat16))
    t = flat[192:192 + 96].view(torch.float32).view(6, 4).t()  # a transposed (non-contiguous) view
    t.copy_(torch.rand(4, 6))
    other = torch.arange(5, dtype=torch.int64)  # a storage of its own
    bucket = {"w": w, "b": b, "t": t, "other": other, "e": torch.zeros(0, 8)}
    blocks, empty = storage_views(bucket)
    assert [len(entries) for _, entries in blocks] == [3, 1]
    assert [x.numel() for x, _ in blocks] == [1024, 40]
    assert empty == [{"name": "e", "dtype": "float32", "size": [0, 8], "device": 0}]
    assert blocks[0][1][2] == {"name": "t", "dtype": "float32", "size": [4, 6], "stride": [1, 4], "offset": 192}
    got = {k: v for x, entries in blocks for k, v in open_views(x.clone(), entries).items()}
    for name in ("w", "b", "t", "other"):
        assert got[name].dtype == bucket[name].dtype and got[name].stride() == bucket[name].stride()
        assert torch.equal(got[name], bucket[name]), name


def test_ipc_export_of_an_empty_tensor_shares_nothing(monkeypatch) -> None:
    """An empty storage has no IPC handle (torch returns None): it is described, not shared."""
    from distflow.transport.movers import cuda_ipc as weight_transport

    class EmptyCuda:  # what export_ipc reads of a zero-size CUDA tensor
        is_cuda, dtype, shape, device = True, torch.bfloat16, torch.Size([0, 8]), torch.device("cuda", 1)

        def numel(self) -> int:
            return 0

    def no_share(_t):
        raise AssertionError("reduce_tensor must not be called on an empty tensor")

    monkeypatch.setattr("torch.multiprocessing.reductions.reduce_tensor", no_share)
    assert weight_transport.export_ipc({"bias": EmptyCuda()}) == {
        "blocks": [], "empty": [{"name": "bias", "dtype": "bfloat16", "size": [0, 8], "device": 1}]}
    assert weight_transport.release_ipc(weight_transport.export_ipc({"bias": EmptyCuda()})) == 0


def test_pinned_pool_reuses_the_smallest_fitting_buffer() -> None:
    """The staging pool (CUDA buckets -> host) takes the smallest free buffer that fits, wherever it
    sits in the free list, and hands it out once (it found it with list.remove, which compares
    tensors elementwise and raised on a buffer of another size before it)."""
    from distflow.transport.pool import PinnedPool

    pool = PinnedPool()
    big = pool.stage({"w": torch.zeros(1024)})[1]
    small = pool.stage({"w": torch.zeros(40)})[1]
    mid = pool.stage({"w": torch.zeros(100)})[1]
    for buf in (big, mid, small):
        pool.give_back(buf)
    views, got = pool.stage({"a": torch.arange(10.0), "b": torch.ones(3, dtype=torch.int64)})
    assert got is small and torch.equal(views["a"], torch.arange(10.0)) and torch.equal(views["b"], torch.ones(3))
    assert pool.stage({"w": torch.zeros(90)})[1] is mid  # smallest fit among big, mid
    assert pool.stage({"w": torch.zeros(90)})[1] is big  # the last one free
    fresh = pool.stage({"w": torch.zeros(90)})[1]
    assert all(fresh is not b for b in (big, mid, small))  # none free: a new buffer


def _wmsg(bucket: int | None, value: float, send: int | None = 1, sender: str = "trainer", **extra) -> Envelope:
    """A weights message of version 1 (a bucket ``w<k>`` filled with ``value``, or a commit)."""
    meta = {"version": 1, "base": None, **({} if send is None else {"send": send}),
            **({} if bucket is None else {"bucket": bucket}), **extra}
    return Envelope(sender, "weights", meta, {} if bucket is None else {f"w{bucket}": torch.full((2,), value)})


def _values(upd) -> list[dict]:
    return [{k: v.tolist() for k, v in b.items()} for b in upd.buckets]


def test_buckets_may_arrive_in_any_order() -> None:
    """Bucket handlers finish in any order (a big first bucket is copied or streamed longer than the
    small one after it): the version is assembled by index, and a commit needs every index."""
    async def main() -> None:
        inbox = WeightInbox()
        await inbox.receive(_wmsg(2, 3.0))
        await inbox.receive(_wmsg(0, 1.0))
        await inbox.receive(_wmsg(1, 2.0))
        await inbox.receive(_wmsg(None, 0, commit=True, num_buckets=3))
        upd = inbox.take_update()
        assert upd is not None and upd.version == 1 and inbox.version == 1
        assert _values(upd) == [{"w0": [1.0, 1.0]}, {"w1": [2.0, 2.0]}, {"w2": [3.0, 3.0]}]
        assert inbox.taken_bytes == 3 * 2 * 4  # the bytes of this weight sync: 3 buckets of 2 fp32
        # a commit whose indices are not all in is refused, naming what arrived
        inbox = WeightInbox()
        await inbox.receive(_wmsg(1, 2.0))
        await inbox.receive(_wmsg(2, 3.0))
        with pytest.raises(ValueError, match=r"buckets \[1, 2\] of send 1 arrived"):
            await inbox.receive(_wmsg(None, 0, commit=True, num_buckets=2))
        assert inbox.version == 0 and inbox.take_update() is None

    asyncio.run(main())


def test_a_send_that_starts_over_replaces_the_partial_version() -> None:
    """A version whose send starts over (a new attempt after an ack timeout) is assembled from the
    new attempt alone; a late bucket or commit of the abandoned attempt changes nothing."""
    async def main() -> None:
        inbox = WeightInbox()
        await inbox.receive(_wmsg(0, 1.0, send=1))
        await inbox.receive(_wmsg(1, 1.0, send=1))  # ... and the send broke off here
        await inbox.receive(_wmsg(1, 2.0, send=2))
        await inbox.receive(_wmsg(0, 1.0, send=1))  # late, from the abandoned attempt: dropped
        with pytest.raises(ValueError, match="superseded by send 2"):
            await inbox.receive(_wmsg(None, 0, send=1, commit=True, num_buckets=2))
        await inbox.receive(_wmsg(0, 2.0, send=2))
        await inbox.receive(_wmsg(None, 0, send=2, commit=True, num_buckets=2))
        upd = inbox.take_update()
        assert upd is not None and upd.version == 1 and inbox.stale_dropped == 1
        assert _values(upd) == [{"w0": [2.0, 2.0]}, {"w1": [2.0, 2.0]}]
        # the sync's bytes: the two buckets of the attempt committed (2 fp32 each); the wire carried 4
        assert inbox.taken_bytes == 2 * 8 and inbox.received_bytes == 4 * 8
        # a sender that does not number its attempts: an index seen twice starts the version over
        inbox = WeightInbox()
        for bucket, value in ((0, 1.0), (1, 1.0), (0, 2.0), (1, 2.0)):
            await inbox.receive(_wmsg(bucket, value, send=None))
        await inbox.receive(_wmsg(None, 0, send=None, commit=True, num_buckets=2))
        assert _values(inbox.take_update()) == [{"w0": [2.0, 2.0]}, {"w1": [2.0, 2.0]}]
        with pytest.raises(ValueError, match="'bucket' must be an int"):
            await inbox.receive(Envelope("trainer", "weights", {"version": 2, "base": None, "bucket": "0"},
                                         {"w0": torch.ones(2)}))

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["zmq", "shm"])
def test_a_big_first_bucket_overtaken_by_a_small_one_still_makes_the_version(kind: str) -> None:
    """Real channels: bucket 0 (an embedding bigger than the bucket size; streamed in chunks on zmq,
    copied in a worker thread on shm) completes after the small bucket 1 sent behind it. The
    version arrives (it used to be refused at its commit, then resent and refused forever)."""
    async def main() -> None:
        rx, tx = make_transport(kind, "rollout", SECRET), make_transport(kind, "trainer", SECRET)
        inbox = WeightInbox()
        rx.set_handler(inbox.receive)
        await rx.start()
        await tx.start()
        ep = Endpoint("rollout", "127.0.0.1", rx.port)
        pub = WeightPublisher(tx, ["rollout"], lambda _: ep, lambda _: True, timeout=30)
        big, small = torch.arange(40 << 20 >> 2, dtype=torch.float32), torch.full((1024,), 7.0)
        try:
            pub.offer(1, [{"embed": big}, {"layer0": small}])
            await inbox.wait_for(1, 20, lambda: None)
            upd = inbox.take_update()
            assert upd is not None and [list(b) for b in upd.buckets] == [["embed"], ["layer0"]]
            assert torch.equal(upd.buckets[0]["embed"], big) and torch.equal(upd.buckets[1]["layer0"], small)
            await pub.flush(10)
            assert pub.sent["rollout"] == 1 and pub.stats["full_versions"] == 1  # the first attempt, no resend
            assert pub.stats["messages"] == 3 and inbox.stale_dropped == 0
        finally:
            await pub.close()
            await tx.close()
            await rx.close()

    asyncio.run(main())


def test_a_spilled_bucket_is_copied_off_the_event_loop(monkeypatch) -> None:
    """A bucket that must leave a GPU short of memory is copied to host memory in a worker thread
    (a device-to-host copy on the loop would stall gossip and acks behind the engine's kernels);
    a copy that fails leaves no empty bucket behind for the commit to accept. No GPU here: which
    buckets spill, and the copy, are replaced (test_held_gpu_buckets_leave_a_gpu_short_of_memory
    runs the real ones)."""
    import threading

    from distflow.weights import inbox as weights_mod

    copied_on: list[int] = []

    def to_host(bucket, pool):
        copied_on.append(threading.get_ident())
        if "bad" in bucket:
            raise RuntimeError("copy failed")
        return pool.stage(bucket)

    monkeypatch.setattr(weights_mod, "spill_needed", lambda bucket, reserve: True)
    monkeypatch.setattr(weights_mod, "to_host", to_host)

    async def main() -> None:
        inbox = WeightInbox()
        msg = {"version": 1, "base": None}
        await inbox.receive(Envelope("trainer", "weights", {**msg, "bucket": 0}, {"w": torch.arange(4.0)}))
        with pytest.raises(RuntimeError, match="copy failed"):
            await inbox.receive(Envelope("trainer", "weights", {**msg, "bucket": 1}, {"bad": torch.zeros(2)}))
        with pytest.raises(ValueError, match=r"for 2 buckets .* but buckets \[0\]"):
            await inbox.receive(Envelope("trainer", "weights", {**msg, "commit": True, "num_buckets": 2}, {}))
        await inbox.receive(Envelope("trainer", "weights", {**msg, "bucket": 0}, {"w": torch.arange(4.0)}))
        await inbox.receive(Envelope("trainer", "weights", {**msg, "commit": True, "num_buckets": 1}, {}))
        upd = inbox.take_update()
        assert upd is not None and torch.equal(upd.buckets[0]["w"], torch.arange(4.0))
        assert len(copied_on) == 3 and threading.get_ident() not in copied_on

    asyncio.run(main())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_held_gpu_buckets_leave_a_gpu_short_of_memory() -> None:
    """Buckets that arrive in device memory (the NCCL tier) and wait for the engine stay on the GPU
    while it has the reserve free beside them, else they are held in host memory, values intact."""
    async def one(reserve: int) -> torch.Tensor:
        inbox = WeightInbox(gpu_reserve=reserve)
        w = torch.arange(8.0, device="cuda")
        await inbox.receive(Envelope("trainer", "weights", {"version": 1, "bucket": 0, "base": None}, {"w": w}))
        await inbox.receive(Envelope("trainer", "weights", {"version": 1, "base": None, "commit": True,
                                                             "num_buckets": 1}, {}))
        upd = inbox.take_update()
        assert upd is not None
        return upd.buckets[0]["w"]

    kept = asyncio.run(one(0))
    moved = asyncio.run(one(1 << 60))
    assert kept.is_cuda and moved.device.type == "cpu" and moved.is_pinned()  # page-locked, never pageable
    assert torch.equal(moved, torch.arange(8.0)) and torch.equal(kept.cpu(), moved)
