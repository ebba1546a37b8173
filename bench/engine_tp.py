"""Benchmark: the built-in engine with tensor parallelism (``rollout_tensor_parallel``) against TP=1.

Builds bench/engine.py's random Qwen2-shaped model (``--shape``), then generates the same prompts
(``--prompts`` prompts, ``--new`` tokens each, temperature 1, no stop ids) with a TP=1 engine and a
TP=``--tp`` engine (rank 0 here, ``--tp - 1`` follower processes; gloo on CPU, one GPU each and
NCCL on CUDA), and reports for each: tokens/s (wall, after a warm-up call, best of ``--repeats``),
the weight bytes each rank holds (rank 0's model, the followers' as they report them), whether the
two produced the same tokens and the largest logprob difference. Ends with exactly one JSON line.

What to expect: on CPU with one torch thread per rank, TP adds two all-reduces per layer per step
(and a broadcast of the step's inputs) over loopback TCP, so a small model generates SLOWER with
TP; the point of TP there is the per-rank weight (and KV cache) bytes, about 1/N of the split
layers (the embeddings and LM head stay whole on every rank). Speed-ups need GPUs with a fast link
and a model whose layers are large. Run: ``python bench/engine_tp.py [--tp 2 --shape small]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", default="small", help="bench/engine.py's shapes: small, qwen0.5b")
    ap.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel degree to compare with 1")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=32, help="tokens per response")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every rank (CPU)")
    args = ap.parse_args(argv)

    import torch

    from bench.engine import SHAPES, build_model, make_prompts, run_engine
    from distflow.rollout.engine import SamplingParams, TorchEngine
    from distflow.rollout.llama_forward import module_bytes

    torch.set_num_threads(args.threads)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0)
    prompts = make_prompts(args.prompts, SHAPES[args.shape]["vocab_size"], 8, 32, seed=0)
    rows: dict[str, dict] = {}
    outs = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "model", args.shape, getattr(torch, dtype))
        for tp in (1, args.tp):
            eng = TorchEngine(path, device=args.device, dtype=dtype, max_slots=args.slots, tensor_parallel=tp,
                              compile=False)  # TP decodes eagerly: compare like with like
            run_engine(eng, prompts[:2], params, seed=1)  # warm-up
            best = None
            for _ in range(args.repeats):
                dt, cpu, toks, _ = run_engine(eng, prompts, params, seed=7)
                best = dt if best is None else min(best, dt)
            outs[tp] = eng.generate(prompts, params, seed=7)
            ranks = [module_bytes(eng.model)] + ([s["weight_bytes"] for s in eng.tp.ask("stats")] if eng.tp else [])
            rows[f"tp{tp}"] = {"tok_s": toks / best, "wall_s": best, "tokens": toks, "rank_weight_bytes": ranks}
            eng.close()
    same = [a.tokens for a in outs[1]] == [b.tokens for b in outs[args.tp]]
    diff = max(abs(x - y) for a, b in zip(outs[1], outs[args.tp]) for x, y in zip(a.logprobs, b.logprobs))
    one, many = rows["tp1"], rows[f"tp{args.tp}"]
    summary = {"bench": "engine_tp", "device": args.device, "shape": args.shape, "dtype": dtype, "tp": args.tp,
               "prompts": args.prompts, "new_tokens": args.new, **{f"{k}_{m}": v for k, r in rows.items()
                                                                  for m, v in r.items()},
               "tok_s_ratio": many["tok_s"] / one["tok_s"],
               "rank_weight_ratio": max(many["rank_weight_bytes"]) / one["rank_weight_bytes"][0],
               "same_tokens": same, "max_logprob_diff": diff}
    print(f"{'':6} {'tok/s':>10} {'wall s':>8} {'weight MB per rank':>30}")
    for k, r in rows.items():
        mbs = ", ".join(f"{b / 1e6:.1f}" for b in r["rank_weight_bytes"])
        print(f"{k:6} {r['tok_s']:10.1f} {r['wall_s']:8.2f} {mbs:>30}")
    print(f"TP={args.tp} / TP=1: tokens/s x{summary['tok_s_ratio']:.2f}, largest rank's weights "
          f"x{summary['rank_weight_ratio']:.2f}; same tokens: {same}, largest logprob difference {diff:.2e}")
    print(json.dumps(summary, sort_keys=True))
    return summary


if __name__ == "__main__":
    main()
