"""Benchmark: the trainer's tensor-parallel and sequence-parallel meshes against one rank, on one long sample.

Why it exists: issue #37 asks whether ``tensor_parallel: 2``, ``sequence_parallel: 2`` and both compute
the same thing as one rank, and what each saves per rank. Each variant runs in real gloo processes (forked,
a FileStore), loads the same random model through the trainer's own loader (``load_for_training``: FSDP2,
the TP plan, the (dp, sp) mesh) and does what the policy update does with one packed micro-batch: the
decoder and the chunked response-only head (``response_forward``; with SP each rank holds half of the
row, :mod:`distflow.trainer.ulysses`), the token-mean of the response logprobs as loss, backward.

Reported per variant: the loss, the largest difference of the response logprobs and of every gradient
(``full_tensor``) from the one-rank baseline's, and per rank: parameter bytes (the local shards) and
the bytes autograd saved for backward (``saved_tensors_hooks``, parameters excluded: the activations
held between forward and backward), with their ratios to the baseline's. On a CPU, wall times mean
little (gloo collectives, 2 cores); memory and equality are the point. Ends with one JSON line.

    python bench/trainer.py --parallel          # CPU: ~1 min on 2 cores
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

# name -> (ranks, tensor_parallel, sequence_parallel); each dp 1: one data-parallel share, as the baseline
VARIANTS = {"baseline": (1, 1, 1), "tp2": (2, 2, 1), "sp2": (2, 1, 2), "sp2xtp2": (4, 2, 2)}


def _rank(rank: int, world: int, store: str, model_dir: str, tp: int, sp: int, lens: tuple[int, int],
          out: str) -> None:
    import torch
    import torch.distributed as dist

    from distflow.trainer.model import load_for_training
    from distflow.trainer.packing import pack_inputs
    from distflow.trainer.parallel import sp_group, trainer_mesh
    from distflow.trainer.ulysses import shard_inputs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = trainer_mesh("cpu", world, tp, sp)
        model = load_for_training(model_dir, mesh, torch.device("cpu"), torch.float32)
        g = torch.Generator().manual_seed(1)
        vocab = model.config.vocab_size
        inputs = pack_inputs([torch.randint(0, vocab, (lens[0],), generator=g)],
                             [torch.randint(0, vocab, (lens[1],), generator=g)])
        if sp > 1:
            inputs = shard_inputs(inputs, sp_group(mesh))
        local = lambda p: p.to_local() if hasattr(p, "to_local") else p  # noqa: E731
        param_bytes = sum(local(p).numel() * p.element_size() for p in model.parameters())
        seen: dict = {}

        def pack(t):
            if not (t.is_leaf and t.requires_grad):  # a parameter is not an activation
                x = getattr(t, "_local_tensor", t)  # (a DTensor: this rank's part)
                seen[(x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.dtype)] = \
                    x.numel() * x.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, _ = model.response_forward(inputs, 1.0, 1024, False)
        loss = lp.mean()
        loss.backward()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                 for n, p in model.named_parameters()}
        mine = {"param_bytes": param_bytes, "saved_bytes": sum(seen.values()), "row": int(inputs.input_ids.shape[1])}
        per_rank: list[Any] = [None] * world
        dist.all_gather_object(per_rank, mine)
        if rank == 0:
            torch.save({"loss": float(loss.detach()), "lp": lp.detach(), "grads": grads, "ranks": per_rank}, out)
    finally:
        dist.destroy_process_group()


def _save_model(shape: dict, out_dir: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(shape)
    if spec.pop("arch") != "llama":
        raise SystemExit("--parallel runs the llama-style shapes only")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**spec, max_position_embeddings=8192, tie_word_embeddings=False,
                                 use_cache=False)).save_pretrained(out_dir)


def run(shape: dict, prompt_len: int, response_len: int) -> dict:
    """Every variant of :data:`VARIANTS`; the dict the JSON line reports."""
    import torch
    import torch.multiprocessing as mp

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="distflow-bench-parallel-") as tmp:
        model_dir = os.path.join(tmp, "model")
        _save_model(shape, model_dir)
        for name, (world, tp, sp) in VARIANTS.items():
            out = os.path.join(tmp, f"{name}.pt")
            mp.start_processes(_rank, args=(world, os.path.join(tmp, f"{name}.store"), model_dir, tp, sp,
                                            (prompt_len, response_len), out), nprocs=world, join=True,
                               start_method="fork")
            results[name] = torch.load(out)
    base = results["baseline"]
    b_param, b_saved = base["ranks"][0]["param_bytes"], base["ranks"][0]["saved_bytes"]
    report: dict[str, Any] = {}
    for name, r in results.items():
        grad_diff = max(float((r["grads"][n] - g).abs().max() / g.abs().max().clamp(min=1e-30))
                        for n, g in base["grads"].items())
        param = max(x["param_bytes"] for x in r["ranks"])
        saved = max(x["saved_bytes"] for x in r["ranks"])
        report[name] = {"ranks": len(r["ranks"]), "row_tokens_per_rank": r["ranks"][0]["row"],
                        "loss": round(r["loss"], 6), "loss_abs_diff": abs(r["loss"] - base["loss"]),
                        "logprob_max_abs_diff": float((r["lp"] - base["lp"]).abs().max()),
                        "grad_max_rel_diff": grad_diff,
                        "param_mib_per_rank": round(param / 2**20, 2), "saved_activation_mib_per_rank":
                        round(saved / 2**20, 2), "param_ratio": round(param / b_param, 3),
                        "saved_activation_ratio": round(saved / b_saved, 3)}
    return report


def main(args: Any, shapes: dict) -> None:
    """``bench/trainer.py --parallel``: print the variants, then one JSON line (``shapes``: the bench's)."""
    report = run(shapes[args.shape], args.prompt_len_parallel, args.response_len_parallel)
    tokens = args.prompt_len_parallel + args.response_len_parallel
    print(f"trainer parallel bench: {args.shape}, one packed sample of {tokens} tokens "
          f"({args.response_len_parallel} response), fp32, gloo on cpu", file=sys.stderr)
    for name, r in report.items():
        print(f"  {name:8s} {r}", file=sys.stderr)
    for name in ("tp2", "sp2", "sp2xtp2"):
        r = report[name]
        print(f"  {name} / baseline per rank: parameters x{r['param_ratio']}, saved activations "
              f"x{r['saved_activation_ratio']}; loss diff {r['loss_abs_diff']:.2e}, max grad rel diff "
              f"{r['grad_max_rel_diff']:.2e}", file=sys.stderr)
    print(json.dumps({"bench": "trainer_parallel", "device": "cpu", "shape": args.shape, "tokens": tokens,
                      **report}))
