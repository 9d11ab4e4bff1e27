"""Tool calls (service/core/tool_calls.py): tools rendered by the model's chat template, calls generated under a grammar
(tool_choice required or a named function) or opened by the model (auto), read back whole and streamed as OpenAI's
deltas, over HTTP with the official client and over gRPC, in the hermes, Llama 3 JSON and Mistral formats; bad tools
and choices refused by name."""

import dataclasses
import json
import shutil

import grpc
import jsonschema
import numpy as np
import openai
import pytest

from kvserve.contract.chat import ChatMessage, ChatTemplate, ToolCall, load_chat_template
from kvserve.contract.tokenizer import ByteTokenizer, HFTokenizer
from kvserve.model.presets import preset
from kvserve.service.core.engine_errors import InvalidArgument
from kvserve.service.core.limits import EngineLimits
from kvserve.service.core.sampling import SamplingParams
from kvserve.service.core.sequence import FinishReason, GenerationRequest
from kvserve.service.core.structured import TokenMasks
from kvserve.service.core.tool_call_text import RULES, CallFormat, CallParser
from kvserve.service.core.tool_calls import ToolChoice, ToolRequest
from kvserve.service.core.validation import RequestValidator
from kvserve.v1 import generation_pb2 as pb

from ...conftest import TOOL_TEMPLATES
from ..conftest import collect, serving, stub_of

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "A city's forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "clock": CLOCK}
QUESTION = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}]
SPECIAL = {"hermes": {"eos_token": "<|im_end|>"}, "llama3_json": {"bos_token": "<s>", "eos_token": "</s>"},
           "mistral": {"bos_token": "<s>", "eos_token": "</s>"}}


def artifact_with_template(long_tiny_artifact, tmp_path_factory, style: str):
    """The long-context tiny model (one token a byte) with a chat template of style's call format."""
    directory = tmp_path_factory.mktemp("tools") / f"tiny-{style}"
    shutil.copytree(long_tiny_artifact, directory)
    (directory / "chat_template.jinja").write_text(TOOL_TEMPLATES[style])
    (directory / "tokenizer_config.json").write_text(json.dumps(SPECIAL[style]))
    return directory


@pytest.fixture(scope="module", params=sorted(TOOL_TEMPLATES))
def tool_server(request, long_tiny_artifact, tmp_path_factory):
    directory = artifact_with_template(long_tiny_artifact, tmp_path_factory, request.param)
    with serving(directory, http_port=0, max_batch_size=4) as running:
        yield request.param, running, directory


@pytest.fixture(scope="module")
def limited_server(long_tiny_artifact, tmp_path_factory):
    """The hermes-format model with low tool limits (the edge's checks are the same whatever the format)."""
    with serving(artifact_with_template(long_tiny_artifact, tmp_path_factory, "hermes"), http_port=0, max_batch_size=2, max_tools=3,
                 max_tools_bytes=2048) as running:
        yield running


def client_of(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{running.app.http_port}/v1", api_key="unused", max_retries=0, timeout=60)


def streamed_calls(chunks) -> tuple[str, list[dict], str]:
    """(content, calls, finish reason) put together from a stream's deltas, as an OpenAI client does."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"], ids=["named", "required"])
def test_held_calls_parse_and_validate_streamed_and_not(tool_server, choice):
    style, running, _ = tool_server
    client = client_of(running)
    # Sampled replies make one call (parallel calls off): with them on, a random model may call until max_tokens cuts it.
    for sampling in [dict(temperature=0), dict(temperature=1.0, seed=3, parallel_tool_calls=False),
                     dict(temperature=0.8, seed=11, parallel_tool_calls=False)]:
        whole = client.chat.completions.create(model=running.app.http.model_name, messages=QUESTION, tools=TOOLS, tool_choice=choice,
                                               max_tokens=300, **sampling)
        answer = whole.choices[0]
        assert answer.finish_reason in ("tool_calls", "length" if "seed" not in sampling else None), answer
        assert answer.message.tool_calls and not answer.message.content
        for call in answer.message.tool_calls:
            assert call.type == "function" and call.function.name in SCHEMAS
            if isinstance(choice, dict):
                assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            assert len(call.id) == (9 if style == "mistral" else 29)
        content, calls, reason = streamed_calls(client.chat.completions.create(
            model=running.app.http.model_name, messages=QUESTION, tools=TOOLS, tool_choice=choice, max_tokens=300, stream=True, **sampling))
        assert reason == answer.finish_reason and not content
        if reason == "length":  # the call it was writing streamed in part; the whole answer lists the calls made whole
            calls = [c for c in calls if parses(c["arguments"])]
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in answer.message.tool_calls]
        assert all(c["id"] for c in calls)


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_auto_and_none_stream_what_they_answer_whole(tool_server, choice):
    """The model's own choice (auto) and text only (none): the streamed content and calls add up to the whole answer's."""
    style, running, _ = tool_server
    client = client_of(running)
    request = dict(model=running.app.http.model_name, messages=QUESTION, tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**request).choices[0]
    content, calls, reason = streamed_calls(client.chat.completions.create(stream=True, **request))
    assert reason == whole.finish_reason and content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls if parses(c["arguments"])] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    if choice == "none":
        assert whole.message.tool_calls is None and reason in ("stop", "length")


def test_one_call_when_parallel_calls_are_off(tool_server):
    style, running, _ = tool_server
    for seed in range(3):
        answer = client_of(running).chat.completions.create(
            model=running.app.http.model_name, messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=300, temperature=1.0, seed=seed).choices[0]
        assert answer.finish_reason == "tool_calls" and len(answer.message.tool_calls) == 1


def test_a_tool_result_goes_back_into_the_conversation(tool_server):
    """The reply's calls and a tool turn answering one, sent back as an OpenAI client sends them, render through the
    template exactly as the template renders them itself."""
    style, running, directory = tool_server
    client = client_of(running)
    first = client.chat.completions.create(model=running.app.http.model_name, messages=QUESTION, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "clock"}}, max_tokens=200, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'}]
    second = client.chat.completions.create(model=running.app.http.model_name, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=5, temperature=0)
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason == "length"
    template = load_chat_template(directory)
    rendered = template.render([ChatMessage(m["role"], m["content"]) for m in QUESTION] + [
        ChatMessage("assistant", "", tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in first.choices[0].message.tool_calls)),
        ChatMessage("tool", '{"time": "12:00"}', tool_call_id=call.id)], tools=TOOLS)
    assert second.usage.prompt_tokens == len(rendered.encode()) and "12:00" in rendered


def test_grpc_conversations_carry_tools_and_return_the_calls(tool_server):
    style, running, _ = tool_server
    conversation = pb.Conversation(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in QUESTION], tools=json.dumps(TOOLS),
                                   tool_choice=pb.ToolChoice(function="clock"), parallel_tool_calls=False)
    with stub_of(running) as stub:
        responses = list(stub.Generate(pb.GenerateRequest(messages=conversation, max_new_tokens=200), timeout=60))
        finish = responses[-1].finish
        assert finish.reason == pb.FINISH_REASON_TOOL_CALLS and [c.name for c in finish.tool_calls] == ["clock"]
        jsonschema.validate(json.loads(finish.tool_calls[0].arguments), CLOCK)
        raw = "".join(r.token.tool_call_delta for r in responses)
        assert finish.tool_calls[0].arguments in raw and not "".join(r.token.text_delta for r in responses)
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(pb.GenerateRequest(messages=pb.Conversation(messages=conversation.messages, tool_choice=pb.ToolChoice(
                mode=pb.TOOL_CHOICE_MODE_REQUIRED)), max_new_tokens=2), timeout=60))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details() == "tool_choice: needs tools"


def parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def tool(name, parameters=None, **extra):
    function = {"name": name, **({"parameters": parameters} if parameters is not None else {})}
    return {"type": "function", "function": function, **extra}


BAD = [
    (dict(tools={"a": 1}), "tools", "tools must be a list"),
    (dict(tools=[]), "tools", "tools: must be a non-empty list"),
    (dict(tools=[{"type": "retrieval"}]), "tools", 'tools[0]: must be {"type": "function"'),
    (dict(tools=[tool("bad name")]), "tools", "tools[0].function.name: must be 1 to 64 letters"),
    (dict(tools=[tool("a"), tool("a")]), "tools", "tools[1].function.name: 'a' is named twice"),
    (dict(tools=[{"type": "function", "function": {"name": "a", "returns": {}}}]), "tools", "tools[0].function.returns: is not a field"),
    (dict(tools=[tool("a", [])]), "tools", "tools[0].function.parameters: must be a JSON schema of an object"),
    # A call's arguments are an object (OpenAI's rule): a schema of anything else is refused, whatever the choice.
    (dict(tools=[tool("a", {"type": "integer"})], tool_choice="required"), "tools", "tools[0].function.parameters: must be a JSON schema of an object"),
    (dict(tools=[tool("a", {"enum": [1, 2]})], tool_choice={"type": "function", "function": {"name": "a"}}), "tools",
     "tools[0].function.parameters: must be a JSON schema of an object"),
    (dict(tools=[tool("a", {"type": "array", "items": {"type": "string"}})]), "tools", "tools[0].function.parameters: must be a JSON schema of an object"),
    (dict(tools=[tool("a", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 2, "maximum": 1}}, "required": ["n"]})],
          tool_choice="required"), "tools", "tools:"),
    (dict(tools=[{"type": "function", "function": {"name": "a", "strict": "yes"}}]), "tools", "tools[0].function.strict: must be true or false"),
    (dict(tools=[tool("a", {"type": "object", "properties": {"x": {"$ref": "https://example.com/x.json"}}})]), "tools",
     "tools[0].function.parameters.properties.x.$ref: 'https://example.com/x.json' is not a local reference"),
    (dict(tools=[tool("a")] * 4), "tools", "tools: 4 tools; at most 3"),
    (dict(tools=[tool("a", {"description": "x" * 3000})]), "tools", "bytes of JSON; at most 2048"),
    (dict(tools=[tool("a")], tool_choice={"type": "function", "function": {"name": "b"}}), "tool_choice", "names the function 'b'"),
    (dict(tool_choice="required"), "tool_choice", "tool_choice needs tools"),
    (dict(tools=[tool("a")], tool_choice="sometimes"), "tool_choice", "tool_choice must be"),
    (dict(tools=[tool("a")], parallel_tool_calls="yes"), "parallel_tool_calls", "parallel_tool_calls must be true or false"),
    (dict(tools=[tool("a")], response_format={"type": "json_object"}), "tools", "cannot also follow response_format"),
    (dict(functions=[{"name": "a"}]), "functions", "functions is not supported"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "x", "type": "function",
                                                                         "function": {"name": "a", "arguments": "{nope"}}]}]),
     "messages", "messages[0].tool_calls[0].arguments: must be a JSON object"),
    (dict(messages=[{"role": "assistant", "tool_calls": "x"}]), "messages[0].tool_calls", "messages[0].tool_calls must be a list"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "x", "type": "function",
                                                                         "function": {"name": "a", "arguments": '{"x": ["\\ud800"]}'}}]}]),
     "messages", "messages[0].tool_calls[0].arguments.x[0]: is not valid Unicode (a lone surrogate)"),
    (dict(messages=[{"role": "tool", "content": "{}", "tool_call_id": "x" * 300_000}]), "messages", "bytes of content; at most"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": json.dumps({"x": "y" * 300_000})}}]}]), "messages",
     "bytes of content; at most"),
]


@pytest.mark.parametrize("body, param, message", BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_tools_and_choices_are_refused_by_name(limited_server, body, param, message):
    request = {"model": limited_server.app.http.model_name, "messages": QUESTION, "max_tokens": 2, **body}
    with pytest.raises(openai.BadRequestError) as error:
        client_of(limited_server).post("/chat/completions", body=request, cast_to=object)
    assert error.value.body["param"] == param and message in error.value.body["message"], error.value.body


def test_the_tool_limits_are_reported(limited_server):
    with stub_of(limited_server) as stub:
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.limits.max_tools, info.limits.max_tools_bytes, info.tool_call_format) == (3, 2048, "hermes")


def test_tools_need_a_template_that_renders_them(tiny_artifact):
    """A model without a template, or whose template reads no tools, refuses tools by name; completions take none."""
    with serving(tiny_artifact, http_port=0, max_batch_size=1) as running, stub_of(running) as stub:
        assert stub.GetModelInfo(pb.GetModelInfoRequest()).tool_call_format == ""
        client = client_of(running)
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=running.app.http.model_name, messages=QUESTION, tools=[tool("a")], max_tokens=2)
        assert error.value.body["param"] == "tools" and "does not render tools" in error.value.body["message"]
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=running.app.http.model_name, prompt="x", max_tokens=2, extra_body={"tools": [tool("a")]})
        assert error.value.body["param"] == "tools"


# The auto choice, step by step: a reply forced token by token (one-hot logits) through the real validator and sequence.
AUTO_REPLIES = {
    "hermes": ('Let me look. <tool_call>\n{"name": "clock", "arguments": {"zone": "UTC"}}\n</tool_call>', "Let me look. "),
    "llama3_json": ('  {"name": "clock", "parameters": {"zone": "UTC"}}', "  "),
    "mistral": ('[TOOL_CALLS][{"name": "clock", "arguments": {"zone": "UTC"}}]', ""),
}


def validator_for(style: str, tokenizer=None, config=None) -> RequestValidator:
    config = config or dataclasses.replace(preset("tiny"), n_ctx=2048)
    return RequestValidator(config, tokenizer or ByteTokenizer(), EngineLimits(), ChatTemplate(TOOL_TEMPLATES[style], SPECIAL[style]))


def force(seq, token: int, masks: TokenMasks):
    """One step that takes token (greedy over one-hot logits), under the sequence's mask when it has one; the mask's
    allowed ids come back too."""
    allowed = masks.start([seq]).result()[seq] if seq.constraint is not None else None
    logits = np.full(257, -10.0, dtype=np.float32)
    logits[token] = 10.0
    return seq.advance(logits, allowed=allowed), allowed


@pytest.mark.parametrize("style", sorted(AUTO_REPLIES))
def test_auto_leaves_text_free_until_a_call_opens_then_holds_the_rest(style):
    reply, content = AUTO_REPLIES[style]
    validator = validator_for(style)
    request = GenerationRequest(prompt_messages=(ChatMessage("user", "Time?"),), tools=ToolRequest(json.dumps(TOOLS)),
                                sampling=SamplingParams(temperature=0), max_new_tokens=200)
    seq = validator.make_sequence(request)
    masks = TokenMasks(257)
    events, opened_at = [], None
    try:
        for position, byte in enumerate(reply.encode()):
            event, allowed = force(seq, byte, masks)
            events.append(event)
            if seq.constraint is not None and opened_at is None:
                opened_at = position
            if allowed is not None and reply[position - 1:position + 1] == '"c':  # the name's first letter: a function's only
                assert sorted(chr(t) for t in allowed) == ["c", "g"]
        assert opened_at is not None and opened_at <= len(content) + len(RULES[CallFormat(style)].marker)
        event, allowed = force(seq, 256, masks)  # end of sequence: the grammar allows it once the calls are whole
        assert 256 in allowed
        events.append(event)
    finally:
        masks.close()
    finish = events[-1].finish
    assert finish.reason is FinishReason.TOOL_CALLS and [(c.name, json.loads(c.arguments)) for c in finish.tool_calls] == [("clock", {"zone": "UTC"})]
    assert "".join(e.text for e in events) == content
    assert "".join(e.call_text for e in events) == reply[len(content):]


def test_auto_text_without_a_call_is_all_content():
    validator = validator_for("hermes")
    seq = validator.make_sequence(GenerationRequest(prompt_messages=(ChatMessage("user", "Hi"),), tools=ToolRequest(json.dumps(TOOLS)),
                                                    sampling=SamplingParams(temperature=0), max_new_tokens=200))
    masks = TokenMasks(257)
    try:
        events = [force(seq, byte, masks)[0] for byte in "a < b <tool".encode()] + [force(seq, 256, masks)[0]]
    finally:
        masks.close()
    assert "".join(e.text for e in events) == "a < b <tool" and seq.constraint is None
    assert events[-1].finish.reason is FinishReason.END_OF_SEQUENCE and not events[-1].finish.tool_calls


ARGUMENTS = json.dumps({"x": '}"{', "y": [1, {"z": "\\"}]})  # braces, an escaped quote and an escaped backslash in strings
CALL_TEXTS = {
    "hermes": f'<tool_call>\n{{"name": "a\\"b", "arguments": {ARGUMENTS}}}\n</tool_call>\n<tool_call>\n{{"name": "c", "arguments": {{}}}}\n</tool_call>',
    "llama3_json": f'{{"name": "a\\"b", "parameters": {ARGUMENTS}}}; {{"name": "c", "parameters": {{}}}}',
    "mistral": f'[TOOL_CALLS][{{"name": "a\\"b", "arguments": {ARGUMENTS}}}, {{"name": "c", "arguments": {{}}}}]',
}


@pytest.mark.parametrize("style", sorted(CALL_TEXTS))
def test_calls_stream_as_they_read_whole(style):
    """Fed a character at a time or all at once, the parser reads the same calls, and the streamed argument pieces add up
    to each call's arguments (braces and quotes inside strings included)."""
    text = CALL_TEXTS[style]
    whole = CallParser(RULES[CallFormat(style)].ids)
    whole.push(text)
    streamed = CallParser(RULES[CallFormat(style)].ids)
    deltas = [d for ch in text for d in streamed.push(ch)]
    want = [("a\"b", ARGUMENTS), ("c", "{}")]
    assert [(c.name, c.arguments) for c in whole.complete_calls()] == want == [(c.name, c.arguments) for c in streamed.complete_calls()]
    for index, (name, arguments) in enumerate(want):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].name == name and mine[0].id and "".join(d.arguments for d in mine) == arguments


def gpt2_with_added(directory, added: list[str], special: bool) -> HFTokenizer:
    """GPT-2's BPE with tokens added whole, as Qwen's tokenizer adds <tool_call> (not special) and Mistral's [TOOL_CALLS]
    (special)."""
    from tokenizers import AddedToken, Tokenizer

    from kvserve.model.vocabulary import write_preset_tokenizer

    write_preset_tokenizer("gpt2", directory)
    base = Tokenizer.from_file(str(directory / "tokenizer.json"))
    base.add_tokens([AddedToken(text, special=special, normalized=False) for text in added])
    base.save(str(directory / "tokenizer.json"))
    return HFTokenizer(directory / "tokenizer.json")


def run_forced(validator, config, tokenizer, reply: str, request: ToolRequest):
    """The reply forced token by token (its own tokenization, then end of sequence) through a sequence with tools: each
    token must be one its mask allows once a constraint holds it. The events."""
    seq = validator.make_sequence(GenerationRequest(prompt_messages=(ChatMessage("user", "Time?"),), tools=request,
                                                    sampling=SamplingParams(temperature=0), max_new_tokens=80))
    masks, events = TokenMasks(config.vocab_size), []
    try:
        for token in tokenizer.encode(reply, add_special_tokens=False) + [config.eos_token_ids[0]]:
            allowed = masks.start([seq]).result()[seq] if seq.constraint is not None else None
            assert allowed is None or token in allowed, (token, tokenizer.decode([token]))
            logits = np.full(config.vocab_size, -10.0, dtype=np.float32)
            logits[token] = 10.0
            events.append(seq.advance(logits, allowed=allowed))
    finally:
        masks.close()
    return seq, events


@pytest.mark.parametrize("choice", [ToolChoice.AUTO, ToolChoice.REQUIRED])
def test_qwens_added_call_tokens_are_the_grammars_own(tmp_path, choice):
    """Qwen's <tool_call> and </tool_call> are added tokens that are not special (they decode to their text): llguidance
    reads every added token as special, so the grammar names them as tokens; a reply writing them as the tokenizer does
    passes its mask, opens its call (auto), and is read back."""
    tokenizer = gpt2_with_added(tmp_path, ["<tool_call>", "</tool_call>"], special=False)
    config = dataclasses.replace(preset("gpt2"), vocab_size=50259, eos_token_ids=(50256,))
    validator = validator_for("hermes", tokenizer, config)
    assert validator.tool_calling.marker_id == 50257 and "<[50257]>" in validator.tool_calling.grammar(
        [validator.tool_calling.read(ToolRequest(json.dumps(TOOLS)))[1][1]], True) and "<[50258]>" in validator.tool_calling.grammar(
        [validator.tool_calling.read(ToolRequest(json.dumps(TOOLS)))[1][1]], True)
    content = "Let me see. " if choice is ToolChoice.AUTO else ""
    call = '<tool_call>\n{"name": "clock", "arguments": {"zone": "CET"}}\n</tool_call>'
    seq, events = run_forced(validator, config, tokenizer, content + call, ToolRequest(json.dumps(TOOLS), choice))
    assert "".join(e.text for e in events) == content and "".join(e.call_text for e in events) == call
    finish = events[-1].finish
    assert finish.reason is FinishReason.TOOL_CALLS and [(c.name, c.arguments) for c in finish.tool_calls] == [("clock", '{"zone": "CET"}')]


def test_mistrals_special_marker_is_the_grammars_own(tmp_path):
    """Mistral's [TOOL_CALLS] is a special token, which decodes to no text: the grammar names it, a reply that opens with
    it is held to the calls from there, and its calls are read from the text after it."""
    tokenizer = gpt2_with_added(tmp_path, ["[TOOL_CALLS]"], special=True)
    config = dataclasses.replace(preset("gpt2"), vocab_size=50258, eos_token_ids=(50256,))
    validator = validator_for("mistral", tokenizer, config)
    assert validator.tool_calling.marker_id == 50257
    seq, events = run_forced(validator, config, tokenizer, '[TOOL_CALLS][{"name": "clock", "arguments": {"zone": "UTC"}}]',
                             ToolRequest(json.dumps(TOOLS)))
    assert seq.constraint is not None and events[0].text == "" and "".join(e.call_text for e in events) == (
        '[{"name": "clock", "arguments": {"zone": "UTC"}}]')
    assert [(c.name, c.arguments) for c in events[-1].finish.tool_calls] == [("clock", '{"zone": "UTC"}')]


def test_tool_choice_none_renders_the_tools_and_holds_nothing():
    validator = validator_for("hermes")
    seq = validator.make_sequence(GenerationRequest(prompt_messages=(ChatMessage("user", "Hi"),),
                                                    tools=ToolRequest(json.dumps(TOOLS), ToolChoice.NONE)))
    assert seq.constraint is None and seq.tool_calls is None and b"get_weather" in bytes(seq.prompt_ids)


def test_auto_opens_a_call_mid_stream_through_the_server(tool_server, monkeypatch):
    """A reply that writes content and then a call, scripted into the real server (sampling picks the script's next
    token; each must be one the sequence's mask allows once it has one): the scheduler moves the sequence from free to
    masked steps mid-stream, and both edges get content, then the call."""
    import kvserve.service.core.sequence as sequence_module

    style, running, _ = tool_server
    script, content = AUTO_REPLIES[style]
    reply = script.encode()  # its bytes, then the end of sequence
    real_choose = sequence_module.choose

    def scripted(logits, params, rng, seen, generated, allowed=None):
        if params.seed != 4242:  # other requests sample as they would
            return real_choose(logits, params, rng, seen, generated, allowed)
        token = reply[len(generated)] if len(generated) < len(reply) else 256
        assert allowed is None or token in allowed, (bytes([token]) if token < 256 else token, len(generated))
        return token

    monkeypatch.setattr(sequence_module, "choose", scripted)
    client = client_of(running)
    request = dict(model=running.app.http.model_name, messages=QUESTION, tools=TOOLS, max_tokens=200, temperature=1.0, seed=4241)
    whole = client.chat.completions.create(**request).choices[0]  # OpenAI's seed s is the engine's s + 1 (openai_protocol.parse)
    assert whole.finish_reason == "tool_calls" and (whole.message.content or "") == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [("clock", {"zone": "UTC"})]
    streamed_content, calls, reason = streamed_calls(client.chat.completions.create(stream=True, **request))
    assert (streamed_content, reason) == (content, "tool_calls") and [c["name"] for c in calls] == ["clock"]
    assert calls[0]["arguments"] == whole.message.tool_calls[0].function.arguments


# Surrogates spelled as JSON escapes inside JSON text (a tool's schema or description, a call's arguments, the template's
# variables): valid UTF-8 on the wire, lone surrogates once parsed. Refused by name through the validator both edges use.
SURROGATE_TOOLS = json.dumps([{"type": "function", "function": {"name": "clock", "description": "\udc00", "parameters": CLOCK}}])


@pytest.mark.parametrize("choice", [ToolChoice.NONE, ToolChoice.AUTO])
def test_a_lone_surrogate_in_the_tools_is_refused_by_its_path(choice):
    validator = validator_for("hermes")
    assert "\\udc00" in SURROGATE_TOOLS  # an escape: the text itself is ASCII
    with pytest.raises(InvalidArgument) as error:
        validator.make_sequence(GenerationRequest(prompt_messages=(ChatMessage("user", "Hi"),), tools=ToolRequest(SURROGATE_TOOLS, choice)))
    assert (error.value.field, error.value.message) == ("tools[0].function.description", "is not valid Unicode (a lone surrogate)")


def test_grpc_refuses_surrogates_in_tools_and_arguments_as_invalid_argument(tool_server):
    _, running, _ = tool_server
    call = pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c", name="clock", arguments='{"zone": "\\ud800"}')])
    cases = [(pb.Conversation(messages=[pb.ChatMessage(role="user", content="Hi")], tools=SURROGATE_TOOLS,
                              tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE)),
              "tools[0].function.description: is not valid Unicode (a lone surrogate)"),
             (pb.Conversation(messages=[pb.ChatMessage(role="user", content="Hi"), call], tools=json.dumps(TOOLS)),
              "prompt.messages[1].tool_calls[0].arguments.zone: is not valid Unicode (a lone surrogate)")]
    with stub_of(running) as stub:
        for conversation, details in cases:
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(pb.GenerateRequest(messages=conversation, max_new_tokens=2), timeout=60))
            assert (error.value.code(), error.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, details)


# The client's own references: "#/$defs/..." and "#/properties/..." point into its parameters, not the server's wrapper.
DIGITS = {"type": "object", "$defs": {"Digit": {"type": "integer", "minimum": 0, "maximum": 9}},
          "properties": {"first": {"$ref": "#/$defs/Digit"}, "copy": {"$ref": "#/properties/first"},
                         "enum": {"type": "array", "items": {"$ref": "#/$defs/Digit"}, "maxItems": 2}},
          "required": ["first", "copy", "enum"], "additionalProperties": False}


@pytest.mark.parametrize("style", sorted(TOOL_TEMPLATES))
def test_local_references_resolve_in_the_clients_own_parameters(style):
    validator = validator_for(style)
    tools = json.dumps([{"type": "function", "function": {"name": "digits", "parameters": DIGITS}}, TOOLS[1]])
    seq = validator.make_sequence(GenerationRequest(prompt_messages=(ChatMessage("user", "Hi"),), tools=ToolRequest(tools, ToolChoice.REQUIRED),
                                                    sampling=SamplingParams(temperature=0), max_new_tokens=200))
    masks, event, rng = TokenMasks(257), None, np.random.default_rng(5)
    try:
        while event is None or event.finish is None:
            allowed = masks.start([seq]).result()[seq]
            logits = np.full(257, -10.0, dtype=np.float32)
            logits[rng.choice(allowed)] = 10.0  # any token the grammar allows
            event = seq.advance(logits, allowed=allowed)
    finally:
        masks.close()
    calls = event.finish.tool_calls
    assert event.finish.reason is FinishReason.TOOL_CALLS and calls, event
    for call in calls:
        arguments = json.loads(call.arguments)
        jsonschema.validate(arguments, DIGITS if call.name == "digits" else CLOCK)


def test_template_variables_may_bear_the_renderers_own_names_and_no_lone_surrogate():
    validator = validator_for("hermes")
    seq = validator.make_sequence(GenerationRequest(prompt_messages=(ChatMessage("user", "Hi"),), chat_template_kwargs=json.dumps({"self": 1})))
    assert seq.prompt_ids
    with pytest.raises(InvalidArgument) as error:  # gRPC's chat_template_kwargs is JSON text: an escape spells the surrogate
        validator.make_sequence(GenerationRequest(prompt_messages=(ChatMessage("user", "Hi"),), chat_template_kwargs='{"note": ["\\udc00"]}'))
    assert (error.value.field, error.value.message) == ("chat_template_kwargs.note[0]", "is not valid Unicode (a lone surrogate)")
