"""The one typed configuration schema of a DistFlow run.

Every process (launcher, rollout node, trainer node) validates the same YAML file with
this schema before it starts anything, so a bad key fails everywhere at once with an
error that names it. The schema is deliberately flat: one batch unit
(``prompts_per_step``) and everything else derived from it (``samples_per_step``,
``rollout_batch``, ``buffer_capacity``, ...), so two numbers can never disagree.

``key=value`` overrides (``distflow run CONFIG lr=1e-4 workflow.1.fn=gsm8k``) are
applied to the raw mapping before validation, with YAML typing of the value.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError, field_validator, model_validator

from distflow.core.dag import Plan, WorkflowError, WorkflowNode, _suggest, load_workflow, plan
from distflow.rl.loss_keys import check_ignored_keys  # torch-free
from distflow.rl.names import (GROUP_ESTIMATORS, LOSS_AGG_DEFAULTS, LOSS_CLIP_DEFAULTS,  # torch-free, from the catalog
                               LOSS_RECOMPUTE_DEFAULTS, TOKEN_ESTIMATOR_NAMES)
from distflow.rl.node_args import check_node_args  # torch-free


RESERVED_GROUPS = ("rollout", "trainer", "controller")
_GROUP_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_\-]*$")


class ConfigError(ValueError):
    """A configuration problem; the message names the key."""


class MeshSettings(BaseModel):
    """Failure-detector and deadline settings of the control plane (see docs/configuration.md)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    protocol_period_s: float = Field(0.2, gt=0)
    suspicion_timeout_s: float = Field(1.5, gt=0)
    request_timeout_s: float = Field(10.0, gt=0)
    join_timeout_s: float = Field(60.0, gt=0)
    max_frame_bytes: int = Field(1 << 20, ge=4096)


class Config(BaseModel):
    """A DistFlow run. See docs/configuration.md for every key."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)  # .inf crashed at start

    name: str = "distflow"
    seed: int = Field(0, ge=0)
    output_dir: str = Field("outputs/run", min_length=1)

    # -- cluster ---------------------------------------------------------------
    rollout_nodes: int = Field(1, ge=1, description="rollout worker processes (data-parallel size)")
    trainer_nodes: int = Field(1, ge=1, description="trainer processes (FSDP group size)")
    bind_host: str = Field("127.0.0.1", description="address nodes bind to; loopback unless told otherwise")
    advertise_host: str | None = Field(None, description="address peers use to reach a node bound to 0.0.0.0")
    rendezvous_port: int = Field(0, ge=0, le=65535,
                                 description="trainer rank 0's torch.distributed rendezvous port (0 = any free port)")
    controller: Literal["distributed", "single"] = Field(
        "distributed", description="single = route every stage's output through one controller process "
                                   "(the hybrid-controller design, kept to measure against)")
    worker_groups: dict[str, int] = Field(
        default_factory=dict, description="extra worker groups between rollout and trainer: group name -> node "
                                          "count; a workflow node with that `group` runs on those nodes (e.g. a "
                                          "reward model on nodes of its own)")
    mesh: MeshSettings = Field(default_factory=MeshSettings)
    route_by: Literal["owner", "tokens"] = Field(
        "owner", description="owner = hash(sample_id) mod trainers; tokens = balance each step's tokens across trainers")
    channel: Literal["zmq", "shm", "auto"] = Field(
        "auto", description="data-plane transport; auto = shm to peers on this host, zmq to others")
    posting: bool = Field(
        True, description="with shared memory, rollout nodes post each step's parts to the trainers on their host "
                          "(a record in the trainer's mailbox, no message per part); false = a message per part")
    weight_transport: Literal["auto", "channel", "cuda_ipc", "nccl"] = Field(
        "auto", description="how weights reach rollout nodes: auto = cuda_ipc when trainer and rollout share a GPU, "
                            "nccl between different GPUs (with the NCCL channel), the data channel otherwise")
    weight_sync: Literal["full", "delta"] = Field(
        "full", description="delta = send only tensors whose bytes changed since the version the peer holds "
                            "(full resend when it is too far behind or rejoined); the engine applies partial sets")
    weight_bucket_mb: int = Field(64, ge=1, le=4096, description="size of a weight-sync bucket in MiB (gather, "
                                                                 "send and apply one bucket at a time)")

    # -- model -----------------------------------------------------------------
    model_path: str = Field(min_length=1)
    toy_model: bool = Field(False, description="build the tiny toy model at model_path if it is missing")
    toy_kind: Literal["successor", "gsm8k"] = Field(
        "successor", description="which toy model toy_model builds: successor = the character-level Llama of the "
                                 "quickstart; gsm8k = a byte-level BPE chat tokenizer and a tiny Qwen2")
    engine: Literal["torch", "vllm"] = "torch"
    engine_compile: bool = Field(True, description="torch engine on CUDA: capture the decode step as CUDA graphs "
                                                   "(once per process); false = eager. Ignored on CPU")
    engine_max_slots: int = Field(256, ge=1, le=65536, description="torch engine: sequences decoded at once "
                                                                   "(continuous-batching slots of its KV cache)")
    engine_kv_cache_memory_fraction: float | None = Field(
        None, gt=0, le=1, description="torch engine on CUDA: the share of the GPU's free memory its KV cache may take "
                                      "(fewer slots than engine_max_slots when they do not fit, logged); null = 0.9 "
                                      "divided among the nodes placed on that GPU (colocate, shared rollout GPUs)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    torch_threads: int = Field(1, ge=1, description="intra-op threads per node process")
    gpus: int | list[int] | None = Field(
        None, description="GPUs `distflow run` may use with device: cuda: null = every visible GPU, N = the "
                          "first N, [i, j, ...] = these physical ids. One GPU per trainer rank always")
    colocate: bool = Field(False, description="rollout nodes share the trainers' GPUs (round-robin) instead of "
                                              "taking GPUs of their own")
    restarts: int = Field(3, ge=0, description="`distflow run` restarts a dead rollout node up to this many "
                                               "times (same id and ports); a dead trainer stops the run")

    @field_validator("worker_groups")
    @classmethod
    def _worker_groups(cls, v: dict[str, int]) -> dict[str, int]:
        for name, n in v.items():
            if name in RESERVED_GROUPS:
                raise ValueError(f"{name!r} is a built-in group; a worker group needs another name "
                                 f"(not {', '.join(RESERVED_GROUPS)})")
            if not _GROUP_RE.match(name):
                raise ValueError(f"group name {name!r} must use only letters, digits, '_' and '-'")
            if n < 1:
                raise ValueError(f"group {name!r} has {n} nodes; a worker group needs at least 1")
        return v

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, v: Any) -> Any:
        if isinstance(v, bool) or (isinstance(v, list) and any(isinstance(g, bool) for g in v)):
            raise ValueError(f"{v!r} is not a GPU count or a list of GPU ids")
        if isinstance(v, int) and v < 1:
            raise ValueError(f"{v} must be at least 1 (or null for every visible GPU)")
        if isinstance(v, list) and (not v or any(not isinstance(g, int) or g < 0 for g in v) or len(set(v)) != len(v)):
            raise ValueError(f"{v} must be a non-empty list of distinct GPU ids >= 0")
        return v

    # -- data ------------------------------------------------------------------
    dataset: str = Field(min_length=1)
    prompt_key: str = Field("prompt", min_length=1)
    chat_template: bool = Field(False, description="wrap each prompt in the tokenizer's chat template")
    stop_token_ids: list[NonNegativeInt] = Field(
        default_factory=list, description="token ids that end a response besides the model's EOS ids (with "
                                          "chat_template, the template's end-of-turn id is one)")
    shuffle: bool = True
    bad_rows: Literal["error", "skip"] = "error"
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="stop after this many trainer steps")

    # -- evaluation on held-out prompts (distflow/rollout/evaluation.py) -----------------
    eval_dataset: str | None = Field(None, min_length=1,
                                     description="held-out prompts (JSONL/Parquet, the keys of dataset), "
                                                 "scored by the workflow's rewards and never trained on; "
                                                 "results in output_dir/eval.jsonl")
    eval_every: int = Field(0, ge=0, description="evaluate every N trainer steps (0: only before training and "
                                                 "after the last step)")
    eval_before_train: bool = Field(True, description="evaluate the starting weights (step 0, or the step a "
                                                      "resumed run starts at)")
    eval_samples_per_prompt: int = Field(1, ge=1, description="responses per held-out prompt (above 1 also "
                                                              "reports best-of-n)")
    eval_temperature: float = Field(0.0, ge=0, description="sampling temperature of evaluation (0 = greedy)")

    # -- the batch unit ------------------------------------------------------------
    prompts_per_step: int = Field(..., ge=1, description="prompts per trainer step, over all rollout nodes")
    group_size: int = Field(8, ge=1, description="samples per prompt (GRPO group)")
    micro_batch_size: int = Field(64, ge=1, description="samples per forward/backward on a trainer")
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=2, description="token budget of a packed micro-batch (samples packed into one row, block-diagonal "
                                "attention, no padding); None = padded micro-batches of micro_batch_size samples")
    activation_checkpointing: bool = Field(False, description="checkpoint every decoder layer of the policy")
    grad_sync: Literal["auto", "step", "micro_batch"] = Field(
        "auto", description="when the policy's gradients are reduce-scattered: step = once per optimizer step "
                            "(every rank holds the full unsharded fp32 gradients, and between micro-batches the "
                            "weights, up to 6 bytes x params in bf16); micro_batch = after every "
                            "micro-batch's backward (overlapped with it; memory stays sharded); auto = step on "
                            "one trainer or when that costs at most 2 GiB more per GPU, else micro_batch")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="learning-rate schedule after warm-up (linear/cosine decay to 0 at the last step)")
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up, in trainer steps")
    peak_flops: float | None = Field(None, gt=0, description="peak FLOP/s of ONE trainer device, for the mfu "
                                                             "metric; None: from the GPU's name (device.PEAK_FLOPS), "
                                                             "else a 1e14 placeholder")
    logprob_chunk_tokens: int = Field(1024, ge=1, description="response tokens per chunk of the LM head "
                                                              "(peak logits memory = chunk x vocab x 4 bytes)")

    # -- sampling ---------------------------------------------------------------
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)

    # -- optimisation -------------------------------------------------------------
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.999)

    @field_validator("adam_betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):  # also refuses NaN (AdamW would, only once the model is loaded)
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v
    grad_clip: float = Field(1.0, gt=0)
    clip_low: float = Field(0.2, ge=0, description="ratio clip below 1; default 0.2 (gspo: 3e-4)")
    clip_high: float = Field(0.2, ge=0, description="ratio clip above 1; default 0.2 (gspo: 4e-4)")
    dual_clip: float | None = Field(None, gt=1, description="PPO dual clip c > 1: a token with a negative "
                                    "advantage loses at most -c * A however large its ratio (verl's clip_ratio_c, 3); "
                                    "losses grpo, ppo, dapo, reinforce_pp; null = off")
    kl_coef: float = Field(0.0, ge=0)
    # -- algorithm (docs/algorithms.md) -------------------------------------------
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="how per-token losses become one scalar; seq-mean-token-sum-norm is Dr. GRPO's "
                                  "constant normaliser (max_new_tokens)")
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "k3", description="estimator of the KL loss term (kl_coef, kl_in_reward false); as a loss its gradient is "
                          "KL(pi || ref)'s with k2, KL(ref || pi)'s with k3 and low_var_kl (GRPO's usual), zero with "
                          "k1 (refused)")
    kl_in_reward: bool = Field(False, description="kl_coef penalises the per-token reward (a gae or "
                                                  "reinforce_pp_token node) instead of adding a KL loss term")
    kl_reward_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "k1", description="estimator of the per-token KL penalty with kl_in_reward: k1 (log pi - log ref), whose "
                          "score-function gradient is the KL's (verl's and OpenRLHF's default); kl_estimator is "
                          "the loss term's")
    kl_clamp: float | None = Field(
        10.0, gt=0, description="bound of the k3 estimator (loss term and reward penalty): where k3 would exceed it "
                                "because the policy finds a token far less likely than the reference, it continues "
                                "along its tangent, so a token's gradient is at most kl_clamp + d_c where k3(d_c) = "
                                "kl_clamp (12.61 at 10; exact k3's is 4.9e8 at a log-ratio of 20); null = exact k3")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus coefficient in the policy loss")
    overlong: Literal["none", "mask", "penalty"] = Field(
        "none", description="truncated responses (finish_reason length): mask = no loss, penalty = DAPO's soft "
                            "overlong punishment over the last overlong_buffer tokens")
    overlong_buffer: int = Field(0, ge=0, description="tokens before max_new_tokens where the overlong penalty ramps")
    max_prompt_length: int | None = Field(None, ge=1, description="prompts with more tokens are skipped and counted")
    ppo_epochs: int = Field(1, ge=1, description="passes over each step's batch")
    mini_batches_per_step: int = Field(1, ge=1, description="optimizer steps per pass (the batch is split)")
    recompute_old_logprobs: bool = Field(False, description="the trainer recomputes old (proximal) logprobs "
                                                            "instead of using the engine's")
    tis_cap: float | None = Field(None, gt=0, description="truncated importance sampling cap between behaviour "
                                                          "(engine) and proximal policies; null = off")
    critic_path: str | None = Field(None, description="critic initialisation (default: model_path + value head)")
    critic_lr: float | None = Field(None, gt=0, description="critic learning rate (default: lr)")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE / return discount")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    value_clip: float | None = Field(0.2, gt=0, description="critic value clipping range; null = unclipped")

    @model_validator(mode="after")
    def _algorithm(self) -> "Config":
        for n in self.workflow:  # what each stage reads of its node's args (a dotted fn: preflight)
            check_node_args(n, type(self).model_fields)
        for n in self.workflow:
            if n.type.value == "COMPUTE" and n.fn in GROUP_ESTIMATORS and self.group_size < 2:
                raise ValueError(f"group_size: {self.group_size} gives workflow node {n.id!r} ({n.fn}, a group "
                                 f"baseline) all-zero advantages; use group_size >= 2")
            if n.type.value == "COMPUTE" and n.fn == "dynamic_sampling" and self.group_size < 2:
                raise ValueError(f"group_size: {self.group_size} makes every group of workflow node {n.id!r} "
                                 "(dynamic_sampling) constant: each step would be regenerated max_retries times "
                                 "for nothing; use group_size >= 2")
        if self.temperature == 0:
            raise ValueError("temperature: 0 (greedy) makes every sample of a prompt identical and the policy "
                             "gradient zero; training needs temperature > 0")
        if self.kl_in_reward and self.kl_coef > 0 and not any(
                n.type.value == "COMPUTE" and n.fn in TOKEN_ESTIMATOR_NAMES for n in self.workflow):
            raise ValueError("kl_in_reward: true puts the KL penalty into per-token rewards, which only a token-level "
                             f"estimator ({', '.join(TOKEN_ESTIMATOR_NAMES)}) reads; this workflow has none, so the "
                             "run would train with no KL at all. Use kl_in_reward: false (a KL loss term), or a gae "
                             "or reinforce_pp_token node")
        if self.kl_coef > 0 and not self.kl_in_reward and self.kl_estimator == "k1":
            raise ValueError("kl_estimator: k1 as a KL loss term (kl_coef > 0, kl_in_reward false) regularises "
                             "nothing: only log pi of the sampled token is differentiated, and the mean of that "
                             "gradient is zero. Use k3 (the default) or k2 (the gradient of KL(pi || ref)), or "
                             "kl_in_reward: true, where k1 is the usual penalty (kl_reward_estimator)")
        check_ignored_keys(self)  # a key the chosen loss ignores (cispo: clip_low), where set
        for n in self.workflow:  # a loss's own clip range and aggregation where the config leaves them unset
            if n.role.value != "ACTOR" or n.type.value != "MODEL_TRAIN":
                continue
            if n.fn in LOSS_CLIP_DEFAULTS:
                low, high = LOSS_CLIP_DEFAULTS[n.fn]
                if "clip_low" not in self.model_fields_set:
                    self.clip_low = low
                if "clip_high" not in self.model_fields_set:
                    self.clip_high = high
            if n.fn in LOSS_AGG_DEFAULTS and "loss_agg" not in self.model_fields_set:
                self.loss_agg = LOSS_AGG_DEFAULTS[n.fn]
            if n.fn in LOSS_RECOMPUTE_DEFAULTS and "recompute_old_logprobs" not in self.model_fields_set:
                self.recompute_old_logprobs = True
        if self.kl_coef > 0 and not any(n.role.value == "REFERENCE" for n in self.workflow):
            raise ValueError(f"kl_coef: {self.kl_coef} penalises the KL to the reference model, but the workflow has "
                             "no REFERENCE MODEL_INFERENCE node, so no KL would be applied. Add one (fn: ref_logprob, "
                             "deps: [generate], a dep of the update) or set kl_coef: 0")
        if self.tis_cap is not None and not self.recompute_old_logprobs:
            raise ValueError("tis_cap: truncated importance sampling weighs the proximal policy (the trainer's "
                             "recomputed old logprobs) against the engine's; without recompute_old_logprobs: true "
                             "both are the engine's, every weight is 1 and tis_cap does nothing. Set "
                             "recompute_old_logprobs: true, or remove tis_cap")
        if self.overlong == "penalty" and not 0 < self.overlong_buffer <= self.max_new_tokens:
            raise ValueError(f"overlong_buffer: overlong: penalty needs 0 < overlong_buffer <= max_new_tokens "
                             f"({self.max_new_tokens}), got {self.overlong_buffer}")
        return self
    max_staleness: int = Field(1, ge=0, description="0 = strictly on-policy")
    save_every: int = Field(0, ge=0, description="save a checkpoint every N steps (0 = only at the end)")
    resume_from: str | None = Field(None, description="continue a run from a DistFlow checkpoint directory")
    trace_samples: bool = Field(False, description="write per-node sample accounting to output_dir/trace/")

    # -- deadlines ------------------------------------------------------------------
    step_timeout_s: float = Field(600.0, gt=0, description="longest wait for one step's data or weights")

    # -- trackers and operator metrics (distflow/trackers, distflow/core/prometheus.py; docs/trackers.md) --
    trackers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        ["jsonl"], description="where trainer rank 0 logs every step's metrics, evaluation rows and sample "
                               "tables; jsonl (metrics.jsonl, eval.jsonl, samples.jsonl) is always on")
    tracker_project: str = Field("distflow", min_length=1, description="W&B project / MLflow experiment name")
    tracker_run_name: str | None = Field(None, min_length=1, description="the run's name in the trackers "
                                                                         "(default: name)")
    tracker_uri: str | None = Field(None, min_length=1, description="MLflow tracking URI (default: "
                                    "$MLFLOW_TRACKING_URI, else the file store output_dir/mlruns)")
    wandb_mode: Literal["offline", "online", "shared"] = Field(
        "offline", description="offline: files under output_dir/wandb (wandb sync uploads them); online; shared: "
                               "W&B's multi-writer mode, every node writes the same run id")
    sample_table_k: int = Field(4, ge=0, description="the sample table of a logged step holds the top-k and "
                                                     "bottom-k of trainer rank 0's samples by reward (0: no table)")
    sample_table_every: int = Field(1, ge=1, description="log a sample table every N trainer steps")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus /metrics of every node on "
                                     "this port (0: any free port, logged; null: off)")
    metrics_host: str = Field("127.0.0.1", min_length=1, description="address of the /metrics endpoint "
                                                                      "(loopback unless opened on purpose)")

    workflow: list[WorkflowNode]

    @field_validator("workflow", mode="before")
    @classmethod
    def _workflow_list(cls, v: Any) -> Any:
        if not isinstance(v, list) or not v:
            raise ValueError("workflow must be a non-empty list of nodes")
        try:
            return load_workflow(v)
        except WorkflowError as e:
            raise ValueError(str(e)) from None

    @model_validator(mode="after")
    def _derived(self) -> "Config":
        if self.prompts_per_step % self.rollout_nodes:
            raise ValueError(
                f"prompts_per_step ({self.prompts_per_step}) must be a multiple of rollout_nodes "
                f"({self.rollout_nodes}): each rollout node generates an equal share of every step"
            )
        groups = ("rollout", "trainer", *self.worker_groups)
        for n in self.workflow:
            if n.group is not None and n.group not in groups:
                raise ValueError(f"workflow node {n.id!r}: key 'group' names {n.group!r}, which is not rollout, "
                                 f"trainer or a group of worker_groups ({', '.join(self.worker_groups) or 'none'})")
        if self.worker_groups and self.controller == "single":
            raise ValueError("worker_groups: controller: single routes every batch through one controller; it "
                             "cannot be combined with worker groups (use controller: distributed)")
        if self.device == "cpu" and self.gpus is not None:  # here, not only in placement: --check sees it too
            raise ValueError(f"gpus: {self.gpus!r} is set, but device is cpu; set device: cuda or gpus: null")
        if self.device == "cpu" and self.engine == "vllm":
            raise ValueError("engine: vllm runs on GPUs only, but device is cpu; use engine: torch (or device: cuda)")
        if self.device == "cpu" and self.weight_transport in ("cuda_ipc", "nccl"):
            raise ValueError(f"weight_transport: {self.weight_transport} moves weights between GPUs, but device is "
                             "cpu; use weight_transport: auto or channel (or device: cuda)")
        if self.dtype == "float16":  # bf16 has fp32's exponent range; fp16 needs a loss scaler to train
            raise ValueError("dtype float16: training in float16 needs loss scaling, which DistFlow does not do "
                             "(per-token gradients of ~1e-5 underflow in the half-precision matmuls); use bfloat16 "
                             "(GPUs since Ampere) or float32. A reward model may still run in float16 (args.dtype)")
        try:
            p = self.plan()
        except WorkflowError as e:
            raise ValueError(str(e)) from None
        if self.kl_in_reward and self.kl_coef > 0:  # the per-token penalty reads the reference logprobs
            seen_reference = False
            for n in p.pipeline("trainer"):
                seen_reference = seen_reference or n.role.value == "REFERENCE"
                if n.type.value == "COMPUTE" and n.fn in TOKEN_ESTIMATOR_NAMES and not seen_reference:
                    raise ValueError(f"kl_in_reward: workflow node {n.id!r} ({n.fn}) puts the KL into per-token "
                                     "rewards, but the REFERENCE MODEL_INFERENCE node runs after it; make the "
                                     "reference depend on generate only, and add it to this node's deps (key 'deps')")
        for g in self.worker_groups:
            if not p.pipeline(g):
                raise ValueError(f"worker_groups: group {g!r} runs no workflow node (give a node `group: {g}`)")
        self._check_eval(p)
        for n in p.nodes:
            if n.fn == "dynamic_sampling" and p.group_of[n.id] != "rollout":
                raise ValueError(f"workflow node {n.id!r}: dynamic_sampling regenerates prompts, so it runs on the "
                                 f"rollout group, not on {p.group_of[n.id]!r} (key 'group', or its deps: it runs where "
                                 "they are)")
        return self

    def _check_eval(self, p: Any) -> None:
        """The evaluation keys: set only with eval_dataset, whose scores need every REWARD node on
        the rollout group (evaluation runs there: generate, then the rewards; nothing is sent on)."""
        if self.eval_dataset is None:
            for key in ("eval_every", "eval_samples_per_prompt", "eval_temperature"):
                if getattr(self, key) != type(self).model_fields[key].default:  # (a dumped config sets them all)
                    raise ValueError(f"{key}: set, but there is no eval_dataset to evaluate on; set eval_dataset "
                                     f"(held-out prompts) or remove {key}")
            return
        rewards = [n for n in p.nodes if n.role.value == "REWARD"]
        elsewhere = [n.id for n in rewards if p.group_of[n.id] != "rollout"]
        if not rewards or elsewhere:
            where = (f"workflow nodes {elsewhere} run on another group" if elsewhere
                     else "the workflow has no REWARD node")
            raise ValueError(f"eval_dataset: evaluation scores held-out prompts with the REWARD nodes on the rollout "
                             f"group, but {where}; remove eval_dataset, or run the rewards on the rollout group")

    # -- derived quantities (the only place they are computed) ---------------------
    @property
    def rollout_batch(self) -> int:
        """Prompts each rollout node generates per step."""
        return self.prompts_per_step // self.rollout_nodes

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def buffer_capacity(self) -> int:
        """Samples a trainer's BufferShard holds: enough for every step a rollout may run ahead."""
        return (self.max_staleness + 2) * self.samples_per_step

    def group_sizes(self) -> dict[str, int]:
        """Workers per group, in flow order (rollout, the worker_groups, trainer): the planner's input."""
        return {"rollout": self.rollout_nodes, **self.worker_groups, "trainer": self.trainer_nodes}

    @property
    def controller_nodes(self) -> int:
        return 1 if self.controller == "single" else 0

    def plan(self) -> Plan:
        return plan(self.workflow, self.group_sizes())

    def node(self, role: str, type_: str) -> WorkflowNode | None:
        """The first workflow node with this role and type (e.g. ("REWARD", "COMPUTE"))."""
        for n in self.workflow:
            if n.role.value == role and n.type.value == type_:
                return n
        return None

    def total_steps(self, num_rows: int) -> int:
        steps = self.epochs * math.ceil(num_rows / self.prompts_per_step)
        return min(steps, self.max_steps) if self.max_steps else steps


# ---------------------------------------------------------------------- loading
class DuplicateKeyError(yaml.YAMLError):
    """A mapping of the YAML gives one key twice (PyYAML would silently keep the last)."""

    def __init__(self, key: Any, line: int, first: int):
        super().__init__(f"key {key!r} is given twice (lines {first} and {line}); the second would silently "
                         f"replace the first: keep one")
        self.line = line


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping. Keys a merge (``<<: *anchor``)
    brings in may still be overridden by the mapping's own keys, as YAML intends."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKeyError(key, line, seen[key])
            except TypeError:  # an unhashable key: the base class names it
                continue
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that raises :class:`DuplicateKeyError` for a key given twice in one mapping."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (YAML-typed values) to a raw config mapping."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, _, text = item.partition("=")
        try:
            value = load_yaml(text) if text else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key}: cannot parse value {text!r}: {e}") from None
        parts = key.strip().split(".")
        target: Any = raw
        for i, part in enumerate(parts[:-1]):
            where = ".".join(parts[: i + 1])
            if isinstance(target, list):
                if not part.isdigit() or int(part) >= len(target):
                    raise ConfigError(f"override {key}: {where} is not an index of the list")
                target = target[int(part)]
            elif isinstance(target, dict):
                target = target.setdefault(part, {})
            else:
                raise ConfigError(f"override {key}: {where} is not a mapping")
        last = parts[-1]
        if isinstance(target, list):
            if not last.isdigit() or int(last) >= len(target):
                raise ConfigError(f"override {key}: {last} is not an index of the list")
            target[int(last)] = value
        elif isinstance(target, dict):
            target[last] = value
        else:
            raise ConfigError(f"override {key}: parent is not a mapping")
    return raw


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(config)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden" and len(e["loc"]) <= 2:  # a misspelt top-level (or mesh.) key
            fields = MeshSettings.model_fields if len(e["loc"]) == 2 and e["loc"][0] == "mesh" else (
                Config.model_fields if len(e["loc"]) == 1 else {})
            msg = f"unknown key{_suggest(str(e['loc'][-1]), list(fields))}"
        lines.append(f"  {loc}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read, override and validate a config file. Raises ConfigError naming the key."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        raw = load_yaml(p.read_text())
    except DuplicateKeyError as e:
        raise ConfigError(f"{p}:{e.line}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: a config must be a mapping of keys, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides)
    return config_from_dict(raw, source=str(p))


def config_from_dict(raw: dict[str, Any], source: str = "config") -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{source}: {_format_errors(e)}") from None
