"""Name -> function registries of the RL maths, and the resolver every executor uses.

Why this module exists: a workflow node names its function (``fn: grpo``); the executors
look it up here (or import a dotted ``package.module:function``), so adding an algorithm
is a config plus, at most, one registered pure function.

* ``ADVANTAGE_ESTIMATORS``: outcome estimators ``fn(rewards [n], group_ids [n], **node.args)
  -> [n]`` (ACTOR COMPUTE nodes). ``GROUP_ESTIMATORS`` need ``group_size >= 2``.
* ``TOKEN_ESTIMATORS``: estimators over per-token rewards (the outcome on the last token, minus
  the KL with ``kl_in_reward``), run on the trainer group: ``gae`` (and the critic's values),
  ``reinforce_pp_token`` (discounted returns; the trainer whitens them over the whole step).
* ``POLICY_LOSSES``: ``fn(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high,
  **finish_loss keywords) -> (loss, metrics)`` (ACTOR MODEL_TRAIN nodes).
* ``VALUE_LOSSES``: CRITIC MODEL_TRAIN nodes.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Callable, Mapping

from torch import Tensor

from distflow.rl.catalog import FUNCTIONS, functions

__all__ = ["ADVANTAGE_ESTIMATORS", "COMPUTE_FUNCTIONS", "GROUP_ESTIMATORS", "TOKEN_ESTIMATORS",
           "TOKEN_WEIGHTED_ESTIMATORS", "POLICY_LOSSES", "VALUE_LOSSES", "outcome_advantages", "resolve"]


def _table(slot: str, kind: str | None = None) -> dict[str, Callable[..., Any]]:
    return {name: FUNCTIONS[slot][name].load() for name in functions(slot, kind)}


# The catalog's functions, imported: names and properties are the catalog's (distflow.rl.catalog).
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = _table("compute", "outcome")
TOKEN_WEIGHTED_ESTIMATORS = frozenset(functions("compute", "outcome", token_weighted=True))
GROUP_ESTIMATORS = functions("compute", "outcome", group_baseline=True)
TOKEN_ESTIMATORS: dict[str, Callable[..., Any]] = _table("compute", "token")
POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = _table("policy_loss")
COMPUTE_FUNCTIONS: dict[str, Callable[..., Any]] = _table("compute")  # every name an ACTOR COMPUTE node may give
VALUE_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = _table("value_loss")


def resolve(registry: Mapping[str, Callable[..., Any]], name: str, what: str) -> Callable[..., Any]:
    """Look ``name`` up in ``registry``, or import a dotted ``"package.module:function"``.

    ``what`` describes the thing being resolved (e.g. ``"workflow node 'update' policy
    loss"``) and leads every error message, which also names ``name`` and lists the known
    names. Dotted names import code named by the (trusted, local) config file.
    """
    known = ", ".join(sorted(registry)) or "(none)"
    hint = f"known: {known}; or a dotted 'package.module:function'"
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{what}: expected a non-empty name, got {name!r} ({hint})")
    if name in registry:
        return registry[name]
    if ":" not in name:
        close = difflib.get_close_matches(name, list(registry), n=1)
        suggestion = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{what}: unknown name {name!r}{suggestion}; {hint}")
    module_name, _, attr_path = name.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"{what}: {name!r} is not of the form 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what}: cannot import module {module_name!r} for {name!r}: {e}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{what}: {name!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise ValueError(f"{what}: {name!r} is a {type(obj).__name__}, not a callable")
    return obj


def outcome_advantages(name: str, what: str, rewards: Tensor, group_ids: Tensor, token_counts: Tensor,
                       args: Mapping[str, Any]) -> Tensor:
    """The outcome estimator ``name`` (registered or dotted) on rewards [n], group_ids [n] ->
    advantages [n] fp32; token_counts [n] (response lengths) go to the estimators that whiten over
    tokens. ``what`` leads a resolution error; ``args``: the workflow node's arguments."""
    fn = resolve(ADVANTAGE_ESTIMATORS, name, what)
    extra = {"token_counts": token_counts} if name in TOKEN_WEIGHTED_ESTIMATORS else {}
    return fn(rewards, group_ids, **extra, **args).float()
