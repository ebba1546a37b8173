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
from distflow.trackers.names import VERL_NAMES
from tests.conftest import ROOT
from tests.process_group import process_group, store_path

# What the trainer loop adds to the step's metrics (distflow/trainer/worker.py's row), and the
# rollout counters a step may carry.
LOOP_KEYS = ("step", "total_steps", "policy_version", "samples", "samples_per_s", "step_time_s", "throughput",
             "elapsed_s", "dropped_parts", "startup_s", "weight_sync_bytes", "weight_load_bytes",
             "max_memory_allocated_gb", "peak_rss_gb")
ROLLOUT_COUNTERS = ("skipped_prompts", "bad_prompts", "bad_rows", "resampled_prompts", "dropped_prompts",
                    "generated_samples", "generated_reward", "generated_reward_mean", "reward_out_of_range")
EVAL_KEYS = ("step", "eval_reward_mean", "eval_prompts", "eval_samples", "eval_response_len_mean",
             "eval_truncated_frac", "eval_skipped_prompts", "eval_shards", "eval_num_shards", "eval_failed_shards",
             "policy_version_min", "policy_version_max", "eval_time_s")


def table_rows(section: str) -> list[list[str]]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return [line.split("|")[1:-1] for line in body.splitlines() if line.startswith("| `")]


def documented(section: str) -> set[str]:
    return {k for row in table_rows(section) for k in re.findall(r"`([a-z_0-9]+)`", row[0])}


def documented_verl_names() -> dict[str, str | None]:
    """metrics.jsonl's "verl name" column: key -> verl name (None: "-", or a blank cell for the row)."""
    out: dict[str, str | None] = {}
    for row in table_rows("metrics.jsonl"):
        keys = re.findall(r"`([a-z_0-9]+)`", row[0])
        names = [n.strip().strip("`") for n in row[1].split(",")] if row[1].strip() else ["-"] * len(keys)
        assert len(names) == len(keys), f"docs/metrics.md: {keys} has {len(names)} verl names"
        out.update({k: None if n == "-" else n for k, n in zip(keys, names)})
    return out


def test_every_key_a_step_writes_is_documented(toy_model, toy_data) -> None:
    torch.set_num_threads(1)
    keys = set(LOOP_KEYS) | set(ROLLOUT_COUNTERS) | set(STAGE_KEYS) | set(STAGE_TIME_KEYS) | set(OPTIONAL_METRICS)
    keys |= {"time_critic_s", "time_reward_s", "time_compute_s"} | set(VERL_NAMES)
    rows = {}
    for example, extra in (("grpo_quickstart.yaml", ["recompute_old_logprobs=true"]), ("ppo_quickstart.yaml", [])):
        cfg = load_config(ROOT / "examples" / example, [f"model_path={toy_model}", f"dataset={toy_data}",
                                                        "toy_model=false", "prompts_per_step=4", "group_size=2",
                                                        "max_new_tokens=2", "rollout_nodes=1", "trainer_nodes=1",
                                                        *extra])
        with process_group(store_path()):
            rows[example] = row = next(synchronous_run(cfg, 1))
        keys |= set(row)
    # the step's statistics in a real row: ordered extremes, the engine and the trainer on the same weights
    grpo = rows["grpo_quickstart.yaml"]
    for name in ("response_len", "prompt_len", "reward", "advantage"):
        assert grpo[f"{name}_max"] >= grpo[f"{name}_mean"] >= grpo[f"{name}_min"], name
    assert 0.0 <= grpo["truncated_frac"] <= 1.0 and grpo["staleness_max"] == 0.0 and grpo["peak_rss_gb"] > 0
    assert abs(grpo["logprob_diff_mean"]) < 1e-4 and grpo["logprob_kl_k3"] < 1e-6 and grpo["logprob_diff_max"] < 1e-3
    assert "logprob_diff_mean" not in rows["ppo_quickstart.yaml"]  # no recomputed logprobs: nothing measured
    missing = sorted(keys - documented("metrics.jsonl"))
    assert not missing, f"docs/metrics.md documents no row for {missing}"
    assert not set(EVAL_KEYS) - documented("eval.jsonl")


def test_the_verl_name_column_is_the_trackers_table():
    """docs/metrics.md's "verl name" column says exactly what distflow/trackers/names.py maps."""
    column = documented_verl_names()
    assert {k: v for k, v in column.items() if v is not None} == VERL_NAMES


def test_reward_curve_puts_training_rows_at_the_version_that_generated_them() -> None:
    assert generated_by({"step": 25, "staleness_mean": 1.0}) == 24.0  # one step ahead: samples of version 24
    assert generated_by({"step": 25, "staleness_mean": 0.0}) == 25.0  # on-policy: the version evaluated at 25
    assert generated_by({"step": 3}) == 3.0
