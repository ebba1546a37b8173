"""LoRA on the trainer (``model.lora``): PEFT adapters over a frozen base, saved in PEFT's format.

Why it exists: training only low-rank adapters makes a policy update touch a few MB instead of the
whole model, and a weight sync carry only those MB. The adapters are PEFT's own LoRA layers,
injected in place (``peft.inject_adapter_in_model``), so the model stays the transformers model
the rest of the trainer knows (the decoder layers FSDP2 shards, ``response_forward``): only the
target ``nn.Linear`` modules become PEFT ``lora.Linear`` modules, their base weight frozen
(``<module>.base_layer.weight``) beside a trainable ``lora_A``/``lora_B``. FSDP2 shards the frozen
base with the adapters; the optimizer holds the adapters only.

The checkpoint is a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``,
loadable with ``peft.PeftModel.from_pretrained(base, dir)``), and a run resumes from one by loading
the base from ``model_path`` and the adapter from it (:func:`load_adapter`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from distflow.weights.adapter import ADAPTER, is_adapter, target_linears

__all__ = ["ADAPTER_FILE", "inject_lora", "load_adapter", "peft_config", "save_adapter"]

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # what a PeftModel's state dict puts before the model's own names


def peft_config(lora: Any, base: str | None = None) -> Any:
    """A ``peft.LoraConfig`` from the config's ``model.lora`` section (``base``: the base model's path)."""
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                      lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base)


def inject_lora(model: torch.nn.Module, lora: Any, path: str = "") -> torch.nn.Module:
    """Put PEFT LoRA adapters on ``model``'s target modules in place (base frozen, adapters
    trainable) and return it. A target list that matches no linear module is a ConfigError naming
    ``model.lora.target_modules`` and the linear modules the model has (by their last name part)."""
    from peft import inject_adapter_in_model

    from distflow.core.config_keys import ConfigError

    if not target_linears(model, lora.target_modules):
        have = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(f"model.lora.target_modules: {list(lora.target_modules)} matches no nn.Linear module of "
                          f"the model {path!r}; its linear modules are named {have}")
    with warnings.catch_warnings():  # PEFT warns of an adapter on a tied LM head: the adapter is the head's
        warnings.filterwarnings("ignore", message=".*tied layer is part of the adapter")  # alone, the base stays tied
        model = inject_adapter_in_model(peft_config(lora), model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():  # PEFT froze the rest; said here, not assumed
        p.requires_grad_(is_adapter(name))
    return model


def to_peft_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Trainer adapter names -> PEFT's saved names (``model.layers.0...lora_A.default.weight`` ->
    ``base_model.model.model.layers.0...lora_A.weight``)."""
    return {PEFT_PREFIX + k.replace(f".{ADAPTER}.", "."): v for k, v in state.items() if is_adapter(k)}


def from_peft_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_peft_names`."""
    out = {}
    for k, v in state.items():
        name = k.removeprefix(PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            name = name.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
        out[name] = v
    return out


def save_adapter(out_dir: Path, state: dict[str, torch.Tensor], lora: Any, base: str) -> None:
    """Write ``state``'s adapter tensors (trainer names, fp32) as a PEFT adapter directory."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in to_peft_names(state).items()}
    save_file(tensors, str(out_dir / ADAPTER_FILE), metadata={"format": "pt"})
    peft_config(lora, base).save_pretrained(str(out_dir))


def load_adapter(model: torch.nn.Module, ckpt: Path) -> None:
    """Copy the adapter of the PEFT directory ``ckpt`` into ``model`` (injected, not yet sharded).
    Every adapter parameter of the model must be in the file, with its shape: a checkpoint of
    another rank or target list is an error naming ``resume_from``, not a half-loaded adapter."""
    from safetensors.torch import load_file

    saved = from_peft_names(load_file(str(ckpt / ADAPTER_FILE)))
    own = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    wrong = sorted(set(own) ^ set(saved)) + sorted(n for n in own if n in saved and saved[n].shape != own[n].shape)
    if wrong:
        cfg = json.loads((ckpt / CONFIG_FILE).read_text()) if (ckpt / CONFIG_FILE).is_file() else {}
        raise ValueError(f"resume_from: the adapter in {ckpt} (r={cfg.get('r')}, target_modules="
                         f"{cfg.get('target_modules')}) does not fit model.lora: {len(wrong)} tensor(s) differ, "
                         f"e.g. {wrong[:3]}")
    with torch.no_grad():
        for n, p in own.items():
            p.copy_(saved[n])
