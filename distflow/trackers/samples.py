"""A step's sample table: the top-k and bottom-k samples by reward, as text.

Why top and bottom: the best responses show what the policy learned, the worst show what
it still gets wrong (or a reward function that misfires); a random handful shows neither.
Why per step and not overwritten: a table that only ever holds the newest step cannot show
how the answers changed, which is the one thing a sample table is for.

Trainer rank 0 builds the table from the samples *it* owns this step (samples are routed to
ranks by a hash of their id, so that is an unbiased share of the step; no process sees all
samples, by design). Picking the rows is a few tensor ops on rank 0's loop; turning tokens
into text happens later, on the trackers' thread.
"""

from __future__ import annotations

from typing import Any, Callable


def pick_rows(batch: Any, k: int) -> list[dict[str, Any]]:
    """Up to ``k`` best and ``k`` worst samples of ``batch`` (a SampleBatch) by reward, best
    first then worst first, each once (a batch of fewer than 2k samples is split between
    them). Token ids, not text: ``decode_rows`` turns them into text."""
    n = len(batch)
    if n == 0 or k <= 0:
        return []
    t = batch.tensors
    rewards = t["reward"].float().tolist()
    plens, rlens = t["prompt_lens"].tolist(), t["response_lens"].tolist()
    p_off = [0] * n
    r_off = [0] * n
    for i in range(1, n):
        p_off[i] = p_off[i - 1] + plens[i - 1]
        r_off[i] = r_off[i - 1] + rlens[i - 1]
    order = sorted(range(n), key=lambda i: (-rewards[i], i))
    top = order[:min(k, (n + 1) // 2)]
    bottom = [i for i in reversed(order) if i not in set(top)][:k]
    prompts, responses = t["prompt_tokens"], t["response_tokens"]
    rows = []
    for kind, picked in (("top", top), ("bottom", bottom)):
        for rank, i in enumerate(picked):
            rows.append({"kind": kind, "rank": rank, "reward": rewards[i], "sample_id": batch.sample_ids[i],
                         "prompt": prompts[p_off[i]: p_off[i] + plens[i]].tolist(),
                         "response": responses[r_off[i]: r_off[i] + rlens[i]].tolist()})
    return rows


def decode_rows(step: int, rows: list[dict[str, Any]], decode: Callable[[list[int]], str] | None) -> list[dict]:
    """``rows`` with text for token ids (``decode`` None: the ids as text) and the step."""
    def text(ids: list[int]) -> str:
        return decode(ids) if decode is not None else " ".join(map(str, ids))

    return [{**r, "step": step, "prompt": text(r["prompt"]), "response": text(r["response"])} for r in rows]
