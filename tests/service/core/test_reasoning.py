"""A reasoning model's thinking told apart from its answer (service/core/reasoning.py): the split of a reply's text as it
streams, and through a served model whose template opens the thinking in the prompt (DeepSeek-R1's way): the thinking
in reasoning_content and its own stream deltas (HTTP) or reasoning_delta (gRPC), counted in usage, bounded by a
thinking budget that makes the reply close it, a structure held to the answer alone, and nothing split for a model or
a conversation that does not think."""

import json

import grpc
import httpx2 as httpx  # openai 3 brings it (the httpx API under another name)
import openai
import pytest

from kvserve.service.core.reasoning import ThinkingMarkers, ThinkingSplit, opens_thinking, thinking_markers
from kvserve.v1 import generation_pb2 as pb

from ..conftest import collect, serving, stub_of

MARKERS = ThinkingMarkers("<think>", "</think>")


def run(split: ThinkingSplit, deltas: list[str]) -> tuple[str, str]:
    thinking, answer = "", ""
    for number, delta in enumerate(deltas):
        t, a = split.split(delta, finishing=number == len(deltas) - 1)
        thinking, answer = thinking + t, answer + a
    return thinking, answer


@pytest.mark.parametrize("thinking, deltas, want", [
    (False, ["<th", "ink>\nLet me ", "see.</th", "ink>\n\n", "Moses."], ("\nLet me see.", "Moses.")),  # Qwen3: the reply opens it
    (True, ["Hmm, ", "x < y", "</think>", "\n\nYes"], ("Hmm, x < y", "Yes")),  # the prompt opened it
    (False, ["  The answer", " is 4."], ("", "  The answer is 4.")),  # no thinking: all answer
    (True, ["still thinking <", "/thi"], ("still thinking </thi", "")),  # cut off mid-thought: what was held is thinking
    (False, ["\n", "<think>", "a</think>b"], ("a", "b")),
])
def test_a_reply_is_split_at_its_markers_whatever_the_deltas(thinking, deltas, want):
    assert run(ThinkingSplit(MARKERS, thinking), deltas) == want


def test_a_reply_held_to_a_structure_from_its_first_token_opens_no_thinking():
    assert run(ThinkingSplit(MARKERS, False, may_open=False), ["<think>{", "}"]) == ("", "<think>{}")


def test_markers_come_from_the_template_and_the_prompt_says_where_the_reply_starts():
    assert thinking_markers("{{ '<think>' }}...{{ '</think>' }}") == MARKERS and thinking_markers("no thinking here") is None
    assert thinking_markers(None) is None
    assert opens_thinking("user: hi\nassistant: <think>\n", MARKERS)
    assert not opens_thinking("user: hi\nassistant: <think>\n</think>\n\n", MARKERS) and not opens_thinking("user: hi", MARKERS)


# DeepSeek-R1's way: the template opens the thinking; told enable_thinking false (Qwen3's variable), it closes it too.
TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant: <think>\\n' }}{% if enable_thinking is false %}{{ '</think>\\n\\n' }}"
            "{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "Who was Moses?"}]


@pytest.fixture(scope="module")
def thinker(tiny_artifact, tmp_path_factory):
    import shutil

    directory = tmp_path_factory.mktemp("reasoning") / "tiny-thinker"
    shutil.copytree(tiny_artifact, directory)
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    with serving(directory, http_port=0, max_batch_size=2, thinking_token_budget=40) as running, stub_of(running) as stub:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{running.app.http_port}/v1", api_key="unused", max_retries=0, timeout=60)
        yield running, client, stub


def test_a_budget_closes_the_thinking_and_the_reply_answers_after_it(thinker):
    _, client, _ = thinker
    reply = client.chat.completions.create(model="tiny-thinker", messages=MESSAGES, max_tokens=30, temperature=0,
                                           extra_body={"thinking_token_budget": 6, "ignore_eos": True})
    message = reply.choices[0].message.model_dump()
    # The tiny model (a token a byte) never writes the marker itself: after 6 tokens of thinking it is made to write
    # "</think>" (8 more tokens, thinking too), then answers with the rest.
    assert reply.usage.completion_tokens_details.reasoning_tokens == 6 + len("</think>")
    assert message["reasoning_content"] == message["reasoning"] and "</think>" not in message["reasoning_content"]
    assert len(message["reasoning_content"]) <= 6 and "<think>" not in (message["content"] or "")  # a token a byte: at most a character each
    assert reply.usage.completion_tokens == 30


def test_thinking_streams_as_its_own_deltas_and_grpc_splits_alike(thinker):
    _, client, stub = thinker
    chunks = list(client.chat.completions.create(model="tiny-thinker", messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}, extra_body={"thinking_token_budget": 10}))
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    thinking = "".join(d.get("reasoning_content") or "" for d in deltas)
    answer = "".join(d.get("content") or "" for d in deltas)
    whole = client.chat.completions.create(model="tiny-thinker", messages=MESSAGES, max_tokens=24, temperature=0,
                                           extra_body={"thinking_token_budget": 10}).choices[0].message.model_dump()
    assert (thinking, answer) == (whole["reasoning_content"], whole["content"])
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 10 + len("</think>")
    request = pb.GenerateRequest(messages=pb.Conversation(messages=[pb.ChatMessage(**m) for m in MESSAGES]), max_new_tokens=24,
                                 thinking_token_budget=10)
    responses = list(stub.Generate(request))
    assert "".join(r.token.reasoning_delta for r in responses) == thinking
    assert "".join(r.token.text_delta for r in responses) == answer
    assert responses[-1].finish.reasoning_tokens == 10 + len("</think>")


def test_the_server_default_budget_holds_when_the_request_sets_none(thinker):
    _, client, stub = thinker
    reply = client.chat.completions.create(model="tiny-thinker", messages=MESSAGES, max_tokens=60, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens_details.reasoning_tokens == 40 + len("</think>")  # serve --thinking-token-budget 40
    assert stub.GetModelInfo(pb.GetModelInfoRequest()).limits.thinking_token_budget == 40


def test_a_conversation_told_not_to_think_is_all_answer(thinker):
    _, client, _ = thinker
    reply = client.chat.completions.create(model="tiny-thinker", messages=MESSAGES, max_tokens=8, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message.model_dump()
    assert message.get("reasoning_content") is None and reply.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_structure_holds_the_answer_not_the_thinking(thinker):
    _, client, _ = thinker
    reply = client.chat.completions.create(model="tiny-thinker", messages=MESSAGES, max_tokens=60, temperature=0,
                                           response_format={"type": "json_object"}, extra_body={"thinking_token_budget": 5})
    message = reply.choices[0].message.model_dump()
    assert message["reasoning_content"] is not None and reply.usage.completion_tokens_details.reasoning_tokens == 5 + len("</think>")
    if reply.choices[0].finish_reason == "stop":  # the structure closed: the answer is JSON
        json.loads(message["content"])
    else:
        assert message["content"].lstrip().startswith("{")


def test_a_bad_budget_is_refused_naming_it(thinker):
    running, _, stub = thinker
    answer = httpx.post(f"http://127.0.0.1:{running.app.http_port}/v1/chat/completions", timeout=30,
                        json={"model": "tiny-thinker", "messages": MESSAGES, "thinking_token_budget": 0})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "thinking_token_budget"
    with pytest.raises(grpc.RpcError) as error:
        collect(stub, pb.GenerateRequest(messages=pb.Conversation(messages=[pb.ChatMessage(**m) for m in MESSAGES]), max_new_tokens=2,
                                         thinking_token_budget=10**6))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details().startswith("thinking_token_budget: must be in [1, ")


EFFORT_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ 'effort=' + (reasoning_effort | default('unset')) + ' assistant:' }}{% endif %}")


def test_reasoning_effort_reaches_a_template_that_reads_it_over_chat_and_responses(tiny_artifact, tmp_path):
    import shutil

    directory = tmp_path / "tiny-effort"
    shutil.copytree(tiny_artifact, directory)
    (directory / "chat_template.jinja").write_text(EFFORT_TEMPLATE)
    with serving(directory, http_port=0, max_batch_size=1) as running:
        base = f"http://127.0.0.1:{running.app.http_port}/v1"
        for effort, expected in ((None, "unset"), ("low", "low"), ("high", "high")):
            body = {"model": "tiny-effort", "messages": MESSAGES, "max_tokens": 1} | ({"reasoning_effort": effort} if effort else {})
            rendered = httpx.post(f"{base}/chat/completions/render", json=body, timeout=30).json()["prompt"]
            assert rendered.endswith(f"effort={expected} assistant:")
        # chat_template_kwargs' own value wins; a value OpenAI does not define is refused naming it
        body = {"model": "tiny-effort", "messages": MESSAGES, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}
        assert httpx.post(f"{base}/chat/completions/render", json=body, timeout=30).json()["prompt"].endswith("effort=high assistant:")
        refused = httpx.post(f"{base}/chat/completions", json={"model": "tiny-effort", "messages": MESSAGES, "reasoning_effort": "max"}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
        response = client.responses.create(model="tiny-effort", input="Who was Moses?", reasoning={"effort": "medium"}, max_output_tokens=1)
        assert response.usage.input_tokens == len("user: Who was Moses?\neffort=medium assistant:".encode())
        refused = httpx.post(f"{base}/responses", json={"model": "tiny-effort", "input": "x", "reasoning": {"effort": "max"}}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning.effort"
