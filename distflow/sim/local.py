"""The validation step on this machine's cores: what the model predicts for a real run of bench/scale.py.

Why it exists: the cluster model (:mod:`cluster`) cannot be checked at 1024 workers, but its
parts can be checked where real processes run: N producer and N consumer processes (and a
controller) of ``bench/redistribute.py``'s harness, generation and update replaced by sleeps of
known length, real parts through the real channel and ``scatter``. Here every process shares
``cores`` cores (processor sharing, :class:`engine.Cores`): a cluster gives each process a core,
this machine gives 17 processes two. The same :class:`Calibration` costs as the cluster model
are charged (all parts are posted: one host). Predicts wall time and CPU seconds per step.

The single controller here is the bench's relay (gather the step, one split), which is what its
harness runs; the cluster model's per-batch controller differs only in how many splits it does.
"""

from __future__ import annotations

from dataclasses import dataclass

from distflow.sim.calibrate import Calibration
from distflow.sim.engine import Cores, Engine


@dataclass(frozen=True)
class LocalStep:
    """One validation step: per producer ``samples`` samples of ``sample_bytes`` each, generation
    sleeps ``gen_s`` (one per producer), update sleep ``update_s``; owner routing splits each
    batch about evenly (the harness's ids hash evenly: the model splits bytes equally)."""

    n: int
    samples: int
    sample_bytes: int
    gen_s: tuple[float, ...]
    update_s: float

    @property
    def batch_bytes(self) -> int:
        return self.samples * self.sample_bytes


def predict(design: str, st: LocalStep, cal: Calibration, cores: float = 2.0) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one step of ``design`` ("distflow" | "single")."""
    eng = Engine()
    cpu = Cores(eng, cores)
    n, b = st.n, st.batch_bytes
    ends: list[float] = []
    parts_in = {f"c{j}": 0 for j in range(n)}

    def consumer_done(j: int) -> None:
        eng.after(st.update_s, lambda: ends.append(eng.now))

    def consumer_part(j: int, need: int, nbytes: float) -> None:
        parts_in[f"c{j}"] += 1
        if parts_in[f"c{j}"] == need:
            cpu.submit(f"c{j}", cal.take_s + cal.wake_s + nbytes * cal.join_s_per_byte, consumer_done, j)

    def post_to_consumers(need: int, per_part: float) -> None:
        for j in range(n):
            cpu.submit(f"c{j}", cal.post_rx_s, consumer_part, j, need, per_part * need)

    if design == "distflow":
        def produce(i: int) -> None:
            work = cal.scatter_s + cal.wake_s + n * cal.post_tx_s + b * cal.pack_s_per_byte
            cpu.submit(f"p{i}", work, post_to_consumers, n, b / n)
    elif design == "single":
        got = [0]

        def relay() -> None:
            work = (cal.take_s + cal.wake_s + n * b * cal.join_s_per_byte + cal.scatter_s + n * cal.post_tx_s
                    + n * b * cal.pack_s_per_byte)
            cpu.submit("ctl", work, post_to_consumers, 1, b)

        def arrived() -> None:
            got[0] += 1
            if got[0] == n:
                relay()

        def produce(i: int) -> None:
            work = cal.scatter_s + cal.wake_s + cal.post_tx_s + b * cal.pack_s_per_byte
            cpu.submit(f"p{i}", work, lambda: cpu.submit("ctl", cal.post_rx_s, arrived))
    else:
        raise ValueError(f"design must be 'distflow' or 'single', got {design!r}")
    for i in range(n):
        eng.at(st.gen_s[i], produce, i)
    eng.run()
    if len(ends) != n:
        raise RuntimeError(f"model step incomplete: {len(ends)} of {n} consumers finished")
    return max(ends), sum(cpu.cpu.values())
