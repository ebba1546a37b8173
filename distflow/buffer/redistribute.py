"""Stage-to-stage redistribution: the all-to-all between producer and consumer groups.

When a DAG edge connects a producer group of DP size P to a consumer group of DP size C,
every producer splits its batch for a step by owner (``routing.owner``) or by token
balance, and sends each consumer its part *directly* — no process sees all the data.
Each producer sends exactly one message per consumer per step, even an empty one: that
message is also the producer's end-of-step marker, so a consumer knows a step is
complete when it has one part from each of the P producers (``BufferShard.take_step``).

Consumers receive with :func:`shard_receiver` (a channel handler that puts parts into a
BufferShard, applying its backpressure to the sending producer) and collect a step with
:func:`gather_step`. Sizes may be uneven; nothing requires equal chunks.

Each part of a split travels packed (:class:`batch.PackedPart`: one buffer, one layout), and
on a channel that can lend shared memory (same host) it is written straight into a slot lent
for its consumer (:class:`routing.Packer`): the split is then the producer's only copy of the
bytes, the send itself copies nothing, and the channel handles one tensor per part.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Collection, Sequence

import msgpack

from distflow.buffer.batch import PACKED, PackedPart, SampleBatch, check_packed
from distflow.buffer.routing import Packer, owner_groups, owners, split_parts, token_partition
from distflow.buffer.shard import BufferShard
from distflow.transport import Endpoint, Envelope, Transport
from distflow.transport.movers.posting import UNKNOWN, Post

BALANCE_MODES = ("owner", "tokens")
RESERVED_META = frozenset({"sample_ids", "prompt_ids", "extras", "step", "source_rank", "num_sources", "part",
                           "num_parts", "balance", PACKED})


class ScatterError(RuntimeError):
    """Some consumers did not accept their part of a step. ``failed``: {consumer node id: error}."""

    def __init__(self, step: int, failed: dict[str, BaseException], delivered: list[str]):
        detail = "; ".join(f"{k}: {type(e).__name__}: {e}" for k, e in failed.items())
        super().__init__(f"step {step}: {len(failed)} consumer(s) did not accept their part ({detail})")
        self.step = step
        self.failed = failed
        self.delivered = delivered


def groups_for(batch: SampleBatch, num_consumers: int, balance: str, source_rank: int = 0) -> list[list[int]]:
    """Sample indices of each consumer's part under a balance mode ("owner" | "tokens").

    ``tokens``: this producer's samples partitioned by token count (``token_partition``, heaviest
    part first), part k to consumer ``(k + source_rank) mod N``: every producer putting its
    heaviest part on consumer 0 would load that rank with the heaviest part of every producer
    (the scaling model measured 0.07 efficiency at 512 ranks that way; rotated, 0.97)."""
    if balance == "owner":
        return owner_groups(batch, num_consumers)
    if balance == "tokens":
        parts = token_partition(batch.num_tokens(), num_consumers)
        return [parts[(c - source_rank) % num_consumers] for c in range(num_consumers)]
    raise ValueError(f"unknown balance mode {balance!r}; expected one of {BALANCE_MODES}")


async def scatter(
    channel: Transport,
    batch: SampleBatch,
    consumers: list[Endpoint],
    *,
    step: int,
    source_rank: int,
    kind: str = "samples",
    timeout: float,
    balance: str = "owner",
    num_sources: int | None = None,
    extra_meta: dict[str, Any] | None = None,
    only: Collection[int] | None = None,
    replicas: int = 1,
) -> dict[str, Any]:
    """Send this producer's part of ``step`` to every consumer (concurrently); one message each.

    The message meta is the part's ``SampleBatch.to_wire()`` meta (so ``SampleBatch.from_wire(
    env.meta, env.tensors)`` works on it) plus ``step``, ``source_rank``, ``num_sources``,
    ``part``, ``num_parts``, ``balance`` and any ``extra_meta`` (msgpack-able, not those keys).
    ``only`` (consumer indices) sends just those parts, e.g. a retry to the consumers a first
    attempt could not reach; the split is the same, so each part still goes to its owner.
    ``replicas`` > 1: the consumers are that many replica groups of equal size, in order
    (``trainer_replicas``), and each group receives the whole batch: consumer ``k`` gets the part of
    rank ``k mod size`` of its group (``part`` / ``num_parts`` name that rank and the group's size).
    Returns ``{"step", "samples": [per consumer], "bytes", "seconds"}``. Raises ScatterError
    naming the consumers that failed (the others did receive their part).

    This is the one routing function of the data plane: rollout nodes (distributed mode),
    the ``controller: single`` baseline and ``bench/redistribute.py`` all send through it.
    """
    if not consumers:
        raise ValueError("scatter needs at least one consumer endpoint")
    clash = RESERVED_META & set(extra_meta or {})
    if clash:
        raise ValueError(f"extra_meta may not set reserved keys {sorted(clash)}")
    if len({c.node_id for c in consumers}) != len(consumers):
        raise ValueError(f"duplicate consumer node ids in {[c.node_id for c in consumers]}")
    t0 = time.perf_counter()
    size = len(consumers) // replicas
    if replicas < 1 or size * replicas != len(consumers):
        raise ValueError(f"{len(consumers)} consumers are not {replicas} replica groups of equal size")
    owned = groups_for(batch, size, balance, source_rank)
    groups = [owned[k % size] for k in range(len(consumers))]  # every replica group: the whole batch
    common = {**(extra_meta or {}), "step": step, "source_rank": source_rank, "num_sources": num_sources,
              "num_parts": size, "balance": balance}
    wanted = [k for k in range(len(consumers)) if only is None or k in only]
    posted, nbytes = await _post(channel, batch, groups, consumers, wanted, kind, common)
    rest = set(wanted) - posted
    lend = (lambda k, n: channel.lend(consumers[k], n)) if channel.supports("shm") else None
    parts = split_parts(batch, groups, lend, rest) if rest else []
    sends: dict[str, asyncio.Task] = {}
    for rank, (consumer, part) in enumerate(zip(consumers, parts)):
        if part is None:
            continue
        wire_meta, tensors = part.to_wire()
        meta = {**common, **wire_meta, "part": rank % size}
        sends[consumer.node_id] = asyncio.create_task(
            channel.send(consumer, kind, meta, tensors, timeout=timeout),
            name=f"scatter-{kind}-s{step}-r{source_rank}->{consumer.node_id}")
    nbytes += sum(p.nbytes() for p in parts if p is not None)
    results = await asyncio.gather(*sends.values(), return_exceptions=True)
    parts.clear()  # lent slots are reused once every view of them is gone
    failed = {k: r for k, r in zip(sends, results) if isinstance(r, BaseException)}
    if failed:
        raise ScatterError(step, failed, [consumers[k].node_id for k in posted] + [k for k in sends if k not in failed])
    return {"step": step, "samples": [len(g) for g in groups], "bytes": nbytes, "posted": len(posted),
            "seconds": time.perf_counter() - t0}


async def _post(channel: Transport, batch: SampleBatch, groups: list[list[int]], consumers: list[Endpoint],
                wanted: list[int], kind: str, common: dict[str, Any]) -> tuple[set[int], int]:
    """Post the wanted parts whose consumers take ``kind`` by mailbox on this host: the batch is
    packed once into a buffer shared with them (every part's samples, field by field), and each gets
    a record naming its span. Returns (the parts posted, their bytes); the others go as messages."""
    if not channel.supports("posting"):
        return set(), 0
    posters = {k: channel.known_poster(consumers[k], kind) for k in wanted}
    unknown = [k for k, p in posters.items() if p is UNKNOWN]
    if unknown:
        found = await asyncio.gather(*(channel.poster(consumers[k], kind) for k in unknown))
        posters.update(zip(unknown, found))
    local = [k for k in wanted if posters[k] is not None]
    if not local:
        return set(), 0
    packer = Packer(batch)
    order = [i for k in local for i in groups[k]]
    layout, total = packer.layout(order)
    spans = packer.spans([groups[k] for k in local], layout)
    ids, prompt_ids, extras = batch.sample_ids, batch.prompt_ids, batch.extras
    metas = [msgpack.packb({**common, "sample_ids": [ids[i] for i in groups[k]],
                            "prompt_ids": [prompt_ids[i] for i in groups[k]],
                            "extras": [extras[i] for i in groups[k]], PACKED: part_layout,
                            "part": k % common["num_parts"]},
                           use_bin_type=True) for k, (_, _, part_layout) in zip(local, spans)]
    buf = await channel.shared_buffer(total, sum(len(m) + 8 for m in metas))
    if buf is None:
        return set(), 0
    posted: set[int] = set()
    nbytes = 0
    try:
        if total:
            packer.fill(order, layout, buf.data)
        for k, (lo, hi, _), meta in zip(local, spans, metas):
            if channel.post(posters[k], buf, common["step"], meta, lo, hi):
                posted.add(k)
                nbytes += hi - lo
    finally:
        channel.finish(buf)
    return posted, nbytes


def parse_part(env: Envelope) -> tuple[int, SampleBatch]:
    """(step, batch) of a scatter message; raises ValueError naming what is malformed or misrouted."""
    step = _step_of(env)
    batch = SampleBatch.from_wire(env.meta, env.tensors)
    _check_owners(env, batch.sample_ids)
    return step, batch


def parse_packed(env: Envelope | Post) -> tuple[int, SampleBatch | PackedPart]:
    """:func:`parse_part` for a part that goes straight into a shard (a message, or a same-host
    :class:`Post`): a packed part stays packed, its layout checked but no tensor built
    (``SampleBatch.concat`` copies its fields out of the buffer when the step is taken), at a
    fraction of the Python cost of building a batch of views."""
    meta = env.meta
    if isinstance(env, Post):
        buf = env.data
    elif meta.get(PACKED) is None:
        return parse_part(env)
    else:
        buf = env.tensors.get(PACKED)
        if len(env.tensors) != 1 or buf is None:
            raise ValueError(f"a packed batch carries one tensor {PACKED!r}, got {sorted(env.tensors)}")
    step = _step_of(env)
    try:
        ids, prompt_ids, extras = list(meta["sample_ids"]), list(meta["prompt_ids"]), list(meta.get("extras") or [])
    except (KeyError, TypeError) as e:
        raise ValueError(f"SampleBatch wire meta lacks or mistypes {e}") from None
    if len(prompt_ids) != len(ids) or (extras and len(extras) != len(ids)):
        raise ValueError(f"SampleBatch: {len(ids)} sample_ids but {len(prompt_ids)} prompt_ids, {len(extras)} extras")
    nbytes = check_packed(meta.get(PACKED), buf, len(ids))
    _check_owners(env, ids)
    return step, PackedPart(ids, prompt_ids, extras or [{} for _ in ids], buf, meta[PACKED], nbytes,
                            env if isinstance(env, Post) else None)


def _step_of(env: Envelope | Post) -> int:
    step = env.meta.get("step")
    if not isinstance(step, int) or step < 0:
        kind = "posted part" if isinstance(env, Post) else f"{env.kind} message"
        raise ValueError(f"{kind} from {env.sender}: 'step' must be a non-negative int, got {step!r}")
    return step


def _check_owners(env: Envelope | Post, sample_ids: list[str]) -> None:
    meta = env.meta
    part, num_parts = meta.get("part"), meta.get("num_parts")
    # (one consumer owns every sample: nothing to check)
    if meta.get("balance") == "owner" and isinstance(part, int) and isinstance(num_parts, int) and num_parts > 1:
        for sid, o in zip(sample_ids, owners(sample_ids, num_parts)):
            if o != part:
                raise ValueError(f"sample {sid!r} from {env.sender} was routed to consumer {part} of {num_parts}, "
                                 f"but its owner is {o} (inconsistent consumer lists?)")


def shard_receiver(shard: BufferShard, *, put_timeout: float) -> Callable[[Envelope], Any]:
    """A channel handler that stores each received part in ``shard`` under (step, sender node id).

    The handler awaits ``shard.put``, so a full shard holds back the producer's ack (backpressure).
    """

    async def handler(env: Envelope) -> None:
        step, batch = parse_packed(env)
        await shard.put(batch, step=step, source=env.sender, timeout=put_timeout)

    return handler


def open_ingress(channel: Transport, shard: BufferShard, accept: Callable[[Post], None] | None = None,
                 kind: str = "samples") -> bool:
    """Let same-host producers post ``kind`` parts straight into ``shard`` (no message per part: a
    record in this channel's mailbox, read when the shard is; see ``transport/movers/posting.py``).
    ``accept(post)`` stores a posted part with ``shard.put_nowait`` or drops it (default: under
    (step, sender node id), as :func:`shard_receiver` stores messages, which keep arriving from
    other hosts). False when the channel cannot take posts (not shared memory)."""
    inbox = channel.open_mailbox(kind)
    if inbox is None:
        return False

    def store(post: Post) -> None:
        step, batch = parse_packed(post)
        shard.put_nowait(batch, step=step, source=post.sender)

    shard.attach(inbox, accept or store)
    return True


async def gather_step(
    shard: BufferShard,
    step: int,
    producers: Sequence[str],
    timeout: float,
    *,
    min_version: int | None = None,
    alive: Callable[[str], bool] | None = None,
) -> SampleBatch:
    """This consumer's samples of ``step``: one part from each producer node id, sorted by producer."""
    return await shard.take_step(step, producers, timeout, min_version=min_version, alive=alive)
