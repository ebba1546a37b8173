"""The sections of a DistFlow config: one pydantic model per concern.

Why sections: one flat model of ~90 keys served every process, and a reader could not tell which
keys the engine reads from those of the trainer or the launcher. Each section here is the place
a user of verl or prime-rl would look for a key (``model.model_path``, ``trainer.lr``,
``rollout.temperature``, ...). Every key keeps its flat name too (``lr: 1e-4`` is
``trainer: {lr: 1e-4}``): key names are unique across sections, so a flat key names one field.

Only rules about one key live here (a range, a list of GPU ids, the workflow's node schema);
rules between keys of different sections are the :class:`distflow.core.config.Config`'s.
Every field has a ``description``: ``distflow config --explain KEY`` prints it, and
docs/configuration.md is generated from it (``python3 -m distflow.core.config_docs``).
Torch-free: entry points import this before torch.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, field_validator

from distflow.core.dag import WorkflowError, WorkflowNode, load_workflow

RESERVED_GROUPS = ("rollout", "trainer", "controller")
_GROUP_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_\-]*$")


class Section(BaseModel):
    """Base of every section: unknown keys are errors, and so are .inf and NaN (``.inf`` crashed at start)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)


class LoraSection(Section):
    """LoRA (``model.lora``): train low-rank adapters over a frozen base (PEFT, docs/lora.md)."""

    rank: int = Field(8, gt=0, description="rank r of every adapter (`A: r x in`, `B: out x r`)")
    alpha: float = Field(16.0, gt=0, description=(
        "scaling numerator: the adapter adds `alpha / rank * B @ A` to each target weight (PEFT's `lora_alpha`)"))
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                      min_length=1, description=(
        "names of the `nn.Linear` modules that get an adapter: a module matches when its name is the entry or ends "
        "with `.` + the entry (PEFT's rule), e.g. `q_proj`, `mlp.down_proj`. Non-empty; the trainer refuses a list "
        "that matches no linear module of the model, naming `model.lora.target_modules` and the modules it has"))
    dropout: float = Field(0.0, ge=0, lt=1, description=(
        "dropout on the adapter's input while training (PEFT's `lora_dropout`); the engine samples without it, so "
        "a nonzero value makes the trainer's logprobs of a sample differ from the sampler's"))

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        if any(not t.strip() for t in v):
            raise ValueError(f"every target module must be a non-empty module name, got {v}")
        return v


class ModelSection(Section):
    """The policy model (and the critic's starting point), and the dtype everything computes in."""

    model_path: str = Field(min_length=1, description=(
        "local Hugging Face model directory (nothing is downloaded): `distflow run` (and `distflow-node` of a "
        "rollout or trainer node, at every start) refuses one without a `config.json` naming its `model_type`, or "
        "without tokenizer files, before any node starts (exit 2, one line)"))
    toy_model: bool = Field(False, description=(
        "build the tiny toy model at `model_path` when it is missing (with `toy_kind: successor`, also the toy "
        "reward model at the `args.path` of each REWARD MODEL_INFERENCE node that is missing one; `distflow "
        "toy-model --kind reward DIR` builds it by hand). Only `distflow run` builds it; a hand-started node "
        "(`distflow-node`) refuses a missing one, naming the `distflow toy-model DIR` command that builds it"))
    toy_kind: Literal["successor", "gsm8k", "tool", "vlm"] = Field("successor", description=(
        "which toy model `toy_model` builds: `successor` (the quickstart's character-level Llama), `gsm8k` (a "
        "byte-level BPE tokenizer with a Qwen chat template and a tiny Qwen2; docs/gsm8k.md), `tool` (a "
        "character-level chat tokenizer with a Hermes tool template and a tiny Llama; docs/agents.md) or `vlm` "
        "(a tiny Qwen2-VL with its image processor, for the colour-naming task; docs/vlm.md)"))
    freeze_vision_tower: bool = Field(False, description=(
        "vision-language models (docs/vlm.md): keep the vision tower's weights fixed (no gradients, no optimizer "
        "state; the tower still runs in every forward). `false` trains it with the language model. Ignored for "
        "text-only models"))
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description=(
        "compute dtype of the trainer and the engines: `float32` or `bfloat16` (master weights, AdamW state and "
        "gradient reduction stay fp32: FSDP2 `MixedPrecisionPolicy`; the checkpoint's Hugging Face weights are "
        "the fp32 masters); `float16` is refused (training in it needs loss scaling, which DistFlow does not do)"))
    critic_path: str | None = Field(None, description=(
        "PPO critic initialisation: a saved critic directory or any Hugging Face causal LM (null: `model_path`, "
        "with a zero-initialised scalar value head)"))
    lora: LoraSection | None = Field(None, description=(
        "train LoRA adapters instead of the whole policy: `{rank, alpha, target_modules, dropout}` (docs/lora.md). "
        "Only the adapters train (the base is frozen, sharded by FSDP2 like the rest), only adapter tensors go to "
        "the rollout nodes at a weight sync, whose engine merges them into its base weights and reports a checksum "
        "of what it applied (a mismatch stops the run, naming the version); the checkpoint is a PEFT adapter "
        "directory. `engine: torch` only. null: full fine-tuning"))


class DataSection(Section):
    """The prompt sets and the batch unit (``prompts_per_step``, from which every other size derives)."""

    dataset: str = Field(min_length=1, description=(
        "JSONL or Parquet prompt set; each rollout rank reads only its own shard. `distflow run` (and "
        "`distflow-node --role rollout`) opens it as a rollout node does and checks the rows the run reads "
        "first (up to 100,000; all of them when the run covers an epoch) as its steps would, before any node "
        "starts (see `bad_rows`)"))
    prompt_key: str = Field("prompt", min_length=1, description=(
        "the row key holding the prompt: text, or with `chat_template: true` also a conversation of chat messages "
        "(`[{role, content}, ...]`, rendered with the template). A row whose prompt is neither, malformed, or "
        "encodes to no tokens is skipped and counted (`bad_prompts` in the step's metrics), never a crash"))
    chat_template: bool = Field(False, description="wrap each prompt in the tokenizer's chat template")
    image_key: str = Field("images", min_length=1, description=(
        "vision-language models (docs/vlm.md): the row key listing the prompt's images: file paths relative to the "
        "dataset file or absolute, or (Parquet) `{bytes, path}` structs; the prompt is rendered in the model's chat template with one image placeholder "
        "per image. A row whose image is missing, unreadable or too large is a bad row (`bad_rows`), named; a "
        "row without the key is a text prompt"))
    max_image_pixels: int | None = Field(16_777_216, ge=1, description=(
        "an image with more pixels (width x height, read from its header before it is decoded) makes its row a "
        "bad row (`bad_rows`); null: no limit. The model's image processor then resizes what it keeps to its "
        "own pixel bounds"))
    shuffle: bool = Field(True, description="a seeded permutation of the prompt set each epoch, before sharding")
    bad_rows: Literal["error", "skip"] = Field("error", description=(
        "`error` (names file and line) or `skip` (logged, and counted as `bad_rows` in the step's metrics); a row "
        "is bad when it is no JSON object, lacks `prompt_key`, or lacks a key a REWARD COMPUTE node's function "
        "reads (its `required_keys`: `answer` for the built-in rewards), or is one that function cannot score "
        "(its `check_row`); checked before generation, so a skipped prompt drops with its whole group. A prompt "
        "file with no rows is always an error. Before any node starts, `distflow run` names the first bad row of "
        "those the run reads (`error`: exit 2), or counts them (`skip`: printed), and refuses a run in which every "
        "such row is bad"))
    max_prompt_length: int | None = Field(None, ge=1, description=(
        "prompts with more tokens are skipped (never a crash) and counted (`skipped_prompts`), as are prompts "
        "longer than the model's positions less `max_new_tokens` whether it is set or not; with the torch engine "
        "it also sizes the KV cache once, for `max_prompt_length + max_new_tokens` positions per sequence (without "
        "it the cache grows with the longest prompt seen, and each growth recaptures the CUDA graphs mid-step)"))
    prompts_per_step: int = Field(..., ge=1, description=(
        "**the batch unit**: prompts per trainer step, over all rollout nodes (a multiple of `rollout_nodes`). "
        "Derived from it: each rollout node generates `prompts_per_step / rollout_nodes` prompts a step, a step "
        "has `prompts_per_step * group_size` samples, a trainer's buffer holds `(max_staleness + 2) * "
        "samples_per_step` samples, and a run has `epochs * ceil(rows / prompts_per_step)` steps (capped by "
        "`max_steps`)"))
    eval_dataset: str | None = Field(None, min_length=1, description=(
        "held-out JSONL or Parquet prompts with the keys of `dataset` (`prompt_key`, what the rewards read), read "
        "in file order, scored by the workflow's rewards and never trained on; results in `output_dir/eval.jsonl`. "
        "Checked before the run like `dataset` (first 100,000 rows). Needs every REWARD node on the rollout group"))


class RolloutSection(Section):
    """The rollout engine, sampling, and how far generation may run ahead of training."""

    engine: Literal["torch", "vllm"] = Field("torch", description=(
        "rollout engine: built-in `torch`, or `vllm` (extra, GPU; with `device: cpu` a config error)"))
    engine_compile: bool = Field(True, description=(
        "`torch` engine on CUDA: capture the decode step as CUDA graphs (cost paid once per process); `false` = "
        "eager; ignored on CPU"))
    engine_max_slots: int = Field(256, ge=1, le=65536, description=(
        "`torch` engine: sequences decoded at once (continuous-batching slots of its KV cache; a finished one's "
        "slot is refilled at once)"))
    engine_gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description=(
        "share of each GPU's TOTAL memory the processes on it may use together (vLLM's `gpu_memory_utilization`; the "
        "rest is CUDA contexts and fragmentation). A colocated trainer's `engine_trainer_memory_fraction` comes off "
        "first, the engines placed on the GPU split the rest; the `torch` engine's KV cache gets its part less its "
        "weights and prefill reserve, planned once (fewer than `engine_max_slots` slots when they do not fit, "
        "logged; an error naming `max_new_tokens` when not even one does). `vllm` gets its part as its own "
        "`gpu_memory_utilization`. null: 0.9"))
    engine_trainer_memory_fraction: float = Field(0.5, ge=0, lt=1, description=(
        "with `colocate`: share of the GPU's TOTAL memory kept for the trainer rank on it (its weight shards, "
        "gradients, optimizer state and activations), taken off `engine_gpu_memory_utilization` before the engine "
        "plans its KV cache, so the trainer's first step still fits; must be below it. Ignored without `colocate`"))
    group_size: int = Field(8, ge=1, description="samples per prompt (the GRPO group)")
    max_new_tokens: int = Field(16, ge=1, description=(
        "response length limit; refused before the run when it leaves no room for a prompt in the model's "
        "`max_position_embeddings` (or, with `max_prompt_length`, when the two add up to more)"))
    temperature: float = Field(1.0, ge=0, description=(
        "sampling temperature; must be > 0 (`0`, greedy, makes every sample of a prompt identical and the policy "
        "gradient zero: a config error)"))
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens of this probability")
    top_k: int = Field(0, ge=0, description="sample among the k likeliest tokens; 0 = off")
    stop_token_ids: list[NonNegativeInt] = Field(default_factory=list, description=(
        "token ids that end a response besides the model's EOS ids (tokenizer, generation config, model config). "
        "With `chat_template` the template's end-of-turn token is always one: a base model prompted in a chat "
        "template would otherwise write made-up turns until `max_new_tokens`"))
    max_staleness: int = Field(1, ge=0, description=(
        "a sample may be generated by weights at most this many versions old; `0` = strictly on-policy"))
    eval_samples_per_prompt: int = Field(1, ge=1, description=(
        "responses per held-out prompt of `eval_dataset` (above 1, `eval_best_of_n_mean` is reported too)"))
    eval_temperature: float = Field(0.0, ge=0, description=(
        "sampling temperature of evaluation; 0 is greedy (`top_p`, `top_k`, `max_new_tokens` and "
        "`max_prompt_length` are the run's)"))


class EnvSection(Section):
    """Multi-turn agentic episodes (docs/agents.md): the environment or tools, and the episode's budgets.
    Read by the generate node's ``fn: episodes`` (and only with it)."""

    environment: str | None = Field(None, min_length=3, description=(
        "`module:Class` of the environment, one instance per episode (`reset(row)`, `step(reply)`; "
        "docs/agents.md); imported and its `environment_args` bound to the constructor before any node starts. "
        "Needs the generate node's `fn: episodes`; not with `tools`"))
    environment_args: dict[str, Any] = Field(default_factory=dict, description=(
        "keyword arguments of the environment's constructor (with `tools`: of the built-in tool environment: "
        "`system_prompt`, `tool_timeout`, `reward: module:function`, ...)"))
    tools: list[str] = Field(default_factory=list, description=(
        "`module:function` tools of the built-in tool environment (Hermes `<tool_call>` JSON calls; schemas from "
        "the signatures and docstrings), e.g. `distflow.env.sandbox:python`; not with `environment`"))
    max_turns: int = Field(4, ge=1, description="model turns per episode")
    max_total_tokens: int = Field(512, ge=2, description=(
        "tokens of the whole episode the model conditions on (prompt, turns, observations); each turn samples at "
        "most `min(max_new_tokens, what is left)`, and at most the model's positions"))
    max_tool_errors: int | None = Field(None, ge=0, description=(
        "failed tool calls per episode before it stops (`stop_tool_error`); null: no limit"))
    env_timeout_s: float = Field(60.0, gt=0, description=(
        "deadline of every call into the environment (constructor, `reset`, `step`, `close`); past it the episode "
        "ends as `env_error` (counted, not trained), the others go on"))
    max_concurrent_episodes: int | None = Field(None, ge=1, description=(
        "episodes of a rollout node in flight at once (null: all of its step's)"))
    agent: str | None = Field(None, min_length=3, description=(
        "`module:function` of an agent, `async def agent(row, client) -> reward`, run once per episode against "
        "the rollout node's OpenAI-compatible endpoint (`client.base_url`, `client.api_key`, `client.chat`); "
        "each request is one turn, the returned float the episode's reward (docs/agents.md). Needs `fn: "
        "episodes`; not with `environment` or `tools`"))
    agent_host: str = Field("127.0.0.1", min_length=1, description=(
        "address the agent endpoint listens on (loopback: only this host's agents reach it; every request needs "
        "its episode's bearer token)"))
    agent_port: int = Field(0, ge=0, le=65535, description=(
        "port of the agent endpoint; 0 = a free one (each rollout node its own; a fixed port fits one rollout "
        "node per host)"))


class TrainerSection(Section):
    """The optimiser, its schedule, micro-batching, the run's length, checkpoints and evaluation points."""

    lr: float = Field(1e-5, gt=0, description="AdamW learning rate (the peak, after `warmup_steps`)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1)")
    grad_clip: float = Field(1.0, gt=0, description=(
        "global gradient-norm clip; an optimizer step whose norm is not finite (NaN/inf gradients) is skipped, "
        "weights and optimizer state untouched, logged and counted (`skipped_steps`, `critic_skipped_steps` in "
        "metrics.jsonl)"))
    max_nonfinite_steps: int = Field(3, ge=1, description=(
        "steps in a row whose loss or gradient is not finite (each skipped and warned of, naming the step) before "
        "the run stops as diverged, exit 2, naming the steps and the `lr`; the engine meanwhile refuses to sample "
        "from non-finite logits (exit 2, naming the weights version)"))
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description=(
        "`constant`, `linear` or `cosine` (decay to 0 at the run's last step), after the warm-up"))
    warmup_steps: int = Field(0, ge=0, description="linear warm-up of the learning rate over this many trainer steps")
    critic_lr: float | None = Field(None, gt=0, description="critic learning rate (null: `lr`)")
    micro_batch_size: int = Field(64, ge=1, description="samples per forward/backward on a trainer")
    max_tokens_per_micro_batch: int | None = Field(None, ge=2, description=(
        "token budget of a **packed** micro-batch: samples (prompt + response) are packed end to end into one row "
        "(first-fit decreasing, at most `micro_batch_size` samples), each with its own position ids, attending "
        "only to itself (varlen attention); no pad compute. null = padded micro-batches of `micro_batch_size` "
        "samples. Same loss and gradients either way; the PPO critic packs the same way"))
    ppo_epochs: int = Field(1, ge=1, description="passes over each step's batch (critic; the actor when it implements it)")
    mini_batches_per_step: int = Field(1, ge=1, description=(
        "optimizer steps per pass: the batch is split into this many mini-batches"))
    activation_checkpointing: bool = Field(False, description=(
        "recompute each decoder layer's activations in backward (less memory, ~1/3 more compute); the policy's "
        "and, in PPO, the critic's"))
    grad_sync: Literal["auto", "step", "micro_batch"] = Field("auto", description=(
        "when the policy's gradients are reduce-scattered over the trainers. `step`: once per optimizer step (least "
        "communication, but every rank holds the full unsharded fp32 gradients, and between micro-batches the "
        "compute-dtype weights: up to 6 bytes x params in bf16). `micro_batch`: after every micro-batch's "
        "backward (overlapped with it; memory stays sharded). `auto`: `step` on one trainer or when it costs at "
        "most 2 GiB more per GPU than sharded training, else `micro_batch` (logged). Same gradients either way"))
    logprob_chunk_tokens: int = Field(1024, ge=1, description=(
        "response tokens per chunk of the LM head; the head runs on response positions only and its fp32 logits "
        "memory is this x vocab x 4 bytes, whatever the batch"))
    peak_flops: float | None = Field(None, gt=0, description=(
        "peak FLOP/s of ONE trainer device, for the `mfu` metric (6 x params x tokens / update time / (trainers x "
        "peak_flops)). null: the GPU's dense data-sheet peak for `dtype`, looked up by its name "
        "(`distflow.device.PEAK_FLOPS`), else a 1e14 placeholder (on CPU, or an unknown GPU: the log says so)"))
    epochs: int = Field(1, ge=1, description="passes over the prompt set")
    max_steps: int | None = Field(None, ge=1, description="stop after this many trainer steps")
    save_every: int = Field(0, ge=0, description=(
        "also save `checkpoint-N/` every N steps (the final `checkpoint/` is always written)"))
    save_interval_s: float = Field(120.0, ge=0, description=(
        "also save `checkpoint-N/` at the first step end this many seconds after the run's start or its last "
        "such save, so that a dead trainer loses little training; but never more often than 20 times the last "
        "save's duration apart (saving takes at most 5% of the run: a big model's saves space themselves "
        "out). Every rank agrees (they save when any of them is due); the previous time-based checkpoint is "
        "removed once the next is written (those of `save_every` are kept). 0: only `save_every` and the "
        "final `checkpoint/`"))
    hang_timeout_s: float = Field(30.0, ge=0, description=(
        "a trainer rank whose position (its `beat` in the mesh: the step's start, each stage of its train half, "
        "the publish, its end; and in the train half the collectives it called in the stage) stays behind "
        "another rank's this long is named as stuck, and a collective every rank entered that has not completed "
        "this long is named as a hung group; the ranks that see it stop (so `distflow run` recovers the "
        "trainers; docs/recovery.md). Raise it where one rank's own work in a stage (a stage without "
        "collectives, a long compute between two of the model's all-gathers) may take longer. 0: off (hangs "
        "are then bounded by `collective_timeout_s`)"))
    keep_checkpoints: int = Field(0, ge=0, description=(
        "keep only the N newest `checkpoint-N/` directories of this run (older ones are removed once a newer one "
        "is complete); 0: keep every `save_every` checkpoint. The final `checkpoint/` is always kept"))
    resume_from: str | None = Field(None, description=(
        "continue from a DistFlow checkpoint directory: weights, sharded optimizer state, and the data position "
        "(the global step; rollout nodes skip to it). Refused, naming the keys, when `seed`, `shuffle`, "
        "`prompts_per_step` or the dataset's row count differ from the checkpoint's; to start over from its "
        "weights use `model_path: DIR` instead. Checked before any node starts"))
    eval_every: int = Field(0, ge=0, description=(
        "evaluate on `eval_dataset` every N trainer steps; 0: only before training and after the last step"))
    eval_before_train: bool = Field(True, description=(
        "evaluate the starting weights (step 0, or the step a resumed run starts at)"))

    @field_validator("adam_betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):  # also refuses NaN (AdamW would, only once the model is loaded)
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v


class AlgorithmSection(Section):
    """The RL algorithm: the workflow DAG and the loss, KL, advantage and off-policy settings.

    Which algorithm each key belongs to, with references: docs/algorithms.md."""

    workflow: list[WorkflowNode] = Field(description=(
        "the RL algorithm as a DAG of nodes `{id, role, type, fn, deps, group, args}` (see the Workflow section "
        "below); the planner decides which worker group runs each node"))
    clip_low: float = Field(0.2, ge=0, description=(
        "PPO/GRPO ratio clip below 1; unset, a `gspo` update takes GSPO's sequence-level range (3e-4)"))
    clip_high: float = Field(0.2, ge=0, description=(
        "ratio clip above 1 (clip-higher when `clip_high > clip_low`); unset, a `gspo` update takes 4e-4"))
    dual_clip: float | None = Field(None, gt=1, description=(
        "PPO dual clip `c > 1`: a token with a negative advantage loses at most `-c x A` however large its ratio "
        "(verl's `clip_ratio_c`, typically 3); for the clipped-surrogate losses only, refused with others; "
        "null = off"))
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description=(
            "per-token losses -> one scalar: `token-mean` (global token mean over ranks and micro-batches), "
            "`seq-mean-token-sum`, `seq-mean-token-mean` (GSPO's, its default when unset), "
            "`seq-mean-token-sum-norm` (Dr. GRPO: divided by sequences x `max_new_tokens`)"))
    kl_coef: float = Field(0.0, ge=0, description=(
        "weight of the KL to the reference model (above 0 it needs a REFERENCE node in the workflow; the "
        "reference model is not loaded at all when it is 0)"))
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field("k3", description=(
        "estimator of the KL loss term (`kl_coef`, `kl_in_reward: false`): `k2`, `k3`, `low_var_kl` (verl's: k3 "
        "clamped to [-10, 10]); as a loss only log pi is differentiated, so k2's gradient is that of KL(pi || "
        "ref) and k3's that of KL(ref || pi), GRPO's usual; `k1` (gradient zero in expectation) is refused"))
    kl_in_reward: bool = Field(False, description=(
        "`kl_coef` x KL is subtracted from the per-token reward (a token-level estimator node on the trainer) "
        "instead of added to the loss; refused with a workflow that has none, or whose REFERENCE node runs after "
        "it. The penalty's policy logprobs are the old ones (the engine's unless `recompute_old_logprobs`)"))
    kl_reward_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field("k1", description=(
        "the KL estimator of the per-token penalty with `kl_in_reward`: `k1` (`log pi - log ref`: through the "
        "reward its score-function gradient is the KL's; verl's and OpenRLHF's default), `k2`, `k3`, `low_var_kl`"))
    kl_clamp: float | None = Field(10.0, gt=0, description=(
        "bound of the `k3` estimator, as a loss term and as a reward penalty: where k3 would exceed it because the "
        "policy finds a token far less likely than the reference (`d = log ref - log pi` past the knee `d_c` where "
        "`e^d - d - 1 = kl_clamp`, 2.61 at 10), k3 continues along its tangent, so one token's gradient is at most "
        "`kl_clamp + d_c` (12.61) instead of `e^d - 1` (4.9e8 at d = 20); the token is still pulled back, unlike "
        "`low_var_kl`'s clamp. `null` = the exact k3 (tangent only past d = 20). Refused where set while neither "
        "`kl_estimator` nor `kl_reward_estimator` is `k3`"))
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus: the loss subtracts this x the token entropy")
    overlong: Literal["none", "mask", "penalty"] = Field("none", description=(
        "truncated responses (`finish_reason: length`): `mask` = advantage 0 (no policy gradient), `penalty` = "
        "DAPO's soft overlong punishment added to the reward an advantage is computed from"))
    overlong_buffer: int = Field(0, ge=0, description=(
        "with `overlong: penalty`: the penalty ramps from 0 to -1 over the last `overlong_buffer` tokens before "
        "`max_new_tokens` (must be in `1..max_new_tokens`)"))
    recompute_old_logprobs: bool = Field(False, description=(
        "the trainer recomputes the old (proximal) logprobs before the update (in the same pass as the reference "
        "logprobs) instead of using the engine's; a `gspo` update turns it on unless set (its clip range is "
        "smaller than the usual engine/trainer logprob difference in bf16)"))
    tis_cap: float | None = Field(None, gt=0, description=(
        "truncated importance sampling: per-token weight `min(exp(old - behaviour), tis_cap)` on the policy "
        "gradient; needs `recompute_old_logprobs: true` (without it every weight is 1); null = off"))
    gamma: float = Field(1.0, ge=0, le=1, description=(
        "discount of GAE's and `reinforce_pp_token`'s returns (a node's `args.gamma` overrides it)"))
    lam: float = Field(0.95, ge=0, le=1, description="GAE's lambda (a `gae` node's `args.lam` overrides it)")
    value_clip: float | None = Field(0.2, gt=0, description=(
        "critic value clipping range around the old values; null = unclipped"))

    @field_validator("workflow", mode="before")
    @classmethod
    def _workflow_list(cls, v: Any) -> Any:
        if not isinstance(v, list) or not v:
            raise ValueError("workflow must be a non-empty list of nodes")
        try:
            return load_workflow(v)
        except WorkflowError as e:
            raise ValueError(str(e)) from None


class TransportSection(Section):
    """The data plane: how samples and weights move between nodes, and how long a step may wait for them."""

    channel: Literal["zmq", "shm", "auto"] = Field("auto", description=(
        "data-plane transport: `auto` (shared memory to peers on the same host, ZeroMQ frames to others, NCCL for "
        "CUDA tensors), `zmq`, `shm`"))
    posting: bool = Field(True, description=(
        "with shared memory, a rollout node *posts* each step's parts to the trainers on its host: one copy of "
        "the step's batch into a buffer those trainers map, and a signed record in each trainer's mailbox, with "
        "no message, ack or wake-up per part. `false`: a message per part, as to other hosts"))
    route_by: Literal["owner", "tokens"] = Field("owner", description=(
        "how a step's samples are split among trainer ranks: `owner` (`hash(sample_id) mod T`) or `tokens` "
        "(balanced by token count, for long, uneven responses; a step re-sent after a partial delivery may be "
        "split differently, so prefer `owner` where rollout nodes may fail)"))
    weight_transport: Literal["auto", "channel", "cuda_ipc", "nccl"] = Field("auto", description=(
        "how weights reach rollout nodes: `auto` (`cuda_ipc` when the trainer and the rollout node share a GPU, "
        "`nccl` between different GPUs when the data channel carries NCCL, `channel` otherwise), `channel` (the "
        "data channel, pinned host staging for CUDA weights), `cuda_ipc` (one GPU only), `nccl` (GPU buckets "
        "over the NCCL channel). With `cuda_ipc` or `nccl` a trainer rank serving rollout nodes keeps the newest "
        "version's buckets on its GPU (one copy of the model in the compute dtype)"))
    weight_sync: Literal["full", "delta"] = Field("full", description=(
        "`full` = every version in full; `delta` = only tensors whose bytes changed since the version the peer "
        "holds (a full version when the peer has none, rejoined, refused a delta or is more than 8 versions "
        "behind); the rollout engine must accept a partial set of tensors"))
    weight_bucket_mb: int = Field(64, ge=1, le=4096, description=(
        "weight-sync bucket size in MiB: the trainer gathers, sends and the rollout applies one bucket at a time"))
    step_timeout_s: float = Field(600.0, gt=0, description=(
        "longest wait for one step's samples or weights; the trainer ranks' collectives may wait 30 min more, or "
        "as long as the fp32 checkpoint takes to write at 50 MB/s if that is longer (`collective_timeout_s`)"))
    collective_timeout_s: float | None = Field(None, gt=0, description=(
        "the trainer ranks' process-group timeout (gloo / NCCL), for every collective and the background "
        "checkpoint writes: a rank that waits longer fails, and `distflow run` recovers the trainers "
        "(`recover_retries`). null: `step_timeout_s` plus 30 min, or plus the time the fp32 checkpoint takes to "
        "write at 50 MB/s if that is longer (not torch's own default)"))


class MeshSection(Section):
    """The control plane: addresses nodes bind to and advertise, and the failure detector's timings."""

    bind_host: str = Field("127.0.0.1", description=(
        "address nodes bind to; loopback unless told otherwise. `0.0.0.0` (or `::`) needs `advertise_host`"))
    advertise_host: str | None = Field(None, description=(
        "the address peers use to reach a node bound to `0.0.0.0` (`distflow-node --advertise-host`)"))
    rendezvous_port: int = Field(0, ge=0, le=65535, description=(
        "trainer rank 0's torch.distributed rendezvous port; 0 = any free port (pin it for firewalls)"))
    protocol_period_s: float = Field(0.2, gt=0, description="gossip/probe period")
    suspicion_timeout_s: float = Field(1.5, gt=0, description="suspect -> dead after this long without refutation")
    request_timeout_s: float = Field(10.0, gt=0, description="deadline of a control request")
    join_timeout_s: float = Field(60.0, gt=0, description=(
        "how long a node waits for its seeds and for the groups to be complete"))
    max_frame_bytes: int = Field(1 << 20, ge=4096, description="larger control frames are dropped and counted")
    metrics_port: int | None = Field(None, ge=0, le=65535, description=(
        "serve Prometheus `/metrics` of every node on this port (0: any free port, logged; null: off); one node "
        "per host with a fixed port"))
    metrics_host: str = Field("127.0.0.1", min_length=1, description=(
        "address of the `/metrics` endpoint (loopback unless opened on purpose)"))


class LaunchSection(Section):
    """What runs where: the run's name, seed and output, node counts, devices, and supervision."""

    name: str = Field("distflow", description="run name")
    seed: int = Field(0, ge=0, description="seeds data order, sampling and initialisation")
    output_dir: str = Field("outputs/run", min_length=1, description=(
        "`metrics.jsonl`, `eval.jsonl`, `reward_curve.png`, `checkpoint/`, `logs/`, `trace/`, and the resolved "
        "`config.yaml` the nodes of `distflow run` read"))
    rollout_nodes: int = Field(1, ge=1, description="rollout processes (rollout data-parallel size)")
    trainer_nodes: int = Field(1, ge=1, description="trainer processes (the FSDP2 group)")
    trainer_replicas: int = Field(1, ge=1, description=(
        "trainer replica groups that keep training when one dies (torchft; docs/recovery.md): the `trainer_nodes` "
        "ranks split into this many groups of consecutive ranks, each its own torch.distributed group, kept in step "
        "by a quorum; a dead group is restarted alone and copies the live state from a peer. Each group receives "
        "every step (R times the trainer-bound bytes). Must divide trainer_nodes (each group an FSDP2 group of "
        "trainer_nodes / R ranks); needs `mini_batches_per_step` and `ppo_epochs` 1, no critic, "
        "`tensor_parallel` 1 and `controller: distributed` without `worker_groups`. 1: one group (off)"))
    tensor_parallel: int = Field(1, ge=1, description=(
        "tensor-parallel degree of the trainer: the `trainer_nodes` ranks form a 2-D mesh (trainer_nodes / N "
        "FSDP2 data-parallel shards x N tensor-parallel ranks, consecutive ranks in a TP group); each decoder "
        "layer's q/k/v/gate/up projections are split by columns and o/down by rows over the N ranks "
        "(Llama/Qwen layouts; N must divide trainer_nodes, the attention and KV heads and the MLP width). "
        "Same loss, gradients and published weights as 1 (docs/parallelism.md). Not with `lora`"))
    sequence_parallel: int = Field(1, ge=1, description=(
        "sequence-parallel degree of the trainer (Ulysses): the `trainer_nodes` ranks form a mesh "
        "(data-parallel shards x N consecutive ranks, x `tensor_parallel` innermost when both are set); an SP "
        "group trains one share of the samples, each rank holding 1/N of every packed micro-batch row (padded "
        "to a multiple of N), with all-to-alls over the attention heads around the attention; FSDP2 shards "
        "over the data-parallel x SP ranks. Micro-batches are always packed (`max_tokens_per_micro_batch` "
        "bounds the whole row, before the split). N x tensor_parallel must divide trainer_nodes and the "
        "attention heads; N must divide the KV heads per TP rank or be a multiple of them; not for "
        "vision-language models. Same loss, gradients and weights as 1 (docs/parallelism.md)"))
    rollout_tensor_parallel: int = Field(1, ge=1, description=(
        "tensor-parallel degree of each rollout node's built-in engine: the node's process is rank 0 and spawns "
        "N-1 follower processes that run the same forward in lockstep (gloo on CPU; with `device: cuda` the node "
        "owns N distinct GPUs, one per rank, NCCL), each holding 1/N of the attention heads, KV heads (and KV "
        "cache) and MLP width (Llama/Qwen layouts; N must divide them, checked when the model loads); weight "
        "syncs send each follower only its shard (docs/parallelism.md). `engine: torch` only, not with `lora`; "
        "CUDA graphs are off"))
    worker_groups: dict[str, int] = Field(default_factory=dict, description=(
        "extra worker groups between rollout and trainer: group name -> node count, e.g. `{reward: 1}`. A "
        "workflow node with `group: NAME` runs on that group's nodes; rollout shard s goes to the group's rank "
        "`s % count`. Names must not be `rollout`, `trainer` or `controller`; each group must run at least one "
        "workflow node; not with `controller: single`. `distflow run` starts nodes `<name>-<i>` "
        "(`distflow-node --role worker --group NAME`)"))
    controller: Literal["distributed", "single"] = Field("distributed", description=(
        "`distributed` (no driver) or `single`: every batch routed through one controller process, the "
        "hybrid-controller baseline kept to measure against"))
    device: Literal["cpu", "cuda"] = Field("cpu", description="`cpu` (gloo) or `cuda` (NCCL)")
    gpus: int | list[int] | None = Field(None, description=(
        "with `device: cuda`, the GPUs `distflow run` may use: null = every visible GPU, `N` = the first N, "
        "`[i, j, ...]` = these ids (relative to the launcher's own `CUDA_VISIBLE_DEVICES`). One distinct GPU per "
        "trainer rank, always; rollout nodes take the rest round-robin. A config error with `device: cpu`"))
    colocate: bool = Field(False, description=(
        "with `device: cuda`: rollout nodes share the trainers' GPUs (round-robin) instead of taking GPUs of "
        "their own"))
    torch_threads: int = Field(1, ge=1, description="intra-op threads per node process")
    fork_nodes: bool = Field(True, description=(
        "`distflow run` starts its nodes by forking one process that has imported torch and transformers once "
        "(saves each node ~2 s of CPU at start; `distflow.launch.zygote`); false, or where that process cannot "
        "be used (said once), each node is its own `distflow-node` program"))
    restarts: int = Field(3, ge=0, description=(
        "`distflow run` restarts a dead rollout node (same id and ports) up to this many times while the others "
        "cover its shard; a dead trainer rank is recovered from a checkpoint (`recover_retries`), a dead "
        "controller stops the run, and so does a node that exits 2 (a "
        "configuration or data error), which is never restarted"))
    recover_retries: int = Field(3, ge=0, description=(
        "`distflow run`: when a trainer rank dies, restart every trainer rank from the newest complete "
        "checkpoint of this run (else `resume_from`) up to this many times, while the rollout nodes keep running, "
        "take the checkpoint's weights and regenerate the steps after it (docs/recovery.md). 0, after the last "
        "retry, with no checkpoint to go back to, or with `controller: single` / `worker_groups`: the run stops, "
        "naming the checkpoint to `resume_from`"))
    trace_samples: bool = Field(False, description="each node writes which sample ids it handled to `output_dir/trace/`")
    # trackers (distflow/trackers; docs/trackers.md): where the run's metrics go besides metrics.jsonl
    trackers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(["jsonl"], description=(
        "where trainer rank 0 logs every step's metrics, evaluation rows and sample tables; `jsonl` "
        "(metrics.jsonl, eval.jsonl, samples.jsonl) is always on"))
    tracker_project: str = Field("distflow", min_length=1, description="W&B project / MLflow experiment name")
    tracker_run_name: str | None = Field(None, min_length=1, description="the run's name in the trackers "
                                                                         "(default: `name`)")
    tracker_uri: str | None = Field(None, min_length=1, description=(
        "MLflow tracking URI (default: `$MLFLOW_TRACKING_URI`, else SQLite at `output_dir/mlflow.db`)"))
    wandb_mode: Literal["offline", "online", "shared"] = Field("offline", description=(
        "`offline`: files under `output_dir/wandb` (`wandb sync` uploads them); `online`; `shared`: W&B's "
        "multi-writer mode, every node writes the same run id"))
    sample_table_k: int = Field(4, ge=0, description=(
        "the sample table of a logged step holds the top-k and bottom-k of trainer rank 0's samples by reward "
        "(0: no table)"))
    sample_table_every: int = Field(1, ge=1, description="log a sample table every N trainer steps")

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


# section name -> model, in the order the docs and `distflow config --show` present them
SECTIONS: dict[str, type[Section]] = {
    "model": ModelSection, "data": DataSection, "algorithm": AlgorithmSection, "rollout": RolloutSection,
    "env": EnvSection, "trainer": TrainerSection, "transport": TransportSection, "mesh": MeshSection,
    "launch": LaunchSection,
}
REQUIRED_SECTIONS = ("model", "data", "algorithm")  # they hold a key without a default

# flat key -> its section: generated from the sections (a key name is unique across them)
FLAT_KEYS: dict[str, str] = {key: name for name, model in SECTIONS.items() for key in model.model_fields}
assert len(FLAT_KEYS) == sum(len(m.model_fields) for m in SECTIONS.values()), "a key name is in two sections"
assert not set(FLAT_KEYS) & set(SECTIONS), "a key is named like a section"
