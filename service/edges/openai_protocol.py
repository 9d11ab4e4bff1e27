"""The OpenAI protocol's requests, apart from their transport (http_api.py): a completions or chat body parsed into the
engine's request, every refusal an ApiError naming the parameter (openai_errors.py). What the endpoints share is
openai_sampling.py's, chat's own parameters openai_chat.py's, the Responses API's openai_responses.py's; the answers'
bodies are openai_answers.py's.

Errors are OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`): 400 for a bad or unsupported parameter
(named), a body nested too deep or holding invalid Unicode; 401; 404 for another model or path; 405; 413 for a body
over --max-message-bytes; 415 for a body not sent as application/json; 429 when the queue is full; 503 while loading
or draining.
"""

from __future__ import annotations

from ..core.limits import EngineLimits
from .openai_chat import CHAT, chat_request
from .openai_errors import ApiError, shown
from .openai_sampling import COMMON, Parsed, checked, load_body, shared_parameters
from ..core.sequence import GenerationRequest

# Parameters the API defines that kvserve does not implement yet: refused by name with 400 when set to anything but
# their no-op value, never silently ignored.
# (functions and function_call: the API's older spelling of tools and tool_choice.)
NOT_YET = {"best_of": 1, "echo": False, "suffix": None, "functions": None, "function_call": None}
ALLOWED = {"completions": COMMON | {"prompt"} | set(NOT_YET), "chat": COMMON | CHAT | set(NOT_YET)}


def parse_body(raw: bytes, kind: str, model_name: str, limits: EngineLimits, context: int | None = None) -> Parsed:
    """A request body's bytes to the engine request, with every check that reads the whole body: JSON, its nesting and
    Unicode (check_body), the parameters (parse), and its sizes (validation.check_sizes; context: the served model's,
    which bounds a prompt of token ids). Run in the
    server's input worker process (tokenizing.py): a 4 MiB body is ~8 ms of parsing that holds the GIL, which four
    clients sending such bodies would otherwise take from the model steps and the event loop streaming their tokens."""
    return checked(parse(load_body(raw, limits), kind, model_name, limits), limits, context)


def _same(value, no_op) -> bool:
    """value is the parameter's no-op value itself: equal and of the same type (1 is not true, 0 is not false)."""
    return value is None or (type(value) is type(no_op) and value == no_op) or value == {} or value == []


def parse(body, kind: str, model_name: str, limits: EngineLimits) -> Parsed:
    """The engine request for an OpenAI body (kind "completions" or "chat"); every refusal names its parameter."""
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
    shared = shared_parameters(body, kind, limits)
    request = chat_request(body, shared) if kind == "chat" else _completion_request(body, shared.fields)
    return Parsed(request, shared.stream, shared.include_usage, shared.logprobs, shared.n, shared.continuous_usage)


def _completion_request(body: dict, fields: dict) -> GenerationRequest:
    """A completions body's prompt: text, or token ids (a batch of one of either)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return GenerationRequest(prompt_text=prompt, **fields)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return GenerationRequest(prompt_ids=tuple(prompt), **fields)
    raise ApiError(400, "prompt must be a string or a list of token ids (one prompt a request)", "prompt")
