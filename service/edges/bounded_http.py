"""The standard library's threaded HTTP/1.1 server with every wait on a client bounded, for the two small ports that
answer GET /metrics (the Prometheus metrics port, and the gauges' own process: gateway_gauges.py). Standard library
only: the gauges' child process imports it.

- At most max_connections connections at once; one beyond is closed unanswered, before it is read.
- Each request's line and headers are due within header_timeout of the connection opening or of the previous answer:
  a client that sends nothing, or trickles its headers a byte at a time, loses its connection then (a watchdog thread
  shuts the socket down, which ends the blocked read), so no client holds a slot, a descriptor or a thread for longer.
- A client that leaves early (a reset, a broken pipe) ends its thread quietly: socketserver would print a traceback
  to the server's log for each one.
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WATCH_INTERVAL = 0.25  # seconds between the watchdog's rounds: a deadline is kept to within this


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening (OSError if it cannot be), Nagle off for the connections it accepts."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted connections inherit it
        listener.bind((host, port))
        listener.listen(16)
    except OSError:
        listener.close()
        raise
    return listener


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread a connection, at most max_connections at once, each request's headers within header_timeout."""

    daemon_threads = True

    def __init__(self, listener: socket.socket, handler: type[BaseHTTPRequestHandler], max_connections: int, header_timeout: float):
        """listener: a bound, listening socket (the server takes it over)."""
        super().__init__(listener.getsockname()[:2], handler, bind_and_activate=False)
        self.socket.close()
        self.socket = listener
        self.header_timeout = header_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._deadlines: dict[socket.socket, float] = {}  # connection -> when its request's headers are due
        self._lock = threading.Lock()
        self._watching = threading.Event()
        threading.Thread(target=self._watch, name="kvserve-http-deadlines", daemon=True).start()

    def expect_request(self, connection: socket.socket) -> None:
        """A request's line and headers are due on connection from now."""
        with self._lock:
            self._deadlines[connection] = time.monotonic() + self.header_timeout

    def request_read(self, connection: socket.socket) -> None:
        """connection's request is in: no deadline while it is answered."""
        with self._lock:
            self._deadlines.pop(connection, None)

    def _watch(self) -> None:
        while not self._watching.wait(WATCH_INTERVAL):
            now = time.monotonic()
            with self._lock:
                late = [c for c, due in self._deadlines.items() if due <= now]
                for connection in late:
                    del self._deadlines[connection]
            for connection in late:
                try:
                    connection.shutdown(socket.SHUT_RDWR)  # the handler's read ends; its thread closes the socket
                except OSError:
                    pass

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.request_read(request)
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        pass  # a client that reset or left mid-answer: nothing to report, and never a traceback in the log

    def server_close(self) -> None:
        self._watching.set()
        super().server_close()


class BoundedHandler(BaseHTTPRequestHandler):
    """A handler for BoundedHTTPServer answering GET /metrics with exposition(): kept alive, each request's headers on
    the server's deadline, no access log."""

    protocol_version = "HTTP/1.1"  # kept alive: scrapers reuse their connection
    server: BoundedHTTPServer
    paths = ("/metrics",)  # what is answered; any other path is 404

    def exposition(self) -> tuple[bytes, str]:
        """The body and its content type."""
        raise NotImplementedError

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] not in self.paths:
            self.answer(404, b"not found: this port serves /metrics\n", "text/plain; charset=utf-8")
        else:
            self.answer(200, *self.exposition())

    def handle_one_request(self) -> None:
        self.server.expect_request(self.connection)
        super().handle_one_request()

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # the line and the headers are read by now
        self.server.request_read(self.connection)
        return parsed

    def answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        pass  # one line a scrape is noise
