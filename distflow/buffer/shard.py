"""BufferShard: the per-node buffer between DAG stages, with backpressure and staleness.

Every node keeps its incoming samples here, keyed by (step, source). Producers ``put``
their part of a step (an empty part is still a part: it says "nothing more from me for
this step"); the consumer ``take_step``s once every expected source delivered. Capacity
is in samples and is enforced by making producers *wait* — a full buffer never drops
data. Two rules keep waiting from turning into deadlock:

* a part larger than the whole capacity enters when the shard is empty;
* a part for a step a consumer is currently waiting on always enters (otherwise a
  capacity smaller than one step would block the very parts the consumer needs).
  Capacity therefore bounds *read-ahead* (parts of future steps), which is what it is for.

``take_step`` enforces the staleness bound (``min_version``) and notices dead producers
through an ``alive`` callback instead of waiting for its deadline.

Same-host producers may *post* their parts instead (:meth:`BufferShard.attach`: a channel mailbox,
``transport/movers/posting.py``): a posted part is delivered once its record is in the mailbox, and
enters the shard when the shard reads the mailbox (every ``take_step`` and ``put`` does, and the
mailbox's doorbell wakes a waiting ``take_step`` only once the records it waits for are all
there). Posted parts skip the capacity wait: the mailbox bounds how far a producer runs ahead.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, Callable, Collection

from distflow.buffer.batch import PackedPart, SampleBatch
from distflow.core.aio import woken
from distflow.transport.movers.posting import Post

log = logging.getLogger(__name__)


class SourceLostError(RuntimeError):
    """A producer that still owes its part of a step is dead."""

    def __init__(self, step: int, dead: list[str], missing: list[str]):
        super().__init__(f"step {step}: source(s) {dead} died before delivering (still missing: {missing})")
        self.step = step
        self.dead = dead
        self.missing = missing


class DuplicatePartError(ValueError):
    """A second part for a (step, source) already held or taken."""


class StaleSampleError(ValueError):
    """Samples older than the staleness bound. ``batch`` holds the whole (consumed) step."""

    def __init__(self, step: int, stale_ids: list[str], min_version: int, batch: SampleBatch):
        shown = stale_ids[:5] + (["..."] if len(stale_ids) > 5 else [])
        super().__init__(f"step {step}: {len(stale_ids)} sample(s) have policy_version < {min_version}: {shown}")
        self.step = step
        self.stale_ids = stale_ids
        self.min_version = min_version
        self.batch = batch


class BufferShard:
    """Per-node sample buffer keyed by (step, source); see the module docstring."""

    def __init__(self, capacity: int, *, name: str = "buffer", history: int = 4096, poll_interval: float = 0.05):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"BufferShard capacity must be a positive int (samples), got {capacity!r}")
        self.capacity = capacity
        self.name = name
        self._history = history
        self._poll = poll_interval
        self._parts: dict[int, dict[str, SampleBatch]] = {}
        self._reserved: set[tuple[int, str]] = set()  # puts in progress (waiting for capacity)
        self._taken: set[tuple[int, str]] = set()
        self._max_taken = -1
        self._takers: list[tuple[int, tuple[str, ...]]] = []  # (step, sources) of each waiting take_step
        self._cond = asyncio.Condition()
        self._held_samples = 0
        self._held_bytes = 0
        self._waiting = 0
        self._c: Counter[str] = Counter()
        self._inbox: Any = None  # a channel mailbox (posting.Inbox) whose posts enter through ``_accept``
        self._accept: Callable[[Post], None] | None = None
        self._kick: asyncio.Task | None = None
        self._post: Post | None = None  # the post _accept is looking at
        self._stored = False  # ... and whether it stored it

    def attach(self, inbox: Any, accept: Callable[[Post], None]) -> None:
        """Read same-host posts from ``inbox`` (``Transport.open_mailbox``): ``accept(post)`` stores
        each with :meth:`put_nowait`, as ``redistribute.parse_packed(post)`` returns it (a packed part
        that views the producer's buffer: the shard releases it when the part leaves), or drops it;
        what it raises is logged and counted, and a post not stored is released at once."""
        self._inbox, self._accept = inbox, accept
        inbox.waker = self._rang

    def _rang(self) -> None:
        """The mailbox's doorbell: what a waiting taker armed for is there; wake it (one task per ring)."""
        if self._kick is None or self._kick.done():
            self._kick = asyncio.get_running_loop().create_task(self._notify(), name=f"{self.name}-posts")

    async def _notify(self) -> None:
        async with self._cond:  # (the taker reads the mailbox itself when it wakes)
            self._cond.notify_all()

    def _pump(self) -> None:
        """Move every part posted to the attached mailbox into the shard (synchronous: callers hold
        the condition's lock or run between awaits)."""
        if self._inbox is None:
            return
        for post in self._inbox.drain():
            self._post, self._stored = post, False
            try:
                self._accept(post)  # type: ignore[misc]
            except Exception as e:  # noqa: BLE001 - a bad post is dropped, never the taker
                self._c["posts_refused"] += 1
                if self._c["posts_refused"] <= 3 or self._c["posts_refused"] % 1000 == 0:
                    log.warning("%s: refused a post from %s (%s: %s)", self.name, post.sender, type(e).__name__, e)
            if not self._stored:  # dropped (late, duplicate, malformed): the producer may reuse it
                post.release()
        self._post = None

    def _arm(self) -> bool:
        """Ask the mailbox to ring once the posts the waiting takers miss are there; True if they are
        already (read them instead of sleeping)."""
        if self._inbox is None or not self._takers:
            return False
        if len(self._takers) > 1:  # several steps awaited: any post wakes
            return self._inbox.arm(None, 1)
        step, srcs = self._takers[0]
        have = self._parts.get(step, {})
        missing = sum(1 for x in srcs if x not in have)
        return missing > 0 and self._inbox.arm(step, missing)

    def put_nowait(self, batch: PackedPart, *, step: int, source: str) -> None:
        """Store a posted part now (no capacity wait); DuplicatePartError for a second part of (step, source)."""
        if self._post is None or not isinstance(batch, PackedPart) or batch.post is not self._post:
            raise TypeError("put_nowait stores the post being accepted, as parse_packed returns it")
        key = (step, source)
        if key in self._taken or key in self._reserved or source in self._parts.get(step, {}):
            raise DuplicatePartError(f"{self.name}: duplicate part for step {step} from {source!r}")
        self._parts.setdefault(step, {})[source] = batch
        n = len(batch)
        self._held_samples += n
        self._held_bytes += batch.nbytes()
        self._c["in"] += n
        self._c["puts"] += 1
        self._c["posted_parts"] += 1
        self._stored = True  # (released when it leaves the shard)

    # ------------------------------------------------------------------ producer side
    async def put(self, batch: SampleBatch, *, step: int, source: str, timeout: float) -> None:
        """Add ``source``'s part of ``step``; waits (up to ``timeout``) while the shard is full."""
        if not isinstance(batch, (SampleBatch, PackedPart)):
            raise TypeError(f"BufferShard.put expects a SampleBatch (or a PackedPart), got {type(batch).__name__}")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if not isinstance(source, str) or not source:
            raise ValueError(f"source must be a non-empty str, got {source!r}")
        key = (step, source)
        n = len(batch)
        async with self._cond:
            self._pump()  # posted parts first: this part may complete a step together with them
            if key in self._reserved:  # a first copy still waits for room: its fate decides this one's
                self._waiting += 1  # (its admission or failure then wakes us)
                try:
                    if not await woken(self._cond.wait_for(lambda: key not in self._reserved), timeout):
                        raise TimeoutError(f"{self.name}: put of step {step} from {source!r} waited {timeout:g}s "
                                           "for an earlier copy of the same part to be stored or given up")
                finally:
                    self._waiting -= 1
            if key in self._taken or source in self._parts.get(step, {}):
                raise DuplicatePartError(f"{self.name}: duplicate part for step {step} from {source!r}")
            self._reserved.add(key)
            admitted = False
            try:
                if not self._admissible(n, step):
                    self._waiting += 1
                    try:
                        if not await woken(self._cond.wait_for(lambda: self._admissible(n, step)), timeout):
                            raise TimeoutError(
                                f"{self.name}: put of step {step} from {source!r} ({n} samples) waited {timeout:g}s "
                                f"for capacity (holding {self._held_samples}/{self.capacity} samples)")
                    finally:
                        self._waiting -= 1
                self._parts.setdefault(step, {})[source] = batch
                self._held_samples += n
                self._held_bytes += batch.nbytes()
                self._c["in"] += n
                self._c["puts"] += 1
                admitted = True
                # wake takers only when this part completes a step one of them waits for (a step's N
                # parts would otherwise wake each taker N times), or producers waiting for room
                have = self._parts[step]
                if self._waiting or any(s == step and all(x in have for x in srcs) for s, srcs in self._takers) \
                        or self._arm():  # (re-armed: a taker's missing posts are fewer now, or all there)
                    self._cond.notify_all()
            finally:
                self._reserved.discard(key)
                if not admitted:
                    self._cond.notify_all()

    def _admissible(self, n: int, step: int) -> bool:
        return self._held_samples + n <= self.capacity or self._held_samples == 0 or any(s == step for s, _ in self._takers)

    # ------------------------------------------------------------------ consumer side
    async def take_step(
        self,
        step: int,
        sources: Collection[str],
        timeout: float,
        min_version: int | None = None,
        alive: Callable[[str], bool] | None = None,
        progress: Callable[[list[str]], Any] | None = None,
    ) -> SampleBatch:
        """Wait for every source's part of ``step``; return them concatenated in sorted-source order.
        ``timeout`` runs from the start or, with ``progress``, from the last change of
        ``progress(missing sources)`` (the producers of those parts are busy with something else that
        moves, e.g. an evaluation; another producer's progress must not count)."""
        if isinstance(sources, str):
            raise TypeError("sources must be a collection of source names, not a single str")
        srcs = sorted(set(sources))
        for s in srcs:
            if (step, s) in self._taken:
                raise ValueError(f"{self.name}: step {step} from {s!r} was already taken")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        started, seen = loop.time(), None
        async with self._cond:
            me = (step, tuple(srcs))
            self._takers.append(me)
            self._cond.notify_all()  # producers blocked on this step may enter now
            try:
                while True:
                    self._pump()
                    have = self._parts.get(step, {})
                    missing = [s for s in srcs if s not in have]
                    if not missing:
                        break
                    if alive is not None:
                        dead = [s for s in missing if not alive(s)]
                        if dead:
                            raise SourceLostError(step, dead, missing)
                    if progress is not None and seen is None:
                        seen = progress(missing)
                    remaining = deadline - loop.time()
                    if remaining <= 0 and progress is not None and (now := progress(missing)) != seen:
                        seen, deadline = now, loop.time() + timeout
                        remaining = timeout
                    if remaining <= 0:
                        waited = loop.time() - started
                        why = (f"{timeout:g}s" if progress is None
                               else f"{waited:.0f}s, the last {timeout:g}s without progress")
                        raise TimeoutError(f"{self.name}: step {step} incomplete after {why}; "
                                           f"missing parts from {missing} (have {sorted(have)})")
                    if self._arm():
                        continue  # the missing parts were posted meanwhile
                    await woken(self._cond.wait(), min(remaining, self._poll) if alive else remaining)
                parts = [have[s] for s in srcs]
                nonempty = [p for p in parts if len(p)]
                # one non-empty part is returned as is (no copy: a packed one as views of its buffer,
                # released when they die); else concat raises, keeping the parts, if their fields disagree
                kept = nonempty[0] if len(nonempty) == 1 else None
                if kept is not None:
                    batch = kept.to_batch() if isinstance(kept, PackedPart) else kept
                else:
                    batch = SampleBatch.concat(parts)
                for p in parts:
                    if p is not kept and isinstance(p, PackedPart):
                        p.release()  # copied out (or empty): its producer may reuse the memory
                for s in srcs:
                    del have[s]
                    self._taken.add((step, s))
                if not have:
                    self._parts.pop(step, None)
                self._held_samples -= sum(len(p) for p in parts)
                self._held_bytes -= sum(p.nbytes() for p in parts)
                self._c["out"] += len(batch)
                self._c["takes"] += 1
                self._prune_taken(step)
                self._cond.notify_all()
            finally:
                self._takers.remove(me)
        if min_version is not None and len(batch):
            pv = batch.tensors.get("policy_version")
            if pv is None:
                raise ValueError(f"{self.name}: min_version={min_version} but step {step} has no policy_version field")
            stale = (pv < min_version).nonzero().flatten().tolist()
            if stale:
                self._c["stale_rejected"] += len(stale)
                raise StaleSampleError(step, [batch.sample_ids[i] for i in stale], min_version, batch)
        return batch

    def _prune_taken(self, step: int) -> None:
        self._max_taken = max(self._max_taken, step)
        if len(self._taken) > 4 * self._history:
            floor = self._max_taken - self._history
            self._taken = {k for k in self._taken if k[0] > floor}

    async def discard_before(self, step: int) -> int:
        """Drop every part held for a step below ``step`` (steps that will never be taken: a
        resumed run starts at its checkpoint's step, and a part sent before the rollout nodes
        knew that would hold capacity for the whole run). Returns the number of parts dropped;
        a later copy of one of them counts as a duplicate."""
        async with self._cond:
            self._pump()
            dropped = 0
            for s in [s for s in self._parts if s < step]:
                for source, part in self._parts.pop(s).items():
                    self._held_samples -= len(part)
                    self._held_bytes -= part.nbytes()
                    self._taken.add((s, source))
                    if isinstance(part, PackedPart):
                        part.release()
                    dropped += 1
            if dropped:
                self._c["discarded_parts"] += dropped
                self._cond.notify_all()  # room for producers waiting on capacity
            return dropped

    # ------------------------------------------------------------------ introspection
    def steps_held(self) -> dict[int, list[str]]:
        """{step: [sources with a part held]}."""
        return {s: sorted(p) for s, p in sorted(self._parts.items())}

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "capacity": self.capacity,
            "in": self._c["in"],
            "out": self._c["out"],
            "puts": self._c["puts"],
            "takes": self._c["takes"],
            "waiting": self._waiting,
            "samples_held": self._held_samples,
            "bytes_held": self._held_bytes,
            "parts_held": sum(len(p) for p in self._parts.values()),
            "stale_rejected": self._c["stale_rejected"],
            "posted_parts": self._c["posted_parts"],
            "posts_refused": self._c["posts_refused"],
        }
