"""Episodes through a real 2 rollout x 2 trainer ``distflow run`` of examples/tool_quickstart.yaml:
every episode of every row the rollout nodes read is trained exactly once, by id, on the
trainer rank that owns it, within the staleness bound; the episode metrics reach metrics.jsonl
summed over both rollout shards."""

from __future__ import annotations

from collections import Counter

from distflow.buffer.routing import owner
from distflow.trace import read_trace
from distflow.trainer.metrics import read_metrics
from tests.conftest import ROOT, run_distflow

EXAMPLE = ROOT / "examples" / "tool_quickstart.yaml"


def test_two_by_two_run_trains_every_episode_once(tmp_path):
    out = tmp_path / "run"
    steps, prompts, group = 3, 8, 4
    r = run_distflow(["run", str(EXAMPLE), "--no-progress", f"output_dir={out}", f"model_path={tmp_path / 'model'}",
                      f"max_steps={steps}", f"prompts_per_step={prompts}", f"group_size={group}",
                      "trace_samples=true"], timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(steps))
    for m in metrics:
        assert m["episodes"] == prompts * group  # both shards' counters, summed
        assert m["samples"] == m["trained_episodes"] == prompts * group  # no split, no environment error
        assert 0.0 <= m["tool_call_rate"] <= 1.0 and m["episode_turns_mean"] >= 1.0
    trace = read_trace(out)
    assert sorted(trace) == ["rollout-0", "rollout-1", "trainer-0", "trainer-1"]
    shards = [{p for rec in trace[f"rollout-{k}"] for p in rec["prompt_ids"]} for k in range(2)]
    assert not shards[0] & shards[1] and len(shards[0] | shards[1]) == steps * prompts
    seen: Counter[str] = Counter()
    for rank in range(2):
        for rec in trace[f"trainer-{rank}"]:
            assert all(owner(s, 2) == rank for s in rec["sample_ids"])
            assert all(rec["step"] - v <= 1 for v in rec["policy_versions"])  # max_staleness: 1, per episode
            seen.update(rec["sample_ids"])
    assert set(seen.values()) == {1}  # each episode trained once
    assert set(seen) == {f"{p}:s{j}" for p in shards[0] | shards[1] for j in range(group)}
