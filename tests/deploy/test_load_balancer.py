"""The real load balancer (Debian's nginx, configured from deploy/nginx.conf) in front of two server
processes on loopback: gRPC streams and HTTP API streams spread over both, and gRPC survives one replica going away."""

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx2 as httpx

from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

from ..conftest import REPO
from .conftest import ServeProcess, compose_config, free_port, local_environment, metric, need, wait_port


def render_nginx_conf(replica_ports, listen_port, source: str = "nginx.conf", api_ports=(), api_listen: int | None = None) -> str:
    """deploy/SOURCE with the replicas (gRPC ports, and HTTP API ports) and the listen addresses moved onto loopback."""
    conf = (REPO / "deploy" / source).read_text()
    ssl = " ssl" if "listen 50051 ssl" in conf else ""

    def block(marker: str, lines: str, text: str) -> str:
        return re.sub(rf"(# {marker}: begin\n).*?(\s*# {marker}: end)", lambda m: m.group(1) + lines + m.group(2).lstrip("\n"), text, flags=re.S)

    servers = "".join(f"    server 127.0.0.1:{p} max_fails=1 fail_timeout=10s;\n" for p in replica_ports)
    conf = block("listen", f"    listen 127.0.0.1:{listen_port}{ssl} http2;\n", block("replicas", servers, conf))
    api_servers = "".join(f"    server 127.0.0.1:{p} max_fails=1 fail_timeout=10s;\n" for p in api_ports or replica_ports)
    conf = block("api-port", f"    listen 127.0.0.1:{api_listen or free_port()}{ssl};\n", block("api-servers", api_servers, conf))
    return conf.replace("access_log /dev/stdout;", "access_log off;")


def generate(target: str, n: int = 8) -> int:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        responses = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_new_tokens=n, ignore_eos=True), timeout=30))
    return len(responses)


def requests_served(replica) -> float:
    return metric(replica.metrics_port, "kvserve_requests_total", method="Generate", code="OK")


def test_streams_spread_over_replicas_and_survive_one_stopping(tiny_artifact, tmp_path, serve_processes):
    nginx = need("nginx")
    environment = compose_config("cpu")["services"]["server-cpu"]["environment"]
    replicas = []
    for _ in range(2):  # each handed to the fixture as soon as it runs: a second that fails to start leaks no first
        replicas.append(ServeProcess(local_environment(environment, tiny_artifact)))
        serve_processes.append(replicas[-1])
    listen, api_listen = free_port(), free_port()
    (tmp_path / "nginx.conf").write_text(render_nginx_conf([r.port for r in replicas], listen, api_ports=[r.http_port for r in replicas],
                                                           api_listen=api_listen))
    proxy = subprocess.Popen(
        [nginx, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e", "stderr", "-g", f"daemon off; pid {tmp_path}/nginx.pid;"],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_port(listen)
        target = f"127.0.0.1:{listen}"
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda _: generate(target), range(12))) == [8] * 12
        first, second = requests_served(replicas[0]), requests_served(replicas[1])
        assert first > 0 and second > 0 and first + second == 12

        # the OpenAI-compatible API through the same balancer: streamed events pass through, both replicas answer
        body = {"model": "tiny", "prompt": "In", "max_tokens": 8, "temperature": 0, "stream": True}
        for _ in range(6):
            with httpx.stream("POST", f"http://127.0.0.1:{api_listen}/v1/completions", json=body, timeout=30) as response:
                lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            # a chunk for the tokens ready together (8 tokens: 8 chunks at most), the last with its finish, then [DONE]
            assert response.status_code == 200 and 2 <= len(lines) <= 9 and lines[-1] == "data: [DONE]"
            assert '"finish_reason": "length"' in lines[-2]
        answered = [metric(r.metrics_port, "kvserve_requests_total", method="Completions", code="OK") for r in replicas]
        assert min(answered) > 0 and sum(answered) == 6

        assert replicas[0].stop() == 0  # one replica goes away (SIGTERM, drained)
        assert [generate(target) for _ in range(6)] == [8] * 6
        assert requests_served(replicas[1]) == second + 6
    finally:
        proxy.terminate()
        proxy.wait(10)
