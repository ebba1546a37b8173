"""PPO's critic: its own FSDP2-sharded value model and optimizer, trained in the trainer group.

Why it exists: PPO's advantages come from a learned value function (GAE). The critic is
the actor's architecture with the LM head replaced by a scalar value head, initialised
from ``critic_path`` (a critic directory this module saved, or any Hugging Face causal
LM, whose decoder is used) or from ``model_path``. It has its own optimizer
(``critic_lr``), is checkpointed beside the actor (``<checkpoint>/critic/``: config,
``value_model.safetensors`` and the sharded optimizer state) and resumed with
``resume_from``.

Value convention (as verl): the value of response token t is read at the hidden state
that PREDICTS token t (the position before it), i.e. the state in which it was chosen;
``ModelInputs.index`` already holds exactly those positions.

Collectives must line up across ranks although ranks hold different sample counts, so,
like the actor, every pass agrees on its micro-batch count (all-reduce MAX) and ranks with
fewer run dummy micro-batches; the loss is normalised by the global token count / world.
This file keeps a small local version of that rule (:func:`_micro_batches`) on the
``distflow.trainer.packing`` inputs, so it does not depend on the actor's internals.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from distflow.buffer.batch import SampleBatch
from distflow.core.config import Config
from distflow.core.dag import WorkflowNode
from distflow.device import node_device
from distflow.rl.registry import VALUE_LOSSES, resolve
from distflow.rl.shaping import response_loss_mask, sampled_token_counts
from distflow.trainer.actor import (DeviceSums, all_reduce, apply_optimizer_config, load_optimizer,
                                    ragged_in_batch_order, save_optimizer, step_micro_batches)
from distflow.trainer.attention import model_attention_mask, use_varlen_attention
from distflow.trainer.model import (DTYPES, clip_and_step, disable_dropout, enable_activation_checkpointing,
                                    gather_full_state, shard_fp32)
from distflow.trainer.packing import ModelInputs, split_mini_batches

log = logging.getLogger(__name__)

__all__ = ["ValueModel", "Critic", "CRITIC_DIR", "WEIGHTS_FILE"]

CRITIC_DIR = "critic"
WEIGHTS_FILE = "value_model.safetensors"
OPTIM_DIR = "optimizer"
class ValueModel(torch.nn.Module):
    """A decoder (``model``: the ``.model`` of a ``*ForCausalLM``) and a scalar ``value_head``."""

    def __init__(self, decoder: torch.nn.Module, hidden_size: int, config: Any):
        super().__init__()
        self.model = decoder
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        self.config = config

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                index: torch.Tensor, **attention: Any) -> torch.Tensor:
        """ModelInputs fields -> values [N] fp32 at the ``index`` positions (flat ragged order);
        ``attention``: a packed row's varlen kwargs (``ModelInputs.attention_kwargs``). The
        value head runs in fp32 whatever the compute dtype (a bf16 value would put ~0.4%
        rounding into every GAE target); its gradient flows back to the compute-dtype weight."""
        mask = model_attention_mask(self.model.config, attention_mask, attention, input_ids.device)
        hidden = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                            use_cache=False, **attention).last_hidden_state  # [R, L, H]
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
        # the head is an fp32 FSDP unit of its own (Critic: shard_fp32's fp32_modules), called as a module so its
        # hooks gather fp32 weights; clone: an FSDP2 root must not return a view (an in-place op would skip its hooks)
        return self.value_head(picked.float()).squeeze(-1).clone()


def build_value_model(path: str) -> ValueModel:
    """fp32 ValueModel on the CPU from a critic dir (``value_model.safetensors``) or an HF causal LM."""
    from transformers import AutoConfig, AutoModel

    from distflow.hf import LOAD_LOCK, check_model_dir, load_causal_lm

    p = check_model_dir(path)
    if (p / WEIGHTS_FILE).is_file():
        from safetensors.torch import load_file

        with LOAD_LOCK:
            config = AutoConfig.from_pretrained(str(p), local_files_only=True)
        torch.manual_seed(0)
        vm = ValueModel(AutoModel.from_config(config, dtype=torch.float32), config.hidden_size, config)
        state = load_file(str(p / WEIGHTS_FILE))
        missing, unexpected = vm.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"critic_path {str(p)!r}: {WEIGHTS_FILE} does not match the model (missing "
                             f"{missing[:5]}, unexpected {unexpected[:5]})")
        return vm
    lm = load_causal_lm(p, torch.float32, "cpu")
    decoder = getattr(lm, "model", None)
    if decoder is None:
        raise ValueError(f"critic_path {str(p)!r}: {type(lm).__name__} has no '.model' decoder")
    return ValueModel(decoder, lm.config.hidden_size, lm.config)


def meta_value_model(path: str) -> ValueModel:
    """:func:`build_value_model`'s structure on the meta device (no memory, no weights): what
    trainer ranks other than 0 shard (:func:`~distflow.trainer.model.shard_fp32`)."""
    from transformers import AutoConfig, AutoModel

    from distflow.hf import LOAD_LOCK, check_model_dir, meta_causal_lm

    p = check_model_dir(path)
    if not (p / WEIGHTS_FILE).is_file():
        lm = meta_causal_lm(p, torch.float32)
        return ValueModel(lm.model, lm.config.hidden_size, lm.config)
    with LOAD_LOCK:
        config = AutoConfig.from_pretrained(str(p), local_files_only=True)
    with torch.device("meta"):
        return ValueModel(AutoModel.from_config(config, dtype=torch.float32), config.hidden_size, config)


def _micro_batches(batch: SampleBatch, idx: list[int], micro_batch_size: int, max_tokens: int | None
                   ) -> Iterator[tuple[list[int] | None, ModelInputs]]:
    """The actor's micro-batch rule (:func:`distflow.trainer.actor.step_micro_batches`: the
    same count on every rank, dummies for ranks with fewer; packed rows under ``max_tokens``,
    padded ones without) over the samples ``idx`` of ``batch``; chunk indices are indices
    into ``batch``."""
    sub = batch if idx == list(range(len(batch))) else batch.select(idx)
    for chunk, inputs in step_micro_batches(sub, micro_batch_size=micro_batch_size, max_tokens=max_tokens):
        yield (None if chunk is None else [idx[j] for j in chunk]), inputs


class Critic:
    """The FSDP2 value model with its optimizer: ``values(batch)`` and ``update(node, batch)``."""

    def __init__(self, cfg: Config):
        from distflow.trainer.parallel import trainer_mesh

        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = node_device(cfg.device)
        # FSDP2 over every trainer rank, whatever tensor_parallel: the critic is not split (docs/parallelism.md),
        # and it computes on this rank's own samples
        mesh = trainer_mesh(self.device.type, self.world, 1)
        resume = Path(cfg.resume_from) / CRITIC_DIR if cfg.resume_from else None
        source = str(resume) if resume is not None and resume.is_dir() else (cfg.critic_path or cfg.model_path)

        def prepare(vm: ValueModel) -> None:
            use_varlen_attention(vm.model, source)  # packed rows: no cross-sample attention
            disable_dropout(vm)
            if cfg.activation_checkpointing:  # the critic is as large as the actor: the same memory rule
                enable_activation_checkpointing(vm.model)

        # only rank 0 reads the weights; every rank shards a meta model and gets its shards from rank 0
        self.model = shard_fp32(lambda: build_value_model(source), lambda: meta_value_model(source), mesh,
                                self.device, DTYPES[cfg.dtype], prepare, lambda vm: [vm.value_head]).train()
        self.config = self.model.config
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=cfg.critic_lr or cfg.lr, betas=cfg.adam_betas,
                                       weight_decay=cfg.weight_decay)
        self.steps = 0
        if resume is not None and resume.is_dir():
            self._resume(resume)

    # ------------------------------------------------------------------ stages
    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        x = inputs.to(self.device)
        return self.model(x.input_ids, x.position_ids, x.attention_mask, x.index, **x.attention_kwargs())

    @torch.no_grad()
    def values(self, batch: SampleBatch) -> SampleBatch:
        """CRITIC MODEL_INFERENCE: ``values`` (ragged, one per response token) of every sample."""
        parts = []
        for chunk, inputs in _micro_batches(batch, list(range(len(batch))), self.cfg.micro_batch_size,
                                              self.cfg.max_tokens_per_micro_batch):
            v = self._forward(inputs)
            if chunk is not None:
                parts.append((chunk, inputs.response_lens, v))
        # no backward follows, so FSDP2 would keep the root's gathered parameters (embeddings, norm, head) until
        # the next forward, through the actor's update: free them now (as the actor does for the reference)
        self.model.reshard()
        batch.set_ragged("values", ragged_in_batch_order(parts, len(batch)))
        return batch

    def update(self, node: WorkflowNode, batch: SampleBatch) -> dict[str, float]:
        """CRITIC MODEL_TRAIN: ``ppo_epochs`` passes, each ``mini_batches_per_step`` optimizer
        steps on the clipped value loss against ``returns`` (old values = ``values``)."""
        for key in ("values", "returns"):
            if key not in batch.tensors:
                raise ValueError(f"workflow node {node.id!r}: the batch has no {key!r} (the critic update needs a "
                                 f"CRITIC MODEL_INFERENCE node and GAE before it)")
        loss_fn = resolve(VALUE_LOSSES, node.fn, f"workflow node {node.id!r} value loss")
        cfg = self.cfg
        sums = DeviceSums(["vf_loss", "vf_clip_frac", "value_mean"], self.device)  # read back once, at the end
        steps, skipped, grad_norm = 0, 0, 0.0
        # the tokens the value loss fits: every response token, or an episode's sampled ones (its
        # observation tokens have no return: GAE skips them)
        sampled = response_loss_mask(batch)
        trained = sampled_token_counts(batch)
        for _ in range(cfg.ppo_epochs):
            for mini in split_mini_batches(len(batch), cfg.mini_batches_per_step):
                tokens = all_reduce([float(trained[mini].sum()) if mini else 0.0])[0]
                normalizer = max(tokens, 1.0) / self.world
                self.optim.zero_grad(set_to_none=True)
                for chunk, inputs in _micro_batches(batch, mini, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch):
                    v = self._forward(inputs)
                    fitted = float(v.numel())
                    if chunk is None:
                        loss, metrics = v.sum() * 0.0, {}
                    else:
                        mb = batch.select(chunk)
                        mask = (torch.ones(1, v.numel(), device=self.device) if sampled is None else
                                mb.tensors["loss_mask"].to(self.device, dtype=torch.float32)[None])
                        old = mb.tensors["values"].to(self.device, non_blocking=True)[None]  # no stream sync
                        ret = mb.tensors["returns"].to(self.device, non_blocking=True)[None]
                        loss, metrics = loss_fn(v[None], old, ret, mask, clip=cfg.value_clip,
                                                token_normalizer=normalizer)
                        if sampled is not None:
                            fitted = float(mb.tensors["loss_mask"].sum())
                    loss.backward()
                    w = fitted / max(tokens, 1.0) / (cfg.ppo_epochs * cfg.mini_batches_per_step)
                    for k in sums.keys:
                        if k in metrics:
                            sums.add(k, metrics[k], w)
                grad_norm = clip_and_step(self.model, self.optim, cfg.grad_clip, "critic")  # the last step's
                skipped += not math.isfinite(grad_norm)
                steps += 1
        self.steps += steps
        out = sums.all_reduce()
        out.update(vf_grad_norm=grad_norm, critic_steps=float(steps), critic_skipped_steps=float(skipped))
        return out

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, ckpt_dir: Path) -> None:
        """``<ckpt_dir>/critic/``: config + full fp32 weights (rank 0) and the sharded optimizer
        state (every rank, torch.distributed.checkpoint). A collective: call on every rank."""
        from safetensors.torch import save_file

        out = Path(ckpt_dir) / CRITIC_DIR
        out.mkdir(parents=True, exist_ok=True)
        full = gather_full_state(self.model, keep=self.rank == 0, device=self.device)  # rank 0 keeps
        save_optimizer(self.model, self.optim, out / OPTIM_DIR, self.rank)
        if self.rank == 0:
            save_file(full, str(out / WEIGHTS_FILE))
            self.config.save_pretrained(str(out))
            (out / "critic_state.json").write_text(json.dumps({"steps": self.steps}))

    def _resume(self, ckpt: Path) -> None:
        load_optimizer(self.model, self.optim, ckpt / OPTIM_DIR)
        apply_optimizer_config(self.optim, self.cfg, lr=self.cfg.critic_lr or self.cfg.lr)
        state = ckpt / "critic_state.json"
        self.steps = int(json.loads(state.read_text())["steps"]) if state.is_file() else 0
        log.info("critic resumed from %s (%d optimizer steps)", ckpt, self.steps)


def critic_nodes(pipeline: list[WorkflowNode]) -> bool:
    """Whether a trainer pipeline needs a critic."""
    return any(n.role.value == "CRITIC" for n in pipeline)

