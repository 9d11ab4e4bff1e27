"""deploy/k8s/overlays/precise-prefix-routing: llm-d-router's precise prefix-cache routing over the gateway overlay's
replicas. It builds, validates and passes checkov, and its pieces agree with each other and with kvserve: the servers
publish KV events on the port the picker's pod discovery dials, under a topic its filter takes, in blocks of the size
its token processor keys; they carry the engine-type label whose metric map names gauges kvserve exports; the token
producer renders on the servers' HTTP API over TLS against the CA it mounts; the network policies open those paths to
the picker alone. (No cluster or picker runs here.)"""

from __future__ import annotations

import pytest
import yaml

from kvserve.service.edges.metrics import Metrics
from kvserve.service.core.prompt_cache import BLOCK_TOKENS

from ..conftest import REPO
from .test_inference_gateway import named, pod_labels, render
from .test_kubernetes import checkov, run, tool

OVERLAY = REPO / "deploy/k8s/overlays/precise-prefix-routing"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    return render(OVERLAY, tmp_path_factory)


def picker_config(objects) -> dict:
    return yaml.safe_load(named(objects, "ConfigMap", "kvserve-epp-config")["data"]["scheduling.yaml"])


def plugin(config: dict, kind: str) -> dict:
    (found,) = [p for p in config["plugins"] if p["type"] == kind]
    return found.get("parameters", {})


def server_container(objects) -> dict:
    (server,) = named(objects, "Deployment", "kvserve-server")["spec"]["template"]["spec"]["containers"]
    return server


def test_it_builds_validates_and_passes_checkov(rendered):
    objects, path = rendered
    result = run(tool("kubernetes-validate"), "--strict", "--quiet", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    result = checkov("-f", str(path), "--framework", "kubernetes")
    assert result.returncode == 0, result.stdout[-4000:]
    assert yaml.safe_load(result.stdout)["summary"]["failed"] == 0
    (picker,) = named(objects, "Deployment", "kvserve-epp")["spec"]["template"]["spec"]["containers"]
    assert picker["image"].startswith("ghcr.io/llm-d/llm-d-router-endpoint-picker:v")
    args = dict(arg.split("=", 1) for arg in picker["args"])
    assert args["--config-file"] == "/config/scheduling.yaml" and not any(a.endswith("-metric") for a in args)


def test_the_servers_publish_where_the_picker_subscribes(rendered):
    objects, _ = rendered
    env = {e["name"]: e["value"] for e in server_container(objects)["env"]}
    ports = {p["name"]: p["containerPort"] for p in server_container(objects)["ports"]}
    events = plugin(picker_config(objects), "precise-prefix-cache-producer")
    discovery = events["kvEventsConfig"]["podDiscoveryConfig"]
    assert events["kvEventsConfig"]["discoverPods"] is True
    assert env["KVSERVE_KV_EVENTS"] == f"tcp://*:{discovery['socketPort']}" == f"tcp://*:{ports['kv-events']}"
    assert env["KVSERVE_KV_EVENTS_REPLAY"] == f"tcp://*:{discovery['replaySocketPort']}" == f"tcp://*:{ports['kv-replay']}"
    assert env.get("KVSERVE_PROMPT_CACHE", "on") == "on"  # events are the prompt cache's
    assert "KVSERVE_KV_EVENTS_TOPIC" not in env and "kv@pod@model".startswith(events["kvEventsConfig"]["topicFilter"])
    assert events["tokenProcessorConfig"]["blockSizeTokens"] == BLOCK_TOKENS
    selector = dict(pair.split("=") for pair in discovery["podLabelSelector"].split(","))
    assert selector.items() <= pod_labels(objects, "kvserve-server").items()


def test_the_engine_label_maps_to_gauges_the_server_exports(rendered):
    objects, _ = rendered
    labels = pod_labels(objects, "kvserve-server")
    assert labels["llm-d.ai/engine-type"] == labels["inference.networking.k8s.io/engine-type"] == "kvserve"
    extractor = plugin(picker_config(objects), "core-metrics-extractor")
    (engine,) = [e for e in extractor["engineConfigs"] if e["name"] == labels["llm-d.ai/engine-type"]]
    metrics = Metrics()
    metrics.set_cache_config(BLOCK_TOKENS, 64)  # as the server does once its rows are known
    scraped = {metric.name: metric.type for metric in metrics.gateway_registry.collect()}  # what the gauges port answers
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        assert scraped[engine[key]] == "gauge", key
    assert engine["loraSpec"] == ""


def test_the_token_producer_renders_on_the_servers_over_verified_tls(rendered):
    objects, _ = rendered
    config = picker_config(objects)
    producer = plugin(config, "token-producer")["vllm"]
    service = named(objects, "Service", "kvserve-server")
    (http,) = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    assert producer["url"] == f"https://{service['metadata']['name']}.kvserve.svc:{http['port']}"
    env = {e["name"]: e["value"] for e in server_container(objects)["env"]}
    assert int(env["KVSERVE_HTTP_PORT"]) == http["port"] and "KVSERVE_TLS_CERT" in env
    spec = named(objects, "Deployment", "kvserve-epp")["spec"]["template"]["spec"]
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if producer["caCertPath"].startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == "kvserve-ca"  # the CA the gateway's BackendTLSPolicy verifies the servers with
    scorer = plugin(config, "prefix-cache-scorer")
    assert scorer["prefixMatchInfoProducerName"] == "precise-prefix-cache-producer"
    sources = {s["pluginRef"]: [e["pluginRef"] for e in s["extractors"]] for s in config["dataLayer"]["sources"]}
    assert sources == {"metrics-data-source": ["core-metrics-extractor"], "endpoint-notification-source": ["precise-prefix-cache-producer"]}
    profiled = {ref["pluginRef"] for profile in config["schedulingProfiles"] for ref in profile["plugins"]}
    assert profiled <= {p["type"] for p in config["plugins"]} and "prefix-cache-scorer" in profiled


def test_only_the_picker_reaches_the_event_sockets(rendered):
    objects, _ = rendered
    ports = {p["name"]: p["containerPort"] for p in server_container(objects)["ports"]}
    into = named(objects, "NetworkPolicy", "kvserve-server-events-from-the-picker")["spec"]
    (rule,) = into["ingress"]
    assert [f["podSelector"]["matchLabels"].items() <= pod_labels(objects, "kvserve-epp").items() for f in rule["from"]] == [True]
    assert {p["port"] for p in rule["ports"]} == {"kv-events", "kv-replay", "http"}
    out = named(objects, "NetworkPolicy", "kvserve-epp-to-events")["spec"]
    (egress,) = out["egress"]
    assert egress["to"][0]["podSelector"]["matchLabels"].items() <= pod_labels(objects, "kvserve-server").items()
    assert {p["port"] for p in egress["ports"]} == {ports["kv-events"], ports["kv-replay"], ports["http"]}
    others = [o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] not in
              ("kvserve-server-events-from-the-picker", "kvserve-epp-to-events")]
    assert not any(str(p.get("port")) in ("kv-events", "kv-replay", "5557", "5558")
                   for o in others for rule in o["spec"].get("ingress", []) for p in rule.get("ports", []))
