"""Deployment: the docker-compose file, the Dockerfile, and the pdsh launcher, for real.

- docker-compose: the file is resolved by a real ``docker-compose config`` (Debian's
  package validates without a Docker engine), and every service's command, as compose
  resolved it, is run here with ``--check`` appended: the real ``sh -c`` launch line and
  the real ``distflow-node``. What only a container has is stood in for: the in-container
  paths map to the repository, and ``hostname`` answers as the container would.
- pdsh: ``distflow-pdsh`` starts a cluster with pdsh's ``exec`` module (no ssh) on two
  loopback "hosts" (127.0.0.1, 127.0.0.2), status lists the nodes, it trains, stop leaves
  no process, and the cluster secret never shows in any process's command line or log.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib.machinery import SourceFileLoader
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest
import yaml

from distflow.core.auth import new_secret
from distflow.core.config import read_raw
from distflow.trainer.metrics import read_metrics
from tests.conftest import ROOT
from tests.netns import missing_tool

DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
PDSH_LAUNCHER = DEPLOY / "pdsh" / "distflow-pdsh"
FAKE_ADDR = "172.18.0.5"


# ====================================================================== docker-compose
@pytest.fixture(scope="module")
def compose() -> list[str]:
    """The compose command: Docker's v2 plugin if present, else Debian's docker-compose (scripts/test-deps.sh)."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 timeout=30).returncode == 0:
        return ["docker", "compose"]
    reason = missing_tool("docker-compose", "docker-compose")
    if reason:
        pytest.skip(reason)
    return ["docker-compose"]


def compose_config(compose: list[str], tmp_path: Path, secret: str, profiles: tuple[str, ...] = (), **env: str) -> dict:
    env_file = tmp_path / "compose.env"
    env_file.write_text(f"DISTFLOW_SECRET={secret}\n")
    full = {k: v for k, v in os.environ.items() if not k.startswith("DISTFLOW_")}
    full.update(DISTFLOW_ENV_FILE=str(env_file), **env)
    # --env-file: interpolate from this test's file, never from a developer's deploy/.env
    flags = [f for p in profiles for f in ("--profile", p)]
    r = subprocess.run([*compose, "--env-file", str(env_file), "-f", str(COMPOSE), *flags, "config"], capture_output=True,
                       text=True, timeout=120, env=full, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


@pytest.fixture
def image_toy_model(toy_model, tmp_path):
    """The toy model the image builds at /opt/distflow/toy-model, where run_service_check finds it
    (``--check`` checks the model directory of a rollout or trainer node), and the image's /app:
    the examples, and the toy reward model it builds where grpo_reward_model.yaml names it
    (relative to the example; a worker node checks the reward model its group loads)."""
    from distflow.toy import build_toy_reward_model

    (tmp_path / "toy-model").symlink_to(toy_model)
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "examples").symlink_to(ROOT / "examples")
    build_toy_reward_model(tmp_path / "app" / "outputs" / "toy-reward-model")


def run_service_check(service: dict, tmp_path: Path, hostname: str) -> subprocess.CompletedProcess:
    """Run the service's resolved command here with ``--check`` appended."""
    def local(text: str) -> str:
        text = re.sub(r"(?<![\w.-])/data/", f"{tmp_path}/data/", text)  # the volume, not /app/examples/data/
        app = tmp_path / "app" if (tmp_path / "app").is_dir() else ROOT  # the image's /app (image_toy_model)
        return text.replace("/app/", f"{app}/").replace("/opt/distflow/toy-model", str(tmp_path / "toy-model"))

    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "hostname").write_text('#!/bin/sh\nif [ "$1" = "-i" ]; then echo "$FAKE_ADDR 10.9.9.9"; '
                                   'else echo "$FAKE_HOSTNAME"; fi\n')
    (fake / "hostname").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTFLOW_")}
    env.update({k: local(str(v)) for k, v in service["environment"].items()})
    env.update(PATH=f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}", FAKE_ADDR=FAKE_ADDR,
               FAKE_HOSTNAME=hostname)
    cmd = [local(c.replace("$$", "$")) for c in service["command"]] + ["--check"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)  # the image's WORKDIR


def test_compose_services_resolve_and_every_command_checks(compose, tmp_path, image_toy_model):
    secret = new_secret()
    cfg = compose_config(compose, tmp_path, secret)
    services = cfg["services"]
    # the worker-group service is in profile "workers" (compose v1 lists it anyway; v2 does not)
    assert set(services) - {"worker"} == {"trainer-0", "trainer", "rollout"}
    assert services.get("worker", {}).get("profiles", ["workers"]) == ["workers"]
    services.pop("worker", None)
    assert services["trainer-0"]["hostname"] == "trainer-0"
    assert services["trainer"]["deploy"]["replicas"] == 1 and services["rollout"]["deploy"]["replicas"] == 2
    for name, svc in services.items():
        assert svc["environment"]["DISTFLOW_SECRET"] == secret  # from the env file, nowhere else
        assert secret not in json.dumps(svc["command"])
        targets = [v["target"] if isinstance(v, dict) else v.split(":")[1] for v in svc["volumes"]]
        assert targets == ["/data"], svc["volumes"]
        assert svc["build"]["dockerfile"].endswith("Dockerfile")

    expected = {  # service -> (hostname the container would have, node id, role, seeds, a pipeline stage)
        "trainer-0": ("trainer-0", "trainer-0", "trainer", "(first node)", "'update'"),
        "trainer": ("8d1c0e2f4a6b", "trainer-8d1c0e2f4a6b", "trainer", "['trainer-0:29600']", "'update'"),
        "rollout": ("3f2a9c1b7e4d", "rollout-3f2a9c1b7e4d", "rollout", "['trainer-0:29600']", "'generate'"),
    }
    for name, (hostname, node_id, role, seeds, stage) in expected.items():
        r = run_service_check(services[name], tmp_path, hostname)
        assert r.returncode == 0, f"{name}: {r.stderr}"
        assert r.stdout.startswith(f"ok: {node_id} role={role} host={FAKE_ADDR} seeds={seeds} "), r.stdout
        assert stage in r.stdout


def test_compose_counts_come_from_the_environment(compose, tmp_path, image_toy_model):
    cfg = compose_config(compose, tmp_path, new_secret(), DISTFLOW_ROLLOUT_NODES="4", DISTFLOW_TRAINER_NODES="3",
                         DISTFLOW_TRAINER_REPLICAS="2", DISTFLOW_RUN_NAME="big")
    s = cfg["services"]
    assert s["rollout"]["deploy"]["replicas"] == 4 and s["trainer"]["deploy"]["replicas"] == 2
    for svc in s.values():
        assert str(svc["environment"]["DISTFLOW_ROLLOUT_NODES"]) == "4"
        assert str(svc["environment"]["DISTFLOW_TRAINER_NODES"]) == "3"
        assert svc["environment"]["DISTFLOW_OUTPUT_DIR"] == "/data/big"
    assert run_service_check(s["rollout"], tmp_path, "aaaa").returncode == 0
    # The counts really reach the config: 3 rollout nodes cannot share the quickstart's 32 prompts per step.
    bad = compose_config(compose, tmp_path, new_secret(), DISTFLOW_ROLLOUT_NODES="3")
    r = run_service_check(bad["services"]["rollout"], tmp_path, "bbbb")
    assert r.returncode == 2 and "prompts_per_step (32) must be a multiple of rollout_nodes (3)" in r.stderr


def test_compose_worker_group_profile_checks_with_the_reward_model_example(compose, tmp_path, image_toy_model):
    """``--profile workers`` with DISTFLOW_WORKER_GROUP/NODES: the `worker` service runs that
    group's nodes (``--role worker --group reward``) and every node gets ``worker_groups.reward``."""
    cfg = compose_config(compose, tmp_path, new_secret(), profiles=("workers",),
                         DISTFLOW_CONFIG="/app/examples/grpo_reward_model.yaml", DISTFLOW_WORKER_GROUP="reward",
                         DISTFLOW_WORKER_NODES="2")
    s = cfg["services"]
    assert s["worker"]["deploy"]["replicas"] == 2 and s["worker"]["profiles"] == ["workers"]
    expected = {"worker": ("5e6f7a8b9c0d", "ok: worker-5e6f7a8b9c0d role=reward", "['score', 'rm', 'advantage']"),
                "rollout": ("1a2b3c4d5e6f", "ok: rollout-1a2b3c4d5e6f role=rollout", "['generate']"),
                "trainer-0": ("trainer-0", "ok: trainer-0 role=trainer", "'update'")}
    for name, (hostname, head, stage) in expected.items():
        r = run_service_check(s[name], tmp_path, hostname)
        assert r.returncode == 0, f"{name}: {r.stderr}"
        assert r.stdout.startswith(head) and stage in r.stdout, r.stdout
    # the count reaches the config: a worker group of 0 nodes is refused by its validation
    bad = compose_config(compose, tmp_path, new_secret(), profiles=("workers",),
                         DISTFLOW_CONFIG="/app/examples/grpo_reward_model.yaml", DISTFLOW_WORKER_GROUP="reward",
                         DISTFLOW_WORKER_NODES="0")
    r = run_service_check(bad["services"]["rollout"], tmp_path, "dddd")
    assert r.returncode == 2 and "worker_groups" in r.stderr, r.stderr


def test_committed_env_example_has_no_secret_and_dot_env_is_ignored(compose, tmp_path):
    example = (DEPLOY / "env.example").read_text()
    assert re.search(r"^DISTFLOW_SECRET=$", example, re.M)
    cfg = compose_config(compose, tmp_path, "")
    r = run_service_check(cfg["services"]["rollout"], tmp_path, "cccc")
    assert r.returncode == 2 and "DISTFLOW_SECRET must hold the cluster secret" in r.stderr
    if shutil.which("git") and (ROOT / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", "deploy/.env"], cwd=ROOT, timeout=30)
        assert ignored.returncode == 0, "deploy/.env must be git-ignored"
    else:
        assert "deploy/.env" in (ROOT / ".gitignore").read_text().split()


def test_dockerfile_provides_what_compose_uses():
    lines = [ln.strip() for ln in (DEPLOY / "Dockerfile").read_text().splitlines()]
    code = [ln for ln in lines if ln and not ln.startswith("#")]
    assert code[0] == "FROM python:3.11-slim"
    torch_at = next(i for i, ln in enumerate(code) if 'pip install "torch==' in ln)
    deps_at = next(i for i, ln in enumerate(code) if "pip install -r /tmp/requirements.txt" in ln)
    project_at = next(i for i, ln in enumerate(code) if ln.startswith("RUN pip install --no-deps ."))
    assert torch_at < deps_at < project_at  # torch's CPU build first (as scripts/setup.sh does), so that
    # the project's `torch>=...` requirement is already met and no CUDA build is pulled
    assert "download.pytorch.org/whl/cpu" in code[torch_at] or "download.pytorch.org/whl/cpu" in code[torch_at - 1]
    assert "WORKDIR /app" in code and "COPY examples ./examples" in code
    assert "RUN distflow toy-model /opt/distflow/toy-model" in code
    assert "EXPOSE 29600 29601" in code
    compose_text = COMPOSE.read_text()
    for path in ("/app/examples/grpo_quickstart.yaml", "/app/examples/data/successor.jsonl",
                 "/opt/distflow/toy-model", "--port 29600 --data-port 29601"):
        assert path in compose_text
    # (the quickstart's eval_dataset is relative to the example file: examples/data/, which COPY examples puts there)
    for path in ("examples/grpo_quickstart.yaml", "examples/data/successor.jsonl", "examples/data/successor_eval.jsonl"):
        assert (ROOT / path).is_file()


# ====================================================================== the launcher's plan (no pdsh needed)
def load_launcher() -> ModuleType:
    loader = SourceFileLoader("distflow_pdsh", str(PDSH_LAUNCHER))
    spec = importlib.util.spec_from_loader("distflow_pdsh", loader)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["distflow_pdsh"] = mod
    loader.exec_module(mod)
    return mod


def test_hostfile_example_plans_ids_ports_devices_and_seeds():
    dp = load_launcher()
    specs = dp.parse_hostfile((DEPLOY / "pdsh" / "hostfile.example").read_text())
    plans = dp.build_plans(specs, "/c.yaml", ["lr=1e-4"], "/run", "/work")
    a, b, c = plans["gpu-a"], plans["gpu-b"], plans["cpu-c"]
    assert [(n["id"], n["port"], n["data_port"], n["gpu"]) for n in a["nodes"]] == [
        ("trainer-gpu-a-0", 29600, 29601, "0"), ("trainer-gpu-a-1", 29602, 29603, "1")]
    assert [(n["id"], n["port"], n["gpu"]) for n in b["nodes"]] == [
        (f"rollout-gpu-b-{i}", 29600 + 2 * i, str(i)) for i in range(4)]
    assert [(n["id"], n["port"], n["gpu"]) for n in c["nodes"]] == [
        ("rollout-cpu-c-0", 29700, None), ("rollout-cpu-c-1", 29702, None)]
    assert a["overrides"] == ["lr=1e-4", "rollout_nodes=6", "trainer_nodes=2", "device=cuda"]
    assert c["overrides"] == ["lr=1e-4", "rollout_nodes=6", "trainer_nodes=2"]
    assert {p["seeds"] for p in plans.values()} == {"10.0.0.11:29600,10.0.0.12:29600"}
    assert a["env"] == {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}
    assert (a["bind"], b["bind"], c["bind"]) == ("10.0.0.11", "10.0.0.12", "10.0.0.13")


def test_hostfile_gpus_follow_the_placement_rule():
    """One distinct GPU per trainer; rollout nodes on the rest, or with colocate=1 on the
    trainers' GPUs (distflow.launch.placement.place, the rule of `distflow run`)."""
    dp = load_launcher()
    plan = lambda text: {n["id"]: n["gpu"] for p in dp.build_plans(dp.parse_hostfile(text), "/c.yaml", [], "/r", "/w")
                         .values() for n in p["nodes"]}  # noqa: E731
    assert plan("h trainer=2 rollout=3 gpus=4,5,6 bind=10.0.0.1") == {
        "trainer-h-0": "4", "trainer-h-1": "5", "rollout-h-0": "6", "rollout-h-1": "6", "rollout-h-2": "6"}
    assert plan("h trainer=2 rollout=3 gpus=0,1 colocate=1 bind=10.0.0.1") == {
        "trainer-h-0": "0", "trainer-h-1": "1", "rollout-h-0": "0", "rollout-h-1": "1", "rollout-h-2": "0"}
    # each node's environment says how many of the host's nodes share its GPU (KV-cache sizing)
    (p,) = dp.build_plans(dp.parse_hostfile("h trainer=2 rollout=3 gpus=0,1 colocate=1 bind=10.0.0.1"), "/c.yaml",
                          [], "/r", "/w").values()
    assert {n["id"]: dp._node_env(p, n, "s" * 32)["DISTFLOW_GPU_NODES"] for n in p["nodes"]} == {
        "trainer-h-0": "3", "trainer-h-1": "2", "rollout-h-0": "3", "rollout-h-1": "2", "rollout-h-2": "3"}
    with pytest.raises(dp.LaunchError, match="host h: gpus: 1 GPU.*trainer_nodes=2 needs one GPU per trainer rank"):
        plan("h trainer=2 rollout=1 gpus=0 bind=10.0.0.1")
    with pytest.raises(dp.LaunchError, match="none is left for the rollout nodes.*colocate"):
        plan("h trainer=1 rollout=1 gpus=0 bind=10.0.0.1")
    with pytest.raises(dp.LaunchError, match="host h: trainer=2 on device=cuda needs gpus="):
        plan("h trainer=2 rollout=1 device=cuda bind=10.0.0.1")
    assert plan("h trainer=1 rollout=1 device=cuda bind=10.0.0.1") == {"trainer-h-0": None, "rollout-h-0": None}


def test_hostfile_without_gpus_is_refused_when_the_config_says_cuda(tmp_path):
    """The "two trainer ranks need gpus=" rule reads the device the nodes will run on: the
    host's device=, else the config's (with the command line's overrides)."""
    dp = load_launcher()
    cuda, cpu = tmp_path / "cuda.yaml", tmp_path / "cpu.yaml"
    cuda.write_text("device: cuda\n")
    cpu.write_text("lr: 1.0e-5\n")
    two = dp.parse_hostfile("h trainer=2 rollout=1 bind=10.0.0.1")
    with pytest.raises(dp.LaunchError, match=r"host h: trainer=2 on device: cuda \(from the config\) needs gpus="):
        dp.build_plans(two, str(cuda), [], "/r", "/w")
    with pytest.raises(dp.LaunchError, match="needs gpus="):
        dp.build_plans(two, str(cpu), ["device=cuda"], "/r", "/w")
    assert dp.build_plans(two, str(cuda), ["device=cpu"], "/r", "/w")  # overridden back to cpu
    assert dp.build_plans(dp.parse_hostfile("h trainer=2 rollout=1 device=cpu bind=10.0.0.1"), str(cuda), [],
                          "/r", "/w")  # the host's device= wins
    assert dp.build_plans(two, str(tmp_path / "missing.yaml"), [], "/r", "/w")  # unreadable here: the check says so


def test_hostfile_worker_groups_plan_their_nodes_counts_and_argv(tmp_path):
    """``group.NAME=N``: N nodes of worker group NAME on that host (``--role worker --group
    NAME``), the totals become ``worker_groups.NAME``, GPUs are placed like rollout nodes, and
    the planned command line passes ``distflow-node --check`` on the shipped example."""
    dp = load_launcher()
    specs = dp.parse_hostfile("a trainer=1 rollout=1 group.reward=1 gpus=0,1 device=cuda bind=10.0.0.1\n"
                              "b rollout=1 group.reward=2 bind=10.0.0.2 port=29700")
    plans = dp.build_plans(specs, str(ROOT / "examples" / "grpo_reward_model.yaml"), [], "/run", str(ROOT))
    a, b = plans["a"], plans["b"]
    assert [(n["id"], n["role"], n.get("group"), n["port"], n["gpu"]) for n in a["nodes"]] == [
        ("trainer-a-0", "trainer", None, 29600, "0"), ("rollout-a-0", "rollout", None, 29602, "1"),
        ("reward-a-0", "worker", "reward", 29604, "1")]
    assert [(n["id"], n["port"]) for n in b["nodes"]] == [("rollout-b-0", 29700), ("reward-b-0", 29702),
                                                          ("reward-b-1", 29704)]
    assert b["overrides"] == ["rollout_nodes=2", "trainer_nodes=1", "worker_groups.reward=3"]
    argv = dp._node_argv(a, a["nodes"][2])
    assert argv[argv.index("--role") + 1: argv.index("--role") + 4] == ["worker", "--group", "reward"]
    env = {**os.environ, "DISTFLOW_SECRET": new_secret()}
    r = subprocess.run([*argv, "--check"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ok: reward-a-0 role=reward ") and "pipeline=['score', 'rm', 'advantage']" in r.stdout, \
        r.stdout


@pytest.mark.parametrize("text, message", [
    ("a trainer=1 rollout=1 colour=blue", "hostfile:1: unknown key 'colour'"),
    ("a trainer=1 rollout=1 colocate=yes bind=10.0.0.1", "hostfile:1: colocate='yes' must be 0 or 1"),
    ("a trainer=1 bind=10.0.0.1\n\na rollout=1 bind=10.0.0.1", "hostfile:3: host 'a' is listed twice"),
    ("a trainer=one bind=10.0.0.1", "hostfile:1: trainer='one' must be a non-negative integer"),
    ("a rollout=2 bind=10.0.0.1", "a cluster needs at least one trainer and one rollout node"),
    ("a trainer=1 bind=10.0.0.1 env.DISTFLOW_SECRET=x", "hostfile:1: never put the secret in the hostfile"),
    ("a,b trainer=1 rollout=1", "hostfile:1: 'a,b' is not a host name"),
    ("a trainer=1 rollout=1 bind=0.0.0.0", "bind=0.0.0.0 cannot be advertised"),
    ("localhost trainer=1 rollout=1", "resolves to loopback"),
    ("a trainer=1 rollout=1 bind=10.0.0.1 port=29600\nb rollout=1 bind=10.0.0.1 port=29602",
     "b and a both use 10.0.0.1:29602"),
    ("a trainer=1 rollout=1 bind=10.0.0.1 device=tpu", "device='tpu' must be cpu or cuda"),
    ("a trainer=1 rollout=1 bind=10.0.0.1 port=65534", "port=65534 leaves no room for 2 nodes"),
    ("a trainer=1 rollout=1 group.reward=1 bind=10.0.0.1 port=65532", "port=65532 leaves no room for 3 nodes"),
    ("a trainer=1 rollout=1 group.9x=1 bind=10.0.0.1", "hostfile:1: 'group.9x': a worker group name"),
    ("a trainer=1 rollout=1 group.reward=two bind=10.0.0.1", "group.reward='two' must be a non-negative"),
])
def test_hostfile_errors_name_the_line_and_the_problem(text: str, message: str) -> None:
    dp = load_launcher()
    with pytest.raises(dp.LaunchError, match=re.escape(message)):
        dp.parse_hostfile(text)


# ====================================================================== pdsh, for real
@pytest.fixture(scope="module")
def pdsh() -> str:
    reason = missing_tool("pdsh", "pdsh")
    if reason:
        pytest.skip(reason)
    return shutil.which("pdsh")


def free_base_port(addr: str, n: int) -> int:
    """A base port with ``n`` consecutive bindable ports, below the ephemeral range."""
    import random

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    while True:
        base = rng.randrange(max(1024, low - 12000), low - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind((addr, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


def processes_mentioning(*needles: str) -> dict[int, str]:
    found = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if any(n.encode() in cmd for n in needles):
                found[int(p.name)] = cmd.replace(b"\0", b" ").decode(errors="replace")[:200]
    return found


class CmdlineWatch:
    """Samples every process's command line in the background, looking for the secret."""

    def __init__(self, secret: str):
        self.secret, self.hits, self.samples = secret.encode(), [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cmdline-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for p in Path("/proc").iterdir():
                if p.name.isdigit():
                    try:
                        if self.secret in (p / "cmdline").read_bytes():
                            self.hits.append(p.name)
                    except OSError:
                        pass
            self.samples += 1
            self._stop.wait(0.02)

    def __enter__(self) -> "CmdlineWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def launcher(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DISTFLOW_SECRET"}
    return subprocess.run([sys.executable, str(PDSH_LAUNCHER), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture
def pdsh_run(pdsh: str, toy_model: Path, tmp_path: Path) -> Iterator[dict]:
    """A run dir, config, secret file and hostfile for two loopback hosts; kills leftovers at the end."""
    from distflow.toy import make_toy_dataset

    data = tmp_path / "data.jsonl"
    make_toy_dataset(data, 400, seed=5)
    raw = read_raw(ROOT / "examples" / "grpo_quickstart.yaml")
    raw.update(output_dir=str(tmp_path / "out"), model_path=str(toy_model), toy_model=False, dataset=str(data),
               prompts_per_step=4, group_size=2, max_new_tokens=2, epochs=100)  # far longer than the test
    raw["mesh"] = {"protocol_period_s": 0.2, "join_timeout_s": 60}
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    secret = new_secret()
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(secret)
    secret_file.chmod(0o600)
    p1, p2 = free_base_port("127.0.0.1", 4), free_base_port("127.0.0.2", 4)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# two 'hosts' on loopback\n127.0.0.1 trainer=1 rollout=1 port={p1}\n"
                        f"127.0.0.2 rollout=1 port={p2}\n")
    run_dir = tmp_path / "run"
    ctx = {"cfg": cfg, "secret": secret, "secret_file": secret_file, "hostfile": hostfile, "run_dir": run_dir,
           "ports": (p1, p2), "out": tmp_path / "out",
           "start": ["start", str(hostfile), str(cfg), "--rcmd", "exec", "--python", sys.executable,
                     "--run-dir", str(run_dir), "--secret-file", str(secret_file)]}
    yield ctx
    for pid in processes_mentioning(str(run_dir), str(cfg)):  # only if the test failed half-way
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_pdsh_cluster_starts_reports_trains_and_stops_without_leaks(pdsh_run):
    c = pdsh_run
    p1, p2 = c["ports"]
    ids = {"trainer-127.0.0.1-0": f"127.0.0.1:{p1}", "rollout-127.0.0.1-0": f"127.0.0.1:{p1 + 2}",
           "rollout-127.0.0.2-0": f"127.0.0.2:{p2}"}
    with CmdlineWatch(c["secret"]) as watch:
        r = launcher(*c["start"])
        assert r.returncode == 0, r.stderr
        started = dict(ln.split("\t")[1:3] for ln in r.stdout.splitlines())
        assert set(started) == set(ids)
        pids = [int(v.split()[1]) for v in started.values()]
        assert "trainer rank 0 is trainer-127.0.0.1-0 on 127.0.0.1" in r.stderr

        deadline = time.monotonic() + 60
        while True:  # the mesh as `distflow status` sees it, through the launcher
            st = launcher("status", "--run-dir", str(c["run_dir"]), "--json", timeout=120)
            assert st.returncode == 0, st.stderr + st.stdout
            report = json.loads(st.stdout)
            members = {m["id"]: m for m in report["members"]}
            if set(members) == set(ids) and all(m["state"] == "alive" for m in members.values()):
                break
            assert time.monotonic() < deadline, report
            time.sleep(1)
        assert {i: m["address"] for i, m in members.items()} == ids
        assert {i: m["role"] for i, m in members.items()} == {i: i.split("-")[0] for i in ids}
        procs = {row["node"]: row for rows in report["processes"].values() for row in rows}
        assert set(procs) == set(ids) and all(row["alive"] for row in procs.values())
        assert sorted(row["pid"] for row in procs.values()) == sorted(pids)

        metrics = c["out"] / "metrics.jsonl"
        while len(read_metrics(metrics)) < 3:
            assert time.monotonic() < deadline + 60, "no training steps"
            time.sleep(0.2)
        first = len(read_metrics(metrics))
        while len(read_metrics(metrics)) <= first:
            assert time.monotonic() < deadline + 90, "training stalled"
            time.sleep(0.2)

        t0 = time.monotonic()
        stop = launcher("stop", "--run-dir", str(c["run_dir"]), "--grace", "15", timeout=120)
        assert stop.returncode == 0, stop.stderr
        assert time.monotonic() - t0 < 40
    rows = [ln.split("\t") for ln in stop.stdout.splitlines()]
    assert {row[1] for row in rows} == set(ids) and all(row[2] in ("terminated", "killed") for row in rows), rows
    assert all(re.fullmatch(r"rc=-?\d+", row[3]) for row in rows), rows  # the keeper recorded every exit
    assert processes_mentioning(str(c["run_dir"]), str(c["cfg"])) == {}
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids)
    # The secret never appeared on a command line, in a log or in anything the launcher printed.
    assert watch.samples > 20 and watch.hits == []
    for f in c["run_dir"].rglob("*"):
        if f.is_file() and f.name != "secret":
            assert c["secret"] not in f.read_text(errors="replace"), f
    assert c["secret"] not in r.stdout + r.stderr + st.stdout + stop.stdout + stop.stderr
    assert (c["run_dir"] / "secret").stat().st_mode & 0o777 == 0o600
    # The logs were gathered per host.
    collected = c["run_dir"] / "collected"
    for node_id in ids:
        host = node_id.split("-")[1]
        assert f"{node_id} up: control" in (collected / host / f"{node_id}.log").read_text()


def test_pdsh_worker_group_node_trains_and_stops(pdsh_run):
    """A hostfile with ``group.reward=1``: the reward worker starts on its host as
    ``--role worker --group reward``, joins with its group's role, scores every step (the
    trainer trains them) and stops with the rest."""
    c = pdsh_run
    raw = yaml.safe_load(c["cfg"].read_text())
    raw["worker_groups"] = {"reward": 1}
    raw["workflow"] = [
        {"id": "generate", "role": "ACTOR", "type": "MODEL_INFERENCE", "fn": "generate"},
        {"id": "score", "role": "REWARD", "type": "COMPUTE", "fn": "successor", "deps": ["generate"],
         "group": "reward"},
        {"id": "advantage", "role": "ACTOR", "type": "COMPUTE", "fn": "grpo", "deps": ["score"]},
        {"id": "update", "role": "ACTOR", "type": "MODEL_TRAIN", "fn": "grpo", "deps": ["advantage"]}]
    raw["kl_coef"] = 0.0  # no reference node: no KL (the config refuses kl_coef > 0 without one)
    raw.update(eval_dataset=None, eval_every=0)  # evaluation needs the rewards on the rollout group
    c["cfg"].write_text(yaml.safe_dump(raw))
    p1, p2 = c["ports"]
    c["hostfile"].write_text(f"127.0.0.1 trainer=1 rollout=1 port={p1}\n127.0.0.2 rollout=1 group.reward=1 port={p2}\n")
    r = launcher(*c["start"])
    try:
        assert r.returncode == 0, r.stderr
        started = dict(ln.split("\t")[1:3] for ln in r.stdout.splitlines())
        assert set(started) == {"trainer-127.0.0.1-0", "rollout-127.0.0.1-0", "rollout-127.0.0.2-0",
                                "reward-127.0.0.2-0"}
        metrics = c["out"] / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while len(read_metrics(metrics)) < 3:
            assert time.monotonic() < deadline, "no training steps"
            time.sleep(0.2)
        st = launcher("status", "--run-dir", str(c["run_dir"]), "--json", timeout=120)
        members = {m["id"]: m for m in json.loads(st.stdout)["members"]}
        assert members["reward-127.0.0.2-0"]["role"] == "reward"
        assert members["reward-127.0.0.2-0"]["address"] == f"127.0.0.2:{p2 + 2}"
        assert all(row["samples"] == 8 for row in read_metrics(metrics)[:3])  # 4 prompts x 2, all scored
    finally:
        stop = launcher("stop", "--run-dir", str(c["run_dir"]), "--grace", "15", timeout=120)
    assert stop.returncode == 0, stop.stderr
    assert processes_mentioning(str(c["run_dir"]), str(c["cfg"])) == {}
    log = (c["run_dir"] / "collected" / "127.0.0.2" / "reward-127.0.0.2-0.log").read_text()
    assert "reward-127.0.0.2-0 up: control" in log


def test_pdsh_bad_config_starts_nothing_and_says_why(pdsh_run):
    c = pdsh_run
    r = launcher(*c["start"], "prompts_per_step=3")
    assert r.returncode == 2
    assert "check failed, nothing was started" in r.stderr
    assert "prompts_per_step (3) must be a multiple of rollout_nodes (2)" in r.stderr
    assert processes_mentioning(str(c["run_dir"]), str(c["cfg"])) == {}
    assert not list(c["run_dir"].glob("hosts/*/pids/*.pid"))


# ====================================================================== the tests' system tools
def test_tests_install_nothing_and_every_tool_they_skip_without_comes_from_test_deps():
    """One documented step installs the system tools (scripts/test-deps.sh, run by setup.sh as root
    with apt-get); a test whose tool is missing skips naming the tool and that step."""
    script = (ROOT / "scripts" / "test-deps.sh").read_text()
    installed = set(tuple(t.split(":")) for t in re.search(r"^TOOLS=\(([^)]*)\)", script, re.M).group(1)
                    .replace('"', "").split())
    sources = {p.name: p.read_text() for p in (ROOT / "tests").glob("*.py")}
    checked = {m for text in sources.values() for m in re.findall(r'missing_tool\("([^"]+)", "([^"]+)"\)', text)}
    assert checked == installed == {("pdsh", "pdsh"), ("docker-compose", "docker-compose"), ("ip", "iproute2"),
                                    ("munged", "munge"), ("slurmctld", "slurm-wlm"), ("slurmd", "slurm-wlm")}
    for needle in ('"apt' + '-get"', "'apt" + "-get'", '"pip", "inst' + 'all"', '"-m", "p' + 'ip"'):  # argv of an install
        assert not [name for name, text in sources.items() if needle in text], needle
    assert "bash scripts/test-deps.sh" in (ROOT / "scripts" / "setup.sh").read_text()
    reason = missing_tool  # (not spelled as a call: the scan above would count these two)
    assert reason("dft-no-such-tool", "dft-pkg") == ("dft-no-such-tool is not installed: run scripts/test-deps.sh "
                                                    "(as root; it installs Debian's dft-pkg)")
    assert reason("sh", "dash") is None
