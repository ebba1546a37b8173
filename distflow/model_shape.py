"""The widths a tensor-parallel split divides, read from a model's config (torch-free).

Why it exists: the trainer's tensor parallelism (:mod:`distflow.trainer.parallel`) and the engine's
(:mod:`distflow.rollout.tp_shard`) split the same things (attention heads, KV heads, the MLP width)
and refuse the same models; rollout code does not import the trainer, so the reading lives below both.
"""

from __future__ import annotations

from typing import Any

__all__ = ["split_widths", "undivided"]


def split_widths(config: Any) -> dict[str, int]:
    """``num_attention_heads``, ``num_key_value_heads`` (the heads when unset) and ``intermediate_size``
    of a model config (its text config for a vision-language model)."""
    cfg = getattr(config, "text_config", None) or config
    heads = int(cfg.num_attention_heads)
    return {"num_attention_heads": heads, "num_key_value_heads": int(getattr(cfg, "num_key_value_heads", None) or heads),
            "intermediate_size": int(cfg.intermediate_size)}


def undivided(config: Any, n: int) -> dict[str, int]:
    """The widths of :func:`split_widths` that ``n`` does not divide (each rank must hold whole heads)."""
    return {what: v for what, v in split_widths(config).items() if v % n}
