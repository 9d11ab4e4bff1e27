"""The gRPC edge: a thin servicer (protobuf <-> engine domain), one interceptor that maps errors to status
codes and logs them, and the server's lifecycle: bind (TLS, tokens, reflection, health, metrics) with health
NOT_SERVING, bring the model up (loading.py), serve, drain, stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserve.contract.chat import ChatMessage
from kvserve.errors import UserError
from kvserve.runtime import DecoderRuntime
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

from .engine import Engine, InvalidArgument, QueueFull, Unavailable
from .gate import GateResult
from .http_api import HttpApi
from .limits import TRANSPORT_METADATA_BYTES
from .loading import load_model, open_servable
from .metrics import Metrics
from .options import ServerOptions
from .sampling import SamplingParams
from .security import MetadataLimitInterceptor, TokenAuthInterceptor, TokenFile, server_credentials
from .sequence import FinishReason, GenerationRequest, StepEvent
from .structured import FormatKind, ResponseFormat
from .tokenizing import TokenizeProcess

log = logging.getLogger("kvserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
# gRPC's own metadata limits, raised above limits.MAX_METADATA_BYTES so ours (with a message) is the one a client meets.
TRANSPORT_METADATA = [("grpc.max_metadata_size", TRANSPORT_METADATA_BYTES), ("grpc.absolute_max_metadata_size", TRANSPORT_METADATA_BYTES)]
FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.END_OF_SEQUENCE: pb.FINISH_REASON_END_OF_SEQUENCE,
}
STATUS_OF = {InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT, QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED, Unavailable: grpc.StatusCode.UNAVAILABLE}


class ListenFailed(UserError):
    """The gRPC port could not be bound."""


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
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(request, context):
                code = None
                try:
                    if isinstance(request, _Undecodable):
                        raise InvalidArgument("request", request.reason)
                    response = await inner_unary(request, context)
                    code = "OK"
                    return response
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    status, message = self._refusal(method, exc)
                    code = status.name
                    await context.abort(status, message)
                finally:
                    self._count(method, code or _ended_early(context))

            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=_lenient(handler.request_deserializer, method),
                response_serializer=_passing_bytes(handler.response_serializer),
            )
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                code = None
                try:
                    if isinstance(request, _Undecodable):
                        raise InvalidArgument("request", request.reason)
                    async for response in inner_stream(request, context):
                        yield response
                    code = "OK"
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    status, message = self._refusal(method, exc)
                    code = status.name
                    await context.abort(status, message)
                finally:  # also when the stream is cancelled or closed mid-way (CancelledError, GeneratorExit)
                    self._count(method, code or _ended_early(context))

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=_lenient(handler.request_deserializer, method),
                response_serializer=_passing_bytes(handler.response_serializer),
            )
        return handler

    @staticmethod
    def _refusal(method: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
        """The status and message exc ends its RPC with, logged once (a traceback only for a bug: INTERNAL)."""
        code = next((c for kind, c in STATUS_OF.items() if isinstance(exc, kind)), grpc.StatusCode.INTERNAL)
        if code is grpc.StatusCode.INTERNAL:
            log.error("%s failed", method, exc_info=exc)
            return code, f"internal error: {exc}"
        log.info("%s refused: %s: %s", method, code.name, exc)
        return code, str(exc)


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    """protobuf -> engine domain -> protobuf; nothing else."""

    def __init__(self, app: "App"):
        self.app = app

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        engine = self.app.ready_engine()
        if request.n <= 1:
            async with contextlib.aclosing(engine.generate(_to_domain(request))) as events:
                async for event in events:
                    yield _to_proto(event, engine.tokenizer)
            return
        async with contextlib.aclosing(engine.generate_n(_to_domain(request), request.n)) as events:
            async for index, event in events:
                response = _to_proto(event, engine.tokenizer)
                response.index = index
                yield response

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        self.app.ready_engine().check_text("text", request.text)
        return await self.app.tokenizing.respond(request.text)  # the serialized response: bytes pass through

    async def GetModelInfo(self, request, context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        app = self.app
        engine = app.ready_engine()
        config = app.artifact.config
        stats = engine.stats()
        return pb.GetModelInfoResponse(
            config=pb.ModelConfig(
                vocab_size=config.vocab_size, context_length=config.n_ctx, d_model=config.d_model,
                num_heads=config.n_head, num_layers=config.n_layer, eos_token_id=config.eos_token_id,
                architecture=config.architecture, model_type=config.model_type, num_key_value_heads=config.n_kv_head,
                head_dim=config.head_dim, eos_token_ids=config.eos_token_ids,
            ),
            manifest_sha256=app.artifact.manifest_sha256,
            dtype=app.artifact.dtype,
            execution_provider=app.runtime.provider,
            provider_note="; ".join(note for note in (app.runtime.fallback_reason, app.runtime.cuda_graph_note) if note),
            limits=pb.Limits(
                max_batch_size=engine.limits.max_batch_size, max_queue=engine.limits.max_queue, max_total_tokens=engine.config.n_ctx,
                step_token_budget=engine.limits.step_token_budget, max_stop_sequences=engine.limits.max_stop_sequences,
                max_stop_length=engine.limits.max_stop_length, max_text_bytes=engine.limits.max_text_bytes,
                max_message_bytes=app.options.max_message_bytes, max_chat_messages=engine.limits.max_chat_messages,
                max_response_format_bytes=engine.limits.max_response_format_bytes,
            ),
            live=pb.LiveCounts(
                active_sequences=stats["active"], queued_sequences=stats["queued"], kv_slots_in_use=stats["active"], cached_rows=stats["cached"],
                kv_cache_bytes=stats["kv_bytes"],
                sequences=[pb.SequenceKv(sequence_id=i, tokens=t, kv_cache_bytes=b) for i, t, b in stats["sequences"]],
            ),
            parity_gate=pb.ParityGate(passed=app.gate.passed, overridden=app.gate.overridden, summary=app.gate.summary),
            tokenizer=engine.tokenizer.name,
            kv_cache=app.artifact.kv_cache,
            attention=app.artifact.attention,
            chat=engine.chat_template is not None,
        )


def _to_domain(request: pb.GenerateRequest) -> GenerationRequest:
    sampling = request.sampling
    prompt = request.WhichOneof("prompt")
    return GenerationRequest(
        prompt_text=request.text if prompt == "text" else None,
        prompt_ids=tuple(request.token_ids.ids) if prompt == "token_ids" else None,
        prompt_messages=tuple(ChatMessage(m.role, m.content) for m in request.messages.messages) if prompt == "messages" else None,
        max_new_tokens=request.max_new_tokens,
        sampling=SamplingParams(
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p or 1.0,
            repetition_penalty=sampling.repetition_penalty or 1.0,
            seed=sampling.seed,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            min_p=sampling.min_p,
            logit_bias=tuple(sorted(sampling.logit_bias.items())),
        ),
        stop_sequences=tuple(request.stop_sequences),
        stop_token_ids=tuple(request.stop_token_ids),
        return_logprobs=request.return_logprobs,
        top_logprobs=request.top_logprobs,
        ignore_eos=request.ignore_eos,
        response_format=_response_format(request.response_format) if request.HasField("response_format") else None,
    )


FORMAT_KINDS = {"json_schema": FormatKind.JSON_SCHEMA, "json_object": FormatKind.JSON_OBJECT, "regex": FormatKind.REGEX,
                "lark_grammar": FormatKind.GRAMMAR}


def _response_format(message: pb.ResponseFormat) -> ResponseFormat:
    kind = message.WhichOneof("format")
    if kind is None:
        raise InvalidArgument("response_format", "set one of json_schema, json_object, regex or lark_grammar")
    return ResponseFormat(FORMAT_KINDS[kind], "" if kind == "json_object" else getattr(message, kind))


def _to_proto(event: StepEvent, tokenizer) -> pb.GenerateResponse:
    response = pb.GenerateResponse(token=pb.Token(id=event.token_id, text_delta=event.text, logprob=event.logprob))
    if event.top_logprobs:
        pieces = tokenizer.pieces([token for token, _ in event.top_logprobs])
        response.token.top_logprobs.extend(
            pb.TopLogprob(id=token, text=piece, logprob=logprob) for (token, logprob), piece in zip(event.top_logprobs, pieces))
    finish = event.finish
    if finish is not None:
        response.finish.CopyFrom(
            pb.FinishDetails(
                reason=FINISH_REASONS[finish.reason], prompt_tokens=finish.prompt_tokens, generated_tokens=finish.generated_tokens,
                time_to_first_token_ns=finish.time_to_first_token_ns, total_ns=finish.total_ns, stop_sequence=finish.stop_sequence,
                cached_prompt_tokens=finish.cached_prompt_tokens,
            )
        )
    return response


class App:
    """The running server: gRPC first (health NOT_SERVING), then model load, gate and warm-up, then SERVING."""

    def __init__(self, options: ServerOptions):
        self.options = options
        self.artifact = None
        self.runtime: DecoderRuntime | None = None
        self.engine: Engine | None = None
        self.steps = None  # the step thread (scheduler.step_thread), made in load(), closed after the engine
        self.tokenizing: TokenizeProcess | None = None  # answers Tokenize calls (tokenizing.py), started in load()
        self.gate = GateResult(False, "not run yet")
        self.health: health.aio.HealthServicer | None = None  # both made in start(), on the serving loop
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        self.metrics = Metrics()
        self.metrics_port: int | None = None
        self.tokens: TokenFile | None = None
        self.http: HttpApi | None = None  # the OpenAI-compatible API, when options.http_port is set
        self.http_port: int | None = None
        self._draining = False

    def reload_tokens(self) -> None:
        """SIGHUP: read the token file again; a file that cannot be used keeps the tokens in force."""
        if self.tokens is None:
            return
        try:
            self.tokens.reload()
        except UserError as exc:
            log.error("keeping the tokens in force: %s", exc)

    def ready_engine(self) -> Engine:
        if self._draining:
            raise Unavailable("the server is shutting down")
        if self.engine is None:
            raise Unavailable("the model is still loading")
        return self.engine

    async def start(self) -> int:
        """Check the artifact's files, bind metrics and gRPC (health NOT_SERVING); a bad artifact or a taken
        port is refused before anything listens."""
        self.artifact = await asyncio.to_thread(open_servable, self.options.artifact)
        credentials = server_credentials(self.options.tls_cert, self.options.tls_key, self.options.tls_client_ca)
        self.tokens = TokenFile(self.options.auth_tokens) if self.options.auth_tokens else None
        if self.options.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve_http(self.options.host, self.options.metrics_port)
            except OSError as exc:
                raise ListenFailed(f"cannot serve metrics on {self.options.host}:{self.options.metrics_port} ({exc.strerror or exc})") from None
        self.health = health.aio.HealthServicer()
        # No SO_REUSEPORT: a second server on a taken port must fail, not silently share its traffic.
        self.server = grpc.aio.server(
            interceptors=[MetadataLimitInterceptor(self.metrics), TokenAuthInterceptor(self.tokens, self.metrics), ErrorInterceptor(self.metrics)],
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", self.options.max_message_bytes), *TRANSPORT_METADATA],
        )
        pb_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(self), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.options.reflection:
            reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        address = f"{self.options.host}:{self.options.port}"
        try:
            if credentials is not None:
                self.port = self.server.add_secure_port(address, credentials)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpc's message says only "Failed to bind"
            self.port = 0
        if self.port == 0:
            self.metrics.close()
            raise ListenFailed(f"cannot listen on {address} (in use, or not an address of this host)")
        http_socket = None
        if self.options.http_port is not None:
            self.http = HttpApi(self)
            try:
                http_socket = self.http.bind(self.options.host, self.options.http_port)
            except OSError as exc:
                self.metrics.close()
                raise ListenFailed(f"cannot serve HTTP on {self.options.host}:{self.options.http_port} ({exc.strerror or exc})") from None
        if self.options.health_port is not None:
            self.health_server = grpc.aio.server(interceptors=[MetadataLimitInterceptor()], options=[("grpc.so_reuseport", 0), *TRANSPORT_METADATA])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            health_address = f"{self.options.host}:{self.options.health_port}"
            try:
                self.health_port = self.health_server.add_insecure_port(health_address)
            except RuntimeError:
                self.health_port = 0
            if self.health_port == 0:
                self.metrics.close()
                raise ListenFailed(f"cannot serve health on {health_address} (in use, or not an address of this host)")
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        if self.http is not None:
            self.http_port = await self.http.start(http_socket)
        log.info(
            "listening on %s:%d (%s%s; NOT_SERVING until the model is loaded and checked)", self.options.host, self.port,
            "mutual TLS" if self.options.tls_client_ca else ("TLS" if credentials is not None else "plaintext"),
            ", bearer tokens required" if self.tokens is not None else "",
        )
        if self.metrics_port is not None:
            log.info("metrics on http://%s:%d/metrics", self.options.host, self.metrics_port)
        if self.health_port is not None:
            log.info("health only, plaintext, on %s:%d", self.options.host, self.health_port)
        if self.http_port is not None:
            log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if credentials is not None else "http", self.options.host, self.http_port)
        return self.port

    async def load(self) -> None:
        """Bring the model up (loading.py: session, parity gate, serving batch, warm-up); then serve."""
        options = self.options
        if self.artifact is None:
            self.artifact = await asyncio.to_thread(open_servable, options.artifact)
        loaded = await load_model(options, self.artifact, self._noted_provider)
        self.runtime, self.gate, self.steps = loaded.runtime, loaded.gate, loaded.steps
        self.tokenizing = TokenizeProcess(self.artifact.tokenizer_path)
        engine = Engine(loaded.runtime, loaded.config, loaded.tokenizer, options.limits, self.metrics, batch=loaded.batch, step_thread=loaded.steps,
                        chat_template=loaded.chat_template)
        engine.start()
        self.engine = engine
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        config = loaded.config
        log.info(
            "SERVING %s (%s %s, %d layers, %d K/V heads, batch <= %d, %d tokens a sequence)",
            options.artifact, config.model_type, self.artifact.dtype, config.n_layer, config.n_kv_head, options.limits.max_batch_size, config.n_ctx,
        )

    def _noted_provider(self, runtime: DecoderRuntime) -> None:
        """Once the session is open, before the gate: which provider serves, in the log and the metrics."""
        self.runtime = runtime
        self.metrics.execution_provider.labels(provider=runtime.provider).set(1)

    async def shutdown(self) -> None:
        """NOT_SERVING first, refuse new requests, let in-flight streams finish within the grace period."""
        self._draining = True
        await self.health.enter_graceful_shutdown()
        if self.engine is not None:
            self.engine.stop_accepting()
            drained = await self.engine.drain(self.options.drain_seconds)
            if not drained:
                log.warning("grace period of %gs over; ending the streams still running with UNAVAILABLE", self.options.drain_seconds)
                await self.engine.stop_streams(
                    f"the server stopped before this stream finished (its {self.options.drain_seconds:g}s drain period ran out)"
                )
        await self.server.stop(grace=1.0)
        if self.health_server is not None:
            await self.health_server.stop(grace=None)
        if self.http is not None:
            await self.http.stop()
        if self.engine is not None:
            await self.engine.close()
        if self.tokenizing is not None:
            self.tokenizing.close()
        if self.steps is not None:
            self.steps.shutdown(wait=False)  # a load cancelled by a signal may still be running a gate or warm-up step
        self.metrics.close()
        log.info("stopped")


async def serve(options: ServerOptions) -> int:
    """Run until SIGTERM or SIGINT, then drain and return 0."""
    app = App(options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, app.reload_tokens)
    await app.start()
    loader = asyncio.create_task(app.load())
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({loader, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if loader.done() and loader.exception() is not None:
        await app.server.stop(grace=None)
        if app.health_server is not None:
            await app.health_server.stop(grace=None)
        raise loader.exception()
    await waiter
    if not loader.done():
        loader.cancel()
    log.info("signal received: draining (up to %.0fs)", options.drain_seconds)
    await app.shutdown()
    return 0
