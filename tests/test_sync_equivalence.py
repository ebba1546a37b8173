"""``max_staleness: 0`` is strictly on-policy: the distributed run reproduces a plain
synchronous loop (generate -> reward -> advantage -> update, one process, no network)
step for step, for the same seed."""

from __future__ import annotations

import pytest
import torch

from distflow.core.config import load_config
from distflow.step import synchronous_run
from distflow.trainer.metrics import read_metrics
from tests.conftest import ROOT, run_distflow
from tests.process_group import process_group, store_path

STEPS = 4


def synchronous_reference(cfg) -> list[dict]:
    """The step's two halves called one after the other in this process (distflow.step)."""
    torch.set_num_threads(1)
    with process_group(store_path()):
        return list(synchronous_run(cfg, STEPS))


def test_on_policy_run_matches_synchronous_loop(toy_model, toy_data, tmp_path):
    overrides = [f"output_dir={tmp_path / 'run'}", f"model_path={toy_model}", f"dataset={toy_data}",
                 "toy_model=false", "rollout_nodes=1", "trainer_nodes=1", "max_staleness=0", f"max_steps={STEPS}",
                 "prompts_per_step=8", "group_size=4", "max_new_tokens=2", "lr=0.01"]
    r = run_distflow(["run", "examples/grpo_quickstart.yaml", "--no-progress", *overrides], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    distributed = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["staleness_mean"] for m in distributed] == [0.0] * STEPS

    reference = synchronous_reference(load_config(ROOT / "examples" / "grpo_quickstart.yaml", overrides))
    assert len(reference) == STEPS
    for d, s in zip(distributed, reference):
        assert d["reward_mean"] == pytest.approx(s["reward_mean"], abs=1e-9)
        assert d["loss"] == pytest.approx(s["loss"], abs=1e-6)
        assert d["grad_norm"] == pytest.approx(s["grad_norm"], rel=1e-5)
    assert len({m["reward_mean"] for m in distributed}) > 1 or distributed[0]["loss"] != 0.0


def test_resumed_run_continues_exactly_where_it_stopped(toy_model, toy_data, tmp_path):
    """Stop after 3 steps, resume from the checkpoint: the same 6 steps as an uninterrupted
    run (weights, sharded optimizer state and data position all restored)."""
    common = [f"model_path={toy_model}", f"dataset={toy_data}", "toy_model=false", "rollout_nodes=1",
              "trainer_nodes=2", "max_staleness=0", "prompts_per_step=8", "group_size=4", "max_new_tokens=2",
              "lr=0.01", "trace_samples=true"]
    args = ["run", "examples/grpo_quickstart.yaml", "--no-progress"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    r = run_distflow(args + common + [f"output_dir={whole}", "max_steps=6"], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_distflow(args + common + [f"output_dir={split}", "max_steps=3"], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (split / "checkpoint" / "distflow_state.json").is_file()
    r = run_distflow(args + common + [f"output_dir={split}", "max_steps=6", f"resume_from={split / 'checkpoint'}"],
                     timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = read_metrics(whole / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    assert [m["step"] for m in b] == list(range(6)) and [m["policy_version"] for m in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert x["reward_mean"] == pytest.approx(y["reward_mean"], abs=1e-9), x["step"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-8), x["step"]
    # The resumed trainers trained exactly the remaining steps' samples.
    from distflow.trace import read_trace

    resumed = read_trace(split)
    assert sorted({rec["step"] for node in ("trainer-0", "trainer-1") for rec in resumed[node]}) == [3, 4, 5]
    # ...and the rollout nodes generated nothing the checkpoint already covered (they wait for the
    # trainers' step before the first batch of a resumed run)
    generated = [rec["step"] for node, recs in resumed.items() if node.startswith("rollout") for rec in recs]
    assert generated and min(generated) == 3, sorted(generated)
