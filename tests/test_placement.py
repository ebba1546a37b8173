"""GPU placement: the environment each child of `distflow run` gets, computed on CPU.

distflow.launch.placement.place takes the GPU count as an argument, so every case (count and list
forms, colocation, refusals) is checked here without a GPU; the launcher's own use of it
(plan_placement) is checked on the real config schema, and a `distflow run` that asks for
more than this machine has is refused before any node starts.
"""

from __future__ import annotations

import pytest

from distflow.core.config import ConfigError, load_config
from distflow.launch.roles import node_roles
from distflow.launch.placement import PlacementError, describe, place, plan_placement
from tests.conftest import run_distflow

QUICKSTART = "examples/grpo_quickstart.yaml"
NODES = [("trainer-0", "trainer"), ("trainer-1", "trainer"), ("rollout-0", "rollout"), ("rollout-1", "rollout"),
         ("rollout-2", "rollout")]


def gpus_of(slots) -> dict[str, str | None]:
    return {s.node_id: s.env["CUDA_VISIBLE_DEVICES"] for s in slots}


def test_cpu_hides_every_gpu():
    slots = place(NODES, device="cpu", present=8)
    assert gpus_of(slots) == {i: "" for i, _ in NODES}
    assert all(s.gpu is None for s in slots)
    with pytest.raises(PlacementError, match="gpus: 2 is set, but device is cpu"):
        place(NODES, device="cpu", gpus=2)


def test_null_takes_every_gpu_trainers_first_rollouts_share_the_rest():
    slots = place(NODES, device="cuda", gpus=None, present=4)
    assert gpus_of(slots) == {"trainer-0": "0", "trainer-1": "1", "rollout-0": "2", "rollout-1": "3",
                              "rollout-2": "2"}
    assert {s.env["DISTFLOW_LOCAL_GPU"] for s in slots} == {"0"}  # one visible GPU each: cuda:0
    assert describe(slots) == "placement: GPU 0: trainer-0; GPU 1: trainer-1; GPU 2: rollout-0, rollout-2; " \
                              "GPU 3: rollout-1"


def test_count_form_uses_the_first_n():
    slots = place(NODES, device="cuda", gpus=3, present=8)
    assert gpus_of(slots) == {"trainer-0": "0", "trainer-1": "1", "rollout-0": "2", "rollout-1": "2",
                              "rollout-2": "2"}


def test_list_form_names_physical_ids_through_the_launchers_visible_devices():
    slots = place(NODES, device="cuda", gpus=[3, 1, 2], present=4)
    assert gpus_of(slots) == {"trainer-0": "3", "trainer-1": "1", "rollout-0": "2", "rollout-1": "2",
                              "rollout-2": "2"}
    # The launcher itself was given GPUs 4-7: index 0 of its view is physical GPU 4.
    slots = place(NODES, device="cuda", gpus=[0, 1, 3], present=4, visible=["4", "5", "6", "7"])
    assert gpus_of(slots) == {"trainer-0": "4", "trainer-1": "5", "rollout-0": "7", "rollout-1": "7",
                              "rollout-2": "7"}


def test_colocation_puts_rollouts_on_the_trainers_gpus_round_robin():
    slots = place(NODES, device="cuda", gpus=2, colocate=True, present=2)
    assert gpus_of(slots) == {"trainer-0": "0", "trainer-1": "1", "rollout-0": "0", "rollout-1": "1",
                              "rollout-2": "0"}
    one = place([("trainer-0", "trainer"), ("rollout-0", "rollout"), ("rollout-1", "rollout")], device="cuda",
                colocate=True, present=1)
    assert gpus_of(one) == {"trainer-0": "0", "rollout-0": "0", "rollout-1": "0"}
    # every node learns how many share its GPU (an engine's KV cache leaves the others room)
    assert {s.node_id: s.env["DISTFLOW_GPU_NODES"] for s in slots} == {
        "trainer-0": "3", "trainer-1": "2", "rollout-0": "3", "rollout-1": "2", "rollout-2": "3"}
    assert {s.env["DISTFLOW_GPU_NODES"] for s in one} == {"3"}
    apart = place(NODES, device="cuda", gpus=None, present=4)  # rollout-0 and rollout-2 share GPU 2
    assert {s.node_id: s.env["DISTFLOW_GPU_NODES"] for s in apart} == {
        "trainer-0": "1", "trainer-1": "1", "rollout-0": "2", "rollout-1": "1", "rollout-2": "2"}
    assert "DISTFLOW_GPU_NODES" not in place(NODES, device="cpu")[0].env


def test_trainer_ranks_follow_sorted_ids_and_controllers_get_no_gpu():
    nodes = [("trainer-b", "trainer"), ("trainer-a", "trainer"), ("rollout-0", "rollout"),
             ("controller-0", "controller")]
    assert gpus_of(place(nodes, device="cuda", present=3)) == {"trainer-a": "0", "trainer-b": "1",
                                                               "rollout-0": "2", "controller-0": ""}


def test_gpu_nodes_get_nccl_error_handling_and_the_flight_recorder_unless_the_user_set_them():
    """A cuda placement turns on NCCL's async error handling, the flight recorder and its dump on
    timeout for every node on a GPU; a key the launcher's environment sets is left to it (the
    children inherit it); nodes without a GPU, and cpu placements, get none."""
    nodes = [*NODES, ("controller-0", "controller")]
    slots = {s.node_id: s for s in place(nodes, device="cuda", present=8, environ={})}
    for node_id in ("trainer-0", "trainer-1", "rollout-0", "rollout-2"):
        env = slots[node_id].env
        assert (env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], env["TORCH_NCCL_TRACE_BUFFER_SIZE"],
                env["TORCH_NCCL_DUMP_ON_TIMEOUT"]) == ("1", "2000", "1")
    assert not any(k.startswith("TORCH_NCCL") for k in slots["controller-0"].env)
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    env = next(s.env for s in place(nodes, device="cuda", present=8, environ=mine) if s.node_id == "trainer-0")
    assert {k: v for k, v in env.items() if k.startswith("TORCH_NCCL")} == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert not any(k.startswith("TORCH_NCCL") for s in place(NODES, device="cpu", environ={}) for k in s.env)


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpus=None, present=0), "device: cuda, but no GPU is present"),
    (dict(gpus=4, present=2), "gpus: 4 GPUs asked for, but only 2 present"),
    (dict(gpus=[0, 5], present=4), r"gpus: \[0, 5\] names GPU\(s\) \[5\], but only 4 present"),
    # pdsh passes a hostfile's gpus= straight in (no config validation): two trainers on GPU 1 is refused.
    (dict(gpus=[1, 1, 2], present=None), r"gpus: \[1, 1, 2\] must name distinct GPU ids >= 0 \(1 given twice\)"),
    (dict(gpus=[-1, 0, 1], present=4), r"gpus: \[-1, 0, 1\] must name distinct GPU ids >= 0"),
    (dict(gpus=1, present=4), "gpus: 1 GPU\\(s\\) usable \\(0\\), but trainer_nodes=2 needs one GPU per trainer rank"),
    (dict(gpus=2, present=4), "none is left for the rollout nodes; give more GPUs or set colocate: true"),
])
def test_impossible_placements_are_refused_naming_the_key(kwargs, message):
    with pytest.raises(PlacementError, match=message):
        place(NODES, device="cuda", **kwargs)


def test_launcher_plan_from_the_config():
    cfg = load_config(QUICKSTART, ["device=cuda", "gpus=[0,1]", "colocate=true"])
    assert [n for n, _ in node_roles(cfg)] == ["trainer-0", "trainer-1", "rollout-0", "rollout-1"]
    assert gpus_of(plan_placement(cfg, present=2)) == {"trainer-0": "0", "trainer-1": "1", "rollout-0": "0",
                                                       "rollout-1": "1"}
    with pytest.raises(ConfigError, match=r"^gpus: the 2 trainer rank\(s\) take every usable GPU \(0,1\)"):
        plan_placement(load_config(QUICKSTART, ["device=cuda", "gpus=2"]), present=2)


def test_distflow_run_refuses_cuda_without_a_gpu_before_starting_anything(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = run_distflow(["run", QUICKSTART, f"output_dir={tmp_path}", "device=cuda", f"model_path={tmp_path / 'm'}"],
                     timeout=120)
    assert r.returncode == 2, r.stderr  # a config error, as every refusal before any node starts
    assert "distflow run: " in r.stderr and "device: cuda, but no GPU is present" in r.stderr
    assert not list((tmp_path / "logs").glob("*.log"))  # no node was started
