"""torch.distributed groups for tests, rendezvoused through a FileStore.

Why: a TCP rendezvous needs a free port (which another test's connection can take between the
check and the bind), and its store server lives in rank 0: when rank 0 exits first, a slower
rank still tearing its group down loses the store and aborts ("terminate called without an
active exception"). A FileStore has neither problem. Each group gets its own fresh file. A rank
that exits while another still tears its gloo group down aborts that one the same way, so no
rank leaves before all have torn down (a file per rank beside the store).
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

_seq = itertools.count()


def store_path(directory: str | os.PathLike | None = None) -> str:
    """A path for a new FileStore (the file must not exist yet)."""
    base = str(directory) if directory is not None else tempfile.mkdtemp(prefix="distflow-pg-")
    return os.path.join(base, f"store-{os.getpid()}-{next(_seq)}")


@contextmanager
def process_group(store: str, rank: int = 0, world: int = 1, backend: str = "gloo", **kw: Any) -> Iterator[None]:
    """Join a group for the block (``kw``: more ``init_process_group`` arguments, e.g. ``device_id``);
    every rank waits for the others before leaving it."""
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world, **kw)
    ok = False
    try:
        yield
        if world > 1:
            dist.barrier()
        ok = True
    finally:
        dist.destroy_process_group()
    if ok and world > 1:
        _exit_barrier(store, rank, world)


def _exit_barrier(store: str, rank: int, world: int, timeout: float = 60.0) -> None:
    """Wait (bounded) until every rank has torn its group down. A rank that exits while another is
    still in ``destroy_process_group`` closes gloo's connections under it, and gloo's thread then
    aborts that process ("terminate called without an active exception")."""
    import time

    marks = f"{store}.exit"
    os.makedirs(marks, exist_ok=True)
    open(os.path.join(marks, str(rank)), "w").close()
    deadline = time.monotonic() + timeout
    while len(os.listdir(marks)) < world and time.monotonic() < deadline:
        time.sleep(0.01)
