"""What every OpenAI generation request shares (completions, chat, and the Responses API through chat): the body's JSON,
its nesting and Unicode, the sampling and stopping parameters (vLLM's extensions among them), streaming options and
log-probabilities, and response_format. Each refusal names its parameter (openai_errors.ApiError)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..core.engine_errors import InvalidArgument
from ..core.limits import MAX_BIAS, MAX_PENALTY, MAX_SCALE, MIN_SCALE, EngineLimits
from .openai_errors import ApiError, api_error, shown
from ..core.sampling import MAX_SEED, SamplingParams
from ..core.sequence import GenerationRequest
from ..core.structured import FormatKind, ResponseFormat
from ..core.text import encodable
from ..core.validation import check_sizes

OPENAI_MAX_TEMPERATURE = 2.0  # OpenAI's own bound (gRPC takes up to limits.MAX_SCALE)
# vLLM's sampling extensions, as vLLM names them (benchmark tools send them): docs/serving.md, "vLLM's extensions".
VLLM = {"ignore_eos", "min_tokens", "top_k", "repetition_penalty", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output"}
# kvserve's own: speculation (false: this request's steps check no drafts; docs/serving.md, "Speculation").
KVSERVE = {"speculation"}
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "logprobs", "user",
          "presence_penalty", "frequency_penalty", "logit_bias", "min_p", "response_format"} | VLLM | KVSERVE


@dataclass(frozen=True)
class Parsed:
    """An OpenAI request as the engine takes it."""

    request: GenerationRequest
    stream: bool
    include_usage: bool
    logprobs: bool
    n: int  # completions of the prompt, each its own sequence (seeds seed, seed + 1, ... when a seed is given)
    continuous_usage: bool = False  # with include_usage: every streamed chunk carries the usage so far (vLLM's)


@dataclass(frozen=True)
class Shared:
    """The parameters every generation request takes, read (shared_parameters): the engine request's fields that do not
    depend on the endpoint, and how the answer is sent."""

    fields: dict  # GenerationRequest's keyword arguments but the prompt's
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: bool
    n: int


def number(body: dict, name: str, default, low: float, high: float, kind=float, param: str | None = None):
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


def flag(body: dict, name: str, param: str | None = None) -> bool:
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


def shared_parameters(body: dict, kind: str, limits: EngineLimits) -> Shared:
    """The parameters every generation request shares, of a body of kind "completions" or "chat" (whose log-probabilities
    are spelled differently). Sizes are held to the same limits as gRPC's (limits.py); temperature to OpenAI's [0, 2]."""
    n = number(body, "n", 1, 1, limits.max_n, int)
    if kind == "chat" and "top_logprobs" in body and body["top_logprobs"] is not None and body.get("logprobs") is not True:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = number(body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens",
                         16 if kind == "completions" else 0, 1 if "max_tokens" in body or "max_completion_tokens" in body else 0, 2**31 - 1, int)
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise ApiError(400, "top_p must be in (0, 1], got 0", "top_p")
    seed = body.get("seed")  # any int; the engine's 0 means "choose one", so a given seed maps to 1 .. 2^63 - 1
    seed = 0 if seed is None else number(body, "seed", 0, -(2**63), 2**64 - 1, int) % MAX_SEED + 1
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict) or not all(isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10 for k in bias):
        raise ApiError(400, "logit_bias must map token ids (decimal digits, as strings) to numbers", "logit_bias")
    if len(bias) > limits.max_logit_bias:
        raise ApiError(400, f"logit_bias has {len(bias)} entries; at most {limits.max_logit_bias}", "logit_bias")
    logit_bias = tuple(sorted((int(k), number(bias, k, 0.0, -MAX_BIAS, MAX_BIAS, param="logit_bias")) for k in bias))
    sampling = SamplingParams(
        temperature=number(body, "temperature", 1.0, 0.0, OPENAI_MAX_TEMPERATURE), top_p=top_p, seed=seed, logit_bias=logit_bias,
        presence_penalty=number(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        min_p=number(body, "min_p", 0.0, 0.0, 1.0),
        top_k=max(0, number(body, "top_k", 0, -1, 2**31 - 1, int)),  # vLLM's -1 (and 0): off
        repetition_penalty=number(body, "repetition_penalty", 1.0, MIN_SCALE, MAX_SCALE),
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
    stream = flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise ApiError(400, "stream_options takes include_usage and continuous_usage_stats (vLLM's) only", "stream_options")
    include_usage = flag(options, "include_usage", "stream_options.include_usage")
    continuous_usage = flag(options, "continuous_usage_stats", "stream_options.continuous_usage_stats")
    logprobs = body.get("logprobs")
    if kind == "chat":
        logprobs = flag(body, "logprobs")
        top = number(body, "top_logprobs", 0, 0, limits.max_top_logprobs, int)
    else:  # an int: the sampled token's log-probability and this many alternatives
        top = 0 if logprobs is None else number(body, "logprobs", 0, 0, limits.max_top_logprobs, int)
        logprobs = logprobs is not None
    fields = dict(max_new_tokens=max_tokens, sampling=sampling, stop_sequences=tuple(stop), return_logprobs=logprobs, top_logprobs=top,
                  response_format=response_format(body.get("response_format")), ignore_eos=flag(body, "ignore_eos"),
                  min_new_tokens=number(body, "min_tokens", 0, 0, 2**31 - 1, int), stop_token_ids=tuple(stop_token_ids),
                  skip_special_tokens=skip_special, include_stop_sequence=flag(body, "include_stop_str_in_output"),
                  speculation=body.get("speculation") is None or flag(body, "speculation"), streamed=stream)
    return Shared(fields, stream, include_usage, continuous_usage, logprobs, n)


JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
MAX_SCHEMA_NAME = 64  # characters of json_schema.name, as OpenAI bounds it


def response_format(value) -> ResponseFormat | None:
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
    flag(spec, "strict", "response_format.json_schema.strict")  # enforced either way: only its type is checked
    return ResponseFormat(FormatKind.JSON_SCHEMA, json.dumps(spec["schema"]))
