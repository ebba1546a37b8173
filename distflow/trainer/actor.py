"""The trainer's model side: FSDP2 policy (+ frozen reference), one update per step.

Everything here is blocking torch code that the trainer's asyncio loop runs in a worker
thread. The trainer group is one torch.distributed process group (gloo on CPU, NCCL on
GPU); :func:`distflow.trainer.model.load_for_training` loads fp32 master weights and shards
them with FSDP2 (mixed precision: ``dtype`` is the compute dtype); with ``tensor_parallel`` the
mesh is 2-D and each TP group trains its ranks' united samples (:mod:`distflow.trainer.parallel`); with
``sequence_parallel`` an SP group does, each rank on 1/N of every packed row (:mod:`distflow.trainer.ulysses`).

Collectives must line up across ranks even though owner routing gives each rank a
different number of samples (possibly zero). So every forward/backward loop first agrees
on the number of micro-batches (all-reduce MAX, :func:`step_micro_batches`) and ranks with
fewer run dummy micro-batches with no response token. Loss normalisation uses the GLOBAL
token (and sequence) count so the DP-averaged gradient is the token mean over the whole
step, however samples fall into ranks and micro-batches. Gradients are reduce-scattered
once per step on the last micro-batch, or after every micro-batch (``grad_sync``,
:func:`grad_sync_mode`): once per step moves the fewest bytes (one reduce-scatter, and the
weights the first forward gathered stay unsharded until the last backward: one all-gather per
unit and optimizer step, :func:`keep_weights_gathered`), but FSDP2 then keeps every parameter's
UNSHARDED fp32 gradient, and from the first forward on its compute-dtype weight, on every rank
(up to 6 bytes x params per GPU in bf16, ~42 GB for a 7B model), which undoes sharding.

Micro-batches are padded (``micro_batch_size`` samples) or, with
``max_tokens_per_micro_batch``, packed (:mod:`distflow.trainer.packing`); logprobs come from
the chunked response-only head (:mod:`distflow.trainer.head`) either way.

Reusable by composition (a critic, the executor): :func:`all_reduce`,
:func:`step_micro_batches`, :func:`flat_to_padded`, :func:`load_for_training`.
"""

from __future__ import annotations

import inspect
import logging
import math
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from distflow.trainer.collectives import counted
from distflow.buffer.batch import SampleBatch
from distflow.core.config import Config
from distflow.core.dag import WorkflowNode
from distflow.device import collective_device, node_device
from distflow.hf import load_tokenizer, meta_causal_lm
from distflow.launch.checkpoint import read_run_state
from distflow.rl.registry import POLICY_LOSSES, resolve
from distflow.weights.adapter import is_adapter
from distflow.rl.shaping import response_loss_mask, trained_samples, trained_token_counts, trained_token_mask
from distflow.trainer.lora import save_adapter
from distflow.trainer.model import DTYPES, clip_and_step, gather_full_state, load_for_training
from distflow.trainer.parallel import share_size, share_union, sp_group, tp_size, trainer_mesh
from distflow.trainer.ulysses import shard_inputs
from distflow.trainer.replicas import StepNotCommitted
from distflow.trainer.packing import (ModelInputs, dummy_inputs, pack_inputs, pad_inputs, plan_micro_batches,
                                      split_mini_batches)
from distflow.trainer.schedule import lr_at
from distflow.vision import batch_images

log = logging.getLogger(__name__)

__all__ = ["Actor", "DTYPES", "DeviceSums", "StepNotCommitted", "all_reduce", "flat_to_padded", "grad_sync_mode", "ragged_in_batch_order",
           "step_micro_batches"]

# Loss metrics some policy losses report (token means): logged per step when any micro-batch had them.
OPTIONAL_METRICS = ("ratio_mean", "approx_kl", "tis_weight_mean", "tis_clip_frac")
OPTIM_DIR = "optimizer"
# grad_sync auto: reduce-scatter once per step only while that holds at most this many bytes
# per GPU beyond sharded gradients and weights.
GRAD_SYNC_AUTO_BYTES = 2 << 30


def keep_weights_gathered(model: torch.nn.Module, keep: bool) -> None:
    """Whether the FSDP2 units under ``model``'s root (the decoder layers) keep their gathered
    weights after forward (``keep``), so that their backward, and the next micro-batch, gather
    nothing; or reshard them, FSDP2's default. The root never reshards after forward (FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if m is not model and isinstance(m, FSDPModule):
            m.set_reshard_after_forward(not keep, recurse=False)


def grad_sync_mode(setting: str, world: int, num_params: int, param_bytes: int = 2) -> tuple[str, int]:
    """The effective ``grad_sync`` ("step" | "micro_batch") for ``setting`` ("auto" too) and
    the bytes per GPU that "step" holds beyond sharded training: with gradient sync off,
    FSDP2 keeps each parameter's unsharded gradient, in fp32 (the reduce dtype), until the
    step's reduce-scatter (4 x params instead of 4 x params / world), and with more than one
    rank "step" keeps the weights each backward gathered, unsharded in the compute dtype
    (``param_bytes`` x params on top of the fp32 shard), until the next micro-batch's forward
    has used them."""
    if setting not in ("auto", "step", "micro_batch"):
        raise ValueError(f"grad_sync must be auto, step or micro_batch, got {setting!r}")
    extra = 4 * num_params * (world - 1) // max(world, 1) + (param_bytes * num_params if world > 1 else 0)
    if setting == "auto":
        setting = "step" if world == 1 or extra <= GRAD_SYNC_AUTO_BYTES else "micro_batch"
    return setting, extra


def all_reduce(values: list[float] | torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> list[float]:
    """All-reduce a few numbers over ``group`` and read them back (the one host sync): floats,
    or a tensor of them on any device (:class:`DeviceSums`). The tensor given to the collective
    lives on the group's device (:func:`distflow.device.collective_device`)."""
    dev = collective_device(group)
    if torch.is_tensor(values):
        t = values.detach().to(dev, torch.float64, copy=True)
    else:
        t = torch.tensor(values, dtype=torch.float64).to(dev)
    counted("all_reduce", dist.all_reduce, t, op=op, group=group)
    return t.tolist()


class DeviceSums:
    """A step's weighted metric sums, accumulated where the values are (the GPU) and read back
    once per step by :meth:`all_reduce`. Reading each micro-batch's loss back (``float(loss)``)
    would make the CPU wait for the GPU after every micro-batch: it could not queue the next
    one (nor FSDP2 its prefetching all-gathers) while the GPU finishes this one."""

    def __init__(self, keys: list[str], device: torch.device):
        self.keys = list(keys)
        self._slot = {k: i for i, k in enumerate(self.keys)}
        self._sums = torch.zeros(len(self.keys), dtype=torch.float64, device=device)

    def add(self, key: str, value: torch.Tensor | float, weight: float = 1.0) -> None:
        """sums[key] += value * weight (a one-element tensor, on any device, or a number: what
        ``float()`` takes, as a user's loss may return; no device read)."""
        v = (value.detach().reshape(()).to(self._sums.device, torch.float64, non_blocking=True)
             if torch.is_tensor(value) else float(value))
        self._sums[self._slot[key]] += v * weight

    def all_reduce(self) -> dict[str, float]:
        """The sums over every rank (a collective), read back once."""
        return dict(zip(self.keys, all_reduce(self._sums)))


def ragged_in_batch_order(parts: list[tuple[list[int], list[int], torch.Tensor]], n: int) -> torch.Tensor:
    """Per-micro-batch results of an inference pass -> one flat CPU tensor in the batch's ragged
    order. ``parts``: one ``(sample indices, their lengths, flat values [sum(lengths)])`` per
    micro-batch, the values on any device; they come back in ONE device-to-host copy (a copy per
    micro-batch would stall the GPU's queue once each). ``n``: the batch size (every sample in a part)."""
    if not parts:
        return torch.zeros(0)
    flat = torch.cat([v for _, _, v in parts]).cpu()
    pieces: list[torch.Tensor | None] = [None] * n
    order = [i for idx, _, _ in parts for i in idx]
    for i, piece in zip(order, torch.split(flat, [x for _, lens, _ in parts for x in lens])):
        pieces[i] = piece
    return torch.cat(pieces)  # type: ignore[arg-type]


def step_micro_batches(batch: SampleBatch, *, micro_batch_size: int, max_tokens: int | None,
                       pad_id: int = 0, group=None,
                       packed: bool = False) -> Iterator[tuple[list[int] | None, ModelInputs]]:
    """This rank's micro-batches of ``batch`` as (sample indices, CPU model inputs); the
    same COUNT on every rank of ``group`` (a collective), dummies ``(None, dummy_inputs())``
    at the end for ranks with fewer. Packed with a token budget (or ``packed``), padded without."""
    prompts, responses = batch.ragged("prompt_tokens"), batch.ragged("response_tokens")
    lengths = [int(p.numel() + r.numel()) for p, r in zip(prompts, responses)]
    images = "pixel_values" in batch.tensors
    plan = plan_micro_batches(lengths, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
    n = int(all_reduce([len(plan)], dist.ReduceOp.MAX, group)[0])
    for idx in plan:
        ps, rs = [prompts[i] for i in idx], [responses[i] for i in idx]
        inputs = pack_inputs(ps, rs) if max_tokens is not None or packed else pad_inputs(ps, rs, pad_id)
        pics = batch_images(batch, idx) if images else None
        if pics is not None:
            inputs.pixel_values, inputs.image_grid_thw = pics
        yield idx, inputs
    for _ in range(n - len(plan)):
        yield None, dummy_inputs()


def flat_to_padded(flat: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """flat [sum(lens)] -> (values [B, max(lens)] zero-padded, mask [B, max(lens)] bool).

    The values go to their padded places by index (positions computed on the host from
    ``lens``), not ``masked_scatter``: its backward is a ``masked_select``, which on CUDA reads
    the selected count back, a host sync in every micro-batch's backward. ``index_copy``'s
    backward is an ``index_select``: nothing is read back."""
    width = max(lens, default=0)
    lengths = torch.tensor(lens, dtype=torch.int64)
    starts = torch.arange(len(lens), dtype=torch.int64) * width - torch.cumsum(lengths, 0) + lengths
    total = sum(lens)  # host ints: nothing read back, not even from the host tensors
    pos = torch.arange(total, dtype=torch.int64) + starts.repeat_interleave(lengths, output_size=total)
    dev = flat.device  # host-built indices go over without a stream sync
    mask = torch.arange(width, device=dev)[None, :] < lengths.to(dev, non_blocking=True)[:, None]
    values = flat.new_zeros(len(lens) * width).index_copy(0, pos.to(dev, non_blocking=True), flat)
    return values.view(len(lens), width), mask


def _call_loss(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a policy loss with the keywords it accepts (a user's loss may take fewer)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


class Actor:
    """FSDP2-sharded policy with its optimizer, and an optional frozen reference model
    (loaded only when the workflow has a reference node AND ``kl_coef > 0``)."""

    def __init__(self, cfg: Config, with_reference: bool):
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = node_device(cfg.device)
        self.compute_dtype = DTYPES[cfg.dtype]
        # (dp[, sp][, tp]) with tensor_parallel or sequence_parallel > 1, else (world,): trainer/parallel.py
        self.mesh = mesh = trainer_mesh(self.device.type, self.world, getattr(cfg, "tensor_parallel", 1),
                                        getattr(cfg, "sequence_parallel", 1))
        self.tp, self.share, self.sp_group = tp_size(mesh), share_size(mesh), sp_group(mesh)  # share: SP x TP
        if self.rank == 0 and self.share > 1:
            log.info("trainer mesh: %s", " x ".join(f"{n} {k}" for n, k in zip(mesh.mesh_dim_names, mesh.shape)))
        # The checkpoint's run state, checked against this config before anything is loaded.
        self.resumed = read_run_state(Path(cfg.resume_from), cfg) if cfg.resume_from else None
        torch.manual_seed(cfg.seed)
        # A resumed run continues from its checkpoint; the reference stays the original model.
        # With LoRA the base is always model_path and a checkpoint holds the adapter only (trainer/lora.py).
        self.lora = cfg.lora
        self.model = load_for_training(cfg.model_path if self.lora else cfg.resume_from or cfg.model_path, mesh,
                                       self.device, self.compute_dtype,
                                       activation_checkpointing=cfg.activation_checkpointing, lora=self.lora,
                                       adapter_from=cfg.resume_from if self.lora else None,
                                       freeze_vision=cfg.freeze_vision_tower)
        self.ref = None
        if with_reference and cfg.kl_coef > 0:
            self.ref = load_for_training(cfg.model_path, mesh, self.device, self.compute_dtype, trainable=False)
        self.optim = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr, betas=cfg.adam_betas,
                                       weight_decay=cfg.weight_decay)
        self.num_params = sum(p.numel() for p in self.model.parameters())  # DTensor numel = full size
        self.grad_sync, extra = grad_sync_mode(cfg.grad_sync, self.world, self.num_params, self.compute_dtype.itemsize)
        if self.rank == 0:
            log.info("grad_sync: %s (%s; reducing once per step holds %.1f GiB more per GPU)", self.grad_sync,
                     cfg.grad_sync, extra / 2**30)
            if self.grad_sync == "step" and extra > GRAD_SYNC_AUTO_BYTES:
                log.warning("grad_sync: step holds the full unsharded fp32 gradients and weights on every rank "
                            "during a step, %.1f GiB more per GPU; grad_sync: micro_batch keeps them sharded",
                            extra / 2**30)
        self.pad_id = 0
        self.version = 0
        # Replica groups kept in step (distflow.trainer.replicas.ReplicaSync, or None): the optimizer step
        # averages the gradients over the quorum and is taken only when it commits (StepNotCommitted).
        # step_counts: this rank's (trained tokens, trained sequences) of the WHOLE step, of which it trains a
        # share: the loss is normalised by the step's count over the participants, so the quorum's mean gradient
        # is the step's token mean however the shares split the tokens.
        self.replicas: Any = None
        self.step_counts: tuple[float, float] | None = None
        self.total_steps: int | None = cfg.max_steps  # the worker sets the run's length when it learns it
        if self.resumed is not None:
            self._resume(Path(cfg.resume_from), self.resumed)

    def _resume(self, ckpt: Path, state: dict[str, Any]) -> None:
        self.version = int(state["policy_version"])
        load_optimizer(self.model, self.optim, ckpt / OPTIM_DIR)
        apply_optimizer_config(self.optim, self.cfg)
        log.info("resumed from %s at policy version %d", ckpt, self.version)

    # ------------------------------------------------------------------ helpers
    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        return all_reduce(values, op)

    def _micro_batches(self, batch: SampleBatch) -> Iterator[tuple[list[int] | None, ModelInputs]]:
        for idx, inputs in step_micro_batches(batch, micro_batch_size=self.cfg.micro_batch_size,
                                              max_tokens=self.cfg.max_tokens_per_micro_batch, pad_id=self.pad_id,
                                              packed=self.sp_group is not None):
            yield idx, (inputs if self.sp_group is None else shard_inputs(inputs, self.sp_group)).to(self.device)

    def _forward(self, model: Any, inputs: ModelInputs, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        return model.response_forward(inputs, self.cfg.temperature, self.cfg.logprob_chunk_tokens, with_entropy)

    # ------------------------------------------------------------------ stages
    @torch.no_grad()
    def reference_logprobs(self, batch: SampleBatch) -> SampleBatch:
        """The pre-update inference pass, ONE pass over the batch: ``ref_logprobs`` from the
        frozen reference (skipped when there is none, i.e. ``kl_coef`` 0) and, with
        ``recompute_old_logprobs``, ``old_logprobs`` from the current policy."""
        return self._inference_pass(batch, ref=self.ref is not None,
                                    old=self.cfg.recompute_old_logprobs and "old_logprobs" not in batch.tensors,
                                    reshard_policy=self.cfg.node("CRITIC", "MODEL_INFERENCE") is not None)

    @torch.no_grad()
    def old_logprobs(self, batch: SampleBatch) -> SampleBatch:
        """``old_logprobs`` (the loss's proximal policy) recomputed with the current policy."""
        return self._inference_pass(batch, ref=False, old=True)

    @torch.no_grad()
    def _inference_pass(self, batch: SampleBatch, ref: bool, old: bool, reshard_policy: bool = False,
                        united: bool = False) -> SampleBatch:
        """The pass over ``batch``, this rank's samples; with tensor or sequence parallelism its group's
        united samples (:func:`~distflow.trainer.parallel.share_union`), this rank's rows kept (``united``:
        the batch is the group's already, as in :meth:`update`)."""
        fields = [name for name, want in (("ref_logprobs", ref), ("old_logprobs", old)) if want]
        if not fields:
            return batch
        if self.share > 1 and not united:
            group, mine = share_union(batch, self.mesh)
            self._inference_pass(group, ref, old, reshard_policy, united=True)
            own = group.select(range(mine.start, mine.stop))
            for name in fields:
                batch.set_ragged(name, own.tensors[name])
            return batch
        parts: dict[str, list[tuple[list[int], list[int], torch.Tensor]]] = {f: [] for f in fields}
        for idx, inputs in self._micro_batches(batch):
            for name in fields:
                lp, _ = self._forward(self.ref if name == "ref_logprobs" else self.model, inputs, with_entropy=False)
                if idx is not None:
                    parts[name].append((idx, inputs.response_lens, lp))
        for name in fields:
            batch.set_ragged(name, ragged_in_batch_order(parts[name], len(batch)))
        if ref:
            # FSDP2 reshards the root (embeddings, final norm, LM head) after backward, never after
            # forward, and the reference never runs backward: without this its root would stay
            # all-gathered on every GPU for the whole run (~2 GB at 7B)
            self.ref.reshard()
        if old and reshard_policy:
            # the same for the policy when a model stage runs before its update (PPO: the critic's
            # values); otherwise (GRPO) the update comes next and would only gather it again
            self.model.reshard()
        return batch

    def update(self, node: WorkflowNode, batch: SampleBatch) -> dict[str, float]:
        """``ppo_epochs`` passes over this rank's share of the step's samples, each split into
        ``mini_batches_per_step`` optimizer steps (1 x 1 by default: one step per batch). The
        old (proximal) logprobs are fixed before the first step; the policy version advances
        once per batch (versions count trainer steps in the weight protocol). Metrics are the
        mean over the optimizer steps. With tensor parallelism a TP group trains its ranks' samples
        together (:func:`~distflow.trainer.parallel.share_union`), as does an SP group."""
        cfg = self.cfg
        loss_fn = resolve(POLICY_LOSSES, node.fn, f"workflow node {node.id!r} policy loss")
        batch = share_union(batch, self.mesh)[0]
        if cfg.recompute_old_logprobs and "old_logprobs" not in batch.tensors:
            self._inference_pass(batch, ref=False, old=True, united=True)
        kl_in_reward = bool(getattr(cfg, "kl_in_reward", False))
        kl_coef = cfg.kl_coef if "ref_logprobs" in batch.tensors and not kl_in_reward else 0.0
        lr = lr_at(self.version, cfg.lr, cfg.lr_schedule, cfg.warmup_steps, self.total_steps)
        for group in self.optim.param_groups:
            group["lr"] = lr
        minis = split_mini_batches(len(batch), cfg.mini_batches_per_step)  # same count on every rank
        if self.replicas is not None and len(minis) * cfg.ppo_epochs != 1:
            raise ValueError("trainer replica groups commit one optimizer step a step: mini_batches_per_step "
                             "and ppo_epochs must be 1 (a step half committed cannot be taken again)")
        steps = [self._optimizer_step(loss_fn, batch if len(minis) == 1 else batch.select(mini), kl_coef)
                 for _ in range(cfg.ppo_epochs) for mini in minis]
        self.version += 1
        keys = dict.fromkeys(k for st in steps for k in st)  # an optional metric may be missing from a step
        out = {k: sum(vals) / len(vals) for k in keys if (vals := [st[k] for st in steps if k in st])}
        norms = [st["grad_norm"] for st in steps if math.isfinite(st["grad_norm"])]
        out["grad_norm"] = sum(norms) / len(norms) if norms else steps[-1]["grad_norm"]  # skipped steps: counted
        # Tokens count the batch once (not once per epoch); tokens/s is per optimizer pass.
        out.update(tokens=sum(s["tokens"] for s in steps[:len(minis)]),
                   train_tokens=sum(s["train_tokens"] for s in steps), lr=lr, optimizer_steps=len(steps),
                   skipped_steps=sum(s["skipped_steps"] for s in steps))
        return out

    def _optimizer_step(self, loss_fn, batch: SampleBatch, kl_coef: float) -> dict[str, float]:
        """One optimizer step over ``batch`` (this rank's part of a mini-batch; every rank calls it)."""
        cfg = self.cfg
        lens = trained_token_counts(batch, cfg)  # overlong: mask drops truncated ones
        whole = list(self.step_counts) if self.replicas is not None and self.step_counts is not None else []
        global_tokens, global_seqs, global_all, *whole = self._all_reduce(
            [float(lens.sum()), float((lens > 0).sum()), float(batch.num_tokens().sum()) if len(batch) else 0.0, *whole])
        # FSDP averages gradients over ranks: normalise by the global count / world.
        # (With tensor or sequence parallelism every sample is counted N times, on each rank of its group, and
        # each of those computes its whole loss: the same quotient. See trainer/ulysses.py for SP's gradients.
        # With replica groups, the whole step's counts over the quorum's participants: trainer/replicas.py.)
        norm_tokens, norm_seqs = (w / self.replicas.participants for w in whole) if whole else (global_tokens,
                                                                                                  global_seqs)
        normalizer = max(norm_tokens, 1.0) / self.world
        seq_normalizer = max(norm_seqs, 1.0) / self.world
        self.optim.zero_grad(set_to_none=True)
        sums = DeviceSums(["loss", "pg_loss", "kl", "clip_frac", "entropy",  # the same keys on every rank
                           *(k for m in OPTIONAL_METRICS for k in (m, f"{m}/w"))], self.device)
        mbs = list(self._micro_batches(batch))
        once = self.grad_sync == "step"
        keep_gathered = once and self.world > 1  # one rank gathers nothing: nothing to keep
        try:
            if keep_gathered:  # the first forward gathers the weights; they stay until the last backward
                keep_weights_gathered(self.model, True)
            for i, (idx, inputs) in enumerate(mbs):
                if once:  # reduce-scatter on the last only; until then each backward leaves the weights
                    last = i == len(mbs) - 1  # unsharded, so no later forward or backward gathers them
                    self.model.set_requires_gradient_sync(last)
                    if keep_gathered:
                        self.model.set_reshard_after_backward(last)
                lp, ent = self._forward(self.model, inputs)
                if idx is None:  # a dummy micro-batch (this rank has fewer): no loss, no metrics
                    loss, metrics, kept = lp.sum() * 0.0, {}, 0
                else:
                    mb = batch.select(idx)
                    keep = trained_samples(mb, cfg)
                    loss, metrics = self._loss(loss_fn, mb, keep, inputs, lp, ent, kl_coef, normalizer,
                                               seq_normalizer)
                    kept = sum(n for n, k in zip(inputs.response_lens, keep.tolist()) if k)  # host numbers
                    trained = trained_token_mask(mb, cfg)  # an episode's observation tokens are not trained
                    if response_loss_mask(mb) is not None:
                        kept = int(trained.sum())  # (a CPU tensor: no device sync)
                    trained = trained.to(ent.device, non_blocking=True)
                    # entropy over the tokens the loss trains on (a select, not a boolean index: no sync)
                    ent_sum = torch.where(trained, ent.detach().double(), 0.0).sum()
                    sums.add("entropy", ent_sum, 1.0 / max(global_tokens, 1.0))
                loss.backward()
                w = kept / max(global_tokens, 1.0)  # share of the global token mean
                sums.add("loss", loss, 1.0 / self.world)
                for k in ("pg_loss", "kl", "clip_frac"):
                    if k in metrics:
                        sums.add(k, metrics[k], w)
                for k in OPTIONAL_METRICS:  # not every loss reports these: a token weight per key, too
                    if k in metrics:
                        sums.add(k, metrics[k], w)
                        sums.add(f"{k}/w", w)
        finally:  # also after a failed micro-batch: no flag stays off
            if once:
                self.model.set_requires_gradient_sync(True)
            if keep_gathered:
                self.model.set_reshard_after_backward(True)
                keep_weights_gathered(self.model, False)
        if self.replicas is not None:  # replica groups (torchft): the quorum's mean gradient, if it commits
            self.replicas.average_gradients(self.model)
            if not self.replicas.commit():
                self.optim.zero_grad(set_to_none=True)
                raise StepNotCommitted(f"policy version {self.version}: a replica group dropped out of the "
                                       "step; the weights are unchanged: take the step again with the new quorum")
        grad_norm = clip_and_step(self.model, self.optim, cfg.grad_clip, "policy")
        out = sums.all_reduce()
        for k in OPTIONAL_METRICS:  # the token-weighted mean over the ranks that reported it, else left out
            weight = out.pop(f"{k}/w")
            value = out.pop(k)
            if weight > 0:
                out[k] = value / weight
        out.update(grad_norm=grad_norm, tokens=global_tokens / self.share, train_tokens=global_all / self.share,
                   skipped_steps=float(not math.isfinite(grad_norm)))
        return out

    def _loss(self, loss_fn, mb: SampleBatch, keep: torch.Tensor, inputs: ModelInputs, lp, ent, kl_coef, normalizer,
              seq_normalizer):
        """The policy loss of one micro-batch: flat [N] values -> [B, T] for the loss function.
        keep: [B] bool, the samples the loss trains on (:func:`~distflow.rl.shaping.trained_samples`)."""
        cfg, dev, rl = self.cfg, self.device, inputs.response_lens

        def to_dev(t: torch.Tensor) -> torch.Tensor:  # without a stream sync (the forward is still queued)
            return t.to(dev, non_blocking=True)

        def padded(name: str) -> torch.Tensor:
            return flat_to_padded(to_dev(mb.tensors[name]), rl)[0]

        lp2, mask = flat_to_padded(lp, rl)
        mask = mask & to_dev(keep)[:, None]  # overlong: mask: truncated samples add nothing
        if "loss_mask" in mb.tensors:  # a multi-turn episode: only the tokens the engine sampled
            mask = mask & (padded("loss_mask") != 0)
        has_old = "old_logprobs" in mb.tensors
        adv = padded("token_advantages") if "token_advantages" in mb.tensors else to_dev(mb.tensors["advantage"])
        return _call_loss(
            loss_fn, lp2, padded("old_logprobs" if has_old else "logprobs"), adv, mask.float(),
            clip_low=cfg.clip_low, clip_high=cfg.clip_high,
            **({"dual_clip": cfg.dual_clip} if getattr(cfg, "dual_clip", None) is not None else {}),
            ref_logprobs=padded("ref_logprobs") if kl_coef else None, kl_coef=kl_coef,
            kl_estimator=getattr(cfg, "kl_estimator", "k3"), kl_clamp=getattr(cfg, "kl_clamp", 10.0),
            entropy=flat_to_padded(ent, rl)[0], entropy_coef=getattr(cfg, "entropy_coef", 0.0),
            behaviour_logprobs=padded("logprobs") if has_old else None, tis_cap=getattr(cfg, "tis_cap", None),
            loss_agg=getattr(cfg, "loss_agg", "token-mean"), token_normalizer=normalizer,
            seq_normalizer=seq_normalizer, norm_constant=float(cfg.max_new_tokens))

    # ------------------------------------------------------------------ weights
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded fp32 master weights for the checkpoint: on rank 0 (which writes it), on
        the CPU, never sharing memory with the live parameters; ``{}`` on the other ranks. A
        collective: every rank calls it (:func:`~distflow.trainer.model.gather_full_state`).
        Publishing to rollout nodes streams buckets instead (``gather.iter_weight_buckets``).
        With ``model.lora``: the adapter tensors only (the base never changes)."""
        return gather_full_state(self.model, keep=self.rank == 0, device=self.device,
                                 only=is_adapter if self.lora else None)

    def save_checkpoint(self, out_dir: Path, state: dict[str, torch.Tensor], group: Any = None) -> Callable[[], None]:
        """A Hugging Face directory (model + tokenizer, loadable with from_pretrained, written by
        rank 0; the weights are the fp32 master weights whatever the compute ``dtype``, so a
        resumed run continues exactly; ``from_pretrained(dtype=...)`` casts on load) plus the
        sharded fp32 optimizer state (every rank writes its shard with
        torch.distributed.checkpoint). A collective. The directory counts as a checkpoint only
        once :func:`distflow.launch.checkpoint.mark_checkpoint` has written ``distflow_state.json``
        (after every part).

        Rank 0 writes ``state`` through a model built on the meta device, not a second full
        fp32 copy loaded from ``model_path`` (that doubled host memory at every checkpoint).
        With ``model.lora`` the directory holds the adapter only, in PEFT's format (``state`` is
        the adapter's: :meth:`full_state_dict`), beside the tokenizer and the optimizer state.

        Returns what is left to write once the state is in host memory (``state`` is already:
        ``full_state_dict`` copies): call it, or hand it to a background thread
        (:class:`distflow.trainer.async_save.CheckpointWriter`); with ``group`` (that writer's gloo
        group) the optimizer shards are staged to host memory now and written by it too."""
        out_dir.mkdir(parents=True, exist_ok=True)
        optimizer_written = save_optimizer(self.model, self.optim, out_dir / OPTIM_DIR, self.rank, group)

        def finish() -> None:
            optimizer_written()
            if self.rank == 0:
                self._write_model(out_dir, state)

        return finish

    def _write_model(self, out_dir: Path, state: dict[str, torch.Tensor]) -> None:
        """Rank 0: the Hugging Face directory of ``state`` (fp32 master weights) and the tokenizer;
        with ``model.lora`` a PEFT adapter directory (``PeftModel.from_pretrained(base, out_dir)``)."""
        if self.lora:
            save_adapter(out_dir, state, self.lora, str(Path(self.cfg.model_path).resolve()))
            load_tokenizer(self.cfg.model_path).save_pretrained(str(out_dir))
            return
        model = meta_causal_lm(self.cfg.model_path, torch.float32)
        model.load_state_dict(state, strict=True, assign=True)
        model.tie_weights()  # assign replaced the tied parameters with two separate ones
        if (Path(self.cfg.model_path) / "generation_config.json").is_file():  # from_config made a default one:
            from transformers import GenerationConfig  # keep the model's stop ids and sampling defaults

            model.generation_config = GenerationConfig.from_pretrained(self.cfg.model_path, local_files_only=True)
        model.save_pretrained(str(out_dir))
        load_tokenizer(self.cfg.model_path).save_pretrained(str(out_dir))
        images = Path(self.cfg.model_path) / "preprocessor_config.json"  # a vision-language model's image processor
        if images.is_file():
            (out_dir / images.name).write_bytes(images.read_bytes())


def apply_optimizer_config(optim: torch.optim.Optimizer, cfg: Config, lr: float | None = None) -> None:
    """The config's AdamW settings over what a loaded optimizer state restored: loading restores
    the checkpoint's param groups, and a resumed run must use the config it was started with.
    ``lr``: a constant learning rate to restore too (the critic's; the actor's is set every step)."""
    for g in optim.param_groups:
        g["betas"], g["weight_decay"] = tuple(cfg.adam_betas), cfg.weight_decay
        if lr is not None:
            g["lr"] = lr


def checkpoint_writer(path: Path) -> Any:
    """The DCP writer of an optimizer-state directory: overwriting a previous save in place
    (``checkpoint/`` is rewritten at every run's end) said explicitly, not left to a default
    (torch still warns about that default at every overwrite; that one warning is silenced)."""
    import warnings

    from torch.distributed.checkpoint import FileSystemWriter

    warnings.filterwarnings("ignore", message="Detected an existing checkpoint in .* overwriting since "
                            "self.overwrite=True", category=UserWarning)  # added once: a repeat replaces it

    if "overwrite" in inspect.signature(FileSystemWriter.__init__).parameters:
        return FileSystemWriter(str(path), overwrite=True)
    return FileSystemWriter(str(path))  # pragma: no cover - a torch that always overwrites


NEVER_STEPPED = "never_stepped"  # in an optimizer directory: saved before any optimizer step, no state


def save_optimizer(model: torch.nn.Module, optim: torch.optim.Optimizer, path: Path, rank: int,
                   group: Any = None) -> Callable[[], None]:
    """The sharded optimizer state into ``path`` (torch.distributed.checkpoint, every rank its
    shard). A collective. An optimizer that never stepped (a stop before the first update, or
    every step skipped as non-finite) has no state, and ``get_optimizer_state_dict`` would make
    some with a fake step at lr 0, in the live optimizer too: the first real update would then
    take step 2's bias correction (0.74x the step with betas 0.9/0.999). So nothing is saved
    and a marker says so (the same on every rank: skipped steps are skipped everywhere).

    Returns a wait for the write: with ``group`` (a gloo group of the checkpoint writer's) the
    state is staged to host memory now and written in torch.distributed.checkpoint's background
    thread (``dcp.async_save``; its collectives on ``group``, never on the trainer group), and the
    wait returns once every rank's shard is on disk (on the coordinator, rank 0: it gathers their
    results before writing the metadata). Without, it is written now."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    marker = path / NEVER_STEPPED
    if not all_reduce([0.0 if optim.state else 1.0], dist.ReduceOp.MAX)[0]:
        if rank == 0:
            marker.unlink(missing_ok=True)  # a directory rewritten in place (checkpoint/)
        state = {"optim": get_optimizer_state_dict(model, optim)}
        if group is None:
            dcp.save(state, storage_writer=checkpoint_writer(path))
        else:
            saving = dcp.async_save(state, storage_writer=checkpoint_writer(path), process_group=group)
            saving = getattr(saving, "upload_completion", saving)  # (a torch that answers with staging + upload)
            return lambda: saving.result()
    elif rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        marker.touch()
    return lambda: None


def load_optimizer(model: torch.nn.Module, optim: torch.optim.Optimizer, path: Path) -> bool:
    """Restore what :func:`save_optimizer` wrote (a collective); False for a checkpoint saved
    before any optimizer step (the optimizer starts fresh, as it did then)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    if (path / NEVER_STEPPED).is_file():
        return False
    state = {"optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=str(path))
    set_optimizer_state_dict(model, optim, state["optim"])
    return True
