"""Shared-memory segment names and their life cycle: create, map, unlink, sweep after a crash.

Why it exists: a POSIX shared-memory segment is a file in ``/dev/shm`` that outlives its
processes unless someone unlinks it. This module owns every rule that keeps DistFlow's segments
from leaking (see :mod:`.movers.shm` for how the channel uses them):

* names are ``distflow-shm.<pid>.<pid start time>.<random>.<n>``, created 0600 with
  ``posix_fallocate`` (a full tmpfs is a clean error, never SIGBUS);
* the process remembers the names it created until they are unlinked; ``atexit`` and a SIGTERM
  hook (installed only if SIGTERM still has the default action) unlink what is left;
* :func:`sweep_stale_segments` removes segments whose owner pid is gone or was reused (SIGKILL);
* a receiver keeps what it mapped in a :class:`Mappings` table (a sender's message slots, a
  producer's shared buffers), dropped after ``idle_s`` unused (the memory goes with the last view).
"""

from __future__ import annotations

import atexit
import errno
import mmap
import os
import re
import signal
import stat
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from distflow.transport.api import log

SHM_DIR = "/dev/shm"
PREFIX = "distflow-shm"
_NAME_RE = re.compile(rf"^{re.escape(PREFIX)}\.(\d+)\.(\d+)\.([0-9a-f]{{8}})\.(\d+)$")
MIN_SEGMENT = 1 << 20

# ---------------------------------------------------------------------- process-wide registry
_owned: set[str] = set()  # names this process created and that may still exist
_owned_lock = threading.Lock()
_hooks_installed = False
_counter = 0


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def _proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/pid/stat); None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


_MY_TAG = f"{os.getpid()}.{_proc_start_ticks(os.getpid()) or 0}"


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
    except OSError as e:  # pragma: no cover - permissions etc.
        log.warning("shm: could not unlink %s: %s", name, e)
    with _owned_lock:
        _owned.discard(name)


def cleanup_owned() -> int:
    """Unlink every segment name this process still owns. Returns how many were removed."""
    with _owned_lock:
        names = list(_owned)
    for n in names:
        _unlink(n)
    return len(names)


def _on_sigterm(signum: int, frame: Any) -> None:
    cleanup_owned()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def install_hooks() -> None:
    global _hooks_installed, _MY_TAG
    if _hooks_installed:
        return
    _hooks_installed = True
    _MY_TAG = f"{os.getpid()}.{_proc_start_ticks(os.getpid()) or 0}"  # after a fork the pid differs
    atexit.register(cleanup_owned)
    if threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):  # pragma: no cover
            pass


def sweep_stale_segments(min_age_s: float = 2.0) -> list[str]:
    """Remove DistFlow segments whose creating process is gone (crash, SIGKILL).

    A segment belongs to ``pid`` started at ``ticks`` (both in its name); it is stale
    when no live process has that pid *and* start time. ``min_age_s`` spares segments
    created moments ago (a process in another pid namespace sharing /dev/shm).
    Returns the removed names.
    """
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        m = _NAME_RE.match(name)
        if not m:
            continue
        pid, ticks = int(m.group(1)), int(m.group(2))
        if _proc_start_ticks(pid) == ticks:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if now - os.stat(path).st_mtime < min_age_s:
                continue
            os.unlink(path)
            removed.append(name)
        except FileNotFoundError:
            continue
        except OSError as e:
            log.warning("shm sweep: could not remove %s: %s", name, e)
    if removed:
        log.info("shm sweep: removed %d stale segment(s)", len(removed))
    return removed


def open_segment(path: str, size: int | None = None, create: bool = False) -> tuple[mmap.mmap, int]:
    """(mapping, open fd) of a segment: created 0600 with ``posix_fallocate`` (``create``: a full
    tmpfs is a clean OSError, never SIGBUS later; the file is removed again on failure), else an
    existing regular file of this user, mapped whole. The caller owns the fd (locks are taken on it)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            assert size is not None
            os.posix_fallocate(fd, 0, size)
        else:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise PermissionError(f"{path} is not a regular file owned by this user")
            size = st.st_size
        return mmap.mmap(fd, size), fd
    except BaseException:
        os.close(fd)
        if create:
            os.unlink(path)
        raise


def _map_segment(path: str, size: int | None = None, create: bool = False) -> mmap.mmap:
    """:func:`open_segment` without the fd (the mapping keeps the memory)."""
    mm, fd = open_segment(path, size, create)
    os.close(fd)
    return mm


def reserve_name() -> tuple[str, str]:
    """A fresh segment name and its path, registered for cleanup (atexit, SIGTERM, the sweep after a
    crash) until :func:`_unlink`; :func:`release_name` forgets one whose creation failed."""
    global _counter
    _counter += 1
    name = f"{PREFIX}.{_MY_TAG}.{os.urandom(4).hex()}.{_counter}"
    with _owned_lock:
        _owned.add(name)
    return name, os.path.join(SHM_DIR, name)


def release_name(name: str) -> None:
    with _owned_lock:
        _owned.discard(name)


def create_segment(size: int) -> tuple[str, mmap.mmap]:
    """A new segment of ``size`` bytes (name, mapping), registered for cleanup until unlinked."""
    name, path = reserve_name()
    try:
        return name, _map_segment(path, size, create=True)
    except BaseException:
        release_name(name)
        raise


@dataclass(eq=False)
class Mapped:
    """One mapped segment: its mapping, its size, a uint8 view of all of it, when it was last used."""

    mm: mmap.mmap
    size: int
    last_used: float

    def __post_init__(self) -> None:
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)


class Mappings:
    """A receiver's mappings of other processes' segments, keyed by (sender node id, name): mapped
    once, reused by every later message or post naming them, dropped after ``idle_s`` unused (a
    dead or idle sender's; the memory goes when the last tensor viewing it does)."""

    def __init__(self, idle_s: float = 300.0):
        self._maps: dict[tuple[str, str], Mapped] = {}
        self.idle_s = idle_s
        self._expired_at = 0.0

    def open(self, sender: str, name: str, *, unlink: bool) -> Mapped:
        """Map ``name`` (a regular 0600 file of this user in SHM_DIR; OSError/ValueError otherwise);
        ``unlink``: remove the name at once (a message slot: only this receiver maps it), else
        leave it (a shared buffer: other consumers map it too; its owner removes it)."""
        m = self._maps.get((sender, name))
        if m is not None:
            return m
        path = os.path.join(SHM_DIR, name)
        mm = _map_segment(path)
        if unlink:
            try:
                os.unlink(path)  # the mapping keeps the memory; the name must not outlive us
            except OSError as e:
                if e.errno != errno.ENOENT:
                    log.warning("shm: could not unlink %s: %s", name, e)
        m = self._maps[(sender, name)] = Mapped(mm, len(mm), time.monotonic())
        return m

    def get(self, sender: str, name: str) -> Mapped | None:
        m = self._maps.get((sender, name))
        if m is not None:
            m.last_used = time.monotonic()
        return m

    def drop(self, sender: str, name: str) -> None:
        self._maps.pop((sender, name), None)

    def expire(self) -> None:
        """Drop mappings unused for ``idle_s`` (at most one scan a second)."""
        now = time.monotonic()
        if now - self._expired_at < 1.0:  # a scan per message would cost more than the mappings
            return
        self._expired_at = now
        for key in [k for k, m in self._maps.items() if now - m.last_used > self.idle_s]:
            del self._maps[key]  # unmapped once no tensor views it

    def __len__(self) -> int:
        return len(self._maps)

    def clear(self) -> None:
        self._maps.clear()  # a mapping still viewed by live tensors is unmapped when they die
