"""Opt-in Prometheus ``/metrics`` of one node (config ``metrics_port``; loopback unless
``metrics_host`` says otherwise).

Why per node and pull-based: with no driver there is no central process to push from, and
operators already scrape every host; each node answers for itself: the membership it sees
(members alive / suspect / dead by role, how long ago each peer was last heard of: the
message lag), its own event-loop lag and message counters, its buffer fill (trainers), its
engine's slots in use (rollout nodes), and its step and policy version. The text format is
written here by hand (a dozen lines) so a node needs no extra package; tests parse it with
prometheus_client's own parser. One small asyncio HTTP server answering GET only: it reads
state the node already keeps, and never blocks the loop.

Other modules add gauges with :func:`register` (the engine registers its slots): a callable
returning ``{name: value}``, read at every scrape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

_SOURCES: dict[str, Callable[[], dict[str, float]]] = {}


def register(name: str, source: Callable[[], dict[str, float]]) -> None:
    """Gauges ``distflow_<key>`` from ``source()`` at every scrape (a source that raises is skipped)."""
    _SOURCES[name] = source


def _esc(v: Any) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Text:
    """Samples grouped by metric: the text format wants each family's lines together."""

    def __init__(self) -> None:
        self.families: dict[str, list[str]] = {}

    def add(self, name: str, kind: str, help_: str, value: float, **labels: Any) -> None:
        name = f"distflow_{name}"
        lines = self.families.setdefault(name, [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lab = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
        lines.append(f"{name}{{{lab}}} {float(value)!r}" if lab else f"{name} {float(value)!r}")

    def text(self) -> str:
        return "".join(line + "\n" for lines in self.families.values() for line in lines)


def render(rt: Any) -> str:
    """The exposition text of ``rt`` (a Runtime) now."""
    t = _Text()
    node, now = rt.node, time.time()
    st = node.stats()
    me = node.node_id
    t.add("node_info", "gauge", "this node (always 1)", 1, node_id=me, role=rt.role)
    members = node.members(include_dead=True)
    by = {}
    for m in members:
        by[(m.role, m.state)] = by.get((m.role, m.state), 0) + 1
    for state in ("alive", "suspect", "dead", "left"):
        for role in sorted({m.role for m in members}) or [rt.role]:
            t.add("members", "gauge", "members this node sees, by role and state", by.get((role, state), 0),
                  role=role, state=state)
    for m in members:
        if m.node_id != me:
            t.add("peer_last_heard_seconds", "gauge", "seconds since a peer was last heard of (message lag)",
                  max(0.0, now - m.last_seen), peer=m.node_id, role=m.role)
            t.add("peer_loop_lag_seconds", "gauge", "a peer's reported event-loop lag", m.loop_lag_s, peer=m.node_id)
    t.add("loop_lag_seconds", "gauge", "this node's event-loop lag", st.get("loop_lag_s") or 0.0)
    t.add("messages_received_total", "counter", "control messages received", st.get("received", 0))
    t.add("messages_sent_total", "counter", "control messages sent", st.get("sent", 0))
    for reason, n in sorted((st.get("dropped_by_reason") or {}).items()):
        t.add("messages_dropped_total", "counter", "control messages dropped, by reason", n, reason=reason)
    t.add("protocol_rounds_total", "counter", "gossip protocol rounds", st.get("protocol_rounds", 0))
    shard = getattr(rt, "shard", None)
    if shard is not None:
        s = shard.stats()
        t.add("buffer_samples", "gauge", "samples held in this node's buffer shard", s["samples_held"])
        t.add("buffer_capacity_samples", "gauge", "capacity of the buffer shard", s["capacity"])
        t.add("buffer_fill_ratio", "gauge", "samples held / capacity", s["samples_held"] / max(s["capacity"], 1))
        t.add("buffer_bytes", "gauge", "bytes held in the buffer shard", s["bytes_held"])
        t.add("buffer_parts_taken_total", "counter", "step parts taken in", s["puts"])
    mine = node.member(me)
    meta = mine.meta if mine is not None else {}
    for key, help_ in (("step", "the trainer step this node is at"), ("policy_version", "weights version in use")):
        if isinstance(meta.get(key), (int, float)):
            t.add(key, "gauge", help_, meta[key])
    for key, v in sorted(meta.items()):
        if key.startswith("time_") and key.endswith("_s") and isinstance(v, (int, float)):
            t.add("stage_seconds", "gauge", "seconds of the last step's stage", v, stage=key[5:-2])
    for src_name, source in list(_SOURCES.items()):
        try:
            values = source()
        except Exception:  # noqa: BLE001 - a source gone bad drops its gauges, not the scrape
            continue
        for k, v in sorted(values.items()):
            t.add(k, "gauge", f"from {src_name}", v)
    return t.text()


class MetricsServer:
    """``GET /metrics`` over plain HTTP/1.0 (one response per connection)."""

    def __init__(self, rt: Any):
        self.rt = rt
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> "MetricsServer":
        self.server = await asyncio.start_server(self._serve, host, port)
        self.port = self.server.sockets[0].getsockname()[1]
        self.rt.node.set_meta(metrics_port=self.port)
        log.info("%s: Prometheus metrics at http://%s:%d/metrics", self.rt.node.node_id, host, self.port)
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)).strip():
                pass  # the headers: not needed
            parts = request.decode("latin-1").split()
            if len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] == "/metrics":
                status, body = "200 OK", render(self.rt).encode()
            else:
                status, body = "404 Not Found", b"GET /metrics\n"
            writer.write(f"HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
