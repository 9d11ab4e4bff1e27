"""The process: the composition root of a server. Bind gRPC (TLS, tokens, reflection, health, metrics) and HTTP with
health NOT_SERVING, bring the model up (loading.py), serve, drain, stop. The edges it wires (grpc_servicer.py,
http_api.py) translate protocols and ask it for the engine; nothing else reaches into it."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserve.errors import UserError
from kvserve.runtime import DecoderRuntime
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

from ..core.engine import Engine
from ..core.engine_errors import Unavailable
from ..edges.grpc_errors import ErrorInterceptor
from ..edges.grpc_servicer import GenerationServicer
from ..core.limits import TRANSPORT_METADATA_BYTES
from .loading import load_model, open_servable, served_config
from ..core.prompt_cache import BLOCK_TOKENS
from ..edges.metrics import Metrics
from ..core.model_info import GateResult, ModelInfo
from .options import ServerOptions
from ..edges.security import MetadataLimitInterceptor, TokenAuthInterceptor, TokenFile, server_credentials
from ..edges.tokenizing import TokenizeProcess

if TYPE_CHECKING:  # imported when --http-port is given: Starlette and uvicorn cost a start 45 ms (bench/startup.py)
    from ..edges.http_api import HttpApi

log = logging.getLogger("kvserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
# gRPC's own metadata limits, raised above limits.MAX_METADATA_BYTES so ours (with a message) is the one a client meets.
TRANSPORT_METADATA = [("grpc.max_metadata_size", TRANSPORT_METADATA_BYTES), ("grpc.absolute_max_metadata_size", TRANSPORT_METADATA_BYTES)]


def connection_bounds(limits) -> list[tuple[str, int]]:
    """gRPC's channel arguments for the declared waits: a connection's handshake within the header timeout, and one with
    no call in flight closed after the idle timeout (a stream in flight is never cut). No SO_REUSEPORT: a second server
    on a taken port must fail, not silently share its traffic."""
    return [("grpc.so_reuseport", 0), ("grpc.server_handshake_timeout_ms", 1000 * limits.header_timeout_seconds),
            ("grpc.max_connection_idle_ms", 1000 * limits.idle_timeout_seconds), *TRANSPORT_METADATA]


class ListenFailed(UserError):
    """A port (gRPC, HTTP, health or metrics) could not be bound."""


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
        self.tracer = None  # tracing.RequestTracer with --otlp-traces-endpoint
        self.kv_events = None  # kv_events.KvEventPublisher with --kv-events
        self.metrics_port: int | None = None
        self.gateway_metrics_port: int | None = None
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

    def ready_tokenizing(self) -> TokenizeProcess:
        self.ready_engine()
        return self.tokenizing

    def model_info(self) -> ModelInfo:
        """What GetModelInfo reports: the model, how it runs, the limits in force and the load now."""
        engine, artifact, runtime = self.ready_engine(), self.artifact, self.runtime
        return ModelInfo(
            config=artifact.config, max_total_tokens=engine.config.n_ctx, manifest_sha256=artifact.manifest_sha256,
            dtype=artifact.dtype, kv_dtype=artifact.kv_dtype, kv_cache=artifact.kv_cache, attention=artifact.attention, provider=runtime.provider,
            provider_note="; ".join(note for note in (runtime.fallback_reason, runtime.cuda_graph_note) if note),
            limits=engine.limits, live=engine.live(), gate=self.gate, tokenizer=engine.tokenizer.name,
            chat=engine.chat_template is not None,
            tool_call_format=engine.validator.tool_calling.format.value if engine.validator.tool_calling.format else "",
        )

    async def start(self) -> int:
        """Check the artifact's files, bind metrics and gRPC (health NOT_SERVING); a bad artifact or a taken
        port is refused before anything listens."""
        self.artifact = await asyncio.to_thread(open_servable, self.options.artifact)
        served = served_config(self.artifact.config, self.options.max_context)
        self.metrics.set_cache_config(BLOCK_TOKENS, self.options.limits.max_batch_size * served.n_ctx // BLOCK_TOKENS)
        credentials = server_credentials(self.options.tls_cert, self.options.tls_key, self.options.tls_client_ca)
        self.tokens = TokenFile(self.options.auth_tokens) if self.options.auth_tokens is not None else None
        if self.options.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve_http(self.options.host, self.options.metrics_port, self.options.limits.header_timeout_seconds,
                                                            self.options.limits.max_connections)
            except OSError as exc:
                raise ListenFailed(f"cannot serve metrics on {self.options.host}:{self.options.metrics_port} ({exc.strerror or exc})") from None
        if self.options.gateway_metrics_port is not None:
            limits = self.options.limits
            try:
                self.gateway_metrics_port = await asyncio.to_thread(self.metrics.serve_gateway, self.options.host, self.options.gateway_metrics_port,
                                                                    limits.header_timeout_seconds, limits.max_connections)
            except OSError as exc:
                raise ListenFailed(f"cannot serve the gateway's gauges on {self.options.host}:{self.options.gateway_metrics_port} "
                                   f"({exc.strerror or exc})") from None
        if self.options.kv_events is not None:
            from ..edges.kv_events import KvEventPublisher

            topic = self.options.kv_events_topic or f"kv@{socket.gethostname()}@{Path(self.options.artifact).resolve().name}"
            try:
                self.kv_events = await asyncio.to_thread(KvEventPublisher, self.options.kv_events, topic, BLOCK_TOKENS, "CPU",
                                                         self.options.kv_events_replay)
            except OSError as exc:
                raise ListenFailed(str(exc)) from None
        self.health = health.aio.HealthServicer()
        limits = self.options.limits
        self.server = grpc.aio.server(
            interceptors=[MetadataLimitInterceptor(self.metrics), TokenAuthInterceptor(self.tokens, self.metrics), ErrorInterceptor(self.metrics)],
            options=[("grpc.max_receive_message_length", limits.max_message_bytes), *connection_bounds(limits)],
            maximum_concurrent_rpcs=limits.max_connections,
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
            from ..edges.http_api import HttpApi

            self.http = HttpApi(self.ready_engine, self.ready_tokenizing, self.options, self.tokens, self.metrics)
            try:
                http_socket = self.http.bind(self.options.host, self.options.http_port)
            except OSError as exc:
                self.metrics.close()
                raise ListenFailed(f"cannot serve HTTP on {self.options.host}:{self.options.http_port} ({exc.strerror or exc})") from None
        if self.options.health_port is not None:
            self.health_server = grpc.aio.server(interceptors=[MetadataLimitInterceptor()], options=connection_bounds(limits))
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
        if self.gateway_metrics_port is not None:
            log.info("the inference gateway's gauges on http://%s:%d/metrics", self.options.host, self.gateway_metrics_port)
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
        if options.traces is not None:
            from ..edges.tracing import RequestTracer  # OpenTelemetry's SDK is imported only when traces are on

            self.tracer = RequestTracer(options.traces)
        if self.kv_events is not None:  # the serving rows' changes, not the warm-up's (theirs were forgotten)
            self.kv_events.medium = "GPU" if loaded.runtime.device == "cuda" else "CPU"
            self.metrics.watch_kv_events(self.kv_events)
        engine = Engine(loaded.runtime, loaded.config, loaded.tokenizer, options.limits, self.metrics, batch=loaded.batch, step_thread=loaded.steps,
                        chat_template=loaded.chat_template, encoder=self.tokenizing.encode_within, tracer=self.tracer,
                        model_name=Path(options.artifact).resolve().name, kv_budget=loaded.kv_budget, kv_events=self.kv_events)
        self.metrics.set_rows(options.limits.max_batch_size)
        self.metrics.kv_budget.set(engine.live().kv_budget_bytes)
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
        if self.kv_events is not None:
            await asyncio.to_thread(self.kv_events.close)
        if self.tracer is not None:
            if not await asyncio.to_thread(self.tracer.close):  # the spans still buffered are exported first, bounded
                from ..edges.tracing import TRACE_FLUSH_SECONDS

                log.warning("the trace collector did not take the last spans within %gs; they were dropped", TRACE_FLUSH_SECONDS)
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
