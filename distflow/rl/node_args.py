"""What a workflow node's ``args`` may hold, checked with the config, before any node starts.

Why it exists: a stage reads a few keys of its node's ``args`` and ignored the rest, so a typo
(``gama: 0.99`` on a ``gae`` node) trained with the config's value and said nothing, and a key an
estimator does not take (``grpo`` with ``std: false``) failed at step 1, after every model had
loaded. Here each built-in stage and function declares the keys it reads and what each value
must be; :func:`check_node_args` refuses anything else with the node, the key, a did-you-mean
and, for a key that is a config setting (``clip_high`` on an update node), the config key to
set instead. A ``package.module:function`` is checked against its signature where it is
imported (:func:`distflow.launch.preflight.check_functions`).

Torch-free (the launcher's start-up): the names of the compute dtypes are repeated from
:data:`distflow.device.COMPUTE_DTYPES`, and a test keeps the two equal.
"""

from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Callable, Collection, Mapping

__all__ = ["STAGE_ARGS", "REQUIRED_ARGS", "FN_ARGS", "check_node_args", "check_signature_args"]

Check = Callable[[Any], "str | None"]  # the problem with a value, or None

REWARD_MODEL_DTYPES = ("float32", "bfloat16", "float16")  # = distflow.device.COMPUTE_DTYPES


def _number(lo: float = -math.inf, hi: float = math.inf, *, above: bool = False) -> Check:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            return "must be a number"
        if (v <= lo if above else v < lo) or v > hi:
            low = f"> {lo:g}" if above else f">= {lo:g}"
            return f"must be {low}" + (f" and <= {hi:g}" if hi != math.inf else "")
        return None
    return check


def _flag(v: Any) -> str | None:
    return None if isinstance(v, bool) else "must be true or false"


def _count(lo: int) -> Check:
    def check(v: Any) -> str | None:
        return None if isinstance(v, int) and not isinstance(v, bool) and v >= lo else f"must be an integer >= {lo}"
    return check


def _one_of(*names: str) -> Check:
    def check(v: Any) -> str | None:
        return None if v in names else f"must be one of {', '.join(names)}"
    return check


def _path(v: Any) -> str | None:
    return None if isinstance(v, str) and v.strip() else "must be a non-empty path"


_EPS = {"eps": _number(0)}
_DISCOUNT = {"gamma": _number(0, 1), "whiten": _flag}

# (role, type) -> the keys its stage reads, whatever the fn (the stages without an fn table).
STAGE_ARGS: dict[tuple[str, str], dict[str, Check]] = {
    ("ACTOR", "MODEL_INFERENCE"): {},  # generate: sampling is configured by config keys
    ("ACTOR", "MODEL_TRAIN"): {},  # the loss: clip_low, clip_high, kl_coef, ... are config keys
    ("REFERENCE", "MODEL_INFERENCE"): {},
    ("CRITIC", "MODEL_INFERENCE"): {},
    ("CRITIC", "MODEL_TRAIN"): {},  # value_clip, critic_lr are config keys
    ("REWARD", "MODEL_INFERENCE"): {"path": _path, "weight": _number(), "dtype": _one_of(*REWARD_MODEL_DTYPES),
                                    "micro_batch_size": _count(1)},
}

# (role, type) -> the keys its node must set.
REQUIRED_ARGS: dict[tuple[str, str], tuple[str, ...]] = {("REWARD", "MODEL_INFERENCE"): ("path",)}

# Built-in fn of an ACTOR COMPUTE or REWARD COMPUTE node -> the keys it reads.
FN_ARGS: dict[str, dict[str, Check]] = {
    "grpo": {"norm_std": _flag, **_EPS},
    "dr_grpo": dict(_EPS),
    "rloo": {},
    "reinforce_pp": dict(_EPS),
    "reinforce_pp_baseline": dict(_EPS),
    "gae": {**_DISCOUNT, "lam": _number(0, 1)},
    "reinforce_pp_token": dict(_DISCOUNT),
    "dynamic_sampling": {"max_retries": _count(0), "refill": _one_of("fresh", "same")},
    "successor": {}, "gsm8k": {}, "exact_match": {},  # rule rewards: fn(response, row)
}


def _allowed(role: str, kind: str, fn: str) -> dict[str, Check] | None:
    """The keys a node may set, or None where a dotted function's signature decides."""
    if (role, kind) in STAGE_ARGS:
        return STAGE_ARGS[(role, kind)]
    return FN_ARGS.get(fn)


def check_node_args(node: Any, config_keys: Collection[str] = ()) -> None:
    """Refuse a key of ``node.args`` its stage does not read, or a value it cannot use: ValueError
    naming the node and the key. ``config_keys``: the config's settings, named when a node key is
    one of them (a setting of the whole run, not of a node)."""
    role, kind = node.role.value, node.type.value
    allowed = _allowed(role, kind, node.fn)
    if allowed is None:
        return
    what = f"workflow node {node.id!r} ({node.fn})"
    for key in REQUIRED_ARGS.get((role, kind), ()):
        if key not in node.args:
            raise ValueError(f"{what}: args.{key} is required (it reads {', '.join(sorted(allowed))})")
    for key, value in node.args.items():
        if key not in allowed:
            takes = f"it reads {', '.join(sorted(allowed))}" if allowed else "it reads no args"
            close = difflib.get_close_matches(str(key), list(allowed), n=1)
            hint = (f" (did you mean {close[0]!r}?)" if close else
                    f" ({key!r} is a config key, set at the top level for the whole run)" if key in config_keys
                    else "")
            raise ValueError(f"{what}: args.{key} is not an argument of this stage{hint}; {takes}")
        problem = allowed[key](value)
        if problem:
            raise ValueError(f"{what}: args.{key} {problem} (got {value!r})")


def check_signature_args(fn: Callable[..., Any], leading: int, args: Mapping[str, Any], what: str) -> None:
    """A dotted function called as ``fn(<leading positional values>, **args)``: refuse ``args`` its
    signature cannot take, naming them (a function without a signature, e.g. a C builtin, passes)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*([None] * leading), **args)
    except TypeError as e:
        params = [p.name for i, p in enumerate(sig.parameters.values())
                  if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and i >= leading)]
        takes = f"it takes {', '.join(params)}" if params else "it takes no keyword arguments"
        raise ValueError(f"{what}: its args do not fit its signature ({e}); {takes}") from None
