"""Checkpoints written in the background: the trainer blocks only while the state is copied to host memory.

Why it exists: a checkpoint used to stop training for as long as its files took to write
(minutes for a big model on a shared file system), so saving often enough that a dead trainer
loses little (``save_interval_s``, :mod:`distflow.launch.recovery`) cost a share of the run. Now
:func:`distflow.trainer.stages.save_checkpoint` gathers the weights to rank 0's host memory and
has torch.distributed.checkpoint stage (copy to host) the optimizer shards, both synchronously,
then hands the writing to this writer's thread and returns; the next step trains meanwhile.

The completion marker (``distflow_state.json``, :func:`distflow.launch.checkpoint.mark_checkpoint`)
is written by that thread last, after every rank's shards are on disk, so a checkpoint still
being written (or whose writer was killed) is never loaded or offered for recovery. One write
is in flight at a time: a save waits for the previous one first (and so does the end of the run,
:meth:`CheckpointWriter.close`), with a deadline. The optimizer shards' collectives in the
background run on a gloo group of their own (:attr:`CheckpointWriter.group`), never interleaved
with the training's collectives on the trainer group.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

log = logging.getLogger(__name__)

__all__ = ["CheckpointWriter"]


class CheckpointWriter:
    """One background thread writing one checkpoint at a time. Created on every trainer rank at
    once (the gloo group for the optimizer shards is made by a collective)."""

    def __init__(self, timeout_s: float, group: Any = None):
        self.timeout_s = timeout_s  # the longest wait for a write (the ranks' collectives included)
        self.group = group if group is not None else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._then: list[Callable[[], None]] = []  # to run once the write in flight is complete
        self._complete = True
        self.writes = 0

    def submit(self, name: str, write: Callable[[], None]) -> None:
        """Run ``write`` in the background (after the previous write, which is waited for first)."""
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as e:  # noqa: BLE001 - raised in the trainer by the next wait()
                log.exception("writing checkpoint %s failed", name)
                self._error = e
            with self._lock:
                then, self._then, self._complete = self._then, [], True
            for fn in then if self._error is None else ():  # (a failed write replaces nothing)
                try:
                    fn()
                except Exception:  # noqa: BLE001 - a removal that failed leaves a checkpoint too many
                    log.exception("after checkpoint %s", name)

        # A daemon thread: a trainer that fails mid-write exits without waiting for it (the checkpoint
        # has no marker then, and is never loaded).
        self._complete = False
        self._thread = threading.Thread(target=run, name=f"checkpoint-writer-{name}", daemon=True)
        self.writes += 1
        self._thread.start()

    def after(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the write in flight is complete (in the writer's thread; now, in this one,
        when none is): e.g. remove the checkpoints it replaces, never before it is whole."""
        with self._lock:
            if not self._complete:
                self._then.append(fn)
                return
        fn()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Until the write in flight is done (bounded by ``timeout_s``: TimeoutError); its error, if any."""
        if self._thread is not None:
            self._thread.join(self.timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint writer: {self._thread.name} not done after {self.timeout_s:.0f}s")
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint failed: {type(error).__name__}: {error}") from error

    def close(self) -> None:
        """The end of the run: the last write done (before the process group goes)."""
        self.wait()
