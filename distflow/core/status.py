"""``distflow status``: join the mesh as an observer and print who is there.

Why this module exists: with no driver there is no central place to ask "what is my
cluster doing?". Any member knows the whole membership, so the status command simply
joins through a seed as a short-lived ``observer`` member, lets membership converge,
prints each member's role, rank, address, state, policy version, last-seen age,
throughput, event-loop lag and where its last step's time went (a table, or JSON), and
leaves gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import time
from typing import Any

from distflow.core.aio import woken
from distflow.core.auth import secret_from_env
from distflow.core.mesh import MeshConfig, Member
from distflow.core.node import JoinTimeout, Node, parse_address

COLUMNS = ("id", "role", "rank", "address", "state", "policy_version", "last_seen_s", "samples_per_s", "loop_lag_s",
           "stages")
_HEADERS = ("ID", "ROLE", "RANK", "ADDRESS", "STATE", "POLICY", "LAST SEEN", "SAMPLES/S", "LOOP LAG", "LAST STEP")

# Per-stage seconds of a step, in pipeline order, with their short names. Trainer rank 0
# publishes them (with tokens_per_s and mfu) in its metadata and metrics.jsonl; rollout
# nodes publish time_generate_s and time_load_weights_s.
STAGE_TIME_KEYS = ("time_generate_s", "time_wait_s", "time_logprobs_s", "time_update_s", "time_weights_s",
                   "time_load_weights_s")
_STAGE_NAMES = {"time_generate_s": "gen", "time_wait_s": "wait", "time_logprobs_s": "logp",
                "time_update_s": "upd", "time_weights_s": "wts", "time_load_weights_s": "load"}


def format_stages(values: dict[str, Any]) -> str:
    """A compact one-line summary of a step's stage times and throughput, e.g.
    ``gen 1.20s wait 0.05s upd 0.80s | 1.2k tok/s mfu 3.1%`` (keys absent are skipped)."""
    parts = [f"{_STAGE_NAMES[k]} {float(values[k]):.2f}s" for k in STAGE_TIME_KEYS
             if isinstance(values.get(k), (int, float))]
    rate = []
    if isinstance(values.get("tokens_per_s"), (int, float)):
        tps = float(values["tokens_per_s"])
        rate.append(f"{tps / 1000:.1f}k tok/s" if tps >= 1000 else f"{tps:.0f} tok/s")
    if isinstance(values.get("mfu"), (int, float)):
        rate.append(f"mfu {100 * float(values['mfu']):.3g}%")
    return " | ".join(x for x in (" ".join(parts), " ".join(rate)) if x)


def member_row(m: Member, now: float) -> dict[str, Any]:
    """The status fields of one member (JSON-able); ``stages`` only for a member that
    reports stage times (:func:`format_stages`)."""
    return {
        "id": m.node_id, "role": m.role, "rank": m.meta.get("rank"), "address": m.address, "state": m.state,
        "policy_version": m.meta.get("policy_version"), "last_seen_s": round(max(0.0, now - m.last_seen), 3),
        "samples_per_s": m.meta.get("samples_per_s"), "loop_lag_s": round(m.loop_lag_s, 4),
        **({"stages": stages} if (stages := format_stages(m.meta)) else {}),
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(key: str, v: Any) -> str:
        if v is None:
            return "-"
        if key == "last_seen_s":
            return f"{v:.1f}s"
        if key == "loop_lag_s":
            return f"{v * 1000:.0f}ms"
        if isinstance(v, float):
            return f"{v:.1f}"
        return str(v)

    cols = [c for c in COLUMNS if c != "stages" or any("stages" in r for r in rows)]  # only when reported
    heads = [h for c, h in zip(COLUMNS, _HEADERS) if c in cols]
    table = [heads] + [[cell(k, r.get(k)) for k in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)


async def _settle(node: Node, max_wait: float) -> None:
    """Wait until the member set stops changing for a few protocol periods (or ``max_wait``)."""
    quiet = 3 * node.config.protocol_period_s
    deadline = time.monotonic() + max_wait
    last = None
    stable_since = time.monotonic()
    while time.monotonic() < deadline:
        snap = tuple((m.node_id, m.state, m.incarnation) for m in node.members(include_dead=True))
        if snap != last:
            last, stable_since = snap, time.monotonic()
        elif time.monotonic() - stable_since >= quiet:
            return
        await asyncio.sleep(node.config.protocol_period_s / 2)


async def _fresh_lags(node: Node, timeout: float = 1.0) -> dict[str, float]:
    """Ask every live member for its current loop lag (gossip carries it only on stalls)."""
    peers = [m.node_id for m in node.members() if m.node_id != node.node_id]
    replies = await asyncio.gather(*(node.request(p, "mesh.stats", {}, timeout=timeout) for p in peers),
                                   return_exceptions=True)
    return {p: float(r["loop_lag_s"]) for p, r in zip(peers, replies)
            if isinstance(r, dict) and isinstance(r.get("loop_lag_s"), (int, float))}


async def _run(args: argparse.Namespace, secret: str) -> int:
    node_id = f"status-{socket.gethostname()}-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    node = Node(node_id, "observer", secret=secret, host=args.host, seeds=args.seeds,
                config=MeshConfig(join_timeout_s=args.timeout, shutdown_timeout_s=2.0))
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await node.start()
    except JoinTimeout as e:
        print(f"distflow status: error: {e}", file=sys.stderr)
        return 1
    try:
        while True:
            await _settle(node, args.settle)
            lags = await _fresh_lags(node)
            now = time.time()
            rows = [member_row(m, now) for m in node.members(include_dead=True)
                    if m.node_id != node.node_id and (args.all or m.role != "observer" or m.state in ("alive", "suspect"))]
            for r in rows:
                if r["id"] in lags:
                    r["loop_lag_s"] = round(lags[r["id"]], 4)
            if args.json:
                print(json.dumps({"time": now, "seeds": args.seeds, "members": rows}), flush=True)
            else:
                if args.watch:
                    print(time.strftime("%Y-%m-%d %H:%M:%S"), flush=True)
                print(format_table(rows), flush=True)
            if not args.watch:
                return 0
            if await woken(stop.wait(), args.watch):
                return 0  # SIGINT/SIGTERM: leave gracefully
    finally:
        await node.stop(graceful=True)


def status_main(argv: list[str]) -> int:
    """``distflow status --seeds HOST:PORT[,...] [--json] [--watch SECONDS]``; returns the exit code."""
    p = argparse.ArgumentParser(prog="distflow status", description="Show the members of a DistFlow cluster.")
    p.add_argument("--seeds", required=True, help="HOST:PORT[,HOST:PORT...] of any running members")
    p.add_argument("--json", action="store_true", help="print JSON (one document per line) instead of a table")
    p.add_argument("--watch", type=float, default=0.0, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a seed to answer (default 10)")
    p.add_argument("--settle", type=float, default=2.0, help="max seconds to let membership converge (default 2)")
    p.add_argument("--all", action="store_true", help="also list observers that have left")
    p.add_argument("--host", default="127.0.0.1", help="local address to bind (must be reachable by the seeds)")
    args = p.parse_args(argv)
    try:
        args.seeds = [s.strip() for s in args.seeds.split(",") if s.strip()]
        if not args.seeds:
            raise ValueError("--seeds is empty")
        for s in args.seeds:
            parse_address(s)
        if args.watch < 0 or args.timeout <= 0:
            raise ValueError("--watch must be >= 0 and --timeout > 0")
    except ValueError as e:
        print(f"distflow status: error: {e}", file=sys.stderr)
        return 2
    try:
        secret = secret_from_env()
    except RuntimeError as e:
        print(f"distflow status: error: {e}", file=sys.stderr)
        return 2
    assert secret is not None
    try:
        return asyncio.run(_run(args, secret))
    except KeyboardInterrupt:
        return 0
    except (OSError, ValueError) as e:
        print(f"distflow status: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(status_main(sys.argv[1:]))
