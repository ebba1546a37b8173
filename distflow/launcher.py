"""``distflow run``: start a whole local cluster as real ``distflow-node`` processes, and supervise it.

The launcher only starts processes and hands them ``--seeds``, their GPUs
(``CUDA_VISIBLE_DEVICES``, from :mod:`distflow.placement`) and the cluster secret (through
the environment, never the command line); it takes no part in the run. It shows progress
by tailing the ``metrics.jsonl`` that trainer rank 0 writes, and supervises like torchrun:

- a dead rollout node does not stop the run: the other rollout nodes adopt its shard
  (as on a hand-started cluster), and it is restarted with the same id and ports, up to
  ``restarts`` times;
- a dead node of a worker group (``worker_groups``) is restarted the same way; meanwhile
  the rollout nodes retry their sends to it;
- a dead trainer rank (or controller) stops every node at once, and the message names
  it and the newest checkpoint to ``resume_from``;
- Ctrl-C stops the rollout nodes first, so the trainers save a final checkpoint at their
  last completed step and exit by themselves (bounded: then SIGTERM, then SIGKILL).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import yaml

from distflow.core.auth import SECRET_ENV, new_secret
from distflow.core.config import Config
from distflow.core.dag import WorkflowNode

STOP_GRACE_S = 15.0
RESTARTABLE = ("rollout", "worker")  # roles a dead node of which is restarted (a dead trainer ends the run)
T0_ENV = "DISTFLOW_T0"  # wall-clock start of the launcher process, for the start-up figure


@dataclass
class Child:
    node_id: str
    role: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0

    def respawn(self) -> None:
        """Start the node again: same id, same ports, same environment; its log is appended to."""
        self.restarts += 1
        with self.log_path.open("a") as f:
            f.write(f"\n----- distflow run: restart {self.restarts} of {self.node_id} -----\n")
            f.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)


def launch_time() -> float | None:
    """Wall-clock start of the ``distflow run`` that launched this process (``DISTFLOW_T0``), or None."""
    try:
        return float(os.environ[T0_ENV])
    except (KeyError, ValueError):
        return None


def process_start_time() -> float:
    """Wall-clock time this process started (from /proc; now, where there is no /proc)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # since boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def newest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint of ``output_dir`` with the highest policy version (``checkpoint``,
    ``checkpoint-N``), complete enough to ``resume_from``; None when there is none."""
    import json

    best: tuple[int, float, Path] | None = None
    for d in Path(output_dir).glob("checkpoint*"):
        state = d / "distflow_state.json"  # written last by trainer rank 0 (distflow.trainer.actor.STATE_FILE)
        try:
            key = (int(json.loads(state.read_text())["policy_version"]), state.stat().st_mtime, d)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if best is None or key[:2] > best[:2]:
            best = key
    return best[2] if best else None


def resume_hint(output_dir: str | Path, resume_from: str | None = None) -> str:
    """What to resume from after a stop: the newest checkpoint of ``output_dir``, else the one
    this run resumed from (``resume_from``), else none."""
    ckpt = newest_checkpoint(output_dir)
    if ckpt is None and resume_from:
        return f"no newer checkpoint was saved; continue with resume_from={resume_from}"
    if ckpt is None:
        return "no checkpoint was saved yet (save_every: N saves one every N steps); restart from scratch"
    return f"newest checkpoint {ckpt}: continue with resume_from={ckpt}"


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


def check_functions(cfg: Config, nodes: Sequence[WorkflowNode] | None = None) -> None:
    """Resolve the workflow functions (rewards, estimators, losses) of ``nodes`` (default: every
    node) now, before any node starts. Built-in names are checked against torch-free name tables
    (start-up); a dotted ``package.module:function`` is imported, and an unknown name gets the
    resolver's error (with a did-you-mean). A node process checks its own pipeline's: a host
    need not have the packages of the stages other hosts run."""
    from distflow.rl.names import COMPUTE_NAMES, POLICY_LOSS_NAMES
    from distflow.rollout.rewards import resolve_reward, reward_keys, reward_row_check

    def check(names: tuple[str, ...], fn: str, what: str) -> None:
        if fn not in names:
            from distflow.rl.registry import resolve

            resolve(dict.fromkeys(names), fn, what)

    for node in cfg.workflow if nodes is None else nodes:
        kind = (node.role.value, node.type.value)
        try:
            if kind == ("REWARD", "COMPUTE"):  # and what it declares of the rows (required_keys, check_row)
                fn = resolve_reward(node.fn)
                reward_keys(fn, node.fn)
                reward_row_check(fn, node.fn)
            elif kind == ("ACTOR", "COMPUTE"):
                check(COMPUTE_NAMES, node.fn, "advantage estimator")
            elif kind == ("ACTOR", "MODEL_TRAIN"):
                check(POLICY_LOSS_NAMES, node.fn, "policy loss")
        except Exception as e:
            raise SystemExit(f"distflow: workflow node {node.id!r}: {e}") from None


def prepare(cfg: Config) -> Path:
    """Create output_dir, build the toy model if asked, and write the resolved config children read."""
    check_functions(cfg)
    out = Path(cfg.output_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if cfg.toy_model and not (Path(cfg.model_path) / "config.json").is_file():
        from distflow.toy import ensure_toy_model

        print(f"distflow: building the {cfg.toy_kind} toy model at {cfg.model_path}", file=sys.stderr)
        ensure_toy_model(cfg.model_path, kind=cfg.toy_kind)
    if cfg.toy_model and cfg.toy_kind == "successor":
        from distflow.toy import ensure_toy_model

        for n in cfg.workflow:  # the toy reward models the workflow names (same tokenizer as the toy policy)
            path = n.args.get("path")
            if (n.role.value, n.type.value) == ("REWARD", "MODEL_INFERENCE") and isinstance(path, str) and path \
                    and not (Path(path) / "config.json").is_file():
                print(f"distflow: building the toy reward model at {path}", file=sys.stderr)
                ensure_toy_model(path, kind="reward")
    if not Path(cfg.dataset).is_file():
        raise SystemExit(f"distflow run: dataset {cfg.dataset!r} not found")
    resolved = out / "config.yaml"
    resolved.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return resolved


def node_roles(cfg: Config) -> list[tuple[str, str]]:
    """(node_id, role) of every node `distflow run` starts, in start order."""
    roles = [("trainer", i) for i in range(cfg.trainer_nodes)] + [("rollout", i) for i in range(cfg.rollout_nodes)]
    roles += [("controller", i) for i in range(cfg.controller_nodes)]
    out = [(f"{role}-{i}", role) for role, i in roles]
    return out + [(f"{g}-{i}", "worker") for g, n in cfg.worker_groups.items() for i in range(n)]


def worker_group(node_id: str) -> str:
    """The worker group of a ``worker`` node started by `distflow run` (its id is ``<group>-<i>``)."""
    return node_id.rsplit("-", 1)[0]


def gpus_present() -> tuple[int, list[str] | None]:
    """How many GPUs this launcher sees, and its own CUDA_VISIBLE_DEVICES entries (None = unset)."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = None if raw is None else [v.strip() for v in raw.split(",") if v.strip()]
    import torch

    return torch.cuda.device_count(), visible


def plan_placement(cfg: Config, present: int | None = None, visible: list[str] | None = None):
    """Each node's GPU environment (distflow.placement.place for this config); exits naming
    the key when the placement is impossible. ``present`` None: ask torch (cuda only)."""
    from distflow.placement import PlacementError, place

    if cfg.device == "cuda" and present is None:
        present, visible = gpus_present()
    try:
        return place(node_roles(cfg), device=cfg.device, gpus=cfg.gpus, colocate=cfg.colocate, present=present,
                     visible=visible)
    except PlacementError as e:
        raise SystemExit(f"distflow run: {e}") from None


def start_children(cfg: Config, config_path: Path, secret: str, placement=None) -> list[Child]:
    nodes = node_roles(cfg)
    slots = {s.node_id: s for s in (placement if placement is not None else plan_placement(cfg))}
    ports = _free_ports(cfg.bind_host, 2 * len(nodes))
    seeds = f"{cfg.bind_host}:{ports[0]}"  # everyone joins through the first node; gossip does the rest
    env = dict(os.environ, **{SECRET_ENV: secret, "PYTHONUNBUFFERED": "1",
                              "OMP_NUM_THREADS": str(cfg.torch_threads)})
    env.setdefault(T0_ENV, repr(process_start_time()))
    children = []
    for k, (node_id, role) in enumerate(nodes):
        log_path = Path(cfg.output_dir) / "logs" / f"{node_id}.log"
        cmd = _node_command() + [
            "--role", role, "--config", str(config_path), "--node-id", node_id, "--host", cfg.bind_host,
            "--port", str(ports[2 * k]), "--data-port", str(ports[2 * k + 1]),
            "--seeds", "" if k == 0 else seeds,
        ] + (["--group", worker_group(node_id)] if role == "worker" else [])
        child_env = {**env, **slots[node_id].env}
        f = log_path.open("w")
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
        f.close()
        children.append(Child(node_id, role, ports[2 * k], proc, log_path, cmd, child_env))
    return children


def _wait_all(children: list[Child], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    for c in children:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    return True


def stop_children(children: list[Child], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every live child, then SIGKILL whatever is left after the grace period."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    _wait_all(children, grace_s)
    for c in children:
        if c.proc.poll() is None:
            try:
                os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait(timeout=5)
            except ProcessLookupError:  # it exited meanwhile
                pass
            except subprocess.TimeoutExpired:  # e.g. stuck in the GPU driver: go on with the others
                print(f"distflow: {c.node_id} (pid {c.proc.pid}) did not exit 5 s after SIGKILL", file=sys.stderr)


def stop_for_checkpoint(children: list[Child], grace_s: float) -> None:
    """Stop the producers first (the rollout and controller nodes leave the mesh), so each
    trainer saves a checkpoint at its last completed step and exits by itself; then the rest."""
    producers = [c for c in children if c.role != "trainer"]
    stop_children(producers)
    trainers = [c for c in children if c.role == "trainer"]
    if not _wait_all(trainers, grace_s):
        print(f"distflow: the trainers did not stop within {grace_s:.0f}s; stopping them", file=sys.stderr)
    stop_children(trainers)


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
        from distflow.core.status import format_stages
        from distflow.trainer.metrics import read_metrics

        rows = read_metrics(self.path)
        for r in rows[self.seen:]:
            self.last = r
            if self.bar.total is None and "total_steps" in r:
                self.bar.total = r["total_steps"]
            self.bar.update(1)
            stages = format_stages(r)
            gen = {"generated": f"{r['generated_reward_mean']:.3f}"} if "generated_reward_mean" in r else {}
            self.bar.set_postfix(reward=f"{r['reward_mean']:.3f}", **gen, samples_s=f"{r['samples_per_s']:.0f}",
                                 stale=f"{r['staleness_mean']:.2f}", **({"time": stages} if stages else {}),
                                 refresh=False)
            if self.plain:
                generated = "".join(f"{k}={v} " for k, v in gen.items())
                print(f"step {r['step'] + 1}/{r.get('total_steps', '?')} reward={r['reward_mean']:.3f} {generated}"
                      f"loss={r.get('loss', 0):.4f} samples/s={r['samples_per_s']:.0f} "
                      f"staleness={r['staleness_mean']:.2f}" + (f" [{stages}]" if stages else ""), flush=True)
        self.seen = len(rows)

    def close(self) -> None:
        self.bar.close()


def launch(cfg: Config, in_process: bool = False, progress: bool = True) -> int:
    config_path = prepare(cfg)
    if in_process:
        from distflow.inprocess import run_in_process

        return run_in_process(cfg)
    placement = plan_placement(cfg)  # refuses an impossible placement before anything starts
    secret = os.environ.get(SECRET_ENV) or new_secret()
    metrics = Path(cfg.output_dir) / "metrics.jsonl"
    if not cfg.resume_from:
        metrics.unlink(missing_ok=True)
    from distflow.placement import describe

    print(f"distflow: {describe(placement)}", file=sys.stderr)
    children = start_children(cfg, config_path, secret, placement)
    seed = f"{cfg.bind_host}:{children[0].port}"
    hint = ("" if os.environ.get(SECRET_ENV) else
            f" (export {SECRET_ENV} before `distflow run` to be able to do that: this run's secret is random)")
    extra = "".join(f" + {n} {g}" for g, n in cfg.worker_groups.items())
    print(f"distflow: {cfg.rollout_nodes} rollout{extra} + {cfg.trainer_nodes} trainer nodes, logs in "
          f"{Path(cfg.output_dir) / 'logs'}; watch with `distflow status --seeds {seed}`{hint}", file=sys.stderr)
    bar = Progress(metrics, enabled=progress and sys.stderr.isatty())
    try:
        code = supervise(cfg, children, bar)
        bar.poll()
    except KeyboardInterrupt:
        bar.close()
        # A big model's save takes minutes: the trainers get as long as any of their collectives may take.
        print(f"\ndistflow: interrupted; stopping the rollout nodes, the trainers save a checkpoint (up to "
              f"{cfg.step_timeout_s:.0f}s, step_timeout_s; Ctrl-C again to stop at once)", file=sys.stderr)
        try:
            stop_for_checkpoint(children, grace_s=cfg.step_timeout_s)
        except KeyboardInterrupt:  # a second Ctrl-C: do not wait for the checkpoint
            print("distflow: interrupted again; stopping every node now", file=sys.stderr)
            stop_children(children, grace_s=5.0)
        print(f"distflow: stopped. {resume_hint(cfg.output_dir, cfg.resume_from)}", file=sys.stderr)
        return 130
    except BaseException:  # the launcher itself failed: never leave the nodes running detached
        print("distflow: the launcher failed; stopping every node", file=sys.stderr)
        stop_children(children, grace_s=5.0)
        raise
    finally:
        bar.close()
    if code:
        return code
    last = bar.last or {}
    gen = f" (generated {last['generated_reward_mean']:.3f})" if "generated_reward_mean" in last else ""
    print(f"distflow: done. {last.get('step', -1) + 1} steps, final reward {last.get('reward_mean', float('nan')):.3f}"
          f"{gen}; metrics {metrics}, checkpoint {Path(cfg.output_dir) / 'checkpoint'}", file=sys.stderr)
    return 0


def _report(failed: list[Child], cfg: Config, why: str) -> None:
    lines = [f"distflow: {c.node_id} failed (exit {c.proc.returncode}): {_error_line(c.log_path)}" for c in failed]
    first = failed[0]
    hint = resume_hint(cfg.output_dir, cfg.resume_from)
    print("\n".join(lines) + f"\ndistflow: {why}; stopping the other nodes. {hint}\n"
          f"--- last lines of {first.log_path} ---\n{_tail(first.log_path)}", file=sys.stderr)


def supervise(cfg: Config, children: list[Child], bar: Progress | None = None, poll_s: float = 0.2) -> int:
    """Watch the children until the run ends; restart dead rollout nodes. Returns the exit code."""
    trainers = [c for c in children if c.role == "trainer"]
    handled: set[int] = set()  # pids of dead rollout processes already dealt with
    while True:
        if bar is not None:
            bar.poll()
        codes = {c.node_id: c.proc.poll() for c in children}
        if all(codes[t.node_id] == 0 for t in trainers):
            break  # the trainers finished: the run is done
        fatal = [c for c in children if c.role not in RESTARTABLE and codes[c.node_id] not in (None, 0)]
        if fatal:
            time.sleep(1.0)  # let the nodes that saw the failure report what they saw
            failed = fatal + [c for c in children if c not in fatal and c.proc.poll() not in (None, 0)]
            _report(failed, cfg, f"{fatal[0].role} {fatal[0].node_id} died, the run cannot go on without it")
            stop_children(children)
            return 1
        trainers_running = all(codes[t.node_id] is None for t in trainers)
        for c in children:
            rc = codes[c.node_id]
            if c.role not in RESTARTABLE or rc in (None, 0) or c.proc.pid in handled or not trainers_running:
                continue
            handled.add(c.proc.pid)
            why = f"{c.node_id} died (exit {rc}): {_error_line(c.log_path)}"
            if c.restarts >= cfg.restarts:
                _report([c], cfg, f"{c.node_id} used up its {cfg.restarts} restarts (restarts: {cfg.restarts})")
                stop_children(children)
                return 1
            meanwhile = ("its shard is adopted by the other rollout nodes" if c.role == "rollout" else
                         "the rollout nodes retry their sends to it until it is back")
            print(f"distflow: {why}; {meanwhile}; restarting it with the same "
                  f"id and ports (restart {c.restarts + 1} of {cfg.restarts})", file=sys.stderr)
            c.respawn()
        time.sleep(poll_s)
    # The trainers are done: the rollout nodes stop on the final version within a moment (a
    # restarted one still joining never will: it is stopped).
    rest = [c for c in children if c.role != "trainer"]
    if not _wait_all(rest, 5.0):
        stop_children(rest)
    return 0
