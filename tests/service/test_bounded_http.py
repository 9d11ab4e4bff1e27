"""The two small ports that answer GET /metrics (the metrics port, and the gauges' own process), on
service/bounded_http.py: a client that leaves early leaves no traceback in the log, a silent or trickling connection
is closed at its headers' deadline, and so clients holding the connection cap shut a scraper out for at most that
long."""

from __future__ import annotations

import http.client
import socket
import struct
import time

import pytest

from kvserve.service.metrics import Metrics

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


def test_clients_that_leave_early_leave_no_traceback(port, capfd):
    for _ in range(60):
        client = socket.create_connection(("127.0.0.1", port))
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        client.close()
    # The reset connections' threads may still hold the two slots a moment: a scraper retries, as Prometheus does.
    deadline = time.monotonic() + 10
    while True:
        try:
            assert scrape(port) == 200
            break
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    time.sleep(0.5)  # what the server's threads had to print, printed
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error" not in err, err[:2000]


def test_silent_and_trickling_connections_are_closed_at_the_headers_deadline(port):
    silent = socket.create_connection(("127.0.0.1", port))
    trickling = socket.create_connection(("127.0.0.1", port))
    started = time.monotonic()
    trickling.sendall(b"G")
    while time.monotonic() - started < HEADER_TIMEOUT + 1.5:  # a byte every 0.2 s: never idle, never done
        time.sleep(0.2)
        try:
            trickling.sendall(b"E")
        except (BrokenPipeError, ConnectionResetError):
            break
    assert closed_by_server(trickling, 1.0)
    assert closed_by_server(silent, 1.0)
    assert time.monotonic() - started < HEADER_TIMEOUT + 3
    silent.close()
    trickling.close()


def test_clients_holding_the_cap_shut_a_scraper_out_at_most_until_their_deadline(port):
    holders = [socket.create_connection(("127.0.0.1", port)) for _ in range(CAP)]
    for holder in holders:
        holder.sendall(b"GET /metr")  # headers begun, never finished
    time.sleep(0.2)
    beyond = socket.create_connection(("127.0.0.1", port))
    assert closed_by_server(beyond, 2.0)  # beyond the cap: closed unanswered
    beyond.close()
    deadline = time.monotonic() + HEADER_TIMEOUT + 3
    while time.monotonic() < deadline:
        try:
            if scrape(port) == 200:
                break
        except (ConnectionResetError, http.client.RemoteDisconnected, BrokenPipeError):
            time.sleep(0.1)
    else:
        pytest.fail("the holders kept the scraper out past their headers' deadline")
    assert all(closed_by_server(holder, 1.0) for holder in holders)
    for holder in holders:
        holder.close()
