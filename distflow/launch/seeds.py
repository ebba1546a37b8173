"""``distflow-node --seeds auto``: the seeds from where the node runs, not from its command line.

Why: under Slurm or Kubernetes the addresses are only known once the allocation exists, so
a launcher cannot write them into a command line beforehand; the node finds them itself, in
this order:

1. ``$DISTFLOW_SEEDS`` (``HOST:PORT[,...]``), when set: an explicit choice wins.
2. Slurm (``$SLURM_JOB_NODELIST``): the first host of the trainer component
   (``SLURM_JOB_NODELIST_HET_GROUP_0`` in a heterogeneous job: a step of component 1 sees
   only its own nodes in ``SLURM_JOB_NODELIST``), expanded by ``scontrol show hostnames``,
   at its ``NodeAddr`` (``scontrol show node``: a node name need not resolve, as with
   ``NodeName=n01 NodeAddr=10.1.0.1``; the name when there is none), at
   ``$DISTFLOW_SEED_PORT`` (29600): trainer rank 0, which ``distflow slurm``'s script
   starts there.
3. Kubernetes (``$KUBERNETES_SERVICE_HOST``): the stable DNS name of the seed StatefulSet's
   first pod through the headless Service (``$DISTFLOW_K8S_SEED_POD.$DISTFLOW_K8S_SERVICE``),
   as ``distflow k8s``'s manifests set them.

The node's own address is left out (the first node joins nobody), so every node of a job
can be started with the same ``--seeds auto``.
"""

from __future__ import annotations

import os
import socket
import subprocess

DEFAULT_PORT = 29600


def _addrs(host: str) -> set[str]:
    try:
        return {a[4][0] for a in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return set()


def slurm_first_host(env: dict[str, str]) -> str | None:
    nodelist = env.get("SLURM_JOB_NODELIST_HET_GROUP_0") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    r = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    hosts = r.stdout.split()
    if r.returncode != 0 or not hosts:
        raise RuntimeError(f"scontrol show hostnames {nodelist}: {r.stderr.strip() or 'no hosts'}")
    return node_addr(hosts[0])


def node_addr(node: str) -> str:
    """The address Slurm itself reaches NODE at (its ``NodeAddr``); NODE when scontrol has none."""
    try:
        r = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return node
    addrs = [f.split("=", 1)[1] for f in r.stdout.split() if f.startswith("NodeAddr=")]
    return addrs[0] if r.returncode == 0 and addrs and addrs[0] not in ("", "(null)") else node


def auto_seeds(my_host: str, my_port: int, env: dict[str, str] | None = None) -> list[str]:
    """The seeds for a node binding ``my_host:my_port`` (itself excluded). Raises ConfigError
    naming what was looked at when none is found."""
    from distflow.core.config import ConfigError

    env = dict(os.environ if env is None else env)
    port = int(env.get("DISTFLOW_SEED_PORT") or DEFAULT_PORT)
    if env.get("DISTFLOW_SEEDS"):
        seeds = [s.strip() for s in env["DISTFLOW_SEEDS"].split(",") if s.strip()]
    elif env.get("SLURM_JOB_NODELIST"):
        try:
            seeds = [f"{slurm_first_host(env)}:{port}"]
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            raise ConfigError(f"--seeds auto: cannot expand the Slurm node list: {e}") from None
    elif env.get("KUBERNETES_SERVICE_HOST") and env.get("DISTFLOW_K8S_SERVICE") and env.get("DISTFLOW_K8S_SEED_POD"):
        seeds = [f"{env['DISTFLOW_K8S_SEED_POD']}.{env['DISTFLOW_K8S_SERVICE']}:{port}"]
    else:
        raise ConfigError("--seeds auto: no DISTFLOW_SEEDS, no Slurm allocation (SLURM_JOB_NODELIST) and no "
                          "Kubernetes pod of `distflow k8s` (DISTFLOW_K8S_SERVICE) to find seeds from")
    mine = _addrs(my_host) | {my_host}
    if env.get("DISTFLOW_K8S_SEED_POD") and socket.gethostname() == env["DISTFLOW_K8S_SEED_POD"]:
        mine.add(seeds[0].rpartition(":")[0])  # the seed pod itself (its DNS name may not resolve yet)

    def is_me(seed: str) -> bool:
        host, _, p = seed.rpartition(":")
        return int(p) == my_port and (host in mine or bool(_addrs(host) & mine))

    return [s for s in seeds if not is_me(s)]
