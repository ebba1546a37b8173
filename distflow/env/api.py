"""The environment interface of multi-turn episodes, and the checks on what an environment returns.

Why it exists: a config names an environment the way it names a reward function
(``environment: package.module:Class`` with ``environment_args: {...}``); the runner
(:mod:`distflow.env.runner`) makes one instance per episode and talks to it only through
this module. Environments are user code, so everything they return is validated here and
every failure becomes an :class:`EnvError` naming the environment, the method and what was
wrong: the runner ends that one episode with a counted error and goes on with the others.

An environment is any object with

* ``reset(row: dict) -> list[dict]``: the first chat messages of the episode (e.g. a
  system prompt and the user's question taken from the dataset row);
* ``step(reply: str) -> StepResult``: the model's reply text of one turn in, the next
  messages (tool results, a user's follow-up), an optional reward, ``done`` and ``info``
  out. A plain dict with those keys is accepted too.

Both may be ``async def`` or plain methods; plain ones run in a worker thread
(:func:`in_thread`) so a slow environment never blocks the event loop that drives the
other episodes (and, once integrated, the engine). An optional ``tools`` attribute (a list of
JSON schemas) is passed to the chat template, and an optional ``close()`` is called at the end.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import inspect
import math
import numbers
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

__all__ = ["StepResult", "Environment", "EnvError", "EnvTimeout", "load_environment", "load_object", "call_env",
           "deadline", "in_thread",
           "check_messages", "check_step_result"]


@dataclass
class StepResult:
    """What one ``step`` returns: the messages the environment adds to the conversation (may be
    empty when ``done``), the reward of this step (None: no reward here; the episode's reward is
    the sum of the non-None ones), whether the episode is over, and free-form ``info`` (the
    runner reads ``tool_calls`` and ``tool_errors`` counts from it for the metrics).
    ``replace``: ``messages`` is the whole conversation so far, not an addition to it (an agent
    on the chat endpoint sends the whole conversation with every request; the next prompt is
    rendered from it and must still extend the previous context, else the episode splits)."""

    messages: list[dict] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    info: dict = field(default_factory=dict)
    replace: bool = False


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (one instance per episode). See the module doc."""

    def reset(self, row: dict) -> Any:  # -> list[dict] | Awaitable[list[dict]]
        ...

    def step(self, reply: str) -> Any:  # -> StepResult | dict | Awaitable[...]
        ...


class EnvError(Exception):
    """The environment failed: it raised, returned something malformed, or did not answer by its
    deadline. Ends the one episode (``stop_reason: env_error``, its tokens not trained)."""


class EnvTimeout(EnvError):
    """The environment (or a tool) did not answer by its deadline."""


_ROLES = ("system", "user", "assistant", "tool")


def load_object(spec: str, what: str = "environment") -> Any:
    """``"package.module:Name"`` -> the object, or ValueError saying which part is wrong."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{what} {spec!r}: expected 'package.module:Name'")
    mod_name, attr = spec.split(":")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import module {mod_name!r} ({e})") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_environment(spec: str | type | Callable[..., Any], args: dict | None = None) -> Callable[[], Any]:
    """A factory making one fresh environment per episode from ``environment: module:Class`` and
    ``environment_args``. Checks now, before any episode, that the class exists, has ``reset`` and
    ``step``, and that ``args`` bind to its constructor: a config error is raised once, at load,
    as ValueError naming the key, not once per episode."""
    args = dict(args or {})
    name = spec if isinstance(spec, str) else getattr(spec, "__qualname__", repr(spec))
    cls = load_object(spec) if isinstance(spec, str) else spec
    if not callable(cls):
        raise ValueError(f"environment {name!r} is a {type(cls).__name__}, not a class or factory")
    if isinstance(cls, type):
        missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
        if missing:
            raise ValueError(f"environment {name!r} has no {' and no '.join(missing)} method "
                             f"(an environment has reset(row) -> messages and step(reply) -> StepResult)")
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as e:
        raise ValueError(f"environment_args {sorted(args)} do not fit environment {name!r}: {e}") from None
    except ValueError:  # no signature (a builtin): let the call tell
        pass

    def make() -> Any:
        try:
            env = cls(**args)
        except Exception as e:
            raise EnvError(f"environment {name!r}: constructor raised {type(e).__name__}: {e}") from e
        for m in ("reset", "step"):
            if not callable(getattr(env, m, None)):
                raise EnvError(f"environment {name!r}: the object it made has no {m}() method")
        return env

    make.spec = name  # type: ignore[attr-defined]
    return make


async def deadline(awaitable: Any, timeout: float | None, grace: float = 1.0) -> Any:
    """``await awaitable`` for at most ``timeout`` seconds (None: no limit), else asyncio.TimeoutError.
    Past the deadline the work is cancelled and given ``grace`` seconds to clean up (a sandbox
    reaps its killed child); unlike :func:`asyncio.wait_for`, it is never waited for longer: user
    code that swallows the cancellation and goes on hanging cannot hold the episode (the task is
    left behind; its eventual exception is retrieved, not logged)."""
    task = asyncio.ensure_future(awaitable)
    if timeout is None:
        return await task
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task in done:
        return task.result()
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    await asyncio.wait({task}, timeout=grace)
    raise asyncio.TimeoutError


async def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a daemon worker thread, awaited. Not :func:`asyncio.to_thread`:
    its pool is joined when the loop closes (``asyncio.run`` returns) and when the interpreter
    exits, so one user function that never returns would hang the node there, after its episode
    was long released at its deadline. A daemon thread is abandoned instead."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()
    ctx = contextvars.copy_context()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def work() -> None:
        try:
            out = ctx.run(fn, *args, **kwargs)
        except BaseException as e:  # noqa: BLE001  (handed to the awaiting coroutine)
            ok, out = False, e
        else:
            ok = True
        try:
            loop.call_soon_threadsafe(settle, ok, out)
        except RuntimeError:  # the loop is closed: nobody waits for this any more
            pass

    threading.Thread(target=work, name=f"distflow-env-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await future


async def call_env(fn: Callable[..., Any], *args: Any, timeout: float | None, what: str) -> Any:
    """``fn(*args)`` with a deadline: a coroutine function is awaited, a plain one runs in a worker
    thread (:func:`in_thread`). Raises :class:`EnvTimeout` past ``timeout`` seconds and
    :class:`EnvError` when it raises (both naming ``what``). A plain function that hangs keeps its
    thread (Python cannot stop a thread), but the episode is released at the deadline all the same."""
    async def call() -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        out = await in_thread(fn, *args)
        return await out if inspect.isawaitable(out) else out

    try:
        return await deadline(call(), timeout)
    except asyncio.TimeoutError:
        raise EnvTimeout(f"{what} did not answer within {timeout:g} s") from None
    except EnvError:
        raise
    except Exception as e:
        raise EnvError(f"{what} raised {type(e).__name__}: {e}") from e


def check_messages(value: Any, what: str, *, allow_empty: bool) -> list[dict]:
    """``value`` as a list of chat messages (``role`` one of system/user/assistant/tool, string
    ``content``; other keys such as a tool message's ``name`` kept), or EnvError naming the first
    bad message."""
    if not isinstance(value, (list, tuple)):
        raise EnvError(f"{what} returned {type(value).__name__}, expected a list of chat messages")
    if not value and not allow_empty:
        raise EnvError(f"{what} returned no messages (the episode needs at least one to prompt the model)")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise EnvError(f"{what}: message {i} is {type(m).__name__}, expected a dict with 'role' and 'content'")
        if m.get("role") not in _ROLES:
            raise EnvError(f"{what}: message {i} has role {m.get('role')!r}, expected one of {list(_ROLES)}")
        if not isinstance(m.get("content"), str):
            raise EnvError(f"{what}: message {i} ({m['role']}) has content of type "
                           f"{type(m.get('content')).__name__}, expected str")
        out.append(dict(m))
    return out


def check_step_result(value: Any, what: str) -> StepResult:
    """``value`` (a StepResult, or a dict with ``messages``, ``done`` and optionally ``reward`` and
    ``info``) checked field by field, or EnvError naming the malformed field."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"messages", "reward", "done", "info", "replace"})
        if unknown:
            raise EnvError(f"{what} returned a dict with unknown keys {unknown} "
                           f"(expected messages, reward, done, info, replace)")
        if "done" not in value:
            raise EnvError(f"{what} returned a dict without 'done'")
        value = StepResult(value.get("messages", []), value.get("reward"), value["done"], value.get("info") or {},
                           bool(value.get("replace", False)))
    if not isinstance(value, StepResult):
        raise EnvError(f"{what} returned {type(value).__name__}, expected a StepResult or a dict with "
                       f"messages, reward, done, info")
    if not isinstance(value.done, bool):
        raise EnvError(f"{what}: done is {type(value.done).__name__} {value.done!r:.40}, expected bool")
    reward = value.reward
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            raise EnvError(f"{what}: reward is {reward!r:.40}, expected a finite number or None")
        reward = float(reward)
    if not isinstance(value.info, dict):
        raise EnvError(f"{what}: info is {type(value.info).__name__}, expected dict")
    messages = check_messages(value.messages, what, allow_empty=True)
    if not messages and not value.done:
        raise EnvError(f"{what}: no messages and not done (the model would be prompted with nothing new)")
    return StepResult(messages, reward, value.done, dict(value.info), bool(value.replace))

