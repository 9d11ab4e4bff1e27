"""service/edges/gateway_gauges.py: the inference gateway's gauges from a process of their own. What the server writes is
what a scrape reads, in the text prometheus_client renders for the same gauges; the child speaks HTTP/1.1 (kept
alive, 404, 501, 400), holds at most its connections, is refused a taken port, and ends with the server however the
server ends."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from prometheus_client import generate_latest

from kvserve.service.edges.gateway_gauges import GatewayGaugeServer
from kvserve.service.edges.metrics import Metrics


@pytest.fixture
def metrics():
    metrics = Metrics()
    metrics.serve_gateway("127.0.0.1", 0, header_timeout=5, max_connections=2)
    yield metrics
    metrics.close()


def get(connection: http.client.HTTPConnection, path: str = "/metrics", method: str = "GET") -> tuple[int, str, bytes]:
    connection.request(method, path)
    response = connection.getresponse()
    return response.status, response.getheader("Content-Type"), response.read()


def test_a_scrape_reads_what_the_server_wrote_as_prometheus_client_renders_it(metrics):
    port = metrics._gateway_server.port
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    status, content_type, idle = get(connection)
    assert status == 200 and content_type == "text/plain; version=0.0.4; charset=utf-8"  # the text format every parser reads
    assert idle == generate_latest(metrics.gateway_registry)  # all zeros before any step
    metrics.set_rows(8)
    for queued, running in ((3, 8), (0, 5), (0, 0)):
        metrics.on_step(running, running, queued, 0)
        _, _, body = get(connection)  # the same connection each time: kept alive, as the picker's Go client keeps it
        assert body == generate_latest(metrics.gateway_registry)
        assert f"vllm:num_requests_waiting {float(queued)}\n".encode() in body
        assert f"vllm:kv_cache_usage_perc {running / 8}\n".encode() in body


def test_other_paths_methods_and_garbage_get_http_errors(metrics):
    port = metrics._gateway_server.port
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    assert get(connection, "/v1/models")[0] == 404
    assert get(connection, "/metrics?name[]=x")[0] == 200  # a query is the picker's to add; the gauges are the answer
    assert get(connection, method="POST")[0] == 501
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = b"".join(iter(lambda: raw.recv(4096), b""))  # to the close: garbage ends its connection
        assert b"400 - Bad request syntax" in answer


def test_a_connection_beyond_the_limit_is_closed_unanswered(metrics):
    port = metrics._gateway_server.port
    held = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(2)]
    for connection in held:
        assert get(connection)[0] == 200  # both connected and kept alive: the limit (2) is reached
    with socket.create_connection(("127.0.0.1", port), timeout=10) as third:
        third.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert third.recv(1024) == b""  # closed
    held[0].close()
    time.sleep(0.2)  # the child's thread for it sees the close and gives its slot back
    assert get(http.client.HTTPConnection("127.0.0.1", port, timeout=10))[0] == 200


def test_a_taken_port_is_refused_at_start():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            GatewayGaugeServer("127.0.0.1", taken.getsockname()[1], header_timeout=5, max_connections=2)


def test_the_child_ends_with_a_server_that_is_killed(tmp_path):
    server = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from kvserve.service.edges.gateway_gauges import GatewayGaugeServer
        gauges = GatewayGaugeServer("127.0.0.1", 0, header_timeout=5, max_connections=2)
        print(gauges._child.pid, gauges.port, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    child, port = map(int, server.stdout.readline().split())
    assert get(http.client.HTTPConnection("127.0.0.1", port, timeout=10))[0] == 200
    server.send_signal(signal.SIGKILL)  # no exit hook runs
    server.wait()
    # The child's leader turns zombie before its other threads (and with them its sockets) are gone: wait for what
    # matters, the port refusing, not for a state that comes first.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _still_listening(port):
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}") or "zombie" in _state(child)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=10)


def _still_listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
        return True
    except ConnectionRefusedError:
        return False


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(line for line in status if line.startswith("State:")).lower()
    except FileNotFoundError:
        return "gone"
