"""Tests for distflow.core.dag: workflow validation and per-group planning."""

from __future__ import annotations

import copy
import itertools
import random
import re
from typing import Any

import pytest

from distflow.core.dag import (
    GRPO_WORKFLOW,
    PPO_WORKFLOW,
    NodeType,
    Role,
    WorkflowError,
    WorkflowNode,
    load_workflow,
    plan,
)

SIZES = {"rollout": 2, "trainer": 2}


def ids(nodes: list[WorkflowNode]) -> list[str]:
    return [n.id for n in nodes]


def wf(*extra: dict[str, Any], base: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """A copy of GRPO (or ``base``) with extra nodes appended."""
    return copy.deepcopy(GRPO_WORKFLOW if base is None else base) + list(extra)


def node(id: str, role: str = "ACTOR", type: str = "COMPUTE", fn: str = "f", **kw: Any) -> dict[str, Any]:
    return {"id": id, "role": role, "type": type, "fn": fn, **kw}


def plan_error(nodes: Any, sizes: dict[str, int] = SIZES) -> str:
    with pytest.raises(WorkflowError) as ei:
        plan(nodes, sizes)
    return str(ei.value)


# ----------------------------------------------------------------------------- reference plans
def test_grpo_plan() -> None:
    p = plan(GRPO_WORKFLOW, SIZES)
    assert ids(p.nodes) == ["generate", "reward", "reference", "advantage", "update"]
    assert p.depth == {"generate": 0, "reward": 1, "reference": 1, "advantage": 2, "update": 3}
    assert p.group_of == {"generate": "rollout", "reward": "rollout", "reference": "trainer",
                          "advantage": "rollout", "update": "trainer"}
    assert {g: ids(v) for g, v in p.pipelines.items()} == {
        "rollout": ["generate", "reward", "advantage"],
        "trainer": ["reference", "update"],
    }
    assert ids(p.pipeline("rollout")) == ["generate", "reward", "advantage"]
    assert p.boundary == [("generate", "reference"), ("advantage", "update")]
    assert p.flow == ["rollout", "trainer"]
    assert p.boundary_out_of("rollout") == p.boundary and p.boundary_out_of("trainer") == []
    assert p.boundary_into("trainer") == p.boundary and p.boundary_into("rollout") == []
    assert ids(p.consumers("generate")) == ["reward", "reference"]
    assert p.node("update").type is NodeType.MODEL_TRAIN and p.node("update").role is Role.ACTOR


def test_ppo_plan() -> None:
    p = plan(PPO_WORKFLOW, {"trainer": 4, "rollout": 1})
    assert ids(p.nodes) == ["generate", "reward", "reference", "values", "gae", "update", "critic_update"]
    assert p.depth == {"generate": 0, "reward": 1, "reference": 1, "values": 1, "gae": 2, "update": 3,
                       "critic_update": 3}
    # gae's deepest deps are reward (rollout) and values (trainer) at depth 1: the tie goes to the later group
    assert p.group_of["gae"] == "trainer"
    assert {g: ids(v) for g, v in p.pipelines.items()} == {
        "rollout": ["generate", "reward"],
        "trainer": ["reference", "values", "gae", "update", "critic_update"],
    }
    assert p.boundary == [("generate", "reference"), ("generate", "values"), ("reward", "gae")]
    assert p.flow == ["rollout", "trainer"]  # rollout first whatever the mapping order
    assert p.node("gae").args == {"gamma": 1.0, "lam": 0.95}


def test_plan_accepts_nodes_and_a_workflow_mapping() -> None:
    nodes = load_workflow(GRPO_WORKFLOW)
    assert all(isinstance(n, WorkflowNode) for n in nodes)
    a = plan(nodes, SIZES)
    b = plan({"workflow": GRPO_WORKFLOW}, SIZES)
    assert ids(a.nodes) == ids(b.nodes) and a.boundary == b.boundary


def test_lowercase_role_and_type_are_accepted() -> None:
    n = load_workflow([node("g", role="actor", type="model_inference")])[0]
    assert n.role is Role.ACTOR and n.type is NodeType.MODEL_INFERENCE


# ----------------------------------------------------------------------------- declaration order
@pytest.mark.parametrize("workflow", [GRPO_WORKFLOW, PPO_WORKFLOW], ids=["grpo", "ppo"])
def test_plan_is_independent_of_declaration_order(workflow: list[dict[str, Any]]) -> None:
    ref = plan(workflow, SIZES)
    perms = list(itertools.permutations(workflow))
    random.Random(0).shuffle(perms)
    for perm in perms[:400]:
        p = plan(list(perm), SIZES)
        assert p.depth == ref.depth
        assert p.group_of == ref.group_of
        assert sorted(p.boundary) == sorted(ref.boundary)
        assert [p.depth[n.id] for n in p.nodes] == sorted(p.depth.values())
        for g in ref.pipelines:
            # same nodes at each depth; only same-depth ties may change places
            assert sorted((p.depth[n.id], n.id) for n in p.pipeline(g)) == \
                sorted((ref.depth[n.id], n.id) for n in ref.pipeline(g))
            assert [p.depth[n.id] for n in p.pipeline(g)] == [ref.depth[n.id] for n in ref.pipeline(g)]
        if workflow is GRPO_WORKFLOW:  # no same-group ties in GRPO: the pipelines are identical
            assert {g: ids(v) for g, v in p.pipelines.items()} == {g: ids(v) for g, v in ref.pipelines.items()}


def test_same_depth_ties_follow_declaration_order() -> None:
    swapped = copy.deepcopy(PPO_WORKFLOW)
    swapped[5], swapped[6] = swapped[6], swapped[5]  # critic_update before update
    swapped[2], swapped[3] = swapped[3], swapped[2]  # values before reference
    p = plan(swapped, SIZES)
    assert ids(p.pipeline("trainer")) == ["values", "reference", "gae", "critic_update", "update"]


# ----------------------------------------------------------------------------- groups
def test_custom_group_between_rollout_and_trainer() -> None:
    workflow = [
        node("generate", type="MODEL_INFERENCE", fn="generate"),
        node("rm_score", role="REWARD", type="MODEL_INFERENCE", fn="rm", deps=["generate"], group="rm"),
        node("advantage", fn="grpo", deps=["rm_score"]),
        node("update", type="MODEL_TRAIN", fn="grpo", deps=["advantage"]),
    ]
    p = plan(workflow, {"trainer": 1, "rm": 3, "rollout": 2})
    assert p.flow == ["rollout", "rm", "trainer"]
    assert p.group_of == {"generate": "rollout", "rm_score": "rm", "advantage": "rm", "update": "trainer"}
    assert p.boundary == [("generate", "rm_score"), ("advantage", "update")]
    assert {g: ids(v) for g, v in p.pipelines.items()} == {
        "rollout": ["generate"], "rm": ["rm_score", "advantage"], "trainer": ["update"]}
    msg = plan_error(workflow, {"trainer": 1, "rm": 0, "rollout": 2})
    assert msg == "node 'rm_score' (role REWARD) has no workers: group 'rm' has size 0"


def test_reward_model_inference_defaults_to_trainer_and_groups_without_nodes_have_empty_pipelines() -> None:
    p = plan(wf(node("rm", role="REWARD", type="MODEL_INFERENCE", deps=["generate"])), {**SIZES, "spare": 1})
    assert p.group_of["rm"] == "trainer"
    assert p.pipeline("spare") == []
    with pytest.raises(WorkflowError, match=r"no group 'nope' in this plan \(groups: rollout, spare, trainer\)"):
        p.pipeline("nope")


def test_compute_goes_to_its_deepest_dependency() -> None:
    # deps at depths 0 (rollout) and 1 (trainer): the deeper one wins
    p = plan(wf(node("x", deps=["generate", "reference"])), SIZES)
    assert p.group_of["x"] == "trainer" and p.depth["x"] == 2
    # deps at the same depth 1 in rollout and trainer: the later group in flow order wins
    p = plan(wf(node("y", deps=["reward", "reference"])), SIZES)
    assert p.group_of["y"] == "trainer"
    assert ("reward", "y") in p.boundary and ("reference", "y") not in p.boundary
    # an explicit group overrides the rule
    p = plan(wf(node("z", deps=["reference"], group="trainer"), node("w", deps=["reward"], group="trainer")), SIZES)
    assert p.group_of["w"] == "trainer" and ("reward", "w") in p.boundary


# ----------------------------------------------------------------------------- errors: graph
def test_duplicate_id() -> None:
    msg = plan_error(wf(node("reward", deps=["generate"])))
    assert msg == "duplicate node id 'reward' (workflow[1] and workflow[5])"


def test_unknown_dep_names_node_key_and_dep() -> None:
    msg = plan_error(wf(node("x", deps=["advantges"])))
    assert msg == "node 'x' (role ACTOR): key 'deps' names unknown node 'advantges' (did you mean 'advantage'?)"


def test_duplicate_dep() -> None:
    msg = plan_error(wf(node("x", deps=["reward", "reward"])))
    assert msg == "node 'x' (role ACTOR): key 'deps' lists 'reward' twice"


def test_cycle_of_length_1_is_a_self_dependency() -> None:
    msg = plan_error(wf(node("x", role="REWARD", deps=["x"])))
    assert msg == "node 'x' (role REWARD) depends on itself (key 'deps')"


def test_cycle_of_length_2() -> None:
    msg = plan_error(wf(node("x", deps=["y"]), node("y", deps=["x"])))
    assert "cycle" in msg and "'x' -> 'y' -> 'x'" in msg
    assert "generate" not in msg and "update" not in msg


def test_cycle_of_length_3_entered_from_a_node_off_the_cycle() -> None:
    # tail -> a -> b -> c -> a : 'tail' is declared first and reaches the cycle, but is not on it
    msg = plan_error(wf(node("tail", deps=["a"]), node("a", deps=["b"]), node("b", deps=["c"]),
                        node("c", deps=["a", "generate"])))
    assert "'a' -> 'b' -> 'c' -> 'a'" in msg
    assert re.search(r"through nodes 'a', 'b', 'c'", msg)
    assert "tail" not in msg and "generate" not in msg


def test_cycle_through_the_reference_workflow() -> None:
    # make generate's output depend on update: generate is the ACTOR inference node, but the cycle is found first
    nodes = copy.deepcopy(GRPO_WORKFLOW)
    nodes[0]["deps"] = ["update"]
    msg = plan_error(nodes)
    assert "cycle" in msg
    for n in ("generate", "reward", "advantage", "update"):
        assert repr(n) in msg
    assert "reference" not in msg


def test_compute_without_deps() -> None:
    msg = plan_error(wf(node("lonely", role="REWARD")))
    assert msg.startswith("node 'lonely' (role REWARD): a COMPUTE node")
    assert "'deps'" in msg


# ----------------------------------------------------------------------------- errors: groups and roles
def test_group_with_zero_workers() -> None:
    assert plan_error(GRPO_WORKFLOW, {"rollout": 2, "trainer": 0}) == \
        "node 'reference' (role REFERENCE) has no workers: group 'trainer' has size 0"
    assert plan_error(GRPO_WORKFLOW, {"rollout": 0, "trainer": 1}) == \
        "node 'generate' (role ACTOR) has no workers: group 'rollout' has size 0"


def test_group_not_configured() -> None:
    msg = plan_error(wf(node("rm", role="REWARD", type="MODEL_INFERENCE", deps=["generate"], group="rm")))
    assert msg == "node 'rm' (role REWARD) has no workers: group 'rm' is not configured " \
                  "(group sizes: rollout=2, trainer=2)"
    assert "group 'trainer' is not configured" in plan_error(GRPO_WORKFLOW, {"rollout": 1})


def test_backward_edge_from_trainer_to_rollout() -> None:
    msg = plan_error(wf(node("late", deps=["reference"], group="rollout")))
    assert msg.startswith("node 'late' (role ACTOR) on group 'rollout' depends on node 'reference' on group 'trainer'")
    assert "data must flow forward (rollout -> trainer)" in msg
    # without an explicit group: deepest dep 'advantage' (depth 2, rollout) outranks 'reference' (depth 1, trainer)
    msg = plan_error(wf(node("mix", deps=["reference", "advantage"])))
    assert "node 'mix'" in msg and "node 'reference'" in msg and "forward" in msg


def test_backward_edge_between_custom_groups_follows_group_sizes_order() -> None:
    workflow = wf(node("a", deps=["generate"], group="g2"), node("b", deps=["a"], group="g1"))
    plan(workflow, {**SIZES, "g2": 1, "g1": 1})
    msg = plan_error(workflow, {**SIZES, "g1": 1, "g2": 1})
    assert "node 'b'" in msg and "node 'a'" in msg and "(rollout -> g1 -> g2 -> trainer)" in msg


def test_needs_a_model_train_node() -> None:
    msg = plan_error(GRPO_WORKFLOW[:4])
    assert msg.startswith("workflow has no MODEL_TRAIN node (nodes: 'generate', 'reward', 'advantage', 'reference')")


def _edit(base: list[dict[str, Any]], drop: tuple[str, ...] = (), **deps: list[str]) -> list[dict[str, Any]]:
    """A copy of ``base`` without the nodes ``drop``, with the deps of the nodes named in ``deps`` replaced."""
    out = [copy.deepcopy(n) for n in base if n["id"] not in drop]
    for n in out:
        if n["id"] in deps:
            n["deps"] = deps[n["id"]]
    return out


@pytest.mark.parametrize("nodes, expected", [
    # no generate node: nothing produces samples (the reference model reads none)
    ([node("reference", role="REFERENCE", type="MODEL_INFERENCE", fn="ref_logprob"),
      node("advantage", fn="f", deps=["reference"]), node("update", type="MODEL_TRAIN", deps=["advantage"])],
     "workflow has no ACTOR MODEL_INFERENCE (generate) node (nodes: 'reference', 'advantage', 'update'): "
     "nothing would produce samples"),
    # GRPO's estimator fed straight from generate: no rewards to normalise
    (_edit(GRPO_WORKFLOW, ("reward",), advantage=["generate"]),
     "node 'advantage' (role ACTOR): grpo reads rewards, but no node upstream of it (key 'deps', directly or "
     "through its deps) makes them: an ACTOR MODEL_INFERENCE (episodes) or REWARD COMPUTE or REWARD "
     "MODEL_INFERENCE node"),
    # the update fed by the reference only: no advantages
    (_edit(GRPO_WORKFLOW, update=["reference"]),
     "node 'update' (role ACTOR): grpo reads advantages, but no node upstream of it (key 'deps', directly or "
     "through its deps) makes them: an ACTOR COMPUTE (grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, "
     "gae, reinforce_pp_token) node"),
    # a filter is not an estimator
    (_edit(GRPO_WORKFLOW, ("advantage",), update=["ds", "reference"])
     + [node("ds", fn="dynamic_sampling", deps=["reward"])],
     "node 'update' (role ACTOR): grpo reads advantages"),
    # gae without the critic's values; the critic update without gae's returns
    (_edit(PPO_WORKFLOW, gae=["reward"]),
     "node 'gae' (role ACTOR): gae reads values, but no node upstream of it (key 'deps', directly or through its "
     "deps) makes them: a CRITIC MODEL_INFERENCE node"),
    (_edit(PPO_WORKFLOW, critic_update=["values", "reward"]),
     "node 'critic_update' (role CRITIC): value_loss reads returns, but no node upstream of it (key 'deps', "
     "directly or through its deps) makes them: an ACTOR COMPUTE (gae) node"),
])
def test_each_stage_input_is_made_upstream(nodes, expected) -> None:
    """Shapes that plan but would fail at step 1 (after every model has loaded) are named here."""
    assert plan_error(nodes).startswith(expected)


def test_inputs_may_come_through_deps_and_custom_estimators_count() -> None:
    # rewards reach the estimator through a filter; a custom ACTOR COMPUTE fn feeds the update
    p = plan(_edit(GRPO_WORKFLOW, advantage=["ds"]) + [node("ds", fn="dynamic_sampling", deps=["reward"])], SIZES)
    assert p.group_of["ds"] == "rollout"
    plan(_edit(GRPO_WORKFLOW, ("advantage",), update=["mine", "reference"]) + [node("mine", fn="pkg.m:adv",
                                                                                   deps=["generate"])], SIZES)


def test_at_most_one_generate_node_without_deps() -> None:
    msg = plan_error(wf(node("generate2", type="MODEL_INFERENCE")))
    assert msg == "at most one ACTOR MODEL_INFERENCE (generate) node is allowed, got 'generate', 'generate2'"
    nodes = wf(node("prep", role="REWARD", type="MODEL_INFERENCE"))
    nodes[0]["deps"] = ["prep"]
    msg = plan_error(nodes)
    assert msg.startswith("node 'generate' (role ACTOR): the generate node reads prompts")
    assert "'deps'" in msg


def test_empty_workflow_and_bad_group_sizes() -> None:
    assert "workflow is empty" in plan_error([])
    assert plan_error(GRPO_WORKFLOW, {"rollout": -1, "trainer": 1}) == \
        "group_sizes['rollout'] must be a non-negative integer, got -1"
    assert "got True" in plan_error(GRPO_WORKFLOW, {"rollout": True, "trainer": 1})
    assert "got '2'" in plan_error(GRPO_WORKFLOW, {"rollout": "2", "trainer": 1})


# ----------------------------------------------------------------------------- errors: loading
@pytest.mark.parametrize(
    "bad, expected",
    [
        ({"id": "reward", "role": "REWARD", "type": "COMPUTE", "deps": ["generate"]},
         "workflow[1] (node 'reward'): missing key 'fn'"),
        ({"id": "reward", "role": "JUDGE", "type": "COMPUTE", "fn": "f"},
         "workflow[1] (node 'reward'): key 'role': Input should be 'ACTOR', 'CRITIC', 'REWARD' or 'REFERENCE' "
         "(got 'JUDGE')"),
        ({"id": "reward", "role": "REWARD", "type": "COMPUTE", "fn": "f", "dep": ["generate"]},
         "workflow[1] (node 'reward'): unknown key 'dep' (did you mean 'deps'?)"),
        ({"id": "reward", "role": "REWARD", "type": "COMPUTE", "fn": "f", "deps": "generate"},
         "workflow[1] (node 'reward'): key 'deps': Input should be a valid list (got 'generate')"),
        ({"id": "", "role": "REWARD", "type": "COMPUTE", "fn": "f"},
         "workflow[1] (node ''): key 'id': node id must be non-empty and use only letters, digits, '_', '-', '.' "
         "(got '')"),
        ({"id": "a b", "role": "REWARD", "type": "COMPUTE", "fn": " "},
         "workflow[1] (node 'a b'): key 'id': node id must be non-empty and use only letters, digits, '_', '-', '.' "
         "(got 'a b'); key 'fn': fn must name a function (got an empty string)"),
        ({"role": "REWARD", "type": "COMPUTE", "fn": "f"}, "workflow[1]: missing key 'id'"),
        ("reward", "workflow[1]: expected a mapping with keys id, role, type, fn, got str 'reward'"),
    ],
)
def test_load_workflow_errors_name_index_id_and_key(bad: Any, expected: str) -> None:
    nodes = [copy.deepcopy(GRPO_WORKFLOW[0]), bad]
    with pytest.raises(WorkflowError) as ei:
        load_workflow(nodes)
    assert str(ei.value) == expected
    assert plan_error(nodes) == expected


def test_load_workflow_rejects_non_lists() -> None:
    for obj, kind in (("generate", "str"), (None, "NoneType"), ({"nodes": []}, "dict")):
        with pytest.raises(WorkflowError, match=f"workflow: expected a list of nodes, got {kind}"):
            load_workflow(obj)


def test_nodes_are_immutable() -> None:
    n = load_workflow(GRPO_WORKFLOW)[0]
    with pytest.raises(Exception):
        n.id = "other"  # type: ignore[misc]


def test_long_chain_plans_without_recursion() -> None:
    chain = [node("generate", type="MODEL_INFERENCE", fn="generate")]
    chain += [node(f"c{i}", deps=[chain[-1]["id"] if i == 0 else f"c{i - 1}"]) for i in range(3000)]
    chain.append(node("update", type="MODEL_TRAIN", deps=["c2999"]))
    p = plan(list(reversed(chain)), SIZES)
    assert p.depth["update"] == 3001 and ids(p.nodes)[:2] == ["generate", "c0"]
    assert p.boundary == [("c2999", "update")]


# ----------------------------------------------------------------------------- executor stages per group
@pytest.mark.parametrize("extra,sizes,expected", [
    (node("ref_c", role="REFERENCE", type="COMPUTE", deps=["generate"]), SIZES,
     "node 'ref_c' (role REFERENCE): no stage runs role REFERENCE with type COMPUTE (keys 'role', 'type')"),
    (node("rm_train", role="REWARD", type="MODEL_TRAIN", deps=["generate"]), SIZES,
     "node 'rm_train' (role REWARD): no stage runs role REWARD with type MODEL_TRAIN"),
    (node("crit", role="CRITIC", type="COMPUTE", deps=["generate"]), SIZES,
     "node 'crit' (role CRITIC): no stage runs role CRITIC with type COMPUTE"),
    (node("ref2", role="REFERENCE", type="MODEL_INFERENCE", deps=["generate"], group="rollout"), SIZES,
     "node 'ref2' (role REFERENCE): REFERENCE MODEL_INFERENCE cannot run on group 'rollout' (key 'group'); "
     "it runs on 'trainer'"),
    (node("score", role="REWARD", type="COMPUTE", deps=["reference"], group="trainer"), SIZES,
     "node 'score' (role REWARD): REWARD COMPUTE cannot run on group 'trainer' (key 'group'); it runs on "
     "'rollout', a group of its own"),
    (node("v", role="CRITIC", type="MODEL_INFERENCE", deps=["generate"], group="rm"), {**SIZES, "rm": 1},
     "node 'v' (role CRITIC): CRITIC MODEL_INFERENCE cannot run on group 'rm' (key 'group'); it runs on 'trainer'"),
])
def test_unknown_role_type_group_combinations_are_rejected_by_name(extra, sizes, expected) -> None:
    assert plan_error(wf(extra), sizes).startswith(expected)


def test_generate_only_on_rollout_and_supported_placements_plan() -> None:
    bad = copy.deepcopy(GRPO_WORKFLOW)
    bad[0]["group"] = "trainer"
    with pytest.raises(WorkflowError, match=r"ACTOR MODEL_INFERENCE cannot run on group 'trainer'"):
        plan(bad, SIZES)
    # a reward model on the rollout group, a learned reward model and a trainer-side estimator on the trainer
    ok = wf(node("rm", role="REWARD", type="MODEL_INFERENCE", deps=["generate"], group="rollout"),
            node("rm_t", role="REWARD", type="MODEL_INFERENCE", deps=["reference"]),
            node("est", fn="reinforce_pp", deps=["rm_t"]))
    p = plan(ok, SIZES)
    assert (p.group_of["rm"], p.group_of["rm_t"], p.group_of["est"]) == ("rollout", "trainer", "trainer")
    assert ids(plan(PPO_WORKFLOW, SIZES).pipeline("trainer")) == ["reference", "values", "gae", "update",
                                                                   "critic_update"]


@pytest.mark.parametrize("index, fn, message", [
    (0, "banana", "node 'generate' (role ACTOR): ACTOR MODEL_INFERENCE (generate) takes fn 'generate' or 'episodes', not 'banana' "
                  "(key 'fn')"),
    (3, "ref_logprb", "node 'reference' (role REFERENCE): REFERENCE MODEL_INFERENCE (reference logprobs) takes fn "
                      "'ref_logprob' or 'ref', not 'ref_logprb' (did you mean 'ref_logprob'?) (key 'fn')"),
])
def test_the_fn_of_a_stage_without_functions_is_one_it_knows(index, fn, message) -> None:
    """A generate or reference node's fn names no function, but a typo there was accepted
    whatever it said (workflow.0.fn=banana trained normally): it is refused, naming the key."""
    nodes = [dict(n) for n in GRPO_WORKFLOW]
    nodes[index]["fn"] = fn
    assert plan_error(nodes) == message
