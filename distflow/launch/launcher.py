"""``distflow run``: start a whole local cluster as real ``distflow-node`` processes, and supervise it.

The launcher only starts processes and hands them ``--seeds``, their GPUs
(``CUDA_VISIBLE_DEVICES``, from :mod:`distflow.launch.placement`) and the cluster secret (through
the environment, never the command line); it takes no part in the run. It shows progress
by tailing the ``metrics.jsonl`` that trainer rank 0 writes, and supervises like torchrun:

- a dead rollout node does not stop the run: the other rollout nodes adopt its shard
  (as on a hand-started cluster), and it is restarted with the same id and ports, up to
  ``restarts`` times;
- a dead node of a worker group (``worker_groups``) is restarted the same way; meanwhile
  the rollout nodes retry their sends to it;
- a dead trainer rank (or controller) stops every node at once, and the message names
  it and the newest checkpoint to ``resume_from``;
- Ctrl-C (or SIGTERM, SIGHUP) stops the rollout nodes first, so the trainers save a final
  checkpoint at their last completed step and exit by themselves (bounded: then SIGTERM, then
  SIGKILL); before the first step has completed there is nothing to save: every node stops at once;
- a node that exits 2 (a configuration or data error: a restart would fail the same way) is
  not restarted: the run stops, naming it;
- on Linux each node gets SIGTERM when the launcher dies (``PR_SET_PDEATHSIG``), even by SIGKILL:
  the node asks for it first thing (:func:`die_with_launcher`), not a ``preexec_fn`` in the launcher.

Inputs that cannot work are refused before any node starts (:func:`prepare`, exit 2): the
prompt set (read the way the rollout nodes read it), the model directory, ``resume_from``
(:mod:`distflow.launch.preflight`).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from distflow.core.auth import SECRET_ENV, new_secret
from distflow.core.config import Config, ConfigError
from distflow.core.launch_env import LAUNCHER_PID_ENV, T0_ENV, process_start_time
from distflow.launch.checkpoint import checkpoint_version, resume_hint
from distflow.launch.preflight import check_functions, check_inputs
from distflow.launch.roles import RESTARTABLE, cluster_nodes, node_roles
from distflow.launch.signals import catch_stop_signals, restore_signals, signum_of, stop_name

STOP_GRACE_S = 15.0
CONFIG_EXIT = 2  # a node's exit status on a configuration or data error (distflow.launch.cli): never restarted
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def spawn(cmd: list[str], log_file, env: dict[str, str]) -> subprocess.Popen:
    """Start a node: its own session (a Ctrl-C in the terminal reaches only the launcher, which
    stops the nodes in order), output to ``log_file``; the node has the kernel send it SIGTERM
    when the launcher dies (:func:`die_with_launcher`, told the launcher's pid in ``LAUNCHER_PID_ENV``).
    No ``preexec_fn``: Python documents it as unsafe in a process with threads (tqdm's monitor
    thread, when a node is restarted), where the child can deadlock before its exec. The signal
    follows the *thread* that forked: the pid is passed only from the main thread (which lives as
    long as the launcher)."""
    env = {k: v for k, v in env.items() if k != LAUNCHER_PID_ENV}
    if threading.current_thread() is threading.main_thread():
        env[LAUNCHER_PID_ENV] = str(os.getpid())
    return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def die_with_launcher() -> None:
    """First thing in a node (``distflow-node``, before torch is imported): when `distflow run` started
    it (``LAUNCHER_PID_ENV``), have the kernel send it SIGTERM when the launcher dies (Linux
    ``PR_SET_PDEATHSIG``), so that a launcher killed by SIGKILL or the OOM killer leaves no node
    training detached; and exit at once if the launcher died before that (the node's parent is no
    longer the launcher: no signal would come). The variable is removed from the environment: the
    node's own children are not nodes of the launcher. Elsewhere than Linux, nothing."""
    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM)) != 0:
            return
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != launcher.strip():
        print(f"distflow-node: its launcher (pid {launcher}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)  # as if the signal had come


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
            self.proc = spawn(self.cmd, f, self.env)


def check_bind_host(host: str) -> None:
    """A ConfigError naming ``bind_host`` when this machine cannot bind ``host`` (not one of its
    addresses, a name that does not resolve): the search for free ports retried it for ever."""
    with socket.socket() as s:
        try:
            s.bind((host, 0))
        except OSError as e:  # socket.gaierror included
            raise ConfigError(f"bind_host: cannot bind {host!r} on this machine ({e})") from None


def _free_ports(host: str, n: int) -> list[int]:
    """n bindable ports BELOW the kernel's ephemeral range, so that no outgoing connection
    (which takes an ephemeral port) can grab one before its node binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    ports: list[int] = []
    for _ in range(100_000):  # bounded: a range with no free port is an error, not a hang
        if len(ports) == n:
            return ports
        port = rng.randrange(max(1024, low - 12000), low)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        ports.append(port)
    raise ConfigError(f"bind_host: found {len(ports)} of the {n} free ports the nodes need on {host!r} below the "
                      f"ephemeral range ({low})")


def _node_command() -> list[str]:
    exe = shutil.which("distflow-node")
    return [exe] if exe else [sys.executable, "-c", "import sys; from distflow.launch.cli import node_main; sys.exit(node_main())"]


def _make_dir(path: Path, key: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        file = next((str(q) for q in (path, *path.parents) if q.is_file()), None)
        raise ConfigError(f"{key}: cannot create {str(path)!r}: " + (f"{file!r} is a file" if file else
                                                                     str(e.strerror or e))) from None


def build_toy_models(cfg: Config) -> None:
    """``toy_model: true``: the toy policy at model_path and the toy reward models the workflow names."""
    from distflow.toy import ensure_toy_model

    todo = [(cfg.model_path, cfg.toy_kind, "model_path")] if not (Path(cfg.model_path) / "config.json").is_file() else []
    if cfg.toy_kind == "successor":  # the toy reward models the workflow names (same tokenizer as the toy policy)
        todo += [(n.args["path"], "reward", f"workflow node {n.id!r}: args.path") for n in cfg.workflow
                 if (n.role.value, n.type.value) == ("REWARD", "MODEL_INFERENCE") and isinstance(n.args.get("path"), str)
                 and n.args["path"] and not (Path(n.args["path"]) / "config.json").is_file()]
    for path, kind, key in todo:
        _make_dir(Path(path), key)
        print(f"distflow: building the {'toy reward' if kind == 'reward' else f'{kind} toy'} model at {path}",
              file=sys.stderr)
        ensure_toy_model(path, kind=kind)


def prepare(cfg: Config) -> Path:
    """Check what can be checked before any node starts (workflow functions, bind_host, output_dir,
    the inputs: :func:`check_inputs`; a ConfigError naming the key, exit 2), build the toy model if
    asked, create output_dir and write the resolved config the children read."""
    check_functions(cfg)
    if cfg.bind_host in ("0.0.0.0", "::", "") and not cfg.advertise_host:
        raise ConfigError(f"bind_host: {cfg.bind_host or '(empty)'} binds every interface, but the nodes need an "
                          f"address to reach each other: set advertise_host too (or bind_host: 127.0.0.1)")
    check_bind_host(cfg.bind_host)
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir: {str(out)!r} is a file, not a directory")
    if cfg.toy_model:
        build_toy_models(cfg)
    if not Path(cfg.dataset).is_file():
        raise ConfigError(f"dataset: {cfg.dataset!r} " + ("is a directory, not a prompt file (.jsonl, .parquet)"
                                                          if Path(cfg.dataset).is_dir() else "not found"))
    for note in check_inputs(cfg):
        print(f"distflow: {note}", file=sys.stderr)
    _make_dir(out / "logs", "output_dir")
    resolved = out / "config.yaml"
    resolved.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return resolved


def gpus_present() -> tuple[int, list[str] | None]:
    """How many GPUs this launcher sees, and its own CUDA_VISIBLE_DEVICES entries (None = unset)."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = None if raw is None else [v.strip() for v in raw.split(",") if v.strip()]
    import torch

    return torch.cuda.device_count(), visible


def plan_placement(cfg: Config, present: int | None = None, visible: list[str] | None = None):
    """Each node's GPU environment (distflow.launch.placement.place for this config); exits naming
    the key when the placement is impossible. ``present`` None: ask torch (cuda only)."""
    from distflow.launch.placement import PlacementError, place

    if cfg.device == "cuda" and present is None:
        present, visible = gpus_present()
    try:
        return place(node_roles(cfg), device=cfg.device, gpus=cfg.gpus, colocate=cfg.colocate, present=present,
                     visible=visible)
    except PlacementError as e:
        raise ConfigError(str(e)) from None


def start_children(cfg: Config, config_path: Path, secret: str, placement=None) -> list[Child]:
    nodes = cluster_nodes(cfg)
    slots = {s.node_id: s for s in (placement if placement is not None else plan_placement(cfg))}
    ports = _free_ports(cfg.bind_host, 2 * len(nodes))
    seeds = f"{cfg.bind_host}:{ports[0]}"  # everyone joins through the first node; gossip does the rest
    env = dict(os.environ, **{SECRET_ENV: secret, "PYTHONUNBUFFERED": "1",
                              "OMP_NUM_THREADS": str(cfg.torch_threads)})
    env.setdefault(T0_ENV, repr(process_start_time()))
    children = []
    for k, node in enumerate(nodes):
        node_id, role = node.node_id, node.kind
        log_path = Path(cfg.output_dir) / "logs" / f"{node_id}.log"
        cmd = _node_command() + [
            "--role", role, "--config", str(config_path), "--node-id", node_id, "--host", cfg.bind_host,
            "--port", str(ports[2 * k]), "--data-port", str(ports[2 * k + 1]),
            "--seeds", "" if k == 0 else seeds,
        ] + (["--group", node.group] if node.group else [])
        child_env = {**env, **slots[node_id].env}
        try:
            with log_path.open("w") as f:
                proc = spawn(cmd, f, child_env)
        except BaseException:  # a signal, EMFILE, ...: the nodes already started do not stay behind
            stop_children(children, grace_s=5.0)
            raise
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
    """The node's own one-line account of its failure: its last ERROR record, else the last
    non-empty line of its log (a node that failed before its logging was set up: a usage error,
    a config refused by ``distflow-node``)."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    errors = [ln for ln in lines if " ERROR " in ln]
    if errors:
        return errors[-1].split(": ", 1)[-1]
    return lines[-1].strip() if lines else "(its log is empty)"


class Progress:
    """A progress bar fed by metrics.jsonl (or plain lines when not a terminal)."""

    def __init__(self, metrics_path: Path, enabled: bool, skip_existing: bool = False):
        from tqdm import tqdm

        from distflow.trainer.metrics import read_metrics

        # skip_existing: a resumed run's rows before its checkpoint are not shown again
        self.path, self.seen = metrics_path, len(read_metrics(metrics_path)) if skip_existing else 0
        self.bar = tqdm(total=None, unit="step", desc="training", disable=not enabled, dynamic_ncols=True)
        self.plain = not enabled
        self.last: dict | None = None
        self.bad_rows = 0  # rows skipped (bad_rows: skip) over the run
        self.empty_steps = 0  # steps that trained on 0 samples while rows were skipped
        self.eval_path = metrics_path.with_name("eval.jsonl")  # held-out evaluation rows
        self.evals_seen = len(read_metrics(self.eval_path)) if skip_existing else 0

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
            bad = int(r.get("bad_rows") or 0)
            self.bad_rows += bad
            self.bar.set_postfix(reward=f"{r['reward_mean']:.3f}", **gen, samples_s=f"{r['samples_per_s']:.0f}",
                                 stale=f"{r['staleness_mean']:.2f}", **({"bad_rows": bad} if bad else {}),
                                 **({"time": stages} if stages else {}), refresh=False)
            if self.plain:
                generated = "".join(f"{k}={v} " for k, v in gen.items())
                print(f"step {r['step'] + 1}/{r.get('total_steps', '?')} reward={r['reward_mean']:.3f} {generated}"
                      f"loss={r.get('loss', 0):.4f} samples/s={r['samples_per_s']:.0f} "
                      f"staleness={r['staleness_mean']:.2f}" + (f" bad_rows={bad}" if bad else "")
                      + (f" [{stages}]" if stages else ""), flush=True)
            if bad and not r.get("samples"):
                self.empty_steps += 1
                self.bar.write(f"distflow: WARNING: step {r['step'] + 1} trained on 0 samples: its {bad} bad rows "
                               f"were skipped (bad_rows: skip; the rollout logs name them)", file=sys.stderr)
        self.seen = len(rows)
        evals = read_metrics(self.eval_path) if self.eval_path.is_file() else []
        for e in evals[self.evals_seen:]:
            mean, failed = e.get("eval_reward_mean"), e.get("eval_failed_shards")
            self.bar.write(f"eval at step {e.get('step')}: reward {'-' if mean is None else f'{mean:.3f}'} over "
                           f"{e.get('eval_samples')} held-out samples"
                           + (f" ({failed} eval shard(s) failed: the rollout logs name the error)" if failed else "")
                           + ("" if e.get("eval_shards") == e.get("eval_num_shards")
                              else f" (partial: {e.get('eval_shards')} of {e.get('eval_num_shards')} shards)"))
        self.evals_seen = len(evals)

    def summary(self) -> str:
        """The bad rows of the run, for the done message ("" when none)."""
        if not self.bad_rows:
            return ""
        empty = (f"; WARNING: {self.empty_steps} step(s) trained on 0 samples (every row bad)"
                 if self.empty_steps else "")
        return f"; {self.bad_rows} bad rows skipped (bad_rows: skip){empty}"

    def close(self) -> None:
        try:
            self.bar.close()
        except (OSError, ValueError):  # the terminal is gone (SIGHUP)
            pass


def _say(text: str) -> None:
    """A line on stderr; a terminal that is gone (SIGHUP) is no reason not to stop the nodes."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def launch(cfg: Config, in_process: bool = False, progress: bool = True) -> int:
    """Run ``cfg`` on a local cluster; the exit status: 0 done, 1 a node failed, 2 a node's
    configuration or data error, 128 + the signal when stopped by Ctrl-C, SIGTERM or SIGHUP.
    Raises ConfigError (exit 2) for what it refuses before any node starts."""
    config_path = prepare(cfg)
    if in_process:
        from distflow.launch.inprocess import run_in_process

        return run_in_process(cfg)
    placement = plan_placement(cfg)  # refuses an impossible placement before anything starts
    secret = os.environ.get(SECRET_ENV) or new_secret()
    metrics = Path(cfg.output_dir) / "metrics.jsonl"
    from distflow.launch.placement import describe
    from distflow.trainer.metrics import MetricsWriter, read_metrics

    if not cfg.resume_from:
        metrics.unlink(missing_ok=True)
        metrics.with_name("eval.jsonl").unlink(missing_ok=True)  # never a previous run's evaluation
    else:  # the rows before the checkpoint's step stay, as trainer rank 0 keeps them (later ones are trained again)
        step = checkpoint_version(Path(cfg.resume_from))  # the resume_step the trainer uses (its version)
        for name in ("metrics.jsonl", "eval.jsonl"):
            MetricsWriter(metrics.parent, resume_step=step, name=name)
    print(f"distflow: {describe(placement)}", file=sys.stderr)
    bar = Progress(metrics, enabled=progress and sys.stderr.isatty(), skip_existing=True)
    rows_at_start = bar.seen  # a resumed run's earlier steps
    children: list[Child] = []
    previous = catch_stop_signals()
    try:
        children = start_children(cfg, config_path, secret, placement)
        seed = f"{cfg.bind_host}:{children[0].port}"
        hint = ("" if os.environ.get(SECRET_ENV) else
                f" (export {SECRET_ENV} before `distflow run` to be able to do that: this run's secret is random)")
        extra = "".join(f" + {n} {g}" for g, n in cfg.worker_groups.items())
        print(f"distflow: {cfg.rollout_nodes} rollout{extra} + {cfg.trainer_nodes} trainer nodes, logs in "
              f"{Path(cfg.output_dir) / 'logs'}; watch with `distflow status --seeds {seed}`{hint}", file=sys.stderr)
        code = supervise(cfg, children, bar)
        bar.poll()
    except KeyboardInterrupt as why:  # Ctrl-C, or SIGTERM / SIGHUP (Interrupted)
        bar.close()
        stepped = len(read_metrics(metrics)) > rows_at_start  # a step of this run completed: save it
        return stop_on_interrupt(cfg, children, why, checkpoint=stepped)
    except BaseException:  # the launcher itself failed: never leave the nodes running detached
        print("distflow: the launcher failed; stopping every node", file=sys.stderr)
        stop_children(children, grace_s=5.0)
        raise
    finally:
        bar.close()
        restore_signals(previous)
    if code:
        return code
    last = bar.last or {}
    gen = f" (generated {last['generated_reward_mean']:.3f})" if "generated_reward_mean" in last else ""
    print(f"distflow: done. {last.get('step', -1) + 1} steps, final reward {last.get('reward_mean', float('nan')):.3f}"
          f"{gen}{eval_summary(Path(cfg.output_dir) / 'eval.jsonl')}{bar.summary()}; metrics {metrics}, "
          f"checkpoint {Path(cfg.output_dir) / 'checkpoint'}", file=sys.stderr)
    return 0


def eval_summary(path: Path) -> str:
    """", held-out eval 0.12 -> 0.87 (steps 0-100)" from eval.jsonl, or "" without an evaluation."""
    from distflow.trainer.metrics import eval_curve

    curve, incomplete = eval_curve(path)
    left_out = f"; {incomplete} partial or failed row(s) left out" if incomplete else ""
    if not curve:
        return f", held-out eval: no complete evaluation ({path}{left_out})" if incomplete else ""
    (s0, r0), (s1, r1) = curve[0], curve[-1]
    return f", held-out eval {r0:.3f} -> {r1:.3f} (steps {s0}-{s1}, {path}{left_out})"


def stop_on_interrupt(cfg: Config, children: list[Child], why: KeyboardInterrupt, checkpoint: bool) -> int:
    """Stop the run on Ctrl-C (or SIGTERM/SIGHUP: :class:`Interrupted`); returns 128 + the signal.
    ``checkpoint``: a step has completed, so the trainers save it (:func:`stop_for_checkpoint`);
    else there is nothing to save, and trainers still forming their group would wait for the
    rollout nodes up to join_timeout_s: every node stops at once. A second signal stops every
    node at once."""
    name, code = stop_name(signum_of(why)), 128 + signum_of(why)
    try:
        if checkpoint:
            # A big model's save takes minutes: the trainers get as long as any of their collectives may take.
            _say(f"\ndistflow: interrupted ({name}); stopping the rollout nodes, the trainers save a checkpoint (up to "
                 f"{cfg.step_timeout_s:.0f}s, step_timeout_s; {name} again to stop at once)")
            stop_for_checkpoint(children, grace_s=cfg.step_timeout_s)
        else:
            _say(f"\ndistflow: interrupted ({name}) before the first step completed (nothing to save); stopping "
                 f"every node now")
            stop_children(children)
    except KeyboardInterrupt:  # a second Ctrl-C: do not wait for the checkpoint
        _say("distflow: interrupted again; stopping every node now")
        stop_children(children, grace_s=5.0)
    _say(f"distflow: stopped. {resume_hint(cfg.output_dir, cfg.resume_from)}")
    return code


def _report(failed: list[Child], cfg: Config, why: str) -> None:
    lines = [f"distflow: {c.node_id} failed (exit {c.proc.returncode}): {_error_line(c.log_path)}" for c in failed]
    first = failed[0]
    hint = resume_hint(cfg.output_dir, cfg.resume_from)
    print("\n".join(lines) + f"\ndistflow: {why}; stopping the other nodes. {hint}\n"
          f"--- last lines of {first.log_path} ---\n{_tail(first.log_path)}", file=sys.stderr)


def supervise(cfg: Config, children: list[Child], bar: Progress | None = None, poll_s: float = 0.2) -> int:
    """Watch the children until the run ends; restart dead rollout nodes (not one that exited
    ``CONFIG_EXIT``: that stops the run, exit 2). Returns the exit code."""
    trainers = [c for c in children if c.role == "trainer"]
    handled: set[int] = set()  # pids of dead rollout processes already dealt with
    while True:
        if bar is not None:
            bar.poll()
        codes = {c.node_id: c.proc.poll() for c in children}
        if all(codes[t.node_id] == 0 for t in trainers):
            break  # the trainers finished: the run is done
        misconfigured = [c for c in children if codes[c.node_id] == CONFIG_EXIT]
        if misconfigured:  # deterministic: a restart would fail the same way, and so would the adopters of its work
            _report(misconfigured, cfg, f"{misconfigured[0].node_id} exited {CONFIG_EXIT} on a configuration or data "
                                        f"error, which a restart would not fix: not restarted, the run stops")
            stop_children(children)
            return CONFIG_EXIT
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
