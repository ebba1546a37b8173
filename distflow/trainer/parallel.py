"""The trainer's device mesh: FSDP2 data parallel x tensor parallel (``tensor_parallel``) x sequence
parallel (``sequence_parallel``, Ulysses: :mod:`distflow.trainer.ulysses`).

Why it exists: a model too big for FSDP2 alone (its layers' activations and gathered weights per
GPU) is split inside each layer too, Megatron-style, as torchtitan does: the trainer's
``trainer_nodes`` ranks form a 2-D mesh ``(dp, tp)`` (``tp = tensor_parallel``, consecutive ranks
share a TP group, so on GPUs a TP group is one host's NVLink domain), every decoder layer's
attention and MLP are ``parallelize_module``-d over ``tp`` and then everything is ``fully_shard``-ed
over ``dp``.

The plan (the Llama/Qwen family, transformers' own ``base_model_tp_plan``): ``ColwiseParallel`` on
q/k/v and gate/up (each TP rank computes ``num_heads / tp`` heads, ``num_kv_heads / tp`` KV heads and
``intermediate_size / tp`` MLP columns, on its local tensor), ``RowwiseParallel`` on o and down
(one all-reduce each: the layer's output is replicated again). The embeddings, norms and LM head
stay replicated over ``tp`` (sharded over ``dp`` by FSDP2): the chunked logprob head
(:mod:`distflow.trainer.head`) runs unchanged on replicated hidden states, and the gradients of
replicated parameters come out equal on every TP rank (the column-parallel inputs' gradients are
all-reduced), so FSDP2 reduces them over ``dp`` only.

A TP group computes ONE data-parallel share: its ranks must see the same samples. Each trainer
rank receives its own samples (owner routing); the actor unites its TP group's samples before a
pass (:func:`share_union`) and keeps its own rows of the results. Counts all-reduced over the whole
group then count each sample ``tp`` times, which the step's normalisers (global / world) absorb.

With ``sequence_parallel: N`` the mesh is ``(dp, sp)``: an SP group of N consecutive ranks
also computes ONE data-parallel share (united by the same :func:`share_union`), each rank holding
1/N of every packed row; FSDP2 shards over all ``dp x sp`` ranks (the flattened mesh), since each
SP rank's gradients come from other tokens. Both at once: ``(dp, sp, tp)``, TP innermost; the share
group is then the SP x TP ranks, and FSDP2 shards over ``dp x sp`` (torchtitan's dp x cp x tp).

Weights leave through ``full_tensor()`` of each DTensor, whatever its mesh
(:mod:`distflow.trainer.gather`): rollout nodes and checkpoints get the same tensors as with
``tensor_parallel: 1``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TP_PLAN", "apply_tensor_parallel", "check_tp_model", "dp_mesh", "is_mesh_rank0", "share_size",
           "share_union", "sp_group", "sp_size", "tp_size", "trainer_mesh"]

# module name under each decoder layer -> "colwise" | "rowwise" (transformers' base_model_tp_plan of Llama/Qwen)
TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
           "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
           "mlp.down_proj": "rowwise"}


def trainer_mesh(device_type: str, world: int, tp: int, sp: int = 1) -> Any:
    """The trainer group's device mesh: 1-D ``(world,)`` for ``tp == sp == 1`` (plain FSDP2), else the
    dimensions ``dp``, then ``sp`` when ``sp > 1``, then ``tp`` when ``tp > 1`` (innermost: consecutive
    ranks share a TP group, then an SP group), e.g. ``(world // (sp * tp), sp, tp)`` named
    ``("dp", "sp", "tp")``. ``world`` must be divisible by ``tp * sp`` (the config checks it; said again
    here, naming the keys, for a caller that built its own)."""
    from torch.distributed.device_mesh import init_device_mesh

    if tp < 1 or world % tp:
        raise ValueError(f"tensor_parallel ({tp}) must divide trainer_nodes ({world})")
    if sp < 1 or world % (sp * tp):
        raise ValueError(f"sequence_parallel ({sp}) x tensor_parallel ({tp}) must divide trainer_nodes ({world})")
    if tp == sp == 1:
        return init_device_mesh(device_type, (world,))
    dims = [("dp", world // (sp * tp))] + [(n, k) for n, k in (("sp", sp), ("tp", tp)) if k > 1]
    return init_device_mesh(device_type, tuple(k for _, k in dims), mesh_dim_names=tuple(n for n, _ in dims))


def _has(mesh: Any, dim: str) -> bool:
    return dim in (mesh.mesh_dim_names or ())


def tp_size(mesh: Any) -> int:
    """The tensor-parallel degree of a trainer mesh (1 without a ``tp`` dimension)."""
    return mesh["tp"].size() if _has(mesh, "tp") else 1


def sp_size(mesh: Any) -> int:
    """The sequence-parallel degree of a trainer mesh (1 without an ``sp`` dimension)."""
    return mesh["sp"].size() if _has(mesh, "sp") else 1


def share_size(mesh: Any) -> int:
    """How many ranks compute one data-parallel share together (its SP x TP group; 1 for a 1-D mesh)."""
    return tp_size(mesh) * sp_size(mesh)


def sp_group(mesh: Any) -> Any:
    """This rank's sequence-parallel process group, or None without an ``sp`` dimension."""
    return mesh["sp"].get_group() if _has(mesh, "sp") else None


def _share_mesh(mesh: Any) -> Any:
    """The 1-D mesh of this rank's share group (its ``tp``, ``sp``, or both flattened), or None."""
    dims = tuple(d for d in ("sp", "tp") if _has(mesh, d))
    if not dims:
        return None
    return mesh[dims[0]] if len(dims) == 1 else mesh[dims]._flatten("sp_tp")


def dp_mesh(mesh: Any) -> Any:
    """The mesh FSDP2 shards over: the ``dp`` dimension when there is no ``sp`` (the split layers are
    sharded over ``tp`` already); ``dp`` and ``sp`` flattened when there is (every SP rank holds
    gradient contributions of other tokens, so the gradient reduce spans them all, as verl's FSDP does
    with Ulysses and torchtitan's over dp x cp); a 1-D mesh itself."""
    if mesh.ndim == 1 and not _has(mesh, "dp"):
        return mesh
    if not _has(mesh, "sp"):
        return mesh["dp"]
    return mesh["dp", "sp"]._flatten("dp_sp")  # cached by name: the same mesh on every call


def is_mesh_rank0(mesh: Any) -> bool:
    """Whether this rank is the mesh's first (the one that reads the checkpoint), on any mesh."""
    return all(c == 0 for c in mesh.get_coordinate())


def check_tp_model(config: Any, tp: int) -> None:
    """Refuse, naming the key, a model whose heads or MLP width ``tp`` does not divide (each TP rank
    computes whole heads), or that is not of the Llama/Qwen layout :data:`TP_PLAN` names."""
    if tp == 1:
        return
    from distflow.model_shape import undivided

    bad = undivided(config, tp)
    if bad:
        what, n = next(iter(bad.items()))
        raise ValueError(f"tensor_parallel: {tp} must divide the model's {what} ({n}): each tensor-parallel "
                         "rank computes whole heads and an equal share of the MLP")


def apply_tensor_parallel(model: torch.nn.Module, mesh: Any) -> None:
    """``parallelize_module`` every decoder layer of ``model`` (a Hugging Face ``*ForCausalLM``) over
    ``mesh["tp"]`` with :data:`TP_PLAN`; a 1-D mesh: nothing. Runs before ``fully_shard``. The layers'
    parameters become DTensors sharded over ``tp`` (FSDP2 then adds the ``dp`` dimension)."""
    if tp_size(mesh) == 1:
        return
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh["tp"]
    check_tp_model(model.config, tp.size())
    layers = getattr(getattr(model, "model", model), "layers", None)
    if not layers:
        raise ValueError(f"tensor_parallel: {type(model).__name__} has no decoder layers (model.layers) to split")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in layers:
        names = {name for name, _ in layer.named_modules()}
        missing = [name for name in TP_PLAN if name not in names]
        if missing:
            raise ValueError(f"tensor_parallel: {type(layer).__name__} has no {', '.join(missing)}; the "
                             "tensor-parallel plan covers the Llama/Qwen layout (q/k/v/o_proj, gate/up/down_proj)")
        parallelize_module(layer, tp, {name: styles[style]() for name, style in TP_PLAN.items()})


def share_union(batch: Any, mesh: Any) -> tuple[Any, slice]:
    """The samples of this rank's whole share group (its TP, SP or SP x TP ranks, in group-rank order)
    and where this rank's own are in it: ``(united batch, slice)``. A collective over that group
    (objects through gloo/NCCL); a 1-D mesh returns ``(batch, slice(None))`` and moves nothing."""
    share = _share_mesh(mesh)
    if share is None:
        return batch, slice(None)
    from distflow.buffer.batch import SampleBatch
    from distflow.trainer.collectives import counted

    parts: list[Any] = [None] * share.size()
    counted("all_gather_object", dist.all_gather_object, parts, batch, group=share.get_group())
    me = share.get_local_rank()
    start = sum(len(p) for p in parts[:me])
    nonempty = [p for p in parts if len(p)]
    united = SampleBatch.concat(nonempty) if nonempty else batch
    return united, slice(start, start + len(batch))
