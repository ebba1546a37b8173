"""Reward functions that fail at run time, for the failure-propagation tests."""

import os
import sys


def exploding_reward(response: str, row: dict) -> float:
    """A bug in the user's function: the node exits 2 naming it, never restarted."""
    raise RuntimeError(f"boom on row {row.get('prompt')!r}")


def dying_reward(response: str, row: dict) -> float:
    """The process dies under the stage (as a segfault or an OOM kill would): a node failure,
    restarted up to `restarts` times."""
    print(f"dying on row {row.get('prompt')!r}", file=sys.stderr, flush=True)
    os._exit(1)
