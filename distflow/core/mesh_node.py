"""A bare mesh node process: membership only, no DAG, no engines.

Why this module exists: tests and benchmarks need real, separately killable processes
(``kill -9``) that speak the control plane, without the weight of a rollout or trainer
worker. It is also the smallest thing to run by hand to check that hosts can see each
other with a given secret::

    DISTFLOW_SECRET=... python -m distflow.core.mesh_node --id n1 --role worker --port 0 \\
        --seeds 10.0.0.1:7000

It prints exactly one line ``READY host:port`` on stdout once bound and joined, runs
until SIGTERM/SIGINT, then leaves gracefully and exits 0 (1 if it could not join,
2 on a usage error).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time

from distflow.core.auth import secret_from_env
from distflow.core.mesh import MeshConfig
from distflow.core.node import JoinTimeout, Node


def _parse_meta(items: list[str]) -> dict:
    meta: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--meta expects KEY=VALUE, got {item!r}")
        try:
            meta[key] = json.loads(value)
        except json.JSONDecodeError:
            meta[key] = value
    return meta


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m distflow.core.mesh_node", description=__doc__.splitlines()[0])
    p.add_argument("--id", required=True, help="node id, unique in the cluster")
    p.add_argument("--role", default="worker")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--advertise-host", default=None, help="address others use, if not the bind address")
    p.add_argument("--port", type=int, default=0, help="control port (0: ephemeral)")
    p.add_argument("--seeds", default="", help="HOST:PORT[,HOST:PORT...] of any running members")
    p.add_argument("--meta", action="append", default=[], help="KEY=VALUE (JSON value) metadata, repeatable")
    p.add_argument("--join-timeout", type=float, default=30.0)
    p.add_argument("--test-hooks", action="store_true",
                   help="register the 'test.block' handler that blocks the event loop (tests only)")
    return p


async def _run(args: argparse.Namespace, secret: str) -> int:
    config = MeshConfig(join_timeout_s=args.join_timeout, advertise_host=args.advertise_host)
    node = Node(args.id, args.role, secret=secret, host=args.host, port=args.port,
                seeds=[s for s in args.seeds.split(",") if s.strip()], meta=_parse_meta(args.meta), config=config)
    if args.test_hooks:
        async def block(sender: str, body: dict) -> dict:
            seconds = min(float(body.get("seconds", 0.5)), 5.0)
            time.sleep(seconds)  # deliberately blocks the event loop
            return {"slept": seconds}
        node.on("test.block", block)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await node.start()
    except JoinTimeout as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"READY {node.address}", flush=True)
    await stop.wait()
    await node.stop(graceful=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        secret = secret_from_env()
        _parse_meta(args.meta)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        runner = asyncio.run
    try:
        return runner(_run(args, secret))  # type: ignore[arg-type]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
