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
def vlm_model(tmp_path_factory) -> Path:
    """The tiny random Qwen2-VL of the VLM tests (distflow/toy_vlm.py; tests/test_vlm*.py), built once."""
    from distflow.toy_vlm import build_vlm_model

    return Path(build_vlm_model(tmp_path_factory.mktemp("vlm") / "model", seed=1, init_std=0.2))


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


@pytest.fixture(scope="session")
def shared_zygote(tmp_path_factory):
    """One zygote for every `distflow run` of this test process (``DISTFLOW_ZYGOTE``,
    distflow/launch/zygote.py): torch is imported once per pytest worker, not once per run. Nothing
    is lost if it cannot start: each run then starts its own, as a user's does."""
    import json
    import signal
    import threading

    from distflow.core.launch_env import LAUNCHER_PID_ENV
    from distflow.launch.zygote import SHARED_ENV

    sock = tmp_path_factory.mktemp("zygote") / "sock"
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from distflow.launch.zygote_main import main; "
                             "sys.exit(main())", "--socket", str(sock)], cwd=ROOT, stdout=subprocess.PIPE,
                            env={**os.environ, LAUNCHER_PID_ENV: str(os.getpid())}, start_new_session=True)
    first: list[bytes] = []
    reader = threading.Thread(target=lambda: first.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(120)
    ready = bool(first) and "ready" in json.loads(first[0] or b"{}")
    if ready:
        os.environ[SHARED_ENV] = str(sock)
    yield sock if ready else None
    os.environ.pop(SHARED_ENV, None)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> None:
    """Every test starts on one torch intra-op thread, as a node runs (``torch_threads: 1``); a test
    that wants more sets them in its body. Two xdist workers and their cluster processes share the
    2-core machine: a worker spinning two OpenMP threads waits for a time slice at every small op
    (tests/test_engine_batching.py: 5 s alone, ~100 s beside the rest of the suite on two threads)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _cluster_tests_share_a_zygote(request: pytest.FixtureRequest) -> None:
    if dict(request.node.user_properties).get("tier") == "cluster":
        request.getfixturevalue("shared_zygote")


def run_distflow(args: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (as a user would)."""
    return subprocess.run([sys.executable, "-m", "distflow.launch.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


# ---------------------------------------------------------------------- tiers
# Every test is in exactly one tier, selected with -m (CI runs all three):
#   unit     starts no process: the fast loop (`pytest -m unit`)
#   cluster  starts processes: `distflow run` clusters, distflow-node, pdsh, network namespaces,
#            helper children, torch.multiprocessing ranks (`pytest -m cluster`)
#   gpu      marked @pytest.mark.gpu: needs CUDA, skipped without it (`pytest -m gpu`)
# Nothing is listed by hand: a test is `cluster` when its code, a helper or class of tests/ it
# names, or one of its fixtures, starts a process (see _starts_processes). An explicit
# @pytest.mark.cluster or @pytest.mark.unit decides where that reading cannot. A unit-tier test
# that starts a Python or DistFlow process anyway fails, naming this (see _unit_tier_guard).
TIERS = ("unit", "cluster", "gpu")
_STARTERS = {"Popen", "run_distflow", "create_subprocess_exec", "create_subprocess_shell", "ProcessPoolExecutor",
             "start_processes"}
_SUBPROCESS_CALLS = {"run", "call", "check_call", "check_output"}
_PROCESS_APIS = {("distflow.launch.children", "spawn"), ("distflow.launch.launcher", "launch")}  # DistFlow's own starters
_STARTER_MODULES = {m for m, _ in _PROCESS_APIS}


def _own_code(obj: object) -> list:
    """The code objects of a function or class defined under tests/ (none for anything else)."""
    import inspect

    if not (getattr(obj, "__module__", None) or "").startswith("tests"):
        return []
    if inspect.isclass(obj):
        return [c for v in vars(obj).values() for c in _own_code(getattr(v, "__func__", v))]
    fn = inspect.unwrap(obj) if callable(obj) else None
    code = getattr(fn, "__code__", None)
    return [code] if code is not None else []


def _starts_processes(code, namespace: dict, seen: set) -> bool:
    """Whether this code (its nested functions, and what it names from tests/) starts a process. It
    reads names, not calls, so it errs towards `cluster` (the side where nothing is missed)."""
    if code in seen:
        return False
    seen.add(code)
    names = set(code.co_names)
    if names & _STARTERS or ("subprocess" in names and names & _SUBPROCESS_CALLS):
        return True
    if "spawn" in names and names & {"mp", "multiprocessing", "children"}:  # torch.multiprocessing.spawn, ours
        return True
    if "Process" in names and names & {"get_context", "multiprocessing", "mp"}:
        return True
    if "launch" in names and "launcher" in names:  # distflow.launch.launcher.launch: a whole cluster
        return True
    nested = [c for c in code.co_consts if hasattr(c, "co_names")]
    if any(_starts_processes(c, namespace, seen) for c in nested):
        return True
    named = [namespace.get(name) for name in names] + _imported_here(code)
    if any((getattr(obj, "__module__", None), getattr(obj, "__name__", None)) in _PROCESS_APIS for obj in named):
        return True
    for obj in named:
        for sub in _own_code(obj):
            if _starts_processes(sub, getattr(obj, "__globals__", None) or vars(sys.modules[obj.__module__]), seen):
                return True
    return False


_IMPORTED_HERE: dict = {}  # code -> _imported_here(code): every test of a function reads the same code


def _imported_here(code) -> list:
    """What ``from tests.x import y`` inside this function brings in (a local name, not a global)."""
    if code not in _IMPORTED_HERE:
        _IMPORTED_HERE[code] = _read_imports(code)
    return _IMPORTED_HERE[code]


def _read_imports(code) -> list:
    import dis
    import importlib

    found, module = [], None
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME":
            module = ins.argval
        elif ins.opname == "IMPORT_FROM" and module and (module.startswith("tests") or module in _STARTER_MODULES):
            try:
                found.append(getattr(importlib.import_module(module), ins.argval))
            except (ImportError, AttributeError):
                pass
    return found


def tier_of(item: pytest.Item) -> str:
    """The tier of a collected test (exactly one of TIERS)."""
    explicit = [t for t in TIERS if item.get_closest_marker(t)]
    if "gpu" in explicit:
        return "gpu"
    if explicit:
        return explicit[0]
    seen: set = set()
    fn = getattr(item, "function", None)
    funcs = [fn] if fn is not None else []
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in (info.name2fixturedefs.items() if info else ()):
        funcs += [d.func for d in defs if name != "_unit_tier_guard"]  # the guard names Popen to police it
    for f in funcs:
        for code in _own_code(f):
            if _starts_processes(code, f.__globals__, seen):
                return "cluster"
    return "unit"


@pytest.hookimpl(tryfirst=True)  # before xdist's hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = None
    for item in items:
        _group_by_shared_fixture(item)
        tier = tier_of(item)
        item.user_properties.append(("tier", tier))
        if not item.get_closest_marker(tier):
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "gpu":
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def _group_by_shared_fixture(item: pytest.Item) -> None:
    """``python3 -m pytest`` runs on two xdist workers (pyproject's addopts, ``--dist loadgroup``):
    tests spread one by one, except those sharing a module- or class-scoped fixture (a cluster run
    several tests read, a Slurm lab), which stay together on one worker, so the fixture is built once."""
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(info, "names_closure", ()):
        defs = info.name2fixturedefs.get(name)
        if defs and defs[-1].scope in ("module", "class"):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
            return


_PY_OR_DISTFLOW = ("python", "distflow", "pdsh")


@pytest.fixture(autouse=True)
def _unit_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test the tiers read as `unit` must not start a Python or DistFlow process: if it does, the
    reading missed how it starts one, and `pytest -m unit` would run a cluster. It fails, naming the
    fix (@pytest.mark.cluster on the test). Other programs (git, fc-list) are not checked."""
    if dict(request.node.user_properties).get("tier") != "unit":
        return
    import multiprocessing.process
    import subprocess as sp

    where = request.node.nodeid

    def refuse(what: str) -> None:
        pytest.fail(f"{where} starts a process ({what}) but the tiers read it as `unit`: mark it "
                    f"@pytest.mark.cluster (tests/conftest.py, tiers)", pytrace=False)

    execute = sp.Popen._execute_child

    def guarded(self, args, executable, *rest, **kw):
        argv = [args] if isinstance(args, (str, bytes)) else list(args)
        prog = os.path.basename(str(executable or (argv[0] if argv else "")))
        if any(k in prog for k in _PY_OR_DISTFLOW) or prog == os.path.basename(sys.executable):
            refuse(" ".join(map(str, argv))[:200])
        return execute(self, args, executable, *rest, **kw)

    monkeypatch.setattr(sp.Popen, "_execute_child", guarded)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start",
                        lambda self: refuse(f"multiprocessing {getattr(self, 'name', '')}"))
