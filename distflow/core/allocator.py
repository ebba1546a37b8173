"""Keep freed buffers in the process instead of handing them back to the kernel every step.

Why: a data-plane process allocates the same few-MiB buffers every step (a consumer joins
the parts of a step into one batch; a trainer packs micro-batches). glibc returns a freed
block above its mmap threshold to the kernel at once, and trims the heap top past its trim
threshold, so the next step's buffer is page-faulted and zeroed by the kernel anew: in
``bench/redistribute.py`` that was about a tenth of the peer-to-peer handoff's CPU. Raising
both thresholds once per process keeps those buffers for reuse; blocks of 32 MiB and more
(weights, checkpoints) are still mapped and unmapped on their own.

Not a buffer pool: the data plane's pools (``distflow/transport/pool.py``) keep the buffers
whose memory they own warm; this keeps glibc from returning the others (numpy / torch arrays a
step allocates) to the kernel.

Linux/glibc only (elsewhere, or with ``DISTFLOW_MALLOC_TUNING=0``, nothing changes). Nodes
call :func:`keep_freed_memory` at start-up; so do the benchmark's workers, as nodes do.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

# mallopt(3) parameters
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 256 << 20  # free heap top kept before trimming: a few steps' buffers


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; True when they were set."""
    if os.environ.get("DISTFLOW_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc; musl has no mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.debug("mallopt refused the thresholds; the allocator keeps its defaults")
    return ok
