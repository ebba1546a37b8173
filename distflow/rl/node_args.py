"""What a workflow node's ``args`` may hold, checked with the config, before any node starts.

Why it exists: a stage reads a few keys of its node's ``args`` and ignored the rest, so a typo
(``gama: 0.99`` on a ``gae`` node) trained with the config's value and said nothing, and a key an
estimator does not take (``grpo`` with ``std: false``) failed at step 1, after every model had
loaded. Here each built-in stage and function declares the keys it reads and what each value
must be; :func:`check_node_args` refuses anything else with the node, the key, a did-you-mean
and, for a key that is a config setting (``clip_high`` on an update node), the config key to
set instead. A ``package.module:function`` is checked against its signature where it is
imported (:func:`distflow.launch.preflight.check_functions`).

The keys are declared with each stage and function in :mod:`distflow.rl.catalog`; this module
applies them. Torch-free (the launcher's start-up).
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, Collection, Mapping

from distflow.rl.catalog import FUNCTIONS, REWARD_MODEL_DTYPES, STAGES
from distflow.rl.checks import Check

__all__ = ["STAGE_ARGS", "REQUIRED_ARGS", "FN_ARGS", "REWARD_MODEL_DTYPES", "check_node_args",
           "check_signature_args"]

# (role, type) -> the keys its stage reads, whatever the fn (the stages whose fn picks no catalog function).
STAGE_ARGS: dict[tuple[str, str], Mapping[str, Check]] = {k: s.args for k, s in STAGES.items() if s.args is not None}

# (role, type) -> the keys its node must set.
REQUIRED_ARGS: dict[tuple[str, str], tuple[str, ...]] = {k: s.required for k, s in STAGES.items() if s.required}

# Built-in fn of an ACTOR COMPUTE or REWARD COMPUTE node -> the keys it reads.
FN_ARGS: dict[str, Mapping[str, Check]] = {name: f.args for slot in ("compute", "reward")
                                           for name, f in FUNCTIONS[slot].items()}


def _allowed(role: str, kind: str, fn: str) -> Mapping[str, Check] | None:
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
