"""The agentic example learns: ``examples/tool_quickstart.yaml`` (a secret only a tool returns,
distflow/env/toy_tasks.py) through the step functions, its default 30 steps on CPU. Reported:
the first-10 and last-10 mean reward, the last step's ``tool_call_rate`` and the wall time; and
every key its rows carry is documented in docs/metrics.md."""

from __future__ import annotations

from tests.conftest import ROOT
from tests.learning import learning_run
from tests.test_metrics_doc import documented

EXAMPLE = ROOT / "examples" / "tool_quickstart.yaml"


def test_tool_quickstart_learns_to_call_the_tool(tmp_path):
    cfg, rows, first, last, wall = learning_run(EXAMPLE, "tool", tmp_path)
    rewards = [r["reward_mean"] for r in rows]
    rate = rows[-1]["tool_call_rate"]
    print(f"\ntool_quickstart: {len(rows)} steps, first-10 reward {first:.3f}, last-10 {last:.3f}, "
          f"tool_call_rate {rows[0]['tool_call_rate']:.3f} -> {rate:.3f}, wall {wall:.0f} s")
    assert len(rows) == cfg.max_steps == 30
    assert last - first >= 0.3, rewards
    assert rate >= 0.8, [r["tool_call_rate"] for r in rows]
    assert rows[-1]["episodes"] == cfg.rollout_batch * cfg.group_size  # one shard's: every episode counted
    assert rows[-1]["episode_turns_mean"] > 1.5 and rows[-1]["episode_splits"] == 0
    missing = sorted(set().union(*rows) - documented("metrics.jsonl"))
    assert not missing, f"docs/metrics.md documents no row for {missing}"
