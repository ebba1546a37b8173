"""``distflow k8s``: the manifests validate against the Kubernetes schemas (kubernetes-validate),
and say what the nodes need: one StatefulSet per role started in parallel, the headless Service
whose DNS name of the first trainer pod is every node's seed, the secret as a Secret, GPUs."""

from __future__ import annotations

import importlib.util
import stat

import pytest
import yaml

from tests.conftest import ROOT, run_distflow

QUICKSTART = ROOT / "examples" / "grpo_quickstart.yaml"


def render(*args: str) -> list[dict]:
    r = run_distflow(["k8s", str(QUICKSTART), *args], timeout=60)
    assert r.returncode == 0, r.stderr
    return list(yaml.safe_load_all(r.stdout))


@pytest.mark.skipif(importlib.util.find_spec("kubernetes_validate") is None,
                    reason="kubernetes-validate is not installed (pip install -e '.[dev]')")
def test_manifests_validate_against_the_kubernetes_schemas():
    import kubernetes_validate

    docs = render("--namespace=rl", "--pvc=shared-outputs", "device=cuda", "max_steps=5")
    for d in docs:
        kubernetes_validate.validate(d, "1.30.0", strict=True)  # raises naming the field
    kinds = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert kinds == [("Secret", "grpo-quickstart-secret"), ("ConfigMap", "grpo-quickstart-config"),
                     ("Service", "grpo-quickstart-nodes"), ("StatefulSet", "grpo-quickstart-trainer"),
                     ("StatefulSet", "grpo-quickstart-rollout")]
    svc = docs[2]["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    for sts, role in ((docs[3], "trainer"), (docs[4], "rollout")):
        spec = sts["spec"]
        assert spec["podManagementPolicy"] == "Parallel" and spec["replicas"] == 2
        assert spec["serviceName"] == "grpo-quickstart-nodes"
        c = spec["template"]["spec"]["containers"][0]
        assert c["command"][:3] == ["distflow-node", "--role", role] and "auto" in c["command"]
        assert "max_steps=5" in c["command"] and c["resources"]["limits"] == {"nvidia.com/gpu": 1}
        env = {e["name"]: e for e in c["env"]}
        assert env["DISTFLOW_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "grpo-quickstart-secret"
        assert env["DISTFLOW_K8S_SEED_POD"]["value"] == "grpo-quickstart-trainer-0"
        assert not any(docs[0]["stringData"]["DISTFLOW_SECRET"] in a for a in c["command"])
        vols = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
        assert vols["data"]["persistentVolumeClaim"]["claimName"] == "shared-outputs"


def test_an_existing_secret_a_file_only_the_user_reads_and_the_seed_a_pod_finds(tmp_path, monkeypatch):
    docs = render("--existing-secret=mine")
    assert [d["kind"] for d in docs][0] == "ConfigMap" and "limits" not in str(docs[-1])  # cpu: no GPUs
    out = tmp_path / "m.yaml"
    r = run_distflow(["k8s", str(QUICKSTART), "-o", str(out)], timeout=60)
    assert r.returncode == 0 and stat.S_IMODE(out.stat().st_mode) == 0o600
    from distflow.launch.seeds import auto_seeds

    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "DISTFLOW_K8S_SERVICE": "grpo-quickstart-nodes",
           "DISTFLOW_K8S_SEED_POD": "grpo-quickstart-trainer-0", "DISTFLOW_SEED_PORT": "29600"}
    assert auto_seeds("10.2.0.7", 29600, env) == ["grpo-quickstart-trainer-0.grpo-quickstart-nodes:29600"]
    monkeypatch.setattr("socket.gethostname", lambda: "grpo-quickstart-trainer-0")
    assert auto_seeds("10.2.0.5", 29600, env) == []  # the seed pod joins nobody
