"""Tools from plain functions: schemas from signatures and docstrings, Hermes tool-call parsing
(malformed calls are error observations), concurrent execution with per-call deadlines."""

from __future__ import annotations

import asyncio
import time
from typing import Literal, Optional

import pytest

from distflow.env import ToolEnvironment, function_schema, parse_tool_calls, run_tool_calls
from distflow.env.tools import Tool, parse_docstring, resolve_tools


def search(query: str, limit: Optional[int] = None, tags: list[str] = (), mode: Literal["fast", "deep"] = "fast",
           weights: dict | None = None, *rest, **extra) -> list:
    """Search the notes.

    Longer text that is not the description's first paragraph.

    Args:
        query (str): what to look for,
            over two lines.
        limit: at most this many.
        mode: how hard to look.

    Returns:
        the hits.
    """
    return []


def numpy_style(x: float, ys: tuple[int, ...]) -> float:
    """Scale things.

    Parameters
    ----------
    x : float
        The factor,
        continued.
    ys : tuple of int
        The values.

    Returns
    -------
    float
    """
    return x


def test_schema_from_signature_and_google_docstring():
    f = function_schema(search)["function"]
    assert f["name"] == "search" and f["description"] == "Search the notes."
    p = f["parameters"]
    assert p["type"] == "object" and p["required"] == ["query"]
    assert p["properties"] == {
        "query": {"type": "string", "description": "what to look for, over two lines."},
        "limit": {"type": "integer", "description": "at most this many."},
        "tags": {"type": "array", "items": {"type": "string"}},
        "mode": {"enum": ["fast", "deep"], "type": "string", "description": "how hard to look.", "default": "fast"},
        "weights": {"type": "object"},
    }


def test_schema_from_numpy_docstring():
    f = function_schema(numpy_style)["function"]
    assert f["description"] == "Scale things."
    assert f["parameters"]["properties"] == {
        "x": {"type": "number", "description": "The factor, continued."},
        "ys": {"type": "array", "items": {"type": "integer"}, "description": "The values."},
    }
    assert parse_docstring(None) == ("", {})


def test_parse_hermes_calls_and_malformed_ones():
    text = ('Let me look. <tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
            "<tool_call>{'name': 'add'}</tool_call>"
            '<tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a"')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [("search", {"query": "x"}, True),
                                                                           ("add", {"a": 1}, True)]
    assert "not valid JSON" in calls[2].error
    assert "must be a JSON object" in calls[3].error
    assert "arguments must be a JSON object" in calls[4].error
    assert "not closed" in calls[5].error
    assert parse_tool_calls("no calls here") == []


async def slow(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long.
    """
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


def sync_slow(seconds: float) -> dict:
    """Sleep in a thread.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return {"slept": seconds}


def fails(x: int) -> int:
    """Divide by zero."""
    return x // 0


def test_calls_run_concurrently_each_with_its_deadline():
    tools = resolve_tools([slow, sync_slow, fails])
    calls = parse_tool_calls(
        '<tool_call>{"name": "slow", "arguments": {"seconds": 1.0}}</tool_call>'
        '<tool_call>{"name": "sync_slow", "arguments": {"seconds": 1.0}}</tool_call>'
        '<tool_call>{"name": "slow", "arguments": {"seconds": 30}}</tool_call>'
        '<tool_call>{"name": "fails", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "slow", "arguments": {"secs": 1}}</tool_call>'
        '<tool_call>not json</tool_call>')
    t0 = time.monotonic()
    msgs, errors = asyncio.run(run_tool_calls(calls, tools, timeout=1.5))
    took = time.monotonic() - t0
    assert took < 3.0, took  # concurrent: about 1.5 s, not 1 + 1 + 1.5
    assert [m["name"] for m in msgs] == ["slow", "sync_slow", "slow", "fails", "nope", "slow", "invalid_tool_call"]
    assert all(m["role"] == "tool" for m in msgs)
    assert msgs[0]["content"] == "slept 1.0" and msgs[1]["content"] == '{"slept": 1.0}'
    assert msgs[2]["content"] == "Error: slow timed out after 1.5 s"
    assert msgs[3]["content"] == "Error: fails raised ZeroDivisionError: integer division or modulo by zero"
    assert msgs[4]["content"].startswith("Error: unknown tool 'nope'; the tools are")
    assert msgs[5]["content"].startswith("Error: bad arguments for slow:")
    assert msgs[6]["content"].startswith("Error: the tool call is not valid JSON")
    assert errors == 5


def test_tool_environment_turns_malformed_calls_into_observations():
    env = ToolEnvironment([slow], system_prompt="sys", max_calls_per_turn=1, reward=lambda reply, row: 1.0 * (
        reply == row["answer"]))
    assert env.tools == [function_schema(slow)]
    first = asyncio.run(env.reset({"prompt": "hi", "answer": "42"}))
    assert first == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    r = asyncio.run(env.step('<tool_call>{"name": "slow", "arguments": {"seconds": 0}}</tool_call>'
                             '<tool_call>{"name": "slow", "arguments": {"seconds": 0}}</tool_call>'))
    assert not r.done and r.info == {"tool_calls": 2, "tool_errors": 1}
    assert r.messages[1]["content"] == "Error: more than 1 tool calls in one turn"
    r = asyncio.run(env.step("<tool_call>{oops</tool_call>"))
    assert not r.done and r.messages[0]["content"].startswith("Error: the tool call is not valid JSON")
    r = asyncio.run(env.step("42"))
    assert r.done and r.reward == 1.0 and r.messages == []


def test_tools_by_name_and_their_errors():
    assert Tool.of("tests.test_env_tools:fails").name == "fails"
    with pytest.raises(ValueError, match="has no attribute"):
        Tool.of("tests.test_env_tools:missing")
    with pytest.raises(ValueError, match="two tools are named 'fails'"):
        resolve_tools([fails, "tests.test_env_tools:fails"])
    with pytest.raises(ValueError, match="not a function"):
        Tool.of("tests.test_env_tools:__doc__")


def test_the_package_imports_without_torch_or_transformers():
    """The building blocks are pure: a rollout process pays for torch only where it needs it."""
    import subprocess
    import sys

    code = ("import sys, distflow.env, distflow.env.toy; "
            "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
