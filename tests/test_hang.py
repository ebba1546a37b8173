"""A trainer rank that hangs while the others wait in a collective is named within seconds and the
run recovers by itself: real `distflow run` processes, a real hang (tests/hang_fns.py).

trainer-1 sleeps inside its advantage estimator at its third step; trainer-0 goes on into the
update's collectives and waits there. trainer-1's progress counter (mesh meta ``beat``, moved
before each stage of the train half) stays behind trainer-0's, so after ``hang_timeout_s``
trainer-0 names it stuck and stops; `distflow run` restarts every trainer rank from the newest
checkpoint (docs/recovery.md), and the run ends with every prompt trained exactly once.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path

from distflow.trace import read_trace
from distflow.trainer.metrics import read_metrics
from tests.procs import run_pids
from tests.test_supervise import make_data, start_run

HANG_S = 4.0


def _hang_and_recover(tmp_path, toy_model, *extra: str, named: str = "trainer rank trainer-1 is stuck",
                      namers: tuple[str, ...] = ("trainer-0",)) -> tuple[float, str, str, Path]:
    """Run until trainer-1 writes its marker (it hangs), then until the log of one of ``namers`` names it
    (``named``: the phrase); the run
    must end by itself with every prompt trained exactly once. Returns (seconds from the hang to the
    name, the naming line, the run's stderr, its output dir)."""
    rows = 16
    out, marker = tmp_path / "run", tmp_path / "hung"
    proc = start_run(out, toy_model, make_data(tmp_path, rows), "trainer_nodes=2", "rollout_nodes=1", "save_every=1",
                     "save_interval_s=0", "eval_dataset=null", "eval_every=0", f"hang_timeout_s={HANG_S}",
                     *(e.replace("MARKER", str(marker)) for e in extra))
    try:
        deadline = time.monotonic() + 120
        while not marker.is_file():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "trainer-1 never reached its hang"
            time.sleep(0.05)
        hung_at = float(marker.read_text().split()[1])
        logs = [out / "logs" / f"{n}.log" for n in namers]
        while not any(named in log.read_text() for log in logs):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() - hung_at < HANG_S + 30, f"the hang was not named: {logs[0].read_text()[-2000:]}"
            time.sleep(0.05)
        named_after = time.time() - hung_at
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    assert HANG_S - 0.5 <= named_after < HANG_S + 10, named_after  # hang_timeout_s (from when trainer-0 saw it behind)
    steps = rows // 4
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == list(range(steps))
    trace = read_trace(out)
    trained = Counter(s for node in ("trainer-0", "trainer-1") for rec in trace[node] for s in rec["sample_ids"])
    assert set(trained) == {f"e0:{i}:s{j}" for i in range(rows) for j in range(2)}
    assert set(trained.values()) == {1}  # every sample trained exactly once
    assert not run_pids(out)
    line = next(ln for log in logs for ln in log.read_text().splitlines() if named in ln)
    return named_after, line, err, out


def test_a_rank_hung_in_its_own_stage_is_named_within_seconds_and_the_run_recovers(toy_model, tmp_path):
    _, line, err, _ = _hang_and_recover(tmp_path, toy_model, "workflow.2.fn=tests.hang_fns:grpo_hanging_once",
                                        "workflow.2.group=trainer", "workflow.2.args.marker=MARKER")
    assert "its progress stayed at step 2 (advantage" in line and "trainer-0 reached step 2 (update" in line, line
    assert "restarting the trainers from checkpoint step 2" in err, err[-3000:]


def test_a_rank_hung_between_the_models_collectives_is_named_by_its_collective_count(toy_model, tmp_path,
                                                                                      monkeypatch):
    """trainer-1 hangs in its policy loss (tests/hang_fns.py: after the forward's all-gathers, before the
    backward's); trainer-0 goes on into the backward's all-gathers and waits there, in the same stage
    (equal beats). Its collective count (mesh meta ``coll``) stays behind trainer-0's: named."""
    monkeypatch.setenv("HANG_MARKER", str(tmp_path / "hung"))
    _, line, err, _ = _hang_and_recover(tmp_path, toy_model, "workflow.4.fn=tests.hang_fns:loss_hanging_once")
    m = re.search(r"its progress stayed at step (\d+) \(update, after (\d+) collectives?\) for \d+s while "
                  r"trainer-0 reached step (\d+) \(update, after (\d+) collectives?\)", line)
    assert m, line
    step, behind, step0, ahead = map(int, m.groups())
    assert step == step0 and ahead > behind > 0, line
    assert f"restarting the trainers from checkpoint step {step}" in err, err[-3000:]


def test_a_rank_hung_inside_a_collective_every_rank_entered_is_named_as_that_collective(toy_model, tmp_path,
                                                                                       monkeypatch):
    """trainer-1 enters a collective in its policy loss and never leaves it (tests/hang_fns.py, as a hung
    kernel); trainer-0 waits in its backward's collective of the same index. Equal positions, so no
    rank is behind: after hang_timeout_s each rank's pending collective names the group as hung there (the
    first to say it stops the run; trainer-1's pending one is its own)."""
    monkeypatch.setenv("HANG_MARKER", str(tmp_path / "hung"))
    monkeypatch.setenv("HANG_INSIDE", "1")
    _, line, err, _ = _hang_and_recover(tmp_path, toy_model, "workflow.4.fn=tests.hang_fns:loss_hanging_once",
                                        named="the trainer group is hung in collective",
                                        namers=("trainer-0", "trainer-1"))  # (both see it; the first one stops the run)
    m = re.search(r"hung in collective (\d+) \((?:all_gather|reduce_scatter|all_reduce)(?:, [\d.]+ MiB)?\) of step "
                  r"(\d+) \(update\): every rank entered it \(trainer-0, trainer-1\) and it has not completed on "
                  r"trainer-[01] for \d+s", line)
    assert m, line
    assert f"restarting the trainers from checkpoint step {m.group(2)}" in err, err[-3000:]
