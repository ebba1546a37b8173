"""Loading Hugging Face models and tokenizers from local directories, safely.

``from_pretrained`` is not thread-safe (it switches torch's default device/dtype and
init contexts globally while it builds a model), and a node loads models from worker
threads, possibly several at once (the in-process mode runs every node in one process).
All loading goes through one process-wide lock, local files only, progress bars off.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()

LOAD_LOCK = threading.Lock()


from distflow.model_dir import ModelDirError  # noqa: E402 - re-exported: distflow.hf.ModelDirError


def check_model_dir(path: str | Path) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ModelDirError(f"model_path {str(p)!r} is not a Hugging Face model directory (no config.json); "
                            f"models load from local directories only, nothing is downloaded")
    return p


def _auto_class(cfg: Any) -> Any:
    """``AutoModelForCausalLM``, or for a vision-language model (a config with a ``vision_config``:
    Qwen2-VL, which ``AutoModelForCausalLM`` does not map) ``AutoModelForImageTextToText``, whose
    ``*ForConditionalGeneration`` holds the vision tower and the language model under ``.model``."""
    if getattr(cfg, "vision_config", None) is not None:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_causal_lm(path: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> Any:
    p = check_model_dir(path)
    with LOAD_LOCK:
        cfg = AutoConfig.from_pretrained(str(p), local_files_only=True)
        model = _auto_class(cfg).from_pretrained(str(p), dtype=dtype, local_files_only=True)
    return model.to(device)


def meta_causal_lm(path: str | Path, dtype: torch.dtype) -> Any:
    """The model of ``path`` built on the meta device: its structure and config, no memory and
    no weights (a trainer rank that gets its shards from rank 0 reads no checkpoint)."""
    p = check_model_dir(path)
    with LOAD_LOCK:
        cfg = AutoConfig.from_pretrained(str(p), local_files_only=True)
        with torch.device("meta"):
            return _auto_class(cfg).from_config(cfg, dtype=dtype)


def load_tokenizer(path: str | Path) -> Any:
    p = check_model_dir(path)
    with LOAD_LOCK:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)


def chat_prompt_ids(tokenizer: Any, prompt: str | list[dict[str, Any]]) -> list[int]:
    """Token ids of ``prompt`` in the tokenizer's chat template, ready for the assistant's reply.

    ``prompt``: the text of one user turn, or a conversation as chat messages
    (``[{"role": "system" | "user" | "assistant", "content": str}, ...]``, the prompt format of
    many RL datasets). The template is rendered to text and then tokenized without extra special
    tokens (the template already holds them). This is the same on transformers 4 and 5, where
    ``apply_chat_template(tokenize=True)`` returns a ``BatchEncoding`` instead of a list.
    Raises ValueError naming what is wrong with a malformed conversation.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat_template: true, but the tokenizer has no chat template "
                         "(set chat_template: false, or use a model directory whose tokenizer has one)")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else chat_messages(prompt)
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja2's TemplateError (e.g. roles that do not alternate) is no ValueError
        if type(e).__module__.split(".")[0] != "jinja2":
            raise
        raise ValueError(f"the chat template refused the conversation: {e}") from None
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def end_of_turn(tokenizer: Any) -> tuple[int, tuple[int, ...]] | None:
    """(end-of-turn id, the ids after it) of the tokenizer's chat template: the last special token
    it writes after an assistant turn (Qwen: ``<|im_end|>`` then ``\n``; Llama 3: ``<|eot_id|>``,
    nothing after it). None without a template, for one that refuses a plain user/assistant
    exchange, or that ends the turn on no special token."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # a template that wants other roles (a system turn) or refuses this shape
        return None
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    last = next((k for k in range(len(ids) - 1, -1, -1) if ids[k] in special), None)
    return None if last is None else (ids[last], tuple(ids[last + 1:]))


def chat_messages(value: Any) -> list[dict[str, str]]:
    """``value`` checked as a non-empty list of ``{"role", "content"}`` messages (str values)."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"a chat prompt must be a non-empty list of messages, got {type(value).__name__}")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"chat message {i} must be a mapping with string 'role' and 'content', got {m!r:.80}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def logit_transform(config: Any) -> tuple[float, float | None]:
    """(multiplier, soft cap) a Hugging Face causal LM applies to ``hidden @ lm_head.T`` before its
    logits come out: Granite divides by ``logits_scaling``, Cohere multiplies by ``logit_scale`` (and
    some models by ``output_multiplier``), Gemma 2/3 soft-cap at ``final_logit_softcapping``
    (``cap * tanh(x / cap)``). The trainer's logprobs must be of the distribution the engine sampled
    from (``model(...).logits``), or the importance ratio is not 1 on-policy."""
    mult = 1.0
    for key, invert in (("logits_scaling", True), ("logit_scale", False), ("output_multiplier", False)):
        v = getattr(config, key, None)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"model config {key}={v!r}: expected a positive number")
        mult = mult / v if invert else mult * v
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
        raise ValueError(f"model config final_logit_softcapping={cap!r}: expected a positive number or null")
    return float(mult), (None if cap is None else float(cap))
