"""The OpenAI protocol's answers, apart from its transport (http_api.py): the response and stream-chunk bodies of
/v1/completions and /v1/chat/completions, from the engine's step events (the requests are openai_protocol.py's)."""

from __future__ import annotations

import json
from collections.abc import Callable

from .openai_sampling import Parsed
from ..core.sequence import FinishReason, StepEvent
from ..core.tool_call_text import CallDelta

FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.STOP_SEQUENCE: "stop", FinishReason.END_OF_SEQUENCE: "stop",
                  FinishReason.TOOL_CALLS: "tool_calls"}


def logprobs_object(kind: str, events: list[StepEvent], pieces: Callable[[list[int]], list[str]]) -> dict:
    """A choice's logprobs object for events (a whole answer's, or one streamed token's); pieces: the tokenizer's text of ids."""
    tokens = pieces([e.token_id for e in events])
    alternatives = [[(piece, lp) for piece, (_, lp) in zip(pieces([t for t, _ in e.top_logprobs]), e.top_logprobs)]
                    if e.top_logprobs else [] for e in events]
    if kind == "chat":
        return {"content": [
            {"token": token, "logprob": e.logprob, "bytes": list(token.encode("utf-8")),
             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in top]}
            for token, e, top in zip(tokens, events, alternatives)]}
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in events], "top_logprobs": [dict(top) for top in alternatives],
            "text_offset": None}


def usage(finishes: list) -> dict:
    """The usage object of n completions of one prompt (each completion's Finish)."""
    prompt = finishes[0].prompt_tokens  # one prompt, counted once
    completion = sum(f.generated_tokens for f in finishes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": min(f.cached_prompt_tokens for f in finishes)},
            "completion_tokens_details": {"reasoning_tokens": sum(f.reasoning_tokens for f in finishes),
                                          # OpenAI's names for predicted outputs' tokens: here, the drafts a step checked
                                          "accepted_prediction_tokens": sum(f.accepted_draft_tokens for f in finishes),
                                          "rejected_prediction_tokens": sum(f.rejected_draft_tokens for f in finishes)}}


def object_name(kind: str, streamed: bool) -> str:
    if kind == "chat":
        return "chat.completion.chunk" if streamed else "chat.completion"
    return "text_completion"


def whole_body(ids: str, kind: str, model: str, created: int, completions: list[list[StepEvent]], parsed: Parsed,
               pieces: Callable[[list[int]], list[str]]) -> dict:
    """The one JSON body of an answer not streamed: every completion's text (or message), finish reason and usage."""
    choices = []
    for index, completion in enumerate(completions):
        text = "".join(event.text for event in completion)
        finish = completion[-1].finish
        choice = {"index": index, "logprobs": logprobs_object(kind, completion, pieces) if parsed.logprobs else None,
                  "finish_reason": FINISH_REASONS[finish.reason]}
        if kind == "chat":
            message = {"role": "assistant", "content": text}
            thinking = "".join(event.reasoning for event in completion)
            if thinking or finish.reasoning_tokens:  # a reasoning model's thinking, under both names clients read
                message["reasoning_content"] = message["reasoning"] = thinking
            if finish.tool_calls:
                message["content"] = text or None
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                         for c in finish.tool_calls]
            choice["message"] = message
        else:
            choice["text"] = text
        choices.append(choice)
    return {"id": ids, "object": object_name(kind, False), "created": created, "model": model, "choices": choices,
            "usage": usage([c[-1].finish for c in completions])}


def token_choice(kind: str, index: int, events: list[StepEvent], parsed: Parsed, pieces: Callable[[list[int]], list[str]]) -> dict:
    """The tokens of completion index ready together (one, or a step's accepted drafts, or the steps that ran while the
    loop wrote), as one chunk's choice: their text, thinking and tool-call pieces joined, their logprobs in order, the
    last's finish reason."""
    last = events[-1]
    reason = FINISH_REASONS[last.finish.reason] if last.finish is not None else None
    choice = {"index": index, "logprobs": logprobs_object(kind, events, pieces) if parsed.logprobs else None, "finish_reason": reason}
    text = "".join(e.text for e in events)
    if kind == "chat":
        reasoning = "".join(e.reasoning for e in events)
        deltas = tuple(delta for e in events for delta in e.call_deltas)
        choice["delta"] = {"content": text} if text or not (deltas or reasoning) else {}
        if reasoning:
            choice["delta"]["reasoning_content"] = choice["delta"]["reasoning"] = reasoning
        if deltas:
            choice["delta"]["tool_calls"] = call_deltas(deltas)
    else:
        choice["text"] = text
    return choice


def call_deltas(deltas: tuple[CallDelta, ...]) -> list[dict]:
    """A step's pieces of tool calls as OpenAI streams them: one entry a call, its id and name first."""
    merged: dict[int, dict] = {}
    for delta in deltas:
        entry = merged.setdefault(delta.index, {"index": delta.index, "function": {"arguments": ""}})
        if delta.name is not None:
            entry.update(id=delta.id, type="function")
            entry["function"]["name"] = delta.name
        entry["function"]["arguments"] += delta.arguments
    return list(merged.values())


def opening_choices(n: int) -> list[dict]:
    """A chat stream's first chunk: each completion's assistant role, no content yet."""
    return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None} for i in range(n)]


def sse(body: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


STREAM_END = "data: [DONE]\n\n"
