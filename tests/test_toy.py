"""The shipped toy task: tokenizer/model round trips, the dataset, and the starting policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distflow.rollout.engine import SamplingParams, TorchEngine
from distflow.rollout.rewards import resolve_reward
from distflow.toy import (
    build_toy_model,
    build_toy_tokenizer,
    ensure_toy_model,
    make_toy_dataset,
    successor_answer,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_toy_model(tmp_path_factory.mktemp("toy") / "model", seed=0)


def test_tokenizer_round_trip(tmp_path: Path) -> None:
    built = build_toy_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    assert len(tok) == len(built) == 17  # 4 specials + 10 digits + '=', '+', ' '
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    ids = tok("3947=")["input_ids"]
    assert ids == [2, 7, 13, 8, 11, 14]  # <bos> '3' '9' '4' '7' '='
    assert tok.decode(ids, skip_special_tokens=True) == "3947="
    assert tok.decode([tok.convert_tokens_to_ids("8"), tok.eos_token_id], skip_special_tokens=True) == "8"
    assert tok.decode(tok("1 + 2")["input_ids"], skip_special_tokens=True) == "1 + 2"
    assert tok.encode("x", add_special_tokens=False) == [tok.unk_token_id]


def test_model_round_trip_and_determinism(tmp_path: Path, model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (17, 64, 2, 4)
    assert cfg.max_position_embeddings == 64 and cfg.eos_token_id == 1 and cfg.pad_token_id == 0
    assert (Path(model_dir) / "model.safetensors").is_file()
    out = model(input_ids=torch.tensor([[2, 7, 13, 8, 11, 14]])).logits
    assert out.shape == (1, 6, 17) and torch.isfinite(out).all()
    again = AutoModelForCausalLM.from_pretrained(build_toy_model(tmp_path / "again", seed=0), local_files_only=True)
    other = AutoModelForCausalLM.from_pretrained(build_toy_model(tmp_path / "other", seed=1), local_files_only=True)
    sd, sd_again, sd_other = model.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(sd[k], sd_again[k]) for k in sd)
    assert not torch.equal(sd["model.layers.0.self_attn.q_proj.weight"], sd_other["model.layers.0.self_attn.q_proj.weight"])


def test_build_does_not_disturb_global_rng(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_toy_model(tmp_path / "m", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_ensure_toy_model_builds_once(tmp_path: Path) -> None:
    target = tmp_path / "ensure"
    assert ensure_toy_model(target) == str(target)
    weights = target / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    ensure_toy_model(target)
    assert weights.stat().st_mtime_ns == stamp  # config.json present: nothing rebuilt


def test_dataset_format_and_determinism(tmp_path: Path) -> None:
    a = make_toy_dataset(tmp_path / "a.jsonl", 200, seed=3)
    b = make_toy_dataset(tmp_path / "b.jsonl", 200, seed=3)
    c = make_toy_dataset(tmp_path / "c.jsonl", 200, seed=4)
    text_a = Path(a).read_text()
    assert text_a == Path(b).read_text() and text_a != Path(c).read_text()
    rows = [json.loads(line) for line in text_a.splitlines()]
    assert len(rows) == 200
    for r in rows:
        assert set(r) == {"prompt", "answer"}
        digits = r["prompt"][:-1]
        assert r["prompt"].endswith("=") and digits.isdigit() and 3 <= len(digits) <= 6
        assert r["answer"] == str((int(digits[-1]) + 1) % 10)
    assert {r["answer"] for r in rows} == set("0123456789")
    assert make_toy_dataset(tmp_path / "empty.jsonl", 0) and Path(tmp_path / "empty.jsonl").read_text() == ""
    with pytest.raises(ValueError, match="n_rows"):
        make_toy_dataset(tmp_path / "neg.jsonl", -1)


def test_successor_answer_and_reward() -> None:
    assert successor_answer("3947=") == "8"
    assert successor_answer("129=") == "0"
    with pytest.raises(ValueError, match="not a successor prompt"):
        successor_answer("abc=")
    reward = resolve_reward("successor")
    row = {"prompt": "129=", "answer": successor_answer("129=")}
    assert reward("0", row) == 1.0
    assert reward(" 0 + 1", row) == 1.0
    assert reward("9", row) == 0.0
    assert reward("=+ =", row) == 0.0
    assert reward("", row) == 0.0


def test_random_policy_success_rate_is_low(tmp_path: Path, model_dir: str) -> None:
    """The untrained policy must leave room to learn: well under 0.35, but not zero."""
    rows = [json.loads(x) for x in Path(make_toy_dataset(tmp_path / "d.jsonl", 64, seed=0)).read_text().splitlines()]
    engine = TorchEngine(model_dir)
    prompts = [engine.tokenizer(r["prompt"])["input_ids"] for r in rows]
    comps = engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0), seed=0)
    reward = resolve_reward("successor")
    texts = [engine.tokenizer.decode(c.tokens, skip_special_tokens=True) for c in comps]
    scores = [reward(t, r) for t, r in zip(texts, rows)]
    assert len(scores) == 64 and set(scores) <= {0.0, 1.0}
    rate = sum(scores) / 64
    assert 0.0 < rate < 0.35, rate
    # Near-uniform start: the first token's probability of the right digit is about 1/17.
    p_right = [torch.tensor(c.logprobs[0]).exp().item() for c, r in zip(comps, rows)
               if c.tokens[0] == engine.tokenizer.convert_tokens_to_ids(r["answer"])]
    assert all(0.02 < p < 0.2 for p in p_right)
