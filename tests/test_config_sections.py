"""The config in sections: every field described, flat / sectioned / dotted keys alike, flat
reads delegated to the sections, one rule for relative paths, the one input check of
`distflow run` and `distflow-node`, `distflow config --explain`, and the generated docs."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distflow.core.config import Config, ConfigError, config_from_dict, load_config, read_raw
from distflow.core.config_sections import FLAT_KEYS, SECTIONS
from tests.conftest import ROOT, run_distflow

QUICKSTART = ROOT / "examples" / "grpo_quickstart.yaml"
NODE = [sys.executable, "-c", "import sys; from distflow.cli import node_main; sys.exit(node_main())"]
NODE_ENV = {**os.environ, "DISTFLOW_SECRET": "x" * 32, "PYTHONPATH": os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


# ----------------------------------------------------------------------------- the schema
def test_every_field_of_every_section_has_a_description():
    assert list(SECTIONS) == ["model", "data", "algorithm", "rollout", "env", "trainer", "transport", "mesh", "launch"]
    assert list(Config.model_fields) == list(SECTIONS)
    undescribed = [f"{name}.{key}" for name, model in SECTIONS.items() for key, field in model.model_fields.items()
                   if not (field.description or "").strip()]
    assert not undescribed, f"fields without a description: {undescribed}"
    assert all((Config.model_fields[s].description or "").strip() for s in SECTIONS)


def test_flat_keys_name_one_field_each_and_are_read_through_to_their_section():
    """Every section's keys, generated into FLAT_KEYS; ``cfg.<key>`` reads ``cfg.<section>.<key>``
    (the ~40 modules reading flat keys need not change) and refuses a write, naming the section."""
    assert sum(len(m.model_fields) for m in SECTIONS.values()) == len(FLAT_KEYS) == 129
    cfg = load_config(QUICKSTART)
    for key, section in FLAT_KEYS.items():
        assert getattr(cfg, key) is getattr(getattr(cfg, section), key), key
        assert getattr(Config, key).__doc__ == f"``{section}.{key}`` (read-only)"
    with pytest.raises(AttributeError, match=r"Config.lr is read-only: set cfg.trainer.lr"):
        cfg.lr = 0.5
    cfg.trainer.lr = 0.5
    assert cfg.lr == 0.5
    # where a verl / prime-rl user looks
    assert {FLAT_KEYS[k] for k in ("model_path", "dtype")} == {"model"}
    assert {FLAT_KEYS[k] for k in ("dataset", "prompts_per_step", "max_prompt_length")} == {"data"}
    assert {FLAT_KEYS[k] for k in ("temperature", "group_size", "max_new_tokens", "engine")} == {"rollout"}
    assert {FLAT_KEYS[k] for k in ("lr", "micro_batch_size", "resume_from", "max_steps")} == {"trainer"}
    assert {FLAT_KEYS[k] for k in ("workflow", "kl_coef", "clip_low", "gamma", "lam")} == {"algorithm"}
    assert {FLAT_KEYS[k] for k in ("channel", "weight_sync", "step_timeout_s")} == {"transport"}
    assert {FLAT_KEYS[k] for k in ("protocol_period_s", "bind_host")} == {"mesh"}
    assert {FLAT_KEYS[k] for k in ("rollout_nodes", "output_dir", "gpus", "device")} == {"launch"}


def test_flat_sectioned_and_dotted_keys_are_one_config(tmp_path):
    flat = load_config(QUICKSTART)
    sectioned = tmp_path / "sectioned.yaml"  # every key in its section (the dump of the flat one)
    sectioned.write_text(yaml.safe_dump(flat.model_dump(mode="json"), sort_keys=False))
    assert load_config(sectioned) == flat
    mixed = read_raw(QUICKSTART)  # flat keys and a section side by side
    mixed["trainer"] = {"lr": mixed.pop("lr"), "grad_clip": mixed.pop("grad_clip")}
    assert config_from_dict(mixed) == flat
    dotted, plain = load_config(QUICKSTART, ["trainer.lr=0.01"]), load_config(QUICKSTART, ["lr=0.01"])
    assert dotted == plain and dotted.trainer.lr == 0.01
    assert load_config(sectioned, ["lr=0.01", "workflow.1.fn=exact_match", "rollout_nodes=1"]) == \
        load_config(QUICKSTART, ["trainer.lr=0.01", "algorithm.workflow.1.fn=exact_match", "launch.rollout_nodes=1"])
    mixed["transport"] = None  # a section whose keys are all commented out
    assert config_from_dict(mixed) == flat
    mixed["trainer"]["lr"], mixed["lr"] = 0.1, 0.2  # one key given both ways: neither is silently kept
    with pytest.raises(ConfigError, match=r"lr: given twice, as lr and as trainer.lr; keep one"):
        config_from_dict(mixed)


@pytest.mark.parametrize("overrides, needle", [
    (["lrr=1"], "lrr: unknown key (did you mean 'lr'?)"),
    (["trainer.lrr=1"], "trainer.lrr: unknown key (did you mean 'lr'?)"),
    (["trainer={temperature: 0.5}"], "trainer.temperature: unknown key ('temperature' is a key of section rollout: "
                                      "rollout.temperature)"),
    (["lr=-1"], "trainer.lr: Input should be greater than 0"),
    (["trainer.lr=-1"], "trainer.lr: Input should be greater than 0"),
    (["mesh.join_timeout=3"], "mesh.join_timeout: unknown key (did you mean 'join_timeout_s'?)"),
    (["model=[1]"], "model: Input should be a valid dictionary"),
])
def test_errors_name_the_dotted_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, overrides)
    assert needle in str(e.value), str(e.value)


def test_a_missing_required_key_is_named_in_its_section():
    raw = read_raw(QUICKSTART)
    del raw["model_path"]
    with pytest.raises(ConfigError, match=r"model.model_path: Field required"):
        config_from_dict(raw)


def test_the_config_round_trips_through_yaml_json_pickle_and_copies(tmp_path):
    """`distflow run` hands its nodes ``output_dir/config.yaml`` (model_dump as YAML): read in any
    directory it is the same config, its paths unchanged; pickles (in-process nodes) too."""
    cfg = load_config(QUICKSTART, ["lr=0.01", "kl_coef=0.01"])
    elsewhere = tmp_path / "out" / "config.yaml"
    elsewhere.parent.mkdir()
    elsewhere.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    again = load_config(elsewhere)
    assert again == cfg and again.dataset == cfg.dataset == str(ROOT / "examples" / "data" / "successor.jsonl")
    assert Config.model_validate_json(cfg.model_dump_json()) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg and pickle.loads(pickle.dumps(cfg)).plan().pipelines
    copy = cfg.model_copy(update={"temperature": 0.5, "max_steps": 3})
    assert (copy.temperature, copy.max_steps, copy.total_steps(100)) == (0.5, 3, 3)
    assert (cfg.temperature, cfg.max_steps) == (1.0, None)  # the original is untouched
    copy.trainer.lr = 1.0
    assert cfg.lr == 0.01  # every section is copied
    with pytest.raises(ConfigError, match="unknown key"):
        cfg.model_copy(update={"temperatur": 0.5})


# ----------------------------------------------------------------------------- paths
def _config_elsewhere(tmp_path: Path, toy_model: Path, **extra) -> Path:
    """A config in tmp/conf/ naming its data relative to itself, as a copied example does."""
    conf = tmp_path / "conf"
    (conf / "data").mkdir(parents=True)
    (conf / "data" / "d.jsonl").write_text("".join(f'{{"prompt": "{i}=", "answer": "{(i + 1) % 10}"}}\n'
                                                   for i in range(64)))
    raw = read_raw(QUICKSTART)
    raw.update({"model_path": str(toy_model), "toy_model": False, "dataset": "data/d.jsonl",
                "eval_dataset": "data/d.jsonl", "output_dir": "out", **extra})
    path = conf / "c.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_relative_paths_are_relative_to_where_they_were_written(tmp_path, toy_model, monkeypatch):
    """In the file: its directory, whatever the working directory. On the command line and for
    defaults: the working directory. `~` is expanded; a reward model's args.path is a path too."""
    path = _config_elsewhere(tmp_path, toy_model, resume_from="ckpt/step-3")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    cfg = load_config(path)
    conf = tmp_path / "conf"
    assert (cfg.dataset, cfg.eval_dataset) == (str(conf / "data" / "d.jsonl"),) * 2
    assert (cfg.output_dir, cfg.resume_from, cfg.model_path) == (str(conf / "out"), str(conf / "ckpt" / "step-3"),
                                                                 str(toy_model))
    assert cfg.path_origins == {"dataset": "data/d.jsonl", "eval_dataset": "data/d.jsonl", "output_dir": "out",
                                "resume_from": "ckpt/step-3"}
    cli = load_config(path, ["dataset=here.jsonl", "output_dir=../o", "critic_path=~/critic"])
    assert (cli.dataset, cli.output_dir) == (str(cwd / "here.jsonl"), str(tmp_path / "o"))
    assert cli.critic_path == str(Path.home() / "critic") and "dataset" not in cli.path_origins
    raw = read_raw(path)
    del raw["output_dir"]
    assert config_from_dict(raw).output_dir == str(cwd / "outputs" / "run")  # a default: the working directory
    rm = load_config(ROOT / "examples" / "grpo_reward_model.yaml")
    assert rm.node("REWARD", "MODEL_INFERENCE").args["path"] == str(ROOT / "outputs" / "toy-reward-model")
    assert load_config(ROOT / "examples" / "grpo_reward_model.yaml", ["workflow.2.args.path=rm"]).node(
        "REWARD", "MODEL_INFERENCE").args["path"] == str(cwd / "rm")


def test_every_example_means_the_same_files_from_any_directory(tmp_path, monkeypatch):
    """The examples' relative paths are relative to examples/, and land where they did when
    `distflow run examples/...` ran from the repository root."""
    here = {p.name: load_config(p).model_dump() for p in sorted((ROOT / "examples").glob("*.yaml"))}
    monkeypatch.chdir(tmp_path)
    for p in sorted((ROOT / "examples").glob("*.yaml")):
        cfg = load_config(p)
        assert cfg.model_dump() == here[p.name], p.name
        assert cfg.output_dir.startswith(str(ROOT / "outputs")), p.name
        for key in ("dataset", "eval_dataset"):
            value = getattr(cfg, key)
            assert value is None or value.startswith("/data/") or Path(value).is_file(), (p.name, key, value)


def test_a_node_started_from_another_directory_finds_the_files_of_its_config(tmp_path, toy_model):
    path = _config_elsewhere(tmp_path, toy_model)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for role in ("rollout", "trainer"):
        r = subprocess.run(NODE + ["--role", role, "--config", str(path), "--check"], cwd=elsewhere, env=NODE_ENV,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("ok:"), r.stderr
    r = subprocess.run(NODE + ["--role", "rollout", "--config", str(QUICKSTART), f"model_path={toy_model}",
                               "toy_model=false", "--check"], cwd=elsewhere, env=NODE_ENV, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr  # the example's data (and held-out data) relative to the example


def test_distflow_node_refuses_a_missing_input_of_its_role_at_every_start(tmp_path, toy_model):
    """As `distflow run` does: one line naming the key and the path (and how a relative one was
    resolved), exit 2, before joining; with --check too. A trainer does not read the prompt set."""
    path = _config_elsewhere(tmp_path, toy_model, dataset="data/nope.jsonl")
    missing = tmp_path / "conf" / "data" / "nope.jsonl"
    for flags in ([], ["--check"]):
        r = subprocess.run(NODE + ["--role", "rollout", "--config", str(path), *flags], cwd=tmp_path, env=NODE_ENV,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith(f"distflow-node: dataset: '{missing}' not found (written 'data/nope.jsonl' in "
                                   "the config file: a relative path there is relative to the file's directory)")
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = subprocess.run(NODE + ["--role", "trainer", "--config", str(path), "--check"], cwd=tmp_path, env=NODE_ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(NODE + ["--role", "trainer", "--config", str(path), "--check", "resume_from=nockpt"],
                       cwd=tmp_path, env=NODE_ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"distflow-node: resume_from: '{tmp_path / 'nockpt'}' does not exist" in r.stderr


def test_distflow_run_and_the_nodes_share_one_input_check(tmp_path, toy_model, monkeypatch):
    """preflight.check_inputs (`distflow run`, `distflow-node --check`) makes the same check the
    node makes at start; a path the file wrote the old way (relative to the working directory)
    gets a hint saying so."""
    from distflow.core.config_paths import check_input_paths
    from distflow.launch.preflight import check_inputs

    path = _config_elsewhere(tmp_path, toy_model, eval_dataset="examples/data/successor_eval.jsonl")
    monkeypatch.chdir(ROOT)
    cfg = load_config(path)
    with pytest.raises(ConfigError, match=f"^eval_dataset: .?{tmp_path / 'conf' / 'examples'}.* not found"):
        check_inputs(cfg)  # (`distflow run`: the prompt sets are opened as the nodes open them, first)
    with pytest.raises(ConfigError) as e:
        check_input_paths(cfg)
    assert str(e.value) == (f"eval_dataset: '{tmp_path / 'conf' / 'examples' / 'data' / 'successor_eval.jsonl'}' "
                                "not found (written 'examples/data/successor_eval.jsonl' in the config file: a "
                                "relative path there is relative to the file's directory; "
                                "'examples/data/successor_eval.jsonl' exists under the working directory: write it "
                                "relative to the file, or absolute)")
    check_input_paths(cfg, "trainer")  # not an input of a trainer
    cfg = load_config(path, [f"eval_dataset={tmp_path / 'conf' / 'data' / 'd.jsonl'}", "critic_path=nocritic"])
    for check, role in ((check_inputs, None), (check_inputs, "trainer"), (check_input_paths, "trainer")):
        with pytest.raises(ConfigError, match=f"^critic_path: '{ROOT / 'nocritic'}' does not exist$"):
            check(cfg, role)
    check_input_paths(cfg, "rollout")


def test_a_node_checks_the_reward_models_its_group_runs(tmp_path, toy_model):
    """A worker group's node checks the reward model it loads (not a rollout or trainer node);
    a toy reward model `distflow run` is yet to build is left to it."""
    from distflow.core.config_paths import check_input_paths

    example = ROOT / "examples" / "grpo_reward_model.yaml"
    rm = tmp_path / "rm"
    cfg = load_config(example, ["toy_model=false", f"model_path={toy_model}", f"workflow.2.args.path={rm}"])
    assert cfg.workflow[2].id == "rm"
    with pytest.raises(ConfigError, match=rf"^workflow node 'rm': args.path: '{rm}' does not exist$"):
        check_input_paths(cfg, "reward")
    with pytest.raises(ConfigError, match=r"^workflow node 'rm': args.path"):
        check_input_paths(cfg)  # `distflow run`: every node's inputs
    for role in ("rollout", "trainer"):
        check_input_paths(cfg, role)
    check_input_paths(load_config(example, [f"workflow.2.args.path={rm}"]), "reward")  # toy_model: built by run


# ----------------------------------------------------------------------------- explain, show, docs
def test_config_explain_prints_section_type_default_and_doc(capsys):
    from distflow.core.config_explain import config_main

    for name in ("lr", "trainer.lr"):
        assert config_main(["--explain", name]) == 0
        out = capsys.readouterr().out
        assert out.startswith("trainer.lr  (flat: lr)\n  section: trainer: The optimiser")
        assert "  type:    float (> 0)\n  default: 1e-05\n" in out and "AdamW learning rate" in out
    assert config_main(["--explain", "mesh.join_timeout_s"]) == 0
    assert "default: 60.0" in capsys.readouterr().out
    assert config_main(["--explain", "rollout"]) == 0
    assert "  rollout.temperature" in capsys.readouterr().out
    for name, needle in (("lrr", "lrr: unknown key (did you mean 'lr'?)"),
                         ("rollout.lr", "rollout.lr: unknown key ('lr' is a key of section trainer: trainer.lr)")):
        assert config_main(["--explain", name]) == 2
        assert f"distflow config: {needle}" in capsys.readouterr().err


def test_distflow_config_through_the_cli():
    r = run_distflow(["config", "--explain", "temperatur"], timeout=60)
    assert r.returncode == 2 and "did you mean 'temperature'?" in r.stderr, r.stderr
    r = run_distflow(["config", "--show", "examples/grpo_quickstart.yaml", "lr=0.5"], timeout=60)
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout)
    assert list(shown) == list(SECTIONS) and shown["trainer"]["lr"] == 0.5
    assert shown["data"]["dataset"] == str(ROOT / "examples" / "data" / "successor.jsonl")


def test_docs_configuration_md_is_generated_from_the_sections():
    """Regenerate with: python3 -m distflow.core.config_docs > docs/configuration.md"""
    from distflow.core.config_docs import generate

    assert (ROOT / "docs" / "configuration.md").read_text() == generate(), \
        "docs/configuration.md is stale: python3 -m distflow.core.config_docs > docs/configuration.md"


def test_the_config_modules_stay_torch_free():
    """Thin entry points import the config (and `distflow config` all of it) before torch."""
    code = ("import sys, distflow.core.config, distflow.core.config_explain, distflow.core.config_docs; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], env=NODE_ENV, timeout=60).returncode == 0


def test_show_into_a_closed_pipe_ends_quietly():
    """`distflow config --show CONFIG | head -1`: the reader is gone before the output is written; the
    command ends with SIGPIPE's status and no BrokenPipeError traceback."""
    r, w = os.pipe()
    os.close(r)  # a reader that stopped reading: every write gets EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "distflow.launch.cli", "config", "--show", str(QUICKSTART)],
                              cwd=ROOT, stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr[-2000:]
