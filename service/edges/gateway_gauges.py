"""The inference gateway's three gauges, answered by a process of their own: `serve --gateway-metrics-port`.

In the server's process a scrape waits for the event loop, which hands each step's tokens to every stream in one
go: under 16 decoding streams /metrics on the HTTP API port answered in 7.4-7.8 ms at p99, and the scrapes cost the
streams up to 9% of their tokens/s (bench/metrics_scrape.py). So the server writes the three values into a shared
page as it delivers each step (GaugeBoard: one aligned 8-byte float each, no lock: a scrape may read one step's
waiting beside the next step's running, which it could not tell from a scrape a step later), and a child process
answers GET /metrics from that page with the standard library's HTTP/1.1 server, never taking the server's GIL.

The child (`python -m kvserve.service.edges.gateway_gauges`) is handed the listening socket, bound by the server so a taken
port is refused at start, and the page, both as file descriptors; it ends when its stdin, a pipe the server holds,
reaches its end: when the server ends, however it ends. It asks Linux (6.12 and later) for a short time slice, which
any process may: a task that wakes with a short slice gets the CPU ahead of the model's threads, which keep every
core busy under load (p99 6.1 -> 5.1 ms in bench/metrics_scrape.py on 2 cores).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import platform
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading

from .bounded_http import BoundedHandler, BoundedHTTPServer, listening_socket

# The protocol's gauges (gateway-api-inference-extension, proposal 003) under vLLM's names, the endpoint picker's
# defaults; metrics.py registers the same names and help for the HTTP API's /metrics.
GAUGES = (
    ("vllm:num_requests_waiting", "Requests waiting for a batch row (inference gateway protocol)"),
    ("vllm:num_requests_running", "Requests holding a batch row (inference gateway protocol)"),
    ("vllm:kv_cache_usage_perc", "Fraction of the batch's K/V rows holding a running sequence, 0 to 1 (inference gateway protocol)"),
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format, as prometheus_client serves it
_LAYOUT = struct.Struct("=3d")
# sched_setattr's number per machine, and the slice asked for: the scheduler's shortest, 0.1 ms (a scrape's work is
# ~0.05 ms; the default slice is several times longer).
SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}
SLICE_NS = 100_000
READY = b"ready\n"  # the child's first line on stdout
START_SECONDS = 20.0  # the child's interpreter start and imports, on a busy machine


class GaugeBoard:
    """The shared page: the server writes, the child reads."""

    def __init__(self, fd: int):
        self.fd = fd
        self._page = mmap.mmap(fd, _LAYOUT.size)

    @classmethod
    def create(cls) -> GaugeBoard:
        with tempfile.TemporaryFile() as file:  # unlinked at once: the mapping and the child's descriptor keep it
            os.ftruncate(file.fileno(), _LAYOUT.size)
            return cls(os.dup(file.fileno()))

    def write(self, waiting: float, running: float, usage: float) -> None:
        _LAYOUT.pack_into(self._page, 0, waiting, running, usage)

    def read(self) -> tuple[float, float, float]:
        return _LAYOUT.unpack_from(self._page, 0)

    def close(self) -> None:
        self._page.close()
        os.close(self.fd)


def exposition(values: tuple[float, float, float], constant: bytes = b"") -> bytes:
    """The three gauges in Prometheus' text format, then constant (what does not change while the server runs: the
    cache's configuration, cache_config_exposition)."""
    return "".join(f"# HELP {name} {help_text}\n# TYPE {name} gauge\n{name} {float(value)!r}\n"
                   for (name, help_text), value in zip(GAUGES, values)).encode() + constant


CACHE_CONFIG = "vllm:cache_config_info"  # vLLM's, read by the router's prefix scorer for its block size


def cache_config_exposition(block_size: int, blocks: int) -> bytes:
    """vllm:cache_config_info in Prometheus' text format: the prompt cache's block size and how many blocks the K/V
    holds (every row's context), as vLLM labels them; its value is 1."""
    return (f"# HELP {CACHE_CONFIG} The K/V cache's configuration (block_size: the prompt cache's blocks; num_gpu_blocks: "
            f"blocks of K/V the batch's rows hold)\n# TYPE {CACHE_CONFIG} gauge\n"
            f'{CACHE_CONFIG}{{block_size="{block_size}",num_gpu_blocks="{blocks}"}} 1.0\n').encode()


class GatewayGaugeServer:
    """The child process that answers the gauges, and the board the server writes them to."""

    def __init__(self, host: str, port: int, header_timeout: float, max_connections: int, constant: bytes = b""):
        """Binds host:port now (OSError if it cannot), then starts the child and waits for it to say it is ready; constant:
        exposition text answered after the gauges (cache_config_exposition)."""
        listener = listening_socket(host, port)
        try:
            self.port = listener.getsockname()[1]
            self.board = GaugeBoard.create()
            self.board.write(0.0, 0.0, 0.0)
            self._child = subprocess.Popen(
                [sys.executable, "-m", __spec__.name, "--socket-fd", str(listener.fileno()), "--board-fd", str(self.board.fd),
                 "--header-timeout", str(header_timeout), "--max-connections", str(max_connections), "--constant", constant.decode()],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(listener.fileno(), self.board.fd))
        finally:
            listener.close()  # the child's copy listens; with the child gone, a scrape is refused, not left waiting
        line = self._first_line()
        if line != READY:
            self.close()
            raise OSError(f"the gauges' process did not start ({line.decode(errors='replace').strip() or 'no answer'})")

    def _first_line(self) -> bytes:
        lines: list[bytes] = []
        reader = threading.Thread(target=lambda: lines.append(self._child.stdout.readline()), daemon=True)
        reader.start()
        reader.join(START_SECONDS)
        return lines[0] if lines else b""

    def close(self) -> None:
        if self._child.poll() is None:
            self._child.stdin.close()  # its end of file: the child exits
            try:
                self._child.wait(5)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()
        self._child.stdout.close()
        self.board.close()


# --- the child ------------------------------------------------------------------------------------------------


class _GaugeHandler(BoundedHandler):
    board: GaugeBoard  # set on the class at the child's start
    constant = b""

    def exposition(self) -> tuple[bytes, str]:
        return exposition(self.board.read(), self.constant), CONTENT_TYPE


def _ask_for_a_short_slice() -> None:
    """sched_setattr(SCHED_OTHER, runtime=SLICE_NS) for this process's threads (inherited by those it starts). Older
    kernels ignore the slice; elsewhere nothing is asked: the gauges are answered all the same."""
    number = SCHED_SETATTR.get(platform.machine())
    if number is None or sys.platform != "linux":
        return
    # struct sched_attr, its first version: size, policy, flags, nice, priority, runtime, deadline, period
    attr = ctypes.create_string_buffer(struct.pack("=IIQiIQQQ", 48, 0, 0, 0, 0, SLICE_NS, 0, 0))
    ctypes.CDLL(None, use_errno=True).syscall(number, 0, attr, 0)


def _exit_at_end_of_stdin() -> None:
    sys.stdin.buffer.read()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description="the inference gateway's gauges, for a kvserve server (it starts this)")
    parser.add_argument("--socket-fd", type=int, required=True)
    parser.add_argument("--board-fd", type=int, required=True)
    parser.add_argument("--header-timeout", type=float, required=True)
    parser.add_argument("--max-connections", type=int, required=True)
    parser.add_argument("--constant", default="")
    args = parser.parse_args()
    _ask_for_a_short_slice()
    threading.Thread(target=_exit_at_end_of_stdin, daemon=True, name="kvserve-parent-watch").start()
    listener = socket.socket(fileno=args.socket_fd)
    _GaugeHandler.board = GaugeBoard(args.board_fd)
    _GaugeHandler.constant = args.constant.encode()
    server = BoundedHTTPServer(listener, _GaugeHandler, args.max_connections, args.header_timeout)
    sys.stdout.buffer.write(READY)
    sys.stdout.buffer.flush()
    server.serve_forever()


if __name__ == "__main__":
    main()
