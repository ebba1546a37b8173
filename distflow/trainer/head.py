"""The memory-lean LM head: logprobs (and entropy) of response tokens only, chunk by chunk.

Why it exists: the policy loss needs ``log_softmax(logits / T)[target]`` at response
positions only. Running the LM head over every position and keeping fp32 logits for
autograd costs O(tokens x vocab) fp32 memory (151936 x 4 bytes = 0.6 MB per token for a
Qwen2 vocabulary) and most of those positions are prompt tokens. Here the head runs on the
gathered response hidden states only, ``chunk_tokens`` rows at a time, inside one custom
autograd Function that saves just its inputs and the per-token log-normaliser and
recomputes each chunk's logits in backward. Peak extra memory is O(chunk x vocab),
whatever the number of tokens. The policy entropy (for the metrics, and an entropy bonus
in the loss) comes out of the same chunks; it is differentiable too.

Logits are computed in the weight's dtype (the compute dtype under mixed precision, as the
full-model path and the rollout engine do) and then promoted to fp32 for the softmax. In
backward both matmuls run in that dtype too (tensor cores; an fp32 matmul is ~16x slower on
an H100): the weight gradient, summed over chunks, accumulates in fp32 through
fp32-output GEMMs on CUDA, each chunk's added in place in row blocks of at most 64 MiB
(:func:`_add_mm_fp32`: no fp32 [vocab, hidden] temporary per chunk); elsewhere, and for fp32
weights, it is computed in fp32 with ``addmm_`` into the accumulator.

:func:`response_forward` runs a Hugging Face causal LM's decoder once over
:class:`~distflow.trainer.packing.ModelInputs` (packed or padded) and applies the head; the
actor registers it as an FSDP2 forward method so the root module's parameters (embeddings,
final norm, LM head) are all-gathered around it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from distflow.hf import logit_transform
from distflow.trainer.attention import model_attention_mask
from distflow.trainer.packing import ModelInputs
from distflow.trainer.ulysses import gather_tokens

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_CHUNK_TOKENS", "chunked_logprobs", "response_forward"]

DEFAULT_CHUNK_TOKENS = 1024
_HALF = (torch.float16, torch.bfloat16)
# Whether torch.mm(..., out_dtype=torch.float32) (aten::mm.dtype, CUDA-only) works here; None = untried.
_MM_FP32_OUT: list[bool | None] = [None]
# The most bytes one fp32 block of a chunk's weight-gradient product may take (the rest of the
# [V, H] product is computed block by block into the accumulator, never whole).
PRODUCT_BLOCK_BYTES = 64 << 20


def _add_mm_fp32(acc: Tensor | None, a: Tensor, b: Tensor) -> Tensor:
    """``acc + a @ b`` in fp32, ``acc`` updated in place (None: a new fp32 zero tensor), with no
    fp32 temporary of ``acc``'s size. Half precision CUDA inputs: tensor-core GEMMs with an fp32
    result (``aten::mm.dtype``) of at most :data:`PRODUCT_BLOCK_BYTES` rows at a time, each added
    into its rows of ``acc`` (:func:`_add_rows`). ``addmm(acc, a, b, out_dtype=float32)`` cannot
    do it in one call: its CUDA kernel requires ``acc``'s dtype to be the inputs' (bf16), and a
    whole ``mm.dtype`` product per chunk was a 2.2 GB fp32 temporary for a 152k x 3584 head.
    Otherwise (CPU, fp32, a torch without ``mm.dtype``): ``addmm_`` in place on the inputs promoted
    to fp32 (chunk-sized copies)."""
    if acc is None:
        acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    if a.is_cuda and a.dtype in _HALF and b.dtype == a.dtype and _optional_kernel(
            _MM_FP32_OUT, lambda: torch.mm(a[:1], b, out_dtype=torch.float32), "torch.mm(out_dtype=float32)",
            "the weight gradient is computed in fp32 (slower)") is not None:
        return _add_rows(acc, a, b, lambda x, y: torch.mm(x, y, out_dtype=torch.float32))
    return acc.addmm_(a.float(), b.float())


def _add_rows(acc: Tensor, a: Tensor, b: Tensor, product: Any, block_bytes: int = PRODUCT_BLOCK_BYTES) -> Tensor:
    """``acc += product(a, b)`` block by block over ``a``'s rows: ``product`` (an fp32-result
    matmul) runs on at most ``block_bytes // (4 * acc.shape[1])`` rows at a time, so the only
    temporary is one such block, whatever the vocabulary."""
    rows = max(1, block_bytes // (4 * max(1, acc.shape[1])))
    for r in range(0, a.shape[0], rows):
        acc[r:r + rows].add_(product(a[r:r + rows], b))
    return acc


def _optional_kernel(works: list[bool | None], call: Any, what: str, instead: str) -> Tensor | None:
    """``call()``, or None when this torch lacks the kernel (remembered in ``works``: the first
    refusal, an argument or dispatch check before any kernel ran, is logged once and the caller's
    fallback is used from then on). A failure after it once worked is a real error and raises."""
    if works[0] is False:
        return None
    try:
        out = call()
    except torch.OutOfMemoryError:
        raise
    except (TypeError, NotImplementedError, RuntimeError) as e:
        if works[0]:
            raise
        works[0] = False
        log.warning("LM head backward: %s unavailable (%s); %s", what, e, instead)
        return None
    works[0] = True
    return out


class _ChunkedLogprobs(torch.autograd.Function):
    """hidden [N, H], weight [V, H], targets [N] -> (logprobs [N] fp32, entropy [N] fp32)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: float, chunk: int,
                with_entropy: bool, mult: float = 1.0, cap: float | None = None):
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = (torch.empty if with_entropy else torch.zeros)(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            logits = _logits(hidden[s:s + chunk], weight, inv_temp, mult, cap)[0]  # [c, V] fp32, one chunk only
            z = torch.logsumexp(logits, dim=-1)
            lse[s:s + chunk] = z
            logp = logits.sub_(z[:, None])  # in place: log-softmax
            lp[s:s + chunk] = logp.gather(-1, targets[s:s + chunk, None]).squeeze(-1)
            if with_entropy:
                ent[s:s + chunk] = -torch.linalg.vecdot(logp.exp(), logp)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.inv_temp, ctx.chunk, ctx.mult, ctx.cap = inv_temp, chunk, mult, cap
        ctx.set_materialize_grads(False)  # an unused output (usually entropy) gets None, not zeros
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp: Tensor | None, grad_ent: Tensor | None):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        inv_temp, chunk, mult, cap = ctx.inv_temp, ctx.chunk, ctx.mult, ctx.cap
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w: Tensor | None = None  # fp32 [V, H], summed over the chunks
        if grad_lp is None:
            grad_lp = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            logits, squash = _logits(h, weight, inv_temp, mult, cap)
            g = grad_lp[s:s + chunk].float()[:, None]
            logp = logits.sub_(lse[s:s + chunk, None])  # in place: log-softmax
            if grad_ent is not None:  # dH/dlogit_j = -p_j (log p_j + H), folded in before logp is consumed
                ge = grad_ent[s:s + chunk].float()[:, None]
                scale = logp.add(ent[s:s + chunk, None]).mul_(ge).add_(g)  # g + ge (log p + H)
                dlogits = logp.exp_().mul_(scale.neg_())
            else:
                dlogits = logp.exp_().mul_(-g)  # d lp / d logits = onehot(target) - softmax
            dlogits.scatter_add_(-1, targets[s:s + chunk, None], g)
            if inv_temp * mult != 1.0:
                dlogits.mul_(inv_temp * mult)  # the chain factors 1/T and the model's multiplier
            if squash is not None:  # d cap*tanh(x/cap) / dx = 1 - tanh(x/cap)^2
                dlogits.mul_(squash.square_().neg_().add_(1.0))
            dl = dlogits.to(weight.dtype)  # the matmuls run in the weight's dtype (a no-op in fp32)
            if need_h:
                grad_h[s:s + chunk] = (dl @ weight).to(hidden.dtype)
            if need_w:  # half precision on CUDA: dl @ h with an fp32 result; else fp32 dlogits @ fp32 h
                fast = weight.is_cuda and weight.dtype in _HALF
                grad_w = _add_mm_fp32(grad_w, (dl if fast else dlogits).t(), h)
        if need_w and grad_w is None:  # no tokens
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None, None


def _logits(h: Tensor, weight: Tensor, inv_temp: float, mult: float, cap: float | None) -> tuple[Tensor, Tensor | None]:
    """One chunk's fp32 logits as the model defines them, then tempered: ``cap * tanh(mult * h @ W.T / cap) / T``
    (no tanh without ``cap``), and ``tanh(...)`` itself when capped (its derivative, for backward), else None."""
    logits = (h @ weight.t()).float()
    if mult != 1.0:
        logits.mul_(mult)
    squash = None
    if cap is not None:
        squash = logits.div_(cap).tanh_()
        logits = squash.mul(cap)
    if inv_temp != 1.0:
        logits.mul_(inv_temp)
    return logits, squash


def chunked_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS, with_entropy: bool = True,
                     transform: tuple[float, float | None] = (1.0, None)) -> tuple[Tensor, Tensor]:
    """``log_softmax(hidden @ weight.T / T)[targets]`` and the entropy of that distribution.
    ``transform``: the model's (multiplier, soft cap) of its logits (:func:`distflow.hf.logit_transform`), applied
    before the temperature.

    hidden [N, H] (any float dtype), weight [V, H] (the LM head, no bias), targets [N] int64.
    Returns (logprobs [N] fp32, entropy [N] fp32), both differentiable w.r.t. hidden and
    weight. ``temperature == 0`` (greedy sampling, whose logprobs the engines report at
    temperature 1) is treated as 1. Extra memory is O(chunk_tokens x V). ``with_entropy=False``
    skips the entropy (returned as zeros, not differentiable): logprob-only passes.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"chunked_logprobs: hidden {list(hidden.shape)} must be [N, H] and weight "
                         f"{list(weight.shape)} [V, H]")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"chunked_logprobs: targets {list(targets.shape)} must be [{hidden.shape[0]}]")
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"chunked_logprobs: temperature must be >= 0, got {temperature!r}")
    if chunk_tokens < 1:
        raise ValueError(f"chunked_logprobs: chunk_tokens must be >= 1, got {chunk_tokens}")
    inv_temp = 1.0 / float(temperature) if temperature > 0 else 1.0
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    mult, cap = transform
    return _ChunkedLogprobs.apply(hidden, weight, targets.to(torch.int64), inv_temp, int(chunk_tokens),
                                  bool(with_entropy), float(mult), cap)


def response_forward(model: Any, inputs: ModelInputs, temperature: float = 1.0,
                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS, with_entropy: bool = True) -> tuple[Tensor, Tensor]:
    """Logprobs and entropy of the response tokens of ``inputs`` under a causal LM.

    ``model`` is a Hugging Face ``*ForCausalLM`` (``.model`` the decoder, ``.lm_head`` a
    bias-free Linear; its config's logit scaling and soft cap are applied, as its own forward
    does). Returns (logprobs [N], entropy [N]) fp32, N = sum(response lens), in
    the batch's flat ragged order. The decoder runs without KV cache. Packed inputs pass
    their cumulative sample lengths to the attention (``distflow_varlen`` attends per
    sample); with transformers' own implementations the block-diagonal mask comes from the
    position ids instead. With sequence parallelism (``inputs.sp``, :mod:`distflow.trainer.ulysses`)
    the decoder and the head run on this rank's slice and the values of the whole row come back.
    """
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("response_forward: LM heads with a bias are not supported")
    if getattr(model.model, "visual", None) is not None:  # a vision-language model: its images, M-RoPE positions
        hidden = _vision_hidden(model, inputs)
    else:
        attention = inputs.attention_kwargs()
        mask = model_attention_mask(model.model.config, inputs.attention_mask, attention, inputs.input_ids.device)
        hidden = model.model(input_ids=inputs.input_ids, attention_mask=mask, position_ids=inputs.position_ids,
                             use_cache=False, **attention).last_hidden_state  # [R, L, H]
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, inputs.index)  # [N, H]
    lp, ent = chunked_logprobs(picked, head_weight(head), inputs.targets, temperature, chunk_tokens, with_entropy,
                               logit_transform(model.config))
    # sequence parallelism: this rank's slice of the row -> the whole row's, on every SP rank
    return (lp, ent) if inputs.sp is None else gather_tokens(lp, ent, inputs.sp)


def _vision_hidden(model: Any, inputs: ModelInputs) -> Tensor:
    """The decoder's hidden states [R, L, H] of a vision-language micro-batch (padded or packed): the
    images through the vision tower into their placeholder tokens, M-RoPE positions computed as the
    engine computes them (:func:`distflow.vision.mrope_positions`), so the logprobs are the engine's.
    Only PROMPT tokens are image placeholders: a sampled response token may be the image-token id
    (a random policy samples any id), which the model's own forward would take for one."""
    from distflow.vision import mrope_positions

    inner, ids = model.model, inputs.input_ids
    mask = inputs.attention_mask if inputs.attention_mask is not None else torch.ones_like(ids)
    prompt = mask.reshape(-1) != 0
    prompt[inputs.index + 1] = False  # the response tokens (``index`` points at the positions predicting them)
    image = (ids == int(inner.config.image_token_id)) & prompt.view_as(ids)
    embeds = inner.get_input_embeddings()(ids)
    tokens = int(image.sum())  # (one host read per micro-batch)
    if inputs.pixel_values is not None or tokens:  # image tokens without images: the sample lost them on the way
        feats = None if inputs.pixel_values is None else torch.cat(list(inner.get_image_features(
            inputs.pixel_values, inputs.image_grid_thw, return_dict=True).pooler_output)).to(embeds.dtype)
        if feats is None or feats.shape[0] != tokens:
            raise ValueError(f"{0 if feats is None else feats.shape[0]} image features for {tokens} image tokens in "
                             f"the prompts of a micro-batch")
        embeds = embeds.masked_scatter(image[..., None], feats)
    if inputs.seq_lens:  # a packed row: each sample's M-RoPE positions, after its text positions (Qwen2-VL
        pos = _packed_mrope(model, ids, image, inputs)  # builds the per-sample causal mask from those)
    else:
        pos = mrope_positions(model, ids, mask, inputs.image_grid_thw, image)
    return inner.language_model(inputs_embeds=embeds, attention_mask=inputs.attention_mask, position_ids=pos,
                                use_cache=False).last_hidden_state


def _packed_mrope(model: Any, ids: Tensor, image: Tensor, inputs: ModelInputs) -> Tensor:
    """Position ids [4, 1, S] of a packed vision-language row: its text positions (0, 1, ... per
    sample: what the attention mask is built from, one causal block per sample) then the M-RoPE
    positions of each sample on its own, its images' grids taken in order (one grid per run of
    image tokens in its prompt)."""
    from distflow.vision import mrope_positions

    grids = inputs.image_grid_thw
    parts, start, used = [], 0, 0
    flags = image[0].tolist()
    for n in inputs.seq_lens:
        seg = slice(start, start + n)
        k = sum(flags[i] and (i == start or not flags[i - 1]) for i in range(start, start + n))  # its image blocks
        grid = None if grids is None or not k else grids[used:used + k]
        parts.append(mrope_positions(model, ids[:, seg], torch.ones_like(ids[:, seg]), grid, image[:, seg]))
        start, used = start + n, used + k
    return torch.cat([inputs.position_ids[None], torch.cat(parts, dim=-1)], dim=0)


def head_weight(head: Any) -> Tensor:
    """The LM head's weight as its forward applies it: with a PEFT LoRA adapter on the head
    (``model.lora.target_modules`` naming ``lm_head``) its ``base_layer.weight`` plus ``scale * B @ A``
    of each active adapter, differentiable in A and B (the chunked head multiplies by one weight, so
    the adapter is folded into it: the adapter's input dropout is not applied to the head)."""
    base = getattr(head, "base_layer", None)
    if base is None or not hasattr(head, "lora_A"):
        return head.weight
    w = base.weight
    for name in head.active_adapters:
        if name in head.lora_A:
            w = w + head.scaling[name] * (head.lora_B[name].weight @ head.lora_A[name].weight)
    return w
