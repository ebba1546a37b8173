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
import signal
import sys
from typing import Callable

from distflow.core.aio import cancel_and_wait, run_loop
from distflow.core.auth import new_secret
from distflow.core.config import Config
from distflow.core.launch_env import run_start
from distflow.launch.checkpoint import resume_hint
from distflow.launch.roles import cluster_nodes, role_loop
from distflow.launch.signals import STOP_SIGNALS, catch_stop_signals, restore_signals, signum_of, stop_name
from distflow.launch.placement import GPU_NODES_ENV

log = logging.getLogger(__name__)


async def _run(cfg: Config) -> int:
    import torch

    from distflow.runtime import Runtime

    first, *others = cluster_nodes(cfg)  # the trainer (trainer_nodes: 1), then the nodes that join through it
    loops = {n.role: role_loop(n.role) for n in (first, *others)}
    torch.set_num_threads(cfg.torch_threads)
    secret = new_secret()
    # Until here a stop signal raised KeyboardInterrupt (run_in_process: catch_stop_signals), which
    # ends the imports at once; from here on the loop handles it, and the runtimes started stop.
    tasks: set[asyncio.Task] = set()
    interrupted = _on_interrupt(asyncio.get_running_loop(), tasks)
    started: list[Runtime] = []
    try:
        trainer = Runtime.create(cfg, first.role, first.node_id, secret, host=cfg.bind_host, port=0, data_port=0,
                                 seeds=[])
        await trainer.start()
        started.append(trainer)
        joined = [Runtime.create(cfg, n.role, n.node_id, secret, host=cfg.bind_host, port=0, data_port=0,
                                 seeds=[trainer.node.address]) for n in others]
        for rt in joined:
            await rt.start()
            started.append(rt)
        if interrupted.is_set():  # during start-up: no role has begun, nothing to save
            log.warning("interrupted during start-up; stopping")
            return 128 + interrupted.signum

        def loop_task(rt: Runtime) -> asyncio.Task:
            return asyncio.create_task(loops[rt.role](rt), name=f"{rt.node.node_id}-loop")

        trainer_task = loop_task(trainer)
        # the groups that receive (controller, worker groups) start their loops before the rollout nodes send
        producers = {loop_task(rt) for rt in sorted(joined, key=lambda rt: rt.role == "rollout")}
        tasks |= {trainer_task, *producers}

        def stepped() -> bool:  # the trainer gossips `step` once it has trained one in this run
            me = trainer.node.member(trainer.node.node_id)
            return me is not None and "step" in me.meta

        return await _supervise(cfg, interrupted, trainer_task, producers, joined, stepped)
    finally:
        await cancel_and_wait(tasks, 10)
        for rt in started[1:] + started[:1]:  # the trainer last
            await rt.stop()


async def _supervise(cfg: Config, interrupted: _Interrupt, trainer_task: asyncio.Task,
                     producers: set[asyncio.Task], producer_rts: list, stepped: Callable[[], bool]) -> int:
    """Wait for the run to end; returns the exit status. On the first stop signal the producers
    leave, as a cluster's on Ctrl-C, and the trainer saves a checkpoint at its last completed step,
    given up to step_timeout_s (as `distflow run` gives the trainers); before the first step has
    completed (``stepped``) there is nothing to save, and every task stops at once, as a cluster's."""
    watch = asyncio.create_task(interrupted.wait(), name="in-process-interrupt")
    loop = asyncio.get_running_loop()
    code, deadline = 0, None
    try:
        pending = {trainer_task, *producers, watch}
        while pending - {watch}:
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                log.error("the trainer did not stop within %.0fs of the interrupt (step_timeout_s); stopping it",
                          cfg.step_timeout_s)
                break
            if watch in done and not stepped():  # nothing to save (a step-0 checkpoint would be the base model)
                log.warning("interrupted (%s) before the first step completed (nothing to save); stopping every "
                            "node now", interrupted.name)
                await cancel_and_wait({trainer_task, *producers}, 10)
                return 128 + interrupted.signum
            if watch in done:  # as a cluster's Ctrl-C: the producers leave, the trainer saves a checkpoint
                log.warning("interrupted (%s): stopping the rollout nodes; the trainer saves a checkpoint (%s "
                            "again to stop at once)", interrupted.name, interrupted.name)
                await cancel_and_wait(producers, 10)  # (a producer still running would keep sending steps)
                for rt in producer_rts:
                    await rt.stop()  # they leave the mesh: the trainer stops at its last completed step
                pending -= {watch, *producers}
                code, deadline = 128 + interrupted.signum, loop.time() + cfg.step_timeout_s
                continue
            failed = [t for t in done if not t.cancelled() and t.exception() is not None]
            if failed:
                t = failed[0]
                log.error("%s failed: %s", t.get_name(), t.exception(), exc_info=t.exception())
                return 1
            if trainer_task.cancelled() and code:  # a second signal
                break
    finally:
        watch.cancel()
    return code


class _Interrupt(asyncio.Event):
    """Set by the first stop signal; ``signum`` is that signal's number."""

    signum = 0

    @property
    def name(self) -> str:
        return stop_name(self.signum)


def _on_interrupt(loop: asyncio.AbstractEventLoop, tasks: set[asyncio.Task]) -> _Interrupt:
    """SIGINT, SIGTERM, SIGHUP (as `distflow run`'s :data:`distflow.launch.signals.STOP_SIGNALS`): the
    first sets the returned event (a graceful stop), a second cancels every task of ``tasks``.
    Where signals cannot be handled (not the main thread) the event never fires."""
    event = _Interrupt()

    def on_signal(sig: int) -> None:
        if event.is_set():
            for t in tasks:
                t.cancel()
        else:
            event.signum = sig
        event.set()

    for sig in ("SIGINT", *STOP_SIGNALS):
        try:
            loop.add_signal_handler(getattr(signal, sig), on_signal, getattr(signal, sig))
        except (NotImplementedError, RuntimeError, ValueError, AttributeError):
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
    # Until the loop handles them (_on_interrupt), and after: SIGINT too, or asyncio's runner would
    # defer a Ctrl-C during the imports to their end.
    previous = catch_stop_signals(("SIGINT", *STOP_SIGNALS))
    try:
        code = run_loop(_run(cfg), exit_if_stuck=True)
    except KeyboardInterrupt as why:  # before the loop handled the signal: no node is up
        code = 128 + signum_of(why)
        print(f"distflow: interrupted ({stop_name(signum_of(why))}) before the nodes started", file=sys.stderr)
    finally:
        restore_signals(previous)
    if code > 128:
        print(f"distflow: stopped. {resume_hint(cfg.output_dir, cfg.resume_from, run_start())}", file=sys.stderr)
    return code
