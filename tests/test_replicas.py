"""Trainer replica groups kept in step by torchft (distflow.trainer.replicas).

The cluster test runs two replica groups of one rank each as processes of their own
(tests/replica_child.py: a mesh node, torchft's lighthouse/manager/gloo group, a torch model),
SIGKILLs one mid-run and starts it again. It checks, in values: the survivor was never restarted
and committed steps alone while the other was dead; the restarted one copied live state (a heal,
not step 0) and committed the later steps in the quorum again; and both end with the weights of
one process training every sample of every step exactly once (a share lost or trained twice in
any step would change them).

The run test starts ``distflow run`` with ``trainer_replicas: 2`` and kills replica group 0 (the
lighthouse's host and the leading group): the other trains on, the killed one heals into the run,
and every sample is trained once, counted by id in the trainers' traces.
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


def _trace_lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []


def _kill_after_two_steps(tmp_path: Path, toy_model, rows: int, victim: str, *extra: str) -> None:
    """`distflow run` of ``rows`` prompts (4 a step) with two replica groups into ``tmp_path / "run"``;
    SIGKILL ``victim`` (of replica group 0) once it traced two committed steps. The run must end with exit
    0 and every step's row, its group restarted alone (no recovery of every trainer from a checkpoint)."""
    from distflow.trainer.metrics import read_metrics
    from tests.test_supervise import make_data, node_pid, start_run

    out = tmp_path / "run"
    proc = start_run(out, toy_model, make_data(tmp_path, rows), "trainer_replicas=2", "eval_dataset=null",
                     "eval_every=0", "max_staleness=1", "save_interval_s=0", "step_timeout_s=60", *extra)
    trace = out / "trace" / f"{victim}.jsonl"
    try:
        _wait(f"{victim}'s first committed step", lambda: len(_trace_lines(trace)) >= 1, 180)
        pid = node_pid(out, victim)
        _wait(f"{victim}'s second committed step", lambda: len(_trace_lines(trace)) >= 2, 60)
        os.kill(pid, signal.SIGKILL)  # mid-run
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    assert f"{victim} died (killed by SIGKILL)" in err and "restarting trainer replica group 0 alone" in err, err[-3000:]
    assert "restarting the trainers from checkpoint" not in err  # no full recovery
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == list(range(rows // 4))


@pytest.mark.cluster
def test_distflow_run_keeps_training_when_a_replica_group_is_killed_and_it_rejoins_from_live_state(toy_model,
                                                                                                  tmp_path):
    """`distflow run` with ``trainer_replicas: 2`` (two groups of one rank): trainer-0, replica group 0, which
    hosts torchft's lighthouse, publishes the weights and writes the metrics rows, is SIGKILLed once it
    traced two committed steps. The launcher restarts it alone; trainer-1 trains on, never restarted: it
    moves to a new lighthouse, takes over the weights and the rows, and trainer-0 heals into the run at the
    quorum's step from trainer-1's live state (no checkpoint). Counted by sample id over the trainers'
    traces (each group's share of each committed step; a share committed by trainer-0 just before its
    death but not yet traced is the rest of the step, by the quorum's rule): every sample of every step
    trained exactly once, within max_staleness."""
    pytest.importorskip("torchft", reason="torchft is not installed (pip install -e '.[ft]'; scripts/setup.sh does)")
    from collections import Counter

    from distflow.trace import read_trace

    rows, per_step = 64, 4
    steps = rows // per_step
    out = tmp_path / "run"
    _kill_after_two_steps(tmp_path, toy_model, rows, "trainer-0", "trainer_nodes=2", "rollout_nodes=2")
    log0, log1 = ((out / "logs" / f"trainer-{i}.log").read_text() for i in (0, 1))
    assert "----- distflow run:" not in log1  # trainer-1 was never restarted
    assert "recovery 1 of 3: trainer-0's replica group heals from a live one" in log0
    # its lighthouse went with it: trainer-1 built its torchft side again on a new one (hosted by the lowest live
    # group: itself, or trainer-0's new life when that was back first), and took over the weights and the rows
    lighthouses = {ln.split("torchft lighthouse ")[1].split()[0] for ln in log1.splitlines()
                   if "trainer replica group 1 of 2: torchft lighthouse" in ln}
    assert len(lighthouses) >= 2 and "trainer replica group 1 leads" in log1, log1[-3000:]
    for r in ("rollout-0", "rollout-1"):
        assert "----- distflow run:" not in (out / "logs" / f"{r}.log").read_text()

    trace = read_trace(out)
    survivor = {rec["step"]: rec for rec in trace["trainer-1"]}
    assert sorted(survivor) == list(range(steps))  # the survivor committed every step, in one life
    # healed from live state at the quorum's step, not step 0 (its new life started at 0; no checkpoint was read)
    healed = [ln for ln in log0.splitlines() if "healed from a live one: at step" in ln]
    assert len(healed) == 1 and healed[0].split("(was ")[1].startswith("0)") and "resume_from" not in log0, log0[-3000:]
    rejoined_at = int(healed[0].split("at step ")[1].split()[0])
    victim = trace["trainer-0"]
    first = [r["step"] for r in victim if r["step"] < rejoined_at]  # its first life's committed steps, traced
    assert len(first) >= 2 and first == list(range(len(first))) and rejoined_at >= len(first)
    assert [r["step"] for r in victim if r["step"] >= rejoined_at] == list(range(rejoined_at, steps))
    # each committed step's samples: the prompts the rollout nodes generated for it (with weights within
    # max_staleness of the step), two samples each
    expected: dict[int, set] = {}
    for node in ("rollout-0", "rollout-1"):
        for rec in trace[node]:
            assert rec["step"] - 1 <= rec["policy_version"] <= rec["step"], rec
            expected.setdefault(rec["step"], set()).update(f"{p}:s{j}" for p in rec["prompt_ids"] for j in range(2))
    trained, alone = Counter(), []
    for k in range(steps):
        recs = [survivor[k]] + [r for r in victim if r["step"] == k]
        together = survivor[k]["participants"]
        assert {r["participants"] for r in recs} == {together} and together in (1, 2), (k, recs)
        ids = [s for r in recs for s in r["sample_ids"]]
        assert len(ids) == len(set(ids)), k  # the shares are disjoint
        if together == 1:
            alone.append(k)  # trainer-1 alone while trainer-0 was dead: the whole step
        elif len(recs) == 1:  # trainer-0 committed this step with trainer-1 and died before its trace line:
            assert k == len(first), k  # its share's gradient is in trainer-1's weights (the average)
            step_ids = sorted(expected[k])
            shares = [{step_ids[i] for i in replica_share(step_ids, 2, r)} for r in (0, 1)]
            assert set(ids) in shares, k  # trainer-1's share by the quorum's rule; trainer-0's is the rest
            ids = step_ids
        assert set(ids) == expected[k], k  # the step's every sample, once
        trained.update(ids)
        assert all(k - 1 <= v <= k for r in recs for v in r["policy_versions"]), k  # max_staleness 1
    assert set(alone) <= set(range(len(first), rejoined_at)), alone  # only while it was dead
    assert set(trained) == {f"e0:{i}:s{j}" for i in range(rows) for j in range(2)}
    assert set(trained.values()) == {1}


@pytest.mark.cluster
def test_replica_groups_of_two_fsdp_ranks_keep_training_when_one_rank_dies_and_the_group_heals_rank_by_rank(
        toy_model, tmp_path):
    """`distflow run` with ``trainer_nodes: 4, trainer_replicas: 2``: two FSDP2 groups of two ranks (trainer-0/1,
    trainer-2/3). trainer-1 (rank 1 of group 0, whose rank 0 hosts torchft's lighthouse and which leads) is
    SIGKILLed mid-run: the launcher stops its group and starts it again alone; group 1 trains on, never
    restarted: both its ranks build their torchft side again together on a new lighthouse, and it takes over
    the weights and the rows; each rank of group 0 heals from the same rank of group 1 (its own shards) at the
    quorum's step. Counted by sample id over the four traces: every sample of every step trained exactly once
    (but for a share group 0 committed as it died, before its trace line)."""
    pytest.importorskip("torchft", reason="torchft is not installed (pip install -e '.[ft]'; scripts/setup.sh does)")
    from collections import Counter

    from distflow.trace import read_trace

    rows, per_step = 48, 4
    steps = rows // per_step
    out = tmp_path / "run"
    _kill_after_two_steps(tmp_path, toy_model, rows, "trainer-1", "trainer_nodes=4", "rollout_nodes=1")
    logs = {i: (out / "logs" / f"trainer-{i}.log").read_text() for i in range(4)}
    for i in (2, 3):
        assert "----- distflow run:" not in logs[i]  # group 1 was never restarted
    for i in (0, 1):  # each rank of group 0 healed from live state at the quorum's step (its new life began at 0)
        healed = [ln for ln in logs[i].splitlines() if "healed from a live one: at step" in ln]
        assert len(healed) == 1 and healed[0].split("(was ")[1].startswith("0)"), logs[i][-3000:]
    for i in (2, 3):  # the lighthouse died with trainer-0: both ranks of group 1 moved to a new one, and it leads
        lighthouses = {ln.split("torchft lighthouse ")[1].split()[0] for ln in logs[i].splitlines()
                       if "trainer replica group 1 of 2: torchft lighthouse" in ln}
        assert len(lighthouses) == 2 and "trainer replica group 1 leads" in logs[i], logs[i][-3000:]
    trace = read_trace(out)
    expected: dict[int, set] = {}
    for rec in trace["rollout-0"]:
        expected.setdefault(rec["step"], set()).update(f"{p}:s{j}" for p in rec["prompt_ids"] for j in range(2))
    trained: Counter = Counter()
    for k in range(steps):
        ids = [s for node in ("trainer-0", "trainer-1", "trainer-2", "trainer-3")
               for r in trace.get(node, []) if r["step"] == k for s in r["sample_ids"]]
        assert len(ids) == len(set(ids)), k  # the shares are disjoint
        trained.update(ids)
        missing = expected[k] - set(ids)  # a share of group 0 committed as it died, before its trace line
        assert set(ids) <= expected[k] and (not missing or k <= 3), (k, sorted(missing))
    assert set(trained.values()) == {1}
    assert len(trained) >= rows * 2 - per_step * 2  # at most the untraced share of one step


def _shard_heal(rank: int, world: int, store: str, toy_model: str, out: str) -> None:
    """One rank of a two-rank FSDP2 group: actor ``a`` trains a step; a fresh actor ``b`` loads ``a``'s shard
    state (``shard_state_fns``, through bytes as over torchft's transport); both take the same next step."""
    import io

    from distflow.trainer.actor import Actor
    from distflow.trainer.replicas import shard_state_fns
    from tests.process_group import process_group
    from tests.test_actor import _cfg
    from tests.test_packing import make_batch

    torch.set_num_threads(1)
    with process_group(store, rank, world):
        cfg = _cfg(toy_model, "lr=0.01")
        node = cfg.node("ACTOR", "MODEL_TRAIN")
        a, b = Actor(cfg, with_reference=False), Actor(cfg, with_reference=False)
        first, second = (make_batch(8, seed=s).select(range(rank * 4, rank * 4 + 4)) for s in (3, 4))
        a.update(node, first)
        buf = io.BytesIO()
        torch.save(shard_state_fns(a)[0](), buf)
        buf.seek(0)
        shard_state_fns(b)[1](torch.load(buf, weights_only=False))
        assert b.version == a.version == 1
        stats = [actor.update(node, second) for actor in (a, b)]
        local = [{n: p.to_local().detach().clone() for n, p in actor.model.named_parameters()} for actor in (a, b)]
        moments = [[st["exp_avg"].to_local().clone() for st in actor.optim.state.values()] for actor in (a, b)]
        torch.save({"stats": stats, "local": local, "moments": moments}, f"{out}.{rank}")


def test_a_rank_of_a_group_of_two_heals_from_the_same_rank_of_another_groups_shards(toy_model, tmp_path):
    """What a rank of a restarted group of several FSDP ranks copies (``shard_state_fns``): its own parameter
    and Adam shards, no collective. A fresh actor loaded from a trained one's shards takes the next step
    exactly as its source: the same loss, the same weight and moment shards on both ranks."""
    from tests.test_actor import _forked_fn

    out = str(tmp_path / "heal")
    _forked_fn(_shard_heal, 2, (2, str(tmp_path / "store"), str(toy_model), out))
    for rank in range(2):
        got = torch.load(f"{out}.{rank}", weights_only=False)
        (sa, sb), (la, lb), (ma, mb) = got["stats"], got["local"], got["moments"]
        assert sa["loss"] == sb["loss"] and sa["grad_norm"] == sb["grad_norm"], (sa, sb)
        assert la.keys() == lb.keys() and all(torch.equal(la[n], lb[n]) for n in la)
        assert len(ma) == len(mb) > 0 and all(torch.equal(x, y) for x, y in zip(ma, mb))
        assert any(t.numel() for t in la.values())  # each rank holds its own shards


@pytest.mark.parametrize("lora", [[], ["lora.rank=4", "lora.target_modules=[q_proj,v_proj]"]], ids=["full", "lora"])
def test_two_replica_groups_shares_make_the_whole_steps_update_however_the_tokens_split(toy_model, world1, lora):
    """Two real FSDP2 actors, each a replica group under torchft (one in-process lighthouse, a thread
    each), train their shares of a step whose shares hold different token counts: each share's loss is
    normalised by the whole step's tokens over the participants (``Actor.step_counts``), so after the
    quorum's average both hold exactly the weights of one actor trained on the whole step. With LoRA
    (``lora``): the adapters are what the quorum averages and what both end with."""
    pytest.importorskip("torchft", reason="torchft is not installed (pip install -e '.[ft]'; scripts/setup.sh does)")
    import threading

    from torchft.coordination import LighthouseServer

    from distflow.core.config import load_config
    from distflow.rl.shaping import trained_token_counts
    from distflow.trainer.actor import Actor
    from distflow.trainer.replicas import ReplicaSync, actor_state_fns
    from tests.conftest import ROOT as REPO
    from tests.test_packing import make_batch

    cfg = load_config(REPO / "examples" / "grpo_quickstart.yaml", [f"model_path={toy_model}", "toy_model=false",
                                                                   "micro_batch_size=4", "grad_clip=1000", "lr=0.01",
                                                                   *lora])
    node = cfg.node("ACTOR", "MODEL_TRAIN")
    plain, actors = Actor(cfg, with_reference=False), [Actor(cfg, with_reference=False) for _ in range(2)]
    for a in (plain, *actors):  # AdamW's first step is ~lr * sign(g): with eps 1 it is ~lr * g, so the weights
        for group in a.optim.param_groups:  # compare the gradients (a summation order's noise, not amplified)
            group["eps"] = 1.0
    step = make_batch(10, seed=11, max_resp=8)
    lens = trained_token_counts(step, cfg)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    syncs = [ReplicaSync(f"replica{r}", lighthouse.address(), *actor_state_fns(a), host="127.0.0.1", timeout_s=30)
             for r, a in enumerate(actors)]
    shares: list = [None, None]
    errors: list = []

    def train(r: int) -> None:
        try:
            syncs[r].begin()
            share = step.select(syncs[r].share(step.sample_ids))
            shares[r] = (syncs[r].participants, len(share), float(trained_token_counts(share, cfg).sum()))
            actors[r].replicas = syncs[r]
            actors[r].step_counts = (float(lens.sum()), float((lens > 0).sum()))
            actors[r].update(node, share)
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread below
            errors.append(e)

    try:
        fresh = plain.full_state_dict()
        plain.update(node, step)
        threads = [threading.Thread(target=train, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and not any(t.is_alive() for t in threads), errors
        assert [p for p, _, _ in shares] == [2, 2] and sum(n for _, n, _ in shares) == 10
        assert shares[0][2] != shares[1][2]  # the shares' tokens differ: a share's own mean would be off
        want = plain.full_state_dict()
        assert all("lora_" in name for name in want) == bool(lora) and want  # (LoRA: the adapters only)
        moved = {n for n, t in want.items() if not torch.equal(t, fresh[n])}
        assert moved and all("lora_B" in n for n in moved) == bool(lora), sorted(moved)[:4]  # the step trained
        for a in actors:
            assert a.version == 1
            for name, t in a.full_state_dict().items():
                torch.testing.assert_close(t, want[name], rtol=1e-6, atol=1e-9)
    finally:
        for sync in syncs:
            sync.close()
        lighthouse.shutdown()


@pytest.mark.parametrize("ingress", [True, False], ids=["posted", "messages"])
def test_scatter_gives_every_replica_group_the_whole_step_each_sample_at_its_owner(ingress):
    """``scatter(..., replicas=2)`` to 4 consumers (2 groups of 2): each group receives every sample once,
    at the rank owning it within the group, byte-exact; a part names that rank and the group's size."""
    from distflow.buffer.redistribute import gather_step, scatter
    from distflow.buffer.routing import owner
    from tests.test_posting import batch, consumers, ep, run, samples
    from distflow.transport import make_transport
    from tests.test_posting import SECRET

    async def main():
        cons = await consumers(4, ingress=ingress)
        prods = [make_transport("shm", f"p{i}", SECRET) for i in range(2)]
        for p in prods:
            await p.start()
        sent: dict = {}
        got: list[dict] = [{}, {}]
        for step in range(2):
            for i, p in enumerate(prods):
                b = batch(p.node_id, step, [7, 5][i], seed=10 * step + i)
                sent.update(samples(b))
                await scatter(p, b, [ep(c) for c, _ in cons], step=step, source_rank=i, timeout=10, replicas=2)
            for j, (_, shard) in enumerate(cons):
                taken = await gather_step(shard, step, [p.node_id for p in prods], timeout=10)
                for sid, v in samples(taken).items():
                    assert owner(sid, 2) == j % 2 and sid not in got[j // 2]
                    got[j // 2][sid] = v
        assert got[0] == sent and got[1] == sent and len(sent) == 24
        for c in [*prods, *(c for c, _ in cons)]:
            await c.close()

    run(main())


def test_trainer_replicas_is_refused_where_the_groups_cannot_keep_in_step(toy_model):
    from distflow.core.config import load_config
    from distflow.core.config_keys import ConfigError
    from tests.conftest import ROOT as REPO

    def cfg(*more: str):
        return load_config(REPO / "examples" / "grpo_quickstart.yaml", [f"model_path={toy_model}", "toy_model=false",
                                                                         *more])

    assert cfg("trainer_nodes=2", "trainer_replicas=2").trainer_replicas == 2
    assert cfg("trainer_nodes=4", "trainer_replicas=2").trainer_replicas == 2  # two FSDP groups of two ranks
    for more, why in [(("trainer_nodes=3", "trainer_replicas=2"), "trainer_replicas: 2 must divide trainer_nodes: 3"),
                      (("trainer_replicas=2", "ppo_epochs=2"), "cannot be combined with ppo_epochs"),
                      (("trainer_replicas=2", "mini_batches_per_step=2"), "cannot be combined with mini_batches"),
                      (("trainer_replicas=2", "controller=single"), "cannot be combined with controller")]:
        with pytest.raises(ConfigError, match=why):
            cfg(*more)


def test_the_launcher_restarts_only_the_dead_replica_group_and_marks_it_healing(toy_model, tmp_path):
    """Real child processes: trainer-1's group dead and trainer-0's alive: only trainer-1 is started again,
    with DISTFLOW_HEAL_REPLICA=1 and the live nodes as seeds, no resume_from, counted against
    recover_retries. With every group dead (or without replicas) nothing is done here (the full recovery)."""
    from distflow.core.config import load_config
    from distflow.launch.children import Child
    from distflow.launch.recovery import TrainerRecovery
    from tests.conftest import ROOT as REPO

    cfg = load_config(REPO / "examples" / "grpo_quickstart.yaml", [
        f"model_path={toy_model}", "toy_model=false", f"output_dir={tmp_path}", "trainer_nodes=2",
        "trainer_replicas=2", "recover_retries=2"])
    report = "import os, sys; print('env', os.environ.get('DISTFLOW_HEAL_REPLICA'), 'args', sys.argv[1:])"

    def child(node_id: str, role: str, port: int, live: bool) -> Child:
        log = tmp_path / f"{node_id}.log"
        cmd = [sys.executable, "-c", "import time; time.sleep(60)" if live else "import sys; sys.exit(-9 % 256)"]
        with log.open("w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        c = Child(node_id, role, port, proc, log, [sys.executable, "-c", report], dict(os.environ))
        if not live:
            proc.wait(timeout=30)
        return c

    kids = [child("trainer-0", "trainer", 1000, True), child("trainer-1", "trainer", 1001, False),
            child("rollout-0", "rollout", 1002, True)]
    told: list[str] = []
    try:
        recovery = TrainerRecovery(cfg, since=0.0)
        assert recovery.restart_replicas(kids, [kids[1]], told.append)
        assert recovery.attempts == 1 and kids[0].proc.poll() is None  # the live group untouched
        kids[1].proc.wait(timeout=30)
        out = (tmp_path / "trainer-1.log").read_text()
        assert "heals from a live one" in out
        assert "env 1 args ['--seeds', '127.0.0.1:1000,127.0.0.1:1002']" in out, out  # no resume_from
        assert "restarting trainer replica group 1 alone; it heals from the live replica group 0 (attempt 1/2)" \
            in told[0]
        every = [kids[0], kids[1]]
        kids[0].proc.kill()
        kids[0].proc.wait(timeout=30)
        assert not recovery.restart_replicas(kids, every, told.append)  # every group dead: the full recovery
        single = TrainerRecovery(load_config(REPO / "examples" / "grpo_quickstart.yaml", [
            f"model_path={toy_model}", "toy_model=false", f"output_dir={tmp_path}"]), since=0.0)
        assert not single.restart_replicas(kids, [kids[1]], told.append) and recovery.attempts == 1
    finally:
        for c in kids:
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait(timeout=30)
