"""The zygote process itself (see :mod:`distflow.launch.zygote`): preload, then fork a node per request.

Why a module of its own: it imports the node's entry point (``distflow.launch.cli``) to run it in
each forked child, and the launcher side (:mod:`distflow.launch.zygote`), imported by the launcher
itself, must not: the launcher is what ``distflow.launch.cli`` starts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

# What every node imports (measured: the modules of a quickstart run's nodes, less these, is a dozen
# small ones); the lazy ones transformers and torch.distributed load at a node's first model load,
# FSDP wrap, checkpoint and plot cost as much again as the eager ones.
PRELOAD = ("torch", "transformers", "uvloop", "distflow.launch.cli", "distflow.launch.node", "distflow.rollout.worker",
           "distflow.trainer.worker", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.tokenization_utils_fast",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
           "transformers.generation", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.distributed.tensor", "torch.distributed.device_mesh", "torch._dynamo", "safetensors.torch",
           "matplotlib.pyplot")


def unfit_reason() -> str | None:
    """Why this process must not be forked into nodes (``None``: it may)."""
    if threading.active_count() != 1:
        return f"{threading.active_count()} threads after the imports ({[t.name for t in threading.enumerate()]})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised by an import"
    return None


def main(argv: list[str] | None = None) -> int:
    """The zygote process: preload, report ready, then fork a node per request until stdin ends.
    ``--socket PATH``: a zygote shared by every ``distflow run`` that finds PATH in
    ``DISTFLOW_ZYGOTE`` (a sweep, the test suite): each launcher connects, and when its connection
    closes (it is done, or died) its nodes still running are sent SIGTERM, as its own zygote's would be."""
    from distflow.launch.children import die_with_launcher

    argv = sys.argv[1:] if argv is None else argv
    sock_path = argv[argv.index("--socket") + 1] if "--socket" in argv else None
    die_with_launcher()
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() without initialising CUDA
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what an import prints does not corrupt the protocol
    try:
        import importlib

        for name in PRELOAD:
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - reported to the launcher, which starts nodes by exec
        out.write(json.dumps({"unfit": f"preloading failed: {type(e).__name__}: {e}"}) + "\n")
        return 1
    from setproctitle import setproctitle

    setproctitle("distflow-zygote")  # claims the argv/environ area now, before a node's environment replaces ours
    why = unfit_reason()
    if why:
        out.write(json.dumps({"unfit": why}) + "\n")
        return 1
    if sock_path is None:
        return _serve(_Client(sys.stdin.fileno(), out), None)
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)  # only this user may ask it for processes
    try:
        listener.bind(sock_path)
    finally:
        os.umask(old)
    listener.listen(64)
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    return _serve(None, listener)


class _Client:
    """One launcher: where its requests come from, where its replies go, the nodes it asked for."""

    def __init__(self, in_fd: int, out, conn=None):
        self.in_fd, self.out, self.conn, self.buf, self.pids = in_fd, out, conn, b"", set()

    def send(self, msg: dict) -> None:
        if self.out is None:  # closed: its launcher is gone (a node of it that ends now is only reaped)
            return
        try:
            self.out.write(json.dumps(msg) + "\n")
            self.out.flush()
        except OSError:  # it is gone; its nodes are stopped when its end is read
            pass

    def close(self) -> None:
        for f in (self.out, self.conn):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        self.out = self.conn = None


def _serve(first: _Client | None, listener) -> int:
    import selectors

    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of it
    sel = selectors.DefaultSelector()
    sel.register(rfd, selectors.EVENT_READ, "chld")
    clients: list[_Client] = []
    owner: dict[int, _Client] = {}

    def add(c: _Client) -> None:
        clients.append(c)
        sel.register(c.in_fd, selectors.EVENT_READ, c)
        c.send({"ready": os.getpid()})

    def in_child() -> None:  # what a forked node must not keep of the zygote
        signal.set_wakeup_fd(-1)
        for fd in (rfd, wfd):
            os.close(fd)
        for c in clients:
            c.close()
        if listener is not None:
            listener.close()

    if first is not None:
        add(first)
    else:
        sel.register(listener, selectors.EVENT_READ, "listen")
    while True:
        for key, _ in sel.select():
            if key.data == "chld":
                os.read(rfd, 4096)
            elif key.data == "listen":
                conn, _ = listener.accept()
                add(_Client(conn.fileno(), conn.makefile("w", buffering=1), conn))
            else:
                c = key.data
                try:
                    chunk = os.read(c.in_fd, 65536)
                except OSError:  # reset: a launcher killed with replies it had not read (ECONNRESET)
                    chunk = b""
                if not chunk:  # the launcher is done (its nodes are stopped) or gone
                    if first is not None:
                        return 0
                    sel.unregister(c.in_fd)
                    clients.remove(c)
                    for pid in c.pids:  # what its own zygote's death would do to them
                        try:
                            os.killpg(pid, signal.SIGTERM)
                        except (ProcessLookupError, PermissionError):
                            pass
                    c.close()
                    continue
                c.buf += chunk
                while b"\n" in c.buf:
                    line, c.buf = c.buf.split(b"\n", 1)
                    pid = _fork(json.loads(line), in_child)
                    if isinstance(pid, int):
                        owner[pid] = c
                        c.pids.add(pid)
                    c.send({"pid": pid} if isinstance(pid, int) else {"error": pid})
        _reap(owner)


def _reap(owner: dict) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        c = owner.pop(pid, None)
        if c is not None:
            c.pids.discard(pid)
            c.send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(req: dict, in_child) -> int | str:
    try:
        log_fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as e:
        return f"cannot open the log {req['log']}: {e}"
    pid = os.fork()
    if pid:
        os.close(log_fd)
        return pid
    # The node. Nothing of the zygote's loop survives; what follows is a distflow-node process.
    code = 1
    try:
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
        in_child()
        os.setsid()  # its own session, as spawn() gives an exec'd node
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.chdir(req.get("cwd") or os.getcwd())
        os.environ.clear()
        os.environ.update(req["env"])
        for entry in reversed([e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]):
            if entry not in sys.path:  # as the interpreter reads it at start: this run's, not the zygote's
                sys.path.insert(1, entry)
        from distflow.core.launch_env import LAUNCHER_PID_ENV

        os.environ[LAUNCHER_PID_ENV] = str(os.getppid())  # the zygote: the node dies with it
        import random

        random.seed()  # not the zygote's sequence, shared by every sibling
        sys.argv = ["distflow-node", *req["args"]]
        from setproctitle import setproctitle

        setproctitle(" ".join(sys.argv))  # ps, pkill and /proc show the node's own command line
        from distflow.launch.cli import node_main

        code = node_main(req["args"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an exec'd node would: the traceback in its log, exit 1
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    raise SystemExit(code)  # unwinds to the top: atexit handlers and finalisers run, as in any node


