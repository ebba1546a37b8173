"""The shipped algorithm configs: each validates and plans (fast), and each learns the toy task
end to end in one default run (`distflow run`, as shipped: 2 rollout + 2 trainer nodes):
mean reward of the last 10 steps minus the first 10 >= 0.3. The reward is the policy's: with
a filter (DAPO's dynamic sampling) that is ``generated_reward_mean``, the reward of what was
generated before the filter dropped groups (the trained samples' mean is biased by the filter).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distflow.core.config import load_config
from distflow.trainer.metrics import read_metrics
from tests.conftest import ROOT, run_distflow

CONFIGS = {
    "ppo": ["generate", "reward"],
    "dapo": ["generate", "reward", "filter", "advantage"],
    "gspo": ["generate", "reward", "advantage"],
    "reinforce_pp": ["generate", "reward"],
    "cispo": ["generate", "reward", "advantage"],
}
TRAINER = {
    "ppo": ["reference", "values", "gae", "update", "critic_update"],
    "dapo": ["update"],
    "gspo": ["update"],
    "reinforce_pp": ["reference", "advantage", "update"],
    "cispo": ["update"],
}


def path(algo: str) -> Path:
    return ROOT / "examples" / f"{algo}_quickstart.yaml"


@pytest.mark.parametrize("algo", sorted(CONFIGS))
def test_config_validates_and_plans(algo: str) -> None:
    from distflow.launch.preflight import check_functions

    cfg = load_config(path(algo))
    p = cfg.plan()
    assert [n.id for n in p.pipeline("rollout")] == CONFIGS[algo]
    assert [n.id for n in p.pipeline("trainer")] == TRAINER[algo]
    check_functions(cfg)  # every fn resolves (rewards, estimators, losses)
    assert cfg.toy_model and cfg.dataset == "examples/data/successor.jsonl"


def test_algorithm_keys_are_what_the_docs_say() -> None:
    c = {a: load_config(path(a)) for a in CONFIGS}
    assert c["dapo"].clip_high > c["dapo"].clip_low and c["dapo"].overlong == "penalty" and c["dapo"].kl_coef == 0
    assert c["gspo"].loss_agg == "seq-mean-token-mean" and c["gspo"].clip_high < 1e-3
    assert c["reinforce_pp"].kl_in_reward and c["reinforce_pp"].kl_reward_estimator == "k1"
    assert c["ppo"].kl_in_reward and c["ppo"].critic_lr
    assert c["cispo"].workflow[-1].fn == "cispo"


def test_a_loss_brings_its_aggregation_and_dual_clip_reaches_only_surrogate_losses(tmp_path) -> None:
    from distflow.core.config import ConfigError

    text = path("gspo").read_text().replace("loss_agg: seq-mean-token-mean\n", "")
    assert not any(line.startswith("loss_agg:") for line in text.splitlines())
    unset = tmp_path / "gspo.yaml"
    unset.write_text(text)
    assert load_config(unset).loss_agg == "seq-mean-token-mean"  # GSPO's own (verl fixes it), not token-mean
    assert load_config(unset, ["loss_agg=token-mean"]).loss_agg == "token-mean"  # a choice stays a choice
    assert load_config(path("dapo"), ["dual_clip=3"]).dual_clip == 3.0
    with pytest.raises(ConfigError, match=r"dual_clip: workflow node 'update' trains with 'gspo'"):
        load_config(unset, ["dual_clip=3"])
    with pytest.raises(ConfigError, match=r"dual_clip"):
        load_config(path("dapo"), ["dual_clip=1"])  # c must be > 1


def _learns(algo: str, tmp_path: Path, toy_model: Path) -> None:
    out = tmp_path / algo
    r = run_distflow(["run", str(path(algo)), "--no-progress", f"output_dir={out}", f"model_path={toy_model}",
                      "toy_model=false"], timeout=420)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    key = "generated_reward_mean" if "generated_reward_mean" in rows[0] else "reward_mean"
    assert (key == "generated_reward_mean") == (algo == "dapo")
    rewards = [m[key] for m in rows]
    assert len(rewards) >= 20
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"{algo}: {len(rewards)} steps, {key} first-10 {first:.3f}, last-10 {last:.3f}")
    assert last - first >= 0.3, (first, last)


@pytest.mark.parametrize("algo", sorted(CONFIGS))
def test_shipped_algorithm_learns(algo: str, tmp_path, toy_model) -> None:
    _learns(algo, tmp_path, toy_model)
