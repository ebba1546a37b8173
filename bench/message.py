"""Benchmark: the fixed CPU cost of one data-plane message against a raw socket round trip.

Why it exists: a peer-to-peer stage handoff has one part per (producer, consumer) pair, P x C
parts a step, where a single controller handles P + C. Sent as messages, whether moving each byte
once also cost less CPU than routing it through one process (``bench/redistribute.py``'s
``p2p_cpu_ms_N`` vs ``single_cpu_ms_N``) was decided by the fixed cost of one message: its signed
header, the receiver's checks and handler task, the signed ack and the sender's wake-up on it.
This measures that cost alone, next to its floor on the same machine. Parts for consumers on the
same host are now posted instead (a record in the consumer's mailbox, ``transport/movers/posting.py``;
``bench/redistribute.py --posting off`` times them as messages); parts to other hosts, and every
other kind of message, still pay this.

Two processes, a sender and a receiver, one message in flight (each send awaits its ack):
* channel: ``make_transport(kind)`` on both ends (default ``auto``: shared memory on one host, as
  nodes use), on the event loop nodes run; each message is a handoff part as ``scatter`` sends
  it: the meta of 8 samples (ids, prompt ids, extras, the packed layout of 7 fields, step,
  ranks) and one packed buffer of ``--payload-kib`` in a slot lent by the channel (filled in
  place, as the split fills it: the send copies nothing); the receiver's handler keeps nothing;
* raw (baseline): a Unix socket pair between the same two processes, on the same event loops:
  a header-sized message and an ack-sized reply, with no framing, MAC, checks or payload.
Rounds alternate (the host is shared: drift hits both alike); CPU of every thread of both
processes from /proc/<pid>/task/*/schedstat; microseconds per message, median of rounds.

Run: ``python bench/message.py [--msgs 2000] [--rounds 6] [--channel auto|shm|zmq] [--payload-kib 64]``.
Prints a report and ends with exactly one JSON line.
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
from typing import Any

from redistribute import SECRET, cpu_ns  # same directory: one CPU reader for the benchmarks

HEADER_BYTES, ACK_BYTES = 700, 140  # about a part's signed header and a signed ack


def part_meta(step: int) -> dict[str, Any]:
    """The meta ``scatter`` puts on one part of 8 samples (sizes as in bench/redistribute.py)."""
    n, prompt, response = 8, 1024, 3072
    layout, pos = [], 0
    for name, dtype, count in (("prompt_lens", "int64", n), ("prompt_tokens", "int64", n * prompt),
                               ("response_lens", "int64", n), ("response_tokens", "int64", n * response),
                               ("logprobs", "float32", n * response), ("ref_logprobs", "float32", n * response),
                               ("policy_version", "int64", n)):
        layout.append([name, dtype, pos, count])
        pos += (count * (8 if dtype == "int64" else 4) + 63) // 64 * 64
    return {"sample_ids": [f"p0:{step}:{i}" for i in range(n)], "prompt_ids": [f"e0:{i}" for i in range(n)],
            "extras": [{} for _ in range(n)], "packed": layout, "step": step, "source_rank": 0,
            "num_sources": 8, "part": 3, "num_parts": 8, "balance": "owner"}


def serve_raw(loop: asyncio.AbstractEventLoop, s: socket.socket, done: asyncio.Future) -> None:
    """Reply ACK_BYTES to every HEADER_BYTES received (the raw baseline's receiving end)."""
    buf, reply, got = bytearray(65536), b"a" * ACK_BYTES, [0]

    def readable() -> None:
        try:
            k = s.recv_into(buf)
        except BlockingIOError:
            return
        if not k:
            loop.remove_reader(s.fileno())
            done.set_result(None)
            return
        got[0] += k
        while got[0] >= HEADER_BYTES:
            got[0] -= HEADER_BYTES
            s.send(reply)

    loop.add_reader(s.fileno(), readable)


def process_main(role: str, fd: int, kind: str, port: int, payload: int) -> None:
    import torch

    torch.set_num_threads(1)
    from distflow.core.aio import run_loop
    from distflow.core.allocator import keep_freed_memory
    from distflow.transport import Endpoint, make_transport

    keep_freed_memory()  # as a node does at start-up

    async def receiver() -> None:
        loop = asyncio.get_running_loop()
        ch = make_transport(kind, "rx", SECRET)

        async def sink(env: Any) -> None:
            return None

        ch.set_handler(sink)
        await ch.start()
        print(json.dumps({"port": ch.port, "transport": ch.stats()["transport"]}), flush=True)
        s = socket.socket(fileno=fd)
        s.setblocking(False)
        done = loop.create_future()
        serve_raw(loop, s, done)
        await asyncio.wait_for(done, 3600)  # the sender closes its end when it is done
        await asyncio.wait_for(ch.close(), 10)

    async def sender() -> None:
        loop = asyncio.get_running_loop()
        ch = make_transport(kind, "tx", SECRET)
        await ch.start()
        peer = Endpoint("rx", "127.0.0.1", port)
        s = socket.socket(fileno=fd)
        s.setblocking(False)
        header, buf = b"h" * HEADER_BYTES, bytearray(65536)
        lend = ch.lend if ch.supports("shm") else None
        private = torch.zeros(payload, dtype=torch.uint8)

        def part() -> dict[str, torch.Tensor]:
            """A part's buffer as a split makes it: a slot lent for the peer (no copy on send)."""
            if not payload:
                return {}
            lent = lend(peer, payload) if lend is not None else None
            return {"packed": lent if lent is not None else private}

        lines: asyncio.Queue = asyncio.Queue()

        def read_stdin() -> None:
            for x in sys.stdin:
                loop.call_soon_threadsafe(lines.put_nowait, x)
            loop.call_soon_threadsafe(lines.put_nowait, None)

        threading.Thread(target=read_stdin, daemon=True, name="bench-stdin").start()
        raw: dict[str, Any] = {"fut": None, "got": 0}

        def raw_readable() -> None:  # the raw baseline's reply; registered once, as a channel's socket is
            try:
                raw["got"] += s.recv_into(buf)
            except BlockingIOError:
                return
            fut = raw["fut"]
            if raw["got"] >= ACK_BYTES and fut is not None and not fut.done():
                raw["got"] -= ACK_BYTES
                fut.set_result(None)

        loop.add_reader(s.fileno(), raw_readable)
        step = 0
        while (line := await lines.get()) is not None:
            mode, n = line.split()
            for _ in range(int(n)):
                if mode == "channel":
                    await ch.send(peer, "samples", part_meta(step), part(), timeout=60)
                    step += 1
                else:
                    fut = raw["fut"] = loop.create_future()
                    s.send(header)
                    await asyncio.wait_for(fut, 60)
            print("done", flush=True)
        loop.remove_reader(s.fileno())
        s.close()
        await asyncio.wait_for(ch.close(), 10)

    run_loop(receiver() if role == "rx" else sender())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--msgs", type=int, default=2000, help="messages per round and mode")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--channel", default="auto", help="auto | shm | zmq")
    ap.add_argument("--payload-kib", type=int, default=64, help="packed buffer per message (0: meta only)")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    payload = args.payload_kib * 1024
    if args.role:
        process_main(args.role, args.fd, args.channel, args.port, payload)
        return
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    base = [sys.executable, os.path.abspath(__file__), "--channel", args.channel, "--payload-kib", str(args.payload_kib)]
    rx = subprocess.Popen([*base, "--role", "rx", "--fd", str(b.fileno())], pass_fds=[b.fileno()],
                          stdout=subprocess.PIPE, text=True)
    info = json.loads(rx.stdout.readline())
    tx = subprocess.Popen([*base, "--role", "tx", "--fd", str(a.fileno()), "--port", str(info["port"])],
                          pass_fds=[a.fileno()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    a.close()
    b.close()

    def run(mode: str, n: int) -> tuple[float, float, float]:
        """(sender, receiver, wall) microseconds per message."""
        c0, r0, t0 = cpu_ns(tx.pid), cpu_ns(rx.pid), time.perf_counter()
        tx.stdin.write(f"{mode} {n}\n")
        tx.stdin.flush()
        if tx.stdout.readline().strip() != "done":
            raise RuntimeError("sender process failed (see its stderr)")
        wall = time.perf_counter() - t0
        time.sleep(0.02)  # the last ack's trailing work
        return (cpu_ns(tx.pid) - c0) / n / 1e3, (cpu_ns(rx.pid) - r0) / n / 1e3, wall / n * 1e6

    try:
        for mode in ("channel", "raw"):  # warm-up: connections, segments, first allocations
            run(mode, max(200, args.msgs // 4))
        res: dict[str, list[tuple[float, float, float]]] = {"channel": [], "raw": []}
        for i in range(args.rounds):
            for mode in (("channel", "raw") if i % 2 == 0 else ("raw", "channel")):
                res[mode].append(run(mode, args.msgs))
    finally:
        tx.stdin.close()
        tx.wait(timeout=30)
        rx.wait(timeout=30)
    fig: dict[str, Any] = {"cores": os.cpu_count(), "channel": args.channel, "transport": info["transport"],
                           "payload_kib": args.payload_kib, "msgs": args.msgs, "rounds": args.rounds}
    for mode, rows in res.items():
        for k, name in enumerate(("tx_us", "rx_us", "wall_us")):
            fig[f"{mode}_{name}"] = round(statistics.median(r[k] for r in rows), 1)
        fig[f"{mode}_cpu_us"] = round(statistics.median(r[0] + r[1] for r in rows), 1)
    ratios = [c[0] + c[1] for c in res["channel"]]
    fig["channel_vs_raw"] = round(statistics.median(
        (c[0] + c[1]) / (r[0] + r[1]) for c, r in zip(res["channel"], res["raw"])), 1)
    print(f"machine: {fig['cores']} cores; channel {args.channel} (transport {info['transport']}), "
          f"{args.payload_kib} KiB lent payload; {args.rounds} rounds x {args.msgs} messages, one in flight")
    for mode in ("channel", "raw"):
        print(f"  {mode:8s} CPU per message {fig[f'{mode}_cpu_us']:7.1f} us (sender {fig[f'{mode}_tx_us']:.1f}, "
              f"receiver {fig[f'{mode}_rx_us']:.1f}); wall {fig[f'{mode}_wall_us']:.1f} us")
    print(f"  channel / raw CPU per message: {fig['channel_vs_raw']}x "
          f"(channel rounds {min(ratios):.1f}-{max(ratios):.1f} us)")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
