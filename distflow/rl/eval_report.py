"""The evaluation report: what a rollout node sends trainer rank 0 for one eval shard and point.

Why a module of its own: the rollout nodes make the reports (:mod:`distflow.rollout.evaluation`)
and trainer rank 0 checks and combines them (:mod:`distflow.trainer.evaluation`); the format
and its arithmetic belong to neither role. A report is counts and sums only (no tensors), so
a point's means are exact over every sample of every shard, not means of shard means.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from distflow.buffer.batch import SampleBatch
from distflow.rl.shaping import group_index

EVAL_KIND = "eval"  # the data-plane message kind of a shard's report
SUMMARY_KEYS = ("samples", "prompts", "reward_sum", "best_sum", "truncated", "response_tokens", "skipped_prompts")


def eval_points(cfg: Any, start: int, total: int) -> list[int]:
    """The steps whose weights are evaluated, ascending: ``start`` (the run's first step) with
    ``eval_before_train``, every multiple of ``eval_every`` from ``start`` on but 0 (a run resumed
    at a multiple evaluates it again: its row was dropped with the later ones), and ``total`` (the
    final weights). Empty without ``eval_dataset``."""
    if cfg.eval_dataset is None:
        return []
    points = {total}
    if cfg.eval_before_train:
        points.add(start)
    if every := cfg.eval_every:
        first = -(-max(start, 1) // every) * every  # the first multiple >= start, and > 0
        points.update(range(first, total, every))
    return sorted(p for p in points if start <= p <= total)


def eval_progress(member: Callable[[str], Any], node_ids: Sequence[str]) -> tuple:
    """The nodes' gossiped ``eval_progress`` (chunks of held-out prompts each has evaluated; a
    rollout node gossips it as it evaluates): a change is progress that extends a step's deadline.
    ``member``: node id -> mesh member or None."""
    return tuple((m.meta.get("eval_progress", 0) if (m := member(i)) is not None else 0) for i in node_ids)


def due_point(points: list[int], version: int) -> int | None:
    """The latest point ``version`` has reached (a node whose weights jumped past a point
    evaluates the newest one only), or None; the caller drops the points up to it."""
    reached = [p for p in points if p <= version]
    return reached[-1] if reached else None


def summarize(batch: SampleBatch) -> dict[str, float]:
    """Sums over a scored batch: ``samples``, ``prompts``, ``reward_sum``, ``best_sum`` (each
    prompt's best reward: best-of-n), ``truncated`` and ``response_tokens``."""
    n = len(batch)
    if not n:
        return {k: 0 for k in SUMMARY_KEYS if k != "skipped_prompts"}
    t = batch.tensors
    reward = t["reward"].double().reshape(n)
    groups = group_index(batch.prompt_ids)
    num_prompts = int(groups.max()) + 1
    best = reward.new_full((num_prompts,), float("-inf")).scatter_reduce(0, groups, reward, "amax")
    return {"samples": n, "prompts": num_prompts, "reward_sum": float(reward.sum()), "best_sum": float(best.sum()),
            "truncated": int(t["truncated"].sum()) if "truncated" in t else 0,
            "response_tokens": int(t["response_lens"].sum())}


def report_meta(point: int, shard: int, version: int, summary: dict[str, Any] | None, num_shards: int,
                error: str = "") -> dict[str, Any]:
    """The meta of a shard's ``eval`` message to trainer rank 0; a failed evaluation reports
    ``error`` and no summary (so that its point still closes, with the shard counted as failed)."""
    if summary is None:
        summary = {**{k: 0 for k in SUMMARY_KEYS}, "seconds": 0.0}
    meta = {"point": point, "shard": shard, "num_shards": num_shards, "version": version, **summary}
    return {**meta, "error": error[:500]} if error else meta


def report_problem(meta: Any, num_shards: int) -> str:
    """'' when ``meta`` is a well-formed shard report, else what is wrong with it."""
    if not isinstance(meta, dict):
        return "meta is not a map"
    for key in ("point", "shard", "version"):
        if type(meta.get(key)) is not int or meta[key] < 0:
            return f"{key!r} must be an int >= 0, got {meta.get(key)!r}"
    if meta["shard"] >= num_shards:
        return f"shard {meta['shard']} is not one of the {num_shards} eval shards"
    if not isinstance(meta.get("error", ""), str):
        return f"'error' must be a str, got {type(meta['error']).__name__}"
    for key in (*SUMMARY_KEYS, "seconds"):
        v = meta.get(key)
        if type(v) not in (int, float) or not math.isfinite(v) or (key not in ("reward_sum", "best_sum") and v < 0):
            return f"{key!r} must be a finite number, got {v!r}"
    return ""


def eval_row(point: int, reports: list[dict[str, Any]], num_shards: int) -> dict[str, Any]:
    """One point's row from its shards' reports: means over every sample (and prompt) of every
    shard, not means of shard means; ``eval_best_of_n_mean`` (each prompt's best reward) when
    prompts had several responses."""
    tot = {k: sum(r[k] for r in reports) for k in SUMMARY_KEYS}
    n, prompts = tot["samples"], tot["prompts"]
    versions = [r["version"] for r in reports]
    best = {"eval_best_of_n_mean": tot["best_sum"] / prompts} if n > prompts else {}  # several per prompt
    return {"step": point, "eval_reward_mean": tot["reward_sum"] / n if n else None, **best,
            "eval_samples": int(n), "eval_prompts": int(prompts),
            "eval_truncated_frac": tot["truncated"] / n if n else None,
            "eval_response_len_mean": tot["response_tokens"] / n if n else None,
            "eval_skipped_prompts": int(tot["skipped_prompts"]),
            "policy_version_min": min(versions), "policy_version_max": max(versions),
            "eval_time_s": max(r["seconds"] for r in reports),
            "eval_shards": len(reports), "eval_num_shards": num_shards,
            "eval_failed_shards": sum(1 for r in reports if r.get("error"))}
