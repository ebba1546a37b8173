"""The one Tracker interface, and the set of trackers trainer rank 0 feeds.

Why a set behind a queue: trainer rank 0 is on the critical path of every step, and a
tracker may be slow (a remote MLflow server, W&B's service starting up) or fail half-way
(a full disk, a server gone). So rank 0 only *enqueues* a step's row; one background thread
hands it to every configured backend. A backend that raises is logged (its first failure
with the traceback) and counted, and the run goes on: the failures show up as
``tracker_failures`` in the next ``metrics.jsonl`` row and in the final log line. A backend
that cannot *start* is different: :func:`distflow.trackers.open_trackers` raises before the
first step, because a run whose results would silently go nowhere is worse than no run.

Backends are composed, never subclassed beyond :class:`Tracker`: each module
(``backend_jsonl.py``, ``backend_tensorboard.py``, ``backend_wandb.py``, ``backend_mlflow.py``)
holds one small class (not named after its library, which it imports).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable

from distflow.trackers.samples import decode_rows, pick_rows

log = logging.getLogger(__name__)

# One sample of a step's table: the columns every backend writes, in this order.
SAMPLE_COLUMNS = ("step", "kind", "rank", "reward", "prompt", "response")


class Tracker(ABC):
    """One backend. Every method is called from the set's worker thread, one call at a time."""

    name: str = "?"

    @abstractmethod
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Every numeric metric of one trainer step."""

    @abstractmethod
    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """One held-out evaluation row (its numeric fields), at the step it evaluated."""

    @abstractmethod
    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """The step's sample table: ``SAMPLE_COLUMNS`` per row (top-k and bottom-k by reward)."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release; after this the tracker gets no call."""


def numeric(row: dict[str, Any]) -> dict[str, float]:
    """The row's finite-or-not numbers (bools as 0/1); strings, None and lists left out:
    every backend takes scalars only."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, (int, float)):
            out[k] = float(v)
    return out


class TrackerSet:
    """The configured backends behind one worker thread (see the module docstring)."""

    def __init__(self, trackers: list[Tracker], max_pending: int = 1000, sample_k: int = 0, sample_every: int = 1,
                 decode: Callable[[list[int]], str] | None = None):
        self.trackers = trackers
        self.sample_k, self.sample_every, self.decode = sample_k, sample_every, decode
        self.failures: dict[str, int] = {t.name: 0 for t in trackers}
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._dropped = 0
        self._thread = threading.Thread(target=self._work, name="trackers", daemon=True)
        self._thread.start()
        # A trainer that fails mid-run never reaches its close(): flush what is queued at exit
        # anyway (a W&B offline file or MLflow run left half-written is worse than a late exit).
        atexit.register(self.close, 10.0)

    # ------------------------------------------------------------------ producer side (rank 0's loop)
    def submit(self, method: str, step: int, payload: Any) -> None:
        """Queue one call for every backend; never blocks the trainer (a full queue drops and counts)."""
        if not self.trackers:
            return
        try:
            self._queue.put_nowait((method, step, payload))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                log.warning("trackers: %d calls pending, dropping %s at step %d (a backend is too slow)",
                            self._queue.maxsize, method, step)

    def samples(self, step: int, batch: Any) -> None:
        """Queue the step's sample table (every ``sample_every`` steps; ``sample_k`` 0: never)."""
        if self.sample_k > 0 and step % self.sample_every == 0:
            self.submit("log_samples", step, pick_rows(batch, self.sample_k))

    def total_failures(self) -> int:
        return sum(self.failures.values()) + self._dropped

    def tee(self, writer: Any, method: str = "log_metrics") -> "Tee":
        """``writer`` (a MetricsWriter) whose every row also goes to the backends by ``method``."""
        return Tee(writer, self, method)

    def close(self, timeout: float = 60.0) -> None:
        """Drain the queue (bounded by ``timeout``), close every backend, log what failed."""
        if not self._thread.is_alive():
            return
        atexit.unregister(self.close)
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("trackers: not drained after %.0f s; closing what is left unflushed", timeout)
        bad = {k: v for k, v in self.failures.items() if v}
        if bad or self._dropped:
            log.warning("trackers: failed calls per backend %s, dropped %d", bad, self._dropped)

    # ------------------------------------------------------------------ consumer side (the thread)
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            method, step, payload = item
            if method == "log_samples":  # text once, for every backend
                try:
                    payload = decode_rows(step, payload, self.decode)
                except Exception:  # noqa: BLE001 - a tokenizer failing on odd ids: the ids instead
                    log.warning("trackers: cannot decode the sample table of step %d; writing token ids", step)
                    payload = decode_rows(step, payload, None)
            for t in self.trackers:
                self._call(t, lambda t=t: getattr(t, method)(step, payload), f"{method} at step {step}")
        for t in self.trackers:
            self._call(t, t.close, "close")

    def _call(self, t: Tracker, fn: Callable[[], None], what: str) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a tracker failing mid-run must not stop training
            self.failures[t.name] += 1
            if self.failures[t.name] == 1:
                log.exception("tracker %s failed (%s); training goes on, further failures are counted", t.name, what)
            else:
                log.warning("tracker %s failed (%s): %d failures so far", t.name, what, self.failures[t.name])


class Tee:
    """A MetricsWriter look-alike (``write``, ``path``) that writes the JSONL row first, with
    ``tracker_failures`` when any, then queues it for the backends."""

    def __init__(self, writer: Any, trackers: TrackerSet, method: str):
        self.writer, self.trackers, self.method = writer, trackers, method
        self.path = writer.path

    def write(self, record: dict[str, Any]) -> None:
        if self.method == "log_metrics" and (n := self.trackers.total_failures()):
            record = {**record, "tracker_failures": n}
        self.writer.write(record)
        step = record.get("step")
        if isinstance(step, int):
            self.trackers.submit(self.method, step, numeric(record))
