"""Count the scalar reads (``float(t)``, ``t.item()``, ``bool(t)``: ``aten._local_scalar_dense``)
that a block of trainer code makes, by the distflow file that makes them, and the tensors it
builds from host data (``torch.tensor``, ``new_tensor``: ``aten.lift_fresh``, on a GPU a
blocking upload that waits for the stream just as a read does).

Why: on a GPU each such read of a device tensor waits for the GPU to drain its queue. A
trainer loop that reads a value back per micro-batch cannot queue the next micro-batch (nor
FSDP2 its prefetching all-gathers) while the GPU finishes this one. CI has no GPU, so the
tests count the reads on CPU instead: the count a file makes must not grow with the number
of micro-batches.
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """``with HostReads() as r: ...``; then ``r.by_file["actor.py"]`` is that distflow file's count, and
    ``r.by_caller["masking_utils.py"]`` the count of the innermost file outside torch (a library's too);
    ``r.uploads`` counts the tensors built from host data."""

    def __init__(self) -> None:
        super().__init__()
        self.by_file: collections.Counter[str] = collections.Counter()
        self.by_caller: collections.Counter[str] = collections.Counter()
        self.uploads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default:
            self.uploads += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            stack = traceback.extract_stack()[:-1]
            frames = [f for f in stack if "/distflow/" in f.filename]
            if frames:
                self.by_file[frames[-1].filename.rsplit("/", 1)[-1]] += 1
            outside = [f for f in stack if "/torch/" not in f.filename]
            if outside:
                self.by_caller[outside[-1].filename.rsplit("/", 1)[-1]] += 1
        return func(*args, **(kwargs or {}))
