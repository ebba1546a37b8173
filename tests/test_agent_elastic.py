"""Episodes survive a kill -9 of a rollout node: real ``distflow-node`` processes of the tool
example (3 rollout, 1 trainer, as tests/test_elastic.py starts them); rollout-1 is killed mid-run,
its shard adopted, and every episode of the epoch is still trained exactly once, by id."""

from __future__ import annotations

import time
from collections import Counter


from distflow.core.config import read_raw
from distflow.trace import read_trace
from distflow.trainer.metrics import read_metrics
from tests.conftest import ROOT
from tests.test_elastic import HandCluster

ROWS, PER_STEP, GROUP = 180, 6, 2


def test_killed_rollout_loses_no_episode(tmp_path):
    from distflow.env.toy_tasks import make_tool_dataset
    from distflow.toy import ensure_toy_model

    data = make_tool_dataset(tmp_path / "data.jsonl", ROWS, seed=3)
    raw = read_raw(ROOT / "examples" / "tool_quickstart.yaml")
    raw.update(output_dir=str(tmp_path / "out"), model_path=ensure_toy_model(tmp_path / "model", kind="tool"),
               toy_model=False, dataset=data, rollout_nodes=3, trainer_nodes=1, prompts_per_step=PER_STEP,
               group_size=GROUP, max_steps=None, trace_samples=True, max_staleness=1, step_timeout_s=120)
    nodes = HandCluster(tmp_path, raw)
    try:
        killed_at = nodes.wait_rows(3, time.monotonic() + 180)
        assert killed_at < ROWS // PER_STEP - 5, "the run ended before the kill: make it longer"
        nodes.kill("rollout-1")
        nodes.wait_exit_0(("trainer-0", "rollout-0", "rollout-2"), 240)
    finally:
        nodes.close()
    metrics_path = nodes.metrics

    metrics = read_metrics(metrics_path)
    assert [m["step"] for m in metrics] == list(range(ROWS // PER_STEP))
    trace = read_trace(tmp_path / "out")
    trained = Counter(s for rec in trace["trainer-0"] for s in rec["sample_ids"])
    assert set(trained.values()) == {1}  # no episode trained twice, although its producer died
    assert set(trained) == {f"e0:{i}:s{j}" for i in range(ROWS) for j in range(GROUP)}  # none lost
    assert any(rec["shard"] == 1 for rec in trace["rollout-0"] + trace["rollout-2"])  # shard 1 adopted
