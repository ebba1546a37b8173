"""Event-loop plumbing shared by every entry point: uvloop, and worker threads that cannot hold a process.

Why the executor: ``asyncio.to_thread`` runs a call in the loop's default executor, whose threads
the interpreter (and ``asyncio.run``'s shutdown) joins at exit. A call abandoned at its deadline (an
NCCL init whose peer never came, a collective with a dead rank, a generation interrupted by
SIGTERM) would then keep the process alive after its role loop had ended: for as long as the call
blocks, which for a hung collective is for ever. :func:`run_loop` installs a
:class:`DaemonThreadPool` instead: its threads are daemon threads, and its shutdown waits at most
``thread_grace_s`` for the calls still running, names them in the log, and returns. A node
entry point then exits at once (``exit_if_stuck``): finalizing the interpreter under a thread
still inside torch aborts the process.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Coroutine, Iterable, TypeVar

T = TypeVar("T")
log = logging.getLogger("distflow.aio")
THREAD_GRACE_S = 5.0  # how long the loop's shutdown waits for worker threads still running a call


class DaemonThreadPool(ThreadPoolExecutor):
    """A thread pool whose threads never keep the process alive; ``shutdown(wait=True)`` is bounded.

    Same contract as :class:`ThreadPoolExecutor` (a subclass only because the event loop accepts
    nothing else as its default executor; none of the base class's machinery is used): up to
    ``max_workers`` threads, started on demand and reused; queued calls still run after
    ``shutdown`` unless ``cancel_futures``. Only ``shutdown(wait=True)`` differs: it waits
    ``grace_s`` at most, then logs the calls still running (by function name) and returns,
    leaving them to die with the process.
    """

    def __init__(self, max_workers: int | None = None, name: str = "distflow-worker",
                 grace_s: float = THREAD_GRACE_S):
        super().__init__(max_workers=1, thread_name_prefix=name)  # starts no thread
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers!r}")
        self._max = max_workers or min(32, (os.cpu_count() or 1) + 4)  # asyncio's default
        self._name, self._grace = name, float(grace_s)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle_workers = threading.Semaphore(0)  # released by a worker each time it is free
        self._guard = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._running: dict[threading.Thread, str] = {}
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._guard:
            if self._closed:
                raise RuntimeError(f"{self._name}: cannot schedule new calls after shutdown")
            fut: Future = Future()
            self._jobs.put((fut, fn, args, kwargs))
            if not self._idle_workers.acquire(blocking=False) and len(self._workers) < self._max:
                t = threading.Thread(target=self._work, name=f"{self._name}_{len(self._workers)}", daemon=True)
                self._workers.append(t)
                t.start()
        return fut

    def _work(self) -> None:
        me = threading.current_thread()
        while (job := self._jobs.get()) is not None:
            _run_job(job, me, self._running)
            del job  # nothing of the last call (its arguments) stays alive while the thread is idle
            self._idle_workers.release()

    def running(self) -> list[str]:
        """The calls running now (function names)."""
        return list(self._running.values())

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._guard:
            self._closed = True
            workers = list(self._workers)
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in workers:
            self._jobs.put(None)
        if not wait:
            return
        deadline = time.monotonic() + self._grace
        for t in workers:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = self.running()
        if stuck:
            log.warning("%s: %d worker thread(s) still in %s %gs after shutdown; not waiting for them "
                        "(daemon threads: they end with the process)", self._name, len(stuck),
                        ", ".join(sorted(stuck)), self._grace)


def _run_job(job: tuple[Future, Callable[..., Any], tuple, dict], me: threading.Thread,
             running: dict[threading.Thread, str]) -> None:
    """One call, its outcome on its future (a function of its own: its result is freed on return,
    not kept by the idle thread); whatever happens, the worker goes on."""
    fut, fn, args, kwargs = job
    if not fut.set_running_or_notify_cancel():
        return
    try:
        running[me] = describe_call(fn)
        result = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - the caller gets it, as from any executor
        fut.set_exception(e)
    else:
        fut.set_result(result)
    finally:
        running.pop(me, None)


async def cancel_and_wait(tasks: Iterable[asyncio.Task], timeout: float, every: float = 0.2) -> set[asyncio.Task]:
    """Cancel ``tasks`` and wait for them, at most ``timeout`` seconds; the tasks still running.

    Why not one ``cancel()`` and a wait: a task may swallow a cancellation (on Python 3.11
    ``asyncio.wait_for`` returns its waiter's result when a cancellation lands with the wake-up;
    this code base's idle waits use :func:`woken`, which does not, but a library's may), and a
    loop that polls on then goes on as if never cancelled. So the tasks still running are
    cancelled again every ``every`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    left = {t for t in tasks if not t.done()}
    while left:
        for t in left:
            t.cancel()
        wait = min(every, end - loop.time())
        if wait <= 0:
            break
        _, left = await asyncio.wait(left, timeout=wait)
    return left


async def woken(waiter: Awaitable[Any], timeout: float) -> bool:
    """Await ``waiter`` (an Event's or a Condition's ``wait()``) for at most ``timeout`` seconds:
    True if it finished, False if the time ran out. The one idle wait of the code base.

    Why not ``asyncio.wait_for``: on Python 3.11 it runs the waiter as a task of its own and, when
    a cancellation lands in the same loop pass as the wake-up, returns the result instead of
    raising, so a loop that polls with it goes on as if never cancelled. ``asyncio.timeout``
    cancels the caller itself and tells its own cancellation from another's by count, so a
    cancellation always propagates (a wake-up that races the timeout may read as False: the
    callers re-check their condition)."""
    try:
        async with asyncio.timeout(max(0.0, timeout)):
            await waiter
        return True
    except TimeoutError:
        return False


def describe_call(fn: Callable[..., Any]) -> str:
    """The name of the function a submitted call runs (``to_thread`` wraps it in a context's ``run``)."""
    try:
        while isinstance(fn, functools.partial):
            owner = getattr(fn.func, "__self__", None)
            fn = fn.args[0] if isinstance(owner, contextvars.Context) and fn.args else fn.func
        name = getattr(fn, "__qualname__", None)
        return name if isinstance(name, str) else type(fn).__qualname__
    except Exception:  # noqa: BLE001 - an odd callable must not cost the call its thread
        return type(fn).__qualname__


def run_loop(coro: Coroutine[Any, Any, T], *, thread_grace_s: float = THREAD_GRACE_S,
             exit_if_stuck: bool = False) -> T:
    """Run a coroutine to completion on uvloop (falls back to the stdlib loop), with a
    :class:`DaemonThreadPool` as the default executor: at the end, worker threads still in a
    call get ``thread_grace_s`` seconds, then the process no longer waits for them.

    ``exit_if_stuck`` (the node entry points): when a call is still running after that, the
    process exits at once (``os._exit``) with the coroutine's result as its status (an int; 1 if
    it raised, 130 on Ctrl-C), logs and output flushed. Interpreter shutdown with a thread still
    inside torch aborts the process (the thread is killed while it re-takes the GIL in C++)."""
    pool = DaemonThreadPool(grace_s=thread_grace_s)

    async def main() -> T:
        asyncio.get_running_loop().set_default_executor(pool)
        return await coro

    try:
        result = _run(main())
    except BaseException as e:
        if exit_if_stuck and pool.running():
            log.error("stopping on %s with worker threads still running", type(e).__name__, exc_info=e)
            exit_now(130 if isinstance(e, KeyboardInterrupt) else 1)
        raise
    if exit_if_stuck and pool.running():
        exit_now(result if isinstance(result, int) and not isinstance(result, bool) else 0)
    return result


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.run(coro)
    return uvloop.run(coro)


def exit_now(code: int) -> None:
    """Exit the process now with ``code`` (no interpreter shutdown), logs and output flushed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
