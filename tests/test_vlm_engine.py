"""The static-KV engine on a Qwen2-VL (distflow/rollout/vlm_forward.py; docs/vlm.md "Rollout"), on the tiny
toy VLM (distflow/toy_vlm.py) in fp32 on CPU:

- logprobs of sampled tokens are the Hugging Face model's own forward on the same prompt, images and
  response, and the tokens are the HF generate path's with the same seed (both draw from the same
  per-sequence counter streams), in a batch mixing text-only prompts and images of two sizes;
- the vision tower runs once per generate call over the distinct prompts' images (a GRPO group once),
  and once more when a weight swap mid-call re-prefills the live sequences (the same tokens follow);
- the request-level continuous engine runs two image episodes of different rope deltas, and a second
  turn that reuses the first's KV (a text extension positioned past the images) matches HF too;
- a vision-language model the static path cannot drive falls back to the HF loop with a warning.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from distflow.rollout.protocol import SamplingParams
from distflow.rollout.torch_engine import TorchEngine
from distflow.rollout.vlm_forward import VLMRunner
from distflow.toy_vlm import make_vlm_dataset
from distflow.vision import ImageInputs, mrope_positions


@pytest.fixture(scope="module")
def engine(vlm_model) -> TorchEngine:
    return TorchEngine(str(vlm_model))


def _encode(engine: TorchEngine, size: tuple[int, int] | None, rgb=(200, 30, 30)) -> tuple[list[int], ImageInputs]:
    from PIL import Image

    return engine.vision.encode("?", [] if size is None else [Image.new("RGB", size, rgb)])


def _hf_logprobs(model, ids: list[int], response: list[int], pics: ImageInputs | None) -> list[float]:
    p = next(model.parameters())
    full = torch.tensor([ids + response], device=p.device)
    kw = {} if pics is None else {"pixel_values": pics.pixel_values.to(p.device, p.dtype),
                                  "image_grid_thw": pics.grid_thw.to(p.device),
                                  "mm_token_type_ids": (full == model.config.image_token_id).int()}
    with torch.no_grad():
        logits = model(input_ids=full, **kw).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(ids) - 1 + j, t]) for j, t in enumerate(response)]


def _delta(model, ids: list[int], pics: ImageInputs) -> int:
    t = torch.tensor([ids])
    return int(mrope_positions(model, t, torch.ones_like(t), pics.grid_thw).max()) + 1 - len(ids)


def _worst_vs_hf(engine: TorchEngine, prompts, images, comps) -> tuple[float, list[int]]:
    """The largest |engine - HF| logprob and the indices compared (a response holding the image-token id
    is skipped: HF's forward would take it for an image placeholder; the trainer does not)."""
    worst, compared = 0.0, []
    for i, (p, x, c) in enumerate(zip(prompts, images, comps)):
        if engine.vision.image_token_id in c.tokens:
            continue
        ref = _hf_logprobs(engine.model, p, c.tokens, x)
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, c.logprobs)))
        compared.append(i)
    return worst, compared


def test_static_kv_logprobs_and_tokens_are_the_hf_paths_in_a_mixed_batch(engine, vlm_model, monkeypatch, caplog):
    assert isinstance(engine.runner, VLMRunner)  # the static-KV path, not the HF loop
    small, wide, text = _encode(engine, (16, 16)), _encode(engine, (32, 16), (30, 40, 220)), _encode(engine, None)
    assert wide[1].grid_thw.tolist() == [[1, 4, 8]] and text[1] is None
    assert _delta(engine.model, *small) == -2 and _delta(engine.model, *wide) == -4  # different M-RoPE offsets
    order = [small, text, wide, small, text, wide, small, wide]  # groups interleaved, text rows among them
    prompts, images = [p for p, _ in order], [x for _, x in order]
    calls: list[int] = []
    hook = engine.model.model.visual.register_forward_hook(lambda m, a, out: calls.append(int(a[0].shape[0])))
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    try:
        comps = engine.generate(prompts, params, seed=11, images=images)
    finally:
        hook.remove()
    assert calls == [16 + 32], calls  # one vision pass over the two distinct images, not six prompts'
    assert len({tuple(c.tokens) for c in comps}) > 3
    worst, compared = _worst_vs_hf(engine, prompts, images, comps)
    kinds = {id(order[i]) for i in compared}
    assert len(compared) >= 5 and len(kinds) == 3 and worst < 1e-4, (compared, worst)  # text, small and wide
    # 3 slots: sequences of both rope deltas and text wait, are admitted as others finish and are compacted
    # (each slot's delta moves with it): the same tokens and logprobs, whatever the slots
    few = TorchEngine(str(vlm_model), max_slots=3)
    moves = []
    move = few.runner.move_slot
    monkeypatch.setattr(few.runner, "move_slot", lambda *a: (moves.append(a), move(*a)))
    again = few.generate(prompts, params, seed=11, images=images)
    assert moves and few.runner.vision_calls >= 2
    assert [c.tokens for c in again] == [c.tokens for c in comps]
    assert max(abs(a - b) for r, c in zip(again, comps) for a, b in zip(r.logprobs, c.logprobs)) < 1e-5
    few.close()
    # a vision call holds at most max_prefill_tokens image tokens (its activations within the prefill's reserve)
    tight = TorchEngine(str(vlm_model), max_prefill_tokens=10)
    calls.clear()
    hook = tight.model.model.visual.register_forward_hook(lambda m, a, out: calls.append(int(a[0].shape[0])))
    try:
        tight.generate([small[0], wide[0], small[0]], params, seed=11, images=[small[1], wide[1], small[1]])
    finally:
        hook.remove()
    assert calls == [16, 32], calls  # 4 + 8 image tokens > 10: two calls
    tight.close()
    # the HF generate path (an architecture the static path refuses: a logged fallback) samples the same tokens
    monkeypatch.setattr("distflow.rollout.torch_engine.vlm_unsupported_reason", lambda m: "model_type 'qwen9_vl'")
    with caplog.at_level(logging.WARNING, logger="distflow.rollout.torch_engine"):
        hf = TorchEngine(str(vlm_model))
    assert hf.runner is None and "qwen9_vl" in caplog.text and "HF generate loop" in caplog.text
    ref = hf.generate(prompts, params, seed=11, images=images)
    assert [c.tokens for c in ref] == [c.tokens for c in comps]
    assert max(abs(a - b) for r, c in zip(ref, comps) for a, b in zip(r.logprobs, c.logprobs)) < 1e-4
    hf.close()


def test_a_weight_swap_mid_call_reencodes_the_images_and_continues(engine):
    small, wide = _encode(engine, (16, 16), (30, 200, 40)), _encode(engine, (32, 16))
    prompts, images = [small[0]] * 3 + [wide[0]] * 3, [small[1]] * 3 + [wide[1]] * 3
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    before = engine.runner.vision_calls
    plain = engine.generate(prompts, params, seed=5, images=images)
    assert engine.runner.vision_calls == before + 1
    w = engine.model.lm_head.weight.detach().clone()
    sent = []

    def update():  # the same values as version 1, after the first decode step: the live sequences re-prefill
        if sent:
            return None
        sent.append(1)
        return engine.version + 1, {"lm_head.weight": w}, True

    swaps = engine.stats["weight_swaps"]
    swapped = engine.generate(prompts, params, seed=5, images=images, weights_update=update)
    assert engine.stats["weight_swaps"] == swaps + 1 and engine.runner.vision_calls == before + 3
    assert [c.tokens for c in swapped] == [c.tokens for c in plain]
    assert sum(c.first_version + 1 == c.last_version for c in swapped) >= 3  # (the rest had stopped before it)
    assert max(abs(a - b) for s, p in zip(swapped, plain) for a, b in zip(s.logprobs, p.logprobs)) < 1e-5


def test_continuous_engine_runs_image_episodes_of_different_rope_deltas(engine):
    small, wide = _encode(engine, (16, 16), (230, 220, 30)), _encode(engine, (32, 16), (30, 200, 40))
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    tail = engine.tokenizer("? ?", add_special_tokens=False)["input_ids"]

    async def episodes():
        async with engine.continuous(seed=3, max_length=48) as cont:
            a, b = await asyncio.gather(cont.submit(small[0], params, key=("a", 0), session="a", images=small[1]),
                                        cont.submit(wide[0], params, key=("b", 0), session="b", images=wide[1]))
            second = wide[0] + b.tokens + tail  # episode b's next turn: its context, then more text
            c = await cont.submit(second, params, key=("b", 1), session="b", turn=1, images=wide[1])
            with pytest.raises(ValueError, match="fewer image tokens than its images' 8 merged patches"):
                await cont.submit(small[0], params, images=wide[1])  # refused before it reaches the engine thread
            return a, b, c, second

    hits, reused = engine.stats.get("kv_hits", 0), engine.stats.get("kv_reused_tokens", 0)
    a, b, c, second = asyncio.run(asyncio.wait_for(episodes(), 120))
    assert engine.stats["kv_hits"] == hits + 1  # turn 2 prefilled only its new tokens, past the images
    assert engine.stats["kv_reused_tokens"] == reused + len(wide[0]) + len(b.tokens) - 1
    image = engine.vision.image_token_id
    assert all(image not in x.tokens for x in (a, b, c)), "seed picks responses without the image-token id"
    worst, compared = _worst_vs_hf(engine, [small[0], wide[0], second], [small[1], wide[1], wide[1]], [a, b, c])
    assert compared == [0, 1, 2] and worst < 1e-4, worst
    # a later turn whose context holds a SAMPLED image-token id: text, positioned past the images (not a 9th image
    # token, which made get_rope_index run out of grids and stopped the engine thread)
    r = engine.runner
    r.bind([0, 1], [wide[0], wide[0] + [image] + tail], [wide[1], wide[1]])
    (_, pos), (_, later) = r.bound[0], r.bound[1]
    assert torch.equal(later[:, :len(wide[0])], pos) and later[:, len(wide[0])].tolist() == [int(pos.max()) + 1] * 3
    assert r.delta[:2].tolist() == [-4, -4]


def test_a_qwen2_5_vl_runs_on_the_static_path_with_the_hf_logprobs(tmp_path):
    """Qwen2.5-VL: the same text decoder and M-RoPE, another vision tower (windowed attention, 2 blocks)."""
    from distflow.toy_vlm import build_vlm_model

    eng = TorchEngine(build_vlm_model(tmp_path / "q25", seed=2, init_std=0.2, vision_depth=2, family="qwen2_5_vl"))
    assert type(eng.model).__name__ == "Qwen2_5_VLForConditionalGeneration" and isinstance(eng.runner, VLMRunner)
    small, wide, text = _encode(eng, (16, 16)), _encode(eng, (32, 16), (30, 40, 220)), _encode(eng, None)
    order = [small, wide, text, small, wide, text]
    prompts, images = [p for p, _ in order], [x for _, x in order]
    comps = eng.generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0), seed=4, images=images)
    assert eng.runner.vision_calls == 1
    worst, compared = _worst_vs_hf(eng, prompts, images, comps)
    assert len({id(order[i]) for i in compared}) == 3 and worst < 1e-4, (compared, worst)
    eng.close()


def test_the_gpu_example_passes_the_nodes_checks_with_a_local_model_and_dataset(vlm_model, tmp_path):
    """examples/vlm_qwen25vl_3b_gpu.yaml (never run on a GPU): a valid config as written (placeholder paths), and
    with a Qwen2.5-VL-3B-shaped directory (the toy's tokenizer, 3B's text positions; no weights: nothing is
    loaded) and a geometry-style dataset it passes every check its nodes make before they start (--check)."""
    import json
    import shutil

    from distflow.core.config import load_config
    from distflow.launch.preflight import check_functions, check_inputs
    from tests.conftest import ROOT

    example = ROOT / "examples" / "vlm_qwen25vl_3b_gpu.yaml"
    cfg = load_config(example)
    assert (cfg.device, cfg.engine, cfg.dtype, cfg.model_path, cfg.dataset) == (
        "cuda", "torch", "bfloat16", "/models/Qwen2.5-VL-3B-Instruct", "/data/geometry3k/train.parquet")
    assert cfg.engine_gpu_memory_utilization == 0.85 and cfg.max_prompt_length == 2048 and cfg.freeze_vision_tower
    model = tmp_path / "Qwen2.5-VL-3B-Instruct"
    model.mkdir()
    for f in vlm_model.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, model / f.name)
    conf = json.loads((model / "config.json").read_text())
    conf["model_type"] = "qwen2_5_vl"
    conf["text_config"]["max_position_embeddings"] = 128000
    (model / "config.json").write_text(json.dumps(conf))
    make_vlm_dataset(tmp_path / "colours.jsonl", 1, n_images=2)
    rows = [{"problem": "Find x.", "images": ["images/0.png"], "answer": "3"},
            {"problem": "Find the area.", "images": ["images/1.png"], "answer": "12.5"}]
    (tmp_path / "geo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(example, [f"model_path={model}", f"dataset={tmp_path / 'geo.jsonl'}"])
    for role in ("rollout", "trainer"):
        check_functions(cfg, cfg.plan().pipelines.get(role, []))
    assert check_inputs(cfg, None) == []
    with pytest.raises(Exception, match="max_new_tokens"):  # the checks do look: the toy's 256 positions
        check_inputs(load_config(example, [f"model_path={vlm_model}", f"dataset={tmp_path / 'geo.jsonl'}"]), None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_graph_decode_with_rope_deltas_matches_eager_and_hf(vlm_model):
    """CUDA graphs replay the decode step with each slot's rope delta read from the captured per-slot
    tensor: the same tokens as eager decode, logprobs the HF forward's (fp32; TF32 convolutions in the
    vision tower are the same for both sides). Never run yet: no GPU was lent when it was written."""
    runs = {}
    for graphs in (True, False):
        eng = TorchEngine(str(vlm_model), device="cuda", compile=graphs, max_slots=16)
        small, wide = _encode(eng, (16, 16)), _encode(eng, (32, 16), (30, 40, 220))
        prompts, images = [small[0]] * 4 + [wide[0]] * 4, [small[1]] * 4 + [wide[1]] * 4
        runs[graphs] = eng.generate(prompts, SamplingParams(max_new_tokens=24, temperature=1.0), seed=3,
                                    images=images)
        if graphs:
            assert eng.runner.graphs and eng.stats["graph_eager_steps"] == 0 and eng.runner.vision_calls == 1
            worst, compared = _worst_vs_hf(eng, prompts, images, runs[graphs])
            assert len(compared) >= 2 and worst < 1e-3, (compared, worst)
        eng.close()
    assert [c.tokens for c in runs[True]] == [c.tokens for c in runs[False]]
