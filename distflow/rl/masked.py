"""Masked reductions and the shared input checks of every RL formula.

Why this module exists: every loss, estimator and KL term in ``distflow.rl`` reduces over
valid tokens only, in at least fp32, with masked positions contributing exactly 0 to the
value *and* the gradient even when they hold ``inf``/``NaN`` padding. That rule lives here
once. Shapes: ``B`` samples, ``T`` response tokens; ``mask`` is ``[B, T]`` bool or 0/1 float
(a float mask acts as per-token weights).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LOG_RATIO_CLAMP", "masked_sum", "masked_mean", "masked_whiten"]

LOG_RATIO_CLAMP = 20.0  # |log ratio| bound before exp(): keeps exp() finite in fp32


# ----------------------------------------------------------------------------- helpers
def _fp32(x: Tensor) -> Tensor:
    """Promote to at least fp32 (bf16/fp16/int -> fp32; fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _shape(t: Tensor) -> list[int]:
    return list(t.shape)


def _check_bt(name: str, t: Tensor, like: Tensor | None = None) -> None:
    _require(torch.is_tensor(t), f"{name}: expected a tensor, got {type(t).__name__}")
    if like is None:
        _require(t.dim() == 2, f"{name}: expected shape [B, T], got {_shape(t)}")
    else:
        _require(t.shape == like.shape, f"{name}: expected shape {_shape(like)} (like logprobs), got {_shape(t)}")


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """``x * mask`` in fp32 with masked positions forced to exactly 0 (no NaN/inf leak)."""
    x = _fp32(x)
    try:
        mask = torch.broadcast_to(mask, x.shape)
    except RuntimeError:
        raise ValueError(f"mask of shape {_shape(mask)} does not broadcast to values of shape {_shape(x)}") from None
    zero = x.new_zeros(())
    if mask.dtype == torch.bool:
        return torch.where(mask, x, zero)
    w = mask.to(x.dtype)
    return torch.where(w != 0, x * w, zero)


def _normalizer(token_normalizer: float | Tensor | None, mask: Tensor, like: Tensor) -> Tensor:
    """The divisor of a token-level sum: ``mask.sum()`` by default (1 if the mask is empty)."""
    if token_normalizer is None:
        n = _fp32(mask).sum().to(like.dtype)
        return torch.where(n > 0, n, torch.ones_like(n))
    if torch.is_tensor(token_normalizer):
        _require(token_normalizer.numel() == 1,
                 f"token_normalizer: expected a scalar, got shape {_shape(token_normalizer)}")
        n = token_normalizer.detach().reshape(()).to(device=like.device, dtype=like.dtype)
        if n.device.type == "cpu":  # checked only where it costs no device sync
            _require(bool(n > 0), f"token_normalizer must be > 0, got {float(n)}")
        return n
    _require(isinstance(token_normalizer, (int, float)) and token_normalizer > 0,
             f"token_normalizer must be a positive number or scalar tensor, got {token_normalizer!r}")
    return like.new_full((), float(token_normalizer))  # a fill kernel: new_tensor would upload and wait


# ----------------------------------------------------------------------------- masked reductions
def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of ``x * mask`` over ``dim`` (all dims if None), in fp32.

    x: ``[*S]``; mask: bool or float, broadcastable to ``[*S]``. Returns a scalar, or
    ``[*S]`` without ``dim``. Masked positions contribute exactly 0 even if ``x`` is inf/NaN there.
    """
    m = _masked(x, mask)
    return m.sum() if dim is None else m.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None, eps: float = 0.0) -> Tensor:
    """``masked_sum(x, mask, dim) / (mask.sum(dim) + eps)``, in fp32.

    x: ``[*S]``; mask broadcastable to ``[*S]``. Where the mask is empty (count + eps == 0)
    the mean is defined as 0 (never NaN, and no NaN gradient).
    """
    num = masked_sum(x, mask, dim)
    count = _fp32(torch.broadcast_to(mask, x.shape)).to(num.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    denom = count + eps
    empty = denom == 0
    return torch.where(empty, torch.zeros_like(num), num / torch.where(empty, torch.ones_like(denom), denom))


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalize ``x [B, T]`` to zero mean / unit (unbiased) variance over valid tokens; masked -> 0.

    Used by PPO on GAE advantages. With ``shift_mean=False`` the mean is added back.
    Returns ``[B, T]`` fp32; fewer than 2 valid tokens -> centred values, no scaling.
    """
    mean = masked_mean(x, mask)
    count = _fp32(torch.broadcast_to(mask, x.shape)).sum()
    centred = _masked(_fp32(x) - mean, mask)
    var = masked_sum(centred * centred, mask) / torch.clamp(count - 1, min=1.0)
    out = centred * torch.rsqrt(var + eps) if bool(count > 1) else centred
    if not shift_mean:
        out = out + mean
    return _masked(out, mask)
