"""The OpenAI-compatible HTTP API, served beside gRPC by the same process, event loop and engine.

    GET  /v1/models              the one model this server serves (its artifact directory's name)
    POST /v1/completions         text or token-id prompt
    POST /v1/chat/completions    a conversation, rendered by the model's chat template
    GET  /health                 200 when serving, 503 while loading or draining (no token needed)

`stream: true` answers with server-sent events ending in `data: [DONE]`; otherwise one JSON body; both report
`usage`. The same bearer tokens (`Authorization: Bearer`), TLS certificate and key, and limits as gRPC; errors are
OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`): 400 for a bad or unsupported parameter (named),
401, 404 for another model, 413 for a body over --max-message-bytes, 429 when the queue is full, 503 while loading
or draining. A client that disconnects has its sequence cancelled: its row is freed within a step.

Starlette for routing and responses, uvicorn for HTTP, run as a task on the gRPC server's loop (one engine, no
second process); uvicorn's own signal handling is left off, the server's handles SIGTERM for both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvserve.contract.chat import ChatMessage

from .engine import MAX_N, EngineError, InvalidArgument, QueueFull, Unavailable
from .sampling import MAX_SEED, SamplingParams
from .sequence import FinishReason, GenerationRequest
from .structured import FormatKind, ResponseFormat


FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.STOP_SEQUENCE: "stop", FinishReason.END_OF_SEQUENCE: "stop"}
# The status each refusal gets, and the gRPC code name the request metric counts it under (one label set for both APIs).
STATUS_CODES = {200: "OK", 400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED",
                429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "server_error"}
# Parameters the API defines that kvserve does not implement yet: refused by name with 400 when set to anything but
# their no-op value, never silently ignored.
NOT_YET = {"best_of": 1, "echo": False, "suffix": None, "tools": None, "tool_choice": None, "functions": None}
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "logprobs", "user",
          "presence_penalty", "frequency_penalty", "logit_bias", "min_p", "response_format"}
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs: alternatives a token, as OpenAI bounds it
ALLOWED = {"completions": COMMON | {"prompt"} | set(NOT_YET), "chat": COMMON | {"messages", "max_completion_tokens", "top_logprobs"} | set(NOT_YET)}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES[self.status], "param": self.param, "code": self.code}}


# The engine names gRPC's fields; an HTTP client is told the OpenAI parameter it sent.
PARAMS = {"max_new_tokens": "max_tokens", "prompt.text": "prompt", "prompt.token_ids": "prompt", "prompt.messages": "messages",
          "stop_sequences": "stop", "sampling.temperature": "temperature", "sampling.top_p": "top_p",
          "response_format.json_schema": "response_format", "response_format.json_object": "response_format"}


def _engine_error(exc: EngineError) -> ApiError:
    if isinstance(exc, InvalidArgument):
        return ApiError(400, str(exc), PARAMS.get(exc.field, exc.field.split("[")[0].replace("prompt.messages", "messages")), "invalid_value")
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


def _number(body: dict, name: str, default, low: float, high: float, kind=float):
    value = body.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise ApiError(400, f"{name} must be a{'n integer' if kind is int else ' number'}, got {json.dumps(value)}", name)
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be in [{low:g}, {high:g}], got {value}", name)
    return kind(value)


def parse(body, kind: str, model_name: str) -> Parsed:
    """The engine request for an OpenAI body (kind "completions" or "chat"); every refusal names its parameter."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - ALLOWED[kind])
    if unknown:
        raise ApiError(400, f"unsupported parameter: {unknown[0]}", unknown[0], "unsupported_parameter")
    for name, no_op in NOT_YET.items():
        if name in body and body[name] not in (no_op, None) and body[name] != {} and body[name] != []:
            raise ApiError(400, f"{name} is not supported by kvserve yet", name, "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: the name GET /v1/models lists", "model")
    if model != model_name:
        raise ApiError(404, f"the model {model!r} does not exist here; this server serves {model_name!r}", "model", "model_not_found")
    n = _number(body, "n", 1, 1, MAX_N, int)
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
    if not isinstance(bias, dict) or not all(isinstance(k, str) and k.isdigit() for k in bias):
        raise ApiError(400, "logit_bias must map token ids (as strings) to numbers", "logit_bias")
    logit_bias = tuple(sorted((int(k), _number(bias, k, 0.0, -100.0, 100.0)) for k in bias)) if len(bias) <= 300 else None
    if logit_bias is None:
        raise ApiError(400, f"logit_bias has {len(bias)} entries; at most 300", "logit_bias")
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=top_p, seed=seed, logit_bias=logit_bias,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0), frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
    )
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a string or a list of non-empty strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, "stream_options takes include_usage only", "stream_options")
    logprobs = body.get("logprobs")
    if kind == "chat":
        if logprobs not in (None, True, False):
            raise ApiError(400, "logprobs must be true or false", "logprobs")
        top = _number(body, "top_logprobs", 0, 0, 20, int)
        logprobs = bool(logprobs)
    else:  # an int: the sampled token's log-probability and this many alternatives
        top = 0 if logprobs is None else _number(body, "logprobs", 0, 0, MAX_COMPLETION_LOGPROBS, int)
        logprobs = logprobs is not None
    common = dict(max_new_tokens=max_tokens, sampling=sampling, stop_sequences=tuple(stop), return_logprobs=logprobs, top_logprobs=top,
                  response_format=_response_format(body.get("response_format")))
    if kind == "chat":
        request = GenerationRequest(prompt_messages=tuple(_messages(body.get("messages"))), **common)
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
    return Parsed(request, stream, bool(options.get("include_usage")), logprobs, n)


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
    if spec.get("strict") not in (None, True, False):
        raise ApiError(400, "response_format.json_schema.strict must be true or false", "response_format.json_schema.strict")
    return ResponseFormat(FormatKind.JSON_SCHEMA, json.dumps(spec["schema"]))


def _messages(messages) -> list[ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{index}] must be an object with a role", f"messages[{index}]")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, f"messages[{index}].content: only text parts are supported", f"messages[{index}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{index}].content must be a string", f"messages[{index}].content")
        out.append(ChatMessage(message["role"], content))
    return out


class HttpApi:
    """The HTTP side of one App: routes bound to its engine, a uvicorn server on the App's loop."""

    def __init__(self, app):
        self.app = app
        self.model_name = Path(app.options.artifact).resolve().name
        self.asgi = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ])
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
        options = self.app.options
        tls = {}
        if options.tls_cert:
            tls = dict(ssl_certfile=options.tls_cert, ssl_keyfile=options.tls_key)
            if options.tls_client_ca:
                tls.update(ssl_ca_certs=options.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(self.asgi, lifespan="off", log_level="warning", access_log=False, timeout_graceful_shutdown=1, **tls)
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
        tokens = self.app.tokens
        if tokens is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token or not tokens.accepts(token.strip().encode()):
            raise ApiError(401, "a valid bearer token is required (Authorization: Bearer TOKEN)", code="invalid_api_key")

    def _refusal(self, method: str, error: ApiError) -> JSONResponse:
        self.app.metrics.on_request(method, STATUS_CODES[error.status])
        return JSONResponse(error.body(), status_code=error.status)

    async def health(self, request: Request) -> Response:
        try:
            self.app.ready_engine()
        except Unavailable as exc:
            return JSONResponse({"status": "not serving", "reason": str(exc)}, status_code=503)
        return JSONResponse({"status": "serving"})

    async def models(self, request: Request) -> Response:
        try:
            self._authorized(request)
        except ApiError as error:
            return self._refusal("Models", error)
        self.app.metrics.on_request("Models", "OK")
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvserve"}]})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions", "Completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat", "ChatCompletions")

    async def _body(self, request: Request) -> dict:
        limit = self.app.options.max_message_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body has {declared} bytes; at most {limit} (--max-message-bytes)", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body has more than {limit} bytes (--max-message-bytes)", code="request_too_large")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not JSON: {exc}") from None

    async def _generate(self, request: Request, kind: str, method: str) -> Response:
        events = None
        try:
            self._authorized(request)
            engine = self.app.ready_engine()
            parsed = parse(await self._body(request), kind, self.model_name)
            events = engine.generate_n(parsed.request, parsed.n)
            # every completion admitted (or the request refused: bad prompt, full queue) before a response starts
            first = await _unless_disconnected(request, anext(events))
        except ApiError as error:
            return self._refusal(method, error)
        except EngineError as exc:
            return self._refusal(method, _engine_error(exc))
        except StopAsyncIteration:  # the engine ended the stream without a token: not expected
            return self._refusal(method, ApiError(500, "the generation ended without a token", code="internal_error"))
        except ClientGone:  # before its first token (waiting for a row, or prefilling): the sequences are cancelled
            self.app.metrics.on_request(method, "CANCELLED")
            return Response(status_code=499)
        ids = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}"
        if parsed.stream:
            return StreamingResponse(self._stream(events, first, parsed, kind, method, ids), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._whole(request, events, first, parsed, kind, method, ids)

    def _logprobs(self, kind: str, events: list) -> dict:
        """The choice's logprobs object for events (a whole answer's, or one streamed token's)."""
        pieces = self.app.engine.tokenizer.pieces
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

    @staticmethod
    def _usage(finishes: list) -> dict:
        prompt = finishes[0].prompt_tokens  # one prompt, counted once
        completion = sum(f.generated_tokens for f in finishes)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": min(f.cached_prompt_tokens for f in finishes)}}

    async def _whole(self, request: Request, events, first, parsed: Parsed, kind: str, method: str, ids: str) -> Response:
        """Every token of every completion, then one body; a client that goes away first cancels the sequences."""
        collected: list[list] = [[] for _ in range(parsed.n)]
        collected[first[0]].append(first[1])

        async def rest():
            async for index, event in events:
                collected[index].append(event)

        try:
            await _unless_disconnected(request, rest())
        except ClientGone:  # the sequences are cancelled: their rows are freed at the next step
            self.app.metrics.on_request(method, "CANCELLED")
            return Response(status_code=499)
        except EngineError as exc:
            return self._refusal(method, _engine_error(exc))
        finally:
            await events.aclose()
        choices = []
        for index, completion in enumerate(collected):
            text = "".join(event.text for event in completion)
            choice = {"index": index, "logprobs": self._logprobs(kind, completion) if parsed.logprobs else None,
                      "finish_reason": FINISH_REASONS[completion[-1].finish.reason]}
            choice.update({"message": {"role": "assistant", "content": text}} if kind == "chat" else {"text": text})
            choices.append(choice)
        self.app.metrics.on_request(method, "OK")
        return JSONResponse({"id": ids, "object": "chat.completion" if kind == "chat" else "text_completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices, "usage": self._usage([c[-1].finish for c in collected])})

    async def _stream(self, events, first, parsed: Parsed, kind: str, method: str, ids: str):
        """Server-sent events: a chunk a token (of whichever completion made it), each completion's last with its finish
        reason, usage if asked, then [DONE]. Closed early (the client went away), every sequence is cancelled."""
        created, obj = int(time.time()), "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(choices, usage=None) -> str:
            body = {"id": ids, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if parsed.include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        async def everything():
            yield first
            async for item in events:
                yield item

        code, finishes = "OK", {}
        try:
            if kind == "chat":
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                             for i in range(parsed.n)])
            async for index, event in everything():
                reason = FINISH_REASONS[event.finish.reason] if event.finish is not None else None
                choice = {"index": index, "logprobs": self._logprobs(kind, [event]) if parsed.logprobs else None, "finish_reason": reason}
                choice.update({"delta": {"content": event.text}} if kind == "chat" else {"text": event.text})
                yield chunk([choice])
                if event.finish is not None:
                    finishes[index] = event.finish
            if parsed.include_usage:
                yield chunk([], self._usage([finishes[i] for i in range(parsed.n)]))
            yield "data: [DONE]\n\n"
        except EngineError as exc:  # the response has started: the error goes in the stream
            error = _engine_error(exc)
            code = STATUS_CODES[error.status]
            yield f"data: {json.dumps(error.body())}\n\n"
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            await events.aclose()
            self.app.metrics.on_request(method, code)


class ClientGone(Exception):
    """The client disconnected before its answer started."""


async def _unless_disconnected(request: Request, awaitable):
    """awaitable's result, or ClientGone when the client disconnects first (awaitable is then cancelled)."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        raise ClientGone()
    return work.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: the gRPC server's own handle SIGTERM and drain both APIs."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
