"""Tensor-parallel generation in the built-in engine (rollout_tensor_parallel; distflow/rollout/tp_engine.py).

Real processes: a TP=2 engine spawns one follower process, the two ranks form a real gloo group,
and the row-parallel all-reduces run over it. Compared with a TP=1 engine on the same checkpoint:
the toy Llama model (4 heads = 4 KV heads, tied embeddings) and a tiny Qwen2 (GQA: 4 query heads,
2 KV heads, qkv biases, untied head), built here.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from distflow.rollout.protocol import SamplingParams
from distflow.rollout.torch_engine import TorchEngine
from distflow.rollout.llama_forward import module_bytes
from distflow.rollout.tp_shard import RANK0_ONLY, kind_of, shard_of

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [1, 2, 3], [8], [9, 10, 11, 12, 13], [4, 5, 6, 7]]
PARAMS = SamplingParams(max_new_tokens=10, temperature=1.0)


@pytest.fixture(scope="module")
def qwen2_model(tmp_path_factory):
    """A tiny Qwen2 with grouped-query attention over the toy tokenizer, sharp enough (init 0.3)
    that sampling is not a coin toss between near-equal tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from distflow.toy import build_toy_tokenizer

    out = tmp_path_factory.mktemp("qwen2") / "model"
    tok = build_toy_tokenizer(out)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.3, tie_word_embeddings=False, use_sliding_window=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        Qwen2ForCausalLM(cfg).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def pairs(toy_model, qwen2_model):
    """(TP=1, TP=2) engines of each model; the TP=2 ones are closed at the end (their followers exit).
    One intra-op thread, as a node runs (``torch_threads``; the followers take rank 0's count): two
    processes each spinning OpenMP threads on 2 cores make every collective wait for a time slice."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    paths = {"toy": toy_model, "qwen2": qwen2_model}
    with ThreadPoolExecutor(2) as pool:  # the two followers start (import torch, load) side by side
        tp2 = {name: pool.submit(TorchEngine, str(path), max_slots=4, tensor_parallel=2)
               for name, path in paths.items()}
        made = {name: (TorchEngine(str(path), max_slots=4), tp2[name].result()) for name, path in paths.items()}
    yield made
    for one, two in made.values():
        one.close()
        two.close()
    torch.set_num_threads(threads)


def _agree(one: TorchEngine, two: TorchEngine, seed: int) -> None:
    a, b = one.generate(PROMPTS, PARAMS, seed=seed), two.generate(PROMPTS, PARAMS, seed=seed)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert sum(len(c.tokens) for c in a) > len(PROMPTS)  # real generations, not all stopped at once
    for x, y in zip(a, b):
        assert x.finish_reason == y.finish_reason
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


@pytest.mark.cluster  # the TP=2 engines' follower processes (multiprocessing: no Popen)
@pytest.mark.parametrize("name", ["toy", "qwen2"])
def test_tp2_matches_tp1(pairs, name):
    """The same seeds give the same tokens, logprobs within 1e-5 (fp32); each rank holds half of
    the split layers, and its KV cache half of the KV heads."""
    one, two = pairs[name]
    _agree(one, two, seed=5)
    cfg = one.model.config
    full_q = one.model.model.layers[0].self_attn.q_proj.weight
    mine = two.model.model.layers[0].self_attn.q_proj.weight
    assert mine.shape[0] * 2 == full_q.shape[0] and torch.equal(mine, full_q[:full_q.shape[0] // 2])
    assert two.runner.k_cache.shape[2] * 2 == one.runner.k_cache.shape[2] == cfg.num_key_value_heads
    with pytest.raises(NotImplementedError, match="LlamaRunner._decode is not driven"):
        two.runner._decode(1, 1)  # a runner call rank 0 would make alone: refused, never a hang
    assert two.tp.ready[0] < 0.8 * sum(t.numel() * t.element_size() for t in one.model.state_dict().values())
    # the follower's bytes: rank 0's shard less an untied LM head (qwen2), which only rank 0 holds
    head = two.model.lm_head.weight
    assert two.tp.head == (name == "qwen2")
    assert two.tp.ready[0] == module_bytes(two.model) - (head.numel() * head.element_size() if two.tp.head else 0)


@pytest.mark.cluster  # the TP=2 engines' follower processes (multiprocessing: no Popen)
def test_weight_update_sends_each_follower_only_its_shard(pairs):
    """A new version (full tensors, as the trainer publishes them) reaches rank 0; the follower
    receives exactly its slices of the split tensors plus the replicated ones (bytes counted on the
    follower); both engines still agree, also after a delta of one tensor and after a swap in the
    middle of a generate call (partial rollout: the in-flight sequences re-prefilled on every rank)."""
    one, two = pairs["qwen2"]
    g = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in one.model.state_dict().items()}
    before = two.tp.ask("stats")[0]["weight_bytes_received"]
    one.load_weights(1, new)
    two.load_weights(1, new)
    got = two.tp.ask("stats")[0]["weight_bytes_received"] - before
    shard = sum(shard_of(k, v, 1, 2, head=True).numel() * v.element_size() for k, v in new.items()
                if kind_of(k, v, head=True) not in RANK0_ONLY)  # qwen2's head is untied: rank 0's alone
    full = sum(v.numel() * v.element_size() for v in new.values())
    assert got == shard < full
    assert two.version == 1
    _agree(one, two, seed=6)
    delta = {"model.layers.1.mlp.down_proj.weight": new["model.layers.1.mlp.down_proj.weight"] * 1.5}
    one.load_weights(2, delta, partial=True)
    two.load_weights(2, delta, partial=True)
    _agree(one, two, seed=7)
    # mid-generate (partial rollout): new weights at the 3rd poll; the in-flight sequences are re-prefilled
    mid = {k: v * 0.9 for k, v in new.items()}
    runs = []
    for eng in (one, two):
        polls = []
        update = lambda p=polls: (p.append(1), (4, mid) if len(p) == 3 else None)[1]  # noqa: E731
        runs.append(eng.generate(PROMPTS, PARAMS, seed=8, weights_update=update))
        assert eng.version == 4 and eng.stats["weight_swaps"] >= 1
    assert [c.tokens for c in runs[0]] == [c.tokens for c in runs[1]]
    versions = [c.last_version for c in runs[1]]
    assert versions == [c.last_version for c in runs[0]] and 4 in versions
    for x, y in zip(*runs):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="shape mismatch"):  # validated against the FULL shapes, on rank 0
        two.load_weights(3, {"model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 64)}, partial=True)


@pytest.mark.cluster  # the TP=2 engines' follower processes (multiprocessing: no Popen)
def test_continuous_engine_reuses_kv_on_every_rank(pairs):
    """The request-level engine (episodes): a second turn extends the first turn's stored KV, which
    each rank keeps for its own heads (rank 0's copy carries the handle); same tokens and
    logprobs as TP=1, and the followers drop their copies when rank 0's are collected."""
    import asyncio
    import gc

    async def episode(engine: TorchEngine) -> tuple[list, dict]:
        async with engine.continuous(seed=2, max_length=64) as cont:
            first = await cont.submit([1, 2, 3, 4], PARAMS, key="t0", session="ep", turn=0)
            second = await cont.submit([1, 2, 3, 4, *first.tokens, 5, 6], PARAMS, key="t1", session="ep", turn=1)
            return [first, second], dict(cont.stats)

    one, two = pairs["qwen2"]
    (a, sa), (b, sb) = asyncio.run(episode(one)), asyncio.run(episode(two))
    assert sa["kv_hits"] == sb["kv_hits"] == 1 and sb["kv_reused_tokens"] > 4
    assert [c.tokens for c in a] == [c.tokens for c in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
    gc.collect()
    assert two.tp.ask("stats")[0]["saved_prefixes"] == 0


@pytest.mark.cluster  # the TP=2 engines' follower processes (multiprocessing: no Popen)
def test_a_failing_follower_is_named_with_its_error(pairs):
    """A follower whose command fails reports the error and exits; rank 0's next call names both
    (here an unknown command: the qwen2 pair's last use)."""
    _, two = pairs["qwen2"]
    two.tp.send("no-such-command")
    with pytest.raises(RuntimeError, match=r"engine tensor-parallel rank 1 \(pid \d+\) died \(exit code 1\): "
                                           r"ValueError: unknown engine tensor-parallel command 'no-such-command'"):
        two.generate(PROMPTS, PARAMS, seed=1)


@pytest.mark.cluster  # the TP=2 engines' follower processes (multiprocessing: no Popen)
def test_killed_follower_is_named_within_seconds(pairs):
    """kill -9 of the follower: the next generate raises naming its rank and pid at once (the
    group's connection resets; the liveness check), and the engine stays refused."""
    one, two = pairs["toy"]
    proc = two.tp.procs[1]
    proc.kill()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"engine tensor-parallel rank 1 \(pid {proc.pid}\) died \(exit code -9\)"):
        two.generate(PROMPTS, PARAMS, seed=1)
    assert time.monotonic() - t0 < 5
    with pytest.raises(RuntimeError, match="rank 1"):
        two.load_weights(9, {"lm_head.weight": one.model.lm_head.weight.clone()}, partial=True)


def test_refusals(qwen2_model):
    """N must divide the heads, KV heads and MLP width: named before any process starts."""
    with pytest.raises(ValueError, match=r"rollout_tensor_parallel \(3\) must divide num_attention_heads \(4\), "
                                         r"num_key_value_heads \(2\) of the model"):
        TorchEngine(str(qwen2_model), tensor_parallel=3)
    with pytest.raises(ValueError, match=r"rollout_tensor_parallel \(4\) must divide num_key_value_heads \(2\)"):
        TorchEngine(str(qwen2_model), tensor_parallel=4)
    with pytest.raises(ValueError, match="tensor_parallel must be an int >= 1"):
        TorchEngine(str(qwen2_model), tensor_parallel=0)


@pytest.mark.parametrize("overrides, needle", [
    (["rollout_tensor_parallel=2", "lora.rank=4"], "rollout_tensor_parallel (2): the built-in engine's"),
    (["rollout_tensor_parallel=2", "engine=vllm", "device=cuda"], "needs engine: torch and lora: null"),
])
def test_config_refusals(overrides, needle):
    import re

    from distflow.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config("examples/grpo_quickstart.yaml", overrides)
    assert load_config("examples/grpo_quickstart.yaml", ["rollout_tensor_parallel=2"]).rollout_tensor_parallel == 2


def test_placement_gives_a_rollout_node_n_distinct_gpus():
    """With rollout_tensor_parallel: N each rollout node sees N distinct GPUs (its TP ranks are its
    cuda:0..N-1), groups taken round-robin; worker-group nodes keep one GPU; too few is refused."""
    from distflow.launch.placement import PlacementError, describe, place

    nodes = [("trainer-0", "trainer"), ("rollout-0", "rollout"), ("rollout-1", "rollout"), ("rollout-2", "rollout"),
             ("reward-0", "worker")]
    slots = {s.node_id: s.env for s in place(nodes, device="cuda", present=5, rollout_gpus=2)}
    assert [slots[n]["CUDA_VISIBLE_DEVICES"] for n, _ in nodes] == ["0", "1,2", "3,4", "1,2", "1"]
    assert [slots[n]["DISTFLOW_GPU_NODES"] for n, _ in nodes] == ["1", "3", "1", "3", "3"]
    assert "GPU 1,2: rollout-0, rollout-2" in describe(place(nodes, device="cuda", present=5, rollout_gpus=2))
    colo = {s.node_id: s.env["CUDA_VISIBLE_DEVICES"] for s in place(
        [("trainer-0", "trainer"), ("trainer-1", "trainer"), ("rollout-0", "rollout")], device="cuda", present=2,
        colocate=True, rollout_gpus=2)}
    assert colo == {"trainer-0": "0", "trainer-1": "1", "rollout-0": "0,1"}
    with pytest.raises(PlacementError, match=r"rollout_tensor_parallel: 4 GPUs per rollout node, but only 3 GPU"):
        place(nodes, device="cuda", present=4, rollout_gpus=4)
    assert {s.env["CUDA_VISIBLE_DEVICES"] for s in place(nodes, device="cpu", rollout_gpus=2)} == {""}


def test_pdsh_hostfile_gives_a_rollout_node_n_gpus(tmp_path):
    """The pdsh launcher reads rollout_tensor_parallel from the config and places by the same rule;
    a node's DISTFLOW_GPU_NODES counts the nodes on its most shared GPU."""
    import importlib.util
    import sys
    from importlib.machinery import SourceFileLoader
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "deploy" / "pdsh" / "distflow-pdsh"
    loader = SourceFileLoader("distflow_pdsh", str(path))
    dp = importlib.util.module_from_spec(importlib.util.spec_from_loader("distflow_pdsh", loader))
    sys.modules["distflow_pdsh"] = dp
    loader.exec_module(dp)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("launch:\n  device: cuda\n  rollout_tensor_parallel: 2\n")
    specs = dp.parse_hostfile("h trainer=1 rollout=3 gpus=0,1,2,3,4 bind=10.0.0.1")
    (p,) = dp.build_plans(specs, str(cfg), [], "/r", "/w").values()
    assert {n["id"]: n["gpu"] for n in p["nodes"]} == {"trainer-h-0": "0", "rollout-h-0": "1,2",
                                                      "rollout-h-1": "3,4", "rollout-h-2": "1,2"}
    assert {n["id"]: dp._node_env(p, n, "s" * 32)["DISTFLOW_GPU_NODES"] for n in p["nodes"]} == {
        "trainer-h-0": "1", "rollout-h-0": "2", "rollout-h-1": "1", "rollout-h-2": "2"}
    (p,) = dp.build_plans(specs, str(cfg), ["rollout_tensor_parallel=1"], "/r", "/w").values()
    assert [n["gpu"] for n in p["nodes"]] == ["0", "1", "2", "3"]


def test_slurm_and_k8s_ask_rollout_tasks_for_n_gpus():
    """`distflow slurm` / `distflow k8s` give each rollout task / pod rollout_tensor_parallel GPUs
    unless told otherwise."""
    from distflow.launch import k8s
    from distflow.launch.slurm import parser, render

    args = parser().parse_args(["examples/grpo_quickstart.yaml", "--dry-run", "--trainer-hosts=1", "--rollout-hosts=1"])
    script, _, _ = render(args, ["device=cuda", "rollout_tensor_parallel=2"])
    assert "--het-group=1 --ntasks=2 --cpus-per-task=4 --gpus-per-task=2 " in script
    assert "#SBATCH hetjob\n#SBATCH --nodes=1 --ntasks=2 --cpus-per-task=4 --ntasks-per-node=2 --gres=gpu:4\n" in script
    docs = k8s.manifests(k8s.parser().parse_args(["examples/grpo_quickstart.yaml"]),
                         ["device=cuda", "rollout_tensor_parallel=2"], "s" * 32)
    limits = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
              for d in docs if d["kind"] == "StatefulSet"}
    assert {n.rsplit("-", 1)[-1]: v["nvidia.com/gpu"] for n, v in limits.items()} == {"trainer": 1, "rollout": 2}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (one per TP rank)")
def test_tp2_matches_tp1_on_two_gpus(qwen2_model):
    """The CUDA path: rank 0 on cuda:0, the follower on cuda:1, NCCL between them; fp32, so the
    same bound as on CPU; a weight update reaches the follower's GPU."""
    one = TorchEngine(str(qwen2_model), device="cuda", max_slots=4)
    two = TorchEngine(str(qwen2_model), device="cuda", max_slots=4, tensor_parallel=2)
    try:
        _agree(one, two, seed=5)
        new = {k: v * 1.02 for k, v in one.model.state_dict().items()}
        one.load_weights(1, new)
        two.load_weights(1, new)
        _agree(one, two, seed=6)
        assert two.tp.ask("stats")[0]["weight_bytes_received"] > 0
    finally:
        one.close()
        two.close()
