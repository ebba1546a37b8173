"""The one typed configuration schema of a DistFlow run.

Every process (launcher, rollout node, trainer node) validates the same YAML file with
this schema before it starts anything, so a bad key fails everywhere at once with an
error that names it (``trainer.lr: ...``). The schema is in sections, one per concern
(:mod:`distflow.core.config_sections`: model, data, algorithm, rollout, trainer, transport,
mesh, launch), which are the source of truth (``cfg.trainer.lr``); a key may be written flat
(``lr: 1e-4``, as every config before the sections), sectioned (``trainer: {lr: 1e-4}``) or
dotted on the command line (``trainer.lr=1e-4``), and ``cfg.lr`` still reads it (a read-only
delegation to its section, generated from the sections). There is one batch unit
(``prompts_per_step``) and everything else is derived from it (``samples_per_step``,
``rollout_batch``, ``buffer_capacity``, ...), so two numbers can never disagree.

``key=value`` overrides (``distflow run CONFIG lr=1e-4 workflow.1.fn=gsm8k``) are
applied to the raw mapping before validation, with YAML typing of the value. Relative paths
are resolved by one rule (:mod:`distflow.core.config_paths`): in a file, against the file's
directory; on the command line, against the working directory.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from distflow.core.config_keys import ConfigError, canonical, field_of, suggest, to_sections
from distflow.core.config_paths import PATH_KEYS, absolute, absolute_paths, resolve_raw
from distflow.core.config_sections import (FLAT_KEYS, RESERVED_GROUPS, SECTIONS, AlgorithmSection,  # noqa: F401
                                           DataSection, EnvSection, LaunchSection, MeshSection, ModelSection,
                                           RolloutSection, TrainerSection, TransportSection)
from distflow.core.dag import Plan, WorkflowError, WorkflowNode, plan
from distflow.rl.loss_keys import check_ignored_keys  # torch-free
from distflow.rl.names import (GROUP_ESTIMATORS, LOSS_AGG_DEFAULTS, LOSS_CLIP_DEFAULTS,  # torch-free, from the catalog
                               LOSS_RECOMPUTE_DEFAULTS, TOKEN_ESTIMATOR_NAMES)
from distflow.rl.node_args import check_node_args  # torch-free

MeshSettings = MeshSection  # its name before the sections


def replica_layout(trainer_nodes: int, replicas: int) -> list[list[int]]:
    """The trainer ranks of each replica group: ``replicas`` groups of ``trainer_nodes / replicas``
    consecutive ranks (each an FSDP group of its own). ValueError when they do not divide."""
    if replicas < 1 or trainer_nodes % replicas:
        raise ValueError(f"trainer_replicas: {replicas} must divide trainer_nodes: {trainer_nodes} "
                         f"(each replica group is an FSDP group of trainer_nodes / trainer_replicas ranks)")
    size = trainer_nodes // replicas
    return [list(range(r * size, (r + 1) * size)) for r in range(replicas)]


class Config(BaseModel):
    """A DistFlow run: one section per concern. See docs/configuration.md for every key."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)  # .inf crashed at start

    model: ModelSection = Field(description=ModelSection.__doc__)
    data: DataSection = Field(description=DataSection.__doc__)
    algorithm: AlgorithmSection = Field(description=AlgorithmSection.__doc__)
    rollout: RolloutSection = Field(default_factory=RolloutSection, description=RolloutSection.__doc__)
    env: EnvSection = Field(default_factory=EnvSection, description=EnvSection.__doc__)
    trainer: TrainerSection = Field(default_factory=TrainerSection, description=TrainerSection.__doc__)
    transport: TransportSection = Field(default_factory=TransportSection, description=TransportSection.__doc__)
    mesh: MeshSection = Field(default_factory=MeshSection, description=MeshSection.__doc__)
    launch: LaunchSection = Field(default_factory=LaunchSection, description=LaunchSection.__doc__)
    _path_origins: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, data: Any) -> Any:
        """Flat keys (every config before the sections) into their sections."""
        return to_sections(data) if isinstance(data, Mapping) else data

    @model_validator(mode="after")
    def _paths(self) -> "Config":
        absolute_paths(self)  # what no file resolved: against the working directory
        return self

    @model_validator(mode="after")
    def _algorithm(self) -> "Config":
        for n in self.workflow:  # what each stage reads of its node's args (a dotted fn: preflight)
            check_node_args(n, FLAT_KEYS)
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
                if "clip_low" not in self.algorithm.model_fields_set:
                    self.algorithm.clip_low = low
                if "clip_high" not in self.algorithm.model_fields_set:
                    self.algorithm.clip_high = high
            if n.fn in LOSS_AGG_DEFAULTS and "loss_agg" not in self.algorithm.model_fields_set:
                self.algorithm.loss_agg = LOSS_AGG_DEFAULTS[n.fn]
            if n.fn in LOSS_RECOMPUTE_DEFAULTS and "recompute_old_logprobs" not in self.algorithm.model_fields_set:
                self.algorithm.recompute_old_logprobs = True
        if self.kl_coef > 0 and not any(n.role.value == "REFERENCE" for n in self.workflow):
            raise ValueError(f"kl_coef: {self.kl_coef} penalises the KL to the reference model, but the workflow has "
                             "no REFERENCE MODEL_INFERENCE node, so no KL would be applied. Add one (fn: ref_logprob, "
                             "deps: [generate], a dep of the update) or set kl_coef: 0")
        if self.tis_cap is not None and not self.recompute_old_logprobs:
            raise ValueError("tis_cap: truncated importance sampling weighs the proximal policy (the trainer's "
                             "recomputed old logprobs) against the engine's; without recompute_old_logprobs: true "
                             "both are the engine's, every weight is 1 and tis_cap does nothing. Set "
                             "recompute_old_logprobs: true, or remove tis_cap")
        episodes = [n.id for n in self.workflow if (n.role.value, n.type.value, n.fn) ==
                    ("ACTOR", "MODEL_INFERENCE", "episodes")]
        if self.agent and (self.environment or self.tools):
            raise ValueError(f"agent: {self.agent!r} drives its episodes itself through the chat endpoint; remove "
                             f"{'environment' if self.environment else 'tools'} (an agent calls its tools itself), "
                             "or remove agent")
        if episodes and not (self.environment or self.tools or self.agent):
            raise ValueError(f"workflow node {episodes[0]!r}: fn: episodes runs multi-turn episodes, which need "
                             "environment: module:Class, tools: [module:function, ...] or agent: module:function "
                             "(docs/agents.md)")
        if (self.environment or self.tools or self.agent) and not episodes:
            key = "environment" if self.environment else "tools" if self.tools else "agent"
            raise ValueError(f"{key}: set, but no generate node runs "
                             "episodes: give the ACTOR MODEL_INFERENCE node fn: episodes (fn: generate is single-turn)")
        if episodes and self.eval_dataset:
            raise ValueError("eval_dataset: evaluation generates single-turn responses, not episodes; a run with "
                             "fn: episodes cannot evaluate on it yet (remove eval_dataset)")
        if self.environment and self.tools:
            raise ValueError("environment and tools: give either an environment (with its own tools) or tools (the "
                             "built-in tool environment), not both")
        if self.overlong == "penalty" and not 0 < self.overlong_buffer <= self.max_new_tokens:
            raise ValueError(f"overlong_buffer: overlong: penalty needs 0 < overlong_buffer <= max_new_tokens "
                             f"({self.max_new_tokens}), got {self.overlong_buffer}")
        return self



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
        if self.trainer_nodes % self.tensor_parallel:
            raise ValueError(f"tensor_parallel ({self.tensor_parallel}) must divide trainer_nodes "
                             f"({self.trainer_nodes}): the trainers form (trainer_nodes / tensor_parallel) "
                             "data-parallel shards of tensor_parallel ranks each")
        if self.trainer_nodes % (self.sequence_parallel * self.tensor_parallel):
            raise ValueError(f"sequence_parallel ({self.sequence_parallel}) x tensor_parallel "
                             f"({self.tensor_parallel}) must divide trainer_nodes ({self.trainer_nodes}): the "
                             "trainers form data-parallel shards of sequence_parallel x tensor_parallel ranks each")
        self._check_replicas()
        if self.tensor_parallel > 1 and self.lora is not None:
            raise ValueError("tensor_parallel: LoRA adapters wrap the projections the tensor-parallel plan splits; "
                             "use tensor_parallel: 1 with lora (or lora: null)")
        if self.rollout_tensor_parallel > 1 and (self.engine != "torch" or self.lora is not None):
            raise ValueError(f"rollout_tensor_parallel ({self.rollout_tensor_parallel}): the built-in engine's "
                             "tensor parallelism needs engine: torch and lora: null (vLLM's own tensor_parallel_size "
                             "is not wired; LoRA adapters wrap the projections it splits)")
        if self.device == "cpu" and self.gpus is not None:  # here, not only in placement: --check sees it too
            raise ValueError(f"gpus: {self.gpus!r} is set, but device is cpu; set device: cuda or gpus: null")
        if self.colocate and self.engine_trainer_memory_fraction >= (self.engine_gpu_memory_utilization or 0.9):
            raise ValueError(f"engine_trainer_memory_fraction {self.engine_trainer_memory_fraction:g} (the colocated "
                             "trainer's share of the GPU) must be below engine_gpu_memory_utilization "
                             f"{self.engine_gpu_memory_utilization or 0.9:g}, which the engine's share comes out of")
        if self.device == "cpu" and self.engine == "vllm":
            raise ValueError("engine: vllm runs on GPUs only, but device is cpu; use engine: torch (or device: cuda)")
        if self.lora is not None and self.engine != "torch":
            raise ValueError(f"lora: the {self.engine} engine cannot apply LoRA adapters a weight sync sends; use "
                             "engine: torch (or lora: null)")
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

    def _check_replicas(self) -> None:
        """``trainer_replicas``: what the replica groups (distflow.trainer.replicas) can keep in step."""
        r = self.trainer_replicas
        if r == 1:
            return
        replica_layout(self.trainer_nodes, r)  # (a ValueError naming both keys when r does not divide)
        why = {"tensor_parallel": self.tensor_parallel > 1, "sequence_parallel": self.sequence_parallel > 1,
               "mini_batches_per_step": self.mini_batches_per_step != 1,
               "ppo_epochs": self.ppo_epochs != 1, "controller": self.controller != "distributed",
               "worker_groups": bool(self.worker_groups),
               "workflow": any(n.role.value == "CRITIC" for n in self.workflow)}
        bad = [k for k, v in why.items() if v]
        if bad:
            raise ValueError(f"trainer_replicas: {r} cannot be combined with {bad[0]} (replica groups commit one "
                             "optimizer step a step of the actor alone, fed straight by the rollout nodes: "
                             "mini_batches_per_step and ppo_epochs 1, tensor_parallel and sequence_parallel 1, no "
                             "critic node in the "
                             "workflow, controller: distributed without worker_groups)")

    def _check_eval(self, p: Any) -> None:
        """The evaluation keys: set only with eval_dataset, whose scores need every REWARD node on
        the rollout group (evaluation runs there: generate, then the rewards; nothing is sent on)."""
        if self.eval_dataset is None:
            for key in ("eval_every", "eval_samples_per_prompt", "eval_temperature"):
                if getattr(self, key) != field_of(key)[2].default:  # (a dumped config sets them all)
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

    def __eq__(self, other: object) -> bool:
        """Equal settings, wherever the paths were written (:attr:`path_origins` is not compared):
        a config and its dump, read back elsewhere, are the same run."""
        return isinstance(other, Config) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # mutable, as pydantic models are

    @property
    def path_origins(self) -> dict[str, str]:
        """``{key: value as written}`` of the paths the config file wrote relative to its directory."""
        return dict(self._path_origins)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> "Config":
        """A copy with ``update`` applied; its keys may be flat (``{"temperature": 0.0}``) or whole
        sections. Every section is copied too, so changing the copy's never changes this config's."""
        sections: dict[str, Any] = {}
        for key, value in (update or {}).items():
            if key in FLAT_KEYS:
                sections.setdefault(FLAT_KEYS[key], {})[key] = value
            elif key in SECTIONS:
                sections[key] = value
            else:
                raise ConfigError(f"{key}: unknown key{suggest(key)}")
        new = {name: value if isinstance(value, BaseModel) else getattr(self, name).model_copy(update=value, deep=deep)
               for name, value in sections.items()}
        rest = {name: getattr(self, name).model_copy(deep=deep) for name in SECTIONS if name not in new}
        return super().model_copy(update={**rest, **new}, deep=deep)


def _delegate(section: str, key: str) -> property:
    """``cfg.<key>``: a read-only view of ``cfg.<section>.<key>``, so the modules that read flat
    keys need not change while the sections are the source of truth."""
    def get(self: Config) -> Any:
        return getattr(getattr(self, section), key)

    def set_(self: Config, value: Any) -> None:
        raise AttributeError(f"Config.{key} is read-only: set cfg.{section}.{key}")

    return property(get, set_, doc=f"``{section}.{key}`` (read-only)")


assert not any(hasattr(BaseModel, key) for key in FLAT_KEYS), "a key would shadow a pydantic method"
for _key, _section in FLAT_KEYS.items():
    setattr(Config, _key, _delegate(_section, _key))


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


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (YAML-typed values) to a raw config mapping; returns it
    in sections (:func:`~distflow.core.config_keys.to_sections`). A key may be flat (``lr``,
    ``workflow.1.fn``), dotted (``trainer.lr``) or a whole section (``mesh={...}``)."""
    raw = to_sections(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, _, text = item.partition("=")
        try:
            value = load_yaml(text) if text else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key}: cannot parse value {text!r}: {e}") from None
        parts, added = canonical(key)
        target: Any = raw
        for i, part in enumerate(parts[:-1]):
            where = ".".join(parts[added: i + 1]) or part
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
        if e["type"] == "extra_forbidden" and len(e["loc"]) <= 2:  # a misspelt top-level or section key
            section = str(e["loc"][0]) if len(e["loc"]) == 2 else None
            msg = f"unknown key{suggest(str(e['loc'][-1]), section)}"
        lines.append(f"  {loc}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


def _read(path: str | Path) -> tuple[dict[str, Any], dict[str, str], str]:
    """(:func:`read_raw`'s mapping, ``{key: path as written}`` of what it resolved, the file's directory)."""
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
    base = os.path.abspath(p.parent)
    return raw, resolve_raw(raw, base), base


def read_raw(path: str | Path) -> dict[str, Any]:
    """A config file's mapping as written (flat, sectioned or both), its relative paths made
    absolute against the file's directory: what :func:`load_config` validates, and a mapping a
    script may change and write anywhere (or validate with :func:`config_from_dict`) and still
    mean the same files. Raises ConfigError naming the file (and the line of a key given twice)."""
    return _read(path)[0]


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read, override and validate a config file. Raises ConfigError naming the key.

    Relative paths in the file are relative to its directory, those of ``overrides`` to the
    working directory (:mod:`distflow.core.config_paths`)."""
    raw, written, base = _read(path)
    try:
        raw = apply_overrides(raw, overrides)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    cfg = config_from_dict(raw, source=str(path))
    now = {**{k: getattr(cfg, k) for k in PATH_KEYS},
           **{f"workflow node {n.id!r}: args.path": n.args.get("path") for n in cfg.workflow}}
    cfg._path_origins = {k: v for k, v in written.items() if now.get(k) == absolute(v, base)}  # not overridden
    return cfg


def config_from_dict(raw: Mapping[str, Any], source: str = "config") -> Config:
    """Validate a config mapping (flat, sectioned or both); relative paths are relative to the working directory."""
    try:
        return Config.model_validate(raw)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except ValidationError as e:
        raise ConfigError(f"{source}: {_format_errors(e)}") from None
