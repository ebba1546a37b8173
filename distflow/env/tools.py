"""Tools from plain Python functions: their JSON schemas, the model's tool calls, running them.

Why it exists: most agentic tasks are "a model with a few tools". Rather than each user
writing an environment that parses tool calls, this module turns functions named in the
config (``tools: [package.module:function, ...]``) into

* a JSON schema each (:func:`function_schema`: types from the annotations, including
  ``Optional``, ``list[...]``, ``dict``, ``Literal``; descriptions from a Google- or
  NumPy-style docstring), which the chat template renders into the system prompt
  (``apply_chat_template(messages, tools=[schema, ...])``);
* a parser of the calls the model writes (:func:`parse_tool_calls`, the Qwen / Hermes format
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``): a malformed call is not an
  exception but a :class:`ToolCall` with an ``error``, which goes back to the model as an
  observation (it can learn to fix it);
* :func:`run_tool_calls`: the calls of one turn run concurrently, each with its own deadline;
  results and errors come back as ``{"role": "tool", "name": ..., "content": ...}`` messages.

:class:`ToolEnvironment` puts them together as an environment (:mod:`distflow.env.api`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence, Union

from distflow.env.api import StepResult, deadline, in_thread, load_object

__all__ = ["Tool", "ToolCall", "ToolEnvironment", "function_schema", "parse_docstring", "parse_tool_calls",
           "run_tool_calls", "resolve_tools"]

_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def _type_schema(tp: Any) -> dict:
    """JSON schema of one annotation. Unknown types give ``{}`` (any value) rather than an error:
    the schema only guides the model; the call's arguments are bound to the real signature."""
    if tp is inspect.Parameter.empty or tp is Any:
        return {}
    if tp in _SIMPLE:
        return {"type": _SIMPLE[tp]}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        kinds = {_SIMPLE.get(type(a)) for a in args}
        out: dict = {"enum": list(args)}
        if len(kinds) == 1 and None not in kinds:
            out["type"] = kinds.pop()
        return out
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:  # Optional[X]: X (nullability is told by "required", the usual convention)
            return _type_schema(rest[0])
        return {"anyOf": [_type_schema(a) for a in args]}
    if tp in (list, tuple, set, frozenset) or origin in (list, tuple, set, frozenset, Sequence,
                                                         typing.get_origin(Sequence[int])):
        items = args[0] if args and (origin is not tuple or len(args) == 2 and args[1] is Ellipsis) else None
        return {"type": "array", **({"items": _type_schema(items)} if items is not None else {})}
    if tp is dict or origin is dict:
        return {"type": "object"}
    return {}


_ENTRY = re.compile(r"^\*{0,2}(\w+)\s*(?:\(([^)]*)\))?\s*(?::\s*(.*))?$")
_PARAM_SECTIONS = ("args", "arguments", "parameters", "params", "keyword args", "other parameters")
_SECTIONS = _PARAM_SECTIONS + ("returns", "return", "raises", "yields", "examples", "example", "notes", "note",
                               "see also", "references", "attributes", "warnings")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) of a Google-style (``Args:`` then ``name (type): text``)
    or NumPy-style (``Parameters`` underlined with dashes, then ``name : type`` and indented
    text) docstring. The description is the first paragraph before any section."""
    lines = inspect.cleandoc(doc or "").splitlines()
    desc: list[str] = []
    params: dict[str, str] = {}
    section, numpy, base, current = None, False, None, None
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        underlined = i + 1 < len(lines) and len(lines[i + 1].strip()) >= 3 and set(lines[i + 1].strip()) == {"-"}
        head = stripped.rstrip(":").lower()
        if head in _SECTIONS and (stripped.endswith(":") or underlined):
            section, numpy, base, current = head, underlined, None, None
            i += 2 if underlined else 1
            continue
        if section is None:
            desc.append(stripped)
        elif section in _PARAM_SECTIONS and stripped:
            indent = len(lines[i]) - len(lines[i].lstrip())
            base = indent if base is None else base
            m = _ENTRY.match(stripped) if indent <= base else None
            if m:
                current = m.group(1)
                params[current] = "" if numpy else (m.group(3) or "").strip()
            elif current is not None:
                params[current] = (params[current] + " " + stripped).strip()
        i += 1
    paragraphs = [" ".join(p.split()) for p in "\n".join(desc).split("\n\n") if p.strip()]
    return (paragraphs[0] if paragraphs else ""), params


def function_schema(fn: Callable[..., Any], name: str | None = None) -> dict:
    """The OpenAI / Hugging Face tool schema of ``fn``:
    ``{"type": "function", "function": {"name", "description", "parameters": {...}}}``.
    Parameters without a default are ``required``; ``*args`` / ``**kwargs`` are not described."""
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: fall back to what is written
        hints = {}
    desc, param_docs = parse_docstring(inspect.getdoc(fn))
    props, required = {}, []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        schema = _type_schema(hints.get(p.name, p.annotation))
        if param_docs.get(p.name):
            schema["description"] = param_docs[p.name]
        if p.default is p.empty:
            required.append(p.name)
        elif p.default is not None and isinstance(p.default, (str, int, float, bool)):
            schema["default"] = p.default
        props[p.name] = schema
    return {"type": "function", "function": {
        "name": name or fn.__name__, "description": desc,
        "parameters": {"type": "object", "properties": props, "required": required}}}


@dataclass
class Tool:
    """A callable the model may call by ``name``, with its schema."""

    name: str
    fn: Callable[..., Any]
    schema: dict = field(default_factory=dict)

    @classmethod
    def of(cls, fn: Callable[..., Any] | str | Tool) -> Tool:
        if isinstance(fn, Tool):
            return fn
        f = load_object(fn, "tool") if isinstance(fn, str) else fn
        if not callable(f):
            raise ValueError(f"tool {fn!r} is a {type(f).__name__}, not a function")
        schema = function_schema(f)
        return cls(schema["function"]["name"], f, schema)


def resolve_tools(specs: Sequence[Callable[..., Any] | str | Tool]) -> dict[str, Tool]:
    """``tools: [module:function, ...]`` (or the functions) by name; two tools of one name are refused."""
    out: dict[str, Tool] = {}
    for s in specs:
        t = Tool.of(s)
        if t.name in out:
            raise ValueError(f"two tools are named {t.name!r} ({s!r} and an earlier one)")
        out[t.name] = t
    return out


@dataclass
class ToolCall:
    """One call the model wrote: ``name`` and ``arguments``, or ``error`` when it is malformed
    (then ``raw`` is the text of the call, for the error observation)."""

    name: str = ""
    arguments: dict = field(default_factory=dict)
    error: str | None = None
    raw: str = ""


_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The Hermes / Qwen tool calls in ``text``: each ``<tool_call>`` ... ``</tool_call>`` block holds
    one JSON object ``{"name": str, "arguments": object}`` (``arguments`` may also be a JSON string
    of an object, as OpenAI writes it). A block that is not closed, not JSON, or without a string
    ``name`` is a ToolCall with ``error`` set. No block: []."""
    calls = []
    for m in _CALL.finditer(text):
        body = m.group(1).strip()
        closed = m.group(0).endswith("</tool_call>")
        if not closed:
            calls.append(ToolCall(error="a <tool_call> block is not closed with </tool_call>", raw=body))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(error=f"the tool call is not valid JSON ({e.msg} at char {e.pos})", raw=body))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            calls.append(ToolCall(error='a tool call must be a JSON object {"name": str, "arguments": object}',
                                  raw=body))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(name=obj["name"], error="the tool call's arguments must be a JSON object",
                                  raw=body))
            continue
        calls.append(ToolCall(name=obj["name"], arguments=args, raw=body))
    return calls


def _content(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters cut]"


async def _run_one(call: ToolCall, tools: dict[str, Tool], timeout: float | None, limit: int) -> tuple[dict, bool]:
    """(tool message, ok) of one call. Every failure is an observation for the model."""
    name = call.name or "invalid_tool_call"
    if call.error is not None:
        return {"role": "tool", "name": name, "content": f"Error: {call.error}"}, False
    tool = tools.get(call.name)
    if tool is None:
        return {"role": "tool", "name": name,
                "content": f"Error: unknown tool {call.name!r}; the tools are {sorted(tools)}"}, False
    try:
        inspect.signature(tool.fn).bind(**call.arguments)
    except TypeError as e:
        return {"role": "tool", "name": name, "content": f"Error: bad arguments for {call.name}: {e}"}, False
    try:
        if inspect.iscoroutinefunction(tool.fn):
            coro = tool.fn(**call.arguments)
        else:
            coro = in_thread(tool.fn, **call.arguments)
        result = await deadline(coro, timeout)
        if inspect.isawaitable(result):
            result = await deadline(result, timeout)
    except asyncio.TimeoutError:
        return {"role": "tool", "name": name, "content": f"Error: {call.name} timed out after {timeout:g} s"}, False
    except Exception as e:
        return {"role": "tool", "name": name, "content": f"Error: {call.name} raised {type(e).__name__}: {e}"}, False
    return {"role": "tool", "name": name, "content": _content(result, limit)}, True


async def run_tool_calls(calls: Sequence[ToolCall], tools: dict[str, Tool], *, timeout: float | None = 10.0,
                         max_output_chars: int = 4000) -> tuple[list[dict], int]:
    """Run ``calls`` concurrently, each cut at ``timeout`` seconds. Returns (one tool message per
    call, in call order; the number of calls that failed)."""
    done = await asyncio.gather(*(_run_one(c, tools, timeout, max_output_chars) for c in calls))
    return [m for m, _ in done], sum(not ok for _, ok in done)


class ToolEnvironment:
    """The built-in tool environment: the row's prompt as the user turn, the tools' schemas to the
    template; each reply's tool calls are run and their results returned as tool messages; a reply
    without a tool call ends the episode (scored by ``reward``, or left unscored (None) for the
    rollout's reward stage). Over ``max_calls_per_turn`` calls, the extra ones are errors.

    Args:
        tools: the functions, as ``module:function`` names or callables.
        system_prompt: an optional system message.
        prompt_key: the row's key holding the prompt text (or a list of chat messages).
        tool_timeout: seconds each call may take.
        reward: optional ``module:function`` (or callable) ``fn(final_reply, row) -> float``.
    """

    def __init__(self, tools: Sequence[Callable[..., Any] | str], system_prompt: str | None = None,
                 prompt_key: str = "prompt", tool_timeout: float = 10.0, max_calls_per_turn: int = 8,
                 max_output_chars: int = 4000, reward: Callable[[str, dict], float] | str | None = None):
        self.by_name = resolve_tools(tools)
        self.tools = [t.schema for t in self.by_name.values()]
        self.system_prompt, self.prompt_key = system_prompt, prompt_key
        self.tool_timeout, self.max_calls, self.max_output_chars = tool_timeout, max_calls_per_turn, max_output_chars
        self.reward = load_object(reward, "reward") if isinstance(reward, str) else reward
        self.row: dict = {}

    async def reset(self, row: dict) -> list[dict]:
        self.row = row
        prompt = row.get(self.prompt_key)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        if isinstance(prompt, str):
            return messages + [{"role": "user", "content": prompt}]
        if isinstance(prompt, list):
            return messages + list(prompt)
        raise ValueError(f"row key {self.prompt_key!r} is {type(prompt).__name__}, expected str or a list of messages")

    async def step(self, reply: str) -> StepResult:
        calls = parse_tool_calls(reply)
        if not calls:
            score = None if self.reward is None else float(await in_thread(self.reward, reply, self.row))
            return StepResult([], score, True, {"tool_calls": 0, "tool_errors": 0})
        for c in calls[self.max_calls:]:
            c.error = f"more than {self.max_calls} tool calls in one turn"
        messages, errors = await run_tool_calls(calls, self.by_name, timeout=self.tool_timeout,
                                                max_output_chars=self.max_output_chars)
        return StepResult(messages, None, False, {"tool_calls": len(calls), "tool_errors": errors})
