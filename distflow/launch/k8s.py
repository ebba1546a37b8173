"""``distflow k8s CONFIG``: Kubernetes manifests for the config's cluster, printed (or written with ``-o``).

Why StatefulSets and a headless Service: a DistFlow node needs a stable id (a restarted
rollout node rejoins as itself and gets its shard back) and one stable address to join
through. A StatefulSet per role gives pods stable names (``NAME-trainer-0`` ...), which are
the node ids; the headless Service gives each pod a stable DNS name, and the first trainer's
(``NAME-trainer-0.NAME-nodes``) is every node's seed (``--seeds auto``,
:mod:`distflow.launch.seeds`). ``podManagementPolicy: Parallel`` starts all pods at once: the
nodes wait for each other in the mesh (``mesh.join_timeout_s``), not in Kubernetes' order.

Also rendered: the cluster secret as a Secret (given to the nodes through their environment,
never a command line), the config as a ConfigMap, GPUs as ``nvidia.com/gpu`` limits, and the
output directory on a PersistentVolumeClaim the trainers share (``--pvc``; an emptyDir
otherwise, which is lost with the pod). The manifests are plain dicts dumped as YAML, not a
text template, so they are always well-formed; tests validate them against the Kubernetes
schemas (kubernetes-validate).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

CONTROL_PORT, DATA_PORT = 29600, 29601
CONFIG_PATH = "/etc/distflow/config.yaml"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distflow k8s", description="Print Kubernetes manifests for CONFIG (kubectl "
                                "apply -f -). KEY=VALUE arguments override config keys on every node.")
    p.add_argument("config")
    p.add_argument("-o", "--output", default=None, help="write the manifests here (mode 0600: they hold the secret)")
    p.add_argument("--name", default=None, help="prefix of every object (default: the config's name)")
    p.add_argument("--namespace", default=None)
    p.add_argument("--image", default="distflow:latest")
    p.add_argument("--gpus-per-pod", type=int, default=None, help="default: 1 with device: cuda, else 0")
    p.add_argument("--rollout-gpus-per-pod", type=int, default=None,
                   help="default: --gpus-per-pod x rollout_tensor_parallel (the engine's TP ranks)")
    p.add_argument("--cpu", default="4", help="CPU request of a pod")
    p.add_argument("--memory", default="16Gi", help="memory request of a pod")
    p.add_argument("--pvc", default=None, help="an existing ReadWriteMany PersistentVolumeClaim for output_dir")
    p.add_argument("--existing-secret", default=None, help="use this Secret (key DISTFLOW_SECRET); render none")
    return p


def _name(text: str) -> str:
    """A DNS-1123 label from any text (Kubernetes object names)."""
    s = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return (s or "distflow")[:40].rstrip("-")


def manifests(args: argparse.Namespace, overrides: Sequence[str], secret: str) -> list[dict[str, Any]]:
    from distflow.core.config import ConfigError, load_config

    cfg = load_config(args.config, list(overrides))
    if cfg.controller != "distributed" or cfg.worker_groups:
        raise ConfigError("distflow k8s: controller: single and worker_groups are not rendered yet")
    name = _name(args.name or cfg.name)
    service, seed_pod = f"{name}-nodes", f"{name}-trainer-0"
    labels = {"app.kubernetes.io/name": "distflow", "app.kubernetes.io/instance": name}
    meta = lambda n, **extra: {"name": n, "labels": {**labels, **extra},  # noqa: E731
                               **({"namespace": args.namespace} if args.namespace else {})}
    secret_name = args.existing_secret or f"{name}-secret"
    out_dir = "/data/" + _name(Path(cfg.output_dir).name)
    docs: list[dict[str, Any]] = []
    if not args.existing_secret:
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": meta(secret_name), "type": "Opaque",
                     "stringData": {"DISTFLOW_SECRET": secret}})
    docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(f"{name}-config"),
                 "data": {"config.yaml": Path(args.config).read_text()}})
    ports = [{"name": "control", "port": CONTROL_PORT, "targetPort": CONTROL_PORT},
             {"name": "data", "port": DATA_PORT, "targetPort": DATA_PORT}]
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": meta(service),
                 "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels, "ports": ports}})
    gpus = args.gpus_per_pod if args.gpus_per_pod is not None else int(cfg.device == "cuda")
    shape = {"trainer": (cfg.trainer_nodes, gpus),
             "rollout": (cfg.rollout_nodes,
                         args.rollout_gpus_per_pod if args.rollout_gpus_per_pod is not None
                         else gpus * cfg.rollout_tensor_parallel)}  # the engine's TP ranks, one GPU each
    for role, (replicas, role_gpus) in shape.items():
        docs.append(statefulset(name, role, replicas, role_gpus, args, labels, meta, service, seed_pod, secret_name,
                                [f"rollout_nodes={cfg.rollout_nodes}", f"trainer_nodes={cfg.trainer_nodes}",
                                 f"output_dir={out_dir}", *[o for o in overrides if not o.startswith(
                                     ("rollout_nodes=", "trainer_nodes=", "output_dir="))]]))
    return docs


def statefulset(name: str, role: str, replicas: int, gpus: int, args: argparse.Namespace, labels: dict, meta: Any,
                service: str, seed_pod: str, secret_name: str, overrides: list[str]) -> dict[str, Any]:
    pod_labels = {**labels, "distflow/role": role}
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "DISTFLOW_SECRET", "valueFrom": {"secretKeyRef": {"name": secret_name, "key": "DISTFLOW_SECRET"}}},
           {"name": "DISTFLOW_K8S_SERVICE", "value": service}, {"name": "DISTFLOW_K8S_SEED_POD", "value": seed_pod},
           {"name": "DISTFLOW_SEED_PORT", "value": str(CONTROL_PORT)}, {"name": "PYTHONUNBUFFERED", "value": "1"}]
    resources: dict[str, Any] = {"requests": {"cpu": args.cpu, "memory": args.memory}}
    if gpus:
        resources["limits"] = {"nvidia.com/gpu": gpus}
    data_volume = ({"name": "data", "persistentVolumeClaim": {"claimName": args.pvc}} if args.pvc
                   else {"name": "data", "emptyDir": {}})
    container = {
        "name": "node", "image": args.image,
        # The pod's name is its node id (stable across restarts); it binds and advertises its pod IP.
        "command": ["distflow-node", "--role", role, "--config", CONFIG_PATH, "--node-id", "$(POD_NAME)",
                    "--host", "$(POD_IP)", "--port", str(CONTROL_PORT), "--data-port", str(DATA_PORT),
                    "--seeds", "auto", *overrides],
        "env": env, "resources": resources,
        "ports": [{"name": "control", "containerPort": CONTROL_PORT}, {"name": "data", "containerPort": DATA_PORT}],
        "volumeMounts": [{"name": "config", "mountPath": "/etc/distflow", "readOnly": True},
                         {"name": "data", "mountPath": "/data"}, {"name": "shm", "mountPath": "/dev/shm"}],
    }
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": meta(f"{name}-{role}", **{"distflow/role": role}),
            "spec": {"serviceName": service, "replicas": replicas, "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": pod_labels},
                     "template": {"metadata": {"labels": pod_labels},
                                  "spec": {"containers": [container], "terminationGracePeriodSeconds": 60,
                                           "volumes": [{"name": "config", "configMap": {"name": f"{name}-config"}},
                                                       data_volume,
                                                       {"name": "shm", "emptyDir": {"medium": "Memory"}}]}}}}


def main(argv: Sequence[str]) -> int:
    import yaml

    from distflow.core.auth import SECRET_ENV, new_secret
    from distflow.core.config import ConfigError

    flags = [a for a in argv if a.startswith("-") or "=" not in a]
    overrides = [a for a in argv if not a.startswith("-") and "=" in a]
    args = parser().parse_args(flags)
    try:
        docs = manifests(args, overrides, os.environ.get(SECRET_ENV) or new_secret())
    except (ConfigError, OSError) as e:
        print(f"distflow k8s: {e}", file=sys.stderr)
        return 2
    text = yaml.safe_dump_all(docs, sort_keys=False)
    if args.output:
        fd = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        print(f"wrote {len(docs)} manifests to {args.output} (kubectl apply -f {args.output})")
    else:
        sys.stdout.write(text)
    return 0
