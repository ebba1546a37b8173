"""Run metrics: one JSON line per trainer step, and the reward curve.

Written by trainer rank 0 only, into ``output_dir``. The launcher's progress bar tails
``metrics.jsonl``; nothing else depends on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, output_dir: Path, append: bool = False):
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / "metrics.jsonl"
        if not append:
            self.path.write_text("")

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


def plot_reward_curve(metrics_path: Path, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    steps = [r["step"] for r in rows]
    rewards = [r["reward_mean"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, rewards, marker=".", linewidth=1)
    if len(rewards) >= 5:
        k = max(2, len(rewards) // 10)
        smooth = [sum(rewards[max(0, i - k + 1): i + 1]) / len(rewards[max(0, i - k + 1): i + 1])
                  for i in range(len(rewards))]
        ax.plot(steps, smooth, linewidth=2, label=f"mean of last {k}")
        ax.legend(loc="lower right")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.set_title(metrics_path.parent.name)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
