"""Benchmark: seconds per GiB of weight sync by tier, against the naive path, in one run.

Why it exists: weight sync sits on every training step's critical path to the rollout nodes,
and the issue's claim is that moving weights bucket by bucket through the right tier beats
gathering the whole model first. Three real processes: two trainer ranks (an FSDP2 model,
gloo, world size 2, ``--mib`` MiB of fp32 weights in 16 MiB layers; rank 0 serves the rollout
node, rank 1 serves nobody) and a rollout node (an "engine": a dict of preallocated weights
it copies every update into, in place, as a real engine does).

* naive (the path before this change): ``full_tensor()`` of every parameter into fresh pageable
  CPU tensors (one dict, the whole model at once), then 64 MiB buckets over the channel,
  assembled into one dict on the rollout node, then copied into the engine;
* channel tier over ``shm`` and ``zmq``: ``iter_weight_buckets`` (bucket by bucket, the shards sent
  to the serving rank only, straight into the bucket buffer: on shm a slot lent by the channel) fed to
  ``WeightPublisher.publish_iter`` (bucket k on the wire while k+1 is gathered), the rollout's
  ``WeightInbox`` hands the buckets unmerged to the engine;
* on CUDA (when present; the issue's case of one host): ONE trainer rank (FSDP2 over NCCL, world
  size 1, fp32 master weights on GPU 0) publishing in bf16 (``--cuda-gib`` GiB of bf16 weights in
  8 MiB layers; 1 GiB = a 0.5B model) to a rollout process whose engine holds bf16 weights on
  the GPU: naive (``full_tensor()`` to pageable CPU memory in bf16, shm, the engine copies host
  -> GPU) against the tiers ``pinned`` (channel tier: GPU buckets staged into pinned host
  buffers, shm), ``cuda_ipc`` (same GPU: handles in the header, device-to-device copies) and,
  with two GPUs, ``nccl`` (the rollout on GPU 1, the NCCL channel). Figures
  ``cuda_<tier>_s_per_sync`` (the issue's target: <= 0.2 s for 1 GiB) and
  ``cuda_<tier>_vs_naive``. Never run without a GPU.

Time per sync = trainer starts gathering -> the rollout's engine holds the new weights (clock:
CLOCK_MONOTONIC, system-wide). Modes alternate (paired repetitions); medians are reported.
Prints ``<tier>_vs_naive`` ratios (naive seconds / tier seconds) and ends with one JSON line.
Run: ``python bench/weights.py [--mib 256] [--reps 5] [--cuda-gib 1] [--cuda-kinds pinned,cuda_ipc,nccl]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

SECRET = "bench-weights-secret-0123456789abcdef"
LAYER = 2048  # 2048 x 2048 fp32 = 16 MiB per layer (8 MiB in bf16)
WORLD = 2  # trainer ranks on CPU (FSDP2 over gloo); rank 0 serves the rollout node
CUDA_KINDS = ("pinned", "cuda_ipc", "nccl")  # on CUDA: one trainer rank (world 1) on GPU 0


def cuda_side(kind: str, role: str) -> tuple[str, str, str]:
    """(channel kind, GPU index, weight transport) of a CUDA-mode process: the NCCL tier puts the
    rollout on GPU 1 (NCCL refuses two ranks on one GPU), the others share GPU 0."""
    gpu = "1" if kind == "nccl" and role == "rollout" else "0"
    return ("nccl" if kind == "nccl" else "shm"), gpu, ("channel" if kind == "pinned" else kind)


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def rollout_main(kind: str, layers: int, q_out, q_in, cuda: bool = False) -> None:
    if cuda:  # this node's GPU (before anything touches CUDA)
        kind, gpu, _ = cuda_side(kind, "rollout")
        os.environ["DISTFLOW_LOCAL_GPU"] = gpu
    import torch

    from distflow.core.aio import run_loop
    from distflow.transport import HandlerMux, make_transport
    from distflow.device import node_device
    from distflow.weights import WeightInbox

    torch.set_num_threads(1)
    dev = node_device("cuda" if cuda else "cpu")

    def settle() -> None:  # the engine holds the weights once its copies ran
        if cuda:
            torch.cuda.synchronize(dev)

    async def main() -> None:
        dt = torch.bfloat16 if cuda else torch.float32
        engine = {f"{i}.weight": torch.zeros(LAYER, LAYER, dtype=dt, device=dev) for i in range(layers)}
        ch = make_transport(kind, "rollout", SECRET)
        inbox = WeightInbox(device=dev if cuda else None)
        naive: dict = {}
        done = asyncio.Queue()

        def apply(version: int, bucket: dict) -> None:  # the idle engine loads each bucket as it arrives
            for n, t in bucket.items():
                engine[n].copy_(t, non_blocking=cuda)
            settle()  # (a CUDA IPC view must not be dropped before its copy ran)

        inbox.stream_to(apply)

        async def on_weights(env) -> None:
            await inbox.receive(env)
            upd = inbox.take_update()
            if upd is not None:  # whatever was not streamed (nothing, here)
                for b in upd.buckets:
                    apply(upd.version, b)
                del upd
                done.put_nowait(now())

        async def on_naive(env) -> None:  # the old inbox: one dict, then load_weights
            naive.setdefault(env.meta["version"], {}).update(env.tensors)
            if env.meta["bucket"] + 1 == env.meta["num_buckets"]:
                state = naive.pop(env.meta["version"])
                for n, t in state.items():
                    engine[n].copy_(t)  # pageable host -> GPU on CUDA
                settle()
                del state
                done.put_nowait(now())

        mux = HandlerMux()
        mux.register("weights", on_weights)
        mux.register("naive", on_naive)
        ch.set_handler(mux)
        await ch.start()
        q_out.put(ch.port)
        loop = asyncio.get_running_loop()
        while (cmd := await loop.run_in_executor(None, q_in.get)) != "stop":
            q_out.put(await asyncio.wait_for(done.get(), 300))
        await ch.close()

    run_loop(main())


def trainer_main(rank: int, pg_port: int, kind: str, layers: int, reps: int, port: int, q_out, q_roll,
                 cuda: bool = False) -> None:
    transport = "channel"
    if cuda:
        kind, gpu, transport = cuda_side(kind, "trainer")
        os.environ["DISTFLOW_LOCAL_GPU"] = gpu
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from distflow.core.aio import run_loop
    from distflow.transport import Endpoint, make_transport
    from distflow.device import node_device
    from distflow.weights import BUCKET_BYTES, WeightPublisher, buckets
    from distflow.trainer.gather import iter_weight_buckets

    torch.set_num_threads(1)
    dev, world = node_device("cuda" if cuda else "cpu"), 1 if cuda else WORLD
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank,
                            world_size=world, **({"device_id": dev} if cuda else {}))
    model = torch.nn.Sequential(*[torch.nn.Linear(LAYER, LAYER, bias=False) for _ in range(layers)]).to(dev)
    mesh = init_device_mesh(dev.type, (world,))
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    wire = torch.bfloat16 if cuda else None  # fp32 masters published in the engine's bf16

    def naive_state() -> dict:  # Actor.full_state_dict as it was (cast to the engine's dtype on CUDA)
        return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().to("cpu", dtype=wire).contiguous()
                for n, t in model.state_dict().items()}

    def settle() -> None:  # the step's weights are final before the clock starts
        if cuda:
            torch.cuda.synchronize(dev)

    if rank:  # serves no rollout node: takes part in every gather, keeps nothing
        for rep in range(reps + 1):
            for mode in (("naive", "channel") if rep % 2 else ("channel", "naive")):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
                if mode == "naive":
                    naive_state()  # as before: every rank gathered the whole model
                else:
                    for _ in iter_weight_buckets(model, BUCKET_BYTES, keep=False, device="cpu"):
                        pass
        dist.barrier()  # leave together: a rank tearing down while another still runs can abort
        dist.destroy_process_group()
        return

    async def main() -> dict:
        ch = make_transport(kind, "trainer", SECRET)
        await ch.start()
        peer = Endpoint("rollout", "127.0.0.1", port)
        pub = WeightPublisher(ch, ["rollout"], lambda _: peer, lambda _: True, timeout=300,
                              transport_of=lambda _: transport)
        alloc = None if cuda else pub.gather_alloc()  # shm: buckets gathered straight into lent shared memory
        loop = asyncio.get_running_loop()
        times: dict[str, list[float]] = {"naive": [], "channel": []}
        version = 0
        for rep in range(reps + 1):  # the first round warms up (connections, shm segments)
            for mode in (("naive", "channel") if rep % 2 else ("channel", "naive")):
                version += 1
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
                settle()
                q_roll.put("go")
                t0 = now()
                if mode == "naive":
                    state = await asyncio.to_thread(naive_state)
                    parts = buckets(state, BUCKET_BYTES)
                    for i, part in enumerate(parts):
                        await ch.send(peer, "naive", {"version": version, "bucket": i, "num_buckets": len(parts)},
                                      part, timeout=300)
                    del state, parts
                else:
                    await pub.publish_iter(version, iter_weight_buckets(model, BUCKET_BYTES, keep=True,
                                                                        device=dev, alloc=alloc, dtype=wire))
                t1 = await loop.run_in_executor(None, q_out.get)
                if rep:
                    times[mode].append(t1 - t0)
        await pub.close()
        await ch.close()
        return times

    times = run_loop(main())
    dist.barrier()
    dist.destroy_process_group()
    q_out.put(("times", times))


def run_kind(kind: str, layers: int, reps: int, cuda: bool = False) -> dict[str, list[float]]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    q_port, q_roll = ctx.Queue(), ctx.Queue()
    roll = ctx.Process(target=rollout_main, args=(kind, layers, q_port, q_roll, cuda), daemon=True)
    roll.start()
    port = q_port.get(timeout=120)
    # the rollout reports each completed sync on q_port; trainer rank 0 reads it there
    from distflow.launch.children import free_ports

    pg_port = free_ports("127.0.0.1", 1)[0]
    trs = [ctx.Process(target=trainer_main, args=(r, pg_port, kind, layers, reps, port, q_port, q_roll, cuda),
                       daemon=True) for r in range(1 if cuda else WORLD)]
    for t in trs:
        t.start()
    tr = trs[0]
    for t in trs:
        t.join(600)
    times = None
    while not q_port.empty():
        item = q_port.get()
        if isinstance(item, tuple) and item[0] == "times":
            times = item[1]
    q_roll.put("stop")
    roll.join(30)
    for p in (*trs, roll):
        if p.is_alive():
            p.kill()
    if times is None:
        raise RuntimeError(f"{kind}: the trainer process failed (exit code {tr.exitcode})")
    return times


def cuda_figures(args: argparse.Namespace, figures: dict) -> None:
    """The GPU tiers against the naive path, one trainer rank on GPU 0 (see the module docstring)."""
    import torch

    from distflow.transport.movers.nccl import nccl_available

    layers = max(1, round(args.cuda_gib * 1024 / 8))  # 8 MiB of bf16 per layer
    gib = layers * LAYER * LAYER * 2 / 2**30
    print(f"CUDA ({torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} GPU(s)): {gib:.2f} GiB of bf16 "
          f"weights in {layers} layers, fp32 masters on GPU 0; s per sync median [min-max]")
    fmt = lambda xs: f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"  # noqa: E731
    for kind in args.cuda_kinds.split(","):
        if kind not in CUDA_KINDS:
            raise SystemExit(f"--cuda-kinds: unknown tier {kind!r}; expected some of {', '.join(CUDA_KINDS)}")
        if kind == "nccl" and (torch.cuda.device_count() < 2 or not nccl_available()):
            print("nccl: skipped (needs two GPUs and cupy: NCCL refuses two ranks on one GPU)")
            continue
        times = run_kind(kind, layers, args.reps, cuda=True)
        ratios = [a / b for a, b in zip(times["naive"], times["channel"])]
        print(f"{kind:>8}: naive {fmt(times['naive'])} s | {kind} {fmt(times['channel'])} s | "
              f"cuda_{kind}_vs_naive {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")
        figures.update({"cuda_gib": round(gib, 3), f"cuda_naive_{kind}_s_per_sync": round(statistics.median(
            times["naive"]), 4), f"cuda_{kind}_s_per_sync": round(statistics.median(times["channel"]), 4),
            f"cuda_{kind}_vs_naive": round(statistics.median(ratios), 3)})


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="model size in MiB of fp32 weights (16 MiB layers)")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--kinds", default="shm,zmq")
    ap.add_argument("--cuda-gib", type=float, default=1.0, help="CUDA: GiB of bf16 weights synced (1 = a 0.5B model)")
    ap.add_argument("--cuda-kinds", default=",".join(CUDA_KINDS), help="CUDA tiers to time (when a GPU is present)")
    args = ap.parse_args()
    layers = max(1, args.mib // 16)
    gib = layers * LAYER * LAYER * 4 / 2**30
    cores = len(os.sched_getaffinity(0))
    import torch

    print(f"machine: {cores} cores, CUDA {'yes' if torch.cuda.is_available() else 'no (no GPU tiers)'}; "
          f"model {gib * 1024:.0f} MiB fp32 in {layers} layers; {args.reps} paired repetitions; s/GiB median [min-max]")
    figures: dict = {"cores": cores, "mib": round(gib * 1024), "reps": args.reps, "cuda": torch.cuda.is_available()}
    for kind in args.kinds.split(","):
        times = run_kind(kind, layers, args.reps)
        naive = [t / gib for t in times["naive"]]
        tier = [t / gib for t in times["channel"]]
        ratios = [a / b for a, b in zip(times["naive"], times["channel"])]
        fmt = lambda xs: f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"  # noqa: E731
        print(f"{kind:>4}: naive {fmt(naive)} s/GiB | channel tier {fmt(tier)} s/GiB | "
              f"channel_{kind}_vs_naive {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")
        figures.update({f"naive_{kind}_s_per_gib": round(statistics.median(naive), 4),
                        f"channel_{kind}_s_per_gib": round(statistics.median(tier), 4),
                        f"channel_{kind}_vs_naive": round(statistics.median(ratios), 3)})
    if torch.cuda.is_available() and args.cuda_kinds:
        cuda_figures(args, figures)
    sys.stdout.flush()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
