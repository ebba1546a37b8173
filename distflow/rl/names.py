"""The names of the built-in RL functions, and the config keys each policy loss reads, importable
without torch.

Why it exists: ``distflow run`` checks every workflow ``fn`` before it starts a node, and
importing the maths (torch) just to read their names would put a second on the start-up
of every run. :mod:`distflow.rl.registry` maps these same names to the functions; a test
keeps the two in step.
"""

ADVANTAGE_NAMES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
# Token-level estimators: they read per-token rewards (the outcome on the last token, minus the KL
# with kl_in_reward) and run on the trainer group. gae also reads the critic's values and makes
# its returns; reinforce_pp_token is OpenRLHF's REINFORCE++ (discounted returns, whitened).
TOKEN_ESTIMATOR_NAMES = ("gae", "reinforce_pp_token")
CRITIC_ESTIMATOR_NAMES = ("gae",)
COMPUTE_NAMES = ADVANTAGE_NAMES + TOKEN_ESTIMATOR_NAMES + ("dynamic_sampling",)
POLICY_LOSS_NAMES = ("grpo", "ppo", "dapo", "reinforce_pp", "gspo", "cispo")

# A policy loss whose ratio lives on another scale than PPO's token ratio has its own clip range:
# the config applies it when clip_low / clip_high are not set (a test keeps it equal to the
# losses' keyword defaults). GSPO's sequence ratio stays within ~1e-3 of 1 (its paper's 3e-4 / 4e-4).
LOSS_CLIP_DEFAULTS = {"gspo": (3e-4, 4e-4)}

# ... and its own aggregation where the config leaves ``loss_agg`` unset: GSPO's objective is a
# mean over sequences of its per-token mean (verl fixes it for GSPO); token-mean would weigh
# sequences by their length.
LOSS_AGG_DEFAULTS = {"gspo": "seq-mean-token-mean"}

# ... and recomputes the old (proximal) logprobs where ``recompute_old_logprobs`` is unset: with a
# clip range of 3e-4 the engine's logprobs are not close enough to the trainer's (bf16 engines and
# trainers commonly differ by ~1e-3 per token), so most on-policy sequences would clip. verl
# recomputes them for every loss.
LOSS_RECOMPUTE_DEFAULTS = ("gspo",)

# The config keys each built-in policy loss reads. The trainer passes every one of them to every
# loss (distflow.trainer.actor), so a loss that takes a key and does nothing with it would train as
# if the key were unset and say nothing: the config refuses such a key where it is set
# (distflow.rl.loss_keys), with LOSS_IGNORES's reason. LOSS_SHARED_KEYS are read by every loss,
# through losses.finish_loss (tis_cap also needs recompute_old_logprobs, refused without it;
# max_new_tokens only with loss_agg seq-mean-token-sum-norm); LOSS_OPTION_KEYS are the ones some
# loss reads and another ignores. A test varies each key on each loss and checks this table.
LOSS_SHARED_KEYS = ("kl_coef", "kl_estimator", "kl_clamp", "entropy_coef", "tis_cap", "loss_agg")
LOSS_OPTION_KEYS = ("clip_low", "clip_high", "dual_clip")
_SURROGATE = ("clip_low", "clip_high", "dual_clip")  # losses.policy_loss: PPO's token-level clipped surrogate
POLICY_LOSS_KEYS: dict[str, tuple[str, ...]] = {
    "grpo": _SURROGATE + LOSS_SHARED_KEYS,
    "ppo": _SURROGATE + LOSS_SHARED_KEYS,
    "dapo": _SURROGATE + LOSS_SHARED_KEYS,
    "reinforce_pp": _SURROGATE + LOSS_SHARED_KEYS,
    "gspo": ("clip_low", "clip_high") + LOSS_SHARED_KEYS,  # losses.gspo_loss: a sequence ratio, no dual clip
    "cispo": ("clip_high",) + LOSS_SHARED_KEYS,  # losses.cispo_loss: the weight's upper bound only
}
# (loss, key) -> why the loss ignores the key: the refusal's words (every option key a loss does not read).
LOSS_IGNORES: dict[tuple[str, str], str] = {
    ("cispo", "clip_low"): "CISPO clips only the importance weight, from above: clip_high",
    ("cispo", "dual_clip"): "CISPO has no clipped surrogate to dual-clip; its weight is bounded by clip_high",
    ("gspo", "dual_clip"): "GSPO clips a sequence ratio; dual_clip bounds PPO's token-level surrogate "
                           "(grpo, ppo, dapo, reinforce_pp)",
}

# The losses built on PPO's token-level clipped surrogate (``losses.policy_loss``): those a
# ``dual_clip`` applies to.
SURROGATE_LOSS_NAMES = tuple(n for n in POLICY_LOSS_NAMES if "dual_clip" in POLICY_LOSS_KEYS[n])
