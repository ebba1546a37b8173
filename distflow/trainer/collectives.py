"""Every collective a trainer rank calls, counted, so the hang watch knows which one each rank is in.

Why it exists: a rank that hangs between two of the model's collectives (a kernel that never
returns, a loss function stuck, one FSDP all-gather it never reaches) leaves the other ranks waiting
inside the next collective of the same stage, and the stage counters (``beat``) are then equal. The
count of collectives each rank has called in the stage tells them apart, and a collective that every
rank entered but that never completes shows as pending on all of them (:mod:`distflow.progress`,
whose :data:`~distflow.progress.PROGRESS` this module feeds).

What is counted: FSDP2's all-gathers and reduce-scatters, through FSDP2's own comm hooks
(``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``, :func:`count_fsdp`: the
default comms, wrapped), and distflow's own collectives (:func:`counted`: the step's metric sums,
the weight gathers, the buffer broadcast, the Ulysses all-to-alls, ...). DTensor's functional
collectives (tensor parallel, the gradient norm) are not counted: every rank skips the same ones, so
the counts stay comparable. A torch without those hooks counts only distflow's own (logged once).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from distflow.core.once import log_once
from distflow.progress import PROGRESS

log = logging.getLogger(__name__)

__all__ = ["CountedAllGather", "CountedReduceScatter", "count_fsdp", "counted"]


def counted(name: str, fn: Callable[..., Any], /, *args: Any, nbytes: int = 0, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a collective called ``name``, counted: entered before the call, done when it
    returns or, with ``async_op=True``, when its work completes."""
    entry = PROGRESS.enter(name, nbytes or _nbytes(args))
    try:
        out = fn(*args, **kwargs)
    except BaseException:
        PROGRESS.left(entry)
        raise
    if kwargs.get("async_op"):
        PROGRESS.issued(entry, out)
    else:
        PROGRESS.left(entry)
    return out


def _nbytes(args: tuple) -> int:
    """The size of a collective's first tensor argument (its output, for the gathers), 0 when none."""
    for a in args:
        if torch.is_tensor(a):
            return a.numel() * a.element_size()
        if isinstance(a, (list, tuple)) and a and all(torch.is_tensor(t) for t in a):
            return sum(t.numel() * t.element_size() for t in a)
    return 0


class CountedAllGather:
    """FSDP2's default all-gather, counted (FSDP2's ``AllGather`` comm interface: ``allocate`` and the call)."""

    def __init__(self, inner: Any):
        self.inner = inner

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        return counted("all_gather", self.inner, output_tensor, input_tensor, group, async_op=async_op)


class CountedReduceScatter:
    """FSDP2's default reduce-scatter, counted (its ``ReduceScatter`` comm interface)."""

    def __init__(self, inner: Any):
        self.inner = inner

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        return counted("reduce_scatter", self.inner, output_tensor, input_tensor, group, op, async_op=async_op,
                       nbytes=input_tensor.numel() * input_tensor.element_size())


def _warn_once(why: str) -> None:
    log_once(log, f"collectives.fsdp:{why}", logging.WARNING, "the hang watch does not count FSDP2's collectives: "
             "%s; it counts distflow's own (a hang between two of the model's all-gathers is named only by "
             "collective_timeout_s)", why)


def count_fsdp(model: torch.nn.Module) -> int:
    """Count the all-gathers and reduce-scatters of every FSDP2 unit of ``model`` (its default comms
    wrapped). Returns how many units count; 0 (logged once) where this torch has no comm hooks."""
    from torch.distributed.fsdp import FSDPModule

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    except ImportError:
        _warn_once(f"torch {torch.__version__} has no FSDP2 default comms to wrap")
        return 0
    if not hasattr(FSDPModule, "set_custom_all_gather"):
        _warn_once(f"torch {torch.__version__} has no FSDPModule.set_custom_all_gather")
        return 0
    units = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            try:
                m.set_custom_all_gather(CountedAllGather(DefaultAllGather()))
                m.set_custom_reduce_scatter(CountedReduceScatter(DefaultReduceScatter()))
            except ValueError as e:  # (several parameter groups in one unit: FSDP2 refuses a custom comm)
                _warn_once(f"{type(m).__name__}: {e}")
                continue
            units += 1
    return units
