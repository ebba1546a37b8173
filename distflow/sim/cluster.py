"""One synchronous RL step at cluster scale, DistFlow against ``controller: single``.

Why this shape: both designs run the same compute (the same samples generated, the same tokens
trained); they differ only in how a step's samples reach their trainer ranks, and the model
keeps exactly that difference. N workers, one GPU each, ``gpus_per_host`` to a host; each GPU
hosts a rollout node and a trainer rank (``colocate: true``), ``max_staleness: 0``:

1. every rollout node generates its prompts' groups (cost table; the longest response bounds it);
2. DistFlow: each rollout node splits its batch by owner (``distflow.buffer.routing``: the
   nodes' own function on the same sample ids) and sends each trainer its part: posted to
   trainers on its host, an acked message over the host's NIC to the others;
   ``controller: single`` as built (``distflow/stage_worker.py``): each rollout node sends its
   whole batch to the controller, which forwards each batch, as it arrives, split to all N
   trainers (N x N parts from one process); ``controller="gathered"`` is the cheaper variant of
   ``bench/redistribute.py``'s relay (gather the step, one split: N parts);
3. each trainer takes its parts (a FIFO of receive costs on its own process), joins them, and
   the trainer group updates (FSDP: the rank with the most tokens sets the pace), then
   publishes weights to the rollout node on its GPU.

Process CPU and link time are :mod:`engine` servers; the CPU costs are a :class:`Calibration`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distflow.buffer.routing import owners, token_partition
from distflow.sim.calibrate import Calibration
from distflow.sim.costs import CostTable, Network, Workload
from distflow.sim.engine import Engine, Fifo

BALANCES = ("owner", "tokens", "tokens_unrotated")


@dataclass
class Sample:
    sample_id: str
    prompt_len: int
    response_len: int
    nbytes: int

    @property
    def tokens(self) -> int:
        return self.prompt_len + self.response_len


@dataclass
class StepResult:
    design: str
    n: int
    step_s: float
    tokens: int
    gen_s: float  # slowest rollout node's generation
    route_s: float  # last generation end -> last trainer holding its samples
    train_s: float  # update (slowest rank) + exposed collectives
    sync_s: float  # weight gather + publish
    bytes: int
    router_cpu_s: float = 0.0  # the controller's CPU this step (0 for DistFlow: no router)
    router_link_s: float = 0.0  # the controller's busier NIC direction this step
    max_worker_cpu_s: float = 0.0  # busiest rollout / trainer process's data-plane CPU
    trainer_tokens_max_over_mean: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s_per_worker(self) -> float:
        return self.tokens / self.step_s / self.n


def make_batches(n: int, wl: Workload, seed: int, step: int = 0) -> list[list[Sample]]:
    """Each rollout rank's samples for one step: ``prompts_per_worker`` prompts x ``group_size``,
    ids as the rollout stage names them (``e<epoch>:<row>:s<j>``), lengths from the workload."""
    rng = random.Random(f"{seed}:{n}:{step}")
    out = []
    for r in range(n):
        lens = wl.response_lengths(rng, wl.samples_per_worker)
        batch, k = [], 0
        for p in range(wl.prompts_per_worker):
            row = (step * n + r) * wl.prompts_per_worker + p
            for j in range(wl.group_size):
                batch.append(Sample(f"e0:{row}:s{j}", wl.prompt_len, lens[k], wl.sample_bytes(lens[k])))
                k += 1
        out.append(batch)
    return out


def route(batch: list[Sample], n: int, balance: str = "owner", source_rank: int = 0) -> list[list[int]]:
    """Sample indices per trainer rank, by the routing module's own functions.

    ``owner``: ``routing.owners`` (blake2b of the id mod N), as scatter's default. ``tokens``:
    ``routing.token_partition`` per producer with part k sent to rank (k + source_rank) mod N, as
    ``route_by: tokens`` does (``redistribute.groups_for``). ``tokens_unrotated``: every producer's
    part k to rank k, as it did before this model showed that the heaviest part of every producer
    then lands on rank 0."""
    if balance == "owner":
        groups: list[list[int]] = [[] for _ in range(n)]
        for i, r in enumerate(owners([s.sample_id for s in batch], n)):
            groups[r].append(i)
        return groups
    parts = token_partition([s.tokens for s in batch], n)
    if balance == "tokens_unrotated":
        return parts
    if balance == "tokens":
        return [parts[(r - source_rank) % n] for r in range(n)]
    raise ValueError(f"unknown balance {balance!r}; expected one of {BALANCES}")


def generation_s(batch: list[Sample], cost: CostTable) -> float:
    """Continuous batching: throughput-bound, unless the longest response's own decode is longer."""
    prompt = sum(s.prompt_len for s in batch) / cost.prefill_tok_s
    resp = [s.response_len for s in batch]
    return prompt + max(sum(resp) / cost.gen_tok_s, max(resp) / cost.seq_tok_s)


def collectives_s(n: int, cost: CostTable, net: Network) -> tuple[float, float]:
    """(exposed FSDP collectives of one update, weight gather + publish) for N ranks, bf16.

    FSDP moves 3 x the bf16 parameters per rank per step (all-gather forward and backward,
    reduce-scatter of gradients), ``collective_overlap`` of it hidden under compute; the
    weight sync all-gathers them once more, then hands them over NVLink / CUDA IPC on the GPU."""
    pbytes = 2 * cost.params
    per_gpu = net.nvlink_bytes_s if n <= net.gpus_per_host else net.inter_bytes_s * net.nics_per_host / net.gpus_per_host
    frac = (n - 1) / n
    hops = 2 * math.log2(max(2, n)) * net.latency_s  # tree-ish latency per collective (small)
    exposed = (1 - net.collective_overlap) * 3 * pbytes * frac / per_gpu + hops
    sync = pbytes * frac / per_gpu + pbytes / net.nvlink_bytes_s + hops
    return exposed, sync


class _Hosts:
    """Each host's NIC, one :class:`Fifo` per direction (the controller's host too)."""

    def __init__(self, eng: Engine, net: Network, hosts: int, ctrl_nics: int):
        rate = net.inter_bytes_s * net.nics_per_host
        self.egress = [Fifo(eng, f"h{h}-out", rate, net.latency_s) for h in range(hosts)]
        self.ingress = [Fifo(eng, f"h{h}-in", rate) for h in range(hosts)]
        crate = net.inter_bytes_s * ctrl_nics
        self.ctrl_out, self.ctrl_in = Fifo(eng, "ctl-out", crate, net.latency_s), Fifo(eng, "ctl-in", crate)


def fifo_finish_columns(arrive: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """:func:`engine.fifo_finish` of every column at once (column t: trainer t's parts, one per
    producer row): served in arrival order, a FIFO ends at max_k(a_k + the costs from k on)."""
    order = np.argsort(arrive, axis=0, kind="stable")
    a = np.take_along_axis(arrive, order, axis=0)
    c = np.take_along_axis(cost, order, axis=0)
    tail = np.flip(np.cumsum(np.flip(c, axis=0), axis=0), axis=0)
    return (a + tail).max(axis=0)


class _Step:
    """The state of one simulated step: who owns what, when each part reaches its trainer."""

    def __init__(self, n: int, wl: Workload, net: Network, cal: Calibration, seed: int, step: int, balance: str):
        self.n, self.net, self.cal = n, net, cal
        self.batches = make_batches(n, wl, seed, step)
        self.bytes = np.zeros((n, n), dtype=np.int64)  # [producer, trainer] part bytes
        self.tokens = np.zeros(n, dtype=np.int64)  # per trainer
        for p, b in enumerate(self.batches):
            for t, g in enumerate(route(b, n, balance, p)):
                if g:
                    self.bytes[p, t] = sum(b[i].nbytes for i in g)
                    self.tokens[t] += sum(b[i].tokens for i in g)
        self.host = np.arange(n) // net.gpus_per_host
        self.arrive = np.full((n, n), np.nan)  # [part source row, trainer]: when the part is there
        self.rx = np.zeros((n, n))  # receive CPU of each part
        self.slow = 1.0 / max(1e-9, 1.0 - cal.mesh_cpu_fraction)  # each process also gossips

    def rx_cost(self, nbytes: np.ndarray, remote: bool) -> np.ndarray:
        cal = self.cal
        if remote:
            return self.slow * (cal.remote_rx_s + nbytes * cal.remote_rx_s_per_byte)
        return np.full(nbytes.shape, self.slow * cal.post_rx_s)

    def split_cpu(self, pbytes: np.ndarray, src_host: int) -> float:
        """One scatter of parts ``pbytes`` (per trainer) from ``src_host`` (-1: a host of no trainer)."""
        cal, local = self.cal, self.host == src_host
        c = cal.scatter_s + cal.wake_s + float(pbytes.sum()) * cal.pack_s_per_byte
        c += int(local.sum()) * cal.post_tx_s
        c += int((~local).sum()) * cal.remote_tx_s + float(pbytes[~local].sum()) * cal.remote_tx_s_per_byte
        return self.slow * c

    def send(self, eng: Engine, row: int, pbytes: np.ndarray, src_host: int, out_link: Fifo, links: _Hosts) -> None:
        """The parts of a split leave ``src_host`` now: same-host ones posted, the rest per host over ``out_link``."""
        hosts = self.host
        local = hosts == src_host
        self.arrive[row, local] = eng.now
        self.rx[row, local] = self.rx_cost(pbytes[local], False)
        g = self.net.gpus_per_host
        for h in range(int(hosts[-1]) + 1):
            if h == src_host:
                continue
            sl = slice(h * g, min(self.n, (h + 1) * g))
            nb = int(pbytes[sl].sum())
            self.rx[row, sl] = self.rx_cost(pbytes[sl], True)
            if nb:
                out_link.submit(nb, self._land, eng, row, sl, links.ingress[h], nb)
            else:  # an empty part is still a message (the end-of-step marker)
                self.arrive[row, sl] = out_link.submit(0)

    def _land(self, eng: Engine, row: int, sl: slice, ingress: Fifo, nb: int) -> None:
        self.arrive[row, sl] = ingress.submit(nb)


def simulate(design: str, n: int, cost: CostTable, wl: Workload, net: Network, cal: Calibration, *,
             seed: int = 0, step: int = 0, balance: str = "owner", controller: str = "per_batch",
             ctrl_nics: int = 1) -> StepResult:
    """One step of ``design`` ("distflow" | "single") with N workers; see the module docstring."""
    if design not in ("distflow", "single"):
        raise ValueError(f"design must be 'distflow' or 'single', got {design!r}")
    if controller not in ("per_batch", "gathered"):
        raise ValueError(f"controller must be 'per_batch' or 'gathered', got {controller!r}")
    st = _Step(n, wl, net, cal, seed, step, balance)
    gen = [generation_s(b, cost) for b in st.batches]
    eng = Engine()
    links = _Hosts(eng, net, int(st.host[-1]) + 1, ctrl_nics)
    procs = [Fifo(eng, f"rollout-{r}") for r in range(n)]
    worker_cpu = np.zeros(n)
    ctrl = Fifo(eng, "controller")
    if design == "distflow":
        def produce(r: int) -> None:
            cpu = st.split_cpu(st.bytes[r], int(st.host[r]))
            worker_cpu[r] += cpu
            procs[r].submit(cpu, st.send, eng, r, st.bytes[r], int(st.host[r]), links.egress[st.host[r]], links)
    else:
        got: list[int] = []
        merged = st.bytes.sum(axis=0)

        def ctrl_receive(r: int) -> None:
            nb = int(st.bytes[r].sum())
            rx = st.slow * (cal.remote_rx_s + nb * cal.remote_rx_s_per_byte)
            if controller == "per_batch":  # stage_worker.on_samples: forward this batch at once, to all N
                ctrl.submit(rx + st.split_cpu(st.bytes[r], -1), st.send, eng, r, st.bytes[r], -1, links.ctrl_out, links)
                return
            ctrl.submit(rx)
            got.append(r)
            if len(got) == n:  # the bench's relay: one split of the whole step (parts in row 0)
                st.arrive[1:, :], st.rx[1:, :] = -np.inf, 0.0
                take = st.slow * (cal.take_s + float(merged.sum()) * cal.join_s_per_byte)
                ctrl.submit(take + st.split_cpu(merged, -1), st.send, eng, 0, merged, -1, links.ctrl_out, links)

        def produce(r: int) -> None:
            nb = int(st.bytes[r].sum())
            cpu = st.slow * (cal.scatter_s + cal.wake_s + cal.remote_tx_s + nb * cal.remote_tx_s_per_byte)
            worker_cpu[r] += cpu  # one part, the whole batch: no split

            def sent() -> None:
                links.egress[st.host[r]].submit(nb, lambda: links.ctrl_in.submit(nb, ctrl_receive, r))

            procs[r].submit(cpu, sent)
    for r in range(n):
        eng.at(gen[r], produce, r)
    eng.run()
    if np.isnan(st.arrive).any():
        raise RuntimeError("a part never reached its trainer (model bug)")
    join = st.slow * (cal.take_s + cal.wake_s + st.bytes.sum(axis=0) * cal.join_s_per_byte)
    ready = fifo_finish_columns(st.arrive, st.rx) + join
    worker_cpu += st.rx.sum(axis=0) + join  # (trainer t shares worker t's index)
    exposed, sync = collectives_s(n, cost, net)
    train = float(st.tokens.max()) / cost.train_tok_s + exposed
    start = float(ready.max())
    total_tokens = int(st.tokens.sum())
    res = StepResult(design, n, start + train + sync, total_tokens, max(gen), start - max(gen), train, sync,
                     int(st.bytes.sum()), max_worker_cpu_s=float(worker_cpu.max()),
                     trainer_tokens_max_over_mean=float(st.tokens.max()) / (total_tokens / n))
    if design == "single":
        res.router_cpu_s = ctrl.busy
        res.router_link_s = max(links.ctrl_in.busy, links.ctrl_out.busy)
    return res


def controller_cpu_formula(n: int, nbytes_per_worker: float, cal: Calibration, controller: str = "per_batch") -> float:
    """The controller's CPU seconds per step, in closed form (what :func:`simulate` must reproduce):
    per batch received, one message in (fixed + per byte); per split, a scatter call, one message
    out per trainer, and each byte packed and sent once. ``per_batch``: N splits of N parts;
    ``gathered``: one join of the step and one split of N parts. (Mesh gossip's share left out: ``mesh_cpu_fraction=0``.)"""
    b = nbytes_per_worker
    rx = n * (cal.remote_rx_s + b * cal.remote_rx_s_per_byte)
    splits = n if controller == "per_batch" else 1
    tx = splits * (cal.scatter_s + cal.wake_s + n * cal.remote_tx_s) + n * b * (cal.pack_s_per_byte + cal.remote_tx_s_per_byte)
    join = 0.0 if controller == "per_batch" else cal.take_s + n * b * cal.join_s_per_byte  # the relay joins the step
    return rx + tx + join


def controller_saturation_n(budget_s: float, nbytes_per_worker: float, cal: Calibration) -> float:
    """The N at which the per-batch controller's CPU per step reaches ``budget_s`` (e.g. the step's
    compute time: beyond it the controller, not the GPUs, sets the pace): the positive root of
    ``tx N^2 + (rx + scatter + b (rx_b + pack + tx_b)) N = budget``."""
    b = nbytes_per_worker
    a = cal.remote_tx_s
    lin = cal.remote_rx_s + cal.scatter_s + cal.wake_s + b * (cal.remote_rx_s_per_byte + cal.pack_s_per_byte + cal.remote_tx_s_per_byte)
    return (-lin + math.sqrt(lin * lin + 4 * a * budget_s)) / (2 * a)
