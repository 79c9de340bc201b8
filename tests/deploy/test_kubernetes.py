"""Kubernetes manifests: built-in kinds validate strictly against the Kubernetes JSON schemas shipped in
``kubernetes-validate`` (offline); the ServiceMonitor, a CRD those schemas do not cover, gets a structural
check of the fields we use. Then the manifests agree with each other and with the server."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from server.metrics import metric_specs
from tests.deploy.conftest import (
    ADAPTER_VALUES,
    CACHE_DIR,
    ENTRYPOINT,
    KUBERNETES_DIR,
    SERVER_PORT,
    SHUTDOWN_GRACE_SECONDS,
    load_yaml,
    serve_settings,
)

# The oldest Kubernetes the manifests are written for, and the newest schemas the package ships.
KUBERNETES_VERSIONS = ("1.27", kubernetes_validate.utils.latest_version())
CRD_GROUPS = ("monitoring.coreos.com",)
MANIFEST_FILES = sorted(KUBERNETES_DIR.glob("*.yaml"))

# ServiceMonitor (monitoring.coreos.com/v1): the fields of the Prometheus Operator's API we rely on.
SERVICE_MONITOR_SPEC_FIELDS = {
    "selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels", "podTargetLabels",
}  # fmt: skip
SERVICE_MONITOR_ENDPOINT_FIELDS = {
    "port", "targetPort", "path", "scheme", "interval", "scrapeTimeout", "honorLabels", "honorTimestamps",
    "relabelings", "metricRelabelings", "params", "bearerTokenSecret", "authorization", "basicAuth", "tlsConfig",
}  # fmt: skip


def manifests() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{path.name}:{doc['kind']}", doc) for path in MANIFEST_FILES for doc in load_yaml(path)]


def by_kind(kind: str) -> dict[str, Any]:
    found = [doc for _, doc in manifests() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def is_crd(doc: dict[str, Any]) -> bool:
    return doc["apiVersion"].split("/")[0] in CRD_GROUPS


def check_service_monitor(doc: dict[str, Any]) -> None:
    """Structure of a ServiceMonitor: apiVersion, kind, metadata, spec.selector and endpoints."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["kind"] == "ServiceMonitor"
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
    assert isinstance(doc["metadata"]["name"], str) and doc["metadata"]["name"]
    spec = doc["spec"]
    assert set(spec) <= SERVICE_MONITOR_SPEC_FIELDS, set(spec) - SERVICE_MONITOR_SPEC_FIELDS
    assert isinstance(spec["selector"]["matchLabels"], dict) and spec["selector"]["matchLabels"]
    assert isinstance(spec["endpoints"], list) and spec["endpoints"]
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= SERVICE_MONITOR_ENDPOINT_FIELDS, set(endpoint) - SERVICE_MONITOR_ENDPOINT_FIELDS
        assert ("port" in endpoint) != ("targetPort" in endpoint), "a ServiceMonitor endpoint names one port"
        assert str(endpoint.get("path", "/metrics")).startswith("/")
        assert str(endpoint.get("interval", "30s"))[-1] in "smh"


def container() -> dict[str, Any]:
    return by_kind("Deployment")["spec"]["template"]["spec"]["containers"][0]


def pod_labels() -> dict[str, str]:
    return by_kind("Deployment")["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_every_file_holds_named_manifests():
    assert {path.name for path in MANIFEST_FILES} >= {
        "deployment.yaml", "service.yaml", "secret.example.yaml", "hpa.yaml", "servicemonitor.yaml",
    }  # fmt: skip
    for name, doc in manifests():
        assert {"apiVersion", "kind", "metadata"} <= set(doc), name
        assert doc["metadata"]["name"], name


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("name", "doc"), manifests(), ids=[name for name, _ in manifests()])
def test_manifest_validates(name, doc, version):
    if is_crd(doc):
        assert doc["kind"] == "ServiceMonitor", f"{name}: no structural check for this custom resource"
        check_service_monitor(doc)
        return
    kubernetes_validate.validate(doc, version, strict=True)


def test_validation_rejects_a_misspelled_field():
    doc = copy.deepcopy(by_kind("Deployment"))
    pod = doc["spec"]["template"]["spec"]["containers"][0]
    pod["livenesProbe"] = pod.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)
    monitor = copy.deepcopy(by_kind("ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["pth"] = "/metrics"
    with pytest.raises(AssertionError):
        check_service_monitor(monitor)


def test_deployment_runs_the_server_with_real_flags():
    deployment = by_kind("Deployment")
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels())
    settings = serve_settings([*ENTRYPOINT[1:], *container()["args"]])
    assert settings.metrics_compat == "vllm"  # routers and vLLM dashboards read vllm:* names
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > settings.drain_timeout + SHUTDOWN_GRACE_SECONDS
    assert "lifecycle" not in container(), "the server drains on SIGTERM itself: no preStop hook"


def test_probes():
    ports = {port["name"]: port["containerPort"] for port in container()["ports"]}
    assert ports == {"http": SERVER_PORT}
    probes = {name: container()[name]["httpGet"] for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["startupProbe"]["path"] == "/health/ready"
    assert probes["readinessProbe"]["path"] == "/health/ready"
    assert probes["livenessProbe"]["path"] == "/health"
    assert all(probe["port"] in ports for probe in probes.values())
    startup = container()["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "model loading needs minutes"


def test_resources_and_security():
    resources = container()["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])
    pod_security = by_kind("Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] != 0
    assert container()["securityContext"]["allowPrivilegeEscalation"] is False


def test_api_key_comes_from_the_secret():
    env = {item["name"]: item for item in container()["env"]}
    ref = env["DFLASH2_API_KEY"]["valueFrom"]["secretKeyRef"]
    secret = by_kind("Secret")
    assert ref["name"] == secret["metadata"]["name"]
    assert ref["key"] in secret["stringData"]


def test_model_cache_volume_is_mounted_at_the_image_cache():
    mounts = {mount["name"]: mount["mountPath"] for mount in container()["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in by_kind("Deployment")["spec"]["template"]["spec"]["volumes"]}
    cache = [name for name, path in mounts.items() if path == CACHE_DIR]
    assert cache and ("emptyDir" in volumes[cache[0]] or "persistentVolumeClaim" in volumes[cache[0]])


def test_service_and_service_monitor_reach_the_metrics_port():
    service = by_kind("Service")
    assert selects(service["spec"]["selector"], pod_labels())
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http" and port["port"] == SERVER_PORT
    monitor = by_kind("ServiceMonitor")
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert [endpoint["port"] for endpoint in monitor["spec"]["endpoints"]] == [port["name"]]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_pod_disruption_budget_selects_the_pods():
    assert selects(by_kind("PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pod_labels())


def test_hpa_scales_the_deployment_on_the_adapter_metric():
    hpa = by_kind("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == by_kind("Deployment")["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]

    gauges = {"dflash2_" + spec.name for spec in metric_specs(block_size=8) if spec.kind == "gauge"}
    assert name == "dflash2_num_requests_waiting" and name in gauges

    (rule,) = load_yaml(ADAPTER_VALUES)[0]["rules"]["custom"]
    assert rule["seriesQuery"].startswith(name + "{")
    assert rule["name"]["as"] == name
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]


def test_tensor_parallel_example_asks_for_one_gpu_per_rank():
    """deploy/kubernetes/tensor-parallel/: one pod, N GPUs, the server's --tensor-parallel-size N, a
    memory-backed /dev/shm for NCCL; it validates and keeps the pod labels the Service selects."""
    (doc,) = load_yaml(KUBERNETES_DIR / "tensor-parallel" / "deployment.yaml")
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)
    pod = doc["spec"]["template"]["spec"]
    (tp_container,) = pod["containers"]
    settings = serve_settings([*ENTRYPOINT[1:], *tp_container["args"]])
    ranks = settings.engine.tensor_parallel_size
    assert ranks > 1 and tp_container["resources"]["limits"]["nvidia.com/gpu"] == ranks
    assert doc["spec"]["template"]["metadata"]["labels"] == pod_labels()
    shm = {v["name"]: v for v in pod["volumes"]}["dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in tp_container["volumeMounts"]
    assert {m["mountPath"] for m in tp_container["volumeMounts"]} >= {CACHE_DIR}
