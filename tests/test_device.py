"""distflow.device's bookkeeping, on CPU: the chosen GPU is remembered for the process and
is what collectives use, whatever thread asks (torch.cuda.set_device is per thread), and
the helpers that enter it in worker threads (on_device, call_on, iterate_on)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import distflow.device as device


@pytest.fixture
def fake_gpus(monkeypatch):
    """Two fake GPUs: set_device and torch.cuda.device record, per thread, the current index."""
    current = threading.local()
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(device, "_CHOSEN", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "index", 0))

    def set_device(d):
        current.index = torch.device(d).index
        calls.append(("set", current.index))

    @contextlib.contextmanager
    def enter(d):
        prev = getattr(current, "index", 0)
        current.index = torch.device(d).index
        calls.append(("enter", current.index))
        try:
            yield
        finally:
            current.index = prev

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "device", enter)
    return calls


def test_cpu_chooses_nothing_and_helpers_pass_through(monkeypatch):
    monkeypatch.setattr(device, "_CHOSEN", None)
    assert device.node_device("cpu") == torch.device("cpu") and device.chosen_device() is None
    assert device.call_on("cpu", lambda a, b=0: a + b, 1, b=2) == 3
    assert device.call_on(None, lambda: "x") == "x"
    assert list(device.iterate_on(torch.device("cpu"), iter([1, 2, 3]))) == [1, 2, 3]
    with pytest.raises(ValueError, match="device must be"):
        device.node_device("tpu")


def test_node_device_is_remembered_and_used_from_other_threads(fake_gpus, monkeypatch):
    monkeypatch.setenv("DISTFLOW_LOCAL_GPU", "1")
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    assert device.node_device("cuda") == torch.device("cuda", 1)
    assert device.chosen_device() == torch.device("cuda", 1) and fake_gpus == [("set", 1)]
    seen = {}

    def worker():  # a fresh thread: its current device is the default, cuda:0
        seen["current"] = torch.cuda.current_device()
        seen["collective"] = device.collective_device()
        seen["inside"] = device.call_on(device.chosen_device(), torch.cuda.current_device)
        seen["after"] = torch.cuda.current_device()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"current": 0, "collective": torch.device("cuda", 1), "inside": 1, "after": 0}
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    assert device.collective_device() == torch.device("cpu")


def test_collective_device_chooses_when_nothing_was_chosen(fake_gpus, monkeypatch):
    monkeypatch.delenv("DISTFLOW_LOCAL_GPU", raising=False)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    assert device.collective_device() == torch.device("cuda", 0) == device.chosen_device()


def test_bad_local_gpu_names_the_variable(fake_gpus, monkeypatch):
    monkeypatch.setenv("DISTFLOW_LOCAL_GPU", "2")
    with pytest.raises(RuntimeError, match="DISTFLOW_LOCAL_GPU=2"):
        device.node_device("cuda")
    assert device.chosen_device() is None


def test_iterate_on_enters_the_device_for_each_item_only(fake_gpus):
    def gen():
        for i in range(3):
            yield torch.cuda.current_device(), i

    got = []
    for (dev, i) in device.iterate_on(torch.device("cuda", 1), gen()):
        got.append((dev, torch.cuda.current_device()))  # the consumer's own device between items
    assert got == [(1, 0)] * 3
    assert fake_gpus == [("enter", 1)] * 4  # three items and the final StopIteration


@pytest.mark.parametrize("raw, sharers", [(None, 1), ("1", 1), ("3", 3), ("0", 1), ("x", 1), ("-2", 1)])
def test_gpu_sharers_reads_the_placement(monkeypatch, raw, sharers):
    if raw is None:
        monkeypatch.delenv("DISTFLOW_GPU_NODES", raising=False)
    else:
        monkeypatch.setenv("DISTFLOW_GPU_NODES", raw)
    assert device.gpu_sharers() == sharers


def test_engine_memory_splits_the_gpu_between_the_trainer_and_the_engines():
    from types import SimpleNamespace

    from distflow.rollout.worker import engine_memory

    def cfg(util=None, trainer=0.5, colocate=False):
        return SimpleNamespace(engine_gpu_memory_utilization=util, engine_trainer_memory_fraction=trainer,
                               colocate=colocate)

    assert engine_memory(cfg(), 1) == {"gpu_memory_utilization": 0.9, "trainer_memory_fraction": 0.0, "engines": 1}
    # colocated: the trainer rank's share comes off, the two engines beside it split the rest
    assert engine_memory(cfg(colocate=True), 3) == {"gpu_memory_utilization": 0.9, "trainer_memory_fraction": 0.5,
                                                    "engines": 2}
    assert engine_memory(cfg(0.8, colocate=False), 2)["engines"] == 2  # two rollout nodes on one GPU
    with pytest.raises(ValueError, match="must be below engine_gpu_memory_utilization"):
        engine_memory(cfg(0.4, 0.5, colocate=True), 2)


@pytest.mark.parametrize("visible, local, identity", [
    (None, None, "0"), (None, "2", "2"), ("3", None, "3"), ("4,6", "1", "6"),
    ("GPU-aa, GPU-bb", "1", "GPU-bb"), ("5", "3", "?5#3")])
def test_gpu_identity_names_the_physical_gpu_from_the_environment(monkeypatch, visible, local, identity):
    """What a node gossips as its GPU (weights go by CUDA IPC only between nodes of one GPU): the
    launcher's name for it, read without touching CUDA; an out-of-range index never matches."""
    from distflow.device import gpu_identity

    for var, value in (("CUDA_VISIBLE_DEVICES", visible), ("DISTFLOW_LOCAL_GPU", local)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    assert gpu_identity() == identity


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_private_stream_is_none_of_torchs_pool_streams():
    """The engine's capture stream and the NCCL channel's streams are made outside torch's pool
    (32 streams per priority, handed out round-robin to torch.distributed's NCCL streams too)."""
    pytest.importorskip("cupy")
    dev = torch.device("cuda", 0)
    stream, owner = device.private_stream(dev)
    assert owner is not None and stream.device == dev
    pool = {torch.cuda.Stream(dev, priority=p).cuda_stream for p in (0, -1) for _ in range(80)}
    assert stream.cuda_stream not in pool
    x = torch.ones(1024, device=dev)
    with torch.cuda.stream(stream):  # usable as a torch stream
        y = x * 2
    stream.synchronize()
    assert float(y.sum()) == 2048.0
