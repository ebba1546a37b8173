"""The realistic example in CI: GSM8K-format word problems, a BPE chat tokenizer, a tiny Qwen2.

examples/grpo_gsm8k_tiny.yaml is run as shipped (toy_model: true builds the model) for a
few steps with real node processes; the trace of what the rollout nodes sent shows the
chat template around every prompt, responses that end on EOS or at max_new_tokens with
the truncated fraction in the metrics, and a parsed reward for every sample.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distflow.rollout.rewards import extract_final_number, gsm8k
from distflow.trace import read_trace
from distflow.trainer.metrics import read_metrics
from tests.conftest import ROOT, run_distflow

CONFIG = "examples/grpo_gsm8k_tiny.yaml"
DATA = ROOT / "examples" / "data" / "gsm8k_tiny.jsonl"


@pytest.fixture(scope="module")
def gsm8k_model(tmp_path_factory) -> Path:
    from distflow.toy_gsm8k import build_gsm8k_model

    return Path(build_gsm8k_model(tmp_path_factory.mktemp("gsm8k") / "model", seed=0))


def test_shipped_rows_are_gsm8k_format_and_regenerate_identically(tmp_path):
    from distflow.toy_gsm8k import make_gsm8k_dataset

    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert len(rows) == 512
    for row in rows:
        assert set(row) == {"question", "answer"}
        solution, _, number = row["answer"].rpartition("\n#### ")
        assert solution and number.isdigit()
        assert row["question"].endswith("Give the final answer after ####.")
        # The reward parses the answer field and scores the worked solution right, a wrong number wrong.
        assert gsm8k(row["answer"], row) == 1.0
        assert gsm8k(f"so the answer is #### {int(number) + 1}", row) == 0.0
        assert extract_final_number(row["answer"]) == int(number)
    # The shipped file is exactly what the generator writes (`distflow toy-data --kind gsm8k`).
    make_gsm8k_dataset(tmp_path / "d.jsonl", 512, seed=0)
    assert (tmp_path / "d.jsonl").read_text() == DATA.read_text()


def test_tokenizer_is_byte_level_bpe_with_a_qwen_chat_template(gsm8k_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distflow.hf import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(gsm8k_model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(gsm8k_model, local_files_only=True)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.model_type == "qwen2"
    assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tok.eos_token_id
    assert json.loads(tok.backend_tokenizer.to_str())["model"]["type"] == "BPE"
    text = "Ava has 3 apples. How many? Give the final answer after ####."
    ids = chat_prompt_ids(tok, text)
    assert tok.decode(ids) == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text  # byte-level: lossless
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok))


def test_prompts_may_be_chat_messages_and_unusable_ones_are_skipped_and_counted(gsm8k_model):
    """A dataset row's prompt is text (one user turn) or a conversation of chat messages (many
    RL datasets' format); a row that is neither, or malformed, is skipped and counted
    (``bad_prompts``), never a crash of the step."""
    from transformers import AutoTokenizer

    from distflow.buffer.dataloader import PromptRow
    from distflow.hf import chat_prompt_ids
    from distflow.rollout.stages import encode_prompts

    tok = AutoTokenizer.from_pretrained(gsm8k_model, local_files_only=True)
    text = "Ava has 3 apples. How many?"
    assert chat_prompt_ids(tok, [{"role": "user", "content": text}]) == chat_prompt_ids(tok, text)
    with_system = chat_prompt_ids(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}])
    assert tok.decode(with_system).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    rows = [PromptRow(f"e0:{i}", i, {"prompt": p}) for i, p in enumerate([
        text, [{"role": "user", "content": text}], [], [{"role": "user"}], 7, None])]
    out = encode_prompts(tok, rows, "prompt", chat=True)
    assert out[0] == out[1] == chat_prompt_ids(tok, text)
    assert [o for o in out[2:]] == [
        "prompt e0:2: a chat prompt must be a non-empty list of messages, got list",
        "prompt e0:3: chat message 0 must be a mapping with string 'role' and 'content', got {'role': 'user'}",
        "prompt e0:4: key 'prompt' is int, expected a string or a list of chat messages",
        "prompt e0:5: key 'prompt' is NoneType, expected a string or a list of chat messages"]
    # a template that refuses a conversation (raise_exception: jinja2's TemplateError) skips that row too
    strict = AutoTokenizer.from_pretrained(gsm8k_model, local_files_only=True)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system "
                            "role') }}{% endif %}{{ m['content'] }}{% endfor %}")
    sys_row = PromptRow("e0:9", 9, {"prompt": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]})
    assert encode_prompts(strict, [sys_row], "prompt", chat=True) == [
        "prompt e0:9: the chat template refused the conversation: no system role"]
    plain = encode_prompts(tok, rows[:2], "prompt", chat=False)
    assert plain[0] == tok(text)["input_ids"] and plain[1] == (
        "prompt e0:1: key 'prompt' is list, expected a string (chat messages need chat_template: true)")
    # a tokenizer that adds a BOS (Llama's): a prompt rendered already, its BOS in it, gets no second one
    from tokenizers.processors import TemplateProcessing

    bos_tok = AutoTokenizer.from_pretrained(gsm8k_model, local_files_only=True)
    bos_tok.add_special_tokens({"bos_token": "<s>"})
    bos = bos_tok.bos_token_id
    bos_tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    body = bos_tok(text, add_special_tokens=False)["input_ids"]
    rendered = PromptRow("e0:10", 10, {"prompt": "<s>" + text})
    assert encode_prompts(bos_tok, [rows[0], rendered], "prompt", chat=False) == [[bos, *body], [bos, *body]]


def test_grpo_gsm8k_tiny_example_runs(gsm8k_model, tmp_path):
    out = tmp_path / "run"
    r = run_distflow(["run", CONFIG, "--no-progress", f"output_dir={out}", f"model_path={gsm8k_model}",
                      "max_steps=3", "trainer_nodes=1", "trace_samples=true"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gsm8k_model, local_files_only=True)
    im_start, eos = tok.convert_tokens_to_ids("<|im_start|>"), tok.eos_token_id
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    trace = read_trace(out)
    sent = [rec for node in ("rollout-0", "rollout-1") for rec in trace[node]]
    assert sorted(rec["step"] for rec in sent) == [0, 0, 1, 1, 2, 2]
    truncated, lens, rewards = [], [], []
    for rec in sent:
        p = rec["first_prompt_tokens"]
        assert p[0] == im_start and p[-len(header):] == header  # the chat template was applied
        assert tok.decode(p).startswith("<|im_start|>user\n")
        truncated += rec["truncated"]
        lens += rec["response_lens"]
        rewards += rec["rewards"]
    assert len(truncated) == len(lens) == len(rewards) == 3 * 8 * 4
    # Multi-token responses that end on EOS (before the limit) or at max_new_tokens (truncated).
    assert all(n == 32 for n, t in zip(lens, truncated) if t)
    assert all(1 <= n <= 32 for n in lens)
    assert 0 < sum(truncated) < len(truncated), "expected both EOS-ended and truncated responses"
    # A reward parsed for every sample (0 or 1: a random model is rarely right).
    assert set(rewards) <= {0.0, 1.0}
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert 0.0 <= m["truncated_frac"] <= 1.0
        assert m["samples"] == 32
    step_truncated = [sum(t for rec in sent if rec["step"] == s for t in rec["truncated"]) / 32 for s in range(3)]
    assert [m["truncated_frac"] for m in metrics] == pytest.approx(step_truncated)
    assert [m["reward_mean"] for m in metrics] == pytest.approx(
        [sum(x for rec in sent if rec["step"] == s for x in rec["rewards"]) / 32 for s in range(3)])


@pytest.mark.gpu
@pytest.mark.timeout(360)  # past the run's own 300 s, so a slow run fails with its stderr, not pytest's kill
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grpo_gsm8k_tiny_on_one_gpu_colocated(gsm8k_model, tmp_path):
    """The same example on one GPU: trainer and both rollout nodes placed on GPU 0 (colocate)."""
    out = tmp_path / "run"
    r = run_distflow(["run", CONFIG, "--no-progress", f"output_dir={out}", f"model_path={gsm8k_model}",
                      "max_steps=3", "trainer_nodes=1", "device=cuda", "gpus=1", "colocate=true",
                      "dtype=bfloat16"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "placement: GPU 0: trainer-0, rollout-0, rollout-1" in r.stderr
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
