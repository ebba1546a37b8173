"""Images from a dataset row to a vision-language model's inputs (Qwen2-VL family).

Why it exists: a multimodal prompt is more than token ids. The row names its images (paths
relative to the dataset file, or absolute); they are read with pillow, bounded in size, turned
into patches and grid shapes by the model's image processor, and the prompt is rendered by the
model's chat template with one image placeholder per image, each expanded to as many image
tokens as its grid has merged patches (what ``Qwen2VLProcessor`` does; that class is not used
because transformers only builds it with a video processor, which needs torchvision). The same
:class:`ImageInputs` then travel with every sample of the prompt (SampleBatch fields
``pixel_values`` / ``image_grid_thw``) to the engine and to the trainer, which both compute the
M-RoPE positions with :func:`mrope_positions`, so the engine's logprobs and the trainer's agree.

A row whose image is missing, unreadable or larger than ``max_image_pixels`` is a bad row: a
:class:`~distflow.buffer.dataloader.DatasetError` naming the row and the file, which the caller
skips and counts (``bad_rows``) or raises, never a crash of the step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distflow.buffer.batch import SampleBatch
from distflow.buffer.dataloader import BadRowPolicy, DatasetError, PromptRow

__all__ = ["ImageInputs", "VisionPrompter", "attach_images", "batch_images", "encode_image_rows", "image_features",
           "is_vision_config", "load_images", "mrope_positions"]


@dataclass(frozen=True)
class ImageInputs:
    """A prompt's images as the vision tower takes them: ``pixel_values`` [patches, patch_dim]
    float32 and ``grid_thw`` [images, 3] int64 (temporal, height, width patches per image)."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor


def is_vision_config(config: Any) -> bool:
    """True for a model config with a vision tower this module feeds (Qwen2-VL's image tokens)."""
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


def load_images(paths: Any, base_dir: str | os.PathLike[str], max_pixels: int | None, where: str) -> list[Any]:
    """The RGB pillow images of ``paths``: a list of file paths (strings, relative to ``base_dir``
    or absolute) or of ``{"bytes": ..., "path": ...}`` structs (a Parquet image column, as Hugging
    Face ``datasets`` writes one: the encoded bytes, else the path). Raises :class:`DatasetError`
    naming ``where`` (the row) and the image when one is missing, unreadable or has more than
    ``max_pixels`` pixels (checked from the header, before the pixels are decoded: a decompression
    bomb is refused without being decoded)."""
    import io

    from PIL import Image

    if not isinstance(paths, list) or not paths:
        raise DatasetError(f"{where}: 'images' must be a non-empty list of file paths or image structs, "
                           f"got {paths!r:.80}")
    out = []
    for k, p in enumerate(paths):
        data = p.get("bytes") if isinstance(p, dict) else None
        if isinstance(p, dict) and data is None:
            p = p.get("path")
        if data is not None:
            name, src = f"#{k} (bytes)", io.BytesIO(data)
        elif isinstance(p, str) and p:
            name, src = repr(p), Path(p) if os.path.isabs(p) else Path(base_dir) / p
            if not src.is_file():
                raise DatasetError(f"{where}: image {name} not found ({src})")
        else:
            raise DatasetError(f"{where}: image #{k} is neither a file path nor a struct with bytes or a path: "
                               f"{p!r:.80}")
        try:
            with Image.open(src) as im:
                w, h = im.size
                if max_pixels is not None and w * h > max_pixels:
                    raise DatasetError(f"{where}: image {name} is {w}x{h} = {w * h} pixels, over "
                                       f"max_image_pixels {max_pixels}")
                out.append(im.convert("RGB"))
        except DatasetError:
            raise
        except Exception as e:  # pillow's UnidentifiedImageError, truncated files, OSError ...
            raise DatasetError(f"{where}: image {name} cannot be read ({type(e).__name__}: {str(e)[:120]})") from None
    return out


class VisionPrompter:
    """Renders a row's prompt and images for one model directory: its tokenizer's chat template,
    its image processor (``AutoImageProcessor``), its image token and merge size."""

    def __init__(self, tokenizer: Any, model_path: str | os.PathLike[str], config: Any):
        from transformers import AutoImageProcessor

        from distflow.hf import LOAD_LOCK

        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{model_path}: a vision-language model needs a tokenizer with a chat template "
                             "(it places the image tokens)")
        with LOAD_LOCK:
            self.image_processor = AutoImageProcessor.from_pretrained(str(model_path), local_files_only=True)
        self.tokenizer = tokenizer
        self.image_token_id = int(config.image_token_id)
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)

    def encode(self, prompt: Any, images: list[Any]) -> tuple[list[int], ImageInputs | None]:
        """(prompt token ids, image inputs) of a text prompt (or a chat conversation whose user turns
        hold ``{"type": "image"}`` parts, one per image) and its pillow images. A text prompt becomes
        one user turn: the images, then the text. Raises ValueError when the placeholders and the
        images do not match."""
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": [*({"type": "image"} for _ in images),
                                                     {"type": "text", "text": prompt}]}]
        elif isinstance(prompt, list):
            messages = prompt
        else:
            raise ValueError(f"a prompt must be text or chat messages, got {type(prompt).__name__}")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not images:
            if self.image_token in text:
                raise ValueError("the rendered prompt has image placeholders but the row has no images")
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), None
        enc = self.image_processor(images=images, return_tensors="pt")
        pixels, grid = enc["pixel_values"].to(torch.float32), enc["image_grid_thw"].to(torch.int64)
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the rendered prompt has {len(pieces) - 1} image placeholders for {len(images)} images")
        counts = (grid.prod(-1) // self.merge ** 2).tolist()
        text = pieces[0] + "".join(self.image_token * n + rest for n, rest in zip(counts, pieces[1:]))
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if sum(i == self.image_token_id for i in ids) != sum(counts):
            raise ValueError("the tokenizer did not keep the image tokens whole")
        return ids, ImageInputs(pixels.contiguous(), grid.contiguous())


def mrope_positions(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    grid_thw: torch.Tensor | None, image_mask: torch.Tensor | None = None) -> torch.Tensor:
    """M-RoPE position ids [3, B, L] of a (left- or right-) padded batch: text tokens count up on
    all three axes, a block of image tokens takes its (t, h, w) grid positions (the model's own
    ``get_rope_index``, which skips pad tokens, so both paddings give a sample the same ids).
    ``model``: the ``*ForConditionalGeneration`` (or its ``.model``). ``image_mask`` [B, L]: where
    the image tokens are (default: every image-token id; a sampled response may hold that id too,
    and is text)."""
    inner = getattr(model, "model", model)
    if image_mask is None:
        image_mask = input_ids == int(inner.config.image_token_id)
    types = image_mask.to(torch.int32)
    if grid_thw is None or grid_thw.numel() == 0:
        pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return pos[None].expand(3, -1, -1)
    pos, _ = inner.get_rope_index(input_ids, types, image_grid_thw=grid_thw, attention_mask=attention_mask)
    return pos


def image_features(model: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """[merged patches, hidden] features of images by the model's own vision tower (one call), the
    images' rows in order: what replaces their prompts' image tokens. ``model``: the
    ``*ForConditionalGeneration`` (or its ``.model``)."""
    inner = getattr(model, "model", model)
    out = inner.get_image_features(pixel_values, grid_thw, return_dict=True)
    feats = getattr(out, "pooler_output", out)  # (per image in transformers 5; a tuple in some versions)
    return torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats


def encode_image_rows(prompter: VisionPrompter, rows: list[PromptRow], prompt_key: str, image_key: str,
                      max_pixels: int | None, fallback: BadRowPolicy, default_dir: str
                      ) -> list[tuple[list[int], ImageInputs | None] | None]:
    """Each row's (prompt ids, image inputs), or None for a bad row: one whose images are missing,
    unreadable, too large, or do not fit its prompt, rejected (raised under ``bad_rows: error``,
    else skipped and counted) by the policy of the loader that read it (``fallback`` for a row
    made elsewhere), the message naming the row. A row without ``image_key`` (or with an empty
    list, as datasets mixing text rows in write them) is a text prompt (image inputs None). Image
    paths are relative to the row's file (``default_dir`` when it has none)."""
    out: list[tuple[list[int], ImageInputs | None] | None] = []
    for r in rows:
        where = r.where or "prompt " + r.prompt_id
        data = r.data if isinstance(r.data, dict) else {}
        paths = data.get(image_key)
        try:
            images = [] if paths is None or paths == [] else load_images(  # none: a text prompt, rendered alike
                paths, os.path.dirname(os.path.abspath(r.source)) if r.source else default_dir, max_pixels, where)
            try:
                out.append(prompter.encode(data.get(prompt_key), images))
            except ValueError as e:
                raise DatasetError(f"{where}: {e} (prompt {r.prompt_id})") from None
        except DatasetError as e:
            (r.policy or fallback).reject(e)  # raises with bad_rows: error
            out.append(None)
    return out


def attach_images(batch: SampleBatch, images: list[ImageInputs | None]) -> None:
    """Give every sample of ``batch`` its prompt's images (``images[i]`` for sample ``i``; None: no
    image) as the ragged fields ``pixel_values`` / ``image_grid_thw`` (:data:`~distflow.buffer.batch.IMAGE_LENGTHS`)."""
    if len(images) != len(batch):
        raise ValueError(f"{len(images)} image inputs for {len(batch)} samples")
    empty_f, empty_i = torch.zeros(0, dtype=torch.float32), torch.zeros(0, dtype=torch.int64)
    pix = [x.pixel_values.reshape(-1) if x is not None else empty_f for x in images]
    grid = [x.grid_thw.reshape(-1) if x is not None else empty_i for x in images]
    t = batch.tensors
    t["pixel_lens"] = torch.tensor([p.numel() for p in pix], dtype=torch.int64)
    t["pixel_values"] = torch.cat(pix) if pix else empty_f
    t["image_grid_lens"] = torch.tensor([g.numel() for g in grid], dtype=torch.int64)
    t["image_grid_thw"] = torch.cat(grid) if grid else empty_i


def batch_images(batch: SampleBatch, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(pixel_values [patches, patch_dim], image_grid_thw [images, 3]) of the samples ``idx`` of
    ``batch``, in their order (what the vision tower takes for a micro-batch of them), or None when
    they have no image. The patch width is the values over the patches their grids hold."""
    if "pixel_values" not in batch.tensors:
        return None
    pix, grid = batch.ragged("pixel_values"), batch.ragged("image_grid_thw")
    flat = torch.cat([pix[i] for i in idx]) if idx else torch.zeros(0)
    g = torch.cat([grid[i] for i in idx]).reshape(-1, 3) if idx else torch.zeros(0, 3, dtype=torch.int64)
    patches = int(g.prod(-1).sum()) if len(g) else 0
    if not patches:
        return None
    if flat.numel() % patches:
        raise ValueError(f"{flat.numel()} pixel values do not split into {patches} patches")
    return flat.reshape(patches, -1), g
