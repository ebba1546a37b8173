"""Token-in, token-out: an episode's training samples from exactly the tokens the engine sampled.

Why it exists: the tempting way to build a multi-turn sample is to render the finished
conversation with the chat template and tokenize it. That trains on tokens the policy never
sampled whenever tokenization is not the inverse of decoding (a word the model spelled in two
tokens comes back as one) or the template rewrites history (Qwen3 drops earlier ``<think>``
blocks), and the logprobs the engine returned no longer line up: the importance ratio is of
the wrong tokens. Here the sequence is built the other way round:

* the sampled tokens of each turn go in as they came from the engine, with their logprobs and
  loss mask 1 (the stop token too: the model chose to end its turn);
* between turns, the next prompt is rendered from the conversation (template and tokenizer)
  and must **extend the previous context token for token** (the previous context = the last
  prompt + the tokens sampled after it). Only the tokens it adds (the end of the assistant
  turn the template writes, the observation, the next ``<|im_start|>assistant``) go in, with
  loss mask 0 and logprob 0;
* where the rendered prompt does not extend the context, the episode is **split**: the sample
  so far is closed, and a new one starts with the rendered prompt as its prompt (counted in
  ``splits``). Nothing is ever re-tokenized silently.

:func:`render_prompt` renders; :class:`TokenAssembly` keeps the samples of one episode;
:class:`Sample` is one training sample; :class:`Episode` is what the runner returns. Plain
lists of ints, no torch: :meth:`Sample.tensors` builds tensors when asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Sample", "Episode", "TokenAssembly", "render_prompt", "end_of_turn_id", "TemplateError", "STOP_REASONS",
           "TRAINED_STOPS"]

# Why an episode ended. done: the environment said so; max_turns / max_total_tokens: a budget;
# length: a turn was cut at max_new_tokens; tool_error: too many failed tool calls;
# env_error: the environment raised, returned something malformed or hung (not trained);
# prompt_too_long: the first prompt leaves no room in max_total_tokens (a counted skip).
STOP_REASONS = ("done", "max_turns", "max_total_tokens", "length", "tool_error", "env_error", "prompt_too_long")
TRAINED_STOPS = frozenset({"done", "max_turns", "max_total_tokens", "length", "tool_error"})


class TemplateError(ValueError):
    """The chat template refused the conversation, or rendered no tokens."""


def render_prompt(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` in the tokenizer's chat template, ready for the assistant's next
    reply (``add_generation_prompt=True``), with ``tools`` given to the template. Rendered to text
    and then tokenized without extra special tokens (the template holds them), as
    :func:`distflow.hf.chat_prompt_ids` does for single-turn prompts."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("the tokenizer has no chat template (multi-turn episodes need one)")
    kw = {"tools": tools} if tools else {}
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    except Exception as e:  # jinja2's TemplateError (roles out of order, a raise_exception) is no ValueError
        raise TemplateError(f"the chat template refused the conversation: {type(e).__name__}: {e}") from None
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise TemplateError("the chat template rendered no tokens")
    return ids


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The token the chat template ends an assistant turn with (Qwen: ``<|im_end|>``): the last
    special token of a rendered one-exchange conversation; None when there is none. The engine
    must stop on it, and it is stripped from the reply text the environment sees. (The logic of
    :func:`distflow.hf.end_of_turn`, without importing torch.)"""
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # a template that wants other roles, or refuses this shape
        return None
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return next((t for t in reversed(ids) if t in special), None)


@dataclass
class Sample:
    """One training sample of an episode: ``tokens`` = ``prompt_len`` prompt tokens, then the
    turns. ``loss_mask[i]`` is 1 exactly where ``tokens[i]`` was sampled by the engine, and
    ``logprobs[i]`` is its sampling logprob there (0.0 elsewhere). ``turns``: the episode's turn
    indices this sample holds; versions: the weights that sampled its first and last token."""

    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_len: int
    turns: list[int] = field(default_factory=list)
    first_version: int = 0
    last_version: int = 0

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def response_mask(self) -> list[int]:
        return self.loss_mask[self.prompt_len:]

    @property
    def response_logprobs(self) -> list[float]:
        return self.logprobs[self.prompt_len:]

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    def tensors(self) -> dict[str, Any]:
        """``tokens`` (int64), ``loss_mask`` (int64), ``logprobs`` (float32) as torch tensors
        (torch is imported here, not by the module)."""
        import torch

        return {"tokens": torch.tensor(self.tokens, dtype=torch.int64),
                "loss_mask": torch.tensor(self.loss_mask, dtype=torch.int64),
                "logprobs": torch.tensor(self.logprobs, dtype=torch.float32)}


class TokenAssembly:
    """The samples of one episode, built turn by turn (see the module doc).

    ``start(prompt)`` once, then per turn ``add_completion(tokens, logprobs)`` and, if the episode
    goes on, ``extend(next_prompt)`` (False and a new sample when it does not extend)."""

    def __init__(self, prompt: list[int]):
        self.samples: list[Sample] = [Sample(list(prompt), [0] * len(prompt), [0.0] * len(prompt), len(prompt))]
        self.splits = 0
        self.turn = 0  # turns completed

    @property
    def context(self) -> list[int]:
        """What the model has seen and said so far in the current sample (its next prompt must extend it)."""
        return self.samples[-1].tokens

    def add_completion(self, tokens: list[int], logprobs: list[float], first_version: int = 0,
                       last_version: int = 0) -> None:
        """Append one turn's sampled tokens (loss mask 1) and their logprobs."""
        if len(tokens) != len(logprobs):
            raise ValueError(f"a completion has {len(tokens)} tokens but {len(logprobs)} logprobs")
        s = self.samples[-1]
        if not s.turns:
            s.first_version = first_version
        s.last_version = last_version
        s.tokens += tokens
        s.loss_mask += [1] * len(tokens)
        s.logprobs += [float(x) for x in logprobs]
        s.turns.append(self.turn)
        self.turn += 1

    def extend(self, prompt: list[int]) -> bool:
        """Take the next turn's rendered ``prompt``. When it starts with the whole current context,
        its new tokens are appended with loss mask 0 (True). Otherwise the template broke the
        extension property: the current sample is closed and a new one starts from ``prompt``
        (False; ``splits`` counts it)."""
        ctx = self.context
        if len(prompt) >= len(ctx) and prompt[:len(ctx)] == ctx:
            extra = prompt[len(ctx):]
            s = self.samples[-1]
            s.tokens += extra
            s.loss_mask += [0] * len(extra)
            s.logprobs += [0.0] * len(extra)
            return True
        self.splits += 1
        self.samples.append(Sample(list(prompt), [0] * len(prompt), [0.0] * len(prompt), len(prompt)))
        return False

    def finished_samples(self) -> list[Sample]:
        """The samples with at least one sampled token, each ending on its last sampled token
        (an observation after the last turn is not part of any sample)."""
        out = []
        for s in self.samples:
            if not s.turns:
                continue
            last = max(i for i, m in enumerate(s.loss_mask) if m) + 1 if any(s.loss_mask) else s.prompt_len
            out.append(Sample(s.tokens[:last], s.loss_mask[:last], s.logprobs[:last], s.prompt_len, list(s.turns),
                              s.first_version, s.last_version))
        return out


@dataclass
class Episode:
    """One episode's outcome: its training ``samples`` (empty when not trained: an environment
    error or a skip), the ``reward`` (sum of the steps' non-None rewards; None when the
    environment gave none), why it stopped, and its metrics."""

    row: dict
    samples: list[Sample] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)
    stop_reason: str = ""
    error: str | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    splits: int = 0
    turn_lengths: list[int] = field(default_factory=list)  # sampled tokens per turn
    observation_lengths: list[int] = field(default_factory=list)  # tokens added between turns (masked)
    env_time_s: float = 0.0
    generate_time_s: float = 0.0
    truncated: bool = False  # the last turn was cut at max_new_tokens (or the episode's token budget)
    info: dict = field(default_factory=dict)  # the last step's info

    @property
    def trained(self) -> bool:
        return self.stop_reason in TRAINED_STOPS and bool(self.samples)

    @property
    def reward(self) -> float | None:
        given = [r for r in self.rewards if r is not None]
        return sum(given) if given else None

    @property
    def length(self) -> int:
        """Tokens of the episode's samples (prompts, turns and observations)."""
        return sum(len(s.tokens) for s in self.samples)

    def metrics(self) -> dict[str, Any]:
        return {"turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "stop_reason": self.stop_reason, "splits": self.splits, "samples": len(self.samples),
                "turn_lengths": list(self.turn_lengths), "observation_lengths": list(self.observation_lengths),
                "episode_length": self.length, "sampled_tokens": sum(self.turn_lengths),
                "env_time_s": self.env_time_s, "generate_time_s": self.generate_time_s,
                "reward": self.reward, "truncated": self.truncated, "error": self.error}
