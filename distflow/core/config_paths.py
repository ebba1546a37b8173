"""Paths of a DistFlow config: one rule for resolving them, one check that they exist.

The rule (docs/configuration.md, "Paths"): a relative path is relative to **where it was
written**. In a config file, that is the file's directory, so a copied example config finds its
data wherever it is copied to, and a node started by hand from another directory reads the same
files as `distflow run`. On the command line (``dataset=...``), in a Python mapping, or a default
(``output_dir: outputs/run``), it is the working directory, as a shell user expects. ``~`` is
expanded. Every path key is made absolute when the config is validated, so the resolved config
`distflow run` writes for its nodes (``output_dir/config.yaml``) means the same files wherever it
is read.

The check (:func:`check_input_paths`) is the one both `distflow run` and every `distflow-node`
start make: each input a node of a role reads exists, named by key and path. Torch-free; it does
not import the config module (which imports this one).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from distflow.core.config_keys import FLAT_KEYS, ConfigError

# path key -> what it must be: an input file, an input directory, or an output (made if missing)
PATH_KEYS: dict[str, str] = {"model_path": "dir", "critic_path": "dir", "dataset": "file", "eval_dataset": "file",
                             "resume_from": "dir", "output_dir": "out"}
ROLE_INPUTS: dict[str, tuple[str, ...]] = {  # the inputs a node of each role reads (`distflow run`: all)
    "rollout": ("model_path", "dataset", "eval_dataset"),
    "trainer": ("model_path", "critic_path", "resume_from"),
}
MODEL_HINT = "(models load from local Hugging Face model directories; nothing is downloaded)"


def absolute(path: str, base: str | Path) -> str:
    """``path`` (``~`` expanded) joined to ``base`` when relative; normalised lexically (no symlink is resolved)."""
    expanded = os.path.expanduser(path)
    return expanded if os.path.isabs(expanded) else os.path.normpath(os.path.join(str(base), expanded))


def _is_reward_model(node: Any) -> bool:
    """A REWARD MODEL_INFERENCE node, raw (a mapping, any case) or validated; its ``args.path`` is a path key."""
    get = node.get if isinstance(node, dict) else (lambda k: getattr(node, k, None))
    role, kind = (getattr(v, "value", v) for v in (get("role"), get("type")))
    return str(role).strip().upper() == "REWARD" and str(kind).strip().upper() == "MODEL_INFERENCE"


def resolve_raw(raw: dict[str, Any], base: str | Path) -> dict[str, str]:
    """Make the relative path keys of a config file's raw mapping (flat or in sections, before
    overrides) absolute against ``base`` (the file's directory), in place. Returns ``{key: value
    as written}`` for each path it resolved, so an error about a missing file can say how it was
    resolved."""
    given = {}

    def places(key: str) -> list[dict[str, Any]]:
        section = raw.get(FLAT_KEYS[key])
        return [m for m in (raw, section) if isinstance(m, dict)]

    for key in PATH_KEYS:
        for where in places(key):
            value = where.get(key)
            if isinstance(value, str) and value and value != absolute(value, base):
                where[key] = absolute(value, base)
                given[key] = value
    for where in places("workflow"):
        workflow = where.get("workflow")
        for node in workflow if isinstance(workflow, list) else []:
            args = node.get("args") if isinstance(node, dict) and _is_reward_model(node) else None
            value = args.get("path") if isinstance(args, dict) else None
            if isinstance(value, str) and value and value != absolute(value, base):
                args["path"] = absolute(value, base)
                given[f"workflow node {node.get('id')!r}: args.path"] = value
    return given


def absolute_paths(cfg: Any) -> None:
    """Make every path key of a validated config absolute against the working directory: the
    values a file did not set (defaults, overrides, a Python mapping). In place."""
    cwd = os.getcwd()
    for key in PATH_KEYS:
        section = getattr(cfg, FLAT_KEYS[key])
        value = getattr(section, key)
        if isinstance(value, str) and value and not os.path.isabs(value):
            setattr(section, key, absolute(value, cwd))
    nodes = cfg.algorithm.workflow
    for i, n in enumerate(nodes):
        path = n.args.get("path") if _is_reward_model(n) else None
        if isinstance(path, str) and path and not os.path.isabs(path):  # nodes are frozen: a new node
            nodes[i] = n.model_copy(update={"args": {**n.args, "path": absolute(path, cwd)}})


def input_paths(cfg: Any, role: str | None = None) -> list[tuple[str, str, str]]:
    """(key, path, kind) of every input a node of ``role`` reads before it can work (None: every
    role, as `distflow run` starts them all): the keys of :data:`ROLE_INPUTS` and the reward
    models of the workflow nodes its group runs. A toy model `distflow run` is yet to build
    (``toy_model``) is left out for a node, which does not build it."""
    keys = [k for k, kind in PATH_KEYS.items() if kind != "out"] if role is None else ROLE_INPUTS.get(role, ())
    out = [(k, getattr(cfg, k), PATH_KEYS[k]) for k in keys if getattr(cfg, k)]
    nodes = cfg.workflow if role is None else cfg.plan().pipelines.get(role, [])
    rewards = [(f"workflow node {n.id!r}: args.path", n.args["path"], "dir") for n in nodes
               if _is_reward_model(n) and isinstance(n.args.get("path"), str) and n.args["path"]]
    if role is not None and cfg.toy_model:  # what `distflow run` builds: a node does not
        toy = {cfg.model_path} | ({p for _, p, _ in rewards} if cfg.toy_kind == "successor" else set())
        return [(k, p, kind) for k, p, kind in out + rewards if p not in toy or (Path(p) / "config.json").is_file()]
    return out + rewards


def path_problem(path: str, kind: str) -> str | None:
    """Why ``path`` cannot be read as a ``kind`` ("file" or "dir") input, else None."""
    p = Path(path)
    if kind == "file" and p.is_dir():
        return f"{path!r} is a directory, not a prompt file (.jsonl, .parquet)"
    if kind == "dir" and p.exists() and not p.is_dir():
        return f"{path!r} is a file, not a directory"
    if not p.exists():
        return f"{path!r} does not exist" if kind == "dir" else f"{path!r} not found"
    return None


def check_input_paths(cfg: Any, role: str | None = None, given: dict[str, str] | None = None) -> None:
    """Refuse, naming the key and the path, an input a node of ``role`` reads that is missing
    (:func:`input_paths`; ``role``: a node's group, ``rollout``, ``trainer`` or a worker group's
    name): the one check `distflow run` (``role`` None) and every `distflow-node`
    start (with or without ``--check``) make, before anything joins or loads. ``given``: the
    values a config file wrote relative to its directory (:func:`resolve_raw`), for a hint when
    the same relative path exists under the working directory (the rule before config files had
    one); default the config's own record of them."""
    given = getattr(cfg, "path_origins", {}) if given is None else given
    for key, path, kind in input_paths(cfg, role):
        problem = path_problem(path, kind)
        if problem is None:
            continue
        if key == "model_path" and "does not exist" in problem:
            problem += f" {MODEL_HINT}"
        written = given.get(key)
        if written is not None:
            problem += f" (written {written!r} in the config file: a relative path there is relative to the file's " \
                       "directory"
            if Path(absolute(written, os.getcwd())).exists():
                problem += f"; {written!r} exists under the working directory: write it relative to the file, or " \
                           "absolute"
            problem += ")"
        raise ConfigError(f"{key}: {problem}")


def add_import_dirs(config_path: str | os.PathLike) -> list[str]:
    """Make ``package.module:function`` names in the config importable from the config file's directory
    and the working directory (docs/configuration.md, "Imports"): both go after ``sys.path`` and
    ``PYTHONPATH`` (they never shadow an installed package), so the nodes `distflow run` starts (they
    inherit the environment, and read a config copied to output_dir) import what this process
    imports. Returns the directories."""
    import sys

    dirs = list(dict.fromkeys([os.path.abspath(os.path.dirname(os.fspath(config_path)) or "."), os.getcwd()]))
    sys.path.extend(d for d in dirs if d not in sys.path)
    known = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([*known, *[d for d in dirs if d not in known]])
    return dirs
