"""Value checks for workflow node ``args``: each returns the problem with a value, or None.

Why it exists: the catalog (:mod:`distflow.rl.catalog`) declares, per stage and function, the
keys a node's ``args`` may hold and what each value must be; these small builders are how it
says so. Torch-free (the launcher's start-up checks use them).
"""

from __future__ import annotations

import math
from typing import Any, Callable

__all__ = ["Check", "number", "flag", "count", "one_of", "path"]

Check = Callable[[Any], "str | None"]  # the problem with a value, or None


def number(lo: float = -math.inf, hi: float = math.inf, *, above: bool = False) -> Check:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            return "must be a number"
        if (v <= lo if above else v < lo) or v > hi:
            low = f"> {lo:g}" if above else f">= {lo:g}"
            return f"must be {low}" + (f" and <= {hi:g}" if hi != math.inf else "")
        return None
    return check


def flag(v: Any) -> str | None:
    return None if isinstance(v, bool) else "must be true or false"


def count(lo: int) -> Check:
    def check(v: Any) -> str | None:
        return None if isinstance(v, int) and not isinstance(v, bool) and v >= lo else f"must be an integer >= {lo}"
    return check


def one_of(*names: str) -> Check:
    def check(v: Any) -> str | None:
        return None if v in names else f"must be one of {', '.join(names)}"
    return check


def path(v: Any) -> str | None:
    return None if isinstance(v, str) and v.strip() else "must be a non-empty path"
