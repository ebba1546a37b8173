"""Start-up of the quickstart: seconds from `distflow run` to the first generated batch.

    python bench/startup.py [--runs 3] [--config examples/grpo_quickstart.yaml] [key=value ...]

Runs the config for one step, several times, once with its nodes forked from the zygote
(``fork_nodes: true``, the default: distflow/launch/zygote.py) and once with each node its own
program (the baseline, ``fork_nodes: false``), and reads where the time went from the node
logs (every node logs with wall-clock timestamps; `distflow run` hands the nodes its own
start time in DISTFLOW_T0 and each rollout node logs, and gossips as ``startup_s``, the
seconds from it to its first generated batch). Phases, per run (slowest node of each):

  launch   `distflow run` process start -> the node processes are started (config, toy model)
  up       -> every node is up in the mesh (its imports: torch, transformers, the role code)
  groups   -> every node has formed its groups (rank derived from membership)
  ready    -> the engines and trainers are built (model loading, torch.distributed init)
  first    -> the first batch is generated (startup_s)
  total    -> `distflow run` exited (the one-step run's whole wall time)

Besides the medians per variant it prints the baseline / fork ratios of ``startup_s`` and of
``total`` and the CPU time of each run (the launcher and all its nodes), and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
MARKS = {"up": re.compile(r" up: control "), "groups": re.compile(r"(rollout|trainer) rank \d+ of \d+$"),
         "ready": re.compile(r"(shard \d+ of \d+ rows|pipeline \[.*\], serves weights)"),
         "first": re.compile(r"first batch generated ([\d.]+)s after launch")}


def _when(line: str) -> float | None:
    m = STAMP.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def phases(out: Path, t0: float) -> dict[str, float]:
    """Seconds after t0 at which the slowest node reached each mark."""
    reached: dict[str, float] = {}
    startup = []
    for log in sorted((out / "logs").glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            for name, rx in MARKS.items():
                m = rx.search(line)
                if m and (t := _when(line)) is not None:
                    reached[name] = max(reached.get(name, 0.0), t - t0)
                    if name == "first":
                        startup.append(float(m.group(1)))
    if startup:
        reached["startup_s"] = max(startup)
    return reached


def run_once(config: str, out: Path, model: Path, overrides: list[str]) -> dict[str, float] | None:
    """One one-step run: its phases, whole wall time and CPU time (it and its children)."""
    before = os.times()
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "distflow.launch.cli", "run", config, "--no-progress",
                        f"output_dir={out}", f"model_path={model}", "max_steps=1", *overrides],
                       cwd=ROOT, capture_output=True, text=True)
    total = time.time() - t0
    after = os.times()
    if r.returncode:
        print(r.stderr[-3000:], file=sys.stderr)
        return None
    row = phases(out, t0)
    row["total"] = total
    row["cpu_s"] = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--config", default="examples/grpo_quickstart.yaml")
    args, overrides = p.parse_known_args()
    medians: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "toy-model"
        if run_once(args.config, Path(tmp) / "warm", model, overrides) is None:  # builds the toy model: not counted
            return 1
        for variant, fork in (("exec", "false"), ("fork", "true")):
            rows = []
            for k in range(args.runs):
                row = run_once(args.config, Path(tmp) / f"{variant}{k}", model, [*overrides, f"fork_nodes={fork}"])
                if row is None:
                    return 1
                rows.append(row)
                print(f"{variant} run {k + 1}: " + "  ".join(f"{n} {v:5.2f}s" for n, v in row.items()), flush=True)
            keys = [k for k in ("up", "groups", "ready", "first", "startup_s", "total", "cpu_s")
                    if all(k in r for r in rows)]
            medians[variant] = {n: round(statistics.median(r[n] for r in rows), 2) for n in keys}
            print(f"{variant} median: " + "  ".join(f"{n} {v:5.2f}s" for n, v in medians[variant].items()))
    ratios = {f"{k}_ratio": round(medians["exec"][k] / medians["fork"][k], 2)
              for k in ("startup_s", "total", "cpu_s") if k in medians["exec"] and k in medians["fork"]}
    print("exec / fork: " + "  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(json.dumps({"bench": "startup", "runs": args.runs, "exec": medians["exec"], "fork": medians["fork"],
                      **ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
