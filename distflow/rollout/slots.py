"""The static-cache path's slots: admission, the decode step, stop checks, compaction.

Why it exists: the one decode loop of the built-in engine, shared by its two drivers. A
``TorchEngine.generate`` call fills :class:`SlotBatcher` with its prompts and runs it to the
end (:meth:`SlotBatcher.run`); the request-level engine (:mod:`distflow.rollout.continuous`)
keeps one alive on its engine thread, adding requests as they arrive and taking results as
they finish. Both admit waiting sequences into free slots between decode steps, so a short
sequence never waits for a long one.

Each sequence samples from its own counter-based stream ``(key, stream, token index)``
(:func:`distflow.rollout.sampling.counter_uniform`): ``generate`` gives every prompt the
call's key and its index as the stream; the request-level engine gives each request a key of
its own. Either way the draws do not depend on the slot, the admission order or the other
sequences in the batch.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from distflow.rollout.protocol import Completion, SamplingParams, WeightsUpdate, check_finite_logprobs
from distflow.rollout.sampling import counter_uniform, sample_rows

__all__ = ["SlotBatcher"]


class SlotBatcher:
    """Sequences in the slots of a :class:`~distflow.rollout.llama_forward.LlamaRunner`'s cache.

    ``engine``: the TorchEngine (its ``stats``, ``version``, ``sync_every``, ``max_slots``,
    ``_poll``); ``params``: the sampling mode of every sequence (its ``max_new_tokens`` is not
    used: each sequence has its own limit, at most ``width``); ``slots``, ``length``, ``grow_to``:
    the cache to reserve (``LlamaRunner.reserve``). Slot state lives on the device (decode inputs in
    the runner; per-slot outputs here) and is mirrored on the host only where the host can know it
    without a sync (sequence, tokens generated so far). Sequences are added with :meth:`add` and
    wait in :attr:`waiting`.
    """

    def __init__(self, engine: Any, runner: Any, params: SamplingParams, stop: list[int], *, slots: int, length: int,
                 width: int, weights_update: WeightsUpdate | None = None, grow_to: int | None = None):
        self.eng, self.r, self.params = engine, runner, params
        self.weights_update = weights_update
        dev = runner.device
        runner.reserve(slots if not runner.use_graphs else engine.max_slots, length, grow_to)
        s = runner.slots
        self.width = width
        self.stop = torch.tensor(stop, dtype=torch.int64, device=dev)
        self.key = torch.zeros(s, dtype=torch.int64, device=dev)  # per slot: its sequence's sampling key
        self.seq = torch.zeros(s, dtype=torch.int64, device=dev)  # per slot: its sequence's stream index
        self.gen = torch.zeros(s, dtype=torch.int64, device=dev)
        self.done = torch.zeros(s, dtype=torch.bool, device=dev)
        self.end = torch.zeros(s, dtype=torch.int64, device=dev)
        self.out_tok = torch.zeros((s, width), dtype=torch.int64, device=dev)
        self.out_lp = torch.zeros((s, width), dtype=torch.float32, device=dev)
        self.limit = min(slots, s)  # on CUDA the cache may hold fewer (all that fit in memory)
        self.slot_seq: list[int] = [-1] * self.limit  # host: sequence in each slot (-1 = free)
        self.slot_gen: list[int] = [0] * self.limit  # host: tokens generated so far
        self.first_version: dict[int, int] = {}
        self.prompts: dict[int, list[int]] = {}
        self.images: dict[int, Any] = {}  # sequence -> its prompt's ImageInputs (a vision-language model)
        self.max_new: dict[int, int] = {}
        self.stream: dict[int, tuple[int, int]] = {}  # sequence -> (key, stream index)
        self.waiting: deque[int] = deque()
        self.dropped: set[int] = set()  # live sequences nobody waits for any more: freed at the next check
        self.results: dict[int, Completion] = {}
        self.kept_logits: dict[tuple, torch.Tensor] = {}  # prompt key (:meth:`_pkey`) -> [V] first-token logits

    def add(self, q: int, prompt: list[int], max_new: int, key: int, stream: int, images: Any = None) -> None:
        """Queue sequence ``q`` (unique while it lives): ``max_new`` tokens at most (<= width),
        sampled from the stream ``(key, stream)``; ``images``: its prompt's ImageInputs (or None)."""
        if max_new > self.width:
            raise ValueError(f"max_new_tokens {max_new} exceeds this batcher's width {self.width}")
        self.prompts[q], self.max_new[q], self.stream[q] = prompt, max_new, (key, stream)
        if images is not None:
            self.images[q] = images
        self.waiting.append(q)

    def _pkey(self, q: int) -> tuple:
        """What makes two sequences' prompts the same KV: the tokens and the images object (the same text
        with other images is another prompt; a GRPO group shares one object; live while its sequences are)."""
        pics = self.images.get(q)
        return tuple(self.prompts[q]), None if pics is None else id(pics)

    # ---------------------------------------------------------------- main loop (a generate call)
    def run(self) -> dict[int, Completion]:
        """Decode every added sequence to its end; weights may be swapped in between (partial
        rollout: :meth:`reprefill`). Returns the completions by sequence."""
        while True:
            self.admit_all()
            self.compact()
            self.eng.stats["slots_in_use"] = self.n_active  # (Prometheus /metrics)
            if not self.n_active:
                return self.results
            self.decode()
            if self.eng._poll(self.weights_update):
                self.eng.stats["weight_swaps"] += 1
                self.reprefill()

    def admit_all(self) -> None:
        while self.admit():
            self.check()  # a first token may already be a stop (or the length limit)

    def decode(self) -> None:
        """Up to ``sync_every`` decode steps of the live slots (never past a sequence's limit), then a check."""
        remaining = min(self.max_new[q] - g for q, g in zip(self.slot_seq[:self.n_active], self.slot_gen) if q >= 0)
        k = min(self.eng.sync_every, remaining)
        draws = self._draws(k)
        for j in range(k):
            self.step(None if draws is None else draws[:, j])
        self.check()

    @property
    def n_active(self) -> int:
        n = len(self.slot_seq)
        while n and self.slot_seq[n - 1] < 0:
            n -= 1
        return n

    def _draws(self, k: int) -> torch.Tensor | None:
        """[n_active, k] float64: the draws of the next ``k`` decode steps of slots [0, n_active)
        (every one of them samples once a step, so step j's token index is gen + j). One hash of
        ~170 elementwise ops per ``sync_every`` steps instead of per step: on a GPU each is a
        kernel launch outside the captured graph. None when greedy."""
        if self.params.temperature == 0:
            return None
        n = self.n_active
        steps = self.gen[:n, None] + torch.arange(k, dtype=torch.int64, device=self.gen.device)
        return counter_uniform(self.key[:n, None], self.seq[:n, None].expand(n, k), steps)

    def _sample_into(self, slots: torch.Tensor, logits: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
        """Sample for ``slots`` [n] from ``logits`` [n, V]; record token/logprob/stop per slot.
        ``u``: the rows' draws when computed ahead (:meth:`_draws`), else computed here."""
        if u is None and self.params.temperature != 0:
            u = counter_uniform(self.key[slots], self.seq[slots], self.gen[slots])
        tok, lp = sample_rows(logits, self.params, u)
        g = self.gen[slots]
        self.out_tok[slots, g] = tok
        self.out_lp[slots, g] = lp
        hit = (tok[:, None] == self.stop[None, :]).any(-1) & ~self.done[slots]
        self.end[slots] = torch.where(hit, g + 1, self.end[slots])
        self.done[slots] |= hit
        self.gen[slots] = g + 1
        self.r.tok_in[slots] = tok
        return tok

    def step(self, u: torch.Tensor | None = None) -> None:
        n = self.n_active
        max_pos = max(len(self.prompts[q]) + self.slot_gen[i] - 1 for i, q in enumerate(self.slot_seq[:n]) if q >= 0)
        logits = self.r.decode(n, max_pos)
        self._sample_into(torch.arange(n, device=self.r.device), logits, u)
        self.r.pos[:n] += 1
        for i in range(n):
            self.slot_gen[i] += 1
        self.eng.stats["decode_steps"] += 1
        self.eng.stats["decode_rows"] += n

    def check(self) -> None:
        """Finish every slot whose sequence stopped, hit its length limit or was dropped."""
        n, version = self.n_active, self.eng.version
        done = self.done[:n].tolist()
        fin = [i for i in range(n) if self.slot_seq[i] >= 0 and (done[i] or self.slot_gen[i] >= self.max_new[
            self.slot_seq[i]] or self.slot_seq[i] in self.dropped)]
        if not fin:
            return
        idx = torch.tensor(fin, device=self.r.device)
        toks, lps, ends = self.out_tok[idx].tolist(), self.out_lp[idx].tolist(), self.end[idx].tolist()
        for j, i in enumerate(fin):
            q = self.slot_seq[i]
            length = ends[j] if done[i] else min(self.slot_gen[i], self.max_new[q])
            if q in self.dropped:
                self.dropped.discard(q)
                self.discarded(q)
            else:
                check_finite_logprobs(lps[j][:length], version)
                self.finished(i, q, Completion(tokens=toks[j][:length], logprobs=lps[j][:length],
                                               finish_reason="stop" if done[i] else "length",
                                               first_version=self.first_version[q], last_version=version))
            self.first_version.pop(q, None)
            for d in (self.prompts, self.max_new, self.stream, self.images):
                d.pop(q, None)
            self.slot_seq[i] = -1

    def finished(self, slot: int, q: int, completion: Completion) -> None:
        """Sequence ``q`` in ``slot`` is complete (its KV is still in the slot): keep the result."""
        self.results[q] = completion

    def discarded(self, q: int) -> None:
        """Sequence ``q`` was dropped before it finished (nobody waits for it)."""

    # ---------------------------------------------------------------- slots
    def admit(self) -> bool:
        """Prefill waiting sequences into free slots (:meth:`prefill`) and sample their first
        tokens. False when nothing was admitted."""
        free = [i for i in range(self.limit) if self.slot_seq[i] < 0]
        take = min(len(free), len(self.waiting))
        if take <= 0:
            return False
        seqs = [self.waiting.popleft() for _ in range(take)]
        gone = [q for q in seqs if q in self.dropped]  # dropped while waiting: never admitted
        for q in gone:
            self.dropped.discard(q)
            self.discarded(q)
            for d in (self.prompts, self.max_new, self.stream, self.images):
                d.pop(q, None)
        seqs = [q for q in seqs if q not in gone]
        if not seqs:
            return bool(self.waiting)
        slots = free[:len(seqs)]
        self.r.bind(slots, [self.prompts[q] for q in seqs], [self.images.get(q) for q in seqs])  # (a VLM: M-RoPE)
        logits = self.prefill(seqs, slots)
        dev = self.r.device
        slot_t = torch.tensor(slots, device=dev)
        self.key[slot_t] = torch.tensor([self.stream[q][0] for q in seqs], device=dev)
        self.seq[slot_t] = torch.tensor([self.stream[q][1] for q in seqs], device=dev)
        self.gen[slot_t] = 0
        self.done[slot_t] = False
        self.end[slot_t] = 0
        self.r.pos[slot_t] = torch.tensor([len(self.prompts[q]) for q in seqs], device=dev)
        self._sample_into(slot_t, logits)
        for s, q in zip(slots, seqs):
            self.slot_seq[s], self.slot_gen[s] = q, 1
            self.first_version[q] = self.eng.version
        return True

    def prefill(self, seqs: list[int], slots: list[int]) -> torch.Tensor:
        """Write the prompts of ``seqs`` into ``slots``' cache; [len(seqs), V] first-token logits.
        Identical prompts are prefilled once: a prompt still held by a live slot (a GRPO group
        split across two admissions) is copied from there, since a live slot's prompt KV
        (positions [0, len)) is never overwritten while it decodes, with its first-token
        logits kept from its own prefill."""
        live = {self._pkey(q): i for i, q in enumerate(self.slot_seq) if q >= 0}
        first: dict[tuple, int] = {}  # prompt key -> index (into seqs) of its first holder
        owner = []
        for j, q in enumerate(seqs):
            owner.append(first.setdefault(self._pkey(q), j))
        uniq = sorted(set(owner))
        keys = {u: self._pkey(seqs[u]) for u in uniq}
        fresh = [u for u in uniq if not (keys[u] in live and keys[u] in self.kept_logits)]
        if fresh:
            new = self.r.prefill([slots[u] for u in fresh], [list(keys[u][0]) for u in fresh])
            self.eng.stats["prefill_tokens"] += sum(len(keys[u][0]) for u in fresh)
            self.kept_logits.update({keys[u]: new[i] for i, u in enumerate(fresh)})
        for u in uniq:
            src = live.get(keys[u], slots[u]) if u not in fresh else slots[u]
            sharers = [slots[j] for j, o in enumerate(owner) if o == u and slots[j] != src]
            if sharers:
                self.r.copy_prefix(src, sharers, len(keys[u][0]))
        logits = torch.stack([self.kept_logits[self._pkey(q)] for q in seqs])
        # Keep only what the next admission can reuse: the prompt of the next waiting sequence.
        nxt = self._pkey(self.waiting[0]) if self.waiting else None
        self.kept_logits = {k: v for k, v in self.kept_logits.items() if k == nxt}
        return logits

    def compact(self) -> None:
        """Move the highest live slots into free ones below them, so live slots are [0, n)."""
        while True:
            n = self.n_active
            free = [i for i in range(n) if self.slot_seq[i] < 0]
            if not free:
                return
            src, dst = n - 1, free[0]
            # cached: the prompt and every fed token (the last sampled one is fed next, at its position)
            self.r.move_slot(src, dst, len(self.prompts[self.slot_seq[src]]) + self.slot_gen[src] - 1)
            for t in (self.key, self.seq, self.gen, self.done, self.end, self.out_tok, self.out_lp):
                t[dst] = t[src]
            self.slot_seq[dst], self.slot_gen[dst] = self.slot_seq[src], self.slot_gen[src]
            self.slot_seq[src] = -1

    def reprefill(self) -> None:
        """After a weight swap: recompute every live sequence's KV under the new weights."""
        self.kept_logits.clear()  # first-token logits of the old weights
        live = [i for i in range(self.n_active) if self.slot_seq[i] >= 0]
        if not live:
            return
        toks = self.out_tok[torch.tensor(live, device=self.r.device)].tolist()
        seqs = [list(self.prompts[self.slot_seq[i]]) + toks[j][:self.slot_gen[i] - 1] for j, i in enumerate(live)]
        self.r.prefill(live, seqs)
        self.eng.stats["prefill_tokens"] += sum(len(s) for s in seqs)
