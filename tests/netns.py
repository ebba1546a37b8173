"""Several "hosts" on one machine: Linux network namespaces joined by a bridge.

Why this exists: DistFlow's promise is a cluster across hosts, and loopback hides the
ways that can break (a node bound to the wrong address, gloo picking the wrong interface,
a link going away). A network namespace is a host as far as the network stack goes: its
own interfaces, addresses, routes and ports. A :class:`Lab` builds N of them, each with
one veth (``veth0``, address ``SUBNET.i/24``) plugged into a bridge that lives in a
separate "switch" namespace, so the machine's own network is never touched. Taking a
host off the network is ``ip link set pI down`` on the switch side.

Also here: the skip reason of a test whose system tool (``pdsh``, ``docker-compose``, ``ip``)
is missing. Tests install nothing: ``scripts/test-deps.sh`` (run by ``scripts/setup.sh`` as
root with apt-get) is the one step that does.

Every name carries the creating process's pid, so namespaces that a killed test run left
behind are recognised and removed (:func:`reap_stale`) without touching another run's.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass

PREFIX = "dft"
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-(?:sw|h\d+)$")


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message holds the command and its stderr."""


def ip(*args: str, timeout: float = 10.0) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def unavailable_reason() -> str | None:
    """None when namespaces, veths and bridges can be made here, else why not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip"):
        return missing_tool("ip", "iproute2")
    probe = Lab(1)
    try:
        probe.create()
    except (NetnsError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot build network namespaces here: {e}"
    finally:
        probe.destroy()
    return None


def _netns_list() -> list[str]:
    try:
        return [ln.split()[0] for ln in ip("netns", "list").splitlines() if ln.strip()]
    except NetnsError:
        return []


def _kill_inside(ns: str) -> None:
    """SIGKILL what still runs in one of our namespaces (only ever a test's own nodes)."""
    try:
        pids = [int(p) for p in ip("netns", "pids", ns).split()]
    except (NetnsError, ValueError):
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reap_stale() -> list[str]:
    """Remove namespaces left by test runs whose process is gone; returns their names."""
    gone = []
    for ns in _netns_list():
        m = _NAME_RE.match(ns)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # its test run is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _kill_inside(ns)
        try:
            ip("netns", "del", ns)
            gone.append(ns)
        except NetnsError:
            pass
    return gone


@dataclass(frozen=True)
class Host:
    """One namespace-host: ``ns`` name, ``addr`` on the lab subnet, its interface and switch port."""

    index: int
    ns: str
    addr: str
    ifname: str = "veth0"

    @property
    def port_name(self) -> str:
        return f"p{self.index}"

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]


class Lab:
    """``n`` hosts ``SUBNET.1 .. SUBNET.n`` on one bridge. Use as a context manager, or
    ``create()`` / ``destroy()`` (idempotent; also removes what a failed create made)."""

    def __init__(self, n: int, subnet: str = "10.77.0"):
        if not 1 <= n <= 250:
            raise ValueError(f"Lab: 1..250 hosts, got {n}")
        tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{tag}-sw"
        self.hosts = [Host(i, f"{tag}-h{i}", f"{subnet}.{i}") for i in range(1, n + 1)]
        self._made: list[str] = []

    def create(self) -> "Lab":
        try:
            self._add_ns(self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for h in self.hosts:
                self._add_ns(h.ns)
                ip("link", "add", h.ifname, "netns", h.ns, "type", "veth", "peer", "name", h.port_name,
                   "netns", self.switch)
                ip("-n", self.switch, "link", "set", h.port_name, "master", "br0")
                ip("-n", self.switch, "link", "set", h.port_name, "up")
                ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
                ip("-n", h.ns, "link", "set", h.ifname, "up")
                ip("-n", h.ns, "link", "set", "lo", "up")
        except BaseException:
            self.destroy()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def set_link(self, host: Host, up: bool) -> None:
        """Plug a host into the switch, or pull its cable (the switch-side port goes down)."""
        ip("-n", self.switch, "link", "set", host.port_name, "up" if up else "down")

    def destroy(self) -> None:
        """Kill whatever still runs inside, then delete every namespace (their veths go with them)."""
        for ns in reversed(self._made):
            _kill_inside(ns)
            try:
                ip("netns", "del", ns)
            except NetnsError:
                pass
        self._made.clear()

    def __enter__(self) -> "Lab":
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


# ---------------------------------------------------------------------- system tools
TEST_DEPS = "scripts/test-deps.sh"


def missing_tool(binary: str, package: str) -> str | None:
    """None when ``binary`` is on PATH, else the skip reason: the tool, and the one step that installs
    it (tests never install anything themselves)."""
    if shutil.which(binary):
        return None
    return f"{binary} is not installed: run {TEST_DEPS} (as root; it installs Debian's {package})"
