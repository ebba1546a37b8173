"""The rollout group's stages: what each workflow node of the rollout half does.

Why this module exists: the rollout half of a step (:func:`distflow.step.rollout_half`) runs
the rollout group's nodes in plan order (e.g. generate -> reward -> advantage); the catalog
(:mod:`distflow.rl.catalog`) names, for each ``(role, type)``, the function here that runs it
on the rollout group and on worker groups of their own (:mod:`distflow.stage_worker` runs the
same half on the batch it receives). The node's ``fn`` picks the concrete function inside it
(a reward name, an advantage estimator). There is no per-algorithm switch, and the planner has
already rejected a node with no stage here.

Stages: ``stage(node, ctx, batch) -> batch``; they never touch the network.

* ACTOR MODEL_INFERENCE: generate ``group_size`` samples per prompt, tagged with the
  versions that made them; prompts longer than ``max_prompt_length`` are skipped and
  counted (``ctx.stats["skipped_prompts"]``); ``truncated`` marks ``finish_reason ==
  "length"``. It is where rows become prompts (the step's and a refill's alike), so it
  also checks each row for the keys the workflow's rewards declare they read, and with
  their ``check_row`` (:func:`row_requirements`): a row without a key, or one a reward
  cannot score (a gsm8k answer that is no number), is a bad row (``bad_rows``), raised or skipped
  and counted by the policy of the loader that read it, before it costs a generation and
  with its whole group, never in the reward stage, where it would fail the step.
* REWARD COMPUTE: a rule-based reward ``fn(response_text, row) -> float``.
* REWARD MODEL_INFERENCE: a learned reward model (``args.path``), see
  :mod:`distflow.rl.reward_model`.
* ACTOR COMPUTE: an outcome advantage estimator, or ``dynamic_sampling`` (DAPO: regenerate
  the prompts whose groups have constant rewards, ``args.max_retries`` times, then drop
  the groups still constant; counted in ``ctx.stats``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from distflow.buffer.batch import SampleBatch
from distflow.buffer.dataloader import BadRowPolicy, PromptRow, keep_row
from distflow.core.config import Config
from distflow.core.dag import WorkflowNode
from distflow.core.once import log_once
from distflow.hf import chat_prompt_ids, end_of_turn
from distflow.rl.catalog import StageError, UserFunctionError, function, node_runs_on
from distflow.rl.reward_model import score_batch
from distflow.rl.registry import outcome_advantages
from distflow.rl.shaping import group_index, mask_truncated, outcome_rewards, split_episodes, trained_token_counts
from distflow.rollout.engine import RolloutEngine, SamplingParams
from distflow.rollout.rewards import REWARD_RANGE, RowCheck, resolve_reward, reward_value
from distflow.rollout.rewards import row_requirements as rewards_row_requirements
from distflow.vision import attach_images, encode_image_rows

log = logging.getLogger(__name__)

__all__ = ["StageError", "RolloutContext", "sampling_params", "encode_prompts", "row_requirements", "generate",
           "reward", "reward_model", "advantage"]


@dataclass
class RolloutContext:
    """What a rollout stage may use: the engine, the config, this step's prompts and seed,
    the pipeline (for stages that re-run a prefix) and counters returned to the caller."""

    engine: RolloutEngine
    cfg: Config
    rows: list[PromptRow]
    seed: int
    pipeline: list[WorkflowNode] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    weights_update: Callable[[], Any] | None = None  # partial rollout: polled by the engine mid-generation
    refill: Callable[[int, int], list[PromptRow]] | None = None  # (attempt, n) -> fresh prompts of this shard
    rerun: Callable[..., SampleBatch] | None = None  # (pipeline, ctx) -> batch: the rollout half, for a filter

    def count(self, key: str, n: float) -> None:
        self.stats[key] = self.stats.get(key, 0) + n




# The torch engine's counters of CUDA graphs asked for but not used (failed captures, eager decode
# steps), reported per step as engine_<name> when not zero
GRAPH_COUNTERS = ("graph_capture_failures", "graph_eager_steps")


def sampling_params(cfg: Config, tokenizer: Any = None) -> SamplingParams:
    """The config's sampling, with its ``stop_token_ids`` and, with ``chat_template``, the
    template's end-of-turn id: a base model (Qwen2.5's EOS is ``<|endoftext|>``) prompted in a chat
    template ends its turn with ``<|im_end|>``, which is no EOS of its, and would otherwise write
    made-up turns up to ``max_new_tokens``, every sample truncated."""
    stop = list(cfg.stop_token_ids)
    end = end_of_turn(tokenizer) if cfg.chat_template and tokenizer is not None else None
    if end is not None:
        stop.append(end[0])
    return SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          top_p=cfg.top_p, top_k=cfg.top_k, stop_token_ids=tuple(dict.fromkeys(stop)))


def encode_prompts(tokenizer: Any, rows: list[PromptRow], key: str, chat: bool) -> list[list[int] | str]:
    """Each row's prompt token ids, or a string saying why the row cannot be a prompt (the
    caller skips and counts it): ``key`` holds text, or with ``chat`` also a list of chat
    messages; the encoding must not be empty."""
    out: list[list[int] | str] = []
    for r in rows:
        value = r.data.get(key)
        try:
            if isinstance(value, str) and chat:
                ids = chat_prompt_ids(tokenizer, value)
            elif isinstance(value, str):  # a prompt rendered already (its template's BOS in it) gets no second BOS
                bos = getattr(tokenizer, "bos_token", None)
                ids = list(tokenizer(value, add_special_tokens=not (bos and value.startswith(bos)))["input_ids"])
            elif isinstance(value, list) and chat:
                ids = chat_prompt_ids(tokenizer, value)
            else:
                kinds = ("a string or a list of chat messages" if chat
                         else "a string (chat messages need chat_template: true)")
                raise ValueError(f"key {key!r} is {type(value).__name__}, expected {kinds}")
        except ValueError as e:
            if "no chat template" in str(e):
                raise StageError(str(e)) from None  # the model's problem, not the row's
            out.append(f"prompt {r.prompt_id}: {e}")
            continue
        out.append(ids if ids else f"prompt {r.prompt_id}: key {key!r} encodes to no tokens")
    return out


def row_requirements(workflow: list[WorkflowNode]) -> tuple[dict[str, str], list[tuple[RowCheck, str]]]:
    """:func:`distflow.rollout.rewards.row_requirements`, a reward's bad declaration as a StageError."""
    try:
        return rewards_row_requirements(workflow)
    except ValueError as e:
        raise StageError(str(e)) from None


def _need(node: WorkflowNode, batch: SampleBatch | None) -> SampleBatch:
    if batch is None:
        raise StageError(f"workflow node {node.id!r} runs before any generate node on the rollout group")
    return batch


# ----------------------------------------------------------------------------- stages
def prompt_limit(engine: RolloutEngine, cfg: Config) -> int | None:
    """The longest prompt (tokens) a step generates from: ``max_prompt_length``, and at most the engine's
    ``max_positions`` (when it has one) less ``max_new_tokens``, so a prompt too long for the model's
    context is a counted skip, not an error that fails the whole step. None: no bound."""
    limits = [] if cfg.max_prompt_length is None else [cfg.max_prompt_length]
    positions = getattr(engine, "max_positions", None)
    if isinstance(positions, int) and not isinstance(positions, bool):
        limits.append(positions - cfg.max_new_tokens)
    return min(limits) if limits else None


def generate_rows(engine: RolloutEngine, cfg: Config, rows: list[PromptRow], seed: int,
                  stats: dict[str, float] | None = None, weights_update: Callable[[], Any] | None = None) -> SampleBatch:
    """Sample ``group_size`` responses per prompt. Each sample carries ``policy_version`` (the
    weights it started with), ``last_version`` (the weights it ended with) and ``truncated``.
    Rows whose prompt is unusable are skipped (``bad_prompts``); of the others, rows without a
    key a reward reads, or that a reward's ``check_row`` refuses, are bad rows
    (:func:`row_requirements`; counted in their loader's
    ``bad_rows_skipped``, or as ``bad_rows`` in ``stats`` for rows no loader read). With a
    vision-language engine (``engine.vision``) each row's images are read and rendered into its
    prompt (:func:`distflow.vision.encode_image_rows`; a bad image is a bad row the same way) and
    travel with every sample of the row (:func:`distflow.vision.attach_images`)."""
    vision = getattr(engine, "vision", None)
    pics: list[Any] = []
    if vision is not None:  # a vision-language model: each row's images, its prompt in the chat template
        fallback = BadRowPolicy(cfg.bad_rows)
        pairs = encode_image_rows(vision, rows, cfg.prompt_key, cfg.image_key, cfg.max_image_pixels, fallback,
                                  os.path.dirname(os.path.abspath(cfg.dataset)))
        if fallback.skipped and stats is not None:
            stats["bad_rows"] = stats.get("bad_rows", 0) + fallback.skipped
        encoded: list[Any] = [None if p is None else p[0] for p in pairs]  # None: a bad row, counted already
        pics = [None if p is None else p[1] for p in pairs]
    else:
        with_images = next((r for r in rows if isinstance(r.data, dict) and r.data.get(cfg.image_key)), None)
        if with_images is not None:  # generating without them would train on prompts the data does not hold
            raise StageError(f"{with_images.where or with_images.prompt_id}: the row lists images (key "
                             f"{cfg.image_key!r}) but the engine's model takes none (a vision-language model on "
                             f"engine: torch does; docs/vlm.md)")
        encoded = encode_prompts(engine.tokenizer, rows, cfg.prompt_key, cfg.chat_template)
    bad = [e for e in encoded if isinstance(e, str)]
    if bad:  # counted and named, never a crash: the rest of the step goes on
        log.warning("skipping %d unusable prompt(s), e.g. %s", len(bad), bad[0])
        if stats is not None:
            stats["bad_prompts"] = stats.get("bad_prompts", 0) + len(bad)
    keep = [i for i, p in enumerate(encoded) if isinstance(p, list)]
    needed, checks = row_requirements(cfg.workflow)
    if needed or checks:
        fallback = BadRowPolicy(cfg.bad_rows)
        keep = [i for i in keep if keep_row(rows[i], needed, fallback, checks)]  # raises with bad_rows: error
        if fallback.skipped and stats is not None:
            stats["bad_rows"] = stats.get("bad_rows", 0) + fallback.skipped
    limit = prompt_limit(engine, cfg)
    if limit is not None:
        short = [i for i in keep if len(encoded[i]) <= limit]
        if len(short) < len(keep):
            log.warning("skipping %d prompt(s) longer than %d tokens (max_prompt_length %s; the model's %s "
                        "positions less max_new_tokens %d)", len(keep) - len(short), limit, cfg.max_prompt_length,
                        getattr(engine, "max_positions", None), cfg.max_new_tokens)
        if stats is not None and (len(short) < len(keep) or cfg.max_prompt_length is not None):
            stats["skipped_prompts"] = stats.get("skipped_prompts", 0) + len(keep) - len(short)
        keep = short
    rows, prompts = [rows[i] for i in keep], [encoded[i] for i in keep]
    g = cfg.group_size
    flat_prompts = [p for p in prompts for _ in range(g)]  # a group: the same list (the engine prefills it once)
    kw: dict[str, Any] = {"weights_update": weights_update} if weights_update is not None else {}
    flat_images = [pics[i] for i in keep for _ in range(g)] if vision is not None else None
    if flat_images is not None:
        kw["images"] = flat_images
    params = sampling_params(cfg, engine.tokenizer)
    counters = getattr(engine, "stats", None)
    before = {k: counters.get(k, 0) for k in GRAPH_COUNTERS} if isinstance(counters, dict) else {}
    comps = engine.generate(flat_prompts, params, seed=seed, **kw) if flat_prompts else []
    for k, v in before.items():  # CUDA graphs asked for but not used: the step's metrics say so
        if stats is not None and counters[k] != v:
            stats[f"engine_{k}"] = stats.get(f"engine_{k}", 0) + counters[k] - v
    sample_ids, prompt_ids, extras = [], [], []
    for r in rows:
        for j in range(g):
            sample_ids.append(f"{r.prompt_id}:s{j}")
            prompt_ids.append(r.prompt_id)
            extras.append({"row": r.data})
    first = [int(getattr(c, "first_version", engine.version)) for c in comps]
    batch = SampleBatch.from_lists(sample_ids, prompt_ids, flat_prompts, [c.tokens for c in comps],
                                   [c.logprobs for c in comps], policy_version=first, extras=extras)
    batch.set_scalar("last_version", torch.tensor([int(getattr(c, "last_version", engine.version)) for c in comps],
                                                  dtype=torch.int64))
    batch.set_scalar("truncated", torch.tensor([int(c.finish_reason == "length") for c in comps], dtype=torch.int64))
    if flat_images is not None:
        attach_images(batch, flat_images)  # they travel with each sample to its trainer
    return batch


def usable_rows(ctx: RolloutContext) -> list[PromptRow]:
    """The step's rows less the bad ones (a key a reward reads missing, or its ``check_row``
    refusing), skipped and counted by their loader's policy as :func:`generate_rows` does; the
    rows of multi-turn episodes, whose environment renders the prompts itself."""
    needed, checks = row_requirements(ctx.cfg.workflow)
    if not (needed or checks):
        return list(ctx.rows)
    fallback = BadRowPolicy(ctx.cfg.bad_rows)
    keep = [r for r in ctx.rows if keep_row(r, needed, fallback, checks)]  # raises with bad_rows: error
    if fallback.skipped:
        ctx.count("bad_rows", fallback.skipped)
    return keep


def generate(node: WorkflowNode, ctx: RolloutContext, batch: SampleBatch | None) -> SampleBatch:
    """ACTOR MODEL_INFERENCE: ``fn: generate`` (one response per sample) or ``fn: episodes``
    (multi-turn episodes against the config's environment: :mod:`distflow.rollout.episodes`)."""
    if node.fn == "episodes":
        from distflow.rollout.episodes import episodes

        return episodes(ctx, usable_rows(ctx), sampling_params(ctx.cfg, ctx.engine.tokenizer))
    return generate_rows(ctx.engine, ctx.cfg, ctx.rows, ctx.seed, ctx.stats, ctx.weights_update)


def reward(node: WorkflowNode, ctx: RolloutContext, batch: SampleBatch | None) -> SampleBatch:
    """Score every sample with the node's reward function: fn(response_text, row, **args) -> float.
    A function that raises or returns what is not a finite number has a bug that every restart
    would meet again: :class:`UserFunctionError` (the node exits 2) naming the function, the row
    and what it returned. A score outside the documented range is counted (``reward_out_of_range``)
    and warned of once."""
    batch = _need(node, batch)
    try:
        fn: Callable[..., float] = resolve_reward(node.fn)
    except ValueError as e:
        raise StageError(f"workflow node {node.id!r}: {e}") from None
    tok = ctx.engine.tokenizer
    # an episode is scored on its final reply (its response also holds the earlier turns and observations)
    texts = [e["final_reply"] if "final_reply" in e else tok.decode(t.tolist(), skip_special_tokens=True)
             for t, e in zip(batch.ragged("response_tokens"), batch.extras)]
    where = {r.prompt_id: r.where or f"row {r.row_index}" for r in ctx.rows}
    values, outside = [], 0
    for sid, pid, text, extra in zip(batch.sample_ids, batch.prompt_ids, texts, batch.extras):
        what = f"workflow node {node.id!r}: reward {node.fn!r} on {where.get(pid, pid)} (sample {sid})"
        try:
            raw = fn(text, extra["row"], **node.args)
        except Exception as e:  # its bug, not the node's: named and not restarted
            raise UserFunctionError(f"{what} raised {type(e).__name__}: {e}") from e
        try:
            value = reward_value(raw)
        except ValueError as e:
            raise UserFunctionError(f"{what} {e}") from None
        outside += not REWARD_RANGE[0] <= value <= REWARD_RANGE[1]
        values.append(value)
    if outside:
        ctx.count("reward_out_of_range", outside)
        log_once(log, f"reward-range:{node.fn}", logging.WARNING,
                 "workflow node %r: reward %r gave %d of %d scores outside the documented range [%g, %g] "
                 "(counted as reward_out_of_range; group advantages normalise them, shaping assumes the range)",
                 node.id, node.fn, outside, len(values), *REWARD_RANGE)
    scores = torch.tensor(values, dtype=torch.float32)
    if "reward" in batch.tensors:  # an episode's environment rewards (or an earlier REWARD node): added to
        scores = batch.tensors["reward"].float() + scores
    batch.set_scalar("reward", scores)
    return batch


def reward_model(node: WorkflowNode, ctx: RolloutContext, batch: SampleBatch | None) -> SampleBatch:
    from distflow.device import COMPUTE_DTYPES, node_device

    try:
        return score_batch(node, _need(node, batch), node_device(ctx.cfg.device), COMPUTE_DTYPES[ctx.cfg.dtype],
                           ctx.cfg.model_path)
    except ValueError as e:
        raise StageError(str(e)) from None


def _estimate(node: WorkflowNode, ctx: RolloutContext, batch: SampleBatch) -> SampleBatch:
    only = node_runs_on(node.role.value, node.type.value, node.fn)
    if only is not None:
        raise StageError(f"workflow node {node.id!r}: {node.fn!r} runs on the {only} group only (key 'group')")
    rewards, groups, counts = outcome_rewards(batch, ctx.cfg), group_index(batch.prompt_ids), \
        trained_token_counts(batch, ctx.cfg)
    split = split_episodes(batch)
    if split is not None:  # a split episode counts once in its group; its samples share its advantage
        firsts, inverse = split
        rewards, groups = rewards[firsts], group_index([batch.prompt_ids[i] for i in firsts])
        counts = torch.zeros(len(firsts), dtype=counts.dtype).index_add_(0, inverse, counts)
    adv = outcome_advantages(node.fn, f"workflow node {node.id!r} advantage estimator", rewards, groups, counts,
                             node.args)
    if split is not None:
        adv = adv[split[1]]
    batch.set_scalar("advantage", mask_truncated(adv, batch, ctx.cfg))
    return batch


def dynamic_sampling(node: WorkflowNode, ctx: RolloutContext, batch: SampleBatch) -> SampleBatch:
    """DAPO's dynamic sampling on the task reward (``reward``, before overlong shaping): the
    prompts whose samples all got the same reward are replaced, the pipeline prefix re-run on
    the replacements up to ``args.max_retries`` times (default 2), keeping the step's prompt
    count where possible; groups still constant are then dropped. ``args.refill``: ``fresh``
    (default, the paper's recipe: new prompts drawn from this rank's shard, a deterministic
    draw per step and attempt, ``PromptShard.reserve``) or ``same`` (the same prompts with a
    new seed; also what a node without a prompt source, e.g. a worker group, does). A step
    never becomes empty: if every group is constant the batch is kept whole (its group
    advantages are all 0, so it adds no gradient). Counts ``resampled_prompts`` (prompts
    generated as replacements) and ``dropped_prompts``, and ``generated_samples`` /
    ``generated_reward`` (their sum) of the first generation: the trained samples' mean reward
    is biased by the filter (a policy that solves every prompt trains on few, mixed groups),
    the generated one is the policy's."""
    keeps = function("compute", node.fn).load()  # rewards [n], group ids [n] -> keep [n] (nonconstant_groups)
    retries = int(node.args.get("max_retries", 2))
    refill = node.args.get("refill", "fresh")  # fresh | same (the config checked it: distflow.rl.node_args)
    prefix = ctx.pipeline[:ctx.pipeline.index(node)] if node in ctx.pipeline else []
    if len(batch) and "reward" in batch.tensors:
        ctx.count("generated_samples", len(batch))
        ctx.count("generated_reward", float(batch.tensors["reward"].float().sum()))

    def keep_mask(b: SampleBatch) -> list[bool]:
        if not len(b):
            return []
        if "reward" not in b.tensors:
            raise StageError(f"workflow node {node.id!r}: dynamic_sampling needs a REWARD node among its deps")
        return keeps(b.tensors["reward"].float(), group_index(b.prompt_ids)).tolist()

    first, lost_total = batch, 0
    for attempt in range(retries):
        keep = keep_mask(batch)
        bad = dict.fromkeys(p for p, k in zip(batch.prompt_ids, keep) if not k)
        if not bad or not prefix:
            break
        if refill == "fresh" and ctx.refill is not None:
            rows = ctx.refill(attempt, len(bad))
        else:
            rows = [r for r in ctx.rows if r.prompt_id in bad]
        if not rows:
            break
        ctx.count("resampled_prompts", len(rows))
        sub_stats: dict[str, float] = {}
        sub_ctx = RolloutContext(ctx.engine, ctx.cfg, rows, ctx.seed + 7919 * (attempt + 1), ctx.pipeline, sub_stats,
                                 rerun=ctx.rerun)
        assert ctx.rerun is not None, "dynamic_sampling runs inside distflow.step.rollout_half"
        sub = ctx.rerun(prefix, sub_ctx)
        from distflow.rollout.episodes import is_episode_counter

        for key, value in sub_stats.items():  # unusable replacements are counted as well, and episodes run
            if value and (key in ("skipped_prompts", "bad_prompts", "bad_rows") or is_episode_counter(key)):
                ctx.count(key, value)
        # constant groups no replacement took the place of (counted as dropped unless the step falls back)
        lost_total += max(0, len(bad) - len(dict.fromkeys(sub.prompt_ids)))
        batch = SampleBatch.concat([batch.select([i for i, k in enumerate(keep) if k]), sub])
    keep = keep_mask(batch)
    if not len(batch):  # every group was constant and no replacement was usable: the first batch, whole
        return first
    if not any(keep):  # every group left is constant: kept whole (advantages 0), only the lost ones dropped
        if lost_total:
            ctx.count("dropped_prompts", lost_total)
        return batch
    ctx.count("dropped_prompts", lost_total + len(dict.fromkeys(p for p, k in zip(batch.prompt_ids, keep) if not k)))
    return batch.select([i for i, k in enumerate(keep) if k])


def advantage(node: WorkflowNode, ctx: RolloutContext, batch: SampleBatch | None) -> SampleBatch:
    """An outcome advantage estimator over whole prompt groups (all on this node by
    construction), or a group filter (the catalog's kind ``filter``: dynamic sampling)."""
    batch = _need(node, batch)
    fn = function("compute", node.fn)
    return dynamic_sampling(node, ctx, batch) if fn is not None and fn.kind == "filter" else _estimate(node, ctx, batch)
