"""The errors a request can meet in the engine. Each edge maps them once: gRPC to status codes
(grpc_errors.ErrorInterceptor), HTTP to OpenAI error objects (openai_errors.api_error)."""

from __future__ import annotations


class EngineError(Exception):
    """Base of the errors a request can meet in the engine."""


class InvalidArgument(EngineError):
    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field, self.message = field_name, message


class QueueFull(EngineError):
    pass


class Unavailable(EngineError):
    """Not serving (loading, or draining for shutdown)."""


class SequenceFailed(EngineError):
    """An unexpected failure of this request alone."""
