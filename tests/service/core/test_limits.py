"""Limits declared once (service/core/limits.py): each EngineLimits field is a `serve` flag and a KVSERVE_* variable with its
declared default and bounds, a GetModelInfo field, a row of docs/serving.md's table, and the same check over gRPC and
over HTTP."""

import dataclasses

import grpc
import httpx2 as httpx
import pytest

from kvserve.cli import parse_args
from kvserve.service.core.limits import EngineLimits, declarations, markdown_table
from kvserve.v1 import generation_pb2 as pb

from ...conftest import REPO
from ..conftest import serving, stub_of

TIGHT = {"max_n": 2, "max_top_logprobs": 3, "max_logit_bias": 2, "max_role_length": 8, "max_schema_depth": 3, "max_stop_sequences": 2}


def parsed_serve(*args: str):
    return parse_args(["serve", "--model", "x", *args])


def test_every_declared_limit_is_a_flag_with_its_default_and_a_variable(monkeypatch):
    defaults = parsed_serve()
    for declaration in declarations():
        assert getattr(defaults, declaration.name) == declaration.default == getattr(EngineLimits(), declaration.name)
        value = "off" if declaration.is_switch else str(declaration.low + 1)
        assert getattr(parsed_serve(declaration.flag, value), declaration.name) == (False if declaration.is_switch else declaration.low + 1)
        monkeypatch.setenv(declaration.variable, value)
        assert getattr(parsed_serve(), declaration.name) == (False if declaration.is_switch else declaration.low + 1)
        monkeypatch.delenv(declaration.variable)


def test_the_readmes_serve_synopsis_names_every_declared_limit():
    synopsis = (REPO / "README.md").read_text().split("kvserve serve --model ARTIFACT", 1)[1].split("kvserve generate", 1)[0]
    assert [d.flag for d in declarations() if d.flag not in synopsis] == []


def test_a_flag_outside_its_declared_bounds_is_one_line_and_exit_2(capsys):
    for declaration in (d for d in declarations() if not d.is_switch):
        with pytest.raises(SystemExit) as exited:
            parsed_serve(declaration.flag, str(declaration.low - 1))
        assert exited.value.code == 2
        assert f"{declaration.flag}: {declaration.low - 1} is outside [{declaration.low}, {declaration.high}]" in capsys.readouterr().err


def test_get_model_info_reports_every_declared_limit_by_its_name():
    limits_fields = {field.name for field in pb.Limits.DESCRIPTOR.fields}
    assert {d.name for d in declarations()} <= limits_fields
    assert limits_fields - {d.name for d in declarations()} == {"max_total_tokens"}


def test_the_docs_table_is_the_declarations():
    docs = (REPO / "docs" / "serving.md").read_text()
    assert markdown_table() in docs, "docs/serving.md's limits table differs from service/core/limits.py: paste markdown_table()"


@pytest.fixture(scope="module")
def tight(tiny_chat_artifact):
    with serving(tiny_chat_artifact, http_port=0, **TIGHT) as server, stub_of(server) as stub:
        yield server, stub


def test_a_server_reports_the_limits_it_was_given(tight):
    _, stub = tight
    limits = stub.GetModelInfo(pb.GetModelInfoRequest()).limits
    for name, value in dataclasses.asdict(EngineLimits(**TIGHT)).items():
        assert getattr(limits, name) == value, name


GRPC_OVER = {  # each over its TIGHT limit by one, as gRPC sends it -> the field its refusal names
    "n": (dict(n=3), "n: must be in [1, 2], got 3"),
    "top_logprobs": (dict(return_logprobs=True, top_logprobs=4), "top_logprobs: must be in [0, 3], got 4"),
    "logit_bias": (dict(sampling=pb.SamplingParams(logit_bias={1: 1.0, 2: 1.0, 3: 1.0})), "sampling.logit_bias: 3 entries; at most 2"),
    "stop": (dict(stop_sequences=["a", "b", "c"]), "stop_sequences: 3 stop sequences; at most 2"),
    "schema": (dict(response_format=pb.ResponseFormat(json_schema='{"type": "array", "items": {"type": "array", "items": '
                                                                   '{"type": "array", "items": {}}}}')),
               "response_format.json_schema: nested 4 deep; at most 3"),
}
HTTP_OVER = {  # the same, as an OpenAI body says it -> the parameter its 400 names
    "n": ({"n": 3}, "n"),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 4}, "top_logprobs"),
    "logit_bias": ({"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias"),
    "stop": ({"stop": ["a", "b", "c"]}, "stop"),
    "schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "array", "items": {"type": "array", "items": {}}}}}}}, "response_format"),
}


@pytest.mark.parametrize("case", list(GRPC_OVER))
def test_grpc_and_http_refuse_the_same_request_over_a_limit(tight, case):
    server, stub = tight
    fields, message = GRPC_OVER[case]
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(pb.GenerateRequest(text="Hi", max_new_tokens=2, **fields), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in refused.value.details()
    body, param = HTTP_OVER[case]
    reply = httpx.post(f"http://127.0.0.1:{server.app.http_port}/v1/chat/completions", timeout=30,
                       json={"model": "tiny-chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_grpc_and_http_take_the_same_request_at_each_limit(tight):
    server, stub = tight
    events = list(stub.Generate(pb.GenerateRequest(text="Hi", max_new_tokens=2, n=2, return_logprobs=True, top_logprobs=3,
                                                   sampling=pb.SamplingParams(logit_bias={1: 1.0, 2: 1.0}), stop_sequences=["a", "b"]),
                                timeout=30))
    assert sum(event.HasField("finish") for event in events) == 2
    reply = httpx.post(f"http://127.0.0.1:{server.app.http_port}/v1/chat/completions", timeout=30, json={
        "model": "tiny-chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 2, "logprobs": True,
        "top_logprobs": 3, "logit_bias": {"1": 1, "2": 1}, "stop": ["a", "b"]})
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 2, reply.text


def test_a_role_longer_than_the_limit_is_refused_over_both(tight):
    server, stub = tight
    conversation = pb.Conversation(messages=[pb.ChatMessage(role="narrator", content="x"), pb.ChatMessage(role="moderator", content="y")])
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(pb.GenerateRequest(messages=conversation, max_new_tokens=2), timeout=30))
    assert "prompt.messages[1].role: must be 1 to 8 characters, got 9" in refused.value.details()
    reply = httpx.post(f"http://127.0.0.1:{server.app.http_port}/v1/chat/completions", timeout=30,
                       json={"model": "tiny-chat", "messages": [{"role": "moderator", "content": "y"}], "max_tokens": 2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages", reply.text
