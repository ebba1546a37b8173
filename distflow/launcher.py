"""``distflow run``: start a whole local cluster as real ``distflow-node`` processes.

The launcher only starts processes and hands them ``--seeds`` and the cluster secret
(through the environment, never the command line); it takes no part in the run. It
shows progress by tailing the ``metrics.jsonl`` that trainer rank 0 writes, stops every
child within a bounded time on Ctrl-C or on any child's failure, and exits non-zero
with that child's error.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from distflow.core.auth import SECRET_ENV, new_secret
from distflow.core.config import Config

STOP_GRACE_S = 15.0


@dataclass
class Child:
    node_id: str
    role: str
    port: int
    proc: subprocess.Popen
    log_path: Path


def _free_ports(host: str, n: int) -> list[int]:
    """n bindable ports BELOW the kernel's ephemeral range, so that no outgoing connection
    (which takes an ephemeral port) can grab one before its node binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(max(1024, low - 12000), low)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        ports.append(port)
    return ports


def _node_command() -> list[str]:
    exe = shutil.which("distflow-node")
    return [exe] if exe else [sys.executable, "-c", "import sys; from distflow.cli import node_main; sys.exit(node_main())"]


def check_functions(cfg: Config) -> None:
    """Resolve every workflow function (rewards, estimators, losses) now, before any node starts."""
    from distflow.rollout.rewards import resolve_reward
    from distflow.rl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, resolve

    for node in cfg.workflow:
        kind = (node.role.value, node.type.value)
        try:
            if kind == ("REWARD", "COMPUTE"):
                resolve_reward(node.fn)
            elif kind == ("ACTOR", "COMPUTE"):
                resolve(ADVANTAGE_ESTIMATORS, node.fn, "advantage estimator")
            elif kind == ("ACTOR", "MODEL_TRAIN"):
                resolve(POLICY_LOSSES, node.fn, "policy loss")
        except Exception as e:
            raise SystemExit(f"distflow: workflow node {node.id!r}: {e}") from None


def prepare(cfg: Config) -> Path:
    """Create output_dir, build the toy model if asked, and write the resolved config children read."""
    check_functions(cfg)
    out = Path(cfg.output_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if cfg.toy_model and not (Path(cfg.model_path) / "config.json").is_file():
        from distflow.toy import ensure_toy_model

        print(f"distflow: building the toy model at {cfg.model_path}", file=sys.stderr)
        ensure_toy_model(cfg.model_path)
    if not Path(cfg.dataset).is_file():
        raise SystemExit(f"distflow run: dataset {cfg.dataset!r} not found")
    resolved = out / "config.yaml"
    resolved.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return resolved


def start_children(cfg: Config, config_path: Path, secret: str) -> list[Child]:
    roles = [("trainer", i) for i in range(cfg.trainer_nodes)] + [("rollout", i) for i in range(cfg.rollout_nodes)]
    roles += [("controller", i) for i in range(cfg.controller_nodes)]
    ports = _free_ports(cfg.bind_host, 2 * len(roles))
    seeds = f"{cfg.bind_host}:{ports[0]}"  # everyone joins through the first node; gossip does the rest
    env = dict(os.environ, **{SECRET_ENV: secret, "PYTHONUNBUFFERED": "1",
                              "OMP_NUM_THREADS": str(cfg.torch_threads)})
    children = []
    for k, (role, i) in enumerate(roles):
        node_id = f"{role}-{i}"
        log_path = Path(cfg.output_dir) / "logs" / f"{node_id}.log"
        cmd = _node_command() + [
            "--role", role, "--config", str(config_path), "--node-id", node_id, "--host", cfg.bind_host,
            "--port", str(ports[2 * k]), "--data-port", str(ports[2 * k + 1]),
            "--seeds", "" if k == 0 else seeds,
        ]
        f = log_path.open("w")
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        f.close()
        children.append(Child(node_id, role, ports[2 * k], proc, log_path))
    return children


def stop_children(children: list[Child], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every live child, then SIGKILL whatever is left after the grace period."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait(timeout=5)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _error_line(path: Path) -> str:
    """The node's own one-line account of its failure (its last ERROR record)."""
    try:
        errors = [ln for ln in path.read_text(errors="replace").splitlines() if " ERROR " in ln]
    except OSError:
        return "(no log)"
    return errors[-1].split(": ", 1)[-1] if errors else "(no error logged; see its log)"


class Progress:
    """A progress bar fed by metrics.jsonl (or plain lines when not a terminal)."""

    def __init__(self, metrics_path: Path, enabled: bool):
        from tqdm import tqdm

        self.path, self.seen = metrics_path, 0
        self.bar = tqdm(total=None, unit="step", desc="training", disable=not enabled, dynamic_ncols=True)
        self.plain = not enabled
        self.last: dict | None = None

    def poll(self) -> None:
        from distflow.trainer.metrics import read_metrics

        rows = read_metrics(self.path)
        for r in rows[self.seen:]:
            self.last = r
            if self.bar.total is None and "total_steps" in r:
                self.bar.total = r["total_steps"]
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{r['reward_mean']:.3f}", samples_s=f"{r['samples_per_s']:.0f}",
                                 stale=f"{r['staleness_mean']:.2f}", refresh=False)
            if self.plain:
                print(f"step {r['step'] + 1}/{r.get('total_steps', '?')} reward={r['reward_mean']:.3f} "
                      f"loss={r.get('loss', 0):.4f} samples/s={r['samples_per_s']:.0f} "
                      f"staleness={r['staleness_mean']:.2f}", flush=True)
        self.seen = len(rows)

    def close(self) -> None:
        self.bar.close()


def launch(cfg: Config, in_process: bool = False, progress: bool = True) -> int:
    config_path = prepare(cfg)
    if in_process:
        from distflow.inprocess import run_in_process

        return run_in_process(cfg)
    secret = os.environ.get(SECRET_ENV) or new_secret()
    metrics = Path(cfg.output_dir) / "metrics.jsonl"
    if not cfg.resume_from:
        metrics.unlink(missing_ok=True)
    children = start_children(cfg, config_path, secret)
    seed = f"{cfg.bind_host}:{children[0].port}"
    hint = ("" if os.environ.get(SECRET_ENV) else
            f" (export {SECRET_ENV} before `distflow run` to be able to do that: this run's secret is random)")
    print(f"distflow: {cfg.rollout_nodes} rollout + {cfg.trainer_nodes} trainer nodes, logs in "
          f"{Path(cfg.output_dir) / 'logs'}; watch with `distflow status --seeds {seed}`{hint}", file=sys.stderr)
    bar = Progress(metrics, enabled=progress and sys.stderr.isatty())
    failed: list[Child] = []
    try:
        while True:
            bar.poll()
            codes = [c.proc.poll() for c in children]
            failed = [c for c, rc in zip(children, codes) if rc not in (None, 0)]
            if failed or all(rc == 0 for rc in codes):
                break
            time.sleep(0.2)
        bar.poll()
    except KeyboardInterrupt:
        bar.close()
        print("\ndistflow: interrupted, stopping every node", file=sys.stderr)
        stop_children(children)
        return 130
    finally:
        bar.close()
    if failed:
        time.sleep(1.0)  # let the nodes that saw the failure report what they saw
        failed = [c for c in children if c.proc.poll() not in (None, 0)]
        first = failed[0]
        lines = [f"distflow: {c.node_id} failed (exit {c.proc.returncode}): {_error_line(c.log_path)}" for c in failed]
        print("\n".join(lines) + f"\ndistflow: stopping the other nodes.\n--- last lines of {first.log_path} ---\n"
              f"{_tail(first.log_path)}", file=sys.stderr)
        stop_children(children)
        return 1
    last = bar.last or {}
    print(f"distflow: done. {last.get('step', -1) + 1} steps, final reward {last.get('reward_mean', float('nan')):.3f}; "
          f"metrics {metrics}, checkpoint {Path(cfg.output_dir) / 'checkpoint'}", file=sys.stderr)
    return 0
