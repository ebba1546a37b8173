"""A user's mistakes are named at once, never a crash loop: a reward function with a bug.

A reward that raises, or returns NaN, None, a list or a string, has a bug that every restart
of its rollout node would meet again: the node exits 2 (never restarted) with one line naming
the function, the row and what it returned. The return values are checked on the real rollout
half (`distflow.step.rollout_half` on the toy engine); one real `distflow run` shows the whole
path (exit 2, no restart, the function named) within seconds of the first step.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from distflow.buffer.dataloader import PromptRow
from distflow.core.config import load_config
from distflow.rl.catalog import UserFunctionError
from distflow.rollout.engine import make_engine
from distflow.rollout.rewards import reward_value
from distflow.rollout.stages import RolloutContext
from distflow.step import rollout_half
from tests.conftest import ROOT, run_distflow

MODULE = """
def raises(response, row):
    raise KeyError("oops")

def returns_nan(response, row):
    return float("nan")

def returns_inf(response, row):
    return float("inf")

def returns_none(response, row):
    return None

def returns_list(response, row):
    return [1.0]

def returns_text(response, row):
    return "1.0"

def too_big(response, row):
    return 7.5
"""


@pytest.fixture
def reward_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "buggy_rewards.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("buggy_rewards", None)
    return "buggy_rewards"


def rollout(toy_model: Path, toy_data: Path, fn: str) -> tuple[object, dict]:
    cfg = load_config(ROOT / "examples" / "grpo_quickstart.yaml",
                      [f"model_path={toy_model}", f"dataset={toy_data}", "toy_model=false", "group_size=2",
                       "max_new_tokens=2", f"workflow.1.fn={fn}"])
    engine = make_engine("torch", cfg.model_path, dtype=cfg.dtype)
    rows = [PromptRow("e0:0", 0, {"prompt": "12=", "answer": "3"}, where="data.jsonl:1"),
            PromptRow("e0:1", 1, {"prompt": "45=", "answer": "6"}, where="data.jsonl:2")]
    pipeline = cfg.plan().pipeline("rollout")
    stats: dict = {}
    return rollout_half(pipeline, RolloutContext(engine, cfg, rows, 0, pipeline, stats)), stats


@pytest.mark.parametrize("case, needle", [
    ("raises", "raised KeyError: 'oops'"),
    ("returns_nan", "returned nan, not a finite number"),
    ("returns_inf", "returned inf, not a finite number"),
    ("returns_none", "returned None (NoneType), not a number"),
    ("returns_list", "returned [1.0] (list), not a number"),
    ("returns_text", "returned '1.0' (str), not a number"),
])
def test_a_buggy_reward_is_named_with_its_row_and_what_it_returned(toy_model, toy_data, reward_module, case,
                                                                    needle) -> None:
    with pytest.raises(UserFunctionError) as e:
        rollout(toy_model, toy_data, f"{reward_module}:{case}")
    assert str(e.value).startswith(f"workflow node 'reward': reward '{reward_module}:{case}' on data.jsonl:1 "
                                   f"(sample e0:0:s0) ")
    assert str(e.value).endswith(needle)


def test_scores_outside_the_documented_range_are_counted_and_warned_of(toy_model, toy_data, reward_module,
                                                                       caplog) -> None:
    with caplog.at_level("WARNING", logger="distflow.rollout.stages"):
        batch, stats = rollout(toy_model, toy_data, f"{reward_module}:too_big")
    assert batch.tensors["reward"].tolist() == [7.5] * 4
    assert stats["reward_out_of_range"] == 4
    assert "gave 4 of 4 scores outside the documented range [0, 1]" in caplog.text


def test_reward_values_are_numbers_of_any_numeric_kind() -> None:
    assert [reward_value(v) for v in (1, 0.5, True, np.float32(0.25), torch.tensor(0.75))] == [1.0, 0.5, 1.0, 0.25,
                                                                                                 0.75]
    with pytest.raises(ValueError, match=r"returned tensor\(\[1\., 2\.\]\) \(Tensor\), not a number"):
        reward_value(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="returned b'1' \\(bytes\\), not a number"):
        reward_value(b"1")


def test_a_raising_reward_stops_the_run_with_exit_2_and_no_restart(toy_model, toy_data, reward_module, tmp_path):
    t0 = time.monotonic()
    r = run_distflow(["run", "examples/grpo_quickstart.yaml", "--no-progress", f"output_dir={tmp_path / 'run'}",
                      f"model_path={toy_model}", f"dataset={toy_data}", "toy_model=false", "restarts=3",
                      f"workflow.1.fn={reward_module}:raises"], timeout=240,
                     env={"PYTHONPATH": f"{tmp_path}:{ROOT}"})
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stderr[-3000:]
    assert "restarting it" not in r.stderr and "restart 1 of" not in r.stderr
    assert f"reward '{reward_module}:raises' on" in r.stderr and "raised KeyError: 'oops'" in r.stderr
    assert took < 120, took  # start-up (seconds) plus one step: never three restarts with back-off


# ----------------------------------------------------------------------------- a diverging run
def test_divergence_is_named_at_its_step_and_stops_after_max_nonfinite_steps(caplog) -> None:
    from distflow.trainer.health import DivergedError, DivergenceWatch

    watch = DivergenceWatch(limit=2, lr=1e9)
    ok = {"loss": 0.5, "grad_norm": 1.0, "skipped_steps": 0.0, "optimizer_steps": 1.0}
    with caplog.at_level("WARNING", logger="distflow.trainer.health"):
        watch.after_step(0, ok)
        watch.after_step(1, {**ok, "loss": float("nan"), "grad_norm": float("nan"), "skipped_steps": 1.0})
        assert "step 2: the loss (nan) or the gradient norm (nan) is not finite" in caplog.text
        watch.after_step(2, ok)  # a good step ends the run of bad ones
        watch.after_step(3, {**ok, "grad_norm": float("inf"), "skipped_steps": 1.0})
        with pytest.raises(DivergedError, match=r"^training diverged: the loss or gradient was not finite at steps "
                                                r"4, 5 in a row \(max_nonfinite_steps: 2\); lower lr \(now 1e\+09\)"):
            watch.after_step(4, {**ok, "loss": float("inf")})
    # two optimizer steps of which one was skipped: the step still trained
    watch = DivergenceWatch(limit=1, lr=1e-3)
    watch.after_step(0, {**ok, "skipped_steps": 1.0, "optimizer_steps": 2.0})


def test_the_sampler_never_draws_out_of_the_vocabulary_and_the_engine_names_nan_logits(toy_model) -> None:
    from distflow.rollout.protocol import NonFiniteOutputError, SamplingParams
    from distflow.rollout.sampling import sample_rows

    logits = torch.tensor([[0.0, 1.0, 2.0], [float("nan")] * 3])
    tokens, logp = sample_rows(logits, SamplingParams(max_new_tokens=1, temperature=1.0), torch.tensor([0.5, 0.5]))
    assert tokens.tolist()[1] == 2 and math.isnan(logp[1]) and math.isfinite(logp[0])

    engine = make_engine("torch", str(toy_model), dtype="float32")
    state = {k: v * 1e20 for k, v in engine.model.state_dict().items() if v.is_floating_point()}  # finite, exploded
    engine.load_weights(1, state)
    with pytest.raises(NonFiniteOutputError, match=r"^the policy \(weights version 1\) gives non-finite logits: "
                                                   r"training diverged"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, temperature=1.0), seed=0)


def test_a_diverging_run_stops_with_exit_2_in_one_line(toy_model, toy_data, tmp_path):
    r = run_distflow(["run", "examples/grpo_quickstart.yaml", "--no-progress", f"output_dir={tmp_path / 'run'}",
                      f"model_path={toy_model}", "toy_model=false", "lr=1e9", "max_steps=12", "restarts=3"],
                     timeout=240)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "restart 1 of" not in r.stderr
    assert "training diverged" in r.stderr and "lower lr" in r.stderr


# ----------------------------------------------------------------------------- a run that trains nothing
def test_a_run_whose_first_steps_train_nothing_stops_naming_why() -> None:
    from distflow.trainer.health import NothingTrainedError, EmptyRunWatch

    watch = EmptyRunWatch(limit=3)
    watch.after_step(0, 0, {"skipped_prompts": 32})
    watch.after_step(1, 0, {"skipped_prompts": 32})
    with pytest.raises(NothingTrainedError, match=r"^the first 3 steps trained on 0 samples \(last step: "
                                                  r"bad_rows 2, skipped_prompts 30\): the run would train nothing"):
        watch.after_step(2, 0, {"skipped_prompts": 30, "bad_rows": 2, "resampled_prompts": 4})
    later = EmptyRunWatch(limit=1)
    later.after_step(0, 64)
    later.after_step(1, 0)  # a run that trained goes on through an empty step (a filter dropped every group)


def test_a_run_with_no_room_for_its_prompts_exits_non_zero(toy_model, tmp_path):
    r = run_distflow(["run", "examples/grpo_quickstart.yaml", "--no-progress", f"output_dir={tmp_path / 'run'}",
                      f"model_path={toy_model}", "toy_model=false", "max_new_tokens=60", "max_steps=20"],
                     timeout=240)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "the first 3 steps trained on 0 samples (last step: skipped_prompts" in r.stderr, r.stderr[-3000:]
    assert "done." not in r.stderr
