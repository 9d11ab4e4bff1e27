"""OpenAI error objects (`{"error": {"message", "type", "param", "code"}}`) and the engine's errors as them: every refusal
of the OpenAI edge (http_api.py, http_responses.py) names the parameter the client sent."""

from __future__ import annotations

import json

from ..core.engine_errors import EngineError, InvalidArgument, QueueFull, Unavailable

# The status each refusal gets, and the gRPC code name the request metric counts it under (one label set for both APIs).
STATUS_CODES = {200: "OK", 400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 405: "UNIMPLEMENTED",
                413: "RESOURCE_EXHAUSTED", 415: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error", 405: "invalid_request_error",
               413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "server_error"}
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


def shown(value) -> str:
    """A client's value as an error message quotes it: JSON, at most 40 characters, never a lone surrogate."""
    text = json.dumps(value)  # ASCII, surrogates escaped
    return text if len(text) <= 40 else text[:37] + "..."
