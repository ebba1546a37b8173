"""Micro-batch planning and model inputs: padded rows or packed (varlen) rows.

Why it exists: a trainer step's samples have very different lengths (responses vary
1-to-8x). Padding every micro-batch to its longest sample spends most of the compute on
pad tokens. With a token budget (``max_tokens_per_micro_batch``) samples are packed
end to end into ONE row per micro-batch, each with its own position ids (0, 1, ...), and
the model attends block-diagonally (one block per sample): Hugging Face builds that mask
from the position ids when ``attention_mask`` is None and no KV cache is used (SDPA and
eager get a 4D block-diagonal mask, flash-attention varlen ``cu_seqlens``); the tests
check it numerically against the padded path.

Both layouts describe their response tokens the same way: ``index`` (the flat positions,
in the ``[rows * length]`` view, of the hidden states that PREDICT each response token)
and ``targets`` (those tokens), sample by sample in token order. So whatever the layout,
the head computes exactly the flat ragged ``[sum(response lens)]`` values the batch stores.
Pure torch, no I/O, no torch.distributed (the actor agrees on micro-batch counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

__all__ = ["ModelInputs", "SEQ_LENS_KWARG", "SP_GROUP_KWARG", "pack_inputs", "pad_inputs", "plan_micro_batches",
           "dummy_inputs", "sample_lengths"]

# The model kwarg that carries a packed row's sample lengths as Python ints to the attention
# (which then never reads them back from the device tensor: no host sync per layer).
SEQ_LENS_KWARG = "distflow_seq_lens"
# The model kwarg that carries the sequence-parallel group to the attention (distflow/trainer/ulysses.py).
SP_GROUP_KWARG = "distflow_sp_group"


@dataclass
class ModelInputs:
    """One micro-batch as the model sees it.

    input_ids, position_ids: [R, L] int64; attention_mask: [R, L] int64 (padded layout) or
    None (packed: block-diagonal from position ids); index: [N] int64 flat positions into the
    [R * L] hidden states that predict the N response tokens; targets: [N] int64;
    response_lens: per-sample response lengths (sum N); tokens: real (non-pad) tokens;
    cu_seqlens: packed rows only, int32 [n + 1] cumulative sample lengths (for varlen
    attention, :mod:`distflow.trainer.attention`), max_len: the longest sample, seq_lens:
    packed rows only, the sample lengths (host ints, the differences of cu_seqlens); sp: with
    sequence parallelism, this rank's 1/N slice of the row (:class:`distflow.trainer.ulysses.SequenceShard`:
    ids, positions, ``index`` and ``targets`` are the slice's; cu_seqlens, seq_lens and response_lens
    the whole row's).
    """

    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor | None
    index: Tensor
    targets: Tensor
    response_lens: list[int]
    tokens: int
    cu_seqlens: Tensor | None = None
    max_len: int = 0
    seq_lens: tuple[int, ...] = ()
    pixel_values: Tensor | None = None  # a vision-language micro-batch's images (distflow/vision.py)
    image_grid_thw: Tensor | None = None
    sp: Any = None

    def to(self, device: torch.device) -> "ModelInputs":
        mv = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return ModelInputs(mv(self.input_ids), mv(self.position_ids), mv(self.attention_mask), mv(self.index),
                           mv(self.targets), self.response_lens, self.tokens, mv(self.cu_seqlens), self.max_len,
                           self.seq_lens, mv(self.pixel_values), mv(self.image_grid_thw), self.sp)

    def attention_kwargs(self) -> dict:
        """Extra model kwargs for varlen attention (packed rows), else {}."""
        if self.cu_seqlens is None:
            return {}
        out = {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens, "max_length_q": self.max_len,
               "max_length_k": self.max_len}
        if self.sp is not None:
            out[SP_GROUP_KWARG] = self.sp.group
        return {**out, SEQ_LENS_KWARG: self.seq_lens} if self.seq_lens else out

    @property
    def compute_tokens(self) -> int:
        """Token slots the model computes (pads included): R * L."""
        return int(self.input_ids.numel())


def sample_lengths(prompts: Sequence[Tensor], responses: Sequence[Tensor]) -> list[int]:
    """prompt + response length of every sample."""
    return [int(p.numel() + r.numel()) for p, r in zip(prompts, responses)]


def plan_micro_batches(lengths: Sequence[int], *, micro_batch_size: int,
                       max_tokens: int | None = None) -> list[list[int]]:
    """Split samples (by index) into micro-batches.

    ``max_tokens`` None: consecutive groups of ``micro_batch_size`` samples (the padded path).
    Otherwise first-fit decreasing by length into bins of at most ``max_tokens`` tokens (a
    sample longer than the budget gets a bin of its own), at most ``micro_batch_size``
    samples each. Every index appears exactly once; indices within a bin ascend.
    """
    n = len(lengths)
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if max_tokens is None:
        return [list(range(s, min(n, s + micro_batch_size))) for s in range(0, n, micro_batch_size)]
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(n), key=lambda i: (-int(lengths[i]), i)):
        need = int(lengths[i])
        for b in range(len(bins)):
            if need <= room[b] and len(bins[b]) < micro_batch_size:
                bins[b].append(i)
                room[b] -= need
                break
        else:
            bins.append([i])
            room.append(max_tokens - need)
    return [sorted(b) for b in bins]


def _check(prompts: Sequence[Tensor], responses: Sequence[Tensor]) -> None:
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if p.dim() != 1 or r.dim() != 1:
            raise ValueError(f"sample {i}: prompt_tokens/response_tokens must be 1-D, got {list(p.shape)}, "
                             f"{list(r.shape)}")
        if p.numel() == 0:
            raise ValueError(f"sample {i}: empty prompt_tokens (the first response token needs a prefix)")
        if p.is_floating_point() or r.is_floating_point():
            raise ValueError(f"sample {i}: floating-point token ids")


def pack_inputs(prompts: Sequence[Tensor], responses: Sequence[Tensor]) -> ModelInputs:
    """Pack samples end to end into one row: [1, S] with S = sum(P_i + R_i), no padding."""
    _check(prompts, responses)
    ids, pos, index, targets, rlens = [], [], [], [], []
    off = 0
    for p, r in zip(prompts, responses):
        np_, nr = int(p.numel()), int(r.numel())
        ids += [p.to(torch.int64), r.to(torch.int64)]
        pos.append(torch.arange(np_ + nr, dtype=torch.int64))
        index.append(torch.arange(off + np_ - 1, off + np_ + nr - 1, dtype=torch.int64))
        targets.append(r.to(torch.int64))
        rlens.append(nr)
        off += np_ + nr
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64)  # noqa: E731
    lens = [int(p.numel() + r.numel()) for p, r in zip(prompts, responses)]
    cu = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(torch.int32)
    return ModelInputs(cat(ids)[None], cat(pos)[None], None, cat(index), cat(targets), rlens, off, cu,
                       max(lens, default=0), tuple(lens))


def pad_inputs(prompts: Sequence[Tensor], responses: Sequence[Tensor], pad_id: int = 0) -> ModelInputs:
    """Right-pad samples to one [B, L] batch (L = longest sample), position ids from the mask."""
    _check(prompts, responses)
    b = len(prompts)
    width = max(sample_lengths(prompts, responses), default=0)
    ids = torch.full((b, width), int(pad_id), dtype=torch.int64)
    attn = torch.zeros((b, width), dtype=torch.int64)
    index, targets, rlens = [], [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        np_, nr = int(p.numel()), int(r.numel())
        ids[i, :np_] = p.to(torch.int64)
        ids[i, np_:np_ + nr] = r.to(torch.int64)
        attn[i, :np_ + nr] = 1
        index.append(torch.arange(i * width + np_ - 1, i * width + np_ + nr - 1, dtype=torch.int64))
        targets.append(r.to(torch.int64))
        rlens.append(nr)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64)  # noqa: E731
    return ModelInputs(ids, pos, attn, cat(index), cat(targets), rlens, int(attn.sum()))


def dummy_inputs() -> ModelInputs:
    """A 2-token micro-batch with no response token: what a rank with fewer micro-batches
    runs so that every rank makes the same FSDP collectives."""
    z = torch.zeros(1, 2, dtype=torch.int64)
    empty = torch.zeros(0, dtype=torch.int64)
    return ModelInputs(z, torch.arange(2)[None], None, empty, empty, [], 0)


def split_mini_batches(n: int, parts: int) -> list[list[int]]:
    """``range(n)`` cut into ``parts`` contiguous, near-equal pieces (some may be empty)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        size = base + (1 if k < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out
