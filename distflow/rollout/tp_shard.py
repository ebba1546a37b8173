"""How the built-in engine splits a Llama/Qwen model over its tensor-parallel ranks (pure).

Why it exists: with ``rollout_tensor_parallel: N`` a rollout node runs the static-KV forward
(:mod:`distflow.rollout.llama_forward`) on N ranks at once, each holding 1/N of every decoder
layer (Megatron's split, as nano-vllm and vLLM do it): q/k/v and gate/up are column-parallel
(each rank holds whole heads, ``num_heads / N`` query and ``num_kv_heads / N`` KV heads, and
``intermediate_size / N`` MLP columns: output rows of the weight, and of a bias), o_proj and
down_proj are row-parallel (the matching input columns; their outputs are all-reduced, a bias
added by rank 0 only). Embeddings, norms and the LM head stay replicated: every rank holds the
same all-reduced hidden states, so rank 0's whole LM head gives the full logits without a
vocabulary gather (rank 0 alone samples; the followers skip the head). The split is done on the HF module's own parameters in place, so the runner's
code is unchanged but for its per-rank head counts, and each parameter keeps its name: a weight
update is sliced by name (:func:`shard_of`) into the shard each rank receives.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["COLUMN", "ROW", "ROW_BIAS", "REPLICATED", "check_divisible", "kind_of", "shard_model", "shard_of"]

COLUMN, ROW, ROW_BIAS, REPLICATED = "column", "row", "row_bias", "replicated"
_COLUMN = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.", "mlp.up_proj.")
_ROW = ("self_attn.o_proj.", "mlp.down_proj.")


def check_divisible(config: Any, n: int) -> None:
    """Raise ValueError naming ``rollout_tensor_parallel`` when ``n`` does not divide the query
    heads, the KV heads and the MLP width (each rank computes whole heads and whole columns)."""
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    width = int(config.intermediate_size)
    bad = [f"{what} ({v})" for what, v in (("num_attention_heads", heads), ("num_key_value_heads", kv),
                                           ("intermediate_size", width)) if v % n]
    if bad:
        raise ValueError(f"rollout_tensor_parallel ({n}) must divide {', '.join(bad)} of the model: each engine rank "
                         "holds whole attention heads, whole KV heads and an equal share of the MLP")


def kind_of(name: str, tensor: torch.Tensor) -> str:
    """How parameter ``name`` is split: :data:`COLUMN` (dim 0), :data:`ROW` (dim 1 of a weight),
    :data:`ROW_BIAS` (a row-parallel layer's bias: rank 0 holds it, the others zeros, so the
    all-reduce adds it once) or :data:`REPLICATED`."""
    if any(p in name for p in _COLUMN):
        return COLUMN
    if any(p in name for p in _ROW):
        return ROW if tensor.dim() == 2 else ROW_BIAS
    return REPLICATED


def shard_of(name: str, full: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s part of parameter ``name`` given its full value (a view where possible)."""
    kind = kind_of(name, full)
    if kind == COLUMN:
        return full.chunk(n, dim=0)[rank]
    if kind == ROW:
        return full.chunk(n, dim=1)[rank]
    if kind == ROW_BIAS:
        return full if rank == 0 else torch.zeros_like(full)
    return full


def shard_model(model: Any, rank: int, n: int, all_reduce: Callable[[torch.Tensor], None]) -> list[Any]:
    """Replace every split parameter of ``model`` by rank ``rank``'s shard (a new contiguous
    tensor; the full one is freed) and make o_proj and down_proj all-reduce their outputs with
    ``all_reduce`` (in place, over the TP group). Returns the hook handles."""
    check_divisible(model.config, n)
    named = dict(model.named_parameters())
    for name, p in named.items():
        if kind_of(name, p) == REPLICATED:
            continue
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        part = shard_of(name, p.data, rank, n).contiguous().clone()
        setattr(module, attr, torch.nn.Parameter(part, requires_grad=False))
    handles = []
    for layer in model.model.layers:
        for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
            # F.linear adds a bias before the all-reduce: only rank 0 holds it (ROW_BIAS), so it counts once
            handles.append(module.register_forward_hook(lambda _m, _i, out: _reduced(out, all_reduce)))
    return handles


def _reduced(out: torch.Tensor, all_reduce: Callable[[torch.Tensor], None]) -> torch.Tensor:
    all_reduce(out)
    return out
