"""OpenAI's Responses API (/v1/responses) through the official `openai` client: create whole and streamed (the SDK's
own stream helper reading the typed events), the same tokens as chat completions, instructions and items, function
tools and their outputs, previous_response_id over the bounded store (store false keeps nothing; the least recently
used goes first), retrieve and delete, structured text, a reasoning model's thinking as a reasoning item, and refusals
naming the Responses parameter."""

import json

import httpx2 as httpx  # openai 3 brings it (the httpx API under another name)
import openai
import pytest

from kvserve.contract.chat import ChatMessage, load_chat_template

from ..conftest import serving

MODEL = "tiny-chat"
TOOLS = [{"type": "function", "name": "look", "description": "Look a book up", "parameters": {
    "type": "object", "properties": {"b": {"type": "string", "maxLength": 8}}, "required": ["b"], "additionalProperties": False}}]


@pytest.fixture(scope="module")
def running(tiny_chat_artifact):
    with serving(tiny_chat_artifact, http_port=0, max_batch_size=2, max_stored_responses=3) as server:
        yield server


@pytest.fixture(scope="module")
def client(running):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{running.app.http_port}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_response_is_the_chat_completions_answer_as_output_items(client):
    response = client.responses.create(model=MODEL, instructions="Be brief.", input="Who was Moses?", max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": "Who was Moses?"}], max_tokens=12, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.output_text == chat.choices[0].message.content
    assert [item.type for item in response.output] == ["message"] and response.output[0].role == "assistant"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.instructions == "Be brief."


def test_the_sdks_stream_helper_reads_the_events_into_the_same_response(client):
    whole = client.responses.create(model=MODEL, input=[{"role": "user", "content": "In the beginning"}], max_output_tokens=10, temperature=0,
                                    store=False)
    with client.responses.stream(model=MODEL, input=[{"role": "user", "content": "In the beginning"}], max_output_tokens=10,
                                 temperature=0, store=False) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    final = events[-1].response  # response.completed, or response.incomplete at max_output_tokens (the SDK's
    # get_final_response waits for a completed one, as it does with OpenAI's)
    assert final.output_text == whole.output_text and final.status == whole.status
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds and kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 1


def test_previous_response_id_carries_the_conversation_and_store_false_keeps_none(client, running, tiny_chat_artifact):
    first = client.responses.create(model=MODEL, input="Who was Moses?", max_output_tokens=6, temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="And Aaron?", max_output_tokens=6, temperature=0)
    template = load_chat_template(tiny_chat_artifact)
    rendered = template.render([ChatMessage("user", "Who was Moses?"), ChatMessage("assistant", first.output_text), ChatMessage("user", "And Aaron?")])
    assert second.usage.input_tokens == len(rendered.encode())  # a token a byte: the whole conversation, rendered
    assert client.responses.retrieve(first.id).output_text == first.output_text
    (item,) = client.responses.input_items.list(second.id).data  # its own input, not the carried conversation
    assert item.type == "message" and item.role == "user" and item.content[0].text == "And Aaron?"
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    deleted = httpx.delete(f"http://127.0.0.1:{running.app.http_port}/v1/responses/{first.id}", timeout=30).json()
    assert deleted == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, previous_response_id=first.id, input="x", max_output_tokens=2)
    assert missing.value.body["param"] == "previous_response_id"


def test_the_store_keeps_the_last_few_least_recently_used_dropped_first(client):
    ids = [client.responses.create(model=MODEL, input=f"turn {i}", max_output_tokens=1).id for i in range(4)]  # --max-stored-responses 3
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


@pytest.fixture(scope="module")
def long_client(long_tiny_artifact, tmp_path_factory):
    """The long-context tiny model with the default model's chat template: room for tools and their calls."""
    import shutil

    from ...conftest import DEFAULT_CHECKPOINT

    directory = tmp_path_factory.mktemp("responses") / "tiny-long-chat"
    shutil.copytree(long_tiny_artifact, directory)
    shutil.copy2(DEFAULT_CHECKPOINT / "chat_template.jinja", directory / "chat_template.jinja")
    with serving(directory, http_port=0, max_batch_size=2) as server:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.app.http_port}/v1", api_key="unused", max_retries=0, timeout=60)


def test_function_tools_and_their_outputs_round_trip(long_client):
    client, MODEL = long_client, "tiny-long-chat"
    forced = client.responses.create(model=MODEL, input="Gen?", tools=TOOLS, tool_choice={"type": "function", "name": "look"},
                                     max_output_tokens=120, temperature=0)
    calls = [item for item in forced.output if item.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "look" and set(json.loads(calls[0].arguments)) == {"b"}
    items = [{"role": "user", "content": "Gen?"}, {"type": "function_call", "call_id": "call_1", "name": "look", "arguments": '{"b": "Gen"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "ok"}]
    follow = client.responses.create(model=MODEL, input=items, max_output_tokens=4, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "Gen?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "look", "arguments": '{"b": "Gen"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}])
    assert follow.output_text == chat.choices[0].message.content and follow.usage.input_tokens == chat.usage.prompt_tokens
    with client.responses.stream(model=MODEL, input="Find Genesis.", tools=TOOLS, tool_choice="required", max_output_tokens=120,
                                 temperature=0, store=False) as stream:
        events = list(stream)
    kinds, final = [event.type for event in events], events[-1].response
    assert "response.function_call_arguments.done" in kinds
    assert [i.type for i in final.output if i.type == "function_call"] and final.output[-1].arguments


def test_a_streams_tokens_ready_together_are_one_delta(client):
    """A format that leaves the model no choice: its drafts are taken in a step or two, and their text is one delta each;
    the deltas make the whole response's text."""
    forced = {"format": {"type": "json_schema", "name": "forced", "schema": {"const": "kvserve sends what it has"}}}
    whole = client.responses.create(model=MODEL, input="Say it.", text=forced, max_output_tokens=64, temperature=0, store=False)
    with client.responses.stream(model=MODEL, input="Say it.", text=forced, max_output_tokens=64, temperature=0, store=False) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text == '"kvserve sends what it has"'
    assert len(deltas) < whole.usage.output_tokens


def test_text_format_holds_the_output_to_json(client):
    response = client.responses.create(model=MODEL, input="Answer in JSON.", text={"format": {"type": "json_object"}},
                                       max_output_tokens=200, temperature=0)
    if response.status == "completed":
        json.loads(response.output_text)
    else:
        assert response.output_text.lstrip().startswith("{")


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL, "input": "x", "background": True}, 400, "background"),
    ({"model": MODEL, "input": "x", "frequency": 1}, 400, "frequency"),
    ({"model": MODEL, "input": []}, 400, "input"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"model": MODEL, "input": [{"type": "image", "url": "x"}]}, 400, "input[0]"),
    ({"model": MODEL, "input": [{"role": ["user"], "content": "x"}]}, 400, "input[0]"),  # a role that is no string (was a 500)
    ({"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"model": "another", "input": "x"}, 404, "model"),
    ({"model": MODEL, "input": "x" * 300}, 400, "input"),  # past the tiny model's 256-token context: the engine's refusal, renamed
])
def test_refusals_name_the_responses_parameter(running, body, status, param):
    answer = httpx.post(f"http://127.0.0.1:{running.app.http_port}/v1/responses", json=body, timeout=30)
    assert answer.status_code == status and answer.json()["error"]["param"] == param


THINKING = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant: <think>\\n' }}{% endif %}{# </think> #}")


def test_a_reasoning_models_thinking_is_a_reasoning_item(tiny_artifact, tmp_path):
    import shutil

    directory = tmp_path / "tiny-thinker"
    shutil.copytree(tiny_artifact, directory)
    (directory / "chat_template.jinja").write_text(THINKING)
    with serving(directory, http_port=0, max_batch_size=1, thinking_token_budget=4) as running:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{running.app.http_port}/v1", api_key="unused", max_retries=0, timeout=60)
        response = client.responses.create(model="tiny-thinker", input="Who was Moses?", max_output_tokens=20, temperature=0)
        with client.responses.stream(model="tiny-thinker", input="Who was Moses?", max_output_tokens=20, temperature=0) as stream:
            events = list(stream)
        kinds, streamed = [event.type for event in events], events[-1].response
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.usage.output_tokens_details.reasoning_tokens == 4 + len("</think>")
    assert "response.reasoning_text.delta" in kinds and streamed.output[0].content[0].text == response.output[0].content[0].text


def test_five_chained_turns_with_tools_carry_the_whole_conversation(long_client):
    client, model = long_client, "tiny-long-chat"
    turns, previous = [], None
    for number in range(5):
        if number % 2 == 0:  # the user asks, and the reply must call the tool
            response = client.responses.create(model=model, input=f"Turn {number}: find a book.", tools=TOOLS, tool_choice="required",
                                               previous_response_id=previous, max_output_tokens=120, temperature=0)
        else:  # the tool's output answers the call of the turn before
            call = next(item for item in turns[-1].output if item.type == "function_call")
            response = client.responses.create(model=model, previous_response_id=previous, max_output_tokens=8, temperature=0, tools=TOOLS,
                                               tool_choice="none",  # tools are sent each turn (they do not carry over, as OpenAI's)
                                               input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Genesis"}])
        turns.append(response)
        previous = response.id
    assert all(any(item.type == "function_call" for item in turns[i].output) for i in (0, 2, 4))
    sizes = [turn.usage.input_tokens for turn in turns]
    assert sizes == sorted(sizes) and len(set(sizes)) == 5  # each turn reads every turn before it
    assert [client.responses.retrieve(turn.id).id for turn in turns] == [turn.id for turn in turns]
