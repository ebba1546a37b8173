"""docs/metrics.md documents every key a run writes: the keys of real rows (one GRPO and one PPO
step through the step functions, plus the trainer loop's own keys) must each have a row there."""

from __future__ import annotations

import re

import torch

from distflow.core.config import load_config
from distflow.core.status import STAGE_TIME_KEYS
from distflow.step import synchronous_run
from distflow.trainer.actor import OPTIONAL_METRICS
from distflow.trainer.metrics import STAGE_KEYS, generated_by
from tests.conftest import ROOT
from tests.process_group import process_group, store_path

# What the trainer loop adds to the step's metrics (distflow/trainer/worker.py's row), and the
# rollout counters a step may carry.
LOOP_KEYS = ("step", "total_steps", "policy_version", "reward_mean", "samples", "samples_per_s", "staleness_mean",
             "truncated_frac", "response_len_mean", "elapsed_s", "dropped_parts", "startup_s")
ROLLOUT_COUNTERS = ("skipped_prompts", "bad_prompts", "bad_rows", "resampled_prompts", "dropped_prompts",
                    "generated_samples", "generated_reward", "generated_reward_mean", "reward_out_of_range")
EVAL_KEYS = ("step", "eval_reward_mean", "eval_prompts", "eval_samples", "eval_response_len_mean",
             "eval_truncated_frac", "eval_skipped_prompts", "eval_shards", "eval_num_shards", "eval_failed_shards",
             "policy_version_min", "policy_version_max", "eval_time_s")


def documented(section: str) -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return {k for line in body.splitlines() if line.startswith("| `") for k in re.findall(r"`([a-z_0-9]+)`",
                                                                                          line.split("|")[1])}


def test_every_key_a_step_writes_is_documented(toy_model, toy_data) -> None:
    torch.set_num_threads(1)
    keys = set(LOOP_KEYS) | set(ROLLOUT_COUNTERS) | set(STAGE_KEYS) | set(STAGE_TIME_KEYS) | set(OPTIONAL_METRICS)
    keys |= {"time_critic_s", "time_reward_s", "time_compute_s"}
    for example in ("grpo_quickstart.yaml", "ppo_quickstart.yaml"):
        cfg = load_config(ROOT / "examples" / example, [f"model_path={toy_model}", f"dataset={toy_data}",
                                                        "toy_model=false", "prompts_per_step=4", "group_size=2",
                                                        "max_new_tokens=2", "rollout_nodes=1", "trainer_nodes=1"])
        with process_group(store_path()):
            row = next(synchronous_run(cfg, 1))
        keys |= set(row)
    missing = sorted(keys - documented("metrics.jsonl"))
    assert not missing, f"docs/metrics.md documents no row for {missing}"
    assert not set(EVAL_KEYS) - documented("eval.jsonl")


def test_reward_curve_puts_training_rows_at_the_version_that_generated_them() -> None:
    assert generated_by({"step": 25, "staleness_mean": 1.0}) == 24.0  # one step ahead: samples of version 24
    assert generated_by({"step": 25, "staleness_mean": 0.0}) == 25.0  # on-policy: the version evaluated at 25
    assert generated_by({"step": 3}) == 3.0
