"""The continuous-batching engine: forward parity with HF, trainer parity under continuous
batching / prefix sharing / mid-sequence weight swaps, seed determinism across slot
counts, bucketed weight loading, and the CUDA-graph path (GPU only).

Real tiny models built from scratch (distflow.toy and HF configs); the references are
full HF forwards and the trainer's own ``token_logprobs``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from distflow.weights import buckets
from distflow.rollout.engine import Completion, SamplingParams, TorchEngine
from distflow.rollout import llama_forward
from distflow.rollout.llama_forward import LlamaRunner, unsupported_reason
from distflow.toy import build_toy_model
from distflow.trainer.logprobs import gather_response, pad_batch, token_logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_toy_model(tmp_path_factory.mktemp("toy") / "model", seed=0, init_std=0.2)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_toy_model(tmp_path_factory.mktemp("toy") / "other", seed=1, init_std=0.2)


@pytest.fixture(scope="module")
def prompts(model_dir: str) -> list[list[int]]:
    eng = TorchEngine(model_dir)
    out = [eng.tokenizer(s)["input_ids"] for s in ["1=", "3947=", "123456=", "77=", "5=", "808="]]
    eng.close()
    return out


def _recompute(model: torch.nn.Module, prompts: list[list[int]], comps: list[Completion], pad: int,
               temperature: float) -> list[list[float]]:
    """The trainer's logprobs of each completion, split per completion."""
    ids, attn, resp = pad_batch([torch.tensor(p) for p in prompts], [torch.tensor(c.tokens) for c in comps], pad)
    with torch.no_grad():
        flat = gather_response(token_logprobs(model, ids, attn, temperature), resp).tolist()
    out, i = [], 0
    for c in comps:
        out.append(flat[i:i + len(c.tokens)])
        i += len(c.tokens)
    return out


def _max_err(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max((abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)), default=0.0)


# ---------------------------------------------------------------------- forward vs HF
def _tiny(kind: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, \
        Qwen3ForCausalLM

    common = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)
    cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig(**common, rope_theta=500.0)),
                "qwen2": (Qwen2ForCausalLM, Qwen2Config(**common)),
                "qwen3": (Qwen3ForCausalLM, Qwen3Config(**common, head_dim=16))}[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = cls(cfg).eval()
        for name, p in model.named_parameters():  # random biases and norm scales, so they matter
            if name.endswith(".bias") or "norm" in name:
                p.data.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return model


def test_move_slot_copies_only_the_cached_positions() -> None:
    """Compaction moves a slot's positions [0, length), not its whole cache row (a short
    sequence in an 8k-position cache of a 7B model would move ~470 MB), plus its decode inputs."""
    runner = LlamaRunner(_tiny("llama"), use_graphs=False)
    runner.reserve(3, 20)
    runner.k_cache.normal_()
    runner.v_cache.normal_()
    runner.tok_in[2], runner.pos[2] = 11, 6
    k0, v0 = runner.k_cache.clone(), runner.v_cache.clone()
    runner.move_slot(2, 0, 7)
    assert torch.equal(runner.k_cache[:, 0, :, :7], k0[:, 2, :, :7])
    assert torch.equal(runner.v_cache[:, 0, :, :7], v0[:, 2, :, :7])
    assert torch.equal(runner.k_cache[:, 0, :, 7:], k0[:, 0, :, 7:])  # untouched past the cached part
    assert torch.equal(runner.v_cache[:, 0, :, 7:], v0[:, 0, :, 7:])
    assert (runner.tok_in[0], runner.pos[0]) == (11, 6)
    runner.move_slot(2, 1)  # no length: the whole row
    assert torch.equal(runner.k_cache[:, 1], k0[:, 2]) and torch.equal(runner.v_cache[:, 1], v0[:, 2])


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_static_cache_forward_matches_hf_logits(kind: str) -> None:
    model = _tiny(kind)
    assert unsupported_reason(model) is None
    runner = LlamaRunner(model, use_graphs=False)
    runner.reserve(3, 20)
    seqs = [[1, 5, 9, 2, 7], [3, 4, 6], [8, 8, 8, 1, 2, 3, 4, 5]]
    with torch.no_grad():
        ref = [model(input_ids=torch.tensor([s])).logits[0].float() for s in seqs]
    # Slot order deliberately not the sequence order.
    last = runner.prefill([2, 0, 1], [s[:-2] for s in seqs])
    for i, s in enumerate(seqs):
        assert torch.allclose(last[i], ref[i][len(s) - 3], atol=1e-4, rtol=0)
    # Two decode steps for all three at their own positions: slot -> sequence 1, 2, 0.
    order = [1, 2, 0]
    for back in (2, 1):
        runner.tok_in[:3] = torch.tensor([seqs[q][-back] for q in order])
        runner.pos[:3] = torch.tensor([len(seqs[q]) - back for q in order])
        logits = runner.decode(3, max(len(seqs[q]) - back for q in order))
        for slot, q in enumerate(order):
            assert torch.allclose(logits[slot], ref[q][len(seqs[q]) - back], atol=1e-4, rtol=0)


def test_causal_prefill_matches_length_mask_with_gqa() -> None:
    """Prefill runs SDPA with is_causal (so CUDA can use flash with GQA) instead of the
    length mask: same logits, same KV at every real position, same decode after it, with
    right-padded rows of different lengths in one chunk."""
    model = _tiny("qwen2")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    seqs = [[1, 5, 9, 2, 7, 3, 3], [3, 4], [8, 8, 8, 1, 2]]
    out = {}
    for masked in (True, False):
        runner = LlamaRunner(model, use_graphs=False)
        runner.prefill_mask = masked
        runner.reserve(3, 16)
        last = runner.prefill([0, 1, 2], seqs)
        runner.tok_in[:3] = torch.tensor([4, 5, 6])
        runner.pos[:3] = torch.tensor([len(s) for s in seqs])
        out[masked] = (last, runner.decode(3, max(len(s) for s in seqs)), runner)
    (lm, dm, rm), (lc, dc, rc) = out[True], out[False]
    assert torch.allclose(lc, lm, atol=1e-5, rtol=0) and torch.allclose(dc, dm, atol=1e-5, rtol=0)
    for slot, s in enumerate(seqs):  # positions written by prefill and the decode step
        n = len(s) + 1
        assert torch.allclose(rc.k_cache[:, slot, :, :n], rm.k_cache[:, slot, :, :n], atol=1e-5, rtol=0)
        assert torch.allclose(rc.v_cache[:, slot, :, :n], rm.v_cache[:, slot, :, :n], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_prefill_keeps_sdpa_on_a_fused_kernel(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Grouped keys reach SDPA only in half precision (CUDA's flash takes them); in fp32 they are
    repeated to the query heads, which CUDA's memory-efficient kernel takes, instead of SDPA
    falling back to its math kernel and a B x Hq x L x L fp32 score matrix. The logits agree."""

    model = _tiny("qwen2").to(dtype)
    calls: list[tuple[int, int, bool]] = []
    sdpa = llama_forward.F.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        calls.append((q.shape[1], k.shape[1], bool(kw.get("enable_gqa"))))
        return sdpa(q, k, v, *a, **kw)

    monkeypatch.setattr(llama_forward.F, "scaled_dot_product_attention", spy)
    runner = LlamaRunner(model, use_graphs=False)
    runner.reserve(2, 16)
    seqs = [[1, 5, 9, 2, 7, 3, 3], [3, 4, 6]]
    last = runner.prefill([0, 1], seqs)
    assert calls and all(c == ((4, 4, False) if dtype == torch.float32 else (4, 2, True)) for c in calls), calls
    with torch.no_grad():
        ref = [model(input_ids=torch.tensor([s])).logits[0, -1].float() for s in seqs]
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert all(torch.allclose(last[i].float(), ref[i], atol=tol, rtol=0) for i in range(2))


def test_close_releases_the_parameters(model_dir: str) -> None:
    import gc
    import weakref

    eng = TorchEngine(model_dir)
    eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, temperature=0.0))
    ref = weakref.ref(eng.model.model.embed_tokens.weight)
    eng.close()
    gc.collect()
    assert ref() is None  # nothing (weight target, runner) keeps the weights alive


def test_unsupported_architecture_reason() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=4, n_positions=32))
    assert "model_type 'gpt2'" in unsupported_reason(model)


# ---------------------------------------------------------------------- engine vs trainer
def test_continuous_batching_parity_and_no_finished_rows(model_dir: str, prompts: list[list[int]]) -> None:
    eng = TorchEngine(model_dir, max_slots=3)
    many = [prompts[i % len(prompts)] for i in range(14)]
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=8, top_p=0.95)
    comps = eng.generate(many, params, seed=4)
    lengths = [len(c.tokens) for c in comps]
    assert len(set(lengths)) >= 3, lengths  # responses end at a spread of lengths
    assert {c.finish_reason for c in comps} == {"stop", "length"}
    assert _max_err(_recompute(eng.model, many, comps, eng.pad_token_id, 0.8), [c.logprobs for c in comps]) < 1e-4
    # The first token of each sequence comes from its prefill; every decode row produced a
    # kept token (the host checks every step on CPU), so no finished row was decoded.
    assert eng.sync_every == 1
    assert eng.stats["decode_rows"] == sum(lengths) - len(many)
    assert all(c.first_version == c.last_version == 0 for c in comps)


def test_prefix_sharing_prefills_each_prompt_once(model_dir: str, prompts: list[list[int]]) -> None:
    group = 4
    grouped = [p for p in prompts[:3] for _ in range(group)]  # 12 sequences, 3 distinct prompts
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    wide = TorchEngine(model_dir, max_slots=16)
    ref = wide.generate(grouped, params, seed=9)
    assert wide.stats["prefill_tokens"] == len(prompts[0]) + len(prompts[1]) + len(prompts[2])
    # 5 slots: groups split across admissions reuse a live member's KV (never more prefill
    # than once per group per admission), and the samples do not depend on it.
    eng = TorchEngine(model_dir, max_slots=5)
    comps = eng.generate(grouped, params, seed=9)
    assert eng.stats["prefill_tokens"] < group * sum(len(p) for p in prompts[:3])
    assert [c.tokens for c in comps] == [c.tokens for c in ref]
    assert _max_err(_recompute(eng.model, grouped, comps, eng.pad_token_id, 1.0), [c.logprobs for c in comps]) < 1e-4
    for g in range(3):  # a group's members share their prefill but sample their own tokens
        assert len({tuple(c.tokens) for c in comps[g * group:(g + 1) * group]}) > 1
        first = {round(c.logprobs[0], 6) for c in comps[g * group:(g + 1) * group] if c.tokens[0] ==
                 comps[g * group].tokens[0]}
        assert len(first) == 1


@pytest.fixture(scope="module")
def slot_engines(model_dir: str) -> dict[int, TorchEngine]:
    return {s: TorchEngine(model_dir, max_slots=s) for s in (1, 4, 64)}


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9), (1.3, 0, 0.8)])
def test_seed_determinism_regardless_of_slots(slot_engines: dict[int, TorchEngine], prompts: list[list[int]],
                                              temperature: float, top_k: int, top_p: float) -> None:
    params = SamplingParams(max_new_tokens=10, temperature=temperature, top_k=top_k, top_p=top_p)
    many = [prompts[i % len(prompts)] for i in range(10)]
    runs = [eng.generate(many, params, seed=21) for eng in slot_engines.values()]
    for other in runs[1:]:
        assert [c.tokens for c in other] == [c.tokens for c in runs[0]]
        assert _max_err([c.logprobs for c in other], [c.logprobs for c in runs[0]]) < 1e-5
    again = slot_engines[4].generate(many, params, seed=22)
    assert [c.tokens for c in again] != [c.tokens for c in runs[0]]


def test_mid_sequence_weight_swap(model_dir: str, other_dir: str, prompts: list[list[int]]) -> None:
    eng = TorchEngine(model_dir, max_slots=8)
    new = TorchEngine(other_dir)
    old_model = TorchEngine(model_dir).model
    new_sd = {k: v.clone() for k, v in new.model.state_dict().items() if k != "lm_head.weight"}
    calls = []

    def update():  # polled at every step boundary; the new weights arrive at the 3rd poll
        calls.append(len(calls))
        return (7, iter(buckets(new_sd, bucket_bytes=20_000))) if len(calls) == 3 else None

    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=())
    comps = eng.generate(prompts, params, seed=5, weights_update=update)
    assert eng.version == 7 and len(calls) >= 3 and eng.stats["weight_swaps"] == 1
    swapped = 1 + 3  # the prefill token, then one decode step before each of the 3 polls
    old_lp = _recompute(old_model, prompts, comps, eng.pad_token_id, 1.0)
    new_lp = _recompute(new.model, prompts, comps, eng.pad_token_id, 1.0)
    n_after = 0
    for c, o, n in zip(comps, old_lp, new_lp):
        assert _max_err([c.logprobs[:swapped]], [o[:swapped]]) < 1e-4
        assert _max_err([c.logprobs[swapped:]], [n[swapped:]]) < 1e-4
        n_after += len(c.tokens[swapped:])
        assert c.first_version == 0 and c.last_version == (7 if len(c.tokens) > swapped else 0)
    assert n_after > 0
    # The old and new weights really disagree on the swapped tokens.
    assert _max_err([x[swapped:] for x in old_lp], [x[swapped:] for x in new_lp]) > 1e-2


def test_stop_eos_and_length_edges(model_dir: str, prompts: list[list[int]]) -> None:
    eng = TorchEngine(model_dir, max_slots=2)
    one = eng.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0.0))
    assert all(len(c.tokens) == 1 and len(c.logprobs) == 1 for c in one)
    assert all(c.finish_reason == ("stop" if c.tokens[0] in eng.eos_token_ids else "length") for c in one)
    free = eng.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
    eng.runner, runner = None, eng.runner  # the HF loop (unsupported-architecture path) agrees
    try:
        hf = eng.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
    finally:
        eng.runner = runner
    assert [(c.tokens, c.finish_reason) for c in hf] == [(c.tokens, c.finish_reason) for c in free]
    assert _max_err([c.logprobs for c in hf], [c.logprobs for c in free]) < 1e-4
    # Every stop id ends its sequence at its first occurrence, exactly like EOS.
    for c in free:
        if len(c.tokens) > 3:
            stop = c.tokens[2]
            (s,) = eng.generate([prompts[free.index(c)]], SamplingParams(max_new_tokens=10, temperature=0.0,
                                                                          stop_token_ids=(stop,)))
            assert s.finish_reason == "stop" and s.tokens == c.tokens[:c.tokens.index(stop) + 1]


def test_hf_loop_samples_the_static_paths_streams(model_dir: str, prompts: list[list[int]]) -> None:
    """The HF loop (unsupported architectures, sliding windows) draws from the same
    per-sequence streams as the static-cache path: a seed gives the same sampled completions
    on either path and for any HF batch size (it used to share one generator per batch)."""
    eng = TorchEngine(model_dir, max_slots=4)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9)
    static = eng.generate(prompts, params, seed=11)
    eng.runner, runner = None, eng.runner
    try:
        hf = eng.generate(prompts, params, seed=11)
        eng.max_batch_size, batch = 2, eng.max_batch_size
        hf_small = eng.generate(prompts, params, seed=11)
        eng.max_batch_size = batch
        other = eng.generate(prompts, params, seed=12)
    finally:
        eng.runner = runner
    assert [c.tokens for c in hf] == [c.tokens for c in static] == [c.tokens for c in hf_small]
    assert _max_err([c.logprobs for c in hf], [c.logprobs for c in static]) < 1e-4
    assert [c.tokens for c in other] != [c.tokens for c in hf]


# ---------------------------------------------------------------------- weight loading
def test_load_weights_buckets_and_errors(model_dir: str, other_dir: str, prompts: list[list[int]]) -> None:
    eng = TorchEngine(model_dir)
    other = TorchEngine(other_dir)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    want = [c.tokens for c in other.generate(prompts, greedy)]
    before = [c.tokens for c in eng.generate(prompts, greedy)]
    sd = {k: v.clone() for k, v in other.model.state_dict().items()}
    parts = buckets(sd, bucket_bytes=10_000)
    assert len(parts) > 2
    ptr = eng.model.model.embed_tokens.weight.data_ptr()
    bad = [dict(b) for b in parts]
    bad[-1]["model.norm.weight"] = torch.ones(64, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"dtype mismatch: model\.norm\.weight: got torch\.int64"):
        eng.load_weights(2, bad)
    with pytest.raises(TypeError, match="bucket 1 must be a mapping"):
        eng.load_weights(2, [parts[0], 5])
    assert eng.version == 0 and [c.tokens for c in eng.generate(prompts, greedy)] == before
    stale = {"model.norm.weight": torch.zeros(64)}  # a name repeated in a later bucket: the later one wins
    eng.load_weights(2, (b for b in [stale] + parts))  # a one-pass generator of buckets
    assert eng.version == 2 and eng.model.model.embed_tokens.weight.data_ptr() == ptr  # in place
    assert torch.equal(eng.model.model.norm.weight, sd["model.norm.weight"])
    assert [c.tokens for c in eng.generate(prompts, greedy)] == want
    half = {k: v.to(torch.bfloat16) for k, v in TorchEngine(model_dir).model.state_dict().items()}
    eng.load_weights(3, half)  # another float dtype is cast on copy
    assert eng.model.model.norm.weight.dtype == torch.float32


# ---------------------------------------------------------------------- CUDA graphs
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_matches_eager(model_dir: str, other_dir: str, prompts: list[list[int]]) -> None:
    many = [prompts[i % len(prompts)] for i in range(20)]
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    graphs = TorchEngine(model_dir, device="cuda", max_slots=8, compile=True)
    eager = TorchEngine(model_dir, device="cuda", max_slots=8, compile=False)
    a, b = graphs.generate(many, params, seed=3), eager.generate(many, params, seed=3)
    assert graphs.stats["capture_s"] > 0 and eager.stats["capture_s"] == 0
    assert graphs.sync_every > 1
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert _max_err([c.logprobs for c in a], [c.logprobs for c in b]) < 1e-4
    cpu = TorchEngine(model_dir, max_slots=8)
    assert _max_err(_recompute(cpu.model, many, a, cpu.pad_token_id, 1.0), [c.logprobs for c in a]) < 1e-3
    capture, captured = graphs.stats["capture_s"], len(graphs.runner.graphs)
    again = graphs.generate(many, params, seed=3)  # the same buckets again: nothing is recaptured
    assert graphs.stats["capture_s"] == capture and len(graphs.runner.graphs) == captured
    assert [c.tokens for c in again] == [c.tokens for c in a]
    # Weights are copied into the captured parameters in place: the replayed graphs use them.
    other = TorchEngine(other_dir, device="cuda", max_slots=8, compile=False)
    graphs.load_weights(1, {k: v.clone() for k, v in other.model.state_dict().items()})
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    assert [c.tokens for c in graphs.generate(many, greedy)] == [c.tokens for c in other.generate(many, greedy)]


def test_graph_bucket_sizes(model_dir: str) -> None:
    eng = TorchEngine(model_dir, max_slots=48)
    eng.runner.reserve(48, 16)
    assert [eng.runner.bucket(n) for n in (1, 2, 3, 5, 17, 33, 48)] == [1, 2, 4, 8, 32, 48, 48]


def test_partial_weights_delta(model_dir: str, other_dir: str, prompts: list[list[int]]) -> None:
    eng = TorchEngine(model_dir)
    other = TorchEngine(other_dir)
    norm = other.model.model.norm.weight.clone()
    from distflow.weights import WeightUpdate

    with pytest.raises(ValueError, match=r"missing \d+ key"):
        eng.load_weights(1, {"model.norm.weight": norm})
    eng.load_weights(*WeightUpdate(1, [{"model.norm.weight": norm}], True))  # a delta: the rest stays
    assert eng.version == 1 and torch.equal(eng.model.model.norm.weight, norm)
    assert torch.equal(eng.model.model.embed_tokens.weight, TorchEngine(model_dir).model.model.embed_tokens.weight)
    # The same through weights_update, as (version, buckets, partial).
    sd = {k: v.clone() for k, v in other.model.state_dict().items() if k != "model.norm.weight"}
    updates = iter([WeightUpdate(2, [sd], True)])  # what the weight inbox's take_update() returns
    comps = eng.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0),
                         weights_update=lambda: next(updates, None))
    assert eng.version == 2 and all(c.last_version == 2 for c in comps if len(c.tokens) > 2)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    assert [c.tokens for c in eng.generate(prompts, greedy)] == [c.tokens for c in other.generate(prompts, greedy)]


def test_inverse_cdf_sampling_hand_computed() -> None:
    from distflow.rollout.sampling import _inverse_cdf, counter_uniform, seed_key

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.49, 0.5, 1.0 - 2 ** -24])
    assert _inverse_cdf(probs, u).tolist() == [1, 1, 3, 3]  # never a zero-probability column
    a = counter_uniform(seed_key(5), torch.tensor([0, 1, 0]), torch.tensor([0, 0, 1]))
    b = counter_uniform(seed_key(5), torch.tensor([1, 0]), torch.tensor([0, 1]))
    assert a[1] == b[0] and a[2] == b[1] and len(set(a.tolist())) == 3  # a pure function of (seed, seq, step)
    assert counter_uniform(seed_key(6), torch.tensor([0]), torch.tensor([0])) != a[0]
    many = counter_uniform(seed_key(0), torch.arange(20000), torch.zeros(20000, dtype=torch.int64))
    assert 0.0 <= float(many.min()) and float(many.max()) < 1.0 and abs(float(many.mean()) - 0.5) < 0.01
    assert many.dtype == torch.float64 and ((many * 2 ** 24) % 1 != 0).float().mean() > 0.99  # finer than 24 bits
    # A token of probability 1e-8 right after a mass of 0.75: an fp32 CDF does not rise there
    # (spacing 6e-8), so it could never be drawn; in float64 it is drawn for its own sliver of u.
    probs = torch.tensor([[0.75, 1e-8, 0.25 - 1e-8]])
    assert torch.cumsum(probs, -1)[0, 1] == torch.cumsum(probs, -1)[0, 0]  # what fp32 would have done
    assert _inverse_cdf(probs, torch.tensor([0.750000005], dtype=torch.float64)).tolist() == [1]
    assert _inverse_cdf(probs, torch.tensor([0.7499999], dtype=torch.float64)).tolist() == [0]


def test_draws_are_hashed_once_per_sync_block(model_dir: str, prompts: list[list[int]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the host looks every ``sync_every`` (8) decode steps; the sampling draws of those
    steps are hashed in one call (the hash is ~170 kernel launches), and give the same tokens as
    hashing each step (``sync_every`` 1, CPU's setting), rows that stopped mid-block included."""
    from distflow.rollout import slots

    calls: list[tuple[int, ...]] = []
    real = slots.counter_uniform

    def counted(key: torch.Tensor, seq: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(seq.shape))
        return real(key, seq, step)

    monkeypatch.setattr(slots, "counter_uniform", counted)
    many = [prompts[i % len(prompts)] for i in range(9)]
    params = SamplingParams(max_new_tokens=17, temperature=0.9, top_p=0.95)
    eng = TorchEngine(model_dir, max_slots=4)
    ref = eng.generate(many, params, seed=3)
    per_step = len(calls)
    calls.clear()
    eng.sync_every = 8
    out = eng.generate(many, params, seed=3)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    assert _max_err([c.logprobs for c in out], [c.logprobs for c in ref]) < 1e-5  # other batch shapes
    blocks = [s for s in calls if len(s) == 2]
    assert blocks and max(s[1] for s in blocks) == 8  # [slots, steps] blocks of up to 8 steps
    assert len(calls) < per_step / 3, (len(calls), per_step)
    eng.close()


def test_graph_shaped_decode_on_cpu(model_dir: str, prompts: list[list[int]]) -> None:
    """What a captured graph computes — a power-of-two bucket of rows (free slots decoding
    garbage) over a power-of-two bucket of the cache length (or all of it) — gives the eager
    results exactly."""
    many = [prompts[i % len(prompts)] for i in range(11)]
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    ref = TorchEngine(model_dir, max_slots=6).generate(many, params, seed=8)
    for min_length in (4, 1 << 20):  # length buckets from 4 positions on; the whole cache always
        eng = TorchEngine(model_dir, max_slots=6)
        runner = eng.runner
        runner.min_graph_length = min_length
        shapes = []

        def graph_like(n: int, max_pos: int) -> torch.Tensor:
            shapes.append(runner.graph_shape(n, max_pos))
            with torch.inference_mode():
                return runner._decode(*shapes[-1])[:n]

        runner.decode = graph_like
        out = eng.generate(many, params, seed=8)
        assert [c.tokens for c in out] == [c.tokens for c in ref]
        assert _max_err([c.logprobs for c in out], [c.logprobs for c in ref]) < 1e-5
        assert {4, 6} <= {b for b, _ in shapes} and runner.length >= max(len(p) for p in many) + 12
        lengths = {length for _, length in shapes}
        assert lengths == ({runner.length} if min_length > runner.length else lengths)
        if min_length == 4:  # several length buckets, each a power of two below the cache length
            assert len(lengths) >= 2 and all(x & (x - 1) == 0 for x in lengths) and max(lengths) <= runner.length


def test_graph_capture_protocol_on_cpu(model_dir: str, prompts: list[list[int]], monkeypatch) -> None:
    """How a decode graph is captured, with torch.cuda's capture API replaced by recorders (no
    GPU here; ``test_cuda_graph_decode_matches_eager`` runs the real one): on the runner's own
    stream (``device.private_stream``, never one of torch's pool streams), into its one pool, thread-local, and never through ``torch.cuda.graph`` (whose
    __enter__ synchronizes the whole device and empties the allocator) nor any other device-wide
    call; every graph writes its logits into rows of the one ``logits_out`` buffer. A recorded
    graph's replay re-runs what it captured, so generation must give the eager tokens."""
    calls: list[tuple] = []

    class Stream:
        def wait_stream(self, other):
            calls.append(("wait_stream",))

        def synchronize(self):
            calls.append(("stream_sync",))

    side, main = Stream(), Stream()

    class Graph:
        def capture_begin(self, pool=None, capture_error_mode="global"):
            calls.append(("begin", pool, capture_error_mode, current[-1]))
            self.shape = None

        def capture_end(self):
            calls.append(("end",))
            self.shape = captured.pop()

        def replay(self):
            b, length = self.shape
            runner.logits_out[:b].copy_(runner._decode(b, length))

    current = [main]
    captured: list[tuple[int, int]] = []

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    def forbidden(name):
        def call(*a, **k):
            raise AssertionError(f"torch.cuda.{name} called during a capture")
        return call

    real_decode = LlamaRunner._decode

    def decode(self, b, length):
        if current[-1] is side and calls and calls[-1][0] == "begin":
            captured.append((b, length))
        return real_decode(self, b, length)

    cuda = torch.cuda
    monkeypatch.setattr(LlamaRunner, "_decode", decode)
    monkeypatch.setattr(cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(llama_forward, "private_stream", lambda d: (side, "owner"))  # not a pool stream
    monkeypatch.setattr(cuda, "current_stream", lambda d=None: main)
    monkeypatch.setattr(cuda, "graph_pool_handle", lambda: "pool-0")
    monkeypatch.setattr(cuda, "stream", stream)
    monkeypatch.setattr(cuda, "CUDAGraph", Graph)
    for name in ("graph", "synchronize", "empty_cache", "Stream"):
        monkeypatch.setattr(cuda, name, forbidden(name))

    many = [prompts[i % len(prompts)] for i in range(11)]
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    ref = TorchEngine(model_dir, max_slots=6).generate(many, params, seed=8)
    eng = TorchEngine(model_dir, max_slots=6)
    runner = eng.runner
    runner.use_graphs, runner.min_graph_length = True, 4
    out = eng.generate(many, params, seed=8)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    assert _max_err([c.logprobs for c in out], [c.logprobs for c in ref]) < 1e-5
    begins = [c for c in calls if c[0] == "begin"]
    assert len(begins) == len(runner.graphs) >= 3 and all(isinstance(g, Graph) for g in runner.graphs.values())
    assert all(c[1:] == ("pool-0", "thread_local", side) for c in begins)
    assert sum(c[0] == "end" for c in calls) == len(begins)
    assert runner.logits_out.shape == (runner.slots, runner.vocab_size) and runner.logits_out.dtype == torch.float32
    assert {g.shape for g in runner.graphs.values()} == set(runner.graphs)
    eng.close()  # drops what a runner still held by someone else would keep: graphs, cache, logits buffer
    assert runner.graphs == {} and runner.k_cache is None and runner.logits_out is None


def test_a_failed_graph_capture_is_retried_then_decoded_eagerly_and_counted(model_dir: str,
                                                                            prompts: list[list[int]], caplog) -> None:
    """A capture that fails (an op a graph cannot hold, no memory left for its pool) used to fail
    every generate that needed that shape, so the rollout node died; then it silently decoded
    eagerly for the rest of the run. Now each failure is counted, retried once after freeing the
    graphs' memory, the shape decodes eagerly until the next call (same tokens, the warm-up's
    writes to the decode inputs undone), the next call tries again, and after
    MAX_CAPTURE_FAILURES the shape gives up with an error. The failure is a real one: graphs
    forced on a CPU runner, whose capture enters ``torch.cuda.device(cpu)``."""
    many = [prompts[i % len(prompts)] for i in range(7)]
    params = SamplingParams(max_new_tokens=9, temperature=1.0)
    ref = TorchEngine(model_dir, max_slots=4).generate(many, params, seed=2)
    eng = TorchEngine(model_dir, max_slots=4)
    runner = eng.runner
    runner.use_graphs = True
    with caplog.at_level("WARNING", logger="distflow.rollout.llama_forward"):
        out = eng.generate(many, params, seed=2)
        shapes = len(runner._eager_shapes)
        assert shapes >= 1 and eng.stats["graph_capture_failures"] == 2 * shapes  # each tried twice
        assert eng.stats["graph_eager_steps"] == eng.stats["decode_steps"] > 0
        again = eng.generate(many, params, seed=2)  # tried again: failures 3 and 4 give up for good
    assert [c.tokens for c in out] == [c.tokens for c in ref] == [c.tokens for c in again]
    assert _max_err([c.logprobs for c in out], [c.logprobs for c in ref]) < 1e-5
    assert runner.use_graphs and runner.graphs == {} and eng.stats["graph_capture_failures"] == 4 * shapes
    assert len(runner._given_up) == shapes and not runner._eager_shapes  # given up, not "until the next call"
    assert "Expected a cuda device" in runner.graph_error
    msgs = [r.getMessage() for r in caplog.records if "CUDA graph" in r.getMessage()]
    assert sum("retrying" in m for m in msgs) == 2 * shapes and sum("failed again" in m for m in msgs) == shapes
    assert sum(r.levelname == "ERROR" and "rest of the run" in r.getMessage() for r in caplog.records) == shapes
    failures = eng.stats["graph_capture_failures"]
    eng.generate(many, params, seed=2)  # given up: no more capture attempts
    assert eng.stats["graph_capture_failures"] == failures
    eng.close()


def test_bench_engine_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("bench_engine", Path(__file__).parent.parent / "bench" / "engine.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        out = bench.main(["--prompts", "12", "--slots", "4", "--max-new", "6", "--mean-len", "3",
                          "--fixed-prompts", "4", "--fixed-new", "3", "--prompt-len", "2,5"])
    finally:
        torch.set_num_threads(threads)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == out
    assert out["fixed_tokens"] <= 12 and out["variable_len_max"] <= 6 and out["variable_vs_hf_dynamic"] > 0
    assert out["hf_static_compile"] is False and out["threads"] == 1


def test_max_length_sizes_the_cache_once(tmp_path: Path) -> None:
    """max_length (the run's longest prompt plus max_new_tokens) sizes every KV slot at the first
    call, so a later, longer call reuses the cache (a regrow frees it and drops every CUDA graph
    mid-step) and generates what an engine without it generates; it never exceeds the model's
    positions."""
    model = build_toy_model(tmp_path / "m", seed=0, init_std=0.2, max_position_embeddings=512)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    eng = TorchEngine(model, max_slots=4, max_length=300)
    tok = eng.tokenizer
    short, long_ = [tok("1=")["input_ids"]], [tok("12345678=" * 20)["input_ids"]]
    assert len(long_[0]) + 8 > 128  # past the first 128-position bucket a short call would reserve
    eng.generate(short, params, seed=1)
    cache, length = eng.runner.k_cache, eng.runner.length
    assert length >= 300
    out = eng.generate(long_, params, seed=2)
    assert eng.runner.k_cache is cache and eng.runner.length == length  # no regrow
    plain = TorchEngine(model, max_slots=4)
    plain.generate(short, params, seed=1)
    assert plain.runner.length < len(long_[0]) + 8  # without max_length the long call regrows on CPU (on CUDA
    ref = plain.generate(long_, params, seed=2)  # the plan stretches the first cache: memory_plan's grow_to)...
    assert plain.runner.length >= len(long_[0]) + 8
    assert [c.tokens for c in out] == [c.tokens for c in ref]  # ... to the same completions
    capped = TorchEngine(model, max_slots=4, max_length=10_000)
    capped.generate(short, params, seed=1)
    assert capped.runner.length == 512  # the model's positions, not 10,000
    with pytest.raises(ValueError, match="max_length"):
        TorchEngine(model, max_length=0)
    for e in (eng, plain, capped):
        e.close()
