"""What ``distflow run`` shows while the nodes train: a progress bar (or plain lines) fed by
the ``metrics.jsonl`` and ``eval.jsonl`` that trainer rank 0 writes, and the end-of-run summary.

Why it exists: the launcher takes no part in the run, so all it knows of the training is
what rank 0 appends to those files; reading them and saying it well is this module's one job.
"""

from __future__ import annotations

import sys
from pathlib import Path


# The bar's line: the percentage, the bar, the count and times, and the reward (the postfix). Every other
# figure of a step (samples/s, staleness, stage times) is on the status line above it: in the postfix they
# squeezed the bar to one character even at 160 columns.
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"


def bar_postfix(r: dict) -> str:
    """The bar line's postfix for metrics row ``r``: the reward (and the generated one, when the
    trained reward is another: a filter, a shaping). Short: at 80 columns the bar keeps 17."""
    gen = f" (gen {r['generated_reward_mean']:.3f})" if "generated_reward_mean" in r else ""
    return f"reward {r['reward_mean']:.3f}{gen}"


def status_line(r: dict) -> str:
    """The line above the bar for metrics row ``r``: throughput, staleness, bad rows, the stage times."""
    from distflow.core.status import format_stages

    stages, bad = format_stages(r), int(r.get("bad_rows") or 0)
    return (f"step {r['step'] + 1}: {r['samples_per_s']:.0f} samples/s, staleness {r['staleness_mean']:.2f}"
            + (f", bad_rows {bad}" if bad else "") + (f" | {stages}" if stages else ""))


class Progress:
    """A progress bar fed by metrics.jsonl (or plain lines when not a terminal), with a status line
    above it (:func:`status_line`)."""

    def __init__(self, metrics_path: Path, enabled: bool, skip_existing: bool = False):
        from tqdm import tqdm

        from distflow.trainer.metrics import read_metrics

        # skip_existing: a resumed run's rows before its checkpoint are not shown again
        self.path, self.seen = metrics_path, len(read_metrics(metrics_path)) if skip_existing else 0
        self.status = tqdm(total=0, bar_format="{desc}", desc="", position=0, leave=False, disable=not enabled,
                           dynamic_ncols=True)
        self.bar = tqdm(total=None, unit="step", desc="training", disable=not enabled, dynamic_ncols=True,
                        bar_format=BAR_FORMAT, position=1)
        self.plain = not enabled
        self.last: dict | None = None
        self.bad_rows = 0  # rows skipped (bad_rows: skip) over the run
        self.empty_steps = 0  # steps that trained on 0 samples while rows were skipped
        self.eval_path = metrics_path.with_name("eval.jsonl")  # held-out evaluation rows
        self.evals_seen = len(read_metrics(self.eval_path)) if skip_existing else 0

    def poll(self) -> None:
        from distflow.core.status import format_stages
        from distflow.trainer.metrics import read_metrics

        rows = read_metrics(self.path)
        for r in rows[self.seen:]:
            self.last = r
            if self.bar.total is None and "total_steps" in r:
                self.bar.total = r["total_steps"]
            self.bar.update(1)
            stages = format_stages(r)
            gen = {"generated": f"{r['generated_reward_mean']:.3f}"} if "generated_reward_mean" in r else {}
            bad = int(r.get("bad_rows") or 0)
            self.bad_rows += bad
            self.status.set_description_str(status_line(r), refresh=False)
            self.bar.set_postfix_str(bar_postfix(r), refresh=False)
            if self.plain:
                generated = "".join(f"{k}={v} " for k, v in gen.items())
                print(f"step {r['step'] + 1}/{r.get('total_steps', '?')} reward={r['reward_mean']:.3f} {generated}"
                      f"loss={r.get('loss', 0):.4f} samples/s={r['samples_per_s']:.0f} "
                      f"staleness={r['staleness_mean']:.2f}" + (f" bad_rows={bad}" if bad else "")
                      + (f" [{stages}]" if stages else ""), flush=True)
            if bad and not r.get("samples"):
                self.empty_steps += 1
                self.bar.write(f"distflow: WARNING: step {r['step'] + 1} trained on 0 samples: its {bad} bad rows "
                               f"were skipped (bad_rows: skip; the rollout logs name them)", file=sys.stderr)
        if rows[self.seen:]:
            self.status.refresh()
            self.bar.refresh()
        self.seen = len(rows)
        evals = read_metrics(self.eval_path) if self.eval_path.is_file() else []
        for e in evals[self.evals_seen:]:
            mean, failed = e.get("eval_reward_mean"), e.get("eval_failed_shards")
            self.bar.write(f"eval at step {e.get('step')}: reward {'-' if mean is None else f'{mean:.3f}'} over "
                           f"{e.get('eval_samples')} held-out samples"
                           + (f" ({failed} eval shard(s) failed: the rollout logs name the error)" if failed else "")
                           + ("" if e.get("eval_shards") == e.get("eval_num_shards")
                              else f" (partial: {e.get('eval_shards')} of {e.get('eval_num_shards')} shards)"))
        self.evals_seen = len(evals)

    def rows_dropped(self) -> None:
        """metrics.jsonl lost its rows after a checkpoint's step (trainers recovered from it): the
        rows written from now on are new, whatever their count."""
        from distflow.trainer.metrics import read_metrics

        self.seen = min(self.seen, len(read_metrics(self.path)))

    def write(self, text: str) -> None:
        """``text`` on stderr on its own lines: a drawn bar is cleared first and redrawn below it."""
        try:
            self.bar.write(text, file=sys.stderr)
        except (OSError, ValueError):  # the terminal is gone (SIGHUP)
            pass

    def summary(self) -> str:
        """The bad rows of the run, for the done message ("" when none)."""
        if not self.bad_rows:
            return ""
        empty = (f"; WARNING: {self.empty_steps} step(s) trained on 0 samples (every row bad)"
                 if self.empty_steps else "")
        return f"; {self.bad_rows} bad rows skipped (bad_rows: skip){empty}"

    def close(self) -> None:
        try:
            self.status.close()
            self.bar.close()
        except (OSError, ValueError):  # the terminal is gone (SIGHUP)
            pass


def eval_summary(path: Path) -> str:
    """", held-out eval 0.12 -> 0.87 (steps 0-100)" from eval.jsonl, or "" without an evaluation."""
    from distflow.trainer.metrics import eval_curve

    curve, incomplete = eval_curve(path)
    left_out = f"; {incomplete} partial or failed row(s) left out" if incomplete else ""
    if not curve:
        return f", held-out eval: no complete evaluation ({path}{left_out})" if incomplete else ""
    (s0, r0), (s1, r1) = curve[0], curve[-1]
    return f", held-out eval {r0:.3f} -> {r1:.3f} (steps {s0}-{s1}, {path}{left_out})"
