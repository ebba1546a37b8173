"""Per-stage timings of a trainer step: where they come from and where they are shown.

The trainer reads the rollout nodes' last generation / weight-load times from their mesh
metadata, computes tokens/s and MFU of the update, writes it all to metrics.jsonl, plots
``timings.png``, and the progress bar and ``distflow status`` print one summary line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from distflow.core.mesh import Member
from distflow.core.status import STAGE_TIME_KEYS, format_stages, format_table, member_row
from distflow.trainer.metrics import STAGE_KEYS, plot_timings
from distflow.trainer.worker import ROLLOUT_TIME_KEYS, rollout_times, throughput


def _member(node_id: str, meta: dict) -> Member:
    return Member(node_id, "rollout", "127.0.0.1", 7000, "alive", 1, meta, 100.0, 0.0)


def test_rollout_times_are_the_mean_over_reporting_nodes():
    members = {"r0": _member("r0", {"time_generate_s": 1.0, "time_load_weights_s": 0.25}),
               "r1": _member("r1", {"time_generate_s": 3.0}),
               "r2": _member("r2", {"time_generate_s": "bad"})}
    assert ROLLOUT_TIME_KEYS == ("time_generate_s", "time_load_weights_s")
    assert rollout_times(members.get, ["r0", "r1", "r2", "gone"]) == {"time_generate_s": 2.0,
                                                                       "time_load_weights_s": 0.25}
    assert rollout_times(members.get, []) == {}


def test_throughput_and_mfu_hand_computed():
    # 6 x 1e6 params x 5000 tokens / 2 s / (2 ranks x 1e12 FLOP/s) = 0.0075
    out = throughput({"time_update_s": 2.0, "train_tokens": 5000.0}, num_params=1_000_000, world=2, peak_flops=1e12)
    assert out == {"tokens_per_s": 2500.0, "mfu": pytest.approx(0.0075)}
    assert throughput({"time_update_s": 0.0, "train_tokens": 10.0}, 1, 1, 1.0) == {"tokens_per_s": 0.0, "mfu": 0.0}
    # an unknown peak (a CPU): no mfu at all rather than one against a made-up peak
    assert throughput({"time_update_s": 2.0, "train_tokens": 5000.0}, 1_000_000, 2, None) == {"tokens_per_s": 2500.0}


def test_peak_flops_by_gpu_name_and_dtype_and_the_config_wins():
    from types import SimpleNamespace

    from distflow.device import peak_flops, tf32_matmuls
    from distflow.trainer.worker import trainer_peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12  # not the SXM figure
    assert peak_flops("NVIDIA H200", "float16") == 989e12
    # fp32: CUDA cores (torch's default), or TF32 tensor cores at half the bf16 peak when torch is told to
    assert peak_flops("NVIDIA A100-SXM4-80GB", "float32") == 19.5e12 and not tf32_matmuls()
    assert peak_flops("NVIDIA A100-SXM4-80GB", "float32", tf32=True) == 156e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "float32", tf32=False) == 67e12
    assert peak_flops("NVIDIA B200", "float32", tf32=False) is None  # not listed: the placeholder, logged
    # the more specific names first: an L40 is not an L4, an H100 NVL not an SXM H100
    assert peak_flops("NVIDIA L40", "bfloat16") == 181e12 and peak_flops("NVIDIA L40S", "bfloat16") == 362e12
    assert peak_flops("NVIDIA H100 NVL", "bfloat16") == 835e12 and peak_flops("NVIDIA H800 PCIe", "float32") == 51e12
    for setting in ("torch.backends.cuda.matmul.allow_tf32 = True",  # the legacy flag, and the new setting
                    "torch.backends.cuda.matmul.fp32_precision = 'tf32'"):  # (a process of its own: global state)
        code = (f"import torch; {setting}; from distflow.device import peak_flops, tf32_matmuls; "
                "assert tf32_matmuls() and peak_flops('NVIDIA H100 80GB HBM3', 'float32') == 989e12 / 2")
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    for env, want in ((("NVIDIA_TF32_OVERRIDE", "0"), False), (("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1"), True)):
        code = ("import torch; torch.backends.cuda.matmul.allow_tf32 = True; from distflow.device import tf32_matmuls; "
                f"assert tf32_matmuls() is {want}")
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env={**os.environ, env[0]: env[1]})
    assert peak_flops("NVIDIA L40S", "bfloat16") == 362e12 and peak_flops("NVIDIA L4", "bfloat16") == 121e12
    assert peak_flops("Some Future GPU", "bfloat16") is None and peak_flops(None, "bfloat16") is None
    # an H20 is no H200 (listed after it), a GH200's GPU is an H100 SXM's, a GB200 is no B200; AMD by its name
    assert peak_flops("NVIDIA H20", "bfloat16") == 148e12 and peak_flops("NVIDIA H200", "bfloat16") == 989e12
    assert peak_flops("NVIDIA GH200 480GB", "bfloat16") == 989e12 and peak_flops("NVIDIA GB200", "bfloat16") == 2500e12
    assert peak_flops("AMD Instinct MI300X", "bfloat16") == 1307.4e12 and peak_flops("AMD Instinct MI300X", "float32") \
        == 163.4e12
    assert trainer_peak_flops(SimpleNamespace(peak_flops=2e15, device="cuda", dtype="bfloat16")) == 2e15
    assert trainer_peak_flops(SimpleNamespace(peak_flops=None, device="cpu", dtype="float32")) is None


def test_stage_summary_line_status_column_and_plot(tmp_path):
    rec = {"time_generate_s": 1.2, "time_wait_s": 0.05, "time_update_s": 0.8, "tokens_per_s": 1234.0, "mfu": 0.031}
    assert format_stages(rec) == "gen 1.20s wait 0.05s upd 0.80s | 1.2k tok/s mfu 3.1%"
    assert format_stages({"tokens_per_s": 12.0}) == "12 tok/s"
    assert format_stages({}) == ""
    assert set(STAGE_TIME_KEYS) < set(STAGE_KEYS) and {"tokens_per_s", "mfu"} < set(STAGE_KEYS)

    row = member_row(Member("trainer-0", "trainer", "127.0.0.1", 7001, "alive", 1, rec, 100.0, 0.0), now=100.0)
    assert row["stages"] == format_stages(rec)
    lines = format_table([row]).splitlines()
    assert lines[0].endswith("LAST STEP") and lines[1].endswith(format_stages(rec))

    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text("".join(json.dumps({"step": s, **{k: 0.1 * (i + 1) for i, k in enumerate(STAGE_TIME_KEYS)}})
                               + "\n" for s in range(5)))
    plot_timings(metrics, tmp_path / "timings.png")
    assert (tmp_path / "timings.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resumed_run_keeps_the_metrics_rows_before_its_checkpoint_only(tmp_path):
    """The run reached step 5, its newest checkpoint is at step 3: steps 3-5 are trained again
    after the resume, so their old rows go (else metrics.jsonl and the curves hold them twice)."""
    from distflow.trainer.metrics import MetricsWriter, read_metrics

    first = MetricsWriter(tmp_path)
    for step in range(6):
        first.write({"step": step, "reward_mean": step / 10})
    resumed = MetricsWriter(tmp_path, resume_step=3)
    assert [r["step"] for r in read_metrics(resumed.path)] == [0, 1, 2]
    resumed.write({"step": 3, "reward_mean": 0.9})
    assert [(r["step"], r["reward_mean"]) for r in read_metrics(resumed.path)] == [(0, 0.0), (1, 0.1), (2, 0.2),
                                                                                   (3, 0.9)]
    assert [r["step"] for r in read_metrics(MetricsWriter(tmp_path).path)] == []  # a fresh run starts empty
