"""The config schema: derived values, overrides, and errors that name the key."""

from pathlib import Path

import pytest
import yaml

from distflow.core.config import ConfigError, apply_overrides, load_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "grpo_quickstart.yaml"


def write(tmp_path: Path, raw: dict) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def base() -> dict:
    return yaml.safe_load(QUICKSTART.read_text())


def test_quickstart_loads_and_derives():
    cfg = load_config(QUICKSTART)
    assert cfg.rollout_nodes == 2 and cfg.trainer_nodes == 2 and cfg.max_staleness == 1
    assert cfg.rollout_batch == cfg.prompts_per_step // 2
    assert cfg.samples_per_step == cfg.prompts_per_step * cfg.group_size
    assert cfg.buffer_capacity == 3 * cfg.samples_per_step
    plan = cfg.plan()
    assert [n.id for n in plan.pipeline("rollout")] == ["generate", "reward", "advantage"]
    assert [n.id for n in plan.pipeline("trainer")] == ["reference", "update"]
    assert cfg.total_steps(100) == 4  # ceil(100 / 32)
    assert cfg.model_copy(update={"max_steps": 3}).total_steps(100) == 3


def test_grad_sync_defaults_to_auto_and_takes_both_modes():
    assert load_config(QUICKSTART).grad_sync == "auto"
    for mode in ("step", "micro_batch"):
        assert load_config(QUICKSTART, [f"grad_sync={mode}"]).grad_sync == mode


@pytest.mark.parametrize("algo, update", [("grpo", "grpo"), ("ppo", "ppo"), ("dapo", "dapo")])
def test_gsm8k_gpu_examples_validate_with_real_model_settings(algo, update):
    cfg = load_config(ROOT / "examples" / f"{algo}_gsm8k.yaml")
    assert cfg.chat_template and cfg.node("REWARD", "COMPUTE").fn == "gsm8k"
    assert cfg.node("ACTOR", "MODEL_TRAIN").fn == update
    # a pretrained model: small learning rates, real lengths, a micro-batch that fits next to the engine
    assert (cfg.device, cfg.dtype, cfg.lr, cfg.max_new_tokens) == ("cuda", "bfloat16", 1e-6, 512)
    assert cfg.micro_batch_size <= 8 and not cfg.toy_model
    # held out: GSM8K's test split, next to the train split the docs' download gives
    assert cfg.eval_dataset == cfg.dataset.replace("train-", "test-") and cfg.eval_every == 20
    if algo == "ppo":
        assert cfg.critic_lr == 1e-5 and cfg.kl_in_reward
    if algo == "dapo":
        assert cfg.overlong == "penalty" and cfg.overlong_buffer == 128 and cfg.kl_coef == 0
    # the one-GPU command of docs/gsm8k.md places every node on GPU 0
    one = load_config(ROOT / "examples" / f"{algo}_gsm8k.yaml", ["trainer_nodes=1", "gpus=1", "colocate=true"])
    assert one.trainer_nodes == 1 and one.colocate


def test_overrides_typed_nested_and_indexed(tmp_path):
    cfg = load_config(QUICKSTART, ["lr=1e-4", "output_dir=/tmp/x", "mesh.protocol_period_s=0.5",
                                   "workflow.1.fn=exact_match", "max_steps=3"])
    assert cfg.lr == 1e-4 and cfg.output_dir == "/tmp/x" and cfg.mesh.protocol_period_s == 0.5
    assert cfg.workflow[1].fn == "exact_match" and cfg.max_steps == 3
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["lr"])
    with pytest.raises(ConfigError, match="workflow.9"):
        apply_overrides({"workflow": [{}]}, ["workflow.9.fn=x"])


@pytest.mark.parametrize("change, key, needle", [
    ({"lr": -1}, "lr", "greater than 0"),
    ({"learning_rate": 1}, "learning_rate", "unknown key"),
    ({"lrr": 1}, "lrr", "unknown key (did you mean 'lr'?)"),  # a top-level key gets the workflow keys' hint
    ({"mesh": {"join_timeout": 3}}, "mesh.join_timeout", "unknown key (did you mean 'join_timeout_s'?)"),
    ({"engine": "vllm"}, "engine: vllm", "device is cpu"),  # vLLM needs a GPU: refused before any node starts
    ({"prompts_per_step": 31}, "prompts_per_step", "multiple of rollout_nodes"),
    ({"max_staleness": -1}, "max_staleness", "greater than or equal"),
    ({"trainer_nodes": 0}, "trainer_nodes", "greater than or equal"),
    ({"engine": "sglang"}, "engine", "torch"),
    ({"grad_sync": "sometimes"}, "grad_sync", "micro_batch"),
    ({"engine_gpu_memory_utilization": 0}, "engine_gpu_memory_utilization", "greater than 0"),
    ({"engine_gpu_memory_utilization": 1.5}, "engine_gpu_memory_utilization", "less than or equal"),
    ({"engine_trainer_memory_fraction": 1}, "engine_trainer_memory_fraction", "less than 1"),
    ({"colocate": True, "engine_gpu_memory_utilization": 0.5}, "engine_trainer_memory_fraction", "must be below"),
    ({"dtype": "float16", "device": "cuda"}, "dtype float16", "loss scaling"),
    ({"seed": -1}, "seed", "greater than or equal"),
    ({"gpus": 1}, "gpus", "device is cpu"),
    ({"adam_betas": [1.5, 0.999]}, "adam_betas", "[0, 1)"),
    ({"adam_betas": [0.9, float("nan")]}, "adam_betas", "finite number"),
    ({"weight_transport": "nccl"}, "weight_transport: nccl", "device is cpu"),
    ({"weight_transport": "cuda_ipc"}, "weight_transport: cuda_ipc", "device is cpu"),
    ({"tis_cap": 2.0}, "tis_cap", "recompute_old_logprobs: true"),  # else every weight is 1: TIS silently off
])
def test_errors_name_the_key(tmp_path, change, key, needle):
    raw = base()
    raw.update(change)
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, raw))
    assert key in str(e.value) and needle in str(e.value)


def test_kl_in_reward_needs_a_token_level_estimator():
    """Only GAE reads per-token rewards: kl_in_reward with an outcome estimator (GRPO's) would
    drop the KL from the loss and put it nowhere. The config's list of token-level estimators
    is the registry's."""
    from distflow.core.config import TOKEN_ESTIMATOR_NAMES
    from distflow.rl.registry import TOKEN_ESTIMATORS

    assert set(TOKEN_ESTIMATOR_NAMES) == set(TOKEN_ESTIMATORS)
    with pytest.raises(ConfigError, match="kl_in_reward: true puts the KL penalty into per-token rewards"):
        load_config(QUICKSTART, ["kl_in_reward=true", "kl_coef=0.01"])
    assert load_config(QUICKSTART, ["kl_in_reward=true", "kl_coef=0"]).kl_in_reward  # no KL: nothing is lost
    ppo = load_config(ROOT / "examples" / "ppo_quickstart.yaml")
    assert ppo.kl_in_reward and ppo.kl_coef > 0 and ppo.kl_reward_estimator == "k1"


def test_k1_is_refused_as_a_kl_loss_term():
    """As a loss term only log pi of the sampled token is differentiated, and the mean of k1's
    gradient (the score function's) is zero: kl_coef > 0 with k1 would regularise nothing. In
    the reward (kl_in_reward) k1 is the usual penalty, and kl_estimator is not read there."""
    ppo = ROOT / "examples" / "ppo_quickstart.yaml"
    with pytest.raises(ConfigError, match="kl_estimator: k1 as a KL loss term") as e:
        load_config(ppo, ["kl_in_reward=false", "kl_estimator=k1"])
    assert "k3" in str(e.value) and "k2" in str(e.value)
    assert load_config(ppo, ["kl_in_reward=false", "kl_estimator=k2"]).kl_estimator == "k2"
    assert load_config(ppo, ["kl_estimator=k1"]).kl_in_reward  # in the reward: not read
    assert load_config(ppo, ["kl_in_reward=false", "kl_estimator=k1", "kl_coef=0"]).kl_coef == 0


def test_kl_coef_needs_a_reference_node():
    """Without a reference node there are no reference logprobs, and the trainer applied no KL at all."""
    raw = base()
    assert raw["kl_coef"] > 0
    raw["workflow"] = [n for n in raw["workflow"] if n["role"] != "REFERENCE"]
    for n in raw["workflow"]:
        n["deps"] = [d for d in n.get("deps", []) if d != "reference"]
    with pytest.raises(ValueError, match=r"kl_coef: .* no REFERENCE MODEL_INFERENCE node"):
        load_config_dict(raw)
    raw["kl_coef"] = 0.0
    assert load_config_dict(raw).kl_coef == 0


def test_gspo_gets_its_own_clip_range_unless_set():
    """GSPO's sequence ratio stays within ~1e-3 of 1: PPO's 0.2 would never clip it. An unset
    clip range takes the loss's own (the table equals gspo_loss's keyword defaults); a set one
    is kept, and other losses keep 0.2."""
    import inspect

    from distflow.rl.losses import gspo_loss
    from distflow.rl.names import LOSS_CLIP_DEFAULTS

    sig = inspect.signature(gspo_loss).parameters
    assert LOSS_CLIP_DEFAULTS["gspo"] == (sig["clip_low"].default, sig["clip_high"].default)
    raw = base()
    for k in ("clip_low", "clip_high"):
        raw.pop(k, None)
    update = next(n for n in raw["workflow"] if n["type"] == "MODEL_TRAIN")
    assert (load_config_dict(raw).clip_low, load_config_dict(raw).clip_high) == (0.2, 0.2)
    update["fn"] = "gspo"
    cfg = load_config_dict(raw)
    assert (cfg.clip_low, cfg.clip_high) == (3e-4, 4e-4)
    raw["clip_high"] = 1e-3
    cfg = load_config_dict(raw)
    assert (cfg.clip_low, cfg.clip_high) == (3e-4, 1e-3)
    # ... and recomputes the old logprobs unless told: the engine's differ from the trainer's by
    # ~1e-3 per token in bf16, which a 3e-4 clip range would clip on-policy
    assert cfg.recompute_old_logprobs
    raw["recompute_old_logprobs"] = False
    assert not load_config_dict(raw).recompute_old_logprobs
    update["fn"] = "grpo"
    raw.pop("recompute_old_logprobs")
    assert not load_config_dict(raw).recompute_old_logprobs


def load_config_dict(raw: dict):
    from distflow.core.config import Config

    return Config.model_validate(raw)


def test_workflow_errors_name_the_node(tmp_path):
    raw = base()
    raw["workflow"][1]["deps"] = ["nope"]
    with pytest.raises(ConfigError, match="reward"):
        load_config(write(tmp_path, raw))
    raw = base()
    raw["workflow"][0]["role"] = "JUDGE"
    with pytest.raises(ConfigError, match=r"workflow\[0\] \(node .generate.\).*role"):
        load_config(write(tmp_path, raw))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_a_key_given_twice_is_an_error_naming_file_and_line(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `lr:` silently replaced the first."""
    text = QUICKSTART.read_text()
    assert text.count("\nlr: ") == 1
    dup = tmp_path / "dup.yaml"
    dup.write_text(text.replace("\nlr: ", "\nlr: 1.0e-4\nlr: "))
    line = text.split("\nlr: ")[0].count("\n") + 3  # 1-based line of the second lr
    with pytest.raises(ConfigError, match=rf"^{dup}:{line}: key 'lr' is given twice \(lines {line - 1} and {line}\)"):
        load_config(dup)
    nested = tmp_path / "nested.yaml"
    nested.write_text(text + "mesh:\n  protocol_period_s: 0.5\n  protocol_period_s: 0.2\n")
    with pytest.raises(ConfigError, match="key 'protocol_period_s' is given twice"):
        load_config(nested)
    with pytest.raises(ConfigError, match="override mesh: .*key 'a' is given twice"):
        load_config(QUICKSTART, ["mesh={a: 1, a: 2}"])
    # a merge key's values may still be overridden by the mapping's own keys, as YAML intends
    from distflow.core.config import load_yaml

    assert load_yaml("a: &d {p: 1, q: 2}\nb:\n  <<: *d\n  p: 3\n")["b"] == {"p": 3, "q": 2}


def test_every_key_is_documented():
    from distflow.core.config import Config
    from distflow.core.config_sections import FLAT_KEYS

    text = (ROOT / "docs" / "configuration.md").read_text()
    keys = list(Config.model_fields) + list(FLAT_KEYS)  # the sections and every key of each
    missing = [k for k in keys if f"`{k}`" not in text]
    assert not missing, f"undocumented config keys: {missing}"


def test_values_that_validated_then_failed_at_start_or_trained_something_else(tmp_path, toy_model):
    """Refused before anything starts, naming the key: an infinite or NaN number (``.inf`` crashed
    the trainer in ``timedelta``), an empty path (an unset shell variable wrote into the working
    directory), a second policy or critic update (two optimizer steps a step: versions no longer
    count steps), dynamic sampling over groups of one (every group constant: regenerated for
    nothing), and lengths over the model's positions (every prompt skipped: a run of nothing that
    said 'done')."""
    from distflow.launch.preflight import check_inputs

    for bad, key in [(["step_timeout_s=.inf"], "step_timeout_s"), (["lr=nan"], "lr"),
                     (["mesh.join_timeout_s=.inf"], "join_timeout_s"), (["model_path="], "model_path"),
                     (["output_dir="], "output_dir"), (["dataset="], "dataset"), (["eval_dataset="], "eval_dataset")]:
        with pytest.raises(ConfigError, match=key):
            load_config(QUICKSTART, bad)
    raw = base()
    update = next(n for n in raw["workflow"] if n["type"] == "MODEL_TRAIN")
    raw["workflow"].append({**update, "id": "update2"})
    with pytest.raises(ValueError, match=r"at most one ACTOR MODEL_TRAIN node is allowed .* got 'update', 'update2'"):
        load_config_dict(raw)
    dapo = ROOT / "examples" / "dapo_quickstart.yaml"
    with pytest.raises(ConfigError, match=r"group_size: 1 makes every group of workflow node 'filter' "
                                          r"\(dynamic_sampling\) constant"):
        load_config(dapo, ["group_size=1", "workflow.3.fn=reinforce_pp"])
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1", "answer": "2"}\n')
    ok = [f"model_path={toy_model}", "toy_model=false", f"dataset={data}"]
    check_inputs(load_config(QUICKSTART, ok), "rollout")
    with pytest.raises(ConfigError, match=r"max_new_tokens: 64 leaves no room for a prompt in the model's 64 "
                                          r"positions"):
        check_inputs(load_config(QUICKSTART, [*ok, "max_new_tokens=64"]), "rollout")
    with pytest.raises(ConfigError, match=r"max_prompt_length: 60 \+ max_new_tokens: 8 is over the model's 64"):
        check_inputs(load_config(QUICKSTART, [*ok, "max_new_tokens=8", "max_prompt_length=60"]), "rollout")
