"""Is this a Hugging Face model directory? Answered from a few file reads, without torch.

Why it exists: the launcher's checks before a run (:mod:`distflow.launch.preflight`, torch-free
start-up) and the engines loading a model (:mod:`distflow.rollout.protocol`) must refuse a bad
``model_path`` with the same words, and the engines sit below the launcher: the answer lives
below both. Models load from local directories only; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["ModelDirError", "TOKENIZER_FILES", "model_dir_problem"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


class ModelDirError(FileNotFoundError):
    """A model directory that cannot be loaded: a configuration error (a node exits 2 on it, and is not restarted)."""


def model_dir_problem(path: str) -> str | None:
    """Why ``path`` is no Hugging Face model and tokenizer directory (models load from local
    directories only: :func:`distflow.hf.check_model_dir`), or None; torch-free."""
    p = Path(path)
    if not p.is_dir():
        what = "is a file, not a directory" if p.exists() else "does not exist"
        return f"{path!r} {what} (models load from local Hugging Face model directories; nothing is downloaded)"
    try:
        conf = json.loads((p / "config.json").read_text())
    except FileNotFoundError:
        return f"{path!r} is not a Hugging Face model directory (no config.json)"
    except (OSError, ValueError) as e:
        return f"{path!r}: config.json cannot be read ({type(e).__name__}: {e})"
    if not isinstance(conf, dict) or "model_type" not in conf:
        return f"{path!r}: its config.json names no model_type (not a Hugging Face model config)"
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        return f"{path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
    return None
