"""Policy losses: PPO/GRPO clipped surrogate, GSPO, CISPO; loss aggregation, TIS, entropy bonus.

Why this module exists: the policy losses of the modern algorithm set differ in a few
lines (where the ratio is taken, what is clipped, what is stop-gradient), and share the
rest: the KL term, the entropy bonus, truncated importance sampling and the aggregation
of per-token losses into one scalar. Those shared parts live here once
(:func:`finish_loss`), so a new loss is one short pure function registered by name.

Shapes: ``logprobs``, ``old_logprobs``, ``mask`` ``[B, T]``; ``advantages`` ``[B]`` or
``[B, T]``. ``old_logprobs`` is the *proximal* policy (the engine's logprobs, or the
trainer's recomputation with ``recompute_old_logprobs``); ``behaviour_logprobs`` the
policy that actually sampled (the engine's). Every loss returns ``(loss [], metrics)``
with detached fp32 scalar metrics, token means over this batch's valid tokens.

Loss aggregation (``loss_agg``) and data parallelism
----------------------------------------------------
* ``token-mean``: ``sum(l * m) / token_normalizer`` (default: local valid tokens). The
  trainer passes ``N_global / W`` so the FSDP-averaged gradient is the token mean of the
  whole step over ranks and micro-batches (see :mod:`distflow.rl.masked`).
* ``seq-mean-token-sum``: ``sum_i sum_t l_it m_it / seq_normalizer``.
* ``seq-mean-token-mean``: ``sum_i mean_t(l_i) / seq_normalizer``.
* ``seq-mean-token-sum-norm`` (Dr. GRPO): ``sum(l * m) / (seq_normalizer * norm_constant)``
  with a constant ``norm_constant`` (the generation budget, ``max_new_tokens``).
``seq_normalizer`` defaults to the local count of sequences with a valid token; under data
parallelism the trainer passes ``S_global / W`` for the same reason as tokens.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from distflow.rl.kl import K3_CLAMP, kl_estimate
from distflow.rl.masked import (LOG_RATIO_CLAMP, _check_bt, _fp32, _masked, _normalizer, _require, _shape,
                                masked_mean, masked_sum)

__all__ = [
    "LOSS_AGGREGATIONS", "aggregate_loss", "tis_weights", "entropy_from_logits", "finish_loss",
    "policy_loss", "gspo_loss", "cispo_loss",
]

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------- aggregation
def aggregate_loss(per_token: Tensor, mask: Tensor, loss_agg: str = "token-mean", *,
                   token_normalizer: float | Tensor | None = None, seq_normalizer: float | Tensor | None = None,
                   norm_constant: float | None = None) -> Tensor:
    """Reduce per-token losses ``[B, T]`` (mask ``[B, T]``) to a scalar by ``loss_agg`` (module docstring)."""
    _check_bt("per_token", per_token)
    _check_bt("mask", mask, per_token)
    x = _fp32(per_token)
    if loss_agg == "token-mean":
        return masked_sum(x, mask) / _normalizer(token_normalizer, mask, x)
    _require(loss_agg in LOSS_AGGREGATIONS,
             f"loss_agg: unknown aggregation {loss_agg!r}; known: {', '.join(LOSS_AGGREGATIONS)}")
    has = (_fp32(mask) != 0).any(dim=1)
    seqs = _normalizer(seq_normalizer, has, x) if seq_normalizer is not None else \
        torch.clamp(has.to(x.dtype).sum(), min=1.0)
    if loss_agg == "seq-mean-token-sum":
        return masked_sum(x, mask, dim=1).sum() / seqs
    if loss_agg == "seq-mean-token-mean":
        return masked_mean(x, mask, dim=1).sum() / seqs
    _require(norm_constant is not None and norm_constant > 0,
             f"loss_agg {loss_agg!r} needs a positive norm_constant (max_new_tokens), got {norm_constant!r}")
    return masked_sum(x, mask) / (seqs * float(norm_constant))


# ----------------------------------------------------------------------------- shared pieces
def tis_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Truncated importance-sampling weights between the behaviour and the proximal policy.

    old_logprobs (proximal), behaviour_logprobs (the sampler's), mask: ``[B, T]``. Returns
    ``(w [B, T], capped [B, T] bool)`` with ``w = min(exp(old - behaviour), cap)``, detached,
    1 on masked positions; ``capped`` marks valid tokens where the cap was hit.
    """
    _check_bt("old_logprobs", old_logprobs)
    _check_bt("behaviour_logprobs", behaviour_logprobs, old_logprobs)
    _check_bt("mask", mask, old_logprobs)
    _require(cap is not None and cap > 0, f"tis_cap must be > 0, got {cap!r}")
    valid = mask != 0
    d = torch.where(valid, _fp32(old_logprobs).detach() - _fp32(behaviour_logprobs).detach(), 0.0)
    raw = torch.exp(torch.clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    capped = valid & (raw > cap)
    return torch.where(valid, torch.clamp(raw, max=float(cap)), torch.ones_like(raw)), capped


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-position entropy of ``softmax(logits)``: ``[*S, V] -> [*S]`` fp32, differentiable."""
    x = _fp32(logits)
    logp = torch.log_softmax(x, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def _check_common(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                  clip_low: float, clip_high: float) -> Tensor:
    """Validate the shared inputs; returns advantages as ``[B, T]`` fp32 (masked 0)."""
    _check_bt("logprobs", logprobs)
    _check_bt("old_logprobs", old_logprobs, logprobs)
    _check_bt("mask", mask, logprobs)
    _require(torch.is_tensor(advantages), f"advantages: expected a tensor, got {type(advantages).__name__}")
    b = logprobs.shape[0]
    _require(tuple(advantages.shape) in ((b,), tuple(logprobs.shape)),
             f"advantages: expected shape [{b}] or {_shape(logprobs)}, got {_shape(advantages)}")
    _require(0.0 <= clip_low < 1.0, f"clip_low must be in [0, 1), got {clip_low}")
    _require(clip_high >= 0.0, f"clip_high must be >= 0, got {clip_high}")
    adv = _fp32(advantages).detach()
    return torch.where(mask != 0, adv.unsqueeze(1) if adv.dim() == 1 else adv, _fp32(logprobs).new_zeros(()))


def finish_loss(pg: Tensor, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, metrics: dict[str, Tensor], *,
                ref_logprobs: Tensor | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
                kl_clamp: float | None = K3_CLAMP, entropy: Tensor | None = None, entropy_coef: float = 0.0,
                behaviour_logprobs: Tensor | None = None, tis_cap: float | None = None,
                loss_agg: str = "token-mean", token_normalizer: float | Tensor | None = None,
                seq_normalizer: float | Tensor | None = None, norm_constant: float | None = None,
                ) -> tuple[Tensor, dict[str, Tensor]]:
    """Add the shared terms to a per-token policy-gradient loss ``pg [B, T]`` and aggregate.

    ``per_token = tis_w * pg + kl_coef * KL(kl_estimator) - entropy_coef * entropy`` where
    ``tis_w`` are :func:`tis_weights` (when ``tis_cap`` and ``behaviour_logprobs`` are given),
    KL is against ``ref_logprobs`` (``kl_clamp``: k3's bound, :func:`distflow.rl.kl.kl_k3`) and
    ``entropy`` is ``[B, T]`` from the trainer. Adds the
    metrics ``pg_loss``, ``kl``, ``entropy``, ``tis_weight_mean``, ``tis_clip_frac`` (when used).
    """
    _require(kl_coef >= 0.0, f"kl_coef must be >= 0, got {kl_coef}")
    _require(entropy_coef >= 0.0, f"entropy_coef must be >= 0, got {entropy_coef}")
    if kl_coef > 0:
        _require(ref_logprobs is not None, f"kl_coef={kl_coef} needs ref_logprobs (a reference node in the workflow)")
    valid = mask != 0
    lp = _fp32(logprobs)
    zero = lp.new_zeros(())
    per_token = pg
    out = dict(metrics)
    out["pg_loss"] = masked_mean(pg, mask)
    if tis_cap is not None and behaviour_logprobs is not None:
        w, capped = tis_weights(old_logprobs, behaviour_logprobs, mask, tis_cap)
        per_token = per_token * w
        out["tis_weight_mean"] = masked_mean(w, mask)
        out["tis_clip_frac"] = masked_mean(capped.to(lp.dtype), mask)
    if ref_logprobs is not None:
        _check_bt("ref_logprobs", ref_logprobs, logprobs)
        kl = kl_estimate(torch.where(valid, lp, zero), torch.where(valid, _fp32(ref_logprobs).detach(), zero),
                         kl_estimator, clamp=kl_clamp)
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
        out["kl"] = masked_mean(kl, mask)
    else:
        out["kl"] = lp.new_zeros(())
    if entropy is not None:
        _check_bt("entropy", entropy, logprobs)
        if entropy_coef > 0:
            per_token = per_token - entropy_coef * _masked(entropy, valid)
        out["entropy"] = masked_mean(entropy, mask)
    loss = aggregate_loss(per_token, mask, loss_agg, token_normalizer=token_normalizer,
                          seq_normalizer=seq_normalizer, norm_constant=norm_constant)
    return loss, {k: v.detach() for k, v in out.items()}


def _token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    valid = mask != 0
    lp = _fp32(logprobs)
    d = torch.where(valid, lp - _fp32(old_logprobs).detach(), lp.new_zeros(()))
    return torch.clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


# ----------------------------------------------------------------------------- losses
def _clipped_surrogate(adv: Tensor, ratio: Tensor, log_ratio: Tensor, mask: Tensor, clip_low: float,
                       clip_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate, shared by the token-level (PPO/GRPO) and sequence-level (GSPO)
    losses. All [B, T]: adv, ratio, log_ratio (for the approx-KL metric), mask. Returns
    (per-token loss [B, T] = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), metrics:
    clip_frac, ratio_mean, approx_kl)."""
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    with torch.no_grad():
        metrics = {"clip_frac": masked_mean((pg_clipped > pg_unclipped).to(ratio.dtype), mask),
                   "ratio_mean": masked_mean(ratio, mask),
                   "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask)}
    return pg, metrics


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                **shared: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate (token-level ratio).

    ``ratio = exp(logprobs - old_logprobs)`` (log ratio clamped to [-20, 20]); per token
    ``pg = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)`` (``clip_high >
    clip_low`` is DAPO's clip-higher); with ``dual_clip = c > 1`` tokens with ``A < 0`` are
    further bounded by ``-c * A``. ``shared`` are :func:`finish_loss`'s keywords (KL, entropy,
    TIS, aggregation). With the defaults, ``loss == pg_loss + kl_coef * kl``.
    Metrics: ``pg_loss``, ``kl``, ``clip_frac``, ``ratio_mean``, ``approx_kl`` (k3 of old vs
    new), ``dual_clip_frac`` (with ``dual_clip``), plus :func:`finish_loss`'s.
    """
    adv = _check_common(logprobs, old_logprobs, advantages, mask, clip_low, clip_high)
    _require(dual_clip is None or dual_clip > 1.0, f"dual_clip must be > 1 (or None), got {dual_clip}")
    log_ratio = _token_log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(log_ratio)
    pg, metrics = _clipped_surrogate(adv, ratio, log_ratio, mask, clip_low, clip_high)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual = (adv < 0) & (bound < pg)
        pg = torch.where(dual, bound, pg)
        metrics["dual_clip_frac"] = masked_mean(dual.to(ratio.dtype), mask).detach()
    return finish_loss(pg, logprobs, old_logprobs, mask, metrics, **shared)


def gspo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
              clip_low: float = 3e-4, clip_high: float = 4e-4, **shared: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: a sequence-level ratio and sequence-level clipping.

    ``s_i = exp(mean_t(logprobs - old_logprobs))`` over sample i's valid tokens; per token
    ``pg = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)`` where the token's
    ratio is ``sg(s_i) * pi / sg(pi)`` (GSPO-token form: value ``s_i``, gradient
    ``s_i * grad log pi``), so with ``loss_agg: seq-mean-token-mean`` the gradient is exactly
    GSPO's ``grad s_i``. Advantages must be per sample ``[B]`` (or constant per row).
    Metrics as :func:`policy_loss`; ``clip_frac`` counts tokens of clipped sequences and
    ``ratio_mean`` is the token-weighted mean of ``s_i``.
    """
    adv = _check_common(logprobs, old_logprobs, advantages, mask, clip_low, clip_high)
    log_ratio = _token_log_ratio(logprobs, old_logprobs, mask)
    seq_log = masked_mean(log_ratio, mask, dim=1).detach()  # [B]
    lp = _fp32(logprobs)
    tok_log = seq_log.unsqueeze(1) + lp - lp.detach()
    ratio = torch.exp(torch.clamp(tok_log, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    ratio = torch.where(mask != 0, ratio, torch.ones_like(ratio))
    pg, metrics = _clipped_surrogate(adv, ratio, log_ratio, mask, clip_low, clip_high)
    return finish_loss(pg, logprobs, old_logprobs, mask, metrics, **shared)


def cispo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
               clip_low: float = 0.2, clip_high: float = 0.2, **shared: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE weighted by a clipped, stop-gradient importance weight.

    per token ``pg = -sg(min(ratio, 1 + clip_high)) * A * logprobs``: every token keeps its
    gradient (none is dropped by clipping, unlike PPO); only the weight is bounded. As in the
    CISPO paper there is no lower bound on the weight: ``clip_low`` is accepted for a common
    signature (the trainer passes it to every loss) and not used, and the config refuses a
    ``clip_low`` set with ``cispo`` (:data:`distflow.rl.names.POLICY_LOSS_KEYS`). Metrics:
    ``clip_frac`` (tokens whose weight hit the bound), ``ratio_mean``, ``approx_kl``, plus
    :func:`finish_loss`'s.
    """
    adv = _check_common(logprobs, old_logprobs, advantages, mask, clip_low, clip_high)
    log_ratio = _token_log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=1.0 + clip_high).detach()
    lp = torch.where(mask != 0, _fp32(logprobs), _fp32(logprobs).new_zeros(()))
    pg = -weight * adv * lp
    with torch.no_grad():
        metrics = {"clip_frac": masked_mean((ratio > 1.0 + clip_high).to(ratio.dtype), mask),
                   "ratio_mean": masked_mean(ratio, mask),
                   "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask)}
    return finish_loss(pg, logprobs, old_logprobs, mask, metrics, **shared)


LossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
