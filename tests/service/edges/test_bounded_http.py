"""The two small ports that answer GET /metrics (the metrics port, and the gauges' own process), on
service/edges/bounded_http.py: a client that leaves early leaves no traceback in the log, a silent or trickling connection
is closed at its headers' deadline, and so clients holding the connection cap shut a scraper out for at most that
long (one beyond the cap closed unanswered: tests/service/edges/test_gateway_gauges.py)."""

from __future__ import annotations

import http.client
import socket
import struct
import time

import pytest

from kvserve.service.edges.metrics import Metrics

HEADER_TIMEOUT = 1.0
CAP = 2


@pytest.fixture(params=["metrics port", "gauges port"])
def port(request):
    metrics = Metrics()
    if request.param == "metrics port":
        number = metrics.serve_http("127.0.0.1", 0, HEADER_TIMEOUT, CAP)
    else:
        number = metrics.serve_gateway("127.0.0.1", 0, HEADER_TIMEOUT, CAP)
    yield number
    metrics.close()


def scrape(port: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def closed_by_server(connection: socket.socket, within: float) -> bool:
    """Whether the server closes connection (an end of file or a reset) within `within` seconds."""
    connection.settimeout(within)
    try:
        return connection.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def every_slot_free(port: int) -> None:
    """Wait until CAP scrapes can be held at once: every earlier connection's thread has ended (a thread gives its slot
    back last, after whatever it had to report), so whatever those threads printed is printed. A scraper retries, as
    Prometheus does, while they end."""
    deadline = time.monotonic() + 30
    while True:
        connections = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(CAP)]
        try:
            for connection in connections:  # each kept open, holding its slot, while the next is asked
                connection.request("GET", "/metrics")
                response = connection.getresponse()
                response.read()
                assert response.status == 200
            return
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            assert time.monotonic() < deadline, "the slots never came back"
            time.sleep(0.05)
        finally:
            for connection in connections:
                connection.close()


def closed_while_trickling(connection: socket.socket) -> bool:
    """Send a byte every 0.2 s (never idle, never done) until the server closes the connection; False if it has not
    within 30 s."""
    deadline = time.monotonic() + 30
    connection.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            connection.sendall(b"E")
            if connection.recv(1) == b"":
                return True
        except (BrokenPipeError, ConnectionResetError):
            return True
        except TimeoutError:
            pass
    return False


def test_clients_that_leave_early_leave_no_traceback(port, capfd):
    for _ in range(60):
        client = socket.create_connection(("127.0.0.1", port))
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        client.close()
    every_slot_free(port)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error" not in err, err[:2000]


def test_silent_and_trickling_connections_are_closed_at_the_headers_deadline(port):
    silent = socket.create_connection(("127.0.0.1", port))
    trickling = socket.create_connection(("127.0.0.1", port))
    trickling.sendall(b"G")
    assert closed_while_trickling(trickling)  # a deadline from the request's start: bytes do not extend it
    assert closed_by_server(silent, 30)
    silent.close()
    trickling.close()


def test_clients_holding_the_cap_shut_a_scraper_out_at_most_until_their_deadline(port):
    holders = [socket.create_connection(("127.0.0.1", port)) for _ in range(CAP)]
    for holder in holders:
        holder.sendall(b"GET /metr")  # headers begun, never finished
    every_slot_free(port)  # served, though the holders never finish: their headers ran out of time
    assert all(closed_by_server(holder, 30) for holder in holders)
    for holder in holders:
        holder.close()
