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
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from distflow.core.dag import Plan, WorkflowError, WorkflowNode, load_workflow, plan


class ConfigError(ValueError):
    """A configuration problem; the message names the key."""


class MeshSettings(BaseModel):
    """Failure-detector and deadline settings of the control plane (see docs/configuration.md)."""

    model_config = ConfigDict(extra="forbid")
    protocol_period_s: float = Field(0.2, gt=0)
    suspicion_timeout_s: float = Field(1.5, gt=0)
    request_timeout_s: float = Field(10.0, gt=0)
    join_timeout_s: float = Field(60.0, gt=0)
    max_frame_bytes: int = Field(1 << 20, ge=4096)


class Config(BaseModel):
    """A DistFlow run. See docs/configuration.md for every key."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    name: str = "distflow"
    seed: int = 0
    output_dir: str = "outputs/run"

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
    mesh: MeshSettings = Field(default_factory=MeshSettings)
    route_by: Literal["owner", "tokens"] = Field(
        "owner", description="owner = hash(sample_id) mod trainers; tokens = balance each step's tokens across trainers")
    channel: Literal["zmq", "shm", "auto"] = Field(
        "auto", description="data-plane transport; auto = shm to peers on this host, zmq to others")

    # -- model -----------------------------------------------------------------
    model_path: str
    toy_model: bool = Field(False, description="build the tiny toy model at model_path if it is missing")
    engine: Literal["torch", "vllm"] = "torch"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    torch_threads: int = Field(1, ge=1, description="intra-op threads per node process")

    # -- data ------------------------------------------------------------------
    dataset: str
    prompt_key: str = "prompt"
    chat_template: bool = Field(False, description="wrap each prompt in the tokenizer's chat template")
    shuffle: bool = True
    bad_rows: Literal["error", "skip"] = "error"
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="stop after this many trainer steps")

    # -- the batch unit ------------------------------------------------------------
    prompts_per_step: int = Field(..., ge=1, description="prompts per trainer step, over all rollout nodes")
    group_size: int = Field(8, ge=1, description="samples per prompt (GRPO group)")
    micro_batch_size: int = Field(64, ge=1, description="samples per forward/backward on a trainer")

    # -- sampling ---------------------------------------------------------------
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)

    # -- optimisation -------------------------------------------------------------
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)
    kl_coef: float = Field(0.0, ge=0)
    max_staleness: int = Field(1, ge=0, description="0 = strictly on-policy")
    save_every: int = Field(0, ge=0, description="save a checkpoint every N steps (0 = only at the end)")
    resume_from: str | None = Field(None, description="continue a run from a DistFlow checkpoint directory")
    trace_samples: bool = Field(False, description="write per-node sample accounting to output_dir/trace/")

    # -- deadlines ------------------------------------------------------------------
    step_timeout_s: float = Field(600.0, gt=0, description="longest wait for one step's data or weights")

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
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError("dtype float16 is not supported on device cpu; use float32 or bfloat16")
        try:
            self.plan()
        except WorkflowError as e:
            raise ValueError(str(e)) from None
        return self

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
        return {"rollout": self.rollout_nodes, "trainer": self.trainer_nodes}

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
def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (YAML-typed values) to a raw config mapping."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, _, text = item.partition("=")
        try:
            value = yaml.safe_load(text) if text else ""
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
        lines.append(f"  {loc}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read, override and validate a config file. Raises ConfigError naming the key."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text())
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
