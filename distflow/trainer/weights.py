"""Versioned, bucketed weight publication from trainers to rollout nodes.

After every update each trainer rank holds the full weights (gathered collectively) and
sends them to its share of the rollout nodes (rollout i is served by trainer i mod T),
so no trainer sends to everyone. Weights travel in buckets of about ``bucket_bytes`` as
ordinary data-plane messages of kind ``weights``; a rollout node applies a version only
once every bucket of it has arrived, between two generation batches.
"""

from __future__ import annotations

import asyncio
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
