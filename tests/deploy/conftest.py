"""Deployment fixtures: the compose file as docker-compose resolves it, free ports, server processes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from ..conftest import PROVIDER, REPO

PROFILES = ([], ["gpu"], ["cpu"], ["metrics"], ["gpu", "metrics"], ["cpu", "metrics"], ["cpu", "dashboards"])


def need(tool: str) -> str:
    path = shutil.which(tool)
    assert path, f"{tool} is missing: `make system-tools` installs Debian's docker-compose and nginx-light"
    return path


def compose_config(*profiles: str, env: dict | None = None, files: tuple[str, ...] = ("docker-compose.yml",)) -> dict:
    """`docker-compose config` output: the files merged, profiles applied and variables substituted."""
    args = [need("docker-compose")] + [a for f in files for a in ("-f", f)] + [a for p in profiles for a in ("--profile", p)] + ["config"]
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`kvserve serve` as a process configured only through KVSERVE_* variables, as the image runs it."""

    def __init__(self, environment: dict, command=("kvserve", "serve")):
        self.port = int(environment["KVSERVE_PORT"])
        self.metrics_port = int(environment["KVSERVE_METRICS_PORT"])
        self.http_port = int(environment["KVSERVE_HTTP_PORT"]) if environment.get("KVSERVE_HTTP_PORT") else None
        bin_dir = os.path.dirname(sys.executable)
        env = {**os.environ, **environment, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        self.process = subprocess.Popen(list(command), env=env, cwd=REPO, stderr=subprocess.PIPE, text=True)
        self.log = []
        for line in self.process.stderr:
            self.log.append(line)
            if "kvserve.server: SERVING " in line:
                break
        else:
            raise AssertionError("server did not start:\n" + "".join(self.log))

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout)
        self.log.append(self.process.stderr.read())
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def local_environment(environment: dict, artifact) -> dict:
    """A container's environment with its paths and ports moved onto this host's loopback."""
    return {
        **{k: str(v) for k, v in environment.items()},
        "KVSERVE_MODEL": str(artifact),
        "KVSERVE_HOST": "127.0.0.1",
        "KVSERVE_PORT": str(free_port()),
        "KVSERVE_METRICS_PORT": str(free_port()),
        "KVSERVE_HTTP_PORT": str(free_port()),
        "KVSERVE_PROVIDER": PROVIDER,
    }


def metric(port: int, name: str, **labels) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_port(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


def run_health(args: list[str]) -> subprocess.CompletedProcess:
    """A compose health check's command (kvserve ...) run here, with the virtual environment's kvserve."""
    bin_dir = os.path.dirname(sys.executable)
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})


def dockerfile_directive(name: str, directive: str) -> str:
    text = (REPO / "docker" / name).read_text()
    return re.findall(rf"^{directive}\s+(.+)$", text, re.M)[-1]


@pytest.fixture
def serve_processes():
    started = []
    yield started
    for process in started:
        process.kill()
