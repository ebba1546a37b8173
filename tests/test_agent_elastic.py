"""Episodes survive a kill -9 of a rollout node: real ``distflow-node`` processes of the tool
example (3 rollout, 1 trainer, as tests/test_elastic.py starts them); rollout-1 is killed mid-run,
its shard adopted, and every episode of the epoch is still trained exactly once, by id."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import yaml

from distflow.core.auth import new_secret
from distflow.core.config import read_raw
from distflow.launch.children import free_ports
from distflow.trace import read_trace
from distflow.trainer.metrics import read_metrics
from tests.conftest import ROOT
from tests.test_elastic import start

ROWS, PER_STEP, GROUP = 180, 6, 2


def test_killed_rollout_loses_no_episode(tmp_path):
    from distflow.env.toy_tasks import make_tool_dataset
    from distflow.toy import ensure_toy_model

    data = make_tool_dataset(tmp_path / "data.jsonl", ROWS, seed=3)
    raw = read_raw(ROOT / "examples" / "tool_quickstart.yaml")
    raw.update(output_dir=str(tmp_path / "out"), model_path=ensure_toy_model(tmp_path / "model", kind="tool"),
               toy_model=False, dataset=data, rollout_nodes=3, trainer_nodes=1, prompts_per_step=PER_STEP,
               group_size=GROUP, max_steps=None, trace_samples=True, max_staleness=1, step_timeout_s=120)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**os.environ, "DISTFLOW_SECRET": new_secret(), "PYTHONUNBUFFERED": "1"}
    ports = free_ports("127.0.0.1", 4)
    seed = f"127.0.0.1:{ports[0]}"
    procs = {"trainer-0": start("trainer-0", "trainer", cfg, ports[0], "", env, logs)}
    for i in range(3):
        procs[f"rollout-{i}"] = start(f"rollout-{i}", "rollout", cfg, ports[1 + i], seed, env, logs)
    metrics_path = tmp_path / "out" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while len(read_metrics(metrics_path)) < 3 and time.monotonic() < deadline:
            assert procs["trainer-0"].poll() is None, (logs / "trainer-0.log").read_text()[-3000:]
            time.sleep(0.1)
        killed_at = len(read_metrics(metrics_path))
        assert killed_at < ROWS // PER_STEP - 5, "the run ended before the kill: make it longer"
        procs["rollout-1"].send_signal(signal.SIGKILL)
        procs["rollout-1"].wait(10)
        for name in ("trainer-0", "rollout-0", "rollout-2"):
            assert procs[name].wait(timeout=240) == 0, (logs / f"{name}.log").read_text()[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()

    metrics = read_metrics(metrics_path)
    assert [m["step"] for m in metrics] == list(range(ROWS // PER_STEP))
    trace = read_trace(tmp_path / "out")
    trained = Counter(s for rec in trace["trainer-0"] for s in rec["sample_ids"])
    assert set(trained.values()) == {1}  # no episode trained twice, although its producer died
    assert set(trained) == {f"e0:{i}:s{j}" for i in range(ROWS) for j in range(GROUP)}  # none lost
    assert any(rec["shard"] == 1 for rec in trace["rollout-0"] + trace["rollout-2"])  # shard 1 adopted
