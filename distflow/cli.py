"""Command-line entry points: ``distflow`` (run, status, toy) and ``distflow-node``.

Entry points stay thin: they parse arguments and validate the config before anything
heavy is imported, so ``--help``, ``--check`` and config errors answer in a blink; torch
and the role code are imported only once a node really starts.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Callable, Sequence

from distflow.core.auth import SECRET_ENV
from distflow.core.config import Config, ConfigError, load_config

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


def exit_code_of(error: BaseException) -> int:
    """A node's exit status for the error that ended it: 2 (``launcher.CONFIG_EXIT``) for a
    configuration or data error, which a restart would meet again (`distflow run` does not
    restart such a node), else 1."""
    from distflow.buffer.dataloader import DatasetError
    from distflow.hf import ModelDirError

    return 2 if isinstance(error, (ConfigError, DatasetError, ModelDirError)) else 1


# ---------------------------------------------------------------------- distflow-node
def node_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distflow-node", description="Run one DistFlow node (one process, one asyncio loop).")
    p.add_argument("--role", required=True, choices=["rollout", "trainer", "controller", "worker"],
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
    from distflow.launcher import die_with_launcher

    die_with_launcher()  # first: a node of `distflow run` dies with it (a launcher gone already: exit now)
    flags, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    args = node_parser().parse_args(flags)
    try:
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
    from distflow.preflight import check_functions, check_inputs, check_model

    pipeline = cfg.plan().pipelines.get(role, [])
    try:
        check_functions(cfg, pipeline)  # every start, not only --check: a typo is named now, not at step 1
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

    try:
        return run_loop(run_node(cfg, role, node_id, secret, host, args.port, args.data_port, seeds, advertise),
                        exit_if_stuck=True)
    except KeyboardInterrupt:
        return 130


async def run_node(cfg: Config, role: str, node_id: str, secret: str, host: str, port: int, data_port: int,
                   seeds: list[str], advertise_host: str | None = None) -> int:
    """Start the node, run its role's loop, and stop bounded in time on a signal or error."""
    import torch

    from distflow.core.allocator import keep_freed_memory
    from distflow.runtime import Runtime

    torch.set_num_threads(cfg.torch_threads)
    keep_freed_memory()  # a step's buffers are reused, not page-faulted anew
    rt = Runtime.create(cfg, role, node_id, secret, host=host, port=port, data_port=data_port, seeds=seeds,
                        advertise_host=advertise_host)
    if role == "trainer":
        from distflow.trainer.worker import run_trainer as loop_fn
    elif role == "rollout":
        from distflow.rollout.worker import run_rollout as loop_fn
    else:  # the controller, or a node of a worker group: a stage worker
        from distflow.stage_worker import run_stage_worker as loop_fn
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await rt.start()
    except OSError as e:  # a port taken, no seed answering the join (both OSErrors): one line; what started closes
        log.error("%s: cannot start: %s", node_id, e)
        await rt.stop(graceful=False)
        return 1
    log.info("%s up: control %s, data port %d", node_id, rt.node.address, rt.channel.port)
    exporter = None
    if cfg.metrics_port is not None:  # opt-in Prometheus /metrics of this node (distflow/core/prometheus.py)
        from distflow.core.prometheus import MetricsServer

        try:
            exporter = await MetricsServer(rt).start(cfg.metrics_host, cfg.metrics_port)
        except OSError as e:
            log.error("%s: cannot serve /metrics on %s:%d: %s", node_id, cfg.metrics_host, cfg.metrics_port, e)
            await rt.stop(graceful=False)
            return 1
    work = asyncio.create_task(loop_fn(rt), name=f"{role}-loop")
    stopper = asyncio.create_task(stop.wait(), name="signal-wait")
    # A trainer rank watches its group: a dead rank ends the torch.distributed group.
    tasks = {work, stopper}
    if role == "trainer":
        tasks.add(asyncio.create_task(rt.watch_group(), name="group-watch"))
    code, failed_here = 0, False
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if stopper in done:
            log.warning("%s: stopping on signal", node_id)
            code = 143
        else:
            for t in done:
                t.result()  # raises the role loop's (or the group watch's) error
    except Exception as e:
        from distflow.runtime import PeerLostError

        code, failed_here = exit_code_of(e), not isinstance(e, PeerLostError)
        dead = await rt.wait_dead_peers(role, cfg.mesh.suspicion_timeout_s + 2.0) if role == "trainer" else []
        if dead:  # name the dead rank, not the transport error it caused here
            failed_here = False
            from distflow.launcher import resume_hint
            from distflow.runtime import GroupMemberLost

            log.error("%s: %s; %s (here: %s: %s)", node_id, GroupMemberLost(role, dead),
                      resume_hint(cfg.output_dir, cfg.resume_from), type(e).__name__,
                      str(e).splitlines()[0][:200] if str(e) else "")
        else:  # a configuration or data error (exit 2) is its one line: no traceback to read
            log.error("%s: %s: %s", node_id, type(e).__name__, e, exc_info=code != 2)
    finally:
        from distflow.core.aio import cancel_and_wait

        await cancel_and_wait(tasks, 10)
        if exporter is not None:
            await exporter.stop()
        # A node that failed by itself does not "leave": its peers see it die (and adopt its
        # work). One that stops because a peer died announces its leave, so the others know.
        await rt.stop(graceful=not failed_here)
    if code and role == "trainer":
        # A worker thread may be stuck in a collective with a dead rank until its timeout
        # (step_timeout_s), and tearing down the process group can block on that rank too:
        # exit now, not after run_loop's grace for worker threads.
        from distflow.core.aio import exit_now

        exit_now(code)
    return code


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
    sub.add_parser("slurm", help="render (and submit) an sbatch script for CONFIG", add_help=False)
    sub.add_parser("k8s", help="render Kubernetes manifests for CONFIG", add_help=False)
    t = sub.add_parser("toy-model", help="build a tiny toy model and tokenizer into DIR")
    t.add_argument("dir")
    t.add_argument("--kind", choices=["successor", "gsm8k", "reward"], default="successor",
                   help="successor: the quickstart's character-level Llama; gsm8k: BPE chat tokenizer + tiny Qwen2; "
                        "reward: a tiny reward model (sequence classification) over the successor tokenizer")
    t.add_argument("--seed", type=int, default=0)
    d = sub.add_parser("toy-data", help="write a toy prompt set (JSONL) to PATH")
    d.add_argument("path")
    d.add_argument("--kind", choices=["successor", "gsm8k"], default="successor",
                   help="successor: {prompt, answer}; gsm8k: word problems {question, answer: '... #### N'}")
    d.add_argument("--rows", type=positive_int, default=1024)
    d.add_argument("--seed", type=int, default=0)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["status"]:
        from distflow.core.status import status_main

        return status_main(argv[1:])
    if argv[:1] in (["slurm"], ["k8s"]):  # they parse their own arguments (and KEY=VALUE overrides)
        from importlib import import_module

        return import_module(f"distflow.launch.{argv[0]}").main(argv[1:])
    argv, overrides = split_overrides(argv)
    args = p.parse_args(argv)
    if overrides and args.cmd != "run":
        p.error(f"config overrides {overrides} only apply to `distflow run`")
    if args.cmd in ("toy-model", "toy-data"):
        return toy_main(args)
    from distflow.launcher import launch

    try:
        cfg = load_config(args.config, overrides)
        return launch(cfg, in_process=args.in_process, progress=not args.no_progress)
    except ConfigError as e:  # the config, or what `distflow run` refuses before any node starts
        print(f"distflow run: {e}", file=sys.stderr)
        return 2


def toy_main(args: argparse.Namespace) -> int:
    """`distflow toy-model DIR` / `distflow toy-data PATH`: a path that cannot be written is one line, exit 2."""
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
    try:
        if args.cmd == "toy-model":
            from distflow.toy import build_toy_model, build_toy_reward_model
            from distflow.toy_gsm8k import build_gsm8k_model

            build = {"gsm8k": build_gsm8k_model, "reward": build_toy_reward_model}.get(args.kind, build_toy_model)
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
