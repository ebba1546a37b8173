"""Packed (varlen) micro-batches: planning, layouts, and parity with the padded path.

The packed row attends block-diagonally through Hugging Face's position-id packing
detection; these tests check, on a real Llama toy model and a tiny Qwen2 model, that
logprobs, entropies and every parameter gradient equal the padded path's.
"""

from __future__ import annotations

import pytest
import torch

from distflow.buffer.batch import SampleBatch
from distflow.trainer.head import response_forward
from distflow.trainer.packing import dummy_inputs, pack_inputs, pad_inputs, plan_micro_batches


def make_batch(n: int = 12, seed: int = 0, vocab: tuple[int, int] = (3, 17), max_resp: int = 8) -> SampleBatch:
    """A variable-length batch: prompts 2-5 tokens, responses 1-``max_resp`` tokens, engine
    logprobs, advantages. Deterministic for ``seed``."""
    g = torch.Generator().manual_seed(seed)

    def toks(lo: int, hi: int) -> list[int]:
        return torch.randint(vocab[0], vocab[1], (int(torch.randint(lo, hi + 1, (1,), generator=g)),),
                             generator=g).tolist()

    prompts = [toks(2, 5) for _ in range(n)]
    responses = [toks(1, max_resp) for _ in range(n)]
    b = SampleBatch.from_lists([f"s{i}" for i in range(n)], [f"p{i // 4}" for i in range(n)], prompts, responses,
                               [[-2.5 + 0.05 * j for j in range(len(r))] for r in responses])
    b.set_scalar("advantage", torch.randn(n, generator=g))
    return b


def test_plan_micro_batches_hand_computed():
    # samples of 5, 3, 8, 2 tokens (ids 0..3), budget 10: first-fit decreasing
    # 8 -> bin A (2 left); 5 -> bin B (5 left); 3 -> B (2 left); 2 -> A (0 left)
    assert plan_micro_batches([5, 3, 8, 2], micro_batch_size=64, max_tokens=10) == [[2, 3], [0, 1]]
    # the sample cap still applies inside a budget
    assert plan_micro_batches([1, 1, 1], micro_batch_size=2, max_tokens=100) == [[0, 1], [2]]
    # a sample over the budget gets a bin of its own
    assert plan_micro_batches([12, 4], micro_batch_size=8, max_tokens=10) == [[0], [1]]
    # no budget: consecutive groups of micro_batch_size (the padded path)
    assert plan_micro_batches([5, 3, 8, 2, 1], micro_batch_size=2) == [[0, 1], [2, 3], [4]]
    assert plan_micro_batches([], micro_batch_size=2, max_tokens=10) == []
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        plan_micro_batches([3], micro_batch_size=2, max_tokens=0)


def test_pack_and_pad_layouts_hand_computed():
    prompts = [torch.tensor([5, 6]), torch.tensor([7])]
    responses = [torch.tensor([8]), torch.tensor([9, 10])]
    packed = pack_inputs(prompts, responses)
    assert packed.input_ids.tolist() == [[5, 6, 8, 7, 9, 10]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert packed.attention_mask is None
    assert packed.index.tolist() == [1, 3, 4]  # hidden states predicting 8, 9, 10
    assert packed.targets.tolist() == [8, 9, 10]
    assert packed.response_lens == [1, 2] and packed.tokens == 6 and packed.compute_tokens == 6
    assert packed.cu_seqlens.tolist() == [0, 3, 6] and packed.max_len == 3

    padded = pad_inputs(prompts, responses, pad_id=0)
    assert padded.input_ids.tolist() == [[5, 6, 8], [7, 9, 10]]
    assert padded.attention_mask.tolist() == [[1, 1, 1], [1, 1, 1]]
    assert padded.index.tolist() == [1, 3, 4]
    assert padded.targets.tolist() == [8, 9, 10]

    padded = pad_inputs([torch.tensor([5])], [torch.tensor([8])], pad_id=0)
    assert padded.index.tolist() == [0]
    wide = pad_inputs([torch.tensor([5, 6, 7]), torch.tensor([1])], [torch.tensor([8]), torch.tensor([2])], pad_id=0)
    assert wide.input_ids.tolist() == [[5, 6, 7, 8], [1, 2, 0, 0]]
    assert wide.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 1, 1]]
    assert wide.index.tolist() == [2, 4] and wide.tokens == 6 and wide.compute_tokens == 8

    d = dummy_inputs()
    assert d.index.numel() == 0 and d.response_lens == [] and d.tokens == 0
    with pytest.raises(ValueError, match="sample 0: empty prompt_tokens"):
        pack_inputs([torch.tensor([], dtype=torch.int64)], [torch.tensor([1])])
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        pad_inputs(prompts, responses[:1])


def _qwen2_tiny():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return Qwen2ForCausalLM(cfg).float()


def _llama_toy(toy_model):
    from distflow.hf import load_causal_lm

    return load_causal_lm(toy_model, torch.float32)


@pytest.mark.parametrize("attn", ["distflow_varlen", "sdpa"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_equals_padded_logprobs_and_gradients(arch, attn, toy_model):
    """Both the trainer's varlen attention (per-sample causal attention from cu_seqlens) and
    transformers' SDPA (block-diagonal mask from the position ids) are exact."""
    from distflow.trainer.attention import register_varlen_attention

    model = _llama_toy(toy_model) if arch == "llama" else _qwen2_tiny()  # qwen2: grouped-query attention
    if attn == "distflow_varlen":
        model.set_attn_implementation(register_varlen_attention())
    assert model.config._attn_implementation == attn
    model.train()
    batch = make_batch(10, seed=4)
    prompts, responses = batch.ragged("prompt_tokens"), batch.ragged("response_tokens")
    weights = torch.linspace(-1.0, 1.0, int(batch.tensors["response_lens"].sum()))
    results = []
    for inputs in (pad_inputs(prompts, responses), pack_inputs(prompts, responses)):
        model.zero_grad(set_to_none=True)
        lp, ent = response_forward(model, inputs, temperature=0.9, chunk_tokens=7)
        ((lp * weights).sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    assert lp_a.shape == (int(batch.tensors["response_lens"].sum()),)
    assert torch.allclose(lp_a, lp_b, atol=1e-5), (lp_a - lp_b).abs().max()
    assert torch.allclose(ent_a, ent_b, atol=1e-5)
    assert g_a.keys() == g_b.keys()
    for name in g_a:
        assert torch.allclose(g_a[name], g_b[name], atol=1e-5, rtol=1e-4), name
    # and the padded path agrees with the plain full-logits computation (the engine's convention)
    from distflow.trainer.logprobs import gather_response, pad_batch, token_logprobs

    ids, attn, resp = pad_batch(prompts, responses, 0)
    with torch.no_grad():
        ref = gather_response(token_logprobs(model, ids, attn, 0.9), resp)
    assert torch.allclose(lp_a, ref, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_padded_rows_attend_causally_without_a_dense_mask(arch, toy_model, monkeypatch):
    """Right-padded micro-batches under ``distflow_varlen``: SDPA gets no [B, 1, S, S] padding
    mask (its memory grows as S^2 and it keeps SDPA off FlashAttention on a GPU), only causality,
    and logprobs, entropies and every gradient equal transformers' SDPA with its padding mask."""
    import torch.nn.functional as F

    from distflow.trainer.attention import register_varlen_attention

    model = (_llama_toy(toy_model) if arch == "llama" else _qwen2_tiny()).train()
    model.set_attn_implementation("sdpa")
    batch = make_batch(6, seed=11)
    inputs = pad_inputs(batch.ragged("prompt_tokens"), batch.ragged("response_tokens"))
    assert inputs.attention_mask is not None and not bool(inputs.attention_mask.all())  # real padding
    weights = torch.linspace(-1.0, 1.0, int(batch.tensors["response_lens"].sum()))
    calls: list[tuple[object, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, **kw):
        calls.append((None if attn_mask is None else tuple(attn_mask.shape), kw.get("is_causal", False)))
        return sdpa(q, k, v, attn_mask, *args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    results = []
    for attn in ("sdpa", register_varlen_attention()):
        model.set_attn_implementation(attn)
        model.zero_grad(set_to_none=True)
        calls.clear()
        lp, ent = response_forward(model, inputs, temperature=0.9, chunk_tokens=7)
        ((lp * weights).sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                        list(calls)))
    (lp_a, ent_a, g_a, calls_a), (lp_b, ent_b, g_b, calls_b) = results
    width = inputs.input_ids.shape[1]
    assert calls_a and all(shape == (6, 1, width, width) for shape, _ in calls_a)  # transformers: dense mask
    assert calls_b == [(None, True)] * model.config.num_hidden_layers  # ours: one causal call per layer
    assert torch.allclose(lp_a, lp_b, atol=1e-5), (lp_a - lp_b).abs().max()
    assert torch.allclose(ent_a, ent_b, atol=1e-5)
    for name in g_a:
        assert torch.allclose(g_a[name], g_b[name], atol=1e-5, rtol=1e-4), name


def test_packed_rows_do_not_attend_across_samples(toy_model):
    """Changing one sample's tokens leaves every other sample's logprobs in the row unchanged."""
    from distflow.trainer.attention import register_varlen_attention

    model = _llama_toy(toy_model).eval()
    model.set_attn_implementation(register_varlen_attention())
    batch = make_batch(4, seed=9)
    prompts, responses = batch.ragged("prompt_tokens"), batch.ragged("response_tokens")
    with torch.no_grad():
        base, _ = response_forward(model, pack_inputs(prompts, responses))
        changed = [p.clone() for p in prompts]
        changed[1] = (changed[1] + 1).clamp(max=16)
        other, _ = response_forward(model, pack_inputs(changed, responses))
    lens = batch.tensors["response_lens"].tolist()
    a, b = torch.split(base, lens), torch.split(other, lens)
    for i in (0, 2, 3):
        assert torch.equal(a[i], b[i]) or torch.allclose(a[i], b[i], atol=1e-6)
    assert not torch.allclose(a[1], b[1])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_varlen_forward_reads_nothing_back(arch, toy_model):
    """A packed row under ``distflow_varlen`` makes no scalar read (a host sync on a GPU) in the
    forward or backward: its empty 4-D mask spares transformers' packed-sequence scan of the
    position ids. Under transformers' SDPA that scan runs (the counter sees it), and both paths
    give the same logprobs."""
    from distflow.trainer.attention import register_varlen_attention
    from tests.host_reads import HostReads

    model = (_llama_toy(toy_model) if arch == "llama" else _qwen2_tiny()).train()
    batch = make_batch(6, seed=5)
    inputs = pack_inputs(batch.ragged("prompt_tokens"), batch.ragged("response_tokens"))
    with HostReads() as sdpa_reads:
        ref, _ = response_forward(model, inputs, temperature=0.9, chunk_tokens=7)
    assert sdpa_reads.by_caller["masking_utils.py"] >= 1  # transformers' scan, seen by the counter
    model.set_attn_implementation(register_varlen_attention())
    with HostReads() as reads:
        lp, ent = response_forward(model, inputs, temperature=0.9, chunk_tokens=7)
        (lp.sum() + ent.sum()).backward()
    assert sum(reads.by_caller.values()) == 0, dict(reads.by_caller)
    assert torch.allclose(lp, ref, atol=1e-5)


def test_a_model_whose_attention_the_trainer_cannot_compute_is_refused(tmp_path):
    """Gemma 2 soft-caps its attention scores (``softcap=`` to its attention function). The
    trainer's varlen attention took it in ``**kwargs`` and dropped it, so it trained on logprobs
    of another model than the one the engine samples (0.02 off at Gemma 2's cap of 50, 2.3 at a
    cap of 1). Now a config that says so is refused when the model is prepared, naming the key,
    and an attention call carrying such an option fails instead of computing without it."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from distflow.trainer.attention import register_varlen_attention, use_varlen_attention

    common = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, final_logit_softcapping=None)
    capped = Gemma2ForCausalLM(Gemma2Config(**common, attn_logit_softcapping=1.0))
    with pytest.raises(ValueError, match=r"'gemma-dir'.*attn_logit_softcapping=1\.0.*no attention logit soft-capping"):
        use_varlen_attention(capped, "gemma-dir")
    capped.set_attn_implementation(register_varlen_attention())  # as it was before the check
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with pytest.raises(NotImplementedError, match=r"Gemma2Attention calls its attention with softcap="):
        capped(input_ids=ids)
    plain = Gemma2ForCausalLM(Gemma2Config(**common, attn_logit_softcapping=None))
    use_varlen_attention(plain, "gemma-dir")  # no soft-capping: trained as any other model
    assert plain.config._attn_implementation == "distflow_varlen"
    eager = Gemma2ForCausalLM(Gemma2Config(**common, attn_logit_softcapping=None))
    eager.load_state_dict(plain.state_dict())
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, eager(input_ids=ids).logits, atol=1e-5)
