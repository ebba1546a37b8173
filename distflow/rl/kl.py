"""KL estimators between the policy and the reference model, per token.

Why this module exists: GRPO puts a KL term in the loss, PPO/REINFORCE++ subtract it from
the reward, and every framework picks a different Monte-Carlo estimator of
``KL(pi || ref)`` from samples of ``pi``. Schulman's estimators, with
``r = logp - ref_logp = log(pi / ref)`` evaluated at the sampled token:

* ``k1 = r``                         unbiased, high variance, can be negative;
* ``k2 = r^2 / 2``                   biased, low variance, >= 0;
* ``k3 = exp(-r) - 1 + r``           unbiased, >= 0 (GRPO's choice);
* ``low_var_kl`` = k3 with ``r`` clamped to [-20, 20] and the result clamped to
  [-10, 10] (verl's ``low_var_kl``): bounded under large policy drift, but with no gradient
  where a clamp holds (a token the reference finds over ~11 nats less likely than the policy
  is not pulled back at all).

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

from typing import Callable

import torch
from torch import Tensor

from distflow.rl.masked import LOG_RATIO_CLAMP, _fp32, _require, _shape

__all__ = ["kl_k1", "kl_k2", "kl_k3", "kl_low_var", "KL_ESTIMATORS", "kl_estimate"]

LOW_VAR_KL_CLAMP = 10.0


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


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = ``exp(d) - d - 1`` with ``d = ref - logp`` (at most 20). [*S] -> [*S] fp32, >= 0.

    Computed as ``expm1(d) - d``: accurate for small ``d`` and never rounds below 0. Only the
    top is clamped, so ``exp`` stays finite; below, ``exp(d)`` just tends to 0 and the value
    grows as ``-d - 1`` with gradient 1: a token the reference finds far less likely than the
    policy is pulled back hardest, not ignored (a clamp at -20 gave it no gradient).
    """
    d = torch.clamp(-_log_ratio(logprobs, ref_logprobs, "kl_k3"), max=LOG_RATIO_CLAMP)
    return torch.expm1(d) - d


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


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """The per-token KL estimate named ``estimator`` (k1 | k2 | k3 | low_var_kl). [*S] -> [*S]."""
    fn = KL_ESTIMATORS.get(estimator)
    _require(fn is not None, f"kl_estimator: unknown estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")
    return fn(logprobs, ref_logprobs)
