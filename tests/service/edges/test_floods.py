"""No client slows another: 4 clients flooding the largest prompts or bodies the limits admit, over gRPC or HTTP, beside
a running stream take it to at most 3x its time alone (the median and the mean of the streams run while the flood
lasts: a few streams held for seconds would hide below the median). The
flooding client is bench/input_floods.py's (in another process, at the lowest priority: on 2 cores it would
otherwise take a core from the server, which a client on another machine does not)."""

import statistics
import sys

import pytest

from ...conftest import REPO
from ..conftest import serving

sys.path.insert(0, str(REPO / "bench"))
from input_floods import beside_flood, stream_seconds  # noqa: E402


@pytest.fixture(scope="module")
def flooded(tiny_chat_artifact):
    with serving(tiny_chat_artifact, http_port=0, max_batch_size=8, max_queue=64) as server:
        yield server


@pytest.mark.parametrize("kind", ["grpc-prompts", "http-prompts", "http-bodies"])
def test_four_clients_flooding_the_largest_inputs_do_not_stall_a_running_stream(flooded, kind):
    limits = flooded.app.engine.limits
    size = limits.max_message_bytes if kind == "http-bodies" else limits.max_text_bytes
    stream_seconds(flooded.target)  # warm
    alone = statistics.median(stream_seconds(flooded.target) for _ in range(3))
    streams, sent = beside_flood(kind, flooded.target, flooded.app.http_port, size, 8.0)
    assert sent >= 4, "the flood sent its requests"
    assert len(streams) >= 3, "the flood ended before three streams ran beside it"
    median, mean = statistics.median(streams), statistics.fmean(streams)
    assert median <= 3 * alone, f"{kind}: the median stream took {median * 1e3:.0f} ms beside the flood, {alone * 1e3:.0f} ms alone"
    assert mean <= 3 * alone, f"{kind}: the streams took {mean * 1e3:.0f} ms on average beside the flood, {alone * 1e3:.0f} ms alone"
