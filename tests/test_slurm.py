"""``distflow slurm``: the rendered sbatch script, run by a real Slurm (tests/slurm_lab.py).

The quickstart as a heterogeneous job (2 trainers and 2 rollout nodes as two components of
their own CPU and GPU shapes on two Slurm nodes, one distflow-node per task, ranks, ports and
seeds from the allocation, GPUs per task through gres) runs to completion under sbatch; as
a homogeneous job, USR1 to the batch shell, the signal ``--signal=B:USR1@N`` sends before
the time limit, leaves a checkpoint and requeues the job, and the requeued attempt resumes
from it by itself and finishes, every step trained once. Rendering alone (dry run, the gres
lines, a user's template, bad input) needs no Slurm.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distflow.trainer.metrics import read_metrics
from tests.conftest import ROOT, run_distflow

QUICKSTART = ROOT / "examples" / "grpo_quickstart.yaml"
DATA = ROOT / "examples" / "data" / "successor.jsonl"
PORT = 29000 + os.getpid() % 500 * 2  # the trainers' first port (--port), the rollout nodes' 100 above


def render(*args: str) -> subprocess.CompletedProcess:
    return run_distflow(["slurm", str(QUICKSTART), "--dry-run", *args], timeout=60)


def test_dry_run_renders_a_script_bash_accepts_with_steps_gres_signal_and_secret_file():
    r = render("--time=01:00:00", "--signal-s=120", "--gpus-per-task=1", "--partition=gpu", "max_steps=4")
    assert r.returncode == 0, r.stderr
    s = r.stdout
    assert "#SBATCH --signal=B:USR1@120" in s and "#SBATCH --time=01:00:00" in s and "#SBATCH --requeue" in s
    # gres: GPUs per host for the tasks a host gets; each task its own GPU through its step
    assert "#SBATCH --nodes=1 --ntasks=4 --cpus-per-task=4 --ntasks-per-node=4 --gres=gpu:4\n" in s
    assert s.count(" --gpus-per-task=1 \\\n") == 2
    assert s.count("srun --kill-on-bad-exit=1") == 2 and "--seeds auto" in s and "max_steps=4" in s
    assert 'cat "$RUN_DIR/secret"' in s and "DISTFLOW_SECRET=" not in s.replace("DISTFLOW_SECRET=$(cat", "")
    assert subprocess.run(["bash", "-n"], input=s, text=True).returncode == 0


def test_a_heterogeneous_job_gives_trainers_and_rollout_nodes_their_own_host_shapes():
    r = render("--trainer-hosts=1", "--rollout-hosts=2", "--gpus-per-task=1", "--rollout-gpus-per-task=2",
               "--rollout-cpus-per-task=8", "device=cpu")
    assert r.returncode == 0, r.stderr
    s = r.stdout
    assert "#SBATCH hetjob" in s and "--het-group=0 --ntasks=2" in s and "--het-group=1 --ntasks=2" in s
    assert "#SBATCH --nodes=1 --ntasks=2 --cpus-per-task=4 --ntasks-per-node=2 --gres=gpu:2\n#SBATCH hetjob\n" in s
    assert "#SBATCH hetjob\n#SBATCH --nodes=2 --ntasks=2 --cpus-per-task=8 --ntasks-per-node=1 --gres=gpu:2\n" in s
    assert "--het-group=1 --ntasks=2 --cpus-per-task=8 --gpus-per-task=2 " in s


def test_device_cuda_asks_each_component_for_gpus_through_gres_and_cpu_for_none():
    s = render("--trainer-hosts=2", "--rollout-hosts=1", "device=cuda").stdout  # 1 GPU a task by default
    assert "#SBATCH --nodes=2 --ntasks=2 --cpus-per-task=4 --ntasks-per-node=1 --gres=gpu:1\n#SBATCH hetjob\n" in s
    assert "#SBATCH hetjob\n#SBATCH --nodes=1 --ntasks=2 --cpus-per-task=4 --ntasks-per-node=2 --gres=gpu:2\n" in s
    assert s.count("--gpus-per-task=1 ") == 2
    s = render("--trainer-hosts=1", "--rollout-hosts=1", "--rollout-gpus-per-task=0", "device=cuda").stdout
    assert "#SBATCH hetjob\n#SBATCH --nodes=1 --ntasks=2 --cpus-per-task=4\n" in s  # rollout on CPU hosts
    s = render("--trainer-hosts=1", "--rollout-hosts=1", "device=cpu").stdout
    assert "gres" not in s and "gpus" not in s


def test_a_users_template_and_bad_input(tmp_path):
    t = tmp_path / "mine.j2"
    t.write_text("#!/bin/bash\n#SBATCH --ntasks={{ trainers + rollouts }}\necho {{ config }} {{ site }}\n")
    r = render(f"--template={t}")
    assert r.returncode == 2 and "template" in r.stderr and "site" in r.stderr  # StrictUndefined names it
    t.write_text("#!/bin/bash\n#SBATCH --ntasks={{ trainers + rollouts }}\n")
    assert render(f"--template={t}").stdout == "#!/bin/bash\n#SBATCH --ntasks=4\n"
    r = render("lr=banana")
    assert r.returncode == 2 and "lr" in r.stderr
    r = render("--trainer-hosts=1")
    assert r.returncode == 2 and "--rollout-hosts" in r.stderr


def test_seeds_auto_from_env_slurm_and_kubernetes(monkeypatch):
    from distflow.core.config import ConfigError
    from distflow.launch.seeds import auto_seeds

    assert auto_seeds("127.0.0.1", 5000, {"DISTFLOW_SEEDS": "a:1,127.0.0.1:5000"}) == ["a:1"]  # itself left out
    k8s = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "DISTFLOW_K8S_SERVICE": "run-nodes",
           "DISTFLOW_K8S_SEED_POD": "run-trainer-0", "DISTFLOW_SEED_PORT": "29600"}
    assert auto_seeds("10.1.1.1", 29601, k8s) == ["run-trainer-0.run-nodes:29600"]
    with pytest.raises(ConfigError, match="no DISTFLOW_SEEDS"):
        auto_seeds("127.0.0.1", 1, {})


# ---------------------------------------------------------------------- a real Slurm
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    from tests.slurm_lab import SlurmLab, unavailable_reason

    if reason := unavailable_reason():
        pytest.skip(reason)
    lab = SlurmLab(tmp_path_factory.mktemp("slurm"))
    try:
        lab.start()
    except Exception as e:  # noqa: BLE001
        lab.stop()
        pytest.fail(f"cannot start Slurm here: {e}")
    yield lab
    lab.stop()


def submit(slurm, tmp_path: Path, toy_model: Path, *overrides: str) -> tuple[str, Path]:
    out = tmp_path / "run"
    env = {**slurm.env, "PYTHONPATH": str(ROOT), "DISTFLOW_BIND": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "distflow.cli", "slurm", str(QUICKSTART), "--cpus-per-task=1",
                        f"--python={sys.executable}", f"--port={PORT}",
                        f"output_dir={out}", f"model_path={toy_model}", "toy_model=false", f"dataset={DATA}",
                        "prompts_per_step=8", "group_size=2", "eval_dataset=null", "eval_every=0", *overrides],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    job = r.stdout.split()[2].rstrip(":")
    secret = out / "slurm" / "secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    return job, out


def wait_for(slurm, pred, timeout: float, what: str, out: Path):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-1500:]}"
                             for p in sorted((out / "slurm" / "logs").rglob("*")) if p.is_file())
            pytest.fail(f"{what}: not after {timeout:.0f} s\n{logs}\n{slurm.logs()}")
        time.sleep(0.5)


@pytest.mark.cluster
def test_sbatch_runs_the_quickstart_as_a_heterogeneous_job_to_completion(slurm, toy_model, tmp_path):
    # Two components of their own shape (trainers 1 CPU and 1 GPU a task, rollout nodes 2 and 2) on two
    # Slurm nodes; the homogeneous form runs in the requeue test below. The GPUs are the lab's fake
    # ones (device: cpu): what is checked is that Slurm gives each task its own through gres. A
    # --node-cmd wrapper (as a container wrapper would be) writes where its task runs into its log.
    wrapper = tmp_path / "node-wrapper"
    wrapper.write_text('#!/bin/sh\necho "on $SLURMD_NODENAME with CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"\n'
                       'exec distflow-node "$@"\n')
    wrapper.chmod(0o755)
    job, out = submit(slurm, tmp_path, toy_model, "--trainer-hosts=1", "--rollout-hosts=1", "--gpus-per-task=1",
                      "--rollout-cpus-per-task=2", "--rollout-gpus-per-task=2", f"--node-cmd={wrapper}", "max_steps=4")
    wait_for(slurm, lambda: slurm.job_state(job)[0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 400,
             f"job {job} done", out)
    assert slurm.job_state(job)[0] == "COMPLETED", slurm.logs()
    comps = [dict(f.split("=", 1) for f in block.split() if "=" in f)
             for block in slurm.run("scontrol", "show", "job", job).stdout.strip().split("\n\n")]
    shapes = [(c["HetJobId"], c["HetJobOffset"], c["JobState"], c["NumTasks"], c["CPUs/Task"], c["NumCPUs"],
               c["TresPerNode"]) for c in comps]
    assert shapes == [(job, "0", "COMPLETED", "2", "1", "2", "gres:gpu:2"),
                      (job, "1", "COMPLETED", "2", "2", "4", "gres:gpu:4")]
    assert sorted(c["NodeList"] for c in comps) == sorted(slurm.nodes)  # one Slurm node each
    gpus = {}
    for role, first, comp in (("trainer", PORT, comps[0]), ("rollout", PORT + 100, comps[1])):
        for rank in (0, 1):  # rank: SLURM_PROCID in its component's step; ports: SLURM_LOCALID on its node
            log = (out / "slurm" / "logs" / "attempt-0" / f"{role}-{rank}.log").read_text()
            head = log.splitlines()[0]
            assert head.startswith(f"on {comp['NodeList']} with CUDA_VISIBLE_DEVICES="), head
            gpus[role, rank] = head.rpartition("=")[2]
            assert f"{role}-{rank}: {role} rank {rank} of 2" in log
            # the seed: trainer rank 0, at the NodeAddr of component 0's node (SLURM_JOB_NODELIST_HET_GROUP_0)
            seeds = "none (the first node)" if (role, rank) == ("trainer", 0) else f"127.0.0.1:{PORT}"
            assert f"up: control 127.0.0.1:{first + 2 * rank}, data port {first + 1 + 2 * rank}, seeds {seeds}" in log
    # each task its own GPUs of its component's node
    assert sorted([gpus["trainer", 0], gpus["trainer", 1]]) == ["0", "1"]
    assert sorted([gpus["rollout", 0], gpus["rollout", 1]]) == ["0,1", "2,3"]
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]
    logs = sorted(p.name for p in (out / "slurm" / "logs" / "attempt-0").iterdir())
    assert logs == ["rollout-0.log", "rollout-1.log", "trainer-0.log", "trainer-1.log"]
    secret = (out / "slurm" / "secret").read_text()
    for p in (out / "slurm").rglob("*"):  # the secret only in its own file
        assert p.name == "secret" or not p.is_file() or secret not in p.read_text(errors="replace")


@pytest.mark.cluster
def test_the_time_limit_signal_checkpoints_and_the_requeued_job_resumes_by_itself(slurm, toy_model, tmp_path):
    job, out = submit(slurm, tmp_path, toy_model, "max_steps=60")
    wait_for(slurm, lambda: len(read_metrics(out / "metrics.jsonl")) >= 3, 300, "three steps", out)
    # What --signal=B:USR1@N does before the time limit: USR1 to the batch shell.
    slurm.run("scancel", "--batch", "--signal=USR1", job)
    wait_for(slurm, lambda: slurm.job_state(job) == ("PENDING", 1), 180, "the job requeued", out)
    slurm.release_requeued(job)  # Slurm holds a requeued job ~2 min
    wait_for(slurm, lambda: slurm.job_state(job)[0] in ("COMPLETED", "FAILED", "CANCELLED"), 400,
             f"job {job} done", out)
    assert slurm.job_state(job) == ("COMPLETED", 1), slurm.logs()
    first = (out / "slurm" / "logs" / "attempt-1" / "trainer-0.log").read_text()
    assert "resum" in first.lower()
    steps = [m["step"] for m in read_metrics(out / "metrics.jsonl")]
    assert steps == list(range(60))  # every step once: the resumed run dropped nothing and repeated nothing
    batch_log = next((out / "slurm" / "logs").glob("slurm-*.out")).read_text()
    assert "requeueing job" in batch_log and "attempt 1" in batch_log and "resume_from=" in batch_log
