"""Rollout engines: turn prompt token ids into sampled completions with their logprobs.

Why it exists: a rollout node needs one small interface, whatever does the generation —
``generate(prompts, params, seed) -> [Completion]`` and ``load_weights(version, tensors)``.
:class:`TorchEngine` is the built-in engine (plain PyTorch + transformers, batched with a
KV cache), good for CPUs, small GPUs and tests; :class:`VLLMEngine` adapts vLLM's offline
``LLM`` API for production. Both report, per generated token, the fp32 logprob of the
sampled token under ``log_softmax(logits / temperature)`` *before* top-k/top-p filtering,
which is exactly what the trainer recomputes (``distflow.trainer.logprobs.token_logprobs``)
for importance ratios.
"""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch
from distflow.hf import load_causal_lm, load_tokenizer

__all__ = [
    "Completion",
    "RolloutEngine",
    "SamplingParams",
    "TorchEngine",
    "VLLMEngine",
    "make_engine",
    "parse_dtype",
]

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


@dataclass
class Completion:
    """One sampled continuation of one prompt."""

    tokens: list[int]  # generated tokens, including the stop token if one was produced
    logprobs: list[float]  # per token: log_softmax(logits / T)[token] before top-k/top-p (T = 1 when greedy)
    finish_reason: str  # "stop" | "length"


@runtime_checkable
class RolloutEngine(Protocol):
    """What a rollout node needs from a generation backend."""

    version: int
    tokenizer: Any

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> list[Completion]:
        ...

    def load_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
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


def _check_model_dir(model_path: str | Path) -> Path:
    path = Path(model_path)
    if not path.exists():
        raise FileNotFoundError(
            f"model directory {str(path)!r} does not exist (models load from a local Hugging Face directory; "
            f"nothing is downloaded — build the toy model with distflow.toy.build_toy_model)"
        )
    if not path.is_dir():
        raise NotADirectoryError(f"model path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json: not a Hugging Face model directory")
    return path


def _validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or len(p) == 0:
            raise ValueError(f"prompt {i} must be a non-empty list of token ids, got {p!r:.80}")
        for t in p:
            if isinstance(t, bool) or not isinstance(t, int) or not (0 <= t < vocab_size):
                raise ValueError(f"prompt {i} has token {t!r}, outside the vocabulary [0, {vocab_size})")


# ---------------------------------------------------------------------- sampling (pure)
def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside the top-k and the top-p nucleus with -inf.

    logits: [B, V] float (already divided by the temperature). Returns a new [B, V] tensor.
    The most probable token always survives, so every row keeps at least one token.
    """
    out = logits
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]  # [B, 1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p.
        remove_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        remove_sorted[..., 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, sorted_idx, remove_sorted)
        out = out.masked_fill(remove, float("-inf"))
    return out


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    logits: [B, V] fp32. Returns (tokens [B] int64, logprobs [B] fp32) where the logprob is
    log_softmax(logits / T) of the chosen token before filtering (T = 1 for greedy).
    """
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = torch.argmax(logits, dim=-1)
    else:
        scaled = logits / params.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        filtered = filter_top_k_top_p(scaled, params.top_k, params.top_p)
        probs = torch.softmax(filtered, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------------- the built-in engine
class TorchEngine:
    """Batched sampling with a KV cache on plain PyTorch + transformers (CPU and small GPUs)."""

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: torch.dtype | str = torch.float32,
                 max_batch_size: int = 256):

        path = _check_model_dir(model_path)
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} requested but CUDA is not available")
        self.dtype = parse_dtype(dtype)
        self.max_batch_size = max_batch_size
        try:
            self.tokenizer = load_tokenizer(path)
        except Exception as e:
            raise ValueError(f"cannot load the tokenizer from {str(path)!r}: {type(e).__name__}: {e}") from e
        try:
            model = load_causal_lm(path, self.dtype)
        except Exception as e:
            raise ValueError(f"cannot load a causal LM from {str(path)!r}: {type(e).__name__}: {e}") from e
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.model_path = str(path)
        self.version = 0
        self._lock = threading.Lock()  # generate and load_weights may be called from different threads
        cfg = self.model.config
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_positions: int | None = getattr(cfg, "max_position_embeddings", None)
        self.eos_token_ids: tuple[int, ...] = self._collect_eos()
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = getattr(self.model.generation_config, "pad_token_id", None)
        if isinstance(pad, (list, tuple)):
            pad = pad[0] if pad else None
        self.pad_token_id: int = int(pad) if pad is not None else (self.eos_token_id or 0)
        # Tied parameters (e.g. lm_head / embed_tokens) appear under several names in the
        # state dict; a sender may ship any one of them.
        groups: dict[int, list[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
        self._aliases = {n: tuple(g) for g in groups.values() for n in g}

    def _collect_eos(self) -> tuple[int, ...]:
        ids: list[int] = []
        for src in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None),
                    getattr(self.model.config, "eos_token_id", None)):
            for v in (src if isinstance(src, (list, tuple)) else [src]):
                if v is not None and int(v) not in ids:
                    ids.append(int(v))
        return tuple(ids)

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> list[Completion]:
        """Sample one completion per prompt, in order. Deterministic for a given ``seed``."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if self.model is None:
            raise RuntimeError("TorchEngine.generate called after close()")
        params.validate()
        _validate_prompts(prompts, self.vocab_size)
        if not prompts:
            return []
        longest = max(len(p) for p in prompts)
        if self.max_positions is not None and longest + params.max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt length {longest} + max_new_tokens {params.max_new_tokens} exceeds the model's "
                f"max_position_embeddings {self.max_positions}"
            )
        stop = torch.tensor(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)), dtype=torch.int64,
                            device=self.device)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed) % (1 << 63) if seed is not None else random.getrandbits(63))
        out: list[Completion] = []
        with self._lock:
            for start in range(0, len(prompts), self.max_batch_size):
                out.extend(self._generate_batch(prompts[start:start + self.max_batch_size], params, stop, gen))
        return out

    def _generate_batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams, stop: torch.Tensor,
                        gen: torch.Generator) -> list[Completion]:
        b, width, dev = len(prompts), max(len(p) for p in prompts), self.device
        ids = torch.full((b, width), self.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((b, width), dtype=torch.int64)
        for i, p in enumerate(prompts):  # left padding: every row's next token is at the same column
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.int64)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        res = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        past, logits = res.past_key_values, res.logits[:, -1, :].float()
        n = params.max_new_tokens
        tokens = torch.full((b, n), self.pad_token_id, dtype=torch.int64, device=dev)
        logps = torch.zeros((b, n), dtype=torch.float32, device=dev)
        lengths = torch.full((b,), n, dtype=torch.int64, device=dev)
        stopped = torch.zeros(b, dtype=torch.bool, device=dev)
        next_pos = pos[:, -1:]
        for step in range(n):
            tok, lp = sample_next(logits, params, gen)
            tok = torch.where(stopped, self.pad_token_id, tok)
            tokens[:, step], logps[:, step] = tok, lp
            hit = torch.isin(tok, stop) & ~stopped
            lengths = torch.where(hit, step + 1, lengths)
            stopped |= hit
            if step == n - 1 or bool(stopped.all()):
                break
            # Finished rows keep decoding pad tokens (masked in, harmless); their outputs are dropped.
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=dev)], dim=1)
            next_pos = next_pos + 1
            res = self.model(input_ids=tok.unsqueeze(-1), attention_mask=mask, position_ids=next_pos,
                             past_key_values=past, use_cache=True)
            past, logits = res.past_key_values, res.logits[:, -1, :].float()
        tokens_l, logps_l, lens_l, stop_l = tokens.tolist(), logps.tolist(), lengths.tolist(), stopped.tolist()
        return [Completion(tokens=tokens_l[i][:lens_l[i]], logprobs=logps_l[i][:lens_l[i]],
                           finish_reason="stop" if stop_l[i] else "length") for i in range(b)]

    # ------------------------------------------------------------------ weights
    def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Swap weights in place (all or nothing) and set ``version``.

        Names and shapes must match the model's state dict exactly (tied parameters may be
        given under any one of their names); every tensor must be finite. On any mismatch a
        ValueError names the offending keys and the current weights are untouched.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weights version must be an int >= 0, got {version!r}")
        if self.model is None:
            raise RuntimeError("TorchEngine.load_weights called after close()")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of name -> tensor, got {type(state_dict).__name__}")
        own = self.model.state_dict()
        unexpected = sorted(k for k in state_dict if k not in own)
        missing = sorted(k for k in own if k not in state_dict
                         and not any(a in state_dict for a in self._aliases.get(k, ())))
        bad_type = sorted(k for k, v in state_dict.items() if k in own and not isinstance(v, torch.Tensor))
        bad_shape = [f"{k}: got {list(v.shape)}, expected {list(own[k].shape)}" for k, v in sorted(state_dict.items())
                     if k in own and isinstance(v, torch.Tensor) and v.shape != own[k].shape]
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} key(s): {_head(missing)}")
        if unexpected:
            problems.append(f"unexpected {len(unexpected)} key(s): {_head(unexpected)}")
        if bad_type:
            problems.append(f"non-tensor value(s) for: {_head(bad_type)}")
        if bad_shape:
            problems.append(f"shape mismatch: {_head(bad_shape)}")
        if not problems:
            bad_values = sorted(k for k, v in state_dict.items()
                                if (v.is_floating_point() or v.is_complex()) and not bool(torch.isfinite(v).all()))
            if bad_values:
                problems.append(f"non-finite values in: {_head(bad_values)}")
        if problems:
            raise ValueError(f"load_weights(version={version}) rejected the state dict: " + "; ".join(problems))
        with self._lock, torch.no_grad():
            for k, v in state_dict.items():
                own[k].copy_(v)
            self.version = version

    def close(self) -> None:
        """Release the model (and cached GPU memory)."""
        with self._lock:
            self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _head(items: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(items[:n])
    return shown + (f", ... (+{len(items) - n} more)" if len(items) > n else "")


# ---------------------------------------------------------------------- vLLM adapter
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
      ``load_weights`` (which handles vLLM's fused/stacked parameters); with vLLM's V1
      multiprocess engine, sending a function needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
      The prefix cache is reset afterwards so no KV from old weights is reused.
    """

    def __init__(self, model_path: str, *, device: str = "cuda", dtype: torch.dtype | str = "bfloat16",
                 max_batch_size: int = 256, **llm_kwargs: Any):
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ImportError("engine 'vllm' needs vLLM, which is not installed: pip install 'distflow[vllm]' "
                              "(or use engine: torch)") from e
        from vllm import LLM

        path = _check_model_dir(model_path)
        if torch.device(device).type != "cuda":
            raise ValueError(f"engine 'vllm' runs on CUDA devices only, got device {device!r}")
        dt = parse_dtype(dtype)
        llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        self.llm = LLM(model=str(path), dtype=str(dt).removeprefix("torch."), max_num_seqs=max_batch_size,
                       **llm_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.version = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> list[Completion]:
        from vllm import SamplingParams as VSamplingParams

        params.validate()
        _validate_prompts(prompts, len(self.tokenizer))
        base = random.getrandbits(31) if seed is None else int(seed)
        sps = [VSamplingParams(n=1, max_tokens=params.max_new_tokens, temperature=params.temperature,
                               top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else -1,
                               stop_token_ids=list(params.stop_token_ids), seed=(base + i) % (2**31),
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
                                     finish_reason="stop" if c.finish_reason == "stop" else "length"))
        return result

    def load_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weights version must be an int >= 0, got {version!r}")
        self.llm.collective_rpc(_vllm_load_weights, args=(list(state_dict.items()),))
        self.llm.reset_prefix_cache()
        self.version = version

    def close(self) -> None:
        self.llm = None  # vLLM frees its workers when the LLM object is collected


ENGINES = ("torch", "vllm")


def make_engine(name: str, model_path: str, **kw: Any) -> RolloutEngine:
    """Build the engine called ``name`` ("torch" | "vllm") for the model in ``model_path``."""
    if name == "torch":
        return TorchEngine(model_path, **kw)
    if name == "vllm":
        return VLLMEngine(model_path, **kw)
    raise ValueError(f"unknown rollout engine {name!r}: expected one of {list(ENGINES)}")
