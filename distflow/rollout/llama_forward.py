"""A static-KV-cache prefill/decode forward for Llama-family Hugging Face models.

Why it exists: HF's generation path concatenates every layer's KV and the attention mask
on every step and launches ~800 kernels per decode step, which leaves a GPU idle. This
forward reads the HF module's *own* parameters (embed_tokens, q/k/v/o_proj with their
biases, q_norm/k_norm when present, the norms, the MLP, lm_head) and the model's rotary
table, but keeps the KV in one preallocated cache ``[layers, slots, kv_heads, T, head_dim]``
written in place at per-slot positions, with attention through SDPA (prefill: causal, so
CUDA can use the flash kernel, the only fused one with GQA; decode: a length mask).
Loading weights into the HF model therefore updates this path for free. On CUDA the
decode step for a few bucketed (slot count, attended length) shapes is captured once as CUDA
graphs, and the cache
is sized from the engine's share of the GPU's total memory (:mod:`distflow.rollout.memory_plan`),
planned once, rather than assumed to fit. A capture that fails is retried once after freeing the
graphs' memory and counted (``graph_capture_failures``), never silently eager for the rest of the run.

Supported: llama, mistral (no sliding window in reach), qwen2 (qkv bias), qwen3
(q_norm/k_norm) with static RoPE types; :func:`unsupported_reason` says why not otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import torch
import torch.nn.functional as F

from distflow.core.once import log_once
from distflow.device import private_stream
from distflow.hf import logit_transform
from distflow.rollout.memory_plan import (DEFAULT_GPU_MEMORY_UTILIZATION, kv_token_bytes, plan_kv_cache,
                                          prefill_reserve_bytes)

__all__ = ["LlamaRunner", "MAX_CAPTURE_FAILURES", "module_bytes", "unsupported_reason"]

log = logging.getLogger(__name__)

_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
MAX_CAPTURE_FAILURES = 4  # failed captures of one graph shape after which it decodes eagerly for good (logged)

# One graph capture at a time in the process: generate runs in worker threads and
# --in-process may hold several engines, and a capture must not overlap another one, nor a
# device-wide call (torch.cuda.synchronize, empty_cache: the allocator asserts that no capture
# is underway) from another thread. Engine code syncs streams, not devices, for that reason.
_CAPTURE_LOCK = threading.Lock()


def empty_cache() -> None:
    """``torch.cuda.empty_cache()`` while no engine of this process captures a graph."""
    with _CAPTURE_LOCK:
        torch.cuda.empty_cache()


def unsupported_reason(model: Any) -> str | None:
    """None when :class:`LlamaRunner` can drive ``model``, else a short reason."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in _FAMILY:
        return f"model_type {kind!r} is not one of {list(_FAMILY)}"
    if logit_transform(cfg) != (1.0, None):
        return "the model scales or soft-caps its logits (logit_transform)"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the model does not have the Llama module layout (model.embed_tokens/layers/norm/rotary_emb)"
    rope = getattr(inner.rotary_emb, "rope_type", "default")
    if rope in ("dynamic", "longrope"):
        return f"rope_type {rope!r} changes with the sequence length"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window layers"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class LlamaRunner:
    """Prefill and decode over a static KV cache for one HF Llama-family model.

    Slots are rows of the cache. The caller keeps active sequences in slots ``[0, n)``
    (compacting with :meth:`move_slot`), so a decode step is one batch of ``n`` rows.
    """

    def __init__(self, model: Any, *, use_graphs: bool, max_prefill_tokens: int = 8192,
                 gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION, trainer_memory_fraction: float = 0.0,
                 engines: int = 1, extra_bytes: int = 0):
        self.model = model
        inner = getattr(model.model, "language_model", model.model)  # a VLM's text decoder (rollout/vlm_forward.py)
        self.embed, self.layers, self.norm, self.lm_head = inner.embed_tokens, list(inner.layers), inner.norm, \
            model.lm_head
        self.rotary = inner.rotary_emb
        self.vocab_size = int(self.lm_head.weight.shape[0])
        cfg = model.config.get_text_config()
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.scaling = float(attn.scaling)
        self.window = getattr(cfg, "sliding_window", None) if kind_uses_window(cfg) else None
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.use_graphs = bool(use_graphs) and self.device.type == "cuda"
        self.max_prefill_tokens = max_prefill_tokens
        # CUDA memory plan (memory_plan.plan_kv_cache): shares of the GPU's TOTAL memory
        self.gpu_memory_utilization, self.trainer_memory_fraction = gpu_memory_utilization, trainer_memory_fraction
        self.engines = engines  # engines splitting what the trainer leaves of the GPU
        self.model_bytes = module_bytes(model) + int(extra_bytes)  # weights, and what the engine holds besides
        self.plan: Any = None  # the last memory_plan.KVPlan (CUDA)
        self._mem_capped = False  # the cache holds fewer slots than asked (all that fit)
        # Prefill with an explicit length mask instead of is_causal (the reference the causal
        # path is tested against; on CUDA with GQA it forces SDPA's math kernel).
        self.prefill_mask = False
        self.k_cache: torch.Tensor | None = None  # [layers, slots, kv_heads, T, head_dim]
        self.v_cache: torch.Tensor | None = None
        self.cos = self.sin = torch.empty(0)  # [positions, head_dim], model dtype
        # Captured decode steps by (rows, attended length): a step attends only to the length
        # bucket holding its longest sequence, not the whole cache (decode cost follows live length).
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # Every graph writes its logits into rows [0, b) of this one buffer (CUDA, [slots, V] fp32),
        # allocated with the cache: a [b, V] fp32 output kept per graph would add up to GBs with a
        # large vocabulary (~300 MB a length bucket for 256 slots of 152k tokens), none of it planned.
        self.logits_out: torch.Tensor | None = None
        self.min_graph_length = 256  # the shortest length bucket (smaller ones save little)
        self._pool: Any = None
        self._cap_stream: Any = None  # this runner's capture stream (device.private_stream), made on first capture
        self._cap_stream_owner: Any = None
        self.capture_s = 0.0
        self.graph_error: str | None = None  # why the last capture failed
        self.graph_capture_failures = 0  # failed captures (each retried once after freeing memory)
        self.graph_eager_steps = 0  # decode steps run eagerly although graphs were asked for
        self._failed: dict[tuple[int, int], int] = {}  # graph shape -> its failed captures
        self._eager_shapes: set[tuple[int, int]] = set()  # decoded eagerly until the next call (retry_captures)
        self._given_up: set[tuple[int, int]] = set()  # failed MAX_CAPTURE_FAILURES times: eager for good
        # Decode inputs (graph-static on CUDA): the token to feed and its position, per slot.
        self.tok_in = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.pos = torch.zeros(0, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ memory
    @property
    def slots(self) -> int:
        return 0 if self.k_cache is None else self.k_cache.shape[1]

    @property
    def length(self) -> int:
        return 0 if self.k_cache is None else self.k_cache.shape[3]

    def reserve(self, slots: int, length: int, grow_to: int | None = None) -> None:
        """Make the cache hold ``slots`` x ``length`` tokens (reallocates, dropping graphs,
        only when it grows; sizes are rounded up so it rarely does). On CUDA the slots are
        capped to what this engine's share of the GPU's TOTAL memory holds after its weights and
        prefill reserve (:func:`~distflow.rollout.memory_plan.plan_kv_cache`; logged, the caller
        reads :attr:`slots`) and to what is free now, and a cache capped so is not regrown for
        more slots at the same length (which would drop and recapture the graphs on every call).
        ``grow_to`` (CUDA; the model's positions when the run has no prompt bound): the length is
        stretched to what the plan's budget holds for those slots, so later, longer calls fit."""
        if length <= self.length and (slots <= self.slots or self._mem_capped):
            return
        if self.k_cache is not None and length > self.length:
            log.warning("KV cache regrows from %d x %d to %d x %d positions mid-run (a call longer than the "
                        "max_prompt_length + max_new_tokens it was sized for); its CUDA graphs are recaptured",
                        self.slots, self.length, max(slots, self.slots), max(length, self.length))
        slots = max(slots, self.slots)
        length = max(-(-length // 128) * 128, self.length)
        self.k_cache = self.v_cache = self.logits_out = None
        self.graphs.clear()
        if self.device.type == "cuda":
            slots, length = self._planned_slots(slots, length, grow_to)
        shape = (len(self.layers), slots, self.n_kv, length, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.tok_in = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.pos = torch.zeros(slots, dtype=torch.int64, device=self.device)
        if self.use_graphs:
            self.logits_out = torch.empty((slots, self.vocab_size), dtype=torch.float32, device=self.device)
        if self.cos.shape[0] < length:
            pos = torch.arange(length, device=self.device).unsqueeze(0)
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = self.rotary(probe, pos)  # [1, length, head_dim]
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()

    def _planned_slots(self, slots: int, length: int, grow_to: int | None) -> tuple[int, int]:
        """CUDA: (slots, length) of the memory plan (at most ``slots``; ``length`` stretched
        towards ``grow_to``), the slots capped to what is free now (a process over its share:
        logged, naming the numbers)."""
        empty_cache()  # the old cache's memory counts as free below
        free, total = torch.cuda.mem_get_info(self.device)
        logits_row = self.vocab_size * 4 if self.use_graphs else 0  # the graphs' fp32 logits buffer, per slot
        token = kv_token_bytes(len(self.layers), self.n_kv, self.head_dim, self.dtype.itemsize)
        cfg = self.model.config.get_text_config()
        reserve = prefill_reserve_bytes(self.max_prefill_tokens, int(cfg.hidden_size),
                                        int(getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)),
                                        self.vocab_size, self.dtype.itemsize, min(slots, self.max_prefill_tokens))
        plan = self.plan = plan_kv_cache(total, self.model_bytes, int(total * self.trainer_memory_fraction),
                                         self.gpu_memory_utilization, token, want_slots=slots, length=length,
                                         engines=self.engines, slot_extra_bytes=logits_row, reserve_bytes=reserve,
                                         grow_to=grow_to)
        fit, length = plan.slots, plan.length
        per_slot = length * token + logits_row
        now = max(0, free - reserve) // per_slot
        if now < fit:
            log.warning("KV cache: the plan gives %d slots (%.2f GiB) but %.2f GiB is free on %s less the %.2f GiB "
                        "prefill reserve: another process on the GPU uses more than its share "
                        "(engine_trainer_memory_fraction, engine_gpu_memory_utilization); %d slots",
                        fit, fit * per_slot / (1 << 30), free / (1 << 30), self.device, reserve / (1 << 30), now)
            fit = now
        if fit < 1:
            raise RuntimeError(f"KV cache: not one slot of {length} positions ({per_slot / (1 << 30):.2f} GiB) fits in "
                               f"the {free / (1 << 30):.2f} GiB free on {self.device}")
        self._mem_capped = fit < slots
        log.info("KV cache: %d of %d slots x %d positions (%.2f GiB; %.2f GiB a slot) from %g of the GPU's %.1f GiB "
                 "less %g for the trainer, split among %d engine(s), less %.2f GiB of weights and %.2f GiB of "
                 "prefill reserve", fit, slots, length, fit * length * token / (1 << 30), per_slot / (1 << 30),
                 self.gpu_memory_utilization, total / (1 << 30), self.trainer_memory_fraction, self.engines,
                 self.model_bytes / (1 << 30), reserve / (1 << 30))
        return fit, length

    def move_slot(self, src: int, dst: int, length: int | None = None) -> None:
        """Copy slot ``src``'s KV and decode inputs to slot ``dst`` (compaction). ``length``: the
        positions [0, length) src has cached (host-known; default all): a decode step writes its
        position before it attends to it, so nothing past that is ever read, and a short sequence
        in a long cache moves a few MB instead of every layer's whole row (~470 MB for 8k
        positions of a 7B model)."""
        n = self.length if length is None else max(0, min(int(length), self.length))
        self.k_cache[:, dst, :, :n].copy_(self.k_cache[:, src, :, :n])
        self.v_cache[:, dst, :, :n].copy_(self.v_cache[:, src, :, :n])
        self.tok_in[dst] = self.tok_in[src]
        self.pos[dst] = self.pos[src]

    def copy_prefix(self, src: int, dsts: list[int], n: int) -> None:
        """Copy the first ``n`` cached positions of slot ``src`` into every slot of ``dsts``."""
        for d in dsts:
            self.k_cache[:, d, :, :n].copy_(self.k_cache[:, src, :, :n])
            self.v_cache[:, d, :, :n].copy_(self.v_cache[:, src, :, :n])

    def _flat_index(self, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's cache viewed as [slots * kv_heads * T, D] for (slot, head, pos).

        slots: [B] int64; pos: [B, L] int64. Returns [B * kv_heads * L] int64 ordered like
        a [B, kv_heads, L, D] tensor's rows (an index_copy_ is far cheaper than an
        index_put with a slice between the indexed dims)."""
        heads = torch.arange(self.n_kv, device=self.device)
        base = (slots[:, None] * self.n_kv + heads[None, :]) * self.length  # [B, Hkv]
        return (base[:, :, None] + pos[:, None, :]).reshape(-1)

    def _write(self, li: int, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, Hkv, L, D] into layer ``li`` at the rows ``idx`` of :meth:`_flat_index`."""
        d = self.head_dim
        self.k_cache[li].view(-1, d).index_copy_(0, idx, k.reshape(-1, d))
        self.v_cache[li].view(-1, d).index_copy_(0, idx, v.reshape(-1, d))

    # ------------------------------------------------------------------ forward pieces
    def _qkv(self, layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [B, L, hidden]; cos/sin: [B, L, head_dim]. Returns q [B, Hq, L, D], k, v [B, Hkv, L, D]."""
        attn, (b, n) = layer.self_attn, x.shape[:2]
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(b, n, -1, self.head_dim)
        k = attn.k_proj(h).view(b, n, -1, self.head_dim)
        v = attn.v_proj(h).view(b, n, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s, v

    def bind(self, slots: list[int], prompts: list[list[int]], images: list[Any]) -> None:
        """Hook: the prompts (and images) about to be admitted into ``slots`` (a VLM binds M-RoPE offsets)."""

    def _rope(self, pos: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook: cos, sin [B, L, D] at cache positions ``pos`` [B, L] of slots ``rows`` [B] (M-RoPE offsets them)."""
        return self.cos[pos], self.sin[pos]

    def _prefill_inputs(self, slots: list[int], ids: torch.Tensor):
        """Hook: embeddings [B, W, hidden] and cos, sin [B, W, D] of a right-padded prefill chunk from position 0."""
        b, width = ids.shape
        return self.embed(ids), self.cos[:width].unsqueeze(0).expand(b, -1, -1), \
            self.sin[:width].unsqueeze(0).expand(b, -1, -1)

    def _finish_layer(self, layer: Any, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Residual adds around o_proj and the MLP. a: [B, Hq, L, D] attention output."""
        b, n = x.shape[:2]
        x = x + layer.self_attn.o_proj(a.transpose(1, 2).reshape(b, n, self.n_heads * self.head_dim))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Prefill attention; ``mask`` None = causal (queries and keys both start at position 0).

        Grouped keys (GQA) go to SDPA as they are in fp16/bf16 (flash takes them). Outside those
        dtypes no fused CUDA kernel accepts them (flash is half precision only, memory-efficient
        needs as many key heads as query heads), and SDPA's math fallback materialises the whole
        ``B x Hq x L x L`` fp32 score matrix (about 7.5 GB for one 8k-token row of a 14-head model):
        the keys are repeated instead (``B x L x D`` per extra head), which the memory-efficient
        kernel takes."""
        gqa = self.n_kv != self.n_heads
        if mask is not None and q.is_cuda:
            log_once(log, "engine-prefill-mask", logging.WARNING, "engine prefill: an explicit mask sends SDPA to its "
                     "math kernel (fp32 scores of every query and key), slower than the causal flash path")
        if gqa and q.dtype not in (torch.float16, torch.bfloat16):
            log_once(log, "engine-gqa-repeat", logging.WARNING if q.is_cuda else logging.INFO,
                     "engine prefill: %s keys of a GQA model are repeated to the %d query heads (no fused kernel takes "
                     "grouped %s keys): more memory traffic than the flash path of bf16/fp16", q.dtype, self.n_heads,
                     q.dtype)
            group = self.n_heads // self.n_kv
            k, v, gqa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scaling,
                                              enable_gqa=gqa)

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, slots: list[int], seqs: list[list[int]]) -> torch.Tensor:
        """Write the KV of each ``seqs[i]`` at positions ``[0, len)`` of slot ``slots[i]``.

        Returns [len(seqs), V] fp32 logits of each sequence's last position. Runs in
        chunks of at most ``max_prefill_tokens`` padded tokens.
        """
        order = sorted(range(len(seqs)), key=lambda r: len(seqs[r]))  # similar lengths share a chunk: less padding
        out: list[torch.Tensor] = []
        i = 0
        while i < len(order):
            j, width = i, 0
            while j < len(order) and (j == i or max(width, len(seqs[order[j]])) * (j - i + 1)
                                      <= self.max_prefill_tokens):
                width = max(width, len(seqs[order[j]]))
                j += 1
            rows = order[i:j]
            out.append(self._prefill_chunk([slots[r] for r in rows], [seqs[r] for r in rows], width))
            i = j
        logits = torch.cat(out, dim=0)
        back = torch.empty(len(order), dtype=torch.int64)
        back[torch.tensor(order)] = torch.arange(len(order))
        return logits[back.to(logits.device)]

    @torch.inference_mode()
    def extend(self, slots: list[int], starts: list[int], seqs: list[list[int]]) -> torch.Tensor:
        """Prefill only what a slot does not hold yet: slot ``slots[i]`` already caches the KV of
        positions ``[0, starts[i])``; write ``seqs[i]`` at ``[starts[i], starts[i] + len)``, its
        queries attending to the cached prefix and causally to themselves. Returns [len(seqs), V]
        fp32 logits of each sequence's last position (what a full prefill of the whole context
        gives, up to rounding). Padding columns write nothing (their rows are filtered out of
        the cache write), so a row ending at the cache's last position is safe."""
        dev, b = self.device, len(seqs)
        width = max(len(s) for s in seqs)
        ids = torch.zeros((b, width), dtype=torch.int64)
        for r, s in enumerate(seqs):
            ids[r, :len(s)] = torch.tensor(s, dtype=torch.int64)
        ids = ids.to(dev)
        lens = torch.tensor([len(s) for s in seqs], device=dev)
        start = torch.tensor(starts, dtype=torch.int64, device=dev)
        cols = torch.arange(width, device=dev)
        pos = start[:, None] + cols[None, :]  # [b, width]
        valid = cols[None, :] < lens[:, None]
        pos_c = pos.clamp(max=self.length - 1)
        total = int(max(s + len(q) for s, q in zip(starts, seqs)))
        keys = torch.arange(total, device=dev)
        mask = (keys[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # [b, 1, width, total]: prefix + causal
        slot_t = torch.tensor(slots, device=dev)
        cos, sin = self._rope(pos_c, slot_t)  # [b, width, head_dim]
        idx = self._flat_index(slot_t, pos_c)
        keep = valid[:, None, :].expand(b, self.n_kv, width).reshape(-1)
        idx = idx[keep]
        x = self.embed(ids)
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            d = self.head_dim
            self.k_cache[li].view(-1, d).index_copy_(0, idx, k.reshape(-1, d)[keep])
            self.v_cache[li].view(-1, d).index_copy_(0, idx, v.reshape(-1, d)[keep])
            kc, vc = self.k_cache[li, slot_t, :, :total], self.v_cache[li, slot_t, :, :total]  # [b, Hkv, total, D]
            x = self._finish_layer(layer, x, self._attend(q, kc, vc, mask))
        last = x[torch.arange(b, device=dev), lens - 1]
        return self.lm_head(self.norm(last)).float()

    def save_prefix(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of slot ``slot``'s K and V at positions [0, n): [layers, kv_heads, n, head_dim] each."""
        return self.k_cache[:, slot, :, :n].clone(), self.v_cache[:, slot, :, :n].clone()

    def load_prefix(self, slot: int, k: torch.Tensor, v: torch.Tensor, n: int) -> None:
        """Write the first ``n`` positions of a :meth:`save_prefix` pair into slot ``slot``."""
        self.k_cache[:, slot, :, :n].copy_(k[:, :, :n])
        self.v_cache[:, slot, :, :n].copy_(v[:, :, :n])

    def _prefill_chunk(self, slots: list[int], seqs: list[list[int]], width: int) -> torch.Tensor:
        dev, b = self.device, len(seqs)
        ids = torch.zeros((b, width), dtype=torch.int64)
        for r, s in enumerate(seqs):  # right padding: position = column
            ids[r, :len(s)] = torch.tensor(s, dtype=torch.int64)
        ids = ids.to(dev)
        lens = torch.tensor([len(s) for s in seqs], device=dev)
        cols = torch.arange(width, device=dev)
        # Queries and keys are both this chunk's positions [0, width) (a sequence is never
        # split across chunks and no chunk reads KV cached before it), so SDPA's top-left
        # aligned is_causal equals the length mask on every real position. Padding rows
        # (positions >= len) then also see padding keys: their outputs and the KV they write
        # are garbage under either mask and never read (decode writes position p before it
        # attends to [0, p]; copy_prefix copies [0, len); a re-prefill rewrites [0, len)).
        mask = None
        if self.prefill_mask:
            mask = (cols[None, :, None] >= cols[None, None, :]) & (cols[None, None, :] < lens[:, None, None])
            mask = mask.unsqueeze(1)  # [b, 1, width, width]: causal and within the sequence
        x, cos, sin = self._prefill_inputs(slots, ids)
        idx = self._flat_index(torch.tensor(slots, device=dev), cols.unsqueeze(0).expand(b, -1))
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            self._write(li, idx, k, v)
            x = self._finish_layer(layer, x, self._attend(q, k, v, mask))
        last = x[torch.arange(b, device=dev), lens - 1]  # [b, hidden]
        return self.lm_head(self.norm(last)).float()

    # ------------------------------------------------------------------ decode
    def _decode(self, b: int, length: int) -> torch.Tensor:
        """One decode step over slots [0, b): feed ``tok_in`` at ``pos``, attending to cache
        positions [0, length). Returns [b, V] fp32 logits. Graph-capturable (no host sync)."""
        tok, pos = self.tok_in[:b], self.pos[:b]
        idx = self._flat_index(torch.arange(b, device=self.device), pos.unsqueeze(1))
        mask = (torch.arange(length, device=self.device)[None, :] <= pos[:, None]).view(b, 1, 1, length)
        cos, sin = self._rope(pos.unsqueeze(1), torch.arange(b, device=self.device))  # [b, 1, D]
        group = self.n_heads // self.n_kv
        x = self.embed(tok.unsqueeze(1))  # [b, 1, hidden]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            self._write(li, idx, k, v)
            kc, vc = self.k_cache[li, :b, :, :length], self.v_cache[li, :b, :, :length]  # [b, Hkv, length, D]
            # GQA without repeating KV: a kv head's query heads become its query "positions".
            a = F.scaled_dot_product_attention(q.reshape(b, self.n_kv, group, self.head_dim), kc, vc,
                                               attn_mask=mask, scale=self.scaling)
            x = self._finish_layer(layer, x, a.reshape(b, self.n_heads, 1, self.head_dim))
        return self.lm_head(self.norm(x[:, 0])).float()

    def bucket(self, n: int) -> int:
        """The graph batch size used for ``n`` active slots (powers of two, capped at the cache)."""
        b = 1
        while b < n:
            b *= 2
        return min(b, self.slots)

    def length_bucket(self, need: int) -> int:
        """The attended length of a graph for positions [0, need): a power of two of at least
        ``min_graph_length``, capped at the cache length."""
        length = self.min_graph_length
        while length < need:
            length *= 2
        return min(length, self.length)

    def graph_shape(self, n: int, max_pos: int) -> tuple[int, int]:
        """(rows, attended length) of the graph that decodes ``n`` live rows whose largest
        position is ``max_pos``."""
        return self.bucket(n), self.length_bucket(max_pos + 1)

    @torch.inference_mode()
    def decode(self, n: int, max_pos: int) -> torch.Tensor:
        """Decode slots [0, n); ``max_pos`` is the largest position fed (host-known). Returns
        [n, V] fp32 logits. CUDA: replays the captured graph of the (rows, length) bucket
        holding them (capturing it on first use); otherwise eager over the live part of the cache."""
        if not self.use_graphs:
            return self._decode(n, max_pos + 1)
        shape = self.graph_shape(n, max_pos)
        if shape not in self.graphs and not self._capture_or_count(shape):
            self.graph_eager_steps += 1
            return self._decode(n, max_pos + 1)  # the same tokens, slower
        self.graphs[shape].replay()
        return self.logits_out[:n]  # read (sampled) before the next decode step overwrites it

    def retry_captures(self) -> None:
        """Let the shapes whose capture failed during the last call try again (each call does)."""
        self._eager_shapes.clear()

    def _capture_or_count(self, shape: tuple[int, int]) -> bool:
        """Capture ``shape``'s graph; on failure (no memory left for the graph pool, an op a graph
        cannot hold, ...) count it, free the memory the other graphs hold (they are recaptured when
        next used) and try once more. A shape failing twice decodes eagerly until the next call
        (:meth:`retry_captures`), and for good after :data:`MAX_CAPTURE_FAILURES` failures (logged
        as an error). False: decode this step eagerly. Every failure is in ``graph_capture_failures``
        and every eager step in ``graph_eager_steps`` (the engine's stats, the step's metrics)."""
        if shape in self._eager_shapes or shape in self._given_up:
            return False
        for attempt in (1, 2):
            try:
                self._capture(*shape)
                return True
            except Exception as e:  # noqa: BLE001 - any capture failure: counted, retried, never fatal
                self.graph_error = f"{type(e).__name__}: {e}"
                self.graph_capture_failures += 1
                failed = self._failed[shape] = self._failed.get(shape, 0) + 1
            if failed >= MAX_CAPTURE_FAILURES:
                self._given_up.add(shape)
                log.error("capturing the decode step as a CUDA graph (%d rows, %d positions) failed %d times (%s); "
                          "this shape decodes eagerly for the rest of the run, several times slower "
                          "(graph_eager_steps counts its steps; engine_compile: false to skip capturing)",
                          shape[0], shape[1], failed, self.graph_error)
                return False
            if attempt == 1:
                log.warning("capturing the decode step as a CUDA graph (%d rows, %d positions) failed (%s); freeing "
                            "the other graphs' memory and retrying", shape[0], shape[1], self.graph_error)
                self.free_graphs()
        self._eager_shapes.add(shape)
        log.warning("capturing the decode step as a CUDA graph (%d rows, %d positions) failed again (%s); decoding "
                    "it eagerly until the next call, which tries again (graph_capture_failures: %d)",
                    shape[0], shape[1], self.graph_error, self.graph_capture_failures)
        return False

    def free_graphs(self) -> None:
        """Drop every captured graph and its private pool (recaptured on their next use), and give
        the allocator's cached blocks back, so a capture that ran out of memory can try again."""
        self.graphs.clear()
        self._pool = None
        if self.device.type == "cuda":
            empty_cache()

    def _capture(self, b: int, length: int) -> None:
        """Capture the decode step for ``b`` rows attending to cache positions [0, length).
        Rows beyond the live ones decode garbage into free slots (their positions stay in the
        cache; one past ``length`` only attends to a prefix, and nobody reads its output).

        Captures on this runner's own stream, outside torch's stream pool (``torch.cuda.graph``'s
        default is one pool stream shared by the process; torch.distributed's NCCL streams come from
        the same pool, and a collective queued there by the trainer's thread, ``--in-process``,
        would land in the graph) in ``thread_local`` mode: another thread's unsafe CUDA call
        (the event loop receiving weights: cudaMalloc, IPC opens) must not invalidate it, as
        it would in the default global mode. One capture at a time per process."""
        t0 = time.perf_counter()
        saved_tok, saved_pos = self.tok_in.clone(), self.pos.clone()
        try:
            self._record(b, length)
        finally:
            # Warm-up and capture wrote KV at the saved positions of rows [0, b); the real step
            # rewrites those same positions before reading them, so only the inputs need restoring.
            self.tok_in.copy_(saved_tok)
            self.pos.copy_(saved_pos)
        torch.cuda.current_stream(self.device).synchronize()  # not the device: another engine may be capturing
        self.capture_s += time.perf_counter() - t0

    def _record(self, b: int, length: int) -> None:
        """Warm up and capture the graph of (b, length) into ``self.graphs`` (see :meth:`_capture`)."""
        with _CAPTURE_LOCK, torch.cuda.device(self.device):
            if self._cap_stream is None:  # not a pool stream: a trainer's NCCL stream (--in-process) may be one
                self._cap_stream, self._cap_stream_owner = private_stream(self.device)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            side, main = self._cap_stream, torch.cuda.current_stream(self.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for _ in range(2):  # warm up kernels/allocations outside the graph
                    self._decode(b, length)
            main.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # capture_begin/end, not torch.cuda.graph(): its __enter__ synchronizes the whole device
            # and empties the allocator's caches, so each capture (lazy, mid-step) would wait for
            # every other thread's queued work: a trainer's backward (--in-process), a weight bucket
            # still arriving on an NCCL stream (until nccl_timeout, if its sender died mid-bucket).
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    self.logits_out[:b].copy_(self._decode(b, length))
                except BaseException:
                    with contextlib.suppress(Exception):  # the capture's own error is the one to see
                        graph.capture_end()
                    raise
                graph.capture_end()
        self.graphs[(b, length)] = graph


def kind_uses_window(cfg: Any) -> bool:
    """Mistral configs carry a sliding window that applies to every layer."""
    return getattr(cfg, "model_type", None) == "mistral" and bool(getattr(cfg, "sliding_window", None))


def module_bytes(model: Any) -> int:
    """Bytes of a module's parameters and buffers, each storage once (tied weights share one)."""
    seen: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
