"""`distflow run` and `distflow-node` refuse what cannot work before any node starts, in one line
and exit 2; they stop on SIGTERM/SIGHUP like on Ctrl-C; their nodes do not outlive them.

Real processes throughout (the CLI as a subprocess, `sleep` children for the supervisor); one
real cluster run, for SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from distflow.core.config import Config, ConfigError, load_config, read_raw
from distflow.trainer.metrics import read_metrics
from tests.conftest import ROOT, run_distflow
from tests.procs import alive, run_pids

QUICKSTART = "examples/grpo_quickstart.yaml"
NODE = [sys.executable, "-c", "import sys; from distflow.launch.cli import node_main; sys.exit(node_main())"]
NODE_ENV = {**os.environ, "DISTFLOW_SECRET": "x" * 32}


def config(tmp_path: Path, toy_model: Path, data: Path | str, *overrides: str) -> Config:
    return load_config(ROOT / QUICKSTART, [f"output_dir={tmp_path / 'out'}", f"model_path={toy_model}",
                                           "toy_model=false", f"dataset={data}", *overrides])


def jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def good_rows(n: int) -> list[str]:
    return [json.dumps({"prompt": f"{i}=", "answer": str((i + 1) % 10)}) for i in range(n)]


# ----------------------------------------------------------------------------- before any node starts
@pytest.mark.parametrize("case, overrides, needle", [
    ("empty", [], "dataset: {data}: the prompt file has no rows"),
    ("malformed", [], "dataset: {data}:3: invalid JSON"),
    ("good", ["prompt_key=question"], "missing required key 'question'"),
    ("no_answer", [], "missing key 'answer', which reward 'successor' (workflow node 'reward') reads"),
    ("good", ["model_path={tmp}"], "model_path: '{tmp}' is not a Hugging Face model directory (no config.json)"),
    ("good", ["model_path={tmp}/notmodel"], "model_path: '{tmp}/notmodel' does not exist"),
    ("good", ["resume_from={tmp}/nope/checkpoint"], "resume_from '{tmp}/nope/checkpoint': no distflow_state.json"),
    ("good", ["prompt_key=question", "bad_rows=skip", "max_steps=2"],
     "every step would train on 0 samples (bad_rows: skip)"),
    ("good", ["bind_host=0.0.0.0"], "bind_host: 0.0.0.0 binds every interface"),
    ("good", ["bind_host=192.0.2.1"], "bind_host: cannot bind '192.0.2.1' on this machine"),  # TEST-NET-1: hung
    ("good", ["bind_host=no-such-host.invalid"], "bind_host: cannot bind 'no-such-host.invalid' on this machine"),
    ("good", ["output_dir={tmp}/afile"], "output_dir: '{tmp}/afile' is a file"),
    ("good", ["output_dir={tmp}/afile/run"], "output_dir: cannot create '{tmp}/afile/run/logs': '{tmp}/afile' is a file"),
    ("good", ["workflow.1.fn=exact_matchh"], "workflow node 'reward': unknown reward 'exact_matchh'"),
])
def test_prepare_refuses_inputs_that_cannot_work(toy_model, tmp_path, case, overrides, needle):
    """What the rollout or trainer nodes would fail on after start-up (and, restarted, fail on
    again) is named by prepare(), before anything is created in output_dir."""
    from distflow.launch.launcher import prepare

    rows = {"empty": [], "malformed": good_rows(2) + ['{"prompt": "1=", "answer": "2"'] + good_rows(5),
            "good": good_rows(64), "no_answer": good_rows(3) + [json.dumps({"prompt": "1="})]}[case]
    data = jsonl(tmp_path / "data.jsonl", rows)
    (tmp_path / "afile").write_text("x")
    subst = {"tmp": str(tmp_path), "data": str(data)}
    cfg = config(tmp_path, toy_model, data, "prompts_per_step=4", "shuffle=false",
                 *[o.format(**subst) for o in overrides])
    with pytest.raises(ConfigError) as e:
        prepare(cfg)
    assert needle.format(**subst) in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out" / "config.yaml").exists()


def test_prepare_counts_the_rows_bad_rows_skip_will_skip(toy_model, tmp_path, capsys):
    from distflow.launch.launcher import prepare

    data = jsonl(tmp_path / "data.jsonl", good_rows(6) + ["[1, 2]", json.dumps({"prompt": "3="})])
    prepare(config(tmp_path, toy_model, data, "prompts_per_step=4", "bad_rows=skip"))
    err = capsys.readouterr().err
    assert "dataset: 2 of the 8 rows checked are bad and will be skipped (bad_rows: skip)" in err, err
    assert (tmp_path / "out" / "config.yaml").is_file()


def test_prepare_checks_only_the_rows_the_run_reads(toy_model, tmp_path):
    """max_steps=1 of 4 rows a step (no shuffle): a bad row 6 is never read, so it is no error."""
    from distflow.launch.launcher import prepare

    data = jsonl(tmp_path / "data.jsonl", good_rows(5) + ["not json"] + good_rows(10))
    prepare(config(tmp_path, toy_model, data, "prompts_per_step=4", "shuffle=false", "max_steps=1"))
    with pytest.raises(ConfigError, match=r"data.jsonl:6: invalid JSON"):
        prepare(config(tmp_path, toy_model, data, "prompts_per_step=4", "shuffle=false", "max_steps=2"))


def test_distflow_run_refuses_before_any_node_in_one_line_exit_2(toy_model, tmp_path):
    """Through the CLI: one line `distflow run: ...`, exit 2, no node log; an unknown workflow
    function and an impossible placement too (they exited 1 with another prefix)."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for extra, needle in ((f"dataset={empty}", f"distflow run: dataset: {empty}: the prompt file has no rows"),
                          ("workflow.1.fn=exact_matchh", "distflow run: workflow node 'reward': unknown reward"),
                          ("lrr=1", "lrr: unknown key (did you mean 'lr'?)")):
        r = run_distflow(["run", QUICKSTART, "--no-progress", f"output_dir={tmp_path / 'out'}", "toy_model=false",
                          f"model_path={toy_model}", extra], timeout=60)
        assert r.returncode == 2, r.stderr
        assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not list((tmp_path / "out").glob("logs/*.log"))


def test_node_check_runs_the_input_checks_of_its_role(toy_model, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")

    def check(role: str, *overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run(NODE + ["--role", role, "--config", QUICKSTART, f"output_dir={tmp_path}",
                                      f"model_path={toy_model}", *overrides,
                                      "--check"], cwd=ROOT, env=NODE_ENV, capture_output=True, text=True, timeout=60)

    r = check("rollout", f"dataset={empty}")
    assert r.returncode == 2 and "distflow-node: dataset: " in r.stderr and "no rows" in r.stderr, r.stderr
    assert check("trainer", f"dataset={empty}").returncode == 0  # a trainer does not read the prompt set
    r = check("trainer", "toy_model=false", f"model_path={tmp_path}")
    assert r.returncode == 2 and "model_path:" in r.stderr, r.stderr
    r = check("rollout", "workflow.1.fn=exact_matchh")  # an unknown function: exit 2 as well (was 1)
    assert r.returncode == 2 and "distflow-node: workflow node 'reward'" in r.stderr, r.stderr


def test_a_node_whose_model_path_is_no_model_exits_2_in_one_line(tmp_path):
    """A hand-started rollout or trainer node (no --check) whose model_path is no model directory
    exits 2 at start, in one line naming model_path: a configuration error, which `distflow run`
    does not restart. Before, the engine raised FileNotFoundError once the groups had formed (or
    the join timed out first): exit 1 and a traceback. The engine's own check raises the same
    configuration error (ModelDirError), should the directory go away after the start."""
    from distflow.hf import ModelDirError
    from distflow.rollout.protocol import check_model_dir

    missing = tmp_path / "nomodel"
    for role in ("rollout", "trainer"):
        r = subprocess.run(NODE + ["--role", role, "--config", QUICKSTART, f"output_dir={tmp_path}", "toy_model=false",
                                   f"model_path={missing}"], cwd=ROOT, env=NODE_ENV, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert r.stderr.startswith(f"distflow-node: model_path: '{missing}' does not exist (models load from local")
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    with pytest.raises(ModelDirError, match=f"model_path: '{missing}' does not exist"):
        check_model_dir(missing)


def test_node_ports_must_be_ports():
    for flag in ("--port", "--data-port"):
        r = subprocess.run(NODE + ["--role", "rollout", "--config", QUICKSTART, flag, "99999", "--check"], cwd=ROOT,
                           env=NODE_ENV, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "99999 is not a port (0-65535" in r.stderr and "ok:" not in r.stdout, r.stderr


def test_toy_commands_refuse_unusable_paths_in_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for args, needle in ((["toy-model", str(afile)], f"distflow toy-model: '{afile}' is a file"),
                         (["toy-data", str(tmp_path)], f"distflow toy-data: '{tmp_path}' is a directory"),
                         (["toy-data", str(afile / "t.jsonl")], f"distflow toy-data: '{afile}' is a file"),
                         (["toy-data", str(tmp_path / "t.jsonl"), "--rows", "-3"], "-3: must be at least 1")):
        r = run_distflow(args, timeout=60)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert not (tmp_path / "t.jsonl").exists()


# ----------------------------------------------------------------------------- supervision
def sleeper(tmp_path: Path, node_id: str, role: str, cmd: list[str]):
    from distflow.launch.children import Child, spawn

    log = tmp_path / f"{node_id}.log"
    with log.open("w") as f:
        proc = spawn(cmd, f, dict(os.environ))
    return Child(node_id, role, 0, proc, log, cmd, dict(os.environ))


def test_a_node_that_exits_2_is_not_restarted_and_the_run_stops_naming_it(tmp_path, capsys):
    """Exit 2 is a node's configuration or data error: a restart (and the nodes adopting its
    shard) would fail the same way. Before, it was restarted `restarts` times ("its shard is
    adopted by the other rollout nodes") and the run ended with exit 1."""
    from distflow.core.dag import GRPO_WORKFLOW
    from distflow.launch.launcher import supervise

    cfg = Config.model_validate(dict(model_path="m", dataset="d.jsonl", prompts_per_step=2, workflow=GRPO_WORKFLOW,
                                     output_dir=str(tmp_path), restarts=3))
    line = "2026-01-01 00:00:00,000 ERROR [rollout-0] distflow: rollout-0: DatasetError: d.jsonl:5: invalid JSON"
    rollout = sleeper(tmp_path, "rollout-0", "rollout", ["sh", "-c", f"echo '{line}'; exit 2"])
    trainer = sleeper(tmp_path, "trainer-0", "trainer", ["sleep", "60"])
    t0 = time.monotonic()
    code = supervise(cfg, [trainer, rollout], poll_s=0.05)
    err = capsys.readouterr().err
    assert code == 2 and rollout.restarts == 0, err
    assert "rollout-0 failed (exit 2): rollout-0: DatasetError: d.jsonl:5: invalid JSON" in err
    assert "not restarted" in err and "restarting it" not in err
    assert trainer.proc.poll() is not None and time.monotonic() - t0 < 10


def test_node_exit_status_of_configuration_and_data_errors():
    from distflow.buffer.dataloader import DatasetError
    from distflow.launch.node import exit_code_of
    from distflow.hf import ModelDirError

    for e in (DatasetError("d.jsonl:3: invalid JSON"), ConfigError("x"), ModelDirError("model_path 'm'")):
        assert exit_code_of(e) == 2
    assert exit_code_of(RuntimeError("boom")) == 1 and exit_code_of(FileNotFoundError("f")) == 1


def test_error_line_falls_back_to_the_last_line_of_the_log(tmp_path):
    """A node refused before its logging was set up logs no ERROR record: its own last line is named."""
    from distflow.launch.children import error_line

    log = tmp_path / "n.log"
    log.write_text("distflow-node: --host 0.0.0.0 binds every interface; add --advertise-host ADDR\n\n")
    assert error_line(log) == "distflow-node: --host 0.0.0.0 binds every interface; add --advertise-host ADDR"
    log.write_text("x INFO [n] a: up\n2026 ERROR [n] distflow: n: ValueError: bad\ntail\n")
    assert error_line(log) == "n: ValueError: bad"


def test_resume_hint_names_only_checkpoints(tmp_path):
    from distflow.launch.checkpoint import resume_hint

    assert "resume_from=nope/checkpoint" not in resume_hint(tmp_path, "nope/checkpoint")
    ckpt = tmp_path / "old" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "distflow_state.json").write_text('{"policy_version": 3}')
    assert resume_hint(tmp_path / "new", str(ckpt)).endswith(f"resume_from={ckpt}")


def test_progress_shows_bad_rows_and_warns_of_steps_without_samples(tmp_path, capsys):
    from distflow.launch.progress import Progress

    metrics = tmp_path / "metrics.jsonl"
    row = dict(step=0, total_steps=2, reward_mean=0.0, samples=0, samples_per_s=0.0, staleness_mean=0.0, bad_rows=32)
    metrics.write_text(json.dumps(row) + "\n" + json.dumps({**row, "step": 1, "samples": 8, "bad_rows": 3}) + "\n")
    bar = Progress(metrics, enabled=False)
    bar.poll()
    out, err = capsys.readouterr()
    assert "step 1/2 " in out and "bad_rows=32" in out and "bad_rows=3" in out
    assert "WARNING: step 1 trained on 0 samples" in err and "step 2 trained" not in err
    assert bar.summary() == "; 35 bad rows skipped (bad_rows: skip); WARNING: 1 step(s) trained on 0 samples " \
                            "(every row bad)"


# ----------------------------------------------------------------------------- signals
def test_interrupt_before_the_first_step_stops_every_node_at_once(tmp_path, monkeypatch, capsys):
    """No step completed: nothing to checkpoint, and trainers still forming their group would
    wait for the stopped rollout nodes until join_timeout_s. Every node stops at once instead
    of the trainers getting step_timeout_s. Real `sleep` children: a trainer that never exits
    by itself."""
    import distflow.launch.launcher as launcher
    import distflow.launch.placement as placement
    from distflow.core.dag import GRPO_WORKFLOW

    cfg = Config.model_validate(dict(model_path="m", dataset="d.jsonl", prompts_per_step=2, workflow=GRPO_WORKFLOW,
                                     output_dir=str(tmp_path), step_timeout_s=20))
    kids = []

    def start(*_):
        kids.extend(sleeper(tmp_path, n, r, ["sleep", "60"]) for n, r in (("trainer-0", "trainer"),
                                                                         ("rollout-0", "rollout")))
        return kids

    def supervise(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "prepare", lambda cfg: tmp_path / "config.yaml")
    monkeypatch.setattr(launcher, "plan_placement", lambda cfg: [])
    monkeypatch.setattr(launcher, "start_children", start)
    monkeypatch.setattr(launcher, "supervise", supervise)
    monkeypatch.setattr(placement, "describe", lambda p: "test placement")
    t0 = time.monotonic()
    try:
        assert launcher.launch(cfg, progress=False) == 130
        assert time.monotonic() - t0 < 10, "waited for the trainer as if it had a step to save"
        assert [k.proc.poll() for k in kids] == [-signal.SIGTERM] * 2
        assert "before the first step completed" in capsys.readouterr().err
    finally:
        for k in kids:
            if k.proc.poll() is None:
                k.proc.kill()


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_nodes_die_with_a_launcher_killed_by_sigkill(tmp_path):
    """A launcher that cannot stop its nodes (SIGKILL, the OOM killer) still leaves none behind:
    the kernel sends each SIGTERM (nodes run in sessions of their own, so nothing else would). The
    node asks for it itself, first thing (die_with_launcher, as distflow-node does); before, the
    launcher set it in a preexec_fn, which can deadlock the fork of a launcher with threads."""
    marker = tmp_path / "got"
    node = ("import os, signal, sys, time; from distflow.launch.children import die_with_launcher; "
            "die_with_launcher(); "
            f"signal.signal(signal.SIGTERM, lambda *_: (open({str(marker)!r}, 'w').write('SIGTERM'), os._exit(0))); "
            "print('up', flush=True); time.sleep(60)")
    log = str(tmp_path / "node.log")
    code = ("import os, sys, time; from distflow.launch.children import spawn; "
            f"p = spawn([sys.executable, '-c', {node!r}], open({log!r}, 'w'), dict(os.environ)); "
            "print(p.pid, flush=True); time.sleep(60)")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(launcher.stdout.readline())
        wait_for(lambda: "up" in (tmp_path / "node.log").read_text() or not alive(child), 30, "node start-up")
        assert alive(child), (tmp_path / "node.log").read_text()
        launcher.kill()
        launcher.wait(timeout=10)
        wait_for(lambda: not alive(child), 5, "exit of the node")
        assert marker.read_text() == "SIGTERM"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)


def test_spawn_passes_its_pid_to_the_node_and_no_preexec_fn(monkeypatch):
    """The launcher's pid goes to the node in its environment (from the main thread only: the
    signal follows the thread that forked), never through a preexec_fn."""
    import threading

    import distflow.launch.children as children

    calls = []
    monkeypatch.setattr(children.subprocess, "Popen", lambda cmd, **kw: calls.append(kw))
    children.spawn(["true"], None, {"A": "1"})
    thread = threading.Thread(target=children.spawn, args=(["true"], None, {children.LAUNCHER_PID_ENV: "7"}))
    thread.start()
    thread.join(timeout=10)
    assert [sorted(kw) for kw in calls] == [["env", "start_new_session", "stderr", "stdout"]] * 2
    assert calls[0]["env"] == {"A": "1", children.LAUNCHER_PID_ENV: str(os.getpid())}
    assert calls[1]["env"] == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_node_whose_launcher_died_before_it_started_exits_at_once(toy_model):
    """The launcher died between the fork and the node's prctl: no SIGTERM would come, so the node
    (its parent no longer the launcher) exits first thing; a node of a live launcher goes on."""
    def node(launcher_pid: int) -> subprocess.CompletedProcess:
        return subprocess.run(NODE + ["--role", "rollout", "--config", QUICKSTART, "--check",
                                      f"model_path={toy_model}"], cwd=ROOT,
                              env={**NODE_ENV, "DISTFLOW_LAUNCHER_PID": str(launcher_pid)}, capture_output=True,
                              text=True, timeout=60)

    gone = node(2 ** 22 + 1)  # above any pid_max: no process
    assert gone.returncode == 143 and "launcher (pid 4194305) is gone" in gone.stderr, gone.stderr
    assert "ok:" not in gone.stdout
    assert node(os.getpid()).returncode == 0  # its parent: this test


def signal_and_wait(proc: subprocess.Popen, sig: int) -> tuple[str, float]:
    """Send ``sig`` to a running `distflow run` and wait for it to exit (60 s at most): (stderr, seconds)."""
    proc.send_signal(sig)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    return err, time.monotonic() - t0


def stop_after_first_step(toy_model: Path, tmp_path: Path, sig: str, *extra: str):
    """Run the quickstart (small steps) with `distflow run`, send ``sig`` once its first step is in
    metrics.jsonl, and check that the run stopped as on Ctrl-C: exit 128 + the signal within 15 s,
    the trainers' last completed step saved and named. Returns stderr and the node processes
    seen before the signal."""
    from distflow.toy import make_toy_dataset

    data = tmp_path / "data.jsonl"
    make_toy_dataset(data, 800, seed=2)
    out = tmp_path / "run"
    args = ["run", QUICKSTART, "--no-progress", f"output_dir={out}", f"model_path={toy_model}", f"dataset={data}",
            "toy_model=false", "prompts_per_step=4", "group_size=2", "max_new_tokens=2", *extra]
    proc = subprocess.Popen([sys.executable, "-m", "distflow.launch.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: read_metrics(out / "metrics.jsonl") or proc.poll() is not None, 90, "first step")
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        nodes = run_pids(out, skip_zombies=True)
        err, took = signal_and_wait(proc, getattr(signal, sig))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + getattr(signal, sig), err[-3000:]
    assert took < 15, f"stopped {took:.1f}s after {sig}"
    assert f"interrupted ({sig})" in err and "Traceback" not in err, err[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    state = json.loads((out / "checkpoint" / "distflow_state.json").read_text())
    assert state["policy_version"] == state["step"] == len(rows) < 200  # the last completed step
    assert f"resume_from={out / 'checkpoint'}" in err
    return err, nodes


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_in_process_run_stops_on_sigterm_like_ctrl_c(toy_model, tmp_path, sig):
    """`distflow run --in-process` stops on SIGTERM and SIGHUP as `distflow run` does: the rollout
    nodes leave, the trainer saves its last completed step, exit 128 + the signal, bounded. Before,
    SIGTERM exited 130 and SIGHUP (like SIGTERM during start-up) killed the process with no word."""
    stop_after_first_step(toy_model, tmp_path, sig, "--in-process", "trainer_nodes=1")


def test_sigterm_stops_a_run_like_ctrl_c_with_a_checkpoint(toy_model, tmp_path):
    """`timeout N distflow run ...`, a scheduler's stop, a closed terminal: SIGTERM (or SIGHUP) to
    the launcher stops the cluster as Ctrl-C does (the trainers save their last completed step),
    exit 143. Before, the launcher died at once and its 4 nodes trained on, detached."""
    _, nodes = stop_after_first_step(toy_model, tmp_path, "SIGTERM")
    assert len(nodes) == 4
    assert not [pid for pid in nodes if alive(pid)] and not run_pids(tmp_path / "run", skip_zombies=True)


def test_in_process_interrupt_before_the_first_step_saves_nothing_and_stops_at_once(toy_model, tmp_path):
    """As `distflow run`: a stop before any step completed has nothing to save, so every node stops at
    once (before, --in-process gave the trainer its step_timeout_s and saved the untrained model as a
    step-0 checkpoint). The first step is held up in a reward that blocks (its first call marks a file)."""
    (tmp_path / "slow_reward.py").write_text(textwrap.dedent(f"""
        import pathlib, time
        def reward(text, row, **kw):
            pathlib.Path({str(tmp_path / "scoring")!r}).touch()
            time.sleep(60)
            return 0.0
    """))
    cfg = read_raw(ROOT / QUICKSTART)
    for n in cfg["workflow"]:
        if n["role"] == "REWARD":
            n["fn"] = "slow_reward:reward"
    out = tmp_path / "run"
    cfg.update(output_dir=str(out), model_path=str(toy_model), toy_model=False, trainer_nodes=1, eval_dataset=None,
               eval_every=0)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "distflow.launch.cli", "run", str(tmp_path / "cfg.yaml"), "--no-progress",
                             "--in-process"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"})
    try:
        wait_for(lambda: (tmp_path / "scoring").exists() or proc.poll() is not None, 90, "the first reward call")
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        err, took = signal_and_wait(proc, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "before the first step completed (nothing to save)" in err, err[-3000:]
    assert not (out / "checkpoint").exists() and took < 15, (took, err[-2000:])
