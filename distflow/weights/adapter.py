"""LoRA adapter names, target matching and the checksum both ends of a weight sync compute.

Why it exists: with ``model.lora`` a weight sync carries only the adapter tensors, and the most
reported LoRA failure is a sync that silently does nothing (the rollout engine keeps sampling the
base model). So the trainer and the rollout engine must agree on three things without importing
each other: which modules carry an adapter (PEFT's matching rule, :func:`target_linears`), what
the adapter tensors are called (the trainer's parameter names, :func:`adapter_names`), and one
checksum of a whole adapter (:class:`AdapterDigest`): the trainer sends it in each version's
commit, the engine computes it over what it applied, and a difference is an error naming the
version (:mod:`distflow.rollout.lora_apply`). Torch only, no PEFT: a rollout node needs none.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Mapping

import torch

ADAPTER = "default"  # PEFT's adapter name: the trainer's parameters are <module>.lora_A.default.weight


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter tensor (A or B) of the trainer's model."""
    return ".lora_A." in name or ".lora_B." in name


def matches(module: str, targets: Iterable[str]) -> bool:
    """PEFT's rule for a list of ``target_modules``: the module's name is an entry, or ends with
    ``.`` + the entry (``q_proj`` matches ``model.layers.0.self_attn.q_proj``)."""
    return any(module == t or module.endswith("." + t) for t in targets)


def target_linears(model: torch.nn.Module, targets: Iterable[str]) -> dict[str, torch.nn.Linear]:
    """The ``nn.Linear`` modules of ``model`` that ``targets`` name, by module name, in model order."""
    targets = list(targets)
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and matches(n, targets)}


def adapter_names(module: str) -> tuple[str, str]:
    """The trainer's parameter names of one module's adapter: (A ``[r, in]``, B ``[out, r]``)."""
    return f"{module}.lora_A.{ADAPTER}.weight", f"{module}.lora_B.{ADAPTER}.weight"


def tensor_digest(name: str, t: torch.Tensor) -> bytes:
    """blake2b of one named tensor: its name, dtype, shape and bytes (on the host)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
    h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


class AdapterDigest:
    """The checksum of a whole adapter, fed tensor by tensor in any order (the trainer feeds the
    buckets as the gather yields them): blake2b over the tensors' digests in name order. Equal
    checksums mean the same names, dtypes, shapes and bytes."""

    def __init__(self) -> None:
        self.parts: dict[str, bytes] = {}

    def update(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.parts[name] = tensor_digest(name, t)

    def hexdigest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(self.parts):
            h.update(self.parts[name])
        return h.hexdigest()


def adapter_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """:class:`AdapterDigest` of ``tensors`` in one call."""
    d = AdapterDigest()
    d.update(tensors)
    return d.hexdigest()
