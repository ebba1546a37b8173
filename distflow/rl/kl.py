"""KL estimators between the policy and the reference model, per token.

Why this module exists: GRPO puts a KL term in the loss, PPO/REINFORCE++ subtract it from
the reward, and every framework picks a different Monte-Carlo estimator of
``KL(pi || ref)`` from samples of ``pi``. Schulman's estimators, with
``r = logp - ref_logp = log(pi / ref)`` evaluated at the sampled token:

* ``k1 = r``                         unbiased, high variance, can be negative;
* ``k2 = r^2 / 2``                   biased, low variance, >= 0;
* ``k3 = exp(-r) - 1 + r``           unbiased, >= 0 (GRPO's choice); its gradient in ``log pi``,
  ``1 - exp(-r)``, grows without bound where the policy finds a token far less likely than the
  reference (``-4.9e8`` at ``r = -20``), so by default it is **bounded** (``kl_clamp``, below);
* ``low_var_kl`` = k3 with ``r`` clamped to [-20, 20] and the result clamped to
  [-10, 10] (verl's ``low_var_kl``, which verl also calls ``k3``): bounded under large policy
  drift, but with no gradient where a clamp holds (a token the reference finds over ~11 nats
  less likely than the policy, or the policy over ~2.6 nats less likely than the reference, is
  not pulled back at all).

The bound of k3 (``clamp``, the config's ``kl_clamp``, default 10): where the estimate would
exceed ``clamp`` because the policy is the less likely (``d = -r > 0``), k3 continues along its
tangent at the knee ``d_c`` where ``k3 = clamp`` (``exp(d_c) - d_c - 1 = clamp``; 2.6109 at 10).
Its value stays continuous and grows linearly, and its gradient in ``log pi`` never exceeds
``exp(d_c) - 1 = clamp + d_c`` in size (12.61 at 10), however far the token is: one outlier
token cannot blow up a step, and unlike a clamp it is still pulled back, with that largest
force. The other side (``r > 0``) needs no bound: there k3 tends to ``r - 1`` with gradient
below 1. ``clamp=None`` is the exact k3 up to ``d = 20`` (:data:`LOG_RATIO_CLAMP`, which keeps
``exp`` finite), tangent beyond. Names elsewhere (docs/algorithms.md): verl's ``k3`` and
OpenRLHF's ``k3`` are clamped forms (verl: our ``low_var_kl``; OpenRLHF clamps every
estimator's value to [-10, 10]); our ``k3`` is the unclamped estimator with the tangent bound.

As a loss term only ``log pi`` of the sampled token is differentiated, so what each estimator
optimises in expectation is not always the KL its value estimates: k2's gradient is that of
``KL(pi || ref)``; k3's is that of the reverse ``KL(ref || pi)`` (the usual GRPO behaviour);
k1's is zero (the score function's mean), which is why the config refuses k1 as a loss term.

All take ``logprobs`` and ``ref_logprobs`` of one shape (``[B, T]``) and return that shape
in fp32; gradients flow through ``logprobs`` only (the reference is a constant). Used as a
loss term (``kl_estimator`` + ``kl_coef`` in the policy loss) or as a reward penalty
(:func:`distflow.rl.advantages.token_rewards`, ``kl_in_reward``).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
from torch import Tensor

from distflow.rl.masked import LOG_RATIO_CLAMP, _fp32, _require, _shape

__all__ = ["kl_k1", "kl_k2", "kl_k3", "kl_low_var", "KL_ESTIMATORS", "kl_estimate", "k3_knee", "K3_CLAMP"]

LOW_VAR_KL_CLAMP = 10.0
K3_CLAMP = 10.0  # the default bound of k3 (the config's kl_clamp): verl's and OpenRLHF's clamp level


def _log_ratio(logprobs: Tensor, ref_logprobs: Tensor, name: str) -> Tensor:
    _require(torch.is_tensor(logprobs) and torch.is_tensor(ref_logprobs) and logprobs.shape == ref_logprobs.shape,
             f"{name}: logprobs {_shape(logprobs) if torch.is_tensor(logprobs) else logprobs!r} and ref_logprobs "
             f"{_shape(ref_logprobs) if torch.is_tensor(ref_logprobs) else ref_logprobs!r} must have the same shape")
    return _fp32(logprobs) - _fp32(ref_logprobs).detach()


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = ``logp - ref``. [*S], [*S] -> [*S] fp32 (may be negative)."""
    return _log_ratio(logprobs, ref_logprobs, "kl_k1")


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = ``0.5 * (logp - ref)^2``. [*S], [*S] -> [*S] fp32, >= 0."""
    r = _log_ratio(logprobs, ref_logprobs, "kl_k2")
    return 0.5 * r * r


@functools.lru_cache(maxsize=64)
def k3_knee(clamp: float | None) -> float:
    """The log-ratio ``d_c = log ref - log pi > 0`` where k3 reaches ``clamp``: the root of
    ``exp(d) - d - 1 = clamp`` (2.610869 at 10), at most :data:`LOG_RATIO_CLAMP` (20, also the
    knee of ``clamp=None``). Newton from ``sqrt(2 clamp)``, right of the root (``exp(d) - d - 1 >=
    d^2 / 2`` for ``d >= 0``), where the convex function's iterates fall monotonically onto it."""
    if clamp is None:
        return LOG_RATIO_CLAMP
    _require(isinstance(clamp, (int, float)) and not isinstance(clamp, bool) and clamp > 0,
             f"kl_clamp must be > 0 (or None for the exact k3), got {clamp!r}")
    c = float(clamp)
    if c >= math.expm1(LOG_RATIO_CLAMP) - LOG_RATIO_CLAMP:
        return LOG_RATIO_CLAMP
    d = math.sqrt(2.0 * c)
    for _ in range(100):
        step = (math.expm1(d) - d - c) / math.expm1(d)
        d -= step
        if step <= 1e-15 * d:
            break
    return d


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, clamp: float | None = K3_CLAMP) -> Tensor:
    """k3 = ``exp(d) - d - 1`` with ``d = ref - logp``, bounded by ``clamp``. [*S] -> [*S] fp32, >= 0.

    Up to the knee ``d_c = k3_knee(clamp)`` it is exact, computed as ``expm1(d) - d`` (accurate
    for small ``d``, never below 0); beyond, the tangent there: ``clamp + (clamp + d_c)(d - d_c)``,
    gradient in ``logp`` ``-(clamp + d_c)`` (module docstring). Below, ``exp(d)`` just tends to 0
    and the value grows as ``-d - 1`` with gradient 1: a token the reference finds far less likely
    than the policy is pulled back, not ignored (a clamp at -20 gave it no gradient).
    ``clamp=None``: exact up to ``d = 20``, tangent beyond (the gradient there is ~4.9e8).
    """
    d = -_log_ratio(logprobs, ref_logprobs, "kl_k3")
    knee = k3_knee(clamp)
    dc = torch.clamp(d, max=knee)
    # relu, not clamp(min=0): its gradient at exactly the knee is 0, so the two pieces' sum is the slope once
    return torch.expm1(dc) - dc + math.expm1(knee) * torch.relu(d - knee)


def kl_low_var(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """verl's ``low_var_kl``: k3 clamped to [-10, 10]. [*S] -> [*S] fp32 in [0, 10]."""
    d = torch.clamp(-_log_ratio(logprobs, ref_logprobs, "kl_low_var"), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.clamp(torch.expm1(d) - d, -LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_low_var,
}


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3", *,
                clamp: float | None = K3_CLAMP) -> Tensor:
    """The per-token KL estimate named ``estimator`` (k1 | k2 | k3 | low_var_kl). [*S] -> [*S].
    ``clamp``: k3's bound (:func:`kl_k3`; the config's ``kl_clamp``), unused by the others."""
    fn = KL_ESTIMATORS.get(estimator)
    _require(fn is not None, f"kl_estimator: unknown estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")
    if estimator == "k3":
        return kl_k3(logprobs, ref_logprobs, clamp)
    return fn(logprobs, ref_logprobs)
