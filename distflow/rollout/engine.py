"""Rollout engines: turn prompt token ids into sampled completions with their logprobs.

Why it exists: a rollout node needs one small interface, whatever does the generation —
``generate(prompts, params, seed, *, weights_update=None) -> [Completion]`` and
``load_weights(version, weights)`` — and one place that picks the engine by name.
:class:`TorchEngine` (:mod:`distflow.rollout.torch_engine`) is the built-in engine:
continuous batching over a static KV cache, CUDA-graph decode on GPUs, interruptible for
new weights; :class:`VLLMEngine` (:mod:`distflow.rollout.vllm_engine`) adapts vLLM's
offline ``LLM`` API. :class:`TorchEngine` reports, per generated token, the fp32 logprob
of the sampled token under ``log_softmax(logits / temperature)`` *before* top-k/top-p
filtering, which is exactly what the trainer recomputes
(``distflow.trainer.logprobs.token_logprobs``) for importance ratios. vLLM's logprobs are
taken *after* its top-k/top-p renormalisation, so they match the trainer's only with
``top_p: 1`` and ``top_k: 0`` (the vLLM engine warns otherwise: the ratios are biased).
"""

from __future__ import annotations

from typing import Any

from distflow.rollout.protocol import Completion, RolloutEngine, SamplingParams, parse_dtype
from distflow.rollout.sampling import filter_top_k_top_p, sample_next
from distflow.rollout.torch_engine import TorchEngine
from distflow.rollout.vllm_engine import VLLMEngine

__all__ = [
    "Completion",
    "RolloutEngine",
    "SamplingParams",
    "TorchEngine",
    "VLLMEngine",
    "filter_top_k_top_p",
    "make_engine",
    "parse_dtype",
    "sample_next",
]

ENGINES = ("torch", "vllm")


def make_engine(name: str, model_path: str, **kw: Any) -> RolloutEngine:
    """Build the engine called ``name`` ("torch" | "vllm") for the model in ``model_path``.

    Keywords go to the engine (``device``, ``dtype``, ``max_batch_size``; ``compile``,
    ``max_slots`` and ``max_length`` for the torch engine, which vLLM ignores as it batches,
    sizes its cache and compiles itself).
    ``gpu_memory_utilization``, ``trainer_memory_fraction`` and ``engines`` (the node's share of
    its GPU: :func:`distflow.rollout.memory_plan.engine_share`) plan the torch engine's KV cache;
    vLLM gets its own part, ``(utilization - trainer) / engines``, as its ``gpu_memory_utilization``
    (vLLM's share of the total memory too): without it vLLM takes 0.9 of the GPU, and a colocated
    trainer or a second engine would not fit.
    """
    if name == "torch":
        return TorchEngine(model_path, **kw)
    if name == "vllm":
        for torch_only in ("compile", "max_slots", "max_length"):
            kw.pop(torch_only, None)
        util = kw.pop("gpu_memory_utilization", None)
        trainer, engines = kw.pop("trainer_memory_fraction", 0.0), kw.pop("engines", 1)
        if util is not None:
            kw["gpu_memory_utilization"] = (float(util) - float(trainer)) / max(1, int(engines))
        return VLLMEngine(model_path, **kw)
    raise ValueError(f"unknown rollout engine {name!r}: expected one of {list(ENGINES)}")
