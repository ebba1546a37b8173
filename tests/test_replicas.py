"""Trainer replica groups kept in step by torchft (distflow.trainer.replicas).

The cluster test runs two replica groups of one rank each as processes of their own
(tests/replica_child.py: a mesh node, torchft's lighthouse/manager/gloo group, a torch model),
SIGKILLs one mid-run and starts it again. It checks, in values: the survivor was never restarted
and committed steps alone while the other was dead; the restarted one copied live state (a heal,
not step 0) and committed the later steps in the quorum again; and both end with the weights of
one process training every sample of every step exactly once (a share lost or trained twice in
any step would change them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distflow.trainer.replicas import replica_layout, replica_share
from tests.replica_child import STALL_ENV

ROOT = Path(__file__).resolve().parent.parent
STEPS = 30
KILLED_AT = 3  # the step in which the victim dies: after its backward, before the gradient average


def test_replica_layout_splits_the_trainer_ranks_into_equal_groups():
    assert replica_layout(4, 2) == [[0, 1], [2, 3]]
    assert replica_layout(2, 2) == [[0], [1]]
    assert replica_layout(3, 1) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="trainer_replicas: 2 must divide trainer_nodes: 3"):
        replica_layout(3, 2)


def test_the_shares_of_a_quorum_cover_the_step_once_whoever_takes_part():
    ids = [f"7-{i}" for i in range(50)]
    for n in (1, 2, 3):
        shares = [replica_share(ids, n, r) for r in range(n)]
        assert sorted(i for s in shares for i in s) == list(range(50))
    assert replica_share(ids, 2, 0) == replica_share(list(ids), 2, 0)  # a function of the ids: every process agrees
    assert 10 < len(replica_share(ids, 2, 0)) < 40
    with pytest.raises(ValueError):
        replica_share(ids, 2, 2)


def _progress(out: Path, replica: int) -> list[dict]:
    path = out / f"progress-{replica}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _wait(what: str, cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.cluster
def test_a_killed_replica_group_leaves_the_other_training_and_rejoins_from_live_state(tmp_path):
    pytest.importorskip("torchft", reason="torchft is not installed (pip install -e '.[ft]'; scripts/setup.sh does)")
    from tests.replica_child import reference_weights


    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs: list[subprocess.Popen] = []

    def start(replica: int, seed: str | None = None, stall_at: int | None = None) -> subprocess.Popen:
        (tmp_path / f"addr-{replica}").unlink(missing_ok=True)
        log = open(tmp_path / f"log-{replica}-{len(procs)}", "w")
        p = subprocess.Popen([sys.executable, "-m", "tests.replica_child", str(tmp_path), str(replica), "2",
                              str(STEPS), *([seed] if seed else [])], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             env={**env, **({STALL_ENV: str(stall_at)} if stall_at is not None else {})})
        procs.append(p)
        return p

    try:
        first = start(0)
        victim = start(1, f"@{tmp_path / 'addr-0'}", stall_at=KILLED_AT)  # it joins through replica 0 once it is up
        _wait("replica 0's mesh address", (tmp_path / "addr-0").is_file, 60)
        seed = (tmp_path / "addr-0").read_text()
        _wait("the victim inside its step", (tmp_path / "stalled-1").is_file, 60)
        victim.send_signal(signal.SIGKILL)  # the whole replica group (its one rank), mid-step
        victim.wait(timeout=10)
        _wait("the survivor committing steps alone",
              lambda: sum(r["participants"] == 1 for r in _progress(tmp_path, 0)) >= 2, 30)
        again = start(1, seed)
        assert first.wait(timeout=90) == 0, (tmp_path / "log-0-0").read_text()[-3000:]
        assert again.wait(timeout=30) == 0, (tmp_path / "log-1-2").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)

    survivor = json.loads((tmp_path / "result-0.json").read_text())
    rejoined = json.loads((tmp_path / "result-1.json").read_text())
    rows0 = _progress(tmp_path, 0)
    assert [r["step"] for r in rows0] == list(range(STEPS))  # every step committed once, no restart
    assert {r["pid"] for r in rows0} == {first.pid}
    # The step the victim died in: the survivor's gradient average failed, the step was not committed,
    # and the next quorum (the survivor alone) trained the whole step, the dead share included.
    assert survivor["retries"] >= 1
    by_step = {r["step"]: r for r in rows0}
    assert by_step[KILLED_AT]["participants"] == 1 and len(by_step[KILLED_AT]["ids"]) == 8
    assert [r["step"] for r in _progress(tmp_path, 1) if r["pid"] == victim.pid] == list(range(KILLED_AT))
    later = [r for r in _progress(tmp_path, 1) if r["pid"] == again.pid]
    assert later and later[0]["step"] > KILLED_AT and later[0]["healed"] >= 1  # live state, not step 0
    assert all(len(by_step[r["step"]]["ids"]) + len(r["ids"]) == 8 for r in later)  # the shares, once each
    assert all(r["participants"] == 2 for r in later)
    assert rejoined["healed"] >= 1 and rejoined["step"] == survivor["step"] == STEPS
    assert 2 in survivor["participants_seen"][-len(later):]  # back in the quorum till the end
    expected = torch.tensor(reference_weights(STEPS))
    torch.testing.assert_close(torch.tensor(survivor["weights"]), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(rejoined["weights"]), expected, rtol=1e-5, atol=1e-6)


@pytest.fixture()
def world1(tmp_path):
    """This pytest process as a one-rank gloo group: the replica group's own FSDP group."""
    from tests.process_group import process_group, store_path

    with process_group(store_path(tmp_path)):
        yield


def test_the_actor_steps_only_when_the_quorum_commits_and_heals_from_a_peers_state(toy_model, world1):
    """The real FSDP2 actor under torchft (one replica group, an in-process lighthouse): a committed
    step is the plain actor's step (the mean over one participant); a step the quorum does not
    commit (torchft told of an error, as a failed all-reduce tells it) raises StepNotCommitted and
    leaves the weights, optimizer and version as they were; and the state a healing replica copies
    (``actor_state_fns``, through a byte round trip as over torchft's transport) makes a fresh actor
    take the next step exactly as the one it came from."""
    pytest.importorskip("torchft", reason="torchft is not installed (pip install -e '.[ft]'; scripts/setup.sh does)")
    import io

    from torchft.coordination import LighthouseServer

    from distflow.core.config import load_config
    from distflow.trainer.actor import Actor
    from distflow.trainer.replicas import ReplicaSync, StepNotCommitted, actor_state_fns
    from tests.conftest import ROOT as REPO
    from tests.test_packing import make_batch

    cfg = load_config(REPO / "examples" / "grpo_quickstart.yaml", [f"model_path={toy_model}", "toy_model=false",
                                                                   "micro_batch_size=4", "grad_clip=1000", "lr=0.01"])
    node = cfg.node("ACTOR", "MODEL_TRAIN")
    plain, actor = Actor(cfg, with_reference=False), Actor(cfg, with_reference=False)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    sync = ReplicaSync("replica0", lighthouse.address(), *actor_state_fns(actor), host="127.0.0.1", timeout_s=20)
    try:
        actor.replicas = sync
        plain.update(node, make_batch(8, seed=7))
        sync.begin()
        actor.update(node, make_batch(8, seed=7))
        assert actor.version == 1 and sync.step == 1
        after = actor.full_state_dict()
        for name, t in plain.full_state_dict().items():
            torch.testing.assert_close(after[name], t, rtol=1e-5, atol=1e-7)

        sync.begin()
        sync.manager.report_error(RuntimeError("a replica group died in this step"))
        with pytest.raises(StepNotCommitted):
            actor.update(node, make_batch(8, seed=8))
        assert actor.version == 1 and sync.step == 1
        for name, t in actor.full_state_dict().items():
            assert torch.equal(t, after[name]), name

        buf = io.BytesIO()
        torch.save(actor_state_fns(actor)[0](), buf)
        healed = Actor(cfg, with_reference=False)
        actor_state_fns(healed)[1](torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
        assert healed.version == 1
        sync.begin()
        actor.update(node, make_batch(8, seed=9))
        healed.update(node, make_batch(8, seed=9))  # (no replicas: the same single-participant step)
        assert actor.version == healed.version == 2
        final = actor.full_state_dict()
        for name, t in healed.full_state_dict().items():
            torch.testing.assert_close(t, final[name], rtol=1e-5, atol=1e-7)  # AdamW's moments came along
    finally:
        sync.close()
        lighthouse.shutdown()
