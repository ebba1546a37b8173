"""GPU checks of the engine's memory plan and decode paths on a bf16 GQA model (skipped without CUDA).

The model is the smallest that has what the CPU tests cannot: bf16 with grouped KV heads (4
query heads, 2 KV heads of 64: SDPA's flash path), a 32k vocabulary (a logits buffer and an LM
head of realistic width), 2048 positions (the cache sized once to them) and more than 256 new
tokens (several graph length buckets). CUDA-graph decoding, eager decoding and Hugging Face's
own forward (teacher-forced in fp32 on the same bf16 weights) must give the same logprobs up to
bf16 rounding. Run by ``scripts/gpu_check.sh`` (part ``tests``); no figure here is a claim until
that has run on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from distflow.rollout.engine import SamplingParams, TorchEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NEW_TOKENS = 300  # past 256: at least two attended-length buckets per slot bucket


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from distflow.toy import build_toy_tokenizer

    out = tmp_path_factory.mktemp("gqa") / "model"
    tok = build_toy_tokenizer(out)
    cfg = LlamaConfig(vocab_size=32_000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      initializer_range=0.1, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    return str(out)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 32_000, (n,), generator=g).tolist() for n in (5, 17, 40, 9, 64, 23)]


def _hf_logprobs(path: str, prompts: list[list[int]], comps) -> list[list[float]]:
    """Teacher-forced logprobs of each completion under HF's own forward, in fp32 on the bf16 weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).float().cuda().eval()
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, comps):
            ids = torch.tensor([p + c.tokens], device="cuda")
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            pos = torch.arange(len(p) - 1, len(p) - 1 + len(c.tokens), device="cuda")
            out.append(logp[pos, torch.tensor(c.tokens, device="cuda")].tolist())
    return out


def _errors(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(diffs) / len(diffs), max(diffs)


def test_graph_eager_and_hf_logprobs_agree_on_a_bf16_gqa_model(gqa_dir: str) -> None:
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    graphs = TorchEngine(gqa_dir, device="cuda", dtype="bfloat16", max_slots=8, compile=True)
    a = graphs.generate(prompts, params, seed=5)
    runner = graphs.runner
    # the cache was planned once for the model's 2048 positions, and every decode step replayed a graph
    assert runner.plan is not None and runner.length == 2048 and runner.plan.length == 2048
    assert graphs.stats["graph_eager_steps"] == 0 and graphs.stats["graph_capture_failures"] == 0
    assert len({length for _, length in runner.graphs}) >= 2  # > 256 new tokens: two length buckets at least
    cache = runner.k_cache
    graphs.generate([prompts[0] * 20], SamplingParams(max_new_tokens=8), seed=1)  # a longer prompt: no regrow
    assert runner.k_cache is cache
    eager = TorchEngine(gqa_dir, device="cuda", dtype="bfloat16", max_slots=8, compile=False)
    b = eager.generate(prompts, params, seed=5)
    assert all(len(c.tokens) > 256 or c.finish_reason == "stop" for c in a + b)
    hf_a, hf_b = _hf_logprobs(gqa_dir, prompts, a), _hf_logprobs(gqa_dir, prompts, b)
    # bf16 logits (8 bits of mantissa) of ~-10 nats: a few hundredths on average, never a whole nat
    for got, ref in (([c.logprobs for c in a], hf_a), ([c.logprobs for c in b], hf_b)):
        mean, worst = _errors(got, ref)
        assert mean < 0.05 and worst < 0.5, (mean, worst)
    # graph and eager decoding sample from the same per-sequence streams: the same tokens until
    # bf16 rounding of a different kernel shape flips a draw; up to there the contexts are the
    # same, and so are the logprobs (the first token comes from the same prefill in both)
    common = []
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x.tokens, y.tokens)) if p != q), min(len(x.tokens), len(y.tokens)))
        common.append(k)
    assert all(k >= 1 for k in common), common
    mean, _ = _errors([x.logprobs[:k] for x, k in zip(a, common)], [y.logprobs[:k] for y, k in zip(b, common)])
    assert mean < 0.02, (mean, common)
    graphs.close()
    eager.close()


def test_the_engine_stays_within_its_share_of_the_gpu(gqa_dir: str) -> None:
    """The plan (memory_plan.plan_kv_cache) from the GPU's total memory: what the engine allocates
    (weights, cache, logits buffer, graph pools, activations) stays within its share, and a
    colocated trainer's budget is left free whatever the engine's max_slots asked for. (A KV
    position of this model: 2 layers x 2 KV heads x 64 x K and V x 2 bytes = 1024 bytes.)"""
    _, total = torch.cuda.mem_get_info()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    share = 0.02  # a small share of the GPU (~2.8 GiB of an H200): far less than 4096 slots of 2048 positions
    eng = TorchEngine(gqa_dir, device="cuda", dtype="bfloat16", max_slots=4096, compile=True,
                      gpu_memory_utilization=0.5 + share, trainer_memory_fraction=0.5)
    eng.generate(_prompts(), SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0), seed=2)
    plan = eng.runner.plan
    assert plan.slots == eng.runner.slots and plan.length == eng.runner.length
    assert plan.slots * (plan.length * 1024 + 32_000 * 4) <= plan.budget_bytes <= int(total * share)
    assert plan.cache_bytes == eng.runner.k_cache.numel() * 2 * 2  # K and V, bf16: what was allocated
    used = torch.cuda.max_memory_allocated() - base
    assert used <= int(total * share), (used, int(total * share))
    eng.close()


def test_lm_head_backward_peak_memory_holds_no_fp32_product_per_chunk() -> None:
    """bf16 head of 32k x 4096: the fp32 gradient accumulator is 512 MiB; a whole fp32 product per
    chunk (the old fallback, since addmm cannot accumulate bf16 products into fp32) would add as
    much again. Backward's peak over what forward left must stay under the accumulator, the bf16
    gradient, a few chunk-sized [256, V] fp32 tensors and two 64 MiB product blocks."""
    from distflow.trainer import head

    vocab, hidden, n, chunk = 32_000, 4096, 1024, 256
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(n, hidden, device="cuda", generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    lp, ent = head.chunked_logprobs(h, w, t, 1.0, chunk_tokens=chunk)
    loss = lp.sum() + 0.01 * ent.sum()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    acc, grad_w, grad_h = vocab * hidden * 4, vocab * hidden * 2, n * hidden * 2
    bound = acc + grad_w + grad_h + 6 * chunk * vocab * 4 + 2 * head.PRODUCT_BLOCK_BYTES + (32 << 20)
    assert peak < bound, (peak, bound)
    assert head._MM_FP32_OUT[0] is True  # the tensor-core path ran


def test_a_serving_rank_frees_its_gpu_copy_once_the_peer_has_it() -> None:
    """The publisher's GPU buckets (a device tier) are freed once the one peer acked the version."""
    import asyncio

    from distflow.transport import Endpoint, make_transport
    from distflow.weights import WeightInbox, WeightPublisher

    async def main() -> None:
        a, b = make_transport("zmq", "trainer", b"s" * 32), make_transport("zmq", "rollout", b"s" * 32)
        await a.start()
        await b.start()
        inbox = WeightInbox()
        b.set_handler(inbox.receive)
        pub = WeightPublisher(a, ["rollout"], lambda _: Endpoint("rollout", "127.0.0.1", b.port), lambda _: True,
                              timeout=30, transport_of=lambda _: "nccl")
        try:
            state = {f"w{i}": torch.full((4 << 20,), float(i), device="cuda") for i in range(4)}  # 64 MiB
            pub.offer(1, state)
            del state
            held = torch.cuda.memory_allocated()
            await pub.flush(30)
            for _ in range(500):
                if pub.stats["dropped_versions"]:
                    break
                await asyncio.sleep(0.02)
            assert pub.stats["dropped_versions"] == 1
            assert torch.cuda.memory_allocated() <= held - (64 << 20)
            got = dict(inbox.take()[1])
            assert all(torch.equal(got[f"w{i}"].cpu(), torch.full((4 << 20,), float(i))) for i in range(4))
        finally:
            await pub.close()
            await a.close()
            await b.close()

    asyncio.run(main())
