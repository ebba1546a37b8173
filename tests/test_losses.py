"""The modern algorithm set's pure functions against hand-computed numbers.

Loss aggregation, KL estimators, entropy, TIS, GSPO, CISPO, REINFORCE++ and DAPO shaping.
Every expected value is worked out by hand in the comments, never by calling the function
under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from distflow.rl.advantages import (discounted_returns, nonconstant_groups, overlong_penalty,
                                    reinforce_pp_advantages, reinforce_pp_baseline_advantages,
                                    reinforce_pp_token_advantages, token_rewards)
from distflow.rl.kl import K3_CLAMP, k3_knee, kl_estimate, kl_k1, kl_k2, kl_k3, kl_low_var
from distflow.rl.losses import aggregate_loss, cispo_loss, entropy_from_logits, gspo_loss, policy_loss, tis_weights
from distflow.rl.registry import COMPUTE_FUNCTIONS, GROUP_ESTIMATORS, POLICY_LOSSES
from tests.host_reads import HostReads

LN2 = math.log(2.0)


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    exp = torch.tensor(expected, dtype=torch.float64)
    assert actual.shape == exp.shape, (list(actual.shape), list(exp.shape))
    assert torch.allclose(actual.double(), exp, atol=atol, rtol=0), (actual.tolist(), expected)


# ----------------------------------------------------------------------------- aggregation
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, float("nan")]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("agg,kwargs,expected", [
    ("token-mean", {}, 2.5),                                   # (1+2+3+4) / 4
    ("token-mean", {"token_normalizer": 5.0}, 2.0),            # 10 / 5 (global count / world)
    ("seq-mean-token-sum", {}, 5.0),                           # (6 + 4) / 2
    ("seq-mean-token-sum", {"seq_normalizer": 4.0}, 2.5),      # 10 / 4
    ("seq-mean-token-mean", {}, 3.0),                          # (6/3 + 4/1) / 2
    ("seq-mean-token-sum-norm", {"norm_constant": 4}, 1.25),   # Dr. GRPO: 10 / (2 seqs * 4)
])
def test_loss_aggregation(agg, kwargs, expected) -> None:
    close(aggregate_loss(PER_TOKEN, MASK, agg, **kwargs), expected)


@pytest.mark.parametrize("agg,kwargs", [("token-mean", {"token_normalizer": 5.0}),
                                         ("seq-mean-token-sum", {"seq_normalizer": 4.0}),
                                         ("seq-mean-token-mean", {"seq_normalizer": 4.0})])
def test_python_normalizers_make_no_tensor_from_host_data(agg, kwargs) -> None:
    """The trainer passes its global token / sequence counts as Python numbers every micro-batch.
    They must become device scalars by a fill, not from host data (``aten.lift_fresh``: what
    ``torch.tensor``/``new_tensor`` build, a blocking upload on a GPU that waits for its queue)."""
    x, m = PER_TOKEN.clone(), MASK.clone()
    with HostReads() as reads:
        out = aggregate_loss(x, m, agg, **kwargs)
    assert reads.uploads == 0 and not reads.by_file
    assert torch.isfinite(out)


def test_loss_aggregation_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="loss_agg: unknown aggregation 'seq-sum'"):
        aggregate_loss(PER_TOKEN, MASK, "seq-sum")
    with pytest.raises(ValueError, match="needs a positive norm_constant"):
        aggregate_loss(PER_TOKEN, MASK, "seq-mean-token-sum-norm")


def test_seq_mean_token_mean_gradient_weights_sequences_equally() -> None:
    x = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], requires_grad=True)
    aggregate_loss(x, MASK, "seq-mean-token-mean").backward()
    # d/dx: 1/(2 seqs * 3 tokens) for row 0, 1/(2 * 1) for row 0 of row 1, 0 where masked
    close(x.grad, [[1 / 6, 1 / 6, 1 / 6], [0.5, 0.0, 0.0]])


# ----------------------------------------------------------------------------- KL
def test_kl_estimators_by_hand() -> None:
    lp, ref = torch.tensor([math.log(0.5), math.log(0.25)]), torch.tensor([math.log(0.25), math.log(0.5)])
    # r = lp - ref = [ln2, -ln2]
    close(kl_k1(lp, ref), [LN2, -LN2])
    close(kl_k2(lp, ref), [0.5 * LN2 ** 2, 0.5 * LN2 ** 2])  # 0.240227
    # k3 = exp(-r) - 1 + r: 0.5 - 1 + ln2 = 0.193147; 2 - 1 - ln2 = 0.306853
    close(kl_k3(lp, ref), [0.5 - 1 + LN2, 2 - 1 - LN2])
    close(kl_low_var(lp, ref), [0.5 - 1 + LN2, 2 - 1 - LN2])
    close(kl_estimate(lp, ref, "k2"), [0.5 * LN2 ** 2] * 2)


def test_low_var_kl_is_clamped_where_k3_is_not() -> None:
    """A token the reference finds 30 nats less likely than the policy: k3 = e^-30 + 30 - 1 = 29
    and its gradient in logp is 1 - e^-30 = 1, the strongest pull back (a clamp of d at -20 had
    made it 19 with gradient 0); verl's low_var_kl clamps to 10 and has no gradient there."""
    lp, ref = torch.tensor([0.0], requires_grad=True), torch.tensor([-30.0])
    k3 = kl_k3(lp, ref)
    close(k3, [29.0])
    k3.sum().backward()
    close(lp.grad, [1.0])
    lp.grad = None
    low = kl_low_var(lp, ref)
    close(low, [10.0])
    low.sum().backward()
    close(lp.grad, [0.0])
    d = torch.tensor([40.0])  # the top stays clamped: exp(20) is the largest term
    assert torch.isfinite(kl_k3(torch.zeros(1), d)).all()


# k3's knee at the default bound 10: the root of exp(d) - d - 1 = 10, i.e. exp(d) = 11 + d. By hand,
# Newton from d = 2.6: exp(2.6) = 13.463738, f = 13.463738 - 13.6 = -0.136262, f' = 12.463738 ->
# d = 2.610933; exp(2.610933) = 13.611740, f = 0.000808, f' = 12.611740 -> d_c = 2.6108686
# (exp = 13.6108687 = 11 + d_c, f = 3e-8). The bounded gradient is exp(d_c) - 1 = 10 + d_c.
KNEE = 2.6108686
E20 = math.exp(20.0)  # 485165195.41


def test_k3_knee_by_hand() -> None:
    assert K3_CLAMP == 10.0
    assert abs(k3_knee(10.0) - KNEE) < 1e-6
    assert abs(math.exp(k3_knee(10.0)) - 11.0 - k3_knee(10.0)) < 1e-9  # exp(d) - d - 1 = 10
    # clamp 0.5: exp(d) - d - 1 = 0.5 -> d = 0.8577 (exp(0.8577) = 2.3577 = 1.5 + 0.8577)
    assert abs(k3_knee(0.5) - 0.857676) < 1e-5
    assert k3_knee(None) == 20.0 and k3_knee(1e12) == 20.0  # the exp() bound: e^20 - 21 = 4.85e8 < 1e12
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="kl_clamp must be > 0"):
            k3_knee(bad)


# r = logp - ref; d = -r. k3 = exp(d) - d - 1, d k3 / d logp = 1 - exp(d).
#   r = 0:   0, 0 (either way)
#   r = 1:   e^-1 = 0.367879, 1 - e^-1 = 0.632121 (either way: the policy is the likelier, gradient < 1)
#   r = 20:  19 + e^-20 = 19.0, 1 - e^-20 = 1.0 (either way: that side needs no bound)
#   r = -1:  e - 2 = 0.718282, 1 - e = -1.718282 (k3 = 0.72 < 10: under the knee either way)
#   r = -20: exact e^20 - 21 = 485165174.4, 1 - e^20 = -485165194.4;
#            bounded: 10 + (10 + d_c)(20 - d_c) = 10 + 12.6108686 * 17.3891314 = 229.292051, -(10 + d_c)
K3_BY_HAND = [
    (0.0, 10.0, 0.0, 0.0), (0.0, None, 0.0, 0.0),
    (1.0, 10.0, math.exp(-1), 1 - math.exp(-1)), (1.0, None, math.exp(-1), 1 - math.exp(-1)),
    (20.0, 10.0, 19.0, 1.0), (20.0, None, 19.0, 1.0),
    (-1.0, 10.0, math.e - 2, 1 - math.e), (-1.0, None, math.e - 2, 1 - math.e),
    (-20.0, 10.0, 229.292051, -12.6108686), (-20.0, None, E20 - 21, 1 - E20),
]


@pytest.mark.parametrize("r,clamp,value,grad", K3_BY_HAND)
def test_k3_value_and_gradient_by_hand(r, clamp, value, grad) -> None:
    lp = torch.tensor([r], dtype=torch.float64, requires_grad=True)
    k3 = kl_k3(lp, torch.zeros(1, dtype=torch.float64), clamp)
    k3.sum().backward()
    tol = 1e-5 * max(1.0, abs(value))
    assert abs(k3.item() - value) < tol, (k3.item(), value)
    assert abs(lp.grad.item() - grad) < 1e-5 * max(1.0, abs(grad)), (lp.grad.item(), grad)
    # kl_estimate passes the bound to k3 (its default is K3_CLAMP, 10)
    est = kl_estimate(lp.detach(), torch.zeros(1, dtype=torch.float64), "k3", clamp=clamp)
    assert abs(est.item() - value) < tol


def test_k3_is_continuous_with_one_slope_at_the_knee() -> None:
    """At the knee the exact piece and the tangent meet: the value is 10 and the gradient counted once."""
    lp = torch.tensor([-k3_knee(10.0)], dtype=torch.float64, requires_grad=True)
    k3 = kl_k3(lp, torch.zeros(1, dtype=torch.float64))
    k3.sum().backward()
    close(k3, [10.0])
    close(lp.grad, [-12.6108686])
    below = kl_k3(torch.tensor([-k3_knee(10.0) + 1e-6], dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    above = kl_k3(torch.tensor([-k3_knee(10.0) - 1e-6], dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    close(below, [10.0 - 12.6108686e-6], atol=1e-9)
    close(above, [10.0 + 12.6108686e-6], atol=1e-9)


def test_k3_loss_with_one_outlier_token_has_a_bounded_gradient() -> None:
    """A batch of 4 x 8 tokens on the reference (r = 0, gradient 0) but one the policy finds 20 nats
    less likely than the reference (a sampled token the reference loved): GRPO's loss with a KL term
    (kl_coef 0.1, advantages 0: the KL term alone), token-mean over 32 tokens. Its gradient in logp
    is kl_coef / 32 x dk3/dlogp on that token and 0 elsewhere: bounded, 0.1 / 32 x -12.6108686 =
    -0.0394090; exact k3, 0.1 / 32 x (1 - e^20) = -1516141.2 (clipped by grad_clip, that one token
    would be the whole step)."""
    ref = torch.full((4, 8), -1.0)
    mask = torch.ones(4, 8)
    adv = torch.zeros(4)
    norms = {}
    for clamp in (10.0, None):
        lp = ref.clone()
        lp[2, 5] = -21.0
        lp.requires_grad_(True)
        loss, m = policy_loss(lp, lp.detach(), adv, mask, ref_logprobs=ref, kl_coef=0.1, kl_estimator="k3",
                              kl_clamp=clamp)
        loss.backward()
        others = lp.grad.clone()
        others[2, 5] = 0.0
        assert torch.equal(others, torch.zeros(4, 8))
        norms[clamp] = lp.grad.norm().item()
        # the kl metric: the outlier's k3 over 32 tokens (229.292051 / 32 bounded, (e^20 - 21) / 32 exact)
        close(m["kl"], (229.292051 if clamp else E20 - 21) / 32, atol=1e-5 * (1 if clamp else E20 / 32))
    assert abs(norms[10.0] - 0.1 / 32 * 12.6108686) < 1e-6
    assert abs(norms[None] - 0.1 / 32 * (E20 - 1)) < 1e-5 * 0.1 / 32 * E20
    assert norms[10.0] < 0.05 < 1e6 < norms[None]
    # the default of every loss is the bound
    lp = ref.clone()
    lp[2, 5] = -21.0
    lp.requires_grad_(True)
    for fn in (policy_loss, gspo_loss, cispo_loss):
        lp.grad = None
        fn(lp, lp.detach(), adv, mask, ref_logprobs=ref, kl_coef=0.1)[0].backward()
        assert abs(lp.grad.norm().item() - 0.1 / 32 * 12.6108686) < 1e-6, fn.__name__


def test_kl_clamp_must_be_positive() -> None:
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="kl_clamp must be > 0"):
        policy_loss(lp, lp, torch.zeros(1), torch.ones(1, 2), ref_logprobs=lp, kl_coef=0.1, kl_clamp=0.0)


def test_kl_gradient_flows_through_logprobs_only() -> None:
    lp = torch.tensor([math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.25)], requires_grad=True)
    kl_k2(lp, ref).sum().backward()
    close(lp.grad, [LN2])  # d/dlp 0.5 r^2 = r
    assert ref.grad is None


def test_unknown_kl_estimator() -> None:
    with pytest.raises(ValueError, match="kl_estimator: unknown estimator 'k4'"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


# ----------------------------------------------------------------------------- entropy and TIS
def test_entropy_from_logits() -> None:
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])
    # uniform over 2: ln 2; p = (1/4, 3/4): -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    close(entropy_from_logits(logits), [LN2, 0.25 * math.log(4) + 0.75 * math.log(4 / 3)])


def test_tis_weights_are_capped_and_detached() -> None:
    old = torch.tensor([[LN2, 2 * LN2, 5.0]], requires_grad=True)
    behaviour = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, capped = tis_weights(old, behaviour, mask, cap=3.0)
    close(w, [[2.0, 3.0, 1.0]])  # exp(ln2) = 2; exp(ln4) = 4 -> cap 3; masked -> 1
    assert capped.tolist() == [[False, True, False]]
    assert not w.requires_grad


def test_policy_loss_with_entropy_bonus_and_tis() -> None:
    lp = torch.zeros(1, 2, requires_grad=True)
    mask = torch.ones(1, 2)
    adv = torch.tensor([1.0])
    # on-policy ratio 1: pg = -1 per token; entropy bonus 0.1 * [0.5, 1.5]: mean(-1.05, -1.15) = -1.1
    loss, m = policy_loss(lp, lp.detach(), adv, mask, entropy=torch.tensor([[0.5, 1.5]]), entropy_coef=0.1)
    close(loss, -1.1)
    close(m["entropy"], 1.0)
    # TIS: behaviour gives weights exp(0 - (-ln2)) = 2 and exp(ln4) = 4 -> capped at 3: mean(-2, -3)
    behaviour = torch.tensor([[-LN2, -2 * LN2]])
    loss, m = policy_loss(lp, lp.detach(), adv, mask, behaviour_logprobs=behaviour, tis_cap=3.0)
    close(loss, -2.5)
    close(m["tis_weight_mean"], 2.5)
    close(m["tis_clip_frac"], 0.5)
    loss.backward()
    close(lp.grad, [[-1.0, -1.5]])  # -A * w / 2 tokens


# ----------------------------------------------------------------------------- GSPO
def test_gspo_sequence_ratio_is_clipped_per_sequence() -> None:
    lp = torch.tensor([[LN2, 0.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    # s = exp(mean(ln2, 0)) = sqrt(2) = 1.414214 > 1 + 0.2: clipped, pg = -1.2 on both tokens, no gradient
    loss, m = gspo_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
    close(loss, -1.2)
    close(m["ratio_mean"], math.sqrt(2))
    close(m["clip_frac"], 1.0)
    loss.backward()
    close(lp.grad, [[0.0, 0.0]])


def test_gspo_gradient_is_the_sequence_ratio_gradient() -> None:
    lp = torch.tensor([[0.1, -0.1], [0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # s_0 = exp(0) = 1, s_1 = 1; A = [2, -1]; per sequence loss -A_i s_i: seq-mean-token-mean = (-2 + 1) / 2
    loss, _ = gspo_loss(lp, torch.zeros(2, 2), torch.tensor([2.0, -1.0]), mask, loss_agg="seq-mean-token-mean")
    close(loss, -0.5)
    loss.backward()
    # d s_i / d lp_t = s_i / T_i: row 0: -2 * 1/2 / 2 seqs = -0.5; row 1: +1 * 1/1 / 2 = 0.5
    close(lp.grad, [[-0.5, -0.5], [0.5, 0.0]])


# ----------------------------------------------------------------------------- CISPO
def test_cispo_clipped_stop_gradient_weight() -> None:
    lp = torch.tensor([[math.log(0.5), math.log(0.5)]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.5)]])
    # ratio = [2, 1]; weight = min(ratio, 1.28) = [1.28, 1]; pg = -w * A * lp = [1.28 ln2, ln2]
    loss, m = cispo_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2), clip_high=0.28)
    close(loss, (1.28 * LN2 + LN2) / 2)
    close(m["clip_frac"], 0.5)
    close(m["ratio_mean"], 1.5)
    loss.backward()
    close(lp.grad, [[-0.64, -0.5]])  # the clipped token keeps a gradient (-w A / 2), unlike PPO


# ----------------------------------------------------------------------------- REINFORCE++
def test_reinforce_pp_whitens_over_the_whole_batch() -> None:
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735: +-0.5 / 0.57735 = +-0.866025
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    close(adv, [0.866025, -0.866025, -0.866025, 0.866025])
    close(reinforce_pp_advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 1])), [0.0, 0.0])


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens() -> None:
    # group means 0.5 and 1: d = [0.5, -0.5, 0, 0]; std = sqrt(0.5 / 3) = 0.408248 -> +-1.224745
    adv = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    close(adv, [1.224745, -1.224745, 0.0, 0.0])


def test_reinforce_pp_whitens_over_response_tokens() -> None:
    # rewards [1, 0] over 1 and 3 tokens: token mean 1/4; sum w (r - m)^2 = 0.5625 + 3 * 0.0625 = 0.75,
    # unbiased over 4 tokens: 0.75 / 3 -> std 0.5: [0.75 / 0.5, -0.25 / 0.5] (verl's masked_whiten)
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), token_counts=torch.tensor([1, 3]))
    close(adv, [1.5, -0.5])
    # (per sample, the same rewards would give +-0.707107: a long wrong answer outweighed the right one)
    close(reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 1])), [0.707107, -0.707107])
    # a sample with no token weighs nothing; all weightless -> 0
    close(reinforce_pp_advantages(torch.tensor([1.0, 0.0, 5.0]), torch.tensor([0, 1, 2]),
                                  token_counts=torch.tensor([1, 3, 0])), [1.5, -0.5, 9.5], atol=1e-4)
    close(reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), token_counts=torch.tensor([0, 0])),
          [0.0, 0.0])
    with pytest.raises(ValueError, match="token_counts"):
        reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), token_counts=torch.tensor([1]))


def test_reinforce_pp_baseline_whitens_over_response_tokens() -> None:
    # d = [0.5, -0.5, 0, 0] over 1, 3, 2, 2 tokens: mean -1/8, centred [0.625, -0.375, 0.125, 0.125];
    # sum w c^2 = 0.390625 + 0.421875 + 0.0625 = 0.875, / 7 -> std 0.353553
    adv = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]),
                                           token_counts=torch.tensor([1, 3, 2, 2]))
    close(adv, [1.767767, -1.060660, 0.353553, 0.353553])


def test_token_level_returns_and_reinforce_pp_token_advantages() -> None:
    r = torch.tensor([[1.0, 2.0, 4.0]])
    # G = [1 + 0.5 * (2 + 0.5 * 4), 2 + 0.5 * 4, 4] = [3, 4, 4]
    close(discounted_returns(r, torch.ones(1, 3), gamma=0.5), [[3.0, 4.0, 4.0]])
    # whiten [3, 4, 4]: mean 11/3, unbiased std sqrt(1/3): [-1.154701, 0.577350, 0.577350]
    close(reinforce_pp_token_advantages(r, torch.ones(1, 3), gamma=0.5), [[-1.154701, 0.577350, 0.577350]])


# ----------------------------------------------------------------------------- shaping
def test_token_rewards_outcome_on_last_token_minus_kl() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.3, 9.0, 9.0], [9.0, 9.0, 9.0]])
    out = token_rewards(torch.tensor([1.0, 2.0, 5.0]), mask, kl, kl_coef=0.5)
    # row 0: [-0.05, 1 - 0.1]; row 1: [2 - 0.15]; row 2 has no valid token: no reward
    close(out, [[-0.05, 0.9, 0.0], [1.85, 0.0, 0.0], [0.0, 0.0, 0.0]])
    close(token_rewards(torch.tensor([1.0, 2.0, 5.0]), mask), [[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0] * 3])


def test_dynamic_sampling_keeps_only_informative_groups() -> None:
    keep = nonconstant_groups(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1, 2]))
    assert keep.tolist() == [True, True, False, False, False]


def test_overlong_penalty_soft_ramp() -> None:
    # max 4, buffer 2: ramp starts after 2 tokens: (2 - 3) / 2 = -0.5 at 3, -1 at 4, -1 beyond
    close(overlong_penalty(torch.tensor([1, 2, 3, 4, 5]), 4, 2), [0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="overlong_buffer must be an int in"):
        overlong_penalty(torch.tensor([1]), 4, 5)


# ----------------------------------------------------------------------------- registries
def test_registries_and_config_agree() -> None:
    assert {"grpo", "ppo", "dapo", "gspo", "cispo", "reinforce_pp"} <= set(POLICY_LOSSES)
    assert {"gae", "dynamic_sampling", "reinforce_pp", "reinforce_pp_baseline"} <= set(COMPUTE_FUNCTIONS)
    assert set(GROUP_ESTIMATORS) <= set(COMPUTE_FUNCTIONS)


def test_torch_free_names_match_the_registries() -> None:
    """`distflow run` checks workflow names against distflow.rl.names (no torch import); they
    must be exactly the registries' names."""
    from distflow.rl.names import COMPUTE_NAMES, POLICY_LOSS_NAMES

    assert sorted(COMPUTE_NAMES) == sorted(COMPUTE_FUNCTIONS)
    assert sorted(POLICY_LOSS_NAMES) == sorted(POLICY_LOSSES)


# Two samples of 3 tokens where every option key changes a loss that reads it (worked by hand):
# log ratios row 0 [0.5, -0.5, 0.3] (A = +1), row 1 [-0.7, 0.4, -0.6] (A = -1).
#   clip_high: row 0's ratio e^0.5 = 1.65 (A > 0) is cut at 1 + clip_high, 1.01 or 1.2; GSPO's
#     sequence ratio e^0.1 = 1.105 at 1.01 or not at 1.2; CISPO's weight min(1.65, 1 + clip_high).
#   clip_low: row 1's ratio e^-0.7 = 0.50 (A < 0) is raised to 1 - clip_low, 0.99 or 0.8; GSPO's
#     e^-0.3 = 0.74 likewise; CISPO has no lower bound: the same loss.
#   dual_clip: row 1's ratio e^0.4 = 1.49 (A < 0) is bounded by c = 1.3 (PPO's token surrogate only).
KEYS_LP_OLD = torch.tensor([[0.5, -0.5, 0.3], [-0.7, 0.4, -0.6]])
KEYS_BASE = {"clip_low": 0.01, "clip_high": 0.01}
KEYS_ALT = {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 1.3}


def _loss_and_grad(fn, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    lp = KEYS_LP_OLD.clone().requires_grad_(True)
    loss, _ = fn(lp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3), **kw)
    loss.backward()
    return loss.detach(), lp.grad


@pytest.mark.parametrize("name", ["grpo", "ppo", "dapo", "reinforce_pp", "gspo", "cispo"])
def test_the_loss_key_table_is_what_each_loss_reads(name: str) -> None:
    """distflow.rl.names.POLICY_LOSS_KEYS, against the code: changing a key a loss reads changes its
    loss or gradient on this batch; a key it ignores changes neither (or the loss does not take it:
    a TypeError from finish_loss). Every ignored key has the reason the config's refusal gives."""
    from distflow.rl.names import (LOSS_IGNORES, LOSS_OPTION_KEYS, LOSS_SHARED_KEYS, POLICY_LOSS_KEYS,
                                   POLICY_LOSS_NAMES, SURROGATE_LOSS_NAMES)

    assert sorted(POLICY_LOSS_KEYS) == sorted(POLICY_LOSS_NAMES)
    assert set(LOSS_SHARED_KEYS) <= set(POLICY_LOSS_KEYS[name])
    assert SURROGATE_LOSS_NAMES == ("grpo", "ppo", "dapo", "reinforce_pp")
    fn = POLICY_LOSSES[name]
    base_loss, base_grad = _loss_and_grad(fn, **KEYS_BASE)
    for key in LOSS_OPTION_KEYS:
        try:
            loss, grad = _loss_and_grad(fn, **{**KEYS_BASE, key: KEYS_ALT[key]})
        except TypeError:
            changed = False
        else:
            changed = not (torch.allclose(loss, base_loss) and torch.allclose(grad, base_grad))
        assert changed == (key in POLICY_LOSS_KEYS[name]), (name, key, changed)
        assert ((name, key) in LOSS_IGNORES) == (not changed), (name, key)
