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


def test_a_trainer_side_outcome_estimator_counts_a_split_episode_once(toy_model):
    """GRPO as an ACTOR COMPUTE node on the trainer group, over two ranks: episode A (reward 1) was
    split into two samples that landed on different ranks; B and C (reward 0) are whole. A counts
    once in its group ([1, 0, 0], not [1, 1, 0, 0]) and both its samples get its advantage: the
    rollout-side estimator's values, sample for sample."""
    import threading
    from types import SimpleNamespace

    from distflow.rollout.stages import _estimate
    from distflow.trainer.stages import TrainerContext, global_outcome_advantage

    cfg = load_config(ROOT / "examples" / "grpo_quickstart.yaml", [f"model_path={toy_model}", "toy_model=false"])
    node = next(n for n in cfg.workflow if n.fn == "grpo" and n.type.value == "COMPUTE")

    def batch_of(ids: list[str], episodes: list[str], rewards: list[float]) -> SampleBatch:
        b = SampleBatch.from_lists(ids, ["p"] * len(ids), [[5, 6]] * len(ids), [[3, 4, 5]] * len(ids),
                                   [[-1.0] * 3] * len(ids), extras=[{"episode": e} for e in episodes])
        b.set_ragged("loss_mask", torch.tensor([1, 0, 1] * len(ids)))
        b.set_scalar("reward", torch.tensor(rewards))
        b.set_scalar("truncated", torch.zeros(len(ids), dtype=torch.int64))
        return b

    ranks = [batch_of(["p:s0", "p:s1"], ["p:s0", "p:s1"], [1.0, 0.0]),  # A's first sample, B
             batch_of(["p:s0.1", "p:s2"], ["p:s0", "p:s2"], [1.0, 0.0])]  # A's second sample, C
    parts: list = [None, None]
    barrier = threading.Barrier(2)

    def all_gather(rank: int, obj):
        parts[rank] = obj
        barrier.wait(10)
        return list(parts)

    threads = [threading.Thread(target=global_outcome_advantage, name=f"rank{r}", args=(
        node, TrainerContext(cfg, all_gather=lambda obj, r=r: all_gather(r, obj), rank=r), ranks[r]))
        for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    got = [float(x) for b in ranks for x in b.tensors["advantage"]]  # A0, B, A1, C
    whole = batch_of(["p:s0", "p:s1", "p:s0.1", "p:s2"], ["p:s0", "p:s1", "p:s0", "p:s2"], [1.0, 0.0, 1.0, 0.0])
    ref = [float(x) for x in _estimate(node, SimpleNamespace(cfg=cfg), whole).tensors["advantage"]]
    assert got == pytest.approx(ref, abs=1e-6)
    assert got[0] == got[2] > 0 and got[1] == got[3] < 0
    # counted once: the group is [1, 0, 0]: A is 2/3 above the mean, B and C 1/3 below (GRPO scales both alike)
    assert got[0] / -got[1] == pytest.approx(2.0, rel=1e-5)
