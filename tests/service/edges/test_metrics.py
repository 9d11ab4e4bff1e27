"""The Prometheus endpoint: scraped over HTTP after real traffic, every metric docs/deployment.md lists."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvserve.v1 import generation_pb2 as pb

from ...conftest import PROVIDER, PROVIDER_NAMES
from ..conftest import collect, live, long_request, scrape, slowed_server, wait_for


def test_metrics_count_requests_tokens_latencies_batches_and_the_provider(tiny_artifact, monkeypatch):
    # Steps of 30 ms: the second request surely arrives while the first still decodes (a tiny-model step
    # takes about a millisecond, less than one RPC's way in, so unslowed the two could run one after the other).
    with slowed_server(tiny_artifact, monkeypatch, seconds=0.03, metrics_port=0) as (running, stub, _):
        with ThreadPoolExecutor(2) as pool:  # two at once: steps of batch size 2
            list(pool.map(lambda n: collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), max_new_tokens=n, ignore_eos=True)), (5, 7)))
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(pb.GenerateRequest(text=""), timeout=10))
        stub.GetModelInfo(pb.GetModelInfoRequest())
        metrics = scrape(running.app.metrics_port)

    def value(name, **labels):
        return metrics[(name, frozenset(labels.items()))]

    assert value("kvserve_requests_total", method="Generate", code="OK") == 2
    assert value("kvserve_requests_total", method="Generate", code="INVALID_ARGUMENT") == 1
    assert value("kvserve_requests_total", method="GetModelInfo", code="OK") == 1
    assert value("kvserve_generated_tokens_total") == 12
    assert value("kvserve_time_to_first_token_seconds_count") == 2
    assert value("kvserve_inter_token_latency_seconds_count") == 10
    assert value("kvserve_batch_size_sum") == 12 and 7 <= value("kvserve_batch_size_count") < 12
    assert value("kvserve_batch_size_bucket", le="1.0") < value("kvserve_batch_size_count")  # some steps ran both
    assert value("kvserve_queue_depth") == 0 and value("kvserve_kv_slots_in_use") == 0 and value("kvserve_kv_cache_bytes") == 0
    assert value("kvserve_execution_provider", provider=PROVIDER_NAMES[PROVIDER]) == 1


def test_every_finished_rpc_is_counted_once_under_its_real_code(tiny_artifact, monkeypatch, caplog):
    def live_counts(stub):
        counts = live(stub)
        return counts.active_sequences, counts.queued_sequences

    # 0.1 s a step: the expiring requests' 200 tokens take 7 steps at least (1 + drafts.MAX_DRAFT_TOKENS a step), so
    # they outlast their 0.3 s deadline however many drafts the cancelled streams taught the server to take
    with slowed_server(tiny_artifact, monkeypatch, seconds=0.1, metrics_port=0, max_batch_size=4, max_queue=64) as (running, stub, channel):
        cancelled = [stub.Generate(long_request(200), timeout=60) for _ in range(4)]
        for stream in cancelled:
            next(stream)  # four are running ...
        cancelled += [stub.Generate(long_request(200), timeout=60) for _ in range(8)]
        assert wait_for(lambda: live_counts(stub) == (4, 8))  # ... and eight wait: cancelled mid-stream and queued
        for stream in cancelled:
            stream.cancel()

        def expire(_):
            try:
                list(stub.Generate(long_request(200), timeout=0.3))
            except grpc.RpcError as error:
                return error.code()

        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(expire, range(6))) == [grpc.StatusCode.DEADLINE_EXCEEDED] * 6
        raw = channel.unary_stream("/kvserve.v1.GenerationService/Generate")  # bytes in, bytes out
        caplog.clear()
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as error:
                list(raw(b"\xff\xfe garbage, not a protobuf", timeout=10))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid message" in error.value.details()
        assert not [r for r in caplog.records if r.exc_info or r.levelname == "ERROR"]  # one info line each, no traceback

        def counted():
            metrics = scrape(running.app.metrics_port)
            return {code: metrics.get(("kvserve_requests_total", frozenset({("method", "Generate"), ("code", code)})), 0)
                    for code in ("CANCELLED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT", "OK")}

        assert wait_for(lambda: counted() == {"CANCELLED": 12, "DEADLINE_EXCEEDED": 6, "INVALID_ARGUMENT": 3, "OK": 0}, timeout=15), counted()
