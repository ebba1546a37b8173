"""The trainer node's own controller loop: take my samples, update, publish weights.

Each trainer rank receives only the samples it owns (owner = hash(sample_id) mod T),
straight from the rollout nodes. A step is complete when every rollout node's part for it
has arrived (every rollout sends one message per trainer per step, possibly empty). The
ranks then run the trainer group's pipeline (reference logprobs -> update) as one FSDP2
group, publish the new version to their share of the rollout nodes, and rank 0 appends
the step's metrics. Samples older than ``max_staleness`` versions are refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from distflow.buffer.batch import SampleBatch
from distflow.buffer.redistribute import parse_part
from distflow.buffer.shard import DuplicatePartError, SourceLostError
from distflow.core.channels import Envelope
from distflow.core.dag import WorkflowNode
from distflow.runtime import Groups, Runtime
from distflow.trainer.actor import Actor
from distflow.trainer.metrics import MetricsWriter, plot_reward_curve
from distflow.trace import Trace
from distflow.rl.weights import WeightPublisher

log = logging.getLogger(__name__)


async def init_process_group(rt: Runtime, groups: Groups) -> None:
    """The trainer group's torch.distributed group. Rank 0 opens the rendezvous store on
    any free port and gossips it; the others read it from rank 0's metadata."""
    head, world, timeout = groups.trainer[0], len(groups.trainer), timedelta(seconds=rt.cfg.step_timeout_s)
    if groups.rank == 0:
        store = await asyncio.to_thread(lambda: dist.TCPStore(head.host, rt.cfg.rendezvous_port, world, is_master=True,
                                                              timeout=timeout, wait_for_workers=False))
        rt.node.set_meta(pg_port=store.port)
    else:
        ms = await rt.node.wait_for(lambda ms: any(m.node_id == head.node_id and "pg_port" in m.meta for m in ms),
                                    timeout=rt.cfg.mesh.join_timeout_s, what=f"{head.node_id}'s rendezvous port")
        port = next(m.meta["pg_port"] for m in ms if m.node_id == head.node_id)
        store = await asyncio.to_thread(lambda: dist.TCPStore(head.host, port, world, is_master=False,
                                                                timeout=timeout))
    backend = "nccl" if rt.cfg.device == "cuda" else "gloo"
    await asyncio.to_thread(dist.init_process_group, backend, store=store, rank=groups.rank, world_size=world,
                            timeout=timeout)


def train_step(actor: Actor, pipeline: list[WorkflowNode], batch: SampleBatch) -> dict[str, float]:
    stats: dict[str, float] = {}
    for node in pipeline:
        kind = (node.role.value, node.type.value)
        if kind == ("REFERENCE", "MODEL_INFERENCE"):
            batch = actor.reference_logprobs(batch)
        elif kind == ("ACTOR", "MODEL_TRAIN"):
            stats = actor.update(node, batch)
        else:
            raise NotImplementedError(f"workflow node {node.id!r}: {kind} on the trainer group is not supported yet")
    return stats


def step_summary(actor: Actor, batch: SampleBatch, step: int) -> list[float]:
    """Global reward/staleness sums over the step (a collective)."""
    n = float(len(batch))
    reward = float(batch.tensors["reward"].sum()) if n else 0.0
    stale = float((step - batch.tensors["policy_version"]).sum()) if n else 0.0
    return actor._all_reduce([n, reward, stale])


async def run_trainer(rt: Runtime) -> None:
    cfg = rt.cfg
    total: list[int] = []
    consumed = [0]  # steps already taken out of the buffer
    dropped = {"late": 0, "duplicate": 0}

    async def on_samples(env: Envelope) -> None:
        step, batch = parse_part(env)
        shard = env.meta.get("source_rank")
        if not isinstance(shard, int) or not 0 <= shard < cfg.rollout_nodes:
            raise ValueError(f"samples from {env.sender}: source_rank {shard!r} is not a shard of "
                             f"{cfg.rollout_nodes} rollout nodes")
        if not total:
            total.append(int(env.meta["total_steps"]))
        source = f"shard-{shard}"
        # A re-issued shard (its node was down) can arrive twice, or after its step was trained:
        # the first part wins, repeats are acknowledged and dropped.
        if step < consumed[0]:
            dropped["late"] += 1
            return
        try:
            await rt.shard.put(batch, step=step, source=source, timeout=cfg.step_timeout_s)
        except DuplicatePartError:  # two copies arrived at once
            dropped["duplicate"] += 1

    rt.on_data("samples", on_samples)
    groups = await rt.form_groups()
    await init_process_group(rt, groups)
    pipeline = cfg.plan().pipeline("trainer")
    actor = await asyncio.to_thread(Actor, cfg, any(n.role.value == "REFERENCE" for n in pipeline))
    rank, world = groups.rank, len(groups.trainer)
    sources = [f"shard-{s}" for s in range(cfg.rollout_nodes)]
    rollout_ids = [m.node_id for m in groups.rollout]
    mine = [node_id for i, node_id in enumerate(rollout_ids) if i % world == rank]
    publisher = WeightPublisher(rt.channel, mine, rt.endpoint, rt.node.is_alive, timeout=min(cfg.step_timeout_s, 60.0))

    def on_member(event: str, m) -> None:
        if event == "alive":
            publisher.peer_up(m.node_id)
        elif event in ("dead", "left"):
            publisher.peer_down(m.node_id)

    rt.node.subscribe(on_member)
    out_dir = Path(cfg.output_dir)
    writer = MetricsWriter(out_dir, append=bool(cfg.resume_from)) if rank == 0 else None
    trace = Trace(cfg.output_dir, rt.node.node_id, cfg.trace_samples)
    log.info("trainer rank %d/%d: pipeline %s, serves weights to %s", rank, world, [n.id for n in pipeline],
             mine)

    step, t_last, t_start = actor.version, time.perf_counter(), time.perf_counter()
    first_step = consumed[0] = step  # a resumed run continues at its checkpoint's step
    if step:
        rt.node.set_meta(policy_version=step)
        publisher.offer(step, await asyncio.to_thread(actor.full_state_dict))

    def run_state() -> dict:
        return {"step": step, "total_steps": total[0] if total else None, "seed": cfg.seed, "dataset": cfg.dataset}

    while not total or step < total[0]:
        try:
            batch = await rt.shard.take_step(step, sources, timeout=cfg.step_timeout_s,
                                             min_version=step - cfg.max_staleness,
                                             alive=lambda _: any(rt.node.is_alive(i) for i in rollout_ids))
        except SourceLostError:
            if not all((m := rt.node.member(i)) is not None and m.state == "left" for i in rollout_ids):
                raise
            log.warning("trainer rank %d: every rollout node left the mesh (the cluster is being stopped); "
                        "saving a checkpoint at step %d", rank, step)
            break
        consumed[0] = step + 1
        trace.write(step=step, rank=rank, sample_ids=batch.sample_ids,
                    policy_versions=batch.tensors["policy_version"].tolist())
        stats = await asyncio.to_thread(train_step, actor, pipeline, batch)
        n, reward, stale = await asyncio.to_thread(step_summary, actor, batch, step)
        state = await asyncio.to_thread(actor.full_state_dict)
        publisher.offer(actor.version, state)
        now = time.perf_counter()
        rt.node.set_meta(policy_version=actor.version, step=step, samples_per_s=round(n / (now - t_last), 1))
        if writer is not None:
            writer.write({"step": step, "total_steps": total[0], "policy_version": actor.version,
                          "reward_mean": reward / max(n, 1), "samples": int(n),
                          "samples_per_s": n / (now - t_last), "staleness_mean": stale / max(n, 1),
                          "elapsed_s": now - t_start, "dropped_parts": sum(dropped.values()), **stats})
        t_last = now
        step += 1
        if cfg.save_every and step % cfg.save_every == 0 and step < total[0]:
            await asyncio.to_thread(actor.save_checkpoint, out_dir / f"checkpoint-{step}", state, run_state())

    final = state if step > first_step else await asyncio.to_thread(actor.full_state_dict)
    await asyncio.to_thread(actor.save_checkpoint, out_dir / "checkpoint", final, run_state())
    if writer is not None:
        await asyncio.to_thread(plot_reward_curve, writer.path, out_dir / "reward_curve.png")
    await publisher.flush(timeout=30)
    await publisher.close()
    rt.node.set_meta(state="done")
    await asyncio.to_thread(dist.barrier)
    dist.destroy_process_group()
    log.info("trainer rank %d: done after %d steps (dropped parts: %s)", rank, step, dropped)
