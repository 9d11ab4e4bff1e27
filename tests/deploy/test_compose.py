"""docker-compose.yml validates in every profile and says what the deployment promises."""

import subprocess

import pytest

from kvserve.cli import build_parser

from ..conftest import REPO
from .conftest import PROFILES, compose_config, need


@pytest.mark.parametrize("profiles", PROFILES, ids=lambda p: "+".join(p) or "default")
def test_compose_file_validates(profiles):
    args = [need("docker-compose")] + [a for p in profiles for a in ("--profile", p)] + ["config", "-q"]
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_servers_wait_for_a_successful_export_and_mount_it_read_only():
    services = compose_config("gpu", "cpu")["services"]
    for name in ("server", "server-cpu"):
        server = services[name]
        assert server["depends_on"] == {"export": {"condition": "service_completed_successfully"}}
        assert "artifacts:/artifacts:ro" in server["volumes"]
        assert {"50051", "9400"} <= {str(p) for p in server["expose"]}
        assert server["healthcheck"]["test"][:3] == ["CMD", "kvserve", "health"]
    assert "artifacts:/artifacts:rw" in services["export"]["volumes"]
    (device,) = services["server"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 1 and device["capabilities"] == ["gpu"]
    assert "deploy" not in services["server-cpu"] and services["server-cpu"]["environment"]["KVSERVE_PROVIDER"] == "cpu"


def test_stop_grace_period_covers_the_drain():
    server = compose_config("gpu")["services"]["server"]
    grace = int(server["stop_grace_period"].rstrip("s"))
    assert grace > float(server["environment"]["KVSERVE_DRAIN_SECONDS"])


def test_every_server_variable_is_a_serve_flag():
    serve = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    flags = {option for action in serve._actions for option in action.option_strings}
    for name in compose_config("gpu")["services"]["server"]["environment"]:
        assert "--" + name.removeprefix("KVSERVE_").lower().replace("_", "-") in flags, name


def test_metrics_and_load_balancer_are_wired():
    services = compose_config("metrics")["services"]
    assert services["prometheus"]["profiles"] == ["metrics"]
    assert "nginx" in services["lb"]["image"] and any("nginx.conf" in v for v in services["lb"]["volumes"])
    prometheus = (REPO / "deploy" / "prometheus.yml").read_text()
    assert "names: [server]" in prometheus and "port: 9400" in prometheus
