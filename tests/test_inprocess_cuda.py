"""`distflow run --in-process` on device: cuda, checked without a GPU: every node of the one
process shares one GPU (the first of `gpus`), and the weights go over the data channel
(CUDA IPC cannot open a handle in the process that exported it; NCCL refuses two ranks on
one GPU), an explicit GPU tier being refused naming the key."""

from __future__ import annotations

import pytest

from distflow.core.config import load_config
from distflow.launch.inprocess import cuda_in_process, run_in_process

QUICKSTART = "examples/grpo_quickstart.yaml"


@pytest.fixture(autouse=True)
def clean_gpu_env(monkeypatch):
    """cuda_in_process sets these in os.environ: unset them for the test and restore whatever
    was there afterwards (set-then-delete makes monkeypatch remember the original state)."""
    for name in ("DISTFLOW_LOCAL_GPU", "DISTFLOW_GPU_NODES"):
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)


def test_cpu_config_is_left_alone(monkeypatch):
    cfg = load_config(QUICKSTART, ["trainer_nodes=1"])
    assert cuda_in_process(cfg) is cfg
    import os

    assert "DISTFLOW_LOCAL_GPU" not in os.environ


@pytest.mark.parametrize("gpus, index", [(None, "0"), (2, "0"), ("[3,1]", "3")])
def test_cuda_shares_the_first_gpu_and_sends_weights_over_the_channel(monkeypatch, gpus, index):
    import os

    over = ["trainer_nodes=1", "device=cuda"] + ([f"gpus={gpus}"] if gpus is not None else [])
    cfg = cuda_in_process(load_config(QUICKSTART, over))
    assert cfg.weight_transport == "channel"
    assert os.environ["DISTFLOW_LOCAL_GPU"] == index
    assert os.environ["DISTFLOW_GPU_NODES"] == "3"  # one trainer and the two rollout nodes share it


@pytest.mark.parametrize("tier", ["cuda_ipc", "nccl"])
def test_an_explicit_gpu_weight_tier_is_refused_naming_the_key(monkeypatch, capsys, tier):
    cfg = load_config(QUICKSTART, ["trainer_nodes=1", "device=cuda", f"weight_transport={tier}"])
    with pytest.raises(ValueError, match=f"weight_transport: {tier} cannot work in one process"):
        cuda_in_process(cfg)
    assert run_in_process(cfg) == 2
    assert "weight_transport=auto" in capsys.readouterr().err
