"""Held-out evaluation: its points, its config keys, the report arithmetic, trainer rank 0's book,
and one rollout node's evaluation of a real (toy) model through the real stages.

The whole path (rollout nodes -> trainer rank 0 -> eval.jsonl, in real processes) runs in the
shipped quickstart (tests/test_cluster.py::test_quickstart_learns), which evaluates every 25 steps.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from pathlib import Path

import pytest
import torch
import yaml

from distflow.buffer.batch import SampleBatch
from distflow.core.config import Config, ConfigError, load_config, read_raw
from distflow.launch.preflight import check_dataset
from distflow.launch.progress import eval_summary
from distflow.rl.eval_report import due_point, eval_points, eval_progress, eval_row, report_meta, report_problem, summarize
from distflow.rollout.evaluation import eval_pipeline, eval_shard, evaluate
from distflow.trainer.evaluation import EvalBook
from distflow.trainer.metrics import MetricsWriter, read_metrics

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "grpo_quickstart.yaml"
EVAL_FILE = ROOT / "examples" / "data" / "successor_eval.jsonl"


def quickstart(**update) -> Config:
    raw = read_raw(QUICKSTART)
    raw.update(update)
    return Config.model_validate(raw)


def write_config(tmp_path: Path, **update) -> Path:
    raw = read_raw(QUICKSTART)
    raw.update(update)
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


# ------------------------------------------------------------------------------ points and config
@pytest.mark.parametrize("update, start, total, want", [
    ({"eval_every": 25}, 0, 100, [0, 25, 50, 75, 100]),
    ({"eval_every": 30}, 0, 100, [0, 30, 60, 90, 100]),
    ({"eval_every": 0}, 0, 100, [0, 100]),
    ({"eval_every": 25, "eval_before_train": False}, 0, 100, [25, 50, 75, 100]),
    ({"eval_every": 25}, 40, 100, [40, 50, 75, 100]),  # a resumed run starts at its checkpoint's step
    # resumed at a multiple: its row went with the later ones (trained again), so it is evaluated again
    ({"eval_every": 25, "eval_before_train": False}, 50, 100, [50, 75, 100]),
    ({"eval_every": 25}, 0, 25, [0, 25]),
    ({"eval_dataset": None, "eval_every": 0}, 0, 100, []),
])
def test_eval_points(update, start, total, want):
    raw = {"eval_dataset": str(EVAL_FILE), **update}
    assert eval_points(quickstart(**raw), start, total) == want


def test_a_node_whose_weights_jumped_evaluates_the_newest_point_reached():
    assert due_point([0, 25, 50], 0) == 0
    assert due_point([25, 50], 24) is None
    assert due_point([25, 50, 75], 51) == 50  # 25 was passed while generating: only 50 is evaluated
    assert due_point([], 10) is None


@pytest.mark.parametrize("update, needle", [
    ({"eval_every": 10}, "eval_every: set, but there is no eval_dataset"),
    ({"eval_temperature": 0.5}, "eval_temperature: set, but there is no eval_dataset"),
    ({"eval_dataset": "E", "eval_every": -1}, "eval_every"),
    ({"eval_dataset": "E", "eval_samples_per_prompt": 0}, "eval_samples_per_prompt"),
    ({"eval_dataset": "E", "workflow": [
        {"id": "generate", "role": "ACTOR", "type": "MODEL_INFERENCE", "fn": "generate"},
        {"id": "reward", "role": "REWARD", "type": "COMPUTE", "fn": "successor", "deps": ["generate"],
         "group": "scorers"},
        {"id": "advantage", "role": "ACTOR", "type": "COMPUTE", "fn": "grpo", "deps": ["reward"]},
        {"id": "reference", "role": "REFERENCE", "type": "MODEL_INFERENCE", "fn": "ref_logprob",
         "deps": ["generate"]},
        {"id": "update", "role": "ACTOR", "type": "MODEL_TRAIN", "fn": "grpo", "deps": ["advantage", "reference"]}],
      "worker_groups": {"scorers": 1}}, "workflow nodes ['reward'] run on another group"),
])
def test_eval_keys_are_checked_naming_the_key(tmp_path, update, needle):
    update = {k: (str(EVAL_FILE) if v == "E" else v) for k, v in update.items()}
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(write_config(tmp_path, **{"eval_dataset": None, "eval_every": 0, **update}))


def test_eval_dataset_rows_are_checked_before_the_run(tmp_path):
    bad = tmp_path / "eval.jsonl"
    bad.write_text('{"prompt": "12=", "answer": "3"}\n{"question": "no prompt key"}\n')
    with pytest.raises(ConfigError, match=r"eval_dataset: .*eval.jsonl:2: missing required key 'prompt'"):
        check_dataset(quickstart(eval_dataset=str(bad)))
    assert "eval_dataset: 1 of the 2 rows checked are bad" in check_dataset(
        quickstart(eval_dataset=str(bad), bad_rows="skip"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="eval_dataset: .*no rows"):
        check_dataset(quickstart(eval_dataset=str(tmp_path / "empty.jsonl")))
    with pytest.raises(ConfigError, match="eval_dataset: .*not found"):
        check_dataset(quickstart(eval_dataset=str(tmp_path / "missing.jsonl")))


# ------------------------------------------------------------------------------ report arithmetic
def scored(prompts: list[str], rewards: list[float], lens: list[int], truncated: list[int]) -> SampleBatch:
    n = len(prompts)
    b = SampleBatch.from_lists([f"{p}:s{i}" for i, p in enumerate(prompts)], prompts, [[1, 2]] * n,
                               [[5] * k for k in lens], [[0.0] * k for k in lens], policy_version=[0] * n)
    b.set_scalar("reward", torch.tensor(rewards))
    b.set_scalar("truncated", torch.tensor(truncated, dtype=torch.int64))
    return b


def test_summary_sums_rewards_best_of_n_truncation_and_lengths():
    s = summarize(scored(["a", "a", "b", "b", "c", "c"], [1.0, 0.0, 0.0, 0.0, 0.5, -1.0], [3, 1, 2, 2, 4, 4],
                         [1, 0, 0, 0, 1, 1]))
    assert s == {"samples": 6, "prompts": 3, "reward_sum": pytest.approx(0.5), "best_sum": pytest.approx(1.5),
                 "truncated": 3, "response_tokens": 16}


def report(point, shard, version, samples, prompts, reward_sum, best_sum=None, seconds=1.0):
    summary = {"samples": samples, "prompts": prompts, "reward_sum": reward_sum,
               "best_sum": reward_sum if best_sum is None else best_sum, "truncated": 0,
               "response_tokens": 3 * samples, "skipped_prompts": 0, "seconds": seconds}
    return report_meta(point, shard, version, summary, 2)


def test_a_point_is_the_mean_over_every_sample_not_of_shard_means():
    row = eval_row(10, [report(10, 0, 10, 4, 4, 4.0), report(10, 1, 11, 12, 12, 0.0, seconds=2.5)], 2)
    assert row["eval_reward_mean"] == pytest.approx(0.25)  # 4 of 16, not (1.0 + 0.0) / 2
    assert (row["policy_version_min"], row["policy_version_max"], row["eval_time_s"]) == (10, 11, 2.5)
    assert "eval_best_of_n_mean" not in row  # one response per prompt: best-of-n is the mean
    row = eval_row(0, [report(0, 0, 0, 8, 2, 3.0, best_sum=2.0)], 2)
    assert row["eval_best_of_n_mean"] == pytest.approx(1.0) and row["eval_shards"] == 1
    assert eval_row(0, [report(0, 0, 0, 0, 0, 0.0)], 1)["eval_reward_mean"] is None


@pytest.mark.parametrize("change, needle", [
    ({"point": -1}, "'point' must be an int >= 0"),
    ({"shard": 2}, "shard 2 is not one of the 2 eval shards"),
    ({"version": "3"}, "'version' must be an int"),
    ({"reward_sum": math.nan}, "'reward_sum' must be a finite number"),
    ({"samples": -4}, "'samples' must be a finite number"),
])
def test_malformed_reports_are_named(change, needle):
    assert report_problem(report(0, 0, 0, 4, 4, 1.0), 2) == ""
    assert needle in report_problem({**report(0, 0, 0, 4, 4, 1.0), **change}, 2)


# ------------------------------------------------------------------------------ trainer rank 0's book
def test_book_writes_a_point_once_every_shard_reported_and_a_repeat_counts_once(tmp_path):
    book = EvalBook(2)
    assert book.add(report(0, 0, 0, 4, 4, 1.0)) is None
    assert book.add(report(0, 0, 0, 4, 4, 4.0)) is None  # the adopter's copy of shard 0: the first one stays
    book.attach(MetricsWriter(tmp_path))  # rows made before the writer wait for it
    row = book.add(report(0, 1, 0, 4, 4, 3.0))
    assert row is not None and row["eval_reward_mean"] == pytest.approx(0.5)
    assert book.add(report(0, 1, 0, 4, 4, 0.0)) is None  # after its row: ignored
    book.add(report(25, 1, 25, 4, 4, 2.0))  # shard 0 never reports step 25
    with pytest.raises(ValueError, match="eval report from r9: shard 5"):
        book.add({**report(0, 0, 0, 4, 4, 1.0), "shard": 5}, "r9")
    book.finish()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["eval_shards"], r["eval_reward_mean"]) for r in rows] == [(0, 2, 0.5), (25, 1, 0.5)]


def test_book_wait_is_bounded_and_ends_when_the_point_completes():
    async def main():
        loop = asyncio.get_running_loop()
        book = EvalBook(1)
        assert not await book.wait_for(5, 0.3, lambda: True)  # nobody reports: the deadline
        assert not await book.wait_for(5, 30, lambda: False)  # no rollout node left to report: at once
        later = loop.call_later(0.2, book.add, report(5, 0, 5, 2, 2, 1.0))
        assert await asyncio.wait_for(book.wait_for(5, 30, lambda: True), 5)
        later.cancel()
        # a long evaluation that keeps moving extends the deadline; the report then closes the point
        ticks = [0]
        moving = [loop.call_later(0.25 * k, lambda: ticks.__setitem__(0, ticks[0] + 1)) for k in range(1, 7)]
        loop.call_later(1.6, book.add, report(6, 0, 6, 2, 2, 1.0))
        t0 = time.monotonic()
        assert await asyncio.wait_for(book.wait_for(6, 0.6, lambda: True, lambda: ticks[0]), 10)
        assert time.monotonic() - t0 > 1.5
        for h in moving:
            h.cancel()

    asyncio.run(main())


def test_a_failed_shard_closes_its_point_and_missing_points_are_named(tmp_path, caplog):
    book = EvalBook(2, MetricsWriter(tmp_path, name="eval.jsonl"))
    book.add(report(0, 0, 0, 4, 4, 2.0))
    failed = report_meta(0, 1, 0, None, 2, "ValueError: reward failed on sample x")
    assert report_problem(failed, 2) == "" and failed["samples"] == 0
    row = book.add(failed)
    assert row is not None and row["eval_failed_shards"] == 1 and row["eval_reward_mean"] == pytest.approx(0.5)
    assert "'error' must be a str" in report_problem({**failed, "error": 3}, 2)
    book.add(report_meta(3, 0, 3, None, 2, "boom"))
    book.add(report(3, 0, 3, 4, 4, 4.0))  # the adopter's successful copy replaces the failed one
    assert book.add(report(3, 1, 3, 4, 4, 0.0))["eval_failed_shards"] == 0
    with caplog.at_level("WARNING"):
        book.finish(expected=[0, 3, 4])
    assert "no report for the evaluation points at steps [4]" in caplog.text


def test_gossiped_progress_and_the_summary_line_read_rows_by_step(tmp_path):
    class M:
        def __init__(self, n):
            self.meta = {"eval_progress": n} if n is not None else {}

    members = {"r0": M(3), "r1": M(None)}
    assert eval_progress(members.get, ["r0", "r1", "gone"]) == (3, 0, 0)
    w = MetricsWriter(tmp_path, name="eval.jsonl")
    whole = {"eval_shards": 2, "eval_num_shards": 2, "eval_failed_shards": 0}
    for step, mean in ((0, 0.1), (50, 0.7), (100, 0.9), (25, 0.3)):  # a resumed run's row (25) comes last
        w.write({"step": step, "eval_reward_mean": mean, **whole})
    w.write({"step": 60, "eval_reward_mean": None, **whole})  # no sample: left out
    w.write({"step": 110, "eval_reward_mean": 0.2, **whole, "eval_shards": 1})  # partial: left out, counted
    w.write({"step": 120, "eval_reward_mean": 1.0, **whole, "eval_failed_shards": 1})  # a failed shard: the same
    assert eval_summary(tmp_path / "eval.jsonl") == (f", held-out eval 0.100 -> 0.900 (steps 0-100, {tmp_path}/"
                                                     "eval.jsonl; 2 partial or failed row(s) left out)")
    assert eval_summary(tmp_path / "none.jsonl") == ""


# ------------------------------------------------------------------------------ a real evaluation
def test_evaluation_generates_greedily_and_scores_every_row_of_the_shard(toy_model, tmp_path):
    from distflow.rollout.engine import make_engine

    rows = [json.loads(x) for x in EVAL_FILE.read_text().splitlines()[:10]]
    rows.insert(3, {"prompt": "x" * 300 + "=", "answer": "1"})  # longer than max_prompt_length: skipped
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = quickstart(model_path=str(toy_model), eval_dataset=str(data), eval_samples_per_prompt=2,
                     max_prompt_length=64)
    pipeline = cfg.plan().pipeline("rollout")
    assert [n.id for n in eval_pipeline(pipeline)] == ["generate", "reward"]
    engine = make_engine("torch", cfg.model_path, device="cpu", dtype="float32")
    shard = eval_shard(cfg, 1)  # rows 1, 3, 5, 7, 9 of the file: the long one and 4 usable
    chunks: list[int] = []
    a = evaluate(pipeline, engine, cfg, shard, seed=1, on_chunk=chunks.append)
    assert chunks == [0, 1]  # at the start, and after each chunk of rollout_batch (16) prompts
    small = cfg.model_copy(update={"prompts_per_step": 4})  # rollout_batch 2: chunks of 2, 2 and 1 prompts
    b = evaluate(pipeline, engine, small, shard, seed=2, on_chunk=chunks.append)
    assert chunks == [0, 1, 0, 1, 2, 3]
    assert {k: v for k, v in b.items() if k != "seconds"} == {k: v for k, v in a.items() if k != "seconds"}
    assert (a["samples"], a["prompts"], a["skipped_prompts"]) == (8, 4, 1)
    assert a["response_tokens"] == 8 * cfg.max_new_tokens == 24 and a["truncated"] == 8
    # greedy (eval_temperature 0): both responses of a prompt, and both runs, are the same
    assert a["reward_sum"] == b["reward_sum"] and a["best_sum"] * 2 == a["reward_sum"]
    engine.close()


def test_points_in_the_last_steps_are_evaluated_while_the_nodes_wait_for_weights(toy_model, toy_data, tmp_path):
    """In-process run, max_staleness 1: after generating its last step a node only waits for weights,
    and the point one step before the end must still be evaluated then (it was lost before). The
    suite's check that `--in-process` trains at all (exit 0, one metrics row per step) is this run."""
    from tests.conftest import run_distflow

    out = tmp_path / "run"
    r = run_distflow(["run", str(QUICKSTART), "--no-progress", f"output_dir={out}", f"model_path={toy_model}",
                      f"dataset={toy_data}", "toy_model=false", "prompts_per_step=8", "group_size=2",
                      "trainer_nodes=1", "max_steps=4", "eval_every=3", "max_staleness=1", "--in-process"],
                     timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]
    rows = read_metrics(out / "eval.jsonl")
    assert [(e["step"], e["eval_shards"], e["eval_samples"]) for e in rows] == [(0, 2, 128), (3, 2, 128), (4, 2, 128)]
    assert rows[1]["policy_version_min"] == 3 and rows[2]["policy_version_max"] == 4


def test_progress_prints_each_evaluation_once_naming_partial_and_failed_points(tmp_path, capsys):
    from distflow.launch.progress import Progress

    w = MetricsWriter(tmp_path, name="eval.jsonl")
    w.write(eval_row(0, [report(0, 0, 0, 4, 4, 4.0)], 1))  # a resumed run's earlier row: not shown again
    assert Progress(tmp_path / "metrics.jsonl", enabled=False, skip_existing=True).evals_seen == 1
    w = MetricsWriter(tmp_path, name="eval.jsonl")  # a fresh run
    bar = Progress(tmp_path / "metrics.jsonl", enabled=False, skip_existing=True)
    w.write(eval_row(0, [report(0, 0, 0, 4, 4, 1.0), report(0, 1, 0, 4, 4, 0.0)], 2))
    bar.poll()
    w.write(eval_row(25, [report(25, 0, 25, 4, 4, 3.0)], 2))
    w.write(eval_row(50, [report(50, 0, 50, 4, 4, 2.0), report_meta(50, 1, 50, None, 2, "boom")], 2))
    bar.poll()
    bar.poll()
    cap = capsys.readouterr()
    lines = [x for x in (cap.out + cap.err).splitlines() if "eval at" in x]
    assert lines == ["eval at step 0: reward 0.125 over 8 held-out samples",
                     "eval at step 25: reward 0.750 over 4 held-out samples (partial: 1 of 2 shards)",
                     "eval at step 50: reward 0.500 over 4 held-out samples (1 eval shard(s) failed: the rollout "
                     "logs name the error)"], lines
