"""``distflow run --in-process``: every node of the cluster in ONE process and ONE loop.

The same Runtime, mesh, channels and role loops as a real cluster, over real loopback
sockets, but all in this process, so ``breakpoint()`` anywhere in a role's code works
and a debugger sees every node. torch.distributed allows one process group per process,
so this mode needs ``trainer_nodes: 1``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from distflow.core.aio import run_loop
from distflow.core.auth import new_secret
from distflow.core.config import Config
from distflow.placement import GPU_NODES_ENV

log = logging.getLogger(__name__)


async def _run(cfg: Config) -> int:
    import torch

    from distflow.controller import run_controller
    from distflow.rollout.worker import run_rollout
    from distflow.runtime import Runtime
    from distflow.stage_worker import run_stage_worker
    from distflow.trainer.worker import run_trainer

    torch.set_num_threads(cfg.torch_threads)
    secret = new_secret()
    trainer = Runtime.create(cfg, "trainer", "trainer-0", secret, host=cfg.bind_host, port=0, data_port=0, seeds=[])
    await trainer.start()
    rollouts = [Runtime.create(cfg, "rollout", f"rollout-{i}", secret, host=cfg.bind_host, port=0, data_port=0,
                               seeds=[trainer.node.address]) for i in range(cfg.rollout_nodes)]
    controllers = [Runtime.create(cfg, "controller", "controller-0", secret, host=cfg.bind_host, port=0,
                                  data_port=0, seeds=[trainer.node.address])] if cfg.controller == "single" else []
    workers = [Runtime.create(cfg, g, f"{g}-{i}", secret, host=cfg.bind_host, port=0, data_port=0,
                              seeds=[trainer.node.address]) for g, n in cfg.worker_groups.items() for i in range(n)]
    for rt in rollouts + controllers + workers:
        await rt.start()
    trainer_task = asyncio.create_task(run_trainer(trainer), name="trainer-0-loop")
    producers = {asyncio.create_task(run_controller(rt), name="controller-0-loop") for rt in controllers}
    producers |= {asyncio.create_task(run_stage_worker(rt), name=f"{rt.node.node_id}-loop") for rt in workers}
    producers |= {asyncio.create_task(run_rollout(rt), name=f"{rt.node.node_id}-loop") for rt in rollouts}
    tasks = {trainer_task, *producers}
    interrupted = _on_interrupt(asyncio.get_running_loop(), tasks)
    watch = asyncio.create_task(interrupted.wait(), name="in-process-interrupt")
    code = 0
    try:
        pending = set(tasks) | {watch}
        while pending - {watch}:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if watch in done:  # as a cluster's Ctrl-C: the producers leave, the trainer saves a checkpoint
                log.warning("interrupted: stopping the rollout nodes; the trainer saves a checkpoint (Ctrl-C again "
                            "to stop at once)")
                for t in producers:
                    t.cancel()
                await asyncio.wait(producers, timeout=10)
                for rt in [*rollouts, *controllers, *workers]:
                    await rt.stop()  # they leave the mesh: the trainer stops at its last completed step
                pending -= {watch, *producers}
                code = 130
                continue
            failed = [t for t in done if not t.cancelled() and t.exception() is not None]
            if failed:
                t = failed[0]
                log.error("%s failed: %s", t.get_name(), t.exception(), exc_info=t.exception())
                code = 1
                break
            if trainer_task.cancelled() and code == 130:  # a second Ctrl-C
                break
    finally:
        watch.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks, timeout=10)
        for rt in [*rollouts, *controllers, *workers, trainer]:
            await rt.stop()
    return code


def _on_interrupt(loop: asyncio.AbstractEventLoop, tasks: set[asyncio.Task]) -> asyncio.Event:
    """SIGINT/SIGTERM: the first sets the returned event (a graceful stop), a second cancels
    every task. Where signals cannot be handled (not the main thread) the event never fires."""
    import signal

    event = asyncio.Event()

    def on_signal() -> None:
        if event.is_set():
            for t in tasks:
                t.cancel()
        event.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
    return event


def cuda_in_process(cfg: Config) -> Config:
    """The config every in-process node runs with on ``device: cuda``: one process has one GPU
    (:func:`distflow.device.node_device` is per process), the first of ``gpus`` (an index into
    this process's visible GPUs, as for ``distflow run``), so the trainer and every engine share
    it; and the weights go over the data channel: CUDA IPC cannot open a handle in the process
    that exported it, and NCCL refuses two ranks on one GPU. Raises ValueError naming the key."""
    if cfg.device != "cuda":
        return cfg
    if cfg.weight_transport in ("cuda_ipc", "nccl"):
        raise ValueError(f"weight_transport: {cfg.weight_transport} cannot work in one process on one GPU; "
                         f"use weight_transport=auto (or channel) with --in-process")
    index = cfg.gpus[0] if isinstance(cfg.gpus, list) else 0
    os.environ.setdefault("DISTFLOW_LOCAL_GPU", str(index))
    # every node of the run shares the GPU (worker groups too: a reward model loads there): engines size their
    # KV cache for that many
    os.environ.setdefault(GPU_NODES_ENV, str(cfg.trainer_nodes + cfg.rollout_nodes + sum(cfg.worker_groups.values())))
    log.warning("--in-process on cuda: the trainer and %d rollout engine(s) share cuda:%s of this process; the "
                "weights go over the data channel (weight_transport: channel)", cfg.rollout_nodes,
                os.environ["DISTFLOW_LOCAL_GPU"])
    return cfg.model_copy(update={"weight_transport": "channel"})


def run_in_process(cfg: Config) -> int:
    if cfg.trainer_nodes != 1:
        print("distflow run --in-process: needs trainer_nodes=1 (one torch.distributed group per process); "
              "add trainer_nodes=1", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = cuda_in_process(cfg)
    except ValueError as e:
        print(f"distflow run --in-process: {e}", file=sys.stderr)
        return 2
    code = run_loop(_run(cfg), exit_if_stuck=True)
    if code == 130:
        from distflow.launcher import resume_hint  # noqa: PLC0415

        print(f"distflow: stopped. {resume_hint(cfg.output_dir, cfg.resume_from)}", file=sys.stderr)
    return code
