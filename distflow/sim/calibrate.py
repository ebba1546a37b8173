"""Per-message and per-byte CPU costs of the data plane, read from this project's own benchmarks.

Why from the benches: the model's data plane must cost what DistFlow's code costs on the
machine it runs on, not a guess. ``bench/message.py`` times one acked message (the fixed cost
of a part sent to another host) with two payloads, which gives its per-byte slope too;
``bench/redistribute.py --parts handoff`` times the same-host path (posted parts) and the
single-controller relay at two sizes, which separates the per-part cost from the per-byte cost
of the split and the join; ``bench/mesh.py`` gives the SWIM gossip's idle CPU per node. Each
bench is run with its quick options and its final JSON line is read (:func:`run_benches`);
:func:`fit` turns those lines into a :class:`Calibration`. The lines are kept in a JSON file so
a figure can be recomputed from the measurement it came from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

# bench/redistribute.py's handoff payload: 64 samples of 1,024 prompt + 3,072 response tokens
HANDOFF_BYTES = 64 * (1024 * 8 + 3072 * 16)


@dataclass(frozen=True)
class Calibration:
    """CPU seconds of one process's main work, per event. ``remote_*``: a part sent as an acked
    message over zmq to another host (sender / receiver, fixed + per byte); ``post_*``: a part
    posted to a same-host consumer's mailbox; ``pack_s_per_byte`` / ``join_s_per_byte``: the
    producer's split into parts and the consumer's concatenation of a step's parts;
    ``scatter_s`` / ``take_s``: fixed cost of one scatter call / one gathered step; ``wake_s``: what
    a process pays more per step when it slept in between (cold caches, timers: bench/scale.py
    measures it as steps with sleeps against back-to-back steps, :func:`with_wake`);
    ``mesh_cpu_fraction``: share of a core each node spends on SWIM gossip while idle."""

    remote_tx_s: float = 151e-6  # defaults: this project's CI VM, bench/scale.py of 2026-11-29 01:55 UTC
    remote_rx_s: float = 167e-6
    remote_tx_s_per_byte: float = 0.29e-9
    remote_rx_s_per_byte: float = 0.37e-9
    post_tx_s: float = 26e-6
    post_rx_s: float = 45e-6
    pack_s_per_byte: float = 0.084e-9
    join_s_per_byte: float = 0.084e-9
    scatter_s: float = 678e-6
    take_s: float = 383e-6
    wake_s: float = 96e-6
    mesh_cpu_fraction: float = 0.0026
    source: str = "defaults (no bench run)"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Calibration":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def last_json(text: str) -> dict[str, Any]:
    """The final JSON line of a bench's output (the house rule: every bench ends with one)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the bench output")


def _bench(root: str, args: list[str], timeout: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return last_json(out.stdout)


def run_benches(root: str, timeout: float = 600.0) -> dict[str, Any]:
    """Run the benches with quick options (about a minute on 2 idle cores) and return their JSON lines."""
    msg = ["bench/message.py", "--msgs", "300", "--rounds", "4", "--channel", "zmq"]
    lines = {
        "message_zmq_64k": _bench(root, [*msg, "--payload-kib", "64"], timeout),
        "message_zmq_1m": _bench(root, [*msg, "--payload-kib", "1024"], timeout),
        "redistribute": _bench(root, ["bench/redistribute.py", "--quick", "--parts", "handoff", "--sizes", "2,4,8"],
                               timeout),
        "mesh": _bench(root, ["bench/mesh.py", "--sizes", "16", "--repeat", "1", "--idle-seconds", "5",
                              "--idle-nodes", "16"], timeout),
    }
    lines["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines["load_avg"] = os.getloadavg()[0]
    return lines


def fit(lines: dict[str, Any]) -> Calibration:
    """A :class:`Calibration` from the benches' JSON lines (see the module docstring for which is which).

    Remote messages: ``bench/message.py`` at 64 KiB and 1 MiB gives CPU per message on each side;
    the slope between them is the per-byte cost, the intercept the fixed cost. Posted parts:
    ``bench/redistribute.py`` at N=2, 4, 8 (64 samples, 3.5 MiB per producer): a p2p producer
    scatters N parts of the same bytes, so its slope in N (least squares) is the cost of one post;
    a consumer's slope is the cost of one taken part; the controller takes N whole batches and
    splits N x 3.5 MiB, so its slope, less one post and one take, is the per-byte cost of a split
    plus a join; the intercepts, less those bytes, are the fixed costs of a scatter and a take."""
    small, big = lines["message_zmq_64k"], lines["message_zmq_1m"]
    db = (big["payload_kib"] - small["payload_kib"]) * 1024
    tx_b = max(0.0, (big["channel_tx_us"] - small["channel_tx_us"]) * 1e-6 / db)
    rx_b = max(0.0, (big["channel_rx_us"] - small["channel_rx_us"]) * 1e-6 / db)
    tx = max(1e-6, small["channel_tx_us"] * 1e-6 - tx_b * small["payload_kib"] * 1024)
    rx = max(1e-6, small["channel_rx_us"] * 1e-6 - rx_b * small["payload_kib"] * 1024)
    r = lines["redistribute"]
    ms = 1e-3
    sizes = sorted(int(k.rsplit("_", 1)[1]) for k in r if k.startswith("controller_cpu_ms_"))
    post_tx = max(1e-6, _slope(sizes, [r[f"p2p_producer_cpu_ms_{n}"] * ms for n in sizes]))
    post_rx = max(1e-6, _slope(sizes, [r[f"p2p_consumer_cpu_ms_{n}"] * ms for n in sizes]))
    ctrl_slope = _slope(sizes, [r[f"controller_cpu_ms_{n}"] * ms for n in sizes])  # per producer batch
    per_byte = max(0.0, (ctrl_slope - post_tx - post_rx) / HANDOFF_BYTES)  # split + join, each byte once
    pack = join = per_byte / 2  # (the two copies are alike: numpy gathers into one buffer, out of it)
    # intercepts (least squares over the sizes): producer = scatter + N posts + its bytes packed
    scatter = max(0.0, _intercept(sizes, [r[f"p2p_producer_cpu_ms_{n}"] * ms for n in sizes])
                  - HANDOFF_BYTES * pack)
    take = max(0.0, _intercept(sizes, [r[f"p2p_consumer_cpu_ms_{n}"] * ms for n in sizes]) - HANDOFF_BYTES * join)
    m = lines.get("mesh") or {}
    mesh = m.get("idle_cpu_fraction", 0.0) / max(1, m.get("idle_nodes", 1))
    return Calibration(remote_tx_s=tx, remote_rx_s=rx, remote_tx_s_per_byte=tx_b, remote_rx_s_per_byte=rx_b,
                       post_tx_s=post_tx, post_rx_s=post_rx, pack_s_per_byte=pack, join_s_per_byte=join,
                       scatter_s=scatter, take_s=take, mesh_cpu_fraction=mesh,
                       source=f"benches run {lines.get('when', '?')}, load average {lines.get('load_avg', '?')}")


def with_wake(cal: Calibration, wake_s: float) -> Calibration:
    return dataclasses.replace(cal, wake_s=max(0.0, wake_s))


def _slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ys on xs (two points: the line through them)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _intercept(xs: list[int], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return my - _slope(xs, ys) * mx


def load_or_run(path: str, root: str, rerun: bool = False) -> tuple[Calibration, dict[str, Any]]:
    """The calibration of ``path`` (the benches' JSON lines), running the benches first if asked or absent."""
    if rerun or not os.path.exists(path):
        lines = run_benches(root)
        with open(path, "w") as f:
            json.dump(lines, f, indent=1)
    with open(path) as f:
        lines = json.load(f)
    return fit(lines), lines
