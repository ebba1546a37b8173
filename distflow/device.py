"""The one place a process chooses its torch device.

Why it exists: every tensor handed to a collective must live on the process group's
device, and a node must never open a GPU the launcher did not give it. ``distflow run``
(and the pdsh/compose launchers) give each node its GPUs through ``CUDA_VISIBLE_DEVICES``,
so inside a node its first visible GPU is always ``cuda:0``. Everything that picks a
device (the trainer's FSDP mesh, the rollout engine, collectives' scratch tensors, the
NCCL channel) calls :func:`node_device` instead of ``torch.cuda.current_device()``.
"""

from __future__ import annotations

import os

import torch

__all__ = ["collective_device", "node_device", "peak_flops"]


def node_device(kind: str = "cpu") -> torch.device:
    """``"cpu"`` -> cpu; ``"cuda"`` -> this node's GPU (``cuda:0`` of its visible devices, or
    ``cuda:$DISTFLOW_LOCAL_GPU`` when a launcher shares one CUDA_VISIBLE_DEVICES list between
    several nodes). Raises a clear error when CUDA was asked for and there is none."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {kind!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("device: cuda was asked for but torch sees no CUDA GPU "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r})")
    index = int(os.environ.get("DISTFLOW_LOCAL_GPU", "0"))
    if not 0 <= index < torch.cuda.device_count():
        raise RuntimeError(f"DISTFLOW_LOCAL_GPU={index} but only {torch.cuda.device_count()} GPU(s) are visible")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def collective_device(group=None) -> torch.device:
    """The device a collective on ``group`` needs its tensors on: the current GPU for NCCL,
    cpu for gloo."""
    import torch.distributed as dist

    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


# Dense (no sparsity) bf16/fp16 tensor-core peak FLOP/s of one GPU, by a substring of
# torch.cuda.get_device_name() (first match wins: the more specific names come first).
# fp32 compute runs on TF32 tensor cores at half that. Vendor data-sheet figures.
PEAK_BF16_FLOPS = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H800", 989e12),
                   ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L4", 121e12))
FALLBACK_PEAK_FLOPS = 1e14  # a placeholder: mfu is then only comparable between runs on one machine


def peak_flops(device_name: str | None, dtype: str) -> float | None:
    """Peak FLOP/s of one ``device_name`` GPU computing in ``dtype`` ("bfloat16", "float16",
    "float32"), or None for a device not in :data:`PEAK_BF16_FLOPS` (or the CPU: None)."""
    if not device_name:
        return None
    for key, flops in PEAK_BF16_FLOPS:
        if key in device_name:
            return flops if dtype in ("bfloat16", "float16") else flops / 2
    return None
