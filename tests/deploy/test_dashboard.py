"""The Grafana dashboard (deploy/grafana): every panel's query names metrics a server really exports, every metric the
server exports has a panel, and the compose profile that provisions it is wired to Prometheus."""

import json
import re

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.service.edges.metrics import Metrics

from ..conftest import REPO
from .conftest import compose_config

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "kvserve.json"


def exported() -> tuple[set[str], set[str]]:
    """(sample names, metric family names) of a server's registry after every hook has run once."""
    metrics = Metrics()
    metrics.on_request("/kvserve.v1.GenerationService/Generate", "OK")
    metrics.on_token(0, None, 1_000)
    metrics.on_token(0, 1_000, 2_000)
    metrics.on_step(2, 1, 0, 10, 1)
    metrics.on_prompt(3, 4)
    metrics.execution_provider.labels(provider="CPUExecutionProvider").set(1)
    samples = {s.name for f in text_string_to_metric_families(generate_latest(metrics.registry).decode()) for s in f.samples}
    families = {family.name for family in metrics.registry.collect()}  # a counter's without its _total
    return {name for name in samples if name.startswith("kvserve_")}, {name for name in families if name.startswith("kvserve_")}


def queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_panel_queries_metrics_the_server_exports():
    samples, _ = exported()
    assert queries()
    for title, expr in queries():
        names = set(re.findall(r"\bkvserve_[a-z_]+", expr))
        assert names, f"{title}: {expr} names no kvserve metric"
        assert names <= samples, f"{title}: {sorted(names - samples)} is not exported (exported: {sorted(samples)})"


def test_every_exported_metric_has_a_panel():
    samples, families = exported()
    queried = {name for _, expr in queries() for name in re.findall(r"\bkvserve_[a-z_]+", expr)}
    for family in families:
        assert any(name == family or name.startswith(family + "_") for name in queried), f"no panel shows {family}"


def test_panels_read_the_provisioned_prometheus_and_the_profile_runs_both():
    dashboard = json.loads(DASHBOARD.read_text())
    datasource = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    assert {panel["datasource"]["uid"] for panel in dashboard["panels"]} == {datasource["uid"]}
    assert datasource["url"] == "http://prometheus:9090"
    services = compose_config("cpu", "dashboards")["services"]
    assert "dashboards" in services["prometheus"]["profiles"] and services["grafana"]["profiles"] == ["dashboards"]
    mounts = " ".join(v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in services["grafana"]["volumes"])
    assert "deploy/grafana/dashboards" in mounts and "deploy/grafana/provisioning" in mounts
    provider = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/kvserve.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    assert "dashboards" not in services["server-cpu"].get("profiles", [])  # opt-in: the servers run without it
