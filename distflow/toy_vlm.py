"""The vision-language toy task: a tiny Qwen2-VL that RL can teach to name a colour on a CPU.

Why it exists: the image path (dataset rows with images -> processor -> engine -> trainer) needs
a real multimodal model, processor and images that tests and the VLM quickstart can build
without downloading anything. This module builds them deterministically for a seed:

- a word-level tokenizer over a handful of symbols: the chat template's special tokens
  (``<|im_start|>``, ``<|im_end|>``), Qwen2-VL's vision tokens (``<|vision_start|>``,
  ``<|image_pad|>``, ``<|vision_end|>``), the colour words and ``?``. A small vocabulary keeps
  a random policy's first guess right often enough (about one time in ten) for GRPO to learn;
- a ``Qwen2VLImageProcessor`` with 4-pixel patches (a 16x16 image is 4 image tokens) and a chat
  template that renders ``{"type": "image"}`` parts as ``<|vision_start|><|image_pad|><|vision_end|>``;
- a tiny randomly initialised ``Qwen2VLForConditionalGeneration`` (vision tower included),
  saved with ``save_pretrained``;
- the "colour" task: a row's image is one solid colour (a random shade of it), the prompt asks
  ``?`` and the answer is the colour's name (:func:`make_vlm_dataset`).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

__all__ = ["VLM_COLOURS", "build_vlm_model", "build_vlm_processor", "make_vlm_dataset"]

# name -> base RGB; a row's image is a shade of one of these (each channel moved by up to +-40)
VLM_COLOURS: dict[str, tuple[int, int, int]] = {"red": (220, 30, 30), "green": (30, 200, 40),
                                                "blue": (30, 40, 220), "yellow": (230, 220, 30)}
_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>",
             "<|vision_end|>")
_WORDS = ("user", "assistant", "?", "\n")
# Renders a user turn's content parts (``{"type": "image"}`` / ``{"type": "text", "text": ...}``) or
# a plain string, then opens the assistant's turn.
_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PATCH = 4  # pixels per patch side: a 16x16 image is 4x4 patches, 2x2 = 4 image tokens after the 2x2 merge


def build_vlm_processor(out_dir: str | os.PathLike[str]):  # -> PreTrainedTokenizerFast
    """Build the tokenizer (with its chat template) and the image processor, save them into
    ``out_dir`` and return the tokenizer. (No ``Qwen2VLProcessor``: transformers builds one only
    with a video processor, which needs torchvision; :mod:`distflow.vision` does its image-token
    expansion itself.)"""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    try:  # the pillow backend (the default one needs torchvision); saved under the same config either way
        from transformers import Qwen2VLImageProcessorPil as Qwen2VLImageProcessor
    except ImportError:  # pragma: no cover - a transformers without it
        from transformers import Qwen2VLImageProcessor

    words = _SPECIALS + tuple(VLM_COLOURS) + _WORDS
    vocab = {w: i for i, w in enumerate(words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # whole words, "?" and newlines are pieces; other whitespace is dropped
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[a-z]+|\?|\n"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>", padding_side="left", model_max_length=256,
                                  additional_special_tokens=list(_SPECIALS[4:]))
    tok.chat_template = _TEMPLATE
    images = Qwen2VLImageProcessor(patch_size=PATCH, merge_size=2, temporal_patch_size=2,
                                   size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return tok


def build_vlm_model(out_dir: str | os.PathLike[str], *, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, vision_dim: int = 32, vision_depth: int = 1, init_std: float = 0.02,
                    family: str = "qwen2_vl") -> str:
    """Build the processor and a tiny random Qwen2-VL (vision tower of ``vision_depth`` blocks) into
    ``out_dir``; deterministic for ``seed``. ``family="qwen2_5_vl"``: a Qwen2.5-VL instead (the same
    processor and text decoder; its vision tower's windowed attention over 2x2 merged tokens, the last
    block full). Returns ``out_dir`` as a string."""
    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)

    tok = build_vlm_processor(out_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in _SPECIALS}
    half = hidden_size // num_heads // 2  # M-RoPE splits each head's rotary half over (t, h, w)
    section = [half - 2 * (half // 3), half // 3, half // 3]
    text = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                max_position_embeddings=256, initializer_range=init_std, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
                bos_token_id=ids["<bos>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<pad>"])
    vision = dict(depth=vision_depth, embed_dim=vision_dim, hidden_size=hidden_size, num_heads=2, mlp_ratio=2,
                  in_channels=3, patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2,
                  initializer_range=init_std)
    config_cls, model_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    if family == "qwen2_5_vl":
        config_cls, model_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision = dict(depth=vision_depth, hidden_size=vision_dim, out_hidden_size=hidden_size, num_heads=2,
                      intermediate_size=2 * vision_dim, in_channels=3, patch_size=PATCH, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=4 * PATCH, fullatt_block_indexes=[vision_depth - 1],
                      initializer_range=init_std)
    elif family != "qwen2_vl":
        raise ValueError(f"family must be 'qwen2_vl' or 'qwen2_5_vl', got {family!r}")
    config = config_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<unk>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = ids["<pad>"], ids["<|im_end|>"], ids["<bos>"]
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return str(out_dir)


def make_vlm_dataset(path: str | os.PathLike[str], n_rows: int, seed: int = 0, *, n_images: int = 16,
                     size: int = 16, images_dir: str = "images") -> str:
    """Write ``n_images`` solid-colour PNGs (``size`` pixels square) into ``images_dir`` beside ``path``
    and ``n_rows`` JSONL rows ``{"prompt": "?", "images": ["images/3.png"], "answer": "red"}`` (paths
    relative to the dataset file). Deterministic for ``seed``. Returns ``path``."""
    from PIL import Image

    rng = random.Random(seed)
    out = Path(path)
    (out.parent / images_dir).mkdir(parents=True, exist_ok=True)
    names = list(VLM_COLOURS)
    answers = []
    for k in range(n_images):
        name = names[k % len(names)]
        rgb = tuple(max(0, min(255, c + rng.randint(-40, 40))) for c in VLM_COLOURS[name])
        Image.new("RGB", (size, size), rgb).save(out.parent / images_dir / f"{k}.png")
        answers.append(name)
    with open(out, "w") as f:
        for _ in range(n_rows):
            k = rng.randrange(n_images)
            f.write(json.dumps({"prompt": "?", "images": [f"{images_dir}/{k}.png"], "answer": answers[k]}) + "\n")
    return str(out)
