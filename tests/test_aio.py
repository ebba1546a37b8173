"""run_loop's worker threads: a call abandoned at its deadline never holds the process at exit.

Real processes and threads: the first tests run scripts whose only thread call never ends (blocked,
as an NCCL init whose peer never joined; or in and out of torch kernels, as a generation cut off
by SIGTERM) and check that the process still exits, with its own status, naming the call.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import gc
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest

from distflow.core.aio import DaemonThreadPool, describe_call, run_loop

STUCK = textwrap.dedent("""
    import asyncio, threading
    from distflow.core.aio import run_loop

    never = threading.Event()

    async def main():
        try:
            await asyncio.wait_for(asyncio.to_thread(never.wait), 0.2)
        except TimeoutError:
            return "gave up"

    print(run_loop(main(), thread_grace_s=0.5), flush=True)
""")


def test_a_call_abandoned_at_its_deadline_does_not_hold_the_process() -> None:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", STUCK], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "gave up"
    assert took < 20, f"the process took {took:.1f}s to exit"  # it used to wait for the thread for ever
    assert "still in Event.wait" in p.stderr  # the log names the call left behind


IN_TORCH = textwrap.dedent("""
    import asyncio, torch
    from distflow.core.aio import run_loop

    def matmuls():  # in and out of torch kernels for ever, as a generation cut off by SIGTERM
        a = torch.ones(64, 64)
        while True:
            a @ a

    async def main():
        try:
            await asyncio.wait_for(asyncio.to_thread(matmuls), 0.2)
        except TimeoutError:
            return 7

    run_loop(main(), thread_grace_s=0.5, exit_if_stuck=True)
    print("not reached", flush=True)
""")


def test_a_node_exits_with_its_code_while_a_thread_is_still_in_torch() -> None:
    # Interpreter shutdown under such a thread aborts the process (exit 134); a node exits at once instead.
    p = subprocess.run([sys.executable, "-c", IN_TORCH], capture_output=True, text=True, timeout=120)
    assert p.returncode == 7, (p.returncode, p.stderr[-2000:])
    assert "still in main.<locals>.matmuls" in p.stderr or "still in matmuls" in p.stderr, p.stderr[-2000:]
    assert "not reached" not in p.stdout


def test_an_idle_worker_keeps_nothing_of_its_last_call() -> None:
    class Result:
        pass

    pool = DaemonThreadPool(max_workers=1)
    ref = weakref.ref(pool.submit(Result).result(timeout=10))
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:  # the worker drops it once the call returned
        gc.collect()
        time.sleep(0.01)
    assert ref() is None, "an idle worker thread still holds its last call's result"
    pool.shutdown()


def test_a_callable_that_cannot_be_named_still_runs() -> None:
    class Odd(dict):
        __getattr__ = dict.__getitem__  # any attribute lookup raises KeyError

        def __call__(self) -> int:
            return 42

    pool = DaemonThreadPool(max_workers=1)
    assert pool.submit(Odd()).result(timeout=10) == 42
    assert pool.submit(pow, 2, 3).result(timeout=10) == 8  # and the worker lives on
    pool.shutdown()


def test_shutdown_waits_for_a_call_that_ends_within_the_grace() -> None:
    pool = DaemonThreadPool(grace_s=10)
    f = pool.submit(time.sleep, 0.3)
    t0 = time.monotonic()
    pool.shutdown(wait=True)
    assert f.done() and f.result() is None
    assert 0.1 < time.monotonic() - t0 < 5


def test_shutdown_is_bounded_and_names_the_stuck_call(caplog: pytest.LogCaptureFixture) -> None:
    never = threading.Event()
    pool = DaemonThreadPool(grace_s=0.3, name="t-pool")
    pool.submit(never.wait)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="distflow.aio"):
        pool.shutdown(wait=True)
    assert time.monotonic() - t0 < 3
    assert pool.running() == ["Event.wait"]
    assert any("t-pool" in r.message and "Event.wait" in r.message for r in caplog.records)
    assert all(t.daemon for t in pool._workers)
    never.set()


def test_calls_run_concurrently_up_to_max_workers_and_threads_are_reused() -> None:
    pool = DaemonThreadPool(max_workers=3)
    barrier = threading.Barrier(3, timeout=10)  # breaks unless three calls run at once
    names = [pool.submit(lambda: (barrier.wait(), threading.current_thread().name)[1]) for _ in range(3)]
    assert len({f.result(timeout=20) for f in names}) == 3
    later = [pool.submit(threading.current_thread) for _ in range(20)]
    assert len({f.result(timeout=20) for f in later}) <= 3
    assert len(pool._workers) == 3
    pool.shutdown()


def test_results_exceptions_and_use_after_shutdown() -> None:
    pool = DaemonThreadPool(max_workers=1)
    assert pool.submit(pow, 2, 10).result(timeout=10) == 1024
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(timeout=10)
    gate, started = threading.Event(), threading.Event()
    first = pool.submit(lambda: (started.set(), gate.wait(10))[1])
    assert started.wait(10)  # the one worker is busy: the next call stays queued
    queued = pool.submit(pow, 3, 2)
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    gate.set()
    assert first.result(timeout=10) is True
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(pow, 1, 1)


def test_to_thread_runs_on_the_daemon_pool_and_is_named() -> None:
    async def main() -> tuple[bool, str]:
        daemon = await asyncio.to_thread(lambda: threading.current_thread().daemon)
        return daemon, describe_call(functools.partial(contextvars.copy_context().run, time.sleep, 0))

    assert run_loop(main()) == (True, "sleep")
    with pytest.raises(ValueError, match="max_workers"):
        DaemonThreadPool(max_workers=0)


def test_cancel_and_wait_cancels_again_a_task_that_swallowed_its_cancellation():
    """Python 3.11's wait_for/timeout can turn a cancellation that races their timeout into a
    TimeoutError, which a polling loop ignores: one cancel() then leaves the task running."""
    from distflow.core.aio import cancel_and_wait

    async def polling_loop(swallowed: list[int], release: asyncio.Event) -> None:
        while True:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:  # as if the cancel had become a poll's TimeoutError
                if len(swallowed) < 2 and not release.is_set():
                    swallowed.append(1)
                    continue
                raise

    async def stuck(release: asyncio.Event) -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass

    async def main() -> None:
        swallowed: list[int] = []
        release = asyncio.Event()
        t = asyncio.create_task(polling_loop(swallowed, release), name="poller")
        never = asyncio.create_task(stuck(release), name="stuck")
        await asyncio.sleep(0)
        try:
            t0 = time.monotonic()
            left = await cancel_and_wait([t, never], 1.0, every=0.05)
            assert left == {never} and t.cancelled() and swallowed == [1, 1]
            assert 0.9 < time.monotonic() - t0 < 3.0  # bounded by the timeout, not by the stuck task
        finally:
            release.set()  # (whatever happened above: both end at their next cancel)
            for task in (t, never):
                task.cancel()
            await asyncio.wait([t, never], timeout=5)
        assert never.cancelled() or never.done()

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["event", "condition"])
def test_woken_never_swallows_a_cancellation_that_lands_with_the_wake_up(kind: str) -> None:
    """An idle loop waits with ``woken`` and re-checks. ``asyncio.wait_for`` on Python 3.11 returns
    the waiter's result when a cancellation lands in the same loop pass as the wake-up, and the loop
    then goes on polling as if never cancelled; ``woken`` lets the cancellation through. Also: a
    wake-up gives True, a timeout False, and a Condition's lock is held again either way."""
    from distflow.core.aio import woken

    async def main() -> None:
        cond = asyncio.Condition()
        event = asyncio.Event()

        async def idle() -> None:
            while True:  # the callers' shape: wait a while, then look again
                if kind == "event":
                    event.clear()
                    await woken(event.wait(), 5.0)
                else:
                    async with cond:
                        await woken(cond.wait(), 5.0)
                        assert cond.locked()

        task = asyncio.create_task(idle())
        await asyncio.sleep(0.01)
        if kind == "event":
            event.set()
        else:
            async with cond:
                cond.notify_all()
        task.cancel()  # same loop pass as the wake-up
        done, _ = await asyncio.wait({task}, timeout=1.0)
        assert done and task.cancelled(), "the cancellation was swallowed: the loop polls on"

        assert await woken(asyncio.sleep(0.01), 1.0) is True
        event.clear()
        t0 = asyncio.get_running_loop().time()
        assert await woken(event.wait() if kind == "event" else _cond_wait(cond), 0.05) is False
        assert 0.04 < asyncio.get_running_loop().time() - t0 < 1.0
        assert not cond.locked()

    async def _cond_wait(cond: asyncio.Condition) -> None:
        async with cond:
            await cond.wait()

    asyncio.run(main())
