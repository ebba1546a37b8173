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

PRELOAD = ("torch", "transformers", "distflow.launch.cli", "distflow.launch.node", "distflow.rollout.worker",
           "distflow.trainer.worker")


def unfit_reason() -> str | None:
    """Why this process must not be forked into nodes (``None``: it may)."""
    if threading.active_count() != 1:
        return f"{threading.active_count()} threads after the imports ({[t.name for t in threading.enumerate()]})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised by an import"
    return None


def main() -> int:
    """The zygote process: preload, report ready, then fork a node per request until stdin ends."""
    from distflow.launch.children import die_with_launcher

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
    return _serve(out)


def _serve(out) -> int:
    import selectors

    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of it
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "in")
    sel.register(rfd, selectors.EVENT_READ, "chld")
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    buf = b""
    while True:
        for key, _ in sel.select():
            if key.data == "chld":
                os.read(rfd, 4096)
                _reap(out)
                continue
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:  # the launcher is done (its nodes are stopped) or gone
                return 0
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                pid = _fork(json.loads(line), out, (rfd, wfd, sys.stdin.fileno()))
                out.write(json.dumps({"pid": pid} if isinstance(pid, int) else {"error": pid}) + "\n")
        _reap(out)


def _reap(out) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        out.write(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")


def _fork(req: dict, out, close_fds: tuple[int, ...]) -> int | str:
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
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
        for fd in close_fds:
            os.close(fd)
        out.close()
        os.setsid()  # its own session, as spawn() gives an exec'd node
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.chdir(req.get("cwd") or os.getcwd())
        os.environ.clear()
        os.environ.update(req["env"])
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


