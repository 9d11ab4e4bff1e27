"""The gRPC edge's one place where errors become status codes: handlers just raise. Every failure is logged once,
and every finished RPC is counted once, under the status it really ended with. A request whose bytes do not parse
is answered INVALID_ARGUMENT in one log line instead of a traceback per call."""

from __future__ import annotations

import contextlib
import logging

import grpc

from ..core.engine_errors import InvalidArgument, QueueFull, Unavailable
from .metrics import Metrics

log = logging.getLogger("kvserve.server")

STATUS_OF = {InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT, QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED, Unavailable: grpc.StatusCode.UNAVAILABLE}


class _Undecodable:
    """What a request's bytes became when they did not parse: the handler answers INVALID_ARGUMENT for it,
    in one log line, instead of gRPC logging a traceback per call."""

    def __init__(self, reason: str):
        self.reason = reason


def _lenient(deserializer, method: str):
    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:
            return _Undecodable(f"the request bytes are not a valid message for {method} ({type(exc).__name__})")

    return parse


# A client's own deadline timer resets the stream a moment before the server's clock reaches the deadline:
# an RPC that ends this close to it ended because of it.
DEADLINE_SLACK_S = 0.1


def _passing_bytes(serializer):
    """A response serializer that passes a response its handler already serialized (bytes) through as it is."""

    def serialize(response):
        return response if isinstance(response, bytes) else serializer(response)

    return serialize


def _ended_early(context: grpc.aio.ServicerContext) -> str:
    """The status of an RPC that ended without an answer: its deadline passed, or the client went away."""
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """The one place errors become status codes: handlers just raise. Every failure is logged once, and
    every finished RPC is counted exactly once, under the status it really ended with."""

    def __init__(self, metrics: Metrics | None = None):
        self.metrics = metrics

    def _count(self, method: str, code: str) -> None:
        if self.metrics is not None:
            self.metrics.on_request(method, code)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        wrap = dict(request_deserializer=_lenient(handler.request_deserializer, method),
                    response_serializer=_passing_bytes(handler.response_serializer))
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(request, context):
                async with self._answering(method, request, context):
                    return await inner_unary(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, **wrap)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                async with self._answering(method, request, context):
                    async for response in inner_stream(request, context):
                        yield response

            return grpc.unary_stream_rpc_method_handler(stream, **wrap)
        return handler

    @contextlib.asynccontextmanager
    async def _answering(self, method: str, request, context: grpc.aio.ServicerContext):
        """Around one RPC's handler: a request that did not parse is refused, an error ends the call with its status, and
        the call is counted once, under the code it ended with (also when a stream is cancelled or closed mid-way:
        CancelledError and GeneratorExit pass through to the count)."""
        code = None
        try:
            if isinstance(request, _Undecodable):
                raise InvalidArgument("request", request.reason)
            yield
            code = "OK"
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            status, message = self._refusal(method, exc)
            code = status.name
            await context.abort(status, message)
        finally:
            self._count(method, code or _ended_early(context))

    @staticmethod
    def _refusal(method: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
        """The status and message exc ends its RPC with, logged once (a traceback only for a bug: INTERNAL)."""
        code = next((c for kind, c in STATUS_OF.items() if isinstance(exc, kind)), grpc.StatusCode.INTERNAL)
        if code is grpc.StatusCode.INTERNAL:
            log.error("%s failed", method, exc_info=exc)
            return code, f"internal error: {exc}"
        log.info("%s refused: %s: %s", method, code.name, exc)
        return code, str(exc)


