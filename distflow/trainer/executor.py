"""The trainer group's executor: a registry of stage functions run in plan order.

Why this module exists: the trainer's part of a workflow (reference logprobs, critic
values, GAE, actor and critic updates, ...) is a plan, not a hard-coded switch. Each
workflow node's (role, type) selects a registered stage; the node's ``fn`` picks the
function inside it. The pairs registered here are those
:data:`distflow.core.dag.STAGE_GROUPS` allows on ``trainer``, so the planner has already
rejected anything else with the node's name.

Stages: ``stage(node, ctx, batch) -> dict of metrics`` (may add fields to ``batch``):

* REFERENCE MODEL_INFERENCE -> ``ctx.actor.reference_logprobs`` (``ref_logprobs``);
* CRITIC MODEL_INFERENCE -> ``ctx.critic.values`` (``values``);
* ACTOR COMPUTE -> ``gae`` or ``reinforce_pp_token`` (per-token rewards: the shaped outcome on
  the last token, minus ``kl_coef`` x KL with ``kl_in_reward``; advantages whitened over the
  whole step), or an outcome estimator computed over the WHOLE step (rewards gathered from
  every rank, so group baselines and REINFORCE++'s global normalisation see all samples);
* REWARD MODEL_INFERENCE -> a learned reward model (:mod:`distflow.rl.reward_model`);
* ACTOR MODEL_TRAIN -> ``ctx.actor.update``; CRITIC MODEL_TRAIN -> ``ctx.critic.update``
  (metrics prefixed ``critic_``).

Every stage runs on every rank of the trainer group (they are collectives).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from distflow.buffer.batch import SampleBatch
from distflow.core.config import Config
from distflow.core.dag import WorkflowNode
from distflow.core.executor import StageRegistry
from distflow.device import COMPUTE_DTYPES, collective_device, node_device
from distflow.rl.advantages import token_rewards
from distflow.rl.kl import kl_estimate
from distflow.rl.registry import ADVANTAGE_ESTIMATORS, TOKEN_ESTIMATORS, outcome_advantages, resolve
from distflow.rl.reward_model import score_batch
from distflow.rl.shaping import group_index, mask_truncated, outcome_rewards, trained_samples, trained_token_counts

__all__ = ["TrainerContext", "STAGES", "register_stage", "run_pipeline", "build_context", "save_checkpoint",
           "padded", "flat"]


@dataclass
class TrainerContext:
    """What a trainer stage may use. ``all_reduce(values, op)`` and ``all_gather(obj)`` are the
    group's collectives (defaults: torch.distributed, or identity without a process group)."""

    cfg: Config
    actor: Any = None
    critic: Any = None
    all_reduce: Callable[..., list[float]] | None = None
    all_gather: Callable[[Any], list[Any]] | None = None
    rank: int = 0  # this rank in the trainer group (all_gather returns parts in rank order)
    stats: dict[str, float] = field(default_factory=dict)

    def reduce(self, values: list[float]) -> list[float]:
        if self.all_reduce is not None:
            return self.all_reduce(values)
        if dist.is_available() and dist.is_initialized():
            t = torch.tensor(values, dtype=torch.float64, device=collective_device())
            dist.all_reduce(t)
            return t.tolist()
        return list(values)

    def gather(self, obj: Any) -> list[Any]:
        if self.all_gather is not None:
            return self.all_gather(obj)
        if dist.is_available() and dist.is_initialized():
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
            return out
        return [obj]


Stage = Callable[[WorkflowNode, TrainerContext, SampleBatch], dict[str, float]]
REGISTRY: StageRegistry[Stage] = StageRegistry("trainer")
STAGES = REGISTRY.stages
register_stage = REGISTRY.register


# ----------------------------------------------------------------------------- ragged <-> padded
def padded(flat_values: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """flat [sum(lens)] -> (values [B, max(lens)] zero-padded, mask [B, max(lens)] bool):
    the actor's :func:`~distflow.trainer.actor.flat_to_padded` for a lengths tensor."""
    from distflow.trainer.actor import flat_to_padded

    return flat_to_padded(flat_values, [int(n) for n in lens.tolist()])


def flat(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`padded`: [B, T] -> flat [sum(mask)]."""
    return values[mask]


def _need(node: WorkflowNode, what: Any, name: str) -> Any:
    if what is None:
        raise RuntimeError(f"workflow node {node.id!r}: the trainer has no {name} (build_context creates it when "
                           f"the pipeline has a node that needs it)")
    return what


# ----------------------------------------------------------------------------- stages
@register_stage("REFERENCE", "MODEL_INFERENCE")
def reference(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    _need(node, ctx.actor, "actor").reference_logprobs(batch)
    return {}


@register_stage("CRITIC", "MODEL_INFERENCE")
def critic_values(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    _need(node, ctx.critic, "critic").values(batch)
    return {}


@register_stage("REWARD", "MODEL_INFERENCE")
def reward_model(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    """Each rank scores its own samples with a replicated, frozen reward model."""
    score_batch(node, batch, node_device(ctx.cfg.device), COMPUTE_DTYPES[ctx.cfg.dtype], ctx.cfg.model_path)
    return {}


def _token_rewards(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch,
                   mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards [B, T] of a token-level estimator: the shaped outcome on the last response
    token, minus ``kl_coef`` x KL(old || ref) per token with ``kl_in_reward``."""
    cfg = ctx.cfg
    lens = batch.tensors["response_lens"]
    kl = None
    if cfg.kl_in_reward and cfg.kl_coef > 0 and len(batch):
        if "ref_logprobs" not in batch.tensors:  # the config puts a REFERENCE node before it; never silently no KL
            raise ValueError(f"workflow node {node.id!r}: kl_in_reward needs the reference logprobs, but no "
                             f"REFERENCE MODEL_INFERENCE node ran before it on the trainer group")
        old = batch.tensors.get("old_logprobs")
        old = batch.tensors["logprobs"] if old is None else old
        kl = kl_estimate(padded(old.float(), lens)[0], padded(batch.tensors["ref_logprobs"].float(), lens)[0],
                         cfg.kl_reward_estimator)
    outcome = outcome_rewards(batch, cfg) if len(batch) else torch.zeros(0)
    return token_rewards(outcome, mask, kl, cfg.kl_coef if kl is not None else 0.0)


def _whiten_tokens(ctx: TrainerContext, batch: SampleBatch, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """adv [B, T] whitened over the tokens the loss trains on, of every rank of the step (overlong:
    mask leaves some out): ``(a - mean) * rsqrt(var + 1e-8)``, unbiased var, as verl does; masked
    positions 0. Two passes in fp64 (the mean, then the squared deviations from it): REINFORCE++'s
    returns sit near the reward with a spread of ~1e-4 when every sample is right, and a one-pass
    ``E[a^2] - mean^2`` cancels to 0 there. Collectives: every rank calls it."""
    m = mask & trained_samples(batch, ctx.cfg)[:, None]
    picked = adv[m].double()
    n, s = ctx.reduce([float(m.sum()), float(picked.sum())])
    if n <= 1:
        return adv
    mean = s / n
    (sq,) = ctx.reduce([float(((picked - mean) ** 2).sum())])
    scale = 1.0 / math.sqrt(sq / (n - 1) + 1e-8)
    return torch.where(mask, ((adv.double() - mean) * scale).to(adv.dtype), 0.0)


def _set_token_advantages(batch: SampleBatch, ctx: TrainerContext, adv: torch.Tensor, mask: torch.Tensor) -> None:
    adv = mask_truncated(adv, batch, ctx.cfg)
    batch.set_ragged("token_advantages", flat(adv, mask).float())
    batch.set_scalar("advantage", adv.sum(1) / torch.clamp(mask.sum(1), min=1))


def gae(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    """PPO's advantages: ``token_advantages`` and ``returns`` (ragged) from rewards and values.
    ``node.args``: ``gamma``, ``lam`` (default: the config's), ``whiten`` (default true:
    advantages normalised over every valid token of the step, all ranks)."""
    cfg = ctx.cfg
    if "values" not in batch.tensors:
        raise ValueError(f"workflow node {node.id!r}: gae needs the critic's 'values' (a CRITIC MODEL_INFERENCE "
                         f"node among its deps)")
    values, mask = padded(batch.tensors["values"].float(), batch.tensors["response_lens"])
    rewards = _token_rewards(node, ctx, batch, mask)
    gamma, lam = float(node.args.get("gamma", cfg.gamma)), float(node.args.get("lam", cfg.lam))
    adv, ret = TOKEN_ESTIMATORS["gae"](rewards, values, mask, gamma, lam)
    if node.args.get("whiten", True):
        adv = _whiten_tokens(ctx, batch, adv, mask)
    _set_token_advantages(batch, ctx, adv, mask)
    batch.set_ragged("returns", flat(ret, mask).float())
    return {}


def reinforce_pp_token(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    """REINFORCE++ over per-token rewards (OpenRLHF's ``reinforce_plus_plus``): each token's advantage
    is its discounted return ``G_t = r_t + gamma G_{t+1}`` of the token rewards (the outcome on the
    last token, minus ``kl_coef`` x KL per token with ``kl_in_reward``), whitened over every trained
    token of the step (all ranks). No critic. ``node.args``: ``gamma`` (default: the config's),
    ``whiten`` (default true)."""
    lens = batch.tensors["response_lens"]
    mask = padded(torch.zeros(int(lens.sum()), device=lens.device), lens)[1]  # on the batch's device
    rewards = _token_rewards(node, ctx, batch, mask)
    adv = TOKEN_ESTIMATORS["reinforce_pp_token"](rewards, mask, float(node.args.get("gamma", ctx.cfg.gamma)))
    if node.args.get("whiten", True):
        adv = _whiten_tokens(ctx, batch, adv, mask)
    _set_token_advantages(batch, ctx, adv, mask)
    return {}


TOKEN_STAGES: dict[str, Stage] = {"gae": gae, "reinforce_pp_token": reinforce_pp_token}


def global_outcome_advantage(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    """An outcome estimator over the whole step: every rank gathers (prompt ids, rewards) of
    all ranks in rank order, computes the estimator and keeps its own slice."""
    resolve(ADVANTAGE_ESTIMATORS, node.fn, f"workflow node {node.id!r} advantage estimator")  # before the gather
    mine = (list(batch.prompt_ids), (outcome_rewards(batch, ctx.cfg) if len(batch) else torch.zeros(0)).tolist(),
            trained_token_counts(batch, ctx.cfg).tolist())
    parts = ctx.gather(mine)
    offset = sum(len(p[0]) for p in parts[:ctx.rank])
    pids = [x for p in parts for x in p[0]]
    rewards = torch.tensor([x for p in parts for x in p[1]], dtype=torch.float32)
    lens = torch.tensor([x for p in parts for x in p[2]], dtype=torch.int64)
    adv = outcome_advantages(node.fn, f"workflow node {node.id!r} advantage estimator", rewards, group_index(pids),
                             lens, node.args)[offset:offset + len(batch)]
    batch.set_scalar("advantage", mask_truncated(adv, batch, ctx.cfg))
    return {}


@register_stage("ACTOR", "COMPUTE")
def advantage(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    if node.fn in TOKEN_STAGES:
        return TOKEN_STAGES[node.fn](node, ctx, batch)
    return global_outcome_advantage(node, ctx, batch)


@register_stage("ACTOR", "MODEL_TRAIN")
def actor_update(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    actor = _need(node, ctx.actor, "actor")
    t_lp = 0.0
    if ctx.cfg.recompute_old_logprobs and "old_logprobs" not in batch.tensors and hasattr(actor, "old_logprobs"):
        t0 = time.perf_counter()
        actor.old_logprobs(batch)  # the proximal policy, before the update (timed as a logprob pass)
        t_lp = time.perf_counter() - t0
    return {**actor.update(node, batch), "time_logprobs_s": t_lp}


@register_stage("CRITIC", "MODEL_TRAIN")
def critic_update(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    stats = _need(node, ctx.critic, "critic").update(node, batch)
    return {f"critic_{k}" if not k.startswith(("vf_", "critic_")) else k: v for k, v in stats.items()}


# ----------------------------------------------------------------------------- the executor
def run_pipeline(pipeline: list[WorkflowNode], ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    """Run the trainer group's pipeline on one step's batch in plan order (deps checked);
    returns the merged metrics of every stage plus where the time went (``time_logprobs_s``,
    ``time_update_s``, ``time_critic_s``, ``time_reward_s``, ``time_compute_s``). Blocking;
    every rank calls it."""
    stats: dict[str, float] = {"time_logprobs_s": 0.0, "time_update_s": 0.0}
    for node, stage in REGISTRY.walk(pipeline):
        t0 = time.perf_counter()
        out = dict(stage(node, ctx, batch))
        took = time.perf_counter() - t0
        lp = out.pop("time_logprobs_s", 0.0)
        stats.update(out)
        key = _TIMERS.get((node.role.value, node.type.value), "time_compute_s")
        stats["time_logprobs_s"] += lp
        stats[key] = stats.get(key, 0.0) + took - lp
    return stats


# Where each stage's wall time is reported (the step's metrics say where its time went).
_TIMERS = {("REFERENCE", "MODEL_INFERENCE"): "time_logprobs_s", ("ACTOR", "MODEL_TRAIN"): "time_update_s",
           ("CRITIC", "MODEL_INFERENCE"): "time_critic_s", ("CRITIC", "MODEL_TRAIN"): "time_critic_s",
           ("REWARD", "MODEL_INFERENCE"): "time_reward_s"}


def build_context(cfg: Config, pipeline: list[WorkflowNode], actor: Any) -> TrainerContext:
    """The context for ``pipeline``: the given actor, and a :class:`~distflow.trainer.critic.Critic`
    when the pipeline has CRITIC nodes (a collective: every rank calls it)."""
    critic = None
    if any(n.role.value == "CRITIC" for n in pipeline):
        from distflow.trainer.critic import Critic

        critic = Critic(cfg)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return TrainerContext(cfg, actor=actor, critic=critic, rank=rank)


def save_checkpoint(ctx: TrainerContext, out_dir: Any, state: dict[str, torch.Tensor] | None, run_state: dict) -> None:
    """Actor checkpoint plus, with a critic, ``<out_dir>/critic/`` (a collective). Rank 0 takes
    the completion marker away before anything is written and puts it back only after the last
    part: a checkpoint killed mid-write is never taken for a whole one (``newest_checkpoint``).
    ``state``: the actor's full state dict, or None to gather it here, which lets rank 0 drop its
    full fp32 copy of the policy before the critic gathers its own (two at once: ~57 GB at 7B)."""
    from pathlib import Path

    from distflow.launch.checkpoint import mark_checkpoint, unmark_checkpoint

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if ctx.rank == 0:  # before the first collective of the save: no rank has written anything yet
        unmark_checkpoint(out)
    ctx.actor.save_checkpoint(out, ctx.actor.full_state_dict() if state is None else state)  # no name holds it after
    if ctx.critic is not None:
        ctx.critic.save_checkpoint(out)
    if ctx.rank == 0:
        mark_checkpoint(out, {"policy_version": ctx.actor.version, **run_state})
