"""SWIM membership: the pure protocol state machine (no sockets, no clock, no asyncio).

Why this module exists: DistFlow has no driver, so every node must learn who else is in
the cluster, notice crashes within a bounded time, and agree on members' metadata
(ports, group, rank, policy version) without any central registry. This is SWIM
(Das et al., 2002) with the usual production refinements (memberlist/Lifeguard style):
incarnation numbers, suspicion before death, refutation, piggybacked dissemination
retransmitted ~lambda*log(N) times, and tombstones. Keeping it free of I/O makes the
rules testable with hand-made updates and synthetic times; ``node.py`` drives it.

A membership *update* is the full record of one member plus its state, as a list::

    [state_code, node_id, incarnation, role, host, port, meta, loop_lag_s]

Precedence (per member, ``i`` = incoming incarnation, ``j`` = known one):
alive(i) beats anything with j < i; suspect(i) beats alive(j <= i) and suspect(j < i);
dead(i) beats alive/suspect(j <= i); left(i) beats alive/suspect/dead(j <= i).
News about oneself that would make one non-alive (or is newer) is refuted by bumping
one's own incarnation above it. Metadata changes also bump the incarnation.

Dissemination has two paths. Piggyback gossip (every message carries the least-sent
pending updates) spreads single changes: deaths, leaves, metadata. Bulk state transfers
(join answers, periodic anti-entropy, and pulls the node driver triggers when a peer
advertises more live members than this node knows) spread mass changes such as a cold
start; what arrives in bulk is merged but *not* re-gossiped, or a mass join would make
every node re-send the whole membership lambda*log(N) times.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import msgpack

from distflow.core.wire import MAX_ID_LEN, WireError

ALIVE, SUSPECT, DEAD, LEFT = "alive", "suspect", "dead", "left"
STATES = (ALIVE, SUSPECT, DEAD, LEFT)
_CODE = {ALIVE: 0, SUSPECT: 1, DEAD: 2, LEFT: 3}
_LIVE = (ALIVE, SUSPECT)
_U63 = (1 << 63) - 1

Update = list  # [code, node_id, incarnation, role, host, port, meta, loop_lag_s]
Event = tuple  # (event_name, Member) with event_name in STATES or "update"


@dataclass
class MeshConfig:
    """Timing and size knobs of the mesh. Defaults suit a loopback/LAN cluster."""

    protocol_period_s: float = 0.2  # one probe per period
    probe_timeout_s: float | None = None  # direct ack deadline (default: half the period); then indirect probes
    indirect_k: int = 3  # helpers asked to probe an unresponsive member
    suspicion_timeout_s: float = 1.2  # suspect -> dead unless refuted
    retransmit_mult: float = 4.0  # lambda: each update is sent ~lambda*ceil(log10(N+1)) times
    max_frame_bytes: int = 1 << 20
    request_timeout_s: float = 10.0
    join_timeout_s: float = 30.0
    shutdown_timeout_s: float = 5.0
    gossip_fanout: int = 3  # extra gossip-only messages per period while updates are pending
    max_piggyback: int = 64  # updates per message
    piggyback_bytes: int | None = None  # update bytes per message (default: min(32 KiB, max_frame_bytes / 4))
    push_pull_interval_s: float = 10.0  # full-state anti-entropy with one random member
    dead_retention_s: float = 300.0  # tombstones kept this long
    max_msg_age_s: float = 300.0  # accepted clock difference / replay horizon
    max_inflight_handlers: int = 1024
    advertise_host: str | None = None  # address others use; default: the bind host

    def __post_init__(self) -> None:
        if self.probe_timeout_s is None:
            self.probe_timeout_s = self.protocol_period_s / 2
        if self.max_frame_bytes < 4096:
            raise ValueError(f"MeshConfig.max_frame_bytes must be >= 4096, got {self.max_frame_bytes}")
        if self.piggyback_bytes is None:
            self.piggyback_bytes = min(32 * 1024, self.max_frame_bytes // 4)
        for name in ("protocol_period_s", "probe_timeout_s", "suspicion_timeout_s", "request_timeout_s",
                     "join_timeout_s", "shutdown_timeout_s", "push_pull_interval_s", "dead_retention_s",
                     "max_msg_age_s", "retransmit_mult"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"MeshConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.probe_timeout_s >= self.protocol_period_s:
            raise ValueError(
                f"MeshConfig.probe_timeout_s ({self.probe_timeout_s}) must be < protocol_period_s "
                f"({self.protocol_period_s}) to leave time for indirect probes"
            )
        for name in ("indirect_k", "gossip_fanout"):
            if getattr(self, name) < 0:
                raise ValueError(f"MeshConfig.{name} must be >= 0")
        if self.max_piggyback < 1 or not 256 <= self.piggyback_bytes <= self.max_frame_bytes // 2:
            raise ValueError("MeshConfig.max_piggyback must be >= 1 and piggyback_bytes in [256, max_frame_bytes/2]")

    def retransmit_limit(self, n: int) -> int:
        """How many times one update is piggybacked, for ``n`` live members."""
        return max(1, math.ceil(self.retransmit_mult * math.ceil(math.log10(n + 1))))

    def expected_detection_s(self, n: int) -> float:
        """Typical time from a crash to every member marking it dead (not a hard bound).

        One period until some member probes it, one for the probe, the suspicion
        timeout, then dissemination to all (fanout ``gossip_fanout + 1`` per period).
        """
        spread = math.ceil(math.log(max(n, 2)) / math.log(self.gossip_fanout + 2)) + 1
        return (2 + spread) * self.protocol_period_s + self.suspicion_timeout_s

    def refute_window_s(self, n: int) -> float:
        """How long a death must stand before it is believed: a live member declared dead by
        mistake (its host was loaded and missed probes) refutes once the rumour reaches it,
        and its refutation spreads back. Two detection spreads cover both."""
        return 2 * self.expected_detection_s(n)


@dataclass
class Member:
    """One member as this node sees it."""

    node_id: str
    role: str
    host: str
    port: int
    state: str  # "alive" | "suspect" | "dead" | "left"
    incarnation: int
    meta: dict = field(default_factory=dict)
    last_seen: float = 0.0  # time.time() of the last direct or gossiped sign of life
    loop_lag_s: float = 0.0
    since: float = 0.0  # time.time() this node last saw the state change (or first heard of the member)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def copy(self) -> "Member":
        return Member(self.node_id, self.role, self.host, self.port, self.state, self.incarnation, dict(self.meta),
                      self.last_seen, self.loop_lag_s, self.since)

    def to_update(self) -> Update:
        return [_CODE[self.state], self.node_id, self.incarnation, self.role, self.host, self.port, self.meta,
                self.loop_lag_s]


def check_meta(meta: dict) -> dict:
    """``meta`` must be a msgpack-able dict with str keys; ValueError naming the problem."""
    for k in meta:
        if not isinstance(k, str):
            raise ValueError(f"meta keys must be str, got {k!r}")
    try:
        msgpack.packb(meta, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"meta must be msgpack-able (str keys; numbers, str, bytes, lists, dicts): {e}") from None
    return meta


def decode_update(obj: Any) -> Update:
    """Validate one received gossip update. Raises ``WireError("wrong_types")``."""
    if type(obj) is not list or len(obj) != 8:
        raise WireError("wrong_types", "gossip update must be a list of 8")
    code, nid, inc, role, host, port, meta, lag = obj
    if type(code) is not int or not 0 <= code <= 3:
        raise WireError("wrong_types", "gossip update state code must be 0..3")
    if type(nid) is not str or not 0 < len(nid) <= MAX_ID_LEN:
        raise WireError("wrong_types", "gossip update node id must be a non-empty str")
    if type(inc) is not int or not 0 <= inc <= _U63:
        raise WireError("wrong_types", "gossip update incarnation must be an int >= 0")
    if type(role) is not str or len(role) > 64:
        raise WireError("wrong_types", "gossip update role must be a str")
    if type(host) is not str or not 0 < len(host) <= 255:
        raise WireError("wrong_types", "gossip update host must be a non-empty str")
    if type(port) is not int or not 0 < port < 65536:
        raise WireError("wrong_types", "gossip update port must be 1..65535")
    if type(meta) is not dict:
        raise WireError("wrong_types", "gossip update meta must be a map")
    if type(lag) not in (float, int) or not 0 <= lag < 1e6:
        raise WireError("wrong_types", "gossip update loop lag must be a number >= 0")
    return obj


class _Bcast:
    __slots__ = ("node_id", "update", "size", "tx")

    def __init__(self, node_id: str, update: Update, size: int):
        self.node_id, self.update, self.size, self.tx = node_id, update, size, 0


class BroadcastQueue:
    """Pending updates, at most one per member, least-transmitted first."""

    def __init__(self) -> None:
        self._entries: dict[str, _Bcast] = {}
        self._levels: list[dict[str, _Bcast]] = [{}]
        self._packer = msgpack.Packer(use_bin_type=True)

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, update: Update) -> int:
        """Queue ``update`` (replacing an older one about the same member); returns its packed size."""
        nid = update[1]
        old = self._entries.pop(nid, None)
        if old is not None:
            del self._levels[old.tx][nid]
        e = _Bcast(nid, update, len(self._packer.pack(update)))
        self._entries[nid] = e
        self._levels[0][nid] = e
        return e.size

    def take(self, max_count: int, max_bytes: int, limit: int) -> list[Update]:
        """Up to ``max_count`` updates within ``max_bytes``; each is dropped after ``limit`` sends."""
        if not self._entries:
            return []
        picked: list[_Bcast] = []
        budget = max_bytes
        for level in self._levels:
            for e in level.values():
                if e.size <= budget:
                    picked.append(e)
                    budget -= e.size
                    if len(picked) >= max_count:
                        break
            if len(picked) >= max_count or budget < 64:
                break
        for e in picked:
            del self._levels[e.tx][e.node_id]
            e.tx += 1
            if e.tx >= limit:
                del self._entries[e.node_id]
            else:
                if e.tx >= len(self._levels):
                    self._levels.append({})
                self._levels[e.tx][e.node_id] = e
        return [e.update for e in picked]


class Membership:
    """Member table, suspicion timers, probe order and dissemination queue of one node.

    All times are passed in (``now``: ``time.time()`` seconds) so the rules can be tested
    with synthetic clocks.
    """

    def __init__(self, me: Member, config: MeshConfig, rng: random.Random | None = None):
        if me.state != ALIVE:
            raise ValueError("a node starts alive")
        self.config = config
        self.me = me
        self.rng = rng or random.Random()
        self.table: dict[str, Member] = {}
        self._records: dict[str, tuple[Update, int]] = {}  # last accepted update per member, packed size
        self.queue = BroadcastQueue()
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._suspect_deadline: dict[str, float] = {}
        self._tomb_since: dict[str, float] = {}
        self._probe_order: list[str] = []
        self._probe_idx = 0
        self._alive_ids: list[str] | None = None
        self._n_live: int | None = None
        self.refutes = 0
        self.id_conflicts = 0
        self.leaving = False
        self.queue.push(me.to_update())

    # ------------------------------------------------------------------ views
    def get(self, node_id: str) -> Member | None:
        return self.me if node_id == self.me.node_id else self.table.get(node_id)

    def counts(self) -> dict[str, int]:
        c = dict.fromkeys(STATES, 0)
        c[self.me.state] += 1
        for m in self.table.values():
            c[m.state] += 1
        return c

    def n_live(self) -> int:
        """Live members (alive or suspect), self included."""
        if self._n_live is None:
            self._n_live = 1 + sum(1 for m in self.table.values() if m.state in _LIVE)
        return self._n_live

    def alive_ids(self) -> list[str]:
        if self._alive_ids is None:
            self._alive_ids = [nid for nid, m in self.table.items() if m.state == ALIVE]
        return self._alive_ids

    def random_members(self, k: int, exclude: frozenset[str] | set[str] = frozenset()) -> list[Member]:
        """Up to ``k`` distinct random *alive* peers, not in ``exclude``."""
        ids = [i for i in self.alive_ids() if i not in exclude] if exclude else self.alive_ids()
        picked = self.rng.sample(ids, k) if k < len(ids) else list(ids)
        return [self.table[i] for i in picked]

    def next_probe_target(self) -> Member | None:
        """Round-robin over a shuffled list of live peers, reshuffled every round."""
        for _ in range(2):
            while self._probe_idx < len(self._probe_order):
                m = self.table.get(self._probe_order[self._probe_idx])
                self._probe_idx += 1
                if m is not None and m.state in _LIVE:
                    return m
            self._probe_order = [nid for nid, m in self.table.items() if m.state in _LIVE]
            self.rng.shuffle(self._probe_order)
            self._probe_idx = 0
        return None

    # ------------------------------------------------------------------ dissemination
    def piggyback(self, max_count: int | None = None, max_bytes: int | None = None) -> list[Update]:
        c = self.config
        return self.queue.take(max_count or c.max_piggyback, max_bytes or c.piggyback_bytes,
                               c.retransmit_limit(self.n_live()))

    def full_state(self, max_bytes: int) -> list[Update]:
        """Every record (self first, tombstones included) within ``max_bytes`` of msgpack."""
        out = [self.me.to_update()]
        pack = self._pack
        budget = max_bytes - 64 - len(pack(out[0]))
        for nid, (u, size) in self._records.items():
            if not size:
                size = len(pack(u))
                self._records[nid] = (u, size)
            budget -= size
            if budget < 0:
                break
            out.append(u)
        return out

    def _insert_probe(self, nid: str) -> None:
        """New live member: probe it within this round (at its end; the next round is reshuffled)."""
        self._probe_order.append(nid)

    # ------------------------------------------------------------------ own record
    def update_self(self, now: float, meta: dict | None = None, loop_lag_s: float | None = None) -> None:
        """Change own metadata and/or loop lag; bumps the incarnation and gossips it."""
        if meta is not None:
            self.me.meta = meta
        if loop_lag_s is not None:
            self.me.loop_lag_s = loop_lag_s
        self.me.incarnation += 1
        self.me.last_seen = now
        self.queue.push(self.me.to_update())

    def leave(self) -> Update:
        """Mark self as left (graceful leave) and queue the announcement."""
        self.leaving = True
        self.me.state = LEFT
        u = self.me.to_update()
        self.queue.push(u)
        return u

    def _news_about_self(self, u: Update) -> list[Event]:
        code, inc = u[0], u[2]
        if self.leaving:
            return []
        if code == 0 and inc <= self.me.incarnation:
            return []
        if code != 0 and inc < self.me.incarnation:
            return []
        if code == 0 and (u[4] != self.me.host or u[5] != self.me.port):
            self.id_conflicts += 1  # another process with our id, or news from our former life
        self.me.incarnation = max(self.me.incarnation, inc) + 1
        self.refutes += 1
        self.queue.push(self.me.to_update())
        return []

    # ------------------------------------------------------------------ incoming news
    def merge(self, raw: list, now: float, rebroadcast: bool = True) -> list[Event]:
        """Validate, then apply, a received list of updates: all or none.

        Most gossip repeats what this node already knows; those updates are recognised
        after a few type checks and skipped, and only news is fully validated.
        ``rebroadcast=False`` for bulk state transfers (join answers, anti-entropy): the
        sender already disseminates what is fresh in it, and re-gossiping a whole
        membership from every receiver would flood the cluster after a mass join.
        Raises ``WireError("wrong_types")`` before applying anything.
        """
        if type(raw) is not list:
            raise WireError("wrong_types", "updates must be a list")
        news = []
        table, me = self.table, self.me
        for u in raw:
            if type(u) is not list or len(u) != 8:
                raise WireError("wrong_types", "gossip update must be a list of 8")
            code, nid, inc = u[0], u[1], u[2]
            if type(code) is not int or type(nid) is not str or type(inc) is not int:
                raise WireError("wrong_types", "gossip update needs an int state, a str id and an int incarnation")
            if nid == me.node_id:
                if code == 0 and inc <= me.incarnation:
                    continue
            else:
                m = table.get(nid)
                if m is not None and (inc < m.incarnation or (inc == m.incarnation and _CODE[m.state] == code)):
                    continue
            news.append(decode_update(u))
        events: list[Event] = []
        for u in news:
            events += self.apply(u, now, rebroadcast)
        return events

    def apply(self, u: Update, now: float, rebroadcast: bool = True) -> list[Event]:
        """Merge one validated update; returns the events it caused."""
        code, nid, inc = u[0], u[1], u[2]
        if nid == self.me.node_id:
            return self._news_about_self(u)
        m = self.table.get(nid)
        if m is None:
            state = STATES[code]
            m = Member(nid, u[3], u[4], u[5], state, inc, u[6], now, float(u[7]), now)
            self.table[nid] = m
            self._records[nid] = (u, self.queue.push(u) if rebroadcast else 0)
            if state in _LIVE:
                self._alive_ids = self._n_live = None
                self._insert_probe(nid)
                if state == SUSPECT:
                    self._suspect_deadline[nid] = now + self.config.suspicion_timeout_s
                return [(state, m)]
            self._tomb_since[nid] = now
            return []
        j, old = m.incarnation, m.state
        if code == 0:
            ok = inc > j
        elif code == 1:
            ok = inc > j or (inc == j and old == ALIVE)
        elif code == 2:
            ok = inc > j or (inc == j and old in _LIVE)
        else:
            ok = inc > j or (inc == j and old != LEFT)
        if not ok:
            return []
        new = STATES[code]
        m.incarnation, m.role, m.host, m.port, m.meta = inc, u[3], u[4], u[5], u[6]
        m.loop_lag_s = float(u[7])
        m.state = new
        self._records[nid] = (u, self.queue.push(u) if rebroadcast else 0)
        if new == ALIVE:
            m.last_seen = now
            self._suspect_deadline.pop(nid, None)
            self._tomb_since.pop(nid, None)
        elif new == SUSPECT:
            self._suspect_deadline[nid] = now + self.config.suspicion_timeout_s
            self._tomb_since.pop(nid, None)
        else:
            self._suspect_deadline.pop(nid, None)
            self._tomb_since[nid] = now
        if new != old:
            m.since = now
            self._alive_ids = self._n_live = None
            if old not in _LIVE and new in _LIVE:
                self._insert_probe(nid)
            return [(new, m)]
        return [("update", m)] if new in _LIVE else []

    def saw(self, node_id: str, now: float, loop_lag_s: float | None = None) -> None:
        """A direct sign of life (a message or an ack) from ``node_id``."""
        m = self.table.get(node_id)
        if m is not None and m.state in _LIVE:
            m.last_seen = now
            if loop_lag_s is not None:
                m.loop_lag_s = loop_lag_s

    def suspect(self, node_id: str, now: float) -> list[Event]:
        """This node's own probe of ``node_id`` failed."""
        m = self.table.get(node_id)
        if m is None or m.state != ALIVE:
            return []
        return self.apply([1, node_id, m.incarnation, m.role, m.host, m.port, m.meta, m.loop_lag_s], now)

    def expire(self, now: float, slack: float = 0.0) -> list[Event]:
        """Suspects past their deadline (+ ``slack``) become dead; old tombstones are dropped."""
        events: list[Event] = []
        if self._suspect_deadline:
            for nid, deadline in list(self._suspect_deadline.items()):
                if now >= deadline + slack:
                    m = self.table[nid]
                    events += self.apply([2, nid, m.incarnation, m.role, m.host, m.port, m.meta, m.loop_lag_s], now)
        if self._tomb_since:
            horizon = now - self.config.dead_retention_s
            for nid, since in list(self._tomb_since.items()):
                if since < horizon:
                    del self._tomb_since[nid]
                    self.table.pop(nid, None)
                    self._records.pop(nid, None)
                    self._alive_ids = self._n_live = None
        return events
