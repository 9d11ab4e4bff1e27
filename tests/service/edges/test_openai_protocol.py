"""The OpenAI protocol without a transport (service/edges/openai_protocol.py): bodies parsed into engine requests with every
refusal naming its parameter, limits read from EngineLimits, engine errors as OpenAI error objects, and the bodies
an answer is written in."""

import pytest

from kvserve.service.core.engine_errors import InvalidArgument, QueueFull, Unavailable
from kvserve.service.core.limits import EngineLimits
from kvserve.service.edges.openai_answers import usage, whole_body
from kvserve.service.edges.openai_errors import ApiError, api_error
from kvserve.service.edges.openai_protocol import parse
from kvserve.service.core.sequence import Finish, FinishReason, StepEvent
from kvserve.service.core.structured import FormatKind

LIMITS = EngineLimits(max_n=2, max_top_logprobs=3, max_logit_bias=2)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def test_a_chat_body_becomes_the_engine_request_it_describes():
    parsed = parse({**CHAT, "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 0, "stop": "\n", "logprobs": True,
                    "top_logprobs": 3, "n": 2, "stream": True, "stream_options": {"include_usage": True}, "logit_bias": {"7": -100},
                    "response_format": {"type": "json_object"}}, "chat", "m", LIMITS)
    request = parsed.request
    assert (parsed.n, parsed.stream, parsed.include_usage, parsed.logprobs) == (2, True, True, True)
    assert request.max_new_tokens == 5 and request.stop_sequences == ("\n",) and request.top_logprobs == 3 and request.return_logprobs
    assert request.sampling.temperature == 0.5 and request.sampling.seed == 1  # a given seed is never the engine's "choose one"
    assert request.sampling.logit_bias == ((7, -100.0),) and request.response_format.kind is FormatKind.JSON_OBJECT
    assert [(m.role, m.content) for m in request.prompt_messages] == [("user", "Hi")]
    assert request.streamed  # its tokens go to the loop as they come
    completion = parse({"model": "m", "prompt": [[1, 2, 3]]}, "completions", "m", LIMITS).request
    assert completion.prompt_ids == (1, 2, 3) and completion.max_new_tokens == 16  # OpenAI's default for completions
    assert not completion.streamed  # a body: taken whole


@pytest.mark.parametrize("body, kind, status, param", [
    ({**CHAT, "n": 3}, "chat", 400, "n"),  # over LIMITS.max_n
    ({**CHAT, "logprobs": True, "top_logprobs": 4}, "chat", 400, "top_logprobs"),
    ({"model": "m", "prompt": "x", "logprobs": 4}, "completions", 400, "logprobs"),  # the same limit for completions
    ({**CHAT, "logit_bias": {"1": 1, "2": 1, "3": 1}}, "chat", 400, "logit_bias"),
    ({**CHAT, "logit_bias": {"1": 101}}, "chat", 400, "logit_bias"),
    ({**CHAT, "temperature": 2.5}, "chat", 400, "temperature"),
    ({**CHAT, "presence_penalty": -3}, "chat", 400, "presence_penalty"),
    ({**CHAT, "tools": "get_weather"}, "chat", 400, "tools"), ({**CHAT, "functions": [{"name": "f"}]}, "chat", 400, "functions"),
    ({**CHAT, "frobnicate": 1}, "chat", 400, "frobnicate"),
    ({**CHAT, "model": "other"}, "chat", 404, "model"),
    ({"model": "m", "messages": []}, "chat", 400, "messages"),
    ({"model": "m", "prompt": [1, "x"]}, "completions", 400, "prompt"),
    ({**CHAT, "response_format": {"type": "xml"}}, "chat", 400, "response_format"),
    ([1, 2], "chat", 400, None),
    ({**CHAT, "ignore_eos": 1}, "chat", 400, "ignore_eos"), ({**CHAT, "min_tokens": -1}, "chat", 400, "min_tokens"),
    ({**CHAT, "top_k": -2}, "chat", 400, "top_k"), ({**CHAT, "repetition_penalty": 0}, "chat", 400, "repetition_penalty"),
    ({**CHAT, "stop_token_ids": [1, -1]}, "chat", 400, "stop_token_ids"), ({**CHAT, "stop_token_ids": [True]}, "chat", 400, "stop_token_ids"),
    ({**CHAT, "skip_special_tokens": "no"}, "chat", 400, "skip_special_tokens"),
    ({"model": "m", "prompt": "x", "include_stop_str_in_output": 0}, "completions", 400, "include_stop_str_in_output"),
    ({**CHAT, "use_beam_search": True}, "chat", 400, "use_beam_search"),  # an extension kvserve does not take: named
])
def test_each_refusal_has_its_status_and_names_its_parameter(body, kind, status, param):
    with pytest.raises(ApiError) as refused:
        parse(body, kind, "m", LIMITS)
    assert refused.value.status == status and refused.value.param == param
    assert refused.value.body()["error"]["message"]


def test_vllms_sampling_extensions_reach_the_engine_request():
    """What vLLM's bench serve and genai-perf send: ignore_eos, min_tokens, top_k (-1: off), repetition_penalty,
    stop_token_ids, skip_special_tokens, include_stop_str_in_output."""
    request = parse({"model": "m", "prompt": "x", "max_tokens": 8, "ignore_eos": True, "min_tokens": 4, "top_k": 40, "repetition_penalty": 1.1,
                     "stop_token_ids": [7, 9], "skip_special_tokens": False, "include_stop_str_in_output": True}, "completions", "m", LIMITS).request
    assert (request.ignore_eos, request.min_new_tokens, request.stop_token_ids) == (True, 4, (7, 9))
    assert (request.sampling.top_k, request.sampling.repetition_penalty) == (40, 1.1)
    assert (request.skip_special_tokens, request.include_stop_sequence) == (False, True)
    default = parse({**CHAT, "top_k": -1}, "chat", "m", LIMITS).request
    assert (default.sampling.top_k, default.ignore_eos, default.min_new_tokens, default.skip_special_tokens, default.include_stop_sequence) == (
        0, False, 0, True, False)
    assert api_error(InvalidArgument("min_new_tokens", "must be in [0, 8]")).param == "min_tokens"


def test_engine_errors_become_openai_errors_naming_the_parameter_sent():
    too_long = api_error(InvalidArgument("max_new_tokens", "300 new tokens do not fit"))
    assert (too_long.status, too_long.param, too_long.body()["error"]["type"]) == (400, "max_tokens", "invalid_request_error")
    assert api_error(InvalidArgument("prompt.messages[2].role", "too long")).param == "messages"
    assert (api_error(QueueFull("full")).status, api_error(Unavailable("draining")).status) == (429, 503)


def test_a_whole_answer_reports_each_completion_and_the_usage_of_one_prompt():
    def events(text: str, generated: int, cached: int) -> list[StepEvent]:
        finish = Finish(FinishReason.LENGTH, prompt_tokens=4, generated_tokens=generated, time_to_first_token_ns=1, total_ns=2,
                        cached_prompt_tokens=cached, accepted_draft_tokens=cached // 2, rejected_draft_tokens=cached % 2)
        return [StepEvent(1, text[:1], None, None), StepEvent(2, text[1:], None, finish)]

    parsed = parse({**CHAT, "n": 2}, "chat", "m", LIMITS)
    body = whole_body("chatcmpl-x", "chat", "m", 7, [events("ab", 2, 3), events("cd", 2, 0)], parsed, lambda ids: ["?"] * len(ids))
    assert [c["message"]["content"] for c in body["choices"]] == ["ab", "cd"] and body["object"] == "chat.completion"
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"] == usage([e[-1].finish for e in (events("ab", 2, 3), events("cd", 2, 0))]) == {
        "prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": 1, "rejected_prediction_tokens": 1}}
