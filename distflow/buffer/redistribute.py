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

from distflow.buffer.batch import PACKED, SampleBatch
from distflow.buffer.routing import owner_groups, owners, split_parts, token_partition
from distflow.buffer.shard import BufferShard
from distflow.core.channels import Endpoint, Envelope, TensorChannel

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


def groups_for(batch: SampleBatch, num_consumers: int, balance: str) -> list[list[int]]:
    """Sample indices of each consumer's part under a balance mode ("owner" | "tokens")."""
    if balance == "owner":
        return owner_groups(batch, num_consumers)
    if balance == "tokens":
        return token_partition(batch.num_tokens(), num_consumers)
    raise ValueError(f"unknown balance mode {balance!r}; expected one of {BALANCE_MODES}")


async def scatter(
    channel: TensorChannel,
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
) -> dict[str, Any]:
    """Send this producer's part of ``step`` to every consumer (concurrently); one message each.

    The message meta is the part's ``SampleBatch.to_wire()`` meta (so ``SampleBatch.from_wire(
    env.meta, env.tensors)`` works on it) plus ``step``, ``source_rank``, ``num_sources``,
    ``part``, ``num_parts``, ``balance`` and any ``extra_meta`` (msgpack-able, not those keys).
    ``only`` (consumer indices) sends just those parts, e.g. a retry to the consumers a first
    attempt could not reach; the split is the same, so each part still goes to its owner.
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
    groups = groups_for(batch, len(consumers), balance)
    lend = getattr(channel, "lend", None)
    parts = split_parts(batch, groups, None if lend is None else (lambda k, n: lend(consumers[k], n)), only)
    sends: dict[str, asyncio.Task] = {}
    for rank, (consumer, part) in enumerate(zip(consumers, parts)):
        if part is None:
            continue
        wire_meta, tensors = part.to_wire()
        meta = {**(extra_meta or {}), **wire_meta, "step": step, "source_rank": source_rank,
                "num_sources": num_sources, "part": rank, "num_parts": len(consumers), "balance": balance}
        sends[consumer.node_id] = asyncio.create_task(
            channel.send(consumer, kind, meta, tensors, timeout=timeout),
            name=f"scatter-{kind}-s{step}-r{source_rank}->{consumer.node_id}")
    nbytes = sum(p.nbytes() for p in parts if p is not None)
    results = await asyncio.gather(*sends.values(), return_exceptions=True)
    parts.clear()  # lent slots are reused once every view of them is gone
    failed = {k: r for k, r in zip(sends, results) if isinstance(r, BaseException)}
    if failed:
        raise ScatterError(step, failed, [k for k in sends if k not in failed])
    return {"step": step, "samples": [len(g) for g in groups], "bytes": nbytes,
            "seconds": time.perf_counter() - t0}


def parse_part(env: Envelope) -> tuple[int, SampleBatch]:
    """(step, batch) of a scatter message; raises ValueError naming what is malformed or misrouted."""
    meta = env.meta
    step = meta.get("step")
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"{env.kind} message from {env.sender}: 'step' must be a non-negative int, got {step!r}")
    batch = SampleBatch.from_wire(meta, env.tensors)
    part, num_parts = meta.get("part"), meta.get("num_parts")
    if meta.get("balance") == "owner" and isinstance(part, int) and isinstance(num_parts, int) and num_parts > 0:
        for sid, o in zip(batch.sample_ids, owners(batch.sample_ids, num_parts)):
            if o != part:
                raise ValueError(f"sample {sid!r} from {env.sender} was routed to consumer {part} of {num_parts}, "
                                 f"but its owner is {o} (inconsistent consumer lists?)")
    return step, batch


def shard_receiver(shard: BufferShard, *, put_timeout: float) -> Callable[[Envelope], Any]:
    """A channel handler that stores each received part in ``shard`` under (step, sender node id).

    The handler awaits ``shard.put``, so a full shard holds back the producer's ack (backpressure).
    """

    async def handler(env: Envelope) -> None:
        step, batch = parse_part(env)
        await shard.put(batch, step=step, source=env.sender, timeout=put_timeout)

    return handler


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
