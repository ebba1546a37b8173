"""Ulysses sequence parallelism in the trainer (``sequence_parallel``, distflow/trainer/ulysses.py) on real gloo ranks.

Two ranks as ONE sequence-parallel group (mesh dp=1 x sp=2), then four as one SP x TP group (dp=1 x
sp=2 x tp=2), each rank given a different, uneven part of a batch whose first sample is 4,000 tokens
long (the group unites the parts), take one actor step: the reference pass and the update run every
packed row split in two, with all-to-alls around the attention. One rank takes the same step on the
whole batch without SP. Loss, every gradient, the updated weights and the reference logprobs must
agree within float tolerance; each SP rank really held half of each row (padded to an even length).
Ulysses' attention with fewer KV heads than ranks (the heads repeated) equals the whole attention,
forward and backward. And the refusals.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from distflow.buffer.batch import SampleBatch
from tests.conftest import ROOT
from tests.process_group import process_group
from tests.test_actor import _cfg, _forked_fn
from tests.test_packing import make_batch
from tests.test_tensor_parallel import assert_same_step, config_refuses, recorded_update

QUICKSTART = ROOT / "examples" / "grpo_quickstart.yaml"
LONG_PROMPT, LONG_RESPONSE = 3000, 1000


@pytest.mark.parametrize("overrides, needle", [
    (["trainer_nodes=2", "sequence_parallel=3"],
     "sequence_parallel (3) x tensor_parallel (1) must divide trainer_nodes (2)"),
    (["trainer_nodes=2", "tensor_parallel=2", "sequence_parallel=2"],
     "sequence_parallel (2) x tensor_parallel (2) must divide trainer_nodes (2)"),
])
def test_config_refuses_an_sp_degree_that_does_not_fit(overrides, needle):
    assert config_refuses(overrides, needle, "sequence_parallel").sequence_parallel == 2


def test_model_heads_must_split_or_repeat_evenly():
    from transformers import LlamaConfig, Qwen2VLConfig

    from distflow.trainer.parallel import trainer_mesh
    from distflow.trainer.ulysses import check_sp_model

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    check_sp_model(cfg, 2)  # 2 query heads and 1 KV head per rank
    check_sp_model(cfg, 4)  # 1 query head per rank, each KV head repeated twice
    with pytest.raises(ValueError, match=r"sequence_parallel: 3 must divide the model's num_attention_heads \(4\)"):
        check_sp_model(cfg, 3)
    gqa = LlamaConfig(hidden_size=96, intermediate_size=128, num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"sequence_parallel: 2 must divide the model's num_key_value_heads \(3\) or"):
        check_sp_model(LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=3), 2)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(4\) or be a multiple"):
        check_sp_model(gqa, 3)
    check_sp_model(cfg, 2, tp=2)  # 1 query head per rank; the TP rank's 1 KV head repeated
    with pytest.raises(ValueError, match=r"num_attention_heads \(4 / tensor_parallel 2\)"):
        check_sp_model(cfg, 4, tp=2)
    with pytest.raises(ValueError, match="sequence_parallel: 2: vision-language models are not supported"):
        check_sp_model(Qwen2VLConfig(), 2)
    with pytest.raises(ValueError, match=r"sequence_parallel \(2\) x tensor_parallel \(2\) must divide trainer_nodes"):
        trainer_mesh("cpu", 6, 2, 2)  # said again for a caller that builds its own mesh


def long_batch() -> SampleBatch:
    """A 4,000-token sample (prompt 3,000, response 1,000) followed by 7 short ones."""
    g = torch.Generator().manual_seed(11)
    long = SampleBatch.from_lists(["long"], ["pl"], [torch.randint(3, 17, (LONG_PROMPT,), generator=g).tolist()],
                                  [torch.randint(3, 17, (LONG_RESPONSE,), generator=g).tolist()],
                                  [[-2.5] * LONG_RESPONSE])
    long.set_scalar("advantage", torch.tensor([0.7]))
    return SampleBatch.concat([long, make_batch(7, seed=5)])


def _check_gqa_attention(group: Any) -> dict[str, float]:
    """Ulysses over a 2-rank SP ``group`` with 1 KV head (repeated) vs one rank's varlen attention on the
    whole row."""
    from distflow.trainer.attention import varlen_attention
    from distflow.trainer.ulysses import ulysses_attention

    g = torch.Generator().manual_seed(3)
    lens = [5, 9, 6]
    s = sum(lens)
    q, k, v = (torch.randn(1, h, s, 8, generator=g, requires_grad=True) for h in (4, 1, 1))
    cu = torch.tensor([0, 5, 14, 20], dtype=torch.int32)
    kw = {"cu_seq_lens_q": cu, "max_length_q": 9, "distflow_seq_lens": tuple(lens)}
    full, _ = varlen_attention(None, q, k, v, None, **kw)  # [1, S, 4, 8]
    (full * torch.arange(full.numel()).view_as(full).sin()).sum().backward()
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    rank = dist.get_rank(group)
    mine = slice(rank * s // 2, (rank + 1) * s // 2)
    ql, kl, vl = (t.detach()[:, :, mine].clone().requires_grad_(True) for t in (q, k, v))
    out, _ = ulysses_attention(varlen_attention, None, ql, kl, vl, None, group, **kw)
    (out * torch.arange(full.numel()).view_as(full).sin()[:, mine]).sum().backward()
    return {"out": float((out - full[:, mine]).detach().abs().max()),
            **{f"grad_{n}": float((t.grad - r[:, :, mine]).abs().max())
               for n, t, r in zip("qkv", (ql, kl, vl), ref_grads)}}


def _sp_step(rank: int, world: int, store: str, toy_model: str, overrides: list[str], out: str) -> None:
    from distflow.trainer.actor import Actor
    from distflow.trainer.parallel import share_union

    torch.set_num_threads(1)
    with process_group(store, rank, world):
        cfg = _cfg(toy_model, "kl_coef=0.01", "lr=0.01", f"trainer_nodes={world}", *overrides)
        actor = Actor(cfg, with_reference=True)
        batch = long_batch()
        if world > 1:  # uneven parts, as owner routing gives: the share group trains all 8 together
            cuts = [0, 5, 8] if world == 2 else [0, 3, 4, 8, 8]  # (4 ranks: one gets none)
            batch = batch.select(range(cuts[rank], cuts[rank + 1]))
        batch = actor.reference_logprobs(batch)
        ref_lp = batch.tensors["ref_logprobs"].clone()  # this rank's rows only
        rows = [(int(i.input_ids.shape[1]), sum(i.seq_lens), i.tokens) for _, i in  # (this rank's width, the
                actor._micro_batches(share_union(batch, actor.mesh)[0])]  # padded row, its real tokens)
        stats, grads = recorded_update(actor, cfg, batch)
        state = actor.full_state_dict()
        gqa = _check_gqa_attention(actor.sp_group) if world > 1 else {}
        if rank == 0:
            torch.save({"stats": stats, "grads": grads, "state": state, "ref_lp": ref_lp, "rows": rows,
                        "share": actor.share, "gqa": gqa}, out)


@pytest.fixture(scope="module")
def sp1(tmp_path_factory, toy_model) -> dict:
    """One rank's step on the whole batch, packed with a 4,096-token budget: the split steps' reference."""
    tmp = tmp_path_factory.mktemp("sp1")
    _forked_fn(_sp_step, 1, (1, str(tmp / "sp1.store"), str(toy_model), ["max_tokens_per_micro_batch=4096"],
                             str(tmp / "sp1.pt")))
    return torch.load(tmp / "sp1.pt")


@pytest.mark.parametrize("world, overrides", [(2, ["sequence_parallel=2"]),
                                              (4, ["sequence_parallel=2", "activation_checkpointing=true"]),
                                              (4, ["sequence_parallel=2", "tensor_parallel=2"])],
                         ids=["sp2", "dp2xsp2", "sp2xtp2"])
def test_split_step_equals_one_rank_on_a_4k_token_sample(tmp_path, toy_model, sp1, world, overrides):
    """SP=2 (dp 1 x sp 2), two SP groups (dp 2 x sp 2: FSDP2 over all 4 ranks, each group its own share;
    with activation checkpointing, whose recomputation runs the all-to-alls again in backward) and SP=2 x TP=2 (dp 1 x sp 2 x tp 2, each rank one of the toy's 4 heads), without
    a token budget (micro-batches of 4 samples, packed because SP needs one row): the micro-batches differ
    from the reference's too, and the step's loss and gradients must not."""
    assert not dist.is_initialized()
    out = str(tmp_path / "split.pt")
    _forked_fn(_sp_step, world, (world, str(tmp_path / "split.store"), str(toy_model), overrides, out))
    a, b = sp1, torch.load(out)
    assert (a["share"], b["share"]) == (1, 2 if "tensor_parallel=2" not in overrides else 4)
    assert all(v < 1e-5 for v in b["gqa"].values()), b["gqa"]  # KV heads repeated: the whole attention's values
    # each SP rank held half of every row, padded to an even length; the first holds the 4,000-token sample
    assert all(2 * w == n for w, n, _ in b["rows"]) and b["rows"][0][2] > LONG_PROMPT + LONG_RESPONSE
    pads = [n - real for _, n, real in b["rows"]]
    assert pads == ([1, 1] if world == 2 or b["share"] == 4 else [1])  # odd rows: one pad token each
    assert torch.allclose(b["ref_lp"], a["ref_lp"][:b["ref_lp"].numel()], atol=1e-5)  # rank 0's own rows
    assert b["stats"]["tokens"] == a["stats"]["tokens"] > LONG_RESPONSE
    assert_same_step(a, b, rel=1e-4, grad_atol=1e-6)
