"""Checks before a run: what `distflow run` (and ``distflow-node --check``, for its role) can
refuse before any node starts, each as one :class:`ConfigError` naming the key (exit 2), instead
of a node failing after start-up (and being restarted, failing the same way):

- the workflow's functions (rewards, estimators, losses) resolve, and a dotted one takes its
  node's ``args`` (the config checks the built-ins': :mod:`distflow.rl.node_args`):
  :func:`check_functions`;
- the prompt set opens as a rollout node opens it, and the rows the run reads first are usable
  (JSON objects with ``prompt_key`` and what the rewards read): :func:`check_dataset`;
- ``model_path`` is a Hugging Face model and tokenizer directory: :func:`distflow.model_dir.model_dir_problem`;
- ``resume_from`` is a checkpoint this config can continue: :func:`check_resume`.

Torch-free (the launcher's start-up).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from distflow.core.config import Config, ConfigError
from distflow.core.config_paths import check_input_paths
from distflow.core.dag import WorkflowNode
from distflow.model_dir import model_dir_problem

CHECK_ROWS = 100_000  # rows of the prompt set checked before a run (those its steps read first)


def check_functions(cfg: Config, nodes: Sequence[WorkflowNode] | None = None) -> None:
    """Resolve the workflow functions (rewards, estimators, losses) of ``nodes`` (default: every
    node) now, before any node starts. Built-in names are checked against torch-free name tables
    (start-up); a dotted ``package.module:function`` is imported, and an unknown name gets the
    resolver's error (with a did-you-mean). A node process checks its own pipeline's: a host
    need not have the packages of the stages other hosts run."""
    from distflow.rl.names import COMPUTE_NAMES, POLICY_LOSS_NAMES
    from distflow.rl.node_args import FN_ARGS, check_signature_args
    from distflow.rollout.rewards import resolve_reward, reward_keys, reward_row_check

    def check(names: tuple[str, ...], fn: str, what: str) -> Any:
        """None for a built-in name; the imported function for a dotted one."""
        if fn not in names:
            from distflow.rl.registry import resolve

            return resolve(dict.fromkeys(names), fn, what)
        return None

    for node in cfg.workflow if nodes is None else nodes:
        kind = (node.role.value, node.type.value)
        try:
            if kind == ("REWARD", "COMPUTE"):  # and what it declares of the rows (required_keys, check_row)
                fn = resolve_reward(node.fn)
                reward_keys(fn, node.fn)
                reward_row_check(fn, node.fn)
                if node.fn not in FN_ARGS:  # fn(response, row, **args)
                    check_signature_args(fn, 2, node.args, f"reward {node.fn!r}")
            elif kind == ("ACTOR", "COMPUTE"):
                fn = check(COMPUTE_NAMES, node.fn, "advantage estimator")
                if fn is not None:  # a dotted one: fn(rewards, group_ids, **args)
                    check_signature_args(fn, 2, node.args, f"advantage estimator {node.fn!r}")
            elif kind == ("ACTOR", "MODEL_TRAIN"):
                check(POLICY_LOSS_NAMES, node.fn, "policy loss")
        except Exception as e:
            raise ConfigError(f"workflow node {node.id!r}: {e}") from None
    if cfg.agent and any(n.fn == "episodes" for n in (cfg.workflow if nodes is None else nodes)):
        from distflow.env.agent import load_agent  # torch-free: imports the function and checks its signature

        try:
            load_agent(cfg.agent)
        except Exception as e:
            raise ConfigError(f"agent: {e}") from None
    if (cfg.environment or cfg.tools) and any(n.fn == "episodes" for n in (cfg.workflow if nodes is None else nodes)):
        from distflow.env.runner import environment_factory  # torch-free: imports the class and binds its args

        try:
            environment_factory(cfg.environment, cfg.environment_args, cfg.tools)
        except Exception as e:
            raise ConfigError(f"{'environment' if cfg.environment else 'tools'}: {e}") from None


def rows_to_check(cfg: Config, perm, steps_per_epoch: int, num_rows: int, limit: int = CHECK_ROWS) -> list[int]:
    """The rows the run's steps read in epoch 0 (every rollout rank's shard of ``perm``, the
    epoch's order), step by step, at most ``limit``: all rows when the run covers an epoch."""
    ranks, batch = cfg.rollout_nodes, cfg.rollout_batch
    shards = [perm[r::ranks] for r in range(ranks)]
    out: list[int] = []
    for step in range(min(steps_per_epoch, cfg.total_steps(num_rows))):
        for shard in shards:
            out.extend(shard[step * batch:(step + 1) * batch].tolist())
        if len(out) >= limit:
            break
    return out[:limit]


def check_dataset(cfg: Config) -> str | None:
    """Open the prompt set as a rollout node does (:class:`PromptShard`: format, row count) and
    check the rows the run reads first (:data:`CHECK_ROWS`) as its steps would: JSON, ``prompt_key``,
    the keys and ``check_row`` of the workflow's rewards; then the same for ``eval_dataset`` (its
    first rows, in file order, as evaluation reads it). Raises ConfigError naming the key on the
    first bad row with ``bad_rows: error``, and when every row checked is bad with ``bad_rows: skip``
    (each step would train, or evaluate, on nothing); returns a note counting the bad rows
    ``skip`` will skip, else None."""
    from distflow.buffer.dataloader import DatasetError, PromptShard
    from distflow.rollout.rewards import row_requirements

    try:
        requirements = row_requirements(cfg.workflow)  # (keys, checks) the rewards read of a row
    except ValueError as e:
        raise ConfigError(str(e)) from None
    notes = []
    for key in ("dataset", "eval_dataset"):
        path = getattr(cfg, key)
        if path is None:
            continue
        try:
            # as the rollout stages encode a prompt: text, or chat messages with chat_template only
            kinds = {cfg.prompt_key: (str, list) if cfg.chat_template else (str,)}
            shard = PromptShard(path, 0, 1, seed=cfg.seed, shuffle=cfg.shuffle and key == "dataset",
                                bad_rows=cfg.bad_rows, required_keys=(cfg.prompt_key,), key_types=kinds)
        except DatasetError as e:
            raise ConfigError(f"{key}: {e}") from None
        if key == "dataset":
            rows = rows_to_check(cfg, shard.permutation(0), shard.steps_per_epoch(cfg.prompts_per_step),
                                 shard.num_rows)
        else:
            rows = list(range(min(shard.num_rows, CHECK_ROWS)))
        if note := _check_rows(cfg, key, shard, rows, *requirements):
            notes.append(note)
    return "; ".join(notes) or None


def _check_rows(cfg: Config, key: str, shard: Any, rows: list[int], keys: Any, checks: Any) -> str | None:
    """:func:`check_dataset` for one file (``key``): its ``rows`` checked for the rewards' ``keys`` and ``checks``."""
    bad, first = 0, None
    try:
        for problem in shard.problems(rows, keys, checks):
            if cfg.bad_rows == "error":
                raise ConfigError(f"{key}: {problem} (bad_rows: error; bad_rows: skip skips and counts such rows)")
            bad, first = bad + 1, first or problem
    except (RuntimeError, TypeError) as e:  # a reward's check_row that raised or returned nonsense
        raise ConfigError(f"{key}: {e}") from None
    if bad and bad == len(rows):
        every = "every row" if len(rows) == shard.num_rows else f"each of the {len(rows)} rows checked"
        what = "step would train" if key == "dataset" else "evaluation would score"
        raise ConfigError(f"{key}: {every} of {shard.path} is bad, so every {what} on 0 samples "
                          f"(bad_rows: skip); the first: {first}")
    if bad:
        return (f"{key}: {bad} of the {len(rows)} rows checked are bad and will be skipped (bad_rows: skip); "
                f"the first: {first}")
    return None


def check_resume(cfg: Config) -> None:
    """``resume_from`` read as the trainers will (:func:`distflow.launch.checkpoint.read_run_state`: a
    checkpoint with distflow_state.json, written with this config's data order)."""
    if not cfg.resume_from:
        return
    from distflow.launch.checkpoint import newest_checkpoint, read_run_state

    try:
        state = read_run_state(Path(cfg.resume_from), cfg)
        done = int(state["policy_version"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        msg = str(e) if str(e).startswith("resume_from") else f"resume_from {cfg.resume_from!r}: {type(e).__name__}: {e}"
        newest = newest_checkpoint(cfg.output_dir)
        hint = f"; the newest checkpoint of output_dir is {newest}" if newest and str(newest) != cfg.resume_from else ""
        raise ConfigError(msg + hint) from None
    total = _total_steps(cfg, state)
    if total is not None and done >= total:  # else a cluster starts, trains nothing and says "final reward nan"
        raise ConfigError(f"resume_from: checkpoint {cfg.resume_from} is at step {done} of {total}: nothing left to "
                          f"train (raise max_steps or epochs to train on)")


def _total_steps(cfg: Config, state: dict[str, Any]) -> int | None:
    """The steps of the run ``cfg`` resumes: over the checkpoint's recorded row count, else the prompt
    set's (None where neither is known: a trainer host without the prompt set)."""
    num_rows = (state.get("data_order") or {}).get("num_rows")
    if not isinstance(num_rows, int) and Path(cfg.dataset).is_file():
        from distflow.buffer.dataloader import DatasetError, PromptShard

        try:
            num_rows = PromptShard(cfg.dataset, 0, 1, shuffle=False, bad_rows="skip").num_rows
        except DatasetError:
            return None
    return cfg.total_steps(num_rows) if isinstance(num_rows, int) and num_rows > 0 else None


def check_model(cfg: Config, role: str | None = None) -> None:
    """``model_path`` is a model directory, for a node of ``role`` that loads it (rollout, trainer;
    None: any): a few file checks, so every node start makes them (a hand-started node learnt of a
    bad path only after its group had formed, or its join timed out first). A node does not build
    the toy model (`distflow run` builds it before its nodes start): a hand-started node of a
    ``toy_model`` config whose model is missing is told the command that builds it."""
    if role in (None, "rollout", "trainer") and (problem := model_dir_problem(cfg.model_path)):
        toy = ""
        if cfg.toy_model and role is not None:
            kind = "" if cfg.toy_kind == "successor" else f" --kind {cfg.toy_kind}"
            toy = (f"; toy_model: true, but a hand-started node does not build it: run `distflow toy-model "
                   f"{cfg.model_path}{kind}` first (on every host)")
        raise ConfigError(f"model_path: {problem}{toy}")
    if role in (None, "rollout"):
        check_lengths(cfg)


def check_lengths(cfg: Config) -> None:
    """``max_new_tokens`` (and ``max_prompt_length`` with it) fit the model's positions
    (``max_position_embeddings`` in its config.json): otherwise every prompt is skipped as too
    long and the run trains on nothing, while it reports success."""
    try:
        mc = json.loads((Path(cfg.model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return  # model_dir_problem names what is wrong with the directory
    mc = mc.get("text_config", mc) if isinstance(mc.get("text_config"), dict) else mc
    positions = mc.get("max_position_embeddings")
    if not isinstance(positions, int) or isinstance(positions, bool):
        return
    if cfg.max_new_tokens >= positions:
        raise ConfigError(f"max_new_tokens: {cfg.max_new_tokens} leaves no room for a prompt in the model's "
                          f"{positions} positions (max_position_embeddings in {cfg.model_path}/config.json)")
    if cfg.max_prompt_length is not None and cfg.max_prompt_length + cfg.max_new_tokens > positions:
        raise ConfigError(f"max_prompt_length: {cfg.max_prompt_length} + max_new_tokens: {cfg.max_new_tokens} is "
                          f"over the model's {positions} positions (max_position_embeddings in "
                          f"{cfg.model_path}/config.json)")


def check_inputs(cfg: Config, role: str | None = None) -> list[str]:
    """What a node of ``role`` reads before it can work, checked now: the model directory (rollout,
    trainer), the prompt set (rollout), ``resume_from`` (trainer); ``role`` None: every role (`distflow
    run`). Raises ConfigError naming the key; returns notes to print (rows ``bad_rows: skip`` skips)."""
    notes = []
    check_model(cfg, role)
    if role in (None, "rollout") and (note := check_dataset(cfg)):
        notes.append(note)
    if role in (None, "trainer"):
        check_resume(cfg)
    check_input_paths(cfg, role)  # the rest (critic, reward models): distflow-node makes this check at every start
    return notes
