"""Token-in, token-out episodes: exact loss masks against the rendered template, the extension
check and its split, the budgets and stop reasons. Real tokenizer and Jinja template (built
locally, loaded with from_pretrained); a scripted generate stands in for the engine."""

from __future__ import annotations

import asyncio

import pytest

from distflow.env import EpisodeRunner, StepResult, TokenAssembly, environment_factory, render_prompt
from distflow.env.toy import DROP_THINK_TEMPLATE, ScriptedGenerate, build_chat_tokenizer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def broken(x: int) -> int:
    """Always fails."""
    raise RuntimeError("no")


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("chat") / "tok")


@pytest.fixture(scope="module")
def think_tok(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("chat-think") / "tok", DROP_THINK_TEMPLATE)


def runner(tok, gen, tools=("tests.test_env_episode:add",), **kw):
    make = environment_factory(tools=list(tools), environment_args={"system_prompt": "Use tools."})
    return EpisodeRunner(tok, gen, make, **kw)


def ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_two_turn_tool_episode_loss_mask_exact(tok):
    gen = ScriptedGenerate(tok, {"2+3": [CALL, "The sum is 5."]})
    r = runner(tok, gen)
    (ep,) = asyncio.run(r.run([{"prompt": "What is 2+3?"}]))
    assert (ep.stop_reason, ep.turns, ep.tool_calls, ep.tool_errors, ep.splits) == ("done", 2, 1, 0, 0)
    assert ep.messages[3] == {"role": "tool", "name": "add", "content": "5"}
    (s,) = ep.samples
    # The sample is the rendered conversation, token for token (the template's "\n" after the
    # last <|im_end|> is no sampled token and not part of it).
    tools = [r.make_env().tools[0]]
    full = ids(tok, tok.apply_chat_template(ep.messages, tools=tools, tokenize=False))
    assert s.tokens == full[:len(s.tokens)] and full[len(s.tokens):] == ids(tok, "\n")
    # The expected mask from the template alone: assistant turn k starts where the prompt rendered
    # before it ends, and spans exactly the tokens sampled for it (its <|im_end|> included).
    expected, sampled_lp = [0] * len(s.tokens), [0.0] * len(s.tokens)
    for turn, k in enumerate(i for i, m in enumerate(ep.messages) if m["role"] == "assistant"):
        start = len(render_prompt(tok, ep.messages[:k], tools))
        reply = gen.reply_ids("2+3", turn)
        assert s.tokens[start:start + len(reply)] == reply  # by token id
        assert reply[-1] == tok.convert_tokens_to_ids("<|im_end|>")
        expected[start:start + len(reply)] = [1] * len(reply)
        sampled_lp[start:start + len(reply)] = gen.logprobs(turn, len(reply))
    assert s.loss_mask == expected
    assert s.logprobs == sampled_lp
    assert s.prompt_len == len(render_prompt(tok, ep.messages[:2], tools))
    assert s.turns == [0, 1] and ep.turn_lengths == [len(gen.reply_ids("2+3", t)) for t in (0, 1)]
    # What is masked between the turns is the template's and the tool's: "\n", the tool response
    # in its user turn, and the next assistant header.
    between = [t for t, m in zip(s.tokens[s.prompt_len:], s.response_mask) if not m]
    assert tok.decode(between, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert ep.observation_lengths == [len(between)]
    # the schema reached the model, and the reward is left to the reward stage
    assert '"name": "add"' in tok.decode(s.tokens[:s.prompt_len], skip_special_tokens=False)
    assert ep.reward is None and ep.trained and r.stats["samples"] == 1 and r.stats["stop_done"] == 1
    t = s.tensors()
    assert t["tokens"].tolist() == s.tokens and int(t["loss_mask"].sum()) == s.sampled_tokens


def test_template_that_drops_reasoning_splits_and_counts(tok, think_tok):
    script = {"2+3": ["<think>add them</think>\n" + CALL, "The sum is 5."]}
    # control: a template that keeps history extends, one sample
    (ep,) = asyncio.run(runner(tok, ScriptedGenerate(tok, script)).run([{"prompt": "What is 2+3?"}]))
    assert ep.splits == 0 and len(ep.samples) == 1
    gen = ScriptedGenerate(think_tok, script)
    r = runner(think_tok, gen)
    (ep,) = asyncio.run(r.run([{"prompt": "What is 2+3?"}]))
    assert ep.stop_reason == "done" and ep.splits == 1 and r.stats["splits"] == 1
    assert len(ep.samples) == 2
    first, second = ep.samples
    # each sample trains on exactly one turn's sampled tokens, never on re-tokenized text
    for s, turn in ((first, 0), (second, 1)):
        assert [t for t, m in zip(s.tokens, s.loss_mask) if m] == gen.reply_ids("2+3", turn)
        assert s.turns == [turn]
    # the second sample's prompt is what the model was really given at turn 2: without <think>
    assert second.tokens[:second.prompt_len] == gen.calls[1][2]
    assert "<think>" not in think_tok.decode(gen.calls[1][2], skip_special_tokens=False)
    assert "<think>" in think_tok.decode(first.tokens, skip_special_tokens=False)


def test_non_canonical_sampled_tokens_split_instead_of_retokenizing(tok):
    """A model that spells <tool_call> character by character (not its token): decoding and
    re-rendering would turn it into the one token, so the episode splits."""
    chars = [tok.convert_tokens_to_ids(c) for c in "<tool_call>"]
    rest = ids(tok, CALL[len("<tool_call>"):]) + [tok.convert_tokens_to_ids("<|im_end|>")]
    gen = ScriptedGenerate(tok, {"2+3": [CALL, "5"]}, raw={"2+3": {0: chars + rest}})
    (ep,) = asyncio.run(runner(tok, gen).run([{"prompt": "What is 2+3?"}]))
    assert ep.stop_reason == "done" and ep.tool_calls == 1 and ep.splits == 1
    assert [t for t, m in zip(ep.samples[0].tokens, ep.samples[0].loss_mask) if m] == chars + rest


def test_assembly_unit():
    a = TokenAssembly([1, 2, 3])
    a.add_completion([4, 5], [-0.1, -0.2], 3, 4)
    assert a.extend([1, 2, 3, 4, 5, 6, 7]) is True
    a.add_completion([8], [-0.3], 4, 4)
    assert a.extend([1, 2, 9]) is False and a.splits == 1  # not an extension: a new sample
    a.add_completion([10], [-0.4], 5, 5)
    assert a.extend([1, 2, 9, 10, 11]) is True  # then extends again: an observation after the last turn
    s1, s2 = a.finished_samples()
    assert (s1.tokens, s1.loss_mask, s1.logprobs) == ([1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 1, 0, 0, 1],
                                                       [0, 0, 0, -0.1, -0.2, 0, 0, -0.3])
    assert (s1.first_version, s1.last_version, s1.prompt_len) == (3, 4, 3)
    assert (s2.tokens, s2.loss_mask, s2.prompt_len) == ([1, 2, 9, 10], [0, 0, 0, 1], 3)  # trailing 11 not kept
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        a.add_completion([1, 2], [0.0])


class Loop:
    """Asks for a tool call forever (never done)."""

    def __init__(self, reward: float = 0.5):
        self.reward = reward

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, reply):
        return {"messages": [{"role": "user", "content": "again"}], "reward": self.reward, "done": False}


def test_budgets_and_stop_reasons(tok):
    script = {"q": ["x" * 10] * 10, "long": ["y" * 50]}
    gen = ScriptedGenerate(tok, script)
    make = environment_factory(environment="tests.test_env_episode:Loop", environment_args={"reward": 0.5})
    (ep,) = asyncio.run(EpisodeRunner(tok, gen, make, max_turns=3).run([{"prompt": "q"}]))
    assert (ep.stop_reason, ep.turns, ep.reward, ep.trained) == ("max_turns", 3, 1.5, True)
    # per-turn max_new_tokens: the turn is cut, the episode ends with "length" and is kept (truncated)
    (ep,) = asyncio.run(EpisodeRunner(tok, gen, make, max_new_tokens=20).run([{"prompt": "long"}]))
    assert (ep.stop_reason, ep.truncated, ep.turn_lengths, ep.trained) == ("length", True, [20], True)
    # the whole episode's budget: each turn samples at most what is left of it
    prompt_len = len(render_prompt(tok, [{"role": "user", "content": "q"}]))
    r = EpisodeRunner(tok, gen, make, max_total_tokens=prompt_len + 40)
    (ep,) = asyncio.run(r.run([{"prompt": "q"}]))
    assert ep.stop_reason == "max_total_tokens" and ep.turns == 2
    assert max(len(s.tokens) for s in ep.samples) <= prompt_len + 40
    # a first prompt over the budget: a counted skip, nothing generated
    calls = len(gen.calls)
    r = EpisodeRunner(tok, gen, make, max_total_tokens=prompt_len)
    (ep,) = asyncio.run(r.run([{"prompt": "q"}]))
    assert (ep.stop_reason, ep.samples, r.stats["skipped_prompts"]) == ("prompt_too_long", [], 1)
    assert len(gen.calls) == calls and not ep.trained


def test_failed_tool_calls_stop_with_tool_error(tok):
    bad = '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>'
    gen = ScriptedGenerate(tok, {"q": [bad, bad, "done"]})
    r = runner(tok, gen, tools=("tests.test_env_episode:broken",), max_tool_errors=1)
    (ep,) = asyncio.run(r.run([{"prompt": "q"}]))
    assert (ep.stop_reason, ep.turns, ep.tool_calls, ep.tool_errors, ep.trained) == ("tool_error", 2, 2, 2, True)
    assert ep.messages[3]["content"] == "Error: broken raised RuntimeError: no"


def test_step_result_dataclass_and_dict_agree():
    from distflow.env import check_step_result

    a = check_step_result(StepResult([], 1, True), "x")
    b = check_step_result({"messages": [], "reward": 1, "done": True}, "x")
    assert a == b and isinstance(a.reward, float)


def test_a_turn_ended_by_eos_instead_of_the_end_of_turn_splits(tok):
    """The template writes <|im_end|> after the reply, the model sampled <eos>: not the same
    tokens, so the episode splits (the sampled <eos> is trained, never replaced)."""
    eos = tok.eos_token_id
    gen = ScriptedGenerate(tok, {"2+3": [CALL, "5"]}, raw={"2+3": {0: ids(tok, CALL) + [eos]}})
    r = runner(tok, gen)
    (ep,) = r.run_sync([{"prompt": "What is 2+3?"}])
    assert ep.stop_reason == "done" and ep.tool_calls == 1 and ep.splits == 1
    assert ep.messages[2]["content"] == CALL  # the env saw the reply without its stop token
    assert ep.samples[0].tokens[-1] == eos and ep.samples[0].loss_mask[-1] == 1


class Refused:
    """Answers with a second user turn, which the strict template below refuses."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, reply):
        return StepResult([{"role": "user", "content": "{% raise %}"}], None, False, {})


def test_messages_the_template_refuses_are_an_environment_error(tmp_path):
    template = ("{%- for m in messages %}"
                "{% if m.role == 'user' and loop.index > 1 %}{{ raise_exception('one user turn only') }}{% endif %}"
                "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    strict = build_chat_tokenizer(tmp_path / "strict", template)
    gen = ScriptedGenerate(strict, {"q": ["a", "b"]})
    r = EpisodeRunner(strict, gen, environment_factory("tests.test_env_episode:Refused"))
    (ep,) = r.run_sync([{"prompt": "q"}])
    assert ep.stop_reason == "env_error" and "one user turn only" in ep.error and ep.samples == []
