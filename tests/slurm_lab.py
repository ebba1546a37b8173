"""A real one-host Slurm cluster for tests: munged, slurmctld and slurmd started as root.

Why a real one: the sbatch script DistFlow renders is shell run by Slurm's own daemons
(srun steps, signals, requeue); a mock would test our assumptions about Slurm, not Slurm.
Everything is private to the test: its own munge key and socket, its own slurm.conf
(``$SLURM_CONF``), ports, state and spool directories under a temp dir, so the machine's
own Slurm or munge (if any) is never touched. Two Slurm nodes, both the machine itself (two
slurmd, each with its own node name, port and spool), with 8 CPUs configured each
(``SlurmdParameters=config_overrides``: a 2-core CI box still runs 4 tasks).

Why two nodes on one host: the components of a heterogeneous job are started by the backfill
scheduler only, and backfill plans whole nodes: on a one-node cluster it plans component 1
to start when component 0 ends (slurmctld: ``_dump_job_sched: JobId=N+1 to start at <end of
N+0>``), so the job pends (``Resources``) forever. With a second node each component gets its
own, as on a real cluster. ``bf_interval=1``: a heterogeneous job starts within a second or
two instead of at the next 30 s backfill pass.

Each node has 4 GPUs for Slurm's gres (``Gres=gpu:4``, ``gres.conf``): character devices
made here with ``/dev/null``'s numbers (1, 3), so no GPU is needed, and what is checked is
Slurm's own part: which GPUs a job and each task of a step get (``CUDA_VISIBLE_DEVICES``).
Nothing opens them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

from tests.netns import missing_tool


def unavailable_reason() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the Slurm test starts slurmctld/slurmd as root (SlurmUser=root); not root here"
    return missing_tool("munged", "munge") or missing_tool("slurmctld", "slurm-wlm") or missing_tool("slurmd", "slurm-wlm")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmLab:
    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname()
        self.nodes = [self.host, f"{self.host}-b"]  # Slurm node names; both run here
        self.gpus = 4  # per node, fake (module docstring)
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        self.procs: list[subprocess.Popen] = []

    def start(self, timeout: float = 60.0) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o755)
        key = r / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = r / "munge" / "sock"
        self._spawn(["munged", "-F", "-f", f"--key-file={key}", f"--socket={sock}", f"--pid-file={r}/munge/pid",
                     f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge/seed"], "munged")
        self._wait(lambda: sock.exists(), timeout, "munged's socket")
        (r / "dev").mkdir(exist_ok=True)
        for i in range(self.gpus):
            if not (r / "dev" / f"nvidia{i}").exists():
                os.mknod(r / "dev" / f"nvidia{i}", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        (r / "gres.conf").write_text(f"Name=gpu File={r}/dev/nvidia[0-{self.gpus - 1}]\n")  # next to slurm.conf
        port = _free_port()
        nodes = "".join(f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 "
                        f"Port={_free_port() if i else port} CPUs=8 Gres=gpu:{self.gpus} RealMemory=1000 "
                        "State=UNKNOWN\n" for i, n in enumerate(self.nodes))
        (r / "slurm.conf").write_text(f"""ClusterName=dft{os.getpid()}
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={port}
GresTypes=gpu
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=bf_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=30
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
{nodes}PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
""")
        self._spawn(["slurmctld", "-D", "-i", "-f", str(r / "slurm.conf")], "slurmctld")
        for n in self.nodes:
            (r / "spool" / n).mkdir(exist_ok=True)
            self._spawn(["slurmd", "-D", "-f", str(r / "slurm.conf"), "-N", n], f"slurmd-{n}")
        self._wait(lambda: self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split() == ["idle"] * 2,
                   timeout, "both nodes idle in sinfo")

    def _spawn(self, cmd: list[str], name: str) -> None:
        out = open(self.root / "log" / f"{name}.out", "wb")
        self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))

    def _wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm lab: no {what} after {timeout:.0f} s; logs: {self.logs()}")
            time.sleep(0.3)

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        r = subprocess.run(list(cmd), capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
        return r

    def job_state(self, job: str) -> tuple[str, int]:
        """(state, restarts) of a job, from scontrol."""
        out = self.run("scontrol", "show", "job", job).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return fields.get("JobState", "?"), int(fields.get("Restarts", "0"))

    def release_requeued(self, job: str, timeout: float = 120.0) -> None:
        """Start a requeued job now, once its previous attempt is wholly gone.

        Slurm holds a requeued job ~2 min before it may start again. Releasing it at once
        races the old attempt: slurmd revokes the job's credential when the old batch step
        ends, with a 1 s clock, and a new attempt whose credential was issued within that same
        second is killed as "Job credential revoked". So wait for the old steps to be gone and
        the node idle, then let a second boundary pass before releasing.
        """
        self._wait(lambda: not self.run("squeue", "-h", "-s", "-j", job, check=False).stdout.strip(), timeout,
                   f"end of job {job}'s previous steps")
        self._wait(lambda: self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip() == "idle", timeout,
                   "the node idle again after the requeue")
        time.sleep(1.5)
        self.run("scontrol", "update", f"JobId={job}", "StartTime=now")

    def logs(self) -> str:
        files = sorted(p for p in (self.root / "log").glob("*") if p.is_file())
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in files)

    def stop(self) -> None:
        if shutil.which("scancel"):
            self.run("scancel", "--user=root", check=False)
        for p in reversed(self.procs):  # only the daemons this lab started, by pid
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
