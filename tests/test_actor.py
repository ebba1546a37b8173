"""The FSDP2 actor on real gloo process groups: packed vs padded, uneven ranks, the
global token mean, gradient sync once per step or per micro-batch (``grad_sync``), the
fused logprob pass, checkpointing, the learning-rate schedule and sliding-window attention
on packed rows.

The world-size-2 run splits the batch unevenly (7 samples vs 1), packs with a small token
budget so rank 0 runs several micro-batches and rank 1 pads with dummies, and must give
the same loss, gradient norm and updated weights as one rank running the whole batch
padded: that is the "global token mean across ranks and micro-batches" invariant.
"""

from __future__ import annotations

import gc
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distflow.core.config import load_config
from distflow.trainer.schedule import lr_at
from tests.conftest import ROOT
from tests.host_reads import HostReads
from tests.process_group import process_group, store_path
from tests.test_packing import make_batch

QUICKSTART = ROOT / "examples" / "grpo_quickstart.yaml"


def _cfg(toy_model, *overrides):
    return load_config(QUICKSTART, [f"model_path={toy_model}", "toy_model=false", "micro_batch_size=4",
                                    "grad_clip=1000", *overrides])


def _counted_update(actor, cfg, batch) -> tuple[dict, list[bool], int, dict[str, int]]:
    """``actor.update`` of ``batch``, with the flags given to ``set_requires_gradient_sync`` and
    the number of FSDP2 parameter all-gathers (one per FSDP unit and gather) it made, and the
    collectives the hang watch counted in it, by op (distflow.progress)."""
    calls: list[bool] = []
    sync = actor.model.set_requires_gradient_sync
    actor.model.set_requires_gradient_sync = lambda flag, **kw: (calls.append(flag), sync(flag, **kw))
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    gathers = []  # one foreach_all_gather per FSDP unit and gather (the name the param group calls)
    real_gather = group.foreach_all_gather
    group.foreach_all_gather = lambda *a, **kw: (gathers.append(1), real_gather(*a, **kw))[1]
    from distflow.progress import PROGRESS

    PROGRESS.mark(PROGRESS.beat + 1)  # (the hang watch's count of the update's collectives: distflow.progress)
    ops = dict(PROGRESS.ops)
    try:
        stats = actor.update(cfg.node("ACTOR", "MODEL_TRAIN"), batch)
    finally:
        group.foreach_all_gather = real_gather
    counted = {op: n - ops.get(op, 0) for op, n in PROGRESS.ops.items() if n > ops.get(op, 0)}
    assert sum(counted.values()) == PROGRESS.position()[1]
    return stats, calls, len(gathers), counted


def _one_step(world: int, rank: int, toy_model, overrides) -> dict:
    from distflow.trainer.actor import Actor

    cfg = _cfg(toy_model, *overrides)
    actor = Actor(cfg, with_reference=True)
    batch = make_batch(8, seed=5)
    if world == 2:  # uneven: 7 samples on rank 0, 1 on rank 1
        batch = batch.select(range(7) if rank == 0 else [7])
    batch = actor.reference_logprobs(batch)
    n_mb = len(list(actor._micro_batches(batch)))
    stats, calls, gathers, counted = _counted_update(actor, cfg, batch)
    units = 1 + len(actor.model.model.layers)  # the root and each decoder layer
    state = actor.full_state_dict()
    assert (state == {}) == (rank != 0)  # a collective, but only rank 0 keeps a host copy
    return {"stats": stats, "state": state, "n_mb": n_mb, "ref": actor.ref is not None, "mode": actor.grad_sync,
            "sync_calls": calls, "gathers": gathers, "units": units, "counted": counted}


def _step(rank: int, world: int, store: str, toy_model: str, overrides: list[str], out: str) -> None:
    torch.set_num_threads(1)
    with process_group(store, rank, world):
        result = _one_step(world, rank, toy_model, overrides)
        if rank == 0:
            torch.save(result, out)
        else:
            torch.save(result["counted"], f"{out}.{rank}")


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    """This pytest process as a one-rank gloo group (FileStore: no port to race for)."""
    with process_group(store_path(tmp_path_factory.mktemp("pg"))):
        yield


def _forked(nprocs: int, args: tuple) -> None:
    """``_step`` in ``nprocs`` forked processes (:func:`_forked_fn`)."""
    _forked_fn(_step, nprocs, args)


def _forked_fn(fn, nprocs: int, args: tuple) -> None:
    """``fn(rank, *args)`` in ``nprocs`` forked processes (no re-import of torch/transformers).

    A test that ran earlier in this process may have left a process group in a reference cycle
    (a destroyed group's FSDP modules, device meshes): collected in a forked child, its C++
    destructor waits for threads that did not survive the fork, and the child hangs. So the
    garbage is collected here first, and what remains is frozen: a child never collects it."""
    gc.collect()
    gc.freeze()
    try:
        mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="fork")
    finally:
        gc.unfreeze()


def _two_ranks(tmp_path, toy_model, name: str, overrides: list[str]) -> dict:
    out = str(tmp_path / f"{name}.pt")
    _forked(2, (2, str(tmp_path / f"{name}.store"), str(toy_model),
                ["kl_coef=0.01", "lr=0.01", "max_tokens_per_micro_batch=12", *overrides], out))
    return torch.load(out)


def test_packed_uneven_two_ranks_equal_one_rank_padded(tmp_path, toy_model):
    assert not dist.is_initialized()  # the forked ranks join groups of their own
    two = _two_ranks(tmp_path, toy_model, "two", [])
    # grad_sync micro_batch: a reduce-scatter after every micro-batch, the same step
    per_mb = _two_ranks(tmp_path, toy_model, "per_mb", ["grad_sync=micro_batch"])
    out = str(tmp_path / "one.pt")
    _forked(1, (1, str(tmp_path / "one.store"), str(toy_model), ["kl_coef=0.01", "lr=0.01"], out))
    one = torch.load(out)
    assert one["ref"] and two["ref"]
    assert one["n_mb"] == 2  # 8 samples / micro_batch_size 4
    assert two["n_mb"] >= 3  # rank 0's 7 samples of 3-13 tokens in 12-token packs; rank 1 runs dummies
    a, b = one["stats"], two["stats"]
    assert a["tokens"] == b["tokens"] == float(make_batch(8, seed=5).tensors["response_lens"].sum())
    assert a["train_tokens"] == b["train_tokens"] == float(make_batch(8, seed=5).num_tokens().sum())
    assert two["mode"] == "step" and False in two["sync_calls"]  # auto: a toy model reduces once per step
    assert per_mb["mode"] == "micro_batch" and False not in per_mb["sync_calls"]
    # Parameter all-gathers, per micro-batch: every unit before its forward, every layer again for
    # its backward (resharded after forward; the root is not). grad_sync step keeps the weights
    # the first forward gathered until the last backward: one gather per unit and step.
    n, units = two["n_mb"], two["units"]
    assert per_mb["n_mb"] == n and per_mb["gathers"] == n * (2 * units - 1)
    assert two["gathers"] == units
    # The hang watch counts each of them, each reduce-scatter (every unit, once per gradient sync) and the
    # step's metric all-reduce: the same on both ranks, whose samples and micro-batches differ.
    for run, syncs in ((two, 1), (per_mb, n)):
        assert run["counted"] == {"all_gather": run["gathers"], "reduce_scatter": units * syncs,
                                  "all_reduce": run["counted"]["all_reduce"]}, run["counted"]
        assert run["counted"]["all_reduce"] >= 1
    assert torch.load(str(tmp_path / "two.pt") + ".1") == two["counted"]
    assert torch.load(str(tmp_path / "per_mb.pt") + ".1") == per_mb["counted"]
    for other in (two, per_mb):
        b = other["stats"]
        for key in ("loss", "pg_loss", "kl", "clip_frac", "entropy", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        # Adam's first step moves each weight by lr * g / (|g| + eps): lr (0.01) whatever g is, except for a
        # gradient near eps, whose update amplifies the reduction-order rounding of a packed two-rank
        # gradient (seen: 2.8e-6 on one weight in 4096, torch 2.13 on AMD EPYC). 1e-5 is 0.1% of a step;
        # a wrong gradient moves weights by a whole step.
        for name, t in one["state"].items():
            assert torch.allclose(t, other["state"][name], atol=1e-5), name


def test_grad_sync_mode():
    from distflow.trainer.actor import GRAD_SYNC_AUTO_BYTES, grad_sync_mode

    assert grad_sync_mode("auto", 1, 7_000_000_000) == ("step", 0)  # one rank: nothing is sharded anyway
    mode, extra = grad_sync_mode("auto", 8, 7_000_000_000)
    # fp32 gradients unsharded (4 bytes x params x 7/8) + the gathered bf16 weights (2 bytes x params)
    assert mode == "micro_batch" and extra == 4 * 7_000_000_000 * 7 // 8 + 2 * 7_000_000_000  # ~35.8 GiB
    small = GRAD_SYNC_AUTO_BYTES // 4  # 4 x params x 1/2 + 2 x params = exactly the limit on 2 ranks
    assert grad_sync_mode("auto", 2, small) == ("step", GRAD_SYNC_AUTO_BYTES)
    assert grad_sync_mode("auto", 2, small + 1)[0] == "micro_batch"
    assert grad_sync_mode("auto", 2, small // 2 * 2, param_bytes=4)[0] == "micro_batch"  # fp32 weights: 6 x params
    assert grad_sync_mode("auto", 2, 500_000_000) == ("step", 2_000_000_000)  # a 0.5B model on 2 GPUs
    assert grad_sync_mode("step", 8, 7_000_000_000)[0] == "step"
    assert grad_sync_mode("micro_batch", 1, 10)[0] == "micro_batch"
    with pytest.raises(ValueError, match="grad_sync"):
        grad_sync_mode("never", 2, 10)


def test_lr_schedule_hand_computed():
    assert lr_at(0, 1.0, "constant", warmup_steps=4) == 0.25
    assert lr_at(3, 1.0, "constant", warmup_steps=4) == 1.0
    assert lr_at(10, 1.0, "constant", warmup_steps=4, total_steps=12) == 1.0
    assert lr_at(2, 1.0, "linear", warmup_steps=2, total_steps=12) == 1.0
    assert lr_at(7, 1.0, "linear", warmup_steps=2, total_steps=12) == pytest.approx(0.5)
    assert lr_at(12, 1.0, "linear", warmup_steps=2, total_steps=12) == 0.0
    assert lr_at(7, 2.0, "cosine", warmup_steps=2, total_steps=12) == pytest.approx(1.0)
    assert lr_at(4, 2.0, "cosine", total_steps=12) == pytest.approx(1.0 + math.cos(math.pi / 3))
    assert lr_at(5, 1.0, "cosine") == 1.0  # no run length known: no decay
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_at(0, 1.0, "step")


def test_fused_pass_skips_reference_at_kl_zero_and_recomputes_old_logprobs(toy_model, world1):
    from distflow.hf import load_causal_lm
    from distflow.trainer.actor import Actor
    from distflow.trainer.head import response_forward
    from distflow.trainer.packing import pad_inputs

    cfg = _cfg(toy_model, "kl_coef=0", "recompute_old_logprobs=true", "max_tokens_per_micro_batch=16",
               "lr_schedule=linear", "warmup_steps=2", "lr=0.01")
    actor = Actor(cfg, with_reference=True)
    assert actor.ref is None  # kl_coef 0: no reference model loaded, no reference pass
    batch = actor.reference_logprobs(make_batch(8, seed=6))
    assert "ref_logprobs" not in batch.tensors and "old_logprobs" in batch.tensors
    plain = load_causal_lm(toy_model, torch.float32)
    with torch.no_grad():
        expect, _ = response_forward(plain, pad_inputs(batch.ragged("prompt_tokens"), batch.ragged("response_tokens")))
    assert torch.allclose(batch.tensors["old_logprobs"], expect, atol=1e-5)
    stats, calls, _, _ = _counted_update(actor, cfg, batch)
    n_mb = len(list(actor._micro_batches(batch)))
    assert n_mb >= 2 and calls == [False] * (n_mb - 1) + [True, True]  # reduce-scatter on the last micro-batch only
    # proximal = current policy: every ratio is 1, nothing is clipped (the engine's made-up logprobs would clip)
    assert stats["clip_frac"] == 0.0 and stats["kl"] == 0.0
    assert stats["lr"] == pytest.approx(0.005)  # warm-up step 0 of 2
    assert stats["entropy"] > 0
    # the step's statistics the worker logs, through the group's collectives (a group of one here)
    from distflow.trainer.step_stats import step_statistics

    batch.set_scalar("reward", torch.arange(8, dtype=torch.float32))
    batch.set_scalar("truncated", torch.tensor([1, 0, 0, 1, 0, 0, 0, 1]))
    out = step_statistics(batch, cfg, step=2)
    assert (out["samples"], out["reward_mean"], out["reward_max"], out["truncated_frac"]) == (8.0, 3.5, 7.0, 3 / 8)
    assert out["staleness_mean"] == 2.0  # make_batch's samples are of version 0
    assert out["response_len_mean"] == float(batch.tensors["response_lens"].sum()) / 8
    # the old logprobs are this policy's own: the engine's made-up ones differ from them
    assert out["logprob_diff_max"] > 0 and out["logprob_kl_k3"] > 0
    del batch.tensors["truncated"]  # a batch without the field: 0 truncated
    assert step_statistics(batch, cfg, step=2)["truncated_frac"] == 0.0


def test_reference_is_frozen_in_compute_dtype_and_resharded_after_its_pass(toy_model, world1):
    """The frozen reference keeps its shards in the compute dtype (no fp32 master copy: it never
    steps), computes what a plain bf16 copy of the model computes, and its FSDP2 root is sharded
    again after the pass (FSDP2 reshards a root only after backward, which a reference never runs)."""
    from torch.distributed.tensor import DTensor

    from distflow.hf import load_causal_lm
    from distflow.trainer.actor import Actor
    from distflow.trainer.head import response_forward
    from distflow.trainer.packing import pad_inputs

    cfg = _cfg(toy_model, "kl_coef=0.01", "dtype=bfloat16")
    actor = Actor(cfg, with_reference=True)
    assert {p.dtype for p in actor.ref.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in actor.model.parameters()} == {torch.float32}  # the policy's master weights
    root = [p for n, p in actor.ref.named_parameters() if not n.startswith("model.layers.")]
    assert root and all(isinstance(p, DTensor) for p in root)
    batch = actor.reference_logprobs(make_batch(8, seed=6))
    assert all(isinstance(p, DTensor) for n, p in actor.ref.named_parameters() if not n.startswith("model.layers."))
    # with old logprobs recomputed in the same pass and the critic's values to run before the
    # update (PPO), the policy's root is sharded again too; in GRPO the update comes next
    for example, sharded in (("ppo_quickstart.yaml", True), ("grpo_quickstart.yaml", False)):
        cfg = load_config(ROOT / "examples" / example, [f"model_path={toy_model}", "toy_model=false",
                                                         "micro_batch_size=4", "kl_coef=0.01", "dtype=bfloat16",
                                                         "recompute_old_logprobs=true"])
        policy = Actor(cfg, with_reference=True)
        assert "old_logprobs" in policy.reference_logprobs(make_batch(8, seed=6)).tensors
        root = [p for n, p in policy.model.named_parameters() if not n.startswith("model.layers.")]
        assert all(isinstance(p, DTensor) == sharded for p in root), example
    plain = load_causal_lm(toy_model, torch.bfloat16)
    with torch.no_grad():
        expect, _ = response_forward(plain, pad_inputs(batch.ragged("prompt_tokens"), batch.ragged("response_tokens")))
    assert torch.allclose(batch.tensors["ref_logprobs"], expect.float(), atol=2e-2)


def test_grad_sync_per_micro_batch_gives_the_same_step(toy_model, world1):
    from distflow.trainer.actor import Actor

    out = []
    for mode in ("step", "micro_batch"):
        cfg = _cfg(toy_model, f"grad_sync={mode}", "lr=0.01", "max_tokens_per_micro_batch=16")
        actor = Actor(cfg, with_reference=False)
        calls = []
        sync = actor.model.set_requires_gradient_sync
        actor.model.set_requires_gradient_sync = lambda flag, **kw: (calls.append(flag), sync(flag, **kw))
        stats = actor.update(cfg.node("ACTOR", "MODEL_TRAIN"), make_batch(8, seed=7))
        out.append((stats, actor.full_state_dict(), calls))
    (a, sa, ca), (b, sb, cb) = out
    assert False in ca and cb == []  # micro_batch never turns gradient sync off
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    for name in sa:
        assert torch.allclose(sa[name], sb[name], atol=1e-7), name


def test_packed_rows_honour_the_sliding_window():
    """A sliding-window model: packed rows (varlen attention, per-sample SDPA on CPU) and padded
    rows (one banded SDPA) give transformers' own padded logprobs (its sliding-window mask), not
    full causal attention."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from distflow.trainer.attention import register_varlen_attention
    from distflow.trainer.head import response_forward
    from distflow.trainer.packing import pack_inputs, pad_inputs

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=3,
                         max_window_layers=0, layer_types=["sliding_attention"] * 2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [3, 3]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 32, (n,), generator=g) for n in (4, 7, 2)]
    responses = [torch.randint(0, 32, (n,), generator=g) for n in (5, 3, 6)]
    packed = pack_inputs(prompts, responses)
    assert packed.seq_lens == (9, 10, 8)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        padded, _ = response_forward(model, pad_inputs(prompts, responses))
        model.set_attn_implementation(register_varlen_attention())
        padded_varlen, _ = response_forward(model, pad_inputs(prompts, responses))
        windowed, _ = response_forward(model, packed)
        packed.seq_lens = ()  # a caller without host lengths: read from cu_seqlens, same result
        from_cu, _ = response_forward(model, packed)
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        full, _ = response_forward(model, packed)
    assert torch.allclose(windowed, padded, atol=1e-6) and torch.equal(windowed, from_cu)
    assert torch.allclose(padded_varlen, padded, atol=1e-6)
    assert not torch.allclose(full, padded, atol=1e-3)  # the window matters at these lengths


def test_dual_clip_reaches_the_policy_loss(toy_model, world1, monkeypatch):
    from distflow.rl import losses, registry
    from distflow.trainer.actor import Actor

    seen = []

    def recording(*args, **kw):
        seen.append(kw.get("dual_clip"))
        return losses.policy_loss(*args, **kw)

    monkeypatch.setitem(registry.POLICY_LOSSES, "grpo", recording)
    cfg = _cfg(toy_model, "dual_clip=3")
    stats = Actor(cfg, with_reference=False).update(cfg.node("ACTOR", "MODEL_TRAIN"), make_batch(8, seed=7))
    assert seen and set(seen) == {3.0} and math.isfinite(stats["loss"])


def test_activation_checkpointing_gives_the_same_step(toy_model, world1):
    from distflow.trainer.actor import Actor

    out = []
    for ac in ("false", "true"):
        cfg = _cfg(toy_model, f"activation_checkpointing={ac}", "lr=0.01")
        actor = Actor(cfg, with_reference=False)
        stats = actor.update(cfg.node("ACTOR", "MODEL_TRAIN"), make_batch(8, seed=7))
        out.append((stats, actor.full_state_dict()))
    (a, sa), (b, sb) = out
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    for name in sa:
        assert torch.allclose(sa[name], sb[name], atol=1e-7), name


def _gpu_steps(rank: int, store: str, toy_model: str, dtype: str, out: str) -> None:
    with process_group(store, backend="nccl"):
        from distflow.trainer import attention
        from distflow.trainer.actor import Actor

        kernel = attention._flash_varlen()  # count the FlashAttention varlen calls: a torch whose kernel
        calls = [0]  # cannot take this call falls back to per-sample SDPA silently
        if kernel is not None:
            def counted(*args, **kwargs):
                calls[0] += 1
                return kernel[0](*args, **kwargs)

            attention._flash_varlen = lambda: (counted, kernel[1])
        stats = []
        for extra in ([], ["max_tokens_per_micro_batch=24"]):
            cfg = _cfg(toy_model, "device=cuda", f"dtype={dtype}", "lr=0.01", "kl_coef=0.01", *extra)
            actor = Actor(cfg, with_reference=True)
            before = calls[0]
            batch = actor.reference_logprobs(make_batch(8, seed=5))
            assert batch.tensors["ref_logprobs"].device.type == "cpu"  # results leave the GPU
            stats.append(dict(actor.update(cfg.node("ACTOR", "MODEL_TRAIN"), batch), flash_calls=calls[0] - before))
        torch.save(stats, out)
        from distflow.progress import PROGRESS  # the hang watch's collective counts, on NCCL

        torch.cuda.synchronize()
        comm = type(actor.model._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm).__name__
        torch.save({"ops": dict(PROGRESS.ops), "pending": PROGRESS.oldest_pending(), "comm": comm}, out + ".counts")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_packed_varlen_update_matches_padded(toy_model, dtype, tmp_path):
    """On a GPU, one NCCL rank: the packed path (FlashAttention varlen) and the padded path
    (SDPA) give the same step, in fp32 and in bf16 compute."""
    out = str(tmp_path / "gpu.pt")
    mp.start_processes(_gpu_steps, args=(str(tmp_path / "store"), str(toy_model), dtype, out), nprocs=1, join=True,
                       start_method="spawn")
    padded, packed = torch.load(out)
    counts = torch.load(out + ".counts", weights_only=False)
    # the hang watch counts FSDP2's collectives through its comm hooks (on this torch), and each NCCL
    # collective is done once its kernel is (nothing pending after a synchronize)
    assert counts["comm"] == "CountedAllGather" and counts["ops"].get("all_reduce", 0) >= 2, counts
    assert counts["pending"] is None, counts
    assert padded["flash_calls"] == 0  # padded rows: one causal SDPA
    # packed rows: FlashAttention varlen in bf16 (the path the docs promise; torch.nn.attention.varlen
    # on this torch must take the call), per-sample SDPA in fp32
    assert (packed["flash_calls"] > 0) == (dtype == "bfloat16"), packed["flash_calls"]
    tol = 1e-4 if dtype == "float32" else 2e-2
    for key in ("loss", "entropy", "grad_norm"):
        assert packed[key] == pytest.approx(padded[key], rel=tol, abs=tol), key


def _step_nccl(rank: int, world: int, store: str, toy_model: str, overrides: list[str], out: str) -> None:
    os.environ["DISTFLOW_LOCAL_GPU"] = str(rank)  # one GPU per rank, as placement gives each node its own
    with process_group(store, rank, world, backend="nccl", device_id=torch.device("cuda", rank)):
        result = _one_step(world, rank, toy_model, ["device=cuda", *overrides])
        if rank == 0:
            torch.save(result, out)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (one NCCL rank each)")
@pytest.mark.parametrize("grad_sync", ["step", "micro_batch"])
def test_two_nccl_ranks_uneven_equal_one_cpu_rank(tmp_path, toy_model, grad_sync):
    """FSDP2 over NCCL on two GPUs, uneven samples (7 and 1, dummies on the short rank), packed:
    the same step as one CPU rank, padded (fp32: reduce-scatter, padding micro-batches, the
    global token mean and clip_grad_norm_ across the mesh on real NCCL)."""
    two, one = str(tmp_path / "two.pt"), str(tmp_path / "one.pt")
    mp.start_processes(_step_nccl, args=(2, str(tmp_path / "two.store"), str(toy_model),
                                         ["kl_coef=0.01", "lr=0.01", "max_tokens_per_micro_batch=12",
                                          f"grad_sync={grad_sync}"], two), nprocs=2, join=True, start_method="spawn")
    mp.start_processes(_step, args=(1, str(tmp_path / "one.store"), str(toy_model), ["kl_coef=0.01", "lr=0.01"], one),
                       nprocs=1, join=True, start_method="spawn")
    a, b = torch.load(one)["stats"], torch.load(two)["stats"]
    assert a["tokens"] == b["tokens"] and torch.load(two)["mode"] == grad_sync
    for key in ("loss", "pg_loss", "kl", "clip_frac", "entropy", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    for name, t in torch.load(one)["state"].items():
        assert torch.allclose(t, torch.load(two)["state"][name].cpu(), atol=1e-5), name


def test_varlen_kwargs_follow_the_kernels_signature():
    """The FlashAttention varlen call is built from the installed torch's keywords (they changed
    across releases); a call the kernel cannot make falls back to per-sample SDPA (None)."""
    from distflow.trainer.attention import varlen_kwargs

    new = {"scale", "window_size", "enable_gqa"}
    assert varlen_kwargs(new, 0.125, 64, None, True) == {"scale": 0.125, "window_size": (-1, 0), "enable_gqa": True}
    assert varlen_kwargs(new, 0.125, 64, 4096, False) == {"scale": 0.125, "window_size": (4095, 0)}
    old = {"is_causal"}  # an older torch: causal flag, default scale, GQA native
    assert varlen_kwargs(old, 64 ** -0.5, 64, None, True) == {"is_causal": True}
    assert varlen_kwargs(old, 0.2, 64, None, False) is None  # a custom scale it cannot take
    assert varlen_kwargs(old, None, 64, 128, False) is None  # a sliding window it cannot apply
    assert varlen_kwargs({"scale", "window_size"}, 0.1, 64, None, True) is None  # cannot be told about GQA


@pytest.mark.parametrize("window", [None, 3])
def test_per_sample_sdpa_with_kv_heads_repeated_equals_gqa(window):
    """The CUDA form of the per-sample SDPA fallback (K/V repeated to the query heads, so an fp32 or
    banded call can use the memory-efficient kernel) computes what the GQA form computes, values
    and gradients, with query head h reading KV head h // 2 as transformers' repeat_kv does."""
    from distflow.trainer.attention import _per_sample_sdpa

    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 7]
    q = torch.randn(1, 4, 13, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 13, 8, generator=g, requires_grad=True) for _ in range(2))
    outs, grads = [], []
    for expand in (False, True):
        out = _per_sample_sdpa(q, k, v, lens, window, 0.3, expand_kv=expand)
        (out * torch.arange(out.numel()).reshape(out.shape).sin()).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    assert outs[0].shape == (1, 13, 4, 8)
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads))
    # head 3 of the output reads KV head 1: recompute sample 0 by hand
    att = torch.softmax((q[0, 3, :5] @ k[0, 1, :5].T * 0.3).masked_fill(
        ~_causal(5, window), float("-inf")), -1) @ v[0, 1, :5]
    assert torch.allclose(outs[1][0, :5, 3], att.detach(), atol=1e-6)


def _causal(n: int, window: int | None) -> torch.Tensor:
    i = torch.arange(n)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < (window or n))


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_overlong_mask_trains_exactly_as_if_the_truncated_samples_were_not_there(toy_model, world1, loss_agg):
    """DAPO's overlong filtering: with ``overlong: mask`` a truncated sample adds no token to the
    loss and none to its normalisers, so one step on (kept + truncated) samples moves the weights
    exactly as one step on the kept samples alone. Zeroing only the advantage (as before) left
    the truncated tokens in the token-mean's denominator, shrinking the kept samples' gradient."""
    from distflow.trainer.actor import Actor

    batch = make_batch(8, seed=3)
    truncated = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1])
    batch.set_scalar("truncated", truncated)
    kept = batch.select([i for i in range(8) if not truncated[i]])
    states = []
    for b, overlong in ((batch, "mask"), (kept, "none")):
        cfg = _cfg(toy_model, "lr=0.01", "kl_coef=0", f"loss_agg={loss_agg}", f"overlong={overlong}")
        actor = Actor(cfg, with_reference=False)
        stats = actor.update(cfg.node("ACTOR", "MODEL_TRAIN"), b)
        states.append((stats, actor.full_state_dict()))
    (masked, sm), (alone, sa) = states
    assert masked["tokens"] == alone["tokens"] == float(kept.tensors["response_lens"].sum())
    assert masked["loss"] == pytest.approx(alone["loss"], rel=1e-5) and masked["pg_loss"] == pytest.approx(
        alone["pg_loss"], rel=1e-5)
    assert masked["entropy"] == pytest.approx(alone["entropy"], rel=1e-5)  # the metric too: trained tokens only
    for name in sm:
        assert torch.allclose(sm[name], sa[name], atol=1e-7), name


def test_optional_loss_metrics_are_logged_when_the_loss_reports_them(toy_model, world1):
    """ratio_mean and approx_kl (every shipped policy loss) and, with truncated importance
    sampling, tis_weight_mean / tis_clip_frac reach the step's stats (and so metrics.jsonl)."""
    from distflow.trainer.actor import Actor

    plain = _cfg(toy_model, "lr=0.01", "kl_coef=0")
    stats = Actor(plain, with_reference=False).update(plain.node("ACTOR", "MODEL_TRAIN"), make_batch(8, seed=4))
    # the batch's logprobs are made up (not this model's): the ratio is far from 1
    assert 0 < stats["ratio_mean"] != pytest.approx(1.0, abs=0.05) and stats["approx_kl"] > 0.01
    assert "tis_weight_mean" not in stats and "tis_clip_frac" not in stats
    tis = _cfg(toy_model, "lr=0.01", "kl_coef=0", "recompute_old_logprobs=true", "tis_cap=2")
    stats = Actor(tis, with_reference=False).update(tis.node("ACTOR", "MODEL_TRAIN"), make_batch(8, seed=4))
    # old logprobs recomputed by this model before the step: ratio 1, no KL; the made-up behaviour
    # logprobs are what the TIS weights correct for
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and stats["approx_kl"] == pytest.approx(0, abs=1e-6)
    assert 0 < stats["tis_weight_mean"] < 1 and 0 <= stats["tis_clip_frac"] <= 1  # weights exp(old - behaviour)


def test_a_non_finite_gradient_skips_the_optimizer_step(toy_model, world1):
    """A NaN anywhere in the gradients (here one sample's NaN advantage) makes the clipped update
    NaN in every weight: the step is skipped (weights and AdamW state untouched) and counted in
    ``skipped_steps``; the next finite step trains as usual."""
    from distflow.trainer.actor import Actor

    cfg = _cfg(toy_model, "lr=0.01", "kl_coef=0", "mini_batches_per_step=2")
    actor = Actor(cfg, with_reference=False)
    node = cfg.node("ACTOR", "MODEL_TRAIN")
    before = actor.full_state_dict()
    bad = make_batch(8, seed=4)
    bad.tensors["advantage"][0] = float("nan")  # the first mini-batch's; the second one is finite
    stats = actor.update(node, bad)
    # grad_norm: the mean over the steps that were taken (the skipped one is counted, not averaged in)
    assert stats["skipped_steps"] == 1 and stats["optimizer_steps"] == 2 and math.isfinite(stats["grad_norm"])
    after = actor.full_state_dict()
    assert any(not torch.equal(before[n], after[n]) for n in before)  # the finite mini-batch stepped
    assert all(torch.isfinite(t).all() for t in after.values())
    cfg1 = _cfg(toy_model, "lr=0.01", "kl_coef=0")
    actor = Actor(cfg1, with_reference=False)
    stats = actor.update(cfg1.node("ACTOR", "MODEL_TRAIN"), bad)
    assert stats["skipped_steps"] == 1 and math.isnan(stats["grad_norm"])
    assert actor.optim.state_dict()["state"] == {}  # AdamW never stepped
    assert all(torch.equal(before[n], t) for n, t in actor.full_state_dict().items())
    stats = actor.update(cfg1.node("ACTOR", "MODEL_TRAIN"), make_batch(8, seed=4))
    assert stats["skipped_steps"] == 0 and math.isfinite(stats["grad_norm"])
    assert any(not torch.equal(before[n], t) for n, t in actor.full_state_dict().items())
    # a step frees its gradients: none held through the weight publish, checkpoint and next passes
    assert all(p.grad is None for p in actor.model.parameters())


def test_full_state_gathers_a_tied_embedding_once(toy_model, world1):
    """The toy model's LM head is its embedding: the checkpoint gather gathers it once and
    keeps one host copy under both names (for a tied 0.5B-3B model, 0.5-1.2 GB less on rank 0).
    No tensor shares memory with the live parameters."""
    from distflow.weights import tied_names
    from distflow.trainer import gather
    from distflow.trainer.actor import Actor

    actor = Actor(_cfg(toy_model), with_reference=False)
    tied = [g for g in tied_names(actor.model) if len(g) > 1]
    assert tied == [("model.embed_tokens.weight", "lm_head.weight")]
    calls = []
    into = gather._Gatherer.gather_into
    gather._Gatherer.gather_into = lambda self, t, *a, **kw: (calls.append(1), into(self, t, *a, **kw))[1]
    try:
        state = actor.full_state_dict()
    finally:
        gather._Gatherer.gather_into = into
    assert list(state) == list(actor.model.state_dict()) and len(calls) == len(state) - 1
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    assert torch.equal(state["lm_head.weight"], actor.model.lm_head.weight.full_tensor())
    live = {p.to_local().untyped_storage().data_ptr() for p in actor.model.parameters()}
    assert not {t.untyped_storage().data_ptr() for t in state.values()} & live


def test_update_reads_no_value_back_per_micro_batch(toy_model, world1):
    """The update accumulates its metrics on the device and reads them back once per optimizer
    step, and the logprob pass reads its results back once: the scalar reads actor.py makes do
    not grow with the number of micro-batches (on a GPU each would wait for the GPU to drain).
    The metrics are the same whatever the micro-batching."""
    from distflow.trainer.actor import Actor

    seen = []
    for budget in (10_000, 12):  # 2 padded micro-batches vs >= 4 packed ones
        cfg = _cfg(toy_model, "kl_coef=0.01", "lr=0.01", "recompute_old_logprobs=true",
                   f"max_tokens_per_micro_batch={budget}")
        actor = Actor(cfg, with_reference=True)
        copies = []
        cpu = torch.Tensor.cpu
        torch.Tensor.cpu = lambda t, *a, **kw: (copies.append(1), cpu(t, *a, **kw))[1]
        try:
            with HostReads() as reads:
                batch = actor.reference_logprobs(make_batch(8, seed=5))
                stats = actor.update(cfg.node("ACTOR", "MODEL_TRAIN"), batch)
        finally:
            torch.Tensor.cpu = cpu
        seen.append((len(list(actor._micro_batches(batch))), reads.by_file["actor.py"], len(copies), stats))
    (n1, reads1, copies1, s1), (n2, reads2, copies2, s2) = seen
    assert n2 >= 2 * n1
    assert reads2 == reads1 and copies2 == copies1  # the logprob pass copies back once per field, not per micro-batch
    for k in ("loss", "pg_loss", "kl", "entropy", "ratio_mean", "grad_norm"):
        assert s2[k] == pytest.approx(s1[k], rel=1e-5, abs=1e-7), k


def test_device_sums_take_what_float_takes(world1):
    """A loss's metrics may be 0-dim or one-element tensors of any float dtype, or numbers (a
    user's loss); the sums are float64 and read back once, as the all-reduce over the group."""
    from distflow.trainer.actor import DeviceSums

    sums = DeviceSums(["a", "b", "c"], torch.device("cpu"))
    sums.add("a", torch.tensor([2.0]), 0.5)  # shape [1], as float() takes
    sums.add("a", torch.tensor(0.25, dtype=torch.bfloat16))
    sums.add("b", 3)
    sums.add("c", torch.tensor(1.0, requires_grad=True) * 2, 0.1)
    assert sums.all_reduce() == pytest.approx({"a": 1.25, "b": 3.0, "c": 0.2})
    with pytest.raises(RuntimeError):
        sums.add("a", torch.tensor([1.0, 2.0]))  # not one number: refused, as float() refuses it


def test_flat_to_padded_places_values_and_its_backward_reads_nothing_back():
    """A micro-batch's flat per-token values go to a zero-padded [B, max len] layout for the loss.
    With ``masked_scatter`` the backward was a ``masked_select``, which reads the selected count
    back: on a GPU a host sync in every micro-batch's backward (HostReads, a dispatch mode, does
    not see reads nested in a kernel; the profiler does). ``index_copy`` reads nothing back."""
    from distflow.trainer.actor import flat_to_padded

    x = torch.arange(1.0, 8.0, requires_grad=True)
    values, mask = flat_to_padded(x, [3, 0, 4])
    assert values.tolist() == [[1, 2, 3, 0], [0, 0, 0, 0], [4, 5, 6, 7]]
    assert mask.tolist() == [[True, True, True, False], [False] * 4, [True] * 4]
    weights = torch.arange(12.0).view(3, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (values * weights).sum().backward()
    ops = {e.name for e in prof.events()}
    assert not ops & {"aten::_local_scalar_dense", "aten::item", "aten::masked_select", "aten::nonzero"}, ops
    assert x.grad.tolist() == [0, 1, 2, 8, 9, 10, 11]  # each value's weight at its padded place
    empty, none = flat_to_padded(torch.zeros(0), [])
    assert empty.shape == none.shape == (0, 0)


def _gpu_sync_counts(rank: int, store: str, toy_model: str, out: str) -> None:
    with process_group(store, backend="nccl"):
        import warnings

        from distflow.trainer.actor import Actor

        seen = []
        for budget in (10_000, 12):  # 2 padded micro-batches vs >= 4 packed ones, as on CPU
            cfg = _cfg(toy_model, "device=cuda", "dtype=bfloat16", "kl_coef=0.01", "lr=0.01",
                       "recompute_old_logprobs=true", f"max_tokens_per_micro_batch={budget}")
            actor = Actor(cfg, with_reference=True)
            node = cfg.node("ACTOR", "MODEL_TRAIN")
            actor.update(node, actor.reference_logprobs(make_batch(8, seed=4)))  # lazy inits: not counted
            batch = make_batch(8, seed=5)
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    actor.update(node, actor.reference_logprobs(batch))
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
            seen.append((len(list(actor._micro_batches(batch))), syncs))
        torch.save(seen, out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_update_syncs_do_not_grow_with_micro_batches(toy_model, tmp_path):
    """What tests/host_reads.py counts on CPU, measured where it matters: torch's sync debug mode
    warns at every CUDA call that makes the host wait for the GPU (a read-back, a blocking copy,
    a kernel's own read such as masked_select's count, which the CPU count cannot see). A logprob
    pass and an update make as many with 2 micro-batches as with 4 or more."""
    out = str(tmp_path / "syncs.pt")
    mp.start_processes(_gpu_sync_counts, args=(str(tmp_path / "store"), str(toy_model), out), nprocs=1, join=True,
                       start_method="spawn")
    (n1, few), (n2, many) = torch.load(out)
    assert n2 >= 2 * n1
    assert len(many) == len(few), (few, many)
