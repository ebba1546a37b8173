"""The workflow DAG: the node spec of a config file's ``workflow:`` list, and the planner.

Why this module exists: in DistFlow an RL algorithm is a DAG written in the config, not
code, and there is no driver to interpret it at run time. Every node runs :func:`plan`
on the same config and gets the same answer — which worker group runs which workflow
node, in which order, and along which edges data crosses from one group to another (the
edges the buffer routes between peers). A bad workflow is rejected here, before any
process starts work, with an error that names the offending node.

Planning rules
--------------
* ids are unique, non-empty, made of letters, digits, ``_``, ``-``, ``.``; deps name
  existing nodes, not the node itself, not twice; the graph has no cycle.
* depth: 0 without deps, else 1 + the deepest dep. Plan order: by depth, ties by
  declaration order (every node reads the same config, so all agree).
* group of a node: its explicit ``group`` if set; else ACTOR MODEL_INFERENCE (generation)
  -> ``rollout``; any MODEL_TRAIN -> ``trainer``; any other MODEL_INFERENCE (REFERENCE,
  CRITIC, and REWARD models) -> ``trainer`` (frozen/critic models live with the trainer);
  a function the catalog ties to one group (the token-level estimators) -> that group, and
  only there; any other COMPUTE -> the group of its
  deepest dep, ties going to the later group in flow order. A COMPUTE node without deps has
  no input and is an error.
* flow order of groups: ``rollout`` first, ``trainer`` last, any other group of
  ``group_sizes`` in between in the mapping's order. Data edges only go forward (or stay
  within a group): weights flow back from trainer to rollout outside the DAG.
* every node's group must have workers (a positive size in ``group_sizes``).
* at least one MODEL_TRAIN node; exactly one ACTOR MODEL_INFERENCE (generate) node, and
  it has no deps (it reads prompts from the dataloader).
* what a node reads is made upstream of it (a dep, or a dep's dep): each stage and built-in
  function declares in the catalog (:mod:`distflow.rl.catalog`) the sample fields it ``needs``
  and ``produces`` (an estimator needs rewards, GAE also the critic's values and makes returns,
  an update needs advantages, the critic's update returns); a generate node exists. Else the run
  would fail at step 1, after loading. A function that runs on one group only (a token-level
  estimator: per-token rewards, reference logprobs, values live on the trainer) runs there.
* every (role, type) must have a stage on its group (the catalog's ``groups``): e.g.
  generation only on ``rollout``, training and the reference/critic models only on
  ``trainer``; REFERENCE COMPUTE or a REWARD MODEL_TRAIN node has no stage anywhere. The
  step (:mod:`distflow.step`) runs the same catalog, so a plan that passes here never meets
  an unknown stage at run time.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from distflow.rl.catalog import CUSTOM, FUNCTIONS, ROLLOUT, STAGES, TRAINER, node_io, node_runs_on  # torch-free

__all__ = [
    "ROLLOUT", "TRAINER", "Role", "NodeType", "WorkflowNode", "WorkflowError", "Plan", "plan", "load_workflow",
    "GRPO_WORKFLOW", "PPO_WORKFLOW", "STAGE_GROUPS", "CUSTOM",
]

_ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


class _CaseInsensitiveEnum(str, Enum):
    @classmethod
    def _missing_(cls, value: object) -> Any:
        if isinstance(value, str):
            return cls.__members__.get(value.strip().upper())
        return None


class Role(_CaseInsensitiveEnum):
    """Which model (or function family) a workflow node belongs to."""

    ACTOR = "ACTOR"
    CRITIC = "CRITIC"
    REWARD = "REWARD"
    REFERENCE = "REFERENCE"


class NodeType(_CaseInsensitiveEnum):
    """What a workflow node does: run a model forward, train a model, or compute on tensors."""

    MODEL_INFERENCE = "MODEL_INFERENCE"
    MODEL_TRAIN = "MODEL_TRAIN"
    COMPUTE = "COMPUTE"


# (role, type) -> the groups with an implementation of its stage (the catalog's; CUSTOM: a group of its own).
STAGE_GROUPS: dict[tuple[str, str], frozenset[str]] = {k: st.groups for k, st in STAGES.items()}


def _check_stage(n: "WorkflowNode", group: str) -> None:
    key = (n.role.value, n.type.value)
    allowed = STAGE_GROUPS.get(key)
    kind = group if group in (ROLLOUT, TRAINER) else CUSTOM
    if allowed is None:
        known = ", ".join(f"{r} {t}" for r, t in STAGE_GROUPS)
        raise WorkflowError(f"{n.label}: no stage runs role {key[0]} with type {key[1]} (keys 'role', 'type'); "
                            f"supported: {known}")
    if kind not in allowed:
        where = ", ".join(sorted("a group of its own" if g == CUSTOM else repr(g) for g in allowed))
        raise WorkflowError(f"{n.label}: {key[0]} {key[1]} cannot run on group {group!r} (key 'group'); it runs "
                            f"on {where}")
    spec = STAGES[key]
    if spec.fns is not None and n.fn not in spec.fns:
        close = difflib.get_close_matches(n.fn, list(spec.fns), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise WorkflowError(f"{n.label}: {key[0]} {key[1]} ({spec.does}) takes fn {' or '.join(map(repr, spec.fns))}, "
                            f"not {n.fn!r}{hint} (key 'fn')")


class WorkflowError(ValueError):
    """An invalid workflow; the message names the offending node (and key, where relevant)."""


class WorkflowNode(BaseModel):
    """One node of a workflow, as written in the config file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    role: Role
    type: NodeType
    fn: str
    deps: list[str] = Field(default_factory=list)
    group: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("id")
    @classmethod
    def _check_id(cls, v: str) -> str:
        if not _ID_RE.match(v):
            raise ValueError(f"node id must be non-empty and use only letters, digits, '_', '-', '.' (got {v!r})")
        return v

    @field_validator("fn")
    @classmethod
    def _check_fn(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("fn must name a function (got an empty string)")
        return v

    @field_validator("group")
    @classmethod
    def _check_group(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("group must be a non-empty group name, or left out")
        return v

    @property
    def label(self) -> str:
        """``node 'x' (role R)``, the way every planner error names a node."""
        return f"node {self.id!r} (role {self.role.value})"


@dataclass
class Plan:
    """The planner's answer: identical on every node that reads the same config."""

    nodes: list[WorkflowNode]  # topological order: by depth, ties by declaration order
    depth: dict[str, int]
    group_of: dict[str, str]  # node id -> worker group
    pipelines: dict[str, list[WorkflowNode]]  # every configured group (in flow order) -> its nodes in order
    boundary: list[tuple[str, str]]  # (dep_id, node_id) edges whose ends are in different groups
    flow: list[str] = field(default_factory=list)  # groups in flow order (data only moves forward)

    def pipeline(self, group: str) -> list[WorkflowNode]:
        """This group's linear pipeline in execution order ([] for a group with no nodes)."""
        if group not in self.pipelines:
            raise WorkflowError(f"no group {group!r} in this plan (groups: {', '.join(self.pipelines)})")
        return self.pipelines[group]

    def node(self, node_id: str) -> WorkflowNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise WorkflowError(f"no node {node_id!r} in this plan")

    def consumers(self, node_id: str) -> list[WorkflowNode]:
        """Nodes that take ``node_id``'s output as input, in plan order."""
        self.node(node_id)
        return [n for n in self.nodes if node_id in n.deps]

    def boundary_into(self, group: str) -> list[tuple[str, str]]:
        """Cross-group edges whose consumer runs on ``group`` (data this group receives)."""
        return [(d, n) for d, n in self.boundary if self.group_of[n] == group]

    def boundary_out_of(self, group: str) -> list[tuple[str, str]]:
        """Cross-group edges whose producer runs on ``group`` (data this group sends)."""
        return [(d, n) for d, n in self.boundary if self.group_of[d] == group]


# ----------------------------------------------------------------------------- loading
def _suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _format_error(err: Mapping[str, Any]) -> str:
    loc = err.get("loc", ())
    key = str(loc[0]) if loc else "?"
    path = key + "".join(f"[{p}]" for p in loc[1:])
    kind = err.get("type", "")
    if kind == "missing":
        return f"missing key {path!r}"
    if kind == "extra_forbidden":
        return f"unknown key {path!r}{_suggest(key, list(WorkflowNode.model_fields))}"
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    if kind == "value_error":  # our validators already quote the value
        return f"key {path!r}: {msg}"
    got = repr(err.get("input"))
    return f"key {path!r}: {msg} (got {got[:80] + '...' if len(got) > 80 else got})"


def load_workflow(obj: Any) -> list[WorkflowNode]:
    """Validate a workflow: a list of node mappings (or ``{"workflow": [...]}``) -> nodes.

    Node-level problems (missing/unknown keys, bad role or type, bad id) raise
    :class:`WorkflowError` naming the node's index and id and the key. Graph-level checks
    (deps, cycles, groups) are :func:`plan`'s job.
    """
    if isinstance(obj, Mapping) and "workflow" in obj:
        obj = obj["workflow"]
    if isinstance(obj, (str, bytes)) or not isinstance(obj, Sequence):
        raise WorkflowError(f"workflow: expected a list of nodes, got {type(obj).__name__}")
    nodes: list[WorkflowNode] = []
    for i, item in enumerate(obj):
        if isinstance(item, WorkflowNode):
            nodes.append(item)
            continue
        if not isinstance(item, Mapping):
            raise WorkflowError(f"workflow[{i}]: expected a mapping with keys id, role, type, fn, got "
                                f"{type(item).__name__} {item!r}")
        node_id = item.get("id")
        label = f"workflow[{i}]" + (f" (node {node_id!r})" if isinstance(node_id, str) else "")
        try:
            nodes.append(WorkflowNode.model_validate(dict(item)))
        except ValidationError as e:
            raise WorkflowError(f"{label}: " + "; ".join(_format_error(err) for err in e.errors())) from None
    return nodes


# ----------------------------------------------------------------------------- planning
def _check_sizes(group_sizes: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(group_sizes, Mapping):
        raise WorkflowError(f"group_sizes: expected a mapping group -> size, got {type(group_sizes).__name__}")
    sizes: dict[str, int] = {}
    for g, s in group_sizes.items():
        if not isinstance(g, str) or not g:
            raise WorkflowError(f"group_sizes: group names must be non-empty strings, got {g!r}")
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise WorkflowError(f"group_sizes[{g!r}] must be a non-negative integer, got {s!r}")
        sizes[g] = s
    return sizes


def _check_graph(nodes: list[WorkflowNode]) -> dict[str, WorkflowNode]:
    by_id: dict[str, WorkflowNode] = {}
    first_index: dict[str, int] = {}
    for i, n in enumerate(nodes):
        if n.id in by_id:
            raise WorkflowError(f"duplicate node id {n.id!r} (workflow[{first_index[n.id]}] and workflow[{i}])")
        by_id[n.id] = n
        first_index[n.id] = i
    for n in nodes:
        seen: set[str] = set()
        for d in n.deps:
            if d == n.id:
                raise WorkflowError(f"{n.label} depends on itself (key 'deps')")
            if d not in by_id:
                raise WorkflowError(f"{n.label}: key 'deps' names unknown node {d!r}{_suggest(d, list(by_id))}")
            if d in seen:
                raise WorkflowError(f"{n.label}: key 'deps' lists {d!r} twice")
            seen.add(d)
    cycle = _find_cycle(nodes, by_id)
    if cycle:
        chain = " -> ".join(repr(c) for c in cycle)
        raise WorkflowError(f"workflow has a dependency cycle through nodes {', '.join(repr(c) for c in cycle[:-1])}: "
                            f"{chain} (a -> b: a depends on b)")
    return by_id


def _find_cycle(nodes: list[WorkflowNode], by_id: dict[str, WorkflowNode]) -> list[str] | None:
    """A cycle as [a, b, ..., a] (each depends on the next), or None. Iterative DFS, declaration order."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    for root in nodes:
        if state.get(root.id):
            continue
        stack: list[tuple[str, int]] = [(root.id, 0)]
        path: list[str] = [root.id]
        state[root.id] = 1
        while stack:
            nid, i = stack[-1]
            deps = by_id[nid].deps
            if i == len(deps):
                stack.pop()
                path.pop()
                state[nid] = 2
                continue
            stack[-1] = (nid, i + 1)
            d = deps[i]
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if not state.get(d):
                state[d] = 1
                stack.append((d, 0))
                path.append(d)
    return None


def _depths(nodes: list[WorkflowNode], by_id: dict[str, WorkflowNode]) -> dict[str, int]:
    depth: dict[str, int] = {}

    def visit(nid: str) -> int:  # iterative to survive long chains
        todo = [nid]
        while todo:
            cur = todo[-1]
            missing = [d for d in by_id[cur].deps if d not in depth]
            if missing:
                todo.extend(missing)
                continue
            todo.pop()
            depth[cur] = 1 + max((depth[d] for d in by_id[cur].deps), default=-1)
        return depth[nid]

    for n in nodes:
        visit(n.id)
    return depth


def _check_inputs(order: list[WorkflowNode], by_id: dict[str, WorkflowNode]) -> None:
    """Each node's inputs are made upstream of it (module docstring); ``order`` is topological."""
    if not any(n.role is Role.ACTOR and n.type is NodeType.MODEL_INFERENCE for n in order):
        raise WorkflowError(f"workflow has no ACTOR MODEL_INFERENCE (generate) node (nodes: "
                            f"{', '.join(repr(n.id) for n in order)}): nothing would produce samples")

    upstream: dict[str, set[str]] = {}
    for n in order:
        up = upstream[n.id] = set().union(*(upstream[d] | node_io(by_id[d].role.value, by_id[d].type.value,
                                                                   by_id[d].fn)[1] for d in n.deps))
        needs, _ = node_io(n.role.value, n.type.value, n.fn)
        for what in sorted(needs - up - {"responses"}):  # the responses: every node is downstream of generate
            raise WorkflowError(f"{n.label}: {n.fn} reads {what}, but no node upstream of it (key 'deps', "
                                f"directly or through its deps) makes them: {_makers(what)}")


def _makers(what: str) -> str:
    """Which nodes make sample field ``what``, as the catalog declares: 'a REWARD COMPUTE or ... node'."""
    out = []
    for (role, type_), st in STAGES.items():
        if st.slot == "compute":
            names = [f.name for f in FUNCTIONS["compute"].values() if what in f.produces]
            if names:
                out.append(f"{role} {type_} ({', '.join(names)})")
        elif what in st.produces:
            out.append(f"{role} {type_}")
        elif fns := [fn for fn, made in st.fn_produces.items() if what in made]:
            out.append(f"{role} {type_} ({', '.join(fns)})")
    joined = " or ".join(out)
    return f"{'an' if joined[0] in 'AEIOU' else 'a'} {joined} node"


def _flow_order(sizes: dict[str, int]) -> list[str]:
    return [ROLLOUT] + [g for g in sizes if g not in (ROLLOUT, TRAINER)] + [TRAINER]


def _default_group(n: WorkflowNode, depth: dict[str, int], group_of: dict[str, str], rank: dict[str, int]) -> str:
    if n.group is not None:
        return n.group
    if n.type is NodeType.MODEL_INFERENCE:
        return ROLLOUT if n.role is Role.ACTOR else TRAINER
    if n.type is NodeType.MODEL_TRAIN:
        return TRAINER
    only = node_runs_on(n.role.value, n.type.value, n.fn)
    if only is not None:  # a token-level estimator: per-token rewards, reference logprobs, values
        return only
    if not n.deps:
        raise WorkflowError(f"{n.label}: a COMPUTE node runs where its inputs are, so key 'deps' must name at "
                            f"least one node")
    deepest = max(depth[d] for d in n.deps)
    candidates = [group_of[d] for d in n.deps if depth[d] == deepest]
    return max(candidates, key=lambda g: rank.get(g, -1))


def plan(nodes: Sequence[WorkflowNode] | Sequence[Mapping[str, Any]], group_sizes: Mapping[str, int]) -> Plan:
    """Validate a workflow and split it into per-group pipelines.

    nodes: :class:`WorkflowNode` objects or their config mappings. group_sizes: workers per
    group, e.g. ``{"rollout": 2, "trainer": 2}``. Raises :class:`WorkflowError` naming the
    offending node for every rule in the module docstring.
    """
    wf = load_workflow(nodes)
    if not wf:
        raise WorkflowError("workflow is empty: it needs at least one MODEL_TRAIN node")
    sizes = _check_sizes(group_sizes)
    by_id = _check_graph(wf)

    generators = [n for n in wf if n.role is Role.ACTOR and n.type is NodeType.MODEL_INFERENCE]
    if len(generators) > 1:
        raise WorkflowError(f"at most one ACTOR MODEL_INFERENCE (generate) node is allowed, got "
                            f"{', '.join(repr(n.id) for n in generators)}")
    for g in generators:
        if g.deps:
            raise WorkflowError(f"{g.label}: the generate node reads prompts from the dataloader, so key 'deps' "
                                f"must be empty (got {g.deps})")
    for role in (Role.ACTOR, Role.CRITIC):  # two updates would step twice a step (versions count steps)
        updates = [n for n in wf if n.role is role and n.type is NodeType.MODEL_TRAIN]
        if len(updates) > 1:
            ids = ", ".join(repr(n.id) for n in updates)
            raise WorkflowError(f"at most one {role.value} MODEL_TRAIN node is allowed (one optimizer step per "
                                f"mini-batch; policy versions count steps), got {ids}")
    if not any(n.type is NodeType.MODEL_TRAIN for n in wf):
        raise WorkflowError(f"workflow has no MODEL_TRAIN node (nodes: {', '.join(repr(n.id) for n in wf)}): "
                            f"nothing would be trained")

    depth = _depths(wf, by_id)
    decl = {n.id: i for i, n in enumerate(wf)}
    order = sorted(wf, key=lambda n: (depth[n.id], decl[n.id]))
    _check_inputs(order, by_id)
    flow = _flow_order(sizes)
    rank = {g: i for i, g in enumerate(flow)}

    group_of: dict[str, str] = {}
    for n in order:
        g = _default_group(n, depth, group_of, rank)
        if g not in sizes:
            configured = ", ".join(f"{k}={v}" for k, v in sizes.items()) or "none"
            raise WorkflowError(f"{n.label} has no workers: group {g!r} is not configured (group sizes: {configured})")
        if sizes[g] == 0:
            raise WorkflowError(f"{n.label} has no workers: group {g!r} has size 0")
        _check_stage(n, g)
        only = node_runs_on(n.role.value, n.type.value, n.fn)
        if only is not None and g != only:
            raise WorkflowError(f"{n.label}: {n.fn} runs on the {only} group only, not on {g!r} (key 'group')")
        group_of[n.id] = g

    boundary: list[tuple[str, str]] = []
    for n in order:
        for d in n.deps:
            gd, gn = group_of[d], group_of[n.id]
            if gd == gn:
                continue
            if rank[gd] > rank[gn]:
                raise WorkflowError(
                    f"{n.label} on group {gn!r} depends on node {d!r} on group {gd!r}: data must flow forward "
                    f"({' -> '.join(f for f in flow if f in sizes)}); weights flow back outside the DAG")
            boundary.append((d, n.id))

    pipelines = {g: [n for n in order if group_of[n.id] == g] for g in flow if g in sizes}
    return Plan(nodes=order, depth={n.id: depth[n.id] for n in order}, group_of=group_of, pipelines=pipelines,
                boundary=boundary, flow=[g for g in flow if g in sizes])


# ----------------------------------------------------------------------------- reference workflows
GRPO_WORKFLOW: list[dict[str, Any]] = [
    {"id": "generate", "role": "ACTOR", "type": "MODEL_INFERENCE", "fn": "generate"},
    {"id": "reward", "role": "REWARD", "type": "COMPUTE", "fn": "successor", "deps": ["generate"]},
    {"id": "advantage", "role": "ACTOR", "type": "COMPUTE", "fn": "grpo", "deps": ["reward"]},
    {"id": "reference", "role": "REFERENCE", "type": "MODEL_INFERENCE", "fn": "ref_logprob", "deps": ["generate"]},
    {"id": "update", "role": "ACTOR", "type": "MODEL_TRAIN", "fn": "grpo", "deps": ["advantage", "reference"]},
]

PPO_WORKFLOW: list[dict[str, Any]] = [
    {"id": "generate", "role": "ACTOR", "type": "MODEL_INFERENCE", "fn": "generate"},
    {"id": "reward", "role": "REWARD", "type": "COMPUTE", "fn": "successor", "deps": ["generate"]},
    {"id": "reference", "role": "REFERENCE", "type": "MODEL_INFERENCE", "fn": "ref_logprob", "deps": ["generate"]},
    {"id": "values", "role": "CRITIC", "type": "MODEL_INFERENCE", "fn": "value", "deps": ["generate"]},
    {"id": "gae", "role": "ACTOR", "type": "COMPUTE", "fn": "gae", "deps": ["reward", "values"],
     "args": {"gamma": 1.0, "lam": 0.95}},
    {"id": "update", "role": "ACTOR", "type": "MODEL_TRAIN", "fn": "ppo", "deps": ["gae", "reference"]},
    {"id": "critic_update", "role": "CRITIC", "type": "MODEL_TRAIN", "fn": "value_loss", "deps": ["gae"]},
]
