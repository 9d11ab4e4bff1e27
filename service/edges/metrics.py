"""Prometheus metrics. One registry per server, so several servers can share a process (the tests do).

Three gauges are the Kubernetes inference gateway's model-server protocol (gateway-api-inference-extension, proposal
003): its endpoint picker scrapes them from every replica, every 50 ms by default, to route each request. They carry
the names the protocol recommends (vLLM's), which are the picker's defaults, so it needs no flags to read them. They
live in a registry of their own, served alone on the HTTP API's /metrics (the picker's default target) and with the
rest on the metrics port: the whole set takes ~13 times as long to render (its histograms' buckets), too much for every
50 ms on the event loop the streams share (bench/metrics_scrape.py measures both). With --gateway-metrics-port a process
of its own answers them off the server's event loop and GIL (gateway_gauges.py), where a busy server's scrapes cost the
streams least.
"""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .bounded_http import BoundedHandler, BoundedHTTPServer, listening_socket
from .gateway_gauges import CACHE_CONFIG, GAUGES, GatewayGaugeServer, cache_config_exposition

# Latency buckets in seconds: decode steps take ~1 ms on a GPU and tens of ms on a CPU.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    """What the server exports. The scheduler calls on_token, on_prompt and on_step on the event loop as it delivers each
    step; the gRPC interceptors and the HTTP edge call on_request once a call ends."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("kvserve_requests", "Finished RPCs by method and gRPC status code", ["method", "code"], registry=self.registry)
        self.generated_tokens = Counter("kvserve_generated_tokens", "Tokens generated and streamed", registry=self.registry)
        self.time_to_first_token = Histogram(
            "kvserve_time_to_first_token_seconds", "Request arrival to first generated token", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.inter_token_latency = Histogram(
            "kvserve_inter_token_latency_seconds", "Time between consecutive tokens of a sequence", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.batch_size = Histogram("kvserve_batch_size", "Sequences in each model step", buckets=BATCH_BUCKETS, registry=self.registry)
        self.step_tokens = Histogram("kvserve_step_tokens", "Tokens each model step generated, all its sequences' (more than its "
                                     "sequences when one took drafts)", buckets=BATCH_BUCKETS, registry=self.registry)
        self.draft_tokens = Counter("kvserve_draft_tokens", "Draft tokens steps checked (speculation: serve --speculation)",
                                    registry=self.registry)
        self.accepted_draft_tokens = Counter("kvserve_accepted_draft_tokens", "Of the draft tokens checked, those the model agreed "
                                             "with (taken without a step of their own)", registry=self.registry)
        self.queue_depth = Gauge("kvserve_queue_depth", "Requests waiting for a batch slot", registry=self.registry)
        self.kv_slots_in_use = Gauge("kvserve_kv_slots_in_use", "Batch rows holding a sequence's KV cache", registry=self.registry)
        self.kv_cache_bytes = Gauge("kvserve_kv_cache_bytes", "Bytes of KV cache held by the running sequences", registry=self.registry)
        self.cached_kv_bytes = Gauge("kvserve_prompt_cache_bytes", "Bytes of KV cache held by the prompt cache's rows", registry=self.registry)
        self.kv_budget = Gauge("kvserve_kv_cache_budget_bytes", "Bytes the running sequences' and the prompt cache's KV may take "
                               "(serve --kv-cache-memory); 0: no budget", registry=self.registry)
        self.prompt_tokens = Counter(
            "kvserve_prompt_tokens", "Prompt tokens of admitted requests, by whether their K/V came from the prompt cache or was computed",
            ["source"], registry=self.registry,
        )
        self.cached_rows = Gauge("kvserve_prompt_cache_rows", "Free batch rows holding a finished sequence's K/V for the prompt cache",
                                 registry=self.registry)
        self.execution_provider = Gauge(
            "kvserve_execution_provider", "1 for the ONNX Runtime execution provider in use", ["provider"], registry=self.registry
        )
        # The inference gateway's gauges (the module's docstring), in the whole registry too.
        self.gateway_registry = CollectorRegistry()
        self.requests_waiting, self.requests_running, self.kv_cache_usage = (
            Gauge(name, help_text, registry=self.gateway_registry) for name, help_text in GAUGES)
        self.registry.register(self.gateway_registry)
        self._rows = 1
        self.cache_config = b""  # set_cache_config's text, for the gauges' own process
        self._http = None
        self._gateway_server: GatewayGaugeServer | None = None

    content_type = CONTENT_TYPE_LATEST

    def gateway_exposition(self) -> bytes:
        """The inference gateway's gauges in Prometheus' text format (what the HTTP API's /metrics answers)."""
        return generate_latest(self.gateway_registry)

    def watch_kv_events(self, publisher) -> None:
        """Export a KV event publisher's counts (serve --kv-events, kv_events.py), read at each scrape."""
        Gauge("kvserve_kv_events_published", "KV event messages sent to llm-d's router (serve --kv-events)",
              registry=self.registry).set_function(lambda: publisher.published)
        Gauge("kvserve_kv_events_dropped", "Prompt cache changes not published: the event queue was full (a subscriber sees the "
              "gap in sequence numbers)", registry=self.registry).set_function(lambda: publisher.dropped)

    def set_rows(self, rows: int) -> None:
        """The batch's rows: what a full K/V cache holds (a row is a whole context of K/V for one sequence)."""
        self._rows = max(1, rows)

    def serve_http(self, host: str, port: int, header_timeout: float, max_connections: int) -> int:
        """Start the /metrics endpoint on host:port (its waits on clients bounded: bounded_http.py); returns the port it
        listens on."""
        registry = self.registry

        class MetricsHandler(BoundedHandler):
            paths = ("/metrics", "/")  # prometheus_client's server, which this replaced, answered any path

            def exposition(self) -> tuple[bytes, str]:
                return generate_latest(registry), CONTENT_TYPE_LATEST

        self._http = BoundedHTTPServer(listening_socket(host, port), MetricsHandler, max_connections, header_timeout)
        threading.Thread(target=self._http.serve_forever, name="kvserve-metrics", daemon=True).start()
        return self._http.server_address[1]

    def set_cache_config(self, block_size: int, blocks: int) -> None:
        """vllm:cache_config_info, in the gateway's gauges (the HTTP API's /metrics and --gateway-metrics-port's)."""
        self.cache_config = cache_config_exposition(block_size, blocks)
        Gauge(CACHE_CONFIG, "The K/V cache's configuration (block_size: the prompt cache's blocks; num_gpu_blocks: blocks of "
              "K/V the batch's rows hold)", ["block_size", "num_gpu_blocks"], registry=self.gateway_registry).labels(
            block_size=str(block_size), num_gpu_blocks=str(blocks)).set(1)

    def serve_gateway(self, host: str, port: int, header_timeout: float, max_connections: int) -> int:
        """Start the gauges' own process (gateway_gauges.py) on host:port; returns the port it listens on."""
        self._gateway_server = GatewayGaugeServer(host, port, header_timeout, max_connections, self.cache_config)
        return self._gateway_server.port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._gateway_server is not None:
            self._gateway_server.close()
            self._gateway_server = None

    # the scheduler's hooks (event loop thread)

    def on_token(self, arrival_ns: int, previous_ns: int | None, now_ns: int) -> None:
        self.generated_tokens.inc()
        if previous_ns is None:
            self.time_to_first_token.observe((now_ns - arrival_ns) / 1e9)
        else:
            self.inter_token_latency.observe((now_ns - previous_ns) / 1e9)

    def on_prompt(self, reused: int, computed: int) -> None:
        """A request took its row: reused prompt tokens came from the prompt cache, computed ones are prefilled."""
        self.prompt_tokens.labels(source="reused").inc(reused)
        self.prompt_tokens.labels(source="computed").inc(computed)

    def on_step(self, stepped: int, running: int, queued: int, kv_bytes: int, cached_rows: int = 0, cached_bytes: int = 0,
                tokens: int = 0, drafted: int = 0, accepted: int = 0) -> None:
        """stepped: sequences that got a token this step, tokens: the tokens they got; running: rows left in the batch after
        it; cached_rows: free rows holding K/V for the prompt cache, cached_bytes their K/V; drafted: draft tokens the step
        checked, accepted: those taken."""
        if stepped:
            self.batch_size.observe(stepped)
            self.step_tokens.observe(tokens or stepped)
        if drafted:
            self.draft_tokens.inc(drafted)
            self.accepted_draft_tokens.inc(accepted)
        self.queue_depth.set(queued)
        self.kv_slots_in_use.set(running)
        usage = min(1.0, running / self._rows)
        self.requests_waiting.set(queued)
        self.requests_running.set(running)
        self.kv_cache_usage.set(usage)
        if self._gateway_server is not None:
            self._gateway_server.board.write(queued, running, usage)
        self.kv_cache_bytes.set(kv_bytes)
        self.cached_rows.set(cached_rows)
        self.cached_kv_bytes.set(cached_bytes)

    # the edges' hook

    def on_request(self, method: str, code: str) -> None:
        self.requests.labels(method=method.rsplit("/", 1)[-1], code=code).inc()

