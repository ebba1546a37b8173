"""`distflow run`'s GPU plan from what the launcher itself sees, with the GPU count faked
(no GPU needed): the children's CUDA_VISIBLE_DEVICES name the launcher's own visible ids,
each child sees one GPU as cuda:0 (DISTFLOW_LOCAL_GPU=0 whatever the parent had), and a
plan that would put two trainer ranks on one GPU is refused naming the keys."""

from __future__ import annotations

import pytest

from distflow.core.config import ConfigError, load_config
from distflow.launch.placement import plan_placement

QUICKSTART = "examples/grpo_quickstart.yaml"


@pytest.fixture
def eight_gpus_seen_as_four(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setenv("DISTFLOW_LOCAL_GPU", "3")  # the launcher's own: never handed down as is


def test_children_get_the_launchers_visible_ids_one_each(eight_gpus_seen_as_four):
    cfg = load_config(QUICKSTART, ["device=cuda", "trainer_nodes=2", "rollout_nodes=4"])
    slots = {s.node_id: s for s in plan_placement(cfg)}
    assert {i: s.env["CUDA_VISIBLE_DEVICES"] for i, s in slots.items()} == {
        "trainer-0": "4", "trainer-1": "5", "rollout-0": "6", "rollout-1": "7", "rollout-2": "6",
        "rollout-3": "7"}
    assert {s.env["DISTFLOW_LOCAL_GPU"] for s in slots.values()} == {"0"}


def test_more_trainer_ranks_than_gpus_is_refused_naming_the_keys(eight_gpus_seen_as_four):
    cfg = load_config(QUICKSTART, ["device=cuda", "trainer_nodes=5", "rollout_nodes=1", "colocate=true"])
    with pytest.raises(ConfigError, match=r"gpus: 4 GPU\(s\) usable \(4,5,6,7\), but trainer_nodes=5 needs one GPU "
                                         r"per trainer rank"):
        plan_placement(cfg)


def test_a_list_names_indices_of_the_launchers_view(eight_gpus_seen_as_four):
    cfg = load_config(QUICKSTART, ["device=cuda", "trainer_nodes=1", "rollout_nodes=2", "gpus=[3,0]"])
    assert {s.node_id: s.gpu for s in plan_placement(cfg)} == {"trainer-0": "7", "rollout-0": "4", "rollout-1": "4"}
    with pytest.raises(ConfigError, match=r"gpus: \[0, 4\] names GPU\(s\) \[4\], but only 4 present"):
        plan_placement(load_config(QUICKSTART, ["device=cuda", "trainer_nodes=1", "gpus=[0,4]"]))
