"""Name tables of the built-in RL functions and the config keys each policy loss reads, derived
from :mod:`distflow.rl.catalog`.

Why it exists: callers that only need a list of names (``distflow run``'s start-up checks,
error messages) read them here without importing torch. Nothing is spelled here: every
name and property comes from the catalog.
"""

from distflow.rl.catalog import FUNCTIONS, functions

ADVANTAGE_NAMES = functions("compute", "outcome")
TOKEN_ESTIMATOR_NAMES = functions("compute", "token")
CRITIC_ESTIMATOR_NAMES = tuple(n for n in TOKEN_ESTIMATOR_NAMES if "returns" in FUNCTIONS["compute"][n].produces)
COMPUTE_NAMES = functions("compute")
POLICY_LOSS_NAMES = functions("policy_loss")
GROUP_ESTIMATORS = functions("compute", "outcome", group_baseline=True)
LOSS_CLIP_DEFAULTS = {f.name: f.clip for f in FUNCTIONS["policy_loss"].values() if f.clip is not None}
LOSS_AGG_DEFAULTS = {f.name: f.loss_agg for f in FUNCTIONS["policy_loss"].values() if f.loss_agg is not None}
LOSS_RECOMPUTE_DEFAULTS = functions("policy_loss", recompute_old=True)

# The config keys each built-in policy loss reads. The trainer passes every one of them to every
# loss (distflow.trainer.actor), so a loss that takes a key and does nothing with it would train as
# if the key were unset and say nothing: the config refuses such a key where it is set
# (distflow.rl.loss_keys), with the catalog's reason (Function.ignores). LOSS_SHARED_KEYS are read by
# every loss, through losses.finish_loss (tis_cap also needs recompute_old_logprobs, refused without
# it; max_new_tokens only with loss_agg seq-mean-token-sum-norm); LOSS_OPTION_KEYS are the ones some
# loss reads and another ignores. A test varies each key on each loss and checks this table.
LOSS_SHARED_KEYS = ("kl_coef", "kl_estimator", "kl_clamp", "entropy_coef", "tis_cap", "loss_agg")
LOSS_OPTION_KEYS = ("clip_low", "clip_high", "dual_clip")
POLICY_LOSS_KEYS: dict[str, tuple[str, ...]] = {
    f.name: tuple(k for k in LOSS_OPTION_KEYS if k not in f.ignores) + LOSS_SHARED_KEYS
    for f in FUNCTIONS["policy_loss"].values()}
# (loss, key) -> why the loss ignores the key: the refusal's words (every option key a loss does not read).
LOSS_IGNORES: dict[tuple[str, str], str] = {(f.name, k): why for f in FUNCTIONS["policy_loss"].values()
                                            for k, why in f.ignores.items()}
# The losses built on PPO's token-level clipped surrogate (``losses.policy_loss``): those a
# ``dual_clip`` applies to.
SURROGATE_LOSS_NAMES = tuple(n for n in POLICY_LOSS_NAMES if "dual_clip" in POLICY_LOSS_KEYS[n])
