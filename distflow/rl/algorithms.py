"""Compatibility re-export: the RL maths now lives in one-concept modules.

``distflow.rl.masked`` (masked reductions), ``advantages`` (estimators and reward
shaping), ``kl`` (KL estimators), ``losses`` (policy losses, aggregation, TIS, entropy),
``gae`` (GAE and the value loss), ``registry`` (name -> function tables, ``resolve``).
Import from those; this module keeps older imports working.
"""

from distflow.rl.advantages import *  # noqa: F401,F403
from distflow.rl.advantages import group_advantages, rloo_advantages  # noqa: F401
from distflow.rl.gae import compute_gae, value_loss  # noqa: F401
from distflow.rl.kl import KL_ESTIMATORS, kl_estimate, kl_k1, kl_k2, kl_k3, kl_low_var  # noqa: F401
from distflow.rl.losses import (LOSS_AGGREGATIONS, aggregate_loss, cispo_loss, entropy_from_logits,  # noqa: F401
                                finish_loss, gspo_loss, policy_loss, tis_weights)
from distflow.rl.masked import LOG_RATIO_CLAMP, masked_mean, masked_sum, masked_whiten  # noqa: F401
from distflow.rl.registry import (ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS, POLICY_LOSSES,  # noqa: F401
                                  TOKEN_ESTIMATORS, VALUE_LOSSES, resolve)
