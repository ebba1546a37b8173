"""The GPU memory plan of the built-in engine: how many KV-cache slots of how many positions.

Why it exists: the engine used to size its KV cache from a fraction of the memory *free* at its
first generate call. On a GPU shared with a trainer rank (``colocate``) the trainer has not yet
allocated its optimizer state or activations by then, so the engine took what the trainer
needed and the trainer ran out of memory at its first step (a 3B model was enough). The plan
here starts from the GPU's TOTAL memory instead, as vLLM's ``gpu_memory_utilization`` does:
``utilization`` of it is what every process on the GPU may use together; the trainer's budget
comes off first, the rest is split among the engines on the GPU, and each engine's weights and
prefill activations come off its share before the cache is sized. Free memory is only checked
(a clear error when the cache would not fit now), never the basis of the size.

Everything here is pure arithmetic on ints (no torch, no CUDA): tested with hand-computed numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_GPU_MEMORY_UTILIZATION", "KVPlan", "cache_length", "engine_share", "kv_token_bytes",
           "plan_kv_cache", "prefill_reserve_bytes"]

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # share of a GPU's total memory its processes may use (the rest: CUDA contexts)
GIB = 1 << 30


@dataclass(frozen=True)
class KVPlan:
    """The cache an engine allocates: ``slots`` x ``length`` positions of ``token_bytes`` each.

    ``budget_bytes``: what this engine's share leaves for the cache (and the per-slot logits
    buffer) after its weights and prefill reserve; ``cache_bytes``: K and V of every slot;
    ``capped``: fewer slots than asked for fit (the batcher decodes fewer at a time)."""

    slots: int
    length: int
    budget_bytes: int
    cache_bytes: int
    capped: bool


def kv_token_bytes(layers: int, kv_heads: int, head_dim: int, elem_size: int) -> int:
    """Bytes one cached position takes in one slot: K and V of every layer."""
    return 2 * layers * kv_heads * head_dim * elem_size


def prefill_reserve_bytes(max_prefill_tokens: int, hidden: int, intermediate: int, vocab: int, elem_size: int,
                          slots: int = 1) -> int:
    """Activation memory a prefill chunk of ``max_prefill_tokens`` may hold at once (its residual
    stream, q/k/v/attention output, the MLP's gate, up and product) plus the fp32 first-token
    logits of up to ``slots`` rows: kept out of the cache's budget so the first prefill after the
    cache is allocated does not run out of memory."""
    per_token = (5 * hidden + 3 * intermediate) * elem_size
    return max_prefill_tokens * per_token + slots * vocab * 4


def engine_share(utilization: float | None, trainer_fraction: float, sharers: int, colocate: bool
                 ) -> tuple[float, float, int]:
    """(utilization, trainer fraction, engines) of one engine's GPU from the config:
    ``engine_gpu_memory_utilization`` (null: :data:`DEFAULT_GPU_MEMORY_UTILIZATION`), the trainer's
    ``engine_trainer_memory_fraction`` when a trainer rank shares the GPU (``colocate``; else 0),
    and how many engines split the rest: the ``sharers`` nodes the launcher placed on the GPU
    (``DISTFLOW_GPU_NODES``) less the trainer rank."""
    util = DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else float(utilization)
    trainer = float(trainer_fraction) if colocate else 0.0
    engines = max(1, int(sharers) - (1 if colocate else 0))
    if not 0 < util <= 1 or not 0 <= trainer < util:
        raise ValueError(f"GPU memory: engine_trainer_memory_fraction {trainer:g} must be below "
                         f"engine_gpu_memory_utilization {util:g} (both shares of the GPU's total memory)")
    return util, trainer, engines


def cache_length(max_length: int | None, need: int) -> int:
    """Positions a call asks every slot to hold: the run's bound (``max_prompt_length +
    max_new_tokens``) when there is one, fixed from the first call so the cache never regrows
    mid-run (a regrow frees the cache and drops every CUDA graph in the middle of a step), else
    this call's ``need``, which the plan then stretches as far as the budget allows
    (:func:`plan_kv_cache`'s ``grow_to``). Never below ``need``."""
    return max(int(max_length), need) if max_length is not None else need


def plan_kv_cache(total_bytes: int, model_bytes: int, trainer_bytes: int, utilization: float, token_bytes: int, *,
                  want_slots: int, length: int, engines: int = 1, slot_extra_bytes: int = 0,
                  reserve_bytes: int = 0, grow_to: int | None = None, align: int = 128) -> KVPlan:
    """The slots of ``length`` positions one engine allocates.

    ``floor(total_bytes * utilization) - trainer_bytes`` is what the engines on the GPU may use
    together, ``engines`` equal shares; from this engine's, its ``model_bytes`` (weights) and
    ``reserve_bytes`` (prefill activations) come off, and the rest holds as many slots as fit
    (at most ``want_slots``), each ``length * token_bytes`` of K and V plus ``slot_extra_bytes``
    (the CUDA graphs' fp32 logits row). ``grow_to`` (the model's positions, when the run has no
    prompt bound): the slots' length is then stretched to what the budget holds for those slots,
    in multiples of ``align``, at most ``grow_to`` rounded up to ``align``: sized once from the
    budget, so a later, longer call finds room instead of regrowing the cache. Raises a
    RuntimeError naming the keys to change when not even one slot fits."""
    share = (int(total_bytes * utilization) - int(trainer_bytes)) // max(1, engines)
    budget = share - int(model_bytes) - int(reserve_bytes)
    per_slot = length * token_bytes + slot_extra_bytes
    slots = min(want_slots, max(0, budget) // per_slot)
    if slots < 1:
        raise RuntimeError(
            f"KV cache: one slot of {length} positions needs {per_slot / GIB:.2f} GiB, but this engine's share of the "
            f"GPU ({utilization:g} of {total_bytes / GIB:.1f} GiB [engine_gpu_memory_utilization], less "
            f"{trainer_bytes / GIB:.1f} GiB for a colocated trainer [engine_trainer_memory_fraction], split among "
            f"{engines} engine(s)) less its weights ({model_bytes / GIB:.2f} GiB) and prefill reserve "
            f"({reserve_bytes / GIB:.2f} GiB) leaves {budget / GIB:.2f} GiB: lower max_new_tokens or "
            f"max_prompt_length (unset, every slot holds the model's max_position_embeddings), or raise the share")
    if grow_to is not None and grow_to > length:
        room = (budget // slots - slot_extra_bytes) // token_bytes // align * align
        length = max(length, min(-(-grow_to // align) * align, room))
    return KVPlan(slots=slots, length=length, budget_bytes=budget, cache_bytes=slots * length * token_bytes,
                  capped=slots < want_slots)
