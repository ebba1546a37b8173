"""Log a fallback to a slower path once per process, never silently and never per call.

Why it exists: the engine and the trainer pick kernels per call (FlashAttention, the
memory-efficient kernel with repeated KV heads, one SDPA per packed sample, SDPA's math kernel);
a run that took a slower one should say so, but a line per layer and step would drown the log.
One key per kind of fallback: the first call logs, the others are counted (:func:`fallbacks`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

__all__ = ["fallbacks", "log_once"]

_SEEN: Counter[str] = Counter()
_LOCK = threading.Lock()


def log_once(logger: logging.Logger, key: str, level: int, msg: str, *args: object) -> bool:
    """Log ``msg % args`` at ``level`` the first time ``key`` is seen in this process (True then);
    later calls only count it."""
    with _LOCK:
        _SEEN[key] += 1
        first = _SEEN[key] == 1
    if first:
        logger.log(level, msg, *args)
    return first


def fallbacks() -> dict[str, int]:
    """How many times each key was passed to :func:`log_once` (the first, logged, call included)."""
    with _LOCK:
        return dict(_SEEN)
