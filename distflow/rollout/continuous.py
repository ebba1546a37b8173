"""Request-level continuous batching for the built-in engine: ``await engine.submit(prompt, params)``.

Why it exists: an agentic rollout has many episodes in flight, each asking for one turn at a
time whenever its environment answers. A batch-at-a-time engine call
(:class:`distflow.env.batching.BatchedGenerate`) makes every turn wait for the batch it joined
to finish (its longest member) and for the next call to start. Here ONE engine thread runs the
decode loop of :class:`distflow.rollout.slots.SlotBatcher` (the same slots, admission and
compaction as ``TorchEngine.generate``): a request is admitted into a free slot between two
decode steps as soon as it is submitted, and its completion is returned the step it finishes.
The event loop only queues requests and receives results (thread-safe hand-offs): neither an
environment nor the engine blocks the other.

**KV reuse.** A request may name its ``session`` (an episode). When it finishes, the KV of its
context (prompt + sampled tokens, less the last one, which was never fed) is copied out of its
slot into a bounded LRU store (``kv_store_tokens`` positions in all); the session's next request
whose prompt shares a prefix with that context (token for token: the runner's next prompt
extends the previous context) copies the prefix back and prefills only the new tokens
(:meth:`~distflow.rollout.llama_forward.LlamaRunner.extend`). Counted in :attr:`stats`:
``kv_hits``, ``kv_misses`` (a later turn that prefilled its whole context: evicted, stale or not
an extension), ``kv_reused_tokens``, ``kv_evictions``. The store is on the engine's device: on
CUDA it is memory beyond the static cache (by default at most half of what the cache left free).
On CUDA the host looks at the batch every ``sync_every`` (8) decode steps, so a request joins
within 8 steps there (1 on CPU).

**Sampling** is the engine's (:func:`distflow.rollout.sampling.sample_rows`): the tokens and
logprobs returned are the ones sampled, what the trainer trains. Each request draws from its
own counter-based stream keyed by ``(seed, key)`` (the runner passes ``key = (run, episode,
turn)``): a request's draws do not depend on which other requests share its decode steps, nor
on when it was admitted. Its tokens then depend only on its prompt, its key and the logits; on
CPU those are the same for any batch composition as far as the kernels are (a GPU may pick
another kernel for another batch shape and move bf16 logits in the last bits, as for
``generate``). Requests whose sampling mode differs (temperature, top-p, top-k, stop tokens;
not ``max_new_tokens``) are not mixed: the next mode starts when the current one drains.

**Weights** are never loaded mid-request: the thread holds the engine's lock while any request
is in flight; a waiting ``load_weights`` stops admissions, the in-flight requests finish, the
lock is released, the weights load, and admissions resume (stored KV of older weights is
dropped). ``close()`` is bounded: the thread is told to stop and joined with a deadline; the
requests still waiting get an error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from distflow.device import on_device
from distflow.rollout.protocol import Completion, SamplingParams, validate_prompts
from distflow.rollout.slots import SlotBatcher

__all__ = ["ContinuousEngine", "KVStore", "request_key"]

log = logging.getLogger(__name__)


def request_key(seed: int, key: Any) -> int:
    """The 32-bit sampling key of a request: a stable hash of ``(seed, key)`` (not Python's
    ``hash``, which is salted per process for strings; no torch call on the event loop)."""
    return int.from_bytes(hashlib.blake2b(repr((int(seed), key)).encode(), digest_size=4).digest(), "little")


@dataclasses.dataclass
class _Entry:
    tokens: list[int]  # the positions held: KV of tokens[i] at position i
    k: torch.Tensor
    v: torch.Tensor
    version: int


class KVStore:
    """Contexts' KV by session, least recently used evicted past ``max_tokens`` positions in all."""

    def __init__(self, max_tokens: int):
        self.max_tokens, self.tokens = max_tokens, 0
        self.entries: OrderedDict[Any, _Entry] = OrderedDict()
        self.evictions = 0

    def put(self, session: Any, entry: _Entry) -> None:
        self.drop(session)
        if len(entry.tokens) > self.max_tokens:
            return
        while self.tokens + len(entry.tokens) > self.max_tokens:
            _, old = self.entries.popitem(last=False)
            self.tokens -= len(old.tokens)
            self.evictions += 1
        self.entries[session] = entry
        self.tokens += len(entry.tokens)

    def take(self, session: Any) -> _Entry | None:
        entry = self.entries.pop(session, None)
        if entry is not None:
            self.tokens -= len(entry.tokens)
        return entry

    def drop(self, session: Any) -> None:
        self.take(session)

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0


@dataclasses.dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    mode: SamplingParams  # what it must share with the requests it is batched with (_mode)
    key: int
    session: Any
    turn: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    cancelled: bool = False
    images: Any = None  # the prompt's ImageInputs (a vision-language model)


def _mode(params: SamplingParams) -> SamplingParams:
    """What requests batched together must share: all but ``max_new_tokens``."""
    return dataclasses.replace(params, max_new_tokens=1)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _hand(req: _Request, result: Any, error: BaseException | None = None) -> None:
    """Give ``req`` its result (or error) on its event loop; a loop that has closed meanwhile has
    nobody waiting: nothing to do (the engine thread must not die of it)."""
    if isinstance(error, StopIteration):  # a Future refuses it (and the waiter would hang): say what it was
        error = RuntimeError(f"the engine thread failed: {error!r}")
    try:
        req.loop.call_soon_threadsafe(_resolve, req.future, result, error)
    except RuntimeError:  # the loop is closed
        pass


def _last_image_token(prompt: list[int], images: Any, runner: Any) -> int:
    """The position of the prompt's last image placeholder (rollout/vlm_forward.py: placeholders)."""
    from distflow.rollout.vlm_forward import placeholders

    return int(placeholders(torch.tensor(prompt), runner.image_token_id, images, runner.merge)[-1])


class _Slots(SlotBatcher):
    """The engine thread's batcher: hands completions to their futures and parks their KV."""

    def __init__(self, owner: ContinuousEngine, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.owner = owner
        self.requests: dict[int, _Request] = {}

    def finished(self, slot: int, q: int, completion: Completion) -> None:
        req = self.requests.pop(q)
        if req.session is not None:
            held = self.prompts[q] + completion.tokens[:-1]  # the last sampled token was never fed
            k, v = self.r.save_prefix(slot, len(held))
            self.owner.store.put(req.session, _Entry(held, k, v, self.eng.version))
        _hand(req, completion)

    def discarded(self, q: int) -> None:
        self.requests.pop(q, None)

    def prefill(self, seqs: list[int], slots: list[int]) -> torch.Tensor:
        """Sessions whose stored context is a prefix of their prompt get it back and prefill the
        rest (:meth:`LlamaRunner.extend`); the others are prefilled as in ``generate``."""
        hits: list[tuple[int, int, int]] = []  # (index into seqs, slot, reused positions)
        store, stats = self.owner.store, self.eng.stats
        for j, q in enumerate(seqs):
            req = self.requests[q]
            entry = store.take(req.session) if req.session is not None else None
            m = 0
            if entry is not None and entry.version == self.eng.version:
                prompt, held = self.prompts[q], entry.tokens
                limit = min(len(held), len(prompt) - 1)  # the last prompt token is fed: its logits come out
                if req.images is not None and _last_image_token(prompt, req.images, self.r) >= limit:
                    limit = 0  # the images' tokens must come from a prefill (their features), not a text extension
                while m < limit and held[m] == prompt[m]:
                    m += 1
            if m:
                self.r.load_prefix(slots[j], entry.k, entry.v, m)
                hits.append((j, slots[j], m))
                stats["kv_hits"] += 1
                stats["kv_reused_tokens"] += m
            elif req.turn > 0:
                stats["kv_misses"] += 1
        hit_ix = {j for j, _, _ in hits}
        rest = [j for j in range(len(seqs)) if j not in hit_ix]
        out: list[torch.Tensor | None] = [None] * len(seqs)
        if rest:
            logits = super().prefill([seqs[j] for j in rest], [slots[j] for j in rest])
            for i, j in enumerate(rest):
                out[j] = logits[i]
        if hits:
            logits = self.r.extend([s for _, s, _ in hits], [m for _, _, m in hits],
                                   [self.prompts[seqs[j]][m:] for j, _, m in hits])
            stats["prefill_tokens"] += sum(len(self.prompts[seqs[j]]) - m for j, _, m in hits)
            for i, (j, _, _) in enumerate(hits):
                out[j] = logits[i]
        return torch.stack(out)  # type: ignore[arg-type]


class ContinuousEngine:
    """Request-level continuous batching over a :class:`~distflow.rollout.torch_engine.TorchEngine`
    whose model runs on the static-cache path (module doc). Use as ``async with`` (or
    :meth:`start` / :meth:`close`) on the event loop that submits.

    Args:
        engine: the TorchEngine (``engine.runner`` not None).
        seed: the base of every request's sampling key.
        max_slots: sequences decoded at once.
        max_length: positions of a slot: every request's prompt + ``max_new_tokens`` must fit.
        kv_store_tokens: positions of finished contexts kept for reuse (None: ``max_slots *
            max_length``, on CUDA at most what the engine's memory plan left beside the static cache:
            docs/gpu.md).
        request_timeout: seconds a request may take from submission to completion.
    """

    def __init__(self, engine: Any, *, seed: int = 0, max_slots: int | None = None, max_length: int,
                 kv_store_tokens: int | None = None, request_timeout: float = 3600.0):
        if engine.runner is None:
            raise ValueError("continuous batching needs the engine's static-cache path (a Llama-family model "
                             "or Qwen2-VL)")
        self.engine, self.seed = engine, int(seed)
        self.max_slots = min(max_slots or engine.max_slots, engine.max_slots)
        if engine.max_positions is not None:
            max_length = min(max_length, engine.max_positions)
        self.max_length = int(max_length)
        self.request_timeout = request_timeout
        # on CUDA the default is also capped by what the memory plan left beside the static cache (_batcher)
        self._cap_store = kv_store_tokens is None and engine.runner.device.type == "cuda"
        self.store = KVStore(int(kv_store_tokens if kv_store_tokens is not None else self.max_slots * self.max_length))
        self.stats = engine.stats
        for k in ("kv_hits", "kv_misses", "kv_reused_tokens", "kv_evictions", "requests"):
            self.stats.setdefault(k, 0)
        self._inbox: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._serial = 0  # submissions without a key
        self._q = 0  # the engine thread's sequence numbers
        self._live: dict[int, _Request] = {}  # the current batcher's requests (failed with the thread)
        self._version: int | None = None  # weights of the stored KV

    # ------------------------------------------------------------------ the event loop's side
    async def __aenter__(self) -> ContinuousEngine:
        self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name="distflow-engine", daemon=True)
            self._thread.start()

    async def submit(self, prompt_ids: list[int], params: SamplingParams, *, key: Any = None,
                     session: Any = None, turn: int = 0, images: Any = None) -> Completion:
        """One completion of ``prompt_ids``. ``key``: what the request's sampling stream is derived
        from with the seed (None: a fresh serial number: deterministic in submission order only);
        ``session``/``turn``: its episode and turn, for KV reuse (None: nothing stored); ``images``:
        the prompt's :class:`~distflow.vision.ImageInputs` (a vision-language model; a later turn of
        an episode passes its images again: its M-RoPE positions are the whole prompt's)."""
        if self._error is not None:
            raise RuntimeError(f"the engine thread failed: {self._error!r}") from self._error
        if self._closing.is_set() or self._thread is None:
            raise RuntimeError("ContinuousEngine.submit outside start()/close()")
        params.validate()
        validate_prompts([prompt_ids], self.engine.vocab_size)
        if images is not None:  # checked here: a bad request raised on the engine thread would fail every other one
            vision = getattr(self.engine, "vision", None)
            if vision is None:
                raise ValueError(f"{self.engine.model_path} is not a vision-language model: it takes no images")
            need = int(images.grid_thw.prod(-1).sum()) // vision.merge ** 2
            if sum(t == vision.image_token_id for t in prompt_ids) < need:
                raise ValueError(f"the prompt holds fewer image tokens than its images' {need} merged patches")
        if len(prompt_ids) + params.max_new_tokens > self.max_length:
            raise ValueError(f"prompt length {len(prompt_ids)} + max_new_tokens {params.max_new_tokens} exceeds the "
                             f"continuous engine's max_length {self.max_length}")
        if key is None:
            key, self._serial = ("serial", self._serial), self._serial + 1
        loop = asyncio.get_running_loop()
        req = _Request(list(prompt_ids), params, _mode(params), request_key(self.seed, key), session, turn, loop,
                       loop.create_future(), images=images)
        self.stats["requests"] += 1
        self._inbox.put(req)
        self._wake.set()
        try:
            return await asyncio.wait_for(req.future, self.request_timeout)
        except BaseException:
            req.cancelled = True  # the engine thread frees its slot at the next check
            raise

    async def __call__(self, prompt_ids: list[int], params: SamplingParams, key: Any = None) -> Completion:
        """The episode runner's ``generate(prompt_ids, params, key=(run, episode, turn))``: the
        session is the episode, the turn its last element."""
        if key is None:
            return await self.submit(prompt_ids, params)
        return await self.submit(prompt_ids, params, key=key, session=tuple(key[:-1]), turn=int(key[-1]))

    async def close(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (within ``timeout`` seconds; it finishes the decode step it is in)."""
        self._closing.set()
        self._wake.set()
        deadline = time.monotonic() + timeout
        while self._thread is not None and not self._stopped.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._thread is not None and not self._stopped.is_set():
            log.warning("the engine thread did not stop within %.0f s (left behind, a daemon)", timeout)
            return
        self.store.clear()  # (not under a thread still running: it owns the store)

    # ------------------------------------------------------------------ the engine thread
    def _main(self) -> None:
        pending: list[_Request] = []
        try:
            with on_device(self.engine.device), torch.inference_mode():
                self._serve(pending)
        except BaseException as e:  # noqa: BLE001  (every waiting request gets the engine's failure)
            self._error = e
            log.error("the engine thread failed: %r", e)
        finally:
            while True:  # requests that came in meanwhile: nobody will serve them
                try:
                    pending.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            err = self._error or RuntimeError("the continuous engine closed")
            for req in pending + list(self._live.values()):
                _hand(req, None, err)
            self._live = {}
            self._stopped.set()

    def _serve(self, pending: list[_Request]) -> None:
        """The decode loop: take requests, admit the ones of the current mode, step, hand out results.
        ``pending``: requests taken from the inbox and not yet given to a batcher (the caller fails
        them, and the batcher's, on error)."""
        eng, lock = self.engine, self.engine._lock
        b: _Slots | None = None
        try:
            while not self._closing.is_set():
                while True:
                    try:
                        pending.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                pending[:] = [r for r in pending if not r.cancelled]
                if b is None:
                    if not pending or eng._loads_waiting:
                        self._wake.wait(0.05)
                        self._wake.clear()
                        continue
                    if not lock.acquire(timeout=0.05):
                        continue
                    try:
                        b = self._batcher(pending[0].mode)
                    except BaseException:
                        lock.release()
                        raise
                    self._live = b.requests
                for q, req in b.requests.items():
                    if req.cancelled:
                        b.dropped.add(q)
                if not eng._loads_waiting:  # a weight load waits: finish what is in flight, admit nothing
                    rest = []
                    for req in pending:
                        if req.mode != b.params:
                            rest.append(req)
                            continue
                        self._q += 1
                        b.requests[self._q] = req
                        b.add(self._q, req.prompt, req.params.max_new_tokens, req.key, 0, req.images)
                    pending[:] = rest
                    b.admit_all()
                b.compact()
                self.stats["slots_in_use"] = b.n_active
                if b.n_active:
                    b.decode()
                else:  # idle, or drained for a weight load: let load_weights and generate() have the lock
                    back = [b.requests.pop(q) for q in b.waiting]  # (only when a load waits)
                    pending[:0] = back
                    b = None
                    self._live = {}
                    lock.release()
        finally:
            if b is not None:
                lock.release()

    def _batcher(self, mode: SamplingParams) -> _Slots:
        """A fresh batcher on the engine's cache (called with the lock held; weights may have changed
        since the last one: stored KV of other weights is dropped)."""
        eng = self.engine
        if eng.model is None or eng.runner is None:
            raise RuntimeError("the engine was closed under the continuous engine")
        if self._version != eng.version:
            self.store.clear()
            self._version = eng.version
        stop = sorted(set(eng.eos_token_ids) | set(mode.stop_token_ids))
        r = eng.runner
        r.retry_captures()  # shapes whose capture failed during the last batch try again
        eng.stats.update(graph_capture_failures=r.graph_capture_failures, graph_eager_steps=r.graph_eager_steps)
        b = _Slots(self, eng, r, mode, stop, slots=self.max_slots, length=self.max_length, width=self.max_length)
        if self._cap_store:  # once: what the engine's memory plan left beside the static cache
            self._cap_store = False
            per_token = 2 * len(r.layers) * r.n_kv * r.head_dim * r.dtype.itemsize
            plan = r.plan  # memory_plan.KVPlan: the budget the cache (and its logits rows) came out of
            row = r.vocab_size * 4 if r.use_graphs else 0  # the graphs' logits row of each slot
            left = plan.budget_bytes - plan.slots * (plan.length * per_token + row)
            self.store.max_tokens = min(self.store.max_tokens, max(0, left) // per_token)
        return b
