"""Run metrics: one JSON line per trainer step, the reward curve and the per-stage timings.

Written by trainer rank 0 only, into ``output_dir``. The launcher's progress bar tails
``metrics.jsonl``; nothing else depends on it. ``timings.png`` stacks each step's time per
stage (generation, waiting, logprobs, update, weights, weight loading) so the slow stage
is visible at a glance, beside ``reward_curve.png``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distflow.core.status import STAGE_TIME_KEYS

# Every per-stage key a step's metrics (and trainer rank 0's mesh metadata) carry.
STAGE_KEYS = (*STAGE_TIME_KEYS, "tokens_per_s", "mfu")

# What each stage time is, for timings.png's legend (docs/metrics.md has the same words).
STAGE_LABELS = {"time_generate_s": "generate (rollout)", "time_wait_s": "wait for samples (trainer)",
                "time_logprobs_s": "reference / old logprobs (trainer)", "time_update_s": "update (trainer)",
                "time_weights_s": "gather + publish weights (trainer)",
                "time_load_weights_s": "load weights (rollout)"}


class MetricsWriter:
    """``metrics.jsonl`` (or ``name``: ``eval.jsonl``) of a run. A fresh run starts it empty; a run
    resumed at step ``resume_step`` keeps the rows of the steps before it and drops the later ones
    (the run got further than its checkpoint before it stopped: those steps are trained again, and
    would appear twice)."""

    def __init__(self, output_dir: Path, resume_step: int | None = None, name: str = "metrics.jsonl"):
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / name
        if resume_step is None:
            self.path.write_text("")
            return
        kept = [r for r in read_metrics(self.path) if isinstance(r.get("step"), int) and r["step"] < resume_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        tmp.replace(self.path)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line being written right now
    return out


def with_generated_mean(stats: dict[str, float]) -> dict[str, float]:
    """The step's summed rollout counters, plus the per-episode means of multi-turn episodes
    (:func:`distflow.env.runner.episode_means`), plus ``generated_reward_mean`` where a filter
    (DAPO's dynamic sampling) counted what the policy generated before it dropped groups:
    ``reward_mean`` is over the trained samples only, which the filter biases."""
    from distflow.env.runner import episode_means  # torch-free

    stats = episode_means(stats)  # multi-turn episodes: per-episode means of the summed counters
    n = stats.get("generated_samples", 0)
    if n > 0:
        return {**stats, "generated_reward_mean": stats.get("generated_reward", 0.0) / n}
    return stats


def plot_reward_curve(metrics_path: Path, out_png: Path, eval_path: Path | None = None) -> None:
    """The trained samples' mean reward per step (and its running mean), the generated one
    where a filter dropped groups, and the held-out evaluation's (``eval_path``: eval.jsonl)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    steps = [generated_by(r) for r in rows]  # x: the policy version, as eval.jsonl's step
    rewards = [r["reward_mean"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, rewards, marker=".", linewidth=1, label="trained samples")
    generated = [(generated_by(r), r["generated_reward_mean"]) for r in rows if "generated_reward_mean" in r]
    if generated:
        ax.plot(*zip(*generated), linewidth=1, label="generated (before the filter)")
    if len(rewards) >= 5:
        k = max(2, len(rewards) // 10)
        smooth = [sum(rewards[max(0, i - k + 1): i + 1]) / len(rewards[max(0, i - k + 1): i + 1])
                  for i in range(len(rewards))]
        ax.plot(steps, smooth, linewidth=2, label=f"mean of last {k}")
    held_out = eval_curve(eval_path)[0] if eval_path is not None else []
    if held_out:
        ax.plot(*zip(*held_out), marker="o", linewidth=1.5, label="held-out evaluation")
    if generated or held_out or len(rewards) >= 5:
        ax.legend(loc="upper left")
    ax.set_xlabel("policy version (steps trained) that generated the samples")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.set_title(metrics_path.parent.name)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


def generated_by(row: dict[str, Any]) -> float:
    """A metrics row's position on the reward curve: the policy version that generated its samples,
    on average (``step - staleness_mean``; ``step`` is 0-based and is the version the trainer held
    before the step's update), the same axis as an eval.jsonl row's ``step`` (the version it
    evaluated). With rollout one step ahead (``max_staleness: 1``) a step trains on the samples of
    the version before it, so plotting rows at ``step`` put them one step off the evaluations."""
    return float(row["step"]) - float(row.get("staleness_mean") or 0.0)


def eval_curve(path: Path) -> tuple[list[tuple[int, float]], int]:
    """(step, eval_reward_mean) of eval.jsonl's complete rows, by step (partial rows are written
    last, and a resumed run's rows follow the earlier run's), and the number of rows left out:
    partial or with a failed shard (their mean covers only some of the held-out prompts)."""
    rows = [r for r in read_metrics(path) if isinstance(r.get("step"), int)
            and isinstance(r.get("eval_reward_mean"), (int, float))]
    complete = [r for r in rows if r.get("eval_shards") == r.get("eval_num_shards") and not r.get("eval_failed_shards")]
    return sorted((r["step"], float(r["eval_reward_mean"])) for r in complete), len(rows) - len(complete)


def plot_timings(metrics_path: Path, out_png: Path) -> None:
    """Stacked bars: seconds per stage (``STAGE_TIME_KEYS``) for every step. Generation and
    weight loading happen at the rollout nodes, overlapping the trainer's stages when
    rollout runs ahead (``max_staleness`` > 0), so a bar can exceed the step's wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    steps = [int(r["step"]) + 1 for r in rows]  # the progress line's "step k/N"
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=100)
    bottom = [0.0] * len(rows)
    for key in STAGE_TIME_KEYS:
        vals = [float(r.get(key) or 0.0) for r in rows]
        if any(vals):
            ax.bar(steps, vals, bottom=bottom, width=1.0, label=STAGE_LABELS[key])
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("trainer step")
    ax.set_ylabel("seconds per step")
    ax.grid(alpha=0.3, axis="y")
    if any(bottom):  # beside the bars, never over them
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", title="stage (where it runs)",
                  title_fontsize="small", frameon=False)
    ax.set_title(f"{metrics_path.parent.name}: time per stage")
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
