"""Trainer rank 0's side of held-out evaluation: one row of ``eval.jsonl`` per evaluation point.

Why here: the rollout nodes evaluate their shards of ``eval_dataset`` (:mod:`distflow.rollout.
evaluation`) and each sends a small summary straight to trainer rank 0, the process that
already writes the run's metrics into ``output_dir``; no other process sees the reports. A
point's row is written once every shard has reported; a shard reported twice (by its owner
and by a node that adopted it while the owner was down) counts once. At the end of the run
rank 0 waits, bounded, for the final point, and writes any point still missing shards as a
partial row (``eval_shards`` below ``eval_num_shards``) rather than dropping it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Sequence

from distflow.core.aio import woken
from distflow.transport import Envelope
from distflow.rl.eval_report import eval_row, report_problem
from distflow.trainer.metrics import MetricsWriter

log = logging.getLogger(__name__)


class EvalBook:
    """Collects the shards' summaries per point; ``writer`` (rank 0's ``eval.jsonl``) may come
    later than the first report: rows wait for it."""

    def __init__(self, num_shards: int, writer: MetricsWriter | None = None):
        self.num_shards = num_shards
        self.writer = writer
        self.points: dict[int, dict[int, dict[str, Any]]] = {}  # point -> shard -> report
        self.written: set[int] = set()
        self._unwritten: list[dict[str, Any]] = []
        self._changed = asyncio.Event()

    async def receive(self, env: Envelope) -> None:
        """The ``eval`` message handler; a malformed report is refused (the sender logs it)."""
        self.add(env.meta, env.sender)

    def add(self, meta: dict[str, Any], sender: str = "?") -> dict[str, Any] | None:
        """Record one shard's report; the point's row when this completed it, else None."""
        problem = report_problem(meta, self.num_shards)
        if problem:
            raise ValueError(f"eval report from {sender}: {problem}")
        point, shard = meta["point"], meta["shard"]
        if point in self.written:
            return None
        reports = self.points.setdefault(point, {})
        if shard not in reports or (reports[shard].get("error") and not meta.get("error")):
            reports[shard] = dict(meta)  # the first report counts, but a success replaces a failure
        self._changed.set()
        if len(self.points[point]) < self.num_shards:
            return None
        return self._emit(point)

    def attach(self, writer: MetricsWriter) -> None:
        self.writer = writer
        self._flush()

    async def wait_for(self, point: int, timeout: float, alive: Callable[[], bool],
                       progress: Callable[[], Any] | None = None) -> bool:
        """Until ``point``'s row is written (True), ``timeout`` passes without a change of
        ``progress()`` (the rollout nodes' gossiped evaluation progress), or ``alive()`` turns
        false (no rollout node left that has still to report); False then."""
        loop = asyncio.get_running_loop()
        deadline, seen = loop.time() + timeout, None if progress is None else progress()
        while point not in self.written:
            if progress is not None and (now := progress()) != seen:
                seen, deadline = now, loop.time() + timeout
            left = deadline - loop.time()
            if left <= 0 or not alive():
                return False
            self._changed.clear()
            await woken(self._changed.wait(), min(left, 1.0))
        return True

    def finish(self, expected: Sequence[int] = ()) -> None:
        """Write the points still missing shards, as partial rows, and name the ``expected``
        points no shard reported at all (a node whose weights passed two points at once
        evaluated the later one only)."""
        for point in sorted(set(self.points) - self.written):
            got = sorted(self.points[point])
            log.warning("eval at step %d: only eval shards %s of %d reported; writing a partial row",
                        point, got, self.num_shards)
            self._emit(point)
        if missing := sorted(set(expected) - self.written):
            log.warning("eval: no report for the evaluation points at steps %s (weights passed them together "
                        "with a later point, or the nodes stopped first)", missing)

    def _emit(self, point: int) -> dict[str, Any]:
        row = eval_row(point, list(self.points[point].values()), self.num_shards)
        self.written.add(point)
        self._unwritten.append(row)
        self._flush()
        mean = row["eval_reward_mean"]
        log.info("eval at step %d: reward_mean %s over %d samples of %d prompts (weights v%d-v%d)", point,
                 "-" if mean is None else f"{mean:.4f}", row["eval_samples"], row["eval_prompts"],
                 row["policy_version_min"], row["policy_version_max"])
        return row

    def _flush(self) -> None:
        if self.writer is None:
            return
        for row in self._unwritten:
            self.writer.write(row)
        self._unwritten.clear()
