"""docker-compose.yml validates in every profile and says what the deployment promises."""

import os
import subprocess

import pytest

from kvserve.cli import build_parser

from ..conftest import REPO
from .conftest import PROFILES, compose_config, free_port, need, wait_port


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
        assert {"50051", "8000", "9400"} <= {str(p) for p in server["expose"]}
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
    assert services["prometheus"]["profiles"] == ["metrics", "dashboards"]
    assert "nginx" in services["lb"]["image"] and any("nginx.conf" in v for v in services["lb"]["volumes"])
    prometheus = (REPO / "deploy" / "prometheus.yml").read_text()
    assert "names: [server]" in prometheus and "port: 9400" in prometheus


def test_the_tls_override_mounts_secrets_and_keeps_a_working_health_check(pki, tmp_path, tiny_artifact, serve_processes):
    import shutil

    from .conftest import ServeProcess, local_environment, run_health
    from .test_load_balancer import render_nginx_conf

    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for name in ("server.pem", "server.key", "ca.pem"):
        shutil.copy(pki / name, secrets / name)
    (secrets / "tokens").write_text("compose-token\n")
    for profiles in (["gpu"], ["cpu"], ["gpu", "metrics"]):
        args = [need("docker-compose"), "-f", "docker-compose.yml", "-f", "docker-compose.tls.yml"]
        args += [a for p in profiles for a in ("--profile", p)] + ["config", "-q"]
        result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "KVSERVE_SECRETS_DIR": str(secrets)})
        assert result.returncode == 0, result.stderr
    services = compose_config("cpu", files=("docker-compose.yml", "docker-compose.tls.yml"), env={"KVSERVE_SECRETS_DIR": str(secrets)})["services"]
    server = services["server-cpu"]
    assert {"kvserve_tls_cert", "kvserve_tls_key", "kvserve_tls_ca", "kvserve_auth_tokens"} <= {s if isinstance(s, str) else s["source"] for s in server["secrets"]}
    assert "./deploy/nginx-tls.conf:/etc/nginx/nginx.conf:ro" in services["lb"]["volumes"] or any("nginx-tls.conf" in v for v in services["lb"]["volumes"])

    # the server as the TLS compose environment configures it, its secrets moved from /run/secrets to here
    environment = {k: str(v).replace("/run/secrets/kvserve_tls_cert", str(secrets / "server.pem")).replace(
        "/run/secrets/kvserve_tls_key", str(secrets / "server.key")).replace("/run/secrets/kvserve_auth_tokens", str(secrets / "tokens"))
        for k, v in server["environment"].items()}
    replica = ServeProcess(local_environment(environment, tiny_artifact))
    serve_processes.append(replica)
    health = [a.replace("localhost:50051", f"localhost:{replica.port}").replace("/run/secrets/kvserve_tls_ca", str(secrets / "ca.pem"))
              for a in server["healthcheck"]["test"][1:]]
    result = run_health(health)
    assert result.returncode == 0 and result.stdout.strip() == "SERVING", result.stderr

    # nginx with deploy/nginx-tls.conf in front of it: TLS from the client, TLS again to the replica
    listen = free_port()
    api_listen = free_port()
    conf = render_nginx_conf([replica.port], listen, source="nginx-tls.conf", api_ports=[replica.http_port], api_listen=api_listen)
    conf = conf.replace("/run/secrets/kvserve_tls_cert", str(secrets / "server.pem"))
    conf = conf.replace("/run/secrets/kvserve_tls_key", str(secrets / "server.key")).replace("/run/secrets/kvserve_tls_ca", str(secrets / "ca.pem"))
    (tmp_path / "nginx.conf").write_text(conf)
    proxy = subprocess.Popen([need("nginx"), "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e", "stderr", "-g",
                              f"daemon off; pid {tmp_path}/nginx.pid;"], stderr=subprocess.PIPE, text=True)
    try:
        wait_port(listen)
        from kvserve.service.edges.client import ClientSecurity, call_metadata, open_channel
        from kvserve.v1 import generation_pb2 as pb
        from kvserve.v1 import generation_pb2_grpc as pb_grpc

        security = ClientSecurity(tls_ca=str(secrets / "ca.pem"), token_file=str(secrets / "tokens"))
        with open_channel(f"localhost:{listen}", security) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_new_tokens=6, ignore_eos=True)
            assert len(list(stub.Generate(request, timeout=30, metadata=call_metadata(security)))) == 6
        # the HTTP API through the same TLS balancer, dialling the replica over TLS too, the token required
        import ssl

        import httpx2 as httpx

        trusted = ssl.create_default_context(cafile=str(secrets / "ca.pem"))
        url = f"https://localhost:{api_listen}/v1/models"
        assert httpx.get(url, verify=trusted).status_code == 401
        assert httpx.get(url, verify=trusted, headers={"Authorization": "Bearer compose-token"}).json()["data"][0]["object"] == "model"
    finally:
        proxy.terminate()
        proxy.wait(10)
