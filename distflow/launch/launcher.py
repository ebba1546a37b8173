"""``distflow run``: start a whole local cluster as real ``distflow-node`` processes, and supervise it.

The launcher only starts processes and hands them ``--seeds``, their GPUs
(``CUDA_VISIBLE_DEVICES``, from :mod:`distflow.launch.placement`) and the cluster secret (through
the environment, never the command line); it takes no part in the run. It shows progress
by tailing the ``metrics.jsonl`` that trainer rank 0 writes, and supervises like torchrun:

- a dead rollout node does not stop the run: the other rollout nodes adopt its shard
  (as on a hand-started cluster), and it is restarted with the same id and ports, up to
  ``restarts`` times;
- a dead node of a worker group (``worker_groups``) is restarted the same way; meanwhile
  the rollout nodes retry their sends to it;
- a dead trainer rank: every trainer rank is restarted from the newest complete checkpoint
  while the rollout nodes keep running (:mod:`distflow.launch.recovery`, up to ``recover_retries``
  times); after that, or without a checkpoint, or a dead controller, every node stops at once,
  and the message names it and the newest checkpoint to ``resume_from``;
- Ctrl-C (or SIGTERM, SIGHUP) stops the rollout nodes first, so the trainers save a final
  checkpoint at their last completed step and exit by themselves (bounded: then SIGTERM, then
  SIGKILL); before the first step has completed there is nothing to save: every node stops at once;
- a node that exits 2 (a configuration or data error: a restart would fail the same way) is
  not restarted: the run stops, naming it;
- on Linux each node gets SIGTERM when the launcher dies (``PR_SET_PDEATHSIG``), even by SIGKILL:
  the node asks for it first thing (:func:`distflow.launch.children.die_with_launcher`), not a
  ``preexec_fn`` in the launcher.

Inputs that cannot work are refused before any node starts (:func:`prepare`, exit 2): the
prompt set (read the way the rollout nodes read it), the model directory, ``resume_from``
(:mod:`distflow.launch.preflight`).

Here is the run's course (:func:`launch`, :func:`supervise`, :func:`stop_on_interrupt`); the
node processes themselves are :mod:`distflow.launch.children`, the progress bar
:mod:`distflow.launch.progress`.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import yaml

from distflow.core.auth import SECRET_ENV, new_secret
from distflow.core.config import Config, ConfigError
from distflow.core.launch_env import run_start
from distflow.launch.checkpoint import checkpoint_version, resume_hint
from distflow.launch.children import (Child, close_zygote, error_line, exit_text, start_children, stop_children,
                                      stop_for_checkpoint, tail, wait_all)
from distflow.launch.placement import plan_placement
from distflow.launch.preflight import check_functions, check_inputs
from distflow.launch.progress import Progress, eval_summary
from distflow.launch.recovery import TrainerRecovery
from distflow.launch.roles import RESTARTABLE
from distflow.launch.signals import catch_stop_signals, restore_signals, signum_of, stop_name

CONFIG_EXIT = 2  # a node's exit status on a configuration or data error (launch.node.exit_code_of): never restarted
# trainer_replicas: once one replica group finished the run, how long the others may take to end by themselves
# (their last step, the lighthouse's host waiting for them) before they are stopped (one restarted as the run
# ended would wait for peers that are gone)
REPLICA_GRACE_S = 30.0


def check_bind_host(host: str) -> None:
    """A ConfigError naming ``bind_host`` when this machine cannot bind ``host`` (not one of its
    addresses, a name that does not resolve): the search for free ports retried it for ever."""
    with socket.socket() as s:
        try:
            s.bind((host, 0))
        except OSError as e:  # socket.gaierror included
            raise ConfigError(f"bind_host: cannot bind {host!r} on this machine ({e})") from None


def _make_dir(path: Path, key: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        file = next((str(q) for q in (path, *path.parents) if q.is_file()), None)
        raise ConfigError(f"{key}: cannot create {str(path)!r}: " + (f"{file!r} is a file" if file else
                                                                     str(e.strerror or e))) from None


def build_toy_models(cfg: Config) -> None:
    """``toy_model: true``: the toy policy at model_path and the toy reward models the workflow names."""
    from distflow.toy import ensure_toy_model

    todo = [(cfg.model_path, cfg.toy_kind, "model_path")] if not (Path(cfg.model_path) / "config.json").is_file() else []
    if cfg.toy_kind == "successor":  # the toy reward models the workflow names (same tokenizer as the toy policy)
        todo += [(n.args["path"], "reward", f"workflow node {n.id!r}: args.path") for n in cfg.workflow
                 if (n.role.value, n.type.value) == ("REWARD", "MODEL_INFERENCE") and isinstance(n.args.get("path"), str)
                 and n.args["path"] and not (Path(n.args["path"]) / "config.json").is_file()]
    for path, kind, key in todo:
        _make_dir(Path(path), key)
        print(f"distflow: building the {'toy reward' if kind == 'reward' else f'{kind} toy'} model at {path}",
              file=sys.stderr)
        ensure_toy_model(path, kind=kind)


def prepare(cfg: Config) -> Path:
    """Check what can be checked before any node starts (workflow functions, bind_host, output_dir,
    the inputs: :func:`check_inputs`; a ConfigError naming the key, exit 2), build the toy model if
    asked, create output_dir and write the resolved config the children read."""
    check_functions(cfg)
    if cfg.bind_host in ("0.0.0.0", "::", "") and not cfg.advertise_host:
        raise ConfigError(f"bind_host: {cfg.bind_host or '(empty)'} binds every interface, but the nodes need an "
                          f"address to reach each other: set advertise_host too (or bind_host: 127.0.0.1)")
    check_bind_host(cfg.bind_host)
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir: {str(out)!r} is a file, not a directory")
    if cfg.toy_model:
        build_toy_models(cfg)
    if not Path(cfg.dataset).is_file():
        raise ConfigError(f"dataset: {cfg.dataset!r} " + ("is a directory, not a prompt file (.jsonl, .parquet)"
                                                          if Path(cfg.dataset).is_dir() else "not found"))
    for note in check_inputs(cfg):
        print(f"distflow: {note}", file=sys.stderr)
    _make_dir(out / "logs", "output_dir")
    resolved = out / "config.yaml"
    resolved.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return resolved


def _say(text: str) -> None:
    """A line on stderr; a terminal that is gone (SIGHUP) is no reason not to stop the nodes."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def launch(cfg: Config, in_process: bool = False, progress: bool = True) -> int:
    """Run ``cfg`` on a local cluster; the exit status: 0 done, 1 a node failed, 2 a node's
    configuration or data error, 128 + the signal when stopped by Ctrl-C, SIGTERM or SIGHUP.
    Raises ConfigError (exit 2) for what it refuses before any node starts."""
    config_path = prepare(cfg)
    placement = None if in_process else plan_placement(cfg)  # refuses an impossible placement before anything starts
    secret = os.environ.get(SECRET_ENV) or new_secret()
    metrics = Path(cfg.output_dir) / "metrics.jsonl"
    from distflow.launch.placement import describe
    from distflow.trainer.metrics import MetricsWriter, read_metrics

    if not cfg.resume_from:
        metrics.unlink(missing_ok=True)
        metrics.with_name("eval.jsonl").unlink(missing_ok=True)  # never a previous run's evaluation
    else:  # the rows before the checkpoint's step stay, as trainer rank 0 keeps them (later ones are trained again)
        step = checkpoint_version(Path(cfg.resume_from))  # the resume_step the trainer uses (its version)
        for name in ("metrics.jsonl", "eval.jsonl"):
            MetricsWriter(metrics.parent, resume_step=step, name=name)
    bar = Progress(metrics, enabled=progress and sys.stderr.isatty(), skip_existing=True)
    if placement is None:
        return _in_process(cfg, bar)
    print(f"distflow: {describe(placement)}", file=sys.stderr)
    rows_at_start = bar.seen  # a resumed run's earlier steps
    children: list[Child] = []
    previous = catch_stop_signals()
    try:
        children = start_children(cfg, config_path, secret, placement)
        seed = f"{cfg.bind_host}:{children[0].port}"
        hint = ("" if os.environ.get(SECRET_ENV) else
                f" (export {SECRET_ENV} before `distflow run` to be able to do that: this run's secret is random)")
        extra = "".join(f" + {n} {g}" for g, n in cfg.worker_groups.items())
        print(f"distflow: {cfg.rollout_nodes} rollout{extra} + {cfg.trainer_nodes} trainer nodes, logs in "
              f"{Path(cfg.output_dir) / 'logs'}; watch with `distflow status --seeds {seed}`{hint}", file=sys.stderr)
        code = supervise(cfg, children, bar)
        bar.poll()
    except KeyboardInterrupt as why:  # Ctrl-C, or SIGTERM / SIGHUP (Interrupted)
        bar.close()
        stepped = len(read_metrics(metrics)) > rows_at_start  # a step of this run completed: save it
        code = stop_on_interrupt(cfg, children, why, checkpoint=stepped)
        plot_trained(cfg)
        return code
    except BaseException:  # the launcher itself failed: never leave the nodes running detached
        print("distflow: the launcher failed; stopping every node", file=sys.stderr)
        stop_children(children, grace_s=5.0)
        raise
    finally:
        bar.close()
        restore_signals(previous)
        close_zygote(children)
    if code:
        plot_trained(cfg)
        return code
    print(done_message(cfg, bar), file=sys.stderr)
    return 0


def plot_trained(cfg: Config) -> None:
    """A run that failed or was stopped: reward_curve.png and timings.png of the steps it trained
    (trainer rank 0 writes them only at the end of a run that completed), so the plots are never
    lost with the run. Nothing when no step was trained; a plot that fails is one line."""
    from distflow.trainer.metrics import plot_reward_curve, plot_timings, read_metrics

    out = Path(cfg.output_dir)
    metrics, evals = out / "metrics.jsonl", out / "eval.jsonl"
    if not read_metrics(metrics):
        return
    try:
        plot_reward_curve(metrics, out / "reward_curve.png", evals if evals.is_file() else None)
        plot_timings(metrics, out / "timings.png")
    except Exception as e:  # noqa: BLE001 - a plot is no reason to hide the run's own exit status
        _say(f"distflow: could not plot the trained steps: {type(e).__name__}: {e}")
        return
    _say(f"distflow: plots of the {len(read_metrics(metrics))} trained steps: {out / 'reward_curve.png'}, "
         f"{out / 'timings.png'}")


def done_message(cfg: Config, bar: Progress) -> str:
    """The end of a run that completed: its steps, final reward, evaluation, bad rows and outputs."""
    last = bar.last or {}
    gen = f" (generated {last['generated_reward_mean']:.3f})" if "generated_reward_mean" in last else ""
    return (f"distflow: done. {last.get('step', -1) + 1} steps, final reward "
            f"{last.get('reward_mean', float('nan')):.3f}{gen}{eval_summary(Path(cfg.output_dir) / 'eval.jsonl')}"
            f"{bar.summary()}; metrics {bar.path}, checkpoint {Path(cfg.output_dir) / 'checkpoint'}")


def _in_process(cfg: Config, bar: Progress) -> int:
    """``--in-process``: the nodes run in this thread's loop; a thread feeds the same progress (bar or
    step lines) from metrics.jsonl, and a completed run ends with the same summary as ``distflow run``."""
    import threading

    from distflow.launch.inprocess import run_in_process

    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.5):
            bar.poll()

    watcher = threading.Thread(target=watch, name="distflow-progress", daemon=True)
    watcher.start()
    try:
        code = run_in_process(cfg)
    finally:
        stop.set()
        watcher.join(5)
        bar.poll()
        bar.close()
    if code == 0:
        print(done_message(cfg, bar), file=sys.stderr)
    else:
        plot_trained(cfg)
    return code


def stop_on_interrupt(cfg: Config, children: list[Child], why: KeyboardInterrupt, checkpoint: bool) -> int:
    """Stop the run on Ctrl-C (or SIGTERM/SIGHUP: :class:`Interrupted`); returns 128 + the signal.
    ``checkpoint``: a step has completed, so the trainers save it (:func:`stop_for_checkpoint`);
    else there is nothing to save, and trainers still forming their group would wait for the
    rollout nodes up to join_timeout_s: every node stops at once. A second signal stops every
    node at once."""
    name, code = stop_name(signum_of(why)), 128 + signum_of(why)
    try:
        if checkpoint:
            # A big model's save takes minutes: the trainers get as long as any of their collectives may take.
            _say(f"\ndistflow: interrupted ({name}); stopping the rollout nodes, the trainers save a checkpoint (up to "
                 f"{cfg.step_timeout_s:.0f}s, step_timeout_s; {name} again to stop at once)")
            stop_for_checkpoint(children, grace_s=cfg.step_timeout_s)
        else:
            _say(f"\ndistflow: interrupted ({name}) before the first step completed (nothing to save); stopping "
                 f"every node now")
            stop_children(children)
    except KeyboardInterrupt:  # a second Ctrl-C: do not wait for the checkpoint
        _say("distflow: interrupted again; stopping every node now")
        stop_children(children, grace_s=5.0)
    _say(f"distflow: stopped. {resume_hint(cfg.output_dir, cfg.resume_from, run_start())}")
    return code


def _report(failed: list[Child], cfg: Config, why: str, bar: Progress | None = None) -> None:
    lines = [f"distflow: {c.node_id} failed ({exit_text(c.proc.returncode)}): {error_line(c.log_path)}"
             for c in failed]
    first = failed[0]
    hint = resume_hint(cfg.output_dir, cfg.resume_from, run_start())
    _tell(bar, "\n".join(lines) + f"\ndistflow: {why}; stopping the other nodes. {hint}\n"
               f"--- last lines of {first.log_path} ---\n{tail(first.log_path)}")


def _tell(bar: Progress | None, text: str) -> None:
    """A message on its own lines: over a progress bar, the bar's line is cleared first (and redrawn
    after), so the message is never glued onto it."""
    if bar is not None:
        bar.write(text)
    else:
        print(text, file=sys.stderr)


def supervise(cfg: Config, children: list[Child], bar: Progress | None = None, poll_s: float = 0.2) -> int:
    """Watch the children until the run ends; restart dead rollout nodes (not one that exited
    ``CONFIG_EXIT``: that stops the run, exit 2), and every trainer rank from the newest checkpoint
    when one dies (:class:`TrainerRecovery`, up to ``recover_retries`` times). Returns the exit code."""
    trainers = [c for c in children if c.role == "trainer"]
    handled: set[int] = set()  # pids of dead rollout processes already dealt with
    recovery = TrainerRecovery(cfg, run_start())
    while True:
        if bar is not None:
            bar.poll()
        codes = {c.node_id: c.proc.poll() for c in children}
        if all(codes[t.node_id] == 0 for t in trainers):
            break  # the trainers finished: the run is done
        if recovery.replica_finished(children):  # a replica group finished the run: the others' last moments
            if not wait_all([t for t in trainers if t.proc.poll() is None], REPLICA_GRACE_S):
                stop_children([t for t in trainers if t.proc.poll() is None])
            break
        misconfigured = [c for c in children if codes[c.node_id] == CONFIG_EXIT]
        if misconfigured:  # deterministic: a restart would fail the same way, and so would the adopters of its work
            _report(misconfigured, cfg, f"{misconfigured[0].node_id} exited {CONFIG_EXIT} on a configuration or data "
                                        f"error, which a restart would not fix: not restarted, the run stops", bar)
            stop_children(children)
            return CONFIG_EXIT
        fatal = [c for c in children if c.role not in RESTARTABLE and codes[c.node_id] not in (None, 0)]
        if fatal and recovery.restart_replicas(children, fatal, lambda text: _tell(bar, text)):
            continue  # trainer_replicas: only the dead replica group, healing from a live one
        if fatal and recovery.possible(children, fatal):  # every trainer rank again, from the newest checkpoint
            if recovery.recover(children, fatal, lambda text: _tell(bar, text),
                                lambda step: bar.rows_dropped() if bar is not None else None):
                continue
        if fatal:
            time.sleep(1.0)  # let the nodes that saw the failure report what they saw
            failed = fatal + [c for c in children if c not in fatal and c.proc.poll() not in (None, 0)]
            used = f" (after {recovery.attempts} recoveries, recover_retries)" if recovery.attempts else ""
            _report(failed, cfg, f"{fatal[0].role} {fatal[0].node_id} died, the run cannot go on without it{used}",
                    bar)
            stop_children(children)
            return 1
        trainers_running = all(codes[t.node_id] is None for t in trainers)
        for c in children:
            rc = codes[c.node_id]
            if c.role not in RESTARTABLE or rc in (None, 0) or c.proc.pid in handled or not trainers_running:
                continue
            handled.add(c.proc.pid)
            why = f"{c.node_id} died ({exit_text(rc)}): {error_line(c.log_path)}"
            if c.restarts >= cfg.restarts:
                _report([c], cfg, f"{c.node_id} used up its {cfg.restarts} restarts (restarts: {cfg.restarts})", bar)
                stop_children(children)
                return 1
            meanwhile = ("its shard is adopted by the other rollout nodes" if c.role == "rollout" else
                         "the rollout nodes retry their sends to it until it is back")
            _tell(bar, f"distflow: {why}; {meanwhile}; restarting it with the same id and ports "
                       f"(restart {c.restarts + 1} of {cfg.restarts})")
            c.respawn()
        time.sleep(poll_s)
    # The trainers are done: the rollout nodes stop on the final version within a moment (a
    # restarted one still joining never will: it is stopped).
    rest = [c for c in children if c.role != "trainer"]
    if not wait_all(rest, 5.0):
        stop_children(rest)
    return 0
