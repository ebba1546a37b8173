"""Trackers (distflow/trackers): every backend's files read back with its own library's reader.

TensorBoard's EventAccumulator, MLflow's client on a local file store, wandb's Record protobuf
over the offline run file (tests/wandb_log.py), samples.jsonl. Also: a backend failing mid-run
is counted and the others go on; one that cannot start is a ConfigError before training; and
a short real run (in-process) logs every step to all four.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml

from distflow.buffer.batch import SampleBatch
from distflow.core.config import Config, ConfigError
from distflow.trainer.metrics import MetricsWriter, read_metrics
from tests.conftest import ROOT

QUICKSTART = ROOT / "examples" / "grpo_quickstart.yaml"
MISSING = [m for m in ("tensorboard", "mlflow", "wandb") if importlib.util.find_spec(m) is None]
needs_all = pytest.mark.skipif(bool(MISSING), reason=f"not installed: {MISSING} (pip install 'distflow[trackers]')")


def config(tmp_path: Path, **update) -> Config:
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw.update(output_dir=str(tmp_path / "run"), **update)
    return Config.model_validate(raw)


def batch(rewards: list[float]) -> SampleBatch:
    n = len(rewards)
    b = SampleBatch.from_lists([f"s{i}" for i in range(n)], [f"e0:{i}" for i in range(n)],
                               [[1, 2, i % 7 + 1] for i in range(n)], [[3, i % 5 + 1] for i in range(n)])
    b.tensors["reward"] = torch.tensor(rewards)
    return b


def tb_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def tb_texts(log_dir: Path) -> dict[int, str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    tag = next(t for t in acc.Tags()["tensors"] if t.startswith("samples"))
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)}


def wandb_file(out: Path) -> Path:
    files = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no offline W&B run under {out}/wandb"
    return files[-1]


def mlflow_run(out: Path, cfg: Config):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    run_id = json.loads((out / "trackers.json").read_text())["mlflow_run_id"]
    return client, client.get_run(run_id)


@needs_all
def test_every_backend_reads_back_metrics_eval_and_a_sample_table_per_step(tmp_path):
    from distflow.trackers import open_trackers

    cfg = config(tmp_path, trackers=["tensorboard", "wandb", "mlflow"], sample_table_k=2, tracker_run_name="t1")
    out = Path(cfg.output_dir)
    ts = open_trackers(cfg)
    metrics = ts.tee(MetricsWriter(out))
    evals = ts.tee(MetricsWriter(out, name="eval.jsonl"), "log_eval")
    for step in range(3):
        metrics.write({"step": step, "reward_mean": 0.1 * step, "samples": 8, "note": "strings are left out"})
        ts.samples(step, batch([0.0, 1.0, 0.5, 0.25, float(step)]))
    evals.write({"step": 2, "eval_reward_mean": 0.75})
    ts.close()
    assert ts.total_failures() == 0
    # TensorBoard: verl's name where verl has the figure (distflow/trackers/names.py), else train/KEY
    assert tb_scalars(out / "tensorboard", "critic/score/mean") == [(0, 0.0), (1, pytest.approx(0.1)),
                                                                     (2, pytest.approx(0.2))]
    assert tb_scalars(out / "tensorboard", "train/samples") == [(0, 8.0), (1, 8.0), (2, 8.0)]
    assert tb_scalars(out / "tensorboard", "eval/eval_reward_mean") == [(2, 0.75)]
    texts = tb_texts(out / "tensorboard")
    assert sorted(texts) == [0, 1, 2] and "| top | 0 | 2.0 |" in texts[2]
    # MLflow
    client, run = mlflow_run(out, cfg)
    assert run.info.run_name == "t1" and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "critic/score/mean")] == \
        [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.2))]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "samples")] == [8.0] * 3
    assert [m.value for m in client.get_metric_history(run.info.run_id, "eval/eval_reward_mean")] == [0.75]
    import mlflow.artifacts

    table = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/samples/step_000001.json")
    assert table["columns"] == ["step", "kind", "rank", "reward", "prompt", "response"]
    assert [r[1:4] for r in table["data"]] == [["top", 0, 1.0], ["top", 1, 1.0], ["bottom", 0, 0.0], ["bottom", 1, 0.25]]
    # W&B (offline): history rows by wandb's Record protobuf
    from tests.wandb_log import history

    rows = history(wandb_file(out))
    train = [(r["train/step"], r["critic/score/mean"]) for r in rows if "critic/score/mean" in r]
    assert train == [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.2))]
    assert [r["train/samples"] for r in rows if "train/samples" in r] == [8.0] * 3
    assert [(r["eval/step"], r["eval/eval_reward_mean"]) for r in rows if "eval/eval_reward_mean" in r] == [(2, 0.75)]
    tables = [r for r in rows if r.get("samples/_type") == "table-file"]
    assert [(r["train/step"], r["samples/nrows"]) for r in tables] == [(0, 4), (1, 4), (2, 4)]  # each step kept
    t1 = json.loads((wandb_file(out).parent / "files" / tables[1]["samples/path"]).read_text())
    assert t1["columns"][:4] == ["step", "kind", "rank", "reward"] and [r[3] for r in t1["data"]] == [1.0, 1.0, 0.0, 0.25]
    # jsonl: every step's table kept
    samples = read_metrics(out / "samples.jsonl")
    assert [(r["step"], r["kind"]) for r in samples][:4] == [(0, "top"), (0, "top"), (0, "bottom"), (0, "bottom")]
    assert len(samples) == 12 and {r["step"] for r in samples} == {0, 1, 2}


class Boom:
    name = "boom"

    def __init__(self):
        self.calls = 0

    def log_metrics(self, step, metrics):
        self.calls += 1
        raise OSError("disk full")

    log_eval = log_samples = log_metrics

    def close(self):
        pass


def test_a_backend_failing_mid_run_is_counted_and_the_others_go_on(tmp_path):
    from distflow.trackers.backend_jsonl import JsonlTracker
    from distflow.trackers.base import TrackerSet

    out = tmp_path / "run"
    boom = Boom()
    ts = TrackerSet([boom, JsonlTracker(out, None)], sample_k=1)
    w = ts.tee(MetricsWriter(out))
    for step in range(3):
        w.write({"step": step, "reward_mean": 1.0})
        ts.samples(step, batch([0.0, 1.0]))
    ts.close()
    assert boom.calls == 6 and ts.failures == {"boom": 6, "jsonl": 0}
    assert len(read_metrics(out / "samples.jsonl")) == 6  # jsonl kept going
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 3 and rows[0].get("tracker_failures") is None  # counted into later rows once seen


def test_a_backend_that_cannot_start_is_a_config_error_before_training(tmp_path):
    from distflow.trackers import open_trackers

    if importlib.util.find_spec("mlflow") is None:
        pytest.skip("mlflow is not installed (pip install 'distflow[trackers]')")
    cfg = config(tmp_path, trackers=["mlflow"], tracker_uri="nosuchscheme://nowhere")
    with pytest.raises(ConfigError, match="trackers: mlflow cannot start"):
        open_trackers(cfg)
    with pytest.raises(Exception, match="trackers"):
        config(tmp_path, trackers=["neptune"])


def test_the_sample_table_is_top_k_then_bottom_k_each_sample_once():
    from distflow.trackers.samples import pick_rows

    rows = pick_rows(batch([0.5, 0.875, 0.125, 0.75, 0.25]), 2)
    assert [(r["kind"], r["reward"]) for r in rows] == [("top", 0.875), ("top", 0.75), ("bottom", 0.125),
                                                        ("bottom", 0.25)]
    rows = pick_rows(batch([0.5, 0.875, 0.125]), 4)  # fewer than 2k: split, each once
    assert sorted(r["sample_id"] for r in rows) == ["s0", "s1", "s2"]
    assert rows[0]["prompt"] == [1, 2, 2] and rows[0]["response"] == [3, 2]


def check_step_statistics(metrics: list[dict], model: Path) -> None:
    """A real run's rows carry the step's statistics, and they are sane: ordered extremes, shares
    in [0, 1], the engine's logprobs equal to the trainer's where both ran the same weights
    (staleness 0: step 0 at least), the weight bytes published = the model's parameter bytes."""
    import math

    from safetensors import safe_open

    with safe_open(str(next(model.glob("*.safetensors"))), "pt") as f:  # published in fp32, the CPU's dtype
        param_bytes = sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys())  # noqa: SIM118
    for m in metrics:
        for name in ("response_len", "prompt_len", "reward", "advantage"):
            assert m[f"{name}_max"] >= m[f"{name}_mean"] >= m[f"{name}_min"], (name, m)
        assert m["staleness_max"] >= m["staleness_mean"] >= 0 and m["reward_std"] >= 0
        assert 0.0 <= m["truncated_frac"] <= 1.0 and m["throughput"] > 0 and m["step_time_s"] > 0
        assert m["peak_rss_gb"] > 0 and "max_memory_allocated_gb" not in m  # a CPU run: peak RSS, named so
        assert m["weight_sync_bytes"] == param_bytes
        assert m.get("weight_load_bytes", param_bytes) == param_bytes  # full versions, once a node loaded one
        assert m["logprob_kl_k3"] >= 0 and m["logprob_diff_max"] >= abs(m["logprob_diff_mean"])
    on_policy = [m for m in metrics if m["staleness_max"] == 0]
    assert on_policy and all(m["logprob_diff_max"] < 1e-3 and m["logprob_kl_k3"] < 1e-6 for m in on_policy)
    assert "weight_load_bytes" in metrics[-1]


@needs_all
def test_a_real_run_logs_every_step_to_every_tracker(toy_model, toy_data, tmp_path):
    from tests.conftest import run_distflow
    from tests.wandb_log import history

    out = tmp_path / "run"
    r = run_distflow(["run", str(QUICKSTART), "--no-progress", f"output_dir={out}", f"model_path={toy_model}",
                      f"dataset={toy_data}", "toy_model=false", "prompts_per_step=8", "group_size=2",
                      "trainer_nodes=1", "max_steps=3", "eval_every=2", "--in-process", "recompute_old_logprobs=true",
                      "trackers=[tensorboard,wandb,mlflow]", "sample_table_k=2"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = read_metrics(out / "metrics.jsonl")
    steps = [m["step"] for m in metrics]
    evals = [m["step"] for m in read_metrics(out / "eval.jsonl")]
    assert steps == [0, 1, 2] and evals == [0, 2, 3]
    check_step_statistics(metrics, toy_model)
    assert [s for s, _ in tb_scalars(out / "tensorboard", "critic/score/mean")] == steps
    length = tb_scalars(out / "tensorboard", "response_length/max")  # verl's name, read back by TensorBoard's reader
    assert length == [(m["step"], m["response_len_max"]) for m in metrics]
    assert [s for s, _ in tb_scalars(out / "tensorboard", "train/staleness_max")] == steps  # no verl name
    assert [s for s, _ in tb_scalars(out / "tensorboard", "eval/eval_reward_mean")] == evals
    assert sorted(tb_texts(out / "tensorboard")) == steps
    client, run = mlflow_run(out, None)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "timing_s/update_actor")] == steps
    rows = history(wandb_file(out))
    assert [r["train/step"] for r in rows if "critic/score/mean" in r] == steps
    assert [r["eval/step"] for r in rows if "eval/eval_reward_mean" in r] == evals
    samples = read_metrics(out / "samples.jsonl")
    assert {s["step"] for s in samples} == set(steps) and all(s["prompt"].endswith("=") for s in samples)


@needs_all
def test_a_resumed_run_continues_the_same_tracker_runs(tmp_path):
    """resume_from at step 2: TensorBoard purges the steps trained again, MLflow continues the same
    run (its id kept in trackers.json), W&B the same run id, samples.jsonl drops the later tables."""
    from distflow.trackers import open_trackers
    from distflow.trackers.backend_wandb import run_id

    cfg = config(tmp_path, trackers=["tensorboard", "mlflow", "wandb"], sample_table_k=1)
    out = Path(cfg.output_dir)
    for resume, steps in ((None, range(4)), (2, range(2, 5))):
        ts = open_trackers(cfg, resume_step=resume)
        w = ts.tee(MetricsWriter(out, resume_step=resume))
        for step in steps:
            w.write({"step": step, "reward_mean": float(step) + (10 if resume else 0)})
            ts.samples(step, batch([0.0, 1.0]))
        ts.close()
    assert tb_scalars(out / "tensorboard", "critic/score/mean") == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0),
                                                                      (4, 14.0)]
    client, run = mlflow_run(out, cfg)
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert [m.step for m in client.get_metric_history(run.info.run_id, "critic/score/mean")][-3:] == [2, 3, 4]
    # offline-run-<time>-<run id>, with "-1" appended by W&B when both runs started in the same second
    assert {p.name.split("-")[3] for p in out.glob("wandb/offline-run-*")} == {run_id(out, cfg.name)}
    assert [(r["step"], r["kind"]) for r in read_metrics(out / "samples.jsonl")] == \
        [(s, k) for s in range(5) for k in ("top", "bottom")]
