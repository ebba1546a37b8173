"""Node: one mesh member's control plane — a ZMQ ROUTER, SWIM driver and RPC endpoint.

Why this module exists: every DistFlow process (rollout worker, trainer rank, observer)
needs the same control plane: be reachable at one authenticated address, keep the SWIM
membership of ``mesh.py`` running on real sockets and real timers, and let the rest of
the system exchange small application messages (``send``/``request``) with any member
through the same signed channel. It is written so that hundreds of nodes can share one
process and one event loop (the benchmark runs 256): no per-node threads, no globals
other than the shared ZMQ context and a per-loop pool of outgoing sockets.

Sockets: each node binds one ROUTER and only *receives* on it. Everything it sends
(probes, acks, replies, gossip, application messages) goes out through DEALER sockets
created on demand per destination address and shared by all nodes of the event loop;
sends are non-blocking against a bounded queue (ZMQ high-water mark), so a dead or slow
peer can never block a node. Those sockets live in ``out_sockets.py``; the SWIM timers and
probes (join, probe, expiry, gossip, anti-entropy) in ``swim_driver.py``, a mixin of Node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections import Counter
from typing import Any, Awaitable, Callable, Sequence

import zmq
import zmq.asyncio

from distflow.core.aio import cancel_and_wait, woken
from distflow.core.auth import Authenticator
from distflow.core.mesh import ALIVE, DEAD, LEFT, SUSPECT, Member, MeshConfig, Membership, check_meta
from distflow.core.out_sockets import acquire_pool, endpoint, parse_address, release_pool, shared_context
from distflow.core.swim_driver import JoinTimeout, SwimDriver
from distflow.core.wire import KIND_ERROR, KIND_ONEWAY, KIND_REPLY, KIND_REQUEST, Codec, Envelope, WireError

__all__ = ["Node", "Member", "MeshConfig", "PeerUnavailable", "RemoteError", "JoinTimeout", "parse_address"]

log = logging.getLogger("distflow.mesh")

Handler = Callable[[str, dict], Awaitable["dict | None"]]
_RESERVED = ("swim.", "mesh.")
_CONTROL = frozenset({"swim.ping", "swim.ack", "swim.ping_req", "swim.gossip", "swim.join", "swim.join_ack",
                      "swim.sync", "swim.sync_ack"})


class PeerUnavailable(ConnectionError):
    """The peer is unknown, dead or has left (or this node is stopping)."""


class RemoteError(RuntimeError):
    """The peer's handler raised; ``args[0]`` carries its message."""

    def __init__(self, peer: str, msg_type: str, message: str):
        super().__init__(f"{peer} failed handling {msg_type!r}: {message}")
        self.peer, self.msg_type, self.remote_message = peer, msg_type, message


# ---------------------------------------------------------------------- the node
class Node(SwimDriver):
    """A mesh member. See module docstring; API documented per method."""

    def __init__(self, node_id: str, role: str, *, secret: str | bytes, host: str = "127.0.0.1", port: int = 0,
                 seeds: Sequence[str] = (), meta: dict | None = None, config: MeshConfig | None = None):
        if not isinstance(node_id, str) or not 0 < len(node_id) <= 128:
            raise ValueError(f"node_id must be a non-empty str of at most 128 chars, got {node_id!r}")
        if not isinstance(role, str) or not 0 < len(role) <= 64:
            raise ValueError(f"role must be a non-empty str of at most 64 chars, got {role!r}")
        if isinstance(seeds, str):
            seeds = [s for s in seeds.split(",") if s.strip()]
        self._seeds = [parse_address(s) for s in seeds]
        self.node_id, self.role = node_id, role
        self._auth = Authenticator(secret)
        self._host, self._port = host, int(port)
        self._meta = check_meta(dict(meta or {}))
        self.config = config or MeshConfig()
        self.address = ""
        self._rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self._handlers: dict[str, Handler] = {"mesh.view": self._h_view, "mesh.stats": self._h_stats}
        self._subscribers: list[Callable[[str, Member], None]] = []
        self._starting = self._started = self._bound = self._stopped = self._stopping = False
        self._tasks: list[asyncio.Task] = []
        self._side_tasks: set[asyncio.Task] = set()
        self._acks: dict[int, asyncio.Future] = {}
        self._pending: dict[int, tuple[str, str, asyncio.Future]] = {}
        self._seq, self._rounds, self._lag, self._announced_lag, self._last_announce = 0, 0, 0.0, 0.0, 0.0
        self._next_push_pull = self._last_pull = 0.0
        self._refresh_sent: dict[str, float] = {}
        self._join_fut: asyncio.Future | None = None
        self._resync: tuple[float, Envelope] | None = None
        self._changed: asyncio.Event | None = None
        self._warned: dict[str, float] = {}
        self._events: Counter[str] = Counter()
        self._n_received = self._n_sent = self._n_send_dropped = self._n_handler_errors = self._n_restarts = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bind, start the named tasks and join through the seeds (none: first node)."""
        if self._starting:
            raise RuntimeError(f"node {self.node_id} was already started (a Node starts once)")
        self._starting = True
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        c = self.config
        adv = c.advertise_host or self._host
        if adv in ("0.0.0.0", "::", "*"):
            raise ValueError(f"node {self.node_id}: bound to {self._host}; set MeshConfig.advertise_host to an "
                             "address the other nodes can reach")
        self._router = shared_context().socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.RCVHWM, 10000)
        self._router.setsockopt(zmq.MAXMSGSIZE, max(4 * c.max_frame_bytes, 1 << 16))
        try:
            if self._port:
                self._router.bind(endpoint(self._host, self._port))
                port = self._port
            else:
                port = self._router.bind_to_random_port(endpoint(self._host, 0).rsplit(":", 1)[0])
        except zmq.ZMQError as e:
            self._router.close(linger=0)
            raise OSError(f"node {self.node_id}: cannot bind control socket on {self._host}:{self._port}: {e}") from e
        self._router_sync = zmq.Socket.shadow(self._router.underlying)
        boot = time.time_ns() // 1000
        me = Member(self.node_id, self.role, adv, port, ALIVE, boot, self._meta, time.time(), 0.0)
        self.address = me.address
        self._membership = Membership(me, c, self._rng)
        self._codec = Codec(self._auth, self.node_id, boot, max_frame_bytes=c.max_frame_bytes,
                            max_age_s=c.max_msg_age_s)
        self._dropped = self._codec.dropped  # the node counts its own drop reasons alongside the codec's
        self._pool = acquire_pool(self._loop)
        self._bound = self._started = True
        self._next_push_pull = time.monotonic() + self._push_pull_interval() * self._rng.uniform(0.5, 1.0)
        self._spawn_core("recv", self._recv_loop)
        self._spawn_core("lag", self._lag_loop)
        try:
            await self._join()
        except BaseException:
            await self.stop(graceful=False)
            raise
        self._spawn_core("protocol", self._protocol_loop)
        log.debug("node %s (%s) up at %s", self.node_id, self.role, self.address)

    async def stop(self, graceful: bool = True) -> None:
        """Leave (announce it when ``graceful``) and close, within ``shutdown_timeout_s``."""
        if not self._bound or self._stopped:
            return
        self._stopped = self._stopping = True
        c = self.config
        if graceful:
            try:
                await asyncio.wait_for(self._leave(), timeout=c.shutdown_timeout_s / 2)
            except (asyncio.TimeoutError, Exception) as e:  # noqa: BLE001 - leaving is best effort
                log.warning("node %s: leave announcement incomplete: %r", self.node_id, e)
        for t in await cancel_and_wait(self._tasks + list(self._side_tasks), c.shutdown_timeout_s / 2):
            log.error("node %s: task %s did not stop in time", self.node_id, t.get_name())
        err = PeerUnavailable(f"node {self.node_id} is stopping")
        for _, _, fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        self._router.close(linger=0)
        release_pool(self._loop, self._pool)

    async def _leave(self) -> None:
        self._membership.leave()
        peers = self._membership.random_members(8)
        if not peers:
            return
        futs = []
        for m in peers:
            seq, fut = self._new_ack()
            futs.append(fut)
            self._send_member(m, "swim.ping", {"s": seq, "l": self._lag})
        try:
            await asyncio.wait(futs, timeout=min(1.0, self.config.shutdown_timeout_s / 2),
                               return_when=asyncio.FIRST_COMPLETED)
            # give the others a moment, the announcement then spreads by gossip
            await asyncio.wait(futs, timeout=0.05)
        finally:
            for f in futs:
                f.cancel()

    def _spawn_core(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        t = self._loop.create_task(self._supervise(name, factory), name=f"distflow.mesh.{self.node_id}.{name}")
        self._tasks.append(t)

    async def _supervise(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        backoff = 0.05
        while not self._stopping:
            try:
                await factory()
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - supervised: log, count, restart
                self._n_restarts += 1
                log.exception("node %s: task %s crashed; restarting in %.2fs", self.node_id, name, backoff)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 2.0)

    def _spawn_side(self, coro: Awaitable[Any], name: str) -> bool:
        if len(self._side_tasks) >= self.config.max_inflight_handlers:
            return False
        t = self._loop.create_task(coro, name=f"distflow.mesh.{self.node_id}.{name}")  # type: ignore[arg-type]
        self._side_tasks.add(t)
        t.add_done_callback(self._side_tasks.discard)
        return True

    # ------------------------------------------------------------------ public API
    def set_meta(self, **kv: Any) -> None:
        """Update own metadata (merged into ``meta``) and gossip it."""
        meta = check_meta({**self._meta, **kv})
        self._meta = meta
        if self._started:
            self._membership.update_self(time.time(), meta=dict(meta))
            self._notify([("update", self._membership.me)])

    def members(self, role: str | None = None, include_dead: bool = False) -> list[Member]:
        """Copies of the members (self included), sorted by node_id. Live = alive or suspect."""
        if not self._started:
            return []
        ms = [self._membership.me, *self._membership.table.values()]
        out = [m.copy() for m in ms if (include_dead or m.state in (ALIVE, SUSPECT))
               and (role is None or m.role == role)]
        out.sort(key=lambda m: m.node_id)
        return out

    def member(self, node_id: str) -> Member | None:
        m = self._membership.get(node_id) if self._started else None
        return m.copy() if m is not None else None

    def is_alive(self, node_id: str) -> bool:
        """True while the member is alive or suspect (not yet declared dead/left)."""
        m = self._membership.get(node_id) if self._started else None
        return m is not None and m.state in (ALIVE, SUSPECT)

    async def wait_for(self, predicate: Callable[[list[Member]], bool], timeout: float, what: str) -> list[Member]:
        """Wait until ``predicate(live members)`` holds; TimeoutError naming ``what``."""
        if not self._started:
            raise RuntimeError(f"node {self.node_id}: start() it before waiting for {what}")
        deadline = self._loop.time() + timeout
        while True:
            ev = self._changed
            ms = self.members()
            if predicate(ms):
                return ms
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                seen = ", ".join(f"{m.node_id}({m.role},{m.state})" for m in ms)
                raise TimeoutError(f"node {self.node_id}: timed out after {timeout:.3g}s waiting for {what}; "
                                   f"live members: [{seen}]")
            await woken(ev.wait(), min(remaining, 0.25))  # type: ignore[union-attr]

    def on(self, msg_type: str, handler: Handler) -> None:
        """Register ``handler(sender_id, body) -> reply body | None`` for ``msg_type``."""
        if not isinstance(msg_type, str) or not 0 < len(msg_type) <= 128 or msg_type.startswith(_RESERVED):
            raise ValueError(f"bad message type {msg_type!r}: a non-empty str not starting with {_RESERVED}")
        if not callable(handler):
            raise TypeError("handler must be an async callable (sender, body) -> dict | None")
        self._handlers[msg_type] = handler

    async def send(self, node_id: str, msg_type: str, body: dict) -> None:
        """One-way message. Waits (bounded by request_timeout_s) only while the peer's queue is full."""
        await self._send_app(node_id, msg_type, body, KIND_ONEWAY, 0, self._loop.time() + self.config.request_timeout_s)

    async def request(self, node_id: str, msg_type: str, body: dict, timeout: float | None = None) -> dict:
        """Send and await the peer's reply body. TimeoutError / PeerUnavailable / RemoteError."""
        timeout = self.config.request_timeout_s if timeout is None else timeout
        deadline = self._loop.time() + timeout
        self._seq += 1
        rid = self._seq
        fut = self._loop.create_future()
        self._pending[rid] = (node_id, msg_type, fut)
        try:
            await self._send_app(node_id, msg_type, body, KIND_REQUEST, rid, deadline)
            return await asyncio.wait_for(fut, timeout=max(0.0, deadline - self._loop.time()))
        except asyncio.TimeoutError:
            raise TimeoutError(f"node {self.node_id}: request {msg_type!r} to {node_id} got no reply within "
                               f"{timeout:.3g}s") from None
        finally:
            self._pending.pop(rid, None)

    def subscribe(self, callback: Callable[[str, Member], None]) -> None:
        """``callback(event, member)`` for "alive", "suspect", "dead", "left", "update"."""
        self._subscribers.append(callback)

    def stats(self) -> dict:
        """Counters: messages received/sent, drops by reason, loop lag, members by state, events."""
        ms = self._membership if self._started else None
        dropped = dict(self._codec.dropped) if ms else {}
        return {
            "node_id": self.node_id, "address": self.address, "incarnation": ms.me.incarnation if ms else 0,
            "received": self._n_received, "sent": self._n_sent, "send_dropped": self._n_send_dropped,
            "dropped": sum(dropped.values()), "dropped_by_reason": dropped,
            "handler_errors": self._n_handler_errors, "task_restarts": self._n_restarts,
            "refutes": ms.refutes if ms else 0, "loop_lag_s": self._lag, "protocol_rounds": self._rounds,
            "members": ms.counts() if ms else {}, "events": dict(self._events),
            "pending_requests": len(self._pending), "broadcast_queue": len(ms.queue) if ms else 0,
        }

    # ------------------------------------------------------------------ sending
    def _require_peer(self, node_id: str, msg_type: str) -> Member:
        if not self._started or self._stopping:
            raise PeerUnavailable(f"node {self.node_id} is not running; cannot send {msg_type!r} to {node_id}")
        m = self._membership.get(node_id)
        if m is None or m.state in (DEAD, LEFT):
            state = m.state if m else "unknown"
            raise PeerUnavailable(f"node {self.node_id}: peer {node_id!r} is {state}; cannot send {msg_type!r}")
        return m

    async def _send_app(self, node_id: str, msg_type: str, body: dict, kind: int, rid: int, deadline: float) -> None:
        if not isinstance(body, dict):
            raise TypeError(f"message body must be a dict, got {type(body).__name__}")
        while True:
            m = self._require_peer(node_id, msg_type)
            if self._send(m.node_id, m.host, m.port, m.incarnation, msg_type, body, kind, rid, strict=True):
                return
            if self._loop.time() >= deadline:
                raise TimeoutError(f"node {self.node_id}: outgoing queue to {node_id} stayed full; "
                                   f"could not send {msg_type!r}")
            await asyncio.sleep(0.005)

    def _send_member(self, m: Member, msg_type: str, body: dict) -> bool:
        return self._send(m.node_id, m.host, m.port, m.incarnation, msg_type, body)

    def _send(self, to: str, host: str, port: int, to_inc: int, msg_type: str, body: dict,
              kind: int = KIND_ONEWAY, rid: int = 0, strict: bool = False) -> bool:
        """Encode with piggybacked gossip and queue without blocking. False if the queue is full."""
        ms = self._membership
        gossip = ms.piggyback()
        dest = ms.table.get(to)
        if dest is not None and dest.state != ALIVE:
            gossip.insert(0, dest.to_update())  # tell a suspect/dead peer what we think, so it can refute
        try:
            try:
                frames = self._codec.encode(msg_type, body, to=to, to_inc=to_inc, kind=kind, req_id=rid,
                                            addr=self.address, gossip=gossip)
            except ValueError:
                if not gossip:
                    raise
                frames = self._codec.encode(msg_type, body, to=to, to_inc=to_inc, kind=kind, req_id=rid,
                                            addr=self.address)  # a big body leaves no room for gossip
        except ValueError:
            if strict:
                raise
            log.exception("node %s: cannot encode %s", self.node_id, msg_type)
            return False
        ok = self._pool.send(endpoint(host, port), frames)
        self._n_sent += ok
        self._n_send_dropped += not ok
        return ok

    def _reply(self, env: Envelope, kind: int, body: dict, strict: bool = False) -> None:
        try:
            host, port = parse_address(env.addr)
        except ValueError:
            self._drop("wrong_types", env.sender, "reply address")
            return
        if not self._send(env.sender, host, port, env.boot, env.type, body, kind, env.req_id, strict=strict):
            log.debug("node %s: reply to %s dropped (queue full)", self.node_id, env.sender)

    def _new_ack(self) -> tuple[int, asyncio.Future]:
        self._seq += 1
        fut = self._loop.create_future()
        self._acks[self._seq] = fut
        fut.add_done_callback(lambda _f, s=self._seq: self._acks.pop(s, None))
        return self._seq, fut

    # ------------------------------------------------------------------ receiving
    async def _recv_loop(self) -> None:
        sock, sync = self._router, self._router_sync
        while True:
            frames = await sock.recv_multipart()
            self._on_frames(frames)
            for _ in range(127):
                try:
                    frames = sync.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_frames(frames)
            else:
                await asyncio.sleep(0)

    def _drop(self, reason: str, who: str, detail: str) -> None:
        self._dropped[reason] += 1
        self._warn(reason, f"node {self.node_id}: dropped a message from {who} ({reason}: {detail})")

    def _warn(self, key: str, text: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(key, -1e9) > 10.0:
            self._warned[key] = now
            log.warning("%s", text)

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            env = self._codec.decode(frames[1:])  # frames[0]: the ROUTER's connection id
        except WireError as e:
            self._warn(e.reason, f"node {self.node_id}: dropped a message ({e})")
            if e.reason == "stale_dest" and e.envelope is not None:
                with contextlib.suppress(ValueError):  # a return address that is not HOST:PORT
                    self._refresh(e.envelope)
            return
        if env.sender == self.node_id:
            if env.boot != self._codec.boot:
                self._drop("duplicate_id", env.addr, f"another process uses node id {self.node_id!r}")
                return
        self._n_received += 1
        try:
            self._dispatch(env)
        except WireError as e:
            self._drop(e.reason, env.sender, e.detail)
        except Exception:  # noqa: BLE001 - a bug must not take the node down
            self._dropped["internal_error"] += 1
            log.exception("node %s: error handling %r from %s", self.node_id, env.type, env.sender)

    def _dispatch(self, env: Envelope) -> None:
        ms = self._membership
        now = time.time()
        t = env.type
        if env.gossip:
            self._notify(ms.merge(env.gossip, now))
        if t in _CONTROL:
            body = env.body
            ms.saw(env.sender, now, _num(body.get("l")))
            if t in ("swim.ping", "swim.ack", "swim.gossip"):
                # the peer has more live members than we know of at all (tombstones included, so a
                # death we already know about does not count): it knows members we do not
                n = body.get("m")
                if type(n) is int and n > 1 + len(ms.table):
                    self._pull_state(env)
            if t == "swim.ping":
                self._send_ack(env, _int(body, "s"), self.node_id)
            elif t == "swim.ack":
                fut = self._acks.get(_int(body, "s"))
                target = body.get("n")
                if isinstance(target, str):
                    ms.saw(target, now)
                if fut is not None and not fut.done():
                    fut.set_result(True)
            elif t == "swim.ping_req":
                target = (_str(body, "n"), _str(body, "h"), _int(body, "p"), _int(body, "i"))
                if not self._spawn_side(self._indirect_probe(env, _int(body, "s"), *target), "ping_req"):
                    self._dropped["overloaded"] += 1
            elif t in ("swim.join", "swim.sync"):
                state = body.get("state") if t == "swim.sync" else [body.get("u")]
                self._notify(ms.merge(state, now, rebroadcast=type(state) is list and len(state) == 1))
                reply = "swim.join_ack" if t == "swim.join" else "swim.sync_ack"
                host, port = parse_address(env.addr)
                self._send(env.sender, host, port, env.boot, reply,
                           {"state": ms.full_state(self.config.max_frame_bytes // 2)})
            elif t in ("swim.join_ack", "swim.sync_ack"):
                self._notify(ms.merge(body.get("state"), now, rebroadcast=False))
                if t == "swim.join_ack" and self._join_fut is not None and not self._join_fut.done():
                    self._join_fut.set_result(env)
            return  # swim.gossip: the piggyback was all
        if t.startswith(_RESERVED) and t not in self._handlers:
            self._drop("unknown_type", env.sender, t)
            return
        ms.saw(env.sender, now)
        if env.kind in (KIND_REPLY, KIND_ERROR):
            p = self._pending.get(env.req_id)
            if p is None or p[0] != env.sender or p[1] != t or p[2].done():
                self._drop("unexpected_reply", env.sender, f"{t} #{env.req_id}")
            elif env.kind == KIND_REPLY:
                p[2].set_result(env.body)
            else:
                p[2].set_exception(RemoteError(env.sender, t, str(env.body.get("error", "?"))))
            return
        handler = self._handlers.get(t)
        if handler is None:
            self._drop("unknown_type", env.sender, f"no handler for {t!r}")
            if env.kind == KIND_REQUEST:
                self._reply(env, KIND_ERROR, {"error": f"no handler for message type {t!r} on {self.node_id}"})
            return
        if not self._spawn_side(self._run_handler(handler, env), f"handle.{t}"):
            self._drop("overloaded", env.sender, f"{t}: too many handlers in flight")
            if env.kind == KIND_REQUEST:
                self._reply(env, KIND_ERROR, {"error": f"{self.node_id} is overloaded"})

    def _send_ack(self, env: Envelope, seq: int, target: str) -> None:
        host, port = parse_address(env.addr)
        self._send(env.sender, host, port, env.boot, "swim.ack",
                   {"s": seq, "n": target, "l": self._lag, "m": self._membership.n_live()})

    def _pull_state(self, env: Envelope, force: bool = False) -> None:
        """The peer knows more live members than we do: get its full state (at most once a period)."""
        now = time.monotonic()
        if now - self._last_pull < self.config.protocol_period_s and not force:
            return
        self._last_pull = now
        host, port = parse_address(env.addr)
        # only our own record: the peer answers with its full state (a pull, half the cost of a push-pull)
        self._send(env.sender, host, port, env.boot, "swim.sync", {"state": [self._membership.me.to_update()]})

    def _refresh(self, env: Envelope) -> None:
        """A peer addressed an older life of this node: send it our current record (rate-limited)."""
        now = time.monotonic()
        if now - self._refresh_sent.get(env.sender, -1e9) < 1.0:
            return
        self._refresh_sent[env.sender] = now
        if len(self._refresh_sent) > 4096:
            self._refresh_sent.clear()
        host, port = parse_address(env.addr)
        self._send(env.sender, host, port, env.boot, "swim.sync_ack", {"state": [self._membership.me.to_update()]})

    async def _run_handler(self, handler: Handler, env: Envelope) -> None:
        try:
            result = await handler(env.sender, env.body)
            if env.kind == KIND_REQUEST:
                if result is None:
                    result = {}
                if not isinstance(result, dict):
                    raise TypeError(f"handler for {env.type!r} returned {type(result).__name__}, expected dict")
                try:
                    self._reply(env, KIND_REPLY, result, strict=True)
                except ValueError as e:
                    raise ValueError(f"handler for {env.type!r} returned an unsendable reply: {e}") from None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handler errors are the application's, report them
            self._n_handler_errors += 1
            log.warning("node %s: handler for %r from %s raised %s: %s", self.node_id, env.type, env.sender,
                        type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
            if env.kind == KIND_REQUEST:
                self._reply(env, KIND_ERROR, {"error": f"{type(e).__name__}: {e}"[:2000]})

    async def _h_view(self, sender: str, body: dict) -> dict:
        """Built-in ``mesh.view``: this node's membership table (tests, diagnostics)."""
        now = time.time()
        return {"members": {m.node_id: {"state": m.state, "incarnation": m.incarnation, "role": m.role,
                                        "address": m.address, "last_seen_s": round(now - m.last_seen, 3),
                                        "loop_lag_s": m.loop_lag_s, "meta": m.meta}
                            for m in self.members(include_dead=True)}}

    async def _h_stats(self, sender: str, body: dict) -> dict:  # built-in ``mesh.stats``
        return self.stats()

    # ------------------------------------------------------------------ membership events
    def _notify(self, events: list) -> None:
        for name, m in events:
            self._events[name] += 1
            if name in (DEAD, LEFT):
                err = PeerUnavailable(f"node {self.node_id}: peer {m.node_id} is {name}")
                for rid, (peer, _t, fut) in list(self._pending.items()):
                    if peer == m.node_id and not fut.done():
                        fut.set_exception(err)
            for cb in self._subscribers:
                try:
                    cb(name, m.copy())
                except Exception:  # noqa: BLE001 - a subscriber must not break the node
                    self._n_handler_errors += 1
                    log.exception("node %s: subscriber failed on %s %s", self.node_id, name, m.node_id)
        if events and self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()


# ---------------------------------------------------------------------- helpers
def _int(body: dict, key: str) -> int:
    v = body.get(key)
    if type(v) is not int:
        raise WireError("wrong_types", f"field {key!r} must be an int")
    return v


def _str(body: dict, key: str) -> str:
    v = body.get(key)
    if type(v) is not str or not v:
        raise WireError("wrong_types", f"field {key!r} must be a non-empty str")
    return v


def _num(v: Any) -> float | None:
    return float(v) if type(v) in (int, float) and 0 <= v < 1e6 else None
