"""Every shipped algorithm trains on multi-turn episodes, and the token-level estimators skip an
episode's observation tokens: GAE hand-computed on a sample whose middle tokens are masked."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from distflow.buffer.batch import SampleBatch
from distflow.core.config import load_config, read_raw
from distflow.step import synchronous_run
from tests.conftest import ROOT
from tests.process_group import process_group, store_path

ALGORITHMS = ("grpo", "ppo", "dapo", "gspo", "cispo", "reinforce_pp")


def test_gae_runs_over_the_sampled_tokens_only(toy_model):
    """Response of 5 tokens, the middle two an observation (loss mask 0) whose values are junk.
    gamma = lam = 1, reward 1 on the last sampled token: A_t = 1 - V_t on the sampled tokens,
    0 on the others; the returns are 1 there. Unmasked, the junk values would enter the recursion."""
    from distflow.trainer.stages import TrainerContext, token_advantage

    cfg = load_config(ROOT / "examples" / "ppo_quickstart.yaml", [f"model_path={toy_model}", "toy_model=false",
                                                                  "gamma=1", "lam=1", "kl_coef=0"])
    node = next(n for n in cfg.workflow if n.fn == "gae").model_copy(update={"args": {"whiten": False}})
    batch = SampleBatch.from_lists(["e0:0:s0"], ["e0:0"], [[5, 6]], [[3, 4, 5, 6, 7]], [[-1.0] * 5])
    batch.set_ragged("loss_mask", torch.tensor([1, 1, 0, 0, 1]))
    batch.set_ragged("values", torch.tensor([0.1, 0.2, 9.0, -9.0, 0.3]))
    batch.set_scalar("reward", torch.tensor([1.0]))
    token_advantage(node, TrainerContext(cfg), batch)
    assert torch.allclose(batch.tensors["token_advantages"], torch.tensor([0.9, 0.8, 0.0, 0.0, 0.7]))
    assert torch.allclose(batch.tensors["returns"], torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0]))
    assert math.isclose(float(batch.tensors["advantage"][0]), 0.8, rel_tol=1e-6)  # mean over the sampled ones


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    from distflow.toy import ensure_toy_model

    return ensure_toy_model(tmp_path_factory.mktemp("tool-model") / "m", kind="tool")


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_every_shipped_algorithm_trains_on_episodes(algo, tool_model, tmp_path):
    """The algorithm's quickstart workflow with its generate node running episodes of the tool task
    (its successor reward node then scores the final reply, added to the environment's reward)."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(f'{{"prompt": "{i:04d}", "secret": "{i % 10}", "answer": "{i % 10}"}}\n'
                            for i in range(8)))
    raw = read_raw(ROOT / "examples" / f"{algo}_quickstart.yaml")
    raw["workflow"] = [{**n, "fn": "episodes"} if n["type"] == "MODEL_INFERENCE" and n["role"] == "ACTOR" else n
                       for n in raw["workflow"]]
    raw.update(model_path=str(tool_model), toy_model=False, dataset=str(data), prompts_per_step=4, group_size=2,
               max_new_tokens=3, rollout_nodes=1, trainer_nodes=1, micro_batch_size=8, output_dir=str(tmp_path / "o"),
               environment="distflow.env.toy_tasks:LookupEnv", max_turns=2, max_total_tokens=96,
               eval_dataset=None, overlong_buffer=min(raw.get("overlong_buffer", 1), 3))
    raw.pop("eval_every", None)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path)
    with process_group(store_path(tmp_path)):
        row = next(synchronous_run(cfg, 1))
    assert row["episodes"] >= 8 and row["samples"] > 0
    assert math.isfinite(row["loss"]) and 0 < row["tokens"] <= row["episode_sampled_tokens"], row
