"""Per-token logprobs of given sequences under a causal LM (trainer and reference model).

Why it exists: the policy loss needs log pi(token | prefix) for every response token, in
exactly the convention the rollout engine used when it sampled them —
``log_softmax(logits / temperature)`` in fp32 — so that importance ratios are 1 when the
weights are the same. Rollout engines left-pad; the trainer right-pads ragged
prompt+response pairs; position ids come from the attention mask, so both give the same
numbers. Pure torch, no I/O; differentiable.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

__all__ = ["gather_response", "pad_batch", "scatter_response", "token_logprobs"]

# Upper bound on the fp32 logits materialised at once by token_logprobs (bytes).
_CHUNK_BYTES = 1 << 28


def pad_batch(prompts: Sequence[Tensor], responses: Sequence[Tensor], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Concatenate prompt+response per sample and right-pad to one batch.

    prompts[i]: [P_i] int (P_i >= 1), responses[i]: [R_i] int (R_i >= 0).
    Returns, with L = max_i(P_i + R_i):
      input_ids      [B, L] int64 (pad_id after each sample),
      attention_mask [B, L] int64 (1 on the P_i + R_i real tokens),
      response_mask  [B, L] int64 (1 on the R_i response tokens).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"pad_batch: {len(prompts)} prompts but {len(responses)} responses")
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if p.dim() != 1 or r.dim() != 1:
            raise ValueError(f"pad_batch: sample {i} must be 1-D token tensors, got {list(p.shape)} and {list(r.shape)}")
        if p.numel() == 0:
            raise ValueError(f"pad_batch: sample {i} has an empty prompt (the first response token needs a prefix)")
        if p.is_floating_point() or r.is_floating_point():
            raise ValueError(f"pad_batch: sample {i} has floating-point token ids")
    b = len(prompts)
    width = max((int(p.numel() + r.numel()) for p, r in zip(prompts, responses)), default=0)
    device = prompts[0].device if b else torch.device("cpu")
    input_ids = torch.full((b, width), int(pad_id), dtype=torch.int64, device=device)
    attention_mask = torch.zeros((b, width), dtype=torch.int64, device=device)
    response_mask = torch.zeros((b, width), dtype=torch.int64, device=device)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        np_, nr = int(p.numel()), int(r.numel())
        input_ids[i, :np_] = p.to(device=device, dtype=torch.int64)
        input_ids[i, np_:np_ + nr] = r.to(device=device, dtype=torch.int64)
        attention_mask[i, :np_ + nr] = 1
        response_mask[i, np_:np_ + nr] = 1
    return input_ids, attention_mask, response_mask


def token_logprobs(model: Any, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0) -> Tensor:
    """Logprob of every token given its prefix.

    input_ids, attention_mask: [B, L]. Returns [B, L] fp32 with
    ``out[b, t] = log_softmax(logits[b, t-1] / temperature)[input_ids[b, t]]`` where tokens
    t-1 and t are both real (mask 1), and 0 elsewhere (in particular ``out[b, 0] = 0``).
    ``temperature == 0`` means greedy sampling, whose logprobs the engines report at
    temperature 1, so it is treated as 1. Position ids are ``cumsum(mask) - 1`` (clamped),
    so left- and right-padded batches give the same values. Differentiable with respect to
    the model's parameters, but memory-hungry: the model's logits cover every position, and
    autograd keeps each fp32 chunk for backward (O(B x L x V)). This is the reference
    convention (the engine's tests check against it); the trainer uses the chunked,
    response-only head of :mod:`distflow.trainer.head` instead.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"token_logprobs: input_ids {list(input_ids.shape)} and attention_mask "
                         f"{list(attention_mask.shape)} must both be [B, L]")
    if not isinstance(temperature, (int, float)) or temperature < 0 or temperature != temperature:
        raise ValueError(f"token_logprobs: temperature must be >= 0, got {temperature!r}")
    temp = float(temperature) if temperature > 0 else 1.0
    b, length = input_ids.shape
    out = torch.zeros((b, length), dtype=torch.float32, device=input_ids.device)
    if b == 0 or length < 2:
        return out
    mask = attention_mask.to(torch.int64)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits  # [B, L, V], model dtype
    vocab = logits.shape[-1]
    targets = input_ids[:, 1:].unsqueeze(-1)  # [B, L-1, 1]
    rows = max(1, _CHUNK_BYTES // max(1, (length - 1) * vocab * 4))
    pieces = []
    for s in range(0, b, rows):
        x = logits[s:s + rows, :-1].float()  # [r, L-1, V] fp32 (one chunk only)
        if temp != 1.0:
            x = x * (1.0 / temp)  # as the engines and the head scale (a division rounds differently)
        pieces.append(x.gather(-1, targets[s:s + rows]).squeeze(-1) - torch.logsumexp(x, dim=-1))
    lp = torch.cat(pieces, dim=0)  # [B, L-1]
    valid = (mask[:, 1:] != 0) & (mask[:, :-1] != 0)
    return torch.cat([out[:, :1], torch.where(valid, lp, torch.zeros_like(lp))], dim=1)


def gather_response(values: Tensor, response_mask: Tensor) -> Tensor:
    """values [B, L], response_mask [B, L] -> flat [sum(response lens)], sample by sample, in token order."""
    if values.shape != response_mask.shape:
        raise ValueError(f"gather_response: values {list(values.shape)} vs response_mask {list(response_mask.shape)}")
    return values[response_mask != 0]


def scatter_response(flat: Tensor, response_mask: Tensor) -> Tensor:
    """Inverse of :func:`gather_response`: flat [N] -> [B, L] with zeros off the response tokens."""
    sel = response_mask != 0
    n = int(sel.sum())
    if flat.dim() != 1 or flat.shape[0] != n:
        raise ValueError(f"scatter_response: expected {n} flat values for the mask, got {list(flat.shape)}")
    return torch.zeros(response_mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(sel, flat)
