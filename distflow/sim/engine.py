"""The event engine: a clock and a heap of timed callbacks, and the two kinds of server the model needs.

Why this shape: a step is a handful of phases whose durations depend on who waits for whom (a
trainer waits for its last part; a controller works through batches in the order they arrive),
so the model is written as callbacks on a clock rather than as one closed formula. Two servers
cover every shared thing: :class:`Fifo` (one job at a time, arrival order: a network link's one
direction, or one single-threaded process when it has a core of its own) and :class:`Cores`
(processor sharing: each process runs its own jobs in order, and the processes with work share
``cores`` cores equally, as Linux's scheduler roughly does on an oversubscribed machine).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any, Callable, Sequence


class Engine:
    """A simulated clock: ``at(t, fn, *args)`` runs ``fn(*args)`` at time t; ties run in scheduling order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        if t < self.now - 1e-12:
            raise ValueError(f"cannot schedule at {t} before now ({self.now})")
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn, args))
        self._seq += 1

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float = math.inf) -> float:
        """Run events up to ``until``; returns the clock (the time of the last event run)."""
        while self._heap and self._heap[0][0] <= until:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)
        return self.now


class Fifo:
    """One server, jobs in submission order (submit in time order, as callbacks on the clock do).

    ``rate`` turns an amount into seconds (a link: bytes at ``rate`` bytes/s; a process: seconds
    at rate 1); ``latency`` is added after the service (a link's propagation, not occupying it)."""

    def __init__(self, engine: Engine, name: str, rate: float = 1.0, latency: float = 0.0):
        self.engine, self.name, self.rate, self.latency = engine, name, rate, latency
        self.free_at = 0.0
        self.busy = 0.0  # total service time, for utilisation

    def submit(self, amount: float, done: Callable[..., Any] | None = None, *args: Any) -> float:
        """Queue ``amount``; returns when it is delivered (service end + latency), calling ``done`` then."""
        work = amount / self.rate
        start = max(self.engine.now, self.free_at)
        self.free_at = start + work
        self.busy += work
        end = self.free_at + self.latency
        if done is not None:
            self.engine.at(end, done, *args)
        return end


def fifo_finish(arrivals: Sequence[float], costs: Sequence[float] | float, start: float = 0.0) -> float:
    """When one server that is free from ``start`` finishes jobs arriving at ``arrivals`` (any order;
    served in arrival order) each taking ``costs`` (one per job, or the same for all). The closed
    form of a :class:`Fifo` fed those jobs, for the many small parts a trainer receives (N per step,
    N x N in all: one event each would make the model slower than the cluster it describes)."""
    order = sorted(range(len(arrivals)), key=arrivals.__getitem__)
    t = start
    if isinstance(costs, (int, float)):
        for i in order:
            t = max(t, arrivals[i]) + costs
    else:
        for i in order:
            t = max(t, arrivals[i]) + costs[i]
    return t


class Cores:
    """``cores`` cores shared by processes: each process runs its jobs one after another (one
    thread), every process with work runs at ``min(1, cores / busy_processes)`` of a core.

    Why processor sharing: on this 2-core machine 9-17 processes of a validation run are awake
    at once; a process that has its own core in a cluster gets a fraction of one here, and the
    step's wall time stretches by exactly that. ``cores=math.inf`` is a cluster (no contention)."""

    def __init__(self, engine: Engine, cores: float = math.inf):
        self.engine, self.cores = engine, cores
        self.queues: dict[str, deque[list[Any]]] = {}  # process -> [remaining, done, args] jobs
        self.cpu: dict[str, float] = {}  # CPU seconds used per process
        self._last = 0.0
        self._token = 0

    def busy(self) -> int:
        return sum(1 for q in self.queues.values() if q)

    def rate(self) -> float:
        n = self.busy()
        return 0.0 if n == 0 else min(1.0, self.cores / n)

    def _advance(self) -> None:
        dt = self.engine.now - self._last
        self._last = self.engine.now
        if dt <= 0:
            return
        r = self.rate()
        for proc, q in self.queues.items():
            if q:
                q[0][0] -= dt * r
                self.cpu[proc] = self.cpu.get(proc, 0.0) + dt * r

    def _reschedule(self) -> None:
        self._token += 1
        heads = [q[0][0] for q in self.queues.values() if q]
        if heads:
            r = self.rate()
            self.engine.after(max(0.0, min(heads)) / r, self._tick, self._token)

    def _tick(self, token: int) -> None:
        if token != self._token:
            return  # superseded by a later change of the busy set
        self._advance()
        finished = []
        for q in self.queues.values():
            while q and q[0][0] <= 1e-12:
                finished.append(q.popleft())
        self._reschedule()
        for _, done, args in finished:
            if done is not None:
                done(*args)

    def submit(self, proc: str, seconds: float, done: Callable[..., Any] | None = None, *args: Any) -> None:
        """Queue ``seconds`` of CPU work on process ``proc``; ``done(*args)`` when it is finished."""
        self._advance()
        q = self.queues.setdefault(proc, deque())
        if seconds <= 0 and not q:
            self.engine.at(self.engine.now, done, *args) if done is not None else None
            return
        q.append([seconds, done, args])
        self._reschedule()
