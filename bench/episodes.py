"""Benchmark: multi-turn episodes over ``BatchedGenerate`` vs the request-level continuous engine.

Why: an agentic rollout asks for one turn of one episode at a time, whenever that episode's
environment answers. ``BatchedGenerate(engine.generate)`` (distflow/env/batching.py) joins the
turns that are waiting into one ``generate`` call, and every turn of a call waits for the call's
longest; ``TorchEngine.continuous`` (distflow/rollout/continuous.py) admits each turn into the
running batch between two decode steps and keeps an episode's KV between its turns.

Workload (the same for both, seeded): ``--episodes`` episodes of a random Qwen2-shaped model
(bench/engine.py's ``--shape small`` on CPU); each has a prompt of 16..64 tokens and 2..5 turns;
a turn samples up to a per-turn cap drawn from ``--turn-new`` (lo,hi; the random model's EOS,
1 in 4096 per token, rarely ends one first); then its "environment" answers after 0..``--env-ms``
ms with 4..24 observation tokens, appended to the context for the next turn. Temperature 1.

Reported per path: wall time, process CPU time (the engine thread is in this process; on a
busy shared machine the CPU ratio is the steadier figure), sampled tokens per second, prefilled
tokens (the engine's count; KV reuse prefills only each later turn's new tokens), KV hits; and
the ratios of the batched path's wall and CPU time to the continuous one's. One torch thread on
CPU unless ``--threads``. Ends with exactly one JSON line. Run: ``python bench/episodes.py [--episodes 64] [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def plan(n: int, seed: int, turn_new: tuple[int, int]) -> list[dict]:
    """Each episode's prompt, per-turn caps, observations and environment delays (seeded)."""
    rng = random.Random(seed)
    eps = []
    for _ in range(n):
        turns = rng.randint(2, 5)
        eps.append({"prompt": [rng.randrange(3, 4096) for _ in range(rng.randint(16, 64))],
                    "caps": [rng.randint(*turn_new) for _ in range(turns)],
                    "obs": [[rng.randrange(3, 4096) for _ in range(rng.randint(4, 24))] for _ in range(turns)],
                    "delay": [rng.random() for _ in range(turns)]})
    return eps


async def episode(i: int, ep: dict, generate, keyed: bool, env_ms: float) -> int:
    """One episode's turns; returns its sampled tokens."""
    from distflow.rollout.protocol import SamplingParams

    ctx, sampled = list(ep["prompt"]), 0
    for t, cap in enumerate(ep["caps"]):
        params = SamplingParams(max_new_tokens=cap, temperature=1.0)
        comp = await (generate(ctx, params, key=(0, i, t)) if keyed else generate(ctx, params))
        sampled += len(comp.tokens)
        await asyncio.sleep(ep["delay"][t] * env_ms / 1000)
        ctx = ctx + list(comp.tokens) + ep["obs"][t]
    return sampled


async def run_path(eng, eps: list[dict], path: str, slots: int, env_ms: float) -> dict:
    from distflow.env.batching import BatchedGenerate

    prefill0, hits0 = eng.stats["prefill_tokens"], eng.stats.get("kv_hits", 0)
    longest = max(len(e["prompt"]) + sum(e["caps"]) + sum(len(o) for o in e["obs"]) for e in eps)
    t0, c0 = time.perf_counter(), time.process_time()
    if path == "batched":
        gen = BatchedGenerate(eng.generate, seed=0, max_batch=slots, window=0.01)
        tasks = [episode(i, e, gen, False, env_ms) for i, e in enumerate(eps)]
        sampled = sum(await asyncio.gather(*tasks))
        calls = gen.batches
    else:
        async with eng.continuous(seed=0, max_slots=slots, max_length=longest) as cont:
            sampled = sum(await asyncio.gather(*(episode(i, e, cont, True, env_ms) for i, e in enumerate(eps))))
        calls = 0
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall_s": wall, "cpu_s": cpu, "sampled_tokens": sampled, "tok_s": sampled / wall, "engine_calls": calls,
            "prefill_tokens": eng.stats["prefill_tokens"] - prefill0,
            "kv_hits": eng.stats.get("kv_hits", 0) - hits0}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--slots", type=int, default=64, help="engine slots (= BatchedGenerate's max_batch)")
    ap.add_argument("--turn-new", default="4,96", help="per-turn max_new_tokens lo,hi")
    ap.add_argument("--env-ms", type=float, default=20.0, help="environment latency: uniform in [0, env-ms] ms")
    ap.add_argument("--shape", default="small")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per path (alternating; best kept)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    from bench.engine import build_model
    from distflow.rollout.torch_engine import TorchEngine

    torch.set_num_threads(args.threads)
    lo, hi = (int(x) for x in args.turn_new.split(","))
    eps = plan(args.episodes, args.seed, (lo, hi))
    with tempfile.TemporaryDirectory() as d:
        eng = TorchEngine(build_model(Path(d) / "m", args.shape, torch.float32), max_slots=args.slots)
        asyncio.run(run_path(eng, eps[:4], "batched", args.slots, 0))  # warm-up
        asyncio.run(run_path(eng, eps[:4], "continuous", args.slots, 0))
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for path in ("batched", "continuous"):
                r = asyncio.run(run_path(eng, eps, path, args.slots, args.env_ms))
                if path not in best or r["wall_s"] < best[path]["wall_s"]:
                    best[path] = r
        eng.close()
    print(f"{args.episodes} episodes, {sum(len(e['caps']) for e in eps)} turns, turn caps {lo}..{hi}, "
          f"env 0..{args.env_ms:g} ms, {args.slots} slots, shape {args.shape}, {args.threads} thread(s)")
    print(f"{'path':<12}{'wall s':>9}{'cpu s':>8}{'tok/s':>10}{'sampled':>9}{'prefill':>9}{'kv hits':>9}{'calls':>7}")
    for path, r in best.items():
        print(f"{path:<12}{r['wall_s']:>9.2f}{r['cpu_s']:>8.2f}{r['tok_s']:>10.0f}{r['sampled_tokens']:>9}"
              f"{r['prefill_tokens']:>9}"
              f"{r['kv_hits']:>9}{r['engine_calls']:>7}")
    ratio = best["batched"]["wall_s"] / best["continuous"]["wall_s"]
    cpu_ratio = best["batched"]["cpu_s"] / best["continuous"]["cpu_s"]
    print(f"continuous is {ratio:.2f}x the batched path's speed (wall time ratio; process CPU time ratio "
          f"{cpu_ratio:.2f}x, the figure to trust on a busy shared machine)")
    summary = {"bench": "episodes", "episodes": args.episodes, "slots": args.slots, "turn_new": [lo, hi],
               "env_ms": args.env_ms, "shape": args.shape, "threads": args.threads,
               "speedup_continuous_vs_batched": round(ratio, 3), "cpu_ratio_batched_vs_continuous": round(cpu_ratio, 3),
               **{f"{p}_{k}": (round(v, 3) if isinstance(v, float) else v)
                  for p, r in best.items() for k, v in r.items()}}
    print(json.dumps(summary, sort_keys=True))
    return summary


if __name__ == "__main__":
    main()
