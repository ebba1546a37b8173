"""The catalog of the RL step: every built-in stage and function, each named once, with what
it needs and what it produces.

Why it exists: an algorithm is a workflow DAG in the config. Its nodes name a stage by
``(role, type)`` and, inside it, a function by ``fn`` (``grpo``, ``gae``, ``cispo``, ...). Every
layer that has to know something about those names reads it here and nowhere else:

* the planner (:func:`distflow.core.dag.plan`) checks a DAG by what each stage and function
  declares it ``needs`` and ``produces`` (sample fields) and where it may run, not by names;
* the config checks node ``args`` (:mod:`distflow.rl.node_args`) and the rules that depend on a
  function's nature (a group baseline needs ``group_size >= 2``, a token-level estimator reads
  ``kl_in_reward``, a loss's own clip range);
* the step (:mod:`distflow.step`) runs a node by importing the stage's implementation for its
  group, and stages import a function's implementation (``Function.load``) lazily.

Adding an algorithm is one :class:`Function` entry here plus a pure function in ``distflow.rl``.
Torch-free: ``distflow run`` plans and checks a config before any process imports torch.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from distflow.rl.checks import Check, count, flag, number, one_of, path

__all__ = ["Function", "Stage", "StageError", "UserFunctionError", "FUNCTIONS", "STAGES", "ROLLOUT", "TRAINER", "CUSTOM", "REWARD_MODEL_DTYPES",
           "function", "functions", "stage", "node_io", "node_runs_on"]

ROLLOUT, TRAINER = "rollout", "trainer"
CUSTOM = "*"  # any group of group_sizes other than rollout and trainer (e.g. a reward-model group)

# Sample fields the planner follows through a DAG.
RESPONSES, REWARDS, VALUES, REF_LOGPROBS, ADVANTAGES, RETURNS = (
    "responses", "rewards", "values", "reference logprobs", "advantages", "returns")

class StageError(RuntimeError):
    """A stage could not run on a batch; names the workflow node."""


class UserFunctionError(StageError):
    """A function the config names (a reward) raised, or returned what no stage can use (a string,
    None, NaN): a bug in that function, which a restart would meet again. The node exits 2 (the
    exit of a configuration or data error, never restarted), naming the function, the row and
    what it returned."""


REWARD_MODEL_DTYPES = ("float32", "bfloat16", "float16")  # = distflow.device.COMPUTE_DTYPES (a test keeps them equal)


@dataclass(frozen=True)
class Function:
    """A built-in function a node names with ``fn``.

    ``kind``: ``outcome`` (advantage estimator over sample rewards, ``fn(rewards [n], group_ids
    [n], **args) -> [n]``), ``token`` (estimator over per-token rewards; trainer only), ``filter``
    (drops or regenerates samples), ``policy_loss`` or ``value_loss``. ``impl``: the
    ``module:attribute`` implementing it, imported on first use with ``bound`` keyword arguments.
    """

    name: str
    kind: str
    impl: str
    needs: frozenset[str] = frozenset()
    produces: frozenset[str] = frozenset()
    args: Mapping[str, Check] = field(default_factory=dict)
    bound: Mapping[str, Any] = field(default_factory=dict)
    runs_on: str | None = None  # the only group it may run on (None: where its inputs are)
    group_baseline: bool = False  # its baseline is the prompt's group: meaningless with group_size 1
    token_weighted: bool = False  # whitens over response tokens: callers pass token_counts
    # policy losses: the clip range and aggregation of their own ratio scale (where the config leaves them
    # unset), whether they recompute the proximal logprobs by default, and whether dual_clip applies
    clip: tuple[float, float] | None = None
    loss_agg: str | None = None
    recompute_old: bool = False
    surrogate: bool = False
    ignores: Mapping[str, str] = field(default_factory=dict)  # loss option key -> why this loss ignores it

    def load(self) -> Callable[..., Any]:
        return _load(self.impl, tuple(sorted(self.bound.items())))


@functools.lru_cache(maxsize=None)
def _load(impl: str, bound: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
    module, _, attr = impl.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    return functools.partial(fn, **dict(bound)) if bound else fn


_EPS = {"eps": number(0)}
_DISCOUNT = {"gamma": number(0, 1), "whiten": flag}
_ADV = "distflow.rl.advantages"
_LOSS = "distflow.rl.losses"

# The slots a node's fn names a function in: an ACTOR COMPUTE node's ("compute": estimators and filters),
# an ACTOR MODEL_TRAIN node's ("policy_loss"), a CRITIC MODEL_TRAIN node's ("value_loss") and a REWARD
# COMPUTE node's ("reward": the built-in rule rewards, fn(response, row) -> float). A name may
# appear in more than one slot (grpo is an estimator and a loss) but once in each.
FUNCTIONS: dict[str, dict[str, Function]] = {"compute": {}, "policy_loss": {}, "value_loss": {}, "reward": {}}


def _add(slot: str, *fns: Function) -> None:
    for f in fns:
        assert f.name not in FUNCTIONS[slot], f.name
        FUNCTIONS[slot][f.name] = f


_add("compute",
     Function("grpo", "outcome", f"{_ADV}:group_advantages", frozenset({REWARDS}), frozenset({ADVANTAGES}),
              {"norm_std": flag, **_EPS}, group_baseline=True),
     Function("dr_grpo", "outcome", f"{_ADV}:group_advantages", frozenset({REWARDS}), frozenset({ADVANTAGES}),
              dict(_EPS), bound={"norm_std": False}, group_baseline=True),
     Function("rloo", "outcome", f"{_ADV}:rloo_advantages", frozenset({REWARDS}), frozenset({ADVANTAGES}),
              group_baseline=True),
     Function("reinforce_pp", "outcome", f"{_ADV}:reinforce_pp_advantages", frozenset({REWARDS}),
              frozenset({ADVANTAGES}), dict(_EPS), token_weighted=True),
     Function("reinforce_pp_baseline", "outcome", f"{_ADV}:reinforce_pp_baseline_advantages", frozenset({REWARDS}),
              frozenset({ADVANTAGES}), dict(_EPS), group_baseline=True, token_weighted=True),
     # token-level: per-token rewards (the outcome on the last token, minus the KL with kl_in_reward), the
     # reference logprobs and the critic's values live on the trainer group. REINFORCE++ token: OpenRLHF's
     # discounted returns, whitened over the step.
     Function("gae", "token", "distflow.rl.gae:compute_gae", frozenset({REWARDS, VALUES}),
              frozenset({ADVANTAGES, RETURNS}), {**_DISCOUNT, "lam": number(0, 1)}, runs_on=TRAINER),
     Function("reinforce_pp_token", "token", f"{_ADV}:discounted_returns", frozenset({REWARDS}),
              frozenset({ADVANTAGES}), dict(_DISCOUNT), runs_on=TRAINER),
     # DAPO's dynamic sampling: regenerate, then drop, the groups whose rewards are all equal
     Function("dynamic_sampling", "filter", f"{_ADV}:nonconstant_groups", frozenset({REWARDS}),
              args={"max_retries": count(0), "refill": one_of("fresh", "same")}, group_baseline=True))
_add("policy_loss",
     # PPO's clipped token surrogate; KL, entropy, TIS and aggregation from finish_loss. PPO's advantages come
     # from GAE, DAPO is clip_high > clip_low + dynamic sampling + overlong shaping, REINFORCE++ keeps the clip.
     Function("grpo", "policy_loss", f"{_LOSS}:policy_loss", surrogate=True),
     Function("ppo", "policy_loss", f"{_LOSS}:policy_loss", surrogate=True),
     Function("dapo", "policy_loss", f"{_LOSS}:policy_loss", surrogate=True),
     Function("reinforce_pp", "policy_loss", f"{_LOSS}:policy_loss", surrogate=True),
     # GSPO's sequence ratio stays within ~1e-3 of 1 (its paper's 3e-4 / 4e-4); its objective is a mean over
     # sequences of the per-token mean (verl fixes it for GSPO); with a clip range of 3e-4 the engine's
     # logprobs are not close enough to the trainer's (bf16 differs by ~1e-3 per token): recompute them.
     Function("gspo", "policy_loss", f"{_LOSS}:gspo_loss", clip=(3e-4, 4e-4), loss_agg="seq-mean-token-mean",
              recompute_old=True, ignores={"dual_clip": "GSPO clips a sequence ratio; dual_clip bounds PPO's "
                                                        "token-level surrogate (grpo, ppo, dapo, reinforce_pp)"}),
     Function("cispo", "policy_loss", f"{_LOSS}:cispo_loss", ignores={
         "clip_low": "CISPO clips only the importance weight, from above: clip_high",
         "dual_clip": "CISPO has no clipped surrogate to dual-clip; its weight is bounded by clip_high"}))
_add("value_loss", Function("value_loss", "value_loss", "distflow.rl.gae:value_loss"))
_add("reward", *(Function(name, "reward", f"distflow.rollout.rewards:{name}", frozenset({RESPONSES}),
                          frozenset({REWARDS})) for name in ("successor", "gsm8k", "exact_match")))


def function(slot: str, name: str) -> Function | None:
    """The built-in function ``name`` of ``slot``, or None (a dotted ``package.module:function``, or unknown)."""
    return FUNCTIONS[slot].get(name)


def functions(slot: str, kind: str | None = None, **flags: Any) -> tuple[str, ...]:
    """The names in ``slot`` (of ``kind``, with every given attribute equal), in catalog order."""
    return tuple(f.name for f in FUNCTIONS[slot].values()
                 if (kind is None or f.kind == kind) and all(getattr(f, k) == v for k, v in flags.items()))


@dataclass(frozen=True)
class Stage:
    """What a workflow node of one ``(role, type)`` does. ``groups``: where it has an
    implementation (``CUSTOM``: a worker group of its own); ``slot``: the :data:`FUNCTIONS` slot its
    ``fn`` names (None: the fn is free, or a reward name); ``needs`` / ``produces``: the sample
    fields it reads and adds (for ``slot == "compute"``, its function's); ``args``: the keys its
    node may set (None: its function's); ``impl``: ``rollout`` (also worker groups) or ``trainer``
    -> ``module:function`` of the stage; ``timer``: the trainer metric its wall time goes to."""

    role: str
    type: str
    does: str
    groups: frozenset[str]
    impl: Mapping[str, str]
    needs: frozenset[str] = frozenset()
    produces: frozenset[str] = frozenset()
    slot: str | None = None
    args: Mapping[str, Check] | None = field(default_factory=dict)
    required: tuple[str, ...] = ()
    timer: str = "time_compute_s"
    fns: tuple[str, ...] | None = None  # the names its fn may take where no function slot decides (None: any)
    fn_produces: Mapping[str, frozenset[str]] = field(default_factory=dict)  # a fn of fns that makes more

    @property
    def key(self) -> tuple[str, str]:
        return self.role, self.type

    def load(self, group: str) -> Callable[..., Any]:
        """The implementation for a pipeline of ``group`` (a worker group runs the rollout stages)."""
        return _load(self.impl[TRAINER if group == TRAINER else ROLLOUT], ())


_R, _T = "distflow.rollout.stages", "distflow.trainer.stages"

STAGES: dict[tuple[str, str], Stage] = {s.key: s for s in (
    # fn generate: one response per sample; fn episodes: multi-turn episodes against the config's environment
    # or tools (docs/agents.md), which also score them (the environment's rewards; a REWARD node adds to them)
    Stage("ACTOR", "MODEL_INFERENCE", "generate", frozenset({ROLLOUT}), {ROLLOUT: f"{_R}:generate"},
          produces=frozenset({RESPONSES}), fns=("generate", "episodes"),
          fn_produces={"episodes": frozenset({RESPONSES, REWARDS})}),
    Stage("REWARD", "COMPUTE", "rule-based reward (needs the tokenizer's decode)", frozenset({ROLLOUT, CUSTOM}),
          {ROLLOUT: f"{_R}:reward"}, frozenset({RESPONSES}), frozenset({REWARDS}), slot="reward", args=None),
    Stage("REWARD", "MODEL_INFERENCE", "learned reward model", frozenset({ROLLOUT, TRAINER, CUSTOM}),
          {ROLLOUT: f"{_R}:reward_model", TRAINER: f"{_T}:reward_model"}, frozenset({RESPONSES}),
          frozenset({REWARDS}), args={"path": path, "weight": number(), "dtype": one_of(*REWARD_MODEL_DTYPES),
                                      "micro_batch_size": count(1)}, required=("path",), timer="time_reward_s"),
    Stage("ACTOR", "COMPUTE", "advantage estimator or filter", frozenset({ROLLOUT, TRAINER, CUSTOM}),
          {ROLLOUT: f"{_R}:advantage", TRAINER: f"{_T}:advantage"}, produces=frozenset({ADVANTAGES}),
          slot="compute", args=None),
    Stage("REFERENCE", "MODEL_INFERENCE", "reference logprobs", frozenset({TRAINER}), {TRAINER: f"{_T}:reference"},
          frozenset({RESPONSES}), frozenset({REF_LOGPROBS}), timer="time_logprobs_s", fns=("ref_logprob", "ref")),
    Stage("CRITIC", "MODEL_INFERENCE", "critic values", frozenset({TRAINER}), {TRAINER: f"{_T}:critic_values"},
          frozenset({RESPONSES}), frozenset({VALUES}), timer="time_critic_s"),
    Stage("ACTOR", "MODEL_TRAIN", "policy update", frozenset({TRAINER}), {TRAINER: f"{_T}:actor_update"},
          frozenset({ADVANTAGES}), slot="policy_loss", timer="time_update_s"),
    Stage("CRITIC", "MODEL_TRAIN", "critic update", frozenset({TRAINER}), {TRAINER: f"{_T}:critic_update"},
          frozenset({RETURNS}), slot="value_loss", timer="time_critic_s"),
)}


def stage(role: str, type_: str) -> Stage | None:
    return STAGES.get((role, type_))


def node_io(role: str, type_: str, fn: str) -> tuple[frozenset[str], frozenset[str]]:
    """(needs, produces) of a node: its stage's, or, for a function slot, its built-in function's
    (a dotted function is taken to read nothing the planner can check and to make what its stage makes)."""
    s = STAGES.get((role, type_))
    if s is None:
        return frozenset(), frozenset()
    f = FUNCTIONS[s.slot].get(fn) if s.slot == "compute" else None
    if f is None:  # a stage of its own, or a dotted compute function
        return s.needs, s.fn_produces.get(fn, s.produces)
    return s.needs | f.needs, f.produces


def node_runs_on(role: str, type_: str, fn: str) -> str | None:
    """The only group a node may run on because of its function (a token-level estimator), or None."""
    s = STAGES.get((role, type_))
    f = FUNCTIONS[s.slot].get(fn) if s is not None and s.slot else None
    return f.runs_on if f is not None else None
