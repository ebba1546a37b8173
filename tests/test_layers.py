"""The package's shape, checked from its source alone (nothing of it imported, but the last test):
no import circle (imports inside functions count), no file over 600 lines, ``launch`` on top.

Why: a circle means two modules that cannot be understood (or tested, or moved) one without
the other, and it grows silently: one function-level import is enough. The rules are those
of the project's structure check (``arch_check.py``), restated here so the suite keeps them
without that tool.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "distflow"
EXEMPT: tuple[str, ...] = ()  # paths (relative to the repository) these rules do not cover
MAX_LINES = 600
SMALL_INIT = 400  # an __init__.py shorter than this (a docstring, a re-export) adds no edge, as arch_check counts


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file (module level or in a function)."""

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in mods:
                return ".".join(parts[:i])
        return None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        package = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - (node.level - 1)] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                r = resolve(t) if t.startswith("distflow") else None
                if r and r != m and not (mods[r].name == "__init__.py" and len(mods[r].read_text()) < SMALL_INIT):
                    graph[m].add(r)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def exempt(mods: dict[str, Path], m: str) -> bool:
    rel = mods[m].relative_to(ROOT).as_posix()
    return any(rel.startswith(e) for e in EXEMPT)


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_outside_the_exempt_paths():
    mods = modules()
    bad = [c for c in circles(import_graph(mods)) if not all(exempt(mods, m) for m in c)]
    assert not bad, f"import circles (imports inside functions count): {bad}"


def test_no_file_over_600_lines():
    mods = modules()
    long = {mods[m].relative_to(ROOT).as_posix(): n for m in mods if not exempt(mods, m)
            if (n := len(mods[m].read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by concept): {long}"


def test_launch_is_the_top_layer():
    """Nothing below ``distflow.launch`` imports it, but its torch-free leaf of run state
    (``launch.checkpoint``, which the trainer writes through); ``distflow.cli`` is the old
    entry points' shim."""
    mods = modules()
    graph = import_graph(mods)
    up = {m: sorted(t for t in graph[m] if t.startswith("distflow.launch") and t != "distflow.launch.checkpoint")
          for m in mods if not m.startswith(("distflow.launch", "distflow.cli"))}
    assert not {m: t for m, t in up.items() if t}, "modules below launch/ that import it"
    leaf = {t for t in graph["distflow.launch.checkpoint"] if t != "distflow.core.config"}
    assert not leaf, f"launch.checkpoint must stay a leaf (it imports {sorted(leaf)})"


def test_the_launch_side_imports_no_torch():
    """``distflow run`` and ``distflow-node --check`` answer before torch is imported."""
    code = ("import sys; import distflow.launch.cli, distflow.launch.launcher, distflow.launch.inprocess, "
            "distflow.launch.preflight, distflow.launch.placement, distflow.launch.checkpoint, distflow.launch.roles; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
