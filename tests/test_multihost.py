"""Multi-host clusters for real: three network namespaces on a bridge, one "host" each.

Each host has its own address (10.77.0.1-3) and nodes bind to it, exactly as on separate
machines (``ip netns exec NS distflow-node --host 10.77.0.X``). Checked here:

(a) a mesh forms across the hosts and `distflow status` sees it from any of them;
(b) the quickstart trains across hosts, started by ``distflow-pdsh`` over pdsh's exec
    module (``ip netns exec %h``), with the two trainer ranks' gloo group spanning two hosts
    and every sample trained exactly once by the rank that owns it;
(c) one host's cable is pulled mid-run: its node is declared dead by the others within the
    mesh's bound, training goes on with the remaining rollout node, and when the cable is
    back the node rejoins (alive everywhere) and receives current weights.

Needs root and ``ip netns`` (skips cleanly otherwise). Namespaces, veths and the bridge
are removed when a test ends, pass or fail; every process a test starts is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import pytest
import yaml

from distflow.buffer.routing import owner
from distflow.core.auth import new_secret
from distflow.core.config import read_raw
from distflow.trace import read_trace
from distflow.trainer.metrics import read_metrics
from tests.conftest import ROOT
from tests.netns import Host, Lab, missing_tool, reap_stale, unavailable_reason

NODE_MAIN = "import sys; from distflow.launch.cli import node_main; sys.exit(node_main())"
STATUS_MAIN = "import sys; from distflow.core.status import status_main; sys.exit(status_main(sys.argv[1:]))"
PORT = 29600  # each namespace has its own port space: fixed ports cannot collide with anything
PERIOD_S, SUSPICION_S = 0.2, 1.0  # mesh.protocol_period_s, mesh.suspicion_timeout_s of these clusters
BOUND_S = SUSPICION_S + 10 * PERIOD_S  # a cut-off node is declared dead by then (probe, suspect, gossip)


@pytest.fixture(scope="module")
def netns_ok() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    reap_stale()


@pytest.fixture
def lab(netns_ok: None) -> Iterator[Lab]:
    with Lab(3) as lab:
        yield lab


class Nodes:
    """distflow-node processes inside namespaces; all killed (by group) at the end."""

    def __init__(self, tmp: Path, secret: str):
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.secret = secret
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, host: Host, node_id: str, role: str, cfg: Path, seeds: str, port: int = PORT) -> None:
        argv = [sys.executable, "-c", NODE_MAIN, "--role", role, "--config", str(cfg), "--node-id", node_id,
                "--host", host.addr, "--port", str(port), "--data-port", str(port + 1), "--seeds", seeds]
        env = {**os.environ, "DISTFLOW_SECRET": self.secret, "PYTHONUNBUFFERED": "1",
               "GLOO_SOCKET_IFNAME": host.ifname}
        with (self.logs / f"{node_id}.log").open("a") as f:
            self.procs[node_id] = subprocess.Popen(host.wrap(argv), cwd=ROOT, env=env, stdout=f,
                                                   stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, node_id: str) -> str:
        return (self.logs / f"{node_id}.log").read_text(errors="replace")[-3000:]

    def assert_running(self) -> None:
        for node_id, p in self.procs.items():
            assert p.poll() is None, f"{node_id} exited with {p.returncode}:\n{self.log(node_id)}"

    def stop(self, grace: float = 20.0) -> dict[str, int | None]:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        return {i: p.returncode for i, p in self.procs.items()}


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    n = Nodes(tmp_path, new_secret())
    yield n
    n.stop(grace=5)


def write_config(tmp: Path, toy_model: Path, rows: int, **overrides: object) -> Path:
    from distflow.toy import make_toy_dataset

    data = tmp / "data.jsonl"
    make_toy_dataset(data, rows, seed=7)
    raw = read_raw(ROOT / "examples" / "grpo_quickstart.yaml")
    raw.update(output_dir=str(tmp / "out"), model_path=str(toy_model), toy_model=False, dataset=str(data),
               prompts_per_step=4, group_size=2, max_new_tokens=2, step_timeout_s=120)
    raw["mesh"] = {"protocol_period_s": PERIOD_S, "suspicion_timeout_s": SUSPICION_S, "join_timeout_s": 60}
    raw.update(overrides)
    cfg = tmp / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    return cfg


def mesh_view(host: Host, seeds: str, secret: str) -> dict[str, dict] | None:
    """`distflow status --json`, run inside ``host``'s namespace: member id -> row
    (None while the seed does not answer: it may still be starting, or be cut off)."""
    argv = host.wrap([sys.executable, "-c", STATUS_MAIN, "--seeds", seeds, "--host", host.addr, "--json",
                      "--settle", "1", "--timeout", "5"])
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "DISTFLOW_SECRET": secret})
    if r.returncode == 1 and "could not join the mesh" in r.stderr:
        return None
    assert r.returncode == 0, f"status from {host.addr}: {r.stderr}"
    return {m["id"]: m for m in json.loads(r.stdout.splitlines()[-1])["members"]}


def wait_view(host: Host, seeds: str, secret: str, ok: Callable[[dict], bool], timeout: float, what: str,
              nodes: Nodes) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        view = mesh_view(host, seeds, secret)
        if view is not None and ok(view):
            return view
        nodes.assert_running()
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s; view from {host.addr}: {view}"
        time.sleep(0.3)


def wait_steps(metrics: Path, n: int, timeout: float, nodes: Nodes) -> int:
    deadline = time.monotonic() + timeout
    while len(read_metrics(metrics)) < n:
        nodes.assert_running()
        assert time.monotonic() < deadline, f"fewer than {n} steps after {timeout}s"
        time.sleep(0.1)
    return len(read_metrics(metrics))


# ---------------------------------------------------------------------- (a)
def test_mesh_forms_across_three_hosts(lab, nodes, toy_model, tmp_path):
    h1, h2, h3 = lab.hosts
    # rollout_nodes=3 but only two rollout nodes exist: the nodes join and wait for the group.
    cfg = write_config(tmp_path, toy_model, 48, rollout_nodes=3, trainer_nodes=1, prompts_per_step=6)
    seed = f"{h1.addr}:{PORT}"
    nodes.start(h1, "trainer-h1", "trainer", cfg, "")
    nodes.start(h2, "rollout-h2", "rollout", cfg, seed)
    nodes.start(h3, "rollout-h3", "rollout", cfg, seed)
    want = {"trainer-h1": f"{h1.addr}:{PORT}", "rollout-h2": f"{h2.addr}:{PORT}", "rollout-h3": f"{h3.addr}:{PORT}"}

    def formed(view: dict) -> bool:
        return set(view) == set(want) and all(m["state"] == "alive" for m in view.values())

    # Seen from a host that is not the seed, joining through a node that is not the seed.
    view = wait_view(h3, f"{h2.addr}:{PORT}", nodes.secret, formed, 60, "mesh across 3 hosts", nodes)
    assert {i: m["address"] for i, m in view.items()} == want
    assert {i: m["role"] for i, m in view.items()} == {"trainer-h1": "trainer", "rollout-h2": "rollout",
                                                       "rollout-h3": "rollout"}
    assert formed(mesh_view(h1, seed, nodes.secret) or {})
    nodes.assert_running()  # still waiting for the third rollout node, as configured


# ---------------------------------------------------------------------- (b)
def test_quickstart_trains_across_hosts_with_pdsh(lab, toy_model, tmp_path):
    reason = missing_tool("pdsh", "pdsh")
    if reason:
        pytest.skip(reason)
    h1, h2, h3 = lab.hosts
    cfg = write_config(tmp_path, toy_model, 48, prompts_per_step=8, max_steps=3, trace_samples=True)
    secret_file = tmp_path / "secret"
    secret_file.write_text(new_secret())
    secret_file.chmod(0o600)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{h1.ns} trainer=1 bind={h1.addr} env.GLOO_SOCKET_IFNAME={h1.ifname}\n"
                        f"{h2.ns} trainer=1 rollout=1 bind={h2.addr} env.GLOO_SOCKET_IFNAME={h2.ifname}\n"
                        f"{h3.ns} rollout=1 bind={h3.addr} env.GLOO_SOCKET_IFNAME={h3.ifname}\n")
    run_dir = tmp_path / "run"
    base = [sys.executable, str(ROOT / "deploy" / "pdsh" / "distflow-pdsh")]
    env = {k: v for k, v in os.environ.items() if k != "DISTFLOW_SECRET"}

    def pdsh(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run([*base, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)

    try:
        r = pdsh("start", str(hostfile), str(cfg), "--rcmd", "exec", "--exec-prefix", "ip netns exec %h",
                 "--python", sys.executable, "--run-dir", str(run_dir), "--secret-file", str(secret_file))
        assert r.returncode == 0, r.stderr
        w = pdsh("wait", "--run-dir", str(run_dir), "--timeout", "150", timeout=200)
        assert w.returncode == 0, w.stderr + pdsh("logs", "--run-dir", str(run_dir)).stderr
    finally:
        stop = pdsh("stop", "--run-dir", str(run_dir), "--grace", "10", timeout=120)
    assert stop.returncode == 0, stop.stderr

    out = tmp_path / "out"
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    assert (out / "checkpoint" / "config.json").is_file()
    t1, t2 = f"trainer-{h1.ns}-0", f"trainer-{h2.ns}-0"
    trace = read_trace(out)
    assert set(trace) == {t1, t2, f"rollout-{h2.ns}-0", f"rollout-{h3.ns}-0"}
    trained: Counter[str] = Counter()
    for rank, tid in enumerate(sorted([t1, t2])):  # ranks follow sorted ids: h1's trainer is rank 0
        for rec in trace[tid]:
            assert all(owner(s, 2) == rank for s in rec["sample_ids"])
            trained.update(rec["sample_ids"])
    assert set(trained.values()) == {1} and len(trained) == 3 * 8 * 2
    for node_id in trace:
        host = next(h for h in lab.hosts if h.ns in node_id)
        log = (run_dir / "collected" / host.ns / f"{node_id}.log").read_text()
        assert f"control {host.addr}:" in log  # bound to its own host's address


# ---------------------------------------------------------------------- (c)
def test_host_partition_is_detected_survived_and_healed(lab, nodes, toy_model, tmp_path):
    h1, h2, h3 = lab.hosts
    cfg = write_config(tmp_path, toy_model, 4000, rollout_nodes=2, trainer_nodes=1, max_staleness=1,
                       trace_samples=True, epochs=20)  # far longer than the test: it is stopped
    seed = f"{h1.addr}:{PORT}"
    nodes.start(h1, "trainer-h1", "trainer", cfg, "")
    nodes.start(h2, "rollout-h2", "rollout", cfg, seed)
    nodes.start(h3, "rollout-h3", "rollout", cfg, seed)
    metrics = tmp_path / "out" / "metrics.jsonl"
    wait_steps(metrics, 3, 90, nodes)

    lab.set_link(h3, up=False)  # pull host 3's cable
    down_at = time.monotonic()
    polls: list[tuple[float, str | None]] = []  # (when the view was asked for, rollout-h3's state in it)
    while not polls or polls[-1][0] < BOUND_S:
        asked = time.monotonic() - down_at
        polls.append((round(asked, 2), (mesh_view(h1, seed, nodes.secret) or {}).get("rollout-h3", {}).get("state")))
        nodes.assert_running()
        time.sleep(0.2)
    # Every view asked for after the mesh's failure-detection bound shows it dead.
    late = [state for asked, state in polls if asked >= BOUND_S]
    assert late and set(late) == {"dead"}, polls
    dead = lambda v: v.get("rollout-h3", {}).get("state") == "dead"  # noqa: E731
    wait_view(h2, f"{h2.addr}:{PORT}", nodes.secret, dead, 10, "rollout-h3 dead (seen from host 2)", nodes)
    # Training goes on with the rollout node that remains.
    at_death = len(read_metrics(metrics))
    wait_steps(metrics, at_death + 5, 60, nodes)

    v_up = read_metrics(metrics)[-1]["policy_version"]
    lab.set_link(h3, up=True)
    healed = lambda v: set(v) == {"trainer-h1", "rollout-h2", "rollout-h3"} and all(  # noqa: E731
        m["state"] == "alive" for m in v.values())
    wait_view(h1, seed, nodes.secret, healed, 60, "rollout-h3 alive again (host 1)", nodes)
    wait_view(h3, f"{h3.addr}:{PORT}", nodes.secret, healed, 30, "everyone alive (host 3)", nodes)
    caught_up = lambda v: healed(v) and (v["rollout-h3"]["policy_version"] or 0) >= v_up  # noqa: E731
    view = wait_view(h1, seed, nodes.secret, caught_up, 60, f"rollout-h3 on weights >= v{v_up}", nodes)
    assert view["trainer-h1"]["policy_version"] >= v_up
    nodes.assert_running()  # the partitioned node waited for the trainers instead of exiting
    print(f"partition: views of rollout-h3 (s after the cut, state) {polls}, steps {at_death}->"
          f"{len(read_metrics(metrics))}, rollout-h3 caught up to v{view['rollout-h3']['policy_version']} (>= v{v_up})")
    t0 = time.monotonic()
    codes = nodes.stop(grace=30)
    assert all(c is not None for c in codes.values()) and time.monotonic() - t0 < 30

    # Accounting: contiguous full steps (host 3's prompts were re-issued to rollout-h2 while it
    # was cut off, so no step came up short), and no sample trained twice.
    trace = read_trace(tmp_path / "out")
    steps = trace["trainer-h1"]
    assert [rec["step"] for rec in steps] == list(range(len(steps))) and len(steps) >= at_death + 5
    assert all(len(rec["sample_ids"]) == 4 * 2 for rec in steps)
    trained = Counter(s for rec in steps for s in rec["sample_ids"])
    assert set(trained.values()) == {1}
    assert any(rec["shard"] == 1 for rec in trace["rollout-h2"])  # rollout-h2 (rank 0) covered shard 1
