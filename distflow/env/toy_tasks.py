"""The tool toy task: a secret only a tool returns, learned by a tiny random model on CPU.

Why it exists: the agentic path (episodes, tools, loss masks, per-episode metrics) needs an
example that learns end to end in CI without downloading anything, as the successor toy does
for single-turn RL (``examples/tool_quickstart.yaml``). Each row holds a random ``secret`` digit
the prompt does not show (the prompt is only the row's number); the only way to the answer is
to call the ``lookup`` tool and copy what it returns:

* turn 1: a reply holding ``<tool_call>`` calls ``lookup()`` (a toy tool without arguments: the
  tiny model cannot be asked to write JSON; :class:`~distflow.env.tools.ToolEnvironment` is the
  real Hermes parser). The secret comes back as a ``tool`` message, with ``call_reward``;
* the next reply is the answer: ``answer_reward`` when it starts with the secret, and the
  episode ends. A reply without a tool call is an answer too (a guess, right one time in ten).

The toy model (``toy_kind: tool``) is the character-level chat tokenizer of
:mod:`distflow.env.toy` with its Hermes template, cut down to digits and newline (every other
character of the template is ``<unk>``; its EOS is the template's ``<|im_end|>``), and a tiny
random Llama: near-uniform over ~22 tokens,
a random policy calls the tool in a few percent of its episodes, enough for GRPO to start.
"""

from __future__ import annotations

import os
from typing import Any

from distflow.env.api import StepResult

__all__ = ["LookupEnv", "lookup_agent", "build_tool_model", "make_tool_dataset", "TOOL_CHARS"]

TOOL_CHARS = "0123456789\n"


class LookupEnv:
    """One episode of the lookup task (module docstring). ``row``: ``prompt`` (shown) and
    ``secret`` (hidden)."""

    def __init__(self, call_reward: float = 0.5, answer_reward: float = 0.5):
        self.call_reward, self.answer_reward = float(call_reward), float(answer_reward)
        self.secret = ""
        self.called = False

    async def reset(self, row: dict) -> list[dict]:
        self.secret, self.called = str(row["secret"]), False
        return [{"role": "user", "content": str(row["prompt"])}]

    async def step(self, reply: str) -> StepResult:
        if not self.called and "<tool_call>" in reply:
            self.called = True
            return StepResult(messages=[{"role": "tool", "name": "lookup", "content": self.secret}],
                              reward=self.call_reward, done=False, info={"tool_calls": 1, "tool_errors": 0})
        right = reply.strip().startswith(self.secret)
        return StepResult(messages=[], reward=self.answer_reward if right else 0.0, done=True,
                          info={"tool_calls": 0, "tool_errors": 0})


async def lookup_agent(row: dict, client: Any) -> float:
    """The lookup task as an ``agent:`` on the chat endpoint (docs/agents.md), scored as
    :class:`LookupEnv` scores it: a first reply holding ``<tool_call>`` (or parsed ``tool_calls``)
    earns 0.5 and gets the secret back as a tool message; the reply after it (or a first reply
    without a call) earns 0.5 when it starts with the secret. A budget that ends the episode
    (:class:`~distflow.env.agent.EpisodeOver`) leaves the reward earned so far."""
    from distflow.env.agent import EpisodeOver

    secret, reward = str(row["secret"]), 0.0
    messages: list[dict] = [{"role": "user", "content": str(row["prompt"])}]
    try:
        reply = (await client.chat(messages))["choices"][0]["message"]
        if reply.get("tool_calls") or "<tool_call>" in (reply.get("content") or ""):
            reward += 0.5
            messages += [reply, {"role": "tool", "name": "lookup", "content": secret}]
            reply = (await client.chat(messages))["choices"][0]["message"]
    except EpisodeOver:
        return reward
    return reward + (0.5 if (reply.get("content") or "").strip().startswith(secret) else 0.0)


def build_tool_model(out_dir: str | os.PathLike[str], *, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                     num_heads: int = 4, max_position_embeddings: int = 128, init_std: float = 0.02) -> str:
    """The toy chat tokenizer over :data:`TOOL_CHARS` and a tiny random Llama into ``out_dir``
    (deterministic for ``seed``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from distflow.env.toy import build_chat_tokenizer

    tok = build_chat_tokenizer(out_dir, chars=TOOL_CHARS)
    # The end of turn is the only stop: a turn ended by <eos> would be rendered back with <|im_end|> by
    # the template, which breaks the extension property and splits every such episode (docs/agents.md).
    tok.eos_token = "<|im_end|>"
    tok.save_pretrained(str(out_dir))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                         max_position_embeddings=max_position_embeddings, initializer_range=init_std,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return str(out_dir)


def make_tool_dataset(path: str | os.PathLike[str], n_rows: int, seed: int = 0) -> str:
    """``n_rows`` JSONL rows ``{"prompt": "4821", "secret": "4"}``: the prompt a random 4-digit
    number, the secret a random digit it does not determine (deterministic for ``seed``)."""
    from distflow.toy_gsm8k import write_rows  # the one writer of the generated toy datasets

    return write_rows(path, n_rows, seed, lambda rng: {"prompt": f"{rng.randrange(10_000):04d}",
                                                       "secret": str(rng.randrange(10))})
