"""deploy/kubernetes: every overlay renders with `kubectl kustomize` and validates offline against
the Kubernetes schemas bundled in kubernetes-validate; the values users change land where the
services read them, checked by parsing each container's expanded command with pagedserve's own
parser.

kubernetes-validate bundles schemas for Kubernetes 1.25 to 1.37 and reads them from its
package (no network). The CRD kinds (KEDA's ScaledObject, the Prometheus Operator's
ServiceMonitor and PodMonitor) have no bundled schema: they are checked here for what they
point at (a rendered Deployment, a Service port, a metric the api exports).
"""

from __future__ import annotations

import base64
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pagedserve.services.cli import command_parser
from pagedserve.services.launcher.healthcheck import SERVICES as HEALTHCHECKS

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (test extra)")
if shutil.which("kubectl") is None:
    pytest.skip("kubectl is not installed: `kubectl kustomize` renders the manifests", allow_module_level=True)

KUBE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
K8S_VERSIONS = ("1.29.0", "1.32.0", "1.37.0")  # oldest supported upstream, kubectl's, newest bundled
CRD_KINDS = {"ScaledObject", "ServiceMonitor", "PodMonitor"}
WORKLOADS = {"Deployment", "StatefulSet"}


def render(path: Path) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def find(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    assert len(matches) == 1, (kind, name, [d["metadata"]["name"] for d in matches])
    return matches[0]


def container(docs: list[dict], name: str) -> dict:
    return find(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


def expanded_args(docs: list[dict], c: dict) -> list[str]:
    """The container's args with $(VAR) expanded as the kubelet does, from env and envFrom."""
    values: dict[str, str] = {}
    for source in c.get("envFrom", []):
        values.update(find(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in c.get("env", []):
        source = var.get("valueFrom", {})
        if "resourceFieldRef" in source:  # e.g. limits.cpu, divisor 1: whole CPUs, rounded up
            group, resource = source["resourceFieldRef"]["resource"].split(".")
            if resource in c["resources"].get(group, {}):  # else the node's allocatable
                values[var["name"]] = str(math.ceil(float(c["resources"][group][resource])))
        else:
            values[var["name"]] = var.get("value", "a-pod-name" if "fieldRef" in source else "")
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in c["args"]]


def parse(docs: list[dict], name: str):
    args = expanded_args(docs, container(docs, name))
    assert args[0] == "pagedserve"
    parser, _module = command_parser(args[1])
    return parser.parse_args(args[2:])


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render(KUBE / "overlays" / request.param)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_resource_validates_offline(overlay, version):
    name, docs = overlay
    crds = [d for d in docs if d["kind"] in CRD_KINDS]
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises, naming the field
    assert {d["kind"] for d in crds} == (CRD_KINDS if name == "gpu" else set())


def test_strict_validation_rejects_a_misspelt_field():
    """The validator is no formality: one unknown field in a Deployment fails it."""
    doc = find(render(KUBE / "base"), "Deployment", "api")
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, "1.32.0", strict=True)


def test_probes_requests_and_scraping(overlay):
    _name, docs = overlay
    for workload in (d for d in docs if d["kind"] in WORKLOADS):
        pod = workload["spec"]["template"]
        for c in pod["spec"]["containers"]:
            what = f"{workload['metadata']['name']}/{c['name']}"
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), what
            if c["name"] != "exporter":
                assert "readinessProbe" in c and "livenessProbe" in c, what
            for probe in (c.get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe")):
                command = " ".join((probe or {}).get("exec", {}).get("command", []))
                if "pagedserve healthcheck" in command:
                    assert command.split("pagedserve healthcheck ")[1].split()[0] in HEALTHCHECKS, what
    api = container(docs, "api")
    assert (api["livenessProbe"]["httpGet"]["path"], api["readinessProbe"]["httpGet"]["path"]) == ("/health", "/ready")
    for scraped in ("api", "redis"):
        workload = find(docs, "Deployment" if scraped == "api" else "StatefulSet", scraped)
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
    for singleton in ("scheduler", "kvstore"):  # never two at once, even during a rollout
        assert find(docs, "Deployment", singleton)["spec"]["strategy"]["type"] == "Recreate"
    assert {find(docs, "PodDisruptionBudget", n)["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
            for n in ("api", "worker", "redis")} == {"api", "worker", "redis"}
    assert find(docs, "HorizontalPodAutoscaler", "api")["spec"]["scaleTargetRef"]["name"] == "api"


def test_redis_persists_and_runs_sentinels(overlay):
    _name, docs = overlay
    redis = find(docs, "StatefulSet", "redis")
    assert redis["spec"]["replicas"] == 3  # a master, two replicas, three sentinels (quorum 2)
    assert {c["name"] for c in redis["spec"]["template"]["spec"]["containers"]} == {"redis", "sentinel", "exporter"}
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    script = find(docs, "ConfigMap", "redis-scripts")["data"]["redis.sh"]
    assert "--appendonly yes" in script and "sentinel monitor" in script
    checked = subprocess.run(["sh", "-n"], input=script, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr
    config = find(docs, "ConfigMap", "pagedserve-config")["data"]
    assert config["REDIS_URL"].startswith("redis+sentinel://redis-0.redis:26379,")


def test_gpu_variant_asks_for_an_nvidia_gpu():
    docs = render(KUBE / "overlays" / "gpu")
    worker = container(docs, "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["image"] == "pagedserve:gpu" and container(docs, "api")["image"] == "pagedserve:latest"
    assert parse(docs, "worker").device == "cuda"
    scaled = find(docs, "ScaledObject", "worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == find(docs, "Deployment", "worker")["metadata"]["name"]
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    metrics = (Path(__file__).resolve().parents[2] / "services" / "api" / "metrics.py").read_text()
    assert re.search(r'"num_requests_waiting"', metrics) and "pagedserve:num_requests_waiting" in query
    monitor = find(docs, "ServiceMonitor", "api")
    service = find(docs, "Service", "api")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_values_users_change_land_where_they_should(tmp_path):
    """An overlay of the kind a user writes: its model, replicas, KV memory and API key reach
    the services' own command lines and environment."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "llm",
        "resources": [os.path.relpath(KUBE / "overlays" / "cpu", tmp_path)],
        "replicas": [{"name": "worker", "count": 5}, {"name": "api", "count": 3}],
        "configMapGenerator": [{"name": "pagedserve-config", "behavior": "merge", "literals": [
            "PAGEDSERVE_MODEL=/models/my-model.gguf", "PAGEDSERVE_KV_CACHE_MEMORY=6GiB"]}],
        "secretGenerator": [{"name": "pagedserve-api-key", "literals": ["api-key=s3cret"]}],
    }))
    docs = render(tmp_path)
    assert find(docs, "Deployment", "worker")["spec"]["replicas"] == 5
    assert find(docs, "Deployment", "api")["spec"]["replicas"] == 3
    worker, api = parse(docs, "worker"), parse(docs, "api")
    assert (worker.model, worker.kv_cache_memory, worker.device) == ("/models/my-model.gguf", "6GiB", "cpu")
    assert (worker.worker_id, worker.threads) == ("a-pod-name", 4)  # the pod's name, its CPU limit
    assert api.model == "/models/my-model.gguf" and (api.host, api.port) == ("0.0.0.0", 8000)
    (key,) = [v for v in container(docs, "api")["env"] if v["name"] == "PAGEDSERVE_API_KEY"]
    secret = find(docs, "Secret", "pagedserve-api-key")
    assert key["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"] != "pagedserve-api-key"
    assert base64.b64decode(secret["data"]["api-key"]) == b"s3cret"
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"llm"}
    for name in ("scheduler", "kvstore"):
        assert parse(docs, name).prefix == "pagedserve"
