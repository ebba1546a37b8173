"""Images from a dataset to a gradient (docs/vlm.md): a tiny Qwen2-VL built here (distflow/toy_vlm.py,
nothing downloaded), solid-colour PNGs written by pillow.

- the engine's logprobs of sampled tokens are the HF model's own forward on the same prompt, images
  and response (the model computing its own M-RoPE positions), and a GRPO group's images go through
  the vision tower once;
- a missing, a corrupt and an oversized image are each a counted skip naming the row (``bad_rows:
  skip``), and an error naming it under ``bad_rows: error``;
- the trainer's logprobs (FSDP2, images travelling as SampleBatch fields) are the engine's;
- examples/vlm_quickstart.yaml learns in its default run (the step functions, one process);
- a real ``distflow run`` of it (2 rollout x 2 trainer processes) trains every image sample once, on
  the rank that owns it;
- rows listing images stop the step when the engine's model takes none.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distflow.buffer.dataloader import DatasetError, PromptShard
from distflow.core.config import load_config
from distflow.rollout.protocol import SamplingParams
from distflow.rollout.stages import generate_rows
from distflow.rollout.torch_engine import TorchEngine
from distflow.toy_vlm import make_vlm_dataset
from tests.conftest import ROOT, run_distflow

EXAMPLE = ROOT / "examples" / "vlm_quickstart.yaml"


@pytest.fixture(scope="module")
def engine(vlm_model) -> TorchEngine:
    return TorchEngine(str(vlm_model))


def _hf_logprobs(model, ids: list[int], response: list[int], pics) -> list[float]:
    full = torch.tensor([ids + response])
    types = (full == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(input_ids=full, pixel_values=pics.pixel_values, image_grid_thw=pics.grid_thw,
                       mm_token_type_ids=types).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(ids) - 1 + j, t]) for j, t in enumerate(response)]


def test_engine_logprobs_are_the_hf_forward_and_a_group_encodes_its_images_once(engine, tmp_path):
    make_vlm_dataset(tmp_path / "d.jsonl", 2, n_images=3)
    from distflow.vision import load_images

    encoded = [engine.vision.encode("?", load_images([f"images/{k}.png"], tmp_path, None, f"row {k}"))
               for k in range(3)]
    ids0, pics0 = encoded[0]
    assert pics0.grid_thw.tolist() == [[1, 4, 4]] and pics0.pixel_values.shape == (16, 96)
    assert sum(t == engine.vision.image_token_id for t in ids0) == 4  # 4x4 patches merged 2x2
    calls: list[int] = []
    hook = engine.model.model.visual.register_forward_hook(lambda m, a, out: calls.append(int(a[0].shape[0])))
    try:
        g = 4
        prompts = [p for p, _ in encoded for _ in range(g)]
        images = [x for _, x in encoded for _ in range(g)]
        comps = engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0), seed=3, images=images)
    finally:
        hook.remove()
    assert calls == [3 * 16], calls  # one vision pass over the 3 prompts' patches, not 12 prompts'
    assert len({tuple(c.tokens) for c in comps}) > 3  # the group's samples are sampled apart
    worst, compared = 0.0, 0
    for i, c in enumerate(comps):
        if engine.vision.image_token_id in c.tokens:  # HF's forward would take it for an image placeholder
            continue  # (the trainer does not: test_trainer_logprobs_with_images_are_the_engines)
        ids, pics = encoded[i // g]
        ref = _hf_logprobs(engine.model, ids, c.tokens, pics)
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, c.logprobs)))
        compared += 1
    assert compared >= 6 and worst < 1e-4, (compared, worst)
    with pytest.raises(ValueError, match="3 image inputs for 12 prompts"):
        engine.generate(prompts, SamplingParams(max_new_tokens=1), seed=0, images=images[:3])


def _bad_rows_dataset(tmp_path: Path) -> Path:
    from PIL import Image

    path = Path(make_vlm_dataset(tmp_path / "d.jsonl", 3, n_images=2))
    (tmp_path / "images" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    Image.new("RGB", (64, 64), (1, 2, 3)).save(tmp_path / "images" / "big.png")
    with open(path, "a") as f:
        for name in ("missing.png", "corrupt.png", "big.png"):
            f.write(json.dumps({"prompt": "?", "images": [f"images/{name}"], "answer": "red"}) + "\n")
        f.write(json.dumps({"prompt": "?", "images": [], "answer": "red"}) + "\n")  # a text row
    return path


def test_missing_corrupt_and_oversized_images_are_counted_skips_naming_the_row(engine, vlm_model, tmp_path):
    path = _bad_rows_dataset(tmp_path)
    cfg = load_config(EXAMPLE, [f"model_path={vlm_model}", "toy_model=false", f"dataset={path}",
                                "max_image_pixels=1024", "group_size=2"])
    loader = PromptShard(str(path), 0, 1, shuffle=False, bad_rows="skip")
    rows = loader.batch(0, 0, 7)
    stats: dict[str, float] = {}
    batch = generate_rows(engine, cfg, rows, seed=0, stats=stats)
    assert loader.bad_rows_skipped == 3
    assert sorted(set(batch.prompt_ids)) == ["e0:0", "e0:1", "e0:2", "e0:6"] and len(batch) == 8
    # each sample carries its prompt's images: 16 patches x 96 values, one (1, 4, 4) grid; the text row none
    assert batch.tensors["pixel_lens"].tolist() == [16 * 96] * 6 + [0, 0]
    assert batch.tensors["image_grid_thw"].view(-1, 3).tolist() == [[1, 4, 4]] * 6
    assert batch.tensors["prompt_lens"].tolist() == [15] * 6 + [9] * 2  # 4 image tokens and their 2 markers
    strict = PromptShard(str(path), 0, 1, shuffle=False, bad_rows="error")
    for line, what in ((4, "not found"), (5, "cannot be read"),
                       (6, "is 64x64 = 4096 pixels, over max_image_pixels 1024")):
        with pytest.raises(DatasetError, match=f"d.jsonl:{line}: image 'images/.*' {what}"):
            generate_rows(engine, cfg, strict.batch(0, line - 1, 1), seed=0)


def test_trainer_logprobs_with_images_are_the_engines(vlm_model, tmp_path):
    """One FSDP2 trainer rank recomputes the batch's logprobs (images from the SampleBatch fields,
    packed micro-batches: each sample's M-RoPE positions in its row), with the policy and with the frozen
    reference: the engine's, to 1e-4; ``freeze_vision_tower`` leaves only the language model trainable."""
    from distflow.trainer.actor import Actor
    from tests.process_group import process_group, store_path

    path = make_vlm_dataset(tmp_path / "d.jsonl", 4, n_images=4)
    with_ref = tmp_path / "with_reference.yaml"  # the example with a reference node: a KL penalty
    reference = "  - {id: reference, role: REFERENCE, type: MODEL_INFERENCE, fn: ref_logprob, deps: [generate]}\n"
    with_ref.write_text(EXAMPLE.read_text().replace("deps: [advantage]}", "deps: [advantage, reference]}") + reference)
    keys = [f"model_path={vlm_model}", "toy_model=false", f"dataset={path}", "group_size=3", "max_new_tokens=3",
            "micro_batch_size=5", "max_tokens_per_micro_batch=64", "kl_coef=0.001"]
    cfg = load_config(with_ref, [*keys, "freeze_vision_tower=true"])
    eng = TorchEngine(str(vlm_model))
    batch = generate_rows(eng, cfg, PromptShard(path, 0, 1, shuffle=False).batch(0, 0, 4), seed=1)
    with process_group(store_path(tmp_path)):
        actor = Actor(cfg, with_reference=True)  # the frozen reference takes the same path
        assert not any(p.requires_grad for p in actor.model.model.visual.parameters())
        assert all(p.requires_grad for p in actor.model.model.language_model.parameters())
        from distflow.trainer.actor import step_micro_batches

        packed = [inputs for idx, inputs in step_micro_batches(batch, micro_batch_size=5, max_tokens=64)]
        assert all(x.attention_mask is None and len(x.seq_lens) > 1 for x in packed[:-1])  # several samples a row
        actor.old_logprobs(batch)
        actor.reference_logprobs(batch)
        for name in ("old_logprobs", "ref_logprobs"):
            diff = (batch.tensors[name] - batch.tensors["logprobs"]).abs().max().item()
            assert diff < 1e-4, (name, diff)
        # one update: the frozen tower keeps its weights, the language model moves; unfrozen, the tower moves too
        batch.set_scalar("advantage", torch.linspace(-1.0, 1.0, len(batch)))
        for freeze, trainer in ((True, actor), (False, None)):
            if trainer is None:
                trainer = Actor(load_config(with_ref, [*keys, "freeze_vision_tower=false"]), with_reference=False)
            before = trainer.full_state_dict()
            trainer.update(cfg.node("ACTOR", "MODEL_TRAIN"), batch)
            moved = {n for n, p in trainer.full_state_dict().items() if not torch.equal(p, before[n])}
            vision = {n for n in before if ".visual." in n}
            assert vision and (not moved & vision if freeze else vision <= moved), (freeze, sorted(moved))
            assert any(".language_model." in n for n in moved)


def test_vlm_quickstart_learns(tmp_path):
    from tests.learning import learning_run

    cfg, rows, first, last, wall = learning_run(EXAMPLE, "vlm", tmp_path)
    rewards = [r["reward_mean"] for r in rows]
    print(f"\nvlm_quickstart: {len(rows)} steps, first-10 reward {first:.3f}, last-10 {last:.3f}, wall {wall:.0f} s")
    assert len(rows) == cfg.max_steps == 20
    assert last - first >= 0.3, rewards
    assert last >= 0.5, rewards  # above the 0.25 of a policy that names colours without looking


def test_a_real_2x2_run_trains_every_image_sample_once(tmp_path):
    """`distflow run` of the example as 2 rollout x 2 trainer node processes, 3 steps: the launcher
    builds the toy VLM; every sample of every prompt reaches the trainer rank that owns it, once (its
    images with it: a sample whose image tokens arrive without pixels fails the trainer's forward);
    FSDP2 shards the model (vision tower included) over the 2 trainers; the checkpoint is a vision-
    language model directory again (image processor included)."""
    from distflow.buffer.routing import owner
    from distflow.trace import read_trace

    out = tmp_path / "out"
    r = run_distflow(["run", str(EXAMPLE), "--no-progress", f"output_dir={out}", f"model_path={tmp_path / 'model'}",
                      "max_steps=3", "prompts_per_step=8", "group_size=2", "rollout_nodes=2", "trainer_nodes=2",
                      "trace_samples=true"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    trace = read_trace(out)
    shards = [[p for rec in trace[f"rollout-{k}"] for p in rec["prompt_ids"]] for k in range(2)]
    assert len(shards[0]) == len(shards[1]) == 3 * 4 and not set(shards[0]) & set(shards[1])
    seen = []
    for rank in range(2):
        for rec in trace[f"trainer-{rank}"]:
            assert all(owner(s, 2) == rank for s in rec["sample_ids"])
            seen += rec["sample_ids"]
    assert sorted(seen) == sorted(f"{p}:s{j}" for p in shards[0] + shards[1] for j in range(2))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [0, 1, 2] and all(x["prompt_len_min"] == 15 for x in rows)  # 11 text + 4 image
    ckpt = TorchEngine(str(out / "checkpoint"))
    assert ckpt.vision is not None and ckpt.vision.image_processor.patch_size == 4


def test_rows_with_images_and_a_text_only_model_stop_the_step_naming_the_row(toy_model, tmp_path):
    from distflow.rl.catalog import StageError

    path = make_vlm_dataset(tmp_path / "d.jsonl", 2, n_images=2)
    cfg = load_config(EXAMPLE, [f"model_path={toy_model}", "toy_model=false", f"dataset={path}"])
    with pytest.raises(StageError, match=r"d.jsonl:1: the row lists images \(key 'images'\) but the engine's model "
                                         r"takes none"):
        generate_rows(TorchEngine(str(toy_model)), cfg, PromptShard(path, 0, 1, shuffle=False).batch(0, 0, 2), 0)


def test_parquet_image_structs_are_read_and_a_corrupt_one_is_a_counted_skip(engine, vlm_model, tmp_path):
    """A Parquet ``images`` column of ``{bytes, path}`` structs (Hugging Face datasets' image format):
    bytes are decoded, a path is relative to the file; corrupt bytes are a bad row named by its row."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    def png(rgb) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (16, 16), rgb).save(buf, format="PNG")
        return buf.getvalue()

    make_vlm_dataset(tmp_path / "unused.jsonl", 1, n_images=1)  # images/0.png, for the path struct
    rows = [[{"bytes": png((200, 10, 10)), "path": None}], [{"bytes": None, "path": "images/0.png"}],
            [{"bytes": b"garbage", "path": "x.png"}]]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["?"] * 3, "images": rows, "answer": ["red", "red", "blue"]}), path)
    cfg = load_config(EXAMPLE, [f"model_path={vlm_model}", "toy_model=false", f"dataset={path}", "group_size=2"])
    loader = PromptShard(str(path), 0, 1, shuffle=False, bad_rows="skip")
    batch = generate_rows(engine, cfg, loader.batch(0, 0, 3), seed=0)
    assert batch.prompt_ids == ["e0:0", "e0:0", "e0:1", "e0:1"] and loader.bad_rows_skipped == 1
    assert batch.tensors["image_grid_thw"].view(-1, 3).tolist() == [[1, 4, 4]] * 4
    red = batch.tensors["pixel_values"].view(4, 16, 96)
    assert not torch.equal(red[0], red[2])  # the bytes' image and the file's are different pictures
    with pytest.raises(DatasetError, match=r"d.parquet: row 3: image #0 \(bytes\) cannot be read"):
        generate_rows(engine, cfg, PromptShard(str(path), 0, 1, shuffle=False).batch(0, 2, 1), seed=0)
