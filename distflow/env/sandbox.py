"""A sandboxed Python interpreter tool: the model's code runs in a limited, offline subprocess.

Why it exists: "write code, run it, read the output" is the most common agentic tool, and the
code is a policy's, not a person's: it loops forever, allocates without bound, crashes, or
tries the network. None of that may stall or kill the rollout node. Each run is a fresh
``python3 -I`` subprocess (isolated mode: no user site, no PYTHON* variables, no cwd on the
path) in a new session, with:

* ``RLIMIT_CPU`` (CPU seconds; the kernel sends SIGXCPU then SIGKILL), ``RLIMIT_AS`` (address
  space, so an allocation past it is a MemoryError), ``RLIMIT_FSIZE``, no core files: set by
  the child itself before it runs the code;
* a wall-clock deadline (a process sleeping or blocked uses no CPU): the whole process group
  is killed at ``wall_s``;
* no power over the node: started as root, it drops to an unprivileged user (``nobody``) before
  the code runs (when the interpreter works as that user: a Python installed under ``/root``
  does not), so it cannot signal the node's processes or write their files; and an audit hook
  refuses ``os.kill`` / ``os.killpg`` of any process but its own (in the namespace mode, a
  process the code starts is not hooked: there the user switch is what protects the node);
* no network: in a fresh network namespace (``unshare -n``: only a loopback that is down)
  when that works here (as root); otherwise an audit hook in the
  child refuses every socket operation and process creation (``isolation="audit"``). The audit
  hook stops a model's ordinary code (``socket``, ``urllib``, ``subprocess``, ``ctypes``) but
  is no security boundary against an adversary; the namespace is.

Whatever happens (exit code, crash, kill, timeout, output cut) comes back as a
:class:`SandboxResult` and, through the :func:`python` tool, as text for the model: an
observation, never an exception of the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Literal

__all__ = ["SandboxResult", "run_python", "python", "make_python_tool", "netns_available", "runs_as"]

# The child's bootstrap: limits first, then the code read from stdin, then (as root) the switch to
# an unprivileged user, then the audit hook (signals out; with audit isolation also the network
# and new processes), then the code runs.
# Its argv: cpu_s, memory bytes, fsize bytes, isolation, uid to run as (-1: stay).
_BOOT = r"""
import os, resource, sys
cpu, mem, fsize, isolation, uid = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                   int(sys.argv[5]))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
code = sys.stdin.read()
sys.stdin.close()
if uid >= 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
_DENY = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
         "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata") if isolation == "audit" else ()
def _hook(event, args, _deny=_DENY, _me=os.getpid()):
    if event.startswith(_deny) or (event in ("os.kill", "os.killpg") and args[0] not in (_me, 0)):
        raise PermissionError(f"sandbox: {event} is not allowed (no network, no processes, no signals out)")
sys.addaudithook(_hook)
del os, resource, cpu, mem, fsize, isolation, uid
exec(compile(code, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


_NOBODY = 65534  # the conventional uid of "nobody"


@dataclass
class SandboxResult:
    """What one run did. ``exit_code``: the process's (negative: killed by that signal; None:
    killed at the wall deadline). ``limit``: which limit ended it (``wall``, ``cpu``, or None)."""

    stdout: str
    stderr: str
    exit_code: int | None
    limit: str | None = None
    truncated: bool = False
    isolation: str = ""
    uid: int = -1  # the user the code ran as (-1: the node's)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def observation(self, wall_s: float | None = None, cpu_s: float | None = None) -> str:
        """The result as text for the model."""
        parts = []
        if self.stdout:
            parts.append(self.stdout.rstrip("\n"))
        if self.stderr:
            parts.append("[stderr]\n" + self.stderr.rstrip("\n"))
        if self.limit == "wall":
            parts.append(f"[killed: wall-clock limit of {wall_s:g} s]" if wall_s else "[killed: wall-clock limit]")
        elif self.limit == "cpu":
            parts.append(f"[killed: CPU time limit of {cpu_s:g} s]" if cpu_s else "[killed: CPU time limit]")
        elif self.exit_code and self.exit_code < 0:
            parts.append(f"[killed by signal {signal.Signals(-self.exit_code).name}]")
        elif self.exit_code:
            parts.append(f"[exit code {self.exit_code}]")
        if self.truncated:
            parts.append("[output cut]")
        return "\n".join(parts) if parts else "[no output]"


@functools.lru_cache(maxsize=1)
def netns_available() -> bool:
    """Whether ``unshare -n`` can make a network namespace here (as root; checked once per process)."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.lru_cache(maxsize=8)
def runs_as(executable: str, uid: int) -> bool:
    """Whether Python ``executable`` works as user ``uid`` (its standard library readable by it);
    checked once per pair. Needs root."""
    try:
        return subprocess.run([executable, "-I", "-c", "import json, socket, encodings"], user=uid, group=uid,
                              extra_groups=[], capture_output=True, timeout=30, cwd="/").returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


async def _read_capped(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, bool]:
    """Read ``stream`` to its end, keeping the first ``limit`` bytes (the rest is read and dropped,
    so a child printing without end neither blocks on a full pipe nor fills our memory)."""
    kept, cut = bytearray(), False
    while chunk := await stream.read(65536):
        room = limit - len(kept)
        if len(chunk) > room:
            cut = True
        kept += chunk[:max(room, 0)]
    return bytes(kept), cut


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def run_python(code: str, *, cpu_s: int = 5, memory_mb: int = 512, wall_s: float = 10.0,
                     max_output_bytes: int = 16384, isolation: Literal["auto", "netns", "audit"] = "auto",
                     cwd: str | None = None, uid: int | None = None, executable: str | None = None) -> SandboxResult:
    """Run ``code`` in a sandboxed subprocess (see the module doc) and return what happened.
    ``isolation``: ``netns`` (a network namespace; ValueError when unavailable), ``audit`` (the
    in-process hook), ``auto`` (netns when available). Cancelling the call kills the child.
    ``cwd``: the working directory (default: a fresh temporary one, removed afterwards). ``uid``: the
    user the code runs as (default: ``nobody`` when this process is root and ``executable`` works as
    nobody, else this user; -1: this user). ``executable``: the Python to run (default: this one)."""
    has_netns = await asyncio.to_thread(netns_available)  # probes run once, off the loop
    if isolation == "auto":
        isolation = "netns" if has_netns else "audit"
    if isolation == "netns" and not has_netns:
        raise ValueError("isolation='netns' needs `unshare -n` to work here (as root)")
    if isolation not in ("netns", "audit"):
        raise ValueError(f"isolation must be 'auto', 'netns' or 'audit', got {isolation!r}")
    executable = executable or sys.executable
    if uid is None:
        uid = _NOBODY if os.geteuid() == 0 and await asyncio.to_thread(runs_as, executable, _NOBODY) else -1
    argv = [executable, "-I", "-c", _BOOT, str(int(cpu_s)), str(int(memory_mb) << 20), str(64 << 20), isolation,
            str(uid)]
    if isolation == "netns":
        argv = [shutil.which("unshare") or "unshare", "-n", *argv]
    tmp = None if cwd is not None else tempfile.mkdtemp(prefix="distflow-sandbox-")
    if tmp is not None and uid >= 0:
        os.chown(tmp, uid, -1)  # the code may write its scratch files there
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": cwd or tmp, "LANG": "C.UTF-8",
           "PYTHONIOENCODING": "utf-8"}
    proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, cwd=cwd or tmp, env=env,
                                                start_new_session=True)
    limit = None
    try:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        try:
            proc.stdin.write(code.encode("utf-8", "replace"))
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):  # the child died before reading its code
            pass
        reads = asyncio.gather(_read_capped(proc.stdout, max_output_bytes), _read_capped(proc.stderr, max_output_bytes),
                               proc.wait())
        try:
            (out, cut_out), (err, cut_err), rc = await asyncio.wait_for(asyncio.shield(reads), wall_s)
        except asyncio.TimeoutError:
            limit = "wall"
            _kill_group(proc)
            (out, cut_out), (err, cut_err), rc = await reads
    except BaseException:  # cancelled (a tool deadline) or failed: never leave the child running
        _kill_group(proc)
        with contextlib.suppress(BaseException):  # reap it, so its transport closes on this loop
            await asyncio.wait_for(proc.wait(), 5)
        raise
    finally:
        _kill_group(proc)  # a grandchild the code left behind in its session goes too
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if limit is None and rc == -signal.SIGXCPU:
        limit = "cpu"  # RLIMIT_CPU: SIGXCPU at the soft limit (SIGKILL at the hard one, a second later)
    return SandboxResult(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                         None if limit == "wall" else rc, limit, cut_out or cut_err, isolation, uid)


def make_python_tool(*, cpu_s: int = 5, memory_mb: int = 512, wall_s: float = 10.0, max_output_bytes: int = 16384,
                     isolation: Literal["auto", "netns", "audit"] = "auto", executable: str | None = None):
    """A ``python(code)`` tool with these limits (for :class:`distflow.env.tools.ToolEnvironment`)."""

    async def python(code: str) -> str:
        """Run a Python program in a sandbox (no network, limited CPU time and memory) and return
        what it printed. Print the results you need; the value of the last expression is not shown.

        Args:
            code: the complete Python program to run.
        """
        result = await run_python(code, cpu_s=cpu_s, memory_mb=memory_mb, wall_s=wall_s,
                                  max_output_bytes=max_output_bytes, isolation=isolation, executable=executable)
        return result.observation(wall_s, cpu_s)

    return python


python = make_python_tool()  # the default tool: `tools: [distflow.env.sandbox:python]`
