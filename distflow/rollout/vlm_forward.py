"""The static-KV engine path for Qwen2-VL / Qwen2.5-VL: images and M-RoPE over the Llama runner.

Why it exists: a vision-language rollout on the Hugging Face loop gets none of the engine's
continuous batching, slot compaction, KV reuse or CUDA graphs. The text half of Qwen2-VL is a
Qwen2 decoder, so :class:`~distflow.rollout.llama_forward.LlamaRunner` runs it unchanged; the
two differences live here, behind the runner's hooks:

- **images**: at prefill the model's own vision tower (``model.model.visual`` through
  ``get_image_features``) encodes the distinct images of the slots being prefilled, in ONE call
  per ``max_prefill_tokens`` image tokens (a GRPO group's samples share one
  :class:`~distflow.vision.ImageInputs`, and the batcher prefills a group's prompt once anyway),
  and the features replace the embeddings of the prompt's image tokens (only the prompt's: a
  sampled token with the image-token id is text);
- **M-RoPE**: a prompt's rotary positions are 3 x L (temporal, height, width) from the model's
  ``get_rope_index`` (:func:`~distflow.vision.mrope_positions`, as the trainer computes them);
  each frequency of the head's rotary half reads the axis ``mrope_section`` gives it. Past the
  prompt, text positions advance on all three axes from the prompt's largest position + 1, i.e.
  cache position ``p`` rotates as ``p + delta`` with the slot's ``rope delta`` (``max + 1 - L``, 0
  for a text prompt). The delta is a per-slot device tensor moved with the slot (compaction), so
  decode (and its CUDA graphs), continuous batching, KV reuse (:meth:`extend` of a later turn)
  and re-prefill after a weight swap work as for text.

One cos/sin table of text positions serves all of it: with equal positions on the three axes
M-RoPE is plain RoPE, so an axis-split rotary value is a gather from the table.
"""

from __future__ import annotations

from typing import Any

import torch

from distflow.hf import logit_transform
from distflow.rollout.llama_forward import LlamaRunner
from distflow.vision import ImageInputs, image_features, mrope_positions

__all__ = ["VLMRunner", "placeholders", "vlm_unsupported_reason"]

_FAMILY = ("qwen2_vl", "qwen2_5_vl")  # a Qwen2 text decoder, M-RoPE of 3 axes, image tokens replaced in place


def vlm_unsupported_reason(model: Any) -> str | None:
    """None when :class:`VLMRunner` can drive the vision-language ``model``, else a short reason
    (the engine then runs the Hugging Face loop and says so)."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in _FAMILY:
        return f"model_type {kind!r} is not one of {list(_FAMILY)}"
    inner = getattr(model, "model", None)
    text = getattr(inner, "language_model", None)
    if getattr(inner, "visual", None) is None or not hasattr(inner, "get_rope_index") or text is None or not all(
            hasattr(text, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the model does not have the Qwen2-VL module layout (model.visual, model.language_model)"
    tcfg = cfg.get_text_config()
    if logit_transform(tcfg) != (1.0, None) or logit_transform(cfg) != (1.0, None):
        return "the model scales or soft-caps its logits (logit_transform)"
    rope = getattr(text.rotary_emb, "rope_type", "default")
    if rope != "default" or not getattr(text.rotary_emb, "mrope_section", None):
        return f"rope_type {rope!r} (only the default M-RoPE is built)"
    if any(t != "full_attention" for t in (getattr(tcfg, "layer_types", None) or [])):
        return "sliding-window layers"
    return None


def placeholders(ids: torch.Tensor, image_token_id: int, pics: ImageInputs, merge: int) -> torch.Tensor:
    """Positions [N] of the image placeholders of a prompt ``ids`` [L]: its first N image-token ids, N the
    images' merged patches. A later turn of an episode holds sampled tokens, which may be that id too: text."""
    n = int(pics.grid_thw.prod(-1).sum()) // merge ** 2
    where = (ids == image_token_id).nonzero()[:, 0]
    if where.numel() < n:
        raise ValueError(f"a prompt with {where.numel()} image tokens for images of {n} merged patches")
    return where[:n]


class VLMRunner(LlamaRunner):
    """A :class:`LlamaRunner` whose slots may hold a prompt with images (module doc)."""

    def __init__(self, model: Any, **kw: Any):
        super().__init__(model, **kw)
        self.image_token_id = int(model.config.image_token_id)
        half = self.head_dim // 2
        axes = torch.cat([torch.full((n,), i % 3, dtype=torch.int64)
                          for i, n in enumerate(self.rotary.mrope_section)])
        if axes.numel() != half:
            raise ValueError(f"mrope_section {self.rotary.mrope_section} does not split a rotary half of {half}")
        self.axis = torch.cat([axes, axes]).to(self.device)  # [D]: the axis each rotary dim reads
        self.dims = torch.arange(self.head_dim, device=self.device)
        self.delta = torch.zeros(0, dtype=torch.int64, device=self.device)  # [slots]: the rope delta of each
        self.bound: dict[int, tuple[ImageInputs, torch.Tensor] | None] = {}  # slot -> (images, [3, L] positions)
        self._feats: dict[int, torch.Tensor] = {}  # slot -> its prompt's image features (during a prefill)
        self.vision_calls = 0  # vision tower calls (one per max_prefill_tokens image tokens of a prefill)

    def reserve(self, slots: int, length: int, grow_to: int | None = None) -> None:
        super().reserve(slots, length, grow_to)
        if self.delta.numel() != self.slots:  # (re)allocated with the cache: nothing is live
            self.delta = torch.zeros(self.slots, dtype=torch.int64, device=self.device)
            self.bound = {}

    @torch.inference_mode()
    def bind(self, slots: list[int], prompts: list[list[int]], images: list[Any]) -> None:
        """Give each slot its prompt's M-RoPE positions and rope delta (a text prompt: none, delta 0);
        the positions are computed once per distinct (prompt, images)."""
        done: dict[tuple, tuple[torch.Tensor, int]] = {}
        deltas = []
        for s, p, pics in zip(slots, prompts, images):
            if pics is None:
                self.bound[s] = None
                deltas.append(0)
                continue
            key = (id(pics), tuple(p))
            if key not in done:
                ids = torch.tensor([p], dtype=torch.int64, device=self.device)
                image = torch.zeros_like(ids, dtype=torch.bool)
                image[0, placeholders(ids[0], self.image_token_id, pics, self.merge)] = True
                pos = mrope_positions(self.model, ids, torch.ones_like(ids), pics.grid_thw.to(self.device),
                                      image)[:, 0]
                done[key] = (pos, int(pos.max()) + 1 - len(p))
            pos, delta = done[key]
            self.bound[s] = (pics, pos)
            deltas.append(delta)
        self.delta[torch.tensor(slots, device=self.device)] = torch.tensor(deltas, device=self.device)

    def move_slot(self, src: int, dst: int, length: int | None = None) -> None:
        super().move_slot(src, dst, length)
        self.delta[dst] = self.delta[src]
        self.bound[dst] = self.bound.get(src)

    @torch.inference_mode()
    def prefill(self, slots: list[int], seqs: list[list[int]]) -> torch.Tensor:
        """:meth:`LlamaRunner.prefill`, the slots' distinct images encoded first (:meth:`_encode`)."""
        with_images = [s for s in slots if self.bound.get(s) is not None]
        if with_images:
            order: dict[int, ImageInputs] = {}
            for s in with_images:
                order.setdefault(id(self.bound[s][0]), self.bound[s][0])
            by_id = dict(zip(order, self._encode(list(order.values()))))
            self._feats = {s: by_id[id(self.bound[s][0])] for s in with_images}
        try:
            return super().prefill(slots, seqs)
        finally:
            self._feats = {}

    def _encode(self, pics: list[ImageInputs]) -> list[torch.Tensor]:
        """Each prompt's image features [tokens, hidden]: one vision-tower call per ``max_prefill_tokens``
        image tokens (at least one prompt a call), so its activations stay within the prefill's reserve
        (docs/gpu.md) however many prompts an admission brings."""
        counts = [int(x.grid_thw.prod(-1).sum()) // self.merge ** 2 for x in pics]
        out: list[torch.Tensor] = []
        i = 0
        while i < len(pics):
            j, tokens = i + 1, counts[i]
            while j < len(pics) and tokens + counts[j] <= self.max_prefill_tokens:
                tokens += counts[j]
                j += 1
            feats = image_features(self.model, torch.cat([x.pixel_values for x in pics[i:j]]).to(self.device,
                                   self.dtype), torch.cat([x.grid_thw for x in pics[i:j]]).to(self.device))
            self.vision_calls += 1
            if feats.shape[0] != tokens:
                raise ValueError(f"the vision tower gave {feats.shape[0]} features for {tokens} image tokens")
            out.extend(feats.split(counts[i:j]))
            i = j
        return out

    @property
    def merge(self) -> int:
        return int(self.model.config.vision_config.spatial_merge_size)

    def _prefill_inputs(self, slots: list[int], ids: torch.Tensor):
        """Embeddings with the image features in the prompt's image tokens; M-RoPE cos/sin."""
        b, width = ids.shape
        x = self.embed(ids)
        slot_t = torch.tensor(slots, device=self.device)
        pos = torch.arange(width, device=self.device)[None, :] + self.delta[slot_t][:, None]  # past the prompt
        pos3 = pos[None].expand(3, b, width).clone()
        for r, s in enumerate(slots):
            held = self.bound.get(s)
            if held is None:
                continue
            n = min(held[1].shape[1], width)
            pos3[:, r, :n] = held[1][:, :n]
            x[r, placeholders(ids[r, :n], self.image_token_id, held[0], self.merge)] = self._feats[s].to(x.dtype)
        return (x, *self._mrope(pos3))

    def _mrope(self, pos3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, L, D] of M-RoPE positions [3, B, L]: dim d rotates by its axis' position."""
        idx = pos3.clamp(0, self.cos.shape[0] - 1)[self.axis]  # [D, B, L]
        d = self.dims[:, None, None]
        return self.cos[idx, d].permute(1, 2, 0), self.sin[idx, d].permute(1, 2, 0)

    def _rope(self, pos: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Past a prompt every axis is the cache position plus the slot's rope delta (graph-safe)."""
        p = (pos + self.delta[rows][:, None]).clamp(0, self.cos.shape[0] - 1)
        return self.cos[p], self.sin[p]
