"""Ulysses sequence parallelism (``sequence_parallel: N``): one packed row split over N ranks.

Why it exists: a long sample's activations (every layer's hidden states, attention inputs and
outputs) grow with its length, and FSDP2 does not split them: a 32k-token sample can exceed one
GPU whatever the number of data-parallel ranks. As DeepSpeed-Ulysses and verl
(``verl/utils/ulysses.py``) do, an SP group of N ranks computes ONE data-parallel share
(:func:`distflow.trainer.parallel.share_union` unites its ranks' samples) and each rank holds 1/N
of every packed micro-batch row (:func:`shard_inputs`: the row padded to a multiple of N with a
pad "sample" that attends only to itself). Everything outside the attention (embeddings, norms,
MLPs, the LM head) is per token and runs on the local slice. The attention needs every position,
so around it (:func:`ulysses_attention`, called by :func:`distflow.trainer.attention.varlen_attention`
when the model kwargs carry the SP group) an all-to-all turns (local positions, all heads) into
(all positions, heads / N), the varlen attention runs over the whole packed row with its
cumulative sample lengths, and a second all-to-all turns it back. RoPE is applied before, with
each slice's own position ids. With fewer KV heads than N, each KV head is repeated (verl's way)
so every rank has the one its query heads read. With tensor parallelism too (the ``(dp, sp, tp)`` mesh)
the attention sees this TP rank's heads, which the all-to-all splits further.

The logprob head runs on the slice's response positions only; :func:`gather_tokens` concatenates
the SP ranks' logprobs and entropies (each rank's slice predicts a contiguous run of the row's
response tokens), so every rank computes the same loss as without SP. Its backward sums the
ranks' gradients (the adjoint of a gather) and keeps this rank's part: N identical losses then
contribute N times, which the step's normalisers absorb exactly as for tensor parallelism
(global counts count each sample N times), and FSDP2's mean over all ``dp x sp`` ranks gives the
token mean of the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from distflow.trainer.collectives import counted
from distflow.trainer.packing import ModelInputs

__all__ = ["SequenceShard", "check_sp_model", "gather_tokens", "shard_inputs", "ulysses_attention"]


@dataclass(frozen=True)
class SequenceShard:
    """This rank's place in a row split over an SP group: ``counts`` are the response tokens each SP
    rank's slice predicts, in SP-rank order (host ints: the gather needs no size exchange)."""

    group: Any
    rank: int
    size: int
    counts: tuple[int, ...]


def check_sp_model(config: Any, sp: int, tp: int = 1) -> None:
    """Refuse, naming the key, a model Ulysses cannot split ``sp`` ways: each rank attends with
    ``num_attention_heads / (tp * sp)`` whole heads (``tp``: the tensor-parallel degree, which splits the
    heads first), and its ``num_key_value_heads / tp`` KV heads either split evenly or, when there are
    fewer than ``sp``, are repeated (``sp`` must then be a multiple of them). Vision-language models
    (M-RoPE positions, padded batches) are not split."""
    if sp == 1:
        return
    if getattr(config, "vision_config", None) is not None:
        raise ValueError(f"sequence_parallel: {sp}: vision-language models are not supported (their micro-batches "
                         "are padded and their positions are M-RoPE); use sequence_parallel: 1")
    heads = config.num_attention_heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) // tp
    of_tp = f" / tensor_parallel {tp}" if tp > 1 else ""
    if heads % (sp * tp):
        raise ValueError(f"sequence_parallel: {sp} must divide the model's num_attention_heads ({heads}{of_tp}): "
                         "each sequence-parallel rank attends with whole heads")
    if kv % sp and sp % kv:
        raise ValueError(f"sequence_parallel: {sp} must divide the model's num_key_value_heads ({kv * tp}{of_tp}) "
                         "or be a multiple of it (the KV heads are then repeated)")


def shard_inputs(inputs: ModelInputs, group: Any) -> ModelInputs:
    """This rank's slice of a packed one-row micro-batch (CPU inputs, before ``.to(device)``).

    The row is padded to a multiple of the group size with pad tokens (id 0, positions 0, 1, ...)
    that form a "sample" of their own, so no real token attends to them; each rank then holds the
    same number of positions. ``index`` (ascending in a packed row) is cut where the slices end:
    this rank keeps the response tokens its positions predict, renumbered into the slice. A row
    without sample lengths (a dummy micro-batch) is one sample."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    ids, pos = inputs.input_ids, inputs.position_ids
    if ids.shape[0] != 1 or inputs.attention_mask is not None:
        raise ValueError("sequence_parallel: a micro-batch must be one packed row, got "
                         f"{ids.shape[0]} rows{' with padding' if inputs.attention_mask is not None else ''}")
    n = ids.shape[1]
    lens = list(inputs.seq_lens) or [n]
    pad = -n % size
    if pad:
        ids = torch.cat([ids, ids.new_zeros(1, pad)], dim=1)
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype)[None]], dim=1)
        lens.append(pad)
    width = (n + pad) // size
    cuts = torch.searchsorted(inputs.index, torch.arange(size + 1, dtype=inputs.index.dtype) * width).tolist()
    lo, hi = cuts[rank], cuts[rank + 1]
    cu = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(torch.int32)
    mine = slice(rank * width, (rank + 1) * width)
    shard = SequenceShard(group, rank, size, tuple(b - a for a, b in zip(cuts[:-1], cuts[1:])))
    return ModelInputs(ids[:, mine], pos[:, mine], None, inputs.index[lo:hi] - rank * width, inputs.targets[lo:hi],
                       inputs.response_lens, inputs.tokens, cu, max(lens), tuple(lens), sp=shard)


def _all_to_all(x: Tensor, group: Any, scatter: int, gather: int) -> Tensor:
    """Split ``x`` into group-size chunks along ``scatter``, send chunk j to rank j, and concatenate the
    chunks received (in rank order) along ``gather``."""
    size = dist.get_world_size(group)
    ins = [c.contiguous() for c in x.chunk(size, dim=scatter)]
    outs = [torch.empty_like(ins[0]) for _ in range(size)]
    counted("all_to_all", dist.all_to_all, outs, ins, group=group)
    return torch.cat(outs, dim=gather)


class _AllToAll(torch.autograd.Function):
    """:func:`_all_to_all`, differentiable: its adjoint is the all-to-all with the dims swapped."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any, scatter: int, gather: int) -> Tensor:
        ctx.group, ctx.dims = group, (scatter, gather)
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad: Tensor):
        scatter, gather = ctx.dims
        return _all_to_all(grad, ctx.group, gather, scatter), None, None, None


def ulysses_attention(attend: Callable[..., tuple[Tensor, Any]], module: Any, query: Tensor, key: Tensor,
                      value: Tensor, attention_mask: Tensor | None, group: Any, **kwargs: Any) -> tuple[Tensor, None]:
    """query [1, Hq, S/N, D], key/value [1, Hkv, S/N, D] (this rank's positions, all heads) ->
    [1, S/N, Hq, D]: ``attend`` (the varlen attention, given the whole row's cumulative lengths in
    ``kwargs``) runs on [1, Hq/N, S, D] after an all-to-all, and its [1, S, Hq/N, D] output goes back."""
    size = dist.get_world_size(group)
    kv = key.shape[1]
    if kv % size:  # fewer KV heads than ranks: query head h reads KV head h // (Hq / Hkv); rank j gets repeat j
        key, value = (t.repeat_interleave(size // kv, dim=1) for t in (key, value))
    q, k, v = (_AllToAll.apply(t, group, 1, 2) for t in (query, key, value))
    out, _ = attend(module, q, k, v, attention_mask, **kwargs)
    return _AllToAll.apply(out, group, 1, 2), None


class _GatherTokens(torch.autograd.Function):
    """[n_r, C] per SP rank -> [sum n_r, C] on every rank, in rank order. Backward: the gradients of
    all ranks summed (an all-reduce), this rank's rows kept."""

    @staticmethod
    def forward(ctx, x: Tensor, shard: SequenceShard) -> Tensor:
        ctx.shard = shard
        width = max(1, *shard.counts)  # (a collective on an empty tensor is not every backend's)
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(shard.size)]
        counted("all_gather", dist.all_gather, parts, padded, group=shard.group)
        return torch.cat([p[:n] for p, n in zip(parts, shard.counts)])

    @staticmethod
    def backward(ctx, grad: Tensor):
        shard = ctx.shard
        grad = grad.contiguous().clone()
        counted("all_reduce", dist.all_reduce, grad, group=shard.group)
        start = sum(shard.counts[:shard.rank])
        return grad[start:start + shard.counts[shard.rank]], None


def gather_tokens(lp: Tensor, ent: Tensor, shard: SequenceShard) -> tuple[Tensor, Tensor]:
    """The whole row's (logprobs [N], entropy [N]) from each SP rank's slice (one collective)."""
    both = _GatherTokens.apply(torch.stack([lp, ent], dim=1), shard)
    return both[:, 0], both[:, 1]
