"""One node's life in this process, after ``distflow-node`` checked its arguments: start the
runtime, run the role's loop, stop bounded in time on a signal or an error, and exit with a
status that tells ``distflow run`` whether a restart can help.

Why it exists apart from :mod:`distflow.launch.cli`: the command line only parses, validates
and dispatches (torch-free, so ``--help`` and ``--check`` answer at once); this is where torch
and the role's code are imported, the node's asyncio tasks run, and its error becomes one line.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from distflow.core.config import Config, ConfigError
from distflow.launch.roles import role_loop

log = logging.getLogger("distflow")  # the node's own lines, as `distflow run` reads them from its log


def exit_code_of(error: BaseException) -> int:
    """A node's exit status for the error that ended it: 2 (:data:`distflow.launch.launcher.CONFIG_EXIT`) for a
    configuration or data error, a bug in a function the config names (a reward), or a run that
    cannot learn (diverged, trains nothing), which a restart would meet again (`distflow run` does
    not restart such a node), else 1."""
    from distflow.buffer.dataloader import DatasetError
    from distflow.hf import ModelDirError
    from distflow.rl.catalog import UserFunctionError
    from distflow.rollout.protocol import NonFiniteOutputError
    from distflow.trainer.health import DivergedError, NothingTrainedError

    deterministic = (ConfigError, DatasetError, ModelDirError, UserFunctionError, NonFiniteOutputError, DivergedError,
                     NothingTrainedError)
    return 2 if isinstance(error, deterministic) else 1


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
    loop_fn = role_loop(role)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Joining the mesh may wait up to join_timeout_s for its seeds: a stop signal ends that wait too.
    starting = asyncio.create_task(rt.start(), name="runtime-start")
    signalled = asyncio.create_task(stop.wait(), name="signal-wait-start")
    try:
        await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            log.warning("%s: stopping on signal while joining the mesh", node_id)
            from distflow.core.aio import cancel_and_wait

            await cancel_and_wait({starting}, 10)
            await rt.stop(graceful=False)
            return 143
        starting.result()
    except OSError as e:  # a port taken, no seed answering the join (both OSErrors): one line; what started closes
        log.error("%s: cannot start: %s", node_id, e)
        await rt.stop(graceful=False)
        return 1
    finally:
        signalled.cancel()
    # The seeds it joined through: where a launcher found them (--seeds auto) is otherwise invisible.
    log.info("%s up: control %s, data port %d, seeds %s", node_id, rt.node.address, rt.channel.port,
             ",".join(seeds) or "none (the first node)")
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

        stuck = getattr(e, "stuck", False)  # (GroupMemberLost: a rank stuck, the group hung: it fails here)
        code, failed_here = exit_code_of(e), not isinstance(e, PeerLostError) or stuck
        dead = await rt.wait_dead_peers(role, cfg.mesh.suspicion_timeout_s + 2.0) if role == "trainer" and not stuck else []
        if dead:  # name the dead rank, not the transport error it caused here
            failed_here = False
            from distflow.core.launch_env import recovering_trainers, run_start
            from distflow.launch.checkpoint import resume_hint
            from distflow.runtime import GroupMemberLost

            hint = ("`distflow run` restarts the trainers from the newest checkpoint" if recovering_trainers() else
                    resume_hint(cfg.output_dir, cfg.resume_from, run_start()))
            log.error("%s: %s; %s (here: %s: %s)", node_id, GroupMemberLost(role, dead), hint, type(e).__name__,
                      str(e).splitlines()[0][:200] if str(e) else "")
        else:  # a configuration or data error (exit 2), a mesh it could not join: one line, no traceback to read
            from distflow.core.swim_driver import JoinTimeout

            log.error("%s: %s: %s", node_id, type(e).__name__, e, exc_info=code != 2 and not isinstance(e, JoinTimeout))
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
