"""The built-in torch rollout engine and the trainer-side logprobs agree, token for token.

Real tiny Llama model built from scratch (distflow.toy), real KV-cache generation, real
full forward passes as the reference.
"""

from __future__ import annotations

import json
import os
import math
from pathlib import Path

import pytest
import torch

from distflow.rollout.engine import (
    Completion,
    RolloutEngine,
    SamplingParams,
    TorchEngine,
    filter_top_k_top_p,
    make_engine,
    parse_dtype,
)
from distflow.toy import build_toy_model
from distflow.trainer import logprobs as lpmod
from distflow.trainer.logprobs import gather_response, pad_batch, scatter_response, token_logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # A "sharp" random model (init_std 0.2): varied greedy outputs, so argmax checks bite.
    return build_toy_model(tmp_path_factory.mktemp("toy") / "model", seed=0, init_std=0.2)


@pytest.fixture(scope="module")
def engine(model_dir: str) -> TorchEngine:
    eng = TorchEngine(model_dir)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(engine: TorchEngine) -> list[list[int]]:
    # Deliberately different lengths: 3, 6, 8 and 4 tokens (with <bos>).
    return [engine.tokenizer(s)["input_ids"] for s in ["1=", "3947=", "123456=", "77="]]


def _recompute(model: torch.nn.Module, prompts: list[list[int]], comps: list[Completion], pad: int,
               temperature: float) -> torch.Tensor:
    ids, attn, resp = pad_batch([torch.tensor(p) for p in prompts], [torch.tensor(c.tokens) for c in comps], pad)
    with torch.no_grad():
        return gather_response(token_logprobs(model, ids, attn, temperature), resp)


def _unpadded_next_logits(model: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq])).logits[0, -1].float()


# ---------------------------------------------------------------------- engine vs trainer
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 0.9)])
def test_engine_logprobs_equal_trainer_recompute(engine: TorchEngine, prompts: list[list[int]], top_k: int,
                                                 top_p: float) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=top_k, top_p=top_p)
    comps = engine.generate(prompts, params, seed=123)
    assert len(comps) == 4
    flat = _recompute(engine.model, prompts, comps, engine.pad_token_id, 0.7)
    reported = torch.tensor([x for c in comps for x in c.logprobs])
    assert flat.shape == reported.shape == (sum(len(c.tokens) for c in comps),)
    assert torch.allclose(flat, reported, atol=1e-4, rtol=0)
    # Logprobs are taken before filtering: with filters on they are not renormalised,
    # so they match log_softmax(logits / T) of an unpadded, uncached forward.
    c0 = comps[2]
    direct = torch.log_softmax(_unpadded_next_logits(engine.model, prompts[2]) / 0.7, -1)[c0.tokens[0]]
    assert abs(float(direct) - c0.logprobs[0]) < 1e-4
    assert all(lp <= 0.0 for c in comps for lp in c.logprobs)


def test_greedy_matches_argmax_of_full_forward(engine: TorchEngine, prompts: list[list[int]]) -> None:
    comps = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
    for p, c in zip(prompts, comps):
        seq = list(p)
        for tok, lp in zip(c.tokens, c.logprobs):
            logits = _unpadded_next_logits(engine.model, seq)
            assert tok == int(torch.argmax(logits))
            assert abs(lp - float(torch.log_softmax(logits, -1)[tok])) < 1e-4  # greedy reports T = 1
            seq.append(tok)
        if c.finish_reason == "length":
            assert len(c.tokens) == 10
        else:  # greedy hit <eos>: it is the last token and nothing follows it
            assert c.tokens[-1] == engine.tokenizer.eos_token_id and len(c.tokens) < 10
    assert {c.finish_reason for c in comps} == {"stop", "length"}


def test_batched_generation_equals_one_by_one(engine: TorchEngine, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    batched = engine.generate(prompts, params)
    for p, c in zip(prompts, batched):
        (alone,) = engine.generate([p], params)
        assert alone.tokens == c.tokens and alone.finish_reason == c.finish_reason
        assert max(abs(a - b) for a, b in zip(alone.logprobs, c.logprobs)) < 1e-5


def test_topk1_equals_greedy(engine: TorchEngine, prompts: list[list[int]]) -> None:
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    topk1 = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1), seed=7)
    assert [c.tokens for c in topk1] == [c.tokens for c in greedy]
    for a, b in zip(topk1, greedy):  # at T = 1 both report log_softmax(logits)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_tiny_top_p_is_greedy(engine: TorchEngine, prompts: list[list[int]]) -> None:
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
    nucleus = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1e-6), seed=3)
    assert [c.tokens for c in nucleus] == [c.tokens for c in greedy]


def test_stop_token_ends_sequence(engine: TorchEngine) -> None:
    prompt = engine.tokenizer("77=")["input_ids"]  # greedy runs 10 tokens without <eos> on this model
    (free,) = engine.generate([prompt], SamplingParams(max_new_tokens=10, temperature=0.0))
    assert free.finish_reason == "length" and len(free.tokens) == 10
    stop_tok = free.tokens[3]
    first = free.tokens.index(stop_tok)
    (stopped,) = engine.generate([prompt], SamplingParams(max_new_tokens=10, temperature=0.0,
                                                              stop_token_ids=(stop_tok,)))
    assert stopped.finish_reason == "stop"
    assert stopped.tokens == free.tokens[:first + 1]  # includes the stop token
    assert len(stopped.logprobs) == len(stopped.tokens)


def test_eos_and_max_new_tokens_over_many_samples(engine: TorchEngine, prompts: list[list[int]]) -> None:
    eos = engine.tokenizer.eos_token_id
    assert eos in engine.eos_token_ids
    many = [prompts[i % 4] for i in range(64)]
    comps = engine.generate(many, SamplingParams(max_new_tokens=16, temperature=1.0), seed=11)
    stops = [c for c in comps if c.finish_reason == "stop"]
    lengths = [c for c in comps if c.finish_reason == "length"]
    assert len(stops) + len(lengths) == 64
    assert stops, "a random policy over 17 tokens emits <eos> somewhere in 64 x 16 draws"
    for c in stops:
        assert c.tokens[-1] == eos and eos not in c.tokens[:-1] and 1 <= len(c.tokens) <= 16
    for c in lengths:
        assert len(c.tokens) == 16 and eos not in c.tokens
    for c in comps:
        assert len(c.logprobs) == len(c.tokens)
    # Sequences end at different steps (their slots are refilled); the others are unaffected.
    flat = _recompute(engine.model, many, comps, engine.pad_token_id, 1.0)
    assert torch.allclose(flat, torch.tensor([x for c in comps for x in c.logprobs]), atol=1e-4, rtol=0)


def test_same_seed_same_output_and_batch_split(model_dir: str, engine: TorchEngine,
                                               prompts: list[list[int]]) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    a = engine.generate(prompts, params, seed=5)
    b = engine.generate(prompts, params, seed=5)
    c = engine.generate(prompts, params, seed=6)
    assert a == b
    assert [x.tokens for x in a] != [x.tokens for x in c]
    small = TorchEngine(model_dir, max_batch_size=2)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    five = prompts + [prompts[0]]
    assert [x.tokens for x in small.generate(five, greedy)] == [x.tokens for x in engine.generate(five, greedy)]
    assert small.generate([], greedy) == []
    assert engine.generate(prompts, params, seed=2**64 + 5) == engine.generate(prompts, params, seed=2**64 + 5)


def test_load_weights_changes_outputs_and_version(tmp_path: Path, model_dir: str, prompts: list[list[int]]) -> None:
    eng = TorchEngine(model_dir)
    other_dir = build_toy_model(tmp_path / "other", seed=1, init_std=0.2)
    other = TorchEngine(other_dir)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = eng.generate(prompts, greedy)
    assert eng.version == 0
    sd = {k: v.clone() for k, v in other.model.state_dict().items()}
    eng.load_weights(3, sd)
    assert eng.version == 3
    after = eng.generate(prompts, greedy)
    assert [c.tokens for c in after] == [c.tokens for c in other.generate(prompts, greedy)]
    assert [c.tokens for c in after] != [c.tokens for c in before]
    # Tied embeddings: shipping only one of the tied names is enough.
    sd0 = {k: v for k, v in TorchEngine(model_dir).model.state_dict().items() if k != "lm_head.weight"}
    eng.load_weights(4, sd0)
    assert eng.version == 4 and [c.tokens for c in eng.generate(prompts, greedy)] == [c.tokens for c in before]


def test_load_weights_rejects_bad_state_dict(engine: TorchEngine, prompts: list[list[int]]) -> None:
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    ref = engine.generate(prompts, greedy)
    version = engine.version
    good = {k: v.clone() for k, v in engine.model.state_dict().items()}
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    extra = dict(good, **{"model.bogus.weight": torch.zeros(3)})
    shape = dict(good, **{"model.norm.weight": torch.ones(65)})
    nan = dict(good, **{"model.layers.0.mlp.up_proj.weight": torch.full_like(good["model.layers.0.mlp.up_proj.weight"],
                                                                             float("nan"))})
    with pytest.raises(ValueError, match=r"missing 1 key.*model\.norm\.weight"):
        engine.load_weights(9, missing)
    with pytest.raises(ValueError, match=r"unexpected 1 key.*model\.bogus\.weight"):
        engine.load_weights(9, extra)
    with pytest.raises(ValueError, match=r"shape mismatch: model\.norm\.weight: got \[65\], expected \[64\]"):
        engine.load_weights(9, shape)
    with pytest.raises(ValueError, match=r"non-finite values in: model\.layers\.0\.mlp\.up_proj\.weight"):
        engine.load_weights(9, nan)
    with pytest.raises(ValueError, match="version"):
        engine.load_weights(-1, good)
    assert engine.version == version  # all or nothing: nothing was applied
    assert engine.generate(prompts, greedy) == ref


def test_non_finite_check_finds_one_bad_element_without_a_full_size_mask() -> None:
    """The load check reads each tensor's max and min (a NaN propagates through both; an inf is
    one of them) instead of building an ``isfinite`` mask as large as the tensor (0.5 GB for a
    big embedding on a GPU the KV cache filled): one bad element anywhere is still found."""
    from distflow.rollout.weight_loading import _non_finite

    def with_one(value: float, at: int, dtype=torch.float32) -> torch.Tensor:
        t = torch.randn(4097, dtype=torch.float32).to(dtype)
        t[at] = value
        return t.view(17, 241)

    items = [("ok", torch.randn(64, 8)), ("nan", with_one(float("nan"), 4096)), ("neg_inf", with_one(-math.inf, 0)),
             ("inf_bf16", with_one(math.inf, 2000, torch.bfloat16)), ("empty", torch.zeros(0, 3)),
             ("ints", torch.arange(5)), ("half", torch.randn(9).half())]
    assert _non_finite(items) == ["inf_bf16", "nan", "neg_inf"]


def test_missing_or_invalid_model_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TorchEngine(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        TorchEngine(str(tmp_path / "empty"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(ValueError, match="cannot load"):
        TorchEngine(str(bad))


def test_bad_requests_are_clear_errors(engine: TorchEngine) -> None:
    with pytest.raises(ValueError, match="prompt 1 must be a non-empty"):
        engine.generate([[2, 5], []], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt 0 has token 99, outside the vocabulary \[0, 17\)"):
        engine.generate([[2, 99]], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([[2, 5]], SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[2, 5]], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[2, 5]], SamplingParams(max_new_tokens=0))
    with pytest.raises(ValueError, match="max_position_embeddings 64"):
        engine.generate([[2] * 60], SamplingParams(max_new_tokens=8))
    assert engine.generate([[2, 5]], SamplingParams(max_new_tokens=2), seed=1)[0].finish_reason in ("stop", "length")


def test_vllm_gets_the_nodes_gpu_share_and_not_the_torch_only_keywords(model_dir: str, monkeypatch) -> None:
    """vLLM cannot run here: the class is replaced by a recorder of what make_engine passes it."""
    from distflow.rollout import engine as engine_mod

    seen: list[dict] = []
    monkeypatch.setattr(engine_mod, "VLLMEngine", lambda path, **kw: seen.append(kw))
    make_engine("vllm", model_dir, device="cuda", dtype="bfloat16", compile=True, max_slots=64, max_length=640,
                gpu_memory_utilization=0.9, trainer_memory_fraction=0.5, engines=2)
    make_engine("vllm", model_dir, device="cuda")
    assert seen == [{"device": "cuda", "dtype": "bfloat16", "gpu_memory_utilization": pytest.approx(0.2)},
                    {"device": "cuda"}]


def test_vllm_on_a_bare_cuda_device_is_the_nodes_gpu(model_dir: str, monkeypatch) -> None:
    """The rollout worker passes the config's bare "cuda": with DISTFLOW_LOCAL_GPU naming another
    visible GPU (--in-process with gpus: [3, 1]), vLLM's workers would still start on the first one,
    a GPU the launcher never gave this node. Refused before vLLM is imported (so also here)."""
    monkeypatch.setenv("DISTFLOW_LOCAL_GPU", "3")
    with pytest.raises(ValueError, match="first visible GPU, but this node's is cuda:3"):
        make_engine("vllm", model_dir, device="cuda")
    monkeypatch.setenv("DISTFLOW_LOCAL_GPU", "x")
    with pytest.raises(ValueError, match="DISTFLOW_LOCAL_GPU must be a non-negative GPU index, got 'x'"):
        make_engine("vllm", model_dir, device="cuda")
    monkeypatch.setenv("DISTFLOW_LOCAL_GPU", "0")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="vLLM"):  # past the check: cuda:0 is the first visible GPU
            make_engine("vllm", model_dir, device="cuda")


def test_vllm_weight_loader_is_allowed_to_reach_the_engine_process(model_dir: str, monkeypatch) -> None:
    """vLLM pins its own torch and cannot be installed here, so a stand-in ``vllm`` module records
    what the adapter does. vLLM's V1 engine process refuses a function sent by ``collective_rpc``
    unless VLLM_ALLOW_INSECURE_SERIALIZATION=1 is in its environment when ``LLM`` starts it: the
    first weight sync failed without it. A user's own setting is kept."""
    import sys
    import types

    from distflow.rollout import vllm_engine

    seen: dict = {"rpc": []}

    class LLM:
        def __init__(self, model: str, **kw):
            seen["env_at_start"] = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
            seen["kw"] = kw
            self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=96))

        def get_tokenizer(self):
            return None

        def collective_rpc(self, fn, args=()):
            seen["rpc"].append((fn, args))

        def reset_prefix_cache(self):
            seen["reset"] = True

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "")  # recorded, so the engine's setting is undone
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION")
    monkeypatch.delenv("DISTFLOW_LOCAL_GPU", raising=False)
    eng = vllm_engine.VLLMEngine(model_dir, device="cuda")
    assert seen["env_at_start"] == "1" and eng.max_positions == 96
    assert seen["kw"]["logprobs_mode"] == "processed_logprobs"
    w = {"lm_head.weight": torch.ones(2, 3), "model.norm.weight": torch.zeros(3)}
    eng.load_weights(4, iter([w, {"model.embed_tokens.weight": torch.ones(5, 3)}]))
    assert [fn for fn, _ in seen["rpc"]] == [vllm_engine._vllm_load_weights] * 2
    names = [[n for n, _ in args[0]] for _, args in seen["rpc"]]
    assert names == [["lm_head.weight", "model.norm.weight"], ["model.embed_tokens.weight"]]
    assert seen["reset"] and eng.version == 4
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")  # the user's choice stands
    vllm_engine.VLLMEngine(model_dir, device="cuda")
    assert seen["env_at_start"] == "0"


def test_make_engine_and_protocol(model_dir: str) -> None:
    eng = make_engine("torch", model_dir, dtype="float32")
    assert isinstance(eng, RolloutEngine) and isinstance(eng, TorchEngine)
    with pytest.raises(ValueError, match=r"unknown rollout engine 'sglang'.*\['torch', 'vllm'\]"):
        make_engine("sglang", model_dir)
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="vLLM"):
            make_engine("vllm", model_dir)
    # checked before vLLM is imported: its worker processes take the first visible GPU
    with pytest.raises(ValueError, match="first visible GPU, but this node's is cuda:1"):
        make_engine("vllm", model_dir, device="cuda:1")
    with pytest.raises(ValueError, match="CUDA devices only"):
        make_engine("vllm", model_dir, device="cpu")
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("float8")
    eng.close()
    with pytest.raises(RuntimeError, match="after close"):
        eng.generate([[2, 5]], SamplingParams())


def test_bfloat16_engine_runs(model_dir: str, prompts: list[list[int]]) -> None:
    eng = TorchEngine(model_dir, dtype="bfloat16")
    comps = eng.generate(prompts, SamplingParams(max_new_tokens=4), seed=0)
    assert all(isinstance(x, float) and math.isfinite(x) for c in comps for x in c.logprobs)


# ---------------------------------------------------------------------- sampling filters
def test_filter_top_k_top_p_hand_computed() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    ninf = float("-inf")
    k3 = filter_top_k_top_p(logits, 3, 1.0)
    assert torch.equal(torch.isinf(k3), torch.tensor([[False, False, False, True], [True, False, False, False]]))
    p = filter_top_k_top_p(logits, 0, 0.75)  # 0.5 < 0.75 -> keep the 0.3 token; 0.8 >= 0.75 -> drop the rest
    assert torch.equal(torch.isinf(p), torch.tensor([[False, False, True, True], [True, True, False, False]]))
    assert p[0, 2] == ninf and torch.isclose(p[0, 0], logits[0, 0])
    one = filter_top_k_top_p(logits, 0, 0.1)  # the top token always survives
    assert torch.isinf(one).sum(-1).tolist() == [3, 3]
    assert torch.equal(filter_top_k_top_p(logits, 0, 1.0), logits)


# ---------------------------------------------------------------------- trainer-side helpers
def test_pad_batch_hand_computed() -> None:
    ids, attn, resp = pad_batch([torch.tensor([5, 6]), torch.tensor([7])],
                                [torch.tensor([8, 9, 10]), torch.tensor([], dtype=torch.int64)], pad_id=0)
    assert ids.tolist() == [[5, 6, 8, 9, 10], [7, 0, 0, 0, 0]]
    assert attn.tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert resp.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]]
    assert ids.dtype == torch.int64
    with pytest.raises(ValueError, match="empty prompt"):
        pad_batch([torch.tensor([], dtype=torch.int64)], [torch.tensor([1])], 0)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        pad_batch([torch.tensor([1]), torch.tensor([2])], [torch.tensor([1])], 0)


def test_gather_scatter_round_trip() -> None:
    values = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    flat = gather_response(values, mask)
    assert flat.tolist() == [2.0, 3.0, 4.0, 6.0, 7.0]
    back = scatter_response(flat, mask)
    assert back.tolist() == [[0, 0, 2, 3, 4], [0, 6, 7, 0, 0]]
    with pytest.raises(ValueError, match="expected 5 flat values"):
        scatter_response(torch.zeros(4), mask)
    g = torch.ones(5, requires_grad=True)
    scatter_response(g, mask).sum().backward()
    assert g.grad.tolist() == [1.0] * 5


def test_token_logprobs_conventions(engine: TorchEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    model = engine.model
    seqs = [[2, 5, 6, 7, 13], [2, 9, 13]]
    ids, attn, _ = pad_batch([torch.tensor(s) for s in seqs], [torch.tensor([], dtype=torch.int64)] * 2, 0)
    with torch.no_grad():
        lp = token_logprobs(model, ids, attn, temperature=2.0)
        # Hand check against an unpadded forward of sequence 1 alone.
        logits = model(input_ids=torch.tensor([seqs[1]])).logits[0].float()
        manual = [0.0] + [float(torch.log_softmax(logits[t - 1] / 2.0, -1)[seqs[1][t]]) for t in (1, 2)]
        assert lp[1, :3].tolist() == pytest.approx(manual, abs=1e-5)
        assert lp[1, 3:].tolist() == [0.0, 0.0] and lp[0, 0] == 0.0
        # Left padding gives the same values (position ids come from the mask).
        left_ids = torch.tensor([[0, 0, 2, 9, 13]])
        left = token_logprobs(model, left_ids, torch.tensor([[0, 0, 1, 1, 1]]), temperature=2.0)
        assert left[0, 2:].tolist() == pytest.approx(manual, abs=1e-5)
        # Greedy (T = 0) is reported at T = 1.
        assert torch.equal(token_logprobs(model, ids, attn, 0.0), token_logprobs(model, ids, attn, 1.0))
        # Chunked fp32 materialisation gives identical numbers.
        monkeypatch.setattr(lpmod, "_CHUNK_BYTES", 1)
        assert torch.allclose(token_logprobs(model, ids, attn, 2.0), lp, atol=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, attn, -1.0)


def test_token_logprobs_is_differentiable(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    ids, attn, resp = pad_batch([torch.tensor([2, 5, 11])], [torch.tensor([6, 1])], 0)
    lp = token_logprobs(model, ids, attn, 0.7)
    assert lp.dtype == torch.float32 and lp.requires_grad
    (-(gather_response(lp, resp)).sum()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and sum(float(g.abs().sum()) for g in grads) > 0


def test_vllm_request_seeds_of_consecutive_steps_do_not_overlap() -> None:
    """Step seeds are consecutive integers: vLLM's per-request seeds must not be base + i, which
    would give request i of step s+1 the random stream of request i+1 of step s."""
    from distflow.rollout.vllm_engine import request_seed

    step0 = [request_seed(1000, i) for i in range(256)]
    step1 = [request_seed(1001, i) for i in range(256)]
    assert len(set(step0)) == 256 and not set(step0) & set(step1)
    assert all(0 <= s < 2 ** 31 for s in step0 + step1) and request_seed(1000, 3) == step0[3]  # deterministic


def test_hf_loop_reads_stop_flags_every_sync_every_steps(model_dir: str, prompts: list[list[int]],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The HF generate loop (architectures the static-cache runner does not drive) reads the stop flags
    back to the host only every ``sync_every`` steps (8 on a GPU; a read waits for the GPU to drain),
    not once per token; finished rows meanwhile emit pads, so the completions are the same. Reads are
    counted as ``bool(tensor)`` calls made by torch_engine.py (generate runs in inference mode, which a
    dispatch mode does not see)."""
    import traceback

    eng = TorchEngine(model_dir)
    try:
        eng.runner = None  # the HF loop, as for an unsupported architecture
        every_step = eng.generate(prompts * 2, SamplingParams(max_new_tokens=24, temperature=1.0), seed=5)
        reads = {"n": 0}
        plain_bool = torch.Tensor.__bool__

        def counting_bool(t: torch.Tensor) -> bool:
            if traceback.extract_stack(limit=2)[0].filename.endswith("torch_engine.py"):
                reads["n"] += 1
            return plain_bool(t)

        monkeypatch.setattr(torch.Tensor, "__bool__", counting_bool)
        eng.sync_every = 8
        counts = {}
        for n in (8, 24):
            reads["n"] = 0
            out = eng.generate(prompts * 2, SamplingParams(max_new_tokens=n, temperature=1.0), seed=5)
            counts[n] = reads["n"]
        assert [(c.tokens, c.finish_reason) for c in out] == [(c.tokens, c.finish_reason) for c in every_step]
        assert [c.logprobs for c in out] == [c.logprobs for c in every_step]
        assert counts[24] - counts[8] <= 2, counts  # one read per 8 steps; it was one per step (16 more)
    finally:
        eng.close()


def test_hf_loop_passes_the_kv_cache_by_the_models_own_keyword(model_dir: str, prompts: list[list[int]]) -> None:
    """transformers 5.24 renamed forward's ``past_key_values`` to ``cache`` (the old name warns, and goes in
    5.40): the HF loop passes the cache by whichever keyword the model's forward has, with the same tokens."""
    import inspect
    import warnings

    from distflow.rollout.torch_engine import cache_keyword

    eng = TorchEngine(model_dir)
    try:
        eng.runner = None  # the HF loop
        params = SamplingParams(max_new_tokens=6, temperature=1.0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # a deprecated keyword fails the test
            out = eng.generate(prompts, params, seed=3)
        has_cache = "cache" in inspect.signature(eng.model.forward).parameters
        assert cache_keyword(eng.model) == ("cache" if has_cache else "past_key_values")
        assert cache_keyword(type("Old", (), {"forward": lambda self, past_key_values=None: None})()) == "past_key_values"
        assert [c.tokens for c in out] == [c.tokens for c in eng.generate(prompts, params, seed=3)]  # seeded
        assert all(len(c.tokens) >= 1 for c in out)
    finally:
        eng.close()
