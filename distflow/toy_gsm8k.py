"""A GSM8K-class task small enough for CI: word problems, a BPE chat tokenizer, a tiny Qwen2.

Why it exists: the successor toy (distflow.toy) has a 17-symbol character tokenizer, one
token answers and no chat template, so it never exercises what a real post-training run
does: a byte-level BPE tokenizer, a Qwen-style chat template around every prompt,
multi-token responses that end on EOS or on the length limit, and a reward that has to
parse a final number out of free text. This module builds, offline and deterministically
for a seed, the same shapes as a real GSM8K run on a Qwen2.5 model:

- :func:`make_gsm8k_dataset`: arithmetic word problems in GSM8K's JSONL format
  (``question``; ``answer`` = worked solution ending in ``#### <number>``);
- :func:`build_gsm8k_tokenizer`: a byte-level BPE tokenizer trained with the
  ``tokenizers`` library on such problems, with Qwen's specials (``<|endoftext|>``,
  ``<|im_start|>``, ``<|im_end|>``), eos = ``<|im_end|>`` and a Qwen-style chat template;
- :func:`build_gsm8k_model`: a randomly initialised ``Qwen2ForCausalLM`` (qkv bias, GQA)
  saved with ``save_pretrained``, next to its tokenizer.

``distflow toy-model --kind gsm8k DIR`` and ``toy_model: true`` with ``toy_kind: gsm8k``
build it; examples/grpo_gsm8k_tiny.yaml runs GRPO on it; docs/gsm8k.md shows the same
config on a real model directory.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_gsm8k_model", "build_gsm8k_tokenizer", "make_gsm8k_dataset",
           "make_problem"]

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5's template, without the tool-calling branches.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
INSTRUCTION = "Give the final answer after ####."

_NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Kate", "Liam")
_THINGS = ("apples", "marbles", "stickers", "pencils", "cookies", "books", "coins", "stamps")


def make_problem(rng: random.Random) -> tuple[str, str, int]:
    """One word problem: (question, GSM8K-style solution ending in ``#### N``, N)."""
    name, other = rng.sample(_NAMES, 2)
    thing = rng.choice(_THINGS)
    kind = rng.randrange(5)
    a, b, c = rng.randint(2, 40), rng.randint(2, 20), rng.randint(1, 15)
    if kind == 0:
        q = f"{name} has {a} {thing}. {other} gives {name} {b} more. How many {thing} does {name} have now?"
        n, steps = a + b, f"{name} has {a} + {b} = {a + b} {thing}."
    elif kind == 1:
        a = a + b
        q = f"{name} had {a} {thing} and gave {b} of them to {other}. How many {thing} does {name} have left?"
        n, steps = a - b, f"{name} has {a} - {b} = {a - b} {thing} left."
    elif kind == 2:
        q = f"A box holds {b} {thing}. {name} buys {c} boxes. How many {thing} does {name} buy?"
        n, steps = b * c, f"{name} buys {c} * {b} = {b * c} {thing}."
    elif kind == 3:
        q = f"{name} shares {b * c} {thing} equally among {c} friends. How many {thing} does each friend get?"
        n, steps = b, f"Each friend gets {b * c} / {c} = {b} {thing}."
    else:
        earned = b * c
        a = 1 + a % (earned - 1)  # spends less than earned: GSM8K answers are not negative
        q = (f"{name} earns {b} dollars a day for {c} days and then spends {a} dollars on {thing}. "
             f"How many dollars does {name} have left?")
        n, steps = earned - a, f"{name} earns {b} * {c} = {earned} dollars. {earned} - {a} = {earned - a}."
    return f"{q} {INSTRUCTION}", f"{steps}\n#### {n}", n


def make_gsm8k_dataset(path: str | os.PathLike[str], n_rows: int, seed: int = 0) -> str:
    """Write ``n_rows`` JSONL rows ``{"question": ..., "answer": "... #### N"}``; deterministic for ``seed``."""

    def row(rng: random.Random) -> dict:
        q, a, _ = make_problem(rng)
        return {"question": q, "answer": a}

    return write_rows(path, n_rows, seed, row)


def build_gsm8k_tokenizer(out_dir: str | os.PathLike[str], *, seed: int = 0, vocab_size: int = 512,
                          corpus_rows: int = 2000):
    """Train a byte-level BPE tokenizer on generated problems and solutions; save and return
    it (a ``PreTrainedTokenizerFast`` with eos ``<|im_end|>``, pad ``<|endoftext|>`` and the
    chat template). Deterministic for ``seed``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    corpus = []
    for _ in range(corpus_rows):
        q, a, _ = make_problem(rng)
        corpus += [q, a]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(corpus + ["user", "assistant", "system", "\n"], trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  padding_side="left", model_max_length=1024)
    tok.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return tok


def build_gsm8k_model(out_dir: str | os.PathLike[str], *, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                      num_heads: int = 4, num_kv_heads: int = 2, max_position_embeddings: int = 512) -> str:
    """The tokenizer plus a tiny random ``Qwen2ForCausalLM`` in ``out_dir``; returns it as a string.
    Deterministic for ``seed``; loads back with ``AutoModelForCausalLM.from_pretrained``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_gsm8k_tokenizer(out_dir, seed=seed)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return str(out_dir)


def write_rows(path: str | os.PathLike[str], n_rows: int, seed: int, row) -> str:
    """Write ``n_rows`` JSONL rows ``row(rng)`` with one ``random.Random(seed)``; returns the path.
    The one writer of the generated toy datasets (successor, gsm8k)."""
    if n_rows < 0:
        raise ValueError(f"n_rows must be >= 0, got {n_rows}")
    rng = random.Random(seed)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
        for _ in range(n_rows):
            f.write(json.dumps(row(rng)) + "\n")
    return str(p)
