"""The zygote ``distflow run`` forks its nodes from (distflow/launch/zygote.py): a forked node is a
``distflow-node`` process in all that the launcher sees of it (its command line in /proc, its
output in its log, its exit status, signals to it), and the zygote is fit to fork from."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from distflow.launch.zygote import Zygote
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def zygote():
    z = Zygote({"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    yield z
    z.close()


@pytest.mark.cluster
def test_a_forked_node_has_its_command_line_log_and_exit_status(zygote, tmp_path):
    log = tmp_path / "node.log"
    node = zygote.spawn(["--role", "nope", "--config", str(tmp_path / "c.yaml")], str(log), {"X_ZYGOTE_TEST": "1"})
    assert node.wait(timeout=30) == 2  # argparse's exit status for a bad --role, as an exec'd node
    assert "invalid choice: 'nope'" in log.read_text()
    ok = zygote.spawn(["--help"], str(log), {})
    assert ok.wait(timeout=30) == 0 and "--role" in log.read_text()


@pytest.mark.cluster
def test_a_signal_reaches_the_forked_node_and_its_status_says_so(zygote, tmp_path):
    cfg = ROOT / "examples" / "grpo_quickstart.yaml"
    log = tmp_path / "node.log"
    # A node waiting to join seeds that never answer: alive until signalled.
    node = zygote.spawn(["--role", "rollout", "--config", str(cfg), "--seeds", "127.0.0.1:9", "--node-id", "z-0"],
                        str(log), {"DISTFLOW_SECRET": "s" * 32})
    with pytest.raises(subprocess.TimeoutExpired):
        node.wait(timeout=1.0)
    title = open(f"/proc/{node.pid}/cmdline", "rb").read().replace(b"\0", b" ")
    assert b"distflow-node --role rollout --config " in title and b"--node-id z-0" in title
    node.send_signal(signal.SIGKILL)
    assert node.wait(timeout=30) == -signal.SIGKILL and node.poll() == -signal.SIGKILL


@pytest.mark.cluster
def test_a_shared_zygote_stops_the_nodes_a_launcher_leaves_when_its_connection_ends(shared_zygote, tmp_path,
                                                                                     toy_model):
    """DISTFLOW_ZYGOTE: runs share one zygote (the test suite does); a launcher that ends or dies
    closes its connection, and its nodes still running get SIGTERM, as with a zygote of its own."""
    import os
    import time

    from distflow.launch.zygote import SHARED_ENV

    if shared_zygote is None:
        pytest.skip("the shared zygote did not start")
    z = Zygote({SHARED_ENV: str(shared_zygote)})
    # The first node of a mesh (no seeds): up at once, then waiting for peers that never come.
    node = z.spawn(["--role", "rollout", "--config", str(ROOT / "examples" / "grpo_quickstart.yaml"),
                    "--seeds", "", "--node-id", "z-1", f"model_path={toy_model}"], str(tmp_path / "node.log"),
                   {"DISTFLOW_SECRET": "s" * 32})
    up = time.monotonic() + 60
    while " up: control " not in (tmp_path / "node.log").read_text():
        assert node.poll() is None and time.monotonic() < up, (tmp_path / "node.log").read_text()[-2000:]
        time.sleep(0.1)
    z.close()
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{node.pid}") and b"z-1" in open(f"/proc/{node.pid}/cmdline", "rb").read():
        assert time.monotonic() < deadline, "the node outlived its launcher's connection"
        time.sleep(0.1)


def test_a_shared_zygote_outlives_a_launcher_that_resets_its_connection(shared_zygote):
    """A launcher killed before it read the zygote's replies resets the connection (ECONNRESET on the
    zygote's read): the zygote drops that client and still serves the next one."""
    import socket
    import time

    if shared_zygote is None:
        pytest.skip("the shared zygote did not start")
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    gone.connect(str(shared_zygote))
    time.sleep(0.3)  # the zygote's {"ready"} is waiting, unread, when the connection ends
    gone.close()
    time.sleep(0.3)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as next_one:
        next_one.settimeout(10)
        next_one.connect(str(shared_zygote))
        assert b'"ready"' in next_one.makefile("rb").readline()
