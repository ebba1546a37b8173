"""The names of the built-in RL functions, importable without torch.

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

# The losses built on PPO's token-level clipped surrogate (``losses.policy_loss``): those a
# ``dual_clip`` applies to.
SURROGATE_LOSS_NAMES = ("grpo", "ppo", "dapo", "reinforce_pp")
