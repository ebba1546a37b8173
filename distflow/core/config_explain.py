"""``distflow config``: explain a key, or show a config as every process will see it.

Why: with ~90 keys in eight sections, "where does this key go, what does it take, what is its
default" should be one command away, answered from the schema itself (the same descriptions the
generated docs/configuration.md shows), and a config with its overrides, defaults and resolved
paths should be printable before anything starts. Torch-free and quick: no node code is imported.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Sequence

import yaml

from distflow.core.config_docs import bounds_text, default_text, nested_section, type_text
from distflow.core.config_keys import ConfigError, field_of, suggest
from distflow.core.config_sections import SECTIONS


def explain(name: str) -> str:
    """One key's section, type, default and documentation (a flat ``lr`` or dotted ``trainer.lr``
    name), or a section's keys (``trainer``). Raises ConfigError with a did-you-mean when unknown."""
    name = name.strip()
    if name in SECTIONS:
        model = SECTIONS[name]
        lines = [f"{name}: {(model.__doc__ or '').strip().splitlines()[0]}", "keys:"]
        lines += [f"  {name}.{key}" for key in model.model_fields]
        return "\n".join(lines)
    found = field_of(name)
    parent, _, sub = name.rpartition(".")
    outer = field_of(parent) if found is None and parent else None  # a key of a nested section: lora.rank
    inner = nested_section(outer[2]) if outer is not None else None
    if inner is not None and sub in inner.model_fields:
        found = (outer[0], f"{outer[1]}.{sub}", inner.model_fields[sub])
    if found is None:
        section, _, key = name.rpartition(".")
        raise ConfigError(f"{name}: unknown key{suggest(key, section if section in SECTIONS else None)}")
    section, key, field = found
    kind = type_text(field.annotation) + (f" ({bounds_text(field)})" if bounds_text(field) else "")
    doc = textwrap.fill((field.description or "").replace("``", "`"), width=96, initial_indent="  ",
                        subsequent_indent="  ")
    return "\n".join([f"{section}.{key}  (flat: {key})",
                      f"  section: {section}: {(SECTIONS[section].__doc__ or '').strip().splitlines()[0]}",
                      f"  type:    {kind}",
                      f"  default: {default_text(field)}",
                      "", doc])


def show(path: str, overrides: Sequence[str] = ()) -> str:
    """The config at ``path`` with ``overrides``, validated, as YAML in sections: every default
    filled in and every path absolute (what ``distflow run`` writes to ``output_dir/config.yaml``)."""
    from distflow.core.config import load_config

    cfg = load_config(path, overrides)
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def config_main(argv: Sequence[str]) -> int:
    """``distflow config --explain KEY`` / ``distflow config --show CONFIG [KEY=VALUE ...]``;
    exit 2 with one line on an unknown key or an invalid config."""
    p = argparse.ArgumentParser(prog="distflow config", description="Explain config keys, or show a resolved config.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--explain", metavar="KEY", help="a key's section, type, default and meaning (lr or trainer.lr; "
                                                       "a section name lists its keys)")
    what.add_argument("--show", metavar="CONFIG", help="print CONFIG (with KEY=VALUE overrides) resolved, in sections")
    args, rest = p.parse_known_args(list(argv))
    overrides = [a for a in rest if "=" in a and not a.startswith("-")]
    if len(overrides) != len(rest) or (overrides and args.show is None):
        p.error(f"unexpected arguments {[a for a in rest if a not in overrides] or overrides}")
    try:
        print(explain(args.explain) if args.explain is not None else show(args.show, overrides), end="\n")
    except ConfigError as e:
        print(f"distflow config: {e}", file=sys.stderr)
        return 2
    return 0
