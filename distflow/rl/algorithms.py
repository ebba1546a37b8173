"""RL algorithms as pure tensor functions: advantages, KL, the clipped policy loss, GAE, value loss.

Why this module exists: a new algorithm in DistFlow is a new workflow config plus, at
most, one new pure function. Keeping the maths here — no I/O, no ``torch.distributed``,
no transport — makes every formula testable against hand-computed numbers and reusable
by any worker (the rollout group computes group advantages, the trainer computes the
losses). Conventions follow verl's ``core_algos`` and slime's policy loss:

* shapes are written in every signature/docstring: ``B`` samples, ``T`` response tokens,
  ``n`` samples of a flat batch;
* ``mask`` is ``[B, T]``, bool or 0/1 float (a float mask acts as per-token weights);
  masked positions never contribute to a value *or a gradient*, even when they hold
  ``inf``/``NaN`` padding;
* maths is done in (at least) fp32, whatever the input dtype (bf16 logprobs included);
* advantages, old/ref logprobs and returns are treated as constants (detached).

Token-level aggregation and data parallelism
--------------------------------------------
Losses are ``sum(per_token * mask) / token_normalizer``. The default normalizer is the
local ``mask.sum()`` (a token mean over this batch). Under data parallelism the trainer
passes ``token_normalizer = N_global / W`` where ``N_global`` is the number of valid
tokens of the optimizer step summed over all ``W`` data-parallel ranks (and over all
micro-batches, whose losses are then *summed*, not averaged). DDP/FSDP average gradients
over ranks, so the applied gradient is ``(1/W) * sum_r grad(S_r) * W / N_global =
grad(sum_r S_r) / N_global``: exactly the gradient of the token mean over the global
batch, independent of how tokens are spread over ranks and micro-batches.
"""

from __future__ import annotations

import difflib
import functools
import importlib
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

__all__ = [
    "masked_sum", "masked_mean", "masked_whiten", "group_advantages", "rloo_advantages", "kl_k3",
    "policy_loss", "compute_gae", "value_loss", "ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "resolve",
]

LOG_RATIO_CLAMP = 20.0  # |log ratio| bound before exp(): keeps exp() finite in fp32


# ----------------------------------------------------------------------------- helpers
def _fp32(x: Tensor) -> Tensor:
    """Promote to at least fp32 (bf16/fp16/int -> fp32; fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _shape(t: Tensor) -> list[int]:
    return list(t.shape)


def _check_bt(name: str, t: Tensor, like: Tensor | None = None) -> None:
    _require(torch.is_tensor(t), f"{name}: expected a tensor, got {type(t).__name__}")
    if like is None:
        _require(t.dim() == 2, f"{name}: expected shape [B, T], got {_shape(t)}")
    else:
        _require(t.shape == like.shape, f"{name}: expected shape {_shape(like)} (like logprobs), got {_shape(t)}")


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """``x * mask`` in fp32 with masked positions forced to exactly 0 (no NaN/inf leak)."""
    x = _fp32(x)
    try:
        mask = torch.broadcast_to(mask, x.shape)
    except RuntimeError:
        raise ValueError(f"mask of shape {_shape(mask)} does not broadcast to values of shape {_shape(x)}") from None
    zero = x.new_zeros(())
    if mask.dtype == torch.bool:
        return torch.where(mask, x, zero)
    w = mask.to(x.dtype)
    return torch.where(w != 0, x * w, zero)


def _normalizer(token_normalizer: float | Tensor | None, mask: Tensor, like: Tensor) -> Tensor:
    """The divisor of a token-level sum: ``mask.sum()`` by default (1 if the mask is empty)."""
    if token_normalizer is None:
        n = _fp32(mask).sum().to(like.dtype)
        return torch.where(n > 0, n, torch.ones_like(n))
    if torch.is_tensor(token_normalizer):
        _require(token_normalizer.numel() == 1,
                 f"token_normalizer: expected a scalar, got shape {_shape(token_normalizer)}")
        n = token_normalizer.detach().reshape(()).to(device=like.device, dtype=like.dtype)
        if n.device.type == "cpu":  # checked only where it costs no device sync
            _require(bool(n > 0), f"token_normalizer must be > 0, got {float(n)}")
        return n
    _require(isinstance(token_normalizer, (int, float)) and token_normalizer > 0,
             f"token_normalizer must be a positive number or scalar tensor, got {token_normalizer!r}")
    return like.new_tensor(float(token_normalizer))


# ----------------------------------------------------------------------------- masked reductions
def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of ``x * mask`` over ``dim`` (all dims if None), in fp32.

    x: ``[*S]``; mask: bool or float, broadcastable to ``[*S]``. Returns a scalar, or
    ``[*S]`` without ``dim``. Masked positions contribute exactly 0 even if ``x`` is inf/NaN there.
    """
    m = _masked(x, mask)
    return m.sum() if dim is None else m.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None, eps: float = 0.0) -> Tensor:
    """``masked_sum(x, mask, dim) / (mask.sum(dim) + eps)``, in fp32.

    x: ``[*S]``; mask broadcastable to ``[*S]``. Where the mask is empty (count + eps == 0)
    the mean is defined as 0 (never NaN, and no NaN gradient).
    """
    num = masked_sum(x, mask, dim)
    count = _fp32(torch.broadcast_to(mask, x.shape)).to(num.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    denom = count + eps
    empty = denom == 0
    return torch.where(empty, torch.zeros_like(num), num / torch.where(empty, torch.ones_like(denom), denom))


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalize ``x [B, T]`` to zero mean / unit (unbiased) variance over valid tokens; masked -> 0.

    Used by PPO on GAE advantages. With ``shift_mean=False`` the mean is added back.
    Returns ``[B, T]`` fp32; fewer than 2 valid tokens -> centred values, no scaling.
    """
    mean = masked_mean(x, mask)
    count = _fp32(torch.broadcast_to(mask, x.shape)).sum()
    centred = _masked(_fp32(x) - mean, mask)
    var = masked_sum(centred * centred, mask) / torch.clamp(count - 1, min=1.0)
    out = centred * torch.rsqrt(var + eps) if bool(count > 1) else centred
    if not shift_mean:
        out = out + mean
    return _masked(out, mask)


# ----------------------------------------------------------------------------- advantages
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


# ----------------------------------------------------------------------------- KL
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: ``exp(d) - d - 1``, ``d = ref - logp``.

    logprobs, ref_logprobs: same shape (``[B, T]``). Returns that shape, fp32, always >= 0.
    ``d`` is clamped to [-20, 20] so the result stays finite; computed as ``expm1(d) - d``,
    which is accurate for small ``d`` and never rounds below 0.
    """
    _require(torch.is_tensor(logprobs) and torch.is_tensor(ref_logprobs) and logprobs.shape == ref_logprobs.shape,
             f"kl_k3: logprobs {_shape(logprobs)} and ref_logprobs {_shape(ref_logprobs)} must have the same shape")
    d = torch.clamp(_fp32(ref_logprobs) - _fp32(logprobs), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(d) - d


# ----------------------------------------------------------------------------- policy loss
def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    token_normalizer: float | Tensor | None = None,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate loss with token-level aggregation.

    logprobs ``[B, T]`` (requires grad), old_logprobs ``[B, T]``, advantages ``[B]``
    (broadcast over tokens) or ``[B, T]``, mask ``[B, T]``, ref_logprobs ``[B, T]`` or None.

    * ``ratio = exp(logprobs - old_logprobs)`` (log ratio clamped to [-20, 20]);
    * per-token ``pg = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``
      (``clip_high > clip_low`` is DAPO's clip-higher); with ``dual_clip = c > 1``,
      tokens with ``A < 0`` are further bounded by ``-c * A`` (dual-clip PPO);
    * plus ``kl_coef * kl_k3(logprobs, ref_logprobs)`` when ``kl_coef > 0`` (GRPO's KL loss);
    * ``loss = sum(per_token * mask) / token_normalizer`` (default ``mask.sum()``; see the
      module docstring for the data-parallel value the trainer passes).

    Returns ``(loss [], metrics)``; metrics are detached fp32 scalars, all token means over
    *this* batch's valid tokens (whatever ``token_normalizer`` is, so a caller can combine
    micro-batches/ranks by weighting each with its token count): ``pg_loss`` (the clipped
    surrogate), ``kl`` (k3 vs reference; 0 without one), ``clip_frac`` (tokens where the
    clipped branch is active), ``ratio_mean``, ``approx_kl`` (k3 of old vs new,
    ``ratio - 1 - log ratio``); plus ``dual_clip_frac`` when ``dual_clip`` is set. With the
    default normalizer, ``loss == pg_loss + kl_coef * kl``.
    """
    _check_bt("logprobs", logprobs)
    _check_bt("old_logprobs", old_logprobs, logprobs)
    _check_bt("mask", mask, logprobs)
    _require(torch.is_tensor(advantages), f"advantages: expected a tensor, got {type(advantages).__name__}")
    b = logprobs.shape[0]
    _require(tuple(advantages.shape) in ((b,), tuple(logprobs.shape)),
             f"advantages: expected shape [{b}] or {_shape(logprobs)}, got {_shape(advantages)}")
    _require(0.0 <= clip_low < 1.0, f"clip_low must be in [0, 1), got {clip_low}")
    _require(clip_high >= 0.0, f"clip_high must be >= 0, got {clip_high}")
    _require(kl_coef >= 0.0, f"kl_coef must be >= 0, got {kl_coef}")
    _require(dual_clip is None or dual_clip > 1.0, f"dual_clip must be > 1 (or None), got {dual_clip}")
    if kl_coef > 0:
        _require(ref_logprobs is not None, f"kl_coef={kl_coef} needs ref_logprobs (a reference node in the workflow)")
    if ref_logprobs is not None:
        _check_bt("ref_logprobs", ref_logprobs, logprobs)

    valid = mask != 0
    lp = _fp32(logprobs)
    zero = lp.new_zeros(())
    log_ratio = torch.where(valid, lp - _fp32(old_logprobs).detach(), zero)
    log_ratio = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = _fp32(advantages).detach()
    adv = torch.where(valid, adv.unsqueeze(1) if adv.dim() == 1 else adv, zero)

    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    metrics_extra: dict[str, Tensor] = {}
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual = (adv < 0) & (bound < pg)
        pg = torch.where(dual, bound, pg)
        metrics_extra["dual_clip_frac"] = masked_mean(dual.to(lp.dtype), mask).detach()

    norm = _normalizer(token_normalizer, mask, lp)
    per_token = pg
    if ref_logprobs is not None:
        kl = kl_k3(torch.where(valid, lp, zero), torch.where(valid, _fp32(ref_logprobs).detach(), zero))
        if kl_coef > 0:
            per_token = pg + kl_coef * kl
        kl_metric = masked_mean(kl, mask)
    else:
        kl_metric = lp.new_zeros(())
    loss = masked_sum(per_token, mask) / norm

    with torch.no_grad():
        metrics = {
            "pg_loss": masked_mean(pg, mask),
            "kl": kl_metric.detach(),
            "clip_frac": masked_mean(clipped.to(lp.dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            **metrics_extra,
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


# ----------------------------------------------------------------------------- PPO: GAE and value loss
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


# ----------------------------------------------------------------------------- registries
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    # outcome estimators: fn(rewards [n], group_ids [n], **node.args) -> advantages [n]
    "grpo": group_advantages,
    "dr_grpo": functools.partial(group_advantages, norm_std=False),
    "rloo": rloo_advantages,
}

POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    # fn(logprobs, old_logprobs, advantages, mask, **kwargs) -> (loss, metrics)
    "grpo": policy_loss,  # clipped surrogate, token-level aggregation, optional k3 KL loss
    "ppo": policy_loss,  # same clipped surrogate; PPO's advantages come from GAE
}


def resolve(registry: Mapping[str, Callable[..., Any]], name: str, what: str) -> Callable[..., Any]:
    """Look ``name`` up in ``registry``, or import a dotted ``"package.module:function"``.

    ``what`` describes the thing being resolved (e.g. ``"workflow node 'update' policy
    loss"``) and leads every error message, which also names ``name`` and lists the known
    names. Dotted names import code named by the (trusted, local) config file.
    """
    known = ", ".join(sorted(registry)) or "(none)"
    hint = f"known: {known}; or a dotted 'package.module:function'"
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{what}: expected a non-empty name, got {name!r} ({hint})")
    if name in registry:
        return registry[name]
    if ":" not in name:
        close = difflib.get_close_matches(name, list(registry), n=1)
        suggestion = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{what}: unknown name {name!r}{suggestion}; {hint}")
    module_name, _, attr_path = name.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"{what}: {name!r} is not of the form 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what}: cannot import module {module_name!r} for {name!r}: {e}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{what}: {name!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise ValueError(f"{what}: {name!r} is a {type(obj).__name__}, not a callable")
    return obj
