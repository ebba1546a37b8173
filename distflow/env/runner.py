"""The episode runner: many multi-turn episodes in flight on one asyncio loop.

Why it exists: a multi-turn episode alternates between the engine (generate a turn) and the
environment (tools, a simulated user). Run one episode at a time and the engine idles during
every tool call; run them on threads and a hanging environment holds a thread forever. Here
each episode is a coroutine: while one waits for its environment, the others generate. Each
turn calls the ``generate(prompt_ids, params) -> Completion`` it is given (async, or plain);
the engine integration will hand it a function that joins concurrent requests into continuous
batches, so the runner never knows how generation is scheduled.

Per episode: one fresh environment (:func:`distflow.env.api.load_environment`), its first
messages rendered with the chat template (and the environment's ``tools``), then turns until
a stop reason (:data:`distflow.env.episode.STOP_REASONS`):

* budgets: ``max_turns`` (model turns), ``max_total_tokens`` (the sequence the model conditions
  on: prompt + turns + observations; each turn may sample at most what is left of it, and at
  most ``max_new_tokens``), ``max_tool_errors`` (failed tool calls in the episode; None: no limit);
* a deadline (``env_timeout``) on every call into the environment: constructor, ``reset``,
  ``step``, ``close``. An environment that raises, returns something malformed (see
  :func:`distflow.env.api.check_step_result`), or hangs ends its episode with ``env_error``:
  counted, its tokens not trained, the other episodes unaffected;
* a first prompt that already leaves no room in ``max_total_tokens`` is a counted skip
  (``prompt_too_long``), before any generation;
* an environment with an optional ``finish(reply, stop_reason) -> reward | None`` hears of a
  budget ending its episode (``reply``: the last turn's, when the budget cut it before ``step``
  saw it): an agent on the chat endpoint answers its waiting request there and still scores.

An engine failure (``generate`` raising) is not an episode's problem: it propagates and the
other episodes of the run are cancelled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from typing import Any, Callable, Sequence

from distflow.env.api import EnvError, call_env, check_messages, check_step_result, load_environment
from distflow.env.episode import STOP_REASONS, Episode, TemplateError, TokenAssembly, end_of_turn_id, render_prompt
from distflow.env.tools import ToolEnvironment

__all__ = ["EpisodeRunner", "GenerateFn", "environment_factory", "summarize", "episode_means"]

# generate(prompt_ids, params) -> Completion (tokens, logprobs, finish_reason, first/last_version),
# or an awaitable of one; a generate with a ``key`` keyword also gets key=(run, episode, turn)
GenerateFn = Callable[[list[int], Any], Any]


def _takes_key(generate: Any) -> bool:
    """Whether ``generate`` takes ``key=``: a request-level engine (distflow.rollout.continuous) seeds
    each turn from it and keeps an episode's KV between its turns."""
    try:
        return "key" in inspect.signature(generate).parameters
    except (TypeError, ValueError):
        return False


def environment_factory(environment: str | type | None = None, environment_args: dict | None = None,
                        tools: Sequence[str | Callable[..., Any]] | None = None) -> Callable[[], Any]:
    """The config's environment keys as a factory of per-episode environments: ``environment:
    module:Class`` with ``environment_args``, or with only ``tools: [module:function, ...]`` the
    built-in :class:`ToolEnvironment` (``environment_args`` then go to it: ``system_prompt``,
    ``tool_timeout``, ``reward``, ...). Both, or neither, is a ValueError."""
    if environment is not None and tools:
        raise ValueError("give either environment (with its own tools) or tools (the built-in tool environment), "
                         "not both")
    if environment is None and not tools:
        raise ValueError("an agentic run needs environment: module:Class or tools: [module:function, ...]")
    if environment is None:
        return load_environment(ToolEnvironment, {"tools": list(tools or []), **(environment_args or {})})
    return load_environment(environment, environment_args)


def _count(value: Any, key: str, what: str) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EnvError(f"{what}: info[{key!r}] is {value!r:.40}, expected a count (int >= 0)")
    return value


class EpisodeRunner:
    """Runs episodes of one environment kind against one ``generate`` (see the module doc).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        generate: ``generate(prompt_ids, params) -> Completion`` (or an awaitable of one); one
            that takes a ``key`` keyword gets ``key=(run, episode, turn)``: the run's serial
            number, the episode's index in it and the turn's, the same whatever the timing
            (a request-level engine seeds the turn from it and reuses the episode's KV).
        make_env: a factory of one environment per episode (:func:`environment_factory`).
        params: the SamplingParams of every turn (its ``max_new_tokens`` is set per turn); None:
            ``SamplingParams()`` with the template's defaults.
        max_turns, max_total_tokens, max_new_tokens, max_tool_errors: the budgets.
        env_timeout: seconds any one call into the environment may take.
        max_concurrent: episodes in flight at once (None: all).
    """

    def __init__(self, tokenizer: Any, generate: GenerateFn, make_env: Callable[[], Any], *, params: Any = None,
                 max_turns: int = 8, max_total_tokens: int = 4096, max_new_tokens: int = 512,
                 max_tool_errors: int | None = None, env_timeout: float = 60.0, max_concurrent: int | None = None):
        for key, v in (("max_turns", max_turns), ("max_total_tokens", max_total_tokens),
                       ("max_new_tokens", max_new_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key} must be an int >= 1, got {v!r}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn episodes need a tokenizer with a chat template (it renders each turn's "
                             "prompt); this one has none")
        if params is None:
            from distflow.rollout.protocol import SamplingParams  # torch comes with it: only when needed

            params = SamplingParams(max_new_tokens=max_new_tokens)
        # The engine stops at the template's end of turn (else the model writes made-up turns) and
        # the environment sees the reply without it, nor without an EOS that ended it.
        end = end_of_turn_id(tokenizer)
        if end is not None and end not in params.stop_token_ids:
            params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, end))
        self.tokenizer, self.generate, self.make_env, self.params = tokenizer, generate, make_env, params
        self.max_turns, self.max_total_tokens, self.max_new_tokens = max_turns, max_total_tokens, max_new_tokens
        self.max_tool_errors, self.env_timeout = max_tool_errors, env_timeout
        self.max_concurrent = max_concurrent
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_ids = set(params.stop_token_ids) | ({eos} if isinstance(eos, int) else set())
        self.stats: dict[str, float] = {}
        self.keyed = _takes_key(generate)
        self.runs = 0  # run() calls so far: the first element of a turn's key
        self.env_name = getattr(make_env, "spec", getattr(make_env, "__qualname__", "environment"))

    # ------------------------------------------------------------------ one episode
    def reply_text(self, tokens: list[int]) -> str:
        """The reply a turn's tokens say, for the environment: decoded with special tokens kept
        (a tool-call tag may be one), less the stop token that ended the turn."""
        if tokens and tokens[-1] in self.stop_ids:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    async def _generate(self, prompt: list[int], max_new: int, ep: Episode, key: tuple | None) -> Any:
        params = dataclasses.replace(self.params, max_new_tokens=max_new)
        t0 = time.perf_counter()
        out = self.generate(prompt, params, key=key) if self.keyed and key is not None else \
            self.generate(prompt, params)
        comp = await out if inspect.isawaitable(out) else out
        ep.generate_time_s += time.perf_counter() - t0
        tokens, logprobs = list(comp.tokens), list(comp.logprobs)
        if len(tokens) != len(logprobs) or len(tokens) > max_new:
            raise ValueError(f"generate returned {len(tokens)} tokens and {len(logprobs)} logprobs for "
                             f"max_new_tokens={max_new}: an engine bug")
        return comp

    async def _env(self, fn: Callable[..., Any], *args: Any, what: str, ep: Episode) -> Any:
        t0 = time.perf_counter()
        try:
            return await call_env(fn, *args, timeout=self.env_timeout, what=f"environment {self.env_name!r} {what}")
        finally:
            ep.env_time_s += time.perf_counter() - t0

    def _render(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        try:
            return render_prompt(self.tokenizer, messages, tools)
        except TemplateError as e:  # the environment's messages do not fit the template: its error
            raise EnvError(f"environment {self.env_name!r}: {e}") from None

    def _tools(self, env: Any) -> list[dict] | None:
        """The environment's tool schemas for the template, read at every render (an agent's
        requests may name other tools turn by turn)."""
        tools = getattr(env, "tools", None)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise EnvError(f"environment {self.env_name!r}: tools is {type(tools).__name__}, "
                           f"expected a list of JSON schemas (dicts)")
        return tools

    async def run_episode(self, row: dict, key: tuple | None = None) -> Episode:
        """One episode on ``row`` to its stop reason. Never raises for the environment's faults.
        ``key``: the episode's (run, index), extended by the turn for a keyed ``generate``."""
        ep = Episode(row=row)
        env = None
        asm: TokenAssembly | None = None
        messages: list[dict] = []
        try:
            env = await self._env(self.make_env, what="constructor", ep=ep)
            messages = check_messages(await self._env(env.reset, row, what="reset()", ep=ep),
                                      f"environment {self.env_name!r} reset()", allow_empty=False)
            prompt = self._render(messages, self._tools(env))
            if len(prompt) >= self.max_total_tokens:
                ep.stop_reason, ep.messages = "prompt_too_long", messages
                ep.error = f"the first prompt has {len(prompt)} tokens, max_total_tokens is {self.max_total_tokens}"
                return ep
            asm = TokenAssembly(prompt)
            unstepped: str | None = None  # the reply of a turn cut by a budget (never given to step)
            while True:
                max_new = min(self.max_new_tokens, self.max_total_tokens - len(prompt))
                comp = await self._generate(prompt, max_new, ep, None if key is None else (*key, ep.turns))
                asm.add_completion(list(comp.tokens), list(comp.logprobs), int(getattr(comp, "first_version", 0)),
                                   int(getattr(comp, "last_version", 0)))
                ep.turns += 1
                ep.turn_lengths.append(len(comp.tokens))
                reply = self.reply_text(list(comp.tokens))
                messages.append({"role": "assistant", "content": reply})
                if comp.finish_reason == "length":
                    ep.truncated = True
                    ep.stop_reason = "length" if max_new == self.max_new_tokens else "max_total_tokens"
                    unstepped = reply
                    break
                result = check_step_result(await self._env(env.step, reply, what="step()", ep=ep),
                                           f"environment {self.env_name!r} step()")
                what = f"environment {self.env_name!r} step()"
                ep.tool_calls += _count(result.info.get("tool_calls"), "tool_calls", what)
                ep.tool_errors += _count(result.info.get("tool_errors"), "tool_errors", what)
                ep.rewards.append(result.reward)
                ep.info = result.info
                messages = list(result.messages) if result.replace else messages + result.messages
                if result.done:
                    ep.stop_reason = "done"
                    break
                if self.max_tool_errors is not None and ep.tool_errors > self.max_tool_errors:
                    ep.stop_reason = "tool_error"
                    break
                if ep.turns >= self.max_turns:
                    ep.stop_reason = "max_turns"
                    break
                before = len(asm.context)
                prompt = self._render(messages, self._tools(env))
                ep.observation_lengths.append(len(prompt) - before if asm.extend(prompt) else len(prompt))
                if len(prompt) >= self.max_total_tokens:
                    ep.stop_reason = "max_total_tokens"
                    break
            if ep.stop_reason != "done" and callable(getattr(env, "finish", None)):
                reward = await self._env(env.finish, unstepped, ep.stop_reason, what="finish()", ep=ep)
                ep.rewards.append(check_step_result({"done": True, "reward": reward},
                                                    f"environment {self.env_name!r} finish()").reward)
        except EnvError as e:
            ep.stop_reason, ep.error = "env_error", str(e)
        finally:
            if env is not None and callable(getattr(env, "close", None)):
                try:
                    await self._env(env.close, what="close()", ep=ep)
                except EnvError:  # a failing close loses nothing of the episode
                    pass
        ep.messages = messages
        if asm is not None:
            ep.splits = asm.splits
            if ep.stop_reason != "env_error":
                ep.samples = asm.finished_samples()
        return ep

    # ------------------------------------------------------------------ many episodes
    async def run(self, rows: Sequence[dict]) -> list[Episode]:
        """One episode per row, concurrently (at most ``max_concurrent`` at once), in row order.
        Updates :attr:`stats` with :func:`summarize` of them."""
        gate = asyncio.Semaphore(self.max_concurrent) if self.max_concurrent else None
        run = self.runs
        self.runs += 1

        async def one(i: int, row: dict) -> Episode:
            if gate is None:
                return await self.run_episode(row, (run, i))
            async with gate:
                return await self.run_episode(row, (run, i))

        async with asyncio.TaskGroup() as tg:  # generate raising cancels the others (an engine failure)
            tasks = [tg.create_task(one(i, r), name=f"episode-{run}-{i}") for i, r in enumerate(rows)]
        episodes = [t.result() for t in tasks]
        for k, v in summarize(episodes).items():
            self.stats[k] = self.stats.get(k, 0) + v
        return episodes

    def run_sync(self, rows: Sequence[dict]) -> list[Episode]:
        """:meth:`run` on a fresh event loop (from a worker thread of a node)."""
        return asyncio.run(self.run(rows))


def summarize(episodes: Sequence[Episode]) -> dict[str, float]:
    """Counters of a set of episodes: ``episodes``, ``trained_episodes``, ``samples``, ``splits``,
    ``env_errors``, ``skipped_prompts`` (prompt_too_long), ``turns``, ``tool_calls``,
    ``tool_errors``, ``sampled_tokens``, ``episode_tokens``, ``env_time_s``, ``generate_time_s``,
    and ``stop_<reason>`` for each stop reason."""
    out: dict[str, float] = {k: 0 for k in ("episodes", "trained_episodes", "samples", "splits", "env_errors",
                                            "skipped_prompts", "turns", "tool_calls", "tool_errors",
                                            "sampled_tokens", "episode_tokens", "env_time_s", "generate_time_s")}
    out.update({f"stop_{r}": 0 for r in STOP_REASONS})
    for ep in episodes:
        out["episodes"] += 1
        out["trained_episodes"] += ep.trained
        out["samples"] += len(ep.samples)
        out["splits"] += ep.splits
        out["env_errors"] += ep.stop_reason == "env_error"
        out["skipped_prompts"] += ep.stop_reason == "prompt_too_long"
        out["turns"] += ep.turns
        out["tool_calls"] += ep.tool_calls
        out["tool_errors"] += ep.tool_errors
        out["sampled_tokens"] += sum(ep.turn_lengths)
        out["episode_tokens"] += ep.length
        out["env_time_s"] += ep.env_time_s
        out["generate_time_s"] += ep.generate_time_s
        out[f"stop_{ep.stop_reason}"] = out.get(f"stop_{ep.stop_reason}", 0) + 1
    return out


def episode_means(stats: dict[str, float]) -> dict[str, float]:
    """Per-episode means of the summed counters (once per step, after the shards are added):
    ``episode_turns_mean``, ``tool_calls_per_episode``, ``tool_errors_per_episode``,
    ``tool_call_rate`` (share of episodes that called a tool), ``episode_len_mean`` (tokens of an
    episode's samples), ``turn_len_mean`` (sampled tokens per turn). Unchanged without episodes."""
    n = stats.get("episodes", 0)
    if not n:
        return stats
    turns = stats.get("episode_turns", 0)
    return {**stats, "episode_turns_mean": turns / n, "tool_calls_per_episode": stats.get("episode_tool_calls", 0) / n,
            "tool_errors_per_episode": stats.get("episode_tool_errors", 0) / n,
            "tool_call_rate": stats.get("episodes_with_tool_call", 0) / n,
            "episode_len_mean": stats.get("episode_tokens", 0) / n,
            "turn_len_mean": stats.get("episode_sampled_tokens", 0) / max(turns, 1)}
