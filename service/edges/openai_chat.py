"""The chat endpoint's own parameters (/v1/chat/completions, and the Responses API's conversation through it): messages
with their tool calls, tools and tool_choice, the chat template's variables and reasoning effort, the thinking budget.
The parameters every endpoint shares are openai_sampling.py's."""

from __future__ import annotations

import json

from kvserve.contract.chat import ChatMessage, ToolCall

from .openai_errors import ApiError, shown
from .openai_sampling import Shared, number
from ..core.sequence import GenerationRequest
from ..core.tool_calls import ToolChoice, ToolRequest

CHAT = {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls",
        "thinking_token_budget", "reasoning_effort"}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's, handed to the chat template as reasoning_effort


def chat_request(body: dict, shared: Shared) -> GenerationRequest:
    """The engine request of a chat body whose shared parameters are read."""
    budget = None if body.get("thinking_token_budget") is None else number(body, "thinking_token_budget", 0, 1, 2**31 - 1, int)
    return GenerationRequest(prompt_messages=tuple(_messages(body.get("messages"))), thinking_token_budget=budget,
                             chat_template_kwargs=_template_kwargs(body.get("chat_template_kwargs"), body.get("reasoning_effort")),
                             tools=_tools(body), **shared.fields)


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
