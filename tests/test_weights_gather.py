"""``iter_weight_buckets`` against a real FSDP2 model: two gloo processes shard the toy model,
both run the bucketed gather, the keeping rank's buckets equal the unsharded weights exactly
and respect the size limit; the discarding rank yields nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.process_group import process_group, store_path

BUCKET = 40_000  # bytes: the toy model's tensors are 128 B .. 32 KiB, so several buckets and one-tensor ones


def _worker(rank: int, world: int, store: str, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from distflow.hf import load_causal_lm
    from distflow.trainer.gather import iter_weight_buckets

    torch.set_num_threads(1)
    with process_group(store, rank, world):
        model = load_causal_lm(model_dir, torch.float32, torch.device("cpu"))
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with torch.no_grad():  # make the weights rank-independent but not the checkpoint's
            for p in model.parameters():
                p.add_(0.5)
        calls = {"all_gather": 0, "p2p": 0}
        real_ag, real_p2p = dist.all_gather_single, dist.batch_isend_irecv

        def counting_ag(*a, **k):
            calls["all_gather"] += 1
            return real_ag(*a, **k)

        wire: list[torch.dtype] = []  # dtypes of the tensors point-to-point operations move

        def counting_p2p(ops):
            calls["p2p"] += 1
            wire.extend(op.tensor.dtype for op in ops)
            return real_p2p(ops)

        dist.all_gather_single, dist.batch_isend_irecv = counting_ag, counting_p2p
        try:
            # one serving rank: the shards are sent to it only (one flags all-gather, then point-to-point)
            buckets = list(iter_weight_buckets(model, BUCKET, keep=(rank == 0), device="cpu"))
            one_server = dict(calls)
            wire.clear()
            again = list(iter_weight_buckets(model, BUCKET, keep=(rank == 1), device="cpu", dtype=torch.bfloat16))
            again_wire = sorted({str(d) for d in wire})  # cast before the wire: bf16 rows, half the bytes
            calls.update(all_gather=0, p2p=0)
            both = list(iter_weight_buckets(model, BUCKET, keep=True, device="cpu"))  # every rank serves: all-gather
            every_server = dict(calls)
            both16 = list(iter_weight_buckets(model, BUCKET, keep=True, device="cpu", dtype=torch.bfloat16))
            calls.update(all_gather=0, p2p=0)
            nobody = list(iter_weight_buckets(model, BUCKET, keep=False, device="cpu"))  # nothing moves at all
            no_server = dict(calls)
        finally:
            dist.all_gather_single, dist.batch_isend_irecv = real_ag, real_p2p
        torch.save({"buckets": buckets, "again": again, "again_wire": again_wire, "both": both, "both16": both16,
                    "nobody": nobody, "one_server": one_server,
                    "every_server": every_server, "no_server": no_server}, os.path.join(out_dir, f"rank{rank}.pt"))


def test_bucketed_gather_of_fsdp2_model_equals_unsharded_weights(toy_model: Path, tmp_path: Path) -> None:
    from distflow.hf import load_causal_lm
    mp.start_processes(_worker, args=(2, store_path(tmp_path), str(toy_model), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    assert r0["again"] == [] and r1["buckets"] == []  # discarding ranks yield nothing
    assert r0["again_wire"] == r1["again_wire"] == ["torch.bfloat16"]  # fp32 shards cast before they travel
    assert r0["nobody"] == [] and r1["nobody"] == []
    # the toy state dict: 21 tensors, all row-sharded; the LM head is the embedding (tied), published
    # once: 20 tensors, one of them (embed_tokens: 17 rows) uneven
    for r in (r0, r1):
        # one serving rank: only the 1-element flags all-gather, then one point-to-point batch per tensor
        assert r["one_server"] == {"all_gather": 1, "p2p": 20}, r["one_server"]
        # every rank serves: the flags, then one all-gather per even tensor (the 2 uneven: full_tensor)
        assert r["every_server"] == {"all_gather": 1 + 19, "p2p": 0}, r["every_server"]
        assert r["no_server"] == {"all_gather": 1, "p2p": 0}, r["no_server"]  # nobody keeps: only the flags

    model = load_causal_lm(str(toy_model), torch.float32, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expect = {k: v + 0.5 for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for buckets, dtype in ((r0["buckets"], torch.float32), (r1["again"], torch.bfloat16),
                           (r0["both"], torch.float32), (r1["both"], torch.float32),
                           (r0["both16"], torch.bfloat16), (r1["both16"], torch.bfloat16)):  # uneven rows: full_tensor
        assert len(buckets) > 2
        names = [n for b in buckets for n in b]
        assert names == list(expect)  # state-dict order, each tensor exactly once (a tied one under one name)
        for b in buckets:
            size = sum(t.numel() * t.element_size() for t in b.values())
            assert size <= BUCKET or len(b) == 1  # the limit holds; a bigger tensor travels alone
            for n, t in b.items():
                assert t.dtype == dtype and t.is_contiguous()
                assert torch.equal(t, expect[n].to(dtype)), n


def test_bad_bucket_size_is_a_clear_error() -> None:
    from distflow.trainer.gather import iter_weight_buckets

    with pytest.raises(ValueError, match="bucket_bytes"):
        next(iter_weight_buckets(torch.nn.Linear(2, 2), 0, keep=True, device="cpu"))
    with pytest.raises(ValueError, match="place"):
        next(iter_weight_buckets(torch.nn.Linear(2, 2), 10, keep=True, device="cpu", place="disk"))
    with pytest.raises(ValueError, match="pinned"):
        next(iter_weight_buckets(torch.nn.Linear(2, 2), 10, keep=True, device="cpu", place="pinned"))


def test_plain_module_buckets_in_order() -> None:
    """Without FSDP no collective runs; sizes by hand: weight 4x4 fp32 = 64 B, bias 16 B."""
    from distflow.trainer.gather import iter_weight_buckets

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    buckets = list(iter_weight_buckets(m, 80, keep=True, device="cpu"))
    assert [list(b) for b in buckets] == [["0.weight", "0.bias"], ["1.weight", "1.bias"]]
    assert list(iter_weight_buckets(m, 80, keep=False, device="cpu")) == []
    assert [list(b) for b in iter_weight_buckets(m, 64, keep=True, device="cpu")] == [
        ["0.weight"], ["0.bias"], ["1.weight"], ["1.bias"]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_staging_of_cuda_buckets() -> None:
    from distflow.device import node_device
    from distflow.trainer.gather import iter_weight_buckets

    dev = node_device("cuda")
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(dev)
    ref = {k: v.detach().cpu() for k, v in m.state_dict().items()}
    for b in iter_weight_buckets(m, 20_000, keep=True, device=dev, place="pinned"):
        for n, t in b.items():
            assert t.device.type == "cpu" and t.is_pinned() and torch.equal(t, ref[n])
    on_dev = list(iter_weight_buckets(m, 20_000, keep=True, device=dev))
    assert all(t.is_cuda for b in on_dev for t in b.values())


def test_gather_leaves_grad_mode_alone_between_buckets():
    """The trainer runs each next() of the gather in a pool thread that later runs the
    update: no grad-mode context may stay open across a yield (it once did, and the
    next backward in that thread failed with 'does not require grad')."""
    import torch

    from distflow.trainer.gather import iter_weight_buckets

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    it = iter_weight_buckets(model, 64, keep=True, device="cpu")
    first = next(it)
    assert torch.is_grad_enabled()
    assert all(not t.requires_grad for t in first.values())
    rest = list(it)
    assert torch.is_grad_enabled() and len(rest) >= 1


def _nccl_worker(rank: int, world: int, store: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from distflow.device import node_device
    from distflow.trainer.gather import iter_weight_buckets

    os.environ["DISTFLOW_LOCAL_GPU"] = str(rank)
    dev = node_device("cuda")
    with process_group(store, rank, world, "nccl", device_id=dev):
        torch.manual_seed(0)  # the same initial weights on both ranks
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Embedding(17, 64)).to(dev)
        full = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        mesh = init_device_mesh("cuda", (world,))
        for m in model:
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        kept = list(iter_weight_buckets(model, 20_000, keep=(rank == 0), device=dev))
        pinned = list(iter_weight_buckets(model, 20_000, keep=(rank == 1), device=dev, place="pinned",
                                          dtype=torch.bfloat16))
        both = list(iter_weight_buckets(model, 20_000, keep=True, device=dev))
        assert all(t.is_cuda for b in kept + both for t in b.values())
        assert all(t.is_pinned() for b in pinned for t in b.values())
        cpu = lambda bs: [{k: v.cpu() for k, v in b.items()} for b in bs]  # noqa: E731
        torch.save({"full": full, "kept": cpu(kept), "pinned": cpu(pinned), "both": cpu(both)},
                   os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_serving_rank_gather_over_nccl(tmp_path: Path) -> None:
    """NCCL: rank 0 alone keeps (point-to-point into GPU buckets), then rank 1 alone (pinned, bf16),
    then both (all-gather); the 17-row embedding is sharded unevenly."""
    mp.start_processes(_nccl_worker, args=(2, store_path(tmp_path), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert r0["pinned"] == [] and r1["kept"] == []
    for buckets, dtype in ((r0["kept"], torch.float32), (r1["pinned"], torch.bfloat16), (r0["both"], torch.float32),
                           (r1["both"], torch.float32)):
        got = {n: t for b in buckets for n, t in b.items()}
        assert list(got) == list(r0["full"])
        for n, t in got.items():
            assert t.dtype == dtype and torch.equal(t, r0["full"][n].to(dtype)), n
