"""Worker groups of their own (``worker_groups``): config rules, routing, and a real cluster
whose reward model runs on a reward-worker node between the rollout and trainer groups."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest

from distflow.buffer.routing import owner
from distflow.core.config import ConfigError, config_from_dict, load_config, read_raw
from distflow.trace import read_trace
from distflow.trainer.metrics import read_metrics
from tests.conftest import ROOT, run_distflow

EXAMPLE = "examples/grpo_reward_model.yaml"
# The children must import this checkout's distflow, whatever the installed one is.
CHILD_ENV = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def example_raw(**changes) -> dict:
    raw = read_raw(ROOT / EXAMPLE)
    raw.update(changes)
    return raw


# ----------------------------------------------------------------------------- config
def test_example_plans_the_reward_group_between_rollout_and_trainer():
    cfg = load_config(ROOT / EXAMPLE)
    assert cfg.group_sizes() == {"rollout": 2, "reward": 1, "trainer": 2}
    p = cfg.plan()
    assert p.flow == ["rollout", "reward", "trainer"]
    assert {g: [n.id for n in ns] for g, ns in p.pipelines.items()} == {
        "rollout": ["generate"], "reward": ["score", "rm", "advantage"], "trainer": ["reference", "update"]}


def test_unknown_group_names_the_key():
    raw = example_raw()
    raw["workflow"][2]["group"] = "rewards"
    with pytest.raises(ConfigError, match=r"workflow node 'rm': key 'group' names 'rewards'.*worker_groups \(reward\)"):
        config_from_dict(raw)


@pytest.mark.parametrize("groups, match", [
    ({"trainer": 1}, r"worker_groups.*'trainer' is a built-in group"),
    ({"controller": 1}, r"worker_groups.*'controller' is a built-in group"),
    ({"reward": 0}, r"worker_groups.*group 'reward' has 0 nodes"),
    ({"re ward": 1}, r"worker_groups.*group name 're ward'"),
])
def test_bad_worker_groups_name_the_key(groups, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(example_raw(worker_groups=groups))


def test_idle_group_single_controller_and_dynamic_sampling_are_refused():
    with pytest.raises(ConfigError, match=r"group 'judge' runs no workflow node"):
        config_from_dict(example_raw(worker_groups={"reward": 1, "judge": 1}))
    with pytest.raises(ConfigError, match=r"controller: single.*cannot be combined with worker groups"):
        config_from_dict(example_raw(controller="single"))
    raw = example_raw()
    raw["workflow"].insert(3, {"id": "filter", "role": "ACTOR", "type": "COMPUTE", "fn": "dynamic_sampling",
                               "deps": ["rm"]})
    raw["workflow"][4]["deps"] = ["filter"]  # the estimator after the filter, as in DAPO
    with pytest.raises(ConfigError, match=r"'filter': dynamic_sampling .* not on 'reward'"):
        config_from_dict(raw)


# ----------------------------------------------------------------------------- routing and placement
def test_rollout_shard_s_goes_to_worker_rank_s_mod_m_and_the_workers_feed_every_trainer():
    from distflow.runtime import Groups, Runtime

    cfg = config_from_dict(example_raw(rollout_nodes=4, prompts_per_step=32, worker_groups={"reward": 3}))
    m = lambda i: SimpleNamespace(node_id=i)  # noqa: E731
    groups = Groups([m(f"rollout-{i}") for i in range(4)], [m("trainer-0"), m("trainer-1")], 0,
                    workers={"reward": [m("reward-0"), m("reward-1"), m("reward-2")]})
    rt = SimpleNamespace(groups=groups, cfg=cfg, _plan=None, node=SimpleNamespace(node_id="x"))
    assert [Runtime.targets_after(rt, "rollout", s) for s in range(4)] == [
        ["reward-0"], ["reward-1"], ["reward-2"], ["reward-0"]]
    assert Runtime.targets_after(rt, "reward", 2) == ["trainer-0", "trainer-1"]


def test_launcher_starts_worker_nodes_placed_like_rollout_nodes():
    from distflow.launch.placement import plan_placement
    from distflow.launch.roles import cluster_nodes, node_roles

    cfg = config_from_dict(example_raw(worker_groups={"reward": 2}, device="cuda", gpus=4))
    assert node_roles(cfg) == [("trainer-0", "trainer"), ("trainer-1", "trainer"), ("rollout-0", "rollout"),
                               ("rollout-1", "rollout"), ("reward-0", "worker"), ("reward-1", "worker")]
    assert [(n.group, n.role) for n in cluster_nodes(cfg)][-1] == ("reward", "reward")  # `--group reward`
    gpus = {s.node_id: s.gpu for s in plan_placement(cfg, present=4)}
    # Trainers take GPUs 0, 1; rollout and reward-worker nodes share the rest round-robin.
    assert gpus == {"trainer-0": "0", "trainer-1": "1", "rollout-0": "2", "rollout-1": "3",
                    "reward-0": "2", "reward-1": "3"}


def test_node_check_knows_worker_groups(tmp_path):
    env = {**os.environ, **CHILD_ENV, "DISTFLOW_SECRET": "s" * 32}

    def check(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", "import sys; from distflow.launch.cli import node_main; "
                               "sys.exit(node_main())", "--config", EXAMPLE, "--check", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)

    ok = check("--role", "worker", "--group", "reward", "--node-id", "reward-0")
    assert ok.returncode == 0, ok.stderr
    assert "role=reward" in ok.stdout and "pipeline=['score', 'rm', 'advantage']" in ok.stdout
    bad = check("--role", "worker", "--group", "judge")
    assert bad.returncode == 2 and "--group 'judge' is not a group of worker_groups (reward)" in bad.stderr
    assert check("--role", "worker").returncode == 2


def test_toy_reward_model_builds_and_scores(tmp_path):
    from distflow.launch.cli import main
    from distflow.rl.reward_model import RewardModel
    import torch

    assert main(["toy-model", "--kind", "reward", str(tmp_path / "rm")]) == 0
    rm = RewardModel(tmp_path / "rm")
    a = rm.score([torch.tensor([2, 5, 6, 14])], [torch.tensor([7, 1])])
    b = RewardModel(tmp_path / "rm").score([torch.tensor([2, 5, 6, 14])], [torch.tensor([7, 1])])
    assert a.shape == (1,) and torch.equal(a, b)  # deterministic


# ----------------------------------------------------------------------------- a real cluster
def test_reward_model_on_its_own_worker_group_scores_every_sample_once(toy_model, toy_data, tmp_path):
    out, rm_dir = tmp_path / "run", tmp_path / "toy-reward-model"
    # toy_model: true builds the missing reward model at the node's args.path (the policy exists).
    r = run_distflow(["run", EXAMPLE, "--no-progress", f"output_dir={out}", f"model_path={toy_model}",
                      f"dataset={toy_data}", "prompts_per_step=16", "group_size=4", "max_new_tokens=2",
                      "trace_samples=true", f"workflow.2.args.path={rm_dir}"], timeout=240, env=CHILD_ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (rm_dir / "config.json").is_file()
    assert "2 rollout + 1 reward + 2 trainer nodes" in r.stderr

    log = (out / "logs" / "reward-0.log").read_text()
    assert "reward rank 0 of 1: pipeline ['score', 'rm', 'advantage']" in log
    # 3 steps x 2 shards, 48 prompts x 4; a send resent after a hiccup (a peer briefly suspected)
    # is processed again and dropped by the trainers, so at least that many.
    parts, samples = map(int, re.search(r"forwarded (\d+) parts / (\d+) samples", log).groups())
    assert parts >= 6 and samples == 32 * parts

    all_ids = {f"e0:{i}:s{j}" for i in range(48) for j in range(4)}
    trace = read_trace(out)
    assert sorted(trace) == ["reward-0", "rollout-0", "rollout-1", "trainer-0", "trainer-1"]
    # The reward worker scored every (step, shard), every sample, with a reward (a repeat: the same).
    recs = trace["reward-0"]
    assert {(rec["step"], rec["shard"]) for rec in recs} == {(k, s) for k in range(3) for s in range(2)}
    rewards: dict[str, float] = {}
    for rec in recs:
        assert len(rec["rewards"]) == len(rec["sample_ids"]) == 32
        for sid, v in zip(rec["sample_ids"], rec["rewards"]):
            assert rewards.setdefault(sid, v) == v
    assert set(rewards) == all_ids
    # The reward is the successor reward (0/1) plus 0.1 x the reward model's score.
    assert any(v not in (0.0, 1.0) for v in rewards.values())
    # The rollout nodes sent no rewards (scoring is the reward group's job).
    assert all(rec["rewards"] == [] for n in ("rollout-0", "rollout-1") for rec in trace[n])

    # Each trainer got only the samples it owns; every sample was trained exactly once.
    seen: Counter[str] = Counter()
    by_step: dict[int, list[str]] = {}
    for rank in range(2):
        for rec in trace[f"trainer-{rank}"]:
            assert all(owner(s, 2) == rank for s in rec["sample_ids"])
            seen.update(rec["sample_ids"])
            by_step.setdefault(rec["step"], []).extend(rec["sample_ids"])
    assert set(seen.values()) == {1} and set(seen) == all_ids
    # The trainers' reward_mean is the mean of the reward worker's rewards of the step's samples.
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        ids = by_step[m["step"]]
        assert m["samples"] == len(ids) == 64
        assert m["reward_mean"] == pytest.approx(sum(rewards[i] for i in ids) / len(ids), rel=1e-5, abs=1e-6)


def test_killed_reward_worker_is_restarted_and_every_sample_is_still_trained_once(toy_model, tmp_path):
    from tests.procs import run_pids
    from tests.test_supervise import kill_node_midrun, make_data

    rows, out = 64, tmp_path / "run"
    args = ["run", EXAMPLE, "--no-progress", f"output_dir={out}", f"model_path={toy_model}",
            f"dataset={make_data(tmp_path, rows)}", "trainer_nodes=1", "prompts_per_step=4", "group_size=2",
            "max_new_tokens=2", "trace_samples=true", "step_timeout_s=600",
            f"workflow.2.args.path={tmp_path / 'rm'}"]
    proc = subprocess.Popen([sys.executable, "-m", "distflow.launch.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **CHILD_ENV})
    err = kill_node_midrun(proc, out, "reward-0")
    assert proc.returncode == 0, err[-3000:]
    assert "reward-0 died (killed by SIGKILL)" in err
    assert "the rollout nodes retry their sends to it until it is back" in err
    assert "----- distflow run: restart 1 of reward-0 -----" in (out / "logs" / "reward-0.log").read_text()
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == list(range(rows // 4))
    trained = Counter(s for rec in read_trace(out)["trainer-0"] for s in rec["sample_ids"])
    assert set(trained.values()) == {1}
    assert set(trained) == {f"e0:{i}:s{j}" for i in range(rows) for j in range(2)}
    assert not run_pids(out)


def test_a_failing_stage_on_the_worker_group_stops_the_run_naming_it(toy_model, toy_data, tmp_path):
    out = tmp_path / "run"
    r = run_distflow(["run", EXAMPLE, "--no-progress", f"output_dir={out}", f"model_path={toy_model}",
                      f"dataset={toy_data}", "prompts_per_step=16", "group_size=4", "max_new_tokens=2",
                      "restarts=0", "workflow.1.fn=tests.failing:exploding_reward",
                      f"workflow.2.args.path={tmp_path / 'rm'}"], timeout=240, env=CHILD_ENV)
    assert r.returncode == 2, r.stderr[-2000:]  # a bug in the config's reward: never restarted
    assert "reward-0 exited 2" in r.stderr and "not restarted, the run stops" in r.stderr
    assert "workflow node 'score': reward 'tests.failing:exploding_reward' on " in r.stderr
    assert "raised RuntimeError: boom on row" in r.stderr
