"""A step's statistics over the samples of every trainer rank: lengths, rewards, advantages,
staleness, and how far the engine's logprobs are from the trainer's.

Why one module: the trainer loop (each rank holds the samples it owns) and
:func:`distflow.step.synchronous_run` (one rank holds them all) write the same row, and each
figure is computed once, here, from what the batch already carries after the train half (no
extra forward pass): each rank makes partial sums and extremes (:func:`local_parts`, pure), one
SUM and one MAX all-reduce combine them (a minimum travels as the maximum of its negation), and
:func:`finish` turns them into the row's metrics (pure too, so both are tested with hand numbers).

What is measured over what (docs/metrics.md): lengths, rewards, staleness and truncation over
every sample of the step; advantages and the logprob mismatch over the tokens the loss trains on
(:func:`distflow.rl.shaping.trained_token_mask`), as verl's ``critic/advantages/*`` and
``rollout_corr/*`` are. The mismatch needs the trainer's own logprobs of the pre-update policy,
``old_logprobs`` (``recompute_old_logprobs: true``); without them the loss compares against the
engine's logprobs directly and there is nothing to measure (the keys are left out).
"""

from __future__ import annotations

import math
import resource
import sys
from typing import Any, Callable

import torch

from distflow.buffer.batch import SampleBatch
from distflow.rl.kl import kl_k3
from distflow.rl.shaping import trained_token_mask

__all__ = ["SUM_KEYS", "MAX_KEYS", "local_parts", "finish", "step_statistics", "peak_memory"]

# The partial sums each rank makes (all-reduced with SUM).
SUM_KEYS = ("samples", "reward", "reward_sq", "stale", "truncated", "response_tokens", "prompt_tokens",
            "adv", "adv_tokens", "lp_diff", "lp_k3", "lp_tokens")
# The extremes (all-reduced with MAX; the ``_min`` ones hold the negated minimum).
MAX_KEYS = ("reward_max", "reward_min", "response_len_max", "response_len_min", "prompt_len_max", "prompt_len_min",
            "staleness_max", "advantage_max", "advantage_min", "logprob_diff_max")
EMPTY = -math.inf  # the extreme of nothing: any rank's value wins the MAX


def _extremes(x: torch.Tensor, name: str, out: dict[str, float]) -> None:
    """``name_max`` and the negated ``name_min`` of ``x`` (float64) into ``out``; nothing for no values."""
    if x.numel():
        out[f"{name}_max"] = float(x.max())
        out[f"{name}_min"] = float(-x.min())


def _token_advantages(batch: SampleBatch) -> torch.Tensor | None:
    """Flat [sum(response_lens)]: each response token's advantage (a token-level estimator's own,
    an outcome estimator's per-sample value on every token of the sample), or None without any."""
    t = batch.tensors
    if "token_advantages" in t:
        return t["token_advantages"].double()
    if "advantage" in t:
        return torch.repeat_interleave(t["advantage"].double().reshape(-1), t["response_lens"])
    return None


def local_parts(batch: SampleBatch, cfg: Any, step: int) -> tuple[dict[str, float], dict[str, float]]:
    """This rank's (sums, extremes) of ``batch`` at trainer step ``step`` (the version before the
    update: a sample's staleness is ``step - policy_version``). Keys: :data:`SUM_KEYS` (all of
    them) and :data:`MAX_KEYS` (those with a value; :data:`EMPTY` fills in the rest). Pure."""
    t = batch.tensors
    sums = dict.fromkeys(SUM_KEYS, 0.0)
    ext: dict[str, float] = {}
    n = len(batch)
    if n:
        rl, pl = t["response_lens"].double(), t["prompt_lens"].double()
        sums.update(samples=float(n), response_tokens=float(rl.sum()), prompt_tokens=float(pl.sum()))
        _extremes(rl, "response_len", ext)
        _extremes(pl, "prompt_len", ext)
        if "reward" in t:
            r = t["reward"].double().reshape(-1)
            sums.update(reward=float(r.sum()), reward_sq=float((r * r).sum()))
            _extremes(r, "reward", ext)
        if "policy_version" in t:
            stale = step - t["policy_version"].double().reshape(-1)
            sums["stale"] = float(stale.sum())
            ext["staleness_max"] = float(stale.max())
        if t.get("truncated") is not None:
            sums["truncated"] = float((t["truncated"] == 1).sum())
        trained = trained_token_mask(batch, cfg)
        adv = _token_advantages(batch)
        if adv is not None and bool(trained.any()):
            picked = adv[trained]
            sums.update(adv=float(picked.sum()), adv_tokens=float(picked.numel()))
            _extremes(picked, "advantage", ext)
        if "old_logprobs" in t and "logprobs" in t and bool(trained.any()):
            engine, trainer = t["logprobs"][trained].double(), t["old_logprobs"][trained].double()
            diff = engine - trainer
            # k3 of KL(engine || trainer), sampled from the engine: exp(d) - d - 1, d = trainer - engine
            k3 = kl_k3(engine, trainer, clamp=None)
            sums.update(lp_diff=float(diff.sum()), lp_k3=float(k3.double().sum()), lp_tokens=float(diff.numel()))
            ext["logprob_diff_max"] = float(diff.abs().max())
    return sums, {k: ext.get(k, EMPTY) for k in MAX_KEYS}


def finish(sums: dict[str, float], ext: dict[str, float]) -> dict[str, float]:
    """The step's metrics from the summed parts and the extremes of every rank. A figure over no
    value is left out (a step with no trained token has no advantage statistics), except the means
    the row always had (0 over no sample). ``reward_std`` is the population standard deviation."""
    n = sums["samples"]
    out = {"samples": n, "reward_mean": sums["reward"] / max(n, 1), "staleness_mean": sums["stale"] / max(n, 1),
           "truncated_frac": sums["truncated"] / max(n, 1), "response_len_mean": sums["response_tokens"] / max(n, 1)}
    if n:
        mean = sums["reward"] / n
        out["reward_std"] = math.sqrt(max(sums["reward_sq"] / n - mean * mean, 0.0))
        out["prompt_len_mean"] = sums["prompt_tokens"] / n
    if sums["adv_tokens"]:
        out["advantage_mean"] = sums["adv"] / sums["adv_tokens"]
    if sums["lp_tokens"]:
        out["logprob_diff_mean"] = sums["lp_diff"] / sums["lp_tokens"]
        out["logprob_kl_k3"] = sums["lp_k3"] / sums["lp_tokens"]
    for k, v in ext.items():
        if v != EMPTY:
            out[k] = -v if k.endswith("_min") else v
    return out


def peak_memory(device: torch.device) -> dict[str, float]:
    """This process's peak memory so far, GiB: on a GPU what torch allocated on it
    (``max_memory_allocated_gb``, verl's figure: the caching allocator's reserve and other
    processes left out); on a CPU the peak resident set size (``peak_rss_gb``, from getrusage:
    every byte the process touched, model, optimizer and buffers together)."""
    if device.type == "cuda":
        return {"max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"peak_rss_gb": rss / (2**30 if sys.platform == "darwin" else 2**20)}


def step_statistics(batch: SampleBatch, cfg: Any, step: int, reduce: Callable[..., list[float]] | None = None,
                    peaks: dict[str, float] | None = None) -> dict[str, float]:
    """The step's statistics over every rank (a collective: every rank calls it, with its part of
    the step). ``reduce(values, op)``: the group's all-reduce (default
    :func:`distflow.trainer.actor.all_reduce`). ``peaks``: more figures whose maximum over the ranks
    is wanted (the peak memory, the weight bytes published), reduced in the same MAX collective."""
    import torch.distributed as dist

    if reduce is None:
        from distflow.trainer.actor import all_reduce as reduce
    sums, ext = local_parts(batch, cfg, step)
    extra = dict(peaks or {})
    total = dict(zip(SUM_KEYS, reduce([sums[k] for k in SUM_KEYS], dist.ReduceOp.SUM)))
    maxed = dict(zip((*MAX_KEYS, *extra), reduce([*(ext[k] for k in MAX_KEYS), *extra.values()], dist.ReduceOp.MAX)))
    return {**finish(total, {k: maxed[k] for k in MAX_KEYS}), **{k: maxed[k] for k in extra}}
