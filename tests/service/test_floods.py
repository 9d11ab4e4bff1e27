"""No client slows another: 4 clients flooding the largest prompts or bodies the limits admit, over gRPC or HTTP, beside
a running stream. As tests/service/test_security.py measures a flood of Tokenize calls: the attacking clients run in
another process at the lowest priority (on 2 cores they would otherwise take a core from the server, which a client
on another machine does not), and the streams run while they last take at most 3x as long as alone (their median)."""

import subprocess
import sys
import time

import grpc
import pytest

from kvserve.v1 import generation_pb2_grpc as pb_grpc

from ..conftest import REPO
from .conftest import long_request, serving

FLOOD = """
import json, sys, threading, time
kind, target, http_port, size, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
text = ("In the beginning was the Word. " * (size // 31 + 1))[:size]
deadline = time.monotonic() + seconds
sent = []

def grpc_prompts():
    import grpc
    from kvserve.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
    stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 2**26)]))
    while time.monotonic() < deadline:
        try:
            list(stub.Generate(pb.GenerateRequest(text=text, max_new_tokens=1), timeout=60))
        except grpc.RpcError:
            pass
        sent.append(1)

def http_bodies(body):
    import http.client
    while time.monotonic() < deadline:
        connection = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
        connection.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        connection.getresponse().read()
        connection.close()
        sent.append(1)

if kind == "grpc-prompts":
    work, args = grpc_prompts, ()
elif kind == "http-prompts":
    work, args = http_bodies, (json.dumps({"model": "tiny-chat", "messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode(),)
else:  # http-bodies: the largest body --max-message-bytes admits, one long string
    work, args = http_bodies, (json.dumps({"model": "tiny-chat", "prompt": "x" * (size - 64), "max_tokens": 1}).encode(),)
threads = [threading.Thread(target=work, args=args) for _ in range(4)]
print("flooding", flush=True)
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(len(sent), flush=True)
"""


@pytest.fixture(scope="module")
def flooded(tiny_chat_artifact):
    with serving(tiny_chat_artifact, http_port=0, max_batch_size=8, max_queue=64) as server:
        yield server


@pytest.mark.parametrize("kind", ["grpc-prompts", "http-prompts", "http-bodies"])
def test_four_clients_flooding_the_largest_inputs_do_not_stall_a_running_stream(flooded, kind):
    limits = flooded.app.engine.limits
    size = limits.max_message_bytes if kind == "http-bodies" else limits.max_text_bytes

    def stream_seconds() -> float:
        with grpc.insecure_channel(flooded.target) as channel:
            start = time.perf_counter()
            assert len(list(pb_grpc.GenerationServiceStub(channel).Generate(long_request(48), timeout=120))) == 48
            return time.perf_counter() - start

    stream_seconds()  # warm
    alone = sorted(stream_seconds() for _ in range(3))[1]
    flood = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", FLOOD, kind, flooded.target, str(flooded.app.http_port),
                              str(size), "8"], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert flood.stdout.readline().strip() == "flooding"
    beside = []
    while flood.poll() is None:
        beside.append(stream_seconds())
    assert int(flood.stdout.read().strip()) >= 4, "the flood sent its requests"
    assert len(beside) >= 3, "the flood ended before three streams ran beside it"
    median = sorted(beside)[len(beside) // 2]
    assert median <= 3 * alone, f"{kind}: the median stream took {median * 1e3:.0f} ms beside the flood, {alone * 1e3:.0f} ms alone ({beside})"
