"""Elasticity without a coordinator: a rollout node killed mid-run loses no sample.

Real `distflow-node` processes on loopback (started by hand, as on a cluster, so no
launcher tears everything down). kill -9 one rollout node mid-run: its shard is adopted
by the next alive rollout node, the run completes, and every sample of the epoch is
trained exactly once. The killed node is restarted with the same id: it rejoins, skips to
the trainers' current step and receives current weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

from distflow.core.auth import new_secret
from distflow.core.config import read_raw
from distflow.launch.children import free_ports
from distflow.trace import read_trace
from distflow.trainer.metrics import read_metrics
from tests.conftest import ROOT

ROWS, PER_STEP, GROUP = 1200, 6, 2


_zygote = None  # this pytest process's client of the suite's shared zygote (tests/conftest.py: shared_zygote)


def start(node_id: str, role: str, cfg: Path, port: int, seeds: str, env: dict, logs: Path):
    """``distflow-node ARGS`` as a person starts it on a host, its output appended to its log. Under
    the suite's shared zygote (``DISTFLOW_ZYGOTE``) the node is forked from it, as `distflow run`
    forks its nodes (the same ``node_main(ARGS)``, torch already imported); otherwise, or if that
    fails, a fresh interpreter (tests/test_cluster.py always execs the real command)."""
    global _zygote
    from distflow.launch.zygote import SHARED_ENV, Zygote

    args = ["--role", role, "--config", str(cfg), "--node-id", node_id, "--port", str(port), "--seeds", seeds]
    log = logs / f"{node_id}.log"
    if os.environ.get(SHARED_ENV):
        try:
            if _zygote is None or not _zygote.alive():
                _zygote = Zygote(dict(os.environ))
            return _zygote.spawn(args, str(log), env)  # .poll/.wait/.send_signal/.kill, as a Popen's
        except (OSError, RuntimeError):
            _zygote = None
    cmd = [sys.executable, "-c", "import sys; from distflow.launch.cli import node_main; sys.exit(node_main())", *args]
    with log.open("a") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


class HandCluster:
    """One trainer and three rollout `distflow-node` processes started by hand from the config
    ``raw`` (each with its own log under ``tmp_path/logs``), as on a cluster: no launcher."""

    def __init__(self, tmp_path: Path, raw: dict):
        self.cfg = tmp_path / "cfg.yaml"
        self.cfg.write_text(yaml.safe_dump(raw))
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        self.env = {**os.environ, "DISTFLOW_SECRET": new_secret(), "PYTHONUNBUFFERED": "1"}
        self.ports = free_ports("127.0.0.1", 4)
        self.seed = f"127.0.0.1:{self.ports[0]}"
        self.metrics = Path(raw["output_dir"]) / "metrics.jsonl"
        self.procs = {"trainer-0": start("trainer-0", "trainer", self.cfg, self.ports[0], "", self.env, self.logs)}
        for i in range(3):
            self.start_rollout(i)

    def start_rollout(self, i: int) -> None:  # the same id and port on a restart
        self.procs[f"rollout-{i}"] = start(f"rollout-{i}", "rollout", self.cfg, self.ports[1 + i], self.seed, self.env,
                                           self.logs)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()[-3000:]

    def wait_rows(self, n: int, deadline: float) -> int:
        """Wait (bounded) until metrics.jsonl has ``n`` rows while the trainer lives; returns the rows."""
        while len(read_metrics(self.metrics)) < n and time.monotonic() < deadline:
            assert self.procs["trainer-0"].poll() is None, self.log("trainer-0")
            time.sleep(0.1)
        return len(read_metrics(self.metrics))

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)

    def wait_exit_0(self, names: tuple[str, ...], timeout: float) -> None:
        for name in names:
            assert self.procs[name].wait(timeout=timeout) == 0, self.log(name)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()


def test_killed_rollout_is_covered_and_rejoins(toy_model, tmp_path):
    from distflow.toy import make_toy_dataset

    data = tmp_path / "data.jsonl"
    make_toy_dataset(data, ROWS, seed=3)
    raw = read_raw(ROOT / "examples" / "grpo_quickstart.yaml")
    raw.update(output_dir=str(tmp_path / "out"), model_path=str(toy_model), toy_model=False, dataset=str(data),
               rollout_nodes=3, trainer_nodes=1, prompts_per_step=PER_STEP, group_size=GROUP, max_new_tokens=6,
               trace_samples=True, max_staleness=1, step_timeout_s=120)
    nodes = HandCluster(tmp_path, raw)
    try:
        deadline = time.monotonic() + 120
        killed_at = nodes.wait_rows(3, deadline)
        nodes.kill("rollout-1")
        # Training goes on without it (its shard is adopted by rollout-2).
        assert nodes.wait_rows(killed_at + 5, deadline) >= killed_at + 5
        nodes.start_rollout(1)  # same id, same port
        nodes.wait_exit_0(("trainer-0", "rollout-0", "rollout-2", "rollout-1"), 180)
    finally:
        nodes.close()
    logs, metrics_path = nodes.logs, nodes.metrics

    steps = ROWS // PER_STEP
    metrics = read_metrics(metrics_path)
    assert [m["step"] for m in metrics] == list(range(steps))
    trace = read_trace(tmp_path / "out")
    # Every sample of the epoch was trained exactly once, although a producer died.
    trained = Counter(s for rec in trace["trainer-0"] for s in rec["sample_ids"])
    assert set(trained.values()) == {1}
    assert set(trained) == {f"e0:{i}:s{j}" for i in range(ROWS) for j in range(GROUP)}
    # rollout-2 adopted shard 1 while rollout-1 was down.
    assert any(rec["shard"] == 1 for rec in trace["rollout-2"])
    # The restarted rollout-1 caught up: it generated only steps after the kill, with fresh weights.
    log1 = (logs / "rollout-1.log").read_text()
    assert log1.count("rollout rank 1: shard 1") == 2
    after = [rec for rec in trace["rollout-1"] if rec["step"] > killed_at + 5]
    assert after, "the restarted node never generated again"
    assert all(rec["policy_version"] >= rec["step"] - 1 for rec in after)
