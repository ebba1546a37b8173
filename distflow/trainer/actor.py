"""The trainer's model side: FSDP2 policy (+ frozen reference), one update per step.

Everything here is blocking torch code that the trainer's asyncio loop runs in a worker
thread. The trainer group is one torch.distributed process group (gloo on CPU, NCCL on
GPU); FSDP2 (``fully_shard``) shards every decoder layer and the root.

Collectives must line up across ranks even though owner routing gives each rank a
different number of samples (possibly zero). So every forward/backward loop first agrees
on the number of micro-batches (all-reduce MAX) and ranks with fewer run masked dummy
micro-batches. Loss normalisation uses the GLOBAL token count so the DP-averaged
gradient is the token mean over the whole step.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distflow.buffer.batch import SampleBatch
from distflow.core.config import Config
from distflow.core.dag import WorkflowNode
from distflow.device import node_device
from distflow.hf import load_causal_lm, load_tokenizer
from distflow.rl.algorithms import POLICY_LOSSES, resolve
from distflow.trainer.logprobs import gather_response, pad_batch, scatter_response, token_logprobs

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _load_model(cfg: Config, device: torch.device, path: str | None = None):
    return load_causal_lm(path or cfg.model_path, DTYPES[cfg.dtype], device)


STATE_FILE = "distflow_state.json"
OPTIM_DIR = "optimizer"


def _shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", model), "layers", None)
    for layer in layers or []:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class Actor:
    """FSDP2-sharded policy with its optimizer, and an optional frozen reference model."""

    def __init__(self, cfg: Config, with_reference: bool):
        from torch.distributed.device_mesh import init_device_mesh

        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = node_device(cfg.device)
        mesh = init_device_mesh(self.device.type, (self.world,))
        torch.manual_seed(cfg.seed)
        # A resumed run continues from its checkpoint; the reference stays the original model.
        self.model = _shard(_load_model(cfg, self.device, cfg.resume_from), mesh)
        self.model.train()
        self.ref = _shard(_load_model(cfg, self.device), mesh).eval() if with_reference else None
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.adam_betas,
                                       weight_decay=cfg.weight_decay)
        self.pad_id = 0
        self.version = 0
        if cfg.resume_from:
            self._resume(Path(cfg.resume_from))

    def _resume(self, ckpt: Path) -> None:
        import json

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state_file = ckpt / STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"resume_from {str(ckpt)!r}: no {STATE_FILE} (not a DistFlow checkpoint)")
        state = json.loads(state_file.read_text())
        self.version = int(state["policy_version"])
        optim = {"optim": get_optimizer_state_dict(self.model, self.optim)}
        dcp.load(optim, checkpoint_id=str(ckpt / OPTIM_DIR))
        set_optimizer_state_dict(self.model, self.optim, optim["optim"])
        log.info("resumed from %s at policy version %d", ckpt, self.version)

    # ------------------------------------------------------------------ helpers
    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _micro_batches(self, batch: SampleBatch) -> list[SampleBatch | None]:
        """Equal count on every rank; None marks a dummy micro-batch."""
        mb = self.cfg.micro_batch_size
        local = math.ceil(len(batch) / mb)
        n = int(self._all_reduce([local], dist.ReduceOp.MAX)[0])
        parts: list[SampleBatch | None] = [batch.select(range(i * mb, min(len(batch), (i + 1) * mb)))
                                           for i in range(local)]
        return parts + [None] * (n - local)

    def _inputs(self, mb: SampleBatch | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if mb is None:  # dummy: one pad token, fully masked out of the loss
            z = torch.zeros(1, 2, dtype=torch.int64)
            return z.to(self.device), torch.ones_like(z).to(self.device), torch.zeros_like(z).to(self.device)
        ids, attn, resp = pad_batch(mb.ragged("prompt_tokens"), mb.ragged("response_tokens"), self.pad_id)
        return ids.to(self.device), attn.to(self.device), resp.to(self.device)

    # ------------------------------------------------------------------ stages
    @torch.no_grad()
    def reference_logprobs(self, batch: SampleBatch) -> SampleBatch:
        assert self.ref is not None
        out = []
        for mb in self._micro_batches(batch):
            ids, attn, resp = self._inputs(mb)
            lp = token_logprobs(self.ref, ids, attn, self.cfg.temperature).float()
            if mb is not None:
                out.append(gather_response(lp, resp).cpu())
        batch.set_ragged("ref_logprobs", torch.cat(out) if out else torch.zeros(0))
        return batch

    def update(self, node: WorkflowNode, batch: SampleBatch) -> dict[str, float]:
        """One optimizer step over this rank's share of the step's samples."""
        loss_fn = resolve(POLICY_LOSSES, node.fn, f"workflow node {node.id!r} policy loss")
        kl_coef = self.cfg.kl_coef if "ref_logprobs" in batch.tensors else 0.0
        global_tokens = self._all_reduce([float(batch.tensors["response_lens"].sum())])[0]
        normalizer = max(global_tokens, 1.0) / self.world  # FSDP averages gradients over ranks
        self.optim.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_frac": 0.0}
        for mb in self._micro_batches(batch):
            ids, attn, resp = self._inputs(mb)
            lp = token_logprobs(self.model, ids, attn, self.cfg.temperature)
            if mb is None:
                loss = (lp * 0.0).sum()
                metrics: dict[str, Any] = {}
            else:
                old = scatter_response(mb.tensors["logprobs"].to(self.device), resp)
                ref = scatter_response(mb.tensors["ref_logprobs"].to(self.device), resp) if kl_coef else None
                adv = mb.tensors["advantage"].to(self.device)
                loss, metrics = loss_fn(lp, old, adv, resp.float(), clip_low=self.cfg.clip_low,
                                        clip_high=self.cfg.clip_high, ref_logprobs=ref, kl_coef=kl_coef,
                                        token_normalizer=normalizer)
            loss.backward()
            w = float(resp.sum()) / max(global_tokens, 1.0)  # this micro-batch's share of the global token mean
            sums["loss"] += float(loss.detach()) / self.world
            for k in ("pg_loss", "kl", "clip_frac"):
                if k in metrics:
                    sums[k] += float(metrics[k]) * w
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optim.step()
        self.version += 1
        keys = list(sums)
        reduced = self._all_reduce([sums[k] for k in keys])
        out = dict(zip(keys, reduced))
        out["grad_norm"] = float(grad_norm)
        out["tokens"] = global_tokens
        return out

    # ------------------------------------------------------------------ weights
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights on every rank (a collective), for publishing to rollout nodes."""
        out = {}
        for name, t in self.model.state_dict().items():
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            out[name] = full.detach().to("cpu", copy=False).contiguous()
        return out

    def save_checkpoint(self, out_dir: Path, state: dict[str, torch.Tensor], run_state: dict[str, Any]) -> None:
        """A Hugging Face directory (model + tokenizer, loadable with from_pretrained, written by
        rank 0) plus what a resumed run needs: the sharded optimizer state (every rank writes its
        shard with torch.distributed.checkpoint) and ``distflow_state.json`` (policy version and
        the data position, which is the global step)."""
        import json

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        out_dir.mkdir(parents=True, exist_ok=True)
        dcp.save({"optim": get_optimizer_state_dict(self.model, self.optim)}, checkpoint_id=str(out_dir / OPTIM_DIR))
        if self.rank != 0:
            return
        model = _load_model(self.cfg, torch.device("cpu"))
        model.load_state_dict(state, strict=True)
        model.save_pretrained(str(out_dir))
        load_tokenizer(self.cfg.model_path).save_pretrained(str(out_dir))
        (out_dir / STATE_FILE).write_text(json.dumps({"policy_version": self.version, **run_state}, indent=1))
