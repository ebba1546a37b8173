"""Event-loop plumbing shared by every entry point: uvloop when available."""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion on uvloop (falls back to the stdlib loop)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.run(coro)
    return uvloop.run(coro)
