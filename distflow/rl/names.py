"""Name tables of the built-in RL functions, derived from :mod:`distflow.rl.catalog`.

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
SURROGATE_LOSS_NAMES = functions("policy_loss", surrogate=True)
