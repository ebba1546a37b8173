"""A user's mistakes around launching, each named in one line, never silently wrong (issue 41):

- another run's checkpoint in the same output_dir is never offered as this run's resume point;
- `distflow toy-model` / `toy-data` never overwrite what is there without --force;
- a node killed by a signal is reported with the signal's name and its last ERROR line (or none),
  on its own line, not glued onto the progress bar;
- a hand-started node names the command that builds a missing toy model, and one that cannot
  join names the seeds it tried and the deadline, in one line, exit 1.

Real processes where the process is the point (the CLI, `sh` children for the supervisor, one
real node that cannot join); functions otherwise.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distflow.core.config import Config
from tests.conftest import ROOT, run_distflow

QUICKSTART = "examples/grpo_quickstart.yaml"
NODE = [sys.executable, "-c", "import sys; from distflow.launch.cli import node_main; sys.exit(node_main())"]
NODE_ENV = {**os.environ, "DISTFLOW_SECRET": "x" * 32}


def stale_checkpoint(out: Path, age_s: float = 3600.0) -> Path:
    """A complete checkpoint (distflow_state.json) marked ``age_s`` ago: an earlier run's."""
    ckpt = out / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "distflow_state.json").write_text(json.dumps({"policy_version": 3}))
    then = time.time() - age_s
    os.utime(ckpt / "distflow_state.json", (then, then))
    return ckpt


# ----------------------------------------------------------------------------- 1. another run's checkpoint
def test_another_runs_checkpoint_is_never_offered_as_the_resume_point(tmp_path):
    from distflow.launch.checkpoint import newest_checkpoint, resume_hint

    out = tmp_path / "stale"
    ckpt = stale_checkpoint(out)
    started = time.time() - 60  # this run started a minute ago, the checkpoint is an hour old
    assert newest_checkpoint(out, since=started) is None
    assert resume_hint(out, None, started).endswith("restart from scratch")
    assert "resume_from=" not in resume_hint(out, None, started)
    assert resume_hint(out, None, started - 7200) == f"newest checkpoint {ckpt}: continue with resume_from={ckpt}"
    # a run that resumed from that checkpoint and saved nothing new offers it again, as what it resumed from
    assert resume_hint(out, str(ckpt), started).endswith(f"continue with resume_from={ckpt}")


@pytest.mark.cluster
def test_a_failed_run_does_not_offer_the_stale_checkpoint_of_its_output_dir(toy_model, toy_data, tmp_path):
    """`distflow run` in an output_dir that holds an earlier run's checkpoint, with a reward that
    raises: it stops naming the reward, and says it saved nothing, not "newest checkpoint ...:
    continue with resume_from=" that earlier run's checkpoint. The reward's module lies beside the
    config only: the nodes import it all the same (the config's directory is importable)."""
    (tmp_path / "buggy.py").write_text("def raises(response, row):\n    raise KeyError('oops')\n")
    config = tmp_path / "exp.yaml"  # beside buggy.py: its nodes import it with no PYTHONPATH set (item 9)
    config.write_text((ROOT / QUICKSTART).read_text())
    out = tmp_path / "run"
    ckpt = stale_checkpoint(out)
    r = subprocess.run([sys.executable, "-m", "distflow.launch.cli", "run", str(config), "--no-progress",
                        f"output_dir={out}", f"model_path={toy_model}", f"dataset={toy_data}", "toy_model=false",
                        "eval_dataset=null", "eval_every=0", "workflow.1.fn=buggy:raises"], cwd=ROOT,
                       capture_output=True, text=True, timeout=240,
                       env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, r.stderr[-3000:]
    assert "raised KeyError: 'oops'" in r.stderr
    assert f"resume_from={ckpt}" not in r.stderr and "newest checkpoint" not in r.stderr, r.stderr[-3000:]


# ----------------------------------------------------------------------------- 5. toy commands overwrite nothing
def test_toy_commands_refuse_a_non_empty_target_without_force(tmp_path):
    model = tmp_path / "real-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "real": true}')
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "mine"}\n')
    for args, target in ((["toy-model", str(model)], model), (["toy-data", str(data), "--rows", "4"], data)):
        r = run_distflow(args, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and f"'{target}'" in r.stderr and "--force" in r.stderr
    assert json.loads((model / "config.json").read_text())["real"] is True
    assert data.read_text() == '{"prompt": "mine"}\n'
    r = run_distflow(["toy-data", str(data), "--rows", "4", "--force"], timeout=60)
    assert r.returncode == 0 and len(data.read_text().splitlines()) == 4, r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_distflow(["toy-data", str(tmp_path / "new.jsonl"), "--rows", "2"], timeout=60).returncode == 0


# ----------------------------------------------------------------------------- 7. the cause of a node's death
def sh_child(tmp_path: Path, node_id: str, role: str, script: str, log_text: str = ""):
    from distflow.launch.children import Child, spawn

    log = tmp_path / f"{node_id}.log"
    log.write_text(log_text)
    with log.open("a") as f:
        proc = spawn(["sh", "-c", script], f, dict(os.environ))
    return Child(node_id, role, 0, proc, log, ["sh", "-c", script], dict(os.environ))


INFO = "2026-01-01 00:00:00,000 INFO [{0}] distflow.rollout: {0}: eval at step 25: 128 prompts\n"


def test_a_killed_node_is_reported_by_its_signal_not_its_last_info_line(tmp_path, capsys):
    from distflow.core.dag import GRPO_WORKFLOW
    from distflow.launch.children import error_line, exit_text
    from distflow.launch.launcher import supervise

    assert exit_text(-9) == "killed by SIGKILL" and exit_text(-15) == "killed by SIGTERM" and exit_text(1) == "exit 1"
    cfg = Config.model_validate(dict(model_path="m", dataset="d.jsonl", prompts_per_step=2, workflow=GRPO_WORKFLOW,
                                     output_dir=str(tmp_path), restarts=0))
    trainer = sh_child(tmp_path, "trainer-0", "trainer", "sleep 60")
    rollout = sh_child(tmp_path, "rollout-0", "rollout", "kill -9 $$", INFO.format("rollout-0"))
    assert supervise(cfg, [trainer, rollout], poll_s=0.05) == 1
    err = capsys.readouterr().err
    assert "rollout-0 failed (killed by SIGKILL): no ERROR line in its log" in err, err
    assert "eval at step 25" not in err.split("--- last lines of")[0]
    # with an ERROR record, that one is named
    log = tmp_path / "n.log"
    log.write_text(INFO.format("n") + "2026-01-01 00:00:01,000 ERROR [n] distflow: n: OSError: disk full\n"
                   + INFO.format("n"))
    assert error_line(log) == "n: OSError: disk full"


def test_a_death_report_is_never_glued_onto_the_progress_bar(tmp_path, monkeypatch):
    from distflow.launch.progress import Progress

    term = io.StringIO()
    monkeypatch.setattr(sys, "stderr", term)
    bar = Progress(tmp_path / "metrics.jsonl", enabled=True)
    bar.bar.update(3)
    bar.bar.refresh()
    bar.write("distflow: rollout-0 died (killed by SIGKILL): no ERROR line in its log")
    bar.close()
    text = term.getvalue()
    before = text[:text.index("distflow: rollout-0 died")]
    cleaned = before.replace("\x1b[A", "")  # (the cursor moves up to the status line)
    assert "training" in before and cleaned.endswith("\r"), repr(text)
    assert cleaned.rstrip("\r").split("\r")[-1].strip() == "", repr(before)  # the bar's line was cleared first


# ----------------------------------------------------------------------------- 8. hand-started nodes
def test_node_check_names_the_command_that_builds_a_missing_toy_model(tmp_path):
    missing = tmp_path / "toy"
    for role in ("rollout", "trainer"):
        r = subprocess.run(NODE + ["--role", role, "--config", QUICKSTART, f"output_dir={tmp_path}", "toy_model=true",
                                   f"model_path={missing}", "--check"], cwd=ROOT, env=NODE_ENV, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and "ok:" not in r.stdout, (r.stdout, r.stderr)
        assert r.stderr.startswith(f"distflow-node: model_path: '{missing}' does not exist")
        assert f"run `distflow toy-model {missing}` first" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_node_that_cannot_join_names_the_seeds_and_the_deadline_in_one_line(toy_model, tmp_path):
    r = subprocess.run(NODE + ["--role", "rollout", "--config", QUICKSTART, f"output_dir={tmp_path}",
                               "toy_model=false", f"model_path={toy_model}", "--seeds", "127.0.0.1:9",
                               "mesh.join_timeout_s=1"], cwd=ROOT, env=NODE_ENV, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and "127.0.0.1:9" in errors[0] and "mesh.join_timeout_s" in errors[0], r.stderr


def test_a_first_node_whose_group_never_forms_names_the_deadline_without_a_traceback(toy_model, tmp_path):
    r = subprocess.run(NODE + ["--role", "rollout", "--config", QUICKSTART, f"output_dir={tmp_path}",
                               "toy_model=false", f"model_path={toy_model}", "mesh.join_timeout_s=1"],
                       cwd=ROOT, env=NODE_ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and "mesh.join_timeout_s: 1" in errors[0] and "seeds tried: none" in errors[0], r.stderr


# ----------------------------------------------------------------------------- 10. a readable progress bar
ROW = {"step": 36, "total_steps": 100, "reward_mean": 0.5123, "generated_reward_mean": 0.5, "samples_per_s": 2048.0,
       "staleness_mean": 0.45, "bad_rows": 3, "time_generate_s": 1.2, "time_wait_s": 0.05, "time_update_s": 0.8,
       "tokens_per_s": 1234.0, "mfu": 0.031}


@pytest.mark.parametrize("columns, min_bar", [(80, 10), (160, 75)])
def test_the_progress_bar_stays_readable_at_80_and_160_columns(columns, min_bar):
    """The real tqdm format with a full row's figures: the bar keeps its width, the reward is on its
    line, and the other figures (samples/s, staleness, stage times) are on the status line above."""
    from tqdm import tqdm

    from distflow.launch.progress import BAR_FORMAT, bar_postfix, status_line

    line = tqdm.format_meter(37, 100, 12.3, ncols=columns, prefix="training", postfix=bar_postfix(ROW),
                             bar_format=BAR_FORMAT)
    assert len(line) <= columns and line.endswith(", reward 0.512 (gen 0.500)]"), line
    bar = line.split("|")[1]
    assert len(bar) >= min_bar, line
    status = status_line(ROW)
    assert status.startswith("step 37: 2048 samples/s, staleness 0.45, bad_rows 3 | gen 1.20s"), status
    assert "tok/s" in status, status


# ----------------------------------------------------------------------------- 9. validation gaps
def quickstart(toy_model: Path, tmp_path: Path, data: Path, *overrides: str):
    from distflow.core.config import load_config

    return load_config(ROOT / QUICKSTART, [f"output_dir={tmp_path / 'out'}", f"model_path={toy_model}",
                                           "toy_model=false", f"dataset={data}", "eval_dataset=null", "eval_every=0",
                                           "prompts_per_step=4", "shuffle=false", *overrides])


def test_a_list_prompt_without_chat_template_is_refused_at_start_naming_the_row(toy_model, tmp_path):
    from distflow.core.config import ConfigError
    from distflow.launch.preflight import check_dataset

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n"
                            for p in ["12=", ["a", "b"], "34=", "56="]))
    with pytest.raises(ConfigError, match=r"^dataset: .*d\.jsonl:2: key 'prompt' must be str, got list \(a list "
                                          r"of chat messages needs chat_template: true\)"):
        check_dataset(quickstart(toy_model, tmp_path, data))
    note = check_dataset(quickstart(toy_model, tmp_path, data, "bad_rows=skip"))
    assert note is not None and note.startswith("dataset: 1 of the 4 rows checked are bad and will be skipped")


def test_a_null_prompt_is_said_to_be_null(toy_model, tmp_path):
    from distflow.core.config import ConfigError
    from distflow.launch.preflight import check_dataset

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "12=", "answer": "3"}\n{"prompt": null, "answer": "3"}\n')
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: key 'prompt' is null"):
        check_dataset(quickstart(toy_model, tmp_path, data))


def test_a_parquet_file_without_the_prompt_column_lists_its_columns(toy_model, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from distflow.core.config import ConfigError
    from distflow.launch.preflight import check_dataset

    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["12=", "34="], "answer": ["3", "5"]}), data)
    with pytest.raises(ConfigError, match=r"^dataset: .*d\.parquet: no column 'prompt'; its columns: question, answer "
                                          r"\(prompt_key names the column holding the prompts, e\.g\. prompt_key: "
                                          r"question\)$"):
        check_dataset(quickstart(toy_model, tmp_path, data))


def test_resuming_a_finished_run_is_refused_at_start(toy_model, toy_data, tmp_path):
    from distflow.launch.checkpoint import data_order, mark_checkpoint

    cfg = quickstart(toy_model, tmp_path, toy_data, "max_steps=3")
    ckpt = tmp_path / "out" / "checkpoint"
    ckpt.mkdir(parents=True)
    mark_checkpoint(ckpt, {"policy_version": 3, "data_order": data_order(cfg, 48)})
    r = run_distflow(["run", QUICKSTART, "--no-progress", f"output_dir={tmp_path / 'out'}", f"model_path={toy_model}",
                      "toy_model=false", f"dataset={toy_data}", "eval_dataset=null", "eval_every=0",
                      "prompts_per_step=4", "shuffle=false", "max_steps=3", f"resume_from={ckpt}"], timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == (f"distflow run: resume_from: checkpoint {ckpt} is at step 3 "
                                                      f"of 3: nothing left to train (raise max_steps or epochs to "
                                                      f"train on)"), r.stderr


def test_a_known_key_of_another_framework_is_suggested():
    from distflow.core.config import ConfigError, load_config

    for wrong, right in (("learning_rate", "lr"), ("num_generations", "group_size")):
        with pytest.raises(ConfigError, match=f"{wrong}: unknown key \\(did you mean '{right}'\\?\\)"):
            load_config(ROOT / QUICKSTART, [f"{wrong}=1"])


@pytest.mark.cluster
def test_in_process_prints_steps_and_the_summary_and_imports_a_reward_beside_the_config(toy_model, toy_data,
                                                                                           tmp_path):
    """--in-process: the same step lines and final summary as `distflow run`; and a reward module beside
    the config is importable without PYTHONPATH (the config's directory is added)."""
    import yaml

    (tmp_path / "my_rewards.py").write_text("def half(response, row):\n    return 0.5\n")
    raw = yaml.safe_load((ROOT / QUICKSTART).read_text())
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "distflow.launch.cli", "run", str(config), "--in-process",
                        "--no-progress", f"output_dir={tmp_path / 'out'}", f"model_path={toy_model}",
                        "toy_model=false", f"dataset={toy_data}", "eval_dataset=null", "eval_every=0",
                        "trainer_nodes=1", "rollout_nodes=1", "prompts_per_step=4", "group_size=2",
                        "max_new_tokens=2", "max_steps=2", "workflow.1.fn=my_rewards:half"],
                       cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 1/2 reward=0.500" in r.stdout and "step 2/2 reward=0.500" in r.stdout, r.stdout
    assert "distflow: done. 2 steps, final reward 0.500" in r.stderr, r.stderr[-3000:]


# ----------------------------------------------------------------------------- 6. one dead trainer
def test_periodic_saves_by_time_by_default_keeping_only_the_newest(tmp_path):
    from distflow.core.config import load_config
    from distflow.launch.checkpoint import PeriodicSaves

    cfg = load_config(ROOT / QUICKSTART, [])
    assert cfg.save_every == 0 and 0 < cfg.save_interval_s <= 3600  # the default saves
    now = [0.0]
    saves = PeriodicSaves(cfg.model_copy(update={"save_interval_s": 60.0, "save_every": 4}), clock=lambda: now[0])
    assert not saves.due(1, 10)
    now[0] = 61.0
    assert saves.due(2, 10) and not saves.due(10, 10)  # never after the last step: the final checkpoint follows
    for step in (2, 3, 4, 5):
        (tmp_path / saves.name(step)).mkdir()
        saves.saved(tmp_path, step, remove=True)()  # (run once the checkpoint is complete)
    # 2 and 3 were time-based (each removed by the next); 4 is save_every's (kept); 5 time-based (newest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-5"]
    assert not saves.due(6, 10)  # the clock restarted at the last save
    saves.superseded(remove=True)()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]
    assert not PeriodicSaves(cfg.model_copy(update={"save_interval_s": 0.0}), clock=lambda: 1e9).due(3, 10)
    # a save that took 10 s spaces the next to 200 s at least: saving stays under 5% of the run
    now[0] = 0.0
    big = PeriodicSaves(cfg.model_copy(update={"save_interval_s": 60.0}), clock=lambda: now[0])
    now[0] = 100.0
    assert big.due(1, 10)
    now[0] = 110.0
    big.saved(tmp_path, 1, remove=False)
    now[0] = 250.0
    assert not big.due(2, 10)
    now[0] = 311.0
    assert big.due(3, 10)


@pytest.mark.cluster
def test_a_dead_trainer_leaves_a_checkpoint_and_the_plots_by_default(toy_model, tmp_path):
    """Two trainer ranks, no save_every: the time-based saves (here every 0.5 s; both ranks agree) leave a
    checkpoint to resume from when trainer-1 is killed (no automatic recovery here: recover_retries=0),
    and the failed run writes its plots."""
    from distflow.toy import make_toy_dataset
    from distflow.trainer.metrics import read_metrics
    from tests.procs import run_pids

    data = tmp_path / "data.jsonl"
    make_toy_dataset(data, 800, seed=5)
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "distflow.launch.cli", "run", QUICKSTART, "--no-progress",
                             f"output_dir={out}", f"model_path={toy_model}", f"dataset={data}", "toy_model=false",
                             "eval_dataset=null", "eval_every=0", "prompts_per_step=4", "group_size=2",
                             "max_new_tokens=2", "trainer_nodes=2", "rollout_nodes=1", "save_interval_s=0.5",
                             "recover_retries=0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("checkpoint-*/distflow_state.json")) or len(read_metrics(out / "metrics.jsonl")) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        pid = next(iter(run_pids(out, "trainer-1")))
        subprocess.run(["kill", "-9", str(pid)], check=True)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "trainer-1 failed (killed by SIGKILL)" in err and "restart from scratch" not in err
    hint = err.split("resume_from=", 1)[1].split()[0]
    assert Path(hint).name.startswith("checkpoint-") and (Path(hint) / "distflow_state.json").is_file(), err
    assert len(list(out.glob("checkpoint-*"))) <= 2  # the older time-based ones were removed (one may be mid-write)
    assert (out / "reward_curve.png").is_file() and (out / "timings.png").is_file(), err[-2000:]
