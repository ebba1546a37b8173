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
from distflow.rl.kl import kl_estimate, kl_k1, kl_k2, kl_k3, kl_low_var
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
