"""Config keys the chosen policy loss ignores: refused where a config sets them, naming the key.

Why it exists: the trainer passes ``clip_low``, ``clip_high``, ``dual_clip``, ... to every policy
loss, and a loss takes what it does not use (CISPO has no lower bound on its weight, so it ignores
``clip_low``), so a config ported from a framework where the key acts trained differently here and
said nothing. :data:`distflow.rl.names.POLICY_LOSS_KEYS` declares what each built-in loss reads;
:func:`check_ignored_keys` refuses a key the config sets that its loss, or its KL estimators
(``kl_clamp`` bounds k3 only), would ignore. A dotted ``package.module:function`` loss is not
checked here (it is called with the keywords its signature takes).

Torch-free (the launcher validates the config before anything imports torch).
"""

from __future__ import annotations

from typing import Any

from distflow.rl.names import LOSS_IGNORES, LOSS_OPTION_KEYS, POLICY_LOSS_KEYS

__all__ = ["check_ignored_keys", "set_to_act"]


def set_to_act(cfg: Any, key: str) -> bool:
    """Whether the config ``cfg`` (a pydantic model) sets ``key`` to a value that would act.

    Set means given in the file or an override (``model_fields_set``), not a default. Not
    counted: ``null`` (off, which is what a loss that ignores the key does anyway), and, in a
    config that sets every key, the key's default: that is the resolved ``output_dir/config.yaml``
    the launcher writes for its nodes (``model_dump``), where a key the run ignores holds the
    default it had (a value set in the user's file was refused before the dump was written).
    """
    if key not in cfg.model_fields_set:
        return False
    value = getattr(cfg, key)
    if value is None:
        return False
    fields = type(cfg).model_fields
    dumped = set(fields) <= set(cfg.model_fields_set)
    return not (dumped and value == fields[key].default)


def check_ignored_keys(cfg: Any) -> None:
    """Refuse (ValueError naming the key, the node, the loss and what to do) a key ``cfg`` sets
    (:func:`set_to_act`) that the policy loss of an ACTOR MODEL_TRAIN node ignores, or
    ``kl_clamp`` where neither KL estimator is k3."""
    for n in cfg.workflow:
        if n.role.value != "ACTOR" or n.type.value != "MODEL_TRAIN" or n.fn not in POLICY_LOSS_KEYS:
            continue
        for key in LOSS_OPTION_KEYS:
            if key not in POLICY_LOSS_KEYS[n.fn] and set_to_act(cfg, key):
                raise ValueError(f"{key}: workflow node {n.id!r} trains with {n.fn!r}, which ignores it "
                                 f"({LOSS_IGNORES[(n.fn, key)]}); remove {key}")
    if "k3" not in (cfg.kl_estimator, cfg.kl_reward_estimator) and set_to_act(cfg, "kl_clamp"):
        raise ValueError(f"kl_clamp: bounds the k3 KL estimator only, but kl_estimator is {cfg.kl_estimator} and "
                         f"kl_reward_estimator {cfg.kl_reward_estimator}, so it would do nothing; remove kl_clamp "
                         "(or use k3)")
