"""Benchmark: peer-to-peer stage handoff vs a single controller; channel bandwidth vs raw baselines.

Why it exists: DistFlow's claim is that moving each stage's output straight to its consumers
beats routing it through one controller, and that its authenticated channels cost little over
the raw transport. Everything is measured in one run, on this machine, with real processes.

1. Stage handoff, N producers -> N consumers (N = 2, 4, 8), 64 samples per producer, each
   sample a realistic RL payload: 4,096 tokens as int64 (1,024 prompt + 3,072 response),
   fp32 logprobs and an fp32 per-token mask (carried in ``ref_logprobs``) for the response.
   Both modes use the channel ``make_transport(kind)`` gives (default ``auto``: shared memory
   between processes of one host, as a real node would use) on the event loop nodes run
   (uvloop, ``distflow.core.aio.run_loop``), the same library calls
   (``scatter`` / ``shard_receiver`` + ``open_ingress`` / ``gather_step``), every byte delivered:
   on shared memory a part is *posted* (a record in the consumer's mailbox, no message or ack per
   part: ``transport/movers/posting.py``), unless ``--posting off`` makes it an acked message:
   * peer-to-peer: every producer ``scatter``s its batch straight to the owners (DistFlow);
   * single controller (baseline): every producer sends its whole batch to one controller
     process, which gathers the step, splits it by owner and sends each consumer its part
     (twice the bytes through one process).
   Time per handoff = from "go" to the last consumer holding its samples (median of paired,
   interleaved repetitions; ranges printed). Samples are counted by id at every consumer.
   CPU time of every process (all threads, ns, from /proc/<pid>/task/*/schedstat) is recorded
   per handoff, which gives two more figures per N:
   * ``ceiling``: ``cores * single_ms / p2p_total_cpu_ms`` - no schedule of the measured
     peer-to-peer work on this many cores can beat the single controller by more than this
     (work conservation: p2p wall >= its CPU time / cores), so it bounds ``p2p_vs_single`` on
     this machine (to within the little work counted after the clock stops: acks, replies);
   * ``busiest_cpu_ratio``: busiest single-controller process / busiest peer-to-peer process,
     i.e. the speed-up when every process has its own core, as on a cluster;
   * ``*_thread_cpu_ms``: the part of the total spent outside the processes' main threads (the
     zmq I/O threads), which tells Python work from transport work.
   ``--shm-copy-below`` / ``--shm-release-delay`` / ``--posting`` set those shm channel keywords
   for an A/B run.
2. Channel bandwidth, one sender process and one receiver process, 16 MiB messages (``--bw-mib``), each
   acknowledged (``--window`` messages in flight, same for channel and baseline):
   * zmq channel (signed header; 16 MiB is streamed in 1 MiB chunks, each AES-GMAC'd; acked) vs a plain TCP socket
     (``sendall`` / ``recv_into`` a reused buffer, 1-byte ack per message);
   * shm channel (same host) vs ``memcpy`` of the same bytes into a warm buffer (``np.copyto``,
     the copy the channel itself does).
   Channel and baseline alternate in rounds (the host is shared: drift hits both alike); the
   ratio is the median of the per-round ratios. CPU ms per message on each side is reported.

Prints a report and ends with exactly one JSON line of the figures (raw times included).
Run: ``python bench/redistribute.py [--quick] [--channel auto|shm|zmq] [--sizes 2,4,8] [--parts handoff,bandwidth]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

SECRET = "bench-redistribute-secret-0123456789"
PROMPT, RESPONSE, PER_PRODUCER = 1024, 3072, 64
REQUEST_TIMEOUT = 300.0  # seconds any one request to a worker may take


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)  # system-wide: comparable across processes


# ============================================================================ worker process
def worker_main() -> None:
    import torch

    # Many processes share few cores here: intra-op thread pools would oversubscribe the CPU
    # and make every large copy wait on descheduled OpenMP threads (as any multi-process host should).
    torch.set_num_threads(1)
    from distflow.core.allocator import keep_freed_memory

    keep_freed_memory()  # as a node does at start-up (DISTFLOW_MALLOC_TUNING=0 for the A/B)

    from distflow.buffer.batch import SampleBatch
    from distflow.buffer.redistribute import gather_step, open_ingress, scatter, shard_receiver
    from distflow.buffer.shard import BufferShard
    from distflow.core.aio import run_loop
    from distflow.transport import Endpoint, make_transport

    state: dict[str, Any] = {}
    out_lock = threading.Lock()

    def reply(rid: int, **kw: Any) -> None:
        with out_lock:
            sys.stdout.write(json.dumps({"id": rid, **kw}) + "\n")
            sys.stdout.flush()

    def make_batch(n: int, seed: int) -> SampleBatch:
        g = torch.Generator().manual_seed(seed)
        t = {
            "prompt_lens": torch.full((n,), PROMPT, dtype=torch.int64),
            "prompt_tokens": torch.randint(0, 50_000, (n * PROMPT,), generator=g),
            "response_lens": torch.full((n,), RESPONSE, dtype=torch.int64),
            "response_tokens": torch.randint(0, 50_000, (n * RESPONSE,), generator=g),
            "logprobs": -torch.rand(n * RESPONSE, generator=g),
            "ref_logprobs": (torch.rand(n * RESPONSE, generator=g) > 0.1).float(),  # the fp32 loss mask
            "policy_version": torch.zeros(n, dtype=torch.int64),
        }
        return SampleBatch([f"x{i}" for i in range(n)], [f"e0:{i}" for i in range(n)], t)

    def with_ids(b: SampleBatch, node: str, step: int) -> SampleBatch:
        return SampleBatch([f"{node}:{step}:{i}" for i in range(len(b))], b.prompt_ids, b.tensors, b.extras)

    async def bw_send(peer: Any, nbytes: int, reps: int, window: int) -> dict[str, float]:
        if state.get("bw_x") is None or state["bw_x"]["x"].numel() != nbytes:
            state["bw_x"] = {"x": torch.randint(0, 255, (nbytes,), dtype=torch.uint8)}
        x = state["bw_x"]
        slots = asyncio.Semaphore(window)
        tasks: list[asyncio.Task] = []

        async def one() -> None:
            try:
                await state["ch"].send(peer, "bw", {}, x, timeout=60)
            finally:
                slots.release()

        c0, t0 = time.process_time(), time.perf_counter()
        if window == 1:
            for _ in range(reps):
                await state["ch"].send(peer, "bw", {}, x, timeout=60)
        else:
            for i in range(reps):
                await slots.acquire()
                tasks.append(asyncio.create_task(one(), name=f"bench-bw-send-{i}"))
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        return {"gbps": nbytes * reps / dt / 1e9, "cpu_ms": dc / reps * 1e3}

    async def handle(req: dict[str, Any]) -> None:
        rid, cmd = req["id"], req["cmd"]
        try:
            if cmd == "init":
                ch = make_transport(req["kind"], req["node"], SECRET, **req.get("chan_kw", {}))
                shard = BufferShard(1 << 20)
                if req.get("sink"):
                    async def sink(env: Any) -> None:
                        return None
                    ch.set_handler(sink)
                else:
                    ch.set_handler(shard_receiver(shard, put_timeout=120))
                await ch.start()
                if not req.get("sink"):
                    open_ingress(ch, shard)  # same-host producers post their parts (no-op without posting)
                state.update(ch=ch, shard=shard, node=req["node"])
                if req.get("batch"):
                    state["batch"] = make_batch(req.get("samples", PER_PRODUCER), req["seed"])
                reply(rid, port=ch.port, transport=ch.stats()["transport"])
            elif cmd == "scatter":
                if req.get("delay"):  # bench/scale.py's validation: generation replaced by a sleep of known length
                    await asyncio.sleep(req["delay"])
                eps = [Endpoint(*c) for c in req["consumers"]]
                b = with_ids(state["batch"], state["node"], req["step"])
                await scatter(state["ch"], b, eps, step=req["step"], source_rank=req["rank"], timeout=120)
                reply(rid, t=now())
            elif cmd == "take":
                b = await gather_step(state["shard"], req["step"], req["sources"], timeout=120)
                t = now()
                if req.get("after"):  # bench/scale.py's validation: the update replaced by a sleep
                    await asyncio.sleep(req["after"])
                    reply(rid, t=t, end=now(), ids=b.sample_ids)
                else:
                    reply(rid, t=t, ids=b.sample_ids)
            elif cmd == "relay":  # the single controller: gather everything, then send each consumer its part
                b = await gather_step(state["shard"], req["step"], req["sources"], timeout=120)
                eps = [Endpoint(*c) for c in req["consumers"]]
                await scatter(state["ch"], b, eps, step=req["step"], source_rank=0, timeout=120)
                reply(rid, t=now(), n=len(b))
            elif cmd == "bw_send":
                reply(rid, **await bw_send(Endpoint(*req["peer"]), req["bytes"], req["reps"], req["window"]))
            elif cmd == "sock_server":
                srv = socket.create_server(("127.0.0.1", 0))
                srv.settimeout(60)
                threading.Thread(target=sock_server, args=(srv, req["bytes"], req["reps"]), daemon=True,
                                 name="bench-sock-server").start()
                reply(rid, port=srv.getsockname()[1])
            elif cmd == "sock_client":
                reply(rid, **sock_client(req["port"], req["bytes"], req["reps"], req["window"]))
            elif cmd == "memcpy":  # the same primitive the shm channel copies with, into a warm buffer
                import numpy as np

                src = torch.randint(0, 255, (req["bytes"],), dtype=torch.uint8).numpy()
                dst = np.empty_like(src)
                np.copyto(dst, src)
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(req["reps"]):
                    np.copyto(dst, src)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                reply(rid, gbps=req["bytes"] * req["reps"] / dt / 1e9, cpu_ms=dc / req["reps"] * 1e3)
            elif cmd == "cpu":
                reply(rid, cpu=time.process_time())
            elif cmd == "stats":
                reply(rid, stats=state["ch"].stats())
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except BaseException as e:  # report, never hang the coordinator
            reply(rid, error=f"{type(e).__name__}: {e}")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def read_stdin() -> None:
            for line in sys.stdin:
                loop.call_soon_threadsafe(q.put_nowait, line)
            loop.call_soon_threadsafe(q.put_nowait, None)

        threading.Thread(target=read_stdin, daemon=True, name="bench-stdin").start()
        tasks: set[asyncio.Task] = set()
        while (line := await q.get()) is not None:
            req = json.loads(line)
            t = asyncio.create_task(handle(req), name=f"bench-{req['cmd']}-{req['id']}")
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        if "ch" in state:
            await asyncio.wait_for(state["ch"].close(), 10)

    prof_dir = os.environ.get("DISTFLOW_BENCH_PROFILE")
    if not prof_dir:
        run_loop(main())  # uvloop, as every node process runs
        return
    import cProfile

    prof = cProfile.Profile(time.thread_time)  # CPU of this thread, not wall time (processes share cores)
    prof.enable()
    try:
        run_loop(main())
    finally:
        prof.disable()
        prof.dump_stats(os.path.join(prof_dir, f"{state.get('node', os.getpid())}.prof"))


def sock_server(srv: socket.socket, nbytes: int, reps: int) -> None:
    """Receive ``reps`` messages of ``nbytes`` into one reused buffer; 1-byte ack after each."""
    conn, _ = srv.accept()
    conn.settimeout(60)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for _ in range(reps):
        got = 0
        while got < nbytes:
            k = conn.recv_into(view[got:], nbytes - got)
            if not k:
                raise ConnectionError("socket baseline: client closed early")
            got += k
        conn.sendall(b"k")
    conn.close()
    srv.close()


def sock_client(port: int, nbytes: int, reps: int, window: int) -> dict[str, float]:
    """Send ``reps`` messages with at most ``window`` unacknowledged (``reps`` includes nothing else)."""
    import torch

    data = memoryview(torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy())
    with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
        c0, t0 = time.process_time(), time.perf_counter()
        inflight = 0
        for _ in range(reps):
            c.sendall(data)
            inflight += 1
            if inflight >= window:
                if c.recv(1) != b"k":
                    raise ConnectionError("socket baseline: bad ack")
                inflight -= 1
        while inflight:
            if c.recv(1) != b"k":
                raise ConnectionError("socket baseline: bad ack")
            inflight -= 1
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
    return {"gbps": nbytes * reps / dt / 1e9, "cpu_ms": dc / reps * 1e3}


# ============================================================================ coordinator
class Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.pending: dict[int, Future] = {}
        self.lock = threading.Lock()
        self.next = 0
        threading.Thread(target=self._read, daemon=True, name=f"bench-reader-{self.proc.pid}").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.lock:
                fut = self.pending.pop(msg["id"])
            fut.set_result(msg)
        with self.lock:
            for fut in self.pending.values():
                fut.set_exception(RuntimeError(f"worker {self.proc.pid} exited"))

    def ask(self, cmd: str, **kw: Any) -> Future:
        fut: Future = Future()
        with self.lock:
            rid, self.next = self.next, self.next + 1
            self.pending[rid] = fut
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": rid, "cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        return fut

    def stop(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()


def get(fut: Future, timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
    msg = fut.result(timeout=timeout)
    if "error" in msg:
        raise RuntimeError(msg["error"])
    return msg


def cpu_ns(pid: int) -> int | None:
    """CPU time of every thread of ``pid`` in ns (/proc/<pid>/task/*/schedstat); None if unavailable."""
    both = cpu_ns_split(pid)
    return None if both is None else both[0] + both[1]


def cpu_ns_split(pid: int) -> tuple[int, int] | None:
    """(main thread, all other threads: zmq I/O, pyzmq gc) CPU ns of ``pid``; None if unavailable."""
    main = other = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just exited
        if tid == str(pid):
            main += ns
        else:
            other += ns
    return main, other


class Cluster:
    """2*max_n + 1 worker processes: producers, consumers and the controller, one node each."""

    def __init__(self, max_n: int, kind: str, chan_kw: dict[str, Any] | None = None):
        self.prods = [Worker() for _ in range(max_n)]
        self.cons = [Worker() for _ in range(max_n)]
        self.ctrl = Worker()
        kw = chan_kw or {}
        inits = [w.ask("init", kind=kind, node=f"p{i}", batch=True, seed=i, chan_kw=kw)
                 for i, w in enumerate(self.prods)]
        cinits = [w.ask("init", kind=kind, node=f"c{i}", chan_kw=kw) for i, w in enumerate(self.cons)]
        ctl = get(self.ctrl.ask("init", kind=kind, node="ctl", chan_kw=kw))
        transports = {get(f)["transport"] for f in inits} | {ctl["transport"]}
        cports = [get(f) for f in cinits]
        transports |= {c["transport"] for c in cports}
        self.transport = ",".join(sorted(transports))
        self.prod_ids = [f"p{i}" for i in range(max_n)]
        self.cons_eps = [[f"c{i}", "127.0.0.1", p["port"]] for i, p in enumerate(cports)]
        self.ctrl_ep = [["ctl", "127.0.0.1", ctl["port"]]]
        self.step = 0

    def handoff(self, n: int, mode: str) -> tuple[float, dict[str, list[float]]]:
        """One step; returns (wall seconds, CPU ms per role: {"prod": [...], "cons": [...], "ctrl": [...]})."""
        step, self.step = self.step, self.step + 1
        cons, prods = self.cons_eps[:n], self.prod_ids[:n]
        roles = {"prod": self.prods[:n], "cons": self.cons[:n], "ctrl": [self.ctrl] if mode == "single" else []}
        if mode == "p2p":
            takes = [w.ask("take", step=step, sources=prods) for w in self.cons[:n]]
            relay = None
            targets = cons
        else:
            takes = [w.ask("take", step=step, sources=["ctl"]) for w in self.cons[:n]]
            relay = self.ctrl.ask("relay", step=step, sources=prods, consumers=cons)
            targets = self.ctrl_ep
        time.sleep(0.05)  # consumers are waiting before the clock starts
        before = {r: [cpu_ns_split(w.proc.pid) for w in ws] for r, ws in roles.items()}
        t0 = now()
        sends = [w.ask("scatter", step=step, consumers=targets, rank=i) for i, w in enumerate(self.prods[:n])]
        for f in sends:
            get(f)
        if relay is not None:
            get(relay)
        done = [get(f) for f in takes]
        wall = max(d["t"] for d in done) - t0
        time.sleep(0.05)  # let trailing work (acks, shm releases) finish before reading CPU
        after = {r: [cpu_ns_split(w.proc.pid) for w in ws] for r, ws in roles.items()}
        # every sample arrives exactly once, at its owner (counted by id)
        expected = {f"{p}:{step}:{i}" for p in prods for i in range(PER_PRODUCER)}
        got = [s for d in done for s in d["ids"]]
        if len(got) != len(expected) or set(got) != expected:
            raise AssertionError(f"step {step} ({mode}, N={n}): {len(got)} samples delivered, "
                                 f"{len(expected)} expected, {len(set(got) ^ expected)} ids wrong")
        ok = {r: [(a, b) for a, b in zip(after[r], before[r]) if a is not None and b is not None] for r in roles}
        cpu = {r: [(sum(a) - sum(b)) / 1e6 for a, b in ok[r]] for r in roles}
        cpu["threads"] = [sum((a[1] - b[1]) / 1e6 for a, b in ok[r]) for r in roles]  # non-main threads
        return wall, cpu

    def stop(self) -> None:
        for w in [*self.prods, *self.cons, self.ctrl]:
            w.stop()


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"


def handoff_figures(cluster: Cluster, n: int, reps: int, cores: int, figures: dict[str, Any]) -> None:
    # Warm-up, in the measured order (p2p, single, single, p2p, ...) twice: connections, shm
    # slots and first allocations reach their steady state (a producer's slot pool for the
    # consumers grows until two p2p handoffs have run back to back), as in a long training run.
    for i in range(4):
        for mode in (("p2p", "single") if i % 2 == 0 else ("single", "p2p")):
            cluster.handoff(n, mode)
    walls: dict[str, list[float]] = {"p2p": [], "single": []}
    cpus: dict[str, list[dict[str, list[float]]]] = {"p2p": [], "single": []}
    for i in range(reps):
        for mode in (("p2p", "single") if i % 2 == 0 else ("single", "p2p")):  # interleaved, order alternating
            w, c = cluster.handoff(n, mode)
            walls[mode].append(w * 1e3)
            cpus[mode].append(c)
    ratios = [s / p for s, p in zip(walls["single"], walls["p2p"])]
    p2p, single = statistics.median(walls["p2p"]), statistics.median(walls["single"])
    mib = n * PER_PRODUCER * (PROMPT * 8 + RESPONSE * 16) / 2**20
    print(f"N={n}: {mib:5.1f} MiB/step | peer-to-peer {spread(walls['p2p'])} ms | single controller "
          f"{spread(walls['single'])} ms | single/p2p {statistics.median(ratios):.2f}x "
          f"[{min(ratios):.2f}-{max(ratios):.2f}]")
    figures.update({f"p2p_ms_{n}": round(p2p, 2), f"single_ms_{n}": round(single, 2),
                    f"p2p_vs_single_{n}": round(statistics.median(ratios), 3),
                    f"p2p_ms_{n}_range": [round(min(walls["p2p"]), 2), round(max(walls["p2p"]), 2)],
                    f"single_ms_{n}_range": [round(min(walls["single"]), 2), round(max(walls["single"]), 2)],
                    f"p2p_vs_single_{n}_range": [round(min(ratios), 3), round(max(ratios), 3)]})
    if not all(c["prod"] and c["cons"] for m in cpus for c in cpus[m]):
        return  # no per-thread CPU accounting on this OS

    def med(mode: str, f: Any) -> float:
        return statistics.median(f(c) for c in cpus[mode])

    total = {m: med(m, lambda c: sum(c["prod"]) + sum(c["cons"]) + sum(c["ctrl"])) for m in cpus}
    threads = {m: med(m, lambda c: sum(c["threads"])) for m in cpus}
    busiest = {m: med(m, lambda c: max(c["prod"] + c["cons"] + c["ctrl"])) for m in cpus}
    ctrl = med("single", lambda c: c["ctrl"][0])
    ceiling = cores * single / total["p2p"]
    prod, cons = med("p2p", lambda c: statistics.mean(c["prod"])), med("p2p", lambda c: statistics.mean(c["cons"]))
    sprod, scons = (med("single", lambda c: statistics.mean(c["prod"])),
                    med("single", lambda c: statistics.mean(c["cons"])))
    print(f"      CPU per handoff: peer-to-peer {total['p2p']:.1f} ms in all (producer {prod:.1f}, consumer "
          f"{cons:.1f} each); single {total['single']:.1f} ms in all (producer {sprod:.1f}, consumer {scons:.1f} "
          f"each, controller {ctrl:.1f}); of which "
          f"non-main threads (zmq I/O) p2p {threads['p2p']:.1f}, single {threads['single']:.1f}")
    print(f"      ceiling on {cores} cores = cores x single / p2p CPU = {ceiling:.2f}x; busiest process "
          f"{busiest['single']:.1f} vs {busiest['p2p']:.1f} ms = {busiest['single'] / busiest['p2p']:.2f}x "
          f"(one core per process)")
    figures.update({f"p2p_cpu_ms_{n}": round(total["p2p"], 1), f"single_cpu_ms_{n}": round(total["single"], 1),
                    f"controller_cpu_ms_{n}": round(ctrl, 1), f"p2p_producer_cpu_ms_{n}": round(prod, 2),
                    f"p2p_consumer_cpu_ms_{n}": round(cons, 2), f"single_producer_cpu_ms_{n}": round(sprod, 2),
                    f"single_consumer_cpu_ms_{n}": round(scons, 2), f"p2p_thread_cpu_ms_{n}": round(threads["p2p"], 1),
                    f"single_thread_cpu_ms_{n}": round(threads["single"], 1),
                    f"p2p_vs_single_ceiling_{n}": round(ceiling, 3),
                    f"busiest_cpu_ms_p2p_{n}": round(busiest["p2p"], 1),
                    f"busiest_cpu_ms_single_{n}": round(busiest["single"], 1),
                    f"busiest_cpu_ratio_{n}": round(busiest["single"] / busiest["p2p"], 3)})


def bandwidth(kind: str, nbytes: int, reps: int, rounds: int, window: int) -> dict[str, Any]:
    """Channel vs baseline, alternating in ``rounds`` (the host is shared: drift hits both alike)."""
    a, b = Worker(), Worker()
    try:
        get(a.ask("init", kind=kind, node="bw-a"))
        port = get(b.ask("init", kind=kind, node="bw-b", sink=True))["port"]
        peer = ["bw-b", "127.0.0.1", port]
        get(a.ask("bw_send", peer=peer, bytes=nbytes, reps=3, window=window))  # warm-up: connection, slots
        chan, base, cpu = [], [], {"chan_send": [], "chan_recv": [], "base_send": [], "base_recv": []}
        for r in range(rounds):
            for which in (("chan", "base") if r % 2 == 0 else ("base", "chan")):
                if which == "chan":
                    c0 = get(b.ask("cpu"))["cpu"]
                    res = get(a.ask("bw_send", peer=peer, bytes=nbytes, reps=reps, window=window))
                    cpu["chan_recv"].append((get(b.ask("cpu"))["cpu"] - c0) / reps * 1e3)
                    cpu["chan_send"].append(res["cpu_ms"])
                    chan.append(res["gbps"])
                elif kind == "zmq":
                    sport = get(b.ask("sock_server", bytes=nbytes, reps=reps))["port"]
                    c0 = get(b.ask("cpu"))["cpu"]
                    res = get(a.ask("sock_client", port=sport, bytes=nbytes, reps=reps, window=window))
                    cpu["base_recv"].append((get(b.ask("cpu"))["cpu"] - c0) / reps * 1e3)
                    cpu["base_send"].append(res["cpu_ms"])
                    base.append(res["gbps"])
                else:
                    res = get(a.ask("memcpy", bytes=nbytes, reps=reps))
                    cpu["base_send"].append(res["cpu_ms"])
                    base.append(res["gbps"])
        ratios = [c / x for c, x in zip(chan, base)]
        return {"chan": chan, "base": base, "ratios": ratios,
                "cpu": {k: statistics.median(v) for k, v in cpu.items() if v}}
    finally:
        a.stop()
        b.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    ap.add_argument("--channel", default="auto", choices=["auto", "shm", "zmq"],
                    help="channel for the handoff part (default auto: what a node on this host uses)")
    ap.add_argument("--sizes", default="2,4,8")
    ap.add_argument("--window", type=int, default=1, help="messages in flight in the bandwidth part")
    ap.add_argument("--bw-mib", type=int, default=16,
                    help="message size of the bandwidth part in MiB (64: a default weight bucket, above glibc's "
                         "mmap threshold)")
    ap.add_argument("--parts", default="handoff,bandwidth", help="which parts to run (comma-separated)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="cProfile every worker process; <node>.prof files go to DIR (timings are then inflated)")
    ap.add_argument("--shm-copy-below", type=int, default=None,
                    help="handoff: the shm channel's shm_copy_below (bytes; default: the channel's own)")
    ap.add_argument("--shm-release-delay", type=float, default=None,
                    help="handoff: the shm channel's shm_release_delay (seconds; default: the channel's own)")
    ap.add_argument("--posting", choices=["on", "off"], default=None,
                    help="handoff: same-host parts posted to mailboxes (on, the default) or sent as messages")
    args = ap.parse_args()
    if args.worker:
        worker_main()
        return
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        os.environ["DISTFLOW_BENCH_PROFILE"] = os.path.abspath(args.profile)  # the workers inherit it
    reps = 4 if args.quick else 12
    cores = os.cpu_count() or 1
    per_sample = PROMPT * 8 + RESPONSE * 8 + RESPONSE * 4 * 2 + 16
    figures: dict[str, Any] = {"cores": cores, "channel": args.channel, "reps": reps}

    parts = set(args.parts.split(","))
    if parts - {"handoff", "bandwidth"}:
        ap.error(f"--parts: unknown part(s) {sorted(parts - {'handoff', 'bandwidth'})} (known: handoff, bandwidth)")
    if "handoff" in parts:
        chan_kw = {k: v for k, v in (("shm_copy_below", args.shm_copy_below),
                                     ("shm_release_delay", args.shm_release_delay),
                                     ("posting", None if args.posting is None else args.posting == "on"))
                   if v is not None}
        if chan_kw and args.channel == "zmq":
            ap.error("--shm-copy-below, --shm-release-delay and --posting are shared-memory channel options")
        figures.update(chan_kw)
        run_handoff(sizes, reps, cores, args.channel, per_sample, figures, chan_kw)
    if "bandwidth" in parts:
        run_bandwidth(args.quick, args.window, figures, args.bw_mib << 20)
    print(json.dumps(figures))


def run_handoff(sizes: list[int], reps: int, cores: int, channel: str, per_sample: int, figures: dict[str, Any],
                chan_kw: dict[str, Any] | None = None) -> None:
    cluster = Cluster(max(sizes), channel, chan_kw)
    print(f"machine: {cores} cores; payload {per_sample / 1024:.0f} KiB/sample, {PER_PRODUCER} samples "
          f"({PER_PRODUCER * per_sample / 2**20:.1f} MiB) per producer; channel {channel} "
          f"(transport {cluster.transport}); times in ms, median [min-max] of {reps} paired repetitions")
    figures["transport"] = cluster.transport
    try:
        for n in sizes:
            handoff_figures(cluster, n, reps, cores, figures)
    finally:
        cluster.stop()


def run_bandwidth(quick: bool, window: int, figures: dict[str, Any], size: int = 16 << 20) -> None:
    rounds = 5 if quick else 11
    for kind, base_name, key, breps in (("zmq", "socket", "zmq_vs_socket", 24), ("shm", "memcpy", "shm_vs_memcpy", 64)):
        r = bandwidth(kind, size, max(4, breps * (16 << 20) // size), rounds, window)
        cpu = r["cpu"]
        ratios = r["ratios"]
        print(f"{kind} channel {statistics.median(r['chan']):.2f} GB/s vs {base_name} "
              f"{statistics.median(r['base']):.2f} GB/s ({size >> 20} MiB messages, {window} in flight): "
              f"ratio {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] | CPU ms/msg "
              + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()))
        figures.update({f"{kind}_gbps": round(statistics.median(r["chan"]), 3),
                        f"{base_name}_gbps": round(statistics.median(r["base"]), 3),
                        key: round(statistics.median(r["ratios"]), 3),
                        f"{key}_range": [round(min(r["ratios"]), 3), round(max(r["ratios"]), 3)],
                        **{f"{kind}_bw_cpu_ms_{k}": round(v, 3) for k, v in cpu.items()}})
    figures["bw_window"] = window
    figures["bw_mib"] = size >> 20


if __name__ == "__main__":
    main()
