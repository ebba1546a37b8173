"""The vLLM adapter: :class:`RolloutEngine` over vLLM's offline ``LLM`` API.

Why it exists: production rollout nodes with vLLM installed can use it behind the same
protocol as the built-in engine. It does not interrupt generation for new weights
(``weights_update`` is accepted and ignored); each completion reports the engine's version
as both its first and last version. Its logprobs are vLLM's processed ones, taken after the
top-k/top-p renormalisation, while the trainer recomputes unfiltered ones: with ``top_p < 1``
or ``top_k > 0`` the importance ratios are biased, and the engine warns once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from typing import Any

import torch

from distflow.device import local_gpu_index
from distflow.weights.tiers import rpc_copy
from distflow.rollout.protocol import (Completion, SamplingParams, Weights, WeightsUpdate, check_model_dir,
                                       parse_dtype, validate_prompts)

__all__ = ["VLLMEngine"]

log = logging.getLogger(__name__)


def _vllm_load_weights(worker: Any, items: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside every vLLM worker (via ``LLM.collective_rpc``): load HF-named tensors."""
    worker.model_runner.model.load_weights(weights=items)


class VLLMEngine:
    """:class:`RolloutEngine` over vLLM's offline ``LLM`` API (optional extra: ``pip install distflow[vllm]``).

    Not exercised by the test suite (vLLM is not installed in CI). Notes:

    - Logprobs use ``logprobs_mode="processed_logprobs"`` so they are taken after the
      temperature; vLLM takes them *after* top-k/top-p too, so with those filters on they
      are the renormalised values, unlike :class:`TorchEngine` (identical when both are off).
    - Weights go to every worker with ``LLM.collective_rpc`` and the model's own
      ``load_weights`` (which handles vLLM's fused/stacked parameters), as host tensors (a
      bucket may arrive as CUDA IPC views; some vLLM releases refuse to serialise CUDA tensors).
      vLLM's V1 multiprocess engine sends a function only with
      ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (pickle between this process and the engine
      process it starts on this host), which the engine sets unless the environment already
      says otherwise. The prefix cache is reset afterwards so no KV from old weights is reused.
    """

    def __init__(self, model_path: str, *, device: str = "cuda", dtype: torch.dtype | str = "bfloat16",
                 max_batch_size: int = 256, **llm_kwargs: Any):
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"engine 'vllm' runs on CUDA devices only, got device {device!r}")
        # vLLM's worker processes take the first visible GPU, not the current one; a bare "cuda"
        # means this node's GPU, which a launcher sharing one CUDA_VISIBLE_DEVICES list names
        # with DISTFLOW_LOCAL_GPU (distflow.device.node_device)
        index = local_gpu_index() if dev.index is None else dev.index
        if index != 0:
            raise ValueError(f"engine 'vllm' runs on the process's first visible GPU, but this node's is cuda:{index} "
                             f"(--in-process with gpus: placing it elsewhere); run the cluster in process mode "
                             f"(distflow run: each node sees only its own GPU) or use engine: torch")
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ImportError("engine 'vllm' needs vLLM, which is not installed: pip install 'distflow[vllm]' "
                              "(or use engine: torch)") from e
        from vllm import LLM

        path = check_model_dir(model_path)
        dt = parse_dtype(dtype)
        llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        # load_weights sends a function to the engine process, which V1 refuses without this
        # (read there, when the LLM below starts it): without it the first weight sync fails
        if os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1") != "1":
            log.warning("VLLM_ALLOW_INSECURE_SERIALIZATION=%s: vLLM may refuse the weight loader that "
                        "load_weights sends its workers", os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"])
        self.llm = LLM(model=str(path), dtype=str(dt).removeprefix("torch."), max_num_seqs=max_batch_size,
                       **llm_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        # positions per sequence (prompt + response): longer prompts are skipped and counted (rollout.stages)
        model_config = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)  # moves between versions
        self.max_positions: int | None = getattr(model_config, "max_model_len", None)
        self.version = 0
        self._warned_filters = False

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None, *,
                 weights_update: WeightsUpdate | None = None) -> list[Completion]:
        from vllm import SamplingParams as VSamplingParams

        params.validate()
        validate_prompts(prompts, len(self.tokenizer))
        if params.temperature > 0 and (params.top_p < 1.0 or params.top_k > 0) and not self._warned_filters:
            self._warned_filters = True
            log.warning("engine 'vllm' with top_p=%g, top_k=%d: vLLM's logprobs are taken after the top-k/top-p "
                        "renormalisation but the trainer recomputes unfiltered ones, so the importance ratios are "
                        "biased (not 1 on-policy); set top_p: 1 and top_k: 0, or use engine: torch",
                        params.top_p, params.top_k)
        base = random.getrandbits(31) if seed is None else int(seed)
        sps = [VSamplingParams(n=1, max_tokens=params.max_new_tokens, temperature=params.temperature,
                               top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else -1,
                               stop_token_ids=list(params.stop_token_ids), seed=request_seed(base, i),
                               logprobs=0, detokenize=False) for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sps, use_tqdm=False)
        result = []
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            lps = [float(step[t].logprob) for step, t in zip(c.logprobs or [], toks)]
            if len(lps) != len(toks):
                raise RuntimeError(f"vLLM returned {len(lps)} logprobs for {len(toks)} tokens")
            result.append(Completion(tokens=toks, logprobs=lps,
                                     finish_reason="stop" if c.finish_reason == "stop" else "length",
                                     first_version=self.version, last_version=self.version))
        return result

    def load_weights(self, version: int, weights: Weights, partial: bool = False) -> None:
        """``weights``: one mapping or an iterable of bucket mappings (sent bucket by bucket);
        vLLM's ``load_weights`` overwrites only the names given, so ``partial`` needs nothing."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weights version must be an int >= 0, got {version!r}")
        for bucket in ([weights] if isinstance(weights, dict) or hasattr(weights, "items") else weights):
            self.llm.collective_rpc(_vllm_load_weights, args=(list(rpc_copy(bucket).items()),))
        self.llm.reset_prefix_cache()
        self.version = version

    def close(self) -> None:
        self.llm = None  # vLLM frees its workers when the LLM object is collected


def request_seed(base: int, i: int) -> int:
    """vLLM's seed for request ``i`` of a call seeded ``base``: a hash of both, not ``base + i``.
    Step seeds are consecutive integers, so with ``base + i`` request i of step s+1 would replay
    request i+1 of step s (the same random stream on another prompt, every step)."""
    digest = hashlib.blake2b(f"{int(base)}:{int(i)}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF

