"""Versioned, bucketed weight publication from trainers to rollout nodes.

After every update each trainer rank holds the full weights (gathered collectively) and
sends them to its share of the rollout nodes (rollout i is served by trainer i mod T),
so no trainer sends to everyone. Each rollout peer is served by its own background task
(``WeightPublisher``), so training never waits on a slow or cut-off peer. Weights travel in buckets of about ``bucket_bytes`` as
ordinary data-plane messages of kind ``weights``; a rollout node applies a version only
once every bucket of it has arrived, between two generation batches.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import torch

from distflow.core.channels import Endpoint, Envelope, TensorChannel

BUCKET_BYTES = 64 << 20


def buckets(state: dict[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if out[-1] and size + n > bucket_bytes:
            out.append({})
            size = 0
        out[-1][name] = t
        size += n
    return out


async def publish(channel: TensorChannel, peers: list[Endpoint], version: int,
                  state: dict[str, torch.Tensor], timeout: float) -> None:
    """Send one weight version to each peer (peers in parallel, buckets in order)."""
    parts = buckets(state)

    async def one(peer: Endpoint) -> None:
        for i, part in enumerate(parts):
            await channel.send(peer, "weights", {"version": version, "bucket": i, "num_buckets": len(parts)},
                               part, timeout=timeout)

    await asyncio.gather(*(one(p) for p in peers))


class WeightInbox:
    """Rollout side: assembles buckets, keeps the newest complete version."""

    def __init__(self) -> None:
        self.version = 0  # newest complete version received (0 = the initial weights)
        self.pending: dict[str, torch.Tensor] | None = None
        self._partial: dict[int, dict[str, torch.Tensor]] = {}
        self._counts: dict[int, int] = {}
        self._changed = asyncio.Condition()

    async def receive(self, env: Envelope) -> None:
        try:
            v, n = int(env.meta["version"]), int(env.meta["num_buckets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"weights message from {env.sender} has bad meta {env.meta!r}: {e}") from None
        if v <= self.version:
            return  # an old version: newer weights are already here
        self._partial.setdefault(v, {}).update(env.tensors)
        self._counts[v] = self._counts.get(v, 0) + 1
        if self._counts[v] == n:
            self.pending = self._partial.pop(v)
            del self._counts[v]
            for old in [k for k in self._partial if k < v]:
                del self._partial[old], self._counts[old]
            async with self._changed:
                self.version = v
                self._changed.notify_all()

    def take(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest complete weights not yet applied, if any."""
        if self.pending is None:
            return None
        state, self.pending = self.pending, None
        return self.version, state

    async def wait_for(self, version: int, timeout: float, check: Callable[[], None]) -> None:
        """Wait until weights of at least ``version`` have arrived; ``check`` raises if the trainers are gone."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.version < version:
            check()
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"no weights of version {version} within {timeout:.0f}s (have {self.version})")
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=min(left, 1.0))
                except asyncio.TimeoutError:
                    pass


class WeightPublisher:
    """Trainer side: one background sender per rollout peer, always sending the newest version.

    Training never waits for a slow or cut-off rollout node: each peer's task sends the
    newest version it has not yet received, skips peers that are not alive, abandons a
    send when its peer is declared dead, and starts over from the current version when a
    peer comes back (``peer_up``), so a node that rejoins after a partition or a restart
    gets current weights. Endpoints are resolved at send time (a restarted node may have
    a new data port).
    """

    def __init__(self, channel: TensorChannel, peers: list[str], endpoint_of: Callable[[str], Endpoint],
                 is_alive: Callable[[str], bool], timeout: float):
        self.channel, self.endpoint_of, self.is_alive, self.timeout = channel, endpoint_of, is_alive, timeout
        self.peers = list(peers)
        self.latest: tuple[int, dict[str, torch.Tensor]] | None = None
        self.sent = {p: 0 for p in peers}
        self._down = {p: asyncio.Event() for p in peers}
        self._wake = asyncio.Event()
        self._tasks = [asyncio.create_task(self._serve(p), name=f"publish-weights->{p}") for p in peers]

    def offer(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self.latest = (version, state)
        self._wake.set()

    def peer_up(self, node_id: str) -> None:
        """The peer restarted or returned: it may hold old weights, send it the current ones."""
        if node_id in self.sent:
            self.sent[node_id] = 0
            self._down[node_id].clear()
            self._wake.set()

    def peer_down(self, node_id: str) -> None:
        if node_id in self._down:
            self._down[node_id].set()

    async def _serve(self, peer: str) -> None:
        log = logging.getLogger(__name__)
        while True:
            latest = self.latest
            if latest is None or latest[0] <= self.sent[peer] or not self.is_alive(peer):
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass
                continue
            version, state = latest
            send = asyncio.create_task(publish(self.channel, [self.endpoint_of(peer)], version, state,
                                               timeout=self.timeout), name=f"weights-v{version}->{peer}")
            down = asyncio.create_task(self._down[peer].wait(), name=f"watch-{peer}")
            await asyncio.wait({send, down}, return_when=asyncio.FIRST_COMPLETED)
            down.cancel()
            if not send.done():
                send.cancel()
                log.warning("weights v%d -> %s abandoned: the peer is down", version, peer)
                await asyncio.gather(send, return_exceptions=True)
            elif send.exception() is not None:
                log.warning("weights v%d -> %s failed: %s", version, peer, send.exception())
                await asyncio.sleep(0.5)
            else:
                self.sent[peer] = max(self.sent[peer], version)

    async def flush(self, timeout: float) -> None:
        """Wait (bounded) until every alive peer has the newest version."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.latest is not None and loop.time() < deadline:
            if all(self.sent[p] >= self.latest[0] for p in self.peers if self.is_alive(p)):
                return
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
