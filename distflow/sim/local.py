"""The validation step on this machine's cores: what the model predicts for a real run of bench/scale.py.

Why it exists: the cluster model (:mod:`cluster`) cannot be checked at 1024 workers, but its
parts can be checked where real processes run: N producer and N consumer processes (and a
controller) of ``bench/redistribute.py``'s harness, generation and update replaced by sleeps of
known length, real parts through the real channel and ``scatter``. Here every process shares
``cores`` cores (processor sharing, :class:`engine.Cores`): a cluster gives each process a core,
this machine gives 17 processes two. The same :class:`Calibration` costs as the cluster model
are charged: parts are posted (the ``auto`` channel on one host) or, with ``remote``, sent as acked
zmq messages (``--channel zmq``, as between hosts). Predicts wall time and CPU seconds per step.

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


def predict(design: str, st: LocalStep, cal: Calibration, cores: float = 2.0, remote: bool = False) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one step of ``design`` ("distflow" | "single"). ``remote``:
    every part is an acked zmq message (``--channel zmq``: as between hosts) instead of a post."""
    eng = Engine()
    cpu = Cores(eng, cores)
    n, b = st.n, st.batch_bytes
    ends: list[float] = []
    parts_in = {f"c{j}": 0 for j in range(n)}

    def send_cost(parts: int, nbytes: float, packed: bool) -> float:
        """A scatter of ``parts`` parts holding ``nbytes`` (packed into parts, or the whole batch as is)."""
        c = cal.scatter_s + cal.wake_s + (nbytes * cal.pack_s_per_byte if packed else 0.0)
        if remote:
            return c + parts * cal.remote_tx_s + nbytes * cal.remote_tx_s_per_byte
        return c + parts * cal.post_tx_s

    def recv_cost(nbytes: float) -> float:
        return cal.remote_rx_s + nbytes * cal.remote_rx_s_per_byte if remote else cal.post_rx_s

    def consumer_done(j: int) -> None:
        eng.after(st.update_s, lambda: ends.append(eng.now))

    def consumer_part(j: int, need: int, nbytes: float) -> None:
        parts_in[f"c{j}"] += 1
        if parts_in[f"c{j}"] == need:
            cpu.submit(f"c{j}", cal.take_s + cal.wake_s + nbytes * cal.join_s_per_byte, consumer_done, j)

    def post_to_consumers(need: int, per_part: float) -> None:
        for j in range(n):
            cpu.submit(f"c{j}", recv_cost(per_part), consumer_part, j, need, per_part * need)

    if design == "distflow":
        def produce(i: int) -> None:
            cpu.submit(f"p{i}", send_cost(n, b, True), post_to_consumers, n, b / n)
    elif design == "single":
        got = [0]

        def relay() -> None:
            work = cal.take_s + n * b * cal.join_s_per_byte + send_cost(n, n * b, True)
            cpu.submit("ctl", work, post_to_consumers, 1, b)

        def arrived() -> None:
            got[0] += 1
            if got[0] == n:
                relay()

        def produce(i: int) -> None:  # one part: posted (packed into the shared buffer) or the batch as is
            cpu.submit(f"p{i}", send_cost(1, b, not remote), lambda: cpu.submit("ctl", recv_cost(b), arrived))
    else:
        raise ValueError(f"design must be 'distflow' or 'single', got {design!r}")
    for i in range(n):
        eng.at(st.gen_s[i], produce, i)
    eng.run()
    if len(ends) != n:
        raise RuntimeError(f"model step incomplete: {len(ends)} of {n} consumers finished")
    return max(ends), sum(cpu.cpu.values())
