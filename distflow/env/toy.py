"""A tiny chat tokenizer with a Hermes-style tool template, and a scripted ``generate``.

Why it exists: the episode machinery must be tested against a real tokenizer and a real
Jinja chat template (rendered by ``apply_chat_template``, tools included), loaded back with
``from_pretrained`` from a local directory, without downloading anything. The tokenizer is
character-level over printable ASCII plus the Qwen-style specials (``<|im_start|>``,
``<|im_end|>``, ``<tool_call>``, ...), so every token is easy to reason about.
:class:`ScriptedGenerate` stands in for the engine in the tests (and, later, in examples):
it answers each episode's turns from a script, as token ids with logprobs.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

__all__ = ["HERMES_TEMPLATE", "DROP_THINK_TEMPLATE", "CHAT_SPECIALS", "build_chat_tokenizer", "ScriptedGenerate"]

CHAT_SPECIALS = ("<pad>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>")
CHAT_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

# Qwen2.5 / Hermes in miniature: tools listed in the system turn, tool results in a user turn
# wrapped in <tool_response>, every turn "<|im_start|>role\n...<|im_end|>\n".
_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a tool as <tool_call>{"name": name, "arguments": {...}}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ CONTENT }}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
HERMES_TEMPLATE = _TEMPLATE.replace("CONTENT", "m.content").strip("\n")
# Like Qwen3: earlier assistant turns are rendered without their <think>...</think> reasoning,
# which breaks the extension property of a multi-turn episode.
DROP_THINK_TEMPLATE = _TEMPLATE.replace(
    "CONTENT", "m.content.split('</think>')[-1].lstrip('\\n') if (not loop.last and '</think>' in m.content) "
               "else m.content").strip("\n")


def build_chat_tokenizer(out_dir: str | os.PathLike[str], template: str = HERMES_TEMPLATE,
                         chars: str | None = None):  # -> a fast tokenizer
    """Build the character-level chat tokenizer with ``template``, save it into ``out_dir`` and
    load it back with ``AutoTokenizer.from_pretrained`` (the path a model directory takes).
    ``chars``: the characters of the vocabulary (default: printable ASCII and newline; others
    become ``<unk>``): the tool toy task keeps only digits and newline, so that a random policy
    samples a tool call often enough to learn from it."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    chars = list(dict.fromkeys(chars)) if chars is not None else [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(CHAT_SPECIALS + CHAT_MARKERS + tuple(chars))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIALS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_MARKERS])  # as Qwen's
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                  model_max_length=4096)
    tok.chat_template = template
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return AutoTokenizer.from_pretrained(str(out), local_files_only=True)


class ScriptedGenerate:
    """``generate(prompt_ids, params) -> Completion`` from a script: ``scripts[key]`` is the list of
    reply texts of the episode whose prompt contains ``key``, turn by turn (the turn is the number
    of assistant turns already in the prompt). Each reply is tokenized canonically and ends with
    ``<|im_end|>``, unless ``raw[key][turn]`` gives the token ids to return instead; it is cut at
    ``params.max_new_tokens`` (``finish_reason: length``). Logprobs are distinct per position:
    ``-(turn + 1) - i / 1000``. ``delay``: seconds each call takes. Records every call in ``calls``
    as (key, turn, prompt ids, time)."""

    def __init__(self, tokenizer: Any, scripts: dict[str, list[str]], *,
                 raw: dict[str, dict[int, list[int]]] | None = None, delay: float = 0.0, version: int = 0):
        self.tok, self.scripts, self.raw, self.delay, self.version = tokenizer, scripts, raw or {}, delay, version
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.calls: list[tuple[str, int, list[int], float]] = []

    def reply_ids(self, key: str, turn: int) -> list[int]:
        if turn in self.raw.get(key, {}):
            return list(self.raw[key][turn])
        return list(self.tok(self.scripts[key][turn], add_special_tokens=False)["input_ids"]) + [self.end]

    @staticmethod
    def logprobs(turn: int, n: int) -> list[float]:
        return [-(turn + 1) - i / 1000 for i in range(n)]

    async def __call__(self, prompt_ids: list[int], params: Any) -> Any:
        from distflow.rollout.protocol import Completion

        text = self.tok.decode(prompt_ids, skip_special_tokens=False)
        first_user = text.split("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]
        keys = [k for k in self.scripts if k in first_user]
        if len(keys) != 1:
            raise KeyError(f"no single script matches the prompt (matches: {keys})")
        turn = text.count("<|im_start|>assistant") - 1
        self.calls.append((keys[0], turn, list(prompt_ids), asyncio.get_running_loop().time()))
        if self.delay:
            await asyncio.sleep(self.delay)
        ids = self.reply_ids(keys[0], turn)
        cut = len(ids) > params.max_new_tokens
        ids = ids[:params.max_new_tokens]
        return Completion(ids, self.logprobs(turn, len(ids)), "length" if cut else "stop", self.version, self.version)
