"""The trainer group's stages: what each workflow node of the train half does.

Why this module exists: the train half of a step (:func:`distflow.step.train_half`) runs the
trainer group's nodes in plan order; the catalog (:mod:`distflow.rl.catalog`) names, for each
``(role, type)``, the function here that runs it on the trainer group, and the node's ``fn``
picks the maths inside it. The planner has already refused a node with no stage here.

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

from distflow.trainer.collectives import counted
from distflow.buffer.batch import SampleBatch
from distflow.core.config import Config
from distflow.core.dag import WorkflowNode
from distflow.device import COMPUTE_DTYPES, collective_device, node_device
from distflow.rl.advantages import token_rewards
from distflow.rl.kl import kl_estimate
from distflow.rl.catalog import RETURNS, VALUES, function
from distflow.rl.registry import ADVANTAGE_ESTIMATORS, outcome_advantages, resolve
from distflow.rl.reward_model import score_batch
from distflow.rl.shaping import (group_index, mask_truncated, outcome_rewards, split_names, trained_samples,
                                  trained_token_counts)

__all__ = ["TrainerContext", "build_context", "save_checkpoint", "padded", "flat", "reference", "critic_values",
           "reward_model", "advantage", "token_advantage", "actor_update", "critic_update"]


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
            counted("all_reduce", dist.all_reduce, t)
            return t.tolist()
        return list(values)

    def gather(self, obj: Any) -> list[Any]:
        if self.all_gather is not None:
            return self.all_gather(obj)
        if dist.is_available() and dist.is_initialized():
            out: list[Any] = [None] * dist.get_world_size()
            counted("all_gather_object", dist.all_gather_object, out, obj)
            return out
        return [obj]


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
def reference(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    _need(node, ctx.actor, "actor").reference_logprobs(batch)
    return {}


def critic_values(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    _need(node, ctx.critic, "critic").values(batch)
    return {}


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
                         cfg.kl_reward_estimator, clamp=cfg.kl_clamp)
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


def _set_token_advantages(batch: SampleBatch, ctx: TrainerContext, adv: torch.Tensor, mask: torch.Tensor,
                          valid: torch.Tensor) -> None:
    """``mask``: the trained tokens ([B, T]); ``valid``: every response token (the ragged layout)."""
    adv = mask_truncated(adv, batch, ctx.cfg)
    batch.set_ragged("token_advantages", flat(adv, valid).float())
    batch.set_scalar("advantage", adv.sum(1) / torch.clamp(mask.sum(1), min=1))


def _sampled_tokens(batch: SampleBatch, valid: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the response tokens the engine sampled: ``valid`` itself, or within it a
    multi-turn episode's ``loss_mask`` (GAE and the returns skip its observation tokens)."""
    if "loss_mask" not in batch.tensors:
        return valid
    return valid & (padded(batch.tensors["loss_mask"], batch.tensors["response_lens"])[0] != 0)


def token_advantage(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    """A token-level estimator (the catalog's kind ``token``) over per-token rewards: the shaped
    outcome on the last response token, minus ``kl_coef`` x KL per token with ``kl_in_reward``.
    An estimator that reads the critic's values (GAE) gets them and makes ``returns`` (ragged,
    the critic's targets) too; one that does not (REINFORCE++ token: discounted returns ``G_t =
    r_t + gamma G_{t+1}``) makes the advantages alone. Its keyword arguments (``gamma``, ``lam``)
    are the node's ``args``, defaulting to the config keys of the same names; ``whiten`` (default
    true) normalises the advantages over every trained token of the step (all ranks)."""
    fn = function("compute", node.fn)
    lens = batch.tensors["response_lens"]
    if VALUES in fn.needs:
        if "values" not in batch.tensors:
            raise ValueError(f"workflow node {node.id!r}: {node.fn} needs the critic's 'values' (a CRITIC "
                             f"MODEL_INFERENCE node among its deps)")
        values, valid = padded(batch.tensors["values"].float(), lens)
        mask = _sampled_tokens(batch, valid)
        inputs: tuple[torch.Tensor, ...] = (values, mask)
    else:
        valid = padded(torch.zeros(int(lens.sum()), device=lens.device), lens)[1]  # on the batch's device
        mask = _sampled_tokens(batch, valid)
        inputs = (mask,)
    rewards = _token_rewards(node, ctx, batch, mask)
    kw = {k: float(node.args.get(k, getattr(ctx.cfg, k))) for k in fn.args if k in ("gamma", "lam")}
    out = fn.load()(rewards, *inputs, **kw)
    adv, ret = out if RETURNS in fn.produces else (out, None)
    if node.args.get("whiten", True):
        adv = _whiten_tokens(ctx, batch, adv, mask)
    _set_token_advantages(batch, ctx, adv, mask, valid)
    if ret is not None:
        batch.set_ragged("returns", flat(ret, valid).float())
    return {}


def global_outcome_advantage(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    """An outcome estimator over the whole step: every rank gathers (prompt ids, rewards, trained
    tokens, episode names) of all ranks in rank order, computes the estimator and keeps its own
    slice. A multi-turn episode split into several samples (one ``extras["episode"]``) counts once
    in its group, with its samples' trained tokens summed, and its samples share its advantage:
    as the rollout-side estimators count it (:func:`distflow.rl.shaping.split_episodes`)."""
    resolve(ADVANTAGE_ESTIMATORS, node.fn, f"workflow node {node.id!r} advantage estimator")  # before the gather
    mine = (list(batch.prompt_ids), (outcome_rewards(batch, ctx.cfg) if len(batch) else torch.zeros(0)).tolist(),
            trained_token_counts(batch, ctx.cfg).tolist(), [e.get("episode") for e in batch.extras])
    parts = ctx.gather(mine)
    offset = sum(len(p[0]) for p in parts[:ctx.rank])
    pids = [x for p in parts for x in p[0]]
    rewards = torch.tensor([x for p in parts for x in p[1]], dtype=torch.float32)
    lens = torch.tensor([x for p in parts for x in p[2]], dtype=torch.int64)
    split = split_names([x for p in parts for x in p[3]])
    groups = group_index(pids)
    if split is not None:
        firsts, inverse = split
        rewards, groups = rewards[firsts], group_index([pids[i] for i in firsts])
        lens = torch.zeros(len(firsts), dtype=lens.dtype).index_add_(0, inverse, lens)
    adv = outcome_advantages(node.fn, f"workflow node {node.id!r} advantage estimator", rewards, groups, lens,
                             node.args)
    if split is not None:
        adv = adv[inverse]
    adv = adv[offset:offset + len(batch)]
    batch.set_scalar("advantage", mask_truncated(adv, batch, ctx.cfg))
    return {}


def advantage(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    """An ACTOR COMPUTE node on the trainer group: a token-level estimator, or an outcome one over the step."""
    fn = function("compute", node.fn)
    if fn is not None and fn.kind == "token":
        return token_advantage(node, ctx, batch)
    return global_outcome_advantage(node, ctx, batch)


def actor_update(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    actor = _need(node, ctx.actor, "actor")
    t_lp = 0.0
    if ctx.cfg.recompute_old_logprobs and "old_logprobs" not in batch.tensors and hasattr(actor, "old_logprobs"):
        t0 = time.perf_counter()
        actor.old_logprobs(batch)  # the proximal policy, before the update (timed as a logprob pass)
        t_lp = time.perf_counter() - t0
    return {**actor.update(node, batch), "time_logprobs_s": t_lp}


def critic_update(node: WorkflowNode, ctx: TrainerContext, batch: SampleBatch) -> dict[str, float]:
    stats = _need(node, ctx.critic, "critic").update(node, batch)
    return {f"critic_{k}" if not k.startswith(("vf_", "critic_")) else k: v for k, v in stats.items()}


def build_context(cfg: Config, pipeline: list[WorkflowNode], actor: Any) -> TrainerContext:
    """The context for ``pipeline``: the given actor, and a :class:`~distflow.trainer.critic.Critic`
    when the pipeline has CRITIC nodes (a collective: every rank calls it)."""
    critic = None
    if any(n.role.value == "CRITIC" for n in pipeline):
        from distflow.trainer.critic import Critic

        critic = Critic(cfg)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return TrainerContext(cfg, actor=actor, critic=critic, rank=rank)


def save_checkpoint(ctx: TrainerContext, out_dir: Any, state: dict[str, torch.Tensor] | None, run_state: dict,
                    writer: Any = None) -> None:
    """Actor checkpoint plus, with a critic, ``<out_dir>/critic/`` (a collective). Rank 0 takes
    the completion marker away before anything is written and puts it back only after the last
    part: a checkpoint killed mid-write is never taken for a whole one (``newest_checkpoint``).
    ``state``: the actor's full state dict, or None to gather it here, which lets rank 0 drop its
    full fp32 copy of the policy before the critic gathers its own (two at once: ~57 GB at 7B).

    ``writer`` (a :class:`distflow.trainer.async_save.CheckpointWriter`): this returns once the
    actor's state is in host memory, and the writer's thread writes the files (with a critic,
    every part is written here, to hold one full copy at a time; only the marker waits for the
    writer), then the marker (:meth:`CheckpointWriter.after` runs what waits for it
    to be complete). Without, everything is written before it returns."""
    from pathlib import Path

    from distflow.launch.checkpoint import mark_checkpoint, unmark_checkpoint

    out = Path(out_dir)
    if writer is not None:
        writer.wait()  # one write at a time (the same directory may be next: checkpoint/ at the end)
    out.mkdir(parents=True, exist_ok=True)
    if ctx.rank == 0:  # before the first collective of the save: no rank has written anything yet
        unmark_checkpoint(out)
    background = writer is not None and ctx.critic is None  # (a critic: the policy's copy goes before its own)
    group = writer.group if background else None
    write_actor = ctx.actor.save_checkpoint(out, ctx.actor.full_state_dict() if state is None else state, group)
    if not background:
        write_actor()
        write_actor = None  # no name holds rank 0's full copy of the policy now
    if ctx.critic is not None:
        ctx.critic.save_checkpoint(out)
    marker = {"policy_version": ctx.actor.version, **run_state}  # (the version now: training goes on meanwhile)

    def finish() -> None:
        if write_actor is not None:
            write_actor()
        if ctx.rank == 0:
            mark_checkpoint(out, marker)

    if writer is None:
        finish()
    else:
        writer.submit(out.name, finish)
