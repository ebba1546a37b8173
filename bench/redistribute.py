"""Benchmark: peer-to-peer stage handoff vs a single controller; channel bandwidth vs raw baselines.

Everything is measured in one run, on this machine, with real processes:

1. Stage handoff, N producers -> N consumers (N = 2, 4, 8), 64 samples per producer, each
   sample a realistic RL payload: 4,096 tokens as int64 (1,024 prompt + 3,072 response),
   fp32 logprobs and an fp32 per-token mask (carried in ``ref_logprobs``) for the response.
   * peer-to-peer: every producer ``scatter``s its batch straight to the owners (DistFlow);
   * single controller (baseline): every producer sends its whole batch to one controller
     process, which gathers the step, splits it by owner and sends each consumer its part.
   Time per handoff = from "go" to the last consumer holding its samples (median of reps).
2. Channel bandwidth, one sender process and one receiver process, same message size:
   * zmq channel (signed header, Poly1305 payload MAC, acked) vs plain TCP
     ``socket.sendall`` / ``recv_into`` with a 1-byte ack per message;
   * shm channel (same host) vs ``memcpy`` of the same bytes into a warm buffer (``np.copyto``,
     the copy the channel itself does).

Prints a report and ends with exactly one JSON line of the figures. The machine's core count
is part of the JSON: with 2 cores, 2N+1 processes contend for the CPU, which caps how much
the peer-to-peer fan-out can gain. Run: ``python bench/redistribute.py [--quick] [--channel zmq|shm]``.
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


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)  # system-wide: comparable across processes


# ============================================================================ worker process
def worker_main() -> None:
    import torch

    # Many processes share few cores here: intra-op thread pools would oversubscribe the CPU
    # and make every large copy wait on descheduled OpenMP threads (as any multi-process host should).
    torch.set_num_threads(1)

    from distflow.buffer.batch import SampleBatch
    from distflow.buffer.redistribute import gather_step, scatter, shard_receiver
    from distflow.buffer.shard import BufferShard
    from distflow.core.channels import Endpoint, make_channel

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

    async def handle(req: dict[str, Any]) -> None:
        rid, cmd = req["id"], req["cmd"]
        try:
            if cmd == "init":
                ch = make_channel(req["kind"], req["node"], SECRET)
                shard = BufferShard(1 << 20)
                if req.get("sink"):
                    async def sink(env: Any) -> None:
                        return None
                    ch.set_handler(sink)
                else:
                    recv = shard_receiver(shard, put_timeout=120)

                    async def timed(env: Any) -> None:
                        await recv(env)
                        state["last_put"] = now()

                    ch.set_handler(timed)
                await ch.start()
                state.update(ch=ch, shard=shard, node=req["node"])
                if req.get("batch"):
                    state["batch"] = make_batch(PER_PRODUCER, req["seed"])
                reply(rid, port=ch.port)
            elif cmd == "scatter":
                eps = [Endpoint(*c) for c in req["consumers"]]
                b = with_ids(state["batch"], state["node"], req["step"])
                await scatter(state["ch"], b, eps, step=req["step"], source_rank=req["rank"], timeout=120)
                reply(rid, t=now())
            elif cmd == "take":
                t_begin = now()
                b = await gather_step(state["shard"], req["step"], req["sources"], timeout=120)
                reply(rid, t=now(), n=len(b), last_put=state.get("last_put", 0.0), t_begin=t_begin)
            elif cmd == "relay":  # the single controller: gather everything, then send each consumer its part
                b = await gather_step(state["shard"], req["step"], req["sources"], timeout=120)
                eps = [Endpoint(*c) for c in req["consumers"]]
                await scatter(state["ch"], b, eps, step=req["step"], source_rank=0, timeout=120)
                reply(rid, t=now(), n=len(b))
            elif cmd == "bw_send":
                peer = Endpoint(*req["peer"])
                x = {"x": torch.randint(0, 255, (req["bytes"],), dtype=torch.uint8)}
                for _ in range(2):  # warm-up: connection, shm slot, page faults
                    await state["ch"].send(peer, "bw", {}, x, timeout=60)
                t0 = time.perf_counter()
                for _ in range(req["reps"]):
                    await state["ch"].send(peer, "bw", {}, x, timeout=60)
                reply(rid, gbps=req["bytes"] * req["reps"] / (time.perf_counter() - t0) / 1e9)
            elif cmd == "sock_server":
                srv = socket.create_server(("127.0.0.1", 0))
                threading.Thread(target=sock_server, args=(srv, req["bytes"], req["reps"] + 2), daemon=True).start()
                reply(rid, port=srv.getsockname()[1])
            elif cmd == "sock_client":
                reply(rid, gbps=sock_client(req["port"], req["bytes"], req["reps"]))
            elif cmd == "memcpy":  # the same primitive the shm channel copies with, into a warm buffer
                import numpy as np

                src = torch.randint(0, 255, (req["bytes"],), dtype=torch.uint8).numpy()
                dst = np.empty_like(src)
                np.copyto(dst, src)
                t0 = time.perf_counter()
                for _ in range(req["reps"]):
                    np.copyto(dst, src)
                reply(rid, gbps=req["bytes"] * req["reps"] / (time.perf_counter() - t0) / 1e9)
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

        threading.Thread(target=read_stdin, daemon=True).start()
        tasks: set[asyncio.Task] = set()
        while (line := await q.get()) is not None:
            t = asyncio.create_task(handle(json.loads(line)), name="bench-request")
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if "ch" in state:
            await state["ch"].close()

    asyncio.run(main())


def sock_server(srv: socket.socket, nbytes: int, reps: int) -> None:
    conn, _ = srv.accept()
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for _ in range(reps):
        got = 0
        while got < nbytes:
            got += conn.recv_into(view[got:], nbytes - got)
        conn.sendall(b"k")
    conn.close()
    srv.close()


def sock_client(port: int, nbytes: int, reps: int) -> float:
    import torch

    data = memoryview(torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy())
    with socket.create_connection(("127.0.0.1", port)) as c:
        for _ in range(2):
            c.sendall(data)
            c.recv(1)
        t0 = time.perf_counter()
        for _ in range(reps):
            c.sendall(data)
            c.recv(1)
        return nbytes * reps / (time.perf_counter() - t0) / 1e9


# ============================================================================ coordinator
class Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.pending: dict[int, Future] = {}
        self.lock = threading.Lock()
        self.next = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.lock:
                fut = self.pending.pop(msg["id"])
            fut.set_result(msg)
        with self.lock:
            for fut in self.pending.values():
                fut.set_exception(RuntimeError("worker exited"))

    def ask(self, cmd: str, **kw: Any) -> Future:
        fut: Future = Future()
        with self.lock:
            rid, self.next = self.next, self.next + 1
            self.pending[rid] = fut
        self.proc.stdin.write(json.dumps({"id": rid, "cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        return fut

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=20)
        except Exception:
            self.proc.kill()


def get(fut: Future, timeout: float = 300) -> dict[str, Any]:
    msg = fut.result(timeout=timeout)
    if "error" in msg:
        raise RuntimeError(msg["error"])
    return msg


class Cluster:
    """2*max_n + 1 worker processes: producers, consumers and the controller, one node each."""

    def __init__(self, max_n: int, kind: str):
        self.prods = [Worker() for _ in range(max_n)]
        self.cons = [Worker() for _ in range(max_n)]
        self.ctrl = Worker()
        ports = [get(w.ask("init", kind=kind, node=f"p{i}", batch=True, seed=i)) for i, w in enumerate(self.prods)]
        self.prod_ids = [f"p{i}" for i in range(max_n)]
        cports = [get(w.ask("init", kind=kind, node=f"c{i}")) for i, w in enumerate(self.cons)]
        self.cons_eps = [[f"c{i}", "127.0.0.1", p["port"]] for i, p in enumerate(cports)]
        self.ctrl_ep = [["ctl", "127.0.0.1", get(self.ctrl.ask("init", kind=kind, node="ctl"))["port"]]]
        del ports
        self.step = 0

    def handoff(self, n: int, mode: str) -> float:
        step, self.step = self.step, self.step + 1
        cons, prods = self.cons_eps[:n], self.prod_ids[:n]
        if mode == "p2p":
            takes = [w.ask("take", step=step, sources=prods) for w in self.cons[:n]]
            relay = None
            targets = cons
        else:
            takes = [w.ask("take", step=step, sources=["ctl"]) for w in self.cons[:n]]
            relay = self.ctrl.ask("relay", step=step, sources=prods, consumers=cons)
            targets = self.ctrl_ep
        time.sleep(0.05)  # consumers are waiting before the clock starts
        t0 = now()
        sends = [w.ask("scatter", step=step, consumers=targets, rank=i) for i, w in enumerate(self.prods[:n])]
        for f in sends:
            get(f)
        if relay is not None:
            get(relay)
        done = [get(f) for f in takes]
        assert sum(d["n"] for d in done) == n * PER_PRODUCER, "samples lost"
        return max(d["t"] for d in done) - t0

    def busiest_cpu(self, n: int, mode: str, steps: int) -> float:
        """CPU seconds per step of the busiest process (what bounds a step when every node has its
        own cores, as in a real cluster; on this host all processes share the same few cores)."""
        procs = [*self.prods[:n], *self.cons[:n]] + ([self.ctrl] if mode == "single" else [])
        before = [cpu_seconds(w.proc.pid) for w in procs]
        for _ in range(steps):
            self.handoff(n, mode)
        return max(cpu_seconds(w.proc.pid) - b for w, b in zip(procs, before)) / steps

    def stop(self) -> None:
        for w in [*self.prods, *self.cons, self.ctrl]:
            w.stop()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bandwidth(kind: str, nbytes: int, reps: int, rounds: int) -> dict[str, float]:
    """Channel vs baseline, interleaved in ``rounds`` (the host is shared: drift hits both alike)."""
    a, b = Worker(), Worker()
    try:
        get(a.ask("init", kind=kind, node="bw-a"))
        port = get(b.ask("init", kind=kind, node="bw-b", sink=True))["port"]
        chan, base = [], []
        for _ in range(rounds):
            chan.append(get(a.ask("bw_send", peer=["bw-b", "127.0.0.1", port], bytes=nbytes, reps=reps))["gbps"])
            if kind == "zmq":
                sport = get(b.ask("sock_server", bytes=nbytes, reps=reps))["port"]
                base.append(get(a.ask("sock_client", port=sport, bytes=nbytes, reps=reps))["gbps"])
            else:
                base.append(get(a.ask("memcpy", bytes=nbytes, reps=reps))["gbps"])
        return {"channel_gbps": statistics.median(chan), "baseline_gbps": statistics.median(base),
                "ratio": statistics.median(c / x for c, x in zip(chan, base))}
    finally:
        a.stop()
        b.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    ap.add_argument("--channel", default="zmq", choices=["zmq", "shm"], help="channel for the handoff part")
    ap.add_argument("--sizes", default="2,4,8")
    args = ap.parse_args()
    if args.worker:
        worker_main()
        return
    sizes = [int(x) for x in args.sizes.split(",")]
    reps = 3 if args.quick else 9
    per_sample = PROMPT * 8 + RESPONSE * 8 + RESPONSE * 4 * 2 + 16
    print(f"machine: {os.cpu_count()} cores; payload {per_sample / 1024:.0f} KiB/sample, "
          f"{PER_PRODUCER} samples ({PER_PRODUCER * per_sample / 2**20:.1f} MiB) per producer; channel {args.channel}")
    figures: dict[str, Any] = {"cores": os.cpu_count(), "channel": args.channel, "reps": reps}

    cluster = Cluster(max(sizes), args.channel)
    try:
        for n in sizes:
            times: dict[str, list[float]] = {"p2p": [], "single": []}
            cluster.handoff(n, "p2p")  # warm-up: connections, first allocations
            cluster.handoff(n, "single")
            for _ in range(reps):
                for mode in ("p2p", "single"):  # interleaved, so drift hits both alike
                    times[mode].append(cluster.handoff(n, mode))
            p2p, single = statistics.median(times["p2p"]), statistics.median(times["single"])
            ratio = statistics.median(s / p for s, p in zip(times["single"], times["p2p"]))
            mib = n * PER_PRODUCER * per_sample / 2**20
            print(f"N={n}: {mib:6.1f} MiB/step | peer-to-peer {p2p * 1e3:7.1f} ms | single controller "
                  f"{single * 1e3:7.1f} ms | median single/p2p = {ratio:.2f}x")
            figures[f"p2p_ms_{n}"] = round(p2p * 1e3, 2)
            figures[f"single_ms_{n}"] = round(single * 1e3, 2)
            figures[f"p2p_vs_single_{n}"] = round(ratio, 3)
            if os.path.exists("/proc/self/stat"):
                cpu = {m: cluster.busiest_cpu(n, m, 3 if args.quick else 10) for m in ("p2p", "single")}
                print(f"      busiest process CPU per step: peer-to-peer {cpu['p2p'] * 1e3:6.1f} ms, single controller "
                      f"{cpu['single'] * 1e3:6.1f} ms ({cpu['single'] / max(cpu['p2p'], 1e-3):.2f}x)")
                figures[f"busiest_cpu_ms_p2p_{n}"] = round(cpu["p2p"] * 1e3, 1)
                figures[f"busiest_cpu_ms_single_{n}"] = round(cpu["single"] * 1e3, 1)
    finally:
        cluster.stop()

    size, breps, rounds = (16 << 20), 8, (3 if args.quick else 7)
    z = bandwidth("zmq", size, breps, rounds)
    print(f"zmq channel {z['channel_gbps']:.2f} GB/s vs plain TCP socket {z['baseline_gbps']:.2f} GB/s "
          f"({size >> 20} MiB messages, acked, cross-process): median ratio {z['ratio']:.2f}")
    s = bandwidth("shm", size, breps, rounds)
    print(f"shm channel {s['channel_gbps']:.2f} GB/s vs memcpy {s['baseline_gbps']:.2f} GB/s "
          f"({size >> 20} MiB messages, acked, cross-process): median ratio {s['ratio']:.2f}")
    figures.update(zmq_gbps=round(z["channel_gbps"], 3), socket_gbps=round(z["baseline_gbps"], 3),
                   zmq_vs_socket=round(z["ratio"], 3), shm_gbps=round(s["channel_gbps"], 3),
                   memcpy_gbps=round(s["baseline_gbps"], 3), shm_vs_memcpy=round(s["ratio"], 3))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
