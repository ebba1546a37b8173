"""The generate node's ``fn: episodes``: multi-turn agentic episodes as one step's samples.

Why it exists: the episode machinery (:mod:`distflow.env`) builds token-in/token-out samples
from an environment and a per-turn ``generate``; the step needs a :class:`SampleBatch`. This
stage is the seam: it runs ``group_size`` episodes per row of the step (a GRPO group is the
episodes of one row) through :class:`~distflow.env.runner.EpisodeRunner` over the node's engine
(its request-level continuous batching, ``TorchEngine.continuous``, where it has one: each turn
joins the running batch when ready and reuses its episode's KV; else
:class:`~distflow.env.batching.BatchedGenerate`), and turns each episode's samples into batch
rows:

* the prompt is the sample's tokens before its first sampled token, the response the rest (the
  sampled turns AND the observation, tool and template tokens between them), with a ragged
  ``loss_mask`` (1 exactly on the sampled tokens) and ``logprobs`` (the engine's; 0 where masked);
  the trainer trains on the masked tokens only (:func:`distflow.rl.shaping.response_loss_mask`);
* sample ids ``"{prompt_id}:s{j}"`` (episode ``j`` of the row), ``"{prompt_id}:s{j}.{k}"`` for the
  ``k``-th sample of an episode the template split (docs/agents.md); ``extras["episode"]`` names
  the episode, so an advantage estimator counts a split episode once;
* ``reward``: the sum of the environment's step rewards (0.0 where it gave none: a REWARD node
  downstream adds its score of the final reply, ``extras["final_reply"]``);
* ``policy_version`` / ``last_version``: the weights of the sample's first and last sampled token
  (the staleness of an episode), ``truncated``: its last turn was cut.

An episode that ends in ``env_error`` (or is skipped as ``prompt_too_long``) makes no sample:
counted, never trained. The counters go to ``ctx.stats`` (summed over shards by the trainer;
:func:`distflow.env.runner.episode_means` derives the per-episode means once summed).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from distflow.buffer.batch import SampleBatch
from distflow.env import BatchedGenerate, EpisodeRunner, environment_factory
from distflow.rl.catalog import StageError

if TYPE_CHECKING:
    from distflow.rollout.protocol import SamplingParams

log = logging.getLogger(__name__)

__all__ = ["episodes", "episode_counters", "is_episode_counter", "run_episodes"]

# EpisodeRunner's counters -> the step's metric names (docs/metrics.md); "samples" would collide with the loop's
_RENAME = {"episodes": "episodes", "trained_episodes": "trained_episodes", "splits": "episode_splits",
           "env_errors": "env_errors", "skipped_prompts": "skipped_prompts", "turns": "episode_turns",
           "tool_calls": "episode_tool_calls", "tool_errors": "episode_tool_errors",
           "sampled_tokens": "episode_sampled_tokens", "episode_tokens": "episode_tokens",
           "env_time_s": "env_time_s", "generate_time_s": "episode_generate_time_s"}


def is_episode_counter(key: str) -> bool:
    """Whether ``key`` is one of the step's episode counters (:func:`episode_counters`, the KV ones):
    what a re-run of the pipeline prefix (DAPO's replacements) adds to the step's own."""
    return key in _COUNTER_NAMES or key.startswith("stop_")


def episode_counters(eps: list[Any]) -> dict[str, float]:
    """The step's counters of ``eps`` (:func:`distflow.env.runner.summarize`, renamed), plus
    ``episodes_with_tool_call``; sums, so shards add up."""
    from distflow.env.runner import summarize

    out = {_RENAME.get(k, k): v for k, v in summarize(eps).items() if k != "samples"}
    out["episodes_with_tool_call"] = sum(ep.tool_calls > 0 for ep in eps)
    return out


def run_episodes(ctx: Any, rows: list[Any], params: SamplingParams) -> list[Any]:
    """``group_size`` episodes per row (row-major), on a fresh event loop in this thread. ``ctx``:
    the stage's :class:`~distflow.rollout.stages.RolloutContext`; ``params``: every turn's sampling."""
    cfg = ctx.cfg
    data = [r.data for r in rows for _ in range(cfg.group_size)]
    make_env = None
    if not getattr(cfg, "agent", None):
        try:
            make_env = environment_factory(cfg.environment, cfg.environment_args, cfg.tools)
        except ValueError as e:
            raise StageError(f"environment: {e}") from None
    return asyncio.run(_run(ctx, params, data, make_env))


async def _run(ctx: Any, params: SamplingParams, data: list[dict], make_env: Any) -> list[Any]:
    """The step's episodes on this loop, over the engine's request-level continuous batching when it
    has one (``TorchEngine.continuous``), else over :class:`BatchedGenerate` (which one: logged once)."""
    cfg, engine = ctx.cfg, ctx.engine
    limit = cfg.max_total_tokens
    positions = getattr(engine, "max_positions", None)
    if isinstance(positions, int) and not isinstance(positions, bool):
        limit = min(limit, positions)
    continuous = getattr(engine, "continuous", None)
    cont = continuous(seed=ctx.seed, max_slots=max(1, len(data)), max_length=limit) if callable(continuous) else None
    _log_path_once(engine, cont)

    def runner(generate: Any, make: Any) -> EpisodeRunner:
        return EpisodeRunner(engine.tokenizer, generate, make, params=params, max_turns=cfg.max_turns,
                             max_total_tokens=limit, max_new_tokens=cfg.max_new_tokens,
                             max_tool_errors=cfg.max_tool_errors, env_timeout=cfg.env_timeout_s,
                             max_concurrent=cfg.max_concurrent_episodes)

    if cont is None:
        # a short window: the episodes' first turns (their environments start in threads) share one engine batch
        batched = BatchedGenerate(engine.generate, seed=ctx.seed, window=0.01)
        return await _episodes_of(cfg, lambda make: runner(batched, make), data, make_env)
    before = {k: cont.stats.get(k, 0) for k in _KV_COUNTERS}
    async with cont:
        eps = await _episodes_of(cfg, lambda make: runner(cont, make), data, make_env)
    for k, name in _KV_COUNTERS.items():
        ctx.count(name, cont.stats.get(k, 0) - before[k])
    return eps


# the continuous engine's KV-reuse counters -> the step's metric names (docs/metrics.md)
_KV_COUNTERS = {"kv_hits": "episode_kv_hits", "kv_misses": "episode_kv_misses",
                "kv_reused_tokens": "episode_kv_reused_tokens"}
_LOGGED: set[str] = set()
_COUNTER_NAMES = frozenset(_RENAME.values()) | {"episodes_with_tool_call"} | frozenset(_KV_COUNTERS.values())


def _log_path_once(engine: Any, cont: Any) -> None:
    """Which path the episodes' turns take, once per process and path."""
    which = "continuous" if cont is not None else "batched"
    if which in _LOGGED:
        return
    _LOGGED.add(which)
    if cont is not None:
        log.info("episodes: each turn joins the engine's continuous batch when it is ready (TorchEngine.continuous; "
                 "an episode's KV is kept between its turns)")
    else:
        log.info("episodes: turns batched per engine call (BatchedGenerate over %s.generate: the engine has no "
                 "request-level continuous batching)", type(engine).__name__)


async def _episodes_of(cfg: Any, runner: Any, data: list[dict], make_env: Any) -> list[Any]:
    """The environment's episodes, or (``make_env`` None) the agent's on the chat endpoint."""
    if make_env is not None:
        return await runner(make_env).run(data)
    return await _agent_episodes(cfg, runner, data)


async def _agent_episodes(cfg: Any, runner: Any, data: list[dict]) -> list[Any]:
    """``agent: module:function`` episodes: the chat endpoint (docs/agents.md) serves the step's
    episodes on this loop, one bearer token each, and closes with the step."""
    from distflow.env.agent import agent_factory
    from distflow.env.endpoint import ChatEndpoint

    try:
        endpoint = await ChatEndpoint(cfg.agent_host, cfg.agent_port,
                                      model=os.path.basename(str(cfg.model_path).rstrip("/")) or "policy").start()
    except OSError as e:
        raise StageError(f"agent_host/agent_port: the agent endpoint cannot listen on "
                         f"{cfg.agent_host}:{cfg.agent_port}: {e}") from None
    try:
        try:
            make_env = agent_factory(cfg.agent, endpoint)
        except ValueError as e:
            raise StageError(f"agent: {e}") from None
        return await runner(make_env).run(data)
    finally:
        await endpoint.close()


def episodes(ctx: Any, rows: list[Any], params: SamplingParams) -> SampleBatch:
    """``rows`` (the step's usable ones) as episodes, one batch row per episode sample (module
    docstring); called by :func:`distflow.rollout.stages.generate` for ``fn: episodes``."""
    eps = run_episodes(ctx, rows, params) if rows else []
    for k, v in episode_counters(eps).items():
        ctx.count(k, v)
    g = ctx.cfg.group_size
    sids, pids, prompts, responses, logprobs, masks, extras = [], [], [], [], [], [], []
    first, last, truncated, rewards = [], [], [], []
    for i, ep in enumerate(eps):
        if not ep.trained:
            if ep.error:
                log.warning("episode %s:s%d not trained (%s): %s", rows[i // g].prompt_id, i % g, ep.stop_reason,
                            ep.error)
            continue
        row = rows[i // g]
        episode_id = f"{row.prompt_id}:s{i % g}"
        final = next((m["content"] for m in reversed(ep.messages) if m.get("role") == "assistant"), "")
        for k, s in enumerate(ep.samples):
            sids.append(episode_id if k == 0 else f"{episode_id}.{k}")
            pids.append(row.prompt_id)
            prompts.append(s.tokens[:s.prompt_len])
            responses.append(s.response_tokens)
            logprobs.append(s.response_logprobs)
            masks.append(s.response_mask)
            extras.append({"row": row.data, "episode": episode_id, "final_reply": final})
            first.append(s.first_version)
            last.append(s.last_version)
            truncated.append(int(ep.truncated and k == len(ep.samples) - 1))
            rewards.append(float(ep.reward) if ep.reward is not None else 0.0)
    out = SampleBatch.from_lists(sids, pids, prompts, responses, logprobs, policy_version=first, extras=extras)
    out.set_ragged("loss_mask", torch.tensor([m for ms in masks for m in ms], dtype=torch.int64))
    out.set_scalar("last_version", torch.tensor(last, dtype=torch.int64))
    out.set_scalar("truncated", torch.tensor(truncated, dtype=torch.int64))
    out.set_scalar("reward", torch.tensor(rewards, dtype=torch.float32))
    return out
