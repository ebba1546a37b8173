"""The one place a process chooses its torch device.

Why it exists: every tensor handed to a collective must live on the process group's
device, and a node must never open a GPU the launcher did not give it. ``distflow run``
(and the pdsh/compose launchers) give each node its GPUs through ``CUDA_VISIBLE_DEVICES``,
so inside a node its first visible GPU is always ``cuda:0``. Everything that picks a
device (the trainer's FSDP mesh, the rollout engine, collectives' scratch tensors, the
NCCL channel) calls :func:`node_device` instead of ``torch.cuda.current_device()``.

The current CUDA device is per THREAD (``torch.cuda.set_device`` only affects the thread
that calls it), and a node runs its torch work in asyncio worker threads, a different one
each time. So :func:`node_device` remembers its choice for the process,
:func:`collective_device` returns that (not the calling thread's current device), and
whatever runs in a worker thread and relies on the current device (FSDP2's streams,
``all_gather_object``, ``barrier``) is entered through :func:`on_device` /
:func:`call_on` / :func:`iterate_on`. With ``DISTFLOW_LOCAL_GPU`` unset every thread's
default, ``cuda:0``, happens to be right; with it set, nothing else would be.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, TypeVar

import torch

__all__ = ["COMPUTE_DTYPES", "call_on", "chosen_device", "collective_device", "gpu_identity", "gpu_sharers",
           "iterate_on", "local_gpu_index", "node_device", "on_device", "peak_flops", "private_stream"]

T = TypeVar("T")

# The compute dtypes a config may name (trainer ``dtype``, a reward model's ``args.dtype``).
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# This process's GPU once node_device("cuda") chose it (None before, and on CPU).
_CHOSEN: torch.device | None = None


def local_gpu_index() -> int:
    """Which of its visible GPUs this node uses: ``$DISTFLOW_LOCAL_GPU`` (set by a launcher that
    shares one CUDA_VISIBLE_DEVICES list between several nodes), else 0. Read from the
    environment without touching CUDA; raises ValueError naming the variable when it is not
    a non-negative int."""
    raw = os.environ.get("DISTFLOW_LOCAL_GPU", "").strip() or "0"
    try:
        index = int(raw)
    except ValueError:
        index = -1
    if index < 0:
        raise ValueError(f"DISTFLOW_LOCAL_GPU must be a non-negative GPU index, got {raw!r}")
    return index


def node_device(kind: str = "cpu") -> torch.device:
    """``"cpu"`` -> cpu; ``"cuda"`` -> this node's GPU (``cuda:0`` of its visible devices, or
    ``cuda:$DISTFLOW_LOCAL_GPU`` when a launcher shares one CUDA_VISIBLE_DEVICES list between
    several nodes), remembered for the process (:func:`chosen_device`) and made the calling
    thread's current device. Raises a clear error when CUDA was asked for and there is none."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {kind!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("device: cuda was asked for but torch sees no CUDA GPU "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r})")
    index = local_gpu_index()
    if index >= torch.cuda.device_count():
        raise RuntimeError(f"DISTFLOW_LOCAL_GPU={index} but only {torch.cuda.device_count()} GPU(s) are visible")
    global _CHOSEN
    _CHOSEN = torch.device("cuda", index)
    torch.cuda.set_device(_CHOSEN)  # the calling thread's only: see on_device for the others
    return _CHOSEN


def gpu_identity() -> str:
    """Which physical GPU :func:`node_device` opens, as the launcher named it (an entry of
    ``CUDA_VISIBLE_DEVICES``, an index or a UUID; the index itself when that is unset), read
    from the environment without touching CUDA. Two nodes on one host with the same identity
    share a GPU: only they can hand each other CUDA IPC handles (a process cannot open memory
    of a GPU it does not see)."""
    index = local_gpu_index()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    names = [v.strip() for v in visible.split(",") if v.strip()]
    return names[index] if 0 <= index < len(names) else f"?{visible}#{index}"


def chosen_device() -> torch.device | None:
    """The GPU :func:`node_device` chose for this process, or None (not yet, or CPU)."""
    return _CHOSEN


def gpu_sharers() -> int:
    """How many nodes of the run share this node's GPU (``DISTFLOW_GPU_NODES``, set by the
    launcher's placement; 1 when unset or malformed)."""
    from distflow.core.launch_env import GPU_NODES_ENV  # noqa: PLC0415 - pure, no torch

    raw = os.environ.get(GPU_NODES_ENV, "1")
    return int(raw) if raw.isdigit() and int(raw) >= 1 else 1


def collective_device(group=None) -> torch.device:
    """The device a collective on ``group`` needs its tensors on: this node's GPU for NCCL
    (whatever thread asks), cpu for gloo."""
    import torch.distributed as dist

    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    return _CHOSEN if _CHOSEN is not None else node_device("cuda")


@contextlib.contextmanager
def on_device(device: torch.device | str | None) -> Iterator[None]:
    """Make ``device`` the calling thread's current CUDA device for the block (the previous
    one is restored after); a no-op for None or a CPU device."""
    device = None if device is None else torch.device(device)
    if device is None or device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


def call_on(device: torch.device | str | None, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` inside :func:`on_device` (for ``asyncio.to_thread``)."""
    with on_device(device):
        return fn(*args, **kwargs)


def iterate_on(device: torch.device | str | None, it: Iterator[T]) -> Iterator[T]:
    """``it``'s items, each ``next(it)`` run inside :func:`on_device` and no device context
    held across a yield (the next item may be asked for from another thread)."""
    while True:
        with on_device(device):
            try:
                item = next(it)
            except StopIteration:
                return
        yield item


def private_stream(device: torch.device) -> tuple[Any, Any]:
    """(a CUDA stream of the caller's own, the object that owns it) on ``device``.

    ``torch.cuda.Stream()`` hands out torch's pool streams round-robin (32 per priority and
    device), shared with whatever else asks, torch.distributed's NCCL streams among them: another
    thread's collective could then land in a CUDA graph being captured on that stream, or queue
    behind a receive waiting on a dead peer. cupy (which the GPU data plane needs) creates a new
    stream; without cupy the pool's is returned. Keep ``owner`` referenced for as long as the
    stream may have work: the stream is destroyed with it."""
    try:
        import cupy  # noqa: PLC0415
    except ImportError:
        return torch.cuda.Stream(device), None
    device = torch.device(device)
    with cupy.cuda.Device(device.index if device.index is not None else torch.cuda.current_device()):
        owner = cupy.cuda.Stream(non_blocking=True)
    return torch.cuda.ExternalStream(owner.ptr, device=device), owner


# Dense (no sparsity) peak FLOP/s of one GPU, by a substring of torch.cuda.get_device_name()
# (first match wins: the more specific names come first): (bf16/fp16 tensor cores, fp32 without
# tensor cores; None where not listed here). fp32 matmuls run on TF32 tensor cores, at half the
# bf16 figure, only when torch is told to (off by default: :func:`tf32_matmuls`). Vendor data sheets.
# A GH200's GPU is an H100 SXM's ("H200" matches it, with the same figures); an H20 is listed after
# the H200s, a GB200 before the B200; AMD's Instinct GPUs go by the same name (ROCm's torch.cuda).
PEAK_FLOPS = (("H200 NVL", 835e12, 60e12), ("H200", 989e12, 67e12), ("H100 PCIe", 756e12, 51e12),
              ("H100 NVL", 835e12, 60e12), ("H100", 989e12, 67e12), ("H800 PCIe", 756e12, 51e12),
              ("H800", 989e12, 67e12), ("H20", 148e12, 44e12), ("GB200", 2500e12, None), ("B200", 2250e12, None),
              ("B100", 1750e12, None), ("A100", 312e12, 19.5e12), ("A800", 312e12, 19.5e12),
              ("L40S", 362e12, 91.6e12), ("L40", 181e12, 90.5e12), ("L4", 121e12, 30.3e12),
              ("RTX 4090", 165.2e12, 82.6e12), ("RTX A6000", 154.8e12, 38.7e12),
              ("MI325X", 1307.4e12, 163.4e12), ("MI300X", 1307.4e12, 163.4e12), ("MI250X", 383e12, 47.9e12))


def tf32_matmuls() -> bool:
    """Whether torch runs fp32 CUDA matmuls on TF32 tensor cores (its default: no). Reads the
    new setting and the legacy flag (torch refuses some reads once both APIs were used), after
    the environment overrides: ``NVIDIA_TF32_OVERRIDE=0`` (the driver's: never) and
    ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` (torch's: always)."""
    if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        return False
    if os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1":
        return True
    for read in (lambda: torch.backends.cuda.matmul.fp32_precision == "tf32",
                 lambda: bool(torch.backends.cuda.matmul.allow_tf32)):
        try:
            if read():
                return True
        except (AttributeError, RuntimeError):
            pass
    return False


def peak_flops(device_name: str | None, dtype: str, tf32: bool | None = None) -> float | None:
    """Peak FLOP/s of one ``device_name`` GPU computing in ``dtype`` ("bfloat16", "float16",
    "float32"; fp32 on TF32 tensor cores when ``tf32``, default :func:`tf32_matmuls`), or None
    for a device or figure not in :data:`PEAK_FLOPS` (or the CPU: None)."""
    if not device_name:
        return None
    for key, half, fp32 in PEAK_FLOPS:
        if key in device_name:
            if dtype in ("bfloat16", "float16"):
                return half
            return half / 2 if (tf32_matmuls() if tf32 is None else tf32) else fp32
    return None
