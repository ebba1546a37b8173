"""The node processes of ``distflow run``: start, restart and stop them, and read their logs.

Why it exists: :mod:`distflow.launch.launcher` decides *when* a node starts, restarts or
stops (supervision, Ctrl-C); this module is *how*, with the process-level care that
needs: each node in its own session (a Ctrl-C in the terminal reaches only the launcher,
which stops the nodes in order), ports below the ephemeral range, and on Linux a node that
dies with its launcher (``PR_SET_PDEATHSIG``, asked for by the node itself first thing:
:func:`die_with_launcher`, never a ``preexec_fn`` in the launcher). A stop is bounded:
SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distflow.core.auth import SECRET_ENV
from distflow.core.config import Config, ConfigError
from distflow.core.launch_env import LAUNCHER_PID_ENV, RECOVER_ENV, T0_ENV, process_start_time
from distflow.launch.roles import cluster_nodes, trainers_recoverable
from distflow.launch.zygote import Zygote

STOP_GRACE_S = 15.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def spawn(cmd: list[str], log_file, env: dict[str, str], zygote: Zygote | None = None) -> Any:
    """Start a node: its own session (a Ctrl-C in the terminal reaches only the launcher, which
    stops the nodes in order), output to ``log_file``; the node has the kernel send it SIGTERM
    when the launcher dies (:func:`die_with_launcher`, told the launcher's pid in ``LAUNCHER_PID_ENV``).
    No ``preexec_fn``: Python documents it as unsafe in a process with threads (tqdm's monitor
    thread, when a node is restarted), where the child can deadlock before its exec. The signal
    follows the *thread* that forked: the pid is passed only from the main thread (which lives as
    long as the launcher). With a live ``zygote``, the node is forked from it instead (the same
    command line, environment and log; :mod:`distflow.launch.zygote`)."""
    env = {k: v for k, v in env.items() if k != LAUNCHER_PID_ENV}
    prefix = node_command()
    if zygote is not None and zygote.alive() and cmd[:len(prefix)] == prefix:
        try:
            return zygote.spawn(cmd[len(prefix):], log_file.name, env)
        except (OSError, RuntimeError) as e:
            print(f"distflow: forking a node failed ({e}); starting it as its own program", file=sys.stderr)
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
    """One node process of the run, and how to start it again (same command, same environment)."""

    node_id: str
    role: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    zygote: Zygote | None = None  # what forks this node (and its restarts); None: exec

    def respawn(self) -> None:
        """Start the node again: same id, same ports, same environment; its log is appended to."""
        self.restarts += 1
        self.start_again(f"restart {self.restarts} of {self.node_id}")

    def start_again(self, banner: str, overrides: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        """Start the node again under a ``banner`` line in its log (appended to), with config
        ``overrides`` (``key=value``, e.g. a trainer recovered from a checkpoint's ``resume_from``)
        after the command's own arguments; same id, same ports, same environment (plus ``env`` for
        this start only: a replica group restarted alone, ``launch_env.HEAL_ENV``)."""
        with self.log_path.open("a") as f:
            f.write(f"\n----- distflow run: {banner} -----\n")
            f.flush()
            self.proc = spawn(self.cmd + list(overrides), f, {**self.env, **(env or {})}, self.zygote)


def free_ports(host: str, n: int) -> list[int]:
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


def node_command() -> list[str]:
    """``distflow-node`` (the installed script), else the same through this interpreter."""
    exe = shutil.which("distflow-node")
    return [exe] if exe else [sys.executable, "-c",
                              "import sys; from distflow.launch.cli import node_main; sys.exit(node_main())"]


def start_children(cfg: Config, config_path: Path, secret: str, placement: list) -> list[Child]:
    """Start every node of the run (:func:`distflow.launch.roles.cluster_nodes`, the first the seed the
    others join through) with its ``placement`` slot's environment, its log under ``output_dir/logs``."""
    nodes = cluster_nodes(cfg)
    slots = {s.node_id: s for s in placement}
    ports = free_ports(cfg.bind_host, 2 * len(nodes))
    seeds = f"{cfg.bind_host}:{ports[0]}"  # everyone joins through the first node; gossip does the rest
    env = dict(os.environ, **{SECRET_ENV: secret, "PYTHONUNBUFFERED": "1",
                              "OMP_NUM_THREADS": str(cfg.torch_threads)})
    env.setdefault(T0_ENV, repr(process_start_time()))
    if trainers_recoverable(cfg):  # a dead trainer is then a pause for the other nodes (launch.recovery)
        env[RECOVER_ENV] = "1"
    zygote = start_zygote(env) if cfg.fork_nodes else None
    children = []
    for k, node in enumerate(nodes):
        node_id, role = node.node_id, node.kind
        log_path = Path(cfg.output_dir) / "logs" / f"{node_id}.log"
        cmd = node_command() + [
            "--role", role, "--config", str(config_path), "--node-id", node_id, "--host", cfg.bind_host,
            "--port", str(ports[2 * k]), "--data-port", str(ports[2 * k + 1]),
            "--seeds", "" if k == 0 else seeds,
        ] + (["--group", node.group] if node.group else [])
        child_env = {**env, **slots[node_id].env}
        try:
            with log_path.open("w") as f:
                proc = spawn(cmd, f, child_env, zygote)
        except BaseException:  # a signal, EMFILE, ...: the nodes already started do not stay behind
            stop_children(children, grace_s=5.0)
            close_zygote(children)
            raise
        children.append(Child(node_id, role, ports[2 * k], proc, log_path, cmd, child_env, zygote=zygote))
    return children


def start_zygote(env: dict[str, str]) -> Zygote | None:
    """The process the nodes are forked from (:mod:`distflow.launch.zygote`), or None, said once, where
    it cannot be used: nodes are then started as programs, as with ``fork_nodes: false``."""
    if not hasattr(os, "fork"):
        return None
    try:
        return Zygote({k: v for k, v in env.items() if k != SECRET_ENV})
    except (OSError, RuntimeError) as e:
        print(f"distflow: not forking the nodes ({e}); each starts as its own program", file=sys.stderr)
        return None


def close_zygote(children: list[Child]) -> None:
    """End the zygote once its nodes are stopped (they die with it)."""
    for z in {id(c.zygote): c.zygote for c in children if c.zygote is not None}.values():
        z.close()


def wait_all(children: list[Child], timeout: float) -> bool:
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
    wait_all(children, grace_s)
    for c in children:
        if c.proc.poll() is None:
            try:
                os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait(timeout=5)
            except ProcessLookupError:  # it exited meanwhile
                pass
            except subprocess.TimeoutExpired:  # e.g. stuck in the GPU driver: go on with the others
                print(f"distflow: {c.node_id} (pid {c.proc.pid}) did not exit 5 s after SIGKILL", file=sys.stderr)


def kill_children(children: list[Child], wait_s: float = 10.0) -> None:
    """SIGKILL every live child's process group at once and wait (bounded) for them: trainer ranks
    about to be restarted from a checkpoint have nothing to save, and a SIGTERM would let them
    leave the mesh gracefully, which the rollout nodes would take for the end of the run."""
    for c in children:
        if c.proc.poll() is None:
            try:
                os.killpg(c.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if not wait_all(children, wait_s):
        print(f"distflow: {[c.node_id for c in children if c.proc.poll() is None]} did not exit {wait_s:.0f} s "
              f"after SIGKILL", file=sys.stderr)


def stop_for_checkpoint(children: list[Child], grace_s: float) -> None:
    """Stop the producers first (the rollout and controller nodes leave the mesh), so each
    trainer saves a checkpoint at its last completed step and exits by itself; then the rest."""
    producers = [c for c in children if c.role != "trainer"]
    stop_children(producers)
    trainers = [c for c in children if c.role == "trainer"]
    if not wait_all(trainers, grace_s):
        print(f"distflow: the trainers did not stop within {grace_s:.0f}s; stopping them", file=sys.stderr)
    stop_children(trainers)


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING) ")  # a node's non-error log line


def exit_text(returncode: int | None) -> str:
    """How a node process ended, said plainly: "killed by SIGKILL" (a negative status is the signal
    that ended it: the OOM killer, a kill -9), else "exit N"."""
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


def error_line(path: Path) -> str:
    """The node's own one-line account of its failure: its last ERROR record, else the last
    non-empty line of its log when that is not an ordinary log record (a node that failed before
    its logging was set up: a usage error, a config refused by ``distflow-node``, a traceback's
    last line), else "no ERROR line in its log": a node killed from outside (SIGKILL, the OOM
    killer) says nothing, and its last INFO line is no cause."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    errors = [ln for ln in lines if " ERROR " in ln]
    if errors:
        return errors[-1].split(": ", 1)[-1]
    if lines and not LOG_RECORD.match(lines[-1]) and not lines[-1].startswith("-----"):
        return lines[-1].strip()
    return "no ERROR line in its log" if lines else "(its log is empty)"
