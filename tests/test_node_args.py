"""A workflow node's ``args`` are checked with the config (built-in stages and functions) and by
the pre-run check (a dotted function, against its signature): a key no stage reads, or a value
it cannot use, is refused naming the node and the key, before any node starts."""

from __future__ import annotations

import copy
import inspect

import pytest

from distflow.core.config import ConfigError, config_from_dict
from distflow.core.dag import STAGE_GROUPS, PPO_WORKFLOW
from distflow.launch.preflight import check_functions
from distflow.rl.names import COMPUTE_NAMES
from distflow.rl.node_args import FN_ARGS, REWARD_MODEL_DTYPES, STAGE_ARGS

GEN = {"id": "generate", "role": "ACTOR", "type": "MODEL_INFERENCE", "fn": "generate"}
REWARD = {"id": "reward", "role": "REWARD", "type": "COMPUTE", "fn": "successor", "deps": ["generate"]}
ADV = {"id": "advantage", "role": "ACTOR", "type": "COMPUTE", "fn": "grpo", "deps": ["reward"]}
UPDATE = {"id": "update", "role": "ACTOR", "type": "MODEL_TRAIN", "fn": "grpo", "deps": ["advantage"]}


def scaled_reward(response: str, row: dict, *, scale: float = 1.0) -> float:
    return scale * float(bool(response))


def centred(rewards, group_ids, *, shift: float = 0.0):
    return rewards - rewards.mean() + shift


def varargs_reward(*parts, scale: float = 1.0) -> float:
    return scale


def cfg_with(workflow, **kw):
    return config_from_dict({"model_path": "unused", "dataset": "unused.jsonl", "prompts_per_step": 2,
                             "group_size": 2, "max_new_tokens": 3, "workflow": copy.deepcopy(workflow), **kw})


def with_args(node: dict, **args) -> dict:
    return {**node, "args": args}


@pytest.mark.parametrize("workflow, message", [
    ([GEN, REWARD, ADV, with_args(UPDATE, clip_high=0.28)],
     r"workflow node 'update' \(grpo\): args.clip_high is not an argument of this stage \('clip_high' is a config "
     r"key, set at the top level for the whole run\); it reads no args"),
    ([GEN, REWARD, with_args(ADV, std=False), UPDATE],
     r"workflow node 'advantage' \(grpo\): args.std is not an argument of this stage; it reads eps, norm_std"),
    ([GEN, REWARD, with_args(ADV, norm_std="no"), UPDATE],
     r"workflow node 'advantage' \(grpo\): args.norm_std must be true or false \(got 'no'\)"),
    ([GEN, REWARD, with_args(ADV, eps=-1e-6), UPDATE], r"args.eps must be >= 0 \(got -1e-06\)"),
    ([with_args(GEN, temperature=0.7), REWARD, ADV, UPDATE],
     r"workflow node 'generate' \(generate\): args.temperature is not an argument of this stage \('temperature' "
     r"is a config key"),
    ([GEN, with_args(REWARD, scale=2), ADV, UPDATE],
     r"workflow node 'reward' \(successor\): args.scale is not an argument of this stage; it reads no args"),
    ([GEN, REWARD, {"id": "filter", "role": "ACTOR", "type": "COMPUTE", "fn": "dynamic_sampling",
                    "deps": ["reward"], "args": {"refill": "other"}}, {**ADV, "deps": ["filter"]}, UPDATE],
     r"workflow node 'filter' \(dynamic_sampling\): args.refill must be one of fresh, same \(got 'other'\)"),
    ([GEN, REWARD, {"id": "filter", "role": "ACTOR", "type": "COMPUTE", "fn": "dynamic_sampling",
                    "deps": ["reward"], "args": {"max_retries": 1.5}}, {**ADV, "deps": ["filter"]}, UPDATE],
     r"args.max_retries must be an integer >= 0 \(got 1.5\)"),
])
def test_bad_args_of_built_in_stages_are_refused_by_key(workflow, message) -> None:
    with pytest.raises(ConfigError, match=message):
        cfg_with(workflow)


def test_a_misspelt_gae_arg_gets_a_did_you_mean_and_values_are_checked() -> None:
    ppo = copy.deepcopy(PPO_WORKFLOW)
    gae = next(n for n in ppo if n["id"] == "gae")
    gae["args"] = {"gama": 0.99}
    with pytest.raises(ConfigError, match=r"workflow node 'gae' \(gae\): args.gama is not an argument of this stage "
                                          r"\(did you mean 'gamma'\?\); it reads gamma, lam, whiten"):
        cfg_with(ppo)
    gae["args"] = {"lam": 1.5}
    with pytest.raises(ConfigError, match=r"args.lam must be >= 0 and <= 1 \(got 1.5\)"):
        cfg_with(ppo)
    gae["args"] = {"gamma": 0.99, "lam": 0.9, "whiten": False}
    assert cfg_with(ppo).plan().node("gae").args == {"gamma": 0.99, "lam": 0.9, "whiten": False}
    rm = {"id": "rm", "role": "REWARD", "type": "MODEL_INFERENCE", "fn": "reward_model", "deps": ["generate"],
          "args": {"path": "rm-dir", "weight": 0.1, "dtype": "bf16"}}
    with pytest.raises(ConfigError, match=r"workflow node 'rm' \(reward_model\): args.dtype must be one of float32, "
                                          r"bfloat16, float16 \(got 'bf16'\)"):
        cfg_with([GEN, rm, {**ADV, "deps": ["rm"]}, UPDATE])


def test_dotted_functions_are_checked_against_their_signature() -> None:
    reward = {**REWARD, "fn": "tests.test_node_args:scaled_reward"}
    check_functions(cfg_with([GEN, with_args(reward, scale=2.0), ADV, UPDATE]))
    with pytest.raises(ConfigError, match=r"workflow node 'reward': reward 'tests.test_node_args:scaled_reward': its "
                                          r"args do not fit its signature .*'scal'.*; it takes scale"):
        check_functions(cfg_with([GEN, with_args(reward, scal=2.0), ADV, UPDATE]))
    odd = {**REWARD, "fn": "tests.test_node_args:varargs_reward"}  # (*parts, scale): scale is its keyword
    with pytest.raises(ConfigError, match=r"its args do not fit its signature .*'scal'.*; it takes scale$"):
        check_functions(cfg_with([GEN, with_args(odd, scal=2.0), ADV, UPDATE]))
    adv = {**ADV, "fn": "tests.test_node_args:centred"}
    check_functions(cfg_with([GEN, REWARD, with_args(adv, shift=1.0), UPDATE]))
    with pytest.raises(ConfigError, match=r"workflow node 'advantage': advantage estimator "
                                          r"'tests.test_node_args:centred': its args do not fit its signature"):
        check_functions(cfg_with([GEN, REWARD, with_args(adv, shift=1.0, scale=2), UPDATE]))


def test_the_tables_cover_every_stage_and_built_in_and_match_the_functions() -> None:
    from distflow.device import COMPUTE_DTYPES
    from distflow.rl.registry import ADVANTAGE_ESTIMATORS
    from distflow.rollout.rewards import registered_rewards

    assert REWARD_MODEL_DTYPES == tuple(COMPUTE_DTYPES)
    assert set(STAGE_ARGS) | {("ACTOR", "COMPUTE"), ("REWARD", "COMPUTE")} == set(STAGE_GROUPS)
    built_in = {n for n in registered_rewards() if not n.startswith("test_")}  # test_rewards registers its own
    assert set(COMPUTE_NAMES) | built_in <= set(FN_ARGS)
    for name, fn in ADVANTAGE_ESTIMATORS.items():  # what an outcome estimator's args may set is its keywords
        params = {p.name for p in list(inspect.signature(fn).parameters.values())[2:]} - {"token_counts"}
        if name == "dr_grpo":
            params -= {"norm_std"}  # fixed: Dr. GRPO is GRPO without the std
        assert set(FN_ARGS[name]) == params, name
