"""The shipped toy task: a tiny character-level model that RL can teach on a CPU.

Why it exists: the quickstart (``distflow run``), the tests and the benchmarks all need
a policy, a tokenizer and a verifiable task without downloading anything. This module
builds them from scratch, deterministically for a seed:

- a character-level tokenizer with a vocabulary of 17 symbols (digits, ``=``, ``+``,
  space and five special tokens), so that a random policy emits the right digit about
  one time in sixteen and reward is not too sparse to learn from;
- a tiny randomly initialised Llama-style causal LM saved with ``save_pretrained``
  (safetensors), loadable with ``AutoModelForCausalLM.from_pretrained``;
- the "successor" task: the prompt is a few digits followed by ``=`` (``"3947="``),
  the answer is the last digit plus one, modulo 10 (``"8"``).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from distflow.toy_gsm8k import build_gsm8k_model, write_rows  # write_rows: the one writer of generated datasets

__all__ = [
    "TOY_CHARS",
    "TOY_SPECIAL_TOKENS",
    "build_toy_tokenizer",
    "build_toy_model",
    "build_toy_reward_model",
    "ensure_toy_model",
    "make_toy_dataset",
    "successor_answer",
    "toy_prompt",
]

# Order matters: ids are assigned in this order (specials first), so they are stable.
TOY_SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<bos>", "<unk>")
TOY_CHARS: tuple[str, ...] = tuple("0123456789") + ("=", "+", " ")
_MIN_DIGITS = 3
_MAX_DIGITS = 6


def build_toy_tokenizer(out_dir: str | os.PathLike[str]):  # -> PreTrainedTokenizerFast
    """Build the character-level tokenizer, save it into ``out_dir`` and return it.

    Every character of :data:`TOY_CHARS` is one token; anything else maps to ``<unk>``.
    Encoding prepends ``<bos>``; decoding concatenates characters with no separator.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TOY_SPECIAL_TOKENS + TOY_CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # One piece per character (including spaces and newlines).
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=64,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return tok


def build_toy_model(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 64,
    init_std: float = 0.02,
) -> str:
    """Build the toy tokenizer and a tiny random Llama-style causal LM into ``out_dir``.

    Deterministic for ``seed`` (same bytes of weights for the same arguments). Returns
    ``out_dir`` as a string. Loads back with ``AutoModelForCausalLM.from_pretrained``.
    ``init_std`` is the weight init scale: the default 0.02 gives a near-uniform policy
    (what RL starts from); larger values give a sharper, "opinionated" random model.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
    tok = build_toy_tokenizer(out_dir)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    # Fork the RNG so building a model never perturbs the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return str(out_dir)


def build_toy_reward_model(out_dir: str | os.PathLike[str], *, seed: int = 0, hidden_size: int = 32,
                           num_layers: int = 1, num_heads: int = 2, init_std: float = 0.02) -> str:
    """Build a tiny RANDOMLY initialised reward model over the toy tokenizer into ``out_dir``:
    a ``LlamaForSequenceClassification`` with ``num_labels=1`` (a scalar score), loadable
    with ``AutoModelForSequenceClassification``. Deterministic for ``seed``. Its score is
    not informative about the successor task (it is a stand-in that exercises the learned
    reward path end to end); the shipped config adds it, down-weighted, to the rule reward."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = build_toy_tokenizer(out_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                         max_position_embeddings=64, initializer_range=init_std, num_labels=1,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return str(out_dir)


def ensure_toy_model(out_dir: str | os.PathLike[str], *, seed: int = 0, kind: str = "successor") -> str:
    """Build the toy model of ``kind`` (``successor``: this module's; ``tool``:
    :func:`distflow.env.toy_tasks.build_tool_model`; ``gsm8k``:
    :func:`distflow.toy_gsm8k.build_gsm8k_model`; ``reward``: :func:`build_toy_reward_model`; ``vlm``:
    :func:`distflow.toy_vlm.build_vlm_model`) into ``out_dir`` unless a ``config.json`` is already there."""
    if kind not in ("successor", "gsm8k", "reward", "tool", "vlm"):
        raise ValueError(f"toy model kind {kind!r} is not successor, gsm8k, reward, tool or vlm")
    if not (Path(out_dir) / "config.json").is_file():
        if kind == "vlm":  # a tiny Qwen2-VL and its image processor (needs pillow: the vlm extra)
            from distflow.toy_vlm import build_vlm_model

            build_vlm_model(out_dir, seed=seed)
        elif kind == "tool":  # the tool toy task's (distflow.env.toy_tasks): a chat template, digits only
            from distflow.env.toy_tasks import build_tool_model

            build_tool_model(out_dir, seed=seed)
        elif kind == "reward":
            build_toy_reward_model(out_dir, seed=seed)
        elif kind == "gsm8k":
            build_gsm8k_model(out_dir, seed=seed)
        else:
            build_toy_model(out_dir, seed=seed)
    return str(out_dir)


def successor_answer(prompt: str) -> str:
    """The right answer to a successor prompt: ``"3947="`` -> ``"8"``."""
    body = prompt.strip()
    if body.endswith("="):
        body = body[:-1]
    body = body.strip()
    if not body or not body[-1].isdigit():
        raise ValueError(f"not a successor prompt (expected digits followed by '='): {prompt!r}")
    return str((int(body[-1]) + 1) % 10)


def toy_prompt(rng: random.Random) -> str:
    """One random successor prompt: 3 to 6 digits followed by ``=``."""
    n = rng.randint(_MIN_DIGITS, _MAX_DIGITS)
    return "".join(rng.choice("0123456789") for _ in range(n)) + "="


def make_toy_dataset(path: str | os.PathLike[str], n_rows: int, seed: int = 0) -> str:
    """Write ``n_rows`` JSONL rows ``{"prompt": "3947=", "answer": "8"}``; deterministic for ``seed``."""
    def row(rng: random.Random) -> dict:
        prompt = toy_prompt(rng)
        return {"prompt": prompt, "answer": successor_answer(prompt)}

    return write_rows(path, n_rows, seed, row)


