"""Benchmark: the trainer's packed, response-only path against the padded, full-logits path.

Why it exists: issue #11 asks whether packing variable-length samples into one row (block-
diagonal attention, no pad compute) and running the LM head on response positions only,
chunked, makes the update faster and leaner. Both paths run in one process, on the same
random model and the same variable-length batch (responses 1-to-8x in length), and do the
same work a policy update does per micro-batch: forward, per-token logprobs of the response
tokens, a token-weighted loss, backward.

* padded (the trainer before #11): ``micro_batch_size`` samples right-padded to the longest,
  ``token_logprobs`` (LM head and fp32 log-softmax at every position, prompts and pads too);
* packed (now): first-fit token-budget micro-batches (``max_tokens_per_micro_batch``) packed
  into one row each, ``response_forward`` (decoder once, chunked LM head on response
  positions only).

Reported per path: real tokens/s (prompt + response tokens / wall time of forward+backward,
median of ``--reps`` passes, interleaved between the paths), process CPU seconds, compute
slots (tokens the model actually processed, pads included), bytes autograd saved for
backward (deterministic: ``saved_tensors_hooks``; the activation memory held between
forward and backward, the largest single micro-batch) and, on CUDA, the peak allocated
memory (``torch.cuda.max_memory_allocated``). Ratios packed / padded are printed, then
exactly one JSON line.

    python bench/trainer.py                      # CPU default: ~1 min on 2 cores
    python bench/trainer.py --device cuda --shape qwen0.5b --dtype bfloat16

``--parallel`` instead compares the tensor-parallel and sequence-parallel meshes with one rank on one
long sample, in gloo processes (:mod:`bench.trainer_parallel`: equality and memory per rank).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    # a small Llama-style model whose vocabulary dominates, like real small LMs
    "small": dict(arch="llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=688, vocab_size=16384),
    # Qwen2.5-0.5B's shape
    "qwen0.5b": dict(arch="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, intermediate_size=4864, vocab_size=151936),
}


def build_model(shape: str, dtype, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    cls_cfg, cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    cfg = cls_cfg(**spec, max_position_embeddings=4096, tie_word_embeddings=True, attn_implementation="sdpa",
                  use_cache=False)
    from distflow.trainer.attention import register_varlen_attention

    torch.manual_seed(0)
    model = cls(cfg).to(device=device, dtype=dtype).train()
    model.set_attn_implementation(register_varlen_attention())  # what the trainer uses (SDPA when padded)
    return model


def make_batch(n: int, prompt_len: int, min_resp: int, max_resp: int, vocab: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g) for _ in range(n)]
    lens = torch.randint(min_resp, max_resp + 1, (n,), generator=g).tolist()
    responses = [torch.randint(0, vocab, (r,), generator=g) for r in lens]
    return prompts, responses


def micro_batches(prompts, responses, mode: str, micro_batch_size: int, max_tokens: int):
    from distflow.trainer.logprobs import pad_batch
    from distflow.trainer.packing import pack_inputs, plan_micro_batches, sample_lengths

    if mode == "padded":
        plan = plan_micro_batches(sample_lengths(prompts, responses), micro_batch_size=micro_batch_size)
        return [pad_batch([prompts[i] for i in idx], [responses[i] for i in idx], 0) for idx in plan]
    plan = plan_micro_batches(sample_lengths(prompts, responses), micro_batch_size=len(prompts), max_tokens=max_tokens)
    return [pack_inputs([prompts[i] for i in idx], [responses[i] for i in idx]) for idx in plan]


def run_pass(model, mbs, mode: str, device, chunk: int) -> None:
    """Forward + backward of every micro-batch (a token-weighted logprob loss)."""
    from distflow.trainer.head import response_forward
    from distflow.trainer.logprobs import gather_response, token_logprobs

    for mb in mbs:
        if mode == "padded":
            ids, attn, resp = (t.to(device) for t in mb)
            lp = gather_response(token_logprobs(model, ids, attn), resp)
        else:
            lp, _ = response_forward(model, mb.to(device), 1.0, chunk)
        (lp.sum() * 1e-3).backward()


def saved_bytes(model, mb, mode: str, device, chunk: int) -> int:
    """Bytes autograd keeps for backward over one micro-batch's forward (distinct tensors)."""
    import torch

    from distflow.trainer.head import response_forward
    from distflow.trainer.logprobs import gather_response, token_logprobs

    seen: dict = {}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        seen[key] = t.numel() * t.element_size()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if mode == "padded":
            ids, attn, resp = (t.to(device) for t in mb)
            lp = gather_response(token_logprobs(model, ids, attn), resp)
        else:
            lp, _ = response_forward(model, mb.to(device), 1.0, chunk)
    del lp
    return sum(v for k, v in seen.items() if k[0] not in params)  # activations, not the weights


def prepare(model, prompts, responses, mode: str, args, device) -> dict:
    mbs = micro_batches(prompts, responses, mode, args.micro_batch_size, args.max_tokens)
    real = sum(int(p.numel() + r.numel()) for p, r in zip(prompts, responses))
    slots = sum(int(mb[0].numel()) for mb in mbs) if mode == "padded" else sum(mb.compute_tokens for mb in mbs)
    saved = max(saved_bytes(model, mb, mode, device, args.chunk) for mb in mbs)
    return {"mbs": mbs, "micro_batches": len(mbs), "real_tokens": real, "compute_slots": slots,
            "saved_activation_mib": round(saved / 2**20, 2)}


def timed_pass(model, r: dict, mode: str, args, device) -> tuple[float, float, float | None]:
    """(wall s, process CPU s, peak MiB on CUDA) of one forward+backward over the batch."""
    import torch

    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0, c0 = time.perf_counter(), time.process_time()
    run_pass(model, r["mbs"], mode, device, args.chunk)
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    return time.perf_counter() - t0, time.process_time() - c0, peak


def measure(model, prompts, responses, args, device) -> dict[str, dict]:
    """Both paths, warmed up, then ``reps`` interleaved timed passes (padded, packed, padded,
    ...) so load on the machine hits both alike; medians."""
    modes = ("padded", "packed")
    prep = {m: prepare(model, prompts, responses, m, args, device) for m in modes}
    for m in modes:
        timed_pass(model, prep[m], m, args, device)  # warm-up
    runs: dict[str, list] = {m: [] for m in modes}
    for _ in range(args.reps):
        for m in modes:
            runs[m].append(timed_pass(model, prep[m], m, args, device))
    out = {}
    for m in modes:
        wall = statistics.median(x[0] for x in runs[m])
        cpu = statistics.median(x[1] for x in runs[m])
        r = {k: v for k, v in prep[m].items() if k != "mbs"}
        r.update(seconds=round(wall, 4), tokens_per_s=round(r["real_tokens"] / wall, 1),
                 cpu_seconds=round(cpu, 3))
        if device.type == "cuda":
            r["peak_mib"] = round(max(x[2] for x in runs[m]), 1)
        out[m] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--min-resp", type=int, default=16, help="shortest response (the longest is 8x this)")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="padded path: samples per micro-batch")
    ap.add_argument("--max-tokens", type=int, default=1024, help="packed path: token budget per micro-batch")
    ap.add_argument("--chunk", type=int, default=1024, help="packed path: LM-head chunk (tokens)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--parallel", action="store_true", help="TP=2 and SP=2 vs one rank (bench/trainer_parallel.py)")
    ap.add_argument("--prompt-len-parallel", type=int, default=3072, help="--parallel: the sample's prompt")
    ap.add_argument("--response-len-parallel", type=int, default=1024, help="--parallel: the sample's response")
    args = ap.parse_args()
    if args.parallel:
        from bench.trainer_parallel import main as parallel_main

        return parallel_main(args, SHAPES)

    import torch

    from distflow.device import node_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = node_device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model = build_model(args.shape, dtype, device)
    prompts, responses = make_batch(args.samples, args.prompt_len, args.min_resp, 8 * args.min_resp,
                                    model.config.vocab_size)
    print(f"trainer bench: {args.shape} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{dtype}, {device}), {args.samples} samples, prompt {args.prompt_len}, responses "
          f"{args.min_resp}-{8 * args.min_resp} tokens", file=sys.stderr)
    results = measure(model, prompts, responses, args, device)
    for mode, r in results.items():
        print(f"  {mode:7s} {r}", file=sys.stderr)
    pad, pk = results["padded"], results["packed"]
    ratios = {"tokens_per_s_ratio": round(pk["tokens_per_s"] / pad["tokens_per_s"], 2),
              "cpu_seconds_ratio": round(pk["cpu_seconds"] / pad["cpu_seconds"], 3),
              "saved_activation_ratio": round(pk["saved_activation_mib"] / pad["saved_activation_mib"], 3),
              "compute_slots_ratio": round(pk["compute_slots"] / pad["compute_slots"], 3)}
    if "peak_mib" in pk:
        ratios["peak_mib_ratio"] = round(pk["peak_mib"] / pad["peak_mib"], 3)
    print(f"  packed / padded: tokens/s x{ratios['tokens_per_s_ratio']}, saved activations "
          f"x{ratios['saved_activation_ratio']}, compute slots x{ratios['compute_slots_ratio']}", file=sys.stderr)
    print(json.dumps({"bench": "trainer", "device": str(device), "shape": args.shape, "dtype": str(dtype),
                      "samples": args.samples, "padded": pad, "packed": pk, **ratios}))


if __name__ == "__main__":
    main()
