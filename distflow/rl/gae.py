"""PPO's critic side: generalized advantage estimation and the clipped value loss.

Why this module exists: PPO's advantages come from a learned value function. GAE turns
per-token rewards (outcome on the last token, optional KL penalty:
:func:`distflow.rl.advantages.token_rewards`) and the critic's values into advantages and
returns; the critic is trained on those returns with a clipped squared error. Pure tensor
functions, ``[B, T]`` over response tokens, masked positions exactly 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from distflow.rl.masked import _check_bt, _fp32, _masked, _normalizer, _require, masked_mean, masked_sum

__all__ = ["compute_gae", "value_loss"]


@torch.no_grad()
def compute_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over response tokens.

    rewards, values, mask: ``[B, T]`` (the outcome reward usually sits on the last valid
    token). Returns ``(advantages [B, T], returns [B, T])`` fp32, detached, with
    ``returns = advantages + values`` and masked positions exactly 0. Masked positions —
    trailing padding or interior (e.g. tool-output) tokens — are skipped: the recursion
    ``A_t = delta_t + gamma * lam * A_next``, ``delta_t = r_t + gamma * V_next - V_t`` jumps
    over them to the next valid token; past the last valid token ``V = 0``.
    """
    _check_bt("rewards", rewards)
    _check_bt("values", values, rewards)
    _check_bt("mask", mask, rewards)
    _require(0.0 <= gamma <= 1.0, f"gamma must be in [0, 1], got {gamma}")
    _require(0.0 <= lam <= 1.0, f"lam must be in [0, 1], got {lam}")
    valid = mask != 0
    r = _masked(rewards, valid)
    v = _masked(values, valid)
    b, t_len = r.shape
    next_value = r.new_zeros(b)
    last_adv = r.new_zeros(b)
    adv = torch.zeros_like(r)
    for t in reversed(range(t_len)):
        m = valid[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * last_adv
        adv[:, t] = torch.where(m, a_t, 0.0)
        last_adv = torch.where(m, a_t, last_adv)
        next_value = torch.where(m, v[:, t], next_value)
    returns = torch.where(valid, adv + v, 0.0)
    return adv, returns


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None = 0.2,
    token_normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped critic loss: ``0.5 * max((v - R)^2, (clip(v, old - c, old + c) - R)^2)``.

    values ``[B, T]`` (requires grad), old_values, returns, mask ``[B, T]``; ``clip=None``
    gives the plain squared error. Token-level aggregation as in :func:`policy_loss`.
    Returns ``(loss [], metrics)`` with detached scalars, token means over this batch's valid
    tokens: ``vf_loss`` (the per-token loss), ``vf_clip_frac`` (tokens where the clipped
    branch is the larger) and ``value_mean``.
    """
    _check_bt("values", values)
    _check_bt("old_values", old_values, values)
    _check_bt("returns", returns, values)
    _check_bt("mask", mask, values)
    _require(clip is None or clip > 0, f"value clip must be > 0 (or None), got {clip}")
    valid = mask != 0
    v = torch.where(valid, _fp32(values), 0.0)
    old = _masked(old_values.detach(), valid)
    ret = _masked(returns.detach(), valid)
    err = (v - ret) ** 2
    if clip is None:
        per_token = 0.5 * err
        clipped = torch.zeros_like(valid)
    else:
        v_clipped = old + torch.clamp(v - old, -clip, clip)
        err_clipped = (v_clipped - ret) ** 2
        per_token = 0.5 * torch.maximum(err, err_clipped)
        clipped = err_clipped > err
    loss = masked_sum(per_token, mask) / _normalizer(token_normalizer, mask, v)
    with torch.no_grad():
        metrics = {
            "vf_loss": masked_mean(per_token, mask),
            "vf_clip_frac": masked_mean(clipped.to(v.dtype), mask),
            "value_mean": masked_mean(v, mask),
        }
    return loss, metrics
