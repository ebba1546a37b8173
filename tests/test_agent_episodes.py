"""Multi-turn episodes through the step (issue 35): a two-turn tool episode becomes one SampleBatch
row whose loss mask is 1 exactly on the token ids the engine sampled, the environment's rewards
and the episode counters reach the step, and the trainer's loss reads the mask (a hand-computed
value on a tiny case)."""

from __future__ import annotations

import math

import pytest
import torch

from distflow.buffer.batch import SampleBatch
from distflow.buffer.dataloader import PromptRow
from distflow.core.config import load_config
from distflow.rollout.protocol import Completion
from distflow.rollout.stages import RolloutContext
from distflow.step import rollout_half
from tests.conftest import ROOT
from tests.process_group import process_group, store_path

EXAMPLE = ROOT / "examples" / "tool_quickstart.yaml"


class FakeEngine:
    """The engine's batch API over a script: a prompt without a tool response gets ``first`` (a
    tool call), one with a tool response gets ``second`` (the secret copied); records the prompts."""

    max_positions = 128

    def __init__(self, tokenizer, first: list[int], second_of: dict[str, list[int]]):
        self.tokenizer, self.first, self.second_of, self.version = tokenizer, first, second_of, 3
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params, seed=None, **kw):
        out = []
        for p in prompts:
            self.prompts.append(list(p))
            text = self.tokenizer.decode(p, skip_special_tokens=False)
            ids = self.first if "<tool_response>" not in text else self.second_of[text.split("<|im_end|>")[0][-4:]]
            out.append(Completion(list(ids), [-0.5 - i for i in range(len(ids))], "stop", 3, 3))
        return out


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    from distflow.toy import ensure_toy_model

    return ensure_toy_model(tmp_path_factory.mktemp("tool-model") / "m", kind="tool")


def _cfg(model, *over):
    return load_config(EXAMPLE, [f"model_path={model}", "toy_model=false", "rollout_nodes=1", "trainer_nodes=1",
                                 "prompts_per_step=2", "group_size=2", *over])


def test_a_two_turn_tool_episode_trains_exactly_the_sampled_tokens(tool_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model)
    call, end = tok.convert_tokens_to_ids(["<tool_call>", "<|im_end|>"])
    digit = {str(d): tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    rows = [PromptRow("e0:0", 0, {"prompt": "1234", "secret": "7"}), PromptRow("e0:1", 1, {"prompt": "5678",
                                                                                           "secret": "2"})]
    engine = FakeEngine(tok, [call, end], {"1234": [digit["7"], end], "5678": [digit["3"], end]})  # 5678: wrong
    cfg = _cfg(tool_model)
    ctx = RolloutContext(engine, cfg, rows, seed=0, pipeline=cfg.plan().pipeline("rollout"))
    batch = rollout_half(ctx.pipeline, ctx)
    assert batch.sample_ids == ["e0:0:s0", "e0:0:s1", "e0:1:s0", "e0:1:s1"]  # no split: one row per episode
    assert batch.tensors["reward"].tolist() == [1.0, 1.0, 0.5, 0.5]  # the tool's 0.5, the answer's 0.5
    assert batch.tensors["policy_version"].tolist() == [3] * 4 and batch.tensors["last_version"].tolist() == [3] * 4
    adv = batch.tensors["advantage"]
    assert adv.shape == (4,) and torch.all(adv == 0)  # GRPO over the episodes of a row: equal rewards
    for i, (prompt, resp, mask, lp) in enumerate(zip(batch.ragged("prompt_tokens"), batch.ragged("response_tokens"),
                                                     batch.ragged("loss_mask"), batch.ragged("logprobs"))):
        mine = [p for p in engine.prompts if rows[i // 2].data["prompt"] in tok.decode(p)]
        first_prompt = min(mine, key=len)
        assert prompt.tolist() == first_prompt  # the prompt: the tokens before the first sampled one
        second_prompt = max(mine, key=len)
        observation = second_prompt[len(first_prompt) + 2:]  # what the template added after turn 1
        answer = [digit["7"] if i < 2 else digit["3"], end]
        assert resp.tolist() == [call, end] + observation + answer
        assert mask.tolist() == [1, 1] + [0] * len(observation) + [1, 1]  # 1 exactly on the sampled ids
        assert observation and tok.convert_tokens_to_ids("<tool_response>") in observation
        assert lp.tolist() == [-0.5, -1.5] + [0.0] * len(observation) + [-0.5, -1.5]  # sampled; 0 where masked
        assert batch.extras[i]["final_reply"] == ("7" if i < 2 else "3")
    stats = ctx.stats
    assert stats["episodes"] == 4 and stats["episode_turns"] == 8 and stats["episodes_with_tool_call"] == 4
    assert stats["stop_done"] == 4 and stats["episode_splits"] == 0
    # the wire form keeps the mask (a trainer on another host gets it)
    meta, tensors = batch.to_wire()
    assert torch.equal(SampleBatch.from_wire(meta, tensors).tensors["loss_mask"], batch.tensors["loss_mask"])


def test_config_pairs_fn_episodes_with_an_environment(tool_model):
    with pytest.raises(Exception, match="fn: episodes"):
        _cfg(tool_model, "environment=null")
    with pytest.raises(Exception, match="not both"):
        _cfg(tool_model, "tools=[distflow.env.sandbox:python]")
    with pytest.raises(Exception, match="not episodes"):
        _cfg(tool_model, f"eval_dataset={ROOT / 'examples' / 'data' / 'tool_lookup.jsonl'}")
    with pytest.raises(Exception, match="fn: episodes"):  # an environment without an episodes node
        load_config(ROOT / "examples" / "grpo_quickstart.yaml", [f"model_path={tool_model}", "toy_model=false",
                                                                 "environment=distflow.env.toy_tasks:LookupEnv"])


def test_the_policy_loss_reads_the_loss_mask_hand_computed(toy_model, tmp_path):
    """Two samples: A (advantage +1) has 5 response tokens of which 3 were sampled, B (-1) 2 tokens
    without a mask entry of 0. With the old logprobs recomputed the ratio is 1, so the token-mean
    loss is -(3 x 1 + 2 x -1) / 5 = -0.2 (unmasked it would be -(5 - 2) / 7)."""
    from distflow.trainer.actor import Actor

    cfg = load_config(ROOT / "examples" / "grpo_quickstart.yaml",
                      [f"model_path={toy_model}", "toy_model=false", "kl_coef=0", "recompute_old_logprobs=true",
                       "lr=1e-9", "micro_batch_size=4"])
    batch = SampleBatch.from_lists(["a", "b"], ["p", "p"], [[5, 6], [7, 8, 9]], [[3, 4, 5, 6, 7], [8, 9]],
                                   [[-1.0] * 5, [-1.0] * 2])
    batch.set_ragged("loss_mask", torch.tensor([1, 1, 0, 0, 1, 1, 1]))
    batch.set_scalar("advantage", torch.tensor([1.0, -1.0]))
    with process_group(store_path(tmp_path)):
        actor = Actor(cfg, with_reference=False)
        actor.old_logprobs(batch)
        stats = actor.update(cfg.node("ACTOR", "MODEL_TRAIN"), batch)
    assert stats["tokens"] == 5.0
    assert math.isclose(stats["loss"], -0.2, abs_tol=1e-6), stats["loss"]


def test_preflight_imports_the_environment_and_binds_its_args(tool_model):
    from distflow.core.config_keys import ConfigError
    from distflow.launch.preflight import check_functions

    check_functions(_cfg(tool_model))  # the example's: importable, arguments bind
    with pytest.raises(ConfigError, match="environment: .*Nope"):
        check_functions(_cfg(tool_model, "environment=distflow.env.toy_tasks:Nope"))
    with pytest.raises(ConfigError, match="environment: .*bogus"):
        check_functions(_cfg(tool_model, "environment_args={bogus: 1}"))


def test_a_reward_node_adds_its_score_of_the_final_reply_to_the_environment_reward(tool_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model)
    call, end = tok.convert_tokens_to_ids(["<tool_call>", "<|im_end|>"])
    seven = tok.convert_tokens_to_ids("7")
    rows = [PromptRow("e0:0", 0, {"prompt": "1234", "secret": "7", "answer": "7"}),
            PromptRow("e0:1", 1, {"prompt": "5678", "secret": "7", "answer": "1"})]
    engine = FakeEngine(tok, [call, end], {"1234": [seven, end], "5678": [seven, end]})
    workflow = ("[{id: generate, role: ACTOR, type: MODEL_INFERENCE, fn: episodes}, "
                "{id: reward, role: REWARD, type: COMPUTE, fn: exact_match, deps: [generate]}, "
                "{id: advantage, role: ACTOR, type: COMPUTE, fn: grpo, deps: [reward]}, "
                "{id: update, role: ACTOR, type: MODEL_TRAIN, fn: grpo, deps: [advantage]}]")
    cfg = _cfg(tool_model, f"workflow={workflow}")
    ctx = RolloutContext(engine, cfg, rows, seed=0, pipeline=cfg.plan().pipeline("rollout"))
    batch = rollout_half(ctx.pipeline, ctx)
    # the environment's 1.0 (call + right secret), plus exact_match of the final reply "7" (not the response,
    # which holds the tool call and the observation too)
    assert batch.tensors["reward"].tolist() == [2.0, 2.0, 1.0, 1.0]
