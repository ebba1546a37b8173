"""Command-line entry points: ``distflow`` (run, status, toy) and ``distflow-node``.

Entry points stay thin: they parse arguments, validate the config and dispatch, before
anything heavy is imported, so ``--help``, ``--check`` and config errors answer in a blink;
torch and the role code are imported only once a node really starts (:mod:`distflow.launch.node`)
or a run does (:mod:`distflow.launch.launcher`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, Sequence

from distflow.core.auth import SECRET_ENV
from distflow.core.config import ConfigError, load_config
from distflow.core.config_paths import add_import_dirs
from distflow.launch.roles import KINDS

log = logging.getLogger("distflow")


def _setup_logging(node_id: str | None = None, level: str = "INFO") -> None:
    fmt = f"%(asctime)s %(levelname)s [{node_id or 'distflow'}] %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=fmt, stream=sys.stderr)


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate ``key=value`` overrides from flags, wherever they stand on the line."""
    flags, overrides = [], []
    for a in argv:
        if not a.startswith("-") and "=" in a:
            overrides.append(a)
        else:
            flags.append(a)
    return flags, overrides


def parse_seeds(text: str) -> list[str]:
    seeds = [s.strip() for s in text.split(",") if s.strip()]
    for s in seeds:
        host, _, port = s.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--seeds: {s!r} is not HOST:PORT")
    return seeds


def int_in(lo: int, hi: int | None, what: str) -> Callable[[str], int]:
    """An argparse type: an int in [lo, hi] (hi None: no bound above); ``what`` follows the value
    in the error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value}{what}")
        return value
    return parse


port = int_in(0, 65535, " is not a port (0-65535; 0 = any free port)")
positive_int = int_in(1, None, ": must be at least 1")


# ---------------------------------------------------------------------- distflow-node
def node_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distflow-node", description="Run one DistFlow node (one process, one asyncio loop).")
    p.add_argument("--role", required=True, choices=list(KINDS),
                   help="controller only with `controller: single` (the baseline design); worker: a node of "
                        "the worker group named by --group (config worker_groups)")
    p.add_argument("--group", default=None, help="with --role worker: the group of worker_groups this node serves")
    p.add_argument("--config", required=True, help="workflow/run config (YAML)")
    p.add_argument("--seeds", default="", help="HOST:PORT[,...] of any nodes already in the mesh (none for the first); "
                                          "auto: from $DISTFLOW_SEEDS, Slurm or Kubernetes (distflow/launch/seeds.py)")
    p.add_argument("--host", default=None, help="address to bind (default: config bind_host, loopback)")
    p.add_argument("--advertise-host", default=None,
                   help="address peers use to reach this node (required with --host 0.0.0.0, e.g. in containers)")
    p.add_argument("--port", type=port, default=0, help="control port (0 = any free port)")
    p.add_argument("--data-port", type=port, default=0, help="data-plane port (0 = any free port)")
    p.add_argument("--node-id", default=None, help="unique node id (default ROLE-HOST-PORT; with --port 0 "
                                                      "ROLE-HOST-pidPID, which a restart changes: give --node-id "
                                                      "for a node that must rejoin as itself)")
    p.add_argument("--check", action="store_true", help="validate config, role, seeds and what the role reads "
                                                        "(model, prompt set, resume_from), then exit without joining")
    p.add_argument("--log-level", default="INFO")
    p.epilog = "Any KEY=VALUE argument overrides that config key (e.g. lr=1e-4 mesh.protocol_period_s=0.5)."
    return p


def node_main(argv: Sequence[str] | None = None) -> int:
    from distflow.launch.children import die_with_launcher

    die_with_launcher()  # first: a node of `distflow run` dies with it (a launcher gone already: exit now)
    flags, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    args = node_parser().parse_args(flags)
    try:
        add_import_dirs(args.config)  # `my_rewards:score` beside the config or in the working directory
        cfg = load_config(args.config, overrides)
        if args.seeds == "auto":  # from DISTFLOW_SEEDS, the Slurm allocation or the Kubernetes service
            from distflow.launch.seeds import auto_seeds

            args.seeds = ",".join(auto_seeds(args.host or cfg.bind_host, args.port))
        seeds = parse_seeds(args.seeds)
        secret = os.environ.get(SECRET_ENV, "")
        if len(secret) < 16:
            raise ConfigError(f"{SECRET_ENV} must hold the cluster secret (at least 16 characters)")
    except ConfigError as e:
        print(f"distflow-node: {e}", file=sys.stderr)
        return 2
    host = args.host or cfg.bind_host
    advertise = args.advertise_host or cfg.advertise_host
    if host in ("0.0.0.0", "::", "") and not advertise:
        print(f"distflow-node: --host {host or '(empty)'} binds every interface; peers need a concrete address: "
              f"add --advertise-host ADDR (or advertise_host in the config)", file=sys.stderr)
        return 2
    if args.role == "controller" and cfg.controller != "single":
        print("distflow-node: --role controller needs `controller: single` in the config", file=sys.stderr)
        return 2
    if (args.role == "worker") != (args.group is not None):
        print("distflow-node: --group goes with --role worker (and --role worker needs --group)", file=sys.stderr)
        return 2
    if args.role == "worker" and args.group not in cfg.worker_groups:
        print(f"distflow-node: --group {args.group!r} is not a group of worker_groups "
              f"({', '.join(cfg.worker_groups) or 'none configured'})", file=sys.stderr)
        return 2
    role = args.group if args.role == "worker" else args.role  # a worker's mesh role is its group's name
    # With --port 0 the port is not known yet: the pid keeps two such nodes of one host apart.
    node_id = args.node_id or f"{role}-{host}-{args.port or f'pid{os.getpid()}'}"
    from distflow.core.config_paths import check_input_paths
    from distflow.launch.preflight import check_functions, check_inputs, check_model

    pipeline = cfg.plan().pipelines.get(role, [])
    try:
        check_functions(cfg, pipeline)  # every start, not only --check: a typo is named now, not at step 1
        check_input_paths(cfg, role)  # the inputs of its group, named by key and path, as `distflow run` does
        check_model(cfg, args.role)  # every start too (a few stats): not after the group formed
        notes = check_inputs(cfg, args.role) if args.check else []
    except ConfigError as e:
        print(f"distflow-node: {e}", file=sys.stderr)
        return 2
    if args.check:
        for note in notes:
            print(f"distflow-node: {note}", file=sys.stderr)
        print(f"ok: {node_id} role={role} host={host} seeds={seeds or '(first node)'} "
              f"pipeline={[n.id for n in pipeline]}")
        return 0
    _setup_logging(node_id, args.log_level)
    from distflow.core.aio import run_loop
    from distflow.launch.node import run_node

    try:
        return run_loop(run_node(cfg, role, node_id, secret, host, args.port, args.data_port, seeds, advertise),
                        exit_if_stuck=True)
    except KeyboardInterrupt:
        return 130


# ---------------------------------------------------------------------- distflow
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="distflow", description="DistFlow: fully distributed RL for LLM post-training.")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="start a whole local cluster for CONFIG and train")
    r.add_argument("config")
    r.epilog = "Any KEY=VALUE argument overrides that config key, e.g. output_dir=DIR lr=1e-4 workflow.1.fn=gsm8k."
    r.add_argument("--in-process", action="store_true",
                   help="run every node in this process, in one asyncio loop (debugging; needs trainer_nodes=1)")
    r.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    sub.add_parser("status", help="live table of a running cluster's members", add_help=False)
    sub.add_parser("config", help="--explain KEY: a config key's section, type, default and meaning; "
                                  "--show CONFIG: a config resolved", add_help=False)
    sub.add_parser("slurm", help="render (and submit) an sbatch script for CONFIG", add_help=False)
    sub.add_parser("k8s", help="render Kubernetes manifests for CONFIG", add_help=False)
    t = sub.add_parser("toy-model", help="build a tiny toy model and tokenizer into DIR")
    t.add_argument("dir")
    t.add_argument("--kind", choices=["successor", "gsm8k", "reward", "tool", "vlm"], default="successor",
                   help="successor: the quickstart's character-level Llama; gsm8k: BPE chat tokenizer + tiny Qwen2; "
                        "reward: a tiny reward model (sequence classification) over the successor tokenizer; "
                        "tool: a chat tokenizer with a tool template + tiny Llama (examples/tool_quickstart.yaml); "
                        "vlm: a tiny Qwen2-VL with its image processor (examples/vlm_quickstart.yaml)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--force", action="store_true", help="write into DIR even when it is not empty (overwrites)")
    d = sub.add_parser("toy-data", help="write a toy prompt set (JSONL) to PATH")
    d.add_argument("path")
    d.add_argument("--kind", choices=["successor", "gsm8k"], default="successor",
                   help="successor: {prompt, answer}; gsm8k: word problems {question, answer: '... #### N'}")
    d.add_argument("--rows", type=positive_int, default=1024)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--force", action="store_true", help="overwrite PATH when it exists and is not empty")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["status"]:
        from distflow.core.status import status_main

        return into_a_pipe(status_main, argv[1:])
    if argv[:1] == ["config"]:  # `distflow config --explain KEY | --show CONFIG`: distflow/core/config_explain.py
        from distflow.core.config_explain import config_main

        return into_a_pipe(config_main, argv[1:])
    if argv[:1] in (["slurm"], ["k8s"]):  # they parse their own arguments (and KEY=VALUE overrides)
        from importlib import import_module

        return into_a_pipe(import_module(f"distflow.launch.{argv[0]}").main, argv[1:])
    argv, overrides = split_overrides(argv)
    args = p.parse_args(argv)
    if overrides and args.cmd != "run":
        p.error(f"config overrides {overrides} only apply to `distflow run`")
    if args.cmd in ("toy-model", "toy-data"):
        return toy_main(args)
    from distflow.launch.launcher import launch

    try:
        add_import_dirs(args.config)  # for this process's checks and, through PYTHONPATH, every node it starts
        cfg = load_config(args.config, overrides)
        return launch(cfg, in_process=args.in_process, progress=not args.no_progress)
    except ConfigError as e:  # the config, or what `distflow run` refuses before any node starts
        print(f"distflow run: {e}", file=sys.stderr)
        return 2


def into_a_pipe(command, argv: list[str]) -> int:
    """Run a command that prints (``config --show``, ``k8s``, ``status``) whose reader may stop early
    (``| head``): a closed pipe ends it quietly with SIGPIPE's status (141), as a shell tool does,
    instead of a BrokenPipeError traceback (Python ignores SIGPIPE)."""
    try:
        code = command(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit must not fail again
        return 128 + 13


def toy_main(args: argparse.Namespace) -> int:
    """`distflow toy-model DIR` / `distflow toy-data PATH`: a path that cannot be written, or one that holds
    something already (a real model, a prompt set: overwritten only with ``--force``), is one line, exit 2."""
    from pathlib import Path

    target = Path(args.dir if args.cmd == "toy-model" else args.path)
    blocker = next((q for q in (target, *target.parents) if q.exists() and not q.is_dir()), None)
    if args.cmd == "toy-model" and blocker is not None:
        print(f"distflow toy-model: {str(blocker)!r} is a file; DIR must be a directory (or not exist yet)",
              file=sys.stderr)
        return 2
    if args.cmd == "toy-data" and (target.is_dir() or (blocker is not None and blocker != target)):
        what = f"{str(target)!r} is a directory" if target.is_dir() else f"{str(blocker)!r} is a file"
        print(f"distflow toy-data: {what}; PATH must be a file to write", file=sys.stderr)
        return 2
    # Never overwrite what is there (a real model directory, a prompt set) without being told to.
    full = any(target.iterdir()) if target.is_dir() else target.is_file() and target.stat().st_size > 0
    if full and not args.force:
        what = "directory is not empty" if target.is_dir() else "file exists"
        print(f"distflow {args.cmd}: {str(target)!r}: the {what}; refusing to overwrite it (add --force to overwrite, "
              f"or name a new {'DIR' if args.cmd == 'toy-model' else 'PATH'})", file=sys.stderr)
        return 2
    try:
        if args.cmd == "toy-model":
            from distflow.env.toy_tasks import build_tool_model
            from distflow.toy import build_toy_model, build_toy_reward_model
            from distflow.toy_gsm8k import build_gsm8k_model

            build = {"gsm8k": build_gsm8k_model, "reward": build_toy_reward_model,
                     "tool": build_tool_model}.get(args.kind, build_toy_model)
            print(build(args.dir, seed=args.seed))
        else:
            from distflow.toy import make_toy_dataset
            from distflow.toy_gsm8k import make_gsm8k_dataset

            (make_gsm8k_dataset if args.kind == "gsm8k" else make_toy_dataset)(args.path, args.rows, seed=args.seed)
            print(args.path)
    except OSError as e:
        print(f"distflow {args.cmd}: cannot write {str(target)!r}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
