"""The Kubernetes deployment (deploy/) renders, validates, and agrees with the code.

Every kustomization is rendered with `kubectl kustomize` and validated offline
against the Kubernetes JSON schemas that `kubernetes-validate` ships (strict:
unknown fields are errors). Then the cross-checks that keep the manifests and
the router in step: the ConfigMap's router.yaml loads with the router's own
loader, ports and probes match the router's defaults, the autoscaling metric
is one the router exports, every container is locked down, and the grace
period covers the drain.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

from router.config import ServerConfig, load_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUSTOMIZATIONS = {
    "base": DEPLOY / "base",
    "cpu": DEPLOY / "overlays" / "cpu",
    "gpu": DEPLOY / "overlays" / "gpu",
    "inference-gateway": DEPLOY / "overlays" / "inference-gateway",
}
OVERLAYS = ("cpu", "gpu")
# Custom resources kubernetes-validate has no schema for: validated against
# tests/deploy/schemas (the fields deploy/ uses, strict).
CRD_SCHEMAS = {
    "InferencePool": Path(__file__).with_name("schemas") / "inferencepool-v1.json",
    "HTTPRoute": Path(__file__).with_name("schemas") / "httproute-v1.json",
}
# Newest Kubernetes release whose schemas kubernetes-validate ships (offline).
K8S_VERSION = kubernetes_validate.latest_version()

# Metric names the manifests, the adapter rule and docs/deploy.md rely on.
# Each must be exported by router.metrics.
METRICS_RELIED_ON = frozenset(
    {
        "cbserve_num_requests_running",
        "cbserve_num_requests_waiting",
        "cbserve_kv_cache_usage_ratio",
        "cbserve_num_preemptions_total",
        "cbserve_time_to_first_token_seconds",
        "cbserve_inter_token_latency_seconds",
        "cbserve_iteration_tokens",
        "cbserve_generation_tokens_total",
    }
)

KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not on PATH: cannot render the kustomizations")

_RENDERED: dict[str, list[dict]] = {}


def render(name: str) -> list[dict]:
    """`kubectl kustomize` output of one kustomization, as a list of objects."""
    if name not in _RENDERED:
        proc = subprocess.run(
            [KUBECTL, "kustomize", str(KUSTOMIZATIONS[name])], capture_output=True, text=True, timeout=60, check=False
        )
        assert proc.returncode == 0, f"kubectl kustomize {name} failed:\n{proc.stderr}"
        _RENDERED[name] = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    return _RENDERED[name]


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(objs: list[dict]) -> dict:
    return one(objs, "Deployment", "cbserve")["spec"]["template"]["spec"]


def all_containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def container(spec: dict, name: str) -> dict:
    found = [c for c in all_containers(spec) if c["name"] == name]
    assert len(found) == 1, f"expected one container {name!r}, found {len(found)}"
    return found[0]


def config_text(objs: list[dict]) -> str:
    cms = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("cbserve-config")]
    assert len(cms) == 1, "expected one generated ConfigMap cbserve-config-<hash>"
    return cms[0]["data"]["router.yaml"]


def router_config(objs: list[dict], tmp_path: Path):
    path = tmp_path / "router.yaml"
    path.write_text(config_text(objs), encoding="utf-8")
    return load_config(str(path))


def exported_metric_names() -> set[str]:
    """Names router.metrics exports: METRIC_NAMES and what its registries hold."""
    import prometheus_client
    from prometheus_client.registry import CollectorRegistry

    import router.metrics as metrics

    names = set(getattr(metrics, "METRIC_NAMES", ()))
    registries = {id(r): r for r in vars(metrics).values() if isinstance(r, CollectorRegistry)}
    if hasattr(metrics, "Metrics"):  # the router's metrics object and its own registry
        registry = metrics.Metrics().registry
        registries[id(registry)] = registry
    registries.setdefault(id(prometheus_client.REGISTRY), prometheus_client.REGISTRY)
    for registry in registries.values():
        for family in registry.collect():
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
            if family.type == "counter":  # family "x" is exposed as "x_total"
                names.add(family.name + "_total")
    return names


# ---- rendering and schema validation ----------------------------------------------


@needs_kubectl
@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_kustomization_renders_and_validates(name):
    objs = render(name)
    kinds = {o["kind"] for o in objs}
    assert {
        "Deployment",
        "Service",
        "ConfigMap",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
    } <= kinds
    for obj in objs:
        label = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in CRD_SCHEMAS:
            _validate_crd(obj, label)
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except SchemaNotFoundError as exc:  # a CRD or a removed API version
            pytest.fail(f"{name}: {label}: {exc.message}")
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{name}: {label} is invalid for Kubernetes {K8S_VERSION}: {path}: {exc.message}")


def _validate_crd(obj: dict, label: str) -> None:
    import json

    import jsonschema

    schema = json.loads(CRD_SCHEMAS[obj["kind"]].read_text(encoding="utf-8"))
    try:
        jsonschema.validate(obj, schema)
    except jsonschema.ValidationError as exc:
        pytest.fail(f"{label}: {'.'.join(str(p) for p in exc.absolute_path)}: {exc.message}")


@needs_kubectl
def test_validation_is_not_a_no_op():
    deployment = one(render("cpu"), "Deployment")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


# ---- router config ----------------------------------------------------------------


def test_router_yaml_file_loads():
    cfg = load_config(str(DEPLOY / "base" / "router.yaml"))
    assert cfg.executor.address == "unix:///sock/executor.sock"


@needs_kubectl
@pytest.mark.parametrize("name", OVERLAYS)
def test_configmap_router_yaml_loads_with_router_loader(name, tmp_path):
    cfg = router_config(render(name), tmp_path)
    assert cfg.executor.address == "unix:///sock/executor.sock"
    volumes = {v["name"]: v for v in pod_spec(render(name))["volumes"]}
    cm_name = one(render(name), "ConfigMap")["metadata"]["name"]
    assert volumes["config"]["configMap"]["name"] == cm_name, "volume must use the hashed name"


# ---- ports, probes, commands ------------------------------------------------------


@needs_kubectl
@pytest.mark.parametrize("name", OVERLAYS)
def test_router_ports_and_probes_match_router_defaults(name, tmp_path):
    defaults = ServerConfig()
    cfg = router_config(render(name), tmp_path)
    assert (cfg.server.port, cfg.server.metrics_port) == (defaults.port, defaults.metrics_port)

    router = container(pod_spec(render(name)), "router")
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports == {"grpc": defaults.port, "http": defaults.http_port, "metrics": defaults.metrics_port}
    assert cfg.server.http_port == defaults.http_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert router[probe]["grpc"] == {"port": defaults.port}, probe
    args = router["args"]
    assert args[args.index("--port") + 1] == str(defaults.port)
    assert args[args.index("--metrics-port") + 1] == str(defaults.metrics_port)
    assert args[args.index("--http-port") + 1] == str(defaults.http_port)
    assert args[args.index("--executor-address") + 1] == cfg.executor.address

    services = {s["metadata"]["name"]: s for s in render(name) if s["kind"] == "Service"}
    svc_ports = {p["name"]: p["port"] for p in services["cbserve"]["spec"]["ports"]}
    assert svc_ports == {"grpc": defaults.port, "http": defaults.http_port, "metrics": defaults.metrics_port}
    headless = services["cbserve-headless"]["spec"]
    assert headless["clusterIP"] == "None"
    assert [p["port"] for p in headless["ports"]] == [defaults.port]

    policy = one(render(name), "NetworkPolicy")["spec"]
    allowed = {p["port"] for rule in policy["ingress"] for p in rule["ports"]}
    assert allowed == {defaults.port, defaults.http_port, defaults.metrics_port}
    # Every rule names its peers: no port is open to the whole cluster.
    assert all(rule.get("from") for rule in policy["ingress"])
    metrics_from = [
        peer for rule in policy["ingress"] for peer in rule["from"] if _ports(rule) == {defaults.metrics_port}
    ]
    assert metrics_from == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def _ports(rule) -> set[int]:
    return {p["port"] for p in rule["ports"]}


@needs_kubectl
def test_the_endpoint_picker_may_reach_the_pods_it_scores():
    defaults = ServerConfig()
    policy = one(render("inference-gateway"), "NetworkPolicy")["spec"]
    epp = [
        r
        for r in policy["ingress"]
        if {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "cbserve-epp"}}} in r["from"]
    ]
    assert len(epp) == 1 and _ports(epp[0]) == {defaults.http_port, defaults.metrics_port}


@needs_kubectl
@pytest.mark.parametrize("name", OVERLAYS)
def test_two_containers_share_socket_and_config(name):
    spec = pod_spec(render(name))
    executor, router = container(spec, "executor"), container(spec, "router")
    # The executor is a native sidecar: up before the router, stopped after it.
    assert executor["restartPolicy"] == "Always"
    assert executor["args"][executor["args"].index("--listen") + 1] == "unix:///sock/executor.sock"
    for c in (executor, router):
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["sock"] == "/sock" and mounts["config"] == "/etc/cbserve"
        assert c["args"][c["args"].index("--config") + 1] == "/etc/cbserve/router.yaml"
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["HF_HUB_OFFLINE"] == "1"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes["sock"]
    assert "emptyDir" in volumes["model-cache"]
    env = {e["name"]: e.get("value") for e in executor["env"]}
    assert env["CBSERVE_CACHE_DIR"] == "/cache"


@needs_kubectl
def test_gpu_overlay_gives_the_executor_a_gpu_and_bf16():
    spec = pod_spec(render("gpu"))
    executor = container(spec, "executor")
    assert str(executor["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    env = {e["name"]: e.get("value") for e in executor["env"]}
    assert env["CBSERVE_DTYPE"] == "bfloat16" and env["CBSERVE_DEVICE"] == "cuda"
    assert executor["args"][executor["args"].index("--device") + 1] == "$(CBSERVE_DEVICE)"
    cpu_env = {e["name"]: e.get("value") for e in container(pod_spec(render("cpu")), "executor")["env"]}
    assert cpu_env["CBSERVE_DEVICE"] == "auto"
    assert spec["nodeSelector"] and spec["tolerations"]
    assert "nvidia.com/gpu" not in str(pod_spec(render("cpu")))


@needs_kubectl
@pytest.mark.parametrize("name", OVERLAYS)
def test_every_container_has_resources(name):
    for c in all_containers(pod_spec(render(name))):
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][kind]), (c["name"], kind)


# ---- security ---------------------------------------------------------------------


@needs_kubectl
@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_every_container_is_locked_down(name):
    spec = pod_spec(render(name))
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["automountServiceAccountToken"] is False
    for c in all_containers(spec):
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert "add" not in sc["capabilities"], c["name"]
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", c["name"]
        assert sc.get("privileged", False) is False, c["name"]


# ---- drain ------------------------------------------------------------------------


def _prestop_sleep_s(c: dict) -> int:
    pre = c.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:
        return int(pre["sleep"]["seconds"])
    if "exec" in pre and pre["exec"]["command"][0] == "sleep":
        return int(pre["exec"]["command"][1])
    return 0


@needs_kubectl
@pytest.mark.parametrize("name", OVERLAYS)
def test_grace_period_covers_the_drain(name, tmp_path):
    cfg = router_config(render(name), tmp_path)
    spec = pod_spec(render(name))
    router = container(spec, "router")
    prestop = _prestop_sleep_s(router)
    assert prestop > 0, "the router needs a preStop sleep so endpoints update first"
    grace = spec["terminationGracePeriodSeconds"]
    # preStop + drain, then a margin for the router to exit and the executor
    # (a sidecar, stopped after the router) to exit.
    assert grace >= prestop + cfg.server.drain_timeout_s + 10
    # Health is NOT_SERVING while draining: liveness must not kill a draining router.
    live = router["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > prestop + cfg.server.drain_timeout_s


# ---- autoscaling and metrics ------------------------------------------------------


@needs_kubectl
@pytest.mark.parametrize("name", OVERLAYS)
def test_hpa_scales_on_queue_depth_with_cpu_fallback(name):
    objs = render(name)
    hpa = one(objs, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": one(objs, "Deployment")["metadata"]["name"],
    }
    pods = [m["pods"] for m in hpa["metrics"] if m["type"] == "Pods"]
    assert [p["metric"]["name"] for p in pods] == ["cbserve_num_requests_waiting"]
    cpu = [m["resource"] for m in hpa["metrics"] if m["type"] == "Resource"]
    assert cpu and cpu[0]["name"] == "cpu" and cpu[0]["target"]["type"] == "Utilization"
    for p in pods:
        assert p["metric"]["name"] in METRICS_RELIED_ON
    assert "replicas" not in one(objs, "Deployment")["spec"], "the HPA owns the replica count"
    pdb = one(objs, "PodDisruptionBudget")["spec"]
    assert pdb["selector"]["matchLabels"] == one(objs, "Deployment")["spec"]["selector"]["matchLabels"]


def test_adapter_rule_serves_the_hpa_metric():
    rules = yaml.safe_load((DEPLOY / "prometheus-adapter-rules.yaml").read_text())["rules"]
    hpa = yaml.safe_load((DEPLOY / "base" / "hpa.yaml").read_text())
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    served = {r["name"]["as"] for r in rules}
    assert wanted <= served
    for rule in rules:
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}


def test_docs_and_manifests_name_only_metrics_relied_on():
    """Any cbserve_* metric the docs or deploy files mention is in METRICS_RELIED_ON."""
    files = [REPO / "docs" / "deploy.md", *DEPLOY.rglob("*.yaml")]
    mentioned = set()
    for f in files:
        mentioned |= set(re.findall(r"\bcbserve_[a-z0-9_]+", f.read_text(encoding="utf-8")))
    mentioned = {re.sub(r"_(bucket|sum|count)$", "", m) for m in mentioned}
    assert mentioned - METRICS_RELIED_ON == set()


def test_router_exports_every_metric_relied_on():
    names = exported_metric_names()
    missing = sorted(METRICS_RELIED_ON - names)
    assert not missing, f"router.metrics does not export {missing}"


# ---- the inference-gateway overlay ------------------------------------------------


@needs_kubectl
def test_inference_pool_routes_to_the_http_port_through_a_picker_reading_cbserve_metrics():
    objs = render("inference-gateway")
    defaults = ServerConfig()
    pool = one(objs, "InferencePool")["spec"]
    deployment = one(objs, "Deployment", "cbserve")
    assert pool["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert pool["targetPorts"] == [{"number": defaults.http_port}]
    epp_service = one(objs, "Service", pool["endpointPickerRef"]["name"])
    assert [p["port"] for p in epp_service["spec"]["ports"]] == [pool["endpointPickerRef"]["port"]["number"]]
    epp = one(objs, "Deployment", "cbserve-epp")["spec"]["template"]["spec"]
    args = epp["containers"][0]["args"]

    def flag(name):
        return args[args.index(name) + 1]

    assert flag("--pool-name") == one(objs, "InferencePool")["metadata"]["name"]
    assert flag("--model-server-metrics-port") == str(defaults.metrics_port)
    names = {
        flag("--total-queued-requests-metric"),
        flag("--total-running-requests-metric"),
        flag("--kv-cache-usage-percentage-metric"),
    }
    assert names == {"cbserve_num_requests_waiting", "cbserve_num_requests_running", "cbserve_kv_cache_usage_ratio"}
    assert names <= exported_metric_names()
    assert epp["serviceAccountName"] == one(objs, "RoleBinding")["subjects"][0]["name"]
    assert any("inferencepools" in r["resources"] for r in one(objs, "Role")["rules"])
    sc = epp["containers"][0]["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["capabilities"]["drop"] == ["ALL"] and sc["runAsNonRoot"]
    route = one(objs, "HTTPRoute")["spec"]
    backends = [b for rule in route["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "cbserve"}]


def test_crd_schemas_refuse_what_they_should():
    good = yaml.safe_load((DEPLOY / "overlays" / "inference-gateway" / "inferencepool.yaml").read_text())
    _validate_crd(good, "good")
    for broken in (
        {**good, "spec": {**good["spec"], "targetPort": 8000}},
        {**good, "spec": {**good["spec"], "targetPorts": []}},
        {**good, "spec": {k: v for k, v in good["spec"].items() if k != "endpointPickerRef"}},
    ):
        with pytest.raises(pytest.fail.Exception):
            _validate_crd(broken, "broken")
