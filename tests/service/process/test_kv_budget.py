"""serve --kv-cache-memory (service/process/kv_budget.py, the rows' admission in kv_rows.py): a flood beyond the budget waits
in the queue and completes, never more at once than the budget holds; a request that can never fit is refused in one
message naming the budget; GetModelInfo and the metrics report the budget; sizes parse as documented."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvserve.service.process.kv_budget import DEFAULT_SHARE, default_budget, memory_limit, parse_size
from kvserve.v1 import generation_pb2 as pb

from ..conftest import collect, live, long_request, scrape, slowed_server


def test_a_flood_beyond_the_budget_queues_and_completes_and_what_never_fits_is_refused(tiny_artifact, tiny_model, monkeypatch):
    config = tiny_model.config
    token = 2 * config.n_layer * config.n_kv_head * config.head_dim * 4  # K and V of one token, float32
    budget = 110 * token  # two sequences of 3 + 50 tokens (53 each), not three
    with slowed_server(tiny_artifact, monkeypatch, seconds=0.02, max_batch_size=4, max_queue=16, kv_cache_memory=budget,
                       metrics_port=0) as (running, stub, _):
        assert live(stub).kv_cache_budget_bytes == budget
        most = []
        with ThreadPoolExecutor(6) as pool:
            flood = [pool.submit(collect, stub, long_request(50)) for _ in range(6)]
            while not all(f.done() for f in flood):
                now = live(stub)
                most.append((now.active_sequences, now.queued_sequences, now.kv_cache_bytes))
            results = [f.result() for f in flood]
        assert all(len(ids) == 50 for ids, _, _ in results)  # every one completed
        assert max(a for a, _, _ in most) == 2 and max(q for _, q, _ in most) >= 1  # two rows at a time, the rest waited
        assert max(b for _, _, b in most) <= budget
        with pytest.raises(grpc.RpcError) as refused:
            collect(stub, long_request(108))  # 3 + 108 > 110
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == ("max_new_tokens: 108 new tokens after a 3-token prompt do not fit: the server's K/V budget "
                                           "holds 110 tokens (--kv-cache-memory), so at most 107 new tokens")
        metrics = scrape(running.app.metrics_port)
        assert metrics[("kvserve_kv_cache_budget_bytes", frozenset())] == budget
        assert 0 < metrics[("kvserve_prompt_cache_bytes", frozenset())] <= budget


def test_sizes_parse_in_bytes_and_both_kinds_of_unit_and_the_default_is_a_share_of_memory():
    assert [parse_size(s) for s in ("1024", "8G", "8GB", "8Gi", "8GiB", "1.5M", "512ki")] == [
        1024, 8 * 10**9, 8 * 10**9, 8 * 2**30, 8 * 2**30, 1_500_000, 512 * 1024]
    for bad in ("", "eight", "8 gigs", "-1", "8X"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)
    assert parse_size(f"{2**63 - 1}") == 2**63 - 1
    for huge in ("9" * 400, f"{2**63}", "9999999Ti", "9" * 20 + ".5"):  # a float would overflow on the first
        with pytest.raises(ValueError, match="is past the largest size"):
            parse_size(huge)
    assert default_budget() == int(DEFAULT_SHARE * memory_limit()) and 0 < memory_limit()
