"""Tests for the RL maths (distflow.rl) against hand-computed numbers.

Every expected value is a literal worked out by hand (the arithmetic is in the comments),
never by calling the function under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distflow.rl.advantages import group_advantages, rloo_advantages
from distflow.rl.gae import compute_gae, value_loss
from distflow.rl.kl import kl_k3
from distflow.rl.losses import policy_loss
from distflow.rl.masked import masked_mean, masked_sum, masked_whiten
from distflow.rl.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, resolve


def close(actual: torch.Tensor, expected: list | float, atol: float = 1e-5) -> None:
    exp = torch.tensor(expected, dtype=torch.float64)
    assert actual.shape == exp.shape, (list(actual.shape), list(exp.shape))
    assert torch.allclose(actual.double(), exp, atol=atol, rtol=0), (actual.tolist(), expected)


# ----------------------------------------------------------------------------- masked reductions
def test_masked_sum_and_mean_ignore_garbage_in_masked_positions() -> None:
    x = torch.tensor([[1.0, 2.0, float("inf")], [4.0, float("nan"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    close(masked_sum(x, mask), 13.0)  # 1 + 2 + 4 + 6
    close(masked_mean(x, mask), 3.25)  # 13 / 4
    close(masked_sum(x, mask, dim=1), [3.0, 10.0])
    close(masked_mean(x, mask.bool(), dim=1), [1.5, 5.0])
    close(masked_mean(x, mask, eps=1.0), 2.6)  # 13 / (4 + 1)


def test_masked_mean_of_empty_mask_is_zero_without_nan_gradient() -> None:
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    m = masked_mean(x, torch.zeros(1, 2))
    m.backward()
    assert m.item() == 0.0
    assert x.grad is not None and x.grad.tolist() == [[0.0, 0.0]]


def test_masked_sum_rejects_non_broadcastable_mask() -> None:
    with pytest.raises(ValueError, match="does not broadcast"):
        masked_sum(torch.ones(2, 3), torch.ones(3, 2))


def test_masked_whiten() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # mean 2, unbiased var ((1 + 0 + 1) / 2) = 1 -> [-1, 0, 1], masked -> 0
    close(masked_whiten(x, mask), [[-1.0, 0.0, 1.0, 0.0]])
    close(masked_whiten(x, mask, shift_mean=False), [[1.0, 2.0, 3.0, 0.0]])


# ----------------------------------------------------------------------------- advantages
# Group 7 at indices 0, 2, 5: rewards 1, 2, 6 -> mean 3, deviations -2, -1, 3,
#   unbiased var (4 + 1 + 9) / 2 = 7, std sqrt(7) = 2.6457513 -> -0.7559289, -0.3779645, 1.1338934
# Group 3 at indices 1, 3: rewards 0, 1 -> mean 0.5, deviations -0.5, 0.5,
#   unbiased var (0.25 + 0.25) / 1 = 0.5, std 0.7071068 -> -0.7071068, 0.7071068
# Group 11 at index 4: a single sample -> 0
REWARDS = torch.tensor([1.0, 0.0, 2.0, 1.0, 5.0, 6.0])
GROUPS = torch.tensor([7, 3, 7, 3, 11, 7])


def test_group_advantages_uneven_interleaved_groups_and_singleton() -> None:
    adv = group_advantages(REWARDS, GROUPS)
    assert adv.dtype == torch.float32
    close(adv, [-0.7559289, -0.7071068, -0.3779645, 0.7071068, 0.0, 1.1338934])


def test_group_advantages_without_std_normalisation() -> None:
    close(group_advantages(REWARDS, GROUPS, norm_std=False), [-2.0, -0.5, -1.0, 0.5, 0.0, 3.0])
    assert ADVANTAGE_ESTIMATORS["dr_grpo"](REWARDS, GROUPS)[5].item() == pytest.approx(3.0)


def test_group_advantages_all_equal_rewards_are_exactly_zero() -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point: the result must still be exactly 0, never NaN or eps noise
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 1.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    adv = group_advantages(rewards, groups)
    assert adv[:5].tolist() == [0.0] * 5
    assert not torch.isnan(adv).any()
    # group 2: rewards 0, 1 -> mean 0.5, std 0.7071068 -> -0.7071068, 0.7071068
    close(adv[5:], [-0.7071068, 0.7071068])
    # fp64 rewards: sum(0.1 x 3) / 3 - 0.1 = -1.4e-17 in fp64, which a naive (r - mean) / (std + eps) turns into
    # ~1e-11; a constant group must still give exactly 0
    adv64 = group_advantages(rewards.double().clone().fill_(0.1), torch.zeros(7, dtype=torch.int64))
    assert adv64.tolist() == [0.0] * 7


def test_group_advantages_empty_batch() -> None:
    adv = group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.int64))
    assert adv.shape == (0,)


def test_group_advantages_bad_input_names_the_problem() -> None:
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(REWARDS, GROUPS[:5])
    with pytest.raises(ValueError, match="integer dtype"):
        group_advantages(REWARDS, GROUPS.float())
    with pytest.raises(ValueError, match=r"non-finite .* indices \[2\]"):
        group_advantages(torch.tensor([1.0, 0.0, float("nan")]), torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(REWARDS.reshape(2, 3), GROUPS.reshape(2, 3))


def test_rloo_advantages() -> None:
    # group 7: 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5; group 3: 0 - 1 = -1, 1 - 0 = 1; singleton 0
    close(rloo_advantages(REWARDS, GROUPS), [-3.0, -1.0, -1.5, 1.0, 0.0, 4.5])
    assert ADVANTAGE_ESTIMATORS["rloo"] is rloo_advantages


# ----------------------------------------------------------------------------- KL
def test_kl_k3_values() -> None:
    logp = torch.tensor([[-1.0, -2.0, -1.0]])
    ref = torch.tensor([[-1.0, -1.5, -1.5]])
    # d = ref - logp = [0, 0.5, -0.5]: e^0 - 0 - 1 = 0; e^0.5 - 1.5 = 0.1487213; e^-0.5 + 0.5 - 1 = 0.1065307
    close(kl_k3(logp, ref), [[0.0, 0.1487213, 0.1065307]])


def test_kl_k3_is_non_negative_and_finite_for_extreme_ratios() -> None:
    logp = torch.tensor([[0.0, -100.0, -1e-4, -30.0]])
    ref = torch.tensor([[-100.0, 0.0, 0.0, -30.0 + 1e-6]])
    k = kl_k3(logp, ref)
    assert torch.isfinite(k).all() and (k >= 0).all()
    # d = +100 is past k3's knee (kl_clamp 10: d_c = 2.6108686, where e^d - d - 1 = 10): the tangent there,
    # 10 + (10 + d_c)(100 - d_c) = 10 + 12.6108686 x 97.3891314 = 1238.16154
    assert k[0, 1].item() == pytest.approx(1238.16154, rel=1e-6)
    # unbounded (clamp None), past d = 20 (exp stays finite) the tangent there: e^20 - 21 + (e^20 - 1) x 80
    # = 485165174.41 + 38813215552.78 = 39298380727.19
    exact = kl_k3(logp, ref, None)
    assert torch.isfinite(exact).all() and (exact >= 0).all()
    assert exact[0, 1].item() == pytest.approx(39298380727.19, rel=1e-6)
    assert exact[0, 0].item() == pytest.approx(99.0, rel=1e-6)
    # d = -100 is not clamped (exp(d) just tends to 0): e^-100 + 100 - 1 = 99
    assert k[0, 0].item() == pytest.approx(99.0, rel=1e-6)
    # d = 1e-4: d^2/2 = 5e-9 (accurate thanks to expm1)
    assert k[0, 2].item() == pytest.approx(5e-9, rel=1e-3)


def test_kl_k3_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="same shape"):
        kl_k3(torch.zeros(2, 3), torch.zeros(2, 2))


# ----------------------------------------------------------------------------- policy loss
# Hand case: old logprobs and ratios chosen; logprobs = old + log(ratio); clip 0.2 both sides.
#  row 0, A = +1, ratios 1.1 (inside), 1.5 (above), 0.5 (below)
#    -min(1.1, 1.1) = -1.1 ; -min(1.5, 1.2) = -1.2 (clipped) ; -min(0.5, 0.8) = -0.5
#  row 1, A = -2, ratios 0.9 (inside), 0.5 (below), 1.5 (above)
#    -min(-1.8, -1.8) = 1.8 ; -min(-1.0, -1.6) = 1.6 (clipped) ; -min(-3.0, -2.4) = 3.0
#  sum = -1.1 - 1.2 - 0.5 + 1.8 + 1.6 + 3.0 = 3.6 -> token mean 0.6 ; clip_frac 2/6 ; ratio mean 6/6 = 1
#  approx_kl = mean(r - 1 - ln r) = (0.0046898 + 0.0945349 + 0.1931472 + 0.0053605 + 0.1931472 + 0.0945349) / 6
#            = 0.0975691
RATIOS = [[1.1, 1.5, 0.5], [0.9, 0.5, 1.5]]
OLD = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
ADV = torch.tensor([1.0, -2.0])


def hand_logprobs() -> torch.Tensor:
    return (OLD + torch.tensor(RATIOS).log()).requires_grad_(True)


def test_policy_loss_hand_case_inside_and_outside_clip_both_signs() -> None:
    lp = hand_logprobs()
    loss, m = policy_loss(lp, OLD, ADV, torch.ones(2, 3))
    close(loss, 0.6)
    close(m["pg_loss"], 0.6)
    close(m["clip_frac"], 1 / 3)
    close(m["ratio_mean"], 1.0)
    close(m["approx_kl"], 0.0975691)
    close(m["kl"], 0.0)
    assert set(m) == {"pg_loss", "kl", "clip_frac", "ratio_mean", "approx_kl"}
    assert all(not v.requires_grad for v in m.values())
    # d loss / d logp = -A * ratio / 6 where unclipped, 0 where the clipped branch is active:
    #   row 0: -1.1/6, 0, -0.5/6 ; row 1: 2*0.9/6 = 0.3, 0, 2*1.5/6 = 0.5
    loss.backward()
    close(lp.grad, [[-1.1 / 6, 0.0, -0.5 / 6], [0.3, 0.0, 0.5]])


def test_policy_loss_advantages_per_token_equal_broadcast() -> None:
    loss, _ = policy_loss(hand_logprobs(), OLD, ADV[:, None].expand(2, 3).clone(), torch.ones(2, 3))
    close(loss, 0.6)


def test_policy_loss_clip_higher() -> None:
    # clip_high 0.28: row 0 token 1 becomes -min(1.5, 1.28) = -1.28 -> sum 3.6 - 0.08 = 3.52 -> 0.5866667
    # row 1 token 2 (A<0, ratio 1.5): -min(-3.0, -2.56) = 3.0, unchanged
    loss, _ = policy_loss(hand_logprobs(), OLD, ADV, torch.ones(2, 3), clip_high=0.28)
    close(loss, 3.52 / 6)


def test_policy_loss_masked_tokens_change_nothing() -> None:
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    lp = hand_logprobs()
    loss, m = policy_loss(lp, OLD, ADV, mask)
    # drop row 1 token 2 (3.0): (3.6 - 3.0) / 5 = 0.12 ; clip_frac 2/5 ; ratio mean (6 - 1.5) / 5 = 0.9
    close(loss, 0.12)
    close(m["clip_frac"], 0.4)
    close(m["ratio_mean"], 0.9)
    close(m["approx_kl"], 0.0981759)  # (0.5854145 - 0.0945349) / 5
    loss.backward()
    assert lp.grad is not None
    # garbage (inf / nan logprobs, nan advantages, nan ref) at the masked token: same loss, same finite grads
    garbage = lp.detach().clone()
    garbage[1, 2] = float("inf")
    old = OLD.clone()
    old[1, 2] = float("nan")
    adv_bt = ADV[:, None].expand(2, 3).clone()
    adv_bt[1, 2] = float("nan")
    ref = OLD.clone()
    ref[1, 2] = float("nan")
    garbage.requires_grad_(True)
    loss2, m2 = policy_loss(garbage, old, adv_bt, mask.bool(), ref_logprobs=ref, kl_coef=0.5)
    # ref == old here, so d = ref - logp = -ln r and k3 = 1/r + ln r - 1 on the 5 valid tokens:
    #   r = 1.1: 0.0044011, 1.5: 0.0721318, 0.5: 0.3068528, 0.9: 0.0057506, 0.5: 0.3068528 ; sum 0.6959891
    # loss = 0.12 + 0.5 * 0.6959891 / 5 = 0.12 + 0.0695989
    close(loss2, 0.12 + 0.0695989)
    close(m2["kl"], 0.1391978)
    close(m2["pg_loss"], 0.12)
    loss2.backward()
    assert garbage.grad is not None and torch.isfinite(garbage.grad).all()
    assert garbage.grad[1, 2].item() == 0.0


def test_policy_loss_token_normalizer() -> None:
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, m = policy_loss(hand_logprobs(), OLD, ADV, mask, token_normalizer=10.0)
    close(loss, 0.06)  # 0.6 / 10
    close(m["pg_loss"], 0.12)  # metrics stay token means over this batch: 0.6 / 5
    loss_t, _ = policy_loss(hand_logprobs(), OLD, ADV, mask, token_normalizer=torch.tensor(4.0))
    close(loss_t, 0.15)  # 0.6 / 4
    for bad in (0.0, -1.0, torch.tensor([1.0, 2.0])):
        with pytest.raises(ValueError, match="token_normalizer"):
            policy_loss(hand_logprobs(), OLD, ADV, mask, token_normalizer=bad)


def test_policy_loss_kl_term() -> None:
    # pg is 0 (A = 0, ratio 1); k3 on d = [0, 0.5] = [0, 0.1487213]; 0.1 * 0.1487213 / 2 = 0.0074361
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5]])
    loss, m = policy_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 2), ref_logprobs=ref, kl_coef=0.1)
    close(loss, 0.0074361)
    close(m["kl"], 0.1487213 / 2)
    close(m["pg_loss"], 0.0)
    loss.backward()
    # d/dlogp of k3 = 1 - e^d: token 1 -> (1 - e^0.5) * 0.1 / 2 = -0.0324361 (pulls logp towards ref)
    close(lp.grad, [[0.0, -0.0324361]])


def test_policy_loss_dual_clip() -> None:
    # A = -1, ratio 5: standard clipped loss -min(-5, -1.2) = 5, dual clip c=3 bounds it at -c*A = 3
    # A = -1, ratio 2: standard 2 < 3, unchanged;  A = +1, ratio 5: -min(5, 1.2) = -1.2, dual clip n/a
    old = torch.zeros(1, 3)
    lp = torch.tensor([[math.log(5.0), math.log(2.0), math.log(5.0)]], requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, m = policy_loss(lp, old, adv, torch.ones(1, 3), dual_clip=3.0)
    close(loss, (3.0 + 2.0 - 1.2) / 3)
    close(m["dual_clip_frac"], 1 / 3)
    loss_plain, _ = policy_loss(lp, old, adv, torch.ones(1, 3))
    close(loss_plain, (5.0 + 2.0 - 1.2) / 3)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(lp, old, adv, torch.ones(1, 3), dual_clip=0.5)


def test_policy_loss_gradient_pushes_positive_advantage_tokens_up() -> None:
    torch.manual_seed(0)
    old = -torch.rand(2, 2) - 0.5
    lp = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    loss, _ = policy_loss(lp, old, adv, torch.ones(2, 2))
    loss.backward()
    # at ratio 1: d loss / d logp = -A / N = -1/4 for A = +1, +1/4 for A = -1
    close(lp.grad, [[-0.25, -0.25], [0.25, 0.25]])
    with torch.no_grad():
        stepped = lp - 0.1 * lp.grad  # one SGD step
    assert (stepped[0] > old[0]).all() and (stepped[1] < old[1]).all()


def test_policy_loss_computes_in_fp32_for_bf16_inputs() -> None:
    lp = hand_logprobs().detach().to(torch.bfloat16).requires_grad_(True)
    loss, _ = policy_loss(lp, OLD.to(torch.bfloat16), ADV.to(torch.bfloat16), torch.ones(2, 3))
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(0.6, abs=0.03)  # bf16 inputs carry ~3 significant digits
    loss.backward()
    assert lp.grad is not None and lp.grad.dtype == torch.bfloat16


def test_policy_loss_bad_input_names_the_problem() -> None:
    lp = hand_logprobs()
    with pytest.raises(ValueError, match="advantages: expected shape"):
        policy_loss(lp, OLD, torch.ones(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(lp, OLD[:, :2], ADV, torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        policy_loss(lp, OLD, ADV, torch.ones(2, 2))
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(lp, OLD, ADV, torch.ones(2, 3), kl_coef=0.1)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(lp, OLD, ADV, torch.ones(2, 3), clip_low=1.0)


def test_dp_token_normalizer_gives_the_global_token_mean_gradient() -> None:
    """Two 'ranks' with uneven token counts, normalizer = N_global / W, gradients averaged (as DDP/FSDP do)."""
    torch.manual_seed(1)
    b, t = 4, 5
    old = -torch.rand(b, t) - 0.1
    base = old + 0.3 * torch.randn(b, t)
    adv = torch.randn(b)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    full = base.clone().requires_grad_(True)
    policy_loss(full, old, adv, mask)[0].backward()
    n_global, world = float(mask.sum()), 2
    shards = [slice(0, 1), slice(1, 4)]  # 2 tokens on rank 0, 12 on rank 1
    grads, naive = torch.zeros(b, t), torch.zeros(b, t)
    for s in shards:
        for norm, acc in ((n_global / world, grads), (None, naive)):
            part = base[s].clone().requires_grad_(True)
            policy_loss(part, old[s], adv[s], mask[s], token_normalizer=norm)[0].backward()
            acc[s] += part.grad / world  # all-reduce mean of gradients
    assert full.grad is not None
    assert torch.allclose(grads, full.grad, atol=1e-6)
    assert not torch.allclose(naive, full.grad, atol=1e-3)  # per-rank token means would be biased


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 4), t=st.integers(1, 6), seed=st.integers(0, 2**31 - 1), per_token=st.booleans())
def test_on_policy_loss_is_minus_token_mean_advantage(b: int, t: int, seed: int, per_token: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 3
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[0, 0] = True
    adv = torch.randn(b, t, generator=g) if per_token else torch.randn(b, generator=g)
    loss, m = policy_loss(lp, lp.clone(), adv, mask)
    total, count = 0.0, 0
    for i in range(b):
        for j in range(t):
            if mask[i, j]:
                total += float(adv[i, j] if per_token else adv[i])
                count += 1
    assert loss.item() == pytest.approx(-total / count, abs=1e-5)
    assert m["clip_frac"].item() == 0.0 and m["ratio_mean"].item() == pytest.approx(1.0)
    assert m["approx_kl"].item() == pytest.approx(0.0, abs=1e-7)


# ----------------------------------------------------------------------------- GAE and value loss
def test_gae_by_hand() -> None:
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, 99.0], [0.5, 99.0, 0.7]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    # row 0: t2 delta = 1 - 0.7 = 0.3 -> A2 = 0.3
    #        t1 delta = 0.9*0.7 - 0.6 = 0.03 -> A1 = 0.03 + 0.72*0.3 = 0.246
    #        t0 delta = 0.9*0.6 - 0.5 = 0.04 -> A0 = 0.04 + 0.72*0.246 = 0.21712
    # row 1 (trailing pad): t1 delta = 1 - 0.6 = 0.4 -> 0.4 ; t0 = 0.04 + 0.72*0.4 = 0.328
    # row 2 (interior mask at t1 is skipped): A2 = 0.3 ; t0 delta = 0.9*0.7 - 0.5 = 0.13 -> 0.13 + 0.72*0.3 = 0.346
    close(adv, [[0.21712, 0.246, 0.3], [0.328, 0.4, 0.0], [0.346, 0.0, 0.3]])
    close(ret, [[0.71712, 0.846, 1.0], [0.828, 1.0, 0.0], [0.846, 0.0, 1.0]])
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(rewards, values, mask, 1.5, lam)
    with pytest.raises(ValueError, match="values"):
        compute_gae(rewards, values[:, :2], mask, gamma, lam)


def test_value_loss_clipping() -> None:
    # token 1: v=1.0 old=0.5 R=1.2: clip(v) = 0.7; (v-R)^2 = 0.04, (0.7-R)^2 = 0.25 -> 0.5*0.25 = 0.125 (clipped)
    # token 2: v=0.6 old=0.5 R=0.0: inside; 0.36 both -> 0.18
    # token 3: v=0.0 old=0.5 R=0.1: clip(v) = 0.3; 0.01 vs 0.04 -> 0.02 (clipped)
    # token 4: masked garbage.   loss = (0.125 + 0.18 + 0.02) / 3 = 0.1083333
    v = torch.tensor([[1.0, 0.6, 0.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, float("inf")]])
    ret = torch.tensor([[1.2, 0.0, 0.1, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = value_loss(v, old, ret, mask, clip=0.2)
    close(loss, 0.325 / 3)
    close(m["vf_clip_frac"], 2 / 3)
    close(m["value_mean"], 1.6 / 3)
    loss.backward()
    # clipped tokens have no gradient; token 2: (v - R) / 3 = 0.2
    close(v.grad, [[0.0, 0.2, 0.0, 0.0]])
    # without clipping: 0.5 * (0.04 + 0.36 + 0.01) / 3 = 0.0683333 ; with token_normalizer 2: 0.205 / 2
    close(value_loss(v, old, ret, mask, clip=None)[0], 0.205 / 3)
    loss_n, m_n = value_loss(v, old, ret, mask, clip=None, token_normalizer=2.0)
    close(loss_n, 0.1025)
    close(m_n["vf_loss"], 0.205 / 3)  # metrics stay token means
    close(m["vf_loss"], 0.325 / 3)
    with pytest.raises(ValueError, match="clip"):
        value_loss(v, old, ret, mask, clip=0.0)


# ----------------------------------------------------------------------------- registries
def test_registries_and_resolve() -> None:
    assert resolve(ADVANTAGE_ESTIMATORS, "grpo", "advantage estimator") is group_advantages
    assert resolve(POLICY_LOSSES, "ppo", "policy loss") is policy_loss
    assert POLICY_LOSSES["grpo"] is policy_loss
    fn = resolve(ADVANTAGE_ESTIMATORS, "distflow.rl.advantages:rloo_advantages", "advantage estimator")
    assert fn is rloo_advantages
    assert resolve({}, "math:sqrt", "x")(9.0) == 3.0


@pytest.mark.parametrize(
    "name, pattern",
    [
        ("grp", r"workflow node 'adv' estimator: unknown name 'grp' \(did you mean 'grpo'\?\); "
                r"known: dr_grpo, grpo, reinforce_pp, reinforce_pp_baseline, rloo"),
        ("no_such_module_xyz:f", r"workflow node 'adv' estimator: cannot import module 'no_such_module_xyz'"),
        ("math:nope", r"'math' has no attribute 'nope'"),
        ("math:pi", r"'math:pi' is a float, not a callable"),
        (":f", r"not of the form"),
        ("", r"expected a non-empty name"),
    ],
)
def test_resolve_errors_name_what_and_name(name: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        resolve(ADVANTAGE_ESTIMATORS, name, "workflow node 'adv' estimator")
