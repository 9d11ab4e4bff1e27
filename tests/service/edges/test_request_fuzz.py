"""Property-based fuzzing of every GenerateRequest field (hypothesis): whatever a client sends, the answer is a whole
stream or a clear refusal, never INTERNAL, never a hang; and after the whole run the server still serves, and serves
the same tokens for the same request as before it."""

from collections import Counter

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.v1 import generation_pb2 as pb

from ..conftest import collect, serving, stub_of

CLEAR_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
UINT32, UINT64 = 2**32 - 1, 2**64 - 1
EXAMPLES = 120
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
small_or_any = lambda small, limit: st.one_of(st.integers(0, small), st.integers(0, limit))  # noqa: E731
SCHEMAS = ['{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}', '{"type": "string", "maxLength": 3}',
           '{"type": "array", "items": ' * 40 + "{}" + "}" * 40, "[]", '{"type": 7}']


@st.composite
def response_formats(draw):
    kind = draw(st.sampled_from(["json_schema", "json_object", "regex", "lark_grammar"]))
    if kind == "json_object":
        return pb.ResponseFormat(json_object=pb.JsonObject())
    text = {"json_schema": st.one_of(st.sampled_from(SCHEMAS), st.text(max_size=80)),
            "regex": st.one_of(st.sampled_from(["[a-c]{1,4}", "(ab)+", "["]), st.text(max_size=20)),
            "lark_grammar": st.one_of(st.just('start: "x" | "y"'), st.text(max_size=40))}[kind]
    return pb.ResponseFormat(**{kind: draw(text)})


# Each field: (what a well-meaning client sends, anything the wire can carry). A request takes up to three fields from
# the second column and the rest from the first, so some requests stream and every field is tried wild.
FIELDS = {
    "max_new_tokens": (st.integers(0, 24), st.integers(0, UINT32)),
    "temperature": (st.one_of(st.just(0.0), st.floats(0.1, 2.0)), floats32),
    "top_k": (st.integers(0, 50), st.integers(-(2**31), 2**31 - 1)),
    "top_p": (st.one_of(st.just(0.0), st.floats(0.05, 1.0)), floats32),
    "repetition_penalty": (st.one_of(st.just(0.0), st.floats(0.5, 2.0)), floats32),
    "seed": (st.integers(0, 1000), st.integers(0, UINT64)),
    "presence_penalty": (st.floats(-2.0, 2.0), floats32),
    "frequency_penalty": (st.floats(-2.0, 2.0), floats32),
    "min_p": (st.floats(0.0, 0.5), floats32),
    "logit_bias": (st.dictionaries(st.integers(0, 256), st.floats(-100, 100), max_size=4),
                   st.dictionaries(small_or_any(300, UINT32), floats32, min_size=1, max_size=310)),
    "stop_sequences": (st.lists(st.text(min_size=1, max_size=8), max_size=3), st.lists(st.text(max_size=300), max_size=20)),
    "stop_token_ids": (st.lists(st.integers(0, 256), max_size=3), st.lists(small_or_any(300, UINT32), max_size=8)),
    "top_logprobs": (st.integers(0, 5), st.integers(0, UINT32)),
    "n": (st.integers(0, 3), st.integers(0, UINT32)),
    "response_format": (st.none(), response_formats()),
    "prompt": (st.sampled_from(["text", "token_ids", "messages"]), st.sampled_from(["text", "token_ids", "messages", "none"])),
}
SAMPLING = ("temperature", "top_k", "top_p", "repetition_penalty", "seed", "presence_penalty", "frequency_penalty", "min_p", "logit_bias")


@st.composite
def generate_requests(draw):
    wild = draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=3))
    value = {name: draw(FIELDS[name][name in wild]) for name in FIELDS}
    request = pb.GenerateRequest(
        max_new_tokens=value["max_new_tokens"], sampling=pb.SamplingParams(**{name: value[name] for name in SAMPLING}),
        stop_sequences=value["stop_sequences"], stop_token_ids=value["stop_token_ids"], n=value["n"],
        return_logprobs=draw(st.booleans()) or value["top_logprobs"] > 0, top_logprobs=value["top_logprobs"],
        ignore_eos=draw(st.booleans()),
    )
    if value["response_format"] is not None:
        request.response_format.CopyFrom(value["response_format"])
    wild_prompt = "prompt" in wild
    if value["prompt"] == "text":
        request.text = draw(st.text(max_size=300) if wild_prompt else st.text(min_size=1, max_size=40))
    elif value["prompt"] == "token_ids":
        ids = st.lists(small_or_any(300, UINT32), max_size=300) if wild_prompt else st.lists(st.integers(0, 256), min_size=1, max_size=40)
        request.token_ids.CopyFrom(pb.TokenIds(ids=draw(ids)))
    elif value["prompt"] == "messages":
        roles = st.one_of(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=80)) if wild_prompt else st.just("user")
        content = st.text(max_size=120) if wild_prompt else st.text(min_size=1, max_size=40)
        messages = draw(st.lists(st.builds(pb.ChatMessage, role=roles, content=content), min_size=0 if wild_prompt else 1, max_size=5))
        request.messages.CopyFrom(pb.Conversation(messages=messages))
    return request


def outcome(stub, request) -> str:
    """"streamed" or "refused"; anything else fails the test with what happened."""
    try:
        responses = list(stub.Generate(request, timeout=60))
    except grpc.RpcError as error:
        assert error.code() in CLEAR_REFUSALS, (error.code(), error.details(), request)
        assert error.details()
        return "refused"
    finishes = [r for r in responses if r.HasField("finish")]
    assert responses and all(r.HasField("token") for r in responses)
    assert len(finishes) == max(request.n, 1) and responses[-1].HasField("finish"), request  # every completion ends
    return "streamed"


def test_any_request_gets_a_whole_stream_or_a_clear_refusal_and_the_server_serves_on(tiny_chat_artifact):
    reference = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8]), max_new_tokens=12, ignore_eos=True)
    seen: Counter = Counter()
    with serving(tiny_chat_artifact, max_batch_size=8, max_queue=256) as server, stub_of(server) as stub:
        before = collect(stub, reference)[0]

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
        @given(request=generate_requests())
        def fuzz(request):
            seen[outcome(stub, request)] += 1

        fuzz()
        assert sum(seen.values()) >= EXAMPLES and seen["streamed"] and seen["refused"], seen  # it ran, and drew both kinds
        with grpc.insecure_channel(server.target) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="kvserve.v1.GenerationService"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert collect(stub, reference)[0] == before  # the fuzzing left no state behind that changes an answer
        info = stub.GetModelInfo(pb.GetModelInfoRequest()).live
        assert (info.active_sequences, info.queued_sequences) == (0, 0)  # every fuzzed sequence left its row
