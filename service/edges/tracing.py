"""Request traces over OTLP (`serve --otlp-traces-endpoint URL`), off by default.

Each request becomes one trace: a `kvserve.generate` span from its arrival to its last token (a server span, the
child of the caller's W3C `traceparent` when its HTTP headers or gRPC metadata carry one), with three children:
`queue` (waiting for a batch row), `prefill` (its prompt through the model, to the first token) and `decode` (the
rest). Attributes follow OpenTelemetry's GenAI conventions where they have a name (gen_ai.usage.input_tokens, ...),
kvserve's own where not (kvserve.cached_prompt_tokens). A request for n completions gets a `kvserve.request` span
above its n sequences' spans, so it stays one trace.

Nothing runs per token: spans are made once a sequence ends, from the times its Sequence already keeps, and handed
to OpenTelemetry's batch processor, which exports them on its own thread. With tracing off the engine holds None and
skips even that.
"""

from __future__ import annotations

import threading
import time

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..process.options import TraceExport

# What a stop waits for the buffered spans to reach the collector, and what one export may take: a collector that is down
# must not hold a stopping server past its drain (the Kubernetes grace period is the drain + 15 s: deploy/k8s).
TRACE_FLUSH_SECONDS = 5.0


class RequestTracer:
    """Turns finished sequences into spans and exports them."""

    def __init__(self, export: TraceExport, span_processor=None):
        """span_processor: instead of a batch processor over the OTLP exporter (tests pass their own)."""
        # Not shut down at interpreter exit: close() does it, bounded; the SDK's own hook would wait on the collector again.
        self._provider = TracerProvider(resource=Resource.create({"service.name": export.service_name}), shutdown_on_exit=False)
        self._provider.add_span_processor(span_processor or BatchSpanProcessor(_exporter(export)))
        self._tracer = self._provider.get_tracer("kvserve")
        self._propagator = TraceContextTextMapPropagator()
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()  # the sequences keep monotonic times

    def caller_context(self, traceparent: str | None, tracestate: str | None):
        """The caller's trace context from W3C headers; None when it sent none (or one that does not parse)."""
        if not traceparent:
            return None
        carrier = {"traceparent": traceparent, **({"tracestate": tracestate} if tracestate else {})}
        context = self._propagator.extract(carrier)
        return context if trace.get_current_span(context).get_span_context().is_valid else None

    def start_request(self, context, n: int, model: str):
        """A span above a request's n sequences: (the span, its (traceparent, tracestate) for the sequences)."""
        span = self._tracer.start_span("kvserve.request", context=context, kind=SpanKind.SERVER,
                                       attributes={"gen_ai.request.choice.count": n, "gen_ai.request.model": model})
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, trace.set_span_in_context(span))
        return span, (carrier.get("traceparent"), carrier.get("tracestate"))

    def record(self, seq, finish, context, model: str, chat: bool, error: BaseException | None = None) -> None:
        """seq's spans, from its own times: arrival, a row (admitted_ns), first token, end (now); finish: its Finish
        (None: cancelled or failed); chat: whether its prompt was a conversation."""
        offset, end = self._epoch_offset_ns, time.monotonic_ns()
        attributes = {
            "gen_ai.operation.name": "chat" if chat else "text_completion",
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": seq.max_new_tokens,
            "gen_ai.request.temperature": seq.params.temperature,
            "gen_ai.request.top_p": seq.params.top_p,
            "gen_ai.usage.input_tokens": len(seq.prompt_ids),
            "gen_ai.usage.output_tokens": len(seq.generated),
            "kvserve.cached_prompt_tokens": seq.reused_prompt_tokens,
            "kvserve.sequence_id": seq.id,
        }
        if finish is not None:
            attributes["gen_ai.response.finish_reasons"] = (finish.reason.value,)
        root = self._tracer.start_span("kvserve.generate", context=context, kind=SpanKind.SERVER, start_time=seq.arrival_ns + offset,
                                       attributes=attributes)
        inner = trace.set_span_in_context(root)
        admitted = seq.admitted_ns or end
        first = seq.first_token_ns or end
        for name, start, stop in (("queue", seq.arrival_ns, admitted), ("prefill", admitted, first), ("decode", first, end)):
            if seq.admitted_ns or name == "queue":
                self._tracer.start_span(name, context=inner, start_time=start + offset).end(end_time=max(start, stop) + offset)
        if error is not None:
            root.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        elif finish is None:
            root.set_status(Status(StatusCode.ERROR, "cancelled by the client"))
        root.end(end_time=end + offset)

    def close(self) -> bool:
        """Export what is buffered, then stop, waiting at most TRACE_FLUSH_SECONDS; False when the collector did not take
        the spans in that time (they are dropped with the daemon thread still trying)."""
        done = threading.Event()

        def shut_down() -> None:
            self._provider.shutdown()
            done.set()

        threading.Thread(target=shut_down, name="kvserve-trace-flush", daemon=True).start()
        return done.wait(TRACE_FLUSH_SECONDS)


def _exporter(export: TraceExport):
    if export.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=export.endpoint, insecure=export.endpoint.startswith("http://"), timeout=TRACE_FLUSH_SECONDS)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=export.endpoint, timeout=TRACE_FLUSH_SECONDS)
