"""``agent: module:function``: an OpenAI-style agent drives an episode through the node's endpoint.

Why it exists: an agent written against a chat API (``async def agent(row, client) -> reward``,
or a harness it starts with ``client.env()``) should train as it is, and its episodes must still
be recorded token-in/token-out by the one episode machinery there is
(:class:`~distflow.env.runner.EpisodeRunner`, :class:`~distflow.env.episode.TokenAssembly`).
So the agent is turned around into an environment, :class:`AgentEnvironment`:

* ``reset(row)`` starts ``agent(row, client)`` (``client``: the endpoint's ``base_url`` and this
  episode's ``api_key``) and returns the messages of its first request;
* ``step(reply)`` answers the waiting request with the turn's reply (tool calls parsed,
  :func:`~distflow.env.endpoint.chat_completion`) and waits for what the agent does next: a new
  request is the next turn (``StepResult(replace=True)``: the request's whole conversation is
  what the runner renders, and must extend the previous context token for token, else the
  episode splits, counted), the agent returning is the end (its float is the episode's reward);
* ``finish`` (a budget ended the episode): the waiting request is answered (a turn cut by
  ``max_new_tokens`` as ``finish_reason: length``, a request past the budget with 400
  ``episode_over``), and the agent's return value is still the reward; an agent that lets the
  client's :class:`EpisodeOver` escape gives no reward (the episode is trained all the same).

Every wait on the agent has the runner's deadline (``env_timeout_s``): an agent that raises,
returns something that is not a finite number, or hangs ends its episode as ``env_error``
(counted, its tokens not trained), the other episodes unaffected.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
import urllib.error
import urllib.request
from typing import Any, Callable

from distflow.env.api import EnvError, StepResult, in_thread, load_object
from distflow.env.endpoint import ChatEndpoint, ChatRequest, HTTPError, Session, chat_completion
from distflow.env.tools import parse_tool_calls

__all__ = ["AgentClient", "AgentEnvironment", "EndpointError", "EpisodeOver", "load_agent", "agent_factory"]


class EndpointError(RuntimeError):
    """The endpoint answered an error: ``status`` and its ``code`` (``invalid_request``, ...)."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.code = status, code


class EpisodeOver(EndpointError):
    """The episode has no more turns (a budget ended it): return the reward now."""


class AgentClient:
    """What an agent gets: ``base_url`` (``http://127.0.0.1:PORT/v1``) and ``api_key`` (this
    episode's bearer token), for any OpenAI client, and ``chat(messages, **kw)``: one request,
    the response as a dict (``["choices"][0]["message"]``). ``timeout``: seconds one request may
    take (its HTTP call runs in a daemon thread; the turn's generation is inside it)."""

    def __init__(self, base_url: str, api_key: str, model: str = "distflow-policy", timeout: float = 600.0):
        self.base_url, self.api_key, self.model, self.timeout = base_url, api_key, model, timeout

    def env(self) -> dict[str, str]:
        """Environment variables an OpenAI-client harness started as a subprocess reads."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key}

    def _post(self, body: dict) -> dict:
        req = urllib.request.Request(f"{self.base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {self.api_key}",
                                              "Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                err = json.loads(e.read()).get("error", {})
            except (ValueError, AttributeError):
                err = {}
            kind = EpisodeOver if err.get("code") == "episode_over" else EndpointError
            raise kind(e.code, err.get("message", e.reason), err.get("code")) from None

    async def chat(self, messages: list[dict], **kw: Any) -> dict:
        """POST /v1/chat/completions with ``messages`` (and ``tools``, ... in ``kw``)."""
        return await in_thread(self._post, {"model": self.model, "messages": messages, **kw})


def load_agent(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """``agent: module:function`` -> the function, checked now: an ``async def`` taking
    ``(row, client)``; else ValueError naming the key."""
    fn = load_object(spec, "agent") if isinstance(spec, str) else spec
    name = spec if isinstance(spec, str) else getattr(spec, "__qualname__", repr(spec))
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent {name!r} must be an async def function (row, client) -> reward, "
                         f"got {type(fn).__name__}")
    try:
        inspect.signature(fn).bind({}, None)
    except TypeError as e:
        raise ValueError(f"agent {name!r} must take (row, client): {e}") from None
    return fn


def _reward(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise EnvError(f"agent {name!r} returned {value!r:.60}, expected a finite float reward")
    return float(value)


class AgentEnvironment:
    """One episode of ``agent`` through ``endpoint`` as an environment of the runner (module doc)."""

    def __init__(self, agent: Callable[..., Any], endpoint: ChatEndpoint, name: str = "agent"):
        self.agent, self.endpoint, self.name = agent, endpoint, name
        self.session: Session = endpoint.open_session()
        self.client = AgentClient(endpoint.base_url, self.session.token, endpoint.model)
        self.task: asyncio.Task | None = None
        self.pending: ChatRequest | None = None
        self.tools: list[dict] | None = None

    async def _next(self) -> ChatRequest | float:
        """The agent's next request, or its reward when it returned. EnvError when it raised."""
        assert self.task is not None
        get = asyncio.ensure_future(self.session.next_request())
        try:
            await asyncio.wait({get, self.task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():
                get.cancel()
        if get.done() and not get.cancelled():
            self.pending = get.result()
            self.tools = self.pending.tools
            return self.pending
        return self._outcome()

    def _outcome(self) -> float:
        assert self.task is not None and self.task.done()
        if self.task.cancelled():
            raise EnvError(f"agent {self.name!r} was cancelled")
        e = self.task.exception()
        if e is not None:
            raise EnvError(f"agent {self.name!r} raised {type(e).__name__}: {e}") from e
        return _reward(self.task.result(), self.name)

    def _answer(self, value: dict | HTTPError) -> None:
        if self.pending is not None:
            self.session.answer(self.pending, value)
            self.pending = None

    async def reset(self, row: dict) -> list[dict]:
        self.task = asyncio.ensure_future(self.agent(row, self.client))
        first = await self._next()
        if not isinstance(first, ChatRequest):
            raise EnvError(f"agent {self.name!r} returned without asking the model anything")
        return first.messages

    async def step(self, reply: str) -> StepResult:
        self._answer(chat_completion(reply, "stop", self.endpoint.model))
        calls = parse_tool_calls(reply)
        info = {"tool_calls": len(calls), "tool_errors": sum(c.error is not None for c in calls)}
        nxt = await self._next()
        if isinstance(nxt, ChatRequest):
            return StepResult(nxt.messages, None, False, info, replace=True)
        return StepResult([], nxt, True, info)

    async def finish(self, reply: str | None, stop_reason: str) -> float | None:
        """A budget ended the episode: answer the waiting request, then the agent's reward (None
        when it let :class:`EpisodeOver` escape)."""
        if reply is not None:  # the turn was cut: the agent still gets it
            self._answer(chat_completion(reply, "length", self.endpoint.model))
        self._answer(HTTPError(400, f"the episode is over ({stop_reason}): no more turns", code="episode_over"))
        self.session.close(stop_reason)
        assert self.task is not None
        await asyncio.wait({self.task})
        if not self.task.cancelled() and isinstance(self.task.exception(), EpisodeOver):
            return None
        return self._outcome()

    async def close(self) -> None:
        self.endpoint.close_session(self.session, "the episode ended")
        self.pending = None
        if self.task is not None and not self.task.done():
            self.task.cancel()
            self.task.add_done_callback(lambda t: t.cancelled() or t.exception())


def agent_factory(spec: str | Callable[..., Any], endpoint: ChatEndpoint) -> Callable[[], Any]:
    """One :class:`AgentEnvironment` per episode of ``agent: module:function`` on ``endpoint``."""
    fn = load_agent(spec)
    name = spec if isinstance(spec, str) else getattr(spec, "__qualname__", "agent")

    async def make() -> AgentEnvironment:  # async: made on the loop that serves the endpoint, not in a thread
        return AgentEnvironment(fn, endpoint, name)

    make.spec = name  # type: ignore[attr-defined]
    return make
