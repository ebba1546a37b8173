"""Real validation runs for bench/scale.py: N producers -> N consumers, compute replaced by sleeps.

Why: the scaling model is only as good as its prediction of what runs. This starts real
processes with ``bench/redistribute.py``'s harness (its ``Worker`` processes: the project's
channel ``make_channel("auto")``, ``scatter``, ``open_ingress`` / ``gather_step``, uvloop), and
times steps in which each producer sleeps its "generation" time, then scatters its batch (peer to
peer, or to one controller process that gathers the step and splits it: the bench's relay), and
each consumer takes its samples then sleeps its "update" time. Wall time per step is from "go"
to the last consumer's end; CPU per step is every process's CPU (all threads) over the step.
Repetitions alternate the two designs (the host is shared: drift hits both); medians are kept.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from redistribute import PER_PRODUCER, PROMPT, RESPONSE, Worker, cpu_ns, get, now

SAMPLE_BYTES = PROMPT * 8 + RESPONSE * 16 + 64  # int64 tokens, fp32 logprobs and mask (+ scalars)


class SleepCluster:
    """N producers, N consumers and a controller, one process each, on this host's channel."""

    def __init__(self, n: int, samples: int, kind: str = "auto"):
        self.n, self.samples = n, samples
        self.prods = [Worker() for _ in range(n)]
        self.cons = [Worker() for _ in range(n)]
        self.ctrl = Worker()
        fp = [w.ask("init", kind=kind, node=f"p{i}", batch=True, seed=i, samples=samples)
              for i, w in enumerate(self.prods)]
        fc = [w.ask("init", kind=kind, node=f"c{i}") for i, w in enumerate(self.cons)]
        ctl = get(self.ctrl.ask("init", kind=kind, node="ctl"))
        for f in fp:
            get(f)
        self.cons_eps = [[f"c{i}", "127.0.0.1", get(f)["port"]] for i, f in enumerate(fc)]
        self.ctrl_ep = [["ctl", "127.0.0.1", ctl["port"]]]
        self.prod_ids = [f"p{i}" for i in range(n)]
        self.step_no = 0

    def procs(self, design: str) -> list[Worker]:
        return [*self.prods, *self.cons, *([self.ctrl] if design == "single" else [])]

    def step(self, design: str, gen_s: list[float], update_s: float) -> tuple[float, float]:
        """One step; (wall seconds, CPU seconds of every process of the design)."""
        step, self.step_no = self.step_no, self.step_no + 1
        if design == "distflow":
            takes = [w.ask("take", step=step, sources=self.prod_ids, after=update_s) for w in self.cons]
            targets, relay = self.cons_eps, None
        else:
            takes = [w.ask("take", step=step, sources=["ctl"], after=update_s) for w in self.cons]
            relay = self.ctrl.ask("relay", step=step, sources=self.prod_ids, consumers=self.cons_eps)
            targets = self.ctrl_ep
        time.sleep(0.05)  # consumers waiting before the clock starts
        procs = self.procs(design)
        before = [cpu_ns(w.proc.pid) for w in procs]
        t0 = now()
        sends = [w.ask("scatter", step=step, consumers=targets, rank=i, delay=gen_s[i])
                 for i, w in enumerate(self.prods)]
        for f in sends:
            get(f)
        if relay is not None:
            get(relay)
        done = [get(f) for f in takes]
        wall = max(d.get("end", d["t"]) for d in done) - t0
        time.sleep(0.05)  # trailing work (releases) before reading CPU
        after = [cpu_ns(w.proc.pid) for w in procs]
        got = sum(len(d["ids"]) for d in done)
        if got != self.n * self.samples:
            raise AssertionError(f"step {step} ({design}): {got} samples delivered, {self.n * self.samples} expected")
        self.last_cpu = [(a - b) / 1e9 for a, b in zip(after, before)]  # per process: producers, consumers, ctl
        return wall, sum(self.last_cpu)

    def stop(self) -> None:
        for w in [*self.prods, *self.cons, self.ctrl]:
            w.stop()


def gen_schedule(n: int, base: float, spread: float) -> list[float]:
    """Known "generation" sleeps with a tail: producer i sleeps base + spread * (i / (n-1))^2."""
    return [base + spread * ((i / (n - 1)) ** 2 if n > 1 else 0.0) for i in range(n)]


def measure(n: int, samples: int, reps: int, base: float, spread: float, update_s: float,
            kind: str = "auto") -> dict[str, Any]:
    """Median wall and CPU per step of both designs at N, ``reps`` alternating repetitions (after 2 warm-ups)."""
    gen = gen_schedule(n, base, spread)
    cl = SleepCluster(n, samples, kind)
    try:
        for i in range(2):
            for d in ("distflow", "single"):
                cl.step(d, gen, update_s)
        res: dict[str, list[tuple[float, float]]] = {"distflow": [], "single": []}
        for i in range(reps):
            for d in (("distflow", "single") if i % 2 == 0 else ("single", "distflow")):
                res[d].append(cl.step(d, gen, update_s))
    finally:
        cl.stop()
    out: dict[str, Any] = {"n": n, "samples": samples, "gen_s": gen, "update_s": update_s}
    for d, rows in res.items():
        out[f"{d}_wall_s"] = statistics.median(r[0] for r in rows)
        out[f"{d}_cpu_s"] = statistics.median(r[1] for r in rows)
        out[f"{d}_cpu_range"] = [min(r[1] for r in rows), max(r[1] for r in rows)]
    return out


def measure_wake(reps: int = 6, n: int = 2, samples: int = PER_PRODUCER, sleep_s: float = 0.1) -> float:
    """CPU seconds a process pays more per step when it slept between steps (cold caches, timers):
    the same peer-to-peer step back to back and with ``sleep_s`` sleeps, alternating; the median
    difference of total CPU divided by the 2N processes. A property of the machine and its load,
    measured apart from the validation steps it is then charged to."""
    cl = SleepCluster(n, samples)
    try:
        for _ in range(2):
            cl.step("distflow", [0.0] * n, 0.0)
            cl.step("distflow", [sleep_s] * n, sleep_s / 2)
        diffs = []
        for _ in range(reps):
            _, cold = cl.step("distflow", [sleep_s] * n, sleep_s / 2)
            _, warm = cl.step("distflow", [0.0] * n, 0.0)
            diffs.append(cold - warm)
    finally:
        cl.stop()
    return statistics.median(diffs) / (2 * n)


__all__ = ["PER_PRODUCER", "SAMPLE_BYTES", "SleepCluster", "gen_schedule", "measure", "measure_wake"]
