"""Conversations over gRPC: rendered by the artifact's chat template into the same tokens a client could send
itself; refused, with the field and the reason, by a model without a template and past the limits."""

import grpc
import pytest

from kvserve.contract.chat import ChatMessage, load_chat_template
from kvserve.v1 import generation_pb2 as pb

from ..conftest import DEFAULT_CHECKPOINT
from .conftest import collect, serving, stub_of


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
