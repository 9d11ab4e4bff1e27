"""Request traces (service/edges/tracing.py) received by an in-process OTLP collector, over OTLP/HTTP (protobuf) and OTLP/gRPC:
one trace a request with its queue, prefill and decode spans and its token counts, a caller's W3C traceparent honoured
from HTTP headers and gRPC metadata, n completions under one request span; and nothing at all with traces off."""

import socket
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvserve.service.process.options import TraceExport
from kvserve.service.edges.tracing import RequestTracer
from kvserve.v1 import generation_pb2 as pb

from ..conftest import collect, serving, start_server, stub_of

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


class Collector:
    """The spans an OTLP exporter sent, from either transport: [(span, service.name)]."""

    def __init__(self):
        self.spans, self.lock = [], threading.Lock()

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource in request.resource_spans:
                service = next(a.value.string_value for a in resource.resource.attributes if a.key == "service.name")
                self.spans += [(span, service) for scope in resource.scope_spans for span in scope.spans]


@pytest.fixture
def http_collector():
    collector = Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            assert self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
            body = self.rfile.read(int(self.headers["Content-Length"]))
            collector.take(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield collector, f"http://127.0.0.1:{server.server_port}/v1/traces"
    server.shutdown()


@pytest.fixture
def grpc_collector():
    collector = Collector()

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            collector.take(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector, f"http://127.0.0.1:{port}"
    server.stop(None)


def by_trace(collector: Collector) -> dict[str, list]:
    traces: dict[str, list] = {}
    for span, _ in collector.spans:
        traces.setdefault(span.trace_id.hex(), []).append(span)
    return traces


def attributes(span) -> dict:
    out = {}
    for a in span.attributes:
        value = a.value
        out[a.key] = (value.int_value if value.HasField("int_value") else value.string_value if value.HasField("string_value")
                      else value.double_value if value.HasField("double_value") else [v.string_value for v in value.array_value.values])
    return out


def check_request_spans(spans: list, prompt_tokens: int, new_tokens: int, finish: str, operation: str = "text_completion"):
    """One kvserve.generate span with queue, prefill and decode below it, in order, inside it."""
    (root,) = [s for s in spans if s.name == "kvserve.generate"]
    children = {s.name: s for s in spans if s.parent_span_id == root.span_id}
    assert set(children) == {"queue", "prefill", "decode"}
    assert root.start_time_unix_nano <= children["queue"].start_time_unix_nano <= children["queue"].end_time_unix_nano
    assert children["queue"].end_time_unix_nano == children["prefill"].start_time_unix_nano
    assert children["prefill"].end_time_unix_nano == children["decode"].start_time_unix_nano <= root.end_time_unix_nano
    values = attributes(root)
    assert values["gen_ai.usage.input_tokens"] == prompt_tokens and values["gen_ai.usage.output_tokens"] == new_tokens
    assert values["gen_ai.response.finish_reasons"] == [finish] and values["kvserve.cached_prompt_tokens"] >= 0
    assert values["gen_ai.operation.name"] == operation
    assert root.kind == root.SPAN_KIND_SERVER
    return root


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_trace_per_request_with_the_callers_context(tiny_chat_artifact, http_collector, grpc_collector, protocol):
    collector, endpoint = http_collector if protocol == "http/protobuf" else grpc_collector
    with serving(tiny_chat_artifact, http_port=0, max_batch_size=2, traces=TraceExport(endpoint, protocol)) as running:
        with stub_of(running) as stub:
            collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_new_tokens=5, ignore_eos=True))
            list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[4, 5]), max_new_tokens=3, ignore_eos=True),
                               metadata=(("traceparent", TRACEPARENT),), timeout=60))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{running.app.http_port}/v1", api_key="unused", max_retries=0, timeout=60)
        model = running.app.http.model_name
        traced = client.completions.create(model=model, prompt="abcd", max_tokens=4, extra_headers={"traceparent": TRACEPARENT})
        client.completions.create(model=model, prompt="xy", max_tokens=2, n=2, seed=1)
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    traces = by_trace(collector)  # the server's stop exported what it still held
    assert len(traces) == 4 and all(service == "kvserve" for _, service in collector.spans)
    plain = sorted((t for trace_id, t in traces.items() if trace_id != CALLER_TRACE and len(t) == 4),
                   key=lambda t: min(s.start_time_unix_nano for s in t))
    check_request_spans(plain[0], 3, 5, "length")
    # (sampled: the reply may end before its 2 tokens; the span says what the answer said)
    check_request_spans(plain[1], chat.usage.prompt_tokens, chat.usage.completion_tokens,
                        "length" if chat.choices[0].finish_reason == "length" else "end_of_sequence", "chat")
    (caller,) = [t for trace_id, t in traces.items() if trace_id == CALLER_TRACE]
    # the completion samples: it may end before its 4 tokens, and its span says what its answer said
    ends = [(2, 3, "length"), (4, traced.usage.completion_tokens, "length" if traced.choices[0].finish_reason == "length" else "end_of_sequence")]
    roots = [check_request_spans([s for s in caller if s.trace_id == r.trace_id and (s.span_id == r.span_id or s.parent_span_id == r.span_id)],
                                 *end) for r, end in zip(sorted((s for s in caller if s.name == "kvserve.generate"),
                                                                key=lambda s: s.start_time_unix_nano), ends)]
    assert all(root.parent_span_id.hex() == CALLER_SPAN for root in roots)  # gRPC metadata's and HTTP header's
    (two,) = [t for t in traces.values() if any(s.name == "kvserve.request" for s in t)]
    (request,) = [s for s in two if s.name == "kvserve.request"]
    sequences = [s for s in two if s.name == "kvserve.generate"]
    assert len(sequences) == 2 and all(s.parent_span_id == request.span_id for s in sequences)
    assert attributes(request)["gen_ai.request.choice.count"] == 2


def test_a_cancelled_stream_ends_its_trace_with_an_error(tiny_artifact, http_collector):
    collector, endpoint = http_collector
    with serving(tiny_artifact, max_batch_size=1, traces=TraceExport(endpoint)) as running, stub_of(running) as stub:
        stream = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), max_new_tokens=200, ignore_eos=True), timeout=60)
        next(stream)
        stream.cancel()
        collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), max_new_tokens=1))  # the row is free again
    (cancelled,) = [s for s, _ in collector.spans if s.name == "kvserve.generate" and s.status.code == s.status.STATUS_CODE_ERROR]
    assert cancelled.status.message == "cancelled by the client" and "gen_ai.response.finish_reasons" not in attributes(cancelled)


def test_with_traces_off_the_engine_holds_no_tracer(server):
    assert server.app.engine.tracer is None and server.app.tracer is None


class NeverDone:
    """A span processor whose flush never ends: a collector that never answers, as close() sees it."""

    def __init__(self):
        self.released = threading.Event()

    def on_start(self, span, parent_context=None):
        pass

    def on_end(self, span):
        pass

    def shutdown(self):
        self.released.wait()

    def force_flush(self, timeout_millis=30000):
        self.released.wait()
        return True


def test_closing_the_tracer_waits_for_the_collector_at_most_the_flush_bound():
    """The OTLP exporters' own timeouts and retries held a stopping server 10 s and more with the collector down, past
    the Kubernetes grace period after the drain: close() now gives up after TRACE_FLUSH_SECONDS, and says so."""
    processor = NeverDone()
    tracer = RequestTracer(TraceExport("http://127.0.0.1:1"), span_processor=processor)
    try:
        assert tracer.close() is False  # it returned, with the flush still waiting
    finally:
        processor.released.set()


def test_a_stop_with_the_collector_down_ends_without_a_traceback(tiny_artifact, caplog):
    """A collector that takes connections and never answers (down behind its load balancer, say), both protocols: the
    server stops, its exports timing out at TRACE_FLUSH_SECONDS, without a traceback."""
    with socket.socket() as silent:  # the kernel completes each connection; nothing ever reads or answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        for protocol in ("grpc", "http/protobuf"):
            running = start_server(tiny_artifact, max_batch_size=1, traces=TraceExport(endpoint, protocol))
            try:
                with stub_of(running) as stub:
                    collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), max_new_tokens=2))  # a span buffered
            finally:
                running.stop()
    assert "Traceback" not in caplog.text
