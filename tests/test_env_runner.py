"""The episode runner against bad environments: one that hangs is cut at its deadline while the
others go on; one that raises or returns something malformed ends its own episode with a
counted error and none of its tokens trained; loading errors name what is wrong."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from distflow.env import EpisodeRunner, StepResult, environment_factory, load_environment
from distflow.env.toy import ScriptedGenerate, build_chat_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("chat") / "tok")


class Echo:
    """Two turns: asks again after the first reply, done after the second (reward 1)."""

    def __init__(self, mode: str = "ok"):
        self.mode, self.turn = mode, 0

    async def reset(self, row):
        if row.get("reset") == "hang":
            await asyncio.sleep(3600)
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, reply):
        self.turn += 1
        mode = self.mode
        if mode == "hang" and self.turn == 1:
            await asyncio.sleep(3600)
        if mode == "stubborn" and self.turn == 1:  # swallows the cancellation and hangs on
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await asyncio.sleep(3600)
        if mode == "raise" and self.turn == 2:
            raise KeyError("lost the answer")
        if self.turn == 1:
            return StepResult([{"role": "user", "content": "sure?"}], None, False, {})
        return StepResult([], 1.0, True, {})


class SyncEcho:
    """The same with plain methods (run in worker threads); ``hang`` blocks its thread."""

    release = threading.Event()

    def __init__(self, mode: str = "ok"):
        self.mode, self.turn = mode, 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, reply):
        self.turn += 1
        if self.mode == "hang":
            self.release.wait(30)
        if self.mode == "slow":
            time.sleep(0.3)
        if self.turn == 1:
            return StepResult([{"role": "user", "content": "sure?"}], None, False, {})
        return StepResult([], 1.0, True, {})


def make_for(rows_modes: dict[str, str], cls=Echo):
    """A factory whose n-th environment gets the mode of the n-th episode (rows are started in order)."""
    modes = iter(rows_modes.values())
    return lambda: cls(next(modes))


SCRIPT = {f"q{i}": ["first", "second"] for i in range(6)}


@pytest.mark.parametrize("mode", ["hang", "stubborn", "sync_hang", "reset_hang"])
def test_hanging_environment_is_cut_at_its_deadline_while_others_continue(tok, mode):
    cls = SyncEcho if mode == "sync_hang" else Echo
    modes = {f"q{i}": "ok" for i in range(4)}
    modes["q1"] = {"sync_hang": "hang", "reset_hang": "ok"}.get(mode, mode)
    gen = ScriptedGenerate(tok, SCRIPT, delay=0.05)
    r = EpisodeRunner(tok, gen, make_for(modes, cls), env_timeout=1.0)
    rows = [{"prompt": k, **({"reset": "hang"} if mode == "reset_hang" and k == "q1" else {})} for k in modes]
    t0 = time.monotonic()
    eps = asyncio.run(r.run(rows))
    took = time.monotonic() - t0
    SyncEcho.release.set()
    assert took < 10, f"the run took {took:.1f} s: the hang was not cut"
    bad = eps[1]
    assert bad.stop_reason == "env_error" and "did not answer within 1 s" in bad.error
    assert bad.samples == [] and not bad.trained
    for ep in eps[:1] + eps[2:]:
        assert (ep.stop_reason, ep.turns, ep.reward, ep.trained) == ("done", 2, 1.0, True)
    assert (r.stats["env_errors"], r.stats["trained_episodes"], r.stats["stop_done"]) == (1, 3, 3)
    # the others generated their second turns while the hanging one was pending
    hang_start = min([t for k, _, _, t in gen.calls if k == "q1"] or [t for *_, t in gen.calls])
    assert any(k != "q1" and turn == 1 and hang_start <= t < hang_start + 1.0 for k, turn, _, t in gen.calls)
    SyncEcho.release.clear()


def test_raising_environment_is_a_counted_error_and_not_trained(tok):
    modes = {"q0": "ok", "q1": "raise", "q2": "ok"}
    r = EpisodeRunner(tok, ScriptedGenerate(tok, SCRIPT), make_for(modes))
    eps = asyncio.run(r.run([{"prompt": k} for k in modes]))
    assert eps[1].stop_reason == "env_error" and "raised KeyError: 'lost the answer'" in eps[1].error
    assert eps[1].turns == 2 and eps[1].samples == [] and not eps[1].trained  # it had sampled: still not trained
    assert [e.stop_reason for e in (eps[0], eps[2])] == ["done", "done"] and all(e.samples for e in (eps[0], eps[2]))
    assert r.stats["env_errors"] == 1 and r.stats["samples"] == 2


class Malformed:
    """step() returns what the row asks for."""

    def __init__(self):
        self.row = {}

    def reset(self, row):
        self.row = row
        return row.get("first", [{"role": "user", "content": row["prompt"]}])

    def step(self, reply):
        return self.row["out"]


@pytest.mark.parametrize("row, needle", [
    ({"out": "done"}, "returned str, expected a StepResult"),
    ({"out": {"messages": [], "done": "yes"}}, "done is str"),
    ({"out": {"messages": [], "done": True, "reward": float("nan")}}, "reward is nan"),
    ({"out": {"messages": [], "done": True, "score": 1}}, "unknown keys ['score']"),
    ({"out": {"messages": [{"role": "robot", "content": "x"}], "done": False}}, "role 'robot'"),
    ({"out": {"messages": [{"role": "user", "content": 3}], "done": False}}, "content of type int"),
    ({"out": {"messages": [], "done": False}}, "no messages and not done"),
    ({"out": {"messages": [], "done": True, "info": {"tool_calls": -1}}}, "info['tool_calls']"),
    ({"first": [], "out": None}, "reset() returned no messages"),
    ({"first": "hello", "out": None}, "reset() returned str"),
])
def test_malformed_results_are_named_errors(tok, row, needle):
    r = EpisodeRunner(tok, ScriptedGenerate(tok, {"q0": ["a", "b"]}), load_environment(Malformed))
    (ep,) = asyncio.run(r.run([{"prompt": "q0", **row}]))
    assert ep.stop_reason == "env_error" and needle in ep.error, ep.error
    assert ep.samples == [] and r.stats["env_errors"] == 1


def test_engine_failure_propagates(tok):
    async def boom(prompt, params):
        raise RuntimeError("engine died")

    r = EpisodeRunner(tok, boom, make_for({"q0": "ok"}))
    with pytest.raises(ExceptionGroup) as e:
        asyncio.run(r.run([{"prompt": "q0"}]))
    assert "engine died" in str(e.value.exceptions[0])


def test_sync_environment_does_not_block_the_loop_and_times_are_split(tok):
    modes = {"q0": "slow", "q1": "slow", "q2": "slow"}
    gen = ScriptedGenerate(tok, SCRIPT, delay=0.1)
    r = EpisodeRunner(tok, gen, make_for(modes, SyncEcho))
    t0 = time.monotonic()
    eps = asyncio.run(r.run([{"prompt": k} for k in modes]))
    took = time.monotonic() - t0
    assert all(e.stop_reason == "done" for e in eps)
    # serial would be 3 x (2 x 0.3 s env + 2 x 0.1 s generate) = 2.4 s
    assert took < 2.0, took
    for e in eps:
        assert e.env_time_s >= 0.55 and 0.18 <= e.generate_time_s < e.env_time_s
        m = e.metrics()
        assert m["turns"] == 2 and m["stop_reason"] == "done" and m["turn_lengths"] == e.turn_lengths
    assert r.stats["env_time_s"] >= 1.6 and r.stats["generate_time_s"] >= 0.5
    # the template's end of turn is a stop id of every turn, and is not in the reply the env saw
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end in r.params.stop_token_ids and eps[0].messages[1]["content"] == "first"


def test_max_concurrent_bounds_episodes_in_flight(tok):
    gen = ScriptedGenerate(tok, SCRIPT, delay=0.05)
    modes = {f"q{i}": "ok" for i in range(6)}
    r = EpisodeRunner(tok, gen, make_for(modes), max_concurrent=2)
    asyncio.run(r.run([{"prompt": k} for k in modes]))
    started = sorted((t, k) for k, turn, _, t in gen.calls if turn == 0)
    assert len(started) == 6 and started[2][0] - started[0][0] >= 0.09  # the third waited for a slot


class NoStep:
    def reset(self, row):
        return []


def test_a_tokenizer_without_a_chat_template_is_refused_at_once(tok):
    class Plain:
        chat_template = None

    with pytest.raises(ValueError, match="need a tokenizer with a chat template"):
        EpisodeRunner(Plain(), ScriptedGenerate(tok, SCRIPT), make_for({}))


def test_load_environment_errors_name_the_problem():
    with pytest.raises(ValueError, match="expected 'package.module:Name'"):
        load_environment("tests.test_env_runner.Echo")
    with pytest.raises(ValueError, match="cannot import module 'tests.nowhere'"):
        load_environment("tests.nowhere:Echo")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        load_environment("tests.test_env_runner:Nope")
    with pytest.raises(ValueError, match="has no step method"):
        load_environment("tests.test_env_runner:NoStep")
    with pytest.raises(ValueError, match=r"environment_args \['colour'\] do not fit"):
        load_environment("tests.test_env_runner:Echo", {"colour": "red"})
    make = load_environment("tests.test_env_runner:Echo", {"mode": "ok"})
    assert make() is not make() and make().mode == "ok"
    with pytest.raises(ValueError, match="either environment"):
        environment_factory("tests.test_env_runner:Echo", tools=["tests.test_env_episode:add"])
    with pytest.raises(ValueError, match="needs environment"):
        environment_factory()


def test_batched_generate_joins_concurrent_turns_into_engine_batches(tok):
    """The runner over a blocking batch engine (``generate(prompts, params, seed)``): the turns
    requested while it is busy form its next batch; its failure reaches every request."""
    from distflow.env.batching import BatchedGenerate

    scripted = ScriptedGenerate(tok, SCRIPT)
    sizes = []

    def engine_generate(prompts, params, seed):
        sizes.append(len(prompts))
        time.sleep(0.05)
        return [asyncio.run(scripted(p, params)) for p in prompts]

    batched = BatchedGenerate(engine_generate, seed=7, max_batch=4)
    modes = {f"q{i}": "ok" for i in range(6)}
    r = EpisodeRunner(tok, batched, make_for(modes))
    eps = asyncio.run(r.run([{"prompt": k} for k in modes]))
    assert all(e.stop_reason == "done" and e.turns == 2 for e in eps)
    assert sum(sizes) == 12 and max(sizes) == 4 and len(sizes) <= 5 and batched.batches == len(sizes)

    def broken(prompts, params, seed):
        raise RuntimeError("engine died")

    r = EpisodeRunner(tok, BatchedGenerate(broken), make_for({"q0": "ok"}))
    with pytest.raises(ExceptionGroup):
        asyncio.run(r.run([{"prompt": "q0"}]))
