"""A checkpoint's run state, torch-free: the one owner of ``distflow_state.json``.

Why it exists: the launcher (which checkpoint to name after a stop), the checks before a run
(is ``resume_from`` one this config can continue) and the trainer (which writes the file and
reads it back on resume) all need the same answers, and the launcher must give them without
importing torch. So the file's name, its writing (written last, atomically: a directory
counts as a checkpoint only once it holds the file), its reading and validation (the data
order: which prompt rows step k reads), and the "newest complete checkpoint" lookup live
here. The torch side of a checkpoint (model weights, optimizer shards) stays in the trainer
(:meth:`distflow.trainer.actor.Actor.save_checkpoint`, :func:`distflow.trainer.stages.save_checkpoint`),
which calls :func:`unmark_checkpoint` before it writes and :func:`mark_checkpoint` after.

A leaf: it imports only the config, so a node may read it without importing the launcher.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from distflow.core.config import Config

log = logging.getLogger(__name__)

__all__ = ["DATA_ORDER_KEYS", "STATE_FILE", "PeriodicSaves", "check_data_order", "checkpoint_version", "data_order",
           "mark_checkpoint", "newest_checkpoint", "prune_checkpoints", "read_run_state", "resume_hint",
           "unmark_checkpoint"]

STATE_FILE = "distflow_state.json"  # written last by trainer rank 0: its presence makes a directory a checkpoint
# What decides which prompt rows step k reads (distflow.buffer.dataloader: the permutation seeded by (seed,
# epoch), identity without shuffle, of the prompt set's rows, cut into prompts_per_step slices; rollout_nodes
# only splits a step's rows among the nodes). Recorded as the checkpoint's ``data_order``, compared on resume.
DATA_ORDER_KEYS = ("seed", "shuffle", "prompts_per_step")


# ---------------------------------------------------------------------- writing (trainer rank 0)
def unmark_checkpoint(out_dir: Path) -> None:
    """Rank 0, before a checkpoint's first write: a directory being (re)written is not a
    checkpoint until :func:`mark_checkpoint` (a kill mid-write leaves no stale marker behind)."""
    (out_dir / STATE_FILE).unlink(missing_ok=True)


def mark_checkpoint(out_dir: Path, run_state: dict[str, Any]) -> None:
    """Rank 0, after every part of a checkpoint is on disk (the optimizer shards' DCP save ends
    in a collective): ``distflow_state.json``, written to a temporary name and renamed, so the
    marker is either absent or whole. ``run_state`` carries ``policy_version`` and the data position."""
    tmp = out_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(run_state, indent=1))
    os.replace(tmp, out_dir / STATE_FILE)


class PeriodicSaves:
    """When a trainer saves between steps: every ``save_every`` steps (kept), and, by default, every
    ``save_interval_s`` seconds (only the newest of those kept), so that the default run loses little
    training to one dead trainer. Never so often that saving costs more than 1/:data:`COST_SHARE` of the
    run: the interval is at least that many times the last save's duration (the time the trainer was
    blocked: with background writes, the copy to host memory; a big model's save spaces them out; a
    toy's, every ``save_interval_s``). Each rank asks :meth:`due` with its own clock; the trainers agree
    by reducing the answer with MAX (one scalar, next to a step's own collectives: not noticed), so
    every rank saves at the same step. :meth:`saved` (after the save returned) answers what to remove
    once that checkpoint is complete (rank 0 runs it then): the previous time-based checkpoint of this
    run, and with ``keep_checkpoints: N`` every ``checkpoint-K`` of this run but the N newest."""

    COST_SHARE = 20  # a save takes at most 5% of the run's time

    def __init__(self, cfg: Config, clock=time.monotonic, since: float | None = None):
        self.every, self.interval, self.clock = cfg.save_every, cfg.save_interval_s, clock
        self.keep = cfg.keep_checkpoints
        self.since = since  # the run's start (wall clock): an earlier run's checkpoints are never removed
        self.last = self.asked = clock()
        self.cost = 0.0  # the last save's duration (seconds)
        self.previous: Path | None = None  # the last time-based checkpoint this run wrote

    def due(self, step: int, total: int | None) -> bool:
        """This rank's view: a save after ``step`` steps (not after the last: the final checkpoint follows)."""
        if total is not None and step >= total:
            return False
        self.asked = self.clock()
        wait = max(self.interval, self.COST_SHARE * self.cost)
        return bool(self.every and step % self.every == 0) or bool(self.interval and self.asked - self.last >= wait)

    def name(self, step: int) -> str:
        return f"checkpoint-{step}"

    def saved(self, out_dir: Path, step: int, remove: bool) -> Callable[[], None]:
        """After the save at ``step`` returned; ``remove`` (rank 0): the answer removes the previous
        time-based one (unless ``save_every`` keeps this one or that) and what ``keep_checkpoints``
        does not keep. Run it once this checkpoint is complete, never before."""
        self.last = self.clock()
        self.cost = self.last - self.asked
        kept = bool(self.every and step % self.every == 0)
        previous = self.previous if self.previous != out_dir / self.name(step) else None
        self.previous = None if kept else out_dir / self.name(step)
        if not remove:
            return lambda: None

        def prune() -> None:
            if previous is not None:
                shutil.rmtree(previous, ignore_errors=True)
            if self.keep:
                prune_checkpoints(out_dir, self.keep, self.since)

        return prune

    def superseded(self, remove: bool) -> Callable[[], None]:
        """After the final checkpoint (``remove``: rank 0): what removes the last time-based one, no
        longer needed once the final one is complete."""
        previous, self.previous = self.previous, None
        return (lambda: shutil.rmtree(previous, ignore_errors=True)) if remove and previous is not None else \
            (lambda: None)


def prune_checkpoints(out_dir: Path, keep: int, since: float | None = None) -> list[Path]:
    """Remove every complete ``checkpoint-K`` of ``out_dir`` (marked since ``since``: this run's)
    but the ``keep`` newest (by policy version); returns the removed ones. The final ``checkpoint/``,
    another run's checkpoints and one being written (no marker yet) are never touched."""
    found = []
    for d in out_dir.glob("checkpoint-*"):
        try:
            found.append((checkpoint_version(d), (d / STATE_FILE).stat().st_mtime, d))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    mine = sorted((f for f in found if since is None or f[1] >= since), reverse=True)
    removed = [d for _, _, d in mine[keep:]]
    for d in removed:
        shutil.rmtree(d, ignore_errors=True)
    return removed


# ---------------------------------------------------------------------- reading and validation
def read_run_state(ckpt: Path, cfg: Config) -> dict[str, Any]:
    """``resume_from``'s run state (``distflow_state.json``), refused (ValueError naming the keys)
    when ``cfg`` would read other prompts at its step than the run that wrote it
    (:func:`check_data_order`; the row count is checked once the rollout nodes report it). A
    checkpoint of an older DistFlow records no ``data_order``: its ``seed`` is checked, with a warning."""
    state_file = ckpt / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"resume_from {str(ckpt)!r}: no {STATE_FILE} (not a DistFlow checkpoint)")
    state = json.loads(state_file.read_text())
    saved = state.get("data_order")
    if not isinstance(saved, dict):
        saved = {k: state[k] for k in ("seed", "dataset") if k in state}
        log.warning("resume_from %s: the checkpoint records no data order (an older DistFlow wrote it): make sure "
                    "shuffle, prompts_per_step and the dataset are those it was trained with, or its step %s reads "
                    "other prompts", ckpt, state.get("policy_version"))
    if saved.get("dataset") not in (None, cfg.dataset):
        log.warning("resume_from %s: dataset %r, the checkpoint's was %r (taken for the same prompt set, moved; "
                    "its row count is checked)", ckpt, cfg.dataset, saved["dataset"])
    check_data_order(ckpt, int(state["policy_version"]), saved, data_order(cfg, None))
    return state


def data_order(cfg: Config, num_rows: int | None) -> dict[str, Any]:
    """A checkpoint's ``data_order``: the config keys that decide which rows a step reads, the
    prompt set and its row count (None while no rollout node has reported it)."""
    return {**{k: getattr(cfg, k) for k in DATA_ORDER_KEYS}, "dataset": cfg.dataset, "num_rows": num_rows}


def check_data_order(ckpt: Path, step: int, saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Refuse (ValueError) to resume ``ckpt`` at ``step`` when ``now`` (part of a :func:`data_order`)
    differs from the checkpoint's ``saved`` one in a key both know: step k would read other rows
    than in the run that wrote it (re-reading or skipping prompts). The message names each key,
    both values, and what to set back. Another ``dataset`` path alone is no difference (the file
    may have moved; :func:`read_run_state` warns): its row count is compared."""
    known = [k for k in now if k in saved and now[k] is not None and saved[k] is not None]
    diff = [k for k in known if k != "dataset" and now[k] != saved[k]]
    if not diff:
        return
    if "num_rows" in diff and "dataset" in known and now["dataset"] != saved["dataset"]:
        diff.append("dataset")
    fixes = [f"{k}: {json.dumps(saved[k])}" for k in diff if k in DATA_ORDER_KEYS]
    if "num_rows" in diff:
        fixes.append(f"dataset: {saved.get('dataset', '(the one it was trained on)')} (its {saved['num_rows']} rows)")
    was = ", ".join(f"{k} {now[k]!r} (checkpoint: {saved[k]!r})" for k in diff)
    raise ValueError(f"resume_from {str(ckpt)!r}: the data order differs from the run that wrote this checkpoint: "
                     f"{was}; its step {step} would read other prompts than that run's (re-reading or skipping "
                     f"some). Set {', '.join(fixes)} back, or start a new run from these weights "
                     f"(model_path: {ckpt}, without resume_from)")


# ---------------------------------------------------------------------- which checkpoint (the launcher)
def checkpoint_version(ckpt: Path) -> int:
    """The policy version (= trained steps) checkpoint ``ckpt`` holds; raises OSError, ValueError,
    KeyError or TypeError when it is no complete checkpoint."""
    return int(json.loads((ckpt / STATE_FILE).read_text())["policy_version"])


def newest_checkpoint(output_dir: str | Path, since: float | None = None) -> Path | None:
    """The checkpoint of ``output_dir`` with the highest policy version (``checkpoint``,
    ``checkpoint-N``), complete enough to ``resume_from``; None when there is none. ``since``
    (a wall-clock time: the run's start) leaves out the checkpoints marked before it: those of an
    earlier run in the same output_dir, which a run that saved nothing must not offer as its own."""
    best: tuple[int, float, Path] | None = None
    for d in Path(output_dir).glob("checkpoint*"):
        try:
            key = (checkpoint_version(d), (d / STATE_FILE).stat().st_mtime, d)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if since is not None and key[1] < since:
            continue
        if best is None or key[:2] > best[:2]:
            best = key
    return best[2] if best else None


def resume_hint(output_dir: str | Path, resume_from: str | None = None, since: float | None = None) -> str:
    """What to resume from after a stop: the newest checkpoint of ``output_dir`` (written since
    ``since``, the run's start, when given: never another run's), else the one this run resumed
    from (``resume_from``, when it is a checkpoint: it holds distflow_state.json), else none."""
    ckpt = newest_checkpoint(output_dir, since)
    if ckpt is None and resume_from and (Path(resume_from) / STATE_FILE).is_file():
        return f"no newer checkpoint was saved; continue with resume_from={resume_from}"
    if ckpt is None:
        return ("no checkpoint was saved yet (one is saved every save_interval_s seconds and every save_every "
                "steps); restart from scratch")
    return f"newest checkpoint {ckpt}: continue with resume_from={ckpt}"
