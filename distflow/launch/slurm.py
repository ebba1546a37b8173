"""``distflow slurm CONFIG``: render (and submit) an sbatch script that runs the config's cluster.

Why a rendered script and not a Slurm plugin or a Ray cluster: Slurm already starts one
process per task on the allocated hosts, which is all a DistFlow cluster needs; every node
finds its role, rank and seeds from the allocation (``SLURM_PROCID``, ``SLURM_LOCALID``,
``scontrol show hostnames``: :mod:`distflow.launch.seeds`). The script is a Jinja2 template
(``templates/slurm.sbatch.j2``; ``--template`` takes a user's own) so a site can add its
modules, containers or constraints without touching DistFlow.

What the script does (the template's comments say why): trainers and rollout nodes as two job
steps, heterogeneous components when they need different host shapes (``--rollout-hosts``);
GPUs through Slurm's gres (``--gres=gpu:N`` per host of each component, each task its
own through the steps' ``--gpus-per-task``); the cluster secret from a file only its owner
can read; one log folder per attempt; ``USR1`` before the time limit stops the rollout nodes,
the trainers checkpoint, and the job requeues itself and resumes from the newest checkpoint.

``python -m distflow.launch.slurm newest OUTPUT_DIR`` prints ``resume_from=CKPT`` for the
newest complete checkpoint (nothing when there is none): the script calls it at every start.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

TEMPLATES = Path(__file__).parent / "templates"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distflow slurm", description="Render an sbatch script for CONFIG and submit it "
                                "(--dry-run: print it). KEY=VALUE arguments override config keys on every node.")
    p.add_argument("config")
    p.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    p.add_argument("--run-dir", default=None, help="script, secret and logs (default: OUTPUT_DIR/slurm)")
    p.add_argument("--template", default=None, help="your own Jinja2 template (default: the built-in one)")
    p.add_argument("--job-name", default=None)
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--time", default=None, help="time limit, e.g. 04:00:00 (USR1 reaches the job --signal-s before it)")
    p.add_argument("--signal-s", type=int, default=300, help="seconds before the time limit to checkpoint and requeue")
    p.add_argument("--hosts", type=int, default=None, help="hosts of a homogeneous job (default: 1 per 8 tasks)")
    p.add_argument("--trainer-hosts", type=int, default=None,
                   help="with --rollout-hosts: a heterogeneous job, trainers on these hosts...")
    p.add_argument("--rollout-hosts", type=int, default=None, help="...and rollout nodes on these")
    p.add_argument("--cpus-per-task", type=int, default=4)
    p.add_argument("--rollout-cpus-per-task", type=int, default=None)
    p.add_argument("--gpus-per-task", type=int, default=None, help="default: 1 with device: cuda, else 0")
    p.add_argument("--rollout-gpus-per-task", type=int, default=None,
                   help="default: --gpus-per-task x rollout_tensor_parallel (the engine's TP ranks)")
    p.add_argument("--port", type=int, default=29600, help="first node port of a host (trainers; rollout nodes +100)")
    p.add_argument("--python", default="python3", help="the Python with DistFlow installed, on every host")
    p.add_argument("--node-cmd", default="distflow-node")
    p.add_argument("--sbatch-arg", action="append", default=[], help="an extra #SBATCH line (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="exported to every node")
    return p


def render(args: argparse.Namespace, overrides: Sequence[str]) -> tuple[str, Path, Any]:
    """(script text, run dir, config). The config is validated first, so a bad key fails here, not on the
    cluster."""
    import jinja2

    from distflow.core.config import ConfigError, load_config

    cfg = load_config(args.config, list(overrides))
    if cfg.controller != "distributed" or cfg.worker_groups:
        raise ConfigError("distflow slurm: controller: single and worker_groups are not rendered yet; use "
                          "distflow-node per task by hand (docs/deploy.md)")
    if (args.trainer_hosts is None) != (args.rollout_hosts is None):
        raise ConfigError("distflow slurm: --trainer-hosts and --rollout-hosts go together (a heterogeneous job)")
    out = Path(cfg.output_dir).resolve()
    run_dir = Path(args.run_dir).resolve() if args.run_dir else out / "slurm"
    gpus = args.gpus_per_task if args.gpus_per_task is not None else int(cfg.device == "cuda")
    tasks = cfg.trainer_nodes + cfg.rollout_nodes
    # a rollout node's engine runs rollout_tensor_parallel ranks, one GPU each
    rgpus = args.rollout_gpus_per_task if args.rollout_gpus_per_task is not None else gpus * cfg.rollout_tensor_parallel
    env = dict(e.split("=", 1) for e in args.env if "=" in e)
    hosts = args.hosts or max(1, -(-tasks // 8))
    context: dict[str, Any] = dict(
        config=str(Path(args.config).resolve()), cwd=os.getcwd(), job_name=args.job_name or cfg.name,
        run_dir=str(run_dir),
        output_dir=str(out), partition=args.partition, account=args.account, time=args.time,
        signal_s=args.signal_s, sbatch_args=args.sbatch_arg, het=args.rollout_hosts is not None,
        hosts=hosts, trainer_hosts=args.trainer_hosts, rollout_hosts=args.rollout_hosts,
        trainers=cfg.trainer_nodes, rollouts=cfg.rollout_nodes, cpus_per_task=args.cpus_per_task,
        rollout_cpus_per_task=args.rollout_cpus_per_task or args.cpus_per_task, gpus_per_task=gpus,
        rollout_gpus_per_task=rgpus, gres=gres(tasks, hosts, max(gpus, rgpus)),
        trainer_gres=gres(cfg.trainer_nodes, args.trainer_hosts or 1, gpus),
        rollout_gres=gres(cfg.rollout_nodes, args.rollout_hosts or 1, rgpus),
        port=args.port, python=args.python, node_cmd=args.node_cmd, env=env,
        overrides=[o for o in overrides if not o.startswith(("rollout_nodes=", "trainer_nodes=", "output_dir="))])
    loader = jinja2.FileSystemLoader([str(Path(args.template).resolve().parent)] if args.template else [str(TEMPLATES)])
    jenv = jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    jenv.filters["q"] = lambda v: shlex.quote(str(v))
    name = Path(args.template).name if args.template else "slurm.sbatch.j2"
    return jenv.get_template(name).render(**context), run_dir, cfg


def gres(tasks: int, hosts: int, gpus_per_task: int) -> str:
    """The GPU part of a job component's ``#SBATCH`` line: ``--gres=gpu:N`` per host, N for as many tasks
    as a host gets. Why per host and a fixed ``--ntasks-per-node``: gres counts GPUs per node, and
    without the task count Slurm may pack more tasks on a host (block distribution fills its CPUs
    first) than its gres has GPUs for. The steps' ``--gpus-per-task`` then gives each task its own."""
    if not gpus_per_task:
        return ""
    per_host = -(-tasks // hosts)
    return f" --ntasks-per-node={per_host} --gres=gpu:{per_host * gpus_per_task}"


def write_secret(path: Path) -> None:
    """The run's secret, created once with mode 0600 (kept across submissions and requeues);
    ``$DISTFLOW_SECRET`` when set, else a fresh one."""
    from distflow.core.auth import SECRET_ENV, new_secret

    if path.exists():
        if path.stat().st_mode & 0o077:
            raise PermissionError(f"{path} is readable by others: chmod 600 it")
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.environ.get(SECRET_ENV) or new_secret())


def main(argv: Sequence[str]) -> int:
    from distflow.core.config import ConfigError

    if argv[:1] == ["newest"]:
        return newest_main(argv[1:])
    flags = [a for a in argv if a.startswith("-") or "=" not in a]
    overrides = [a for a in argv if not a.startswith("-") and "=" in a]
    args = parser().parse_args(flags)
    try:
        script, run_dir, cfg = render(args, overrides)
    except (ConfigError, OSError) as e:
        print(f"distflow slurm: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a user's template: its Jinja2 error, in one line
        print(f"distflow slurm: the template: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        sys.stdout.write(script)
        return 0
    if cfg.toy_model:  # as `distflow run` does: the nodes only read it
        from distflow.launch.launcher import build_toy_models

        build_toy_models(cfg)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)
    write_secret(run_dir / "secret")
    job = run_dir / "job.sbatch"
    job.write_text(script)
    r = subprocess.run(["sbatch", "--parsable", str(job)], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"distflow slurm: sbatch {job} failed: {r.stderr.strip()}", file=sys.stderr)
        return 1
    print(f"submitted job {r.stdout.strip().split(';')[0]}: {job} (logs: {run_dir / 'logs'})")
    return 0


def newest_main(argv: Sequence[str]) -> int:
    """``newest OUTPUT_DIR``: ``resume_from=CKPT`` of the newest checkpoint, or nothing."""
    from distflow.launch.checkpoint import newest_checkpoint

    if len(argv) != 1:
        print("usage: python -m distflow.launch.slurm newest OUTPUT_DIR", file=sys.stderr)
        return 2
    ckpt = newest_checkpoint(argv[0])
    if ckpt is not None:
        print(f"resume_from={ckpt}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
