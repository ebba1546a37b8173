"""The agent endpoint (issue 35 item 6): an OpenAI-style agent drives an episode over real HTTP
(urllib, http.client, real sockets) while the node records exactly the tokens it sampled; bad
requests get 4xx JSON errors; a failing agent is a counted env error; a budget still lets the
agent score; `agent:` in a one-step real run of the tool toy task."""

from __future__ import annotations

import asyncio
import http.client
import json
import math

import pytest
import yaml

from distflow.env import EpisodeRunner, render_prompt
from distflow.env.agent import AgentClient, EpisodeOver, agent_factory
from distflow.env.api import in_thread
from distflow.env.endpoint import ChatEndpoint
from distflow.env.toy import HERMES_TEMPLATE, ScriptedGenerate, build_chat_tokenizer

# The toy Hermes template, its assistant turns rendering OpenAI tool_calls as Qwen2.5's does
# (`<tool_call>\n{"name": ..., "arguments": <tojson>}\n</tool_call>`), so that a conversation the
# agent sends back with the parsed calls re-renders to the tokens the model sampled.
QWEN_LIKE = HERMES_TEMPLATE.replace(
    "assistant\n{{ m.content }}<|im_end|>",
    "assistant\n{% if m.content %}{{ m.content }}{% endif %}{% for tc in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>")
assert QWEN_LIKE != HERMES_TEMPLATE
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
SYSTEM = {"role": "system", "content": "You add."}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("agent-tok"), template=QWEN_LIKE)


def _run(tok, gen, agent, rows, **kw):
    async def go():
        endpoint = await ChatEndpoint(model="toy").start()
        try:
            runner = EpisodeRunner(tok, gen, agent_factory(agent, endpoint), **{"env_timeout": 5.0, **kw})
            return await runner.run(rows), endpoint
        finally:
            await endpoint.close()
    return asyncio.run(go())


def _http(client: AgentClient, method: str, path: str, body: bytes | None, token: str | None,
          **extra: str) -> tuple[int, dict]:
    host, port = client.base_url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {}),
                   **extra}
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


async def two_turn_agent(row, client):
    """Asks, gets a tool call, answers it, gets the final reply; then probes the endpoint's errors."""
    messages = [SYSTEM, {"role": "user", "content": row["prompt"]}]
    first = await client.chat(messages, tools=[ADD], temperature=0.3)  # sampling keys are the run's: ignored
    call = first["choices"][0]["message"]
    messages += [call, {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "3"}]
    second = await client.chat(messages, tools=[ADD])
    row["responses"] += [first, second]
    good = json.dumps({"messages": messages}).encode()
    for name, args in (("wrong_token", ("POST", "/v1/chat/completions", good, "not-the-key")),
                       ("no_token", ("POST", "/v1/chat/completions", good, None)),
                       ("malformed", ("POST", "/v1/chat/completions", b'{"messages": [', client.api_key)),
                       ("no_messages", ("POST", "/v1/chat/completions", b'{"model": "toy"}', client.api_key)),
                       ("bad_role", ("POST", "/v1/chat/completions",
                                     json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(),
                                     client.api_key)),
                       ("stream", ("POST", "/v1/chat/completions",
                                   json.dumps({"messages": messages, "stream": True}).encode(), client.api_key)),
                       ("models", ("GET", "/v1/models", None, client.api_key)),
                       ("get_chat", ("GET", "/v1/chat/completions", None, client.api_key)),
                       ("nowhere", ("POST", "/v2/anything", good, client.api_key))):
        row["probes"][name] = await in_thread(_http, client, *args)
    row["probes"]["expect"] = await in_thread(_http, client, "POST", "/v1/chat/completions", b"[1, 2]",
                                              client.api_key, Expect="100-continue")  # as curl sends
    return 1.0


def test_two_turns_over_http_record_exactly_the_sampled_tokens_and_mask(tok):
    gen = ScriptedGenerate(tok, {"1+2": [CALL, "The sum is 3."]})
    row = {"prompt": "1+2", "responses": [], "probes": {}}
    (ep,), endpoint = _run(tok, gen, two_turn_agent, [row])
    assert ep.stop_reason == "done" and ep.error is None and ep.reward == 1.0
    assert (ep.turns, ep.tool_calls, ep.tool_errors, ep.splits, len(ep.samples)) == (2, 1, 0, 0, 1)
    first, second = row["responses"]
    msg = first["choices"][0]["message"]
    assert first["choices"][0]["finish_reason"] == "tool_calls" and first["model"] == "toy"
    assert msg["content"] is None and len(msg["tool_calls"]) == 1
    assert msg["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert second["choices"][0] == {"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": "The sum is 3."}}
    # the exact token ids: the first prompt, turn 1 as sampled, what the template added, turn 2 as sampled
    p1 = render_prompt(tok, [SYSTEM, {"role": "user", "content": "1+2"}], [ADD])
    t1, t2 = gen.reply_ids("1+2", 0), gen.reply_ids("1+2", 1)
    assert [c[2] for c in gen.calls][0] == p1
    p2 = gen.calls[1][2]  # what the runner rendered from the agent's second request
    assert p2[:len(p1) + len(t1)] == p1 + t1  # it extends the context token for token: no split
    added = p2[len(p1) + len(t1):]
    assert tok.decode(added, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    (s,) = ep.samples
    assert s.tokens == p1 + t1 + added + t2 and s.prompt_len == len(p1)
    assert s.loss_mask == [0] * len(p1) + [1] * len(t1) + [0] * len(added) + [1] * len(t2)
    assert s.logprobs == [0.0] * len(p1) + gen.logprobs(0, len(t1)) + [0.0] * len(added) + gen.logprobs(1, len(t2))
    assert tok.convert_ids_to_tokens(t1[:1] + t1[-1:]) == ["<tool_call>", "<|im_end|>"]
    # the endpoint's errors: 4xx JSON naming the problem, the episode untouched
    probes = row["probes"]
    assert probes["wrong_token"][0] == 401 and probes["wrong_token"][1]["error"]["code"] == "invalid_api_key"
    assert probes["no_token"][0] == 401
    assert probes["malformed"][0] == 400 and probes["malformed"][1]["error"]["code"] == "invalid_json"
    assert probes["no_messages"][0] == 400 and "messages" in probes["no_messages"][1]["error"]["message"]
    assert probes["bad_role"][0] == 400 and "'robot'" in probes["bad_role"][1]["error"]["message"]
    assert probes["stream"][0] == 400 and probes["stream"][1]["error"]["param"] == "stream"
    assert probes["models"] == (200, {"object": "list", "data": [{"id": "toy", "object": "model", "created": 0,
                                                                  "owned_by": "distflow"}]})
    assert probes["get_chat"][0] == 405 and probes["nowhere"][0] == 404
    assert probes["expect"][0] == 400 and "JSON list" in probes["expect"][1]["error"]["message"]
    assert len(gen.calls) == 2  # no probe reached the engine
    assert endpoint.sessions == {}  # the episode's token is dead once it ended


async def rewriting_agent(row, client):
    """Sends a second request whose history is not the first one's: the template no longer extends."""
    await client.chat([{"role": "user", "content": row["prompt"]}])
    await client.chat([{"role": "user", "content": row["prompt"] + " again"}, {"role": "assistant", "content": "x"},
                       {"role": "user", "content": "go"}])
    return 0.25


async def raising_agent(row, client):
    await client.chat([{"role": "user", "content": row["prompt"]}])
    raise RuntimeError("the harness broke")


async def wordy_agent(row, client):
    await client.chat([{"role": "user", "content": row["prompt"]}])
    return "great"


async def hanging_agent(row, client):
    await client.chat([{"role": "user", "content": row["prompt"]}])
    await asyncio.sleep(60)


async def silent_agent(row, client):
    return 1.0


async def persistent_agent(row, client):
    """Keeps talking past max_turns; catches the end of the episode when it is told so, and scores."""
    messages = [{"role": "user", "content": row["prompt"]}]
    try:
        for _ in range(5):
            reply = (await client.chat(messages))["choices"][0]["message"]
            messages += [reply, {"role": "user", "content": "more"}]
    except EpisodeOver as e:
        row["over"] = (e.status, e.code, str(e))
        return 0.5 if row["prompt"] == "catch" else math.nan
    return 0.0


def test_a_rewritten_history_splits_counted_and_trains_each_sampled_turn(tok):
    gen = ScriptedGenerate(tok, {"hi": ["ok", "fine"]})
    (ep,), _ = _run(tok, gen, rewriting_agent, [{"prompt": "hi"}])
    assert ep.stop_reason == "done" and ep.reward == 0.25 and ep.splits == 1 and len(ep.samples) == 2
    for s, turn in zip(ep.samples, (0, 1)):
        assert s.response_tokens == gen.reply_ids("hi", turn) and s.response_mask == [1] * len(s.response_tokens)
        assert s.tokens[:s.prompt_len] == gen.calls[turn][2]


def test_failing_agents_are_counted_env_errors_with_no_samples(tok):
    gen = ScriptedGenerate(tok, {k: ["ok", "ok"] for k in ("raise", "word", "hang", "quiet")})
    for agent, key, error in ((raising_agent, "raise", "raised RuntimeError: the harness broke"),
                              (wordy_agent, "word", "returned 'great', expected a finite float reward"),
                              (hanging_agent, "hang", "did not answer within 0.5 s"),
                              (silent_agent, "quiet", "returned without asking the model anything")):
        (ep,), endpoint = _run(tok, gen, agent, [{"prompt": key}], env_timeout=0.5)
        assert ep.stop_reason == "env_error" and error in ep.error and ep.samples == [] and not ep.trained, agent
        assert endpoint.sessions == {}


def test_a_budget_ends_the_episode_the_agent_is_told_and_still_scores(tok):
    gen = ScriptedGenerate(tok, {"catch": ["a", "b"], "nan": ["a", "b"]})
    rows = [{"prompt": "catch"}, {"prompt": "nan"}]
    caught, nan = _run(tok, gen, persistent_agent, rows, max_turns=1)[0]
    assert caught.stop_reason == "max_turns" and caught.trained and caught.reward == 0.5
    assert rows[0]["over"][:2] == (400, "episode_over") and "max_turns" in rows[0]["over"][2]
    assert caught.samples[0].response_tokens == gen.reply_ids("catch", 0)
    assert nan.stop_reason == "env_error" and "nan" in nan.error  # the reward after the budget is checked too
    # a turn cut at max_new_tokens still goes back to the agent (finish_reason: length), then the end
    cut = ScriptedGenerate(tok, {"catch": ["abcdef", "b"]})
    row = {"prompt": "catch"}
    (ep,), _ = _run(tok, cut, persistent_agent, [row], max_new_tokens=3)
    assert ep.stop_reason == "length" and ep.truncated and ep.reward == 0.5 and row["over"][1] == "episode_over"
    assert ep.samples[0].response_tokens == cut.reply_ids("catch", 0)[:3]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    from distflow.toy import ensure_toy_model

    return ensure_toy_model(tmp_path_factory.mktemp("tool-model") / "m", kind="tool")


def test_agent_key_in_a_one_step_real_run(tool_model, tmp_path):
    """examples/tool_quickstart.yaml with `agent: distflow.env.toy_tasks:lookup_agent` instead of its
    environment: one step through the step functions, the real torch engine on the tiny model."""
    from distflow.core.config import read_raw
    from distflow.step import synchronous_run
    from tests.conftest import ROOT
    from tests.process_group import process_group, store_path

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(f'{{"prompt": "{i:04d}", "secret": "{i % 10}"}}\n' for i in range(8)))
    raw = read_raw(ROOT / "examples" / "tool_quickstart.yaml")
    for key in ("environment", "environment_args"):
        raw.pop(key)
    raw.update(agent="distflow.env.toy_tasks:lookup_agent", model_path=str(tool_model), toy_model=False,
               dataset=str(data), prompts_per_step=4, group_size=2, rollout_nodes=1, trainer_nodes=1,
               micro_batch_size=8, output_dir=str(tmp_path / "o"), env_timeout_s=20)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    from distflow.core.config import load_config

    cfg = load_config(path)
    with process_group(store_path(tmp_path)):
        row = next(synchronous_run(cfg, 1))
    assert row["episodes"] == 8 and row["env_errors"] == 0 and row["trained_episodes"] == 8, row
    assert row["samples"] >= 8 and math.isfinite(row["loss"]) and 0 < row["tokens"] <= row["episode_sampled_tokens"]


async def sync_looking_agent(row):  # one parameter: not (row, client)
    return 1.0


def test_agent_config_is_checked_before_any_node_starts(tool_model):
    """`agent` pairs with fn: episodes only, excludes environment and tools, and is imported and
    checked (an async def (row, client)) by preflight, each error naming the key."""
    from distflow.core.config import ConfigError, load_config
    from distflow.launch.preflight import check_functions
    from tests.conftest import ROOT

    base = [f"model_path={tool_model}", "toy_model=false", "environment=null"]
    example = ROOT / "examples" / "tool_quickstart.yaml"
    cfg = load_config(example, base + ["agent=distflow.env.toy_tasks:lookup_agent"])
    assert (cfg.agent, cfg.agent_host, cfg.agent_port) == ("distflow.env.toy_tasks:lookup_agent", "127.0.0.1", 0)
    check_functions(cfg)
    with pytest.raises(ConfigError, match=r"agent: .* remove environment"):
        load_config(example, [f"model_path={tool_model}", "toy_model=false", "agent=distflow.env.toy_tasks:lookup_agent"])
    with pytest.raises(ConfigError, match=r"agent: .* remove tools"):
        load_config(example, base + ["agent=distflow.env.toy_tasks:lookup_agent", "tools=[distflow.env.sandbox:python]"])
    with pytest.raises(ConfigError, match=r"agent: set, but no generate node runs episodes"):
        load_config(example, base + ["agent=distflow.env.toy_tasks:lookup_agent", "workflow.0.fn=generate"])
    with pytest.raises(ConfigError, match=r"agent: agent 'distflow.env.toy_tasks:LookupEnv' must be an async def"):
        check_functions(load_config(example, base + ["agent=distflow.env.toy_tasks:LookupEnv"]))
    with pytest.raises(ConfigError, match=r"agent: agent 'tests.test_env_agent:sync_looking_agent' must take \(row, "
                                          r"client\)"):
        check_functions(load_config(example, base + ["agent=tests.test_env_agent:sync_looking_agent"]))
    with pytest.raises(ConfigError, match=r"agent: agent 'distflow.env.toy_tasks:nope'.* no attribute 'nope'"):
        check_functions(load_config(example, base + ["agent=distflow.env.toy_tasks:nope"]))


def test_the_gsm8k_python_tool_example_validates():
    """examples/gsm8k_python_tool.yaml loads and its tool and reward resolve (no model: running it
    needs the instruction model and GPUs, see its header)."""
    from distflow.core.config import load_config
    from distflow.launch.preflight import check_functions
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "examples" / "gsm8k_python_tool.yaml")
    check_functions(cfg)
    assert cfg.tools == ["distflow.env.sandbox:python"] and cfg.agent is None
    assert [n.fn for n in cfg.workflow] == ["episodes", "gsm8k", "grpo", "grpo"]
    assert cfg.environment_args["prompt_key"] == "question" and cfg.device == "cuda"
    assert cfg.model_path.endswith("Qwen2.5-1.5B-Instruct")


def test_a_client_stalling_mid_request_is_cut_at_the_read_deadline():
    """Half a body, then silence: the endpoint closes the connection at read_timeout, and the
    next client is served (a 401 JSON answer)."""
    import socket
    import time

    async def go():
        endpoint = await ChatEndpoint(read_timeout=0.3).start()
        try:
            def stall() -> tuple[bytes, float]:
                with socket.create_connection(("127.0.0.1", endpoint.port), timeout=5) as s:
                    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
                    t0 = time.monotonic()
                    return s.recv(100), time.monotonic() - t0
            data, waited = await in_thread(stall)
            status = await in_thread(_http, AgentClient(endpoint.base_url, "x"), "GET", "/v1/models", None, "x")
            return data, waited, status
        finally:
            await endpoint.close()

    data, waited, status = asyncio.run(go())
    assert data == b"" and 0.25 < waited < 3  # closed, no answer, at the deadline
    assert status[0] == 401 and status[1]["error"]["type"] == "authentication_error"


async def impatient_agent(row, client):
    """Two requests at once: one is the turn, the other is refused (409), the episode goes on."""
    from distflow.env.agent import EndpointError

    messages = [{"role": "user", "content": row["prompt"]}]
    out = await asyncio.gather(client.chat(messages), client.chat(messages), return_exceptions=True)
    row["outcomes"] = sorted("409 " + e.code if isinstance(e, EndpointError) else e["choices"][0]["message"]["content"]
                             for e in out)
    row["client"] = client
    return 1.0


def test_one_turn_at_a_time_and_a_dead_token_after_the_episode(tok):
    gen = ScriptedGenerate(tok, {"both": ["one", "two"]}, delay=0.5)  # the turn is in flight when the other comes
    row = {"prompt": "both"}

    async def go():
        endpoint = await ChatEndpoint().start()
        try:
            runner = EpisodeRunner(tok, gen, agent_factory(impatient_agent, endpoint), env_timeout=5.0)
            (ep,) = await runner.run([row])
            late = await in_thread(_http, row["client"], "GET", "/v1/models", None, row["client"].api_key)
            return ep, late
        finally:
            await endpoint.close()

    ep, late = asyncio.run(go())
    assert row["outcomes"] == ["409 turn_in_flight", "one"] and len(gen.calls) == 1
    assert ep.stop_reason == "done" and ep.reward == 1.0 and ep.samples[0].response_tokens == gen.reply_ids("both", 0)
    assert late[0] == 401  # the episode's api_key died with it
