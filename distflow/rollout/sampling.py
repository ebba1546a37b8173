"""Token sampling: top-k/top-p filtering and a counter-based per-sequence random stream.

Why it exists: the continuous batcher moves sequences between slots and admits them in
any order, so a shared ``torch.Generator`` would make a sequence's tokens depend on which
other sequences shared its decode steps. Instead every draw is a pure function of
``(seed, sequence index, token index)`` (:func:`counter_uniform`, a 32-bit integer hash run
on the device, CUDA-graph safe, no host sync; 53-bit draws, a float64 CDF), so a seed gives
the same draws for any slot count or order (the same completions wherever the logits do not
depend on the batch shape: on a GPU, other shapes may pick other kernels and move bf16
logits in the last bits). Sampling is by inverse CDF over the filtered distribution, with
top-k taken before the top-p sort. Every sampler reports the fp32 logprob of the chosen
token under ``log_softmax(logits / T)`` *before* filtering (T = 1 when greedy): what the
trainer recomputes.
"""

from __future__ import annotations

import torch

from distflow.rollout.protocol import SamplingParams

__all__ = ["counter_uniform", "filter_top_k_top_p", "sample_next", "sample_rows", "seed_key"]

_M32 = 0xFFFFFFFF

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


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    logits: [B, V] fp32. Returns (tokens [B] int64, logprobs [B] fp32) where the logprob is
    log_softmax(logits / T) of the chosen token before filtering (T = 1 for greedy).
    """
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = torch.argmax(logits, dim=-1)
    else:
        scaled = logits * (1.0 / params.temperature)  # as sample_rows and the trainer's head scale
        logp = torch.log_softmax(scaled, dim=-1)
        filtered = filter_top_k_top_p(scaled, params.top_k, params.top_p)
        probs = torch.softmax(filtered, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)



def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return ((x * lo) + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A 32-bit key for ``seed`` (any int; reduced mod 2**63 like the previous engine)."""
    s = int(seed) % (1 << 63)
    t = torch.tensor([s & _M32, s >> 32], dtype=torch.int64)
    return int(_mix32(_mix32(t[0:1]) ^ t[1:2]))


def counter_uniform(key: int, seq: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Uniform draws in [0, 1) that depend only on (key, seq[i], step[i]).

    seq, step: [B] int64 (sequence index in the request, token index in its completion).
    Returns [B] float64 with 53 random bits (two independent 32-bit hash chains): a 24-bit fp32 draw
    cannot resolve the ~1e-8 probabilities of a 150k-token vocabulary's tail. Pure integer
    arithmetic on the tensors' device: no generator state.
    """
    h = _mix32((seq & _M32) ^ key)
    h = _mix32(h ^ (step & _M32))
    hi = _mix32(h ^ 0x9E3779B9)
    g = _mix32((seq & _M32) ^ key ^ 0x85EBCA6B)  # a second chain: the low bits are not a function of hi
    lo = _mix32(_mix32(g ^ (step & _M32)) ^ 0xC2B2AE35)
    return ((hi >> 5) * (1 << 26) + (lo >> 6)).to(torch.float64) * (1.0 / (1 << 53))


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs: [B, N] non-negative rows (not necessarily normalised); u: [B] in [0, 1).
    Returns [B] int64 column indices, never one with zero probability.

    The cumulative sum is float64: in fp32 its spacing near 1 (6e-8) swallows the tail
    tokens that come after the bulk of the mass (they could never be drawn: up to ~1e-3 of
    the probability of a 150k vocabulary), which biases the samples against their logprobs."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # [B, N]
    total = cdf[:, -1:]  # [B, 1]
    # Strictly below the total (u * total may round up to it), so the first column with
    # cdf > target exists and is a column where the cdf rises: one with probability > 0.
    target = torch.minimum(u.to(torch.float64).unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    # A row whose logits were not finite has a NaN cdf and finds no column: it gets the last one (a valid
    # index, no host sync here) and its logprob is NaN, which the engine reports (NonFiniteOutputError).
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample_rows(logits: torch.Tensor, params: SamplingParams,
                u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from its own stream.

    logits: [B, V] fp32; u: [B] float64, each row's draw from :func:`counter_uniform` (None
    when greedy). Callers compute the draws of several decode steps in one call: the hash is
    ~170 elementwise ops, each a kernel launch per step on a GPU, more than the rest of
    sampling. Returns
    (tokens [B] int64, logprobs [B] fp32), the logprob being log_softmax(logits / T) of the
    chosen token before top-k/top-p (T = 1 when greedy). top-k runs before the top-p sort,
    so with top_k set only k candidates per row are sorted.
    """
    if params.temperature == 0:
        tokens = torch.argmax(logits, dim=-1)
        scaled = logits
    else:
        if u is None:
            raise ValueError("sampling at temperature > 0 needs each row's draw u")
        # times 1/T, as the trainer's head scales (logits / T rounds differently: ~1e-5 off parity)
        scaled = logits * (1.0 / params.temperature) if params.temperature != 1 else logits
        vocab = scaled.shape[-1]
        k = params.top_k if 0 < params.top_k < vocab else (vocab if params.top_p < 1.0 else 0)
        if k:
            vals, idx = torch.topk(scaled, k, dim=-1)  # [B, k], sorted descending
            probs = torch.softmax(vals, dim=-1)
            if params.top_p < 1.0:  # drop a token when the mass strictly before it reaches top_p
                drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
                drop[:, 0] = False
                probs = probs.masked_fill(drop, 0.0)
            tokens = idx.gather(-1, _inverse_cdf(probs, u).unsqueeze(-1)).squeeze(-1)
        else:
            tokens = _inverse_cdf(torch.softmax(scaled, dim=-1), u)
    logp = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return tokens, logp
