"""The rollout engine's side of LoRA (``model.lora``): apply a synced adapter exactly, and prove it.

Why it exists: with LoRA a weight sync carries only the adapter tensors (``lora_A``/``lora_B`` of
each target module, the trainer's parameter names). The engine keeps an unmerged copy of each
target weight and, at every sync, sets the live weight to ``W_base + alpha / rank * B @ A``
computed in fp32 and cast once to the engine's dtype: a sync replaces the previous adapter, never
adds to it, and the engine's forward needs no adapter kernels (the CUDA-graph decode step reads
the live weights in place). A delta sync may carry some of the tensors: the engine holds the
current A and B of every module and merges what changed.

A sync that silently does nothing is the failure users report most (rollouts keep sampling the
base model while the trainer reports progress). So every applied version is checked: the trainer
sends the checksum of the whole adapter with each version's commit (``WeightInbox.checksums``), the
engine computes the same checksum over the adapter it applied (:meth:`AdapterTarget.checksum`), and
:func:`verify_applied` raises :class:`WeightSyncError`, naming the version, when they differ or
when either is missing. The node then also gossips the version and its checksum, which the serving
trainer rank compares with what it published (``trainer.worker.check_reported_adapters``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from distflow.rollout.protocol import Weights, head
from distflow.rollout.weight_loading import _non_finite
from distflow.weights.adapter import adapter_checksum, adapter_names, target_linears

__all__ = ["AdapterTarget", "WeightSyncError", "verify_applied"]


class WeightSyncError(RuntimeError):
    """A weight sync the engine did not apply exactly (a checksum mismatch, a missing checksum)."""


class AdapterTarget:
    """What ``load_weights`` of a LoRA run writes: the target modules' live weights, merged from an
    unmerged base copy and the adapter. The same interface as ``weight_loading.WeightTarget``
    (:meth:`validate`, :meth:`copy_in`), so the engine's load and mid-generation swap use either."""

    def __init__(self, model: torch.nn.Module, rank: int, alpha: float, target_modules: list[str]):
        self.modules = target_linears(model, target_modules)
        if not self.modules:
            raise ValueError(f"model.lora.target_modules: {list(target_modules)} matches no nn.Linear module of the "
                             "rollout engine's model")
        self.rank, self.scale = int(rank), float(alpha) / int(rank)
        shared = {id(p) for n, p in model.named_parameters(remove_duplicate=False)
                  if not any(n == f"{m}.weight" for m in self.modules)}
        for m in self.modules.values():  # a tied LM head: merging into it would change the embedding too,
            if id(m.weight) in shared:  # which the adapter does not touch (PEFT adds B @ A to the head's output)
                m.weight = torch.nn.Parameter(m.weight.detach().clone(), requires_grad=False)
        self.base = {n: m.weight.detach().clone() for n, m in self.modules.items()}  # unmerged, engine dtype
        self.expected: dict[str, tuple[str, tuple[int, int]]] = {}  # adapter name -> (module, shape)
        for n, m in self.modules.items():
            a, b = adapter_names(n)
            self.expected[a] = (n, (self.rank, m.in_features))
            self.expected[b] = (n, (m.out_features, self.rank))
        self.held: dict[str, torch.Tensor] = {}  # the adapter applied now (fp32, on the engine's device)
        self._checksum: str | None = None  # of ``held``, computed once per applied version (the node asks often)

    def validate(self, version: int, weights: Weights, partial: bool = False) -> list[Mapping[str, torch.Tensor]]:
        """Check every bucket's names (adapter tensors of the target modules only), shapes and values;
        a full version (``partial`` False, or nothing applied yet) must hold every adapter tensor.
        Raises ValueError naming the version and the offending keys (nothing applied)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weights version must be an int >= 0, got {version!r}")
        buckets = [weights] if isinstance(weights, Mapping) else list(weights)
        given = {k: v for b in buckets for k, v in b.items()}
        problems = []
        if unexpected := sorted(k for k in given if k not in self.expected):
            problems.append(f"not an adapter tensor of model.lora.target_modules: {head(unexpected)}")
        if missing := ([] if partial and self.held else sorted(k for k in self.expected if k not in given)):
            problems.append(f"missing {len(missing)} adapter tensor(s): {head(missing)}")
        bad_shape = sorted(f"{k}: got {list(v.shape)}, expected {list(self.expected[k][1])}" for k, v in given.items()
                           if k in self.expected and tuple(v.shape) != self.expected[k][1])
        if bad_shape:
            problems.append(f"shape mismatch (model.lora.rank {self.rank}?): {head(bad_shape)}")
        if not problems and (bad := _non_finite(list(given.items()))):
            problems.append(f"non-finite values in: {head(bad)}")
        if problems:
            raise ValueError(f"load_weights(version={version}) rejected the LoRA adapter: " + "; ".join(problems))
        return buckets

    @torch.no_grad()
    def copy_in(self, buckets: list[Mapping[str, torch.Tensor]]) -> None:
        """Hold the new A/B tensors (fp32 copies) and re-merge every module they touch:
        ``W = W_base + scale * B @ A`` in fp32, cast to the live weight's dtype, copied in place."""
        touched = set()
        self._checksum = None
        for b in buckets:
            for k, v in b.items():
                module = self.expected[k][0]
                self.held[k] = v.detach().to(self.base[module].device, torch.float32, copy=True)
                touched.add(module)
        for module in touched:
            a, b = adapter_names(module)
            if a not in self.held or b not in self.held:
                continue  # (validate refuses a first version without both)
            merged = self.base[module].float() + self.scale * (self.held[b] @ self.held[a])
            self.modules[module].weight.copy_(merged)

    def checksum(self) -> str | None:
        """The checksum of the adapter this engine applied (None: none yet), as the trainer computes it."""
        if self._checksum is None and self.held:
            self._checksum = adapter_checksum(self.held)
        return self._checksum


def verify_applied(engine: Any, checksums: Mapping[int, str | None]) -> tuple[int, str | None]:
    """The engine's ``(version, checksum)``, checked against the checksum the trainer's commit of that
    version carried (``checksums``: the weight inbox's). Version 0 (the base weights, nothing synced)
    passes. Raises :class:`WeightSyncError` naming the version when the engine holds no adapter, when
    the commit carried no checksum, or when the two differ."""
    version = int(engine.version)
    got = engine.weights_checksum()
    if version == 0:
        return version, got
    if version not in checksums:
        raise WeightSyncError(f"weights v{version}: the engine holds a version whose commit this node never "
                              "received a checksum for (model.lora: every sync is verified)")
    want = checksums[version]
    if want is None:
        raise WeightSyncError(f"weights v{version}: the trainer's commit carried no adapter checksum, so what the "
                              "engine applied cannot be verified (model.lora: trainer and rollout nodes must run the "
                              "same DistFlow)")
    if got != want:
        raise WeightSyncError(f"weights v{version}: the engine applied an adapter with checksum {got!r}, but the "
                              f"trainer published {want!r}: the sync did not reach the engine exactly, and its "
                              "rollouts would not come from the trained policy (model.lora)")
    return version, got
