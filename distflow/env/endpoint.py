"""An OpenAI-compatible chat-completions endpoint on a rollout node, one episode per bearer token.

Why it exists: many agents are written against the OpenAI chat API (a harness, a framework, a
script), not against :class:`~distflow.env.api.Environment`. This endpoint lets such an agent
drive an episode unmodified while the node keeps the token-in/token-out record: each request is
one turn of the episode its bearer token names; the request's messages are rendered with the
chat template by the episode runner (which checks that they extend the previous context token
for token, and splits where they do not), the engine samples the turn, and the response carries
the sampled text (and the Hermes/Qwen tool calls in it, parsed, as ``tool_calls``).

Standard library only: a small HTTP/1.1 server on asyncio streams (keep-alive, Content-Length
bodies, JSON), ``POST /v1/chat/completions`` and ``GET /v1/models``. It binds to loopback unless
told otherwise, and every request must carry ``Authorization: Bearer <token>`` of a live
episode (a fresh random token per episode, compared by digest). A bad request gets a 4xx JSON
error ``{"error": {"message", "type", "code"}}`` naming the problem; nothing a client sends
raises out of the server. Reading a request has a deadline (``read_timeout``): a client that
stalls mid-request cannot hold a connection forever.

The endpoint knows nothing of engines: it hands each valid request to its :class:`Session`
(``await session.next_request()``) and writes whatever the session answers. The adapter that
makes a session an environment of the runner is :mod:`distflow.env.agent`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from distflow.env.api import EnvError, check_messages
from distflow.env.tools import parse_tool_calls

__all__ = ["ChatEndpoint", "Session", "ChatRequest", "HTTPError", "chat_completion", "normalize_messages"]

log = logging.getLogger(__name__)

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            409: "Conflict", 411: "Length Required", 413: "Payload Too Large", 431: "Request Header Fields Too Large",
            500: "Internal Server Error"}


class HTTPError(Exception):
    """A request the endpoint refuses: ``status`` and an OpenAI-style error (``code`` names the kind)."""

    def __init__(self, status: int, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        kind = "authentication_error" if self.status == 401 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "code": self.code, "param": self.param}}


@dataclass
class ChatRequest:
    """One valid chat-completions request: the conversation (normalized for the template), the tools'
    schemas (None: no tools), and the future its response (a dict, or an HTTPError) is set on."""

    messages: list[dict]
    tools: list[dict] | None
    response: asyncio.Future = field(repr=False)


class Session:
    """The endpoint's side of one episode: the requests its token sent, one in flight at a time.
    ``closed`` (a reason): later requests get 400 ``episode_over``."""

    def __init__(self, token: str):
        self.token = token
        self.queue: asyncio.Queue[ChatRequest] = asyncio.Queue()
        self.in_flight: ChatRequest | None = None
        self.closed: str | None = None

    async def next_request(self) -> ChatRequest:
        return await self.queue.get()

    def answer(self, request: ChatRequest, value: dict | HTTPError) -> None:
        """Settle ``request`` with a response body (200) or an error; the next request may come."""
        if not request.response.done():
            request.response.set_result(value)
        if self.in_flight is request:
            self.in_flight = None

    def close(self, reason: str) -> None:
        """No more turns: a waiting or queued request gets 400 ``episode_over`` naming ``reason``."""
        self.closed = reason
        pending = [self.in_flight] if self.in_flight is not None else []
        while not self.queue.empty():
            pending.append(self.queue.get_nowait())
        for r in pending:
            self.answer(r, episode_over(reason))


def episode_over(reason: str) -> HTTPError:
    return HTTPError(400, f"the episode is over ({reason}): no more turns", code="episode_over")


def _content(value: Any, i: int, role: str) -> str:
    """A message's content as text: a string, null (an assistant turn holding only tool calls), or
    OpenAI text parts."""
    if isinstance(value, str):
        return value
    if value is None and role == "assistant":
        return ""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise HTTPError(400, f"messages[{i}].content must be a string or a list of text parts "
                         f"({{'type': 'text', 'text': ...}}), got {type(value).__name__}", param=f"messages[{i}].content")


def _tool_calls(value: Any, i: int) -> list[dict]:
    """An assistant message's OpenAI ``tool_calls``, their JSON-string ``arguments`` parsed into
    objects: the chat templates (Qwen's, Hermes') render ``arguments | tojson``."""
    if not isinstance(value, list):
        raise HTTPError(400, f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise HTTPError(400, f"{where} must be {{'type': 'function', 'function': {{'name': str, 'arguments': "
                                 f"str}}}}", param=where)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise HTTPError(400, f"{where}.function.arguments is not JSON ({e.msg})", param=where) from None
        if not isinstance(args, dict):
            raise HTTPError(400, f"{where}.function.arguments must be a JSON object", param=where)
        out.append({"id": str(call.get("id", f"call_{j}")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def normalize_messages(value: Any) -> list[dict]:
    """The request's ``messages`` as the chat template takes them (roles system/user/assistant/tool;
    ``name``, ``tool_call_id`` and ``tool_calls`` kept), or HTTPError naming the first bad one."""
    if not isinstance(value, list) or not value:
        raise HTTPError(400, "messages must be a non-empty list of chat messages", param="messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise HTTPError(400, f"messages[{i}] is {type(m).__name__}, expected an object", param=f"messages[{i}]")
        role = m.get("role")
        msg = {"role": role, "content": _content(m.get("content"), i, str(role))}
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        out.append(msg)
    try:
        return check_messages(out, "the request", allow_empty=False)
    except EnvError as e:
        raise HTTPError(400, str(e), param="messages") from None


def parse_chat_request(body: bytes) -> tuple[list[dict], list[dict] | None]:
    """``(messages, tools)`` of a chat-completions body, or HTTPError (400) naming the problem.
    Sampling keys (temperature, top_p, max_tokens, ...) are the run's, not the request's: the trained
    tokens must be sampled as the rollout samples them; ``n`` above 1 and ``stream`` are refused."""
    try:
        req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"the request body is not JSON ({getattr(e, 'msg', e)})", code="invalid_json") from None
    if not isinstance(req, dict):
        raise HTTPError(400, f"the request body is a JSON {type(req).__name__}, expected an object")
    if req.get("stream"):
        raise HTTPError(400, "stream: true is not supported (one JSON response per turn)", param="stream")
    if req.get("n", 1) != 1:
        raise HTTPError(400, f"n must be 1 (one sampled reply per turn of the episode), got {req.get('n')!r}",
                        param="n")
    tools = req.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise HTTPError(400, "tools must be a list of tool schemas (objects)", param="tools")
    return normalize_messages(req.get("messages")), (tools or None)


def chat_completion(reply: str, finish_reason: str, model: str) -> dict:
    """The response body of one turn: the sampled ``reply`` as the assistant message. Where the
    Hermes/Qwen parser finds well-formed tool calls, they are ``tool_calls`` (arguments as JSON
    strings, as OpenAI writes them), the text before the first ``<tool_call>`` is the content (null
    when blank) and ``finish_reason`` is ``tool_calls``; a malformed call leaves the text whole."""
    message: dict[str, Any] = {"role": "assistant", "content": reply}
    calls = parse_tool_calls(reply)
    if calls and all(c.error is None for c in calls):
        head = reply[:reply.index("<tool_call>")]
        message["content"] = head if head.strip() else None
        message["tool_calls"] = [{"id": f"call_{secrets.token_hex(6)}", "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                 for c in calls]
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}]}


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class ChatEndpoint:
    """The server: ``await start()``, ``open_session()`` per episode (its token is the episode's
    API key), ``close_session``, ``await close()``. ``port=0``: a free port (``port`` after start)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, model: str = "distflow-policy",
                 read_timeout: float = 60.0, max_body: int = 16 << 20):
        self.host, self.port, self.model = host, port, model
        self.read_timeout, self.max_body = read_timeout, max_body
        self.sessions: dict[bytes, Session] = {}
        self.server: asyncio.AbstractServer | None = None
        self.connections: set[asyncio.Task] = set()
        self.requests = 0
        self.errors = 0  # 4xx/5xx answers

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    async def start(self) -> "ChatEndpoint":
        self.server = await asyncio.start_server(self._connection, self.host, self.port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def close(self, timeout: float = 5.0) -> None:
        """Stop listening, end the open connections and every session (deadline ``timeout``)."""
        for s in list(self.sessions.values()):
            s.close("the endpoint closed")
        self.sessions.clear()
        if self.server is not None:
            self.server.close()
        for t in list(self.connections):
            t.cancel()
        if self.connections:
            await asyncio.wait(set(self.connections), timeout=timeout)
        if self.server is not None:
            try:
                await asyncio.wait_for(self.server.wait_closed(), timeout)
            except asyncio.TimeoutError:
                log.warning("agent endpoint %s: not closed within %g s", self.base_url, timeout)

    def open_session(self) -> Session:
        session = Session(secrets.token_urlsafe(32))
        self.sessions[_digest(session.token)] = session
        return session

    def close_session(self, session: Session, reason: str) -> None:
        session.close(reason)
        self.sessions.pop(_digest(session.token), None)

    # ------------------------------------------------------------------ HTTP
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.connections.add(task)
        try:
            keep = True
            while keep:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.read_timeout)
                except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
                    return  # the client closed (or idled past the deadline) between requests
                except asyncio.LimitOverrunError:
                    await self._write(writer, 431, HTTPError(431, "request headers too large").body(), False)
                    return
                status, body, keep = await self._request(head, reader, writer)
                await self._write(writer, status, body, keep)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            if task is not None:
                self.connections.discard(task)
            writer.close()

    async def _request(self, head: bytes, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> tuple[int, dict, bool]:
        """One request -> (status, JSON body, keep the connection)."""
        self.requests += 1
        try:
            lines = head.decode("latin-1").split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                raise HTTPError(400, f"not an HTTP/1.x request line: {lines[0][:80]!r}")
            method, target, version = parts
            headers = {}
            for line in lines[1:]:
                if line:
                    k, sep, v = line.partition(":")
                    if not sep:
                        raise HTTPError(400, f"malformed header line {line[:80]!r}")
                    headers[k.strip().lower()] = v.strip()
            keep = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
            if "chunked" in headers.get("transfer-encoding", "").lower():
                raise HTTPError(411, "chunked request bodies are not supported: send Content-Length")
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                raise HTTPError(400, "Content-Length is not a number") from None
            if length < 0 or length > self.max_body:
                raise HTTPError(413, f"the body has {length} bytes, at most {self.max_body} are taken")
            if length and headers.get("expect", "").lower() == "100-continue":  # curl, for bodies over 1 KiB
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = await asyncio.wait_for(reader.readexactly(length), self.read_timeout) if length else b""
        except HTTPError as e:
            self.errors += 1
            return e.status, e.body(), False  # the stream may be out of step: close it
        try:
            return 200, await self._route(method, target.split("?")[0].rstrip("/"), headers, body), keep
        except HTTPError as e:
            self.errors += 1
            return e.status, e.body(), keep
        except Exception as e:  # noqa: BLE001  (a bug here answers 500, the server goes on)
            self.errors += 1
            log.exception("agent endpoint: %s %s failed", method, target)
            return 500, HTTPError(500, f"internal error: {type(e).__name__}: {e}", code="internal").body(), False

    def _session(self, headers: dict[str, str]) -> Session:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        session = self.sessions.get(_digest(token.strip())) if scheme.lower() == "bearer" and token else None
        if session is None:
            raise HTTPError(401, "missing or wrong API key: send Authorization: Bearer <the episode's api_key>",
                            code="invalid_api_key")
        return session

    async def _route(self, method: str, path: str, headers: dict[str, str], body: bytes) -> dict:
        if path not in ("/v1/chat/completions", "/v1/models"):
            raise HTTPError(404, f"no route {path!r} (POST /v1/chat/completions, GET /v1/models)", code="not_found")
        want = "POST" if path == "/v1/chat/completions" else "GET"
        if method != want:
            raise HTTPError(405, f"{path} takes {want}, not {method}", code="method_not_allowed")
        session = self._session(headers)  # before the body is read as JSON: a stranger learns nothing
        if path == "/v1/models":
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                "owned_by": "distflow"}]}
        messages, tools = parse_chat_request(body)
        if session.closed:
            raise episode_over(session.closed)
        if session.in_flight is not None:
            raise HTTPError(409, "a request of this episode is already in flight: one turn at a time",
                            code="turn_in_flight")
        request = ChatRequest(messages, tools, asyncio.get_running_loop().create_future())
        session.in_flight = request
        session.queue.put_nowait(request)
        out = await request.response  # settled by the episode: a turn, its end, or the endpoint's close
        if isinstance(out, HTTPError):
            raise out
        return out

    async def _write(self, writer: asyncio.StreamWriter, status: int, body: dict, keep: bool) -> None:
        data = json.dumps(body).encode()
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\nConnection: {'keep-alive' if keep else 'close'}\r\n")
        if status == 401:
            head += "WWW-Authenticate: Bearer\r\n"
        writer.write(head.encode() + b"\r\n" + data)
        await asyncio.wait_for(writer.drain(), self.read_timeout)
