"""The rollout group's stage implementations: what each workflow node does on a rollout node.

The planner hands the rollout group a linear pipeline (e.g. generate -> reward ->
advantage). Each workflow node maps by (role, type) to one stage here; the node's ``fn``
picks the concrete function (a reward name, an advantage estimator). Stages take and
return a SampleBatch and never touch the network.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from distflow.buffer.batch import SampleBatch
from distflow.buffer.dataloader import PromptRow
from distflow.core.config import Config
from distflow.core.dag import WorkflowNode
from distflow.hf import chat_prompt_ids
from distflow.rollout.engine import RolloutEngine, SamplingParams
from distflow.rollout.rewards import resolve_reward
from distflow.rl.algorithms import ADVANTAGE_ESTIMATORS, resolve


class StageError(RuntimeError):
    """A stage could not run on a batch; names the workflow node."""


def sampling_params(cfg: Config) -> SamplingParams:
    return SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          top_p=cfg.top_p, top_k=cfg.top_k)


def encode_prompts(tokenizer: Any, rows: list[PromptRow], key: str, chat: bool) -> list[list[int]]:
    out = []
    for r in rows:
        text = r.data[key]
        if not isinstance(text, str):
            raise StageError(f"prompt {r.prompt_id}: key {key!r} is {type(text).__name__}, expected a string")
        out.append(chat_prompt_ids(tokenizer, text) if chat else list(tokenizer(text)["input_ids"]))
    return out


def generate(engine: RolloutEngine, cfg: Config, rows: list[PromptRow], seed: int) -> SampleBatch:
    """Sample ``group_size`` responses for every prompt; tag each with the engine's version."""
    prompts = encode_prompts(engine.tokenizer, rows, cfg.prompt_key, cfg.chat_template)
    g = cfg.group_size
    flat_prompts = [p for p in prompts for _ in range(g)]
    comps = engine.generate(flat_prompts, sampling_params(cfg), seed=seed) if flat_prompts else []
    sample_ids, prompt_ids, extras = [], [], []
    for r in rows:
        for j in range(g):
            sample_ids.append(f"{r.prompt_id}:s{j}")
            prompt_ids.append(r.prompt_id)
            extras.append({"row": r.data})
    return SampleBatch.from_lists(sample_ids, prompt_ids, flat_prompts, [c.tokens for c in comps],
                                  [c.logprobs for c in comps], policy_version=engine.version, extras=extras)


def reward(engine: RolloutEngine, node: WorkflowNode, batch: SampleBatch) -> SampleBatch:
    """Score every sample with the node's reward function: fn(response_text, row) -> [0, 1]."""
    fn: Callable[[str, dict], float] = resolve_reward(node.fn)
    texts = [engine.tokenizer.decode(t.tolist(), skip_special_tokens=True) for t in batch.ragged("response_tokens")]
    values = []
    for sid, text, extra in zip(batch.sample_ids, texts, batch.extras):
        try:
            values.append(float(fn(text, extra["row"], **node.args)))
        except Exception as e:  # a bad row must name itself, not kill the node silently
            raise StageError(f"workflow node {node.id!r}: reward {node.fn!r} failed on sample {sid}: {e}") from e
    batch.set_scalar("reward", torch.tensor(values, dtype=torch.float32))
    return batch


def advantage(node: WorkflowNode, batch: SampleBatch) -> SampleBatch:
    """Per-group advantages; the whole group of a prompt is on this node by construction."""
    fn = resolve(ADVANTAGE_ESTIMATORS, node.fn, f"workflow node {node.id!r} advantage estimator")
    index = {p: i for i, p in enumerate(dict.fromkeys(batch.prompt_ids))}
    group_ids = torch.tensor([index[p] for p in batch.prompt_ids], dtype=torch.int64)
    batch.set_scalar("advantage", fn(batch.tensors["reward"], group_ids, **node.args).float())
    return batch


def run_pipeline(pipeline: list[WorkflowNode], engine: RolloutEngine, cfg: Config, rows: list[PromptRow],
                 seed: int) -> SampleBatch:
    """Run this group's linear pipeline on one step's prompts (blocking; call in a thread)."""
    batch: SampleBatch | None = None
    for node in pipeline:
        kind = (node.role.value, node.type.value)
        if kind == ("ACTOR", "MODEL_INFERENCE"):
            batch = generate(engine, cfg, rows, seed)
        elif batch is None:
            raise StageError(f"workflow node {node.id!r} runs before any generate node on the rollout group")
        elif kind == ("REWARD", "COMPUTE"):
            batch = reward(engine, node, batch)
        elif node.type.value == "COMPUTE":
            batch = advantage(node, batch)
        else:
            raise StageError(f"workflow node {node.id!r}: {kind} cannot run on a rollout node")
    assert batch is not None
    return batch
