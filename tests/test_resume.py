"""``resume_from`` edge cases: a checkpoint saved at step 0 (Ctrl-C before step 1 finished)
trains on resume, and a resume whose data order differs from the checkpoint's (``seed``,
``shuffle``, ``prompts_per_step``, the prompt set's row count) is refused naming the keys,
since "step k" would read other prompts; a moved prompt set, or a checkpoint of an older
DistFlow (no ``data_order``), resumes with a warning.

The runs are ``distflow run --in-process`` (one process, real mesh and channels)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from distflow.core.config import load_config
from distflow.core.mesh import Member
from distflow.trainer.metrics import read_metrics
from tests.conftest import ROOT, run_distflow

ARGS = ["run", "examples/grpo_quickstart.yaml", "--no-progress", "--in-process"]


def overrides(toy_model: Path, data: Path, out: Path, *more: str) -> list[str]:
    return [f"model_path={toy_model}", f"dataset={data}", "toy_model=false", "rollout_nodes=1", "trainer_nodes=1",
            "max_staleness=0", "prompts_per_step=8", "group_size=4", "max_new_tokens=2", f"output_dir={out}",
            "step_timeout_s=20", *more]


@pytest.fixture(scope="module")
def trained(toy_model, toy_data, tmp_path_factory) -> Path:
    """A real run's checkpoint after 1 step (its run state records the data order)."""
    out = tmp_path_factory.mktemp("resume") / "run"
    r = run_distflow(ARGS + overrides(toy_model, toy_data, out, "max_steps=1"), timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "checkpoint"


def state_of(ckpt: Path) -> dict:
    return json.loads((ckpt / "distflow_state.json").read_text())


def test_the_checkpoint_records_the_data_order(trained, toy_data):
    assert state_of(trained)["data_order"] == {"seed": 0, "shuffle": True, "prompts_per_step": 8,
                                               "dataset": str(toy_data), "num_rows": 48}


def test_resume_from_a_step_0_checkpoint_trains(toy_model, toy_data, tmp_path):
    """The final checkpoint of a run stopped before step 1 finished is at step 0: the trainers
    resume at version 0 and gossip nothing that moves past 0, so the rollout nodes must learn
    the step some other way (``start_step``) instead of waiting for it until step_timeout_s."""
    from distflow.launch.checkpoint import data_order
    from distflow.trainer.actor import Actor
    from distflow.trainer.stages import build_context, save_checkpoint
    from tests.process_group import process_group, store_path

    out = tmp_path / "run"
    cfg = load_config(ROOT / "examples" / "grpo_quickstart.yaml", overrides(toy_model, toy_data, out))
    with process_group(store_path()):  # what the trainer saves when the rollout nodes leave during step 0
        actor = Actor(cfg, with_reference=False)
        ctx = build_context(cfg, cfg.plan().pipeline("trainer"), actor)
        save_checkpoint(ctx, out / "checkpoint", actor.full_state_dict(),
                        {"step": 0, "total_steps": None, "seed": cfg.seed, "dataset": cfg.dataset,
                         "data_order": data_order(cfg, None)})
        # The optimizer never stepped: nothing saved, and no state made up in the live one either
        # (torch's get_optimizer_state_dict would have run a fake step: the first real update
        # would then have taken step 2's bias correction, 0.74x the step).
        assert actor.optim.state == {} and (out / "checkpoint" / "optimizer" / "never_stepped").is_file()
        resumed = Actor(load_config(ROOT / "examples" / "grpo_quickstart.yaml",
                                    overrides(toy_model, toy_data, out, f"resume_from={out / 'checkpoint'}")),
                        with_reference=False)
        assert resumed.optim.state == {}
    assert state_of(out / "checkpoint")["policy_version"] == 0
    r = run_distflow(ARGS + overrides(toy_model, toy_data, out, "max_steps=2", f"resume_from={out / 'checkpoint'}"),
                     timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [(m["step"], m["policy_version"]) for m in read_metrics(out / "metrics.jsonl")] == [(0, 1), (1, 2)]
    assert state_of(out / "checkpoint")["data_order"]["num_rows"] == 48  # learnt from the rollout node
    # rewritten in place after real steps: the state is saved and the marker gone
    assert not (out / "checkpoint" / "optimizer" / "never_stepped").exists()
    assert (out / "checkpoint" / "optimizer" / ".metadata").is_file()


def test_trainers_start_step_is_unknown_until_a_trainer_gossips_it():
    from distflow.rollout.worker import trainers_start_step

    def member(i: str, meta: dict) -> Member:
        return Member(i, "trainer", "127.0.0.1", 7000, "alive", 1, meta, 100.0, 0.0)

    members = {"t0": member("t0", {"policy_version": 0}), "t1": member("t1", {"policy_version": 0})}
    rt = SimpleNamespace(node=SimpleNamespace(member=members.get))
    groups = SimpleNamespace(trainer=[SimpleNamespace(node_id="t0"), SimpleNamespace(node_id="t1")])
    assert trainers_start_step(rt, groups) is None
    members["t1"] = member("t1", {"policy_version": 0, "start_step": 0})
    assert trainers_start_step(rt, groups) == 0


def test_resume_with_another_seed_or_shuffle_is_refused_naming_the_keys(trained, toy_model, toy_data, tmp_path):
    out = tmp_path / "run"
    r = run_distflow(ARGS + overrides(toy_model, toy_data, out, "max_steps=3", f"resume_from={trained}", "seed=1",
                                      "shuffle=false"), timeout=240)
    assert r.returncode != 0
    assert (f"resume_from '{trained}': the data order differs from the run that wrote this checkpoint: "
            "seed 1 (checkpoint: 0), shuffle False (checkpoint: True); its step 1 would read other prompts") in r.stderr
    assert "Set seed: 0, shuffle: true back" in r.stderr, r.stderr[-3000:]
    assert not (out / "metrics.jsonl").exists() or read_metrics(out / "metrics.jsonl") == []


def test_resume_with_another_prompts_per_step_is_refused(trained, toy_model, toy_data, tmp_path):
    r = run_distflow(ARGS + overrides(toy_model, toy_data, tmp_path / "run", "max_steps=3", f"resume_from={trained}",
                                      "prompts_per_step=16"), timeout=240)
    assert r.returncode != 0 and "prompts_per_step 16 (checkpoint: 8)" in r.stderr, r.stderr[-3000:]


def test_resume_on_a_prompt_set_of_another_size_is_refused(trained, toy_model, tmp_path):
    """The trainers learn the row count from the rollout nodes (they may not see the file):
    the first step is refused before it is trained."""
    from distflow.toy import make_toy_dataset

    other = tmp_path / "other.jsonl"
    make_toy_dataset(other, 64, seed=1)
    out = tmp_path / "run"
    r = run_distflow(ARGS + overrides(toy_model, other, out, "max_steps=3", f"resume_from={trained}"), timeout=240)
    assert r.returncode != 0
    assert "num_rows 64 (checkpoint: 48), dataset" in r.stderr and "its step 1 would read" in r.stderr, \
        r.stderr[-3000:]
    assert not (out / "metrics.jsonl").exists() or read_metrics(out / "metrics.jsonl") == []


def test_a_moved_prompt_set_resumes_with_a_warning(trained, toy_model, toy_data, tmp_path, caplog):
    from distflow.launch.checkpoint import read_run_state

    moved = tmp_path / "moved.jsonl"
    shutil.copy(toy_data, moved)
    cfg = load_config(ROOT / "examples" / "grpo_quickstart.yaml", overrides(toy_model, moved, tmp_path / "run"))
    with caplog.at_level(logging.WARNING, logger="distflow.launch.checkpoint"):
        assert read_run_state(trained, cfg)["policy_version"] == 1
    assert f"dataset '{moved}', the checkpoint's was '{toy_data}'" in caplog.text


def test_an_older_checkpoint_without_a_data_order_resumes_with_a_warning(trained, toy_model, toy_data, tmp_path,
                                                                         caplog):
    from distflow.launch.checkpoint import read_run_state

    old = tmp_path / "old"
    shutil.copytree(trained, old)
    state = state_of(old)
    del state["data_order"]  # what DistFlow wrote before it recorded one (seed and dataset only)
    (old / "distflow_state.json").write_text(json.dumps(state))
    cfg = load_config(ROOT / "examples" / "grpo_quickstart.yaml",
                      overrides(toy_model, toy_data, tmp_path / "run", "prompts_per_step=16"))
    with caplog.at_level(logging.WARNING, logger="distflow.launch.checkpoint"):
        assert read_run_state(old, cfg)["policy_version"] == 1  # prompts_per_step is not recorded: not checked
    assert "records no data order" in caplog.text
    with pytest.raises(ValueError, match=r"seed 2 \(checkpoint: 0\)"):  # the seed it did record is
        read_run_state(old, cfg.model_copy(update={"seed": 2}))


def test_the_stop_hint_names_the_checkpoint_a_resumed_run_came_from(tmp_path, trained):
    """A resumed run that stops before saving anything new (e.g. its resume was refused) is told to
    continue from its own resume_from, not to "restart from scratch"."""
    from distflow.launch.checkpoint import resume_hint

    assert "restart from scratch" in resume_hint(tmp_path)
    assert resume_hint(tmp_path, str(trained)) == f"no newer checkpoint was saved; continue with resume_from={trained}"
    newest = resume_hint(trained.parent, "/elsewhere")
    assert newest == f"newest checkpoint {trained}: continue with resume_from={trained}"


def test_a_resumed_run_evaluates_its_start_on_every_node(trained, toy_model, toy_data, tmp_path):
    """Resumed at step 1 with two rollout nodes, max_staleness 1: each node's first weights (v1) may
    come before the trainers' start_step gossip; the start is still an evaluation point of both
    (before, a node that learnt it late dropped it, and its row was partial)."""
    out = tmp_path / "run"
    r = run_distflow(ARGS + overrides(toy_model, toy_data, out, "max_steps=4", f"resume_from={trained}",
                                      "rollout_nodes=2", "max_staleness=1", "eval_every=2"), timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(out / "eval.jsonl")
    assert [(e["step"], e["eval_shards"], e["eval_samples"]) for e in rows] == [(1, 2, 128), (2, 2, 128), (4, 2, 128)]


def test_the_checkpoint_write_allowance_grows_with_the_model(tmp_path):
    """While rank 0 alone writes the fp32 checkpoint the other ranks wait in the next collective:
    its timeout leaves room for the write, 30 min at least, more for a model whose fp32 bytes
    (twice its bf16 files; twice again with a critic) would take longer at 50 MB/s."""
    from distflow.trainer.worker import checkpoint_write_allowance

    small = tmp_path / "small"
    small.mkdir()
    (small / "model.safetensors").write_bytes(b"\0" * 1024)
    assert checkpoint_write_allowance(str(small), critic=True) == 1800.0
    big = tmp_path / "big"  # 140 GB of bf16 shards (a 70B model), sparse files: no disk used
    big.mkdir()
    for i in range(2):
        with open(big / f"model-0000{i}.safetensors", "wb") as f:
            f.truncate(70 * 10**9)
    (big / "config.json").write_text("{}")
    assert checkpoint_write_allowance(str(big), critic=False) == pytest.approx(280e9 / 50e6)  # 93 min
    assert checkpoint_write_allowance(str(big), critic=True) == pytest.approx(560e9 / 50e6)
    assert checkpoint_write_allowance(str(tmp_path / "missing"), critic=False) == 1800.0
