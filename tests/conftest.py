"""Shared fixtures: a tiny toy model and prompt set, built once per test session.

Nothing is downloaded: the model and tokenizer are built here and saved to a temp dir,
then loaded through the real path (from_pretrained on a local directory).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def toy_model(tmp_path_factory) -> Path:
    from distflow.toy import build_toy_model

    return Path(build_toy_model(tmp_path_factory.mktemp("toy") / "model", seed=0))


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory) -> Path:
    """A tiny sequence-classification (reward) model saved to a local directory, with a
    non-zero score head so that its scores differ between samples."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=17, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, num_labels=1,
                         pad_token_id=None)
    model = LlamaForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    out = tmp_path_factory.mktemp("rm") / "reward-model"
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory) -> Path:
    from distflow.toy import make_toy_dataset

    p = tmp_path_factory.mktemp("data") / "successor.jsonl"
    make_toy_dataset(p, 48, seed=1)
    return p


def run_distflow(args: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (as a user would)."""
    return subprocess.run([sys.executable, "-m", "distflow.launch.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
