"""`distflow run` supervises its children like torchrun: real processes, real kill -9.

- a rollout child killed mid-run: its shard is adopted by the other rollout node, the
  launcher restarts it with the same id and ports, the run completes (exit 0) and every
  sample of the epoch is trained exactly once;
- a trainer child killed mid-run without ``recover_retries`` (its recovery: tests/test_recovery.py):
  every node stops promptly (not after step_timeout_s),
  exit 1, and the message names the dead node and the newest checkpoint to resume from;
  the surviving trainer names the dead rank too, not the transport error.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from distflow.core.config import read_raw
from distflow.trace import read_trace
from distflow.trainer.metrics import read_metrics
from tests.conftest import ROOT
from tests.procs import run_pids

QUICKSTART = "examples/grpo_quickstart.yaml"


def node_pid(out: Path, node_id: str) -> int | None:
    """PID of the live node process of this run with this id."""
    return next(iter(run_pids(out, node_id)), None)




def start_run(out: Path, toy_model: Path, data: Path, *extra: str) -> subprocess.Popen:
    args = ["run", QUICKSTART, "--no-progress", f"output_dir={out}", f"model_path={toy_model}", f"dataset={data}",
            "toy_model=false", "prompts_per_step=4", "group_size=2", "max_new_tokens=2", "trace_samples=true",
            "step_timeout_s=600", *extra]
    return subprocess.Popen([sys.executable, "-m", "distflow.launch.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_rows(proc: subprocess.Popen, metrics: Path, n: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while len(read_metrics(metrics)) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"fewer than {n} steps after {timeout}s"
        time.sleep(0.1)
    return len(read_metrics(metrics))


def kill_node_midrun(proc: subprocess.Popen, out: Path, node_id: str, after_rows: int = 3) -> str:
    """Once the run has ``after_rows`` metrics rows, SIGKILL ``node_id``; wait for the run to end
    (its return code is then ``proc.returncode``) and return its stderr."""
    try:
        wait_rows(proc, out / "metrics.jsonl", after_rows)
        pid = node_pid(out, node_id)
        assert pid is not None, f"no pid for {node_id}"
        subprocess.run(["kill", "-9", str(pid)], check=True)
        return proc.communicate(timeout=240)[1]
    finally:
        if proc.poll() is None:
            proc.kill()


def make_data(tmp_path: Path, rows: int) -> Path:
    from distflow.toy import make_toy_dataset

    data = tmp_path / "data.jsonl"
    make_toy_dataset(data, rows, seed=5)
    return data


def test_killed_rollout_child_is_restarted_and_the_run_completes(toy_model, tmp_path):
    rows = 240
    out = tmp_path / "run"
    proc = start_run(out, toy_model, make_data(tmp_path, rows), "trainer_nodes=1", "rollout_nodes=2")
    err = kill_node_midrun(proc, out, "rollout-1")
    assert proc.returncode == 0, err[-3000:]
    assert "rollout-1 died (killed by SIGKILL)" in err
    assert "restarting it with the same id and ports (restart 1 of 3)" in err
    log1 = (out / "logs" / "rollout-1.log").read_text()
    assert "----- distflow run: restart 1 of rollout-1 -----" in log1
    steps = rows // 4
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == list(range(steps))
    trace = read_trace(out)
    trained = Counter(s for rec in trace["trainer-0"] for s in rec["sample_ids"])
    assert set(trained.values()) == {1}  # every sample trained exactly once
    assert set(trained) == {f"e0:{i}:s{j}" for i in range(rows) for j in range(2)}
    # the restarted rollout-1 appended to its trace: the steps of its first life are still there
    first_life = [rec["step"] for rec in trace["rollout-1"] if rec["step"] < 3]
    assert first_life and max(rec["step"] for rec in trace["rollout-1"]) > 3
    assert not run_pids(out)


def test_killed_trainer_stops_every_node_naming_it_and_the_checkpoint(toy_model, tmp_path):
    out = tmp_path / "run"
    proc = start_run(out, toy_model, make_data(tmp_path, 800), "trainer_nodes=2", "rollout_nodes=2",
                     "save_every=2", "recover_retries=0")  # (recovery: tests/test_recovery.py)
    try:
        wait_rows(proc, out / "metrics.jsonl", 3)
        deadline = time.monotonic() + 60  # a checkpoint to name (saved at step 2 by both ranks)
        while not (out / "checkpoint-2" / "distflow_state.json").is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        pid = node_pid(out, "trainer-1")
        subprocess.run(["kill", "-9", str(pid)], check=True)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=120)
        stopped_in = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "trainer-1 failed (killed by SIGKILL)" in err
    assert "trainer trainer-1 died, the run cannot go on without it" in err
    assert "resume_from=" in err and "checkpoint-" in err.split("resume_from=", 1)[1].split()[0]
    assert not run_pids(out)  # every node stopped, by the launcher
    print(f"every node stopped {stopped_in:.1f}s after the kill")
    # The surviving rank's own account names the dead rank, not a transport error.
    log0 = (out / "logs" / "trainer-0.log").read_text()
    assert "trainer rank trainer-1 died" in log0, log0[-3000:]


@pytest.mark.parametrize("controller", ["distributed", "single"])
def test_rollout_nodes_stop_promptly_when_the_trainer_dies_on_a_hand_started_cluster(toy_model, tmp_path, controller):
    """No launcher to stop them: the rollout nodes see the trainer dead in the mesh (while they
    still reach each other, so they are not the ones cut off) and stop within seconds, not
    after step_timeout_s (600 s here), naming the dead trainer. So does a stage worker (here
    the single controller): exit 1 naming the trainer, not "done" (exit 0) at its first sight
    of a dead trainer."""
    import os

    import yaml

    from distflow.core.auth import new_secret
    from distflow.launch.children import free_ports
    from tests.test_elastic import start

    raw = read_raw(ROOT / QUICKSTART)
    raw.update(output_dir=str(tmp_path / "out"), model_path=str(toy_model), toy_model=False,
               dataset=str(make_data(tmp_path, 800)), rollout_nodes=2, trainer_nodes=1, prompts_per_step=4,
               group_size=2, max_new_tokens=2, step_timeout_s=600, controller=controller)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**os.environ, "DISTFLOW_SECRET": new_secret(), "PYTHONUNBUFFERED": "1"}
    ports = free_ports("127.0.0.1", 4)
    seed = f"127.0.0.1:{ports[0]}"
    procs = {"trainer-0": start("trainer-0", "trainer", cfg, ports[0], "", env, logs)}
    for i in range(2):
        procs[f"rollout-{i}"] = start(f"rollout-{i}", "rollout", cfg, ports[1 + i], seed, env, logs)
    if controller == "single":
        procs["controller-0"] = start("controller-0", "controller", cfg, ports[3], seed, env, logs)
    feeders = [i for i in procs if i != "trainer-0"]
    try:
        deadline = time.monotonic() + 120
        while len(read_metrics(tmp_path / "out" / "metrics.jsonl")) < 2:
            assert procs["trainer-0"].poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        procs["trainer-0"].send_signal(signal.SIGKILL)
        codes = {i: procs[i].wait(timeout=60) for i in feeders}  # not step_timeout_s
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    assert codes == dict.fromkeys(feeders, 1)
    for i in feeders:
        assert "trainer trainer-0 died" in (logs / f"{i}.log").read_text(), (logs / f"{i}.log").read_text()[-2000:]


def test_a_healing_node_does_not_take_a_peer_back_before_the_trainer_for_its_death():
    """The partition case (tests/test_multihost.py): a cut-off rollout node saw every peer
    die; on healing they reappear one by one. The first one back is no evidence the trainer
    died while it stayed reachable: it counts only after settling. A peer alive all along, or
    one that announced its leave, is evidence at once."""
    from distflow.core.mesh import Member
    from distflow.runtime import not_cut_off_witness

    def member(node_id: str, state: str, since: float) -> Member:
        return Member(node_id, "rollout", "127.0.0.1", 1, state, 1, {}, since, 0.0, since)

    dead_at, settle = 100.0, 12.0
    back = member("rollout-h2", "alive", 105.0)  # declared dead at ~100, alive again at 105
    assert not_cut_off_witness([back], dead_at, now=106.0, settle_s=settle) is None
    assert not_cut_off_witness([back], dead_at, now=116.9, settle_s=settle) is None
    assert not_cut_off_witness([back], dead_at, now=117.0, settle_s=settle) == "rollout-h2"
    assert not_cut_off_witness([member("r", "alive", 99.0)], dead_at, 101.0, settle) == "r"  # alive all along
    assert not_cut_off_witness([member("r", "alive", 100.0)], dead_at, 101.0, settle) == "r"
    assert not_cut_off_witness([member("r", "left", 104.0)], dead_at, 104.5, settle) == "r"
    assert not_cut_off_witness([member("r", "suspect", 90.0)], dead_at, 200.0, settle) is None  # unreachable
    assert not_cut_off_witness([member("r", "dead", 90.0), back], dead_at, 106.0, settle) is None


def test_a_failing_launcher_stops_its_children_instead_of_leaving_them_detached(tmp_path, monkeypatch):
    """Children run in their own sessions, so a launcher that raises (not Ctrl-C) must stop them itself."""
    import distflow.launch.launcher as launcher
    import distflow.launch.placement as placement
    from distflow.core.config import config_from_dict
    from distflow.core.dag import GRPO_WORKFLOW

    cfg = config_from_dict(dict(model_path="m", dataset="d.jsonl", prompts_per_step=2, workflow=GRPO_WORKFLOW,
                                output_dir=str(tmp_path)))
    kids: list[launcher.Child] = []

    def start(*_):
        for i in range(2):
            p = subprocess.Popen(["sleep", "60"], start_new_session=True)
            kids.append(launcher.Child(f"rollout-{i}", "rollout", 1, p, tmp_path / f"{i}.log"))
        return kids

    def supervise(*_):
        raise OSError("EMFILE while restarting a node")

    monkeypatch.setattr(launcher, "prepare", lambda cfg: tmp_path / "config.yaml")
    monkeypatch.setattr(launcher, "plan_placement", lambda cfg: [])
    monkeypatch.setattr(launcher, "start_children", start)
    monkeypatch.setattr(launcher, "supervise", supervise)
    monkeypatch.setattr(placement, "describe", lambda p: "test placement")
    try:
        with pytest.raises(OSError, match="EMFILE"):
            launcher.launch(cfg, progress=False)
        assert len(kids) == 2 and [k.proc.poll() for k in kids] == [-signal.SIGTERM] * 2
    finally:
        for k in kids:
            if k.proc.poll() is None:
                k.proc.kill()
