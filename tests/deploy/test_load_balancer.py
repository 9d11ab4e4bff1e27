"""The real load balancer (Debian's nginx, configured from deploy/nginx.conf) in front of two server
processes on loopback: streams spread over both, and survive one replica going away."""

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc

from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

from ..conftest import REPO
from .conftest import ServeProcess, compose_config, free_port, local_environment, metric, need, wait_port


def render_nginx_conf(replica_ports, listen_port, source: str = "nginx.conf") -> str:
    """deploy/SOURCE with the replicas and the listen address moved onto loopback."""
    conf = (REPO / "deploy" / source).read_text()
    replicas = "".join(f"    server 127.0.0.1:{p} max_fails=1 fail_timeout=10s;\n" for p in replica_ports)
    conf = re.sub(r"(# replicas: begin\n).*?(\s*# replicas: end)", lambda m: m.group(1) + replicas + m.group(2).lstrip("\n"), conf, flags=re.S)
    ssl = " ssl" if "listen 50051 ssl" in conf else ""
    conf = re.sub(r"(# listen: begin\n).*?(\s*# listen: end)", lambda m: m.group(1) + f"    listen 127.0.0.1:{listen_port}{ssl} http2;\n" + m.group(2).lstrip("\n"), conf, flags=re.S)
    return conf.replace("access_log /dev/stdout;", "access_log off;")


def generate(target: str, n: int = 8) -> int:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        responses = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_new_tokens=n, ignore_eos=True), timeout=30))
    return len(responses)


def served(replica) -> float:
    return metric(replica.metrics_port, "kvserve_requests_total", method="Generate", code="OK")


def test_streams_spread_over_replicas_and_survive_one_stopping(tiny_artifact, tmp_path, serve_processes):
    nginx = need("nginx")
    environment = compose_config("cpu")["services"]["server-cpu"]["environment"]
    replicas = []
    for _ in range(2):  # each handed to the fixture as soon as it runs: a second that fails to start leaks no first
        replicas.append(ServeProcess(local_environment(environment, tiny_artifact)))
        serve_processes.append(replicas[-1])
    listen = free_port()
    (tmp_path / "nginx.conf").write_text(render_nginx_conf([r.port for r in replicas], listen))
    proxy = subprocess.Popen(
        [nginx, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e", "stderr", "-g", f"daemon off; pid {tmp_path}/nginx.pid;"],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_port(listen)
        target = f"127.0.0.1:{listen}"
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda _: generate(target), range(12))) == [8] * 12
        first, second = served(replicas[0]), served(replicas[1])
        assert first > 0 and second > 0 and first + second == 12

        assert replicas[0].stop() == 0  # one replica goes away (SIGTERM, drained)
        assert [generate(target) for _ in range(6)] == [8] * 6
        assert served(replicas[1]) == second + 6
    finally:
        proxy.terminate()
        proxy.wait(10)
