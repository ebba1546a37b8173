"""The shipped algorithm configs: each validates and plans (fast), and each learns the toy task
in its default step count: mean reward of the last 10 steps minus the first 10 >= 0.3. The reward
is the policy's: with a filter (DAPO's dynamic sampling) that is ``generated_reward_mean``, the
reward of what was generated before the filter dropped groups (the trained samples' mean is
biased by the filter).

Where: on the step functions in one process (distflow.step.synchronous_run), except DAPO, which
learns in a real `distflow run` as shipped. synchronous_run is exactly synchronous (max_staleness
0), and DAPO's shipped recipe learns the task only with the one-step staleness it ships with:
measured on one rollout shard and one trainer rank, 200 steps, `distflow run` with max_staleness 1
goes 0.07 -> 1.00 (first-10 -> last-10 generated reward), with max_staleness 0 0.05 -> 0.26, the
latter exactly what synchronous_run gives (ratio 1 and no clipping on-policy: with lr 3e-3 the
entropy collapses by step 60 instead of ~1.1).

A key the chosen loss ignores (cispo: clip_low) is refused where a config sets it; every example
loads, and so does the resolved dump of it that the launcher writes for its nodes.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
import torch

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
    assert cfg.toy_model and cfg.dataset == str(ROOT / "examples" / "data" / "successor.jsonl")  # the file's dir


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


# ---------------------------------------------------------------------- learning
# On the step functions, in one process each (distflow.step.synchronous_run: the rollout half and
# the train half one after the other, one rollout shard and one trainer rank): what the distributed
# run adds on top (routing, staleness, exchange, adoption) is shown by the cluster tests, and that
# the distributed run is the same computation by tests/test_sync_equivalence.py.
LEARNS = sorted(["grpo", "ppo", "gspo", "reinforce_pp", "cispo"])
AS_SHIPPED = ["dapo"]  # learns in a real run only (the module docstring says why)
LONGEST_FIRST = ["ppo", "reinforce_pp", "grpo", "gspo", "cispo"]  # ppo trains a critic too


def learning_curve(algo: str, model_path: str) -> dict:
    """One shipped config, its own step count, on one rollout shard and one trainer rank in this
    process: the policy's reward per step (see the module docstring for which reward)."""
    import torch

    from distflow.buffer.dataloader import PromptShard
    from distflow.step import synchronous_run

    os.chdir(ROOT)  # a fresh process: the configs name the dataset relative to the repository
    torch.set_num_threads(1)  # as a node (torch_threads: 1); two runs share the machine's cores
    cfg = load_config(path(algo), [f"model_path={model_path}", "toy_model=false", "rollout_nodes=1",
                                   "trainer_nodes=1"])
    rows = list(synchronous_run(cfg))
    key = "generated_reward_mean" if "generated_reward_mean" in rows[0] else "reward_mean"
    return {"key": key, "rewards": [m[key] for m in rows], "samples": [m["samples"] for m in rows],
            "steps": cfg.total_steps(PromptShard(cfg.dataset, 0, 1).num_rows), "batch": cfg.samples_per_step}


@pytest.fixture(scope="module")
def curves(request, toy_model) -> Iterator[dict[str, Future]]:
    """The learning runs the session selected, started at once, as many at a time as there are
    cores (each is single-threaded), each in a fresh process: algo -> its learning_curve."""
    wanted = {item.callspec.params["algo"] for item in request.session.items
              if item.module is request.module and item.originalname == "test_shipped_algorithm_learns"}
    order = [a for a in LONGEST_FIRST if a in wanted]
    pool = ProcessPoolExecutor(max_workers=max(1, min(len(order), os.cpu_count() or 1)),
                               mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1)
    try:
        yield {algo: pool.submit(learning_curve, algo, str(toy_model)) for algo in order}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def test_every_shipped_toy_config_has_a_learning_test() -> None:
    shipped = sorted(p.name.removesuffix("_quickstart.yaml") for p in (ROOT / "examples").glob("*_quickstart.yaml"))
    # tool: multi-turn episodes, learning in tests/test_agent_learning.py; grpo_lora: LoRA, in tests/test_lora.py;
    # vlm: images, in tests/test_vlm.py
    assert shipped == sorted(LEARNS + AS_SHIPPED + ["tool", "grpo_lora", "vlm"]) and sorted(LONGEST_FIRST) == LEARNS


@pytest.mark.timeout(960)  # past the wait below, so a slow run fails with the worker's error, not pytest's kill
@pytest.mark.parametrize("algo", LONGEST_FIRST)  # the order the pool starts them
def test_shipped_algorithm_learns(algo: str, curves: dict[str, Future]) -> None:
    run = curves[algo].result(timeout=900)
    assert run["key"] == "reward_mean"  # no filter: the trained samples are all the policy generated
    assert set(run["samples"]) == {run["batch"]}
    assert_learns(algo, run["key"], run["rewards"], run["steps"])


@pytest.mark.timeout(480)  # past the run's own 420 s
def test_dapo_learns_as_shipped(tmp_path, toy_model) -> None:
    out = tmp_path / "dapo"
    r = run_distflow(["run", str(path("dapo")), "--no-progress", f"output_dir={out}", f"model_path={toy_model}",
                      "toy_model=false"], timeout=420)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert all("generated_reward_mean" in m for m in rows)
    from distflow.buffer.dataloader import PromptShard

    cfg = load_config(path("dapo"))
    assert_learns("dapo", "generated_reward_mean", [m["generated_reward_mean"] for m in rows],
                  cfg.total_steps(PromptShard(str(ROOT / cfg.dataset), 0, 1).num_rows))


def assert_learns(algo: str, key: str, rewards: list[float], steps: int) -> None:
    """Every step of the default run, and last-10 minus first-10 mean reward >= 0.3."""
    assert len(rewards) == steps >= 100, (len(rewards), steps)
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"{algo}: {len(rewards)} steps, {key} first-10 {first:.3f}, last-10 {last:.3f}")
    assert last - first >= 0.3, (first, last)


# ------------------------------------------------------------------ keys a loss ignores
def _ignored() -> list[tuple[str, str]]:
    from distflow.rl.names import LOSS_OPTION_KEYS, POLICY_LOSS_KEYS, POLICY_LOSS_NAMES

    return [(loss, key) for loss in POLICY_LOSS_NAMES for key in LOSS_OPTION_KEYS
            if key not in POLICY_LOSS_KEYS[loss]]


def _config(loss: str, **keys):
    """grpo_quickstart (a reference node, kl_coef) trained by ``loss``, with clip_low, clip_high and
    dual_clip unset but for ``keys`` (None: null)."""
    from distflow.core.config import config_from_dict, load_yaml
    from distflow.rl.names import LOSS_OPTION_KEYS

    raw = load_yaml(path("grpo").read_text())
    for k in LOSS_OPTION_KEYS:
        raw.pop(k, None)
    assert raw["workflow"][4]["id"] == "update"
    raw["workflow"][4]["fn"] = loss
    return config_from_dict({**raw, **keys}, source=f"grpo_quickstart with {loss}")


SET_VALUES = {"clip_low": [0.1, 0.2], "clip_high": [0.1, 0.2], "dual_clip": [3.0]}  # 0.2: the default, set


def test_the_ignored_keys_are_cispos_clip_low_and_dual_clip_and_gspos_dual_clip() -> None:
    from distflow.core.config_sections import FLAT_KEYS
    from distflow.rl.names import POLICY_LOSS_KEYS

    assert _ignored() == [("gspo", "dual_clip"), ("cispo", "clip_low"), ("cispo", "dual_clip")]
    assert {k for keys in POLICY_LOSS_KEYS.values() for k in keys} <= set(FLAT_KEYS)  # config keys


@pytest.mark.parametrize("loss,key", _ignored())
def test_a_loss_refuses_each_key_it_ignores_where_set(loss: str, key: str) -> None:
    from distflow.core.config import ConfigError

    cfg = _config(loss)  # unset: loads
    assert cfg.workflow[4].fn == loss and key not in cfg.algorithm.model_fields_set
    for value in SET_VALUES[key]:  # set, even to its default: refused, naming key, node, loss and the fix
        with pytest.raises(ConfigError, match=rf"{key}: workflow node 'update' trains with '{loss}', which ignores "
                                              rf"it \(.+\); remove {key}"):
            _config(loss, **{key: value})
    if key == "dual_clip":  # null is off, which is what the loss does: not refused
        assert _config(loss, dual_clip=None).dual_clip is None


def test_cispos_refusal_says_what_cispo_clips() -> None:
    from distflow.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"clip_low: workflow node 'update' trains with 'cispo', which ignores it "
                                          r"\(CISPO clips only the importance weight, from above: clip_high\); "
                                          r"remove clip_low"):
        load_config(path("cispo"), ["clip_low=0.2"])


@pytest.mark.parametrize("loss", ["grpo", "ppo", "dapo", "reinforce_pp", "gspo", "cispo"])
def test_a_loss_takes_every_key_it_reads(loss: str) -> None:
    from distflow.rl.names import LOSS_OPTION_KEYS, POLICY_LOSS_KEYS

    reads = [k for k in LOSS_OPTION_KEYS if k in POLICY_LOSS_KEYS[loss]]
    cfg = _config(loss, **{k: SET_VALUES[k][0] for k in reads})
    assert all(getattr(cfg, k) == SET_VALUES[k][0] for k in reads)


def test_every_example_loads_and_its_resolved_dump_loads_again(tmp_path) -> None:
    """Every shipped config loads, and so does the resolved config.yaml the launcher writes for its
    nodes (model_dump: every key set, those a loss ignores at their defaults); a dump whose
    ignored key was changed is still refused."""
    import yaml

    from distflow.core.config import ConfigError, config_from_dict

    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert len(examples) >= 11
    for example in examples:
        cfg = load_config(example)
        again = config_from_dict(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json"))))
        assert again.model_dump() == cfg.model_dump(), example.name
    dump = load_config(path("cispo")).model_dump(mode="json")
    assert dump["algorithm"]["clip_low"] == 0.2 and dump["algorithm"]["dual_clip"] is None
    with pytest.raises(ConfigError, match=r"clip_low: workflow node 'update' trains with 'cispo'"):
        config_from_dict({**dump, "algorithm": {**dump["algorithm"], "clip_low": 0.1}})


def test_kl_clamp_is_refused_where_no_estimator_is_k3() -> None:
    from distflow.core.config import ConfigError

    assert load_config(path("grpo")).kl_clamp == 10.0  # the default bound of k3
    assert load_config(path("grpo"), ["kl_clamp=5"]).kl_clamp == 5.0
    assert load_config(path("grpo"), ["kl_clamp=null"]).kl_clamp is None  # the exact k3
    assert load_config(path("grpo"), ["kl_estimator=k2"]).kl_clamp == 10.0  # unset: loads
    with pytest.raises(ConfigError, match=r"kl_clamp: bounds the k3 KL estimator only, but kl_estimator is k2 and "
                                          r"kl_reward_estimator k1, so it would do nothing; remove kl_clamp"):
        load_config(path("grpo"), ["kl_estimator=k2", "kl_clamp=5"])
    # the per-token reward penalty reads it too (kl_reward_estimator k3)
    assert load_config(path("ppo"), ["kl_estimator=k2", "kl_reward_estimator=k3", "kl_clamp=5"]).kl_clamp == 5.0
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match="kl_clamp"):
            load_config(path("grpo"), [f"kl_clamp={bad}"])


def test_kl_clamp_reaches_the_loss_and_the_reward_penalty() -> None:
    """The config's kl_clamp is what the trainer hands the policy loss and the per-token KL penalty.
    One token 20 nats under the reference (d = 20): k3 = 229.292051 bounded (10 + 12.6108686 x
    17.3891314), e^20 - 21 = 485165174.4 exact (kl_clamp null)."""
    from types import SimpleNamespace

    from distflow.buffer.batch import SampleBatch
    from distflow.trainer.actor import Actor
    from distflow.trainer.stages import TrainerContext, _token_rewards

    for over, k3 in (([], 229.292051), (["kl_clamp=null"], math.exp(20) - 21)):
        # the reward penalty: kl_coef 0.5 x k3 on token 0, the outcome (1) on the last token
        cfg = load_config(path("ppo"), ["kl_reward_estimator=k3", "kl_coef=0.5", *over])
        b = SampleBatch.from_lists(["s0"], ["p0"], [[2, 5]], [[6, 7]], [[-21.0, -1.0]])
        b.set_ragged("ref_logprobs", torch.tensor([-1.0, -1.0]))
        b.set_scalar("reward", torch.tensor([1.0]))
        rewards = _token_rewards(cfg.plan().node("gae"), TrainerContext(cfg), b, torch.ones(1, 2, dtype=torch.bool))
        assert rewards.shape == (1, 2) and abs(rewards[0, 1].item() - 1.0) < 1e-6
        assert abs(rewards[0, 0].item() + 0.5 * k3) < 1e-5 * max(1.0, k3)
        # the loss term: the keywords Actor._loss hands the policy loss
        cfg = load_config(path("grpo"), over)
        seen: dict = {}

        def loss_fn(*args, **kw):
            seen.update(kw)
            return torch.zeros(()), {}

        b.set_scalar("advantage", torch.tensor([0.0]))
        fake = SimpleNamespace(cfg=cfg, device=torch.device("cpu"))
        Actor._loss(fake, loss_fn, b, torch.ones(1, dtype=torch.bool), SimpleNamespace(response_lens=[2]),
                    torch.tensor([-21.0, -1.0]), torch.zeros(2), cfg.kl_coef, 2.0, 1.0)
        assert seen["kl_clamp"] == cfg.kl_clamp and seen["kl_estimator"] == "k3"
