"""A node on device: cpu never takes the NCCL data channel, even where `channel: auto` could
(cupy and a GPU present, e.g. a cpu run started by pdsh or compose on a GPU host): the NCCL
channel opens the process's GPU, and NCCL only moves CUDA tensors."""

from __future__ import annotations

import asyncio

from distflow.core.config import load_config

QUICKSTART = "examples/grpo_quickstart.yaml"


def test_cpu_node_never_builds_the_nccl_channel(monkeypatch):
    import distflow.transport.movers.nccl as nc
    from distflow.runtime import Runtime

    def refuse(*a, **k):
        raise AssertionError("a cpu node built the NCCL channel")

    monkeypatch.setattr(nc, "nccl_available", lambda: True)
    monkeypatch.setattr(nc, "NcclMover", refuse)
    cfg = load_config(QUICKSTART, ["channel=auto"])

    async def make():
        return Runtime.create(cfg, "rollout", "rollout-0", "s" * 32, host="127.0.0.1", port=0, data_port=0, seeds=[])

    rt = asyncio.run(make())
    assert not rt.channel.supports("nccl") and rt.channel.transport in ("shm", "zmq")


def test_cuda_node_still_takes_auto(monkeypatch):
    import distflow.transport.movers.nccl as nc
    from distflow.runtime import Runtime

    class Stub:
        name = "nccl"

    stub = Stub()
    monkeypatch.setattr(nc, "nccl_available", lambda: True)
    monkeypatch.setattr(nc, "NcclMover", lambda *a, **k: stub)
    cfg = load_config(QUICKSTART, ["channel=auto", "device=cuda"])

    async def make():
        return Runtime.create(cfg, "rollout", "rollout-0", "s" * 32, host="127.0.0.1", port=0, data_port=0, seeds=[])

    rt = asyncio.run(make())
    assert rt.channel.nccl is stub and rt.channel.supports("nccl") and rt.channel.transport == "nccl"
