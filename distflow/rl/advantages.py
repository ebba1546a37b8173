"""Advantage estimators and reward shaping: pure tensor functions, no I/O.

Why this module exists: an algorithm's advantage is one registered function (a config
names it, ``fn: grpo``), so each estimator lives here, testable against hand-computed
numbers. Outcome estimators share one signature, ``fn(rewards [n], group_ids [n], **args)
-> advantages [n]`` (samples of one prompt share a group id; groups need not be contiguous
nor equal in size). Token-level helpers (``[B, T]``) cover per-token rewards with a KL
penalty and REINFORCE++'s discounted, globally whitened returns. Shaping helpers: DAPO's
dynamic-sampling filter (:func:`nonconstant_groups`) and soft overlong punishment
(:func:`overlong_penalty`).

Statistics are computed in fp64; results are fp32 and detached.
"""

from __future__ import annotations

import torch
from torch import Tensor

from distflow.rl.masked import _check_bt, _fp32, _masked, _require, _shape, masked_whiten

__all__ = [
    "group_advantages", "rloo_advantages", "reinforce_pp_advantages", "reinforce_pp_baseline_advantages",
    "nonconstant_groups", "overlong_penalty", "token_rewards", "discounted_returns",
    "reinforce_pp_token_advantages",
]


def _check_groups(rewards: Tensor, group_ids: Tensor) -> None:
    _require(torch.is_tensor(rewards) and rewards.dim() == 1,
             f"rewards: expected a 1-D tensor [n], got {_shape(rewards) if torch.is_tensor(rewards) else rewards!r}")
    _require(torch.is_tensor(group_ids) and group_ids.dim() == 1 and group_ids.shape == rewards.shape,
             f"group_ids: expected an int tensor of shape {_shape(rewards)} (like rewards), got "
             f"{_shape(group_ids) if torch.is_tensor(group_ids) else group_ids!r}")
    _require(not group_ids.is_floating_point() and not group_ids.is_complex() and group_ids.dtype != torch.bool,
             f"group_ids: expected an integer dtype, got {group_ids.dtype}")
    bad = (~torch.isfinite(rewards)).nonzero().flatten()
    _require(len(bad) == 0, f"rewards: non-finite values (NaN/inf) at indices {bad[:10].tolist()}")


def _group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """rewards [n], group_ids [n] -> (r fp64 [n], group index [n] in [0, G), count [G], reward sum [G])."""
    r = rewards.detach().to(torch.float64)
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, inv, torch.ones_like(r))
    total = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, inv, r)
    return r, inv, count, total


def _constant_group(r: Tensor, inv: Tensor, g: int) -> Tensor:
    """[n] bool: the sample's group has all-equal rewards (singletons included)."""
    hi = torch.full((g,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amax")
    lo = torch.full((g,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amin")
    return (hi == lo)[inv]


def group_advantages(rewards: Tensor, group_ids: Tensor, *, norm_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantages: each sample's reward relative to its prompt group.

    rewards: ``[n]`` float; group_ids: ``[n]`` int (samples of one prompt share an id; groups
    need not be contiguous nor of equal size). Returns ``[n]`` fp32, detached:
    ``A_i = (r_i - mean_g) / (std_g + eps)`` with the *unbiased* std (as GRPO/verl), or
    ``r_i - mean_g`` when ``norm_std=False`` (Dr. GRPO). A group whose rewards are all equal —
    in particular a group of one — gets exactly 0 (no NaN, no eps noise).
    Statistics are computed in fp64.
    """
    _check_groups(rewards, group_ids)
    _require(eps >= 0, f"eps must be >= 0, got {eps}")
    r, inv, count, total = _group_stats(rewards, group_ids)
    dev = r - (total / count)[inv]
    if norm_std:
        sq = torch.zeros_like(count).index_add_(0, inv, dev * dev)
        std = torch.sqrt(sq / torch.clamp(count - 1, min=1.0))
        denom = std[inv] + eps
        adv = dev / torch.where(denom > 0, denom, torch.ones_like(denom))
    else:
        adv = dev
    adv = torch.where(_constant_group(r, inv, count.numel()), torch.zeros_like(adv), adv)
    return adv.to(torch.float32)


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO: reward minus the mean reward of the *other* samples of its group.

    rewards ``[n]`` float, group_ids ``[n]`` int -> ``[n]`` fp32, detached.
    ``A_i = r_i - (sum_g - r_i) / (n_g - 1)``; a group of one (no baseline) gets 0.
    """
    _check_groups(rewards, group_ids)
    r, inv, count, total = _group_stats(rewards, group_ids)
    c = count[inv]
    adv = r - (total[inv] - r) / torch.clamp(c - 1, min=1.0)
    adv = torch.where(_constant_group(r, inv, count.numel()), torch.zeros_like(adv), adv)
    return adv.to(torch.float32)


def _whiten_flat(x: Tensor, eps: float, weights: Tensor | None = None) -> Tensor:
    """[n] fp64 -> [n]: zero mean, unit unbiased std over the whole batch (n < 2 or std 0 -> centred).

    ``weights`` [n] (a sample's token count): the statistics are those of every token of the
    batch, each carrying its sample's value (mean sum(w x) / sum(w), variance
    sum(w (x - mean)^2) / (sum(w) - 1)), as a masked whitening of the value tiled over each
    response; a sample with no token weighs nothing."""
    if x.numel() == 0:
        return x
    if weights is None:
        weights = torch.ones_like(x)
    total = weights.sum()
    if not bool(total > 0):
        return torch.zeros_like(x)
    centred = x - (weights * x).sum() / total
    if not bool(total > 1):
        return centred
    std = (weights * centred.pow(2)).sum().div(total - 1).sqrt()
    return centred / (std + eps) if bool(std > 0) else centred


def _token_weights(token_counts: Tensor | None, like: Tensor) -> Tensor | None:
    if token_counts is None:
        return None
    _require(torch.is_tensor(token_counts) and token_counts.shape == like.shape,
             f"token_counts: expected a tensor of shape {_shape(like)} (like rewards), got "
             f"{_shape(token_counts) if torch.is_tensor(token_counts) else token_counts!r}")
    _require(bool((token_counts >= 0).all()), "token_counts: expected non-negative counts")
    return token_counts.detach().to(device=like.device, dtype=torch.float64)


def reinforce_pp_advantages(rewards: Tensor, group_ids: Tensor, *, token_counts: Tensor | None = None,
                            eps: float = 1e-6) -> Tensor:
    """REINFORCE++ (outcome rewards): the reward whitened over the whole batch, no per-group baseline.

    rewards ``[n]``, group_ids ``[n]`` (ignored except for checks), token_counts ``[n]`` (each
    sample's response length) -> ``[n]`` fp32: ``A_i = (r_i - mean) / (std + eps)``, mean and
    unbiased std over every response TOKEN of the batch (each sample's reward counted once per
    token, as REINFORCE++'s reference implementations whiten the reward tiled over the response
    mask: OpenRLHF, verl). Without ``token_counts`` each sample counts once. "Global-batch
    normalisation": the batch the stage sees; on a rollout node that is the node's step batch.
    A constant batch gets 0.
    """
    _check_groups(rewards, group_ids)
    r = rewards.detach().to(torch.float64)
    return _whiten_flat(r, eps, _token_weights(token_counts, r)).to(torch.float32)


def reinforce_pp_baseline_advantages(rewards: Tensor, group_ids: Tensor, *, token_counts: Tensor | None = None,
                                     eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline: subtract the group mean, then whiten over the whole batch.

    rewards ``[n]``, group_ids ``[n]``, token_counts ``[n]`` -> ``[n]`` fp32. ``d_i = r_i - mean_g``
    (the mean over the group's samples), then ``A = (d - mean(d)) / (std(d) + eps)`` over every
    response token of the batch (unbiased std; each sample once without ``token_counts``), as in
    :func:`reinforce_pp_advantages`. All-constant groups give 0 everywhere.
    """
    _check_groups(rewards, group_ids)
    r, inv, count, total = _group_stats(rewards, group_ids)
    dev = r - (total / count)[inv]
    return _whiten_flat(dev, eps, _token_weights(token_counts, r)).to(torch.float32)


def nonconstant_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """DAPO dynamic sampling: which samples to keep.

    rewards ``[n]``, group_ids ``[n]`` -> ``[n]`` bool, False for every sample of a group whose
    rewards are all equal (all right or all wrong: zero advantage, no learning signal),
    singletons included.
    """
    _check_groups(rewards, group_ids)
    r, inv, count, _ = _group_stats(rewards, group_ids)
    return ~_constant_group(r, inv, count.numel())


def overlong_penalty(response_lens: Tensor, max_len: int, buffer: int) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward.

    response_lens ``[n]`` int -> ``[n]`` fp32: 0 for ``len <= max_len - buffer``, a linear ramp
    ``(max_len - buffer - len) / buffer`` down to -1 at ``len == max_len``, and -1 beyond.
    ``buffer == 0`` gives no ramp (0 up to ``max_len``, -1 beyond).
    """
    _require(torch.is_tensor(response_lens) and response_lens.dim() == 1,
             f"response_lens: expected a 1-D tensor [n], got {response_lens!r}")
    _require(isinstance(max_len, int) and max_len >= 1, f"max_len must be an int >= 1, got {max_len!r}")
    _require(isinstance(buffer, int) and 0 <= buffer <= max_len,
             f"overlong_buffer must be an int in [0, max_len={max_len}], got {buffer!r}")
    n = response_lens.to(torch.float64)
    start = float(max_len - buffer)
    ramp = (start - n) / buffer if buffer else torch.zeros_like(n)
    out = torch.where(n <= start, torch.zeros_like(n), torch.where(n <= max_len, ramp, -torch.ones_like(n)))
    return out.to(torch.float32)


def token_rewards(outcome: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards: the outcome reward on the last valid response token, minus a KL penalty.

    outcome ``[B]``, mask ``[B, T]``, kl ``[B, T]`` (a per-token estimate, see
    :mod:`distflow.rl.kl`) or None -> ``[B, T]`` fp32: ``r_t = -kl_coef * kl_t`` on valid tokens,
    plus ``outcome`` on the last valid token; masked positions 0. A sample with no valid
    token gets no reward.
    """
    _check_bt("mask", mask)
    _require(torch.is_tensor(outcome) and tuple(outcome.shape) == (mask.shape[0],),
             f"outcome: expected shape [{mask.shape[0]}], got "
             f"{_shape(outcome) if torch.is_tensor(outcome) else outcome!r}")
    _require(kl_coef >= 0, f"kl_coef must be >= 0, got {kl_coef}")
    valid = mask != 0
    b, t = valid.shape
    pos = torch.arange(t, device=valid.device).expand(b, t)
    last = (torch.where(valid, pos, torch.full_like(pos, -1)).max(dim=1).values if t  # [B], -1 if empty
            else torch.full((b,), -1, dtype=torch.long, device=valid.device))
    out = torch.zeros((b, t), dtype=torch.float32, device=valid.device)
    if kl is not None and kl_coef > 0:
        _check_bt("kl", kl, out)
        out = out - kl_coef * _masked(kl.detach(), valid).to(torch.float32)
    has = last >= 0
    rows = torch.arange(b, device=valid.device)[has]
    out[rows, last[has]] += _fp32(outcome.detach()).to(torch.float32)[has]
    return _masked(out, valid).to(torch.float32)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` over valid tokens (masked ones skipped). [B, T] -> [B, T] fp32."""
    _check_bt("rewards", rewards)
    _check_bt("mask", mask, rewards)
    _require(0.0 <= gamma <= 1.0, f"gamma must be in [0, 1], got {gamma}")
    valid = mask != 0
    r = _masked(rewards.detach(), valid).to(torch.float32)
    out = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        running = torch.where(valid[:, t], r[:, t] + gamma * running, running)
        out[:, t] = torch.where(valid[:, t], running, 0.0)
    return out


def reinforce_pp_token_advantages(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ with per-token rewards (e.g. KL in reward): discounted returns whitened over
    every valid token of the batch. rewards, mask ``[B, T]`` -> ``[B, T]`` fp32, masked 0."""
    return masked_whiten(discounted_returns(rewards, mask, gamma), mask)
