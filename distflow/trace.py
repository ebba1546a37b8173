"""Sample accounting: which node handled which sample ids, per step (``trace_samples: true``).

Each node appends JSON lines to its own file under ``output_dir/trace/``; nothing is
gathered anywhere during the run. Tests and users audit the invariants afterwards: each
trainer rank got only the samples it owns, rollout shards are disjoint, every prompt of
an epoch was trained on exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class Trace:
    """A node's trace file. A new run starts it empty; a node that ``distflow run`` restarted
    (same id, same run: the file was written after the launcher started, ``DISTFLOW_T0``) appends,
    so the records of its first life stay; a trainer restarted from the checkpoint of step
    ``resume_step`` keeps only the records before it (the later steps are trained again), so the
    trainers' traces hold exactly what their weights were trained on."""

    def __init__(self, output_dir: str, node_id: str, enabled: bool, resume_step: int | None = None):
        self.path = Path(output_dir) / "trace" / f"{node_id}.jsonl" if enabled else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not _written_this_run(self.path):
                self.path.write_text("")
            elif resume_step is not None:  # a trainer restarted from a checkpoint: its later steps are trained again
                lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
                kept = [ln for ln in lines if json.loads(ln).get("step", -1) < resume_step]
                self.path.write_text("".join(ln + "\n" for ln in kept))

    def write(self, **record: Any) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def _written_this_run(path: Path) -> bool:
    from distflow.core.launch_env import launch_time  # noqa: PLC0415 - only nodes that write a trace need it

    t0 = launch_time()
    try:
        return t0 is not None and path.stat().st_mtime >= t0
    except OSError:
        return False


def read_trace(output_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """node_id -> records."""
    out = {}
    for p in sorted((Path(output_dir) / "trace").glob("*.jsonl")):
        out[p.stem] = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return out
