"""End to end: real `distflow run` clusters of real node processes on loopback.

`--in-process` training is checked by tests/test_evaluation.py's in-process run (its metrics
rows) and test_ctrl_c_in_process_... here; an algorithm's learning by
tests/test_algorithm_configs.py on the step functions."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from distflow.buffer.routing import owner
from distflow.trace import read_trace
from distflow.trainer.metrics import read_metrics
from tests.conftest import ROOT, run_distflow
from tests.procs import run_pids

QUICKSTART = "examples/grpo_quickstart.yaml"


def small_run_args(toy_model: Path, toy_data: Path, out: Path, *extra: str) -> list[str]:
    return ["run", QUICKSTART, "--no-progress", f"output_dir={out}", f"model_path={toy_model}",
            f"dataset={toy_data}", "toy_model=false", "prompts_per_step=16", "group_size=4", "max_new_tokens=2",
            *extra]


def test_token_balanced_routing_trains_every_sample_once(toy_model, toy_data, tmp_path):
    out = tmp_path / "run"
    r = run_distflow(small_run_args(toy_model, toy_data, out, "trace_samples=true", "route_by=tokens",
                                    "max_new_tokens=6"), timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    trace = read_trace(out)
    seen = Counter(s for rank in range(2) for rec in trace[f"trainer-{rank}"] for s in rec["sample_ids"])
    assert set(seen.values()) == {1} and len(seen) == 48 * 4
    # Not owner routing: some sample sits on a rank that does not own it.
    assert any(owner(s, 2) != rank for rank in range(2) for rec in trace[f"trainer-{rank}"]
               for s in rec["sample_ids"])


def test_child_failure_stops_everyone_and_names_the_error(toy_model, toy_data, tmp_path):
    """A node that dies (not a deterministic error of the config's code, which exits 2 at once:
    tests/test_user_mistakes.py) is restarted up to `restarts` times, then the run stops, naming it."""
    out = tmp_path / "run"
    t0 = time.monotonic()
    r = run_distflow(small_run_args(toy_model, toy_data, out, "workflow.1.fn=tests.failing:dying_reward",
                                    "restarts=1"), timeout=180, env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 1
    # Each rollout node died, was restarted once (restarts=1), and died again.
    assert "rollout-0 died (exit 1)" in r.stderr and "rollout-1 died (exit 1)" in r.stderr
    assert "(restart 1 of 1)" in r.stderr and " failed (exit 1)" in r.stderr
    assert "dying on row" in r.stderr
    assert time.monotonic() - t0 < 150
    assert not run_pids(out)


def test_bad_workflow_function_fails_before_any_node_starts(tmp_path):
    r = run_distflow(["run", QUICKSTART, f"output_dir={tmp_path}", "workflow.1.fn=no_such_module:reward"], timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("distflow run: workflow node"), r.stderr  # a config error
    assert "workflow node 'reward'" in r.stderr and "no_such_module" in r.stderr
    assert not (tmp_path / "logs").exists()




def test_ctrl_c_stops_every_child_bounded_and_leaves_a_checkpoint(toy_model, tmp_path):
    """SIGINT once the run has trained two steps, with ~200 still to go (so the run cannot end
    first): every child stops, bounded, and the trainers saved their last completed step."""
    import json

    from distflow.toy import make_toy_dataset

    data = tmp_path / "data.jsonl"
    make_toy_dataset(data, 800, seed=2)
    out = tmp_path / "run"
    args = small_run_args(toy_model, data, out, "prompts_per_step=4", "group_size=2")
    proc = subprocess.Popen([sys.executable, "-m", "distflow.launch.cli", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(read_metrics(out / "metrics.jsonl")) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    assert len(run_pids(out)) == 4
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert time.monotonic() - t0 < 60
    assert not run_pids(out)
    rows = read_metrics(out / "metrics.jsonl")
    assert 2 <= len(rows) < 200
    state = json.loads((out / "checkpoint" / "distflow_state.json").read_text())
    assert state["policy_version"] == state["step"] == len(rows)  # the last completed step
    assert f"resume_from={out / 'checkpoint'}" in err


def test_ctrl_c_in_process_saves_the_last_completed_step_like_a_cluster(toy_model, tmp_path):
    """--in-process: the first SIGINT stops the rollout nodes (they leave the mesh), so the trainer
    saves its last completed step and the process exits 130 naming the checkpoint (before, the
    trainer task was cancelled outright: a traceback and no checkpoint)."""
    import json

    from distflow.toy import make_toy_dataset

    data = tmp_path / "data.jsonl"
    make_toy_dataset(data, 800, seed=2)
    out = tmp_path / "run"
    args = small_run_args(toy_model, data, out, "prompts_per_step=4", "group_size=2", "trainer_nodes=1")
    proc = subprocess.Popen([sys.executable, "-m", "distflow.launch.cli", *args, "--in-process"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(read_metrics(out / "metrics.jsonl")) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    rows = read_metrics(out / "metrics.jsonl")
    state = json.loads((out / "checkpoint" / "distflow_state.json").read_text())
    assert state["policy_version"] == state["step"] == len(rows) < 200
    assert f"resume_from={out / 'checkpoint'}" in err and "Traceback" not in err


def test_node_check_validates_without_joining(tmp_path, toy_model):
    env = {**os.environ, "DISTFLOW_SECRET": "x" * 32}
    cmd = [sys.executable, "-c", "import sys; from distflow.launch.cli import node_main; sys.exit(node_main())",
           f"model_path={toy_model}"]  # (the suite's toy model: a fresh checkout has no outputs/toy-model)
    ok = subprocess.run(cmd + ["--role", "rollout", "--config", QUICKSTART, "--seeds", "127.0.0.1:7000", "--check"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "generate" in ok.stdout
    bad = subprocess.run(cmd + ["--role", "trainer", "--config", QUICKSTART, "--seeds", "nohost", "--check"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "nohost" in bad.stderr
    nosecret = subprocess.run(cmd + ["--role", "trainer", "--config", QUICKSTART, "--check"], cwd=ROOT,
                              env={k: v for k, v in env.items() if k != "DISTFLOW_SECRET"},
                              capture_output=True, text=True, timeout=60)
    assert nosecret.returncode == 2 and "DISTFLOW_SECRET" in nosecret.stderr
    wildcard = subprocess.run(cmd + ["--role", "rollout", "--config", QUICKSTART, "--host", "0.0.0.0", "--check"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert wildcard.returncode == 2 and "--advertise-host" in wildcard.stderr
    ok = subprocess.run(cmd + ["--role", "rollout", "--config", QUICKSTART, "--host", "0.0.0.0",
                               "--advertise-host", "10.1.2.3", "--check"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    # --port 0 (the default): two nodes of one host still get distinct default ids
    ids = [subprocess.run(cmd + ["--role", "rollout", "--config", QUICKSTART, "--check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60).stdout.split()[1] for _ in range(2)]
    assert ids[0] != ids[1] and all(i.startswith("rollout-127.0.0.1-pid") for i in ids), ids


def test_node_on_a_taken_port_exits_with_one_line(tmp_path, toy_model):
    """A port another process holds (control or data) is a one-line error naming it and exit 1,
    not a traceback."""
    env = {**os.environ, "DISTFLOW_SECRET": "x" * 32}
    cmd = [sys.executable, "-c", "import sys; from distflow.launch.cli import node_main; sys.exit(node_main())",
           f"model_path={toy_model}"]  # (the suite's toy model: a fresh checkout has no outputs/toy-model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flag, what in (("--port", "control socket"), ("--data-port", "data port")):
            r = subprocess.run(cmd + ["--role", "trainer", "--config", QUICKSTART, flag, str(port)], cwd=ROOT,
                               env=env, capture_output=True, text=True, timeout=60)
            assert r.returncode == 1, r.stderr
            assert "cannot start: " in r.stderr and what in r.stderr and f":{port}" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr, r.stderr


def test_node_stops_on_sigterm_while_still_joining_the_mesh(tmp_path, toy_model):
    """A node whose seeds do not answer waits up to mesh.join_timeout_s to join; SIGTERM (a launcher,
    Slurm, a person stopping a half-started cluster) ends that wait at once, with exit 143."""
    env = {**os.environ, "DISTFLOW_SECRET": "x" * 32}
    cmd = [sys.executable, "-c", "import sys; from distflow.launch.cli import node_main; sys.exit(node_main())",
           f"model_path={toy_model}"]  # (the suite's toy model: a fresh checkout has no outputs/toy-model)
    with socket.socket() as a, socket.socket() as b:  # two free ports: this node's, and a seed nobody serves
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        port, dead_seed = a.getsockname()[1], b.getsockname()[1]
    proc = subprocess.Popen(cmd + ["--role", "rollout", "--config", QUICKSTART, "--port", str(port), "--seeds",
                                   f"127.0.0.1:{dead_seed}", f"output_dir={tmp_path}", "mesh.join_timeout_s=120"],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # its control socket is bound: it is in the join (the signal handlers are set before)
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        time.sleep(0.5)  # well inside the 120 s join wait
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 143 and time.monotonic() - t0 < 10, err[-3000:]
        assert "stopping on signal while joining the mesh" in err and "Traceback" not in err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_node_names_a_bad_workflow_function_at_start_without_check(tmp_path, toy_model):
    """Every start resolves the workflow's functions (not only --check): a typo is named before the
    node joins anything, instead of failing its pipeline at step 1 (here: it would wait for peers)."""
    env = {**os.environ, "DISTFLOW_SECRET": "x" * 32}
    cmd = [sys.executable, "-c", "import sys; from distflow.launch.cli import node_main; sys.exit(node_main())",
           f"model_path={toy_model}"]  # (the suite's toy model: a fresh checkout has no outputs/toy-model)
    r = subprocess.run(cmd + ["--role", "rollout", "--config", QUICKSTART, f"output_dir={tmp_path}",
                              "workflow.1.fn=exact_matchh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "workflow node 'reward'" in r.stderr and "exact_match" in r.stderr, r.stderr[-2000:]
    # A node imports only its own pipeline's functions: a trainer host need not have the reward's package.
    custom = ["--config", QUICKSTART, f"output_dir={tmp_path}", "workflow.1.fn=absent_pkg.rewards:score", "--check"]
    trainer = subprocess.run(cmd + ["--role", "trainer", *custom], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=60)
    assert trainer.returncode == 0, trainer.stderr[-2000:]
    rollout = subprocess.run(cmd + ["--role", "rollout", *custom], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=60)
    assert rollout.returncode == 2 and "absent_pkg" in rollout.stderr, rollout.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.timeout(480)  # past the run's own 420 s, so a slow run fails with its stderr, not pytest's kill
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quickstart_learns_on_one_gpu(tmp_path, dtype):
    """The quickstart on one GPU: 1 trainer + 2 rollout nodes colocated on GPU 0 (NCCL trainer
    group, CUDA engine, CUDA IPC weight sync); it learns as on CPU (+0.3), fp32 and bf16."""
    out = tmp_path / "qs"
    r = run_distflow(["run", QUICKSTART, "--no-progress", f"output_dir={out}", f"model_path={tmp_path / 'toy'}",
                      "device=cuda", "gpus=1", "colocate=true", "trainer_nodes=1", f"dtype={dtype}"], timeout=420)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "placement: GPU 0: trainer-0, rollout-0, rollout-1" in r.stderr
    rewards = [m["reward_mean"] for m in read_metrics(out / "metrics.jsonl")]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"quickstart on GPU ({dtype}): first-10 {first:.3f}, last-10 {last:.3f}")
    assert last - first >= 0.3, (first, last)


# ---------------------------------------------------------------------- the quickstart, as shipped
# One run serves every assertion on it. `.ci/run` runs the README's command and shows it trains;
# this run adds what a console cannot assert: the metrics and eval rows, the per-node accounting
# (trace_samples, which changes no number), the checkpoint and the plots. The toy model is built by
# the run itself at model_path, as a user's first run builds it.
@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("quickstart") / "qs"
    t0 = time.monotonic()
    r = run_distflow(["run", QUICKSTART, "--no-progress", f"output_dir={out}", f"model_path={out.parent / 'toy'}",
                      "trace_samples=true"], timeout=420)
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    return {"out": out, "stderr": r.stderr, "elapsed": elapsed, "metrics": read_metrics(out / "metrics.jsonl")}


def test_quickstart_learns(quickstart):
    """The shipped example, as shipped: 100 steps, last-10 mean reward beats first-10 by >= 0.3."""
    rewards = [m["reward_mean"] for m in quickstart["metrics"]]
    assert len(rewards) == 100  # 3200 prompts / 32 per step, one epoch
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"quickstart: {len(rewards)} steps in {quickstart['elapsed']:.0f}s, first-10 {first:.3f}, last-10 {last:.3f}")
    assert last - first >= 0.3, (first, last)
    assert quickstart["elapsed"] < 300


def test_quickstart_metrics_rows_say_what_each_step_did(quickstart):
    metrics = quickstart["metrics"]
    assert [m["step"] for m in metrics] == list(range(100))
    assert [m["policy_version"] for m in metrics] == list(range(1, 101))
    for m in metrics:
        for key in ("reward_mean", "samples_per_s", "policy_version", "staleness_mean", "loss", "grad_norm"):
            assert key in m, key
        assert m["samples"] == 32 * 8
        assert 0.0 <= m["staleness_mean"] <= 1.0  # max_staleness: 1


def test_quickstart_evaluates_held_out_prompts(quickstart):
    """eval_every: 25: every point, every one of the 128 prompts, greedy, learning too."""
    evals = read_metrics(quickstart["out"] / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 25, 50, 75, 100], evals
    assert all((e["eval_samples"], e["eval_prompts"], e["eval_shards"]) == (128, 128, 2) for e in evals), evals
    # the first weights a node held at or past the point (max_staleness 1: at most one step past it)
    assert all(e["step"] <= e["policy_version_min"] <= e["policy_version_max"] <= e["step"] + 1 for e in evals), evals
    assert evals[0]["policy_version_max"] == 0 and evals[-1]["policy_version_min"] == 100, evals
    print("quickstart held-out eval:", [round(e["eval_reward_mean"], 3) for e in evals])
    assert evals[-1]["eval_reward_mean"] - evals[0]["eval_reward_mean"] >= 0.3, evals
    assert "held-out eval" in quickstart["stderr"]


def test_quickstart_accounts_for_every_sample(quickstart):
    """2 rollout x 2 trainer nodes: disjoint prompt shards covering the set, each trainer rank gets
    only the samples it owns, every sample trained exactly once, within max_staleness."""
    trace = read_trace(quickstart["out"])
    assert sorted(trace) == ["rollout-0", "rollout-1", "trainer-0", "trainer-1"]
    shards = [{p for rec in trace[f"rollout-{r}"] for p in rec["prompt_ids"]} for r in range(2)]
    assert not shards[0] & shards[1]
    assert shards[0] | shards[1] == {f"e0:{i}" for i in range(3200)}
    seen: Counter[str] = Counter()
    for rank in range(2):
        recs = trace[f"trainer-{rank}"]
        assert [rec["step"] for rec in recs] == list(range(100))
        for rec in recs:
            assert all(owner(s, 2) == rank for s in rec["sample_ids"])
            assert all(rec["step"] - v <= 1 for v in rec["policy_versions"])
            seen.update(rec["sample_ids"])
    assert set(seen.values()) == {1}
    assert set(seen) == {f"e0:{i}:s{j}" for i in range(3200) for j in range(8)}


def test_quickstart_leaves_a_hugging_face_checkpoint_plots_and_a_log_per_node(quickstart):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = quickstart["out"]
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint", local_files_only=True)
    AutoTokenizer.from_pretrained(out / "checkpoint", local_files_only=True)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert (out / "reward_curve.png").stat().st_size > 1000 and (out / "timings.png").stat().st_size > 1000
    assert sorted(p.name for p in (out / "logs").glob("*.log")) == [
        "rollout-0.log", "rollout-1.log", "trainer-0.log", "trainer-1.log"]


def test_single_controller_mode_gives_the_same_training_result(toy_model, toy_data, tmp_path):
    """`controller: single` routes every batch through one process; same seed, same result."""
    runs = {}
    for mode in ("distributed", "single"):
        out = tmp_path / mode
        r = run_distflow(small_run_args(toy_model, toy_data, out, f"controller={mode}", "max_staleness=0",
                                        "trace_samples=true"), timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[mode] = read_metrics(out / "metrics.jsonl")
    assert (tmp_path / "single" / "logs" / "controller-0.log").is_file()
    assert "forwarded 6 parts / 192 samples" in (tmp_path / "single" / "logs" / "controller-0.log").read_text()
    assert not (tmp_path / "distributed" / "logs" / "controller-0.log").exists()
    assert len(runs["single"]) == len(runs["distributed"]) == 3
    for a, b in zip(runs["distributed"], runs["single"]):
        for key in ("reward_mean", "loss", "grad_norm", "samples"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
