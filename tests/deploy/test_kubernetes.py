"""deploy/k8s builds with kustomize in every overlay, validates against the Kubernetes schemas, passes checkov,
and says what the deployment promises; the Deployment's own environment and probes work against a real server."""

from __future__ import annotations

import re
import subprocess

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.cli import build_parser

from ..conftest import REPO
from .conftest import ServeProcess, free_port, local_environment

TOOLS = REPO / ".tools" / "bin"
OVERLAYS = {"gpu": REPO / "deploy/k8s/base", "cpu": REPO / "deploy/k8s/overlays/cpu"}
KINDS = ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Job", "Namespace", "NetworkPolicy", "NetworkPolicy",
         "PersistentVolumeClaim", "PodDisruptionBudget", "Service", "Service"]


def tool(name: str) -> str:
    path = TOOLS / name
    assert path.exists(), f"{path} is missing: `make tools` installs deploy/checks-requirements.txt into .tools/"
    return str(path)


def run(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=300)


def render(overlay: str, directory) -> tuple[str, list[dict], object]:
    """(overlay, its objects, the file kubectl kustomize wrote)."""
    result = run(tool("kubectl"), "kustomize", str(OVERLAYS[overlay]))
    assert result.returncode == 0, result.stderr
    path = directory / f"{overlay}.yaml"
    path.write_text(result.stdout)
    return overlay, [o for o in yaml.safe_load_all(result.stdout) if o], path


@pytest.fixture(scope="module", params=sorted(OVERLAYS))
def rendered(request, tmp_path_factory):
    return render(request.param, tmp_path_factory.mktemp("k8s"))


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    return found


def server_container(objects):
    deployment = one(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container, {e["name"]: e["value"] for e in container["env"]}


def test_every_overlay_builds_the_whole_deployment_in_its_namespace(rendered):
    _, objects, _ = rendered
    assert sorted(o["kind"] for o in objects) == KINDS
    assert all(o["metadata"].get("namespace") == "kvserve" for o in objects if o["kind"] != "Namespace")


def test_every_object_validates_against_the_kubernetes_schemas(rendered, tmp_path):
    _, _, path = rendered
    result = run(tool("kubernetes-validate"), "--strict", "--quiet", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    # The validator is not a rubber stamp: the same file with one misspelt field fails, naming it.
    broken = tmp_path / "broken.yaml"
    broken.write_text(path.read_text().replace("containerPort: 50051", "containerPortt: 50051"))
    result = run(tool("kubernetes-validate"), "--strict", "--quiet", str(broken))
    assert result.returncode != 0 and "containerPort" in result.stdout + result.stderr


def checkov(*args: str) -> subprocess.CompletedProcess:
    # --skip-download: no network (checkov would fetch its guideline links)
    return run(tool("checkov"), *args, "--quiet", "--compact", "--skip-download", "--output", "json")


def test_checkov_passes_the_manifests_and_every_skip_says_why(rendered):
    _, objects, path = rendered
    result = checkov("-f", str(path), "--framework", "kubernetes")
    assert result.returncode == 0, result.stdout[-4000:]
    summary = yaml.safe_load(result.stdout)["summary"]
    assert summary["failed"] == 0 and summary["passed"] > 100
    for obj in objects:
        for key, value in obj["metadata"].get("annotations", {}).items():
            if key.startswith("checkov.io/skip"):
                check, reason = value.split("=", 1)
                assert check.startswith("CKV") and len(reason.split()) >= 5, (obj["metadata"]["name"], value)


def test_checkov_passes_the_dockerfiles_and_every_skip_says_why():
    result = checkov("-d", str(REPO / "docker"), "--framework", "dockerfile")
    assert result.returncode == 0, result.stdout[-4000:]
    assert yaml.safe_load(result.stdout)["summary"]["failed"] == 0
    for dockerfile in (REPO / "docker").glob("*.Dockerfile"):
        for skip in re.finditer(r"checkov:skip=(\S+?):(.*)$", dockerfile.read_text(), re.M):
            assert skip.group(1).startswith("CKV") and len(skip.group(2).split()) >= 5, skip.group(0)


def test_the_server_runs_non_root_read_only_and_outlives_its_drain(rendered):
    overlay, objects, _ = rendered
    deployment, container, env = server_container(objects)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] >= 10000
    assert pod["automountServiceAccountToken"] is False
    for each in pod["containers"] + pod["initContainers"]:
        assert each["securityContext"]["readOnlyRootFilesystem"] is True
        assert each["securityContext"]["allowPrivilegeEscalation"] is False
        assert each["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["terminationGracePeriodSeconds"] > float(env["KVSERVE_DRAIN_SECONDS"])
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > float(env["KVSERVE_DRAIN_SECONDS"])
    gpu = container["resources"]["limits"].get("nvidia.com/gpu")
    if overlay == "gpu":
        assert gpu == 1 and env["KVSERVE_PROVIDER"] == "cuda" and pod["tolerations"]
    else:
        assert gpu is None and env["KVSERVE_PROVIDER"] == "cpu" and "tolerations" not in pod


def test_the_probes_are_native_grpc_on_the_plaintext_health_port(rendered):
    _, objects, _ = rendered
    _, container, env = server_container(objects)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": int(env["KVSERVE_PORT"]), "health": int(env["KVSERVE_HEALTH_PORT"]), "metrics": int(env["KVSERVE_METRICS_PORT"]),
                     "http": int(env["KVSERVE_HTTP_PORT"])}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["health"], probe
    assert container["readinessProbe"]["grpc"]["service"] == "kvserve.v1.GenerationService"


def test_the_http_api_is_served_and_open_to_the_grpc_clients_alone(rendered):
    _, objects, _ = rendered
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "kvserve-server")
    assert {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"} in service["spec"]["ports"]
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy" and any(
        {"port": "grpc", "protocol": "TCP"} in rule.get("ports", []) for rule in o["spec"].get("ingress", [])))
    (clients,) = [rule for rule in policy["spec"]["ingress"] if {"port": "grpc", "protocol": "TCP"} in rule["ports"]]
    (http,) = [rule for rule in policy["spec"]["ingress"] if {"port": "http", "protocol": "TCP"} in rule["ports"]]
    assert http is not clients and http["ports"] == [{"port": "http", "protocol": "TCP"}] and http["from"] == clients["from"]


def test_tls_and_tokens_come_from_secrets_mounted_as_files(rendered):
    _, objects, _ = rendered
    deployment, container, env = server_container(objects)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    for variable in ("KVSERVE_TLS_CERT", "KVSERVE_TLS_KEY", "KVSERVE_AUTH_TOKENS"):
        directory, _, _ = env[variable].rpartition("/")
        assert "secret" in volumes[mounts[directory]], variable
    assert all("valueFrom" not in e for e in container["env"])  # no secret in an environment variable


def serve_flags() -> set[str]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return {option for action in serve._actions for option in action.option_strings}


def test_every_variable_is_a_flag_the_programs_read(rendered):
    _, objects, _ = rendered
    _, _, env = server_container(objects)
    flags = serve_flags()
    for name in env:
        assert "--" + name.removeprefix("KVSERVE_").lower().replace("_", "-") in flags, name
    (export,) = one(objects, "Job")["spec"]["template"]["spec"]["containers"]
    job_script = (REPO / "docker/export-job.sh").read_text()
    for variable in export["env"]:
        assert variable["name"] == "HOME" or variable["name"] in job_script, variable["name"]


def test_selectors_autoscaler_and_adapter_rule_point_at_real_things(rendered):
    from kvserve.service.edges.metrics import Metrics

    _, objects, _ = rendered
    deployment, container, _ = server_container(objects)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in container["ports"]}
    for service in (o for o in objects if o["kind"] == "Service"):
        assert service["spec"]["selector"].items() <= labels.items()
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    assert one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ingress = one(objects, "NetworkPolicy", "kvserve-server-ingress")
    assert ingress["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert {p["port"] for rule in ingress["spec"]["ingress"] for p in rule["ports"]} <= port_names
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    exported = {m.name for m in Metrics().registry.collect()}
    assert name in exported  # a gauge the server really exports
    rules = yaml.safe_load(one(objects, "ConfigMap")["data"]["config.yaml"])["rules"]
    assert any(name in rule["seriesQuery"] and rule["name"]["as"] == name for rule in rules)


def test_the_cpu_deployments_environment_serves_tls_and_answers_its_probes(pki, tiny_artifact, serve_processes, tmp_path):
    """`kvserve serve` configured by nothing but the CPU Deployment's variables (paths and ports moved onto
    this host): the probe's plaintext health port says SERVING while the gRPC port stays TLS-only."""
    _, objects, _ = render("cpu", tmp_path)
    _, container, env = server_container(objects)
    (tmp_path / "tokens").write_text("probe-test-token\n")
    files = {
        env["KVSERVE_TLS_CERT"]: pki / "server.pem",
        env["KVSERVE_TLS_KEY"]: pki / "server.key",
        env["KVSERVE_AUTH_TOKENS"]: tmp_path / "tokens",
    }
    local = local_environment({k: files.get(v, v) for k, v in env.items()}, tiny_artifact)
    health_port = free_port()
    local["KVSERVE_HEALTH_PORT"] = str(health_port)
    server = ServeProcess(local)
    serve_processes.append(server)
    probe = container["readinessProbe"]["grpc"]
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:  # what kubelet does: plaintext gRPC health
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=probe["service"]), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel, pytest.raises(grpc.RpcError) as refused:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # the client port speaks only TLS
    assert server.stop() == 0
