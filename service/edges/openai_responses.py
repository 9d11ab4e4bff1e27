"""OpenAI's Responses API (`POST /v1/responses`, retrieve and delete) over the same engine as chat completions: what
OpenAI's SDKs and agent frameworks reach for first in 2026. The transport is http_api.py's; this module holds the
protocol: a Responses body read as the chat request it amounts to (responses_as_chat: input items become messages,
instructions the first system message, a previous response's turns come before them, flat function tools become chat's
nested ones, text.format becomes response_format), the answer written as Responses output items (a reasoning item, a
message, function calls) whole or as the typed stream events the SDK reads, and the bounded store behind
previous_response_id (ResponseStore: the last --max-stored-responses kept, least recently used dropped first;
`store: false` keeps none).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ..core.limits import EngineLimits
from .openai_answers import sse
from .openai_errors import ApiError, shown
from .openai_protocol import parse
from .openai_sampling import Parsed, checked, load_body
from ..core.sequence import Finish, FinishReason, StepEvent

# The Responses parameters kvserve reads; NOT_YET: those it accepts only at their no-op values (the rest is refused by name).
ALLOWED = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens", "temperature",
           "top_p", "stream", "store", "previous_response_id", "text", "metadata", "user", "reasoning"}
NOT_YET = {"truncation": "disabled", "include": [], "background": False, "top_logprobs": 0,
           "service_tier": "auto", "max_tool_calls": None, "prompt": None, "conversation": None}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


@dataclass
class StoredResponse:
    """A stored response: the conversation it answered (chat-style messages), its body, and its own input as items."""

    messages: list[dict]
    body: dict
    input_items: list[dict] = field(default_factory=list)


def input_items(request: dict) -> list[dict]:
    """A Responses body's input as the items GET /v1/responses/{id}/input_items lists (messages given ids and text parts)."""
    given = request.get("input")
    items = [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else list(given or [])
    out = []
    for item in items:
        item = dict(item)
        if item.get("type", "message") == "message":
            item["type"] = "message"
            if isinstance(item.get("content"), str):
                item["content"] = [{"type": "input_text", "text": item["content"]}]
            item.setdefault("id", new_id("msg"))
        out.append(item)
    return out


@dataclass
class ResponseStore:
    """The responses kept for previous_response_id, retrieve and delete: at most `limit`, least recently used dropped first.
    The event loop's alone (no lock)."""

    limit: int
    kept: OrderedDict = field(default_factory=OrderedDict)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.limit == 0:
            return
        self.kept[response_id] = stored
        self.kept.move_to_end(response_id)
        while len(self.kept) > self.limit:
            self.kept.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        stored = self.kept.get(response_id)
        if stored is None:
            raise ApiError(404, f"no stored response {shown(response_id)} (responses are kept in memory, the last {self.limit}, and "
                                "only when created with store true)", param, "response_not_found")
        self.kept.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self.kept[response_id]


# Chat's parameter names, as a Responses client knows them (its errors name what it sent).
PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def parse_responses(raw: bytes, model_name: str, limits: EngineLimits, context: int, store: ResponseStore) -> tuple[Parsed, dict, list[dict]]:
    """A Responses body's bytes to (the engine request, the body, the conversation to store): read as the chat request
    it amounts to, with chat's checks, its refusals naming the Responses parameter."""
    body = load_body(raw, limits)
    chat, conversation = responses_as_chat(body, store)
    try:
        return checked(parse(chat, "chat", model_name, limits), limits, context), body, conversation
    except ApiError as error:
        raise as_responses_error(error) from None


def as_responses_error(error: ApiError) -> ApiError:
    """error, naming the Responses parameter where it named chat's (its parse's, or the engine's through api_error)."""
    param = (error.param or "").split(".")[0].split("[")[0]
    if param in PARAMS:
        return ApiError(error.status, error.message.replace(param, PARAMS[param], 1), (error.param or "").replace(param, PARAMS[param], 1),
                        error.code)
    return error


def responses_as_chat(body, store: ResponseStore) -> tuple[dict, list[dict]]:
    """(the chat completions body a Responses body amounts to, the conversation's messages to store with its answer)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - ALLOWED - set(NOT_YET))
    if unknown:
        raise ApiError(400, f"unsupported parameter: {shown(unknown[0])}", unknown[0], "unsupported_parameter")
    for name, no_op in NOT_YET.items():
        if name in body and body[name] != no_op and body[name] is not None:
            raise ApiError(400, f"{name} is not supported by kvserve yet", name, "unsupported_parameter")
    messages = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise ApiError(400, "previous_response_id must be a string", "previous_response_id")
        messages = list(store.get(previous, "previous_response_id").messages)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "instructions must be a string", "instructions")
        messages = [m for m in messages if not m.get("instructions")]  # a previous response's instructions do not carry over
        messages.insert(0, {"role": "system", "content": instructions, "instructions": True})
    messages += _input_messages(body.get("input"))
    chat = {"model": body.get("model"), "messages": [{k: v for k, v in m.items() if k != "instructions"} for m in messages]}
    for name in ("temperature", "top_p", "stream", "parallel_tool_calls", "user"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
            raise ApiError(400, "text takes format", "text")
        chat["response_format"] = _format(text.get("format"))
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary"} or reasoning.get("summary") not in (None, "auto"):
            raise ApiError(400, "reasoning takes effort (and summary auto: the thinking is returned whole)", "reasoning")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise ApiError(400, "metadata must be an object", "metadata")
    if "store" in body and not isinstance(body["store"], bool):
        raise ApiError(400, f"store must be true or false, got {shown(body['store'])}", "store")
    return chat, messages


def _input_messages(items) -> list[dict]:
    """input: a string (one user message) or a list of items: messages, function calls and their outputs."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "input must be a string or a non-empty list of items", "input")
    messages: list[dict] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item.get("role"), str) and item["role"] in ROLES:
            messages.append({"role": ROLES[item["role"]], "content": _content(item.get("content"), where)})
        elif kind == "function_call" and all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None and not messages[-1]["content"]:
                messages[-1]["tool_calls"].append(call)  # consecutive calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str) and isinstance(item.get("output"), str):
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind == "reasoning":
            continue  # a previous turn's thinking: not shown to the model again, as chat templates leave it out
        else:
            raise ApiError(400, f"{where} must be a message (role user, system, developer or assistant), a function_call "
                                "(call_id, name, arguments) or a function_call_output (call_id, output)", where)
    return messages


def _content(content, where: str) -> str:
    """A message's content: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text") and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts (input_text)", f"{where}.content")


def _tools(tools) -> list[dict]:
    """Responses' flat function tools as chat's nested ones (the engine checks each, naming the field at fault)."""
    if not isinstance(tools, list):
        raise ApiError(400, "tools must be a list of tools", "tools")
    out = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ApiError(400, f"tools[{index}]: only function tools are supported", f"tools[{index}]")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice  # "none", "auto", "required", or what chat's parser refuses naming tool_choice


def _format(value) -> dict | None:
    """text.format as chat's response_format."""
    if value is None:
        return None
    if isinstance(value, dict) and value.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in value.items() if k != "type"}}
    return value  # text, json_object, or what chat's parser refuses


# --- answers -------------------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class Answer:
    """One response's output as it grows: its thinking, its text, its calls."""

    response_id: str
    model: str
    request: dict  # the Responses body (its parameters are echoed in the response)
    created_at: int = field(default_factory=lambda: int(time.time()))
    reasoning_id: str = field(default_factory=lambda: new_id("rs"))
    message_id: str = field(default_factory=lambda: new_id("msg"))
    thinking: str = ""
    text: str = ""
    finish: Finish | None = None

    def add(self, event: StepEvent) -> None:
        self.thinking += event.reasoning
        self.text += event.text
        if event.finish is not None:
            self.finish = event.finish

    def output(self) -> list[dict]:
        items = []
        if self.thinking or (self.finish is not None and self.finish.reasoning_tokens):
            items.append(reasoning_item(self.reasoning_id, self.thinking))
        if self.text or self.finish is None or not self.finish.tool_calls:
            items.append(message_item(self.message_id, self.text))
        for call in self.finish.tool_calls if self.finish is not None else ():
            items.append(call_item(call))
        return items

    def body(self, status: str | None = None) -> dict:
        finish, request = self.finish, self.request
        done = finish is not None
        status = status or ("incomplete" if done and finish.reason is FinishReason.LENGTH else "completed" if done else "in_progress")
        usage = None
        if done:
            usage = {"input_tokens": finish.prompt_tokens, "input_tokens_details": {"cached_tokens": finish.cached_prompt_tokens},
                     "output_tokens": finish.generated_tokens, "output_tokens_details": {"reasoning_tokens": finish.reasoning_tokens},
                     "total_tokens": finish.prompt_tokens + finish.generated_tokens}
        text_format = (request.get("text") or {}).get("format") or {"type": "text"}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status, "model": self.model,
            "output": self.output() if done else [], "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.get("instructions"), "metadata": request.get("metadata") or {},
            "previous_response_id": request.get("previous_response_id"), "store": request.get("store", True),
            "temperature": request.get("temperature", 1.0), "top_p": request.get("top_p", 1.0),
            "max_output_tokens": request.get("max_output_tokens"), "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "tool_choice": request.get("tool_choice", "auto"), "tools": request.get("tools") or [], "text": {"format": text_format},
            "truncation": "disabled", "reasoning": request.get("reasoning"), "user": request.get("user"),
        }

    def stored(self, conversation: list[dict]) -> StoredResponse:
        """What the store keeps of this finished response, which answered conversation."""
        return StoredResponse(self.stored_messages(conversation), self.body(), input_items(self.request))

    def stored_messages(self, conversation: list[dict]) -> list[dict]:
        """The conversation to carry to a response that follows this one: its messages, then this answer's turn."""
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in self.finish.tool_calls]
        turn = {"role": "assistant", "content": self.text or (None if calls else "")}
        if calls:
            turn["tool_calls"] = calls
        return conversation + [turn]


def reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(call, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


class EventStream:
    """A response's stream events (the SDK's typed events), numbered in order, as server-sent events."""

    def __init__(self, answer: Answer):
        self.answer = answer
        self.number = 0
        self.open_item: str | None = None  # "reasoning" or "message": the item the deltas now go to
        self.index = -1  # its output_index
        self.wrote_message = False

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\n" + sse(body)

    def start(self) -> list[str]:
        body = self.answer.body("in_progress")
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def step(self, events: list[StepEvent]) -> list[str]:
        """The events of the tokens ready together (a token, mostly): their thinking's and their answer's text, one delta
        a run of either, in order, each item opened when first written to."""
        out, kind, text = [], None, ""
        for event in events:
            for piece_kind, piece in (("reasoning", event.reasoning), ("message", event.text)):
                if not piece:
                    continue
                if piece_kind != kind and text:
                    out += self._delta(kind, text)
                    text = ""
                kind, text = piece_kind, text + piece
            self.answer.add(event)
        if text:
            out += self._delta(kind, text)
        return out

    def _delta(self, kind: str, text: str) -> list[str]:
        """A run of text of one kind ("reasoning" or "message"), its item opened first if it is not the open one."""
        out = self._switch(kind)
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", item_id=self.answer.reasoning_id, output_index=self.index,
                                  content_index=0, delta=text))
        else:
            out.append(self.event("response.output_text.delta", item_id=self.answer.message_id, output_index=self.index,
                                  content_index=0, delta=text, logprobs=[]))
        return out

    def finish(self) -> list[str]:
        """The open item closed, the calls written whole, then response.completed (or incomplete) with the whole body."""
        answer = self.answer
        out = self._close()
        if not self.wrote_message and not answer.finish.tool_calls:  # an empty reply still has its message
            out += self._switch("message") + self._close()
        for call in answer.finish.tool_calls:
            self.index += 1
            item = call_item(call)
            out.append(self.event("response.output_item.added", output_index=self.index, item={**call_item(call, "in_progress"), "arguments": ""}))
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=self.index, delta=call.arguments))
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=self.index,
                                  name=call.name, arguments=call.arguments))
            out.append(self.event("response.output_item.done", output_index=self.index, item=item))
        body = answer.body()
        out.append(self.event("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body))
        return out

    def _switch(self, kind: str) -> list[str]:
        if self.open_item == kind:
            return []
        out = self._close()
        self.open_item, self.index = kind, self.index + 1
        answer = self.answer
        if kind == "reasoning":
            item = {**reasoning_item(answer.reasoning_id, ""), "content": [], "status": "in_progress"}
            return out + [self.event("response.output_item.added", output_index=self.index, item=item)]
        self.wrote_message = True
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return out + [self.event("response.output_item.added", output_index=self.index, item=message_item(answer.message_id, "", "in_progress")),
                      self.event("response.content_part.added", item_id=answer.message_id, output_index=self.index, content_index=0, part=part)]

    def _close(self) -> list[str]:
        answer, kind = self.answer, self.open_item
        if kind is None:
            return []
        self.open_item = None
        if kind == "reasoning":
            return [self.event("response.reasoning_text.done", item_id=answer.reasoning_id, output_index=self.index, content_index=0,
                               text=answer.thinking),
                    self.event("response.output_item.done", output_index=self.index, item=reasoning_item(answer.reasoning_id, answer.thinking))]
        part = {"type": "output_text", "text": answer.text, "annotations": [], "logprobs": []}
        return [self.event("response.output_text.done", item_id=answer.message_id, output_index=self.index, content_index=0,
                           text=answer.text, logprobs=[]),
                self.event("response.content_part.done", item_id=answer.message_id, output_index=self.index, content_index=0, part=part),
                self.event("response.output_item.done", output_index=self.index, item=message_item(answer.message_id, answer.text))]
