"""How the built-in engine splits a Llama/Qwen model over its tensor-parallel ranks (pure).

Why it exists: with ``rollout_tensor_parallel: N`` a rollout node runs the static-KV forward
(:mod:`distflow.rollout.llama_forward`) on N ranks at once, each holding 1/N of every decoder
layer (Megatron's split, as nano-vllm and vLLM do it): q/k/v and gate/up are column-parallel
(each rank holds whole heads, ``num_heads / N`` query and ``num_kv_heads / N`` KV heads, and
``intermediate_size / N`` MLP columns: output rows of the weight, and of a bias), o_proj and
down_proj are row-parallel (the matching input columns; their outputs are all-reduced, a bias
added by rank 0 only). Embeddings and norms stay replicated, the LM head whole on rank 0: every
rank holds the same all-reduced hidden states, so rank 0's head gives the full logits without a
vocabulary gather (rank 0 alone samples; the followers skip the head and hold none of an untied
one). The split is done on the HF module's own parameters in place, so the runner's code is
unchanged but for its per-rank head counts, and each parameter keeps its name: a weight update is
sliced by name (:func:`shard_of`) into the shard each rank receives.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["COLUMN", "HEAD", "RANK0_ONLY", "REPLICATED", "ROW", "ROW_BIAS", "check_divisible", "kind_of",
           "shard_model", "shard_of", "untied_head"]

COLUMN, ROW, ROW_BIAS, HEAD, REPLICATED = "column", "row", "row_bias", "head", "replicated"
RANK0_ONLY = (ROW_BIAS, HEAD)  # what only rank 0 holds: the followers receive nothing of these
_COLUMN = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.", "mlp.up_proj.")
_ROW = ("self_attn.o_proj.", "mlp.down_proj.")


def check_divisible(config: Any, n: int) -> None:
    """Raise ValueError naming ``rollout_tensor_parallel`` when ``n`` does not divide the query
    heads, the KV heads and the MLP width (each rank computes whole heads and whole columns)."""
    from distflow.model_shape import undivided

    bad = [f"{what} ({v})" for what, v in undivided(config, n).items()]
    if bad:
        raise ValueError(f"rollout_tensor_parallel ({n}) must divide {', '.join(bad)} of the model: each engine rank "
                         "holds whole attention heads, whole KV heads and an equal share of the MLP")


def untied_head(model: Any) -> bool:
    """Whether the LM head is a tensor of its own, not the input embedding's (then only rank 0,
    which alone computes logits, holds it; a tied one is the embedding every rank needs)."""
    return model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()


def kind_of(name: str, tensor: torch.Tensor, head: bool = False) -> str:
    """How parameter ``name`` is split: :data:`COLUMN` (dim 0), :data:`ROW` (dim 1 of a weight),
    :data:`ROW_BIAS` (a row-parallel layer's bias: rank 0 holds it, the others zeros, so the
    all-reduce adds it once), :data:`HEAD` (``head``: an untied LM head, rank 0's alone) or
    :data:`REPLICATED`."""
    if any(p in name for p in _COLUMN):
        return COLUMN
    if any(p in name for p in _ROW):
        return ROW if tensor.dim() == 2 else ROW_BIAS
    if head and name.startswith("lm_head."):
        return HEAD
    return REPLICATED


def shard_of(name: str, full: torch.Tensor, rank: int, n: int, head: bool = False) -> torch.Tensor:
    """Rank ``rank``'s part of parameter ``name`` given its full value (a view where possible);
    ``head``: the LM head is untied (:func:`untied_head`)."""
    kind = kind_of(name, full, head)
    if kind == COLUMN:
        return full.chunk(n, dim=0)[rank]
    if kind == ROW:
        return full.chunk(n, dim=1)[rank]
    if kind == ROW_BIAS:
        return full if rank == 0 else torch.zeros_like(full)
    if kind == HEAD:
        return full if rank == 0 else full[:0]  # a follower's head: no rows (it computes no logits)
    return full


def shard_model(model: Any, rank: int, n: int, all_reduce: Callable[[torch.Tensor], None]) -> bool:
    """Replace every split parameter of ``model`` by rank ``rank``'s shard (a new contiguous
    tensor; the full one is freed) and make o_proj and down_proj all-reduce their outputs with
    ``all_reduce`` (in place, over the TP group). Returns whether the LM head is untied (then a
    follower holds none of it)."""
    check_divisible(model.config, n)
    head = untied_head(model)
    named = dict(model.named_parameters())
    for name, p in named.items():
        if kind_of(name, p, head) == REPLICATED:
            continue
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        part = shard_of(name, p.data, rank, n, head).contiguous().clone()
        setattr(module, attr, torch.nn.Parameter(part, requires_grad=False))
    for layer in model.model.layers:
        for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
            # F.linear adds a bias before the all-reduce: only rank 0 holds it (ROW_BIAS), so it counts once
            module.register_forward_hook(lambda _m, _i, out: _reduced(out, all_reduce))
    return head


def _reduced(out: torch.Tensor, all_reduce: Callable[[torch.Tensor], None]) -> torch.Tensor:
    all_reduce(out)
    return out
