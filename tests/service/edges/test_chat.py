"""Conversations over gRPC: rendered by the artifact's chat template into the same tokens a client could send
itself; refused, with the field and the reason, by a model without a template and past the limits."""

import json

import grpc
import pytest

from kvserve.contract.chat import ChatMessage, load_chat_template
from kvserve.v1 import generation_pb2 as pb

from ...conftest import DEFAULT_CHECKPOINT
from ..conftest import collect, serving, stub_of


@pytest.fixture(scope="module")
def chat_server(tiny_chat_artifact):
    with serving(tiny_chat_artifact, max_batch_size=2, max_chat_messages=4, max_text_bytes=64) as running, stub_of(running) as stub:
        yield stub


def conversation(*turns):
    return pb.Conversation(messages=[pb.ChatMessage(role=role, content=content) for role, content in turns])


def test_a_conversation_generates_what_its_rendered_tokens_generate(chat_server):
    turns = (("system", "Be brief."), ("user", "Who was Moses?"))
    rendered = load_chat_template(DEFAULT_CHECKPOINT).render([ChatMessage(*t) for t in turns])
    assert rendered.endswith("Assistant:")
    as_chat = collect(chat_server, pb.GenerateRequest(messages=conversation(*turns), max_new_tokens=6, ignore_eos=True))
    as_ids = collect(chat_server, pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(rendered.encode())), max_new_tokens=6, ignore_eos=True))
    assert as_chat[0] == as_ids[0]
    assert as_chat[2].prompt_tokens == len(rendered.encode())
    assert chat_server.GetModelInfo(pb.GetModelInfoRequest()).chat


@pytest.mark.parametrize("messages, message", [
    (conversation(), "prompt.messages: the conversation has no messages"),
    (conversation(*[("user", "x")] * 5), "prompt.messages: 5 messages; at most 4"),
    (conversation(("", "x")), "prompt.messages[0].role: must be 1 to 64 characters, got 0"),
    (conversation(("user", "x" * 40), ("user", "y" * 40)), "prompt.messages: 80 bytes of content; at most 64"),
])
def test_conversations_past_the_limits_are_refused_naming_the_field(chat_server, messages, message):
    with pytest.raises(grpc.RpcError) as error:
        collect(chat_server, pb.GenerateRequest(messages=messages, max_new_tokens=2))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details() == message


def test_a_model_without_a_template_refuses_a_conversation_saying_why(stub):
    with pytest.raises(grpc.RpcError) as error:
        collect(stub, pb.GenerateRequest(messages=conversation(("user", "hi")), max_new_tokens=2))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("prompt.messages: this model has no chat template")
    assert not stub.GetModelInfo(pb.GetModelInfoRequest()).chat


THINKING_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                     "{% if add_generation_prompt %}{{ 'assistant:' }}{% if enable_thinking is false %}{{ ' <think></think>' }}{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(tiny_artifact, tmp_path_factory):
    """The tiny artifact with a template that reads a variable of its own (as Qwen3's reads enable_thinking), on gRPC and HTTP."""
    import shutil

    directory = tmp_path_factory.mktemp("thinking") / "tiny-thinking"
    shutil.copytree(tiny_artifact, directory)
    (directory / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    with serving(directory, http_port=0, max_batch_size=2, max_chat_template_kwargs_bytes=64) as running, stub_of(running) as stub:
        yield running, stub


def test_chat_template_kwargs_reach_the_template_over_grpc_and_http(thinking_server):
    import openai

    running, stub = thinking_server
    turns = (("system", "Be brief."), ("user", "Who was Moses?"))
    for kwargs, suffix in (("", "assistant:"), ('{"enable_thinking": false}', "assistant: <think></think>"),
                           ('{"enable_thinking": true}', "assistant:")):
        rendered = "system: Be brief.\nuser: Who was Moses?\n" + suffix
        request = pb.GenerateRequest(messages=pb.Conversation(messages=conversation(*turns).messages, chat_template_kwargs=kwargs),
                                     max_new_tokens=4, ignore_eos=True)
        ids, _, finish = collect(stub, request)
        assert finish.prompt_tokens == len(rendered.encode())
        assert ids == collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(rendered.encode())), max_new_tokens=4, ignore_eos=True))[0]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{running.app.http_port}/v1", api_key="unused", max_retries=0)
        extra = {"chat_template_kwargs": json.loads(kwargs)} if kwargs else {}
        reply = client.chat.completions.create(model="tiny-thinking", messages=[{"role": r, "content": c} for r, c in turns], max_tokens=4,
                                               temperature=0, extra_body=extra)
        assert reply.usage.prompt_tokens == len(rendered.encode())
    assert stub.GetModelInfo(pb.GetModelInfoRequest()).limits.max_chat_template_kwargs_bytes == 64


@pytest.mark.parametrize("kwargs, message", [
    ("[1]", "chat_template_kwargs: must be a JSON object, got list"),
    ("{", "chat_template_kwargs: not valid JSON (JSONDecodeError)"),
    ('{"add_generation_prompt": false}', "chat_template_kwargs: 'add_generation_prompt' is set by the server, not by chat_template_kwargs"),
    ('{"enable_thinking": "' + "x" * 60 + '"}', "chat_template_kwargs: 83 bytes; at most 64"),
])
def test_bad_chat_template_kwargs_are_refused_naming_them_over_grpc_and_http(thinking_server, kwargs, message):
    import httpx2 as httpx  # openai 3 brings it

    running, stub = thinking_server
    request = pb.GenerateRequest(messages=pb.Conversation(messages=conversation(("user", "hi")).messages, chat_template_kwargs=kwargs),
                                 max_new_tokens=2)
    with pytest.raises(grpc.RpcError) as error:
        collect(stub, request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details() == message
    if kwargs.startswith("{") and kwargs.endswith("}"):  # an HTTP body carries an object or nothing
        body = {"model": "tiny-thinking", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": json.loads(kwargs)}
        answer = httpx.post(f"http://127.0.0.1:{running.app.http_port}/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "chat_template_kwargs"
    answer = httpx.post(f"http://127.0.0.1:{running.app.http_port}/v1/chat/completions", timeout=30,
                        json={"model": "tiny-thinking", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]})
    assert answer.status_code == 400 and answer.json()["error"]["message"] == "chat_template_kwargs must be an object"
