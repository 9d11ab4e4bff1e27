"""The OpenAI-compatible API's HTTP transport, served beside gRPC by the same process, event loop and engine.

    GET  /v1/models                          the one model this server serves (its artifact directory's name)
    POST /v1/completions                     text or token-id prompt
    POST /v1/chat/completions                a conversation, rendered by the model's chat template
    POST /v1/completions/render, /v1/chat/completions/render
                                             the token ids a request would be prefilled with (vLLM's, for llm-d's router)
    POST /v1/responses                       OpenAI's Responses API (http_responses.py), through the chat request it amounts to
    GET  /v1/responses/{id}[/input_items], DELETE /v1/responses/{id}
                                             a stored response, its input, its deletion
    GET  /health                             200 when serving, 503 while loading or draining (no token needed)
    GET  /metrics                            the inference gateway's gauges (no token needed)

`stream: true` answers with server-sent events ending in `data: [DONE]`; otherwise one JSON body; both report
`usage`. The same bearer tokens (security.TokenFile, the check gRPC makes), TLS certificate and key, and limits as
gRPC. What a body means and what an answer says is the protocol's (openai_protocol.py); this module reads bodies,
routes, watches for clients that leave (a client that disconnects has its sequences cancelled: their rows are
freed within a step) and writes responses.

Starlette for routing and responses, uvicorn for HTTP, run as a task on the gRPC server's loop (one engine, no
second process); uvicorn's own signal handling is left off, the server's handles SIGTERM for both.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..core.engine import Engine
from ..core.engine_errors import EngineError, Unavailable
from .http_connections import bounded_protocol
from .http_disconnect import ClientGone, unless_disconnected
from .metrics import Metrics
from .openai_answers import STREAM_END, object_name, opening_choices, sse, token_choice, usage, whole_body
from .openai_errors import STATUS_CODES, ApiError, api_error, shown
from .openai_protocol import parse_body
from .openai_sampling import Parsed
from .http_responses import ResponsesEndpoints
from .openai_responses import ResponseStore
from ..process.options import ServerOptions
from .security import TokenFile
from .tokenizing import TokenizeProcess

log = logging.getLogger("kvserve.http")


# A body up to this size is parsed on the event loop (well under a millisecond); a larger one by the input worker
# process (tokenizing.py), whose round trip costs a small body more than its parsing.
INLINE_BODY_BYTES = 64 * 1024


class HttpApi(ResponsesEndpoints):
    """The HTTP side of one server: routes bound to its engine (asked for per request: ready_engine raises Unavailable
    while loading or draining), a uvicorn server on the server's loop."""

    def __init__(self, ready_engine: Callable[[], Engine], ready_inputs: Callable[[], TokenizeProcess], options: ServerOptions,
                 tokens: TokenFile | None, metrics: Metrics):
        """ready_engine, ready_inputs: the engine and the input worker (tokenizing.py), once the model is loaded."""
        self.ready_engine, self.ready_inputs, self.options, self.tokens, self.metrics = ready_engine, ready_inputs, options, tokens, metrics
        self.model_name = Path(options.artifact).resolve().name
        self.stored = ResponseStore(options.limits.max_stored_responses)  # previous_response_id's (openai_responses.py)
        self.asgi = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus_metrics, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions/render", self.render_completions, methods=["POST"]),
            Route("/v1/chat/completions/render", self.render_chat_completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.stored_response, methods=["GET", "DELETE"]),
            Route("/v1/responses/{response_id}/input_items", self.response_input_items, methods=["GET"]),
        ], exception_handlers={HTTPException: self._unrouted})
        # A path with a slash too many is refused as any unrouted path is (its 404 names the path meant), not redirected:
        # a redirect is no OpenAI error, and its Location is built from the Host header a gateway may have rewritten.
        self.asgi.router.redirect_slashes = False
        self.paths = [route.path for route in self.asgi.routes]
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    # --- lifecycle ------------------------------------------------------------------------------------------

    def bind(self, host: str, port: int) -> socket.socket:
        """The listening socket, bound now, so a taken port is refused before anything serves."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: without it a token's event waits for the client's delayed ACK of the
        # headers (Nagle's algorithm), 40 ms on Linux (bench/http_load.py measured +43.7 ms to first token).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
        return sock

    async def start(self, sock: socket.socket) -> int:
        options = self.options
        tls = {}
        if options.tls_cert:
            tls = dict(ssl_certfile=options.tls_cert, ssl_keyfile=options.tls_key)
            if options.tls_client_ca:
                tls.update(ssl_ca_certs=options.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        limits = options.limits
        config = uvicorn.Config(
            self.asgi, lifespan="off", log_level="warning", access_log=False, timeout_graceful_shutdown=1,
            http=bounded_protocol(limits.header_timeout_seconds, limits.body_timeout_seconds, limits.max_connections,
                                  limits.max_connections_per_address),
            timeout_keep_alive=limits.idle_timeout_seconds, **tls,
        )
        self._server = _QuietServer(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]), name="kvserve-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # its failure, raised here
            await asyncio.sleep(0.01)
        return sock.getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task

    # --- the routes -------------------------------------------------------------------------------------------

    def _authorized(self, request: Request) -> None:
        if self.tokens is None:
            return
        reason = self.tokens.refusal(request.headers.get("authorization", ""))
        if reason is not None:
            raise ApiError(401, f"{reason} (Authorization: Bearer TOKEN)", code="invalid_api_key")

    def _refusal(self, method: str, error: ApiError) -> JSONResponse:
        self.metrics.on_request(method, STATUS_CODES[error.status])
        return JSONResponse(error.body(), status_code=error.status)

    async def _unrouted(self, request: Request, exc: HTTPException) -> Response:
        """A path this API does not serve (404) or a method its path does not take (405), as an OpenAI error."""
        if exc.status_code == 405:
            error = ApiError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
        else:
            path = request.url.path
            meant = path.rstrip("/") if path.rstrip("/") in self.paths else None
            error = ApiError(404, f"no route {path}: " + (f"without the trailing slash, {meant}" if meant else
                             "this server serves " + ", ".join(self.paths)), code="not_found")
        return JSONResponse(error.body(), status_code=error.status, headers=getattr(exc, "headers", None))

    async def health(self, request: Request) -> Response:
        try:
            self.ready_engine()
        except Unavailable as exc:
            return JSONResponse({"status": "not serving", "reason": str(exc)}, status_code=503)
        return JSONResponse({"status": "serving"})

    async def prometheus_metrics(self, request: Request) -> Response:
        """The inference gateway's gauges on the API port: where its endpoint picker scrapes them (its InferencePool's
        target port; docs/deployment.md). The whole set is on --metrics-port. Unauthenticated, as /health and the
        metrics port are."""
        return Response(self.metrics.gateway_exposition(), media_type=self.metrics.content_type)

    async def models(self, request: Request) -> Response:
        try:
            self._authorized(request)
        except ApiError as error:
            return self._refusal("Models", error)
        self.metrics.on_request("Models", "OK")
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvserve"}]})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions", "Completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat", "ChatCompletions")

    async def _body(self, request: Request, limits) -> bytes:
        """The request's body, read whole within --max-message-bytes (the input worker parses it: parse_body).
        Only application/json is read: a browser sends that cross-origin only after a preflight this API never answers,
        so a web page cannot spend the server's compute through its visitors."""
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            raise ApiError(415, f"the request body must be JSON sent as Content-Type: application/json, not {shown(media_type or 'none')}",
                           code="unsupported_media_type")
        limit = limits.max_message_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body has {declared} bytes; at most {limit} (--max-message-bytes)", code="request_too_large")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the request body has more than {limit} bytes (--max-message-bytes)", code="request_too_large")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone() from None
        return b"".join(chunks)

    async def render_completions(self, request: Request) -> Response:
        return await self._render(request, "completions", "RenderCompletions")

    async def render_chat_completions(self, request: Request) -> Response:
        return await self._render(request, "chat", "RenderChatCompletions")

    async def _parsed(self, request: Request, kind: str, engine: Engine) -> Parsed:
        """The request's body read and parsed as kind (in the input worker when large)."""
        raw = await self._body(request, engine.limits)
        if len(raw) <= INLINE_BODY_BYTES:
            return parse_body(raw, kind, self.model_name, engine.limits, engine.config.n_ctx)
        return await self.ready_inputs().parse_body(raw, kind, self.model_name, engine.limits, engine.config.n_ctx)

    async def _render(self, request: Request, kind: str, method: str) -> Response:
        """vLLM's render endpoints, which llm-d's router calls to tokenize a request as the server it routes to would:
        the body of a completions or chat request, answered with its prompt's token ids (and text) as generating it
        would have them, refused as generating it would be. Completions answer a list (one item a prompt), chat an object."""
        try:
            self._authorized(request)
            engine = self.ready_engine()
            parsed = await self._parsed(request, kind, engine)
            text, token_ids = await engine.render(parsed.request)
        except ApiError as error:
            return self._refusal(method, error)
        except EngineError as exc:
            return self._refusal(method, api_error(exc))
        except ClientGone:
            self.metrics.on_request(method, "CANCELLED")
            return Response(status_code=499)
        self.metrics.on_request(method, "OK")
        rendered = {"request_id": f"render-{secrets.token_hex(12)}", "model": self.model_name, "token_ids": token_ids, "prompt": text}
        return JSONResponse([rendered] if kind == "completions" else rendered)

    async def _generate(self, request: Request, kind: str, method: str) -> Response:
        events = None
        try:
            self._authorized(request)
            engine = self.ready_engine()
            parsed = await self._parsed(request, kind, engine)
            if "traceparent" in request.headers:  # the caller's W3C trace context, for --otlp-traces-endpoint
                parsed = dataclasses.replace(parsed, request=dataclasses.replace(
                    parsed.request, traceparent=request.headers["traceparent"], tracestate=request.headers.get("tracestate")))
            # streamed: the tokens of a completion ready together go out in one chunk (fewer writes when the loop is busy)
            events = engine.generate_n(parsed.request, parsed.n, batched=parsed.stream)
            # every completion admitted (or the request refused: bad prompt, full queue) before a response starts
            first = await unless_disconnected(request, anext(events))
        except ApiError as error:
            return self._refusal(method, error)
        except EngineError as exc:
            return self._refusal(method, api_error(exc))
        except StopAsyncIteration:  # the engine ended the stream without a token: not expected
            return self._refusal(method, ApiError(500, "the generation ended without a token", code="internal_error"))
        except ClientGone:  # mid-body, or before its first token (waiting for a row, or prefilling): nothing left running
            log.info("%s: the client left before its answer started", method)
            self.metrics.on_request(method, "CANCELLED")
            return Response(status_code=499)
        ids = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}"
        pieces = engine.tokenizer.pieces
        if parsed.stream:
            return StreamingResponse(self._stream(events, first, parsed, kind, method, ids, pieces), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._whole(request, events, first, parsed, kind, method, ids, pieces)

    async def _whole(self, request: Request, events, first, parsed: Parsed, kind: str, method: str, ids: str, pieces) -> Response:
        """Every token of every completion, then one body; a client that goes away first cancels the sequences."""
        collected: list[list] = [[] for _ in range(parsed.n)]
        collected[first[0]].append(first[1])

        refused = await self._drain(request, events, lambda item: collected[item[0]].append(item[1]), method)
        if refused is not None:
            return refused
        self.metrics.on_request(method, "OK")
        return JSONResponse(whole_body(ids, kind, self.model_name, int(time.time()), collected, parsed, pieces))

    async def _drain(self, request: Request, events, take, method: str, refusal=api_error) -> Response | None:
        """Every event left, each to take; the refusal to answer instead (None: all taken): 499 when the client goes
        away first (the sequences are cancelled, their rows freed at the next step), or the engine's error as refusal
        words it."""
        async def rest():
            async for event in events:
                take(event)

        try:
            await unless_disconnected(request, rest())
        except ClientGone:
            self.metrics.on_request(method, "CANCELLED")
            return Response(status_code=499)
        except EngineError as exc:
            return self._refusal(method, refusal(exc))
        finally:
            await events.aclose()
        return None

    async def _stream(self, events, first, parsed: Parsed, kind: str, method: str, ids: str, pieces):
        """Server-sent events: a chunk for the tokens of a completion ready together (one, mostly), each completion's
        last with its finish reason, usage if asked, then [DONE]. Closed early (the client went away), every sequence is
        cancelled. events: generate_n's, batched."""
        created, obj = int(time.time()), object_name(kind, True)

        prompt, generated = first[1][0].prompt_tokens, 0  # the usage so far, for continuous_usage_stats

        def chunk(choices, usage_body=None) -> str:
            body = {"id": ids, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if parsed.include_usage:
                body["usage"] = usage_body
                if usage_body is None and parsed.continuous_usage:
                    body["usage"] = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
            return sse(body)

        async def everything():
            yield first
            async for item in events:
                yield item

        code, finishes = "OK", {}
        try:
            if kind == "chat":
                yield chunk(opening_choices(parsed.n))
            async for index, batch in everything():
                generated += len(batch)
                yield chunk([token_choice(kind, index, batch, parsed, pieces)])
                if batch[-1].finish is not None:
                    finishes[index] = batch[-1].finish
            if parsed.include_usage:
                yield chunk([], usage([finishes[i] for i in range(parsed.n)]))
            yield STREAM_END
        except EngineError as exc:  # the response has started: the error goes in the stream
            error = api_error(exc)
            code = STATUS_CODES[error.status]
            yield sse(error.body())
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            await events.aclose()
            self.metrics.on_request(method, code)


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: the gRPC server's own handle SIGTERM and drain both APIs."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
