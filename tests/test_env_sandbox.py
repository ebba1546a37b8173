"""The sandboxed Python tool, with real subprocesses: no network (a connection to a server that
is listening on this host fails from inside), memory, CPU-time and wall-clock limits, and a
crash or a kill that is an observation, never an exception."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import threading
import time

import pytest

from distflow.env import run_python
from distflow.env.sandbox import make_python_tool, netns_available, runs_as
from distflow.env.tools import ToolEnvironment

pytestmark = pytest.mark.cluster  # every test runs the sandbox's child Python process

ISOLATIONS = [pytest.param("netns", marks=pytest.mark.skipif(not netns_available(), reason="no `unshare -n` here")),
              "audit"]


@pytest.fixture
def server():
    """A TCP server on this host's loopback that counts the connections it accepts."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    accepted, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except (socket.timeout, OSError):
                continue
            accepted.append(1)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1], accepted
    stop.set()
    t.join(2)
    srv.close()


CONNECT = """
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=3).close()
    print("connected")
except Exception as e:
    print("blocked", type(e).__name__, e)
"""


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_network_is_refused(server, isolation):
    port, accepted = server
    socket.create_connection(("127.0.0.1", port), timeout=3).close()  # control: reachable from here
    deadline = time.monotonic() + 3
    while not accepted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert accepted == [1]
    r = asyncio.run(run_python(CONNECT.format(port=port), isolation=isolation, wall_s=20))
    assert r.ok and r.isolation == isolation
    assert r.stdout.startswith("blocked"), r.stdout + r.stderr
    assert "connected" not in r.stdout and accepted == [1]
    if isolation == "audit":  # the hook also stops the way around it: a process that would connect
        r = asyncio.run(run_python("import subprocess; subprocess.run(['true'])", isolation="audit", wall_s=20))
        assert r.exit_code == 1 and "subprocess.Popen is not allowed" in r.stderr


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_memory_over_the_limit_is_a_memory_error(isolation):
    small = asyncio.run(run_python("x = bytearray(16 << 20); print(len(x))", memory_mb=256, isolation=isolation,
                                   wall_s=20))
    assert small.ok and small.stdout.strip() == str(16 << 20)
    big = asyncio.run(run_python("x = bytearray(600 << 20); print('allocated')", memory_mb=256,
                                 isolation=isolation, wall_s=20))
    assert big.exit_code == 1 and "MemoryError" in big.stderr and "allocated" not in big.stdout
    assert big.observation().endswith("MemoryError\n[exit code 1]")


def test_cpu_time_limit_kills_a_busy_loop():
    t0 = time.monotonic()
    r = asyncio.run(run_python("while True: pass", cpu_s=1, wall_s=40))
    assert r.limit == "cpu" and r.exit_code is not None and r.exit_code < 0, r
    assert time.monotonic() - t0 < 40
    assert r.observation(40, 1) == "[killed: CPU time limit of 1 s]"


def test_wall_clock_limit_kills_a_sleeper_and_its_children():
    t0 = time.monotonic()
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); print('started', flush=True); time.sleep(60)"
    r = asyncio.run(run_python(code, wall_s=1.5, isolation="netns" if netns_available() else "audit"))
    took = time.monotonic() - t0
    assert r.limit == "wall" and r.exit_code is None and took < 10, (r, took)
    if netns_available():
        assert r.stdout == "started\n"  # printed before the kill, kept


def test_crash_and_output_flood_are_observations():
    tool = make_python_tool(wall_s=20, max_output_bytes=1000)
    out = asyncio.run(tool("import os; print('before', flush=True); os.abort()"))
    assert out == "before\n[killed by signal SIGABRT]"
    out = asyncio.run(tool("print('x' * 100000)"))
    assert out.endswith("[output cut]") and len(out) < 1100
    out = asyncio.run(tool("1/0"))
    assert "ZeroDivisionError" in out and out.endswith("[exit code 1]")


def test_python_tool_in_the_tool_environment_with_a_shorter_tool_deadline():
    """The tool's deadline cuts the run (the child is killed, not left behind); an observation."""
    env = ToolEnvironment([make_python_tool(wall_s=30)], tool_timeout=1.0)
    asyncio.run(env.reset({"prompt": "compute"}))
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    hang = '<tool_call>{"name": "python", "arguments": {"code": "import time; time.sleep(60)"}}</tool_call>'
    r = asyncio.run(env.step(call + hang))
    assert [m["content"] for m in r.messages] == ["42", "Error: python timed out after 1 s"]
    assert r.info == {"tool_calls": 2, "tool_errors": 1}
    assert env.tools[0]["function"]["parameters"]["required"] == ["code"]


SIGNAL = """
import os
try:
    os.kill({pid}, 0)
    print("reached the node")
except OSError as e:
    print("refused", type(e).__name__)
if {via_process}:
    import subprocess
    r = subprocess.run(["kill", "-0", "{pid}"], capture_output=True)
    print("kill binary", "reached the node" if r.returncode == 0 else "refused")
print("uid", os.getuid())
"""


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_code_cannot_signal_the_node(isolation):
    r = asyncio.run(run_python(SIGNAL.format(pid=os.getpid(), via_process=False), isolation=isolation, wall_s=20))
    assert r.ok and r.stdout.startswith("refused PermissionError"), r.stdout + r.stderr


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


@pytest.mark.skipif(os.geteuid() != 0 or not netns_available() or not SYSTEM_PYTHON
                    or not runs_as(SYSTEM_PYTHON, 65534), reason="needs root, `unshare -n` and a Python nobody can run")
def test_as_root_the_code_runs_as_nobody_and_its_processes_cannot_signal_the_node(server):
    port, accepted = server
    r = asyncio.run(run_python(SIGNAL.format(pid=os.getpid(), via_process=True), isolation="netns", wall_s=20,
                               executable=SYSTEM_PYTHON))
    assert r.uid == 65534 and r.stdout.splitlines() == ["refused PermissionError", "kill binary refused", "uid 65534"]
    r = asyncio.run(run_python(CONNECT.format(port=port), isolation="netns", wall_s=20, executable=SYSTEM_PYTHON))
    assert r.stdout.startswith("blocked") and accepted == []
