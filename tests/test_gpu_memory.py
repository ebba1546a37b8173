"""The GPU memory budget on CPU: the engine's KV-cache plan with hand-computed numbers, the
cache sized once, and every attention fallback logged once (docs/gpu.md)."""

from __future__ import annotations

import logging

import pytest
import torch

from distflow.rollout.memory_plan import (cache_length, engine_share, kv_token_bytes, plan_kv_cache,
                                          prefill_reserve_bytes)

GIB = 1 << 30


def test_kv_token_bytes_of_a_3b_model():
    # Qwen2.5-3B in bf16: 36 layers, 2 KV heads of 128 -> K and V of every layer per position
    assert kv_token_bytes(36, 2, 128, 2) == 2 * 36 * 2 * 128 * 2 == 36_864


def test_the_plan_starts_from_total_memory_after_the_trainers_budget():
    """80 GiB GPU, utilization 0.9 -> 72 GiB; the colocated trainer's 0.5 (40 GiB) first -> 32 GiB;
    one engine: less 6 GiB of weights and 1 GiB of prefill reserve -> 25 GiB for the cache.
    A slot of 4096 positions of the 3B model: 4096 * 36,864 = 150,994,944 bytes, plus the graphs'
    fp32 logits row of a 151,936-token vocabulary (607,744 bytes) = 151,602,688 bytes.
    25 GiB = 26,843,545,600 bytes // 151,602,688 = 177 slots (177.06)."""
    total = 80 * GIB
    plan = plan_kv_cache(total, 6 * GIB, int(total * 0.5), 0.9, 36_864, want_slots=256, length=4096,
                         slot_extra_bytes=151_936 * 4, reserve_bytes=GIB)
    assert plan.budget_bytes == 26_843_545_600
    assert plan.slots == 177 and plan.capped and plan.length == 4096
    assert plan.cache_bytes == 177 * 150_994_944
    # the same GPU alone (no trainer): 72 - 7 = 65 GiB = 69,793,218,560 // 151,602,688 = 460 -> all 256
    alone = plan_kv_cache(total, 6 * GIB, 0, 0.9, 36_864, want_slots=256, length=4096,
                          slot_extra_bytes=151_936 * 4, reserve_bytes=GIB)
    assert alone.slots == 256 and not alone.capped
    # two engines beside the trainer: (72 - 40) / 2 = 16 GiB each, less 7 -> 9 GiB = 9,663,676,416 // 151,602,688 = 63
    two = plan_kv_cache(total, 6 * GIB, int(total * 0.5), 0.9, 36_864, want_slots=256, length=4096, engines=2,
                        slot_extra_bytes=151_936 * 4, reserve_bytes=GIB)
    assert two.slots == 63


def test_a_plan_without_one_slot_names_the_keys():
    with pytest.raises(RuntimeError, match=r"one slot of 4096 positions.*engine_gpu_memory_utilization.*"
                                           r"engine_trainer_memory_fraction.*max_new_tokens"):
        plan_kv_cache(16 * GIB, 7 * GIB, 8 * GIB, 0.9, 36_864, want_slots=8, length=4096)  # 14.4 - 8 - 7 < 0


def test_engine_share_and_the_cache_length_rule():
    assert engine_share(None, 0.5, 1, False) == (0.9, 0.0, 1)  # the engine has its GPU alone
    assert engine_share(None, 0.5, 2, True) == (0.9, 0.5, 1)  # the trainer rank and one engine
    assert engine_share(0.8, 0.3, 4, True) == (0.8, 0.3, 3)
    with pytest.raises(ValueError, match="must be below"):
        engine_share(0.5, 0.5, 2, True)
    # the run's bound (fixed from the first call), else the call's need (never below it)
    assert cache_length(640, 100) == 640
    assert cache_length(None, 100) == 100
    assert cache_length(64, 100) == 100


def test_without_a_prompt_bound_the_plan_sizes_the_length_once_from_the_budget():
    """max_prompt_length unset: the first call needs 1000 positions, but the slots are given the
    length the budget holds for them (multiples of 128, at most the model's positions), so later,
    longer calls never regrow the cache. 8 slots of a 36,864-byte position in 10 GiB:
    10,737,418,240 // 8 = 1,342,177,280 bytes a slot // 36,864 = 36,408 positions -> 36,352
    (a multiple of 128), above the model's 32,768: 32,768."""
    gib10 = 10 * GIB
    plan = plan_kv_cache(gib10, 0, 0, 1.0, 36_864, want_slots=8, length=1000, grow_to=32_768)
    assert (plan.slots, plan.length) == (8, 32_768) and plan.cache_bytes == 8 * 32_768 * 36_864
    # 64 slots: 167,772,160 bytes a slot // 36,864 = 4551 positions -> 4480
    plan = plan_kv_cache(gib10, 0, 0, 1.0, 36_864, want_slots=64, length=1000, grow_to=32_768)
    assert (plan.slots, plan.length) == (64, 4480) and plan.cache_bytes <= plan.budget_bytes
    # a run bound (no grow_to): the asked length, whatever room is left
    assert plan_kv_cache(gib10, 0, 0, 1.0, 36_864, want_slots=64, length=1000).length == 1000


def test_prefill_reserve_by_hand():
    # 8192 tokens x (5 x 2048 + 3 x 11008) x 2 bytes + 4 rows of fp32 logits of 151,936
    assert prefill_reserve_bytes(8192, 2048, 11_008, 151_936, 2, slots=4) == \
        8192 * (5 * 2048 + 3 * 11_008) * 2 + 4 * 151_936 * 4


def test_engine_attention_fallback_is_logged_once(caplog):
    """An fp32 GQA prefill repeats the KV heads (no fused kernel takes grouped fp32 keys): said
    once per process, whatever the number of layers and calls."""
    from distflow.core import once
    from distflow.rollout.llama_forward import LlamaRunner
    from transformers import LlamaConfig, LlamaForCausalLM

    once._SEEN.pop("engine-gqa-repeat", None)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    runner = LlamaRunner(LlamaForCausalLM(cfg).eval(), use_graphs=False)
    runner.reserve(2, 32)
    with caplog.at_level(logging.INFO, logger="distflow.rollout.llama_forward"):
        for _ in range(2):
            runner.prefill([0, 1], [[1, 2, 3], [4, 5]])
    said = [r for r in caplog.records if "repeated" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO  # INFO on CPU, WARNING on CUDA
    assert once.fallbacks()["engine-gqa-repeat"] == 2 * 3  # every layer of both calls counted


def test_trainer_per_sample_attention_is_logged_once(caplog):
    from distflow.core import once
    from distflow.trainer.attention import varlen_attention

    for key in [k for k in once._SEEN if k.startswith("trainer-per-sample-sdpa")]:
        once._SEEN.pop(key)
    q, k = torch.randn(1, 4, 7, 8), torch.randn(1, 2, 7, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with caplog.at_level(logging.INFO, logger="distflow.trainer.attention"):
        for _ in range(3):
            out, _ = varlen_attention(None, q, k, k, None, cu_seq_lens_q=cu, distflow_seq_lens=[3, 4])
    assert out.shape == (1, 7, 4, 8)
    said = [r.getMessage() for r in caplog.records if "one SDPA call per sample" in r.getMessage()]
    assert said == ["trainer attention: packed rows attend one SDPA call per sample (not on CUDA), slower than one "
                    "varlen FlashAttention call"]


def test_spilled_buckets_live_in_reused_pool_buffers(monkeypatch):
    """NCCL buckets that must leave a GPU short of memory go into the inbox's page-locked pool
    (tiers.to_host; pageable memory would make the engine's load a synchronous bounce-buffer copy
    and torch caches freed pinned blocks for good): the buffers of a version go back to the pool
    once the engine has loaded it (at the next take_update) and the next spill reuses them, so
    steady state allocates nothing. No GPU here: which buckets spill is forced, the staging is the
    real pool's."""
    import asyncio

    from distflow.transport import Envelope
    from distflow.weights import inbox as weights_mod

    monkeypatch.setattr(weights_mod, "spill_needed", lambda bucket, reserve: True)
    monkeypatch.setattr(weights_mod, "to_host", lambda bucket, pool: pool.stage(bucket))

    async def main() -> list[int]:
        inbox = weights_mod.WeightInbox()
        ptrs = []
        for v in (1, 2, 3):
            w = torch.full((256,), float(v))
            await inbox.receive(Envelope("t", "weights", {"version": v, "bucket": 0, "base": None}, {"w": w}))
            await inbox.receive(Envelope("t", "weights", {"version": v, "base": None, "commit": True,
                                                          "num_buckets": 1}, {}))
            upd = inbox.take_update()
            held = upd.buckets[0]["w"]
            assert torch.equal(held, w) and held.data_ptr() != w.data_ptr()  # a copy, in a pool buffer
            ptrs.append(held.untyped_storage().data_ptr())
        assert inbox.spilled_bytes == 3 * 256 * 4
        return ptrs

    p1, p2, p3 = asyncio.run(main())
    assert p1 != p2 and p3 == p1  # v1's buffer went back when v2 was taken (v1 loaded): v3 reuses it


def test_a_serving_rank_drops_its_published_copy_once_every_peer_has_it():
    """Through the real publisher and inbox over real zmq channels: with a device tier (here
    ``nccl``, whose buckets the publisher keeps as they were gathered) the published copy is held
    until the one peer acked the version, then dropped (the gathered tensors are freed: weak
    references die) for a host copy in the pool, and a peer that comes back is still served the
    whole version, equal values, from that copy."""
    import asyncio
    import gc
    import weakref

    from distflow.transport import Endpoint, make_transport
    from distflow.weights import WeightInbox, WeightPublisher

    async def main() -> None:
        a, b = make_transport("zmq", "trainer", b"s" * 32), make_transport("zmq", "rollout", b"s" * 32)
        await a.start()
        await b.start()
        inbox = WeightInbox()
        b.set_handler(lambda env: inbox.receive(env))
        pub = WeightPublisher(a, ["rollout"], lambda _: Endpoint("rollout", "127.0.0.1", b.port), lambda _: True,
                              timeout=10, transport_of=lambda _: "nccl", bucket_bytes=1024)
        try:
            state = {f"w{i}": torch.full((100,), float(i)) for i in range(4)}  # 400 bytes each: 4 buckets of 2
            refs = [weakref.ref(t) for t in state.values()]
            want = {k: t.clone() for k, t in state.items()}
            pub.offer(1, state)
            del state
            await pub.flush(10)
            for _ in range(100):  # the drop runs in its own task once the commit was acked
                if pub.stats["dropped_versions"]:
                    break
                await asyncio.sleep(0.02)
            assert pub.stats["dropped_versions"] == 1 and pub.stats["dropped_bytes"] == 4 * 400
            gc.collect()
            assert all(r() is None for r in refs)  # the gathered copy is gone
            got = dict(inbox.take()[1])
            assert all(torch.equal(got[k], want[k]) for k in want)
            inbox = WeightInbox()  # the peer restarted (a new inbox holds nothing) ...
            pub.peer_up("rollout")  # ... and is served again, in full, from the host copy
            for _ in range(250):
                if inbox.pending is not None:
                    break
                await asyncio.sleep(0.02)
            again = dict(inbox.take()[1])
            assert sorted(again) == sorted(want) and all(torch.equal(again[k], want[k]) for k in want)
            assert pub.stats["full_versions"] == 2
        finally:
            await pub.close()
            await a.close()
            await b.close()

    asyncio.run(main())


def test_bench_engine_refuses_figures_of_eager_decoding_when_graphs_were_asked_for(tmp_path):
    """bench/engine.py's check, on a real engine whose captures fail (graphs forced on a CPU
    runner: ``torch.cuda.device(cpu)`` raises inside the real capture): the decode steps ran
    eagerly, so the benchmark must not pass them off as the graph engine's figures."""
    import importlib.util
    from pathlib import Path

    from distflow.rollout.engine import SamplingParams, TorchEngine
    from distflow.toy import build_toy_model

    spec = importlib.util.spec_from_file_location("bench_engine", Path(__file__).parent.parent / "bench" / "engine.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    eng = TorchEngine(build_toy_model(tmp_path / "m", seed=0, init_std=0.2), max_slots=2)
    assert bench.graphs_problem(eng, requested=False) is None
    assert bench.graphs_problem(eng, requested=True) == "CUDA graphs were requested but none was captured"
    eng.runner.use_graphs = True
    eng.generate([[3, 4, 5]], SamplingParams(max_new_tokens=3), seed=0)
    problem = bench.graphs_problem(eng, requested=True)
    assert problem.startswith("CUDA graphs were requested but 2 decode steps ran eagerly (2 failed captures")
    eng.runner = None
    assert "HF fallback loop" in bench.graphs_problem(eng, requested=True)


def test_the_runner_plans_its_cuda_cache_from_total_memory(monkeypatch, caplog):
    """LlamaRunner._planned_slots (the CUDA branch of reserve) on a CPU runner, with the device's
    (free, total) given: the plan's inputs are the runner's own (its weights' bytes, the trainer's
    share of the total, the prefill reserve), and what is free now only caps it, logged."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from distflow.rollout import llama_forward
    from distflow.rollout.llama_forward import LlamaRunner, module_bytes

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).eval()
    runner = LlamaRunner(model, use_graphs=False, max_prefill_tokens=256, gpu_memory_utilization=0.9,
                         trainer_memory_fraction=0.5)
    runner.use_graphs = True  # a logits row per slot, as on CUDA
    assert runner.model_bytes == module_bytes(model) == sum(p.numel() * 4 for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())
    total = 1 << 30
    monkeypatch.setattr(llama_forward, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total, total))
    token = 2 * 2 * 2 * 8 * 4  # K and V x 2 layers x 2 KV heads x head_dim 8 x fp32
    reserve = prefill_reserve_bytes(256, 32, 64, 64, 4, 256)
    want = plan_kv_cache(total, runner.model_bytes, int(total * 0.5), 0.9, token, want_slots=10_000, length=1024,
                         slot_extra_bytes=64 * 4, reserve_bytes=reserve)
    assert runner._planned_slots(10_000, 1024, None) == (want.slots, 1024) and want.capped
    assert runner.plan == want
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (reserve + 3 * (1024 * token + 256), total))
    with caplog.at_level(logging.WARNING, logger="distflow.rollout.llama_forward"):
        assert runner._planned_slots(10_000, 1024, None) == (3, 1024)  # only 3 fit in what is free now
    assert any("uses more than its share" in r.getMessage() for r in caplog.records)


def test_a_capture_that_fails_once_is_retried_after_freeing_the_graphs(tmp_path, monkeypatch, caplog):
    """The first capture runs out of memory; the runner drops the graphs it holds (and their pool),
    retries, and the retry's graph serves every step: one failure counted, no eager step. The
    recorded "graph" replays the eager step into the logits buffer (no GPU here)."""
    import types

    from distflow.rollout.engine import SamplingParams, TorchEngine
    from distflow.rollout.llama_forward import LlamaRunner
    from distflow.toy import build_toy_model

    class Replay:
        def __init__(self, runner, b, length):
            self.runner, self.b, self.length = runner, b, length

        def replay(self):
            self.runner.logits_out[:self.b].copy_(self.runner._decode(self.b, self.length))

    calls: list[tuple[int, int]] = []

    def record(self, b, length):
        calls.append((b, length))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (graph pool)")
        self.graphs[(b, length)] = Replay(self, b, length)

    monkeypatch.setattr(LlamaRunner, "_record", record)
    model = build_toy_model(tmp_path / "m", seed=0, init_std=0.2)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    ref = TorchEngine(model, max_slots=2).generate([[3, 4, 5], [6, 7]], params, seed=4)
    eng = TorchEngine(model, max_slots=2)
    eng.runner.use_graphs = True
    stream = types.SimpleNamespace(synchronize=lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    freed = []
    real_free = LlamaRunner.free_graphs
    monkeypatch.setattr(LlamaRunner, "free_graphs", lambda self: (freed.append(dict(self.graphs)), real_free(self)))
    with caplog.at_level(logging.WARNING, logger="distflow.rollout.llama_forward"):
        out = eng.generate([[3, 4, 5], [6, 7]], params, seed=4)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    assert eng.stats["graph_capture_failures"] == 1 and eng.stats["graph_eager_steps"] == 0
    assert calls[0] == calls[1] and len(freed) == 1 and eng.runner._pool is None
    assert [r.getMessage() for r in caplog.records if "CUDA graph" in r.getMessage()][0].endswith("retrying")
