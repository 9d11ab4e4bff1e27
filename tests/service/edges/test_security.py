"""TLS, mutual TLS and bearer tokens, over real channels: what gets in, what is refused and how it is told."""

import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.service.edges.client import ClientSecurity, call_metadata, open_channel
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

from ...conftest import REPO
from ..conftest import long_request, start_server
from ..process.test_lifecycle import start_process


def generate_ok(target: str, security: ClientSecurity) -> int:
    with open_channel(target, security) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        return len(list(stub.Generate(long_request(4), timeout=20, metadata=call_metadata(security))))


def refused(target: str, security: ClientSecurity) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        generate_ok(target, security)
    return error.value


def test_tls_admits_only_clients_that_trust_the_server(tiny_artifact, pki):
    running = start_server(tiny_artifact, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"))
    try:
        assert generate_ok(running.target, ClientSecurity(tls_ca=str(pki / "ca.pem"))) == 4
        assert refused(running.target, ClientSecurity()).code() == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port
        assert refused(running.target, ClientSecurity(tls_ca=str(pki / "other-ca.pem"))).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop()


def test_mutual_tls_requires_a_client_certificate(tiny_artifact, pki):
    running = start_server(tiny_artifact, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), tls_client_ca=str(pki / "ca.pem"))
    try:
        assert refused(running.target, ClientSecurity(tls_ca=str(pki / "ca.pem"))).code() == grpc.StatusCode.UNAVAILABLE
        client = ClientSecurity(tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / "client.pem"), tls_key=str(pki / "client.key"))
        assert generate_ok(running.target, client) == 4
    finally:
        running.stop()


def test_a_plaintext_health_port_answers_probes_beside_a_tls_port(tiny_artifact, pki):
    """Kubernetes' native gRPC probes speak no TLS: --health-port serves the health service alone, in the clear."""
    running = start_server(tiny_artifact, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), health_port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.app.health_port}") as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="kvserve.v1.GenerationService"), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as error:
                list(pb_grpc.GenerationServiceStub(channel).Generate(long_request(4), timeout=10))
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED  # nothing but health on that port
        assert refused(running.target, ClientSecurity()).code() == grpc.StatusCode.UNAVAILABLE  # the TLS port stays TLS
    finally:
        running.stop()
    with grpc.insecure_channel(f"127.0.0.1:{running.app.health_port}") as channel:  # stopped with the server
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)


def test_bearer_tokens_guard_every_rpc_but_health(tiny_artifact, tmp_path):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    from .test_metrics import scrape

    tokens = tmp_path / "tokens"
    tokens.write_text("# the team's tokens\nalpha-token-123\n\nbeta-token-456\n")
    (tmp_path / "alpha").write_text("alpha-token-123\n")
    (tmp_path / "wrong").write_text("alpha-token-124\n")
    running = start_server(tiny_artifact, auth_tokens=str(tokens), metrics_port=0)
    try:
        error = refused(running.target, ClientSecurity())
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "no authorization metadata" in error.details()
        error = refused(running.target, ClientSecurity(token_file=str(tmp_path / "wrong")))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED and error.details() == "the bearer token is not valid"
        assert generate_ok(running.target, ClientSecurity(token_file=str(tmp_path / "alpha"))) == 4
        with grpc.insecure_channel(running.target) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="kvserve.v1.GenerationService"))
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
            with pytest.raises(grpc.RpcError) as error:
                pb_grpc.GenerationServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(Exception):  # reflection too: only for callers with a token
                ProtoReflectionDescriptorDatabase(channel).get_services()
        metrics = scrape(running.app.metrics_port)
        unauthenticated = sum(v for (name, labels), v in metrics.items() if name == "kvserve_requests_total" and ("code", "UNAUTHENTICATED") in labels)
        assert unauthenticated >= 3
    finally:
        running.stop()


def test_a_revoked_token_is_refused_after_sighup_and_tokens_never_reach_the_log(tiny_artifact, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alpha-token-123\nbeta-token-456\n")
    (tmp_path / "alpha").write_text("alpha-token-123")
    (tmp_path / "beta").write_text("beta-token-456")
    process, port, log = start_process(tiny_artifact, "--auth-tokens", str(tokens))
    try:
        assert "SERVING" in log, log
        target = f"127.0.0.1:{port}"
        alpha, beta = ClientSecurity(token_file=str(tmp_path / "alpha")), ClientSecurity(token_file=str(tmp_path / "beta"))
        assert generate_ok(target, alpha) == 4
        tokens.write_text("beta-token-456\n")  # alpha revoked
        process.send_signal(signal.SIGHUP)
        for _ in range(50):
            try:
                generate_ok(target, alpha)
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED
                break
        else:
            pytest.fail("the revoked token still works after SIGHUP")
        assert generate_ok(target, beta) == 4
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        everything = log + process.stderr.read()
        assert "alpha-token" not in everything and "beta-token" not in everything
    finally:
        process.kill()


def test_the_cli_client_speaks_tls_with_a_token(tiny_artifact, pki, tmp_path):
    (tmp_path / "tokens").write_text("gamma-token-789\n")
    running = start_server(tiny_artifact, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), auth_tokens=str(tmp_path / "tokens"))
    try:
        flags = ["--target", running.target, "--tls-ca", str(pki / "ca.pem"), "--token-file", str(tmp_path / "tokens")]
        health = subprocess.run([sys.executable, "-m", "kvserve.cli", "health", *flags], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert health.returncode == 0 and health.stdout.strip() == "SERVING", health.stderr
        result = subprocess.run([sys.executable, "-m", "kvserve.cli", "generate", "abc", "--max-new-tokens", "5", *flags],
                                capture_output=True, text=True, cwd=REPO, timeout=60)
        assert result.returncode == 0 and "-- 5 tokens" in result.stdout, result.stderr
        no_token = subprocess.run([sys.executable, "-m", "kvserve.cli", "generate", "abc", *flags[:4]], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert no_token.returncode == 1 and "UNAUTHENTICATED: no authorization metadata" in no_token.stderr
    finally:
        running.stop()


def test_oversized_metadata_is_refused_with_its_size_and_the_limit_and_large_allowed_metadata_passes(server):
    from kvserve.service.core.limits import MAX_METADATA_BYTES

    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        health_stub = health_pb2_grpc.HealthStub(channel)
        near_limit = tuple((f"x-entry-{i:03d}", "v" * 60) for i in range(MAX_METADATA_BYTES // 110))  # ~100 bytes each
        assert stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=near_limit, timeout=20).ids
        for entries in (300, 3000):  # a few hundred entries passed gRPC's own 8 KiB limit with an empty message
            metadata = tuple((f"x-entry-{i:04d}", "v" * 60) for i in range(entries))
            for call in (lambda: stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=metadata, timeout=20),
                         lambda: list(stub.Generate(long_request(2), metadata=metadata, timeout=20)),
                         lambda: health_stub.Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=20)):
                with pytest.raises(grpc.RpcError) as error:
                    call()
                assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert f"in {entries + 1} entries" in error.value.details()  # and the user-agent gRPC adds
                assert f"at most {MAX_METADATA_BYTES}" in error.value.details()


FLOOD = """
import sys, threading, grpc
from kvserve.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
target, size = sys.argv[1], int(sys.argv[2])
text = ("In the beginning was the Word. " * (size // 31 + 1))[:size]
stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 2**26)]))
results = []
calls = [threading.Thread(target=lambda: results.append(len(stub.Tokenize(pb.TokenizeRequest(text=text), timeout=120).ids)))
         for _ in range(32)]
print("flooding", flush=True)
for call in calls:
    call.start()
for call in calls:
    call.join()
print(results.count(size), flush=True)
"""


def test_a_flood_of_tokenize_calls_at_the_text_limit_does_not_stall_a_running_stream(server):
    """32 concurrent Tokenize calls of max_text_bytes each, from another client process (their per-id pieces once ran
    on the event loop and held a stream from 34 ms to 8.7 s): the streams run while they last take at most 3x as
    long as alone (the median of them), none more than 12x."""
    import time

    limit = server.app.engine.limits.max_text_bytes

    def stream_seconds() -> float:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            start = time.perf_counter()
            assert len(list(stub.Generate(long_request(48), timeout=60))) == 48
            return time.perf_counter() - start

    stream_seconds()  # warm
    alone = min(stream_seconds() for _ in range(3))
    # The attacking client runs at the lowest priority: on 2 cores it would otherwise take a core from the server,
    # which a client on another machine (the real case) does not.
    flood = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", FLOOD, server.target, str(limit)], stdout=subprocess.PIPE,
                             text=True, cwd=REPO)
    assert flood.stdout.readline().strip() == "flooding"
    beside = []
    while flood.poll() is None:
        beside.append(stream_seconds())
    assert flood.stdout.read().strip() == "32", "every Tokenize call returns the text's ids"
    assert len(beside) >= 2, "the flood ended before two streams ran beside it"
    beside.sort()
    median = beside[len(beside) // 2]
    assert median <= 3 * alone, f"the median stream took {median * 1e3:.0f} ms beside the flood, {alone * 1e3:.0f} ms alone"
    # On 2 cores gRPC's own threads moving the flood's ~40 MB still cost the worst stream several times its time alone
    # (measured 2.9-3.8x, once 6.7x in CI); pieces computed in the server process again held one stream 24.5x.
    assert beside[-1] <= 12 * alone, f"a stream took {beside[-1] * 1e3:.0f} ms beside the flood, {alone * 1e3:.0f} ms alone"


def test_a_tokenize_worker_that_dies_is_replaced_and_the_call_still_answered(server, stub):
    import os
    import signal

    pool = server.app.tokenizing._pool
    assert stub.Tokenize(pb.TokenizeRequest(text="before"), timeout=30).ids  # the worker is up
    for pid in list(pool._processes):
        os.kill(pid, signal.SIGKILL)
    response = stub.Tokenize(pb.TokenizeRequest(text="after"), timeout=60)
    assert "".join(response.pieces) == "after"
    assert server.app.tokenizing._pool is not pool
