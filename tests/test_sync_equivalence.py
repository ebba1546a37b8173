"""``max_staleness: 0`` is strictly on-policy: the distributed run reproduces a plain
synchronous loop (generate -> reward -> advantage -> update, one process, no network)
step for step, for the same seed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distflow.buffer.dataloader import PromptShard
from distflow.core.config import load_config
from distflow.rollout.engine import make_engine
from distflow.rollout.stages import run_pipeline
from distflow.trainer.actor import Actor
from distflow.trainer.metrics import read_metrics
from distflow.trainer.worker import train_step
from tests.conftest import ROOT, run_distflow

STEPS = 4


def synchronous_reference(cfg) -> list[dict]:
    """The textbook synchronous GRPO loop over the same functions, in this process."""
    from distflow.launcher import _free_ports

    torch.set_num_threads(1)
    port = _free_ports("127.0.0.1", 1)[0]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        loader = PromptShard(cfg.dataset, 0, 1, seed=cfg.seed, shuffle=cfg.shuffle)
        engine = make_engine("torch", cfg.model_path, dtype=cfg.dtype)
        plan = cfg.plan()
        actor = Actor(cfg, with_reference=True)
        out = []
        for step, (_, _, rows) in enumerate(loader.iterate(cfg.rollout_batch, cfg.epochs)):
            if step == STEPS:
                break
            seed = (cfg.seed * 1_000_003 + 0) * 100_003 + step
            batch = run_pipeline(plan.pipeline("rollout"), engine, cfg, rows, seed)
            stats = train_step(actor, plan.pipeline("trainer"), batch)
            engine.load_weights(actor.version, actor.full_state_dict())
            out.append({"reward_mean": float(batch.tensors["reward"].mean()), **stats})
        return out
    finally:
        dist.destroy_process_group()


def test_on_policy_run_matches_synchronous_loop(toy_model, toy_data, tmp_path):
    overrides = [f"output_dir={tmp_path / 'run'}", f"model_path={toy_model}", f"dataset={toy_data}",
                 "toy_model=false", "rollout_nodes=1", "trainer_nodes=1", "max_staleness=0", f"max_steps={STEPS}",
                 "prompts_per_step=8", "group_size=4", "max_new_tokens=2", "lr=0.01"]
    r = run_distflow(["run", "examples/grpo_quickstart.yaml", "--no-progress", *overrides], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    distributed = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["staleness_mean"] for m in distributed] == [0.0] * STEPS

    reference = synchronous_reference(load_config(ROOT / "examples" / "grpo_quickstart.yaml", overrides))
    assert len(reference) == STEPS
    for d, s in zip(distributed, reference):
        assert d["reward_mean"] == pytest.approx(s["reward_mean"], abs=1e-9)
        assert d["loss"] == pytest.approx(s["loss"], abs=1e-6)
        assert d["grad_norm"] == pytest.approx(s["grad_norm"], rel=1e-5)
    assert len({m["reward_mean"] for m in distributed}) > 1 or distributed[0]["loss"] != 0.0
