"""Start node processes by forking one that has already imported torch and transformers.

Why it exists: a node spends its first ~2.5 CPU-seconds importing torch, transformers and
DistFlow before it does anything (`python bench/startup.py` compares forked and exec'd nodes).
``distflow run`` starts every node of a host at once, so a host of N nodes paid N times for the
same imports, all competing for the CPU at the moment the run starts; a test suite of cluster
runs paid it for every node of every run. The zygote pays once: ``distflow run`` starts it, it imports those
modules and then forks one child per node (the technique of Android's zygote and of
multiprocessing's forkserver with ``preload``). A forked node then runs ``node_main`` on its
own command line, environment and log file, exactly as a ``distflow-node`` process would.

Safety of fork: the zygote is single-threaded, never touches a device and runs no torch op
(an OpenMP or CUDA runtime initialised before a fork is broken in the child), which it
checks after its imports; if any check fails, or anything about the zygote fails, the
launcher starts nodes the plain way (exec) and says so once. The zygote's children are its
own: it reports each one's pid at the fork and its exit status when it ends, over its stdout
(one JSON line each); :class:`ForkedNode` gives the launcher the ``Popen`` methods it uses.
A node learns its parent is the zygote (``LAUNCHER_PID_ENV``) and dies with it (Linux's
parent-death signal); the zygote dies with the launcher the same way.

Protocol (JSON lines; the zygote side is :mod:`distflow.launch.zygote_main`): launcher -> zygote ``{"args", "env", "log", "cwd"}``; zygote ->
launcher ``{"ready": pid}`` once, or ``{"unfit": why}`` and exit; then ``{"pid"}`` or
``{"error"}`` per request, and ``{"exit": pid, "code"}`` whenever a child ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

READY_TIMEOUT_S = 120.0
SHARED_ENV = "DISTFLOW_ZYGOTE"  # the socket of a zygote shared by every run that sees it (zygote_main --socket)


class ForkedNode:
    """What the launcher uses of a node's ``subprocess.Popen``, for a node the zygote forked."""

    def __init__(self, pid: int, zygote: "Zygote"):
        self.pid, self.zygote, self.returncode = pid, zygote, None
        self.args = ["distflow-node (forked)"]

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.zygote.wait_exit(self.pid, timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's side: start the zygote, ask it for nodes, learn when they end."""

    def __init__(self, env: dict[str, str]):
        from distflow.core.launch_env import LAUNCHER_PID_ENV

        self.proc, self.sock, self.gone = None, None, False
        shared = env.get(SHARED_ENV)
        if shared:  # a zygote already running (a sweep, the test suite): this run is one of its clients
            import socket

            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(shared)
            self.stdin, self.stdout = self.sock.makefile("wb"), self.sock.makefile("rb")
        else:
            env = {**env, LAUNCHER_PID_ENV: str(os.getpid())}
            self.proc = subprocess.Popen([sys.executable, "-c", "import sys; from distflow.launch.zygote_main "
                                          "import main; sys.exit(main())"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env=env, start_new_session=True)
            self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.cond = threading.Condition()
        self.exits: dict[int, int] = {}
        self.replies: list[dict] = []
        self.ready: int | None = None
        self.unfit: str | None = None
        self.lock = threading.Lock()  # one request at a time: replies come back in order
        self.reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self.reader.start()
        with self.cond:
            self.cond.wait_for(lambda: self.ready is not None or self.unfit is not None, READY_TIMEOUT_S)
        if self.ready is None:
            self.close()
            raise RuntimeError(self.unfit or f"the zygote did not report ready in {READY_TIMEOUT_S:.0f} s")

    def _read(self) -> None:
        for raw in self.stdout:
            msg: dict[str, Any] = json.loads(raw)
            with self.cond:
                if "exit" in msg:
                    self.exits[msg["exit"]] = msg["code"]
                elif "ready" in msg:
                    self.ready = msg["ready"]
                elif "unfit" in msg:
                    self.unfit = msg["unfit"]
                else:
                    self.replies.append(msg)
                self.cond.notify_all()
        with self.cond:  # the zygote is gone: so are its nodes (their parent-death signal)
            self.gone = True
            self.unfit = self.unfit or "the zygote exited"
            self.cond.notify_all()

    def alive(self) -> bool:
        return not self.gone and (self.proc is None or self.proc.poll() is None)

    def spawn(self, args: list[str], log_path: str, env: dict[str, str]) -> ForkedNode:
        """A node running ``distflow-node ARGS`` with ``env``, its output appended to ``log_path``."""
        with self.lock:
            with self.cond:
                self.replies.clear()
            line = json.dumps({"args": args, "env": env, "log": log_path, "cwd": os.getcwd()}) + "\n"
            self.stdin.write(line.encode())
            self.stdin.flush()
            with self.cond:
                if not self.cond.wait_for(lambda: self.replies or not self.alive(), 30.0) or not self.replies:
                    raise RuntimeError("the zygote did not answer a start request in 30 s")
                reply = self.replies.pop(0)
        if "error" in reply:
            raise OSError(reply["error"])
        return ForkedNode(reply["pid"], self)

    def exit_code(self, pid: int) -> int | None:
        with self.cond:
            if pid in self.exits:
                return self.exits[pid]
            if self.unfit and not self.alive():
                return -signal.SIGTERM  # its parent-death signal ended it with the zygote
        return None

    def wait_exit(self, pid: int, timeout: float | None) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: pid in self.exits or (self.unfit and not self.alive()), timeout)

    def close(self) -> None:
        """End the zygote (its nodes must be stopped first: they die with it)."""
        try:
            self.stdin.close()
        except OSError:
            pass
        if self.sock is not None:  # the shared zygote stays; our end closes (it stops what we left running)
            import socket

            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # an end now, whatever still holds a file of it
            except OSError:
                pass
            self.sock.close()
            return
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
