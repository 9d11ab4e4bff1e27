"""deploy/k8s/overlays/inference-gateway: many replicas behind the inference gateway. It builds, its core objects
validate against the Kubernetes schemas and pass checkov, its custom resources (InferencePool, Gateway, HTTPRoute,
BackendTLSPolicy: no schema offline) hold the fields their API references require, and every reference between them
points at something real: the pool at the servers' labels and HTTP port, at the picker's Service; the picker at the
pool, reading gauges the server exports on the port the servers give them; the route at the pool; the network
policies open exactly those paths."""

from __future__ import annotations

import pytest
import yaml

from kvserve.service.edges.metrics import Metrics

from ..conftest import REPO
from .test_kubernetes import checkov, run, tool

OVERLAY = REPO / "deploy/k8s/overlays/inference-gateway"
# The picker's defaults (its flags' DefValue in the extension's cmd/epp options), which its docs say a server may
# match instead of configuring the flags.
PICKER_METRIC_FLAGS = {"--total-queued-requests-metric": "vllm:num_requests_waiting",
                       "--total-running-requests-metric": "vllm:num_requests_running",
                       "--kv-cache-usage-percentage-metric": "vllm:kv_cache_usage_perc"}


def render(overlay, tmp_path_factory) -> tuple[list[dict], object]:
    """The overlay as kubectl's kustomize builds it: (its objects, the file they were written to)."""
    result = run(tool("kubectl"), "kustomize", str(overlay))
    assert result.returncode == 0, result.stderr
    path = tmp_path_factory.mktemp(overlay.name) / f"{overlay.name}.yaml"
    path.write_text(result.stdout)
    return [o for o in yaml.safe_load_all(result.stdout) if o], path


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    return render(OVERLAY, tmp_path_factory)


def named(objects, kind: str, name: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def pod_labels(objects, name: str) -> dict:
    return named(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]


def picker_args(objects) -> dict[str, str]:
    (container,) = named(objects, "Deployment", "kvserve-epp")["spec"]["template"]["spec"]["containers"]
    return dict(arg.split("=", 1) for arg in container["args"])


def test_it_builds_validates_and_passes_checkov(rendered):
    objects, path = rendered
    kinds = {o["kind"] for o in objects}
    assert {"InferencePool", "Gateway", "HTTPRoute", "BackendTLSPolicy", "Role", "RoleBinding", "ServiceAccount"} <= kinds
    assert all(o["metadata"].get("namespace") == "kvserve" for o in objects if o["kind"] != "Namespace")
    result = run(tool("kubernetes-validate"), "--strict", "--quiet", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    result = checkov("-f", str(path), "--framework", "kubernetes")
    assert result.returncode == 0, result.stdout[-4000:]
    assert yaml.safe_load(result.stdout)["summary"]["failed"] == 0
    for obj in objects:
        for key, value in obj["metadata"].get("annotations", {}).items():
            if key.startswith("checkov.io/skip"):
                check, reason = value.split("=", 1)
                assert check.startswith("CKV") and len(reason.split()) >= 5, (obj["metadata"]["name"], value)


def test_the_custom_resources_hold_what_their_api_references_require(rendered):
    objects, _ = rendered
    pool = named(objects, "InferencePool", "kvserve")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    assert spec["selector"]["matchLabels"] and 1 <= len(spec["targetPorts"]) <= 8
    assert len({p["number"] for p in spec["targetPorts"]}) == len(spec["targetPorts"])
    picker = spec["endpointPickerRef"]
    assert set(picker) <= {"group", "kind", "name", "port", "failureMode"} and picker.get("kind", "Service") == "Service"
    assert picker.get("failureMode", "FailClose") in ("FailOpen", "FailClose")
    route = named(objects, "HTTPRoute", "kvserve")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    gateway = named(objects, "Gateway", "kvserve")
    assert {p["name"] for p in route["spec"]["parentRefs"]} == {gateway["metadata"]["name"]}
    assert gateway["spec"]["gatewayClassName"] and gateway["spec"]["listeners"]


def test_the_pool_points_at_the_servers_api_port_and_at_the_picker(rendered):
    objects, _ = rendered
    pool = named(objects, "InferencePool", "kvserve")["spec"]
    assert pool["selector"]["matchLabels"].items() <= pod_labels(objects, "kvserve-server").items()
    (server,) = named(objects, "Deployment", "kvserve-server")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in server["env"]}
    assert [p["number"] for p in pool["targetPorts"]] == [int(env["KVSERVE_HTTP_PORT"])]
    assert named(objects, "Deployment", "kvserve-server")["spec"]["replicas"] > 1
    service = named(objects, "Service", pool["endpointPickerRef"]["name"])
    assert service["spec"]["selector"].items() <= pod_labels(objects, "kvserve-epp").items()
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == pool["endpointPickerRef"]["port"]["number"]]
    (picker,) = named(objects, "Deployment", "kvserve-epp")["spec"]["template"]["spec"]["containers"]
    assert port["targetPort"] in {p["name"] for p in picker["ports"]}
    args = picker_args(objects)
    assert int(args["--grpc-port"]) == next(p["containerPort"] for p in picker["ports"] if p["name"] == port["targetPort"])
    assert (args["--pool-name"], args["--pool-namespace"]) == ("kvserve", "kvserve")
    route = named(objects, "HTTPRoute", "kvserve")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "kvserve"}]
    tls = named(objects, "BackendTLSPolicy", "kvserve")["spec"]
    assert tls["targetRefs"] == backends and "TLS_CERT" in " ".join(env)  # the servers' API port speaks TLS
    # the gauges' own port (plaintext, the picker alone may reach it), which the servers open
    assert args["--model-server-metrics-scheme"] == "http" and args["--model-server-metrics-path"] == "/metrics"
    gauges_port = int(args["--model-server-metrics-port"])
    assert int(env["KVSERVE_GATEWAY_METRICS_PORT"]) == gauges_port
    assert {"name": "gauges", "containerPort": gauges_port, "protocol": "TCP"} in server["ports"]


def test_the_picker_reads_gauges_the_server_exports(rendered):
    objects, _ = rendered
    args = picker_args(objects)
    exported = {metric.name: metric.type for metric in Metrics().registry.collect()}
    for flag, default in PICKER_METRIC_FLAGS.items():
        assert args[flag] == default and exported[default] == "gauge", flag
    assert args["--refresh-metrics-interval"] == "50ms"
    config = yaml.safe_load(named(objects, "ConfigMap", "kvserve-epp-config")["data"]["scheduling.yaml"])
    assert "/config/scheduling.yaml" == args["--config-file"]
    plugins = {p["type"] for p in config["plugins"]}
    assert {ref["pluginRef"] for profile in config["schedulingProfiles"] for ref in profile["plugins"]} == plugins
    assert {"prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer"} <= plugins


def test_the_network_policies_open_the_pools_paths_and_no_more(rendered):
    objects, _ = rendered
    picker = named(objects, "NetworkPolicy", "kvserve-epp")["spec"]
    assert picker["podSelector"]["matchLabels"].items() <= pod_labels(objects, "kvserve-epp").items()
    assert [p["port"] for rule in picker["ingress"] for p in rule["ports"]] == ["ext-proc"]
    scrape = [rule for rule in picker["egress"] if rule.get("to")]
    assert scrape[0]["to"][0]["podSelector"]["matchLabels"].items() <= pod_labels(objects, "kvserve-server").items()
    assert scrape[0]["ports"] == [{"port": int(picker_args(objects)["--model-server-metrics-port"]), "protocol": "TCP"}]
    into_servers = named(objects, "NetworkPolicy", "kvserve-server-from-the-pool")["spec"]
    from_picker, from_gateway = into_servers["ingress"]
    assert [f["podSelector"]["matchLabels"].items() <= pod_labels(objects, "kvserve-epp").items() for f in from_picker["from"]] == [True]
    assert [p["port"] for p in from_picker["ports"]] == ["gauges"]  # the picker scrapes; it sends no requests
    assert not any("podSelector" in f and f["podSelector"]["matchLabels"].items() <= pod_labels(objects, "kvserve-epp").items()
                   for f in from_gateway["from"])
    assert [p["port"] for p in from_gateway["ports"]] == ["http"]


def test_the_role_grants_reading_and_nothing_else(rendered):
    objects, _ = rendered
    role = named(objects, "Role", "kvserve-epp")
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in role["rules"])
    binding = named(objects, "RoleBinding", "kvserve-epp")
    assert binding["roleRef"]["name"] == "kvserve-epp" and binding["subjects"][0]["name"] == "kvserve-epp"
    assert named(objects, "Deployment", "kvserve-epp")["spec"]["template"]["spec"]["serviceAccountName"] == "kvserve-epp"
