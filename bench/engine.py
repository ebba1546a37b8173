"""Benchmark: the built-in rollout engine against Hugging Face ``generate``.

Builds a random Qwen2-shaped model (``--shape small`` for CPU, ``--shape qwen0.5b`` for the
Qwen2.5-0.5B shape: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab
151,936) and runs, in one process, on the same prompts:

* ``engine``: :class:`distflow.rollout.engine.TorchEngine` (continuous batching, static KV
  cache; CUDA graphs on CUDA unless ``--no-compile``);
* ``hf_dynamic``: HF ``generate`` with its dynamic cache, ``--slots`` prompts per call;
* ``hf_static_compile``: HF ``generate`` with ``cache_implementation="static"`` and the
  forward under ``torch.compile(mode="reduce-overhead")`` — skipped on CPU unless
  ``--hf-compile`` (compilation there takes longer than the whole benchmark).

Two workloads, both sampling at temperature 1:

* ``fixed``: ``--fixed-prompts`` prompts (one engine batch) whose responses run
  ``--fixed-new`` tokens (no stop ids; the tokenizer's EOS can still end one by chance,
  1 in vocab per token);
* ``variable``: ``--prompts`` prompts (more than ``--slots``) whose responses end at a
  spread of lengths: a set of stop ids covering ~1/``--mean-len`` of the (near-uniform)
  probability mass of the random model ends each response after a geometric number of
  tokens, capped at ``--max-new``. HF gets the same ids as ``eos_token_id``.

Tokens/s counts generated tokens (stop tokens included) over wall time after a warm-up
call per engine (which pays compilation / graph capture, reported separately), and also
per CPU second of this process (``*_cpu_tok_s``, ``cpu_vs_*``: comparable on a busy shared
machine where wall time is not); with
``--repeats N`` the engines alternate N times and each keeps its best time. CPU runs use
one torch thread unless ``--threads`` (a rollout node's ``torch_threads`` default is 1). Prints a
table and ratios, and ends with exactly one JSON line. On CUDA without ``--no-compile`` it exits
non-zero (after the JSON line) when the engine did not decode with CUDA graphs
(:func:`graphs_problem`): its figures would be eager decoding's.
Run: ``python bench/engine.py [--repeats 2]``; on a GPU, the issue's workload:
``python bench/engine.py --device cuda --shape qwen0.5b --fixed-prompts 256 --fixed-new 256
--slots 256`` (bf16 by default on CUDA).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=704, vocab_size=4096),
    "qwen0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     intermediate_size=4864, vocab_size=151936),
}


def build_model(out: Path, shape: str, dtype) -> str:
    """A random Qwen2 model of ``shape`` plus the toy tokenizer, saved to ``out``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from distflow.toy import build_toy_tokenizer

    tok = build_toy_tokenizer(out)
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True,
                      initializer_range=0.02, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, torch_dtype=str(dtype).removeprefix("torch."))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    return str(out)


def make_prompts(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_engine(eng, prompts, params, seed) -> tuple[float, float, int, list[int]]:
    """(wall s, process CPU s, tokens, response lengths) of one generate call."""
    import torch

    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    comps = eng.generate(prompts, params, seed=seed)
    sync()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    lens = [len(c.tokens) for c in comps]
    return dt, cpu, sum(lens), lens


def run_hf(model, prompts, max_new, stop_ids, pad_id, batch, device, static: bool) -> tuple[float, float, int]:
    """HF generate over ``prompts`` in calls of ``batch`` (left padded); counts each row's
    tokens up to and including its first stop id. Returns (wall s, process CPU s, tokens)."""
    import torch

    stop = set(stop_ids)
    total = 0
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(0, len(prompts), batch):
        chunk = prompts[s:s + batch]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        kw = dict(cache_implementation="static") if static else {}
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new,
                                 eos_token_id=sorted(stop), pad_token_id=pad_id, **kw)
        for row in out[:, width:].tolist():
            n = 0
            for t in row:
                n += 1
                if t in stop:
                    break
            total += n
    sync()
    return time.perf_counter() - t0, time.process_time() - c0, total


def graphs_problem(eng, requested: bool) -> str | None:
    """Why the engine did not decode with CUDA graphs although they were ``requested`` (CUDA, no
    ``--no-compile``), or None. A benchmark that silently measured eager decoding would report
    the wrong engine: the HF fallback loop (a model off the static-cache path), captures that
    failed (``graph_eager_steps``: decode steps run eagerly), or no graph captured at all."""
    if not requested:
        return None
    runner = eng.runner
    if runner is None:
        return "CUDA graphs were requested but the model runs on the HF fallback loop (no static cache)"
    if eng.stats["graph_eager_steps"]:
        return (f"CUDA graphs were requested but {eng.stats['graph_eager_steps']} decode steps ran eagerly "
                f"({eng.stats['graph_capture_failures']} failed captures; last error: {runner.graph_error})")
    if not runner.graphs:
        return "CUDA graphs were requested but none was captured"
    return None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: small on cpu, qwen0.5b on cuda")
    ap.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--prompts", type=int, default=512, help="variable workload: number of prompts")
    ap.add_argument("--slots", type=int, default=128, help="engine slots = HF batch size")
    ap.add_argument("--max-new", type=int, default=64, help="response length cap")
    ap.add_argument("--mean-len", type=int, default=24, help="variable workload: mean response length")
    ap.add_argument("--fixed-prompts", type=int, default=128, help="fixed workload: number of prompts")
    ap.add_argument("--fixed-new", type=int, default=32, help="fixed workload: tokens per response")
    ap.add_argument("--prompt-len", default="8,32", help="prompt lengths lo,hi")
    ap.add_argument("--hf-compile", action="store_true", help="also run HF static cache + compile on CPU")
    ap.add_argument("--no-hf-compile", action="store_true", help="skip HF static cache + compile on CUDA")
    ap.add_argument("--no-compile", action="store_true", help="engine without CUDA graphs")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1, a node's torch_threads default; 0 = torch's default)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of each engine (alternating; best kept)")
    args = ap.parse_args(argv)

    import torch

    from distflow.device import node_device
    from distflow.rollout.engine import SamplingParams, TorchEngine, parse_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    device = node_device(args.device)
    shape = args.shape or ("small" if device.type == "cpu" else "qwen0.5b")
    dtype = parse_dtype(args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    vocab = SHAPES[shape]["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "model", shape, dtype)
        eng = TorchEngine(path, device=str(device), dtype=dtype, max_slots=args.slots, compile=not args.no_compile)
        model = eng.model  # HF runs on the very same module and weights
        eos = list(eng.eos_token_ids)
        n_stop = max(1, round(vocab / args.mean_len))
        stop_ids = [t for t in range(3, vocab) if t not in eos][:n_stop]
        workloads = {
            "fixed": (make_prompts(args.fixed_prompts, vocab, lo, hi, 1), args.fixed_new, []),
            "variable": (make_prompts(args.prompts, vocab, lo, hi, 2), args.max_new, stop_ids),
        }
        hf_compile = args.hf_compile if device.type == "cpu" else not args.no_hf_compile
        print(f"bench/engine.py: device {device} ({torch.get_num_threads()} threads), shape {shape}, {dtype}, "
              f"slots {args.slots}", flush=True)

        t0 = time.perf_counter()  # warm-up: kernels, graph capture (paid once per process)
        eng.generate(make_prompts(args.slots, vocab, lo, hi, 3), SamplingParams(max_new_tokens=4), seed=0)
        warm_s = time.perf_counter() - t0
        results: dict[str, dict] = {}
        for name, (prompts, max_new, stops) in workloads.items():
            params = SamplingParams(max_new_tokens=max_new, temperature=1.0, stop_token_ids=tuple(stops))
            hf_stops = eos + stops
            run_hf(model, prompts[:2], 2, hf_stops, eng.pad_token_id, args.slots, device, False)  # warm-up
            row: dict = {}
            for _ in range(args.repeats):  # alternate the two, keep each one's best (shared machines)
                dt, cpu, toks, lens = run_engine(eng, prompts, params, seed=0)
                if dt < row.get("engine_s", float("inf")):
                    row.update(engine_tok_s=toks / dt, engine_s=dt, tokens=toks, len_min=min(lens),
                               len_mean=sum(lens) / len(lens), len_max=max(lens))
                row["engine_cpu_tok_s"] = max(row.get("engine_cpu_tok_s", 0.0), toks / cpu)
                dt, cpu, toks = run_hf(model, prompts, max_new, hf_stops, eng.pad_token_id, args.slots, device,
                                       False)
                if dt < row.get("hf_dynamic_s", float("inf")):
                    row.update(hf_dynamic_tok_s=toks / dt, hf_dynamic_s=dt, hf_tokens=toks)
                row["hf_dynamic_cpu_tok_s"] = max(row.get("hf_dynamic_cpu_tok_s", 0.0), toks / cpu)
            if hf_compile:
                compiled = torch.compile(model.forward, mode="reduce-overhead")
                plain, model.forward = model.forward, compiled
                try:
                    t1 = time.perf_counter()
                    run_hf(model, prompts[:args.slots], max_new, hf_stops, eng.pad_token_id, args.slots, device, True)
                    row["hf_compile_warmup_s"] = time.perf_counter() - t1
                    dt, _, toks = run_hf(model, prompts, max_new, hf_stops, eng.pad_token_id, args.slots, device,
                                         True)
                    row.update(hf_static_compile_tok_s=toks / dt, hf_static_compile_s=dt)
                finally:
                    model.forward = plain
            row["vs_hf_dynamic"] = row["engine_tok_s"] / row["hf_dynamic_tok_s"]
            # Per CPU second of this process: what a busy shared CPU machine can still compare.
            row["cpu_vs_hf_dynamic"] = row["engine_cpu_tok_s"] / row["hf_dynamic_cpu_tok_s"]
            if "hf_static_compile_tok_s" in row:
                row["vs_hf_static_compile"] = row["engine_tok_s"] / row["hf_static_compile_tok_s"]
            results[name] = row
            print(f"{name:9s} {len(prompts)} prompts, lengths {row['len_min']}..{row['len_max']} "
                  f"(mean {row['len_mean']:.1f}): engine {row['engine_tok_s']:,.0f} tok/s, HF dynamic "
                  f"{row['hf_dynamic_tok_s']:,.0f} tok/s -> {row['vs_hf_dynamic']:.2f}x (per CPU second "
                  f"{row['engine_cpu_tok_s']:,.0f} vs {row['hf_dynamic_cpu_tok_s']:,.0f} -> "
                  f"{row['cpu_vs_hf_dynamic']:.2f}x)" +
                  (f", HF static+compile {row['hf_static_compile_tok_s']:,.0f} tok/s -> "
                   f"{row['vs_hf_static_compile']:.2f}x" if hf_compile else ""), flush=True)
        if not hf_compile:
            print("HF static cache + torch.compile skipped" +
                  (" on CPU (compiling takes longer than the benchmark; --hf-compile runs it)"
                   if device.type == "cpu" else " (--no-hf-compile)"))
        summary = {"bench": "engine", "device": str(device), "device_name": torch.cuda.get_device_name(device)
                   if device.type == "cuda" else "cpu", "threads": torch.get_num_threads(), "shape": shape,
                   "dtype": str(dtype).removeprefix("torch."), "slots": args.slots, "repeats": args.repeats,
                   "warmup_s": round(warm_s, 3),
                   "capture_s": round(eng.stats["capture_s"], 3), "hf_static_compile": hf_compile,
                   "graph_capture_failures": eng.stats["graph_capture_failures"],
                   "graph_eager_steps": eng.stats["graph_eager_steps"],
                   **{f"{w}_{k}": (round(v, 3) if isinstance(v, float) else v) for w, r in results.items()
                      for k, v in r.items()}}
        problem = graphs_problem(eng, device.type == "cuda" and not args.no_compile)
        eng.close()
    print(json.dumps(summary, sort_keys=True))
    if problem is not None:  # after the figures, which are printed, but not as the engine's
        raise SystemExit(f"bench/engine.py: {problem}")
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
