"""The SWIM driver of a Node: the timers and probes that keep ``mesh.Membership`` true.

Why it exists: ``mesh.py`` holds the protocol's rules as pure functions of time; this is the
part that runs them on a real event loop: join through the seeds, one probe per protocol
period (direct, then indirect through ``indirect_k`` helpers), suspicion expiry with a
local-health allowance (a lagging loop blames others later), gossip rounds, periodic
push-pull anti-entropy and the announcement of this node's own loop stalls.

A mixin of :class:`distflow.core.node.Node`, which provides the sockets and state it uses:
``config``, ``node_id``, ``address``, ``_membership``, ``_loop``, ``_rng``, ``_seeds``,
``_host``, ``_lag``, ``_rounds``, ``_join_fut``, ``_resync``, ``_next_push_pull``,
``_announced_lag``, ``_last_announce``, ``_stopping`` and the methods ``_notify``,
``_send``, ``_send_member``, ``_send_ack``, ``_new_ack`` and ``_pull_state``.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from distflow.core.mesh import Member
from distflow.core.out_sockets import parse_address
from distflow.core.wire import Envelope

__all__ = ["JoinTimeout", "SwimDriver", "LAG_ANNOUNCE_S"]

LAG_ANNOUNCE_S = 0.5  # a loop stall this long is gossiped to everyone


class JoinTimeout(TimeoutError):
    """No seed answered within ``join_timeout_s``."""


class SwimDriver:
    """Join, probe, expire, gossip and anti-entropy loops (see the module docstring)."""

    _lag: float
    _membership: Any

    def _slack(self) -> float:
        """Local-health allowance: a lagging loop waits longer before it blames others."""
        return min(self._lag, 2 * self.config.protocol_period_s)

    def _push_pull_interval(self) -> float:
        n = self._membership.n_live()
        scale = max(1.0, math.log2(max(n, 1)) - 4) if n > 32 else 1.0
        return self.config.push_pull_interval_s * scale

    async def _join(self) -> None:
        own = parse_address(self.address)
        seeds = [s for s in self._seeds if s != own and not (s[1] == own[1] and s[0] in (self._host, "localhost"))]
        if not seeds:
            return
        c = self.config
        self._join_fut = self._loop.create_future()
        deadline = self._loop.time() + c.join_timeout_s
        wait = 0.25
        me = self._membership.me
        while True:
            for host, port in seeds:
                self._send("", host, port, 0, "swim.join", {"u": me.to_update()})
            remaining = deadline - self._loop.time()
            done, _ = await asyncio.wait({self._join_fut}, timeout=min(wait * self._rng.uniform(0.8, 1.2), remaining))
            if done:
                # others may be joining at the same time (a cold start): pull the seed's state
                # once more after a period, when it knows them (see _protocol_loop)
                self._resync = (self._loop.time() + c.protocol_period_s, self._join_fut.result())
                return
            if self._loop.time() >= deadline:
                names = ", ".join(f"{h}:{p}" for h, p in seeds)
                raise JoinTimeout(f"node {self.node_id} could not join the mesh within {c.join_timeout_s:.3g}s "
                                  f"(mesh.join_timeout_s): no seed answered ({names}); check the seed addresses, "
                                  f"that they are running, "
                                  f"and that DISTFLOW_SECRET is the cluster's")
            wait = min(2 * wait, 2.0)

    async def _lag_loop(self) -> None:
        """Event-loop lag: the overshoot of a 0.1 s sleep (a decaying maximum)."""
        while True:
            t0 = self._loop.time()
            await asyncio.sleep(0.1)
            self._lag = max(self._loop.time() - t0 - 0.1, self._lag * 0.7, 0.0)

    async def _protocol_loop(self) -> None:
        c = self.config
        period = c.protocol_period_s
        await asyncio.sleep(self._rng.uniform(0, period))
        next_t = self._loop.time()
        while True:
            self._rounds += 1
            ms = self._membership
            now = time.time()
            self._notify(ms.expire(now, slack=self._slack()))
            self._maybe_announce_lag(now)
            self._gossip_round()
            self._maybe_push_pull()
            if self._resync is not None and self._loop.time() >= self._resync[0]:
                self._pull_state(self._resync[1], force=True)
                self._resync = None
            target = ms.next_probe_target()
            next_t += period
            if target is not None:
                await self._probe(target, next_t)
                self._notify(ms.expire(time.time(), slack=self._slack()))
            delay = next_t - self._loop.time()
            if delay < 0:
                next_t = self._loop.time()
                delay = 0
            await asyncio.sleep(delay)

    async def _probe(self, target: Member, period_end: float) -> None:
        c = self.config
        seq, fut = self._new_ack()
        try:
            self._send_member(target, "swim.ping", {"s": seq, "l": self._lag, "m": self._membership.n_live()})
            done, _ = await asyncio.wait({fut}, timeout=c.probe_timeout_s + self._slack())
            if done:
                return
            helpers = self._membership.random_members(c.indirect_k, exclude={target.node_id})
            body = {"s": seq, "n": target.node_id, "h": target.host, "p": target.port, "i": target.incarnation}
            for h in helpers:
                self._send_member(h, "swim.ping_req", body)
            remaining = max(period_end - self._loop.time(), c.probe_timeout_s) + self._slack()
            done, _ = await asyncio.wait({fut}, timeout=remaining)
            if not done and not self._stopping:
                self._notify(self._membership.suspect(target.node_id, time.time()))
        finally:
            fut.cancel()

    async def _indirect_probe(self, env: Envelope, seq: int, target: str, host: str, port: int, inc: int) -> None:
        my_seq, fut = self._new_ack()
        try:
            self._send(target, host, port, inc, "swim.ping", {"s": my_seq, "l": self._lag})
            done, _ = await asyncio.wait({fut}, timeout=self.config.probe_timeout_s + self._slack())
            if done:
                self._send_ack(env, seq, target)
        finally:
            fut.cancel()

    def _gossip_round(self) -> None:
        """While updates are pending, piggyback them on extra messages to ``gossip_fanout`` peers."""
        ms = self._membership
        for m in ms.random_members(self.config.gossip_fanout) if len(ms.queue) else ():
            if not len(ms.queue):
                break
            self._send_member(m, "swim.gossip", {"m": ms.n_live()})

    def _maybe_push_pull(self) -> None:
        now = time.monotonic()
        if now < self._next_push_pull:
            return
        self._next_push_pull = now + self._push_pull_interval() * self._rng.uniform(0.8, 1.2)
        peers = self._membership.random_members(1)
        if peers:
            self._send_member(peers[0], "swim.sync",
                              {"state": self._membership.full_state(self.config.max_frame_bytes // 2)})

    def _maybe_announce_lag(self, now: float) -> None:
        """Loop lag travels in every probe/ack; it is disseminated cluster-wide only on a real stall.

        Bumping the incarnation on every lag change would start a gossip storm exactly when
        the cluster is loaded (every node's lag rises together), so only a stall of
        LAG_ANNOUNCE_S or more, or the recovery from it, is announced (at most every 30 s).
        """
        lag = round(self._lag, 3)
        stalled, was = lag >= LAG_ANNOUNCE_S, self._announced_lag >= LAG_ANNOUNCE_S
        if (stalled or was) and (stalled != was or lag > 2 * self._announced_lag) and now - self._last_announce >= 30.0:
            self._announced_lag, self._last_announce = lag, now
            self._membership.update_self(now, loop_lag_s=lag)
