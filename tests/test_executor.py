"""The plan-driven executors: rollout stages on a real TorchEngine, trainer stages on real batches.

Rollout: generate carries finish_reason (``truncated``) and versions, ``max_prompt_length``
skips and counts, DAPO dynamic sampling regenerates then drops constant groups, a learned
reward model (a real tiny LlamaForSequenceClassification) scores like a direct forward,
``overlong: mask`` zeroes truncated advantages. Trainer: GAE by hand, KL in reward, and
outcome estimators over the whole step (gathered from every rank).
"""

from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path

import pytest
import torch

from distflow.buffer.batch import SampleBatch
from distflow.buffer.dataloader import PromptRow
from distflow.core.config import ConfigError, config_from_dict
from distflow.core.dag import load_workflow
from distflow.rollout.engine import SamplingParams, make_engine
from distflow.rollout.stages import RolloutContext, StageError
from distflow.step import rollout_half, train_half as run_trainer_pipeline
from distflow.trainer.stages import TrainerContext

GEN = {"id": "generate", "role": "ACTOR", "type": "MODEL_INFERENCE", "fn": "generate"}
REWARD = {"id": "reward", "role": "REWARD", "type": "COMPUTE", "fn": "successor", "deps": ["generate"]}
ADV = {"id": "advantage", "role": "ACTOR", "type": "COMPUTE", "fn": "grpo", "deps": ["reward"]}
UPDATE = {"id": "update", "role": "ACTOR", "type": "MODEL_TRAIN", "fn": "grpo", "deps": ["advantage"]}


def run_pipeline(pipeline, engine, cfg, rows, seed, stats=None, refill=None):
    """The rollout half on one step's prompts (the rollout node's call, without the node)."""
    ctx = RolloutContext(engine, cfg, rows, seed, list(pipeline), stats if stats is not None else {}, refill=refill)
    return rollout_half(list(pipeline), ctx)


def make_cfg(model: Path | str = "unused", workflow=None, **kw):
    raw = {"model_path": str(model), "dataset": "unused.jsonl", "prompts_per_step": 2, "group_size": 4,
           "max_new_tokens": 3, "workflow": copy.deepcopy(workflow or [GEN, REWARD, ADV, UPDATE]), **kw}
    return config_from_dict(raw)


def rows(*prompts: str) -> list[PromptRow]:
    return [PromptRow(f"e0:{i}", i, {"prompt": p, "answer": str((int(p[-2]) + 1) % 10)}) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def engine(toy_model):
    eng = make_engine("torch", str(toy_model), device="cpu", dtype="float32")
    yield eng
    eng.close()


def rollout(cfg, engine, prompts, seed=3, stats=None):
    return run_pipeline(cfg.plan().pipeline("rollout"), engine, cfg, rows(*prompts), seed, stats)


# ----------------------------------------------------------------------------- rollout
def test_unusable_prompts_are_counted_and_the_step_goes_on(engine, toy_model) -> None:
    cfg = make_cfg(toy_model, max_new_tokens=2)
    good = rows("12=", "34=")
    bad = [PromptRow("e0:7", 7, {"prompt": [{"role": "user", "content": "12="}]}), PromptRow("e0:8", 8, {"prompt": 5})]
    stats: dict = {}
    batch = run_pipeline(cfg.plan().pipeline("rollout"), engine, cfg, [good[0], *bad, good[1]], 3, stats)
    assert sorted(set(batch.prompt_ids)) == ["e0:0", "e0:1"] and len(batch) == 2 * cfg.group_size
    assert stats["bad_prompts"] == 2


def test_generate_carries_finish_reason_and_versions(engine, toy_model) -> None:
    cfg = make_cfg(toy_model, max_new_tokens=2)
    batch = rollout(cfg, engine, ["123=", "4567="])
    prompts = [p.tolist() for p in batch.ragged("prompt_tokens")]
    comps = engine.generate(prompts, SamplingParams(max_new_tokens=2, temperature=1.0), seed=3)
    assert [c.tokens for c in comps] == [r.tolist() for r in batch.ragged("response_tokens")]
    assert batch.tensors["truncated"].tolist() == [int(c.finish_reason == "length") for c in comps]
    assert batch.tensors["truncated"].dtype == torch.int64
    assert batch.tensors["policy_version"].tolist() == [engine.version] * 8
    assert batch.tensors["last_version"].tolist() == [engine.version] * 8
    assert batch.sample_ids[:2] == ["e0:0:s0", "e0:0:s1"] and len(batch) == 8


def test_max_prompt_length_skips_and_counts(engine, toy_model) -> None:
    cfg = make_cfg(toy_model, max_prompt_length=5)
    stats: dict[str, int] = {}
    # "<bos>12=" is 4 tokens (kept); "<bos>12345=" is 7 (skipped); "<bos>1234=" is 6 (skipped)
    batch = rollout(cfg, engine, ["12=", "12345=", "1234="], stats=stats)
    assert stats == {"skipped_prompts": 2}
    assert set(batch.prompt_ids) == {"e0:0"} and len(batch) == 4
    stats = {}
    empty = rollout(cfg, engine, ["12345="], stats=stats)
    assert len(empty) == 0 and stats == {"skipped_prompts": 1}


def test_prompt_too_long_for_the_model_is_a_counted_skip_not_a_failed_step(engine, toy_model) -> None:
    """No max_prompt_length: the bound is the model's 64 positions less max_new_tokens (3), so a
    64-token prompt is skipped and counted while the rest of the step is generated."""
    assert engine.max_positions == 64
    cfg = make_cfg(toy_model)
    stats: dict[str, int] = {}
    batch = rollout(cfg, engine, ["12=", "1" * 62 + "=", "1" * 59 + "="], stats=stats)  # 4, 64 and 61 tokens
    assert stats == {"skipped_prompts": 1}
    assert set(batch.prompt_ids) == {"e0:0", "e0:2"} and len(batch) == 8


_COUNTER = itertools.count()


def alternating_or_constant(response: str, row: dict) -> float:
    """Test reward: 1 for rows marked const, else alternating 0/1 (so every group of >= 2 varies)."""
    return 1.0 if row.get("const") else float(next(_COUNTER) % 2)


def test_dynamic_sampling_regenerates_then_drops_constant_groups(engine, toy_model) -> None:
    wf = [GEN, {**REWARD, "fn": "tests.test_executor:alternating_or_constant"},
          {"id": "filter", "role": "ACTOR", "type": "COMPUTE", "fn": "dynamic_sampling", "deps": ["reward"],
           "args": {"max_retries": 2}},
          {**ADV, "deps": ["filter"]}, UPDATE]
    cfg = make_cfg(toy_model, workflow=wf)
    rs = rows("12=", "345=", "678=")
    rs[1].data["const"] = True
    stats: dict[str, float] = {}
    batch = run_pipeline(cfg.plan().pipeline("rollout"), engine, cfg, rs, 5, stats)
    # 1 prompt, regenerated twice, then dropped; what was generated first is counted before the
    # filter: 4 samples of the constant prompt score 1, the other 8 alternate 0/1
    assert stats == {"resampled_prompts": 2, "dropped_prompts": 1, "generated_samples": 12, "generated_reward": 8.0}
    assert sorted(set(batch.prompt_ids)) == ["e0:0", "e0:2"] and len(batch) == 8
    # every group left varies, so its advantages are not all zero
    for p in ("e0:0", "e0:2"):
        adv = batch.tensors["advantage"][[i for i, q in enumerate(batch.prompt_ids) if q == p]]
        assert adv.abs().sum() > 0
    # all groups constant: nothing to learn, but the step is kept whole (never empty)
    for r in rs:
        r.data["const"] = True
    stats = {}
    batch = run_pipeline(cfg.plan().pipeline("rollout"), engine, cfg, rs, 5, stats)
    assert len(batch) == 12 and stats == {"resampled_prompts": 6, "generated_samples": 12, "generated_reward": 12.0}
    assert batch.tensors["advantage"].abs().sum() == 0


def test_dynamic_sampling_refills_with_fresh_prompts(engine, toy_model) -> None:
    """refill: fresh (the default, DAPO's recipe): a constant group's prompt is replaced by new
    prompts from the shard (here a stub source), retried while the replacements are constant too;
    refill: same keeps regenerating the step's own prompt."""
    def wf(**args):
        return [GEN, {**REWARD, "fn": "tests.test_executor:alternating_or_constant"},
                {"id": "filter", "role": "ACTOR", "type": "COMPUTE", "fn": "dynamic_sampling", "deps": ["reward"],
                 "args": {"max_retries": 2, **args}},
                {**ADV, "deps": ["filter"]}, UPDATE]

    asked: list[tuple[int, int]] = []

    def refill(attempt: int, n: int) -> list[PromptRow]:
        asked.append((attempt, n))
        fresh = [PromptRow(f"fresh{attempt}:{k}", 100 + k, {"prompt": "12=", "const": attempt == 0}) for k in range(n)]
        return fresh

    cfg = make_cfg(toy_model, workflow=wf())
    rs = rows("12=", "345=", "678=")
    rs[1].data["const"] = True
    stats: dict[str, float] = {}
    batch = run_pipeline(cfg.plan().pipeline("rollout"), engine, cfg, rs, 5, stats, refill=refill)
    # attempt 0's replacement is constant too, attempt 1's varies: kept, the step keeps 3 prompts
    assert asked == [(0, 1), (1, 1)]
    assert sorted(set(batch.prompt_ids)) == ["e0:0", "e0:2", "fresh1:0"] and len(batch) == 12
    assert stats == {"resampled_prompts": 2, "dropped_prompts": 0, "generated_samples": 12, "generated_reward": 8.0}
    # a replacement that is too long is skipped and counted, and the group it was to replace counts
    # as dropped (the step shrank by one prompt)
    def too_long(attempt: int, n: int) -> list[PromptRow]:
        return [PromptRow(f"long{attempt}:{k}", 200 + k, {"prompt": "1234567890" * 3}) for k in range(n)]

    stats = {}
    batch = run_pipeline(cfg.plan().pipeline("rollout"), engine, make_cfg(toy_model, workflow=wf(),
                         max_prompt_length=8), rs, 5, stats, refill=too_long)
    assert sorted(set(batch.prompt_ids)) == ["e0:0", "e0:2"]
    assert stats["skipped_prompts"] == stats["dropped_prompts"] == stats["resampled_prompts"] == 1
    # every group constant and every replacement unusable: the step falls back to its first batch,
    # whole, so nothing counts as dropped (the replacements count as resampled and skipped)
    const = rows("12=", "345=")
    for r in const:
        r.data["const"] = True
    stats = {}
    batch = run_pipeline(cfg.plan().pipeline("rollout"), engine, make_cfg(toy_model, workflow=wf(),
                         max_prompt_length=8), const, 5, stats, refill=too_long)
    assert sorted(set(batch.prompt_ids)) == ["e0:0", "e0:1"] and len(batch) == 8
    assert stats.get("dropped_prompts", 0) == 0 and stats["skipped_prompts"] == stats["resampled_prompts"] == 2
    asked.clear()
    cfg = make_cfg(toy_model, workflow=wf(refill="same"))
    batch = run_pipeline(cfg.plan().pipeline("rollout"), engine, cfg, rs, 5, {}, refill=refill)
    assert asked == [] and sorted(set(batch.prompt_ids)) == ["e0:0", "e0:2"]
    with pytest.raises(ConfigError, match=r"args.refill must be one of fresh, same \(got 'new'\)"):
        make_cfg(toy_model, workflow=wf(refill="new"))  # the config refuses it (distflow.rl.node_args)


def test_overlong_mask_zeroes_truncated_advantages(engine, toy_model) -> None:
    wf = [GEN, {**REWARD, "fn": "tests.test_executor:alternating_or_constant"}, ADV, UPDATE]
    cfg = make_cfg(toy_model, workflow=wf, overlong="mask", max_new_tokens=2)
    batch = rollout(cfg, engine, ["12=", "345="])
    trunc = batch.tensors["truncated"].bool()
    assert trunc.any()
    assert batch.tensors["advantage"][trunc].abs().sum() == 0
    ref = make_cfg(toy_model, workflow=wf, max_new_tokens=2)
    assert rollout(ref, engine, ["12=", "345="]).tensors["advantage"].abs().sum() > 0


def test_overlong_penalty_shapes_the_advantage_not_the_logged_reward(engine, toy_model) -> None:
    wf = [GEN, {**REWARD, "fn": "tests.test_executor:alternating_or_constant"}, ADV, UPDATE]
    cfg = make_cfg(toy_model, workflow=wf, overlong="penalty", overlong_buffer=1, max_new_tokens=2)
    for r in (rs := rows("12=", "345=")):
        r.data["const"] = True  # every task reward 1: only the length penalty varies
    batch = run_pipeline(cfg.plan().pipeline("rollout"), engine, cfg, rs, 3, {})
    assert batch.tensors["reward"].tolist() == [1.0] * 8
    lens = batch.tensors["response_lens"]
    adv = batch.tensors["advantage"]
    # penalty: 0 for 1 token, -1 for 2 (the limit): longer responses get a lower advantage
    for p in set(batch.prompt_ids):
        idx = [i for i, q in enumerate(batch.prompt_ids) if q == p]
        for i in idx:
            for j in idx:
                if lens[i] < lens[j]:
                    assert adv[i] > adv[j]


def test_pipeline_out_of_order_is_an_error_naming_the_node(engine, toy_model) -> None:
    cfg = make_cfg(toy_model)
    pipe = cfg.plan().pipeline("rollout")
    with pytest.raises(StageError, match=r"workflow node 'advantage': deps \['reward'\] have not run"):
        run_pipeline([pipe[0], pipe[2], pipe[1]], engine, cfg, rows("12="), 0)


# ----------------------------------------------------------------------------- learned reward model
def test_reward_model_stage_scores_like_a_direct_forward(engine, toy_model, reward_model_dir) -> None:
    from transformers import AutoModelForSequenceClassification

    rm_node = {"id": "rm", "role": "REWARD", "type": "MODEL_INFERENCE", "fn": "reward_model", "deps": ["generate"],
               "group": "rollout", "args": {"path": str(reward_model_dir), "weight": 2.0}}
    cfg = make_cfg(toy_model, workflow=[GEN, rm_node, {**ADV, "deps": ["rm"]}, UPDATE])
    assert cfg.plan().group_of["rm"] == "rollout"
    batch = rollout(cfg, engine, ["12=", "4567="])
    model = AutoModelForSequenceClassification.from_pretrained(str(reward_model_dir)).eval()
    expected = []
    with torch.no_grad():
        for p, r in zip(batch.ragged("prompt_tokens"), batch.ragged("response_tokens")):
            ids = torch.cat([p, r])[None]
            expected.append(2.0 * float(model(input_ids=ids).logits[0, 0]))  # one unpadded sequence: last token
    assert torch.allclose(batch.tensors["reward"], torch.tensor(expected), atol=1e-4)
    assert len(set(round(x, 4) for x in expected)) > 1  # scores differ between samples
    # the same stage on the trainer group scores the same way
    tctx = TrainerContext(cfg)
    tnode = load_workflow([{**rm_node, "group": "trainer"}])[0]
    b2 = SampleBatch(batch.sample_ids, batch.prompt_ids, {k: v for k, v in batch.tensors.items() if k != "reward"})
    run_trainer_pipeline([tnode], tctx, b2)
    assert torch.allclose(b2.tensors["reward"], batch.tensors["reward"], atol=1e-5)
    # without args.dtype the reward model runs in the run's compute dtype (a 7B one in fp32 is 30 GB)
    from distflow.rl import reward_model as rmod

    b3 = SampleBatch(batch.sample_ids, batch.prompt_ids, {k: v for k, v in batch.tensors.items() if k != "reward"})
    run_trainer_pipeline([tnode], TrainerContext(make_cfg(toy_model, workflow=cfg.workflow, dtype="bfloat16")), b3)
    assert (str(reward_model_dir.resolve()), "cpu", "torch.bfloat16") in rmod._CACHE
    assert torch.allclose(b3.tensors["reward"], batch.tensors["reward"], atol=0.1)


def test_reward_model_errors_name_the_node(engine, toy_model, tmp_path) -> None:
    rm_node = {"id": "rm", "role": "REWARD", "type": "MODEL_INFERENCE", "fn": "reward_model", "deps": ["generate"],
               "group": "rollout", "args": {}}
    with pytest.raises(ConfigError, match=r"workflow node 'rm' \(reward_model\): args.path is required"):
        make_cfg(toy_model, workflow=[GEN, rm_node, {**ADV, "deps": ["rm"]}, UPDATE])
    rm_node["args"] = {"path": str(tmp_path)}
    cfg = make_cfg(toy_model, workflow=[GEN, rm_node, {**ADV, "deps": ["rm"]}, UPDATE])
    with pytest.raises(StageError, match="workflow node 'rm': .*not a Hugging Face model directory"):
        rollout(cfg, engine, ["12="])


# ----------------------------------------------------------------------------- trainer stages
PPO_WF = [GEN, REWARD,
          {"id": "reference", "role": "REFERENCE", "type": "MODEL_INFERENCE", "fn": "ref", "deps": ["generate"]},
          {"id": "values", "role": "CRITIC", "type": "MODEL_INFERENCE", "fn": "value", "deps": ["generate"]},
          {"id": "gae", "role": "ACTOR", "type": "COMPUTE", "fn": "gae", "deps": ["reward", "values", "reference"],
           "args": {"whiten": False}},
          {"id": "update", "role": "ACTOR", "type": "MODEL_TRAIN", "fn": "ppo", "deps": ["gae"]}]


def one_sample(**tensors) -> SampleBatch:
    b = SampleBatch.from_lists(["s0"], ["p0"], [[2, 5]], [[6, 7]], [[-1.0, -1.0]])
    for k, v in tensors.items():
        (b.set_ragged if k in ("values", "ref_logprobs") else b.set_scalar)(k, torch.tensor(v))
    return b


def test_gae_stage_by_hand() -> None:
    cfg = make_cfg(workflow=PPO_WF, gamma=1.0, lam=1.0)
    gae_node = cfg.plan().node("gae")
    b = one_sample(values=[0.5, 0.25], reward=[1.0])
    run_trainer_pipeline([gae_node], TrainerContext(cfg), b)
    # token rewards [0, 1]; delta_1 = 1 - 0.25 = 0.75; delta_0 = 0 + 0.25 - 0.5 = -0.25
    # A = [-0.25 + 0.75, 0.75] = [0.5, 0.75]; returns = A + V = [1, 1]
    assert torch.allclose(b.tensors["token_advantages"], torch.tensor([0.5, 0.75]))
    assert torch.allclose(b.tensors["returns"], torch.tensor([1.0, 1.0]))
    # KL in reward (coef 0.5) with k1, the default kl_reward_estimator whatever kl_estimator (the loss
    # term's) says: kl = logp - ref = [-1 - (-2), 0] = [1, 0] -> rewards [-0.5, 1]
    cfg = make_cfg(workflow=PPO_WF, gamma=1.0, lam=1.0, kl_in_reward=True, kl_coef=0.5, kl_estimator="k3")
    assert cfg.kl_reward_estimator == "k1"
    b = one_sample(values=[0.5, 0.25], reward=[1.0], ref_logprobs=[-2.0, -1.0])
    run_trainer_pipeline([gae_node], TrainerContext(cfg), b)
    # delta_0 = -0.5 + 0.25 - 0.5 = -0.75; A = [0, 0.75]; returns [0.5, 1]
    assert torch.allclose(b.tensors["token_advantages"], torch.tensor([0.0, 0.75]))
    assert torch.allclose(b.tensors["returns"], torch.tensor([0.5, 1.0]))
    # kl_reward_estimator k2: kl = 0.5 (logp - ref)^2 = [0.5, 0] -> rewards [-0.25, 1]
    # delta_0 = -0.25 + 0.25 - 0.5 = -0.5; A = [-0.5 + 0.75, 0.75] = [0.25, 0.75]; returns [0.75, 1]
    cfg = make_cfg(workflow=PPO_WF, gamma=1.0, lam=1.0, kl_in_reward=True, kl_coef=0.5, kl_reward_estimator="k2")
    b = one_sample(values=[0.5, 0.25], reward=[1.0], ref_logprobs=[-2.0, -1.0])
    run_trainer_pipeline([gae_node], TrainerContext(cfg), b)
    assert torch.allclose(b.tensors["token_advantages"], torch.tensor([0.25, 0.75]))
    assert torch.allclose(b.tensors["returns"], torch.tensor([0.75, 1.0]))


def other_rank(tokens: list[float]):
    """The trainer group's all-reduce as if a second rank held ``tokens`` (trained token advantages):
    whitening reduces (count, sum), then the squared deviations from the global mean."""
    mean: list[float] = []

    def all_reduce(v: list[float]) -> list[float]:
        if len(v) == 2:
            n, s = v[0] + len(tokens), v[1] + sum(tokens)
            mean.append(s / n)
            return [n, s]
        return [v[0] + sum((x - mean[-1]) ** 2 for x in tokens)]
    return all_reduce


def test_gae_whitening_is_over_every_rank() -> None:
    cfg = make_cfg(workflow=PPO_WF, gamma=1.0, lam=1.0)
    node = load_workflow([{**PPO_WF[4], "args": {}}])[0]
    b = one_sample(values=[0.5, 0.25], reward=[1.0])
    # another rank contributes 2 tokens, 1.5 and -0.5 (sum 1.0, squares 2.5): n = 4,
    # sum = 0.5 + 0.75 + 1 = 2.25, sum sq = 0.25 + 0.5625 + 2.5 = 3.3125
    run_trainer_pipeline([node], TrainerContext(cfg, all_reduce=other_rank([1.5, -0.5])), b)
    mean = 2.25 / 4
    std = math.sqrt((3.3125 / 4 - mean ** 2) * 4 / 3)
    assert torch.allclose(b.tensors["token_advantages"], torch.tensor([(0.5 - mean) / std, (0.75 - mean) / std]),
                          atol=1e-5)


def test_token_whitening_keeps_a_tiny_spread() -> None:
    """Returns of 1 + a spread of 1e-3 or 1e-5 (a step where every sample is right, the KL's noise
    on top) whiten as verl does, (a - mean) * rsqrt(var + 1e-8) in fp64: unit variance, or at most
    1e4 x. A one-pass fp32 E[a^2] - mean^2 cancelled to 0 and scaled the noise by 1e8."""
    from distflow.trainer.stages import _whiten_tokens

    cfg = make_cfg(workflow=PPO_WF, gamma=1.0, lam=1.0)
    b = SampleBatch.from_lists([f"s{i}" for i in range(64)], [f"p{i}" for i in range(64)], [[1]] * 64,
                               [[2, 3, 4]] * 64, [[-1.0] * 3] * 64)
    mask = torch.ones(64, 3, dtype=torch.bool)
    for spread, std in ((1e-3, 1.0), (1e-5, 0.0995)):
        adv = 1.0 + spread * torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
        out = _whiten_tokens(TrainerContext(cfg), b, adv, mask).double()
        a = adv.double()
        expect = (a - a.mean()) * torch.rsqrt(a.var() + 1e-8)
        assert torch.allclose(out, expect, atol=1e-4), spread
        assert float(out.std()) == pytest.approx(std, rel=0.05), spread  # the sample spread is not exact
    same = _whiten_tokens(TrainerContext(cfg), b, torch.ones(64, 3), mask)  # no spread: centred, not blown up
    assert float(same.abs().max()) == 0.0


def test_trainer_outcome_estimator_sees_the_whole_step() -> None:
    adv_node = {**ADV, "group": "trainer"}
    cfg = make_cfg(workflow=[GEN, REWARD, adv_node, UPDATE])
    node = cfg.plan().node("advantage")
    assert cfg.plan().group_of["advantage"] == "trainer"
    b = SampleBatch.from_lists(["a:s0", "b:s0"], ["a", "b"], [[1], [1]], [[2], [3]])
    b.set_scalar("reward", torch.tensor([1.0, 1.0]))
    # rank 1 holds the rest of both groups: a -> [1, 0], b -> [1, 1] (constant)
    other = (["a", "b"], [0.0, 1.0], [1, 1], [None, None])  # (prompt ids, rewards, response lengths, episodes)
    ctx = TrainerContext(cfg, all_gather=lambda mine: [mine, other], rank=0)
    run_trainer_pipeline([node], ctx, b)
    # group a: mean 0.5, unbiased std 0.707107 -> +0.707106; group b constant -> 0
    assert torch.allclose(b.tensors["advantage"], torch.tensor([0.707106, 0.0]), atol=1e-5)


@pytest.mark.parametrize("group", ["rollout", "trainer"])
def test_reinforce_pp_stage_whitens_over_response_tokens(group) -> None:
    """Both groups' advantage stages give REINFORCE++ each sample's response length: rewards
    [1, 0] with responses of 1 and 3 tokens whiten to [1.5, -0.5] (per sample: +-0.707)."""
    cfg = make_cfg(workflow=[GEN, REWARD, {**ADV, "fn": "reinforce_pp", "group": group}, UPDATE], group_size=1)
    node = cfg.plan().node("advantage")
    if group == "trainer":  # rank 1 holds the other sample, a 3-token response with reward 0
        b = SampleBatch.from_lists(["a:s0"], ["a"], [[1]], [[2]])
        b.set_scalar("reward", torch.tensor([1.0]))
        ctx = TrainerContext(cfg, all_gather=lambda mine: [mine, (["b"], [0.0], [3], [None])], rank=0)
        run_trainer_pipeline([node], ctx, b)
        assert torch.allclose(b.tensors["advantage"], torch.tensor([1.5]), atol=1e-5)
        return
    b = SampleBatch.from_lists(["a:s0", "b:s0"], ["a", "b"], [[1], [1]], [[2], [2, 3, 4]])
    b.set_scalar("reward", torch.tensor([1.0, 0.0]))

    rollout_half([node], RolloutContext(None, cfg, [], 0), b)
    assert torch.allclose(b.tensors["advantage"], torch.tensor([1.5, -0.5]), atol=1e-5)


RPP_TOKEN = {"id": "advantage", "role": "ACTOR", "type": "COMPUTE", "fn": "reinforce_pp_token",
             "deps": ["reward", "reference"]}
RPP_WF = [GEN, REWARD, PPO_WF[2], RPP_TOKEN, {**UPDATE, "fn": "reinforce_pp"}]


def test_reinforce_pp_token_stage_by_hand() -> None:
    """REINFORCE++ with the KL in the reward: discounted returns of the token rewards, then
    whitened over the step's tokens (every rank's: the reduce)."""
    cfg = make_cfg(workflow=RPP_WF, group_size=1, gamma=0.5, kl_in_reward=True, kl_coef=0.5)
    p = cfg.plan()
    assert p.group_of["advantage"] == "trainer" and [n.id for n in p.pipeline("trainer")] == [
        "reference", "advantage", "update"]
    node = load_workflow([{**RPP_TOKEN, "args": {"whiten": False}}])[0]
    b = one_sample(reward=[1.0], ref_logprobs=[-2.0, -1.0])
    run_trainer_pipeline([node], TrainerContext(cfg), b)
    # kl (k1) = logp - ref = [1, 0] -> token rewards [-0.5, 1]; G_1 = 1, G_0 = -0.5 + 0.5 * 1 = 0
    assert torch.allclose(b.tensors["token_advantages"], torch.tensor([0.0, 1.0]))
    assert torch.allclose(b.tensors["advantage"], torch.tensor([0.5]))
    assert "returns" not in b.tensors  # no critic to train
    # whitened with another rank's 2 tokens (sum 1.0, squares 2.5): n = 4, sum 2.0, sum sq 3.5
    b = one_sample(reward=[1.0], ref_logprobs=[-2.0, -1.0])
    ctx = TrainerContext(cfg, all_reduce=other_rank([1.5, -0.5]))
    run_trainer_pipeline([cfg.plan().node("advantage")], ctx, b)
    mean = 2.0 / 4
    std = math.sqrt((3.5 / 4 - mean ** 2) * 4 / 3)
    assert torch.allclose(b.tensors["token_advantages"], torch.tensor([-mean / std, (1 - mean) / std]), atol=1e-5)
    # an empty rank still joins the reduce and sets empty fields
    calls: list[list[float]] = []
    e = SampleBatch.from_lists([], [], [], [], [])
    two = other_rank([1.5, -0.5])
    run_trainer_pipeline([cfg.plan().node("advantage")],
                         TrainerContext(cfg, all_reduce=lambda v: calls.append(list(v)) or two(v)), e)
    assert calls == [[0.0, 0.0], [0.0]] and e.tensors["token_advantages"].numel() == 0


def test_reinforce_pp_token_without_kl_is_the_outcome_estimator() -> None:
    """gamma 1 and no KL: every token's return is its sample's reward, and whitening over tokens
    gives what the outcome reinforce_pp gives (it weighs each sample by its response length)."""
    cfg = make_cfg(workflow=[GEN, REWARD, {**RPP_TOKEN, "deps": ["reward"]}, UPDATE], group_size=1)
    assert cfg.plan().group_of["advantage"] == "trainer"  # a token-level estimator, whatever its deps
    b = SampleBatch.from_lists(["a:s0", "b:s0", "c:s0"], ["a", "b", "c"], [[1], [1], [1]],
                               [[2], [2, 3, 4], [5, 6]], [[-1.0], [-1.0] * 3, [-1.0] * 2])
    b.set_scalar("reward", torch.tensor([1.0, 0.0, 0.5]))
    run_trainer_pipeline([cfg.plan().node("advantage")], TrainerContext(cfg), b)
    from distflow.rl.advantages import reinforce_pp_advantages

    per_sample = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 0.5]), torch.arange(3),
                                         token_counts=torch.tensor([1, 3, 2]))
    expect = per_sample.repeat_interleave(torch.tensor([1, 3, 2]))
    assert torch.allclose(b.tensors["token_advantages"], expect, atol=1e-5)
    assert torch.allclose(b.tensors["advantage"], per_sample, atol=1e-5)


@pytest.mark.parametrize("group", ["rollout", "trainer"])
def test_outcome_reinforce_pp_leaves_truncated_samples_out_of_its_statistics(group: str) -> None:
    """overlong: mask takes a truncated sample out of the loss and out of the token form's
    whitening; the outcome form kept it in its mean and std, then zeroed its advantage. Here the
    two samples trained on both have reward 1 and the truncated two 0: the outcome form gave the
    trained ones +1.354 (pushed up although they do not differ), the token form 0."""

    def batch() -> SampleBatch:
        b = SampleBatch.from_lists(["a:s0", "a:s1", "b:s0", "b:s1"], ["a", "a", "b", "b"], [[1]] * 4,
                                   [[2, 3], [2, 3, 4, 5], [6, 7], [6, 7, 8, 9]], [[-1.0] * 2, [-1.0] * 4] * 2)
        b.set_scalar("reward", torch.tensor([1.0, 0.0, 1.0, 0.0]))
        b.set_scalar("truncated", torch.tensor([0, 1, 0, 1]))
        return b

    token = make_cfg(workflow=[GEN, REWARD, {**RPP_TOKEN, "deps": ["reward"]}, UPDATE], overlong="mask")
    b = batch()
    run_trainer_pipeline([token.plan().node("advantage")], TrainerContext(token), b)
    assert torch.equal(b.tensors["advantage"], torch.zeros(4))
    for fn in ("reinforce_pp", "reinforce_pp_baseline"):
        cfg = make_cfg(workflow=[GEN, REWARD, {**ADV, "fn": fn, "group": group}, UPDATE], overlong="mask")
        b = batch()
        if group == "trainer":
            run_trainer_pipeline([cfg.plan().node("advantage")], TrainerContext(cfg), b)
        else:
            rollout_half([cfg.plan().node("advantage")], RolloutContext(None, cfg, [], 0), b)
        assert torch.allclose(b.tensors["advantage"], torch.zeros(4), atol=1e-6), (fn, b.tensors["advantage"])
    # without the mask every sample trains and counts: rewards 1, 0, 1, 0 over 2, 4, 2, 4 tokens
    cfg = make_cfg(workflow=[GEN, REWARD, {**ADV, "fn": "reinforce_pp", "group": group}, UPDATE])
    b = batch()
    if group == "trainer":
        run_trainer_pipeline([cfg.plan().node("advantage")], TrainerContext(cfg), b)
    else:
        rollout_half([cfg.plan().node("advantage")], RolloutContext(None, cfg, [], 0), b)
    mean, n = 4 / 12, 12
    std = math.sqrt((4 * (1 - mean) ** 2 + 8 * mean ** 2) / (n - 1))
    expect = torch.tensor([(1 - mean) / std, -mean / std] * 2)
    assert torch.allclose(b.tensors["advantage"], expect, atol=1e-5)


def test_token_level_estimators_are_placed_on_the_trainer() -> None:
    with pytest.raises(ConfigError, match=r"reinforce_pp_token runs on the trainer group only, not on "
                                          r"'rollout' \(key 'group'\)"):
        make_cfg(workflow=[GEN, REWARD, {**RPP_TOKEN, "deps": ["reward"], "group": "rollout"}, UPDATE])
    # kl_in_reward reads the reference logprobs: the reference must run before the estimator
    late_ref = [GEN, REWARD, {**RPP_TOKEN, "deps": ["reward"]},
                {**PPO_WF[2], "deps": ["advantage"]}, {**UPDATE, "deps": ["advantage", "reference"]}]
    with pytest.raises(ConfigError, match=r"kl_in_reward: workflow node 'advantage' \(reinforce_pp_token\) puts "
                                          r"the KL into per-token rewards, but the REFERENCE MODEL_INFERENCE node "
                                          r"runs after it"):
        make_cfg(workflow=late_ref, kl_in_reward=True, kl_coef=0.1)
    make_cfg(workflow=late_ref, kl_coef=0.1)  # a KL loss term reads it in the update: fine
    # DAPO's filter regenerates prompts: after a token-level estimator it would land on the trainer
    filt = {"id": "filter", "role": "ACTOR", "type": "COMPUTE", "fn": "dynamic_sampling", "deps": ["advantage"]}
    with pytest.raises(ConfigError, match=r"workflow node 'filter': dynamic_sampling regenerates prompts, so it runs "
                                          r"on the rollout group, not on 'trainer'"):
        make_cfg(workflow=[GEN, REWARD, {**RPP_TOKEN, "deps": ["reward"]}, filt, {**UPDATE, "deps": ["filter"]}])
    # and the trainer stage never trains a KL-in-reward run without the KL
    cfg = make_cfg(workflow=RPP_WF, kl_in_reward=True, kl_coef=0.5)
    with pytest.raises(ValueError, match=r"workflow node 'advantage': kl_in_reward needs the reference logprobs"):
        run_trainer_pipeline([cfg.plan().node("advantage")], TrainerContext(cfg), one_sample(reward=[1.0]))


# ----------------------------------------------------------------------------- config validation
@pytest.mark.parametrize("fn", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimators_need_group_size_2(fn) -> None:
    with pytest.raises(ConfigError, match=rf"group_size: 1 gives workflow node 'advantage' \({fn}, a group"):
        make_cfg(workflow=[GEN, REWARD, {**ADV, "fn": fn}, UPDATE], group_size=1)
    make_cfg(workflow=[GEN, REWARD, {**ADV, "fn": "reinforce_pp"}, UPDATE], group_size=1)  # no group baseline


def test_temperature_0_and_overlong_buffer_are_rejected_by_key() -> None:
    with pytest.raises(ConfigError, match=r"temperature: 0 \(greedy\)"):
        make_cfg(temperature=0)
    with pytest.raises(ConfigError, match=r"overlong_buffer: overlong: penalty needs 0 < overlong_buffer"):
        make_cfg(overlong="penalty", overlong_buffer=0)
    with pytest.raises(ConfigError, match=r"loss_agg"):
        make_cfg(loss_agg="sum")
