"""The OpenAI protocol's requests, apart from its transport (http_api.py): request bodies parsed into engine requests
(every refusal an ApiError naming the parameter) and engine errors as OpenAI error objects; the answers' bodies are
openai_answers.py's.

Errors are OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`): 400 for a bad or unsupported parameter
(named), a body nested too deep or holding invalid Unicode; 401; 404 for another model or path; 405; 413 for a body
over --max-message-bytes; 415 for a body not sent as application/json; 429 when the queue is full; 503 while loading
or draining.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvserve.contract.chat import ChatMessage, ToolCall

from .engine_errors import EngineError, InvalidArgument, QueueFull, Unavailable
from .limits import MAX_BIAS, MAX_PENALTY, MAX_SCALE, MIN_SCALE, EngineLimits
from .sampling import MAX_SEED, SamplingParams
from .sequence import GenerationRequest
from .structured import FormatKind, ResponseFormat
from .text import encodable
from .tool_calls import ToolChoice, ToolRequest
from .validation import check_sizes

OPENAI_MAX_TEMPERATURE = 2.0  # OpenAI's own bound (gRPC takes up to limits.MAX_SCALE)

# The status each refusal gets, and the gRPC code name the request metric counts it under (one label set for both APIs).
STATUS_CODES = {200: "OK", 400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 405: "UNIMPLEMENTED",
                413: "RESOURCE_EXHAUSTED", 415: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error", 405: "invalid_request_error",
               413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "server_error"}
# Parameters the API defines that kvserve does not implement yet: refused by name with 400 when set to anything but
# their no-op value, never silently ignored.
# (functions and function_call: the API's older spelling of tools and tool_choice.)
NOT_YET = {"best_of": 1, "echo": False, "suffix": None, "functions": None, "function_call": None}
# vLLM's sampling extensions, as vLLM names them (benchmark tools send them): docs/serving.md, "vLLM's extensions".
VLLM = {"ignore_eos", "min_tokens", "top_k", "repetition_penalty", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output"}
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "logprobs", "user",
          "presence_penalty", "frequency_penalty", "logit_bias", "min_p", "response_format"} | VLLM
CHAT = {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls",
        "thinking_token_budget", "reasoning_effort"}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's, handed to the chat template as reasoning_effort
ALLOWED = {"completions": COMMON | {"prompt"} | set(NOT_YET), "chat": COMMON | CHAT | set(NOT_YET)}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES[self.status], "param": self.param, "code": self.code}}

    def __reduce__(self):  # raised in the body worker's process, re-raised in the server's
        return ApiError, (self.status, self.message, self.param, self.code)


# The engine names gRPC's fields; an HTTP client is told the OpenAI parameter it sent.
PARAMS = {"max_new_tokens": "max_tokens", "prompt.text": "prompt", "prompt.token_ids": "prompt", "prompt.messages": "messages",
          "stop_sequences": "stop", "sampling.temperature": "temperature", "sampling.top_p": "top_p",
          "response_format.json_schema": "response_format", "response_format.json_object": "response_format",
          "min_new_tokens": "min_tokens", "sampling.top_k": "top_k", "sampling.repetition_penalty": "repetition_penalty"}


def api_error(exc: EngineError) -> ApiError:
    """The OpenAI error an engine error is answered with, naming the OpenAI parameter the engine's field came from."""
    if isinstance(exc, InvalidArgument):
        param = PARAMS.get(exc.field) or exc.field.replace("prompt.messages", "messages").replace("sampling.", "")
        return ApiError(400, f"{param}: {exc.message}", param.split("[")[0], "invalid_value")
    if isinstance(exc, QueueFull):
        return ApiError(429, str(exc), code="queue_full")
    if isinstance(exc, Unavailable):
        return ApiError(503, str(exc), code="unavailable")
    return ApiError(500, str(exc), code="internal_error")


@dataclass(frozen=True)
class Parsed:
    """An OpenAI request as the engine takes it."""

    request: GenerationRequest
    stream: bool
    include_usage: bool
    logprobs: bool
    n: int  # completions of the prompt, each its own sequence (seeds seed, seed + 1, ... when a seed is given)
    continuous_usage: bool = False  # with include_usage: every streamed chunk carries the usage so far (vLLM's)


def shown(value) -> str:
    """A client's value as an error message quotes it: JSON, at most 40 characters, never a lone surrogate."""
    text = json.dumps(value)  # ASCII, surrogates escaped
    return text if len(text) <= 40 else text[:37] + "..."


def _number(body: dict, name: str, default, low: float, high: float, kind=float, param: str | None = None):
    """body[name] (default when absent or null) as kind, within [low, high]; refused naming param (default: name).
    Integers of any size compare exactly: none is turned into a float on the way."""
    value = body.get(name, default)
    if value is None:
        value = default
    param = param or name
    wrong_type = isinstance(value, bool) or not isinstance(value, (int, float))
    if wrong_type or (kind is int and isinstance(value, float) and not value.is_integer()):
        raise ApiError(400, f"{param} must be a{'n integer' if kind is int else ' number'}, got {shown(value)}", param)
    if not low <= value <= high:  # NaN fails too
        raise ApiError(400, f"{param} must be in [{low:g}, {high:g}], got {shown(value)}", param)
    return kind(value)


def _flag(body: dict, name: str, param: str | None = None) -> bool:
    """body[name] as a boolean: true, false, or absent/null (false); anything else (1, "false") refused by name."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{param or name} must be true or false, got {shown(value)}", param or name)
    return value


def check_body(body, limits: EngineLimits) -> None:
    """The whole parsed body, before any field is read: nested at most limits.max_json_depth deep, and every string and
    key valid Unicode (JSON's escapes and CESU-8 bytes can spell lone surrogates, which no tokenizer or response
    encodes). Walked without recursion, so no nesting can exhaust the stack; a refusal names the top-level parameter
    the fault is under."""
    stack = [(body, 1, None)]
    while stack:
        value, depth, param = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limits.max_json_depth:
                raise ApiError(400, f"the request body nests deeper than {limits.max_json_depth} (--max-json-depth)"
                               f"{f' under {param}' if param else ''}", param)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str) and not encodable(key):
                    raise ApiError(400, f"a key {f'under {param} ' if param else ''}is not valid Unicode (a lone surrogate)", param)
                stack.append((item, depth + 1, param if param is not None else key))
        elif isinstance(value, str) and not encodable(value):
            raise ApiError(400, f"{param or 'the body'} is not valid Unicode (a lone surrogate)", param)


def _same(value, no_op) -> bool:
    """value is the parameter's no-op value itself: equal and of the same type (1 is not true, 0 is not false)."""
    return value is None or (type(value) is type(no_op) and value == no_op) or value == {} or value == []


def parse_body(raw: bytes, kind: str, model_name: str, limits: EngineLimits, context: int | None = None) -> Parsed:
    """A request body's bytes to the engine request, with every check that reads the whole body: JSON, its nesting and
    Unicode (check_body), the parameters (parse), and its sizes (validation.check_sizes; context: the served model's,
    which bounds a prompt of token ids). Run in the
    server's input worker process (tokenizing.py): a 4 MiB body is ~8 ms of parsing that holds the GIL, which four
    clients sending such bodies would otherwise take from the model steps and the event loop streaming their tokens."""
    return checked(parse(load_body(raw, limits), kind, model_name, limits), limits, context)


def load_body(raw: bytes, limits: EngineLimits):
    """A body's JSON, its nesting and Unicode checked (check_body)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {limits.max_json_depth} (--max-json-depth)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not JSON: {exc}") from None
    check_body(body, limits)
    return body


def checked(parsed: Parsed, limits: EngineLimits, context: int | None) -> Parsed:
    """parsed, its request's sizes held to the limits (validation.check_sizes)."""
    try:
        check_sizes(parsed.request, limits, context)
    except InvalidArgument as exc:
        raise api_error(exc) from None
    return parsed


def parse(body, kind: str, model_name: str, limits: EngineLimits) -> Parsed:
    """The engine request for an OpenAI body (kind "completions" or "chat"); every refusal names its parameter. The
    parameters' sizes are held to the same limits as gRPC's (limits.py); temperature to OpenAI's own [0, 2]."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - ALLOWED[kind])
    if unknown:
        raise ApiError(400, f"unsupported parameter: {shown(unknown[0])}", unknown[0], "unsupported_parameter")
    for name, no_op in NOT_YET.items():
        if name in body and not _same(body[name], no_op):
            raise ApiError(400, f"{name} is not supported by kvserve yet", name, "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: the name GET /v1/models lists", "model")
    if model != model_name:
        raise ApiError(404, f"the model {shown(model)} does not exist here; this server serves {shown(model_name)}", "model", "model_not_found")
    n = _number(body, "n", 1, 1, limits.max_n, int)
    if kind == "chat":
        if "top_logprobs" in body and body["top_logprobs"] is not None and body.get("logprobs") is not True:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = _number(body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens",
                         16 if kind == "completions" else 0, 1 if "max_tokens" in body or "max_completion_tokens" in body else 0, 2**31 - 1, int)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise ApiError(400, "top_p must be in (0, 1], got 0", "top_p")
    seed = body.get("seed")  # any int; the engine's 0 means "choose one", so a given seed maps to 1 .. 2^63 - 1
    seed = 0 if seed is None else _number(body, "seed", 0, -(2**63), 2**64 - 1, int) % MAX_SEED + 1
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict) or not all(isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10 for k in bias):
        raise ApiError(400, "logit_bias must map token ids (decimal digits, as strings) to numbers", "logit_bias")
    if len(bias) > limits.max_logit_bias:
        raise ApiError(400, f"logit_bias has {len(bias)} entries; at most {limits.max_logit_bias}", "logit_bias")
    logit_bias = tuple(sorted((int(k), _number(bias, k, 0.0, -MAX_BIAS, MAX_BIAS, param="logit_bias")) for k in bias))
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, OPENAI_MAX_TEMPERATURE), top_p=top_p, seed=seed, logit_bias=logit_bias,
        presence_penalty=_number(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        top_k=max(0, _number(body, "top_k", 0, -1, 2**31 - 1, int)),  # vLLM's -1 (and 0): off
        repetition_penalty=_number(body, "repetition_penalty", 1.0, MIN_SCALE, MAX_SCALE),
    )
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_token_ids):
        raise ApiError(400, "stop_token_ids must be a list of token ids (non-negative integers)", "stop_token_ids")
    skip_special = body.get("skip_special_tokens", True)
    if not isinstance(skip_special, bool):
        raise ApiError(400, f"skip_special_tokens must be true or false, got {shown(skip_special)}", "skip_special_tokens")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a string or a list of non-empty strings", "stop")
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise ApiError(400, "stream_options takes include_usage and continuous_usage_stats (vLLM's) only", "stream_options")
    include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    continuous_usage = _flag(options, "continuous_usage_stats", "stream_options.continuous_usage_stats")
    logprobs = body.get("logprobs")
    if kind == "chat":
        logprobs = _flag(body, "logprobs")
        top = _number(body, "top_logprobs", 0, 0, limits.max_top_logprobs, int)
    else:  # an int: the sampled token's log-probability and this many alternatives
        top = 0 if logprobs is None else _number(body, "logprobs", 0, 0, limits.max_top_logprobs, int)
        logprobs = logprobs is not None
    common = dict(max_new_tokens=max_tokens, sampling=sampling, stop_sequences=tuple(stop), return_logprobs=logprobs, top_logprobs=top,
                  response_format=_response_format(body.get("response_format")), ignore_eos=_flag(body, "ignore_eos"),
                  min_new_tokens=_number(body, "min_tokens", 0, 0, 2**31 - 1, int), stop_token_ids=tuple(stop_token_ids),
                  skip_special_tokens=skip_special, include_stop_sequence=_flag(body, "include_stop_str_in_output"))
    if kind == "chat":
        budget = None if body.get("thinking_token_budget") is None else _number(body, "thinking_token_budget", 0, 1, 2**31 - 1, int)
        request = GenerationRequest(prompt_messages=tuple(_messages(body.get("messages"))), thinking_token_budget=budget,
                                    chat_template_kwargs=_template_kwargs(body.get("chat_template_kwargs"), body.get("reasoning_effort")),
                                    tools=_tools(body), **common)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            request = GenerationRequest(prompt_text=prompt, **common)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            request = GenerationRequest(prompt_ids=tuple(prompt), **common)
        else:
            raise ApiError(400, "prompt must be a string or a list of token ids (one prompt a request)", "prompt")
    return Parsed(request, stream, include_usage, logprobs, n, continuous_usage)


JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
MAX_SCHEMA_NAME = 64  # characters of json_schema.name, as OpenAI bounds it


def _response_format(value) -> ResponseFormat | None:
    """OpenAI's response_format: text (None), json_object, or json_schema (always enforced, strict or not)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                       "\"json_schema\": {\"name\": ..., \"schema\": {...}}}", "response_format")
    kind = value["type"]
    extra = sorted(set(value) - ({"type", "json_schema"} if kind == "json_schema" else {"type"}))
    if extra:
        raise ApiError(400, f"response_format of type {kind} takes no {extra[0]}", f"response_format.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(FormatKind.JSON_OBJECT)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
        raise ApiError(400, "response_format.json_schema must be an object with a schema (a JSON Schema object)", "response_format.json_schema")
    unknown = sorted(set(spec) - JSON_SCHEMA_KEYS)
    if unknown:
        raise ApiError(400, f"unsupported parameter: response_format.json_schema.{unknown[0]}", f"response_format.json_schema.{unknown[0]}")
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and 0 < len(name) <= MAX_SCHEMA_NAME):
        raise ApiError(400, f"response_format.json_schema.name must be 1 to {MAX_SCHEMA_NAME} characters", "response_format.json_schema.name")
    _flag(spec, "strict", "response_format.json_schema.strict")  # enforced either way: only its type is checked
    return ResponseFormat(FormatKind.JSON_SCHEMA, json.dumps(spec["schema"]))


def _template_kwargs(kwargs, effort=None) -> str | None:
    """chat_template_kwargs (vLLM's name): a JSON object of the chat template's extra variables, passed on as JSON text;
    reasoning_effort joins them as the variable of that name (a template that reads it, as gpt-oss's does, thinks as
    long as told; others ignore it), unless the kwargs set it themselves."""
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ApiError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {shown(effort)}", "reasoning_effort")
    if kwargs is None and effort is None:
        return None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
    kwargs = dict(kwargs or {})
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    return json.dumps(kwargs, ensure_ascii=False)


def _tools(body: dict) -> ToolRequest | None:
    """tools, tool_choice and parallel_tool_calls; the tools themselves are checked by the engine (tool_calls.py), which
    names the field at fault."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, f"parallel_tool_calls must be true or false, got {shown(parallel)}", "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "tools must be a list of tools", "tools")
    function = ""
    if choice is None or choice in ("none", "auto", "required"):
        mode = ToolChoice(choice or "auto")
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str) and set(choice) == {"type", "function"} and set(choice["function"]) == {"name"}):
        mode, function = ToolChoice.FUNCTION, choice["function"]["name"]
    else:
        raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}', "tool_choice")
    return ToolRequest(json.dumps(tools, ensure_ascii=False), mode, function, True if parallel is None else parallel)


MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id", "name"}  # what a message may carry: the rest is refused by name
PART_KEYS = {"type", "text"}


def _messages(messages) -> list[ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"{where} must be an object with a role", where)
        unknown = sorted(set(message) - MESSAGE_KEYS)
        if unknown:
            raise ApiError(400, f"{where}.{unknown[0]} is not supported by kvserve (a message carries a role and its content)",
                           f"{where}.{unknown[0]}", "unsupported_parameter")
        content = message.get("content")
        calls = _message_calls(message.get("tool_calls"), where)
        if content is None and calls:  # an assistant turn of calls alone
            content = ""
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) and set(p) <= PART_KEYS
                       for p in content):
                raise ApiError(400, f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported",
                               f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise ApiError(400, f"{where}.{key} must be a string", f"{where}.{key}")
        out.append(ChatMessage(message["role"], content, calls, message.get("tool_call_id"), message.get("name")))
    return out


def _message_calls(calls, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's tool_calls: [{"id", "type": "function", "function": {"name", "arguments": JSON text}}]."""
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for number, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(call.get("id"), str) and call.get("type", "function") == "function"
                and isinstance(function.get("name"), str) and isinstance(function.get("arguments"), str)):
            raise ApiError(400, f'{where}.tool_calls[{number}] must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                           f'"arguments": "<JSON text>"}}}}', f"{where}.tool_calls")
        out.append(ToolCall(call["id"], function["name"], function["arguments"]))
    return tuple(out)
