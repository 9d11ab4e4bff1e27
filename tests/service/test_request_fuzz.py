"""Property-based fuzzing of request validation (hypothesis): whatever a client sends, the answer is a whole
stream or a clear refusal, never INTERNAL, never a hang, and the server stays healthy."""

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.v1 import generation_pb2 as pb

CLEAR_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
UINT32, UINT64 = 2**32 - 1, 2**64 - 1
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@st.composite
def generate_requests(draw):
    request = pb.GenerateRequest(
        max_new_tokens=draw(st.one_of(st.integers(0, 40), st.integers(0, UINT32))),
        sampling=pb.SamplingParams(
            temperature=draw(st.one_of(st.just(0.0), floats32)), top_k=draw(st.integers(-(2**31), 2**31 - 1)),
            top_p=draw(floats32), repetition_penalty=draw(st.one_of(st.just(1.0), floats32)), seed=draw(st.integers(0, UINT64)),
        ),
        stop_sequences=draw(st.lists(st.text(max_size=300), max_size=20)),
        stop_token_ids=draw(st.lists(st.integers(0, UINT32), max_size=8)),
        return_logprobs=draw(st.booleans()), ignore_eos=draw(st.booleans()),
    )
    prompt = draw(st.sampled_from(["text", "token_ids", "none"]))
    if prompt == "text":
        request.text = draw(st.text(max_size=300))
    elif prompt == "token_ids":
        request.token_ids.CopyFrom(pb.TokenIds(ids=draw(st.lists(st.one_of(st.integers(0, 300), st.integers(0, UINT32)), max_size=300))))
    return request


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=generate_requests())
def test_any_request_gets_a_whole_stream_or_a_clear_refusal(stub, server, request):
    try:
        responses = list(stub.Generate(request, timeout=30))
    except grpc.RpcError as error:
        assert error.code() in CLEAR_REFUSALS, (error.code(), error.details())
        assert error.details()
    else:
        assert responses and responses[-1].HasField("finish")
        assert all(r.HasField("token") for r in responses)


def test_the_server_is_healthy_after_the_fuzzing(server):
    with grpc.insecure_channel(server.target) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="kvserve.v1.GenerationService"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
