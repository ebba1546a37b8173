"""Cheap checkpoints: the trainer blocks only for the copy to host memory, a checkpoint is loaded
or offered only once its completion marker is written, and ``keep_checkpoints`` keeps the N newest.

Real components: a real (one-rank gloo) trainer group, the real Actor and its optimizer, the real
torch.distributed.checkpoint writes; only the Hugging Face write is held at a gate, to catch the
save in the middle of its background write.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from distflow.core.config import load_config
from distflow.launch.checkpoint import (STATE_FILE, PeriodicSaves, data_order, mark_checkpoint, newest_checkpoint,
                                        prune_checkpoints, read_run_state)
from tests.conftest import ROOT


def config(toy_model: Path, toy_data: Path, out: Path, *more: str):
    return load_config(ROOT / "examples" / "grpo_quickstart.yaml", [
        f"model_path={toy_model}", f"dataset={toy_data}", "toy_model=false", "rollout_nodes=1", "trainer_nodes=1",
        f"output_dir={out}", "kl_coef=0", *more])


def test_a_save_returns_before_its_write_and_an_unmarked_checkpoint_is_never_loaded(toy_model, toy_data, tmp_path,
                                                                                     monkeypatch):
    from distflow.trainer.actor import Actor
    from distflow.trainer.async_save import CheckpointWriter
    from distflow.trainer.stages import build_context, save_checkpoint
    from tests.process_group import process_group, store_path

    out = tmp_path / "run"
    cfg = config(toy_model, toy_data, out)
    gate, writing = threading.Event(), threading.Event()
    original = Actor._write_model

    def held(self, out_dir, state):  # the slow file system: the write waits at the gate
        writing.set()
        assert gate.wait(60)
        original(self, out_dir, state)

    monkeypatch.setattr(Actor, "_write_model", held)
    with process_group(store_path()):
        actor = Actor(cfg, with_reference=False)
        ctx = build_context(cfg, cfg.plan().pipeline("trainer"), actor)
        for p in actor.model.parameters():  # one optimizer step: there is optimizer state to write
            p.grad = torch.ones_like(p)
        actor.optim.step()
        actor.version = 1
        saved = {k: v.full_tensor().clone() for k, v in actor.optim.state_dict()["state"][0].items()
                 if isinstance(v, torch.Tensor) and v.dim()}
        writer = CheckpointWriter(timeout_s=120)
        ckpt = out / "checkpoint-1"
        save_checkpoint(ctx, ckpt, None, {"step": 1, "total_steps": 6, "seed": cfg.seed, "dataset": cfg.dataset,
                                          "data_order": data_order(cfg, 48)}, writer)
        assert writing.wait(60) and writer.busy()  # returned while its files are still being written
        assert not (ckpt / STATE_FILE).exists()
        assert newest_checkpoint(out) is None  # neither offered for recovery nor for resume_from
        with pytest.raises(FileNotFoundError, match="no distflow_state.json"):
            read_run_state(ckpt, cfg)
        for p in actor.model.parameters():  # training goes on: the checkpoint keeps what was copied
            p.grad = torch.ones_like(p)
        actor.optim.step()
        done = []
        writer.after(lambda: done.append((ckpt / STATE_FILE).is_file()))  # waits for the write's completion
        assert done == []
        gate.set()
        writer.close()
        assert done == [True] and not writer.busy()
        assert newest_checkpoint(out) == ckpt
        assert json.loads((ckpt / STATE_FILE).read_text())["policy_version"] == 1
        resumed = Actor(config(toy_model, toy_data, out, f"resume_from={ckpt}"), with_reference=False)
        state = resumed.optim.state_dict()["state"][0]
        for k, v in saved.items():  # the optimizer state of the save, not the later step's
            assert torch.equal(state[k].full_tensor(), v), k
        assert resumed.version == 1


def test_keep_checkpoints_keeps_the_newest_complete_ones_of_this_run(toy_model, toy_data, tmp_path):
    cfg = config(toy_model, toy_data, tmp_path, "keep_checkpoints=2", "save_every=1", "save_interval_s=0")
    old = tmp_path / "checkpoint-9"  # another run's (marked before this run started): never removed
    old.mkdir()
    mark_checkpoint(old, {"policy_version": 9})
    import os

    os.utime(old / STATE_FILE, (1000.0, 1000.0))
    saves = PeriodicSaves(cfg, since=2000.0)
    for step in (1, 2, 3, 4):
        ckpt = tmp_path / saves.name(step)
        ckpt.mkdir()
        mark_checkpoint(ckpt, {"policy_version": step})
        saves.saved(tmp_path, step, remove=True)()
    (tmp_path / "checkpoint-5").mkdir()  # being written (no marker): not counted, not removed
    assert prune_checkpoints(tmp_path, 2, since=2000.0) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4", "checkpoint-5",
                                                          "checkpoint-9"]
    assert sorted(p.name for p in prune_checkpoints(tmp_path, 1, since=2000.0)) == ["checkpoint-3"]
