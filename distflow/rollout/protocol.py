"""The rollout-engine protocol and the plain types every engine shares.

Why it exists: the built-in engine (:mod:`distflow.rollout.torch_engine`), the vLLM
adapter (:mod:`distflow.rollout.vllm_engine`) and the rollout stages all speak the same
small interface — ``generate(prompts, params, seed, *, weights_update) -> [Completion]``
and ``load_weights(version, weights)`` — so its types and request validation live here,
apart from any one implementation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, Union, runtime_checkable

import torch

__all__ = ["Completion", "RolloutEngine", "SamplingParams", "Weights", "WeightsUpdate", "parse_dtype"]

# What load_weights accepts: one name -> tensor mapping, or an iterable of bucket mappings.
Weights = Union[Mapping[str, torch.Tensor], Iterable[Mapping[str, torch.Tensor]]]
# Polled by generate() at step boundaries: None (nothing new), (version, weights), or
# (version, weights, partial) where partial=True marks a delta (a subset of the names).
WeightsUpdate = Callable[[], "tuple[int, Weights] | tuple[int, Weights, bool] | None"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` are off."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()  # extra stop ids; the model/tokenizer EOS is always added

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"SamplingParams.stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")


class NonFiniteOutputError(RuntimeError):
    """The policy's logits were not finite (NaN or inf) while sampling: its weights diverged (a
    learning rate far too high). Deterministic for those weights, so the node exits 2 (not
    restarted) naming the weights version, instead of sampling garbage."""


def check_finite_logprobs(logprobs: list[float], version: int) -> None:
    """Raise :class:`NonFiniteOutputError` when a sampled token's logprob is NaN (the sampler's
    mark of a row whose logits were not finite)."""
    if any(x != x for x in logprobs):  # NaN != NaN; cheaper than math.isnan per element
        raise NonFiniteOutputError(f"the policy (weights version {version}) gives non-finite logits: training "
                                   f"diverged (the trainer's log names the step; lower lr, or grad_clip)")


@dataclass
class Completion:
    """One sampled continuation of one prompt."""

    tokens: list[int]  # generated tokens, including the stop token if one was produced
    logprobs: list[float]  # per token: log_softmax(logits / T)[token] before top-k/top-p (T = 1 when greedy)
    finish_reason: str  # "stop" | "length"
    first_version: int = 0  # weights version that produced the first token
    last_version: int = 0  # weights version that produced the last token (> first after a mid-sequence swap)


@runtime_checkable
class RolloutEngine(Protocol):
    """What a rollout node needs from a generation backend. An engine may also have ``max_positions``
    (positions per sequence, prompt + response; None: unknown): longer prompts are then skipped and
    counted before ``generate`` (:func:`distflow.rollout.stages.prompt_limit`)."""

    version: int
    tokenizer: Any

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None, *,
                 weights_update: WeightsUpdate | None = None) -> list[Completion]:
        ...

    def load_weights(self, version: int, weights: Weights, partial: bool = False) -> None:
        ...

    def close(self) -> None:
        ...


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16`` or ``"bfloat16"``/``"bf16"`` -> ``torch.bfloat16`` (clear error otherwise)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"unknown dtype {dtype!r}: expected a torch.dtype or one of {sorted(_DTYPES)}")


def check_model_dir(model_path: str | Path) -> Path:
    """``model_path`` as a model directory the engines can load, else :class:`distflow.model_dir.ModelDirError`
    naming the key: a configuration error, so the node exits 2 in one line and `distflow run` does
    not restart it (a FileNotFoundError was exit 1 with a traceback, and restarted)."""
    path = Path(model_path)
    if not (path / "config.json").is_file():
        from distflow.model_dir import ModelDirError, model_dir_problem

        raise ModelDirError(f"model_path: {model_dir_problem(str(path))}")
    return path


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or len(p) == 0:
            raise ValueError(f"prompt {i} must be a non-empty list of token ids, got {p!r:.80}")
        for t in p:
            if isinstance(t, bool) or not isinstance(t, int) or not (0 <= t < vocab_size):
                raise ValueError(f"prompt {i} has token {t!r}, outside the vocabulary [0, {vocab_size})")




def head(items: Sequence[str], n: int = 5) -> str:
    """The first ``n`` items joined, with a count of the rest (for error messages)."""
    shown = ", ".join(items[:n])
    return shown + (f", ... (+{len(items) - n} more)" if len(items) > n else "")
