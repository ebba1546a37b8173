"""Stop signals as the launchers take them: SIGTERM and SIGHUP stop a run like Ctrl-C.

Why it exists: ``distflow run`` (:mod:`distflow.launch.launcher`) and ``--in-process``
(:mod:`distflow.launch.inprocess`) stop on the same signals, with the same exit status
(128 + the signal) and the same words for them; both use this, neither imports the other
for it.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["Interrupted", "STOP_SIGNALS", "catch_stop_signals", "restore_signals", "signum_of", "stop_name"]

STOP_SIGNALS = ("SIGTERM", "SIGHUP")  # stop `distflow run` like Ctrl-C (SIGINT)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP to `distflow run` (and SIGINT, while `--in-process` starts): handled like
    Ctrl-C (a KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signum_of(why: KeyboardInterrupt) -> int:
    """The signal that stopped the run (SIGINT for a plain Ctrl-C); the exit status is 128 + it."""
    return why.signum if isinstance(why, Interrupted) else signal.SIGINT


def stop_name(signum: int) -> str:
    """A stop signal as the messages name it: Ctrl-C for SIGINT."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _raise_interrupted(signum: int, _frame) -> None:
    raise Interrupted(signum)


def catch_stop_signals(names: tuple[str, ...] = STOP_SIGNALS) -> dict[int, object]:
    """Make SIGTERM and SIGHUP (``names``) raise :class:`Interrupted` in the main thread (the
    previous handlers are returned, for :func:`restore_signals`); nothing from another thread."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    sigs = [getattr(signal, n) for n in names if hasattr(signal, n)]
    return {sig: signal.signal(sig, _raise_interrupted) for sig in sigs}


def restore_signals(previous: dict[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
