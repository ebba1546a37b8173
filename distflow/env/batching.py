"""An adapter from a batch engine to the runner's per-turn ``generate(prompt_ids, params)``.

Why it exists: the episode runner asks for one turn of one episode at a time, from many
coroutines; today's engines (:class:`distflow.rollout.protocol.RolloutEngine`) take a list of
prompts in one blocking call. :class:`BatchedGenerate` joins the turns requested while the
engine is busy (and within ``window`` seconds of the first) into the next batch, one batch per
distinct :class:`SamplingParams` (turns differ in ``max_new_tokens`` near the token budget),
and runs the engine in a worker thread so the loop keeps serving environments meanwhile.

This is batch-at-a-time, not continuous batching: a batch's short turns wait for its longest.
An engine that schedules requests continuously is given to the runner directly as an
async ``generate`` (the built-in engine's :mod:`distflow.rollout.continuous`, which
``fn: episodes`` prefers); this adapter serves the engines without one. Seeds: batch ``k`` is sampled with ``seed + k``; which turns share a batch
depends on environment timing, so a multi-turn run is not bit-reproducible (a single-turn
run with every prompt in one batch is).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from distflow.env.api import in_thread

__all__ = ["BatchedGenerate"]


class BatchedGenerate:
    """``await batched(prompt_ids, params) -> Completion`` over ``engine_generate(prompts, params,
    seed) -> [Completion]`` (e.g. ``engine.generate``). ``max_batch``: prompts per engine call.
    Counters: ``batches``, ``requests``."""

    def __init__(self, engine_generate: Callable[..., list[Any]], *, seed: int | None = 0, max_batch: int = 256,
                 window: float = 0.0):
        self.engine_generate, self.seed, self.max_batch, self.window = engine_generate, seed, max_batch, window
        self.pending: list[tuple[list[int], Any, asyncio.Future]] = []
        self.worker: asyncio.Task | None = None
        self.batches = 0
        self.requests = 0

    async def __call__(self, prompt_ids: list[int], params: Any) -> Any:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((list(prompt_ids), params, future))
        self.requests += 1
        if self.worker is None or self.worker.done():
            self.worker = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        """Run batches while requests are pending; each failure goes to the requests of its batch."""
        await asyncio.sleep(self.window)  # let the turns that are ready now join the first batch
        while self.pending:
            params = self.pending[0][1]
            batch = [p for p in self.pending if p[1] == params][:self.max_batch]
            taken = {id(p) for p in batch}
            self.pending = [p for p in self.pending if id(p) not in taken]
            seed = None if self.seed is None else self.seed + self.batches
            self.batches += 1
            try:
                outs = await in_thread(self.engine_generate, [p[0] for p in batch], params, seed)
                if len(outs) != len(batch):
                    raise RuntimeError(f"the engine returned {len(outs)} completions for {len(batch)} prompts")
            except BaseException as e:  # noqa: BLE001  (the engine's failure is each request's)
                for _, _, f in batch:
                    if not f.done():
                        f.set_exception(e)
                continue
            for (_, _, f), out in zip(batch, outs):
                if not f.done():
                    f.set_result(out)
