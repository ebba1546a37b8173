"""A reward model scores a finished response where it was trained to: at the end of the chat
template's rendering of the conversation (Qwen's ``<|im_end|>\\n``: one token past the
``<|im_end|>`` the policy stops on), checked against the Hugging Face forward of
``apply_chat_template`` on a real byte-level BPE tokenizer with a chat template; a truncated
response is scored as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distflow.rl import reward_model as rmod


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """The policy: a tiny Qwen2 with a byte-level BPE tokenizer and a Qwen-style chat template."""
    from distflow.toy_gsm8k import build_gsm8k_model

    return Path(build_gsm8k_model(tmp_path_factory.mktemp("rm-tok") / "policy", seed=0))


@pytest.fixture(scope="module")
def rm_dir(tok_dir, tmp_path_factory) -> Path:
    """A tiny Qwen2 reward model over the tokenizer's vocabulary, saved WITHOUT a tokenizer (so the
    policy's is used) and, in a second directory, with it."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from distflow.hf import load_tokenizer

    tok = load_tokenizer(tok_dir)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_labels=1,
                         pad_token_id=tok.pad_token_id)
    model = Qwen2ForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    out = tmp_path_factory.mktemp("rm-tmpl") / "rm"
    model.save_pretrained(str(out))
    return out


def test_turn_suffix_reads_the_template(tok_dir) -> None:
    from distflow.hf import load_tokenizer

    tok = load_tokenizer(tok_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert rmod.turn_suffix(tok) == (end, tuple(tok("\n", add_special_tokens=False)["input_ids"]))
    # a template that ends the turn on the special token itself (Llama 3 style): nothing to append
    tok.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                         "'<|im_end|>' }}{%- endfor %}")
    assert rmod.turn_suffix(tok) is None
    tok.chat_template = None
    assert rmod.turn_suffix(tok) is None


def test_finished_response_is_scored_at_the_end_of_the_template(tok_dir, rm_dir) -> None:
    from transformers import AutoModelForSequenceClassification

    from distflow.hf import chat_prompt_ids, load_tokenizer

    tok = load_tokenizer(tok_dir)
    reference = AutoModelForSequenceClassification.from_pretrained(str(rm_dir)).eval()

    def hf_score(ids: list[int]) -> float:
        with torch.no_grad():
            return float(reference(input_ids=torch.tensor([ids])).logits[0, 0])

    question, answers = "Ava has 3 apples and buys 4 more.", ["She has 7 apples.\n#### 7", "#### 12"]
    prompt = chat_prompt_ids(tok, question)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    finished = [tok(a, add_special_tokens=False)["input_ids"] + [end] for a in answers]
    truncated = tok(answers[0], add_special_tokens=False)["input_ids"][:5]
    rm = rmod.load_reward_model(str(rm_dir), tokenizer_dir=str(tok_dir))  # no tokenizer in rm_dir: the policy's
    got = rm.score([torch.tensor(prompt)] * 3, [torch.tensor(r) for r in [*finished, truncated]])
    expected = []
    for a in answers:  # what the reward model saw in training: the whole rendered conversation
        text = tok.apply_chat_template([{"role": "user", "content": question}, {"role": "assistant", "content": a}],
                                       tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids[-2] == end and ids[:-1] == prompt + finished[len(expected)]  # the template adds just "\n"
        expected.append(hf_score(ids))
    expected.append(hf_score(prompt + truncated))  # cut at max_new_tokens: no end of turn, nothing appended
    assert torch.allclose(got, torch.tensor(expected), atol=1e-4)
    # without the suffix the finished scores would differ (the test can tell the two apart)
    assert abs(hf_score(prompt + finished[0]) - expected[0]) > 1e-3
    # a reward model directory holding the tokenizer reads it there (no tokenizer_dir needed)
    with_tok = rm_dir.parent / "rm-with-tok"
    if not with_tok.exists():
        reference.save_pretrained(str(with_tok))
        tok.save_pretrained(str(with_tok))
    assert rm.suffix is not None and rmod.load_reward_model(str(with_tok)).suffix == rm.suffix


def test_a_chat_prompted_response_stops_at_the_templates_end_of_turn(tok_dir) -> None:
    """A base model prompted in a chat template ends its turn with the template's end-of-turn token
    (Qwen's <|im_end|>), which need not be one of its EOS ids (Qwen2.5 base: <|endoftext|>): without
    it in the stop set every response ran to max_new_tokens, truncated. The config's own
    stop_token_ids are added too; without a chat template only those."""
    from distflow.core.config import load_config
    from distflow.hf import end_of_turn, load_tokenizer
    from distflow.rollout.stages import sampling_params

    tok = load_tokenizer(tok_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    quickstart = Path(__file__).resolve().parents[1] / "examples" / "grpo_quickstart.yaml"
    chat = load_config(quickstart, ["chat_template=true", "stop_token_ids=[3, 4]"])
    assert sampling_params(chat, tok).stop_token_ids == (3, 4, end)
    assert sampling_params(load_config(quickstart, ["stop_token_ids=[3]"]), tok).stop_token_ids == (3,)
    assert sampling_params(load_config(quickstart, ["chat_template=true", f"stop_token_ids=[{end}]"]),
                           tok).stop_token_ids == (end,)
    # Llama 3 style: the turn ends on the special token itself, nothing after it
    tok.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                         "'<|im_end|>' }}{%- endfor %}")
    assert end_of_turn(tok) == (end, ())
    tok.chat_template = None
    assert end_of_turn(tok) is None
