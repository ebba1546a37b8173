"""In-place, bucket-by-bucket weight loading into a live model.

Why it exists: a rollout node receives a new weight version as a stream of buckets (see
:mod:`distflow.weights`). Loading must be all or nothing (a bad name, shape or dtype
anywhere leaves the current weights untouched), accept a tied parameter under any of its
names, and copy each bucket straight into the model's parameters on the engine's device
without ever building a second full copy of the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from distflow.weights import tied_names
from distflow.rollout.protocol import Weights, head

__all__ = ["WeightTarget"]


class WeightTarget:
    """The named tensors of one model that ``load_weights`` may overwrite."""

    def __init__(self, model: torch.nn.Module):
        # keep_vars: the live Parameter objects themselves, no copies.
        self.own: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self.aliases = {n: names for names in tied_names(model) for n in names}

    def validate(self, version: int, weights: Weights, partial: bool = False) -> list[Mapping[str, torch.Tensor]]:
        """Check names, types, shapes, dtypes and finiteness of every bucket; return the
        buckets as a list. ``partial``: a delta, so absent names keep their current values.
        Raises ValueError naming the offending keys (nothing applied)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weights version must be an int >= 0, got {version!r}")
        if isinstance(weights, Mapping):
            buckets: list[Mapping[str, torch.Tensor]] = [weights]
        elif isinstance(weights, Iterable) and not isinstance(weights, (str, bytes, torch.Tensor)):
            buckets = list(weights)
            for i, b in enumerate(buckets):
                if not isinstance(b, Mapping):
                    raise TypeError(f"weights bucket {i} must be a mapping of name -> tensor, got {type(b).__name__}")
        else:
            raise TypeError("weights must be a mapping of name -> tensor or an iterable of such buckets, "
                            f"got {type(weights).__name__}")
        own = self.own
        given = {k for b in buckets for k in b}  # a name may repeat across buckets: the later one wins
        unexpected = sorted(k for k in given if k not in own)
        missing = [] if partial else sorted(k for k in own if k not in given
                                            and not any(a in given for a in self.aliases.get(k, ())))
        items = [(k, v) for b in buckets for k, v in b.items() if k in own]
        bad_type = sorted(k for k, v in items if not isinstance(v, torch.Tensor))
        items = [(k, v) for k, v in items if isinstance(v, torch.Tensor)]
        bad_shape = sorted(f"{k}: got {list(v.shape)}, expected {list(own[k].shape)}" for k, v in items
                           if v.shape != own[k].shape)
        bad_dtype = sorted(f"{k}: got {v.dtype}, expected {own[k].dtype}" for k, v in items
                           if v.is_floating_point() != own[k].is_floating_point() or v.is_complex())
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} key(s): {head(missing)}")
        if unexpected:
            problems.append(f"unexpected {len(unexpected)} key(s): {head(unexpected)}")
        if bad_type:
            problems.append(f"non-tensor value(s) for: {head(bad_type)}")
        if bad_shape:
            problems.append(f"shape mismatch: {head(bad_shape)}")
        if bad_dtype:
            problems.append(f"dtype mismatch: {head(bad_dtype)}")
        if not problems:
            bad_values = _non_finite(items)
            if bad_values:
                problems.append(f"non-finite values in: {head(bad_values)}")
        if problems:
            raise ValueError(f"load_weights(version={version}) rejected the state dict: " + "; ".join(problems))
        return buckets

    @torch.no_grad()
    def copy_in(self, buckets: list[Mapping[str, torch.Tensor]]) -> None:
        """Copy validated buckets into the parameters, one bucket at a time and in order (a
        name repeated in a later bucket wins; dtypes cast; asynchronous from pinned host
        memory, then one synchronisation)."""
        cuda: set[torch.device] = set()
        for b in buckets:
            for k, v in b.items():
                dst = self.own[k]
                async_ok = dst.device.type == "cuda" and v.device.type == "cpu" and v.is_pinned()
                dst.copy_(v, non_blocking=async_ok)
                if dst.device.type == "cuda":
                    cuda.add(dst.device)
        for dev in cuda:  # the copies ran on each parameter device's current stream: the sources may be
            torch.cuda.current_stream(dev).synchronize()  # freed or reused once we return (a stream sync:
            # a device-wide one would break another engine's graph capture in this process)


def _finite(v: torch.Tensor) -> torch.Tensor:
    """Whether ``v`` holds no NaN/inf, as a device bool: from its max and min (a NaN propagates
    through both, an inf is one of them), not ``isfinite(v).all()``, whose mask is one byte per
    element (0.5 GB for a 152k x 3.5k embedding, on a GPU whose KV cache took most of it)."""
    if v.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=v.device)
    return torch.isfinite(torch.stack([v.amax(), v.amin()])).all()


def _non_finite(items: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of floating tensors with a NaN/inf, with one host sync per device."""
    by_dev: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for k, v in items:
        if v.is_floating_point():
            by_dev.setdefault(v.device, []).append((k, v))
    bad: list[str] = []
    for entries in by_dev.values():
        flags = torch.stack([_finite(v) for _, v in entries]).tolist()
        bad.extend(k for (k, _), ok in zip(entries, flags) if not ok)
    return sorted(bad)
