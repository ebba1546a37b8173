"""Key names of a DistFlow config: flat (``lr``), dotted (``trainer.lr``) or sectioned YAML
(``trainer: {lr: ...}``) all name the same field.

Why a module of its own: the loader, the ``key=value`` overrides, ``distflow config --explain``
and the error messages must agree on what a name means, and before the sections existed every
config was flat: those files and command lines keep working unchanged. The rule is simple
because a key name is unique across sections (:data:`FLAT_KEYS`): a top-level key that is not a
section name is the flat name of the one field it names. Torch-free.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping

from pydantic.fields import FieldInfo

from distflow.core.config_sections import FLAT_KEYS, SECTIONS


class ConfigError(ValueError):
    """A configuration problem; the message names the key."""


def to_sections(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` (flat keys, sections, or both) as a mapping of sections, every section present (so
    a missing required key is named ``model.model_path``, not ``model``). Keys that are neither a
    section nor a flat key stay at the top level, where validation names them with a did-you-mean.
    Raises ConfigError when one key is given both ways (``lr`` and ``trainer.lr``): silently keeping
    one would hide the other. Does not modify ``raw``; idempotent."""
    out: dict[str, Any] = {}
    for name in SECTIONS:
        value = raw.get(name)
        if value is None:  # absent, or a YAML section whose keys are all commented out
            value = {}
        out[name] = dict(value) if isinstance(value, Mapping) else value
    for key, value in raw.items():
        if key in SECTIONS:
            continue
        section = FLAT_KEYS.get(key) if isinstance(key, str) else None
        if section is None:
            out[key] = value  # unknown: validation names it
        elif not isinstance(out[section], dict):
            out[key] = value  # the section itself is malformed: validation names that
        elif key in out[section]:
            raise ConfigError(f"{key}: given twice, as {key} and as {section}.{key}; keep one")
        else:
            out[section][key] = value
    return out


def canonical(dotted: str) -> tuple[list[str], int]:
    """The dotted path of an override (``lr``, ``trainer.lr``, ``workflow.1.fn``, ``mesh``) within
    the sectioned mapping, and how many leading parts were added (0 or 1: the section of a flat key)."""
    parts = dotted.strip().split(".")
    if parts[0] not in SECTIONS and parts[0] in FLAT_KEYS:
        return [FLAT_KEYS[parts[0]], *parts], 1
    return parts, 0


def field_of(name: str) -> tuple[str, str, FieldInfo] | None:
    """(section, key, field) of a flat (``lr``) or dotted (``trainer.lr``) key name, else None."""
    section, _, key = name.strip().rpartition(".")
    if not section:
        section = FLAT_KEYS.get(key, "")
    model = SECTIONS.get(section)
    if model is None or key not in model.model_fields:
        return None
    return section, key, model.model_fields[key]


# The names other frameworks (TRL, verl, OpenRLHF) and papers give to keys DistFlow spells otherwise: no
# spelling distance finds ``lr`` from ``learning_rate``.
ALIASES = {"learning_rate": "lr", "num_generations": "group_size", "n_samples_per_prompt": "group_size",
           "batch_size": "prompts_per_step", "train_batch_size": "prompts_per_step", "max_tokens": "max_new_tokens",
           "max_completion_length": "max_new_tokens", "response_length": "max_new_tokens", "model": "model_path",
           "model_name_or_path": "model_path", "data_path": "dataset", "train_files": "dataset",
           "num_train_epochs": "epochs", "total_steps": "max_steps", "kl_coeff": "kl_coef", "beta": "kl_coef",
           "gpu_memory_utilization": "engine_gpu_memory_utilization",  # vLLM's name
           "engine_kv_cache_memory_fraction": "engine_gpu_memory_utilization"}  # DistFlow's former key


def suggest(name: str, section: str | None = None) -> str:
    """A hint for an unknown key: the section a known key belongs to when it was put in another
    one, another framework's name for a key (:data:`ALIASES`), else a did-you-mean among the names
    valid there (flat keys and sections at the top level)."""
    if section is not None and name in FLAT_KEYS:
        return f" ({name!r} is a key of section {FLAT_KEYS[name]}: {FLAT_KEYS[name]}.{name})"
    alias = ALIASES.get(name)
    if alias in FLAT_KEYS and (section is None or FLAT_KEYS[alias] == section or section not in SECTIONS):
        return f" (did you mean {alias!r}?)"
    choices = list(SECTIONS[section].model_fields) if section in SECTIONS else [*FLAT_KEYS, *SECTIONS]
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
