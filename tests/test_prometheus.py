"""Prometheus ``/metrics`` of every node (config ``metrics_port``): a real cluster (``distflow
run``, 2 rollout + 2 trainer processes), each node scraped over HTTP while it trains, the text
parsed by prometheus_client's own parser."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import ROOT

QUICKSTART = ROOT / "examples" / "grpo_quickstart.yaml"
DATA = ROOT / "examples" / "data" / "successor.jsonl"
URL = re.compile(r"\[(\S+)\] .*Prometheus metrics at (http://\S+/metrics)")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("prometheus_client") is None,
                                reason="prometheus_client is not installed (pip install -e '.[dev]')")


def scrape(url: str) -> dict[str, list]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, **labels) -> float:
    return next(s.value for s in families[name] if all(s.labels.get(k) == v for k, v in labels.items()))


def test_every_node_serves_metrics_that_prometheus_parses(toy_model, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "distflow.cli", "run", str(QUICKSTART), "--no-progress",
                             f"output_dir={out}", f"model_path={toy_model}", "toy_model=false", f"dataset={DATA}",
                             "prompts_per_step=8", "group_size=2", "eval_dataset=null", "eval_every=0",
                             "max_steps=400", "metrics_port=0"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        urls: dict[str, str] = {}
        deadline = time.monotonic() + 180
        while len(urls) < 4 or not (out / "metrics.jsonl").is_file() or len((out / "metrics.jsonl").read_text()
                                                                                .splitlines()) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 2"
            for log in (out / "logs").glob("*.log") if (out / "logs").is_dir() else []:
                urls.update(URL.findall(log.read_text(errors="replace")))
            time.sleep(0.5)
        scraped = {node: scrape(url) for node, url in sorted(urls.items())}
        for node, fam in scraped.items():
            role = "trainer" if node.startswith("trainer") else "rollout"
            assert value(fam, "distflow_node_info", node_id=node, role=role) == 1
            assert value(fam, "distflow_members", role="trainer", state="alive") == 2
            assert value(fam, "distflow_members", role="rollout", state="alive") == 2
            assert value(fam, "distflow_members", role="rollout", state="suspect") == 0
            lags = [s.value for s in fam["distflow_peer_last_heard_seconds"]]
            assert len(lags) == 3 and all(0 <= x < 10 for x in lags)
            assert value(fam, "distflow_messages_received") > 0  # the parser strips _total from counters
            assert 0 <= value(fam, "distflow_buffer_fill_ratio") <= 1
        trainer = scraped[min(n for n in scraped if n.startswith("trainer"))]
        assert value(trainer, "distflow_step") >= 1 and value(trainer, "distflow_buffer_capacity_samples") > 0
        assert value(trainer, "distflow_stage_seconds", stage="update") > 0
        rollout = scraped[min(n for n in scraped if n.startswith("rollout"))]
        assert value(rollout, "distflow_engine_slots") > 0
        assert 0 <= value(rollout, "distflow_engine_slots_in_use") <= value(rollout, "distflow_engine_slots")
        url = next(iter(urls.values()))
        assert url.startswith("http://127.0.0.1:")  # loopback by default
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url.replace("/metrics", "/other"), timeout=10)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
