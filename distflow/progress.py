"""How far each trainer rank is, down to the collective it is in, and which rank is stuck.

Why it exists: the ranks of one torch.distributed group move through a step together (its
collectives pair them), so one rank that hangs holds every other in a collective, and a collective
deadline long enough for a slow checkpoint (``collective_timeout_s``) names nothing for half an
hour. A dead rank's process is found by the mesh; a rank alive but stuck only by comparing how far
each rank got. Two counters travel in each trainer's mesh metadata:

* ``beat`` (:func:`beat_of`): the step and the point in it: its start (waiting for its samples),
  each stage of its train half, the weight publish, its end; set by the trainer node;
* ``coll`` (``[beat, n]``): the collectives this rank has called since its beat last moved
  (:data:`PROGRESS`; the trainer counts every collective it calls: FSDP2's all-gathers and
  reduce-scatters through FSDP2's comm hooks, and its own: :mod:`distflow.trainer.collectives`).

A rank's *position* is ``(beat, n)``; the rules (:class:`ProgressWatch`), each after
``hang_timeout_s``:

1. **A peer behind me is stuck**: its position stays below mine (it has not reached the
   collective I wait in: a stage of its own it has not left, a hang between two of the model's
   all-gathers, a loss function that never returns). Collective counts are compared within the
   train half's stages only: at the step's start a rank waits for its own samples, and in the
   publish for its own rollout nodes, where a rank behind is slow, not hung.
2. **A collective every rank entered and none left is hung**: my oldest collective still pending
   was issued in the train half that long ago, and every peer's position is at it or past it.
   No rank can be blamed (each entered it): the message names the collective, its index in the
   stage, its op and size, and every rank treats the group as lost.

Equal positions otherwise are a shared wait, never a hang.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

__all__ = ["BEATS_PER_STEP", "LAST_STAGE", "PROGRESS", "PUBLISH", "STEP_DONE", "Pending", "Progress", "ProgressWatch", "beat_of",
           "describe_position", "hung_message", "in_train_half", "position_of", "stuck_message"]

# A rank's progress counter (mesh meta ``beat``): BEATS_PER_STEP points per step. Point 0: the step's
# start (waiting for its samples); 1 + i: before the i-th stage of its train half (distflow.step.train_half),
# so a rank stuck in one stage is behind a rank that went on to the next stage's collectives; PUBLISH: its
# weights going to the rollout nodes it serves; STEP_DONE: the step trained and its weights published.
BEATS_PER_STEP = 100
STEP_DONE = BEATS_PER_STEP - 1
PUBLISH = STEP_DONE - 1
LAST_STAGE = PUBLISH - 1
PENDING_KEPT = 4096  # collectives remembered while they are pending (the oldest are forgotten beyond)


def beat_of(step: int, point: int = 0) -> int:
    """The progress counter of ``point`` (0 .. STEP_DONE) of ``step``."""
    if not 0 <= point <= STEP_DONE:
        raise ValueError(f"beat point {point} is not within 0..{STEP_DONE}")
    return step * BEATS_PER_STEP + point


def in_train_half(beat: int) -> bool:
    """Whether ``beat`` is a stage of the train half (where every rank runs the same collectives on
    its own samples, so collective counts are comparable)."""
    return 1 <= beat % BEATS_PER_STEP <= LAST_STAGE


def describe_position(pos: int | tuple[int, int], at: str | None = None) -> str:
    """A position (or a bare beat) in words: the step, where in it (``at``: the stage it names) and,
    in the train half, the collectives called in it."""
    beat, n = (pos, 0) if isinstance(pos, int) else pos
    step, point = divmod(beat, BEATS_PER_STEP)
    where = at or ("its samples" if point == 0 else "done" if point == STEP_DONE else
                   "publish" if point == PUBLISH else f"stage {point - 1}")
    return f"step {step} ({where}" + (f", after {n} collective{'s' * (n != 1)}" if n else "") + ")"


class Pending(NamedTuple):
    """One collective still pending on this rank; ``index``: its count in the stage (1 = the stage's
    first collective)."""

    beat: int
    index: int
    op: str
    nbytes: int
    age_s: float

    def describe(self, at: str | None = None) -> str:
        size = f", {self.nbytes / 2**20:.2f} MiB" if self.nbytes else ""
        return f"collective {self.index} ({self.op}{size}) of {describe_position(self.beat, at)}"


@dataclass(slots=True)
class _Entry:
    """A collective this rank entered: done when its call returned (synchronous) or its work completed."""

    beat: int
    index: int
    op: str
    nbytes: int
    t0: float
    work: Any = None
    done: bool = False

    def completed(self) -> bool:
        if self.done or self.work is None:
            return self.done
        try:
            return bool(self.work.is_completed())
        except Exception:  # noqa: BLE001 - a failed collective is not pending: its caller raises
            return True


class Progress:
    """This process's position: its beat and the collectives it called since the beat moved, and the
    ones still pending (with their ``torch.distributed`` work, asked ``is_completed()``: a collective
    on a GPU is done when its kernel is, not when the call returned). Thread-safe: the training thread
    (and autograd's) counts, the node's event loop reads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self.beat, self.n = 0, 0
        self.ops: Counter[str] = Counter()  # every collective entered, by op, over the process's life
        self._pending: deque[_Entry] = deque()

    def mark(self, beat: int) -> None:
        """The beat moved (a new stage, a new step): collectives count from 0 again."""
        with self._lock:
            self.beat, self.n = beat, 0

    def position(self) -> tuple[int, int]:
        with self._lock:
            return self.beat, self.n

    def enter(self, op: str, nbytes: int = 0) -> _Entry:
        """A collective is being called: counted now (a rank that hangs inside it has entered it)."""
        with self._lock:
            self._prune()
            self.n += 1
            self.ops[op] += 1
            entry = _Entry(self.beat, self.n, op, int(nbytes), self._clock())
            self._pending.append(entry)
            if len(self._pending) > PENDING_KEPT:
                self._pending.popleft()
            return entry

    @staticmethod
    def issued(entry: _Entry, work: Any) -> None:
        """The call returned ``work`` (asynchronous): pending until ``work.is_completed()`` (None: done)."""
        entry.work, entry.done = work, work is None

    @staticmethod
    def left(entry: _Entry) -> None:
        """The call returned, done (synchronous), or raised."""
        entry.done = True

    def _prune(self) -> None:
        while self._pending and self._pending[0].completed():
            self._pending.popleft()

    def oldest_pending(self) -> Pending | None:
        """The oldest collective this rank entered that has not completed, or None."""
        with self._lock:
            self._prune()
            if not self._pending:
                return None
            e = self._pending[0]
            return Pending(e.beat, e.index, e.op, e.nbytes, self._clock() - e.t0)


PROGRESS = Progress()  # this process's (a trainer rank is one process: the default process group is per process)


def position_of(meta: dict) -> tuple[int, int] | None:
    """A member's position from its mesh metadata (``beat``, ``coll``), or None before its first beat.
    Its collective count only within the train half, and only when it is that beat's."""
    beat = meta.get("beat")
    if type(beat) is not int:
        return None
    coll = meta.get("coll")
    n = coll[1] if (isinstance(coll, (list, tuple)) and len(coll) == 2 and coll[0] == beat
                    and type(coll[1]) is int and in_train_half(beat)) else 0
    return beat, n


class ProgressWatch:
    """Which ranks of a group are stuck, from their positions (:func:`position_of`), and whether the
    group is hung inside a collective (my oldest pending one, :meth:`Progress.oldest_pending`): the
    rules in this module's docstring. A peer's time behind counts from when this node first saw it
    behind, at that position."""

    def __init__(self, hang_s: float):
        self.hang_s = hang_s
        self.behind: dict[str, tuple[Any, Any, float]] = {}  # peer -> (its position, mine, since when)

    def stuck(self, positions: dict[str, Any], me: str, now: float) -> list[tuple[str, Any, Any, float]]:
        """(peer, its position, mine, seconds behind) of every peer behind me for ``hang_s`` or more."""
        mine = positions.get(me)
        out = []
        for peer, pos in positions.items():
            if peer == me or mine is None or pos >= mine:
                self.behind.pop(peer, None)
                continue
            seen = self.behind.get(peer)
            if seen is None or seen[0] != pos:
                seen = self.behind[peer] = (pos, mine, now)
            if now - seen[2] >= self.hang_s:
                out.append((peer, pos, mine, now - seen[2]))
        return out

    def hung(self, positions: dict[str, Any], me: str, pending: Pending | None) -> bool:
        """Rule 2: my oldest pending collective, issued in the train half ``hang_s`` ago or more, that
        every peer has entered too."""
        peers = [pos for peer, pos in positions.items() if peer != me]
        return (pending is not None and pending.age_s >= self.hang_s and in_train_half(pending.beat) and bool(peers)
                and all(pos >= (pending.beat, pending.index) for pos in peers))

    def check(self, positions: dict[str, Any], now: float, me: str, role: str, at: dict[str, str] | None = None,
              pending: Pending | None = None) -> tuple[list[str], str] | None:
        """``(lost ranks, why)`` when either rule holds (the stuck peers, :func:`stuck_message`; or the
        whole group, :func:`hung_message`), else None."""
        at = at or {}
        stuck = self.stuck(positions, me, now)
        if stuck:
            return [peer for peer, *_ in stuck], stuck_message(role, stuck, me, at)
        if self.hung(positions, me, pending):
            assert pending is not None
            peers = sorted(p for p in positions if p != me)
            return peers, hung_message(role, me, peers, pending, at)
        return None


def stuck_message(role: str, stuck: list[tuple[str, Any, Any, float]], me: str, at: dict[str, str]) -> str:
    """Members alive but stuck (:class:`ProgressWatch`), named: they are treated as dead, so the group
    stops and a supervising launcher restarts it."""
    return "; ".join(
        f"{role} rank {peer} is stuck: its progress stayed at {describe_position(pos, at.get(peer))} for {secs:.0f}s "
        f"while {me} reached {describe_position(mine, at.get(me))} (hang_timeout_s)" for peer, pos, mine, secs in stuck
    ) + f": the {role} group cannot go on with it; treated as dead"


def hung_message(role: str, me: str, peers: list[str], pending: Pending, at: dict[str, str]) -> str:
    """Every rank of the group entered one collective and it has not completed here for ``hang_timeout_s``:
    no rank can be blamed, the group is lost as a whole (every rank says so)."""
    return (f"the {role} group is hung in {pending.describe(at.get(me))}: every rank entered it "
            f"({', '.join(sorted([me, *peers]))}) and it has not completed on {me} for {pending.age_s:.0f}s "
            f"(hang_timeout_s): the {role} group cannot go on; treated as a dead rank")
