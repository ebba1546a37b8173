"""`distflow run` recovers a dead trainer rank by itself: real processes, a real kill -9.

Every trainer rank is restarted from the newest complete checkpoint while the rollout nodes
keep running; they go back to the checkpoint's step, take its weights and generate the later
steps again. Counted by sample id in the trainers' traces (which, like metrics.jsonl, keep only
what the final weights were trained on), every prompt of the epoch is trained exactly once.
"""

from __future__ import annotations

import subprocess
import time
from collections import Counter

from distflow.launch.checkpoint import checkpoint_version
from distflow.trace import read_trace
from distflow.trainer.metrics import read_metrics
from tests.procs import run_pids
from tests.test_supervise import make_data, node_pid, start_run


def test_killed_trainer_rank_is_recovered_from_the_checkpoint_and_every_prompt_trained_once(toy_model, tmp_path):
    rows, per_step = 40, 4
    out = tmp_path / "run"
    proc = start_run(out, toy_model, make_data(tmp_path, rows), "trainer_nodes=2", "rollout_nodes=2",
                     "save_every=2", "save_interval_s=0", "eval_dataset=null", "eval_every=0", "max_staleness=1")
    try:
        deadline = time.monotonic() + 60
        while not (out / "checkpoint-2" / "distflow_state.json").is_file():
            assert time.monotonic() < deadline, "no checkpoint-2"
            time.sleep(0.05)
        subprocess.run(["kill", "-9", str(node_pid(out, "trainer-1"))], check=True)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    assert "trainer-1 died (killed by SIGKILL)" in err, err[-3000:]
    line = next(ln for ln in err.splitlines() if "restarting the trainers from checkpoint step" in ln)
    assert "(attempt 1/3)" in line and "the rollout nodes keep running" in line
    step = int(line.split("checkpoint step ")[1].split()[0])
    assert step >= 2
    steps = rows // per_step
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == list(range(steps))
    trace = read_trace(out)
    trained = Counter(s for node in ("trainer-0", "trainer-1") for rec in trace[node] for s in rec["sample_ids"])
    assert set(trained) == {f"e0:{i}:s{j}" for i in range(rows) for j in range(2)}
    assert set(trained.values()) == {1}  # every sample trained exactly once, none lost, none twice
    # the versions went back with the weights: each step trained on samples of the checkpoint's lineage,
    # never of the lost steps' weights (those would be newer than the step), within max_staleness
    for node in ("trainer-0", "trainer-1"):
        for rec in trace[node]:
            assert all(rec["step"] - 1 <= v <= rec["step"] for v in rec["policy_versions"]), rec
    # the rollout nodes were not restarted: one life each, and they generated the steps after the checkpoint again
    for r in ("rollout-0", "rollout-1"):
        assert "distflow run: restart" not in (out / "logs" / f"{r}.log").read_text()
    log0 = (out / "logs" / "rollout-0.log").read_text()
    assert f"the trainers restarted from the checkpoint of step {step}" in log0, log0[-3000:]
    assert "distflow run: recovery 1 of 3: trainer-0 from" in (out / "logs" / "trainer-0.log").read_text()
    assert checkpoint_version(out / "checkpoint") == steps
    assert not run_pids(out)


def test_the_weight_inbox_takes_a_restarted_trainers_older_version_and_drops_its_dead_lifes_messages():
    """A trainer restarted from a checkpoint publishes the checkpoint's version, older than what
    the rollout node holds: the inbox takes it (its sender's life is newer), and a late message
    of the dead life (an older life) is dropped, not taken for the newest weights."""
    import asyncio

    import torch

    from distflow.transport import Envelope
    from distflow.weights import WeightInbox

    async def version(inbox: WeightInbox, v: int, life: int) -> None:
        meta = {"version": v, "base": None, "send": 1, "life": life}
        await inbox.receive(Envelope("trainer-0", "weights", {**meta, "bucket": 0}, {"w": torch.full((2,), float(v))}))
        await inbox.receive(Envelope("trainer-0", "weights", {**meta, "commit": True, "num_buckets": 1}))

    async def main() -> None:
        inbox = WeightInbox()
        await version(inbox, 5, life=100)
        assert inbox.version == 5 and inbox.take_update().version == 5
        await version(inbox, 2, life=200)  # the checkpoint of step 2, from the restarted trainer
        assert inbox.version == 2
        update = inbox.take_update()
        assert update.version == 2 and not update.is_delta and float(update.buckets[0]["w"][0]) == 2.0
        await version(inbox, 6, life=100)  # late, from the dead process
        assert inbox.version == 2 and inbox.pending is None and inbox.stale_dropped == 2  # bucket, commit
        assert inbox.follow("trainer-0", 300) and inbox.version == -1  # the mesh shows a newer life first

    asyncio.run(main())


def test_a_rank_whose_step_counter_stays_behind_is_named_stuck_after_hang_timeout_s():
    """The ranks' step counters (mesh meta ``beat``): equal counts are a shared wait (a collective,
    samples), never a hang; a count behind mine for hang_s, counted from when it was first seen
    behind, is a stuck rank, named with its count and mine."""
    from distflow.progress import ProgressWatch

    watch = ProgressWatch(hang_s=30.0)
    assert watch.stuck({"t0": 4, "t1": 4}, "t0", now=0.0) == []  # together: a shared wait
    assert watch.stuck({"t0": 4, "t1": 4}, "t0", now=500.0) == []  # however long
    assert watch.stuck({"t0": 5, "t1": 4}, "t0", now=501.0) == []  # behind from now on, not from t=0
    assert watch.stuck({"t0": 6, "t1": 4}, "t0", now=530.0) == []
    assert watch.stuck({"t0": 6, "t1": 4}, "t0", now=531.0) == [("t1", 4, 6, 30.0)]
    assert watch.stuck({"t0": 6, "t1": 5}, "t0", now=532.0) == []  # it moved: the clock starts again
    assert watch.stuck({"t0": 6, "t1": 7}, "t0", now=600.0) == []  # ahead of me: its wait, not its hang
    assert watch.stuck({"t0": 8, "t1": 7}, "t0", now=601.0) == []
    assert watch.check({"t0": 8, "t1": 7}, 630.0, "t0", "trainer", {"t0": "update"}) is None
    lost, why = watch.check({"t0": 8, "t1": 7}, 631.0, "t0", "trainer", {"t0": "update"})
    assert lost == ["t1"]  # treated as dead
    assert why == ("trainer rank t1 is stuck: its progress stayed at step 0 (stage 6) for 30s while t0 reached "
                   "step 0 (update) (hang_timeout_s): the trainer group cannot go on with it; treated as dead")


def test_recovery_is_refused_when_it_cannot_reproduce_the_run(toy_model, toy_data, tmp_path):
    """Which deaths are recovered: trainer ranks only, while retries are left, not once a rollout node
    finished (nobody would generate the steps after the checkpoint), not with a controller or worker
    groups between; and from which checkpoint: this run's newest complete one, else its resume_from."""
    from types import SimpleNamespace

    from distflow.core.config import load_config
    from distflow.launch.checkpoint import mark_checkpoint
    from distflow.launch.recovery import TrainerRecovery
    from tests.conftest import ROOT

    def child(node_id: str, role: str, code):
        return SimpleNamespace(node_id=node_id, role=role, proc=SimpleNamespace(poll=lambda: code, returncode=code))

    def cfg(*more: str):
        return load_config(ROOT / "examples" / "grpo_quickstart.yaml", [
            f"model_path={toy_model}", f"dataset={toy_data}", "toy_model=false", f"output_dir={tmp_path}", *more])

    dead = [child("trainer-1", "trainer", -9)]
    running = [child("trainer-0", "trainer", None), dead[0], child("rollout-0", "rollout", None)]
    recovery = TrainerRecovery(cfg("recover_retries=2"), since=0.0)
    assert recovery.possible(running, dead)
    recovery.attempts = 2
    assert not recovery.possible(running, dead)  # retries used up: the run stops as before
    fresh = TrainerRecovery(cfg(), since=0.0)
    assert fresh.possible(running, dead)  # recover_retries: 3 by default
    assert not fresh.possible(running, [child("controller-0", "controller", 1)])
    assert not fresh.possible(running[:2] + [child("rollout-0", "rollout", 0)], dead)  # it had the final weights
    assert not TrainerRecovery(cfg("recover_retries=0"), since=0.0).possible(running, dead)
    assert not TrainerRecovery(cfg("controller=single"), since=0.0).possible(running, dead)
    assert fresh.checkpoint() is None
    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
        mark_checkpoint(tmp_path / f"checkpoint-{step}", {"policy_version": step})
    (tmp_path / "checkpoint-6").mkdir()  # being written when the rank died: never the one
    assert fresh.checkpoint() == tmp_path / "checkpoint-4"
    assert TrainerRecovery(cfg(), since=1e12).checkpoint() is None  # another run's checkpoints are not this run's
    assert TrainerRecovery(cfg(f"resume_from={tmp_path / 'checkpoint-2'}"), since=1e12).checkpoint() == \
        tmp_path / "checkpoint-2"  # the one it resumed from


def test_the_trainer_group_names_a_rank_whose_gossiped_step_counter_stays_behind():
    """The same on real mesh nodes (in this process): each trainer rank gossips its ``beat``; the
    group watch of trainer-0 sees trainer-1's count stay behind its own for hang_s and fails
    naming it (treated as a dead rank), while equal counts never trip it."""
    import asyncio

    import pytest

    from distflow.runtime import GroupMemberLost, Runtime
    from tests.test_nodes_inprocess import SECRET, _cfg, _until

    async def main() -> None:
        cfg = _cfg("trainer_nodes=2")
        nodes: list[Runtime] = []
        try:
            for i, role in enumerate(("trainer", "trainer", "rollout")):
                rt = Runtime.create(cfg, role, f"{role}-{i % 2 if role == 'trainer' else 0}", SECRET,
                                    host="127.0.0.1", port=0, data_port=0,
                                    seeds=[nodes[0].node.address] if nodes else [])
                await rt.start()
                nodes.append(rt)
            t0, t1, _ = nodes
            await asyncio.gather(*(rt.form_groups() for rt in nodes))
            t0.node.set_meta(beat=4)
            t1.node.set_meta(beat=4)
            watch = asyncio.create_task(t0.watch_group(poll_s=0.05, hang_s=1.0), name="group-watch")
            await asyncio.sleep(1.5)
            assert not watch.done()  # together at one count: a shared wait, however long
            t0.node.set_meta(beat=5)  # trainer-0 ends its step; trainer-1 never does
            await _until(lambda: watch.done(), "the stuck rank named", timeout=10)
            with pytest.raises(GroupMemberLost, match=r"trainer rank trainer-1 is stuck: its progress stayed at step 0 "
                                                      r"\(stage 3\) "):
                watch.result()
        finally:
            for rt in nodes:
                await rt.stop(graceful=False)

    asyncio.run(main())
