"""Benchmark: SWIM membership convergence, failure detection and false deaths.

Runs N in-process nodes (one process, one event loop) on loopback for N = 16, 64, 256:

* cold start: node 0 starts alone, nodes 1-2 join through it, then the other N-3 start
  at once with seeds = nodes 0-2; measured in protocol periods until every node knows
  every other (baseline: N = 16; the ratio 256/16 shows how it scales). All N nodes
  share ONE Python process here, so at N = 256 the loop cannot run a 0.2 s period in
  0.2 s of wall time (time dilates, as in any single-process simulation of a cluster):
  ``converge_periods_N`` counts the protocol periods the cluster actually ran (rounds),
  and ``converge_wall_periods_N`` reports wall time / period alongside, for honesty;
* detection: one node is stopped abruptly (no leave) and we time until every other node
  marks it dead (compared with ``MeshConfig.expected_detection_s``);
* false deaths: 64 idle nodes for ``--idle-seconds`` (default 60); any "dead" event is a
  false death.

Prints a human-readable report and ends with exactly one JSON line of the figures.
Run: ``python bench/mesh.py [--sizes 16,64,256] [--idle-seconds 60] [--period 0.2]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import resource
import statistics
import sys
import time

from distflow.core.mesh import MeshConfig
from distflow.core.node import Node

SECRET = "bench-mesh-secret-0123456789abcdef"


class Watch:
    """Tracks, from subscription events only, what every node believes."""

    def __init__(self, nodes: list[Node]):
        self.known: dict[str, set[str]] = {x.node_id: set() for x in nodes}
        self.dead_events: list[tuple[str, str, float]] = []
        self.suspect_events = 0
        self.target = len(nodes) - 1
        self.changed = asyncio.Event()
        for x in nodes:
            x.subscribe(lambda e, m, who=x.node_id: self.on_event(who, e, m.node_id))

    def on_event(self, who: str, event: str, about: str) -> None:
        known = self.known[who]
        before = len(known)
        if event in ("alive", "suspect", "update"):
            known.add(about)
        else:
            known.discard(about)
        if event == "dead":
            self.dead_events.append((who, about, time.perf_counter()))
            self.changed.set()
        elif event == "suspect":
            self.suspect_events += 1
        if len(known) != before and len(known) >= self.target:
            self.changed.set()  # cheap: wake the checker only when a node may have become complete

    async def until(self, cond, timeout: float) -> float:
        t0 = time.perf_counter()
        while not cond():
            remaining = timeout - (time.perf_counter() - t0)
            if remaining <= 0:
                raise TimeoutError("benchmark condition not reached")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), min(remaining, 0.05))
            except asyncio.TimeoutError:
                pass
        return time.perf_counter() - t0


class LagMeter:
    def __init__(self) -> None:
        self.max_lag = 0.0
        self.task = asyncio.get_running_loop().create_task(self.run(), name="bench.lagmeter")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.05)
            self.max_lag = max(self.max_lag, loop.time() - t - 0.05)


async def cold_start(n: int, cfg: MeshConfig) -> tuple[list[Node], Watch, float, int]:
    first = Node("b000", "worker", secret=SECRET, config=cfg)
    await first.start()
    seeds = [first.address]
    early = [Node(f"b{i:03d}", "worker", secret=SECRET, seeds=[first.address], config=cfg) for i in (1, 2)]
    for x in early:
        await x.start()
        seeds.append(x.address)
    rest = [Node(f"b{i:03d}", "worker", secret=SECRET, seeds=seeds, config=cfg) for i in range(3, n)]
    nodes = [first, *early, *rest]
    watch = Watch(nodes)
    for x in (first, *early):  # what they learned before the watch started
        watch.known[x.node_id].update(m.node_id for m in x.members() if m.node_id != x.node_id)
    r0 = first.stats()["protocol_rounds"]
    t0 = time.perf_counter()
    await asyncio.gather(*(x.start() for x in rest))
    await watch.until(lambda: all(len(k) == n - 1 for k in watch.known.values()), 120)
    # protocol rounds node 0 actually ran meanwhile: periods of protocol time, whatever the CPU load
    return nodes, watch, time.perf_counter() - t0, first.stats()["protocol_rounds"] - r0


async def one_size(n: int, cfg: MeshConfig) -> dict:
    lag = LagMeter()
    cpu0 = time.process_time()
    nodes, watch, conv_s, rounds = await cold_start(n, cfg)
    cpu_conv = time.process_time() - cpu0
    # detection is measured in a steady cluster: let the join gossip drain first
    q0 = time.perf_counter()
    while any(x.stats()["broadcast_queue"] for x in nodes) and time.perf_counter() - q0 < 30:
        await asyncio.sleep(0.2)
    quiesce_s = time.perf_counter() - q0
    victim = nodes[len(nodes) // 2]
    others = [x for x in nodes if x is not victim]
    t0 = time.perf_counter()
    await victim.stop(graceful=False)
    vid = victim.node_id
    await watch.until(lambda: sum(1 for w, a, _ in watch.dead_events if a == vid) >= len(others), 60)
    detect_s = max(t for w, a, t in watch.dead_events if a == vid) - t0
    first_s = min(t for w, a, t in watch.dead_events if a == vid) - t0
    false_deaths = sum(1 for _, a, _ in watch.dead_events if a != vid)
    lag.task.cancel()
    await asyncio.gather(*(x.stop(graceful=False) for x in others))
    return {"n": n, "converge_s": conv_s, "converge_periods": conv_s / cfg.protocol_period_s, "converge_rounds": rounds,
            "detect_s": detect_s, "first_detect_s": first_s, "expected_detect_s": cfg.expected_detection_s(n),
            "false_deaths": false_deaths, "suspects": watch.suspect_events, "max_loop_lag_s": lag.max_lag,
            "cpu_s_converge": cpu_conv, "quiesce_s": quiesce_s}


async def idle(n: int, seconds: float, cfg: MeshConfig) -> dict:
    lag = LagMeter()
    nodes, watch, _, _ = await cold_start(n, cfg)
    watch.dead_events.clear()
    watch.suspect_events = 0
    lag.max_lag = 0.0
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    cpu = (time.process_time() - cpu0) / (time.perf_counter() - t0)
    lag.task.cancel()
    sent = sum(x.stats()["sent"] for x in nodes)
    await asyncio.gather(*(x.stop(graceful=False) for x in nodes))
    return {"n": n, "seconds": seconds, "false_deaths": len(watch.dead_events), "suspects": watch.suspect_events,
            "max_loop_lag_s": lag.max_lag, "cpu_fraction": cpu, "msgs_per_node_per_s": sent / n / seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="16,64,256")
    p.add_argument("--repeat", type=int, default=3, help="runs per size; medians are reported")
    p.add_argument("--idle-seconds", type=float, default=60.0)
    p.add_argument("--idle-nodes", type=int, default=64)
    p.add_argument("--period", type=float, default=0.2, help="protocol period (default: the MeshConfig default)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    random.seed(args.seed)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    cfg = MeshConfig(protocol_period_s=args.period)  # every other knob at its default
    sizes = [int(s) for s in args.sizes.split(",")]
    med: dict[int, dict] = {}
    for n in sizes:
        runs = [runner(one_size(n, cfg)) for _ in range(args.repeat)]
        r = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        r["false_deaths"] = sum(x["false_deaths"] for x in runs)
        med[n] = r
        print(f"N={n:4d} (median of {args.repeat}): converge {r['converge_s']:.2f}s = {r['converge_periods']:.1f} "
              f"periods of wall time, {r['converge_rounds']:.0f} protocol rounds | detect first "
              f"{r['first_detect_s']:.2f}s all {r['detect_s']:.2f}s (expected ~{r['expected_detect_s']:.2f}s) | "
              f"false deaths {r['false_deaths']} | max loop lag {r['max_loop_lag_s'] * 1000:.0f}ms | "
              f"cpu {r['cpu_s_converge']:.1f}s for the cold start", flush=True)
    idle_r = runner(idle(args.idle_nodes, args.idle_seconds, cfg))
    print(f"idle N={idle_r['n']} for {idle_r['seconds']:.0f}s: false deaths {idle_r['false_deaths']}, "
          f"suspicions {idle_r['suspects']}, max loop lag {idle_r['max_loop_lag_s'] * 1000:.0f}ms, "
          f"cpu {idle_r['cpu_fraction'] * 100:.0f}% of one core, {idle_r['msgs_per_node_per_s']:.1f} msgs/node/s",
          flush=True)
    lo, hi = min(sizes), max(sizes)
    ratio = med[hi]["converge_periods"] / med[lo]["converge_periods"]
    ratio_rounds = med[hi]["converge_rounds"] / max(1, med[lo]["converge_rounds"])
    print(f"ratio converge N={hi} / N={lo} (baseline): wall-time periods {ratio:.2f}x, protocol rounds "
          f"{ratio_rounds:.2f}x (target <= 3)")
    for n in sizes:
        print(f"ratio detect_s / expected at N={n}: {med[n]['detect_s'] / med[n]['expected_detect_s']:.2f}")
    figures: dict = {f"converge_periods_{n}": med[n]["converge_rounds"] for n in sizes}
    figures.update({f"converge_wall_periods_{n}": round(med[n]["converge_periods"], 2) for n in sizes})
    figures.update({f"detect_s_{n}": round(med[n]["detect_s"], 3) for n in sizes})
    figures.update({
        "detect_s": round(max(med[n]["detect_s"] for n in sizes), 3),
        "converge_ratio": round(ratio_rounds, 2), "converge_wall_ratio": round(ratio, 2),
        "false_deaths": idle_r["false_deaths"] + sum(med[n]["false_deaths"] for n in sizes),
        "idle_suspicions": idle_r["suspects"], "idle_seconds": args.idle_seconds, "idle_nodes": args.idle_nodes,
        "idle_cpu_fraction": round(idle_r["cpu_fraction"], 3), "protocol_period_s": cfg.protocol_period_s,
        "repeat": args.repeat,
        "max_loop_lag_s": round(max([r["max_loop_lag_s"] for r in med.values()] + [idle_r["max_loop_lag_s"]]), 3),
    })
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
