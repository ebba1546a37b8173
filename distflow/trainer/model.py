"""Loading a Hugging Face causal LM for training: fp32 master weights, FSDP2, mixed precision.

Why it exists: the actor, its frozen reference and a PPO critic all need the same recipe,
and getting it wrong is silent (a bf16 master copy rounds lr-1e-6 updates away). So:

* the model is loaded in **fp32** (master weights; the optimizer state follows them); with
  more than one rank only rank 0 reads the checkpoint (into host memory), every rank builds
  the model on the meta device, shards it and receives its shards from rank 0
  (:func:`shard_fp32`), so no rank holds the whole model on its GPU;
* ``dtype`` is the **compute** dtype: FSDP2's ``MixedPrecisionPolicy(param_dtype=dtype,
  reduce_dtype=float32)`` all-gathers the parameters cast to ``dtype`` for forward/backward
  and reduce-scatters gradients in fp32 (works on gloo/CPU as on NCCL; tested);
* attention is ``distflow_varlen`` (:mod:`distflow.trainer.attention`): packed rows attend
  per sample, padded batches use transformers' SDPA;
* dropout is **off** everywhere (the rollout engine samples in eval mode; the trainer must
  compute the same distribution) while the module stays in train mode, which activation
  checkpointing needs;
* ``activation_checkpointing`` checkpoints every decoder layer (transformers'
  ``GradientCheckpointingLayer``, non-reentrant, FSDP2 hooks outside the checkpoint);
* with ``tensor_parallel`` > 1 the trainer mesh is 2-D ``(dp, tp)``: each decoder layer's
  attention and MLP are first split over ``tp`` (:mod:`distflow.trainer.parallel`), then
  FSDP2 shards over ``dp``; with ``sequence_parallel`` > 1 it is ``(dp, sp)`` (or ``(dp, sp, tp)``) and
  FSDP2 shards over dp x sp (:mod:`distflow.trainer.ulysses`: each rank holds 1/N of every packed row);
* every decoder layer and then the root are ``fully_shard``-ed on the trainer's (dp) device
  mesh, and :func:`~distflow.trainer.head.response_forward` is registered as an FSDP
  forward method, so ``model.response_forward(inputs, temperature, chunk)`` all-gathers the
  root's parameters (embeddings, final norm, LM head) like ``forward`` does.
"""

from __future__ import annotations

import logging
import math
import types
from typing import Any, Callable

import torch

from distflow.trainer.collectives import count_fsdp, counted
from distflow.device import COMPUTE_DTYPES
from distflow.hf import load_causal_lm, meta_causal_lm
from distflow.trainer.attention import use_varlen_attention
from distflow.trainer.head import response_forward
from distflow.trainer.parallel import apply_tensor_parallel, dp_mesh, is_mesh_rank0, sp_size, tp_size
from distflow.trainer.ulysses import check_sp_model

log = logging.getLogger(__name__)

__all__ = ["DTYPES", "clip_and_step", "disable_dropout", "gather_full_state", "grad_norm", "load_for_training",
           "load_from_rank0", "shard_fp32", "shard_mixed_precision"]

DTYPES = COMPUTE_DTYPES


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability of ``model`` to 0 (nn.Dropout modules, attention-dropout
    attributes and the config's ``*dropout*`` fields), keeping train mode. Returns ``model``."""
    cfg = getattr(model, "config", None)
    if cfg is not None:
        for key, value in list(vars(cfg).items()):
            if "dropout" in key and isinstance(value, float):
                setattr(cfg, key, 0.0)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for attr in ("attention_dropout", "dropout", "resid_dropout"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    return model


def shard_mixed_precision(model: torch.nn.Module, mesh: Any, compute_dtype: torch.dtype,
                          layers: Any = None, fp32_modules: Any = ()) -> torch.nn.Module:
    """``fully_shard`` each of ``layers`` (default: the decoder layers, ``model.model.layers``)
    and then ``model``, with ``MixedPrecisionPolicy(param_dtype=compute_dtype,
    reduce_dtype=float32)`` unless ``compute_dtype`` is fp32. The parameters are fp32 (the
    master weights), or already ``compute_dtype`` for a frozen model (FSDP2 then casts
    nothing). ``fp32_modules`` (e.g. the critic's value head) are units of their own that
    compute in fp32 (the root's policy would hand them bf16-rounded weights); they must be
    called as modules, so their hooks run. Returns ``model``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh}
    if compute_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        for m in fp32_modules:
            fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                     reduce_dtype=torch.float32))
    if layers is None:  # a vision-language model's decoder layers are under .model.language_model; its vision
        inner = getattr(model, "model", model)  # tower stays in the root unit (gathered with it, once per forward)
        layers = getattr(inner, "layers", None) or getattr(getattr(inner, "language_model", None), "layers", None) or []
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    count_fsdp(model)  # the hang watch counts its all-gathers and reduce-scatters (distflow.progress)
    return model


def enable_activation_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing of every decoder layer, by the name this
    transformers release has (``activation_checkpointing_enable`` from 5.2x on,
    ``gradient_checkpointing_enable`` before)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_for_training(path: str, mesh: Any, device: torch.device, compute_dtype: torch.dtype, *,
                      activation_checkpointing: bool = False, trainable: bool = True, lora: Any = None,
                      adapter_from: str | None = None, freeze_vision: bool = False) -> Any:
    """Load ``path`` in fp32 on ``device``, shard it with FSDP2 on ``mesh`` with mixed
    precision ``compute_dtype`` and return it (train mode, dropout off; ``trainable=False``
    freezes it: a reference model, whose shards are kept in ``compute_dtype`` since a model that
    never steps needs no fp32 master copy: the same values reach its forward, in half the memory).
    ``model.response_forward(inputs, temperature, chunk)`` is its FSDP-aware logprob forward.
    ``lora`` (the config's ``model.lora``): PEFT adapters are injected before sharding, on the
    loaded model and on the meta one alike (so rank 0's adapter initialisation, or the adapter of
    the PEFT directory ``adapter_from``, reaches every rank), and only they stay trainable.
    A vision-language model (Qwen2-VL) keeps transformers' SDPA attention (its M-RoPE batches are
    padded, never packed); ``freeze_vision`` fixes its vision tower's weights."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    def with_lora(model: Any, loaded: bool) -> Any:
        if lora is None:
            return model
        from distflow.trainer.lora import inject_lora, load_adapter

        model = inject_lora(model, lora, path)
        if loaded and adapter_from is not None:
            from pathlib import Path

            load_adapter(model, Path(adapter_from))
        return model

    def prepare(model: Any) -> None:
        model.config.use_cache = False
        vision = getattr(getattr(model, "model", None), "visual", None)
        if vision is None:
            use_varlen_attention(model, path)
        elif freeze_vision:
            vision.requires_grad_(False)
        disable_dropout(model)
        if lora is not None and lora.dropout > 0:  # the adapters' own dropout is a training choice: kept
            for name, m in model.named_modules():
                if isinstance(m, torch.nn.Dropout) and ".lora_dropout." in name + ".":
                    m.p = lora.dropout
        if activation_checkpointing and trainable:
            enable_activation_checkpointing(model)
        if not trainable:
            model.requires_grad_(False)

    dtype = torch.float32 if trainable else compute_dtype
    model = shard_fp32(lambda: with_lora(load_causal_lm(path, dtype, "cpu"), True),
                       lambda: with_lora(meta_causal_lm(path, dtype), False), mesh, device, compute_dtype, prepare)
    model.response_forward = types.MethodType(response_forward, model)
    register_fsdp_forward_method(model, "response_forward")
    return model.train()


def shard_fp32(load: Callable[[], torch.nn.Module], meta: Callable[[], torch.nn.Module], mesh: Any,
               device: torch.device, compute_dtype: torch.dtype,
               prepare: Callable[[torch.nn.Module], Any] = lambda m: None,
               fp32_modules: Callable[[torch.nn.Module], list[torch.nn.Module]] = lambda m: []) -> torch.nn.Module:
    """A model sharded on ``mesh`` (:func:`shard_mixed_precision`), on ``device``, in the dtype
    ``load``/``meta`` build it in: fp32 master weights to train, the compute dtype for a frozen
    model. ``load()`` gives the whole model in host memory, ``meta()`` its structure on the meta
    device; ``prepare(model)`` runs before sharding, ``fp32_modules(model)`` names the submodules that
    compute in fp32 (:func:`shard_mixed_precision`). One rank: the loaded model, moved. More:
    only mesh rank 0 loads, every rank shards ``meta()``, and the shards come from rank 0
    (:func:`load_from_rank0`), so no rank holds the whole model on its GPU."""
    full = None
    if mesh.size() == 1:
        model = load().to(device)
    else:
        full = load() if is_mesh_rank0(mesh) else None
        model = meta()
    prepare(model)
    apply_tensor_parallel(model, mesh)  # a 2-D (dp, tp) mesh: the layers split over tp first (trainer.parallel)
    check_sp_model(model.config, sp_size(mesh), tp_size(mesh))  # an sp dimension: Ulysses splits the heads
    shard_mixed_precision(model, dp_mesh(mesh), compute_dtype, fp32_modules=fp32_modules(model))
    if mesh.size() > 1:
        model.to_empty(device=device)
        load_from_rank0(model, full, mesh)
    return model


def load_from_rank0(model: torch.nn.Module, full: torch.nn.Module | None, mesh: Any) -> None:
    """Fill a sharded, materialised-but-empty ``model`` from ``full`` (the loaded model on mesh
    rank 0, None elsewhere): parameters and persistent buffers through
    ``set_model_state_dict(broadcast_from_rank0=True)`` (each rank keeps its shards), then every
    buffer, the non-persistent ones (rotary tables) included, broadcast from rank 0. A collective.

    Why: loading the whole model on every rank costs a full fp32 copy per rank in host memory and
    on each GPU before sharding (a 14B model is 56 GB): rank 0 alone now holds one, in host memory."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, full.state_dict() if full is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    group = mesh.get_group() if mesh.ndim == 1 else None  # a 2-D trainer mesh spans the whole (default) group
    root = int(mesh.mesh.flatten()[0])
    src = dict(full.named_buffers()) if full is not None else {}
    for name, buf in model.named_buffers():
        if full is not None:
            buf.copy_(src[name])
        counted("broadcast", dist.broadcast, buf, src=root, group=group)


def gather_full_state(model: torch.nn.Module, keep: bool, device: torch.device | str,
                      only: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """``model``'s unsharded state dict on the CPU where ``keep`` (e.g. rank 0, which writes the
    checkpoint), never sharing memory with the live parameters; ``{}`` elsewhere. ``device``:
    the model's (:func:`distflow.device.node_device`).

    A collective: EVERY rank must call it. It is the weight publisher's gather
    (:func:`~distflow.trainer.gather.iter_weight_buckets`): each shard owner sends its rows to the
    keeping ranks only, a bucket's transfers batched and two buckets in flight, where
    ``full_tensor()`` on every rank had sent the whole model to every rank, one tensor at a time.
    The tensors are views of their bucket's buffer (``save_pretrained`` and safetensors take
    them as they are). A tied parameter (an LM head that is the embedding) is gathered once:
    its other names get the same host tensor (``tied_names``). ``only``: the names to gather (the
    LoRA adapters), None = all."""
    from distflow.weights import BUCKET_BYTES, tied_names
    from distflow.trainer.gather import iter_weight_buckets

    out: dict[str, torch.Tensor] = {}
    for bucket in iter_weight_buckets(model, BUCKET_BYTES, keep, device, place="cpu", only=only):
        out.update(bucket)
    if not keep:
        return out
    for names in tied_names(model):
        for alias in names[1:]:
            if names[0] in out:
                out[alias] = out[names[0]]
    return {name: out[name] for name in model.state_dict() if name in out}  # the model's order


def clip_and_step(model: torch.nn.Module, optim: torch.optim.Optimizer, max_norm: float, what: str) -> float:
    """Clip ``model``'s gradients to a global norm of ``max_norm`` and step ``optim``; returns the
    norm before clipping. A norm that is not finite (a NaN or inf gradient anywhere) skips the step
    and drops the gradients instead: clipping by it makes every update NaN, which AdamW writes
    into the fp32 masters on every rank and the next weight sync ships to every rollout node, for
    the rest of the run. The norm is replicated (``full_tensor``), so every rank skips alike; it
    is read on the host, one sync per optimizer step. ``what`` names the model in the warning.
    The gradients are freed either way: kept, they would hold a sharded fp32 copy of the model
    on every GPU through the weight publish, the checkpoint and the next step's forward passes."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = grad_norm([p.grad for p in params])
    value = float(norm)
    finite = math.isfinite(value)
    if finite:
        for group in _by_mesh(params, lambda p: p.grad).values():  # a foreach op takes one mesh's tensors
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        optim.step()
    optim.zero_grad(set_to_none=True)
    if not finite:
        log.warning("%s: gradient norm is %s: optimizer step skipped (weights and optimizer state unchanged)",
                    what, value)
    return value


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of ``grads`` (plain tensors or DTensors on any meshes), replicated: a plain
    tensor on every rank. Why not ``clip_grad_norm_``: with tensor parallelism the gradients live on
    two meshes (the layers' on ``(dp, tp)``, the replicated norms' and embeddings' on ``dp``), and it
    stacks their norms, which DTensor refuses across meshes; here each mesh's norm is made whole
    (``full_tensor``) first and the squares are summed (one mesh: its norm as it is)."""
    if not grads:
        return torch.zeros(())
    norms = []
    for gs in _by_mesh(grads, lambda g: g).values():
        n = torch.nn.utils.get_total_norm(gs, 2.0)
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    if len(norms) == 1:
        return norms[0]
    return torch.stack([n.to(norms[0].device) for n in norms]).square().sum().sqrt()


def _by_mesh(items: list[Any], tensor: Callable[[Any], torch.Tensor]) -> dict[Any, list[Any]]:
    """``items`` grouped by the device mesh of ``tensor(item)`` (None: a plain tensor), in order."""
    out: dict[Any, list[Any]] = {}
    for item in items:
        out.setdefault(getattr(tensor(item), "device_mesh", None), []).append(item)
    return out
