"""``distflow run``'s recovery of dead trainer ranks: every rank restarted from the newest checkpoint.

Why it exists: the ranks of a torch.distributed group cannot be replaced one by one, so a dead
trainer rank used to stop the whole run and wait for a person to ``resume_from`` its newest
checkpoint. The launcher now does that itself, up to ``recover_retries`` times, reusing the one
resume path (``resume_from``, :mod:`distflow.launch.checkpoint`): it kills the surviving ranks,
drops the metrics rows of the steps after the checkpoint (they are trained again), and starts
every trainer rank again with ``resume_from`` set. The rollout nodes keep running: they wait
for the trainers (:func:`distflow.core.launch_env.recovering_trainers`), see them back in new
lives, go back to the checkpoint's step, take its weights and generate the later steps again
with the same seeds (:mod:`distflow.rollout.worker`), so every prompt is trained exactly once.

:func:`distflow.launch.launcher.supervise` decides *when* (a trainer died); this module is *what*.
With replica groups (``trainer_replicas``) a dead group is restarted alone, the others untouched
(:meth:`TrainerRecovery.restart_replicas`): its ranks heal from a live group (torchft), no
checkpoint is read. The death of every group takes the recovery above.

docs/recovery.md tells the whole story.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from distflow.core.config import Config, replica_layout
from distflow.core.launch_env import HEAL_ENV, TRAINER_START_ENV
from distflow.launch.checkpoint import STATE_FILE, checkpoint_version, newest_checkpoint
from distflow.launch.children import Child, error_line, exit_text, kill_children
from distflow.launch.roles import trainers_recoverable

__all__ = ["TrainerRecovery"]


class TrainerRecovery:
    """The recoveries of one run: how many were made, and how to make the next one."""

    def __init__(self, cfg: Config, since: float):
        self.cfg, self.since = cfg, since  # since: the run's start (never another run's checkpoint)
        self.attempts = 0

    def possible(self, children: list[Child], dead: list[Child]) -> bool:
        """Whether the death of ``dead`` (non-empty) is recovered: trainer ranks only, a config that
        allows it (:func:`trainers_recoverable`), retries left, and rollout nodes still to generate
        (one that finished had the final weights: trainers restarted from an older step would wait
        for samples nobody makes any more, and stop short of the run's steps)."""
        finished = [c for c in children if c.role != "trainer" and c.proc.poll() == 0]
        return (trainers_recoverable(self.cfg) and all(c.role == "trainer" for c in dead) and not finished
                and self.attempts < self.cfg.recover_retries)

    def replica_groups(self, children: list[Child]) -> list[list[Child]]:
        """The trainer children in their replica groups (consecutive ranks, ``trainer_replicas``)."""
        trainers = sorted((c for c in children if c.role == "trainer"), key=lambda c: int(c.node_id.rsplit("-", 1)[1]))
        return [[trainers[i] for i in ranks] for ranks in replica_layout(len(trainers), self.cfg.trainer_replicas)]

    def restart_replicas(self, children: list[Child], dead: list[Child], tell: Callable[[str], None]) -> bool:
        """Restart only the replica groups ``dead`` (trainers of :meth:`possible`) belong to, when
        another group is wholly alive (one of them hosts torchft's lighthouse from then on): same
        ids, ports and environment plus ``HEAL_ENV`` (no ``resume_from``: they copy the live state
        from a peer), joining through the live nodes. A group's surviving ranks are killed first (a
        torch.distributed group cannot take a new member). Counted against ``recover_retries``.
        False: nothing done (the full recovery, or the stop, decides)."""
        if self.cfg.trainer_replicas == 1 or not self.possible(children, dead):
            return False
        groups = self.replica_groups(children)
        hit = [g for g, cs in enumerate(groups) if any(c in dead for c in cs)]
        live = [g for g, cs in enumerate(groups) if all(c.proc.poll() is None for c in cs)]
        if not live:
            return False
        restart = [c for g in hit for c in groups[g]]
        kill_children([c for c in restart if c.proc.poll() is None])
        self.attempts += 1
        first = dead[0]
        tell(f"distflow: {first.node_id} died ({exit_text(first.proc.returncode)}): {error_line(first.log_path)}; "
             f"restarting trainer replica group {', '.join(map(str, hit))} alone; it heals from the live "
             f"replica group {live[0]} (attempt {self.attempts}/{self.cfg.recover_retries}); the other trainers "
             "and the rollout nodes keep running")
        seeds = ",".join(f"{self.cfg.bind_host}:{c.port}" for c in children
                         if c not in restart and c.proc.poll() is None)
        for t in restart:
            t.start_again(f"recovery {self.attempts} of {self.cfg.recover_retries}: {t.node_id}'s replica group "
                          "heals from a live one", ("--seeds", seeds) if seeds else (),
                          env={HEAL_ENV: "1", TRAINER_START_ENV: str(self.attempts)})
        return True

    def replica_finished(self, children: list[Child]) -> bool:
        """With replica groups: whether one group has finished the run (each of its ranks exited 0:
        the final checkpoint is complete, ``trainer.replica_run.writes_final_checkpoint``). A group
        restarted to heal as the run ended has nothing left to train."""
        return self.cfg.trainer_replicas > 1 and any(all(c.proc.poll() == 0 for c in g)
                                                     for g in self.replica_groups(children))

    def checkpoint(self) -> Path | None:
        """The newest complete checkpoint of this run, else the ``resume_from`` it started from."""
        ckpt = newest_checkpoint(self.cfg.output_dir, self.since)
        if ckpt is None and self.cfg.resume_from and (Path(self.cfg.resume_from) / STATE_FILE).is_file():
            ckpt = Path(self.cfg.resume_from)
        return ckpt

    def recover(self, children: list[Child], dead: list[Child], tell: Callable[[str], None],
                rows_dropped: Callable[[int], None]) -> bool:
        """Kill every trainer rank and start them again from the newest checkpoint; False (nothing
        done: the run stops as before) when this run has none. ``rows_dropped(step)``: the metrics
        rows from ``step`` on were removed."""
        from distflow.trainer.metrics import MetricsWriter

        first = dead[0]
        why = f"{first.node_id} died ({exit_text(first.proc.returncode)}): {error_line(first.log_path)}"
        if self.checkpoint() is None:  # (the survivors are left to the usual stop, and to report what they saw)
            tell(f"distflow: {why}; no checkpoint of this run to restart the trainers from")
            return False
        trainers = [c for c in children if c.role == "trainer"]
        kill_children(trainers)  # the survivors first: a checkpoint they were writing counts only if complete
        ckpt = self.checkpoint()
        assert ckpt is not None  # (one was complete before the kill; none is removed by it)
        self.attempts += 1
        step = checkpoint_version(ckpt)
        out = Path(self.cfg.output_dir)
        for name in ("metrics.jsonl", "eval.jsonl"):  # as the restarted rank 0 will: the later steps come again
            if (out / name).is_file():
                MetricsWriter(out, resume_step=step, name=name)
        rows_dropped(step)
        tell(f"distflow: {why}; restarting the trainers from checkpoint step {step} ({ckpt}) (attempt "
             f"{self.attempts}/{self.cfg.recover_retries}); the rollout nodes keep running")
        # The mesh's seed was trainer-0 (dead too): the restarted ranks join through the live nodes.
        seeds = ",".join(f"{self.cfg.bind_host}:{c.port}" for c in children
                         if c.role != "trainer" and c.proc.poll() is None)
        for t in trainers:
            t.start_again(f"recovery {self.attempts} of {self.cfg.recover_retries}: {t.node_id} from {ckpt}",
                          (*(("--seeds", seeds) if seeds else ()), f"resume_from={ckpt}"),
                          env={TRAINER_START_ENV: str(self.attempts)})
        return True
