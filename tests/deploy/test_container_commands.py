"""The images' commands, run on this host in the order compose runs them: the export job (export +
verify), the server's entrypoint, its health check, then a streamed generation and a graceful stop.
Paths and ports move to a temporary directory and loopback; everything else is the compose file's."""

import json
import os
import subprocess
import sys

from ..conftest import REPO
from .conftest import ServeProcess, compose_config, dockerfile_directive, local_environment, metric


def run(command, env, timeout=300):
    bin_dir = os.path.dirname(sys.executable)
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **env, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )


def test_export_job_then_serve_health_generate_and_stop(tmp_path, serve_processes):
    services = compose_config("cpu", env={"KVSERVE_EXPORT_PRESET": "tiny", "KVSERVE_EXPORT_KV_CACHE": "slots"})["services"]
    artifact = tmp_path / "artifacts" / "model"
    (tmp_path / "artifacts").mkdir()

    # 1. the export image: ENTRYPOINT is docker/export-job.sh, configured by the compose environment
    assert json.loads(dockerfile_directive("export.Dockerfile", "ENTRYPOINT")) == ["kvserve-export-job"]
    assert "COPY docker/export-job.sh /usr/local/bin/kvserve-export-job" in (REPO / "docker" / "export.Dockerfile").read_text()
    export_env = {**services["export"]["environment"], "KVSERVE_MODEL": str(artifact)}
    assert export_env["KVSERVE_EXPORT_PRESET"] == "tiny"
    first = run(["sh", "docker/export-job.sh"], export_env)
    assert first.returncode == 0, first.stderr
    assert "result: PASS" in first.stdout and (artifact / "manifest.json").exists()
    assert json.loads((artifact / "manifest.json").read_text())["kv_cache"] == "slots"
    again = run(["sh", "docker/export-job.sh"], export_env)  # a restart re-verifies instead of re-exporting
    assert again.returncode == 0 and "already holds" in again.stdout and "result: PASS" in again.stdout

    # 2. the serving image: ENTRYPOINT ["kvserve", "serve"], configured only by KVSERVE_* variables
    entrypoint = json.loads(dockerfile_directive("serve.Dockerfile", "ENTRYPOINT"))
    server_env = local_environment(services["server-cpu"]["environment"], artifact)
    server = ServeProcess(server_env, command=entrypoint)
    serve_processes.append(server)

    # 3. its health check, exactly as compose runs it (the port moved)
    test = services["server-cpu"]["healthcheck"]["test"]
    assert test[0] == "CMD"
    health = run([a.replace("127.0.0.1:50051", f"127.0.0.1:{server.port}") for a in test[1:]], {})
    assert health.returncode == 0 and health.stdout.strip() == "SERVING"

    # 4. a streamed generation through it, counted by its metrics endpoint
    generated = run(["kvserve", "generate", "--target", f"127.0.0.1:{server.port}", "--max-new-tokens", "12", "hello"], {})
    assert generated.returncode == 0, generated.stderr
    assert "-- 12 tokens" in generated.stdout or "finished: end_of_sequence" in generated.stdout
    assert metric(server.metrics_port, "kvserve_requests_total", method="Generate", code="OK") == 1

    # 5. docker stop: SIGTERM, drained within the grace period, exit 0
    assert server.stop(timeout=40) == 0


def test_export_job_fails_the_stack_when_the_export_fails(tmp_path):
    services = compose_config("cpu", env={"KVSERVE_EXPORT_PRESET": "no-such-model"})["services"]
    env = {**services["export"]["environment"], "KVSERVE_MODEL": str(tmp_path / "model")}
    result = run(["sh", "docker/export-job.sh"], env)
    assert result.returncode != 0 and "unknown preset 'no-such-model'" in result.stderr
    assert not (tmp_path / "model").exists()
