"""Request-level continuous batching (distflow/rollout/continuous.py) on the real TorchEngine and
the toy model: a short request joins while a long one decodes and returns first; the sampled
logprobs equal a teacher-forced forward of the same tokens; a second turn extending the first
reuses its KV (counted) with the logprobs of a cold prefill; a request's tokens do not depend on
the requests sharing its batch; a weight load waits for the in-flight requests; a tool episode
through the runner trains exactly the sampled tokens with their logprobs."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from distflow.rollout.protocol import SamplingParams
from distflow.rollout.torch_engine import TorchEngine


@pytest.fixture(scope="module")
def engine(toy_model):
    eng = TorchEngine(str(toy_model), max_slots=8)
    yield eng
    eng.close()


def teacher_forced(eng: TorchEngine, prompt: list[int], tokens: list[int]) -> list[float]:
    """log_softmax of the HF model's own forward over prompt + tokens, at each sampled token."""
    with torch.inference_mode():
        logits = eng.model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(tokens)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_a_short_request_joins_while_a_long_one_decodes_and_returns_first(engine, monkeypatch):
    from distflow.rollout import continuous

    long_p, short_p = [2, 5, 6, 7], [2, 9, 10]
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0)
    # Decode steps counted where they happen: when a request is put in the engine's inbox and when the engine
    # thread hands it its result (the event loop that awaits both may run late on a busy machine)
    handed: dict[int, int] = {}
    hand = continuous._hand
    monkeypatch.setattr(continuous, "_hand", lambda req, *a: (handed.setdefault(
        req.params.max_new_tokens, engine.stats["decode_steps"]), hand(req, *a))[1])

    async def main():
        async with engine.continuous(seed=1, max_length=64) as cont:
            put_at: list[int] = []

            class Inbox:  # the engine's request queue, noting the decode step each request is put at
                def __init__(self, queue):
                    self.queue = queue

                def put(self, req) -> None:
                    put_at.append(engine.stats["decode_steps"])
                    self.queue.put(req)

                def __getattr__(self, name):
                    return getattr(self.queue, name)

            cont._inbox = Inbox(cont._inbox)
            steps0 = engine.stats["decode_steps"]
            long_task = asyncio.create_task(cont.submit(long_p, greedy, key="long"), name="long")
            while engine.stats["decode_steps"] - steps0 < 5:  # the long one is decoding
                await asyncio.sleep(0.001)
            short = await cont.submit(short_p, SamplingParams(max_new_tokens=3, temperature=0.0), key="short")
            assert not long_task.done()  # returned while the long one still decodes
            long = await long_task
            return short, long, put_at, steps0

    short, long, put_at, steps0 = run(main())
    assert long.finish_reason == "length" and len(long.tokens) == 40, long  # the greedy toy path has no EOS
    assert len(short.tokens) == 3
    joined = put_at[1] - steps0  # the long one was decoding when the short one came
    assert joined >= 5 and handed[40] - steps0 >= 39
    # the short one took its 3 tokens within a few steps of joining: it did not wait for the long one's 40
    assert handed[3] - put_at[1] <= 4 and handed[3] < handed[40], (handed, put_at, steps0)


def test_logprobs_equal_a_teacher_forced_forward(engine):
    prompt = [2, 4, 8, 3, 11, 5]
    params = SamplingParams(max_new_tokens=20, temperature=1.0)

    async def main():
        async with engine.continuous(seed=3, max_length=64) as cont:
            return await asyncio.gather(*(cont.submit(prompt, params, key=i) for i in range(4)))

    outs = run(main())
    assert len({tuple(c.tokens) for c in outs}) > 1  # four keys, four streams
    for c in outs:
        ref = teacher_forced(engine, prompt, c.tokens)
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) < 1e-4


def test_a_second_turn_reuses_the_first_turns_kv_with_cold_prefill_logprobs(engine):
    prompt = [2, 4, 8, 3, 11, 5, 6]
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    observation = [12, 13, 14, 3, 9]

    async def main():
        async with engine.continuous(seed=5, max_length=64) as cont:
            hits0, reused0 = engine.stats["kv_hits"], engine.stats["kv_reused_tokens"]
            first = await cont(prompt, params, key=(0, 7, 0))
            second_prompt = prompt + first.tokens + observation
            second = await cont(second_prompt, params, key=(0, 7, 1))
            hits, reused = engine.stats["kv_hits"] - hits0, engine.stats["kv_reused_tokens"] - reused0
        async with engine.continuous(seed=5, max_length=64) as cold:  # no stored KV: a whole prefill
            misses0 = engine.stats["kv_misses"]
            again = await cold(second_prompt, params, key=(0, 7, 1))
            misses = engine.stats["kv_misses"] - misses0
        return first, second_prompt, second, again, hits, reused, misses

    first, second_prompt, second, again, hits, reused, misses = run(main())
    assert hits == 1 and reused == len(prompt) + len(first.tokens) - 1  # all but the last sampled token
    assert misses == 1  # the cold engine had nothing for turn 1
    assert second.tokens == again.tokens  # the same key: the same stream, the same logits
    assert max(abs(a - b) for a, b in zip(second.logprobs, again.logprobs)) < 1e-4
    ref = teacher_forced(engine, second_prompt, second.tokens)
    assert max(abs(a - b) for a, b in zip(second.logprobs, ref)) < 1e-4


def test_a_requests_tokens_do_not_depend_on_its_batch(engine):
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    prompts = {i: [2] + [3 + (i * 5 + j) % 13 for j in range(3 + i)] for i in range(6)}

    async def alone(i):
        async with engine.continuous(seed=9, max_length=64) as cont:
            return await cont.submit(prompts[i], params, key=("ep", i))

    async def together():
        async with engine.continuous(seed=9, max_length=64, max_slots=3) as cont:
            return await asyncio.gather(*(cont.submit(prompts[i], params, key=("ep", i)) for i in reversed(range(6))))

    solo = [run(alone(i)) for i in (0, 4)]
    mixed = run(together())[::-1]
    for got, i in zip(solo, (0, 4)):
        assert got.tokens == mixed[i].tokens
        assert max(abs(a - b) for a, b in zip(got.logprobs, mixed[i].logprobs)) < 1e-5


def test_a_weight_load_waits_for_the_requests_in_flight(engine):
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0)
    v0 = engine.version

    async def main():
        async with engine.continuous(seed=1, max_length=64) as cont:
            task = asyncio.create_task(cont.submit([2, 5, 6, 7], greedy, key="a"), name="in-flight")
            steps0 = engine.stats["decode_steps"]
            while engine.stats["decode_steps"] - steps0 < 3:
                await asyncio.sleep(0.001)
            loaded = threading.Event()
            t = threading.Thread(target=lambda: (engine.load_weights(v0 + 1, weights), loaded.set()), name="load")
            t.start()
            first = await task
            assert first.last_version == v0  # finished under the weights it started with
            t.join(30)
            assert loaded.is_set()
            after = await cont.submit([2, 5, 6, 7], greedy, key="b")
            return first, after

    first, after = run(main())
    assert first.first_version == first.last_version == v0
    assert after.first_version == v0 + 1 and after.tokens == first.tokens  # the same weights, reloaded


def test_a_weight_load_lets_a_request_waiting_for_a_slot_start_under_the_new_weights(engine):
    """One slot: B waits while A decodes; a load arrives; A finishes under the old weights, B is not
    admitted before the load (the thread lets go of the lock with B still waiting) and starts
    under the new ones."""
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    greedy = SamplingParams(max_new_tokens=56, temperature=0.0)
    v0 = engine.version

    async def main():
        async with engine.continuous(seed=1, max_length=64, max_slots=1) as cont:
            a = asyncio.create_task(cont.submit([2, 5, 6, 7], greedy, key="a"), name="a")
            b = asyncio.create_task(cont.submit([2, 9, 10], SamplingParams(max_new_tokens=4, temperature=0.0),
                                                key="b"), name="b")
            steps0 = engine.stats["decode_steps"]
            while engine.stats["decode_steps"] - steps0 < 3:
                await asyncio.sleep(0.001)
            t = threading.Thread(target=engine.load_weights, args=(v0 + 1, weights), name="load")
            t.start()
            ra, rb = await a, await b
            t.join(30)
            return ra, rb

    ra, rb = run(main())
    assert ra.first_version == ra.last_version == v0 and len(ra.tokens) == 56
    assert rb.first_version == rb.last_version == v0 + 1


def test_requests_past_max_length_or_after_close_are_refused(engine):
    async def main():
        cont = engine.continuous(seed=0, max_length=64)
        async with cont:
            with pytest.raises(ValueError, match="max_length"):
                await cont.submit([2] * 60, SamplingParams(max_new_tokens=10))
        with pytest.raises(RuntimeError, match="outside start"):
            await cont.submit([2, 3], SamplingParams(max_new_tokens=2))

    run(main())


def test_an_engine_failure_reaches_the_waiting_request_and_the_next(toy_model):
    """The engine closed under the continuous one: the thread fails, the request waiting gets the
    error, and so does the next submission (at once); close() still returns."""
    eng = TorchEngine(str(toy_model), max_slots=2)

    async def main():
        async with eng.continuous(seed=0, max_length=64) as cont:
            eng.close()
            with pytest.raises(RuntimeError, match="closed under"):
                await cont.submit([2, 3], SamplingParams(max_new_tokens=2))
            with pytest.raises(RuntimeError, match="engine thread failed"):
                await cont.submit([2, 3], SamplingParams(max_new_tokens=2))

    run(main())


class MoreDigits:
    """Three model turns: every reply is answered with a user turn of digits (the tool toy model's
    tokenizer has digits and newline), the last with done and reward 1."""

    def __init__(self):
        self.turn = 0

    async def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, reply):
        from distflow.env import StepResult

        self.turn += 1
        await asyncio.sleep(0.001 * self.turn)  # the environments answer at different times
        return StepResult(messages=[{"role": "user", "content": str(40 + self.turn)}], reward=1.0 if self.turn == 3
                          else None, done=self.turn == 3)


def test_multi_turn_episodes_on_the_continuous_path_train_the_sampled_tokens_and_reuse_kv(tmp_path):
    """The runner over the continuous engine (what fn: episodes uses on a TorchEngine): every
    sample's loss-masked tokens carry the logprobs of a teacher-forced forward of the whole
    sample, observations masked; every later turn of an episode reused its KV."""
    from distflow.env import EpisodeRunner
    from distflow.toy import ensure_toy_model

    eng = TorchEngine(ensure_toy_model(tmp_path / "m", kind="tool"), max_slots=8)
    try:
        # newline and "0" stop a turn too: most turns of the random toy policy end before the length cut
        params = SamplingParams(max_new_tokens=16, temperature=1.0, stop_token_ids=(21, 11))
        rows = [{"prompt": f"{i:04d}"} for i in range(6)]

        async def main():
            async with eng.continuous(seed=11, max_length=128) as cont:
                runner = EpisodeRunner(eng.tokenizer, cont, MoreDigits, params=params, max_turns=3,
                                       max_total_tokens=128, max_new_tokens=16)
                assert runner.keyed
                return await runner.run(rows)

        h0, m0 = eng.stats.get("kv_hits", 0), eng.stats.get("kv_misses", 0)
        eps = run(main())
        later_turns = sum(ep.turns - 1 for ep in eps)
        assert later_turns > 0 and eng.stats["kv_hits"] - h0 == later_turns and eng.stats["kv_misses"] == m0
        for ep in eps:
            assert ep.stop_reason in ("done", "length") and ep.samples
            for s in ep.samples:
                with torch.inference_mode():
                    lp = torch.log_softmax(eng.model(input_ids=torch.tensor([s.tokens])).logits[0].float(), -1)
                for t in range(s.prompt_len, len(s.tokens)):
                    if s.loss_mask[t]:
                        assert abs(s.logprobs[t] - float(lp[t - 1, s.tokens[t]])) < 1e-4
                    else:
                        assert s.logprobs[t] == 0.0
        assert sum(ep.stop_reason == "done" for ep in eps) >= 1
    finally:
        eng.close()


def test_no_request_level_path_off_the_static_cache(toy_model):
    """A model on the HF fallback loop has no continuous engine: fn: episodes then batches turns
    per generate call (BatchedGenerate)."""
    eng = TorchEngine(str(toy_model), max_slots=2)
    try:
        assert eng.continuous(max_length=64) is not None
        eng.runner = None  # as for an architecture the static-cache runner does not drive
        assert eng.continuous(max_length=64) is None
    finally:
        eng.close()
