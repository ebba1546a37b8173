"""The built-in rollout engine: continuous batching over a static KV cache.

Why it exists: generation bounds an RL step, and HF's generate loop wastes most of it
(per-step cache/mask concatenation, finished rows decoded until the whole batch stops,
a host sync per token, every GRPO prompt prefilled ``group_size`` times). This engine
keeps a fixed number of slots; a finished sequence frees its slot at the next check and
a waiting prompt is prefilled into it; identical prompts of one call are prefilled once
and their KV copied; the host looks at stop flags every ``sync_every`` steps (1 on CPU,
where a sync is free); on CUDA the decode step replays CUDA graphs. Each sequence samples
from its own counter-based stream (:mod:`distflow.rollout.sampling`), so results depend on
the seed only, not on slots. ``generate`` can swap weights mid-call (partial rollout):
in-flight sequences are re-prefilled under the new weights and continue. On CUDA the KV
cache is planned from the engine's share of the GPU's TOTAL memory (``gpu_memory_utilization``
less a colocated trainer's ``trainer_memory_fraction``, :mod:`distflow.rollout.memory_plan`;
fewer slots when ``max_slots`` do not fit), sized once for the run's longest sequence, and
``generate``/``load_weights`` run with the engine's GPU as the calling thread's current device
(they run in worker threads; ``set_device`` is per thread).

The slots themselves are :mod:`distflow.rollout.slots` (shared with the request-level engine
of :meth:`TorchEngine.continuous`, :mod:`distflow.rollout.continuous`, which multi-turn
episodes use). Qwen2-VL / Qwen2.5-VL take the same path with their images and M-RoPE
(:mod:`distflow.rollout.vlm_forward`). Models outside these families fall back to an HF
``model(...)`` loop (logged; a vision-language model's fallback as a warning).
"""

from __future__ import annotations

import gc
import inspect
import logging
import random
import threading
from typing import Any, Sequence

import torch

from distflow.core.once import log_once
from distflow.device import node_device, on_device
from distflow.hf import load_causal_lm, load_tokenizer
from distflow.rollout.llama_forward import LlamaRunner, empty_cache, unsupported_reason
from distflow.rollout.memory_plan import DEFAULT_GPU_MEMORY_UTILIZATION, cache_length
from distflow.rollout.protocol import (Completion, SamplingParams, Weights, WeightsUpdate, check_finite_logprobs,
                                       check_model_dir, parse_dtype, validate_prompts)
from distflow.rollout.sampling import counter_uniform, sample_rows, seed_key
from distflow.rollout.lora_apply import AdapterTarget
from distflow.rollout.slots import SlotBatcher
from distflow.rollout.vlm_forward import VLMRunner, vlm_unsupported_reason
from distflow.rollout.weight_loading import WeightTarget
from distflow.vision import ImageInputs, VisionPrompter, is_vision_config, mrope_positions

__all__ = ["TorchEngine"]

log = logging.getLogger(__name__)


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return v


class TorchEngine:
    """Continuous-batching sampler on plain PyTorch + transformers (CPU and GPUs).

    ``max_slots``: sequences decoded at once; ``compile``: capture the decode step as CUDA
    graphs on CUDA (ignored on CPU); ``max_batch_size``: batch size of the HF fallback loop;
    ``gpu_memory_utilization``: on CUDA, the share of the GPU's TOTAL memory its processes may
    use together (vLLM's name); ``trainer_memory_fraction`` of it is a colocated trainer's, and
    ``engines`` engines split the rest; the KV cache gets this engine's part less its weights and
    prefill reserve (the slots are capped to what fits, logged). ``lora``: ``{rank, alpha,
    target_modules}`` when weight syncs carry LoRA adapters (merged into the base, :mod:`distflow.rollout.lora_apply`).
    ``stats`` reports ``capture_s`` (graph capture time, paid once per process and cache
    size), ``graph_capture_failures`` (each retried once after freeing memory),
    ``graph_eager_steps`` (decode steps run eagerly although graphs were asked for),
    ``prefill_tokens``, ``decode_steps``, ``decode_rows`` and ``weight_swaps``
    (mid-generate), cumulative; a request-level engine (:meth:`continuous`) adds ``requests``,
    ``kv_hits``, ``kv_misses``, ``kv_reused_tokens``.
    """

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: torch.dtype | str = torch.float32,
                 max_batch_size: int = 256, max_slots: int = 256, compile: bool = True,
                 max_prefill_tokens: int = 8192, gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                 trainer_memory_fraction: float = 0.0, engines: int = 1, max_length: int | None = None,
                 lora: dict[str, Any] | None = None, tensor_parallel: int = 1):
        path = check_model_dir(model_path)
        self.max_batch_size = _positive_int("max_batch_size", max_batch_size)
        # positions every KV-cache slot holds from the first call (the run's longest prompt plus
        # max_new_tokens): a later, longer call then never regrows the cache, which frees it and
        # recaptures every CUDA graph in the middle of a step; None: sized by the calls seen
        self.max_length = None if max_length is None else _positive_int("max_length", max_length)
        self.max_slots = _positive_int("max_slots", max_slots)
        _positive_int("max_prefill_tokens", max_prefill_tokens)
        for name, v, low in (("gpu_memory_utilization", gpu_memory_utilization, 0.0),
                             ("trainer_memory_fraction", trainer_memory_fraction, None)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 if low is not None else v >= 0) \
                    or not v <= 1:
                raise ValueError(f"{name} must be a number in {'(0' if low is not None else '[0'}, 1], got {v!r}")
        if trainer_memory_fraction >= gpu_memory_utilization:
            raise ValueError(f"trainer_memory_fraction {trainer_memory_fraction} leaves nothing of "
                             f"gpu_memory_utilization {gpu_memory_utilization} for the engine")
        _positive_int("engines", engines)
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} requested but CUDA is not available")
        self.device = node_device(dev.type) if dev.index is None else dev  # this node's GPU
        self.dtype = parse_dtype(dtype)
        try:
            self.tokenizer = load_tokenizer(path)
        except Exception as e:
            raise ValueError(f"cannot load the tokenizer from {str(path)!r}: {type(e).__name__}: {e}") from e
        try:
            model = load_causal_lm(path, self.dtype)
        except Exception as e:
            raise ValueError(f"cannot load a causal LM from {str(path)!r}: {type(e).__name__}: {e}") from e
        self.tp: Any = None  # tensor_parallel > 1: rank 0 of the engine's TP group (rollout/tp_engine.py)
        if _positive_int("tensor_parallel", tensor_parallel) > 1:
            if lora or is_vision_config(model.config):
                raise ValueError("rollout_tensor_parallel: not with LoRA adapters or a vision-language model")
            from distflow.rollout.tp_engine import TensorParallel  # splits `model` in place: only the shard moves

            compile = False  # CUDA graphs: not with TP (the NCCL all-reduces are not captured)
            self.tp = TensorParallel(model, str(path), tensor_parallel, self.device, self.dtype, runner_kw=dict(
                max_prefill_tokens=max_prefill_tokens, gpu_memory_utilization=float(gpu_memory_utilization),
                trainer_memory_fraction=float(trainer_memory_fraction), engines=engines))
        self.model = model.to(self.device).eval().requires_grad_(False)
        self._cache_kw = cache_keyword(self.model)
        self.model_path = str(path)
        self.version = 0
        self._lock = threading.Lock()  # generate and load_weights may be called from different threads
        self._count_lock = threading.Lock()
        self._loads_waiting = 0  # load_weights calls waiting for _lock (a continuous engine drains for them)
        cfg = self.model.config
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_positions: int | None = getattr(cfg, "max_position_embeddings", None)
        if self.max_length is not None and self.max_positions is not None:
            self.max_length = min(self.max_length, self.max_positions)  # never beyond the model's positions
        self.eos_token_ids: tuple[int, ...] = self._collect_eos()
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = getattr(self.model.generation_config, "pad_token_id", None)
        if isinstance(pad, (list, tuple)):
            pad = pad[0] if pad else None
        self.pad_token_id: int = int(pad) if pad is not None else (self.eos_token_id or 0)
        # LoRA ({rank, alpha, target_modules}): weight syncs carry adapters, merged into an unmerged base copy
        self._target: WeightTarget | AdapterTarget | None = (
            AdapterTarget(self.model, lora["rank"], lora["alpha"], lora["target_modules"]) if lora
            else WeightTarget(self.model) if self.tp is None else self.tp.target(self.model))
        self.stats: dict[str, float] = {"capture_s": 0.0, "prefill_tokens": 0, "decode_steps": 0, "decode_rows": 0,
                                        "weight_swaps": 0, "slots_in_use": 0, "graph_capture_failures": 0,
                                        "graph_eager_steps": 0}
        from distflow.core.prometheus import register  # read only when a node serves /metrics

        register("engine", lambda: {"engine_slots_in_use": self.stats["slots_in_use"],
                                    "engine_slots": self.max_slots})
        # a vision-language model (Qwen2-VL): prompts carry images; the static-KV path with M-RoPE (vlm_forward)
        self.vision: VisionPrompter | None = (VisionPrompter(self.tokenizer, path, cfg) if is_vision_config(cfg)
                                              else None)
        if self.vision is not None and self.max_positions is None:
            self.max_positions = getattr(cfg.get_text_config(), "max_position_embeddings", None)
        why = vlm_unsupported_reason(self.model) if self.vision is not None else unsupported_reason(self.model)
        self.runner: LlamaRunner | None = None
        if why is None:
            extra = sum(t.numel() * t.element_size() for t in getattr(self._target, "base", {}).values()) \
                if isinstance(getattr(self._target, "base", None), dict) else 0  # a LoRA engine's unmerged base copy
            self.runner = (VLMRunner if self.vision is not None else LlamaRunner)(
                self.model, use_graphs=compile, max_prefill_tokens=max_prefill_tokens,
                gpu_memory_utilization=float(gpu_memory_utilization),
                trainer_memory_fraction=float(trainer_memory_fraction), engines=engines, extra_bytes=extra)
            if self.tp is not None:  # (refused above for a vision-language model)
                self.runner = self.tp.drive(self.runner)
        else:  # never silent: a VLM on this loop gets no continuous batching, no CUDA graphs
            log.log(logging.WARNING if self.vision is not None else logging.INFO,
                    "TorchEngine: %s; using the HF generate loop (no static cache)", why)
        # Host looks at the device's stop flags (and polls weights_update) every this many steps.
        self.sync_every = 8 if self.device.type == "cuda" else 1

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
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None, *,
                 weights_update: WeightsUpdate | None = None,
                 images: Sequence[ImageInputs | None] | None = None) -> list[Completion]:
        """Sample one completion per prompt, in order. Deterministic for a given ``seed``
        whatever ``max_slots`` is. ``images`` (a vision-language model): each prompt's
        :class:`~distflow.vision.ImageInputs` (or None), its image tokens already in the prompt;
        prompts that are the same list with the same ImageInputs object (a GRPO group) are
        prefilled once, their images encoded once. ``weights_update`` (optional) is polled every
        ``sync_every`` steps; when it returns ``(version, weights)`` they are loaded and the
        in-flight sequences continue under them (see ``Completion.first/last_version``);
        ``(version, weights, True)`` is a partial set (a delta)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if self.model is None:
            raise RuntimeError("TorchEngine.generate called after close()")
        if weights_update is not None and not callable(weights_update):
            raise TypeError(f"weights_update must be callable or None, got {type(weights_update).__name__}")
        params.validate()
        validate_prompts(prompts, self.vocab_size)
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"{len(images)} image inputs for {len(prompts)} prompts")
        if images is not None and self.vision is None and any(x is not None for x in images):
            raise ValueError(f"{self.model_path} is not a vision-language model: it takes no images")
        if not prompts:
            return []
        longest = max(len(p) for p in prompts)
        if self.max_positions is not None and longest + params.max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt length {longest} + max_new_tokens {params.max_new_tokens} exceeds the model's "
                f"max_position_embeddings {self.max_positions}"
            )
        stop = sorted(set(self.eos_token_ids) | set(params.stop_token_ids))
        seed = int(seed) % (1 << 63) if seed is not None else random.getrandbits(63)
        with self._lock, on_device(self.device):
            runner = self.runner
            if runner is not None and runner.window and longest + params.max_new_tokens > runner.window:
                runner = None  # the sliding window would matter: HF's attention handles it
                log_once(log, "engine-window-hf", logging.WARNING, "TorchEngine: prompt + max_new_tokens (%d) passes "
                         "the model's sliding window (%d): such calls run the HF generate loop (no static cache, "
                         "no CUDA graphs), several times slower", longest + params.max_new_tokens,
                         self.runner.window)
            if runner is None:
                return self._generate_hf(prompts, params, stop, seed, weights_update, images)
            try:
                key = seed_key(seed)
                # sized once: the run's bound, else (CUDA) as long as the budget allows, up to the model's positions
                length = cache_length(self.max_length, longest + params.max_new_tokens)
                runner.retry_captures()
                batcher = SlotBatcher(self, runner, params, stop, slots=min(self.max_slots, len(prompts)),
                                      length=length, width=params.max_new_tokens, weights_update=weights_update,
                                      grow_to=self.max_positions if self.max_length is None else None)
                for q, p in enumerate(prompts):  # (a GRPO group: one list, one ImageInputs: prefilled once)
                    batcher.add(q, list(p), params.max_new_tokens, key, q, images[q] if images else None)
                results = batcher.run()
                return [results[q] for q in range(len(prompts))]
            finally:
                self.stats["capture_s"] = runner.capture_s
                self.stats["graph_capture_failures"] = runner.graph_capture_failures
                self.stats["graph_eager_steps"] = runner.graph_eager_steps

    def continuous(self, *, seed: int = 0, max_slots: int | None = None, max_length: int,
                   kv_store_tokens: int | None = None) -> Any:
        """A request-level continuous engine over this one
        (:class:`~distflow.rollout.continuous.ContinuousEngine`: ``async with``, ``await
        submit(prompt, params)``), or None where the model is not on the static-cache path (the
        HF fallback: use ``generate``). ``max_length``: positions of a request, prompt + new tokens."""
        if self.runner is None or self.model is None or (self.runner.window and max_length > self.runner.window):
            return None
        from distflow.rollout.continuous import ContinuousEngine

        return ContinuousEngine(self, seed=seed, max_slots=max_slots, max_length=max_length,
                                kv_store_tokens=kv_store_tokens)

    def _poll(self, weights_update: WeightsUpdate | None) -> bool:
        """Ask for new weights; load them (lock held by generate). True when loaded."""
        if weights_update is None:
            return False
        got = weights_update()
        if got is None:
            return False
        if not (isinstance(got, tuple) and len(got) in (2, 3)):
            raise TypeError("weights_update must return None, (version, weights) or (version, weights, partial), "
                            f"got {type(got).__name__}")
        version, weights, partial = got if len(got) == 3 else (*got, False)
        self._target.copy_in(self._target.validate(version, weights, bool(partial)))
        self.version = version
        return True

    def _generate_hf(self, prompts: list[list[int]], params: SamplingParams, stop: list[int], seed: int,
                     weights_update: WeightsUpdate | None,
                     images: Sequence[ImageInputs | None] | None = None) -> list[Completion]:
        key = seed_key(seed)  # the static path's per-sequence streams: the same draws, any batch size
        stop_t = torch.tensor(stop, dtype=torch.int64, device=self.device)
        out: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            if start:
                self._poll(weights_update)
            end = start + self.max_batch_size
            out.extend(self._generate_hf_batch(prompts[start:end], params, stop_t, key, start,
                                               None if images is None else images[start:end]))
        return out

    def _generate_hf_batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams, stop: torch.Tensor,
                           key: int, first_seq: int,
                           images: Sequence[ImageInputs | None] | None = None) -> list[Completion]:
        b, dev = len(prompts), self.device
        # distinct (prompt, images) pairs are prefilled once (a GRPO group's images encoded once), then
        # their KV cache rows are copied to every sample of theirs
        firsts: dict[tuple, int] = {}
        rows: list[int] = []  # the first sample of each distinct pair
        inverse: list[int] = []  # each sample's pair
        for i in range(b):  # (text-only prompts: every sample its own row, as before)
            k = (id(prompts[i]), id(images[i])) if images else (i,)
            if k not in firsts:
                firsts[k] = len(rows)
                rows.append(i)
            inverse.append(firsts[k])
        uniq = [prompts[r] for r in rows]
        width = max(len(p) for p in uniq)
        ids = torch.full((len(uniq), width), self.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(uniq), width), dtype=torch.int64)
        for i, p in enumerate(uniq):  # left padding: every row's next token is at the same column
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.int64)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        extra: dict[str, Any] = {}
        pics = [images[r] for r in rows if images[r] is not None] if images else []
        if pics:
            grid = torch.cat([x.grid_thw for x in pics]).to(dev)
            extra = {"pixel_values": torch.cat([x.pixel_values for x in pics]).to(dev, self.dtype),
                     "image_grid_thw": grid}
            pos = mrope_positions(self.model, ids, mask, grid)
        elif self.vision is not None:
            pos = mrope_positions(self.model, ids, mask, None)
        else:
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
        res = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **extra)
        past, logits = cache_of(res), res.logits[:, -1, :].float()
        if len(uniq) < b:
            sel = torch.tensor(inverse, dtype=torch.int64, device=dev)
            past.batch_select_indices(sel)
            logits, mask, pos = logits[sel], mask[sel], pos[..., sel, :]
        n = params.max_new_tokens
        tokens = torch.full((b, n), self.pad_token_id, dtype=torch.int64, device=dev)
        logps = torch.zeros((b, n), dtype=torch.float32, device=dev)
        lengths = torch.full((b,), n, dtype=torch.int64, device=dev)
        stopped = torch.zeros(b, dtype=torch.bool, device=dev)
        next_pos = pos[..., -1:]  # [b, 1], or [3, b, 1] (M-RoPE: text tokens advance on every axis)
        seq = torch.arange(first_seq, first_seq + b, dtype=torch.int64, device=dev)
        draws = None if params.temperature == 0 else counter_uniform(  # [b, n]: every step's draws at once
            key, seq[:, None].expand(b, n), torch.arange(n, dtype=torch.int64, device=dev)[None, :].expand(b, n))
        for step in range(n):
            tok, lp = sample_rows(logits, params, None if draws is None else draws[:, step])
            tok = torch.where(stopped, self.pad_token_id, tok)
            tokens[:, step], logps[:, step] = tok, lp
            hit = torch.isin(tok, stop) & ~stopped
            lengths = torch.where(hit, step + 1, lengths)
            stopped |= hit
            # the host looks at the stop flags every sync_every steps (a read of a device tensor waits for
            # the GPU to drain; finished rows meanwhile emit pad tokens that are cut off below)
            if step == n - 1 or ((step + 1) % self.sync_every == 0 and bool(stopped.all())):
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=dev)], dim=1)
            next_pos = next_pos + 1
            res = self.model(input_ids=tok.unsqueeze(-1), attention_mask=mask, position_ids=next_pos,
                             use_cache=True, **{self._cache_kw: past})
            past, logits = cache_of(res), res.logits[:, -1, :].float()
        tokens_l, logps_l, lens_l, stop_l = tokens.tolist(), logps.tolist(), lengths.tolist(), stopped.tolist()
        for i in range(b):
            check_finite_logprobs(logps_l[i][:lens_l[i]], self.version)
        return [Completion(tokens=tokens_l[i][:lens_l[i]], logprobs=logps_l[i][:lens_l[i]],
                           finish_reason="stop" if stop_l[i] else "length", first_version=self.version,
                           last_version=self.version) for i in range(b)]

    # ------------------------------------------------------------------ weights
    def load_weights(self, version: int, weights: Weights, partial: bool = False) -> None:
        """Swap weights in place (all or nothing) and set ``version``.

        ``weights``: one name -> tensor mapping, or an iterable of bucket mappings (as the
        weight inbox delivers them). Every name, shape, dtype and value is checked first
        (tied parameters may come under any one of their names; ``partial=True`` for a
        delta: names left out keep their values); on any problem a ValueError names the
        offending keys and the current weights are untouched. Then each bucket is copied
        straight into the model's parameters on the engine's device.
        """
        target = self._target
        if self.model is None or target is None:
            raise RuntimeError("TorchEngine.load_weights called after close()")
        with on_device(self.device):
            buckets = target.validate(version, weights, partial)
            with self._count_lock:
                self._loads_waiting += 1  # a continuous engine stops admitting and lets go of the lock
            try:
                with self._lock:
                    if self._target is None:
                        raise RuntimeError("TorchEngine closed while load_weights was validating")
                    target.copy_in(buckets)
                    self.version = version
            finally:
                with self._count_lock:
                    self._loads_waiting -= 1

    def weights_checksum(self) -> str | None:
        """With LoRA, the checksum of the adapter this engine applied (``lora_apply.AdapterTarget``),
        as the trainer computes the one it published; None without LoRA or before the first sync."""
        target = self._target
        return target.checksum() if isinstance(target, AdapterTarget) else None

    def close(self) -> None:
        """Release the model, the KV cache and the graphs (and cached GPU memory). Every
        reference to the parameters goes (the weight target holds them all too), so the
        GPU memory really is returned."""
        with self._lock:
            runner, self.runner = self.runner, None
            if runner is not None:  # in case someone else still holds the runner
                runner.graphs.clear()
                runner.k_cache = runner.v_cache = runner.logits_out = None
            self.model = None  # type: ignore[assignment]
            self._target = None
            if self.tp is not None:
                self.tp.close()
        if self.device.type == "cuda":
            gc.collect()  # parameters caught in reference cycles
            empty_cache()


def cache_keyword(model: Any) -> str:
    """The keyword a model's forward takes its KV cache by: ``cache`` (transformers 5.24 renamed
    ``past_key_values``, which it drops in 5.40) where the forward has it, else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(out: Any) -> Any:
    """The KV cache a forward returned (``cache`` since transformers 5.24, ``past_key_values`` before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
